"""Metadata at scale: mount start, first listing, refresh, and first open with many big manifests.

    python -m benchmarks.bench_metadata [--files 10000] [--tensors 1000] [--stores 3]

Writes `--files` committed versions (replicas 2) straight into folder stores, each a manifest of
`--tensors` 1 MiB tensors (one chunk each, a torch-style tensor index): about 300 KB of JSON per file,
as a real checkpoint of that many tensors has. Then, on a fresh mount: the time from `mount.py` to the
first `ls -l` of a folder, a full `ls -lR`, one refresh after another process commits a file, the first
open of a file (its whole manifest is read then), and the daemon's RSS. The baseline is the same tree as
empty files on local disk (`ls -lR` of it), in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from benchmarks.common import BenchError, cpfs, drop_caches, mounted, print_table
from cpfs.catalog import VersionRef
from cpfs.manifest import ChunkEntry, Manifest, path_hash
from cpfs.placement import place
from cpfs.tensor_index import Record, TensorEntry, TensorIndex

MiB = 1024 * 1024


def fake_manifest(path: str, tensors: int, seed: int, stores: list[str]) -> Manifest:
    chunks, entries, records = [], [], []
    off = 64
    for t in range(tensors):
        digest = f"{seed:016x}{t:016x}".ljust(64, "0")
        chunks.append(ChunkEntry(digest, MiB, MiB + 32, "raw", tuple(place(digest, stores, 2))))
        name = f"model.layers.{t // 8}.mlp.experts.{t % 8}.weight"
        entries.append(TensorEntry(name, "bfloat16", (512, 1024), (1024, 1), str(t), off, MiB))
        records.append(Record(f"archive/data/{t}", off, MiB))
        off += MiB
    chunks.insert(0, ChunkEntry("f" * 64, 64, 96, "raw", tuple(stores[:2])))
    index = TensorIndex("torch-zip", tuple(records), tuple(entries), off, off)
    return Manifest(path=path, size=off, mtime_ns=time.time_ns(), mode=0o644, chunk_size=4 * MiB,
                    chunks=tuple(chunks), version=1, tensor_index=index.to_json(), writer="be", host="bench")


def write_stores(root: Path, files: int, tensors: int, names: list[str]) -> int:
    """Commit `files` versions by writing their store files directly (what commits leave behind).
    One manifest is built, then copied with each file's path and chunk names put in."""
    template = fake_manifest("/PATH", tensors, 0xABCDEFABCDEFABCD, names).to_bytes()

    def one(i: int) -> int:
        path = f"/run{i // 100:03d}/step_{i:05d}.pt"
        data = template.replace(b"abcdefabcdefabcd", f"{i:016x}".encode()).replace(b'"/PATH"',
                                                                                   json.dumps(path).encode())
        h = path_hash(path)
        key = VersionRef.key_of(h, 1, "be", "ok")
        for name in place(h, names, 2):
            f = root / name / key
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(data)
        return len(data)

    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(one, range(files)))


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ls_lr(root: Path) -> int:
    n = 0
    for dirpath, dirs, names in os.walk(root):
        for name in names + dirs:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_metadata", description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--stores", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="cpfs-meta-"))
    try:
        names = [f"s{i}" for i in range(args.stores)]
        cfg = tmp / "cpfs.toml"
        cfg.write_text("replicas = 2\n[mount]\nrefresh = \"1s\"\n"
                       f"staging = \"{tmp / 'staging'}\"\n"
                       + "".join(f'[[store]]\nname = "{n}"\nurl = "stores/{n}"\n' for n in names))
        print(f"writing {args.files} manifests of {args.tensors} tensors into {args.stores} folder stores ...")
        t, total = timed(lambda: write_stores(tmp / "stores", args.files, args.tensors, names))
        print(f"  {total / args.files / 1024:.0f} KiB of manifest per file, {2 * total / 2**30:.2f} GiB "
              f"written in {t:.1f} s")
        local = tmp / "local"
        for i in range(args.files):
            d = local / f"run{i // 100:03d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"step_{i:05d}.pt").touch()
        rows = []
        for cold in (True, False):
            if cold:
                drop_caches()
            base_t, n_local = timed(lambda: ls_lr(local))
            mnt = tmp / "mnt"
            t0 = time.perf_counter()
            with mounted(cfg, mnt, tmp / "mount.log") as m:
                mount_t = time.perf_counter() - t0
                first_ls, _ = timed(lambda: [os.lstat(e.path) for e in os.scandir(mnt / "run000")])
                to_first_ls = time.perf_counter() - t0
                full_t, n = timed(lambda: ls_lr(mnt))
                if n != n_local:
                    raise BenchError(f"the mount lists {n} entries, the local tree {n_local}")
                rss = psutil.Process(m.pid).memory_info().rss
                src = tmp / "new.bin"
                src.write_bytes(os.urandom(4096))
                cpfs("put", str(src), "/run000/new.bin", config=cfg)
                time.sleep(1.1)                              # past the refresh interval
                refresh_t, names_now = timed(lambda: os.listdir(mnt / "run000"))
                if "new.bin" not in names_now:
                    raise BenchError("the refresh did not show the new file")
                cpfs("rm", "/run000/new.bin", config=cfg)
                last = args.files - 1
                victim = mnt / f"run{last // 100:03d}" / f"step_{last:05d}.pt"
                open_t, _ = timed(lambda: open(victim, "rb").close())
            rows.append(["cold" if cold else "warm", f"{mount_t:.2f}", f"{to_first_ls:.2f}",
                         f"{full_t:.2f} ({full_t / base_t:.1f}x local)", f"{refresh_t:.2f}",
                         f"{open_t * 1000:.0f} ms", f"{rss / MiB:.0f} MiB"])
        print(f"\n{args.files} files x {args.tensors} tensors, {args.stores} folder stores "
              f"(local ls -lR of the same tree: {base_t:.2f} s)")
        print_table(["page cache", "mount (s)", "mount to first ls -l (s)", "ls -lR (s)",
                     "refresh (s)", "first open", "daemon RSS"], rows)
        return 0
    except BenchError as e:
        print(f"bench_metadata: error: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
