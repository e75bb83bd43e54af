"""`make demo`: a ~1 GiB checkpoint, imported into cpfs, loaded with torch.load cold and warm through a
mount and straight from local disk, compared tensor by tensor.

Uses the embedded default config (three directory stores under $XDG_DATA_HOME/cpfs, replicas 2).
Every timed load runs in a fresh python (see benchmarks.common). A cold load gets a fresh mount (so the
daemon's cache is empty) and dropped kernel caches. Exit status: 0 if every tensor loaded through the
mount equals the original, 1 if any differs or a step fails.

    python -m benchmarks.demo [--repeat N] [--size 1GiB] [--checkpoint PATH]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .common import (BenchError, GiB, LoadResult, Mount, ensure_imported, gbps, human, leaves, mounted, parse_size,
                     print_daemon_report, print_table, remove_tree, timed_load)
from .make_checkpoint import DEFAULT_PATH, make_checkpoint

DEST = "run1/step_100.pt"

# (key, label) of the timed loads, in table order
ROWS = [
    ("direct", "direct from local disk, cold"),
    ("cold", "through cpfs, cold (fresh mount)"),
    ("warm", "through cpfs, warm (2nd load, same mount)"),
    ("direct_mmap", "direct, cold, mmap=True: torch.load"),
    ("direct_mmap_total", "  ... + first read of every tensor"),
    ("mmap", "through cpfs, cold, mmap=True: torch.load"),
    ("mmap_total", "  ... + first read of every tensor"),
]
LAZY = ("direct_mmap", "mmap")     # torch.load with mmap=True reads the tensors only when touched


def _seconds(r: LoadResult, key: str) -> float:
    return r.total_seconds if key.endswith("_total") else r.seconds


def _check(name: str, got: LoadResult, reference: dict[str, str]) -> list[str]:
    """Keys whose dtype, shape or bytes differ from the original's (by fingerprint)."""
    bad = sorted(k for k in set(reference) | set(got.fingerprints) if reference.get(k) != got.fingerprints.get(k))
    return [f"{name}: {k}: expected {reference.get(k, '(missing)')}, got {got.fingerprints.get(k, '(missing)')}"
            for k in bad]


def verify(original: Path, through: Path) -> tuple[dict[str, str], list[str]]:
    """Load the original once and the file through the mount, torch.equal on every key. Returns the
    original's fingerprints (to check the timed loads' against) and the differences found."""
    import torch

    from .common import fingerprints

    a = torch.load(original, weights_only=True)
    b = torch.load(through, weights_only=True)
    la, lb = dict(leaves(a)), dict(leaves(b))
    diffs = [f"{k}: missing through the mount" for k in la.keys() - lb.keys()]
    diffs += [f"{k}: only through the mount" for k in lb.keys() - la.keys()]
    tensors = 0
    for k in la.keys() & lb.keys():
        x, y = la[k], lb[k]
        if isinstance(x, torch.Tensor):
            tensors += 1
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape):
                diffs.append(f"{k}: expected a tensor {x.dtype}{list(x.shape)}, got "
                             f"{getattr(y, 'dtype', type(y).__name__)}{list(getattr(y, 'shape', []))}")
            elif not torch.equal(x, y):
                diffs.append(f"{k}: {int((x != y).sum())} of {x.numel()} elements differ")
        elif x != y:
            diffs.append(f"{k}: {x!r} != {y!r}")
    print(f"  torch.equal on all {tensors} tensors (and == on {len(la) - tensors} other values): "
          f"{'all equal' if not diffs else f'{len(diffs)} DIFFER'}")
    ref = fingerprints(a)
    del a, b, la, lb
    gc.collect()
    return ref, diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_PATH, help=f"default {DEFAULT_PATH}")
    p.add_argument("--size", type=parse_size, default=GiB, help="size of the checkpoint if it must be generated")
    p.add_argument("--repeat", type=int, default=3, help="rounds of timed loads; the table shows the median")
    args = p.parse_args(argv)
    try:
        return run(args.checkpoint.absolute(), args.size, max(1, args.repeat))
    except BenchError as e:
        print(f"\ndemo: error: {e}", file=sys.stderr)
        return 1


def run(ckpt: Path, size: int, repeat: int) -> int:
    print("== 1. checkpoint")
    make_checkpoint(ckpt, size)
    nbytes = ckpt.stat().st_size
    touch = 2 * nbytes

    print("\n== 2. import (embedded default config: stores under $XDG_DATA_HOME/cpfs)")
    ensure_imported(ckpt, DEST)

    print(f"\n== 3. timed torch.load(weights_only=True), {repeat} round(s); each load in a fresh python, after "
          f"writing and freeing {human(touch)} of memory; cold = sync + drop_caches (+ a fresh mount for cpfs)")
    tmp = Path(tempfile.mkdtemp(prefix="cpfs-demo-"))
    mp = tmp / "mnt"
    results: dict[str, list[LoadResult]] = {k: [] for k, _ in ROWS}
    mounts: list[tuple[str, Mount]] = []
    notes: set[str] = set()
    try:
        for rnd in range(1, repeat + 1):
            t0 = time.perf_counter()
            r = timed_load(ckpt, cold=True, touch=touch)
            results["direct"].append(r)
            r = timed_load(ckpt, cold=True, mmap=True, touch=touch)
            results["direct_mmap"].append(r)
            results["direct_mmap_total"].append(r)
            with mounted(None, mp) as m:
                mounts.append((f"round {rnd}, mount for the cold + warm loads", m))
                results["cold"].append(timed_load(mp / DEST, cold=True, touch=touch))
                results["warm"].append(timed_load(mp / DEST, cold=False, touch=touch))
            with mounted(None, mp) as m:
                mounts.append((f"round {rnd}, mount for the mmap=True load", m))
                r = timed_load(mp / DEST, cold=True, mmap=True, touch=touch)
                results["mmap"].append(r)
                results["mmap_total"].append(r)
            print(f"  round {rnd}: " + ", ".join(f"{k} {_seconds(results[k][-1], k):.2f} s" for k, _ in ROWS)
                  + f"   ({time.perf_counter() - t0:.0f} s)")
        for rs in results.values():
            notes.update(r.note for r in rs if r.note)

        print("\n== 4. compare with the original (fresh mount)")
        with mounted(None, mp) as m:
            mounts.append(("verification mount", m))
            reference, diffs = verify(ckpt, mp / DEST)
        checked = 0
        for key, label in ROWS:
            if key.endswith("_total"):
                continue    # the same loads as the row above
            for i, r in enumerate(results[key]):
                diffs += _check(f"{label} (round {i + 1})", r, reference)
                checked += 1
        print(f"  fingerprints (dtype, shape, BLAKE3 of the bytes) of {len(reference)} values in each of the "
              f"{checked} timed loads: {'all match' if not diffs else 'MISMATCH (listed below)'}")
    except BenchError as e:
        print(f"\ndemo: error: {e}", file=sys.stderr)
        print("\n== what the mount daemons logged")
        for title, m in mounts:
            print_daemon_report(m, title, tail=20)
        return 1
    finally:
        remove_tree(tmp)

    report(nbytes, results, repeat)
    for n in sorted(notes):
        print(f"NOTE: {n}")
    print("\n== daemon statistics (logged at unmount)")
    for title, m in mounts:
        print_daemon_report(m, title)
    problems = [pr for _, m in mounts for pr in m.problems]
    if problems:
        print(f"\nFAILED: {len(problems)} problem(s) while unmounting (see PROBLEM lines above)")
    if diffs:
        print(f"\nFAILED: {len(diffs)} difference(s) between the original and what the mount returned:")
        for d in diffs[:50]:
            print(f"  {d}")
        return 1
    if problems:
        return 1
    print("\nOK: every tensor loaded through cpfs equals the original")
    return 0


def report(nbytes: int, results: dict[str, list[LoadResult]], repeat: int) -> None:
    med = {k: statistics.median(_seconds(r, k) for r in rs) for k, rs in results.items()}
    base = med["direct"]
    print(f"\n== results: {human(nbytes)} checkpoint, {'median of ' + str(repeat) + ' rounds' if repeat > 1 else '1 round'}"
          f" (GB/s = 10^9 bytes/s; ratio = time / direct load time)")
    rows = []
    for key, label in ROWS:
        secs = [_seconds(r, key) for r in results[key]]
        spread = f"{min(secs):.2f}-{max(secs):.2f}" if len(secs) > 1 else ""
        lazy = key in LAZY
        rows.append([label, f"{med[key]:.2f}", spread, "(lazy)" if lazy else f"{gbps(nbytes, med[key]):.2f}",
                     f"{med[key] / base:.2f}x"])
    headers = ["load", "seconds", "min-max", "GB/s", "vs direct"]
    if repeat == 1:
        headers.pop(2)
        for row in rows:
            row.pop(2)
    print_table(headers, rows)
    print()
    for key, what in (("cold", "cold through cpfs"), ("warm", "warm through cpfs"),
                      ("mmap_total", "cold through cpfs with mmap=True, load + first read of every tensor")):
        print(f"{what}: {med[key]:.2f} s, {gbps(nbytes, med[key]):.2f} GB/s, "
              f"{med[key] / base:.2f}x the direct load time ({base:.2f} s)")


if __name__ == "__main__":
    sys.exit(main())
