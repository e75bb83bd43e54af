"""Paths whose listing missed some of their stores (one store of three down; write_quorum 1, so a
listing needs both of a path's placement stores): the version found may not be the newest, so it is
shown but not served (EIO), and nothing may treat the path as absent. Left out instead, a put or a
create replaced a folder holding a checkpoint, and a folder rename left a file behind (the second
spares review's finds). And a spare that refused a chunk still takes a manifest."""
from __future__ import annotations

import errno
import os
from contextlib import asynccontextmanager
from pathlib import Path

import pyfuse3
import pytest
import trio

from conftest import write_config
from cpfs import chunk as chunkfmt
from cpfs.cache import ChunkCache
from cpfs.catalog import Catalog
from cpfs.config import load_config
from cpfs.errors import IsADirectory, StoreFull
from cpfs.fs import CpfsOperations
from cpfs.importer import Importer
from cpfs.manifest import Manifest, path_hash
from cpfs.namespace import Namespace
from cpfs.placement import place
from cpfs.pool import StorePool
from cpfs.readahead import Scheduler
from cpfs.store import FaultyStore, open_store

from test_fs_ops import new_file
from test_spares import NAMES, _pool

EXTRA = "write_quorum = 1"


@asynccontextmanager
async def mounted(folder: Path, down: str = "", staging: str = "staging"):
    """The daemon's stack over the folder stores, `down` failing every request from the start."""
    config = load_config(write_config(folder, chunk_size="1MiB", extra=EXTRA))
    pool = StorePool(config, stores=[FaultyStore(open_store(s), down=s.name == down) for s in config.stores])
    await pool.check()
    catalog = Catalog(pool)
    sched = Scheduler(ChunkCache(config.cache_memory), pool.fetch_chunk, config, fetch_many=pool.fetch_chunks,
                      fetch_blocks=pool.fetch_blocks)
    (folder / staging).mkdir()
    ops = CpfsOperations(Namespace(await catalog.load_all()), sched, catalog, config, folder / staging, None)
    async with trio.open_nursery() as n:
        ops.nursery = n
        await n.start(pool.run)
        await n.start(sched.run)
        yield ops, catalog
        n.cancel_scope.cancel()


def _names() -> tuple[str, str, str]:
    """A folder placed on s1 and s2, a file in it placed on s0 (its listing misses s0), one not."""
    d = next(f"d{i}" for i in range(500) if set(place(path_hash(f"/d{i}"), NAMES, 2)) == {"s1", "s2"})
    x = next(f"x{i}.pt" for i in range(500) if "s0" in place(path_hash(f"/{d}/x{i}.pt"), NAMES, 2))
    y = next(f"y{i}.pt" for i in range(500) if "s0" not in place(path_hash(f"/{d}/y{i}.pt"), NAMES, 2))
    return d, x, y


async def _put(tmp_path: Path, dest: str) -> None:
    config = load_config(write_config(tmp_path, chunk_size="1MiB", extra=EXTRA))
    pool = StorePool(config)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(100_000))
    await Importer(pool, Catalog(pool)).put(src, dest)


async def test_a_put_over_a_folder_whose_file_was_not_listed_enough_is_refused(tmp_path: Path) -> None:
    d, x, _ = _names()
    await _put(tmp_path, f"/{d}/{x}")
    config = load_config(write_config(tmp_path, chunk_size="1MiB", extra=EXTRA))
    pool = StorePool(config, stores=[FaultyStore(open_store(s), down=s.name == "s0") for s in config.stores])
    await pool.check()
    src = tmp_path / "small.txt"
    src.write_bytes(b"a small unrelated file")
    with pytest.raises(IsADirectory):
        await Importer(pool, Catalog(pool)).put(src, f"/{d}")


async def test_a_fresh_mount_shows_such_a_file_unreadable_and_creates_nothing_over_its_folder(tmp_path: Path) -> None:
    d, x, _ = _names()
    await _put(tmp_path, f"/{d}/{x}")
    ctx = pyfuse3.RequestContext()
    async with mounted(tmp_path, down="s0") as (ops, _):
        folder = await ops.lookup(pyfuse3.ROOT_INODE, d.encode(), ctx)
        assert folder.st_mode & 0o170000 == 0o040000
        f = await ops.lookup(folder.st_ino, x.encode(), ctx)
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.open(f.st_ino, os.O_RDONLY, ctx)
        assert e.value.errno == errno.EIO
        with pytest.raises(pyfuse3.FUSEError):
            await new_file(ops, pyfuse3.ROOT_INODE, d.encode(), b"a file over the folder")
    async with mounted(tmp_path, staging="st2") as (_, catalog):
        assert {p for p in await catalog.load_all()} == {f"/{d}/{x}"}


async def test_a_folder_with_a_file_not_listed_enough_is_not_renamed_in_part(tmp_path: Path) -> None:
    d, x, y = _names()
    async with mounted(tmp_path, staging="st0") as (ops, _):
        ctx = pyfuse3.RequestContext()
        folder = await ops.mkdir(pyfuse3.ROOT_INODE, d.encode(), 0o755, ctx)
        for name in (x, y):
            await new_file(ops, folder.st_ino, name.encode(), b"checkpoint " + name.encode())
    async with mounted(tmp_path, down="s0", staging="st1") as (ops, _):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.rename(pyfuse3.ROOT_INODE, d.encode(), pyfuse3.ROOT_INODE, b"renamed", 0, ctx)
        assert e.value.errno == errno.EIO
    async with mounted(tmp_path, staging="st2") as (_, catalog):
        assert set(await catalog.load_all()) == {f"/{d}", f"/{d}/{x}", f"/{d}/{y}"}


async def test_a_spare_that_refused_a_chunk_still_takes_a_manifest(tmp_path: Path) -> None:
    """s2, the spare, is nearly full: it refused a chunk, and takes small objects. With s1 down, a
    chunkless commit (an mkdir, a `latest` link) of a path placed on s0 and s1 goes to s2: a store
    that refused of late ranks after those that did not, but before those that are down."""
    path = next(p for i in range(200) if set(place(path_hash(p := f"/latest{i}"), NAMES, 2)) == {"s0", "s1"})
    pool, wrapped = _pool(tmp_path)
    await pool.check()
    wrapped["s2"].refuse("put", "chunks/*", error=StoreFull)
    with pytest.raises(StoreFull):
        await pool.store_chunk(chunkfmt.encode(os.urandom(1000)), ["s2"], 1)
    assert pool.health()[2].refusals == 1
    wrapped["s1"].down = True
    await pool.check()
    m = Manifest(path=path, size=0, mtime_ns=1, mode=0o755, chunk_size=1 << 20, chunks=(), version=0, directory=True)
    assert (await Catalog(pool, writer="ab").commit(m)).version == 1
    assert list((tmp_path / "s2").glob(f"manifests/{path_hash(path)}/*"))
