"""The write path's file layer: WriteSession against real directory stores, without FUSE."""
from __future__ import annotations

import argparse
import errno
import io
import os
import random
import zipfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import trio

from conftest import write_config
from cpfs.catalog import Catalog
from cpfs.chunking import LEAD
from cpfs.config import Config, load_config
from cpfs.errors import CpfsError, NotFound, StoreError, StoreFull
from cpfs.importer import Importer
from cpfs.manifest import Manifest
from cpfs.pool import StorePool
from cpfs.store import FaultyStore, open_store
from cpfs.tensor_index import TensorIndex, build_index
from cpfs.chunk import chunk_hash
from cpfs.upload import encode_span, zero_chunk
from cpfs.writer import StagingError, WriteSession

MiB = 1024 * 1024


@dataclass
class Env:
    config: Config
    pool: StorePool
    catalog: Catalog
    staging: Path
    stores: Path


async def make_env(folder: Path, **kw) -> Env:
    config = load_config(write_config(folder, **kw))
    pool = StorePool(config)
    await pool.check()
    return Env(config, pool, Catalog(pool), folder / "staging", folder / "stores")


@pytest.fixture
async def env(tmp_path: Path) -> Env:
    return await make_env(tmp_path / "cpfs")


@asynccontextmanager
async def open_session(env: Env, path: str, **kw) -> AsyncIterator[WriteSession]:
    async with trio.open_nursery() as nursery:
        session = WriteSession(env.pool, env.catalog, path, staging_dir=env.staging, nursery=nursery, **kw)
        try:
            yield session
        finally:
            await session.aclose()


class SessionFile(io.RawIOBase):
    """A file object over a WriteSession, for writers running in a worker thread (torch.save, zipfile)."""

    def __init__(self, session: WriteSession) -> None:
        self.session = session
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = trio.from_thread.run(self.session.write, self.pos, bytes(data))
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos,
                io.SEEK_END: trio.from_thread.run_sync(lambda: self.session.size)}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


async def save_into(session: WriteSession, save) -> None:
    """Run `save(file)` in a thread, writing through the session as an application would."""
    await trio.to_thread.run_sync(lambda: save(SessionFile(session)))


async def stored_bytes(pool: StorePool, manifest: Manifest) -> bytes:
    """The committed content, read back from the stores."""
    parts = [await pool.fetch_chunk(c, f"test chunk {i}") for i, c in enumerate(manifest.chunks)]
    data = b"".join(parts)
    assert len(data) == manifest.size
    return data


async def until(session: WriteSession, condition: Callable[[], bool]) -> None:
    """Wait for the session's write-behind to get there. The bound guards against a hang, not speed:
    the stores' fsyncs wait on a disk that the rest of a busy suite shares (ext4 makes an fsync also
    write out other files' dirty data), and 20 s was once not enough in CI."""
    with trio.move_on_after(120):
        while not condition():
            await trio.sleep(0.01)
    assert condition(), session.statistics()


def staged_bytes(path: Path) -> int:
    """The bytes a staging file holds: its data ranges, found with SEEK_DATA/SEEK_HOLE. st_blocks would
    also count the filesystem's own blocks (an extent tree, preallocation) and flake at an exact bound."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size, offset, held = os.fstat(fd).st_size, 0, 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as e:       # ENXIO: only a hole is left
                if e.errno == errno.ENXIO:
                    break
                raise
            offset = os.lseek(fd, start, os.SEEK_HOLE)
            held += offset - start
        return held
    finally:
        os.close(fd)


async def commit_bytes(env: Env, path: str, data: bytes) -> Manifest:
    async with open_session(env, path) as s:
        await s.write(0, data)
        return await s.flush()


def model(layers: int, width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-like state dict: per layer ~12*width^2 floats, plus small norms and biases."""
    g = torch.Generator().manual_seed(seed)
    sd = {"embed.weight": torch.randn(16 * width, width, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = torch.randn(3 * width, width, generator=g)
        sd[p + "attn.qkv.bias"] = torch.randn(3 * width, generator=g)
        sd[p + "attn.proj.weight"] = torch.randn(width, width, generator=g)
        sd[p + "norm1.weight"] = torch.ones(width)
        sd[p + "mlp.fc1.weight"] = torch.randn(4 * width, width, generator=g)
        sd[p + "mlp.fc2.weight"] = torch.randn(width, 4 * width, generator=g)
        sd[p + "norm2.weight"] = torch.ones(width)
    return sd


# ---------------------------------------------------------------- round trips

async def test_torch_save_round_trips_and_cuts_like_the_importer(env: Env, tmp_path: Path) -> None:
    sd = model(layers=3, width=192)
    async with open_session(env, "/run1/step_100.pt") as s:
        await save_into(s, lambda f: torch.save(sd, f))
        staged = await s.read(0, s.size)
        m = await s.flush()
        assert await s.read(0, s.size) == staged
    assert m.size == len(staged) and m.tensor_index is not None
    assert m.tensor_index["format"] == "torch-zip"
    data = await stored_bytes(env.pool, m)
    assert data == staged
    loaded = torch.load(io.BytesIO(data))
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert (await env.catalog.get("/run1/step_100.pt")).version == m.version

    # The same bytes imported with `cpfs put` give the same chunks: writes and imports dedup together.
    copy = tmp_path / "copy.pt"
    copy.write_bytes(staged)
    imported = await Importer(env.pool, env.catalog).put_file(copy, "/imported.pt")
    assert [c.digest for c in imported.chunks] == [c.digest for c in m.chunks]
    # ... including the small first chunk of every big record (chunking.LEAD), which the scanner has to
    # predict while the bytes arrive.
    big = [r for r in TensorIndex.from_json(m.tensor_index).records if r.length >= env.config.chunk_size // 8]
    assert len(big) >= 10 and {r.offset + LEAD for r in big} <= set(m.offsets)


async def test_torch_zip_without_index_cuts_like_the_importer(env: Env, tmp_path: Path) -> None:
    """A pickle global the indexer rejects leaves no tensor index: put and the mount still cut alike."""
    sd = {**model(layers=3, width=192), "args": argparse.Namespace(lr=0.1, steps=100)}
    async with open_session(env, "/run1/with_args.pt") as s:
        await save_into(s, lambda f: torch.save(sd, f))
        staged = await s.read(0, s.size)
        m = await s.flush()
    assert m.tensor_index is None and build_index(lambda off, n: staged[off:off + n], len(staged)) is None
    assert len(m.chunks) > len(staged) // env.config.chunk_size + 1  # cut on zip members, not fixed-size

    copy = tmp_path / "with_args.pt"
    copy.write_bytes(staged)
    imported = await Importer(env.pool, env.catalog).put_file(copy, "/imported_with_args.pt")
    assert imported.tensor_index is None
    assert [c.digest for c in imported.chunks] == [c.digest for c in m.chunks]


@pytest.mark.parametrize("writer", ["zipfile", "numpy.savez"])
async def test_writers_that_seek_back_round_trip(env: Env, writer: str) -> None:
    arrays = {f"a{i}": np.random.default_rng(i).standard_normal(40_000 * (i + 1)) for i in range(4)}

    def save(f) -> None:
        if writer == "numpy.savez":
            np.savez(f, **arrays)
            return
        with zipfile.ZipFile(f, "w") as z:
            for name, a in arrays.items():
                z.writestr(name, a.tobytes(), compress_type=zipfile.ZIP_STORED)
            z.writestr("notes.txt", b"checkpoint " * 50_000, compress_type=zipfile.ZIP_DEFLATED)
            with z.open("streamed.bin", "w") as member:  # its header is patched after the data
                member.write(os.urandom(300_000))

    async with open_session(env, f"/{writer}.zip") as s:
        await save_into(s, save)
        staged = await s.read(0, s.size)
        m = await s.flush()
    data = await stored_bytes(env.pool, m)
    assert data == staged
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None
    if writer == "numpy.savez":
        loaded = np.load(io.BytesIO(data))
        assert all(np.array_equal(loaded[k], v) for k, v in arrays.items())


async def test_safetensors_round_trip_with_index(env: Env) -> None:
    sd = {k: v for k, v in model(layers=2, width=128).items()}
    blob = safetensors.torch.save(sd)
    async with open_session(env, "/model.safetensors") as s:
        for off in range(0, len(blob), 128 * 1024):  # as the kernel would hand it over
            await s.write(off, blob[off:off + 128 * 1024])
        m = await s.flush()
        stats = s.statistics()
    assert await stored_bytes(env.pool, m) == blob
    assert m.tensor_index is not None and m.tensor_index["format"] == "safetensors"
    assert stats.chunks_discarded == 0  # write-behind predicted the final layout


# ---------------------------------------------------------------- write-behind

async def test_chunks_upload_while_writing_with_bounded_memory(tmp_path: Path) -> None:
    env = await make_env(tmp_path / "cpfs", extra="[readahead]\nconcurrency = 4")
    data = os.urandom(32 * MiB)
    step = 128 * 1024
    async with open_session(env, "/big.bin") as s:
        for off in range(0, 16 * MiB, step):
            await s.write(off, data[off:off + step])
        # uploads start while the file is still being written
        await until(s, lambda: s.statistics().chunks_streamed > 0)
        for off in range(16 * MiB, len(data), step):
            await s.write(off, data[off:off + step])
        await until(s, lambda: s.statistics().chunks_streamed >= 32)
        before_flush = s.statistics()
        m = await s.flush()
        after = s.statistics()
    print(f"\nwrite-behind: {before_flush.chunks_streamed}/32 chunks stored before flush, "
          f"peak buffered {after.peak_buffered_bytes / MiB:.1f} MiB")
    assert before_flush.chunks_uploaded == 32 and before_flush.commits == 0
    assert after.chunks_uploaded == 32 and after.chunks_reused == 32 and after.chunks_discarded == 0
    assert after.peak_buffered_bytes <= env.config.fetch_concurrency * 2 * (env.config.chunk_size + 64)
    assert await stored_bytes(env.pool, m) == data


async def test_stored_records_leave_the_staging_file_and_come_back_when_needed(env: Env) -> None:
    """Write-behind drops the stored chunks inside finished tensor records from the staging file, which
    then holds about a record, not the checkpoint; a change or a read of those bytes copies them back
    from the stores, and the commit is the bytes written."""
    buf = io.BytesIO()
    torch.save(model(layers=4, width=256), buf)
    data = bytearray(buf.getvalue())
    index = build_index(lambda off, n: bytes(data[off:off + n]), len(data))
    record = max((r for r in index.records if r.offset > len(data) // 2), key=lambda r: r.length)  # ~2 MiB
    async with open_session(env, "/ckpt.pt") as s:
        step, written, rng = 256 * 1024, 0, random.Random(5)

        async def reader() -> None:   # reads of written bytes while chunks are being dropped
            while written < len(data) // 2:
                w = written
                off = rng.randrange(0, max(1, w))
                n = rng.choice([100, 5000, 300_000])
                got = await s.read(off, n)    # a write in flight may have added bytes past `w`
                assert got == bytes(data[off:off + len(got)]) and len(got) >= min(n, w - off)
                await trio.sleep(0)

        async with trio.open_nursery() as n:
            n.start_soon(reader)
            for off in range(0, len(data), step):
                await s.write(off, bytes(data[off:off + step]))
                written = min(len(data), off + step)
                await trio.sleep(0.005)
        # what the reader copied back stays
        await until(s, lambda: staged_bytes(s.staging_path)
                    <= len(data) // 4 + s.statistics().dropped_fetched * MiB)
        dropped = s.statistics().chunks_dropped
        assert dropped >= 10
        refetched = s.statistics().dropped_fetched        # by the reader

        middle = record.offset + record.length // 2
        await s.write(middle, b"patched")                # a partial change: its chunk comes back first
        data[middle:middle + 7] = b"patched"
        assert s.statistics().dropped_fetched == refetched + 1
        m = await s.flush()
        assert await stored_bytes(env.pool, m) == bytes(data)
        assert await s.read(0, len(data)) == bytes(data)  # every dropped chunk read back
        stats = s.statistics()
    assert stats.dropped_fetched == stats.chunks_dropped >= dropped and m.tensor_index is not None
    assert refetched > 0          # the reader did read dropped chunks back
    assert stats.chunks_uploaded == len(m.chunks) + 1     # the patched chunk twice, nothing else again


async def test_a_file_that_is_no_checkpoint_leaves_staging_as_it_is_stored(env: Env) -> None:
    """Any other file (a dataset shard, a copied binary): nothing reads it at commit, so every stored
    chunk but the first leaves the staging file."""
    data = os.urandom(12 * MiB)
    async with open_session(env, "/shard.bin") as s:
        for off in range(0, len(data), 256 * 1024):
            await s.write(off, data[off:off + 256 * 1024])
        await until(s, lambda: staged_bytes(s.staging_path) <= 2 * MiB)
        m = await s.flush()
        assert await s.read(5 * MiB - 3, 10) == data[5 * MiB - 3:5 * MiB + 7]
        stats = s.statistics()
    assert await stored_bytes(env.pool, m) == data
    assert stats.chunks_dropped >= 10 and stats.dropped_fetched == 2


async def test_uploads_that_end_while_write_behind_is_busy_are_not_missed(tmp_path: Path) -> None:
    """Uploads released together end while write-behind drops the first ones from staging; each end
    must still reach it. It once slept through them until the next write (or flush), so the staging
    file kept their bytes."""
    config = load_config(write_config(tmp_path / "cpfs"))
    for round_ in range(5):
        gate = trio.Event()
        stores = [FaultyStore(open_store(s)) for s in config.stores]
        for store in stores:
            store.hold("put", "*", gate)             # the test decides when a batch of uploads ends
        pool = StorePool(config, stores)
        await pool.check()
        env = Env(config, pool, Catalog(pool), tmp_path / "cpfs" / "staging", tmp_path / "cpfs" / "stores")
        data = os.urandom(12 * MiB)
        async with open_session(env, f"/shard{round_}.bin") as s:
            await s.write(0, data)
            await until(s, lambda: s.statistics().uploads_in_flight >= 8)
            gate.set()
            await until(s, lambda: s.statistics().chunks_streamed == 12)
            await until(s, lambda: staged_bytes(s.staging_path) <= MiB)   # it takes milliseconds
            assert staged_bytes(s.staging_path) == MiB    # the first chunk stays
            m = await s.flush()
        assert await stored_bytes(env.pool, m) == data


async def test_out_of_order_writes_are_staged_and_streamed(env: Env) -> None:
    data = os.urandom(8 * MiB)
    blocks = list(range(0, len(data), 256 * 1024))
    random.Random(3).shuffle(blocks)
    async with open_session(env, "/shuffled.bin") as s:
        async with trio.open_nursery() as n:  # concurrent, as FUSE handlers may run
            for off in blocks:
                n.start_soon(s.write, off, data[off:off + 256 * 1024])
        await until(s, lambda: s.statistics().chunks_streamed >= 8)
        m = await s.flush()
    assert await stored_bytes(env.pool, m) == data


async def test_rewrite_after_upload_is_reencoded_at_flush(env: Env) -> None:
    data = bytearray(os.urandom(4 * MiB))
    async with open_session(env, "/rewritten.bin") as s:
        await s.write(0, bytes(data))
        await until(s, lambda: s.statistics().chunks_streamed >= 4)
        await s.write(MiB + 5, b"patched")
        data[MiB + 5:MiB + 12] = b"patched"
        m = await s.flush()
        stats = s.statistics()
    assert await stored_bytes(env.pool, m) == bytes(data)
    assert stats.chunks_discarded == 1 and stats.chunks_uploaded == 5


# ---------------------------------------------------------------- failures

async def test_store_full_fails_flush_and_keeps_the_committed_version(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path / "cpfs"))
    stores = [FaultyStore(open_store(s)) for s in config.stores]
    pool = StorePool(config, stores)
    await pool.check()
    env = Env(config, pool, Catalog(pool), tmp_path / "cpfs" / "staging", tmp_path / "cpfs" / "stores")
    v1 = await commit_bytes(env, "/ckpt.pt", os.urandom(2 * MiB))
    async with open_session(env, "/ckpt.pt") as s:
        for store in stores:
            store.refuse("put", "*", StoreFull)        # a disk filling up
        await s.write(0, os.urandom(3 * MiB))
        with pytest.raises(StoreFull) as failure:
            await s.flush()
        assert failure.value.errno == errno.ENOSPC
    for store in stores:
        store.allow()
    assert (await env.catalog.get("/ckpt.pt")).version == v1.version


async def test_stores_vanishing_mid_write_fail_flush_and_a_retry_commits(env: Env, caplog) -> None:
    v1 = await commit_bytes(env, "/run/ckpt.pt", b"old version")
    data = os.urandom(6 * MiB)
    broken = [env.stores / "s0", env.stores / "s1"]
    async with open_session(env, "/run/ckpt.pt") as s:
        await s.write(0, data[:2 * MiB])
        for folder in broken:  # two of three stores vanish: no chunk can reach 2 replicas
            folder.rename(folder.with_suffix(".away"))
            folder.write_bytes(b"")
        await s.write(2 * MiB, data[2 * MiB:])
        with pytest.raises(StoreError) as failure:
            await s.flush()
        assert failure.value.errno == errno.EIO
        assert "flush failed, the last committed version stays current" in caplog.text
        for folder in broken:
            folder.unlink()
            folder.with_suffix(".away").rename(folder)
        await env.pool.check()  # the stores are back (a daemon's pool.run() probes them as well)
        assert (await env.catalog.get("/run/ckpt.pt")).version == v1.version
        m = await s.flush()  # nothing written was lost: the retry commits it all
    assert await stored_bytes(env.pool, m) == data
    assert (await env.catalog.get("/run/ckpt.pt")).version == m.version


async def test_abort_commits_nothing(env: Env) -> None:
    async with trio.open_nursery() as n:
        s = WriteSession(env.pool, env.catalog, "/aborted.pt", staging_dir=env.staging, nursery=n)
        await s.write(0, os.urandom(3 * MiB))
        await s.abort()
        with pytest.raises(StagingError) as closed:
            await s.write(0, b"more")
        assert closed.value.errno == errno.EBADF
    with pytest.raises(NotFound):
        await env.catalog.get("/aborted.pt")
    assert list(env.staging.iterdir()) == []


# ---------------------------------------------------------------- base versions, truncate, sizes

async def test_open_without_truncate_overwrites_in_place(env: Env) -> None:
    old = os.urandom(3 * MiB + MiB // 2)
    v1 = await commit_bytes(env, "/model.bin", old)
    fetched: list[int] = []

    async def fetch(i: int) -> bytes:
        fetched.append(i)
        return await env.pool.fetch_chunk(v1.chunks[i], f"test base chunk {i}")

    async with open_session(env, "/model.bin", base=v1, fetch=fetch) as s:
        assert s.size == len(old)
        assert await s.read(MiB - 10, 20) == old[MiB - 10:MiB + 10]  # reads the base through
        await s.write(MiB + MiB // 2, b"X" * 100)
        m = await s.flush()
        stats = s.statistics()
    expected = old[:MiB + MiB // 2] + b"X" * 100 + old[MiB + MiB // 2 + 100:]
    assert await stored_bytes(env.pool, m) == expected
    assert sorted(set(fetched)) == [0, 1]     # read of chunks 0-1; the write needed chunk 1 only
    assert stats.chunks_uploaded == 1 and stats.chunks_reused == 3
    assert [c.digest for i, c in enumerate(m.chunks) if i != 1] == \
           [c.digest for i, c in enumerate(v1.chunks) if i != 1]


async def test_truncate_shrink_grow_and_sparse_writes(env: Env) -> None:
    data = os.urandom(3 * MiB)
    async with open_session(env, "/t.bin") as s:
        await s.write(0, data)
        await s.truncate(MiB + 1000)
        await s.truncate(2 * MiB + 5)
        assert s.size == 2 * MiB + 5
        await s.write(4 * MiB, b"tail")  # past the end: a hole of zeros
        m = await s.flush()
    expected = data[:MiB + 1000] + bytes(2 * MiB + 5 - MiB - 1000)
    expected += bytes(4 * MiB - len(expected)) + b"tail"
    assert await stored_bytes(env.pool, m) == expected


def test_a_span_in_a_hole_is_the_zero_chunk_without_reading_it(tmp_path: Path) -> None:
    """A sparse file's holes (`truncate -s 100G`) are the one zero chunk, encoded once: hashing and
    compressing their zeros cost ~2 s per GiB of apparent size at the close (the ML audit: 28 min for an
    896 GiB ftruncate). A span that holds data, even one byte of it, is read."""
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(64 * MiB)
        f.seek(20 * MiB)
        f.write(b"d")
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in (0, 16 * MiB, 60 * MiB):          # before the data, up to it, after the last data
            enc = encode_span(fd, offset, 4 * MiB, "lz4", "sparse")
            assert enc is zero_chunk(4 * MiB, "lz4") and enc.digest == chunk_hash(bytes(4 * MiB))
        enc = encode_span(fd, 16 * MiB, 4 * MiB + 1, "lz4", "sparse")
        assert enc.digest == chunk_hash(bytes(4 * MiB) + b"d")
        enc = encode_span(fd, 21 * MiB, 3 * MiB, "none", "sparse")
        assert enc is zero_chunk(3 * MiB, "none") and enc.raw_len == 3 * MiB
        os.truncate(path, 30 * MiB)                     # shrank meanwhile: no zeros past its end
        with pytest.raises(CpfsError, match="short read"):
            encode_span(fd, 28 * MiB, 4 * MiB, "lz4", "sparse")
    finally:
        os.close(fd)


async def test_a_file_extended_by_truncate_stores_its_holes_as_zeros(env: Env) -> None:
    """Through a write session: data, a 24 MiB hole, a base version's chunks kept, dropped spans
    brought back, then the bytes read back equal."""
    head, tail = os.urandom(MiB + 3), os.urandom(2 * MiB)
    async with open_session(env, "/sparse.bin") as s:
        await s.write(0, head)
        await s.truncate(24 * MiB)
        await s.write(24 * MiB, tail)
        m = await s.flush()
    assert await stored_bytes(env.pool, m) == head + bytes(24 * MiB - len(head)) + tail
    async with open_session(env, "/sparse.bin", base=m) as s:
        await s.truncate(40 * MiB)
        await s.write(30 * MiB, b"mid")
        m2 = await s.flush()
    expected = head + bytes(24 * MiB - len(head)) + tail
    expected += bytes(30 * MiB - len(expected)) + b"mid"
    assert await stored_bytes(env.pool, m2) == expected + bytes(40 * MiB - len(expected))


async def test_rewrite_from_scratch_after_truncate_to_zero(env: Env) -> None:
    first, second = (safetensors.torch.save(model(layers=2, width=128, seed=k)) for k in (1, 2))
    async with open_session(env, "/again.safetensors") as s:
        await s.write(0, first)
        await until(s, lambda: s.statistics().chunks_streamed > 0)
        await s.truncate(0)
        await s.write(0, second)
        m = await s.flush()
    assert await stored_bytes(env.pool, m) == second
    assert m.tensor_index is not None


async def test_truncate_a_base_version(env: Env) -> None:
    old = os.urandom(3 * MiB)
    v1 = await commit_bytes(env, "/b.bin", old)
    async with open_session(env, "/b.bin", base=v1) as s:
        await s.truncate(MiB + MiB // 4)
        await s.truncate(2 * MiB)
        m = await s.flush()
        # Chunk 1, which the cut goes through, and chunk 0: the index reads the head for the format.
        assert s.statistics().base_chunks_fetched == 2
    assert await stored_bytes(env.pool, m) == old[:MiB + MiB // 4] + bytes(3 * MiB // 4)
    async with open_session(env, "/b.bin", base=m) as s:
        await s.truncate(0)
        empty = await s.flush()
    assert empty.size == 0 and empty.chunks == ()


async def test_empty_file_commits_without_chunks(env: Env) -> None:
    async with open_session(env, "/empty.pt") as s:
        m = await s.flush()
    assert m.size == 0 and m.chunks == () and m.tensor_index is None
    assert (await env.catalog.get("/empty.pt")).version == m.version


async def test_flush_again_commits_only_changes(env: Env) -> None:
    async with open_session(env, "/f.bin") as s:
        await s.write(0, b"first")
        m1 = await s.flush()
        assert await s.flush() is m1      # fsync then close: the second is a no-op
        assert s.statistics().commits == 1
        await s.write(5, b" second")
        m2 = await s.flush()
    assert m2.version > m1.version and s.statistics().commits == 2
    assert await stored_bytes(env.pool, await env.catalog.get("/f.bin")) == b"first second"


# ---------------------------------------------------------------- dedup across checkpoints

async def test_frozen_layers_store_only_changed_chunks(env: Env) -> None:
    sd = model(layers=20, width=256)  # ~64 MiB
    async with open_session(env, "/run/step_100.pt") as s:
        await save_into(s, lambda f: torch.save(sd, f))
        first = await s.flush()
    for i in (3, 11):  # fine-tuning changed 2 of 20 layers
        for name in [k for k in sd if k.startswith(f"layers.{i}.")]:
            sd[name] = sd[name] + 0.01
    async with open_session(env, "/run/step_200.pt") as s:
        await save_into(s, lambda f: torch.save(sd, f))
        second = await s.flush()
        stats = s.statistics()
    share = stats.new_raw_bytes / second.size
    print(f"\ndedup: checkpoint of {second.size / MiB:.1f} MiB with 2/20 layers changed added "
          f"{stats.new_raw_bytes / MiB:.2f} MiB of new chunks = {share:.1%} of its size "
          f"({stats.chunks_uploaded} new chunks, {stats.chunks_deduped} deduplicated)")
    assert first.size > 60 * MiB and share <= 0.20
    assert stats.chunks_discarded == 0
    loaded = torch.load(io.BytesIO(await stored_bytes(env.pool, second)))
    assert torch.equal(loaded["layers.11.mlp.fc1.weight"], sd["layers.11.mlp.fc1.weight"])

    # A small new entry first shifts every byte after it: cuts at tensor boundaries still match.
    shifted = {"step": torch.tensor([200.0])} | sd
    async with open_session(env, "/run/step_300.pt") as s:
        await save_into(s, lambda f: torch.save(shifted, f))
        third = await s.flush()
        share = s.statistics().new_raw_bytes / third.size
    print(f"dedup: same with a new small tensor first (every offset shifted): {share:.1%} new")
    assert share <= 0.05
