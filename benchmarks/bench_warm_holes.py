"""Benchmark: warm loads when the kernel has dropped a few pages of the file here and there, against the
same load of the local file with the same pages dropped, in the same run (not a test: it prints).

A host that reclaims a VM's cold pages (DAMON, as on this machine) or memory pressure takes a few pages
of a file the page cache holds. The local file then reads those pages from the disk; the mount asks the
daemon, which fetches their chunks. Before each load, `--holes` random runs of 1-8 pages are dropped
(fadvise DONTNEED) at the same offsets in both files; `--holes 0` leaves only what the host takes.
Each load is torch.load (and mmap=True + a read of every tensor) in a fresh python, after twice the
file's size of memory is written and freed (this VM hands freed memory back to its host). The first
load of each kind finds the daemon's cache empty; later ones find the chunks loaded behind the holes
of the loads before (cpfs/readahead.py, lost pages). `--latency`/`--bandwidth` make the stores
remote-like (the file is imported without them).

    python -m benchmarks.bench_warm_holes [--size 1GiB] [--holes 300] [--repeat 3] [--latency 5ms --bandwidth 400MiB/s]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from .bench_load import DEST, checkpoint_for
from .common import (BenchError, ensure_imported, human, mount_stats, mounted, parse_size, print_table, remove_tree,
                     timed_load, write_store_config)
from .make_checkpoint import make_checkpoint

PAGE = 4096


def drop_pages(path: Path, holes: int, seed: int) -> None:
    """Drop `holes` runs of 1-8 pages at offsets chosen by `seed` from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = os.fstat(fd).st_size // PAGE
        rng = random.Random(seed)
        for _ in range(holes):
            os.posix_fadvise(fd, rng.randrange(pages) * PAGE, PAGE * rng.choice([1, 1, 2, 4, 8]),
                             os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_warm_holes", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    p.add_argument("--holes", type=int, default=300, help="runs of 1-8 pages dropped before each load")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--latency", help="per-request latency of every store, e.g. 5ms (default none)")
    p.add_argument("--bandwidth", help="bandwidth of every store, e.g. 400MiB/s (default none)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cpfs-warm-holes-"))
    try:
        ckpt = checkpoint_for(args.size)
        if not ckpt.exists():
            make_checkpoint(ckpt, args.size)
        cfg = write_store_config(work / "cfg", stores=3, replicas=2)
        ensure_imported(ckpt, DEST, cfg)
        if args.latency or args.bandwidth:
            cfg = write_store_config(work / "cfg", stores=3, replicas=2, name="remote.toml", latency=args.latency,
                                     bandwidth=args.bandwidth)
        touch = 2 * ckpt.stat().st_size          # this VM hands freed memory back to its host
        times: dict[tuple[str, bool], list[float]] = {(w, mm): [] for w in ("local", "cpfs") for mm in (False, True)}
        with mounted(cfg, work / "mnt", work / "mount.log") as m:
            paths = {"local": ckpt, "cpfs": m.path / DEST}
            for path in paths.values():
                warm(path)
            first = mount_stats(m.path)
            before = first["scheduler"]
            for i in range(args.repeat):
                for mm in (False, True):
                    for where, path in paths.items():
                        drop_pages(path, args.holes, seed=2 * i + mm)
                        r = timed_load(path, cold=False, mmap=mm, touch=touch, fingerprint=False)
                        times[(where, mm)].append(r.total_seconds if mm else r.seconds)
            last = mount_stats(m.path)
            after = last["scheduler"]
            misses = last["replicas"].get("block_misses", 0) - first["replicas"].get("block_misses", 0)
        med = {k: statistics.median(v) for k, v in times.items()}
        remote = (f", stores {args.latency or '0ms'} / {args.bandwidth or 'unlimited'}"
                  if args.latency or args.bandwidth else "")
        print(f"\n== {human(ckpt.stat().st_size)} checkpoint, warm loads, {args.holes} runs of 1-8 pages dropped "
              f"before each (the same in both files), median of {args.repeat}{remote}")
        print_table(["load", "local s", "cpfs s", "ratio (local / cpfs)", "cpfs each (s)"],
                    [["torch.load" + (" mmap=True + read" if mm else ""), f"{med[('local', mm)]:.2f}",
                      f"{med[('cpfs', mm)]:.2f}", f"{med[('local', mm)] / med[('cpfs', mm)]:.2f}",
                      " ".join(f"{t:.2f}" for t in times[("cpfs", mm)])] for mm in (False, True)])
        loads = 2 * args.repeat

        def delta(key: str) -> int:
            return after.get(key, 0) - before.get(key, 0)
        print(f"\nthe daemon over these {loads} loads: fetched {human(delta('fetched_bytes'))} in {delta('reads')} "
              f"reads ({delta('block_fetches')} served by fetching blocks, {human(delta('block_bytes'))}, "
              f"{misses} block reads that failed, timed out or did not match (their chunks read whole); "
              f"{delta('refilled')} chunks loaded behind them when idle); the file pushed again "
              f"{delta('kernel_drops')} times")
        return 0
    except BenchError as e:
        print(f"bench_warm_holes: error: {e}", file=sys.stderr)
        return 1
    finally:
        remove_tree(work)


if __name__ == "__main__":
    sys.exit(main())
