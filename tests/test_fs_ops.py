"""The FUSE operations in-process, without a kernel: orders of requests that a mount produces only now and
then. The kernel sends RELEASE after close() has returned, without waiting for it, so the next open of
the same file (a saver rewriting its checkpoint in a loop) can reach the daemon while the last one's
release is still at work; a chmod, a rename or a truncate from another thread can come amid a save.
Each must start from what the one before committed (CpfsOperations._settled)."""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import stat
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from conftest import write_config
from cpfs import chunk as chunkfmt
from cpfs.cache import ChunkCache
from cpfs.catalog import Catalog
from cpfs.config import load_config
from cpfs.errors import NotFound, StoreError, StoreUnavailable
from cpfs.fs import CpfsOperations
from cpfs.manifest import path_hash
from cpfs.namespace import Namespace
from cpfs.pagecache import Pusher
from cpfs.placement import place
from cpfs.pool import StorePool
from cpfs.readahead import Scheduler
from cpfs.store import FaultyStore, open_store

from test_catalog import commit_bytes

MiB = 1 << 20
ROUNDS = 40


@asynccontextmanager
async def operations(folder: Path, faulty: list[FaultyStore] | None = None, staging: str = "staging",
                     writer: str | None = None, pusher: Pusher | None = None, extra: str = "",
                     store_extra: str = "") -> AsyncIterator[tuple[CpfsOperations, Catalog]]:
    """The daemon's stack (cpfs/daemon.py: serve) over folder stores, without pyfuse3.main; with
    `faulty` (an empty list to fill), each store wrapped in a FaultyStore the test can turn down. Two
    at once over one folder are two mounts of the same stores: each needs its own `staging` (and
    `writer` id, as two processes would have). With `pusher`, reads push to the page cache through it
    (its `notify` a model of the kernel's). `extra`, `store_extra`: config lines (conftest.write_config)."""
    config = load_config(write_config(folder, chunk_size="1MiB", extra=extra, store_extra=store_extra))
    if faulty is not None:
        faulty.extend(FaultyStore(open_store(s)) for s in config.stores)
    pool = StorePool(config, stores=faulty)
    await pool.check()
    catalog = Catalog(pool, **({"writer": writer} if writer else {}))
    sched = Scheduler(ChunkCache(config.cache_memory), pool.fetch_chunk, config, fetch_many=pool.fetch_chunks,
                      fetch_blocks=pool.fetch_blocks, on_chunk=pusher, on_reply=pusher.replied if pusher else None)
    (folder / staging).mkdir()
    ops = CpfsOperations(Namespace(await catalog.load_all()), sched, catalog, config, folder / staging, pusher)
    async with trio.open_nursery() as n:
        ops.nursery = n
        await n.start(pool.run)         # store health: probes stores marked down until they answer
        await n.start(sched.run)
        if pusher is not None:
            await n.start(pusher.run)
        yield ops, catalog
        n.cancel_scope.cancel()


async def turns(n: int) -> None:
    """Let the scheduler run n times (other tasks move on meanwhile)."""
    for _ in range(n):
        await trio.lowlevel.checkpoint()


async def save(ops: CpfsOperations, ino: int, data: bytes) -> int:
    """open O_TRUNC, write, close() (the flush, which commits); the release is the caller's."""
    fh = (await ops.open(ino, os.O_WRONLY | os.O_TRUNC, pyfuse3.RequestContext())).fh
    assert await ops.write(fh, 0, data) == len(data)
    await ops.flush(fh)
    return fh


async def new_file(ops: CpfsOperations, parent: int, name: bytes, data: bytes) -> pyfuse3.EntryAttributes:
    """A new file with `data`, closed (committed) and released."""
    fi, attrs = await ops.create(parent, name, 0o644, os.O_WRONLY | os.O_CREAT, pyfuse3.RequestContext())
    assert await ops.write(fi.fh, 0, data) == len(data)
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    return attrs


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
                await turns(delay)
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


def change(size: int | None = None, mode: int | None = None) -> tuple[pyfuse3.EntryAttributes, SimpleNamespace]:
    """setattr's arguments for truncate(2) to `size` or chmod to `mode` (the fields as the kernel
    sets them)."""
    attr = pyfuse3.EntryAttributes()
    if size is not None:
        attr.st_size = size
    if mode is not None:
        attr.st_mode = stat.S_IFREG | mode
    fields = SimpleNamespace(update_size=size is not None, update_mode=mode is not None, update_uid=False,
                             update_gid=False, update_atime=False, update_mtime=False, update_ctime=False)
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
                await turns(delay)
                await ops.setattr(ino, *change(size=half), None, pyfuse3.RequestContext())

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


def fit(data: bytes, size: int) -> bytes:
    """`data` truncated (or extended with zeros) to `size`, as truncate(2) leaves it."""
    return data[:size].ljust(size, b"\0")


@pytest.mark.parametrize("seed", range(int(os.environ.get("STRESS_SEEDS", "4"))))
async def test_random_rounds_of_saves_truncates_chmods_moves_reads_and_late_releases(tmp_path: Path, caplog,
                                                                                     seed: int) -> None:
    """Model-based, seeded: each round runs at once, each after a random number of scheduler turns,
    some of: the release of the last round's save (the kernel's late RELEASE), a save of new bytes
    (open O_TRUNC, writes in pieces, now and then an fsync, close), a truncate(2), a chmod, a move to
    the other name (a rename, or a hard link and an unlink of the old name), a reader. After the round
    the file must hold what some order of those gives (the save's bytes, truncated by the truncate or
    not), under its one name alone, carry the chmod's mode, and no version may ever have been empty;
    nothing may fail. Trio orders the tasks of a batch at random, so a seed picks the operations but
    does not replay a run."""
    rng = random.Random(seed)
    ctx = pyfuse3.RequestContext()

    async def pause() -> None:
        await turns(rng.choice([0, 0, 1, 2, 3, 5, 8]))

    async with operations(tmp_path / "cpfs") as (ops, catalog):
        fh = (await ops.create(pyfuse3.ROOT_INODE, b"f.bin", 0o644, os.O_WRONLY | os.O_CREAT, ctx))[0].fh
        ino = ops.handles[fh].node.ino
        content = os.urandom(MiB)
        await ops.write(fh, 0, content)
        await ops.flush(fh)
        pending: int | None = fh                 # a save's handle whose release comes in the next round
        mode = 0o644
        name = "f.bin"
        with caplog.at_level(logging.WARNING, logger="cpfs"):
            for r in range(ROUNDS):
                data = os.urandom(rng.randrange(1, 3 * MiB)) if rng.random() < 0.7 else None
                size = rng.randrange(1, 3 * MiB) if rng.random() < 0.4 else None
                new_mode = rng.choice([0o600, 0o640, 0o664]) if rng.random() < 0.3 else None
                moving = rng.choice(["rename", "link"]) if rng.random() < 0.3 else None
                saved: list[int] = []
                ends: list[int] = []               # where the save's pieces end (a truncate may come between)

                async def release(fh: int) -> None:
                    await pause()
                    await ops.release(fh)

                async def save_in_pieces(data: bytes) -> None:
                    await pause()
                    fh = (await ops.open(ino, os.O_WRONLY | os.O_TRUNC, ctx)).fh
                    cuts = sorted(rng.sample(range(1, len(data)), min(3, len(data) - 1))) if len(data) > 1 else []
                    ends.extend(cuts)
                    for lo, hi in zip([0, *cuts], [*cuts, len(data)]):
                        assert await ops.write(fh, lo, data[lo:hi]) == hi - lo
                        if rng.random() < 0.2:
                            await ops.fsync(fh, False)      # a version of what is written so far
                        await pause()
                    await ops.flush(fh)
                    saved.append(fh)

                async def truncate(size: int) -> None:
                    await pause()
                    await ops.setattr(ino, *change(size=size), None, ctx)

                async def chmod(mode: int) -> None:
                    await pause()
                    await ops.setattr(ino, *change(mode=mode), None, ctx)

                async def move(how: str, old: bytes, new: bytes) -> None:
                    await pause()
                    if how == "rename":
                        await ops.rename(pyfuse3.ROOT_INODE, old, pyfuse3.ROOT_INODE, new, 0, ctx)
                    else:
                        await ops.link(ino, pyfuse3.ROOT_INODE, new, ctx)
                        await pause()
                        await ops.unlink(pyfuse3.ROOT_INODE, old, ctx)

                async def read() -> None:
                    await pause()
                    fh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
                    await ops.read(fh, rng.randrange(3 * MiB), rng.choice([4096, MiB]))
                    await ops.release(fh)

                async with trio.open_nursery() as n:
                    if pending is not None:
                        n.start_soon(release, pending)
                    if data is not None:
                        n.start_soon(save_in_pieces, data)
                    if size is not None:
                        n.start_soon(truncate, size)
                    if new_mode is not None:
                        n.start_soon(chmod, new_mode)
                    if moving is not None:
                        other = "g.bin" if name == "f.bin" else "f.bin"
                        n.start_soon(move, moving, name.encode(), other.encode())
                        name = other
                    if rng.random() < 0.3:
                        n.start_soon(read)
                pending = saved[0] if saved else None
                if pending is not None and rng.random() < 0.5:
                    await ops.release(pending)
                    pending = None
                base = content if data is None else data
                allowed = [base] if size is None else [fit(base, size)]
                if data is not None and size is not None:       # the truncate came before the save ...
                    allowed += [data, fit(data, max(size, len(data)))]
                    allowed += [data[:size] + bytes(e - size) + data[e:] for e in ends if e > size]   # ... or amid
                mode = new_mode if new_mode is not None else mode
                fh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
                got = bytes(await ops.read(fh, 0, 4 * MiB))
                await ops.release(fh)
                assert sorted(await catalog.load_all()) == [f"/{name}"], r
                current = await catalog.current(f"/{name}")
                assert got in allowed, (r, len(got), [len(a) for a in allowed])
                shown = await ops.getattr(ino, ctx)
                assert (shown.st_size, shown.st_mode & 0o7777) == (len(got), mode), r
                # A truncate or a chmod that came after the save's close joined its open session: it
                # commits when the session ends, at the save's release (next round); until then only
                # the mount shows it.
                deferred = ino in ops.writing and (size is not None or new_mode is not None)
                assert (current.size, current.mode & 0o7777) == (len(got), mode) or deferred, r
                assert all(v.summary and v.summary.size > 0 for v in await catalog.history(f"/{name}")
                           if v.ref.state != "deleted"), r
                content = got
            if pending is not None:
                await ops.release(pending)
        assert not ops.writing and not ops.handles
        assert not caplog.records, [rec.getMessage()[:200] for rec in caplog.records]


@pytest.mark.parametrize("delay", [0, 1, 3])
async def test_a_chmod_under_way_is_not_overtaken_by_an_unlink_or_a_rename(tmp_path: Path, delay: int) -> None:
    """A chmod of a closed file commits a new version of its path. A rename that came meanwhile moved
    the version before it: the renamed file kept its old mode (at each of the 3 delays here), and a chmod
    committing after the move could bring the old name back; an unlink likewise. Each round races a
    chmod against an unlink or a rename, `delay` turns apart: neither may undo the other."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path / "cpfs") as (ops, catalog):
        for r in range(ROUNDS):
            data = os.urandom(MiB // 2 + r)
            attrs = await new_file(ops, pyfuse3.ROOT_INODE, b"a.bin", data)
            renaming = r % 2 == 1

            async def chmod() -> None:
                await ops.setattr(attrs.st_ino, *change(mode=0o600), None, ctx)

            async def remove() -> None:
                await turns(delay)
                if renaming:
                    await ops.rename(pyfuse3.ROOT_INODE, b"a.bin", pyfuse3.ROOT_INODE, b"b.bin", 0, ctx)
                else:
                    await ops.unlink(pyfuse3.ROOT_INODE, b"a.bin", ctx)

            async with trio.open_nursery() as n:
                n.start_soon(chmod)
                n.start_soon(remove)
            with pytest.raises(NotFound):
                await catalog.current("/a.bin")
            if renaming:
                moved = await catalog.current("/b.bin")
                assert moved.mode & 0o777 == 0o600 and moved.size == len(data), r
                await ops.unlink(pyfuse3.ROOT_INODE, b"b.bin", ctx)


@pytest.mark.parametrize("delay", [0, 1, 3, 6])
async def test_a_file_saved_under_a_temporary_name_shows_its_renamed_version(tmp_path: Path, delay: int) -> None:
    """Write `tmp`, close, rename it to `final` (how many savers make a save atomic), with the
    kernel's release of `tmp` arriving `delay` turns after the rename started. The release's flush
    has nothing new and returned the session's last commit, the `tmp` version, which the file then
    showed again (at 3 or 4 of the 4 delays on the code before): `final` read through the manifest of a version
    of `tmp`, a name that no longer exists."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path / "cpfs") as (ops, catalog):
        data = os.urandom(MiB)
        fi, attrs = await ops.create(pyfuse3.ROOT_INODE, b"tmp", 0o644, os.O_WRONLY | os.O_CREAT, ctx)
        await ops.write(fi.fh, 0, data)
        await ops.flush(fi.fh)

        async def release() -> None:
            await turns(delay)
            await ops.release(fi.fh)

        async with trio.open_nursery() as n:
            n.start_soon(ops.rename, pyfuse3.ROOT_INODE, b"tmp", pyfuse3.ROOT_INODE, b"final", 0, ctx)
            n.start_soon(release)
        shown, current = ops.ns.node(attrs.st_ino).summary, await catalog.current("/final")
        assert shown is not None and (shown.path, shown.order) == ("/final", current.order)
        assert (await ops.lookup(pyfuse3.ROOT_INODE, b"final", ctx)).st_ino == attrs.st_ino


async def test_a_truncate_of_a_closed_file_that_cannot_commit_leaves_the_previous_version(tmp_path: Path) -> None:
    """truncate(2) of a closed file commits as its session's last user leaves it. With two of three
    stores down (below write quorum) that commit fails: the truncate fails with an errno, and the
    previous version stays current and readable, whole. Once the stores are back, it truncates."""
    ctx = pyfuse3.RequestContext()
    faulty: list[FaultyStore] = []
    async with operations(tmp_path / "cpfs", faulty) as (ops, catalog):
        data = os.urandom(3 * MiB)
        attrs = await new_file(ops, pyfuse3.ROOT_INODE, b"f.bin", data)
        before = await catalog.current("/f.bin")
        faulty[0].down = faulty[1].down = True
        with pytest.raises(pyfuse3.FUSEError):
            await ops.setattr(attrs.st_ino, *change(size=MiB), None, ctx)
        faulty[0].down = faulty[1].down = False
        with trio.fail_after(30):
            while not all(catalog.pool.is_up(f.name) for f in faulty):
                await trio.sleep(0.1)       # the pool probes them back up (a listing needs 2 of 3)
        assert not ops.writing and (await catalog.current("/f.bin")).order == before.order
        fh = (await ops.open(attrs.st_ino, os.O_RDONLY, ctx)).fh
        assert await ops.read(fh, 0, 4 * MiB) == data
        await ops.release(fh)
        with trio.fail_after(60):
            while True:                     # the pool probes the stores back up
                try:
                    await ops.setattr(attrs.st_ino, *change(size=MiB), None, ctx)
                    break
                except pyfuse3.FUSEError:
                    await trio.sleep(0.2)
        assert (await catalog.current("/f.bin")).size == MiB


@pytest.mark.parametrize("delay", [0, 2, 8, 30, 100])
@pytest.mark.parametrize("other", ["rename", "unlink", "link"])
async def test_a_close_racing_a_rename_an_unlink_or_a_link_from_another_thread(tmp_path: Path, delay: int,
                                                                               other: str) -> None:
    """One thread closes a file it rewrote (the flush uploads, then commits under the file's names)
    while another renames, unlinks or hard-links it, `delay` turns after the close began. Both return
    success, in either order, and the names left hold the save, also for a fresh mount: after a
    rename, the new name has the saved bytes and the old name is gone; after an unlink, no name is
    left; after a link, both names have the saved bytes. The two commits were not ordered: on the
    code before, the close's commit brought back the old name after an unlink (at every delay) and
    after a rename (at 1 or 2 of the 5 delays, by timing). The link did not fail there; it is
    ordered all the same (CpfsOperations._names_changing)."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path / "cpfs") as (ops, catalog):
        attrs = await new_file(ops, pyfuse3.ROOT_INODE, b"f.bin", os.urandom(MiB))
        data = os.urandom(3 * MiB + 5)
        fh = (await ops.open(attrs.st_ino, os.O_WRONLY | os.O_TRUNC, ctx)).fh
        await ops.write(fh, 0, data)

        async def change_names() -> None:
            await turns(delay)
            if other == "rename":
                await ops.rename(pyfuse3.ROOT_INODE, b"f.bin", pyfuse3.ROOT_INODE, b"g.bin", 0, ctx)
            elif other == "unlink":
                await ops.unlink(pyfuse3.ROOT_INODE, b"f.bin", ctx)
            else:
                await ops.link(attrs.st_ino, pyfuse3.ROOT_INODE, b"g.bin", ctx)

        async with trio.open_nursery() as n:
            n.start_soon(ops.flush, fh)
            n.start_soon(change_names)
        await ops.release(fh)
        assert not ops.writing
        left = {"rename": ["/g.bin"], "unlink": [], "link": ["/f.bin", "/g.bin"]}[other]
        assert sorted(await catalog.load_all()) == left       # what a fresh mount sees
        for path in left:
            assert (await catalog.current(path)).size == len(data), path
        if left:
            shown = ops.ns.node(attrs.st_ino).summary     # the version of its first name
            assert shown is not None and shown.order == (await catalog.current(left[0])).order
            fh = (await ops.open(attrs.st_ino, os.O_RDONLY, ctx)).fh
            assert await ops.read(fh, 0, len(data) + 1) == data
            await ops.release(fh)


@pytest.mark.parametrize("delay", [0, 1, 3])
async def test_extended_attributes_set_and_removed_at_once_are_all_kept(tmp_path: Path, delay: int) -> None:
    """Three threads change the extended attributes of one closed file at once, `delay` turns apart:
    two set a name each, one removes an earlier name. Each commits a new version with the file's
    attributes and its own change, so each must start from what the one before committed; on the
    code before, one of two setxattrs was lost in the first round at every delay."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path / "cpfs") as (ops, catalog):
        attrs = await new_file(ops, pyfuse3.ROOT_INODE, b"f.bin", os.urandom(MiB))
        expected: dict[bytes, bytes] = {}
        for r in range(10):
            pair = {f"user.a{r}".encode(): os.urandom(8), f"user.b{r}".encode(): os.urandom(8)}
            expected.update(pair)

            async def set_one(name: bytes, value: bytes, wait: int) -> None:
                await turns(wait)
                await ops.setxattr(attrs.st_ino, name, value, ctx)

            async def remove_one(name: bytes) -> None:
                await turns(delay)
                await ops.removexattr(attrs.st_ino, name, ctx)

            async with trio.open_nursery() as n:
                for i, (name, value) in enumerate(pair.items()):
                    n.start_soon(set_one, name, value, i * delay)
                if r:
                    n.start_soon(remove_one, f"user.a{r - 1}".encode())
                    del expected[f"user.a{r - 1}".encode()]
            assert sorted(await ops.listxattr(attrs.st_ino, ctx)) == sorted(expected), r
            committed = dict((await catalog.current("/f.bin")).xattrs)
            assert {k.encode(): v for k, v in committed.items()} == expected, r


@pytest.mark.parametrize("delay", [0, 1, 2, 4, 8, 16])
async def test_a_save_below_a_folder_being_renamed_lands_under_its_new_name(tmp_path: Path, delay: int) -> None:
    """A folder is renamed while a file below it is saved (open, write, close), the save starting
    `delay` turns after the rename. The save lands under the folder's new name and nothing remains
    under the old one, in the mount and in the stores."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path / "cpfs") as (ops, catalog):
        d = await ops.mkdir(pyfuse3.ROOT_INODE, b"d", 0o755, ctx)
        attrs = await new_file(ops, d.st_ino, b"x.bin", os.urandom(MiB))
        data = os.urandom(2 * MiB + 3)

        async def save_below() -> None:
            await turns(delay)
            fh = await save(ops, attrs.st_ino, data)
            await ops.release(fh)

        async with trio.open_nursery() as n:
            n.start_soon(ops.rename, pyfuse3.ROOT_INODE, b"d", pyfuse3.ROOT_INODE, b"e", 0, ctx)
            n.start_soon(save_below)
        assert sorted(p for p, s in (await catalog.load_all()).items() if not s.directory) == ["/e/x.bin"]
        assert (await catalog.current("/e/x.bin")).size == len(data)
        fh = (await ops.open(attrs.st_ino, os.O_RDONLY, ctx)).fh
        assert await ops.read(fh, 0, 3 * MiB) == data
        await ops.release(fh)


async def test_a_mount_that_listed_a_failed_commit_before_it_was_voided_goes_back(tmp_path: Path) -> None:
    """Another mount's commit of /f fails below quorum, and the store that took its manifest will not
    delete it. In the moment before its writer voids that copy (cpfs/catalog.py: its failed twin, put
    before the deletes and held here), this mount opens the file and shows that version. Once the twin
    is there, it goes back to the version before, although that one is older: the writer was told its
    save failed. No spare: with one, the commit the other stores refuse is made again on it."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, extra="spares = 0") as (ops, _):
        await new_file(ops, pyfuse3.ROOT_INODE, b"f", b"version 1")
        config = load_config(str(tmp_path / "cpfs.toml"))
        first = place(path_hash("/f"), [s.name for s in config.stores], config.replicas)[0]
        release = trio.Event()
        wrappers = [FaultyStore(open_store(s)) for s in config.stores]
        for w in wrappers:
            if w.name != first:
                w.refuse("put", "*.ok.json")                          # below quorum
            w.hold("put", "*.failed.json", release)                   # its twin, held
            w.refuse("delete", "manifests/*")
        writer = Catalog(StorePool(config, stores=wrappers), writer="bb")

        async def read(ino: int) -> bytes:
            fh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
            try:
                return bytes(await ops.read(fh, 0, 100))
            finally:
                await ops.release(fh)

        async def reopened(ino: int) -> int:
            """The file's inode once a newer listing replaced `ino` (open answers ESTALE, the kernel
            looks the name up again)."""
            await trio.sleep(ops.config.refresh)        # open looks for a newer version once per refresh
            with pytest.raises(pyfuse3.FUSEError) as e:
                await ops.open(ino, os.O_RDONLY, ctx)
            assert e.value.errno == errno.ESTALE
            return (await ops.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino

        ino = (await ops.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino
        async with trio.open_nursery() as n:
            async def commit() -> None:
                with pytest.raises(StoreError):
                    await commit_bytes(writer, "/f", b"version 2, failed")
            n.start_soon(commit)
            while not any(w.statistics().held for w in wrappers):
                await trio.sleep(0.01)
            ino = await reopened(ino)
            assert await read(ino) == b"version 2, failed"     # listed before it was voided
            release.set()
        assert writer.statistics().voided == 1
        ino = await reopened(ino)
        assert await read(ino) == b"version 1"


@pytest.mark.parametrize("initial", [b"", b"version 1"])
async def test_an_open_for_writing_closed_unwritten_commits_nothing(tmp_path: Path, initial: bytes) -> None:
    """open(f, "a") and close, nothing written: no new version, for an empty file too. Mount A holds
    the file open so while mount B saves over it: B's save stays current. An empty file's session once
    started without its version, so A's close committed an empty version over B's save."""
    ctx = pyfuse3.RequestContext()
    saved = b"B's checkpoint"
    async with operations(tmp_path, staging="staging-a", writer="aa") as (a, catalog):
        await new_file(a, pyfuse3.ROOT_INODE, b"f", initial)
        before = await catalog.current("/f")
        ino = (await a.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino
        fh = (await a.open(ino, os.O_WRONLY | os.O_APPEND, ctx)).fh
        await a.flush(fh)                                        # a close: nothing to commit
        assert (await catalog.current("/f")).order == before.order
        async with operations(tmp_path, staging="staging-b", writer="bb") as (b, _):
            fb = await save(b, (await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino, saved)
            await b.release(fb)
        await a.flush(fh)
        await a.release(fh)
        now = await catalog.current("/f")
        assert (now.writer, now.size) == ("bb", len(saved))
        assert now.version == before.version + 1


@pytest.mark.parametrize("broken", ["summary", "body"])
async def test_an_open_with_o_trunc_writes_over_a_version_that_cannot_be_read(tmp_path: Path, broken: str) -> None:
    """Every copy of the file's manifest is cut short (its summary line, or its body: chunks and tensor
    index). A new mount cannot read the file (EIO), but a save over it with O_TRUNC works: it needs
    nothing of that version. A cut body once failed that open too."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="staging-a") as (ops, _):
        await new_file(ops, pyfuse3.ROOT_INODE, b"ckpt.pt", os.urandom(100_000))
    copies = list(tmp_path.glob(f"stores/*/manifests/{path_hash('/ckpt.pt')}/*.json"))
    assert len(copies) >= 2
    for f in copies:
        head, _, body = f.read_bytes().partition(b"\n")
        f.write_bytes(head + b"\n" + body[:len(body) // 2] if broken == "body" else head[:len(head) // 2] + b"\n" + body)
    async with operations(tmp_path, staging="staging-b") as (ops, catalog):
        ino = (await ops.lookup(pyfuse3.ROOT_INODE, b"ckpt.pt", ctx)).st_ino
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.open(ino, os.O_RDONLY, ctx)
        assert e.value.errno == errno.EIO
        fh = await save(ops, ino, b"new bytes")
        await ops.release(fh)
        assert (await catalog.current("/ckpt.pt")).size == len(b"new bytes")


class PageCacheModel:
    """The kernel's page cache of one mount, as far as a test needs it: the bytes of each file's pages
    that pushes (the Pusher's notify, from its worker threads) and writes put there. `gate` holds every
    notify until set, as a push waiting for page locks would."""

    def __init__(self) -> None:
        self.pages: dict[int, bytearray] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.in_notify = threading.Event()
        self.lock = threading.Lock()

    def notify(self, inode: int, offset: int, data) -> None:
        self.in_notify.set()
        assert self.gate.wait(30)
        self.put(inode, offset, bytes(data))

    def put(self, inode: int, offset: int, data: bytes) -> None:
        with self.lock:
            page = self.pages.setdefault(inode, bytearray())
            if len(page) < offset + len(data):
                page.extend(bytes(offset + len(data) - len(page)))
            page[offset:offset + len(data)] = data

    def truncate(self, inode: int) -> None:
        with self.lock:
            self.pages[inode] = bytearray()


async def test_a_write_session_lets_no_push_of_the_version_read_before_land(tmp_path: Path) -> None:
    """A reader's pushes of the old version are queued, one is being sent (its thread held), and more of
    its prefetches are in flight (their store reads held) when the file is opened with O_TRUNC and
    written in this mount. The open returns once the push being sent is done, the queued ones are
    withdrawn, and the prefetches that land later push nothing: no page of the kernel's cache (a model
    of it) ends up with the old bytes over the written ones. An audit found the old version's late
    pushes there, read back by the writer and by every later open. Nothing is lost: the reader's own
    reads are answered by the daemon (the new version, as for any open of a file written here)."""
    ctx = pyfuse3.RequestContext()
    old, new = os.urandom(8 * MiB), os.urandom(8 * MiB)
    async with operations(tmp_path, staging="staging-a") as (ops, catalog):
        await new_file(ops, pyfuse3.ROOT_INODE, b"f", old)
        m = await catalog.get("/f")
    later = {chunkfmt.chunk_key(c.digest) for c in m.chunks[4:]}
    land = trio.Event()
    faulty: list[FaultyStore] = []
    model = PageCacheModel()
    async with operations(tmp_path, faulty, staging="staging-b", pusher=Pusher(threads=1, notify=model.notify)
                          ) as (ops, catalog):
        for f in faulty:
            f.hold("get", lambda key: key in later, land, refuse=False)
        ino = (await ops.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino
        rh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
        model.gate.clear()
        for off in range(0, 4 * MiB, 128 * 1024):          # a stream: the next chunks prefetched and pushed
            assert await ops.read(rh, off, 128 * 1024) == old[off:off + 128 * 1024]
        # Whatever the stream pushed by now (its marks are held back), one push is sure to be sent:
        ops.sched.feeder(ino, m).offer(7, old[7 * MiB:])
        with trio.fail_after(10):
            while not model.in_notify.is_set():
                await trio.sleep(0.01)
        opened: list[int] = []

        async def open_for_writing() -> None:
            opened.append((await ops.open(ino, os.O_WRONLY | os.O_TRUNC, ctx)).fh)
        async with trio.open_nursery() as n:
            n.start_soon(open_for_writing)
            await trio.sleep(0.2)
            early = bool(opened)             # the open returned while a push of the old version was being sent
            model.gate.set()
        model.truncate(ino)                                # the kernel's O_TRUNC, once the open returned
        wh = opened[0]
        for off in range(0, len(new), MiB):
            assert await ops.write(wh, off, new[off:off + MiB]) == MiB
            model.put(ino, off, new[off:off + MiB])        # the kernel caches written bytes too
        land.set()                                         # the reader's prefetches land now
        await trio.sleep(0.3)
        await ops.flush(wh)
        await ops.release(wh)
        await trio.sleep(0.3)
        assert await ops.read(rh, 6 * MiB, MiB) == new[6 * MiB:7 * MiB]
        await ops.release(rh)
        await trio.sleep(0.3)
        assert (await catalog.current("/f")).size == len(new)
        stale = [k for k in range(0, len(new), 4096) if model.pages[ino][k:k + 4096] != new[k:k + 4096]]
        assert not stale, f"pages holding other bytes than written: {len(stale)}, first at {stale[0]}"
        assert not early
        assert sum(r.hits for f in faulty for r in f.rules) > 0      # prefetches did land late


async def test_two_first_reads_at_once_open_one_reader(tmp_path: Path) -> None:
    """A handle opened while the file was being written here reads the version committed since: two
    reads at once (the kernel's readahead) open one reader for it, and the release closes it. Each
    opened one, and the reader of the first, replaced, stayed open with its pins (an audit's find)."""
    ctx = pyfuse3.RequestContext()
    data = os.urandom(4 * MiB)
    async with operations(tmp_path) as (ops, _):
        fi, attrs = await ops.create(pyfuse3.ROOT_INODE, b"f", 0o644, os.O_WRONLY | os.O_CREAT, ctx)
        rh = (await ops.open(attrs.st_ino, os.O_RDONLY, ctx)).fh         # while being written
        assert await ops.write(fi.fh, 0, data) == len(data)
        await ops.flush(fi.fh)
        await ops.release(fi.fh)
        got: dict[int, bytes] = {}

        async def read(off: int) -> None:
            got[off] = bytes(await ops.read(rh, off, 128 * 1024))
        async with trio.open_nursery() as n:
            for off in (0, 128 * 1024, 256 * 1024):
                n.start_soon(read, off)
        assert all(got[off] == data[off:off + 128 * 1024] for off in got)
        assert ops.sched.statistics().open_files == 1
        await ops.release(rh)
        await trio.sleep(0.1)
        assert ops.sched.statistics().open_files == 0
        assert ops.sched.cache.statistics().pinned == 0


async def _listed_again(ops: CpfsOperations) -> None:
    """The mount lists the stores again: an `ls` once `refresh` has passed."""
    await trio.sleep(ops.config.refresh)
    await ops.opendir(pyfuse3.ROOT_INODE, pyfuse3.RequestContext())


@pytest.mark.parametrize("inside", [False, True])
async def test_a_folder_replaced_by_a_file_in_another_mount_is_a_file_here(tmp_path: Path, inside: bool) -> None:
    """Mount A removes folder d (and the file in it) and saves a file d; mount B, which showed the
    folder, shows the file once it lists the stores again. It kept the empty folder for good (an
    audit's find), and wrote files into it that no other mount would show."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="staging-a", writer="aa") as (a, _), \
            operations(tmp_path, staging="staging-b", writer="bb") as (b, _):
        d = await a.mkdir(pyfuse3.ROOT_INODE, b"d", 0o755, ctx)
        if inside:
            await new_file(a, d.st_ino, b"x", b"1")
        await _listed_again(b)
        assert stat.S_ISDIR((await b.lookup(pyfuse3.ROOT_INODE, b"d", ctx)).st_mode)
        if inside:
            await a.unlink(d.st_ino, b"x", ctx)
        await a.rmdir(pyfuse3.ROOT_INODE, b"d", ctx)
        await new_file(a, pyfuse3.ROOT_INODE, b"d", b"now a file")
        await _listed_again(b)
        attrs = await b.lookup(pyfuse3.ROOT_INODE, b"d", ctx)
        assert stat.S_ISREG(attrs.st_mode) and attrs.st_size == len(b"now a file")


async def test_an_rmdir_of_a_folder_another_mount_replaced_by_a_file_removes_nothing(tmp_path: Path) -> None:
    """Before mount B lists the stores again, its rmdir of the folder that mount A replaced by a file
    answers ENOTDIR and leaves A's file; an unlink of a file replaced by a folder answers EISDIR. The
    rmdir once removed A's committed file."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="staging-a", writer="aa") as (a, catalog), \
            operations(tmp_path, staging="staging-b", writer="bb") as (b, _):
        await a.mkdir(pyfuse3.ROOT_INODE, b"d", 0o755, ctx)
        await new_file(a, pyfuse3.ROOT_INODE, b"f", b"a file")
        await _listed_again(b)
        await b.lookup(pyfuse3.ROOT_INODE, b"d", ctx)
        await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)
        await a.rmdir(pyfuse3.ROOT_INODE, b"d", ctx)
        await new_file(a, pyfuse3.ROOT_INODE, b"d", b"A's file")
        await a.unlink(pyfuse3.ROOT_INODE, b"f", ctx)
        await a.mkdir(pyfuse3.ROOT_INODE, b"f", 0o755, ctx)
        with pytest.raises(pyfuse3.FUSEError) as e:
            await b.rmdir(pyfuse3.ROOT_INODE, b"d", ctx)
        assert e.value.errno == errno.ENOTDIR
        with pytest.raises(pyfuse3.FUSEError) as e:
            await b.unlink(pyfuse3.ROOT_INODE, b"f", ctx)
        assert e.value.errno == errno.EISDIR
        assert (await catalog.current("/d")).size == len(b"A's file")
        assert (await catalog.current("/f")).directory


async def test_a_file_whose_stores_cannot_be_listed_stays_shown_and_is_never_said_absent(tmp_path: Path) -> None:
    """The stores that hold a file's manifests fail their listings (a burst of S3 503s, say) while
    another store answers: a mount that shows the file keeps it and reads it through its next
    listings, and a lookup that must ask the stores fails (EIO) rather than say there is no such file.
    A file whose stores did answer and that was removed elsewhere still goes. An audit found the
    first file dropped at the next listing: ENOENT for a checkpoint that was there. No spare: with one,
    each path's versions may sit on all three stores, and a listing needs two of them."""
    ctx = pyfuse3.RequestContext()
    faulty: list[FaultyStore] = []
    async with operations(tmp_path, faulty, extra="spares = 0") as (ops, catalog):
        names = [f.name for f in faulty]
        await new_file(ops, pyfuse3.ROOT_INODE, b"ckpt.pt", b"the last good checkpoint")
        holders = place(path_hash("/ckpt.pt"), names, 2)
        other = next(f"/gone-{i}.pt" for i in range(100) if set(place(path_hash(f"/gone-{i}.pt"), names, 2)) != set(holders))
        await new_file(ops, pyfuse3.ROOT_INODE, other[1:].encode(), b"removed elsewhere")
        rules = [(f, f.refuse("list", error=StoreError)) for f in faulty if f.name in holders]
        assert len(rules) == 2           # the third store answers: the listing as a whole succeeds
        await Catalog(catalog.pool, writer="cc").remove(other)
        for _ in range(2):
            await _listed_again(ops)
            attrs = await ops.lookup(pyfuse3.ROOT_INODE, b"ckpt.pt", ctx)
            fh = (await ops.open(attrs.st_ino, os.O_RDONLY, ctx)).fh
            assert bytes(await ops.read(fh, 0, 100)) == b"the last good checkpoint"
            await ops.release(fh)
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.lookup(pyfuse3.ROOT_INODE, other[1:].encode(), ctx)
        assert e.value.errno == errno.ENOENT
        with pytest.raises(StoreUnavailable, match="cannot list the versions of /ckpt.pt on enough stores"):
            await Catalog(catalog.pool, writer="cc").current("/ckpt.pt")
        for f, rule in rules:
            f.allow(rule)
        assert (await Catalog(catalog.pool, writer="cc").current("/ckpt.pt")).size == 24


async def test_a_file_the_kernel_forgot_lets_go_of_its_manifest_and_pushes(tmp_path: Path) -> None:
    """Every file version read in a mount kept a page-cache feeder, with its whole manifest, and its
    node the whole manifest too, for the life of the mount: an evaluator loading each step's
    checkpoint grew the daemon by megabytes per checkpoint. Once the kernel forgets an inode (its
    pages go with it), both go, the counts of what was pushed stay, and the next open reads the same
    bytes."""
    ctx = pyfuse3.RequestContext()
    data = {f"step_{i}.pt".encode(): os.urandom(3 * MiB) for i in range(4)}
    async with operations(tmp_path, staging="staging-a") as (ops, _):
        for name, d in data.items():
            await new_file(ops, pyfuse3.ROOT_INODE, name, d)
    model = PageCacheModel()
    async with operations(tmp_path, staging="staging-b", pusher=Pusher(threads=1, notify=model.notify)) as (ops, _):
        inos = {}
        for name, d in data.items():
            inos[name] = ino = (await ops.lookup(pyfuse3.ROOT_INODE, name, ctx)).st_ino
            fh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
            for off in range(0, len(d), MiB):
                assert await ops.read(fh, off, MiB) == d[off:off + MiB]
            await ops.release(fh)
        before = ops.sched.statistics()
        assert before.feeders == 4 and all(ops.ns.node(i).manifest is not None for i in inos.values())
        await ops.forget([(ino, 1) for ino in inos.values()])
        after = ops.sched.statistics()
        assert after.feeders == 0 and after.pushed == before.pushed
        assert all(ops.ns.node(i).manifest is None for i in inos.values())
        for name, d in data.items():
            fh = (await ops.open(inos[name], os.O_RDONLY, ctx)).fh
            for off in range(0, len(d), MiB):
                assert await ops.read(fh, off, MiB) == d[off:off + MiB]
            await ops.release(fh)
        assert ops.sched.statistics().feeders == 4


async def test_a_file_written_here_that_the_kernel_forgot_leaves_nothing_behind(tmp_path: Path) -> None:
    """A write here ties the file's page-cache pushes to the version its pages hold; once the kernel
    forgets the inode (its pages go with it) that tie goes too, and the next open pushes and reads the
    same bytes. It stayed for the life of the mount, one per file ever written (the soak audit)."""
    ctx = pyfuse3.RequestContext()
    data = {f"step_{i}.pt".encode(): os.urandom(2 * MiB) for i in range(3)}
    model = PageCacheModel()
    async with operations(tmp_path, pusher=Pusher(threads=1, notify=model.notify)) as (ops, _):
        inos = [(await new_file(ops, pyfuse3.ROOT_INODE, name, d)).st_ino for name, d in data.items()]
        assert ops.sched.statistics().written_files == 3
        await ops.forget([(ino, 1) for ino in inos])
        assert ops.sched.statistics().written_files == 0
        for ino, d in zip(inos, data.values()):
            fh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
            for off in range(0, len(d), MiB):
                assert await ops.read(fh, off, MiB) == d[off:off + MiB]
            await ops.release(fh)
        assert ops.sched.statistics().feeders == 3


async def test_a_forgotten_file_this_mount_committed_reads_again(tmp_path: Path) -> None:
    """A version committed by this mount (a save, a chmod, a rename) names no store key: dropping its
    manifest when the kernel forgot the inode made the next open fetch key '' and fail with EIO (CI
    caught it: a reader of a file saved by temporary name and renamed, while another thread chmods it).
    It keeps its manifest, and the next open reads the same bytes."""
    ctx = pyfuse3.RequestContext()
    data = os.urandom(3 * MiB)
    async with operations(tmp_path) as (ops, _):
        ino = (await new_file(ops, pyfuse3.ROOT_INODE, b"ckpt.tmp", data)).st_ino
        for what in ("save", "chmod", "rename"):
            if what == "chmod":
                await ops.setattr(ino, *change(mode=0o600), None, ctx)
            elif what == "rename":
                await ops.rename(pyfuse3.ROOT_INODE, b"ckpt.tmp", pyfuse3.ROOT_INODE, b"ckpt", 0, ctx)
            ino = (await ops.lookup(pyfuse3.ROOT_INODE, b"ckpt" if what == "rename" else b"ckpt.tmp", ctx)).st_ino
            fh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
            assert await ops.read(fh, 0, MiB) == data[:MiB]
            await ops.release(fh)
            await ops.forget([(ino, 1)])
            fh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
            assert await ops.read(fh, MiB, 2 * MiB) == data[MiB:], what
            await ops.release(fh)


async def test_an_fsync_through_a_read_only_descriptor_makes_the_writers_bytes_durable(tmp_path: Path) -> None:
    """fsync(2) of any descriptor of a file flushes the file, as on a local disk: a plain file being
    written through one handle is committed by an fsync through a read-only one (the writer still
    writing). It returned success and made nothing durable (an audit's find)."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path) as (ops, catalog):
        ino = (await new_file(ops, pyfuse3.ROOT_INODE, b"log.txt", b"line 1\n")).st_ino
        wh = (await ops.open(ino, os.O_WRONLY | os.O_APPEND, ctx)).fh
        assert await ops.write(wh, 7, b"line 2\n") == 7
        rh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
        await ops.fsync(rh, False)
        assert (await catalog.current("/log.txt")).size == 14
        await ops.release(rh)
        await ops.flush(wh)
        await ops.release(wh)
        assert (await catalog.current("/log.txt")).size == 14


@pytest.mark.parametrize("how", ["rmdir", "rename"])
async def test_a_new_name_in_a_folder_another_mount_removed_answers_enoent(tmp_path: Path, how: str) -> None:
    """Mount B holds folder d's inode; mount A removes or renames d; B lists the stores again and then
    creates a file, a folder and a symlink in d: ENOENT each, as a local filesystem answers for a
    folder removed under an open descriptor, and nothing is committed. It answered EIO (an audit's
    find: the retired folder raised a KeyError)."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="sa", writer="aa") as (a, catalog), \
            operations(tmp_path, staging="sb", writer="bb") as (b, _):
        await a.mkdir(pyfuse3.ROOT_INODE, b"d", 0o755, ctx)
        await _listed_again(b)
        d = (await b.lookup(pyfuse3.ROOT_INODE, b"d", ctx)).st_ino
        if how == "rmdir":
            await a.rmdir(pyfuse3.ROOT_INODE, b"d", ctx)
        else:
            await a.rename(pyfuse3.ROOT_INODE, b"d", pyfuse3.ROOT_INODE, b"e", 0, ctx)
        await _listed_again(b)
        for make in (lambda: b.create(d, b"x", 0o644, os.O_WRONLY | os.O_CREAT, ctx),
                     lambda: b.mkdir(d, b"y", 0o755, ctx), lambda: b.symlink(d, b"z", b"x", ctx)):
            with pytest.raises(pyfuse3.FUSEError) as e:
                await make()
            assert e.value.errno == errno.ENOENT
        for path in ("/d/x", "/d/y", "/d/z", "/e/x", "/e/y", "/e/z"):
            with pytest.raises(NotFound):
                await catalog.current(path)


async def test_a_save_into_a_folder_another_mount_replaced_by_a_file_fails_and_says_so(tmp_path: Path) -> None:
    """Mount B saves d/x while mount A removes folder d and saves a file d. B's close fails (ENOTDIR)
    and nothing is committed under d; A's file d stays. The close succeeded and committed d/x below
    the file d, where no listing of any mount showed it: a checkpoint said saved and not there (an
    audit's find). A save into a folder that is still one (d2) commits as ever."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="sa", writer="aa") as (a, catalog), \
            operations(tmp_path, staging="sb", writer="bb") as (b, _):
        await a.mkdir(pyfuse3.ROOT_INODE, b"d", 0o755, ctx)
        await a.mkdir(pyfuse3.ROOT_INODE, b"d2", 0o755, ctx)
        await _listed_again(b)
        handles = []
        for folder in (b"d", b"d2"):
            d = (await b.lookup(pyfuse3.ROOT_INODE, folder, ctx)).st_ino
            fi, _ = await b.create(d, b"x", 0o644, os.O_WRONLY | os.O_CREAT, ctx)
            assert await b.write(fi.fh, 0, b"the checkpoint") == 14
            handles.append(fi.fh)
        await a.rmdir(pyfuse3.ROOT_INODE, b"d", ctx)
        await new_file(a, pyfuse3.ROOT_INODE, b"d", b"a file now")
        with pytest.raises(pyfuse3.FUSEError) as e:
            await b.flush(handles[0])
        assert e.value.errno == errno.ENOTDIR
        await b.release(handles[0])
        await b.flush(handles[1])
        await b.release(handles[1])
        with pytest.raises(NotFound):
            await catalog.current("/d/x")
        assert (await catalog.current("/d")).size == len(b"a file now")
        assert (await catalog.current("/d2/x")).size == 14


@pytest.mark.parametrize("what", ["folder renamed", "folder removed", "file renamed", "file removed", "file saved"])
async def test_a_save_whose_file_or_folder_another_mount_moved_fails_and_keeps_its_bytes(tmp_path: Path,
                                                                                        what: str) -> None:
    """Mount B has d/f open for writing (a shard of a checkpoint, a log appended to) when mount A renames
    or removes folder d, or the file itself. B's close fails with ESTALE, commits nothing under the old
    name, and keeps its bytes as a failed version of it (`cpfs log`, `cpfs restore`). It succeeded and
    brought the old name back: d/f alone in a folder d thought gone, and the renamed folder without the
    shard (an audit's find, with rsync-like tools and two mounts). Another mount's newer save of the
    file is no removal: the last close wins, as before."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="sa", writer="aa") as (a, catalog), \
            operations(tmp_path, staging="sb", writer="bb") as (b, _):
        d = await a.mkdir(pyfuse3.ROOT_INODE, b"d", 0o755, ctx)
        await new_file(a, d.st_ino, b"f", b"first lines\n")
        await _listed_again(b)
        bd = (await b.lookup(pyfuse3.ROOT_INODE, b"d", ctx)).st_ino
        fh = (await b.open((await b.lookup(bd, b"f", ctx)).st_ino, os.O_WRONLY, ctx)).fh
        assert await b.write(fh, 12, b"B's lines\n") == 10
        if what == "folder renamed":
            await a.rename(pyfuse3.ROOT_INODE, b"d", pyfuse3.ROOT_INODE, b"e", 0, ctx)
        elif what == "folder removed":
            await a.unlink(d.st_ino, b"f", ctx)
            await a.rmdir(pyfuse3.ROOT_INODE, b"d", ctx)
        elif what == "file renamed":
            await a.rename(d.st_ino, b"f", d.st_ino, b"f.1", 0, ctx)
        elif what == "file removed":
            await a.unlink(d.st_ino, b"f", ctx)
        else:
            await a.release(await save(a, (await a.lookup(d.st_ino, b"f", ctx)).st_ino, b"A's save"))
        if what == "file saved":
            await b.flush(fh)
            await b.release(fh)
            m = await catalog.get("/d/f")
            assert await catalog.pool.fetch_chunk(m.chunks[0], "/d/f") == b"first lines\nB's lines\n"
            return
        with pytest.raises(pyfuse3.FUSEError) as e:
            await b.flush(fh)
        assert e.value.errno == errno.ESTALE
        await b.release(fh)
        with pytest.raises(NotFound):
            await catalog.current("/d/f")
        if what == "folder removed":
            with pytest.raises(NotFound):
                await catalog.current("/d")
        [kept] = [i for i in await catalog.history("/d/f") if i.ref.state == "failed"]
        m = await catalog.get_version("/d/f", kept.ref.version)
        assert await catalog.pool.fetch_chunk(m.chunks[0], "/d/f") == b"first lines\nB's lines\n"
        moved = {"folder renamed": "/e/f", "file renamed": "/d/f.1"}.get(what)
        if moved:
            m = await catalog.get(moved)
            assert await catalog.pool.fetch_chunk(m.chunks[0], moved) == b"first lines\n"


async def test_a_file_another_mount_removed_opens_no_more(tmp_path: Path) -> None:
    """Mount B looked f up; mount A removes it. B's next open (a `refresh` after the lookup, which
    checked too) answers ESTALE (the kernel looks the name up again) and the lookup ENOENT, before any
    listing, as NFS does. The open went on reading the
    removed version until B listed the stores again (an audit's find)."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="sa", writer="aa") as (a, _), \
            operations(tmp_path, staging="sb", writer="bb") as (b, _):
        await new_file(a, pyfuse3.ROOT_INODE, b"f", b"removed elsewhere")
        await _listed_again(b)
        ino = (await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino
        await a.unlink(pyfuse3.ROOT_INODE, b"f", ctx)
        await trio.sleep(b.config.refresh)      # the lookup checked f: the next check is a refresh later
        with pytest.raises(pyfuse3.FUSEError) as e:
            await b.open(ino, os.O_RDONLY, ctx)
        assert e.value.errno == errno.ESTALE
        with pytest.raises(pyfuse3.FUSEError) as e:
            await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)
        assert e.value.errno == errno.ENOENT


async def test_a_symlink_another_mount_replaced_resolves_to_its_new_target(tmp_path: Path) -> None:
    """`latest -> step_1`, replaced by mount A with `latest -> step_2` (a symlink renamed over it, as
    trainers do): mount B, which resolved `latest` before, resolves it to step_2 once `refresh` has
    passed, without listing the stores. It kept step_1 until a listing (an audit's find), so a job
    restarted on B loaded the checkpoint before."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="sa", writer="aa") as (a, _), \
            operations(tmp_path, staging="sb", writer="bb") as (b, _):
        await a.symlink(pyfuse3.ROOT_INODE, b"latest", b"step_1", ctx)
        await _listed_again(b)
        ino = (await b.lookup(pyfuse3.ROOT_INODE, b"latest", ctx)).st_ino
        assert await b.readlink(ino, ctx) == b"step_1"
        await a.symlink(pyfuse3.ROOT_INODE, b"latest.tmp", b"step_2", ctx)
        await a.rename(pyfuse3.ROOT_INODE, b"latest.tmp", pyfuse3.ROOT_INODE, b"latest", 0, ctx)
        await trio.sleep(b.config.refresh)
        ino = (await b.lookup(pyfuse3.ROOT_INODE, b"latest", ctx)).st_ino
        assert await b.readlink(ino, ctx) == b"step_2"
        await a.unlink(pyfuse3.ROOT_INODE, b"latest", ctx)
        await trio.sleep(b.config.refresh)
        with pytest.raises(pyfuse3.FUSEError) as e:
            await b.lookup(pyfuse3.ROOT_INODE, b"latest", ctx)
        assert e.value.errno == errno.ENOENT


async def test_a_file_another_mount_saved_again_looks_up_as_its_new_version(tmp_path: Path) -> None:
    """Mount B's kernel asks for a name again once its entry expires (`entry_timeout`): B answers with
    the version committed since, once `refresh` has passed, without a listing. It answered with the
    version it first listed until an open or a listing, so a watcher polling stat for a new save (size,
    mtime) on another node saw none (the failover-reload audit's find)."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="sa", writer="aa") as (a, _), \
            operations(tmp_path, staging="sb", writer="bb") as (b, _):
        await new_file(a, pyfuse3.ROOT_INODE, b"f", b"version one")
        await _listed_again(b)
        first = await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)
        assert first.st_size == len(b"version one")
        await a.release(await save(a, (await a.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino, b"version two, longer"))
        await trio.sleep(b.config.refresh)
        again = await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)
        assert again.st_ino != first.st_ino and again.st_size == len(b"version two, longer")
        assert (await b.getattr(first.st_ino, ctx)).st_size == len(b"version one")   # its handles' version


async def test_versions_a_mount_listed_but_the_kernel_never_looked_up_are_not_kept(tmp_path: Path) -> None:
    """Each newer version a listing finds gets a new inode and retires the old one until the kernel
    forgets it; an inode the kernel never had gets no forget, and such nodes piled up in a mount that
    watches another's busy files (the soak audit: 6,200 an hour). One the kernel had is kept."""
    ctx = pyfuse3.RequestContext()

    def retired() -> int:
        return json.loads(b.statistics_document())["mount"]["retired"]

    async with operations(tmp_path, staging="sa", writer="aa") as (a, _), \
            operations(tmp_path, staging="sb", writer="bb") as (b, _):
        ino = (await new_file(a, pyfuse3.ROOT_INODE, b"f", b"version 0")).st_ino
        for n in range(1, 6):
            await a.release(await save(a, ino, f"version {n}".encode()))
            await _listed_again(b)
        assert retired() == 0
        await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)             # the kernel has this one
        await a.release(await save(a, ino, b"version 6"))
        await _listed_again(b)
        assert retired() == 1


async def test_a_rename_over_a_name_that_lands_during_a_listing_leaves_the_name_listed(tmp_path: Path) -> None:
    """`x.tmp` renamed over `x` in mount A (keep_versions 1) between another catalog's listing of the
    transaction records and its listing of the manifests: the new `x` is in a transaction that listing
    does not count, and A retired the old `x`. The listing is made again and shows `x`; it left `x` out
    (the busy commits audit: mounts dropped it from their listings, as for a removal)."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="sa", writer="aa", extra="keep_versions = 1") as (a, _):
        await new_file(a, pyfuse3.ROOT_INODE, b"x", b"version 1")
        config = load_config(write_config(tmp_path, chunk_size="1MiB", extra="keep_versions = 1"))
        wrappers = [FaultyStore(open_store(s)) for s in config.stores]
        reader = Catalog(StorePool(config, stores=wrappers), writer="bb")
        release, reached = trio.Event(), trio.Event()
        for w in wrappers:
            w.hold("list", "manifests/", until=release, reached=reached)
        got = {}

        async def listing() -> None:
            got["snapshot"] = await reader.load_all()

        async with trio.open_nursery() as n:
            n.start_soon(listing)
            await reached.wait()                # the records are listed; the manifests wait
            await new_file(a, pyfuse3.ROOT_INODE, b"x.tmp", b"version 2")
            await a.rename(pyfuse3.ROOT_INODE, b"x.tmp", pyfuse3.ROOT_INODE, b"x", 0, ctx)
            release.set()
        assert sorted(got["snapshot"]) == ["/x"]
        assert got["snapshot"]["/x"].size == len(b"version 2")


@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_RDWR])
async def test_an_open_of_a_version_retired_since_its_lookup_answers_estale_not_eio(tmp_path: Path,
                                                                                  flags: int) -> None:
    """Mount A commits f several times a second with keep_versions 1; mount B looked f up a moment ago
    (within `refresh`), and A's saves since retired that version. B's open answers ESTALE (the kernel
    looks the name up again) and the retried lookup opens the newest version. It answered EIO until
    B's next check (the busy commits audit), for reads and for writes without O_TRUNC alike."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, staging="sa", writer="aa", extra="keep_versions = 1") as (a, _), \
            operations(tmp_path, staging="sb", writer="bb", extra="keep_versions = 1") as (b, _):
        await new_file(a, pyfuse3.ROOT_INODE, b"f", b"version 1")
        await _listed_again(b)
        old = (await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino
        ino = (await a.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino
        for n in (2, 3):
            await a.release(await save(a, ino, f"version {n}".encode()))
        with pytest.raises(pyfuse3.FUSEError) as e:
            await b.open(old, flags, ctx)
        assert e.value.errno == errno.ESTALE
        new = (await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino
        fh = (await b.open(new, os.O_RDONLY, ctx)).fh
        try:
            assert await b.read(fh, 0, 100) == b"version 3"
        finally:
            await b.release(fh)


@pytest.mark.parametrize("op", ["chmod", "touch", "truncate", "rename", "link", "setxattr"])
async def test_a_change_in_a_mount_that_has_not_seen_anothers_save_keeps_that_save(tmp_path: Path, op: str) -> None:
    """Mount A saves f twice; B, which looked f up before the second save and has not listed since,
    changes f (chmod, utimensat, truncate, rename, link, setxattr). The change applies to A's newer
    version: every mount then reads A's second save. Made from the version B showed, it was committed
    over the newer one, and every mount read the first save again (an audit's find)."""
    ctx = pyfuse3.RequestContext()
    newer = b"VERSION TWO, newer"
    async with operations(tmp_path, staging="sa", writer="aa") as (a, catalog), \
            operations(tmp_path, staging="sb", writer="bb") as (b, _):
        await new_file(a, pyfuse3.ROOT_INODE, b"f", b"version one")
        await _listed_again(b)
        ino = (await b.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino
        await a.release(await save(a, (await a.lookup(pyfuse3.ROOT_INODE, b"f", ctx)).st_ino, newer))
        path, size = "/f", len(newer)
        if op in ("chmod", "touch", "truncate"):
            attr = pyfuse3.EntryAttributes()
            attr.st_mode, attr.st_mtime_ns, attr.st_size = stat.S_IFREG | 0o600, 1, 7
            fields = SimpleNamespace(update_size=op == "truncate", update_mode=op == "chmod", update_uid=False,
                                     update_gid=False, update_atime=False, update_mtime=op == "touch",
                                     update_ctime=False)
            await b.setattr(ino, attr, fields, None, ctx)
            size = 7 if op == "truncate" else size
        elif op == "rename":
            await b.rename(pyfuse3.ROOT_INODE, b"f", pyfuse3.ROOT_INODE, b"g", 0, ctx)
            path = "/g"
        elif op == "link":
            await b.link(ino, pyfuse3.ROOT_INODE, b"h", ctx)
            path = "/h"
        else:
            await b.setxattr(ino, b"user.k", b"v", ctx)
        m = await catalog.get(path)
        assert m.size == size and await catalog.pool.fetch_chunk(m.chunks[0], path) == newer[:size]
        if op == "chmod":
            assert stat.S_IMODE(m.mode) == 0o600


async def test_refreshes_are_spaced_by_how_long_the_last_one_took(tmp_path: Path) -> None:
    """Every `ls` (opendir) re-reads the manifests at most every `refresh`; a listing of the stores
    that takes long (tens of thousands of names: seconds) spaces the next one by 3x its time, so that
    a tree walk (`rm -rf`, `find`) does not spend most of its time listing. Stores at 150 ms a request
    and refresh 0.05 s: ~0.35 s per listing, so at most 2-3 listings in 2 s (every 0.4 s without the
    spacing: 5). A name another mount commits is still found by its lookup at once."""
    ctx = pyfuse3.RequestContext()
    async with operations(tmp_path, extra='[mount]\nrefresh = "0.05s"', store_extra='latency = "150ms"') \
            as (ops, catalog):
        before = catalog.statistics().listings
        await catalog.load_all()
        per_refresh = catalog.statistics().listings - before      # the listings of one refresh
        before = catalog.statistics().listings
        end = trio.current_time() + 2.0
        while trio.current_time() < end:
            await ops.opendir(pyfuse3.ROOT_INODE, ctx)
            await trio.sleep(0.01)
        refreshes = (catalog.statistics().listings - before) / per_refresh
        assert 1 <= refreshes <= 3, refreshes
        other = Catalog(catalog.pool, writer="bb")
        await commit_bytes(other, "/new.pt", b"committed elsewhere")
        attrs = await ops.lookup(pyfuse3.ROOT_INODE, b"new.pt", ctx)
        assert attrs.st_size == len(b"committed elsewhere")
