"""Benchmark of the read path with simulated remote stores (not a test: it prints, it does not assert).

One checkpoint is imported into two temporary configs whose stores all have the same simulated latency
and bandwidth: "N stores" (default 4 stores, replicas 2) and "1 store" (replicas 1). A cold torch.load
and a cold sequential read (1 MiB reads, like `cat file > /dev/null`) through each mount are compared
with the same file read straight from local disk in the same run, and the N-store mount with the
single store: one reader should get the aggregate bandwidth of all stores.

    python -m benchmarks.bench_load [--size 1GiB] [--stores 4] [--latency 5ms] [--bandwidth 200MiB/s]
                                    [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .common import (GiB, MiB, BenchError, Mount, ensure_imported, human, leave_work, mounted, parse_size,
                     print_daemon_report, print_table, timed_load, timed_read)
from .make_checkpoint import DEFAULT_PATH, make_checkpoint

DEST = "bench/ckpt.pt"


def write_config(folder: Path, *, stores: int, replicas: int, latency: str, bandwidth: str) -> Path:
    """A config with `stores` simulated-remote directory stores under `folder`/stores."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"replicas = {replicas}"]
    for i in range(stores):
        lines += ["", "[[store]]", f'name = "s{i}"', f'url = "stores/s{i}"', f'latency = "{latency}"',
                  f'bandwidth = "{bandwidth}"']
    path = folder / "cpfs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def checkpoint_for(size: int) -> Path:
    """The demo's checkpoint for the default size, else one of the requested size next to it."""
    if size == GiB:
        return DEFAULT_PATH
    return DEFAULT_PATH.with_name(f"bench_{human(size).replace(' ', '').replace('.00', '')}.pt")


@dataclass
class Row:
    label: str
    seconds: float
    floor: float | None = None     # size / aggregate store bandwidth: no reader can beat it


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=GiB, help="checkpoint size (default 1GiB)")
    p.add_argument("--stores", type=int, default=4, help="stores of the multi-store config (default 4)")
    p.add_argument("--replicas", type=int, default=2, help="replicas of the multi-store config (default 2)")
    p.add_argument("--latency", default="5ms", help="simulated per-request latency of every store")
    p.add_argument("--bandwidth", default="200MiB/s", help="simulated bandwidth of every store")
    p.add_argument("--workdir", type=Path, help="where the temporary stores and mounts go (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary stores and logs")
    args = p.parse_args(argv)
    try:
        return run(args)
    except BenchError as e:
        print(f"\nbench_load: error: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    from cpfs.config import parse_rate

    bw = parse_rate(args.bandwidth)
    ckpt = make_checkpoint(checkpoint_for(args.size), args.size)
    nbytes = ckpt.stat().st_size
    touch = 2 * nbytes
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cpfs-bench-", dir=args.workdir or "/tmp"))
    print(f"work folder {work}; every store: latency {args.latency}, bandwidth {args.bandwidth}")
    configs = {
        f"{args.stores} stores": (write_config(work / "multi", stores=args.stores, replicas=args.replicas,
                                               latency=args.latency, bandwidth=args.bandwidth), args.stores),
        "1 store": (write_config(work / "single", stores=1, replicas=1, latency=args.latency,
                                 bandwidth=args.bandwidth), 1),
    }
    mounts: list[tuple[str, Mount]] = []
    rows: list[Row] = []
    read_rows: list[Row] = []
    mismatches: list[str] = []
    try:
        for name, (cfg, _) in configs.items():
            print(f"\n== import into '{name}' ({cfg})")
            ensure_imported(ckpt, DEST, cfg)

        print(f"\n== cold loads of {human(nbytes)} (each in a fresh python, after sync + drop_caches and writing "
              f"and freeing {human(touch)} of memory; a fresh mount for every cpfs measurement)")
        direct = timed_load(ckpt, cold=True, touch=touch)
        rows.append(Row("torch.load, direct from local disk", direct.seconds))
        print(f"  direct torch.load: {direct.seconds:.2f} s")
        read_rows.append(Row("1 MiB reads, direct from local disk",
                             timed_read(ckpt, cold=True, touch=touch).seconds))
        print(f"  direct read: {read_rows[-1].seconds:.2f} s")
        mp = work / "mnt"
        for name, (cfg, stores) in configs.items():
            floor = nbytes / (stores * bw)
            with mounted(cfg, mp, work / f"{name.replace(' ', '-')}-load.log") as m:
                mounts.append((f"'{name}', torch.load", m))
                r = timed_load(mp / DEST, cold=True, touch=touch)
            rows.append(Row(f"torch.load through cpfs, {name}", r.seconds, floor))
            print(f"  {name}: torch.load {r.seconds:.2f} s")
            bad = sorted(k for k in direct.fingerprints if direct.fingerprints[k] != r.fingerprints.get(k))
            mismatches += [f"{name}: {k}" for k in bad]
            with mounted(cfg, mp, work / f"{name.replace(' ', '-')}-read.log") as m:
                mounts.append((f"'{name}', sequential read", m))
                rr = timed_read(mp / DEST, cold=True, touch=touch)
            if rr.size != nbytes:
                mismatches.append(f"{name}: sequential read returned {rr.size} bytes, expected {nbytes}")
            read_rows.append(Row(f"1 MiB reads through cpfs, {name}", rr.seconds, floor))
            print(f"  {name}: sequential read {rr.seconds:.2f} s")
    except BenchError as e:
        print(f"\nbench_load: error: {e}", file=sys.stderr)
        for title, m in mounts:
            print_daemon_report(m, title, tail=20)
        return 1
    finally:
        leave_work(work, args.keep)

    report(nbytes, rows, read_rows, args, bw)
    if not mismatches:
        print(f"\nevery value loaded through cpfs equals the direct load ({len(direct.fingerprints)} values: "
              f"dtype, shape, BLAKE3 of the bytes); every sequential read returned {nbytes} bytes")
    print("\n== daemon statistics (logged at unmount)")
    for title, m in mounts:
        print_daemon_report(m, title)
    failed = bool(mismatches) or any(m.problems for _, m in mounts)
    if mismatches:
        print(f"\nFAILED: {len(mismatches)} value(s) read through cpfs differ from the original:")
        for x in mismatches[:30]:
            print(f"  {x}")
    return 1 if failed else 0


def report(nbytes: int, rows: list[Row], read_rows: list[Row], args: argparse.Namespace, bw: float) -> None:
    print(f"\n== results: {human(nbytes)}, cold; every store {args.latency} latency, {args.bandwidth}; "
          f"floor = size / (stores x store bandwidth)")
    for group in (rows, read_rows):
        base = group[0].seconds
        print()
        print_table(["", "seconds", "MiB/s", "vs direct", "floor s", "of aggregate bw"],
                    [[r.label, f"{r.seconds:.2f}", f"{nbytes / r.seconds / MiB:.0f}", f"{r.seconds / base:.2f}x",
                      "" if r.floor is None else f"{r.floor:.2f}",
                      "" if r.floor is None else f"{100 * r.floor / r.seconds:.0f}%"] for r in group])
    multi, single = f"{args.stores} stores", "1 store"
    print()
    for what, group in (("torch.load", rows), ("sequential read", read_rows)):
        m = next(r for r in group if r.label.endswith(multi))
        s = next(r for r in group if r.label.endswith(single))
        print(f"{what}: {multi} {m.seconds:.2f} s vs {single} {s.seconds:.2f} s = {s.seconds / m.seconds:.2f}x faster "
              f"(ideal {args.stores}x); one reader got {nbytes / m.seconds / MiB:.0f} MiB/s of the "
              f"{args.stores} x {bw / MiB:.0f} = {args.stores * bw / MiB:.0f} MiB/s aggregate "
              f"({100 * m.floor / m.seconds:.0f}%); {m.seconds / group[0].seconds:.2f}x the direct time")


if __name__ == "__main__":
    sys.exit(main())
