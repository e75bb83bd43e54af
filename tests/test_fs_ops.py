"""The FUSE operations in-process, without a kernel: orders of requests that a mount produces only now and
then. The kernel sends RELEASE after close() has returned, without waiting for it, so the next open of
the same file (a saver rewriting its checkpoint in a loop) can reach the daemon while the last one's
release is still at work."""
from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from conftest import write_config
from cpfs.cache import ChunkCache
from cpfs.catalog import Catalog
from cpfs.config import load_config
from cpfs.fs import CpfsOperations
from cpfs.namespace import Namespace
from cpfs.pool import StorePool
from cpfs.readahead import Scheduler

MiB = 1 << 20
ROUNDS = 40


@asynccontextmanager
async def operations(folder: Path) -> AsyncIterator[tuple[CpfsOperations, Catalog]]:
    """The daemon's stack (cpfs/daemon.py: serve) over folder stores, without pyfuse3.main."""
    config = load_config(write_config(folder, chunk_size="1MiB"))
    pool = StorePool(config)
    await pool.check()
    catalog = Catalog(pool)
    sched = Scheduler(ChunkCache(config.cache_memory), pool.fetch_chunk, config, fetch_many=pool.fetch_chunks,
                      fetch_blocks=pool.fetch_blocks)
    staging = folder / "staging"
    staging.mkdir()
    ops = CpfsOperations(Namespace(await catalog.load_all()), sched, catalog, config, staging)
    async with trio.open_nursery() as n:
        ops.nursery = n
        await n.start(sched.run)
        yield ops, catalog
        n.cancel_scope.cancel()


async def save(ops: CpfsOperations, ino: int, data: bytes, flags: int = os.O_WRONLY | os.O_TRUNC) -> int:
    """open, write, close() (the flush, which commits); the release is the caller's."""
    fh = (await ops.open(ino, flags, pyfuse3.RequestContext())).fh
    assert await ops.write(fh, 0, data) == len(data)
    await ops.flush(fh)
    return fh


@pytest.mark.parametrize("delay", [0, 1, 3])
async def test_an_open_that_meets_the_last_release_of_a_rewritten_file_writes_and_commits(
        tmp_path: Path, delay: int) -> None:
    """A release whose session ends while an O_TRUNC open joins it committed the open's truncation (an
    empty file) as the current version, and left the open's handle without a session: its writes
    failed (EIO, logged as a crash), or went in before the end and its close() then committed nothing
    and returned success. Each round races the release of one save against the next save's open,
    `delay` scheduler turns apart, both ways round; no version may ever be empty."""
    async with operations(tmp_path / "cpfs") as (ops, catalog):
        fh = (await ops.create(pyfuse3.ROOT_INODE, b"w.bin", 0o644, os.O_WRONLY | os.O_CREAT,
                               pyfuse3.RequestContext()))[0].fh
        await ops.write(fh, 0, os.urandom(MiB))
        await ops.flush(fh)
        ino = ops.handles[fh].node.ino
        for r in range(ROUNDS):
            data = os.urandom(MiB + r * 4099)
            fhs: list[int] = []

            async def release_late(fh: int = fh) -> None:
                for _ in range(delay):
                    await trio.lowlevel.checkpoint()
                await ops.release(fh)

            async def next_save(data: bytes = data) -> None:
                fhs.append(await save(ops, ino, data))

            async with trio.open_nursery() as n:
                if r % 2:
                    n.start_soon(release_late)
                    n.start_soon(next_save)
                else:
                    n.start_soon(next_save)
                    n.start_soon(release_late)
            fh = fhs[0]
            assert (await catalog.current("/w.bin")).size == len(data), r
            assert await ops.read(fh, 0, len(data) + 1) == data, r
            assert all(v.summary and v.summary.size >= MiB for v in await catalog.history("/w.bin")), r
        await ops.release(fh)
        assert not ops.writing and not ops.handles


def size_change(size: int) -> tuple[pyfuse3.EntryAttributes, SimpleNamespace]:
    """setattr's arguments for truncate(2) to `size` (the fields as the kernel sets them)."""
    attr = pyfuse3.EntryAttributes()
    attr.st_size = size
    fields = SimpleNamespace(update_size=True, update_mode=False, update_uid=False, update_gid=False,
                             update_atime=False, update_mtime=False, update_ctime=False)
    return attr, fields


@pytest.mark.parametrize("delay", [0, 1, 3])
async def test_a_truncate_of_a_closed_file_and_an_open_for_writing_share_the_session(
        tmp_path: Path, delay: int) -> None:
    """truncate(2) of a closed file runs a session of its own; an open for writing that joined it
    meanwhile lost it when the truncate ended it (the open's writes: EIO). Each round races a
    truncate to half the size against a save of new bytes, `delay` scheduler turns apart."""
    async with operations(tmp_path / "cpfs") as (ops, catalog):
        fh = (await ops.create(pyfuse3.ROOT_INODE, b"w.bin", 0o644, os.O_WRONLY | os.O_CREAT,
                               pyfuse3.RequestContext()))[0].fh
        ino = ops.handles[fh].node.ino
        await ops.write(fh, 0, os.urandom(MiB))
        await ops.flush(fh)
        await ops.release(fh)
        for r in range(ROUNDS):
            data = os.urandom(MiB + r * 4099)
            half = len(data) // 2
            fhs: list[int] = []

            async def truncate() -> None:
                for _ in range(delay):
                    await trio.lowlevel.checkpoint()
                await ops.setattr(ino, *size_change(half), None, pyfuse3.RequestContext())

            async def next_save(data: bytes = data) -> None:
                fhs.append(await save(ops, ino, data))

            async with trio.open_nursery() as n:
                if r % 2:
                    n.start_soon(truncate)
                    n.start_soon(next_save)
                else:
                    n.start_soon(next_save)
                    n.start_soon(truncate)
            await ops.flush(fhs[0])          # a truncate after the save's flush joined its session
            await ops.release(fhs[0])
            size = (await catalog.current("/w.bin")).size
            assert size in (len(data), half), r
            got = await ops.read(fh := (await ops.open(ino, os.O_RDONLY, pyfuse3.RequestContext())).fh, 0, size + 1)
            await ops.release(fh)
            assert got == data[:size], r
        assert not ops.writing and not ops.handles
