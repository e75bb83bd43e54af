"""Benchmark: many small files opened, read whole and closed one after another through a mount, against
the same files on local disk, in the same run (not a test: it prints, it does not assert).

What a tree of small files costs per open: a Hugging Face model folder, a tokenizer's files, `cp -r` or
`rsync` out of the mount. Every open of a version asks the mount to keep it from gc (cpfs/holds.py):
an open shorter than holds.DEFER writes nothing to the stores, a longer one a hold per store. The
table gives ms per file and the ratio to local disk (higher is better); the mount's hold figures show
what the opens cost the stores.

    python -m benchmarks.bench_opens [--files 500] [--size 50KiB] [--repeat 3] [--latency 5ms]

Rounds: a fresh mount (the names looked up and the files fetched for the first time), then the same
files again on that mount (the kernel's caches hold them). `--hold-open` keeps one file of the tree
open for the whole round (its hold is written; the others' are not).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from cpfs.holds import DROP_DELAY

from .common import cpfs, drop_caches, mount_stats, mounted, parse_size, print_table, remove_tree, write_store_config


def read_all(folder: Path, names: list[str]) -> float:
    """Seconds to open, read whole and close every file, in order."""
    t = time.perf_counter()
    for name in names:
        with open(folder / name, "rb") as f:
            while f.read(1 << 20):
                pass
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_opens", description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=500)
    p.add_argument("--size", type=parse_size, default=parse_size("50KiB"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--latency", default=None, help='simulated store latency, e.g. "5ms" (default: none)')
    p.add_argument("--hold-open", action="store_true", help="keep one file open during each round")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cpfs-opens-"))
    try:
        src = work / "src"
        src.mkdir()
        names = [f"f{i:05d}.bin" for i in range(args.files)]
        for name in names:
            (src / name).write_bytes(os.urandom(args.size))
        plain = write_store_config(work, stores=3, replicas=2, name="plain.toml")
        cfg = write_store_config(work, stores=3, replicas=2, latency=args.latency,
                                 extra=f'[mount]\nstaging = "{work / "staging"}"\n')
        cpfs("put", str(src), "/tree", config=plain)
        rows: dict[str, list[float]] = {"local disk, cold": [], "local disk, warm": [],
                                        "cpfs fresh mount": [], "cpfs same mount again": []}
        holds: list[dict] = []
        for _ in range(args.repeat):
            drop_caches()
            rows["local disk, cold"].append(read_all(src, names))
            rows["local disk, warm"].append(read_all(src, names))
            drop_caches()
            with mounted(cfg, work / "mnt") as m:
                tree = m.path / "tree"
                kept = open(tree / names[0], "rb") if args.hold_open else None
                try:
                    rows["cpfs fresh mount"].append(read_all(tree, names))
                    rows["cpfs same mount again"].append(read_all(tree, names))
                    time.sleep(DROP_DELAY + 1)            # the closed versions' holds settle
                    holds.append(mount_stats(m.path)["holds"])
                finally:
                    if kept is not None:
                        kept.close()
        base = {"cpfs fresh mount": "local disk, cold", "cpfs same mount again": "local disk, warm"}
        table = []
        for name, times in rows.items():
            t = statistics.median(times)
            ratio = statistics.median(times_b) / t if (times_b := rows.get(base.get(name, name))) else 1.0
            table.append([name, f"{t:.2f}", f"{t / args.files * 1e3:.2f}", f"{ratio:.2f}",
                          " / ".join(f"{x:.2f}" for x in times)])
        print(f"{args.files} files of {args.size} B, 3 folder stores (replicas 2"
              f"{', ' + args.latency + ' per request' if args.latency else ''}), medians of {args.repeat}")
        print_table(["case", "seconds", "ms/file", "ratio", "rounds"], table)
        h = holds[-1]
        print(f"holds of the last round's mount: {h['writes']} written, {h['skipped']} opens closed too soon to "
              f"need one, {h['renewed']} renewed, {h['deleted']} deleted, {h['failed']} failed")
        return 0
    finally:
        remove_tree(work)


if __name__ == "__main__":
    raise SystemExit(main())
