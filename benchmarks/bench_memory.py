"""Daemon memory over repeated cold loads of one large checkpoint: issue 10 asks that the daemon stay
within `[cache] memory` + 150 MiB during a 4 GiB load and not grow over 10 loads.

One checkpoint of `--size` (default 4 GiB) in bench_cpu's shapes: `many` (0.5-2 MiB tensors, the most
chunks and the most per-chunk state per GiB; the default) or `large` (64 MiB tensors), built with torch
under demo-data/cpu and imported into 3 folder stores kept beside it (replicas 2, the embedded default's
cache of 1 GiB unless `--cache`). One mount serves every load, as a training job's node would: `--loads`
loads (default 10), each in a fresh python after `sync; echo 3 > /proc/sys/vm/drop_caches`, so every
byte comes through the daemon again. The kinds of load take turns (`--kinds`, default
torch,mmap,safetensors: torch.load, torch.load(mmap=True) + a read of every tensor, safetensors'
load_file + a read of every tensor). Every torch load's values are checked against a direct load of the
same file.

Per load: the daemon's RSS (every 20 ms, from /proc via psutil) before, at its peak, and once it settled
(the read buffers trimmed back to what the mount keeps ready, which the daemon does once reads stop for
5-10 s; at most SETTLE_MAX s); the chunk cache's bytes and the read buffers' bytes then (the mount's
statistics). The verdict: the highest peak against `[cache] memory` + 150 MiB; growth, as the settled
RSS after the last load of the first kind minus after its first, less what the chunk cache held more
then (its entries are budgeted and evicted, a leak is not), and the least-squares slope of the settled
RSS over all loads. The time of each load is shown, not judged: no memory is written and freed before
a load (this VM charges ~1.5 s/GiB for touching memory it handed back, so a load after one that freed
GiBs takes longer), and the host is shared; bench_cpu and make bench time loads.

    python -m benchmarks.bench_memory [--size 4GiB] [--loads 10] [--shape many] [--kinds torch,mmap,safetensors]
                                      [--cache 1GiB] [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .bench_cpu import DATA, SHAPES, make_checkpoints, write_config
from .common import (MiB, BenchError, LoadResult, RssSampler, ensure_imported, human, leave_work, mount_stats,
                     mounted, parse_size, print_daemon_report, print_table, timed_load, timed_st_load)

KINDS = ("torch", "mmap", "safetensors")
HEADROOM = 150 * MiB          # the allowance above [cache] memory
SETTLE_MAX = 20.0             # seconds after a load at most before its settled RSS is read
GROWTH_OK = 32 * MiB          # growth below this is noise (the allocator, the interpreter's caches)


@dataclass
class Load:
    kind: str
    seconds: float
    before: int        # RSS when it started
    peak: int          # highest RSS sampled during it
    settled: int       # RSS once settled (`settle`)
    cache_used: int    # chunk cache bytes held when settled
    buffers: int       # read buffers' bytes when settled


def _one_load(kind: str, mp: Path, pt_name: str, st_name: str) -> LoadResult:
    """One cold load of `kind` through the mount in a fresh python (torch kinds with fingerprints)."""
    if kind == "safetensors":
        return timed_st_load(mp / st_name, cold=True)
    return timed_load(mp / pt_name, cold=True, mmap=kind == "mmap")


def settle(mp: Path) -> dict:
    """The mount's statistics once its read buffers are trimmed back to the ready ones (or SETTLE_MAX)."""
    deadline = time.monotonic() + SETTLE_MAX
    while True:
        doc = mount_stats(mp)
        if doc["buffers"]["bytes"] <= doc["buffers"]["keep"] or time.monotonic() > deadline:
            return doc
        time.sleep(0.5)


def slope(ys: list[int]) -> float:
    """Least-squares slope of ys over their index (bytes per load)."""
    if len(ys) < 2:
        return 0.0
    xs = range(len(ys))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="cpfs-bench-memory-", dir=args.workdir or "/tmp"))
    cfg = write_config(DATA / f"stores-{args.cache}", args.cache)
    budget = parse_size(args.cache)
    limit = budget + HEADROOM
    mp = work / "mnt"
    loads: list[Load] = []
    mismatches: list[str] = []
    notes: set[str] = set()
    m = None
    try:
        pt, st = make_checkpoints(args.shape, args.size)
        size = pt.stat().st_size
        ensure_imported(pt, f"bench/{pt.name}", cfg, verbose=False)
        if "safetensors" in args.kinds:
            ensure_imported(st, f"bench/{st.name}", cfg, verbose=False)
        print(f"{args.shape} checkpoint {pt.name}: {human(size)}; 3 folder stores, replicas 2, cache {args.cache}; "
              f"{args.loads} cold loads on one mount ({', '.join(args.kinds)} in turn); work folder {work}",
              flush=True)
        want = timed_load(pt, cold=False).fingerprints if {"torch", "mmap"} & set(args.kinds) else {}
        with mounted(cfg, mp, work / "daemon.log") as m:
            with RssSampler(m.pid, interval=0.02) as rss:
                mounted_rss = rss.now()
                for i in range(args.loads):
                    kind = args.kinds[i % len(args.kinds)]
                    rss.reset()
                    before = rss.now()
                    r = _one_load(kind, mp, f"bench/{pt.name}", f"bench/{st.name}")
                    seconds, got = r.total_seconds, r.fingerprints
                    if r.note:
                        notes.add(r.note)
                    doc = settle(mp)
                    peak = rss.reset()
                    loads.append(Load(kind, seconds, before, peak, rss.now(), doc["cache"]["used"],
                                      doc["buffers"]["bytes"]))
                    if got:
                        mismatches += [f"load {i + 1} ({kind}): {k}" for k in want if want[k] != got.get(k)]
                    print(f"  load {i + 1} {kind}: {seconds:.2f} s, daemon RSS peak {human(peak)}, "
                          f"settled {human(loads[-1].settled)}", flush=True)
    except BenchError as e:
        print(f"\nbench_memory: error: {e}", file=sys.stderr)
        if m is not None:
            print_daemon_report(m, "the mount", tail=20)
        return 1
    finally:
        leave_work(work, args.keep)

    for note in notes:
        print(f"NOTE: {note} (the loads were not cold)")
    print(f"\ndaemon RSS after mounting: {human(mounted_rss)}; limit [cache] memory + 150 MiB = {human(limit)}\n")
    print_table(["load", "kind", "seconds", "RSS before", "RSS peak", "RSS settled", "cache held", "read buffers"],
                [[str(i + 1), ld.kind, f"{ld.seconds:.2f}", human(ld.before), human(ld.peak), human(ld.settled),
                  human(ld.cache_used), human(ld.buffers)] for i, ld in enumerate(loads)])
    peak = max(ld.peak for ld in loads)
    same = [ld for ld in loads if ld.kind == loads[0].kind]
    growth = (same[-1].settled - same[0].settled) - (same[-1].cache_used - same[0].cache_used)
    per_load = slope([ld.settled for ld in loads])
    print(f"\npeak RSS {human(peak)} of {human(limit)} allowed: {'met' if peak <= limit else 'MISSED'} "
          f"({human(peak - mounted_rss)} above the RSS after mounting)")
    print(f"growth: settled RSS after {same[0].kind} load {len(same)} of {len(same)} minus after its first, less "
          f"the cache's own growth: {growth / MiB:+.1f} MiB ({'none' if growth <= GROWTH_OK else 'GROWS'}: up to "
          f"{GROWTH_OK // MiB} MiB is noise); slope over all {len(loads)} loads {per_load / MiB:+.2f} MiB per load")
    print(json.dumps({"size": size, "limit": limit, "peak": peak, "mounted": mounted_rss, "growth": growth,
                      "slope_per_load": per_load}))
    if m is not None and (m.problems or m.warnings()):
        print_daemon_report(m, "the mount")
    if mismatches:
        print(f"\nFAILED: {len(mismatches)} value(s) differ from the direct load: {mismatches[:10]}")
        return 1
    print("\nevery torch value loaded through cpfs equals the direct load")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("4GiB"), help="checkpoint size (default 4GiB)")
    p.add_argument("--loads", type=int, default=10, help="cold loads on one mount (default 10)")
    p.add_argument("--shape", choices=SHAPES, default="many", help="tensor sizes (default many: 0.5-2 MiB)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"loads in turn, of {','.join(KINDS)} (default all)")
    p.add_argument("--cache", default="1GiB", help="[cache] memory of the mount (default 1GiB, the default's)")
    p.add_argument("--workdir", help="parent of the work folder (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (the daemon's log)")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad or not args.kinds:
        p.error(f"--kinds: {f'unknown {bad}' if bad else 'none given'}: choose from {', '.join(KINDS)}")
    if args.loads < 1:
        p.error("--loads must be at least 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
