"""Benchmark of the write path: torch.save of a large checkpoint into the mount, against local disk.

One state dict (the demo's LLaMA-like checkpoint, default ~4 GiB) is saved twice, each time by a fresh
python that generates it (same seed, so the same bytes) and times `torch.save` alone: once straight to
local disk, once into a cpfs mount over directory stores on the same disk. Through the mount, save
returns from close() only once every chunk is on `replicas` stores (each put fsynced), so the local
save is also shown followed by an fsync. The stores share the local copy's disk, so `replicas` copies
of the bytes, written from memory with O_DIRECT and fsynced (no torch, no cpfs, no page cache), are
timed too: the disk's floor for a save through the mount here. While the mount's save runs, the
daemon's RSS is sampled every 50 ms: its peak should stay within the cache budget plus a small
constant (write sessions stage on disk and hold at most a few chunks per upload slot in memory, never
the file).

    python -m benchmarks.bench_save [--size 4GiB] [--stores 3] [--replicas 2] [--chunk-size 4MiB]
                                    [--cache 1GiB] [--workdir DIR] [--keep] [--no-verify]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .common import (GiB, MiB, ROOT, BenchError, Mount, RssSampler, drop_caches, human, leave_work, mounted,
                     parse_size, print_daemon_report, print_table, remove_tree)

FILE = "ckpt.pt"         # the same name in both places: torch.save names the archive's folder after it
SAMPLE_EVERY = 0.05


def write_config(folder: Path, *, stores: int, replicas: int, chunk_size: int, cache: int) -> Path:
    """Directory stores and the staging folder under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"replicas = {replicas}", f"chunk_size = {chunk_size}", "", "[cache]", f"memory = {cache}", "",
             "[mount]", f'staging = "{folder / "staging"}"']
    for i in range(stores):
        lines += ["", "[[store]]", f'name = "s{i}"', f'url = "stores/s{i}"']
    path = folder / "cpfs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------
# the saving child

def _child(path: Path, size: int, seed: int, fsync: bool) -> int:
    """Generate the state dict, say so, wait for "go", time torch.save (and an fsync), print JSON."""
    import torch

    from .make_checkpoint import build, shape_for

    t0 = time.perf_counter()
    sd = build(shape_for(size), seed)
    print(json.dumps({"generated": time.perf_counter() - t0}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    t0 = time.perf_counter()
    torch.save(sd, path)                     # closes the file: through cpfs, the commit is in here
    save = time.perf_counter() - t0
    fsync_s = None
    if fsync:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_s = time.perf_counter() - t0
    del sd
    print(json.dumps({"save": save, "fsync": fsync_s, "size": os.path.getsize(path)}), flush=True)
    return 0


@dataclass
class Save:
    seconds: float
    fsync: float | None
    size: int
    rss: RssSampler | None = None


def timed_save(path: Path, size: int, *, seed: int, fsync: bool = False, daemon_pid: int | None = None,
               timeout: float = 3600) -> Save:
    """torch.save into `path` by a fresh python; with `daemon_pid`, that process's RSS is sampled
    from just before the save starts until it returns."""
    cmd = [sys.executable, "-m", "benchmarks.bench_save", "--child", str(path), "--size", str(size),
           "--seed", str(seed)] + (["--fsync"] if fsync else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"the saving python failed before saving: {proc.communicate()[1].strip()[-2000:]}")
        print(f"  generated the state dict in {json.loads(line)['generated']:.1f} s (not timed)")
        rss = RssSampler(daemon_pid, SAMPLE_EVERY) if daemon_pid is not None else None
        if rss is not None:
            rss.__enter__()
        try:
            out, err = proc.communicate("go\n", timeout=timeout)
        finally:
            if rss is not None:
                rss.__exit__(None, None, None)
        if proc.returncode != 0:
            raise BenchError(f"torch.save into {path} failed (exit {proc.returncode}): "
                             f"{err.strip().splitlines()[-1] if err.strip() else 'no message'}")
        r = json.loads(out.strip().splitlines()[-1])
        return Save(r["save"], r["fsync"], r["size"], rss)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def timed_copies(src: Path, folder: Path, copies: int, piece: int = 4 * MiB) -> float:
    """Seconds to write `copies` copies of `src`'s bytes (read into memory outside the timing) as files
    under `folder`, each fsynced: what the stores must write for one save, on this disk, without torch
    or cpfs. The writes are O_DIRECT from one reused aligned buffer (plain writes whose pages are dropped
    as they go where the filesystem refuses it): the disk's own speed, not this VM's cost of fresh
    page-cache pages, which a plain copy pays per byte. A save through the mount over stores on this
    disk cannot beat it; its ratio to it says how much of the gap to the local save is the disk."""
    data = memoryview(src.read_bytes())
    buf = mmap.mmap(-1, piece)                      # page-aligned, as O_DIRECT needs
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(copies):
        path = folder / f"copy{i}"
        try:
            fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644), True
        except OSError:
            fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), False
        try:
            for off in range(0, len(data), piece):
                n = min(piece, len(data) - off)
                if direct and n % mmap.PAGESIZE == 0:
                    buf[:n] = data[off:off + n]
                    os.pwrite(fd, memoryview(buf)[:n], off)
                else:                               # the file's tail (or no O_DIRECT): a plain write
                    if direct:
                        os.close(fd)
                        fd, direct = os.open(path, os.O_WRONLY), False
                    os.pwrite(fd, data[off:off + n], off)
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
            os.fsync(fd)
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t0
    for i in range(copies):
        (folder / f"copy{i}").unlink()
    return seconds


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 * MiB)
        view = memoryview(buf)
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_save", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=4 * GiB, help="checkpoint size (default 4GiB)")
    p.add_argument("--stores", type=int, default=3, help="directory stores (default 3)")
    p.add_argument("--replicas", type=int, default=2, help="replicas (default 2)")
    p.add_argument("--chunk-size", type=parse_size, default=4 * MiB, help="chunk size (default 4MiB)")
    p.add_argument("--cache", type=parse_size, default=GiB, help="the daemon's cache budget (default 1GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="where the local copy, stores and mount go (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (stores, logs)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip reading both files back to compare their sha256")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--fsync", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.size, args.seed, args.fsync)
    try:
        return run(args)
    except BenchError as e:
        print(f"\nbench_save: error: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cpfs-bench-save-", dir=args.workdir or "/tmp"))
    # The local copy, the staging file and `replicas` copies in the stores, on one disk.
    need = args.size * (2 + args.replicas) + GiB
    free = shutil.disk_usage(work).free
    if free < need:
        remove_tree(work)
        raise BenchError(f"{work}: {human(free)} free, this run needs about {human(need)}; use --workdir or --size")
    cfg = write_config(work / "cpfs", stores=args.stores, replicas=args.replicas, chunk_size=args.chunk_size,
                       cache=args.cache)
    print(f"work folder {work}; {args.stores} directory stores there, replicas {args.replicas}, "
          f"chunk size {human(args.chunk_size)}, cache budget {human(args.cache)}")
    (work / "local").mkdir()
    local = work / "local" / FILE
    mp = work / "mnt"
    m: Mount | None = None
    try:
        note = drop_caches()
        if note:
            print(f"  ({note})")
        print(f"\n== torch.save of ~{human(args.size)} straight to local disk ({local})")
        direct = timed_save(local, args.size, seed=args.seed, fsync=True)
        print(f"  torch.save {direct.seconds:.2f} s, then fsync {direct.fsync:.2f} s ({human(direct.size)})")
        drop_caches()
        floor = timed_copies(local, work / "copies", args.replicas)
        print(f"  {args.replicas} copies of its bytes written from memory, O_DIRECT + fsync: {floor:.2f} s "
              f"(what the stores must write, at the disk's speed)")

        drop_caches()
        print(f"\n== torch.save of the same state dict into the mount ({mp / FILE})")
        with mounted(cfg, mp, work / "mount.log") as m:
            via = timed_save(mp / FILE, args.size, seed=args.seed, daemon_pid=m.pid)
            print(f"  torch.save {via.seconds:.2f} s (close() returned once committed)")
            same = None
            if args.verify:
                drop_caches()
                t0 = time.perf_counter()
                same = sha256(mp / FILE) == sha256(local)
                print(f"  read both back, sha256 {'equal' if same else 'DIFFERENT'} ({time.perf_counter() - t0:.1f} s)")
        stored = sum(f.stat().st_size for f in (work / "cpfs" / "stores").rglob("*") if f.is_file())
    finally:
        leave_work(work, args.keep)

    assert via.rss is not None
    size = via.size
    print(f"\n== results: {human(size)} checkpoint, {args.stores} stores x replicas {args.replicas} on the same "
          f"disk as the local copy")
    print()
    rows = [["torch.save, local disk (page cache)", f"{direct.seconds:.2f}", f"{size / direct.seconds / MiB:.0f}", "1.00x"],
            ["torch.save + fsync, local disk", f"{direct.seconds + direct.fsync:.2f}",
             f"{size / (direct.seconds + direct.fsync) / MiB:.0f}",
             f"{(direct.seconds + direct.fsync) / direct.seconds:.2f}x"],
            [f"{args.replicas} copies + fsync, local disk (floor)", f"{floor:.2f}", f"{size / floor / MiB:.0f}",
             f"{floor / direct.seconds:.2f}x"],
            ["torch.save through cpfs (committed)", f"{via.seconds:.2f}", f"{size / via.seconds / MiB:.0f}",
             f"{via.seconds / direct.seconds:.2f}x"]]
    print_table(["", "seconds", "MiB/s", "vs local"], rows)
    growth = via.rss.peak - via.rss.before
    print(f"\nsave through the mount / save to local disk: {via.seconds / direct.seconds:.2f}x "
          f"({via.seconds / (direct.seconds + direct.fsync):.2f}x of save + fsync, {via.seconds / floor:.2f}x of "
          f"writing the {args.replicas} copies the stores hold)")
    print(f"daemon RSS: before {human(via.rss.before)}, peak {human(via.rss.peak)}, growth {human(growth)} "
          f"({via.rss.samples} samples every {SAMPLE_EVERY * 1000:.0f} ms); cache budget {human(args.cache)}: "
          f"peak = budget {'+' if via.rss.peak >= args.cache else '-'} {human(abs(via.rss.peak - args.cache))}")
    print(f"daemon CPU during the save: {via.rss.cpu_seconds:.1f} s "
          f"({100 * via.rss.cpu_seconds / via.seconds:.0f}% of one core; {os.cpu_count()} cores here)")
    print(f"stores hold {human(stored)} = {stored / size:.2f}x the file ({args.replicas} replicas, lz4 where it helps)")
    assert m is not None
    print_daemon_report(m, "mount")
    failed = same is False or bool(m.problems)
    if same is False:
        print("\nFAILED: the file read back through cpfs differs from the local save")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
