"""Benchmark: a cold torch.load when one of three stores is a straggler (or hung), against the same load
with three healthy stores, in the same run (not a test: it prints, it does not assert).

Three simulated remote stores (5 ms per request, 400 MiB/s each, replicas 2) hold one checkpoint. The
healthy config, then the same stores with the first one at 20x the latency (100 ms), then with it hung
(`hang = true`), each loaded cold on a fresh mount, with the direct local load as the baseline. Hedged
reads ask the next replica once a read is slower than its store's recent p95.

    python -m benchmarks.bench_straggler [--size 512MiB] [--repeat 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from .bench_load import DEST, checkpoint_for
from .common import (BenchError, ensure_imported, human, mount_stats, mounted, parse_size, print_table, remove_tree,
                     timed_load)
from .make_checkpoint import make_checkpoint

CASES = {"3 healthy stores": "", "s0 at 20x latency (100 ms)": 'latency = "100ms"', "s0 hung": "hang = true"}


def write_config(folder: Path, s0_extra: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["replicas = 2"]
    for i in range(3):
        latency = "" if (i == 0 and "latency" in s0_extra) else 'latency = "5ms"'
        lines += ["[[store]]", f'name = "s{i}"', f'url = "{folder.parent / "stores" / f"s{i}"}"', latency,
                  'bandwidth = "400MiB/s"', s0_extra if i == 0 else ""]
    path = folder / "cpfs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def replica_figures(doc: dict) -> str:
    """What the pool did during one load: reads per store, hedges, fallbacks, stores marked down."""
    r = doc["replicas"]
    per_store = ", ".join(f"{s['name']} {s['requests']} ({s['bytes_read'] / 2**20:.0f} MiB)" for s in doc["stores"])
    down = [h["name"] for h in doc["health"] if h["marked_down"]]
    return (f"requests {per_store}; hedges {r['hedges_won']}/{r['hedges']} won"
            f" (skipped {r['hedges_skipped']}); fallbacks {r['fallbacks']}"
            + (f"; marked down: {', '.join(down)}" if down else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_straggler", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cpfs-straggler-"))
    try:
        ckpt = checkpoint_for(args.size)
        if not ckpt.exists():
            make_checkpoint(ckpt, args.size)
        configs = {name: write_config(work / f"cfg{i}", extra) for i, (name, extra) in enumerate(CASES.items())}
        ensure_imported(ckpt, DEST, configs["3 healthy stores"])
        touch = 2 * ckpt.stat().st_size
        times: dict[str, list[float]] = {"direct from local disk": [], **{name: [] for name in CASES}}
        stats: dict[str, list[str]] = {name: [] for name in CASES}
        for i in range(args.repeat):
            times["direct from local disk"].append(timed_load(ckpt, cold=True, touch=touch).seconds)
            # The cases in a rotated order each time: a slow spell of a shared machine does not always
            # land on the same case.
            order = list(configs.items())
            for name, cfg in order[i % len(order):] + order[:i % len(order)]:
                with mounted(cfg, work / "mnt", work / "mount.log") as m:
                    times[name].append(timed_load(m.path / DEST, cold=True, touch=touch).seconds)
                    stats[name].append(replica_figures(mount_stats(m.path)))
        med = {k: statistics.median(v) for k, v in times.items()}
        healthy = med["3 healthy stores"]
        print(f"\n== {human(ckpt.stat().st_size)} checkpoint, cold torch.load, median of {args.repeat}; "
              "stores: 5 ms, 400 MiB/s each, replicas 2")
        print_table(["load", "seconds", "vs healthy stores", "vs direct"],
                    [[k, f"{v:.2f}", f"{v / healthy:.2f}x", f"{v / med['direct from local disk']:.2f}x"]
                     for k, v in med.items()])
        print("\neach load (s): " + "; ".join(f"{k} " + " ".join(f"{t:.2f}" for t in v) for k, v in times.items()))
        print("\nreplica reads per load (from the mount's .cpfs-stats): requests (MiB read) per store, hedges won/sent")
        for name, lines in stats.items():
            for i, line in enumerate(lines):
                print(f"  {name} #{i + 1}: {line}")
        return 0
    except BenchError as e:
        print(f"bench_straggler: error: {e}", file=sys.stderr)
        return 1
    finally:
        remove_tree(work)


if __name__ == "__main__":
    sys.exit(main())
