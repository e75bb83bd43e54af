"""Measure the kernel-side knobs of the mount: the bdi readahead (`[mount] read_ahead_kb`) and the
page-cache push (`[mount] notify_store`), by cold torch.load and cold 1 MiB sequential reads through a
fresh mount, against the same file read straight from local disk in the same run (not a test).

    python -m benchmarks.tune_kernel [--size 1GiB] [--repeat 2] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from .common import GiB, ensure_imported, mounted, parse_size, print_table, remove_tree, timed_load, timed_read
from .make_checkpoint import DEFAULT_PATH, make_checkpoint

SETTINGS = [(128, False), (1024, False), (4096, False), (128, True), (1024, True), (4096, True)]


def config(folder: Path, read_ahead_kb: int, notify: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ra{read_ahead_kb}-{'push' if notify else 'nopush'}.toml"
    stores = "".join(f'[[store]]\nname = "s{i}"\nurl = "{folder / "stores" / f"s{i}"}"\n' for i in range(3))
    path.write_text(f"[mount]\nread_ahead_kb = {read_ahead_kb}\nnotify_store = {str(notify).lower()}\n{stores}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune_kernel", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=GiB)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--workdir", type=Path)
    args = p.parse_args(argv)
    src = make_checkpoint(DEFAULT_PATH if args.size == GiB else DEFAULT_PATH.with_name(f"tune_{args.size}.pt"),
                          args.size)
    size = src.stat().st_size
    work = Path(tempfile.mkdtemp(prefix="cpfs-tune-", dir=args.workdir))
    try:
        cfgs = {s: config(work, *s) for s in SETTINGS}
        ensure_imported(src, "tune/ckpt.pt", cfgs[SETTINGS[0]])     # all configs share the stores
        touch = 2 * size
        times: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            times.setdefault("direct load", []).append(timed_load(src, cold=True, touch=touch, fingerprint=False).seconds)
            times.setdefault("direct read", []).append(timed_read(src, cold=True, touch=touch).seconds)
            for (kb, notify), cfg in cfgs.items():
                for kind in ("load", "read"):
                    with mounted(cfg, work / "mnt") as m:
                        f = m.path / "tune" / "ckpt.pt"
                        r = (timed_load(f, cold=True, touch=touch, fingerprint=False) if kind == "load"
                             else timed_read(f, cold=True, touch=touch))
                    times.setdefault(f"read_ahead_kb={kb} notify_store={'on' if notify else 'off'} {kind}",
                                     []).append(r.seconds)
        rows = []
        for name, ts in times.items():
            base = statistics.median(times["direct " + name.rsplit(" ", 1)[-1]])
            t = statistics.median(ts)
            rows.append([name, f"{t:.2f}", f"{size / t / 1e9:.2f}", f"{t / base:.2f}x"])
        print(f"cold, {size / GiB:.2f} GiB, median of {args.repeat}; ratio = time / direct time (same run)")
        print_table(["setting", "seconds", "GB/s", "vs direct"], rows)
    finally:
        remove_tree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
