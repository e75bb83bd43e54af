"""The store contract (DirectoryStore), the simulated remote link (ThrottledStore), and the StorePool's
replica fallback, all on real folders under tmp_path."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import trio

from cpfs import chunk as chunkfmt
from cpfs.config import parse_config
from cpfs.errors import ChunkUnavailable, NoSuchObject, StoreError, StoreUnavailable
from cpfs.manifest import ChunkEntry
from cpfs.pool import StorePool
from cpfs.store import DirectoryStore, ThrottledStore, open_store
from cpfs.store.directory import TMP_SUFFIX


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _temps(root: Path) -> list[str]:
    return [f for f in _files(root) if f.endswith(TMP_SUFFIX)]


# ---- DirectoryStore -------------------------------------------------------------------------------------

async def test_directory_store_contract(tmp_path: Path) -> None:
    """get/put/exists/delete/list behave as the Store interface says, on real files."""
    store = DirectoryStore("d0", tmp_path / "d0")
    await store.check()
    assert await store.list("") == []
    with pytest.raises(NoSuchObject) as e:
        await store.get("chunks/ab/missing")
    assert e.value.store == "d0" and "d0" in str(e.value)
    assert not await store.exists("chunks/ab/missing")

    await store.put("chunks/ab/ab01", b"one")
    await store.put("chunks/ab/ab02", memoryview(b"two"))
    await store.put("chunks/cd/cd01", b"")
    await store.put("manifests/m1.json", b"{}")
    assert await store.get("chunks/ab/ab01") == b"one"
    assert await store.get("chunks/ab/ab02") == b"two"
    assert await store.get("chunks/cd/cd01") == b""
    assert (tmp_path / "d0" / "chunks" / "ab" / "ab01").read_bytes() == b"one"
    assert await store.exists("chunks/ab/ab01")
    assert not await store.exists("chunks/ab")          # a folder is not an object

    assert await store.list("") == ["chunks/ab/ab01", "chunks/ab/ab02", "chunks/cd/cd01", "manifests/m1.json"]
    assert await store.list("chunks/") == ["chunks/ab/ab01", "chunks/ab/ab02", "chunks/cd/cd01"]
    assert await store.list("chunks/ab/ab0") == ["chunks/ab/ab01", "chunks/ab/ab02"]
    assert await store.list("chunk") == ["chunks/ab/ab01", "chunks/ab/ab02", "chunks/cd/cd01"]
    assert await store.list("manifests/") == ["manifests/m1.json"]
    assert await store.list("nothing/here/") == []

    await store.put("chunks/ab/ab01", b"replaced")
    assert await store.get("chunks/ab/ab01") == b"replaced"
    await store.delete("chunks/ab/ab01")
    await store.delete("chunks/ab/ab01")                # absent: not an error
    assert not await store.exists("chunks/ab/ab01")
    with pytest.raises(NoSuchObject):
        await store.get("chunks/ab/ab01")
    assert await store.list("chunks/ab/") == ["chunks/ab/ab02"]


async def test_puts_leave_no_temp_files(tmp_path: Path) -> None:
    """Many concurrent puts, also of the same key, leave only final objects, each one whole."""
    store = DirectoryStore("d0", tmp_path / "d0", trio.CapacityLimiter(8))
    payloads = {i: bytes([i]) * (100_000 + i) for i in range(16)}
    async with trio.open_nursery() as n:
        for i, data in payloads.items():
            n.start_soon(store.put, f"k/{i}", data)
            n.start_soon(store.put, "k/same", data)
    assert _temps(tmp_path / "d0") == []
    assert await store.list("k/") == sorted([f"k/{i}" for i in payloads] + ["k/same"])
    assert await store.get("k/same") in payloads.values()
    for i, data in payloads.items():
        assert await store.get(f"k/{i}") == data


@pytest.mark.parametrize("fail", ["fsync", "rename"])
async def test_failed_put_keeps_old_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str) -> None:
    """A put that fails inside the worker thread (fsync or rename) leaves the old object and no temp file."""
    store = DirectoryStore("d0", tmp_path / "d0")
    await store.put("chunks/ab/x", b"old contents")
    calls = []

    def broken(*args, **kw):
        calls.append(trio.lowlevel.in_trio_run())   # False inside a worker thread
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, fail, broken)
    with pytest.raises(StoreError, match="d0"):
        await store.put("chunks/ab/x", b"new contents that never land")
    monkeypatch.undo()
    assert calls == [False]
    assert await store.get("chunks/ab/x") == b"old contents"
    assert _files(tmp_path / "d0") == ["chunks/ab/x"]


@pytest.mark.parametrize("key", ["../escape", "/etc/passwd", "a/../../b", "chunks/..", "", "a\0b"])
async def test_bad_keys_refused(tmp_path: Path, key: str) -> None:
    """Keys that could leave the store's folder are refused by every operation; nothing is written."""
    (tmp_path / "d0").mkdir()
    (tmp_path / "outside").write_bytes(b"secret")
    store = DirectoryStore("d0", tmp_path / "d0")
    with pytest.raises(StoreError, match="invalid key"):
        await store.put(key, b"x")
    with pytest.raises(StoreError, match="invalid key"):
        await store.get(key)
    with pytest.raises(StoreError, match="invalid key"):
        await store.exists(key)
    with pytest.raises(StoreError, match="invalid key"):
        await store.delete(key)
    assert (tmp_path / "outside").read_bytes() == b"secret"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d0", "outside"]
    assert _files(tmp_path / "d0") == []


@pytest.mark.parametrize("prefix", ["../", "/", "a/../../", ".."])
async def test_list_refuses_escaping_prefix(tmp_path: Path, prefix: str) -> None:
    """list() never walks outside the store's folder."""
    (tmp_path / "outside").write_bytes(b"secret")
    store = DirectoryStore("d0", tmp_path / "d0")
    await store.put("a/b", b"x")
    with pytest.raises(StoreError, match="invalid"):
        await store.list(prefix)


async def test_check(tmp_path: Path) -> None:
    """check() passes for a usable folder (without creating anything) and names an unusable one."""
    await DirectoryStore("fresh", tmp_path / "not" / "yet").check()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_bytes(b"")
    for root in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(StoreUnavailable, match=r"store 'bad'.*" + str(tmp_path / "file")):
            await DirectoryStore("bad", root).check()
    assert _files(tmp_path) == ["file"]


# ---- ThrottledStore -------------------------------------------------------------------------------------

async def _filled(tmp_path: Path, n: int, size: int) -> DirectoryStore:
    inner = DirectoryStore("remote", tmp_path / "remote", trio.CapacityLimiter(16))
    for i in range(n):
        await inner.put(f"k/{i}", bytes([i]) * size)
    return inner


async def test_throttled_latency_overlaps(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """8 concurrent gets with 10 ms latency take ~10 ms in all, not 80 ms; a lone get takes 10 ms."""
    store = ThrottledStore(await _filled(tmp_path, 8, 1000), latency=0.010)
    t0 = trio.current_time()
    assert await store.get("k/0") == bytes([0]) * 1000
    assert trio.current_time() - t0 == pytest.approx(0.010, abs=1e-6)
    got = {}

    async def one(i: int) -> None:
        got[i] = await store.get(f"k/{i}")

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(one, i)
    assert trio.current_time() - t0 == pytest.approx(0.010, abs=1e-6)
    assert got == {i: bytes([i]) * 1000 for i in range(8)}


async def test_throttled_bandwidth_is_shared(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """Two concurrent 1 MiB gets over a 1 MiB/s link take ~2 s: transfers queue on the link."""
    store = ThrottledStore(await _filled(tmp_path, 2, 1 << 20), latency=0.001, bandwidth=float(1 << 20))
    done = []

    async def one(i: int) -> None:
        assert await store.get(f"k/{i}") == bytes([i]) * (1 << 20)
        done.append(trio.current_time() - t0)

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(one, 0)
        n.start_soon(one, 1)
    assert sorted(done) == [pytest.approx(1.0, abs=0.01), pytest.approx(2.0, abs=0.01)]
    t0 = trio.current_time()                     # the link is idle again: one get takes 1 s
    await one(0)
    assert done[-1] == pytest.approx(1.0, abs=0.01)


async def test_open_store_wraps_simulated_links(tmp_path: Path) -> None:
    """[[store]] tables with latency/bandwidth get a ThrottledStore around the folder; others do not."""
    cfg = parse_config('replicas = 1\n[[store]]\nname = "a"\nurl = "a"\n[[store]]\nname = "b"\nurl = "b"\n'
                       'latency = "5ms"\nbandwidth = "300MiB/s"\nconcurrency = 3\n', "test.toml", tmp_path)
    a, b = (open_store(s) for s in cfg.stores)
    assert isinstance(a, DirectoryStore) and a.root == tmp_path / "a"
    assert isinstance(b, ThrottledStore) and b.latency == 0.005 and b.bandwidth == 300 * 1024**2
    assert isinstance(b.inner, DirectoryStore) and b.inner.limiter.total_tokens == 3


# ---- StorePool ------------------------------------------------------------------------------------------

def _pool(tmp_path: Path, stores: int = 2) -> StorePool:
    text = "replicas = 2\n" + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(stores))
    return StorePool(parse_config(text, "test.toml", tmp_path))


async def _stored(pool: StorePool, data: bytes) -> ChunkEntry:
    enc = chunkfmt.encode(data)
    held, new = await pool.store_chunk(enc, pool.names, quorum=2)
    assert new and held == pool.names
    return ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held))


def _chunk_file(tmp_path: Path, store: str, entry: ChunkEntry) -> Path:
    return tmp_path / store / chunkfmt.chunk_key(entry.digest)


async def test_pool_store_chunk_dedups(tmp_path: Path) -> None:
    """A chunk is written once per store; storing it again writes nothing."""
    pool = _pool(tmp_path)
    data = os.urandom(100_000)
    entry = await _stored(pool, data)
    before = [s.bytes_written for s in pool.statistics()]
    held, new = await pool.store_chunk(chunkfmt.encode(data), pool.names, quorum=2)
    assert held == ["s0", "s1"] and not new
    assert [s.bytes_written for s in pool.statistics()] == before == [entry.stored_len] * 2


@pytest.mark.parametrize("damage", ["corrupt", "missing", "truncated"])
async def test_pool_falls_back_to_other_replica(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                damage: str) -> None:
    """A corrupt, missing or truncated replica is skipped with a WARNING naming the store; the bytes
    come from the other replica."""
    data = os.urandom(200_000)
    entry = await _stored(_pool(tmp_path), data)
    pool = _pool(tmp_path)       # a fresh, idle pool tries the replicas in the manifest's order
    bad = entry.stores[0]
    path = _chunk_file(tmp_path, bad, entry)
    blob = bytearray(path.read_bytes())
    if damage == "corrupt":
        blob[len(blob) // 2] ^= 1
        path.write_bytes(blob)
    elif damage == "truncated":
        path.write_bytes(blob[:1000])
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        assert await pool.fetch_chunk(entry, "file /run/x.pt offset 0 chunk 0") == data
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"store {bad!r}" in warnings[0] and "file /run/x.pt offset 0 chunk 0" in warnings[0]
    assert ("corrupt replica" if damage != "missing" else "replica failed") in warnings[0]


async def test_pool_all_replicas_bad(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With every replica bad, fetch_chunk raises ChunkUnavailable naming the place and every store."""
    pool = _pool(tmp_path, stores=3)
    data = os.urandom(50_000)
    enc = chunkfmt.encode(data)
    held, _ = await pool.store_chunk(enc, ["s1", "s2"], quorum=2)
    entry = ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held))
    _chunk_file(tmp_path, "s1", entry).write_bytes(b"CPFC garbage")
    _chunk_file(tmp_path, "s2", entry).unlink()
    where = "file /run/x.pt offset 4194304 chunk 1"
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        with pytest.raises(ChunkUnavailable) as e:
            await pool.fetch_chunk(entry, where)
    msg = str(e.value)
    assert msg.startswith(where) and enc.digest[:16] in msg
    assert "s1" in msg and "s2" in msg and "s0" not in msg
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 2
