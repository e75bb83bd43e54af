"""Fault drills through the real StorePool over real folders: transient errors retried, stores down or
hung (also a worker thread stuck in the kernel), corrupt copies under dedup, manifests that lie.
Faults are injected by wrapping stores (FaultyStore) or by the filesystem, never by patching."""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
from pathlib import Path

import pyfuse3
import pytest
import trio

from cpfs import chunk as chunkfmt
from cpfs.config import Config, parse_config
from cpfs.errors import ChunkUnavailable, StoreDenied, StoreError, StoreFull, StoreUnavailable
from cpfs.fs import boundary
from cpfs.manifest import ChunkEntry
from cpfs.placement import place
from cpfs.pool import DOWN_AFTER, VERIFY_FULL_MAX, StorePool
from cpfs.store import DirectoryStore, FaultyStore, Store, open_store
from cpfs.upload import Uploader

TIMEOUT = 0.3          # seconds: short, so a hung store costs little; bounds below are 10x looser


def _config(tmp_path: Path, stores: int = 3, replicas: int = 2, timeout: float = TIMEOUT) -> Config:
    text = (f'replicas = {replicas}\n[store_defaults]\ntimeout = "{int(timeout * 1000)}ms"\n'
            + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(stores)))
    return parse_config(text, "faults.toml", tmp_path)


def _folders(config: Config) -> list[Store]:
    return [open_store(s) for s in config.stores]


async def test_fault_rules_refuse_or_hold_the_requests_they_pick_and_no_others(tmp_path: Path) -> None:
    """The rules tests stage sequences with (a put taken, then its delete refused; a put held until the
    test lets it land): each picks its operation and keys, the first match decides, `allow` ends it."""
    store = FaultyStore(DirectoryStore("s0", tmp_path / "s0"))
    await store.put("manifests/a", b"1")
    no_deletes = store.refuse("delete", "manifests/*")
    store.refuse("put", lambda key: key.endswith(".failed.json"), StoreFull)
    with pytest.raises(StoreDenied, match="refused"):
        await store.delete("manifests/a")
    await store.delete("chunks/x")                         # another key: through
    with pytest.raises(StoreFull):
        await store.put("manifests/a.failed.json", b"2")
    assert await store.get("manifests/a") == b"1"          # another operation: through
    store.allow(no_deletes)
    await store.delete("manifests/a")
    release = trio.Event()
    held = store.hold("put", "txns/*", release)
    async with trio.open_nursery() as n:
        n.start_soon(store.put, "txns/t.json", b"record")
        await held.reached.wait()
        assert store.statistics().held == 1 and not await store.inner.exists("txns/t.json")
        release.set()
    assert await store.get("txns/t.json") == b"record" and store.statistics().held == 0
    assert (store.statistics().ruled, held.hits) == (2, 1)
    store.allow()
    await store.put("x.failed.json", b"3")
    with pytest.raises(ValueError, match="no store operation"):
        store.refuse("remove", "*")


def _entry(enc: chunkfmt.EncodedChunk, held: list[str]) -> ChunkEntry:
    return ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held))


def _copy(tmp_path: Path, store: str, digest: str) -> Path:
    return tmp_path / store / chunkfmt.chunk_key(digest)


def _every_copy_good(tmp_path: Path, entry: ChunkEntry) -> bool:
    for name in entry.stores:
        try:
            chunkfmt.decode(_copy(tmp_path, name, entry.digest).read_bytes(), entry.digest)
        except Exception:
            return False
    return True


async def _store(pool: StorePool, data: bytes, targets: list[str] | None = None) -> ChunkEntry:
    enc = chunkfmt.encode(data)
    targets = targets or place(enc.digest, pool.names, pool.config.replicas)
    held, *_ = await pool.store_chunk(enc, targets, quorum=len(targets))
    return _entry(enc, held)


def _down(pool: StorePool, name: str) -> bool:
    return not pool.is_up(name)


# ---- transient errors -------------------------------------------------------------------------------

async def test_error_rate_is_retried_and_bytes_stay_right(tmp_path: Path) -> None:
    """With every store failing a fifth of its requests, writes reach quorum and reads return the right
    bytes: the pool retries transient failures; nothing is marked down. (A long timeout: every retry
    fits in it, so the seeded run is the same however slow the machine.)"""
    config = _config(tmp_path, timeout=30)
    faulty = [FaultyStore(s, error_rate=0.2, seed=i) for i, s in enumerate(_folders(config))]
    pool = StorePool(config, stores=faulty, seed=0)
    payloads = [os.urandom(50_000 + i) for i in range(12)]
    entries = [await _store(pool, data, pool.names[i % 3:] + pool.names[:i % 3][:2]) for i, data in enumerate(payloads)]
    for entry, data in zip(entries, payloads):
        assert await pool.fetch_chunk(entry, "drill") == data
    assert sum(f.statistics().errors for f in faulty) > 0
    assert sum(h.retries for h in pool.health()) >= sum(f.statistics().errors for f in faulty)
    assert all(h.up for h in pool.health())


async def test_permanent_errors_are_not_retried(tmp_path: Path) -> None:
    """A missing object is an answer: one request, no retry, the store stays up."""
    pool = StorePool(_config(tmp_path))
    with pytest.raises(StoreError) as e:
        await pool.get("s0", "chunks/ab/missing")
    assert not e.value.transient
    assert pool.statistics()[0].requests == 1 and pool.health()[0].retries == 0 and pool.is_up("s0")


# ---- a store down -----------------------------------------------------------------------------------

async def test_down_store_is_skipped_for_reads_and_probed_back_up(tmp_path: Path) -> None:
    """A store that goes down: reads fall over to the other replica, the store is marked down after
    DOWN_AFTER failed requests and ranked last, and the background probe marks it up once it answers."""
    config = _config(tmp_path)
    faulty = [FaultyStore(s) for s in _folders(config)]
    payloads = [os.urandom(30_000 + i) for i in range(2 * DOWN_AFTER)]
    entries = [await _store(StorePool(config, stores=faulty), data, ["s0", "s1"]) for data in payloads]
    faulty[0].down = True
    pool = StorePool(config, stores=faulty, probe_interval=0.01)   # idle: ranks s0 (failing fast) first
    async with trio.open_nursery() as n:
        await n.start(pool.run)
        with trio.fail_after(10):
            for entry, data in zip(entries, payloads):
                assert await pool.fetch_chunk(entry, "drill") == data
        assert _down(pool, "s0") and pool.rank(["s0", "s1"]) == ["s1", "s0"]
        refused, probes = faulty[0].statistics().refused, pool.health()[0].probes
        assert await pool.fetch_chunk(entries[0], "drill") == payloads[0]
        # A down store is not even asked for the read; only the background probe asks it (every 10 ms).
        assert faulty[0].statistics().refused - refused == pool.health()[0].probes - probes
        faulty[0].down = False
        with trio.fail_after(10):
            while _down(pool, "s0"):
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert pool.health()[0].probes >= 1 and pool.health()[0].marked_down == 1


async def test_writes_below_quorum_fail_cleanly(tmp_path: Path) -> None:
    """With one of two target stores down, a quorum-2 write raises StoreUnavailable naming it (no temp
    files left anywhere); a quorum-1 write succeeds on the other and says so."""
    config = _config(tmp_path)
    faulty = [FaultyStore(s) for s in _folders(config)]
    pool = StorePool(config, stores=faulty)
    faulty[1].down = True
    enc = chunkfmt.encode(os.urandom(40_000))
    with pytest.raises(StoreUnavailable) as e:
        await pool.store_chunk(enc, ["s0", "s1"], quorum=2)
    assert e.value.store == "s1" and "down" in str(e.value)
    with pytest.raises(StoreUnavailable):
        await pool.put_quorum(["s1", "s2"], "manifests/x", b"{}", 2)
    assert await pool.put_quorum(["s1", "s2"], "manifests/x", b"{}", 1) == ["s2"]
    assert (await pool.store_chunk(enc, ["s0", "s1"], quorum=1))[:2] == (["s0"], False)   # s0 got it above
    for i in range(3):
        assert not [p for p in (tmp_path / f"s{i}").rglob("*") if p.name.endswith(".cpfs-tmp")]


async def test_a_write_right_after_an_outage_ended_probes_the_store_instead_of_failing(tmp_path: Path) -> None:
    """A store marked down that answers again: the next write probes it (one probe for the writes at
    that moment) and lands, without waiting for the background probe. It failed at once until that
    probe ran, a save 130 ms after the outage ended among them (an audit's find). A store still down
    fails the write after its probe."""
    config = _config(tmp_path)
    faulty = [FaultyStore(s) for s in _folders(config)]
    pool = StorePool(config, stores=faulty, probe_interval=3600)      # no background probe in time
    faulty[1].down = True
    chunks = [chunkfmt.encode(os.urandom(40_000 + i)) for i in range(DOWN_AFTER + 4)]
    for enc in chunks[:DOWN_AFTER]:
        with pytest.raises(StoreUnavailable):
            await pool.store_chunk(enc, ["s0", "s1"], quorum=2)
    assert _down(pool, "s1")
    faulty[1].down = False
    async with trio.open_nursery() as n:                                # writes at one moment
        for enc in chunks[DOWN_AFTER:]:
            n.start_soon(pool.store_chunk, enc, ["s0", "s1"], 2)
    assert not _down(pool, "s1") and pool.health()[1].probes == 1
    faulty[1].down = True
    for enc in chunks[:DOWN_AFTER + 1]:
        with pytest.raises(StoreUnavailable):
            await pool.store_chunk(enc, ["s1", "s2"], quorum=2)
    assert _down(pool, "s1") and pool.health()[1].probes == 2


async def test_down_in_config_is_a_drill_not_a_config_error(tmp_path: Path) -> None:
    """`down = true` on a [[store]]: check() marks it down instead of refusing to start, reads and
    writes go to the others."""
    config = parse_config('replicas = 2\nwrite_quorum = 1\n'
                          '[[store]]\nname = "s0"\nurl = "s0"\ndown = true\n'
                          '[[store]]\nname = "s1"\nurl = "s1"\n', "drill.toml", tmp_path)
    pool = StorePool(config)
    await pool.check()
    assert _down(pool, "s0") and pool.is_up("s1")
    entry = await _store(pool, b"x" * 5000, ["s1"])
    assert await pool.fetch_chunk(entry, "drill") == b"x" * 5000
    held, *_ = await pool.store_chunk(chunkfmt.encode(b"y" * 5000), ["s0", "s1"], quorum=1)
    assert held == ["s1"]


# ---- a store hung -----------------------------------------------------------------------------------

async def test_a_block_read_from_a_hung_store_gives_up_at_the_hedge_delay(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The replica a block read asks hangs: fetch_blocks gives up after the delay a chunk read would
    hedge at (hedge_max here: no latencies known yet), not the store's timeout, without marking the
    store down; the whole-chunk read that follows hedges to the other replica and gets the bytes."""
    config = dataclasses.replace(_config(tmp_path, timeout=30.0), hedge_max=0.2)
    faulty = [FaultyStore(s) for s in _folders(config)]
    data = os.urandom(2 * chunkfmt.BLOCK)
    entry = await _store(StorePool(config, stores=faulty), data, ["s0", "s1"])
    entry = dataclasses.replace(entry, blocks=chunkfmt.encode(data).blocks)
    faulty[0].hang = True
    pool = StorePool(config, stores=faulty)           # idle: ranks replicas in the entry's order
    with trio.fail_after(20), caplog.at_level(logging.INFO, logger="cpfs.pool"):
        t0 = trio.current_time()
        assert await pool.fetch_blocks(entry, 10, 20, "file /x offset 10 chunk 0") is None
        assert config.hedge_max <= trio.current_time() - t0 < 10   # 0.2 s, far from the 30 s timeout
        assert await pool.fetch_chunk(entry, "file /x offset 10 chunk 0") == data
    assert pool.is_up("s0") and pool.replica_statistics().block_misses == 1
    assert faulty[0].statistics().hung == 2 and pool.replica_statistics().hedges == 1
    assert any("file /x offset 10 chunk 0" in r.getMessage() and "'s0'" in r.getMessage()
               and "no answer within 0.200s" in r.getMessage() for r in caplog.records)


async def test_hung_store_fails_over_within_the_timeout(tmp_path: Path) -> None:
    """hang = true on one of three stores: a fetch whose first replica is there answers from the next
    one after about one timeout, and the hung store is marked down; then reads skip it, and listing
    and writes on it fail within the timeout instead of hanging."""
    config = _config(tmp_path)
    faulty = [FaultyStore(s) for s in _folders(config)]
    data = os.urandom(100_000)
    entry = await _store(StorePool(config, stores=faulty), data, ["s0", "s1"])
    faulty[0].hang = True
    pool = StorePool(config, stores=faulty)           # idle: ranks replicas in the entry's order
    with trio.fail_after(10 * TIMEOUT):
        t0 = trio.current_time()
        assert await pool.fetch_chunk(entry, "drill") == data
        assert trio.current_time() - t0 >= TIMEOUT
        assert _down(pool, "s0") and pool.health()[0].timeouts == 1
        assert await pool.fetch_chunk(entry, "drill") == data         # skips it now
        with pytest.raises(StoreUnavailable):
            await pool.list_keys("s0", "chunks/")
        with pytest.raises(StoreUnavailable):
            await pool.store_chunk(chunkfmt.encode(b"new" * 1000), ["s0", "s2"], quorum=2)
    assert faulty[0].statistics().hung == 2         # the read, then the write's probe (`_revive`)
    assert pool.health()[0].probes == 1


async def test_hang_in_config_at_startup(tmp_path: Path) -> None:
    """hang = true with a per-store timeout: startup marks the store down within that timeout."""
    config = parse_config('replicas = 1\n[[store]]\nname = "s0"\nurl = "s0"\nhang = true\ntimeout = "100ms"\n'
                          '[[store]]\nname = "s1"\nurl = "s1"\n', "drill.toml", tmp_path)
    pool = StorePool(config)
    with trio.fail_after(5):
        await pool.check()
    assert _down(pool, "s0") and pool.health()[0].timeouts == 1


async def test_worker_thread_stuck_in_the_kernel_is_abandoned(tmp_path: Path) -> None:
    """A folder store's read that blocks in the kernel (the chunk file is a FIFO nobody writes: like a
    hung NFS server) is abandoned at the timeout and the read fails over; the thread ends once
    the FIFO gets a writer."""
    config = _config(tmp_path)
    data = os.urandom(80_000)
    entry = await _store(StorePool(config), data, ["s0", "s1"])
    fifo = _copy(tmp_path, "s0", entry.digest)
    fifo.unlink()
    os.mkfifo(fifo)
    pool = StorePool(config)                          # idle: ranks replicas in the entry's order
    try:
        with trio.fail_after(10 * TIMEOUT):
            assert await pool.fetch_chunk(entry, "drill") == data
        assert _down(pool, "s0") and pool.health()[0].timeouts == 1
    finally:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)      # release the stuck reader: it sees EOF
        os.close(fd)


# ---- corrupt copies and dedup -------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
async def test_dedup_rewrites_a_corrupt_copy(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    """A chunk that exists on its placement is reused only after checking it: a copy with a flipped
    byte (small chunk: compared whole), cut short, or with a bad header (large chunk: size and header
    compared) is rewritten, so the write leaves every replica good."""
    pool = StorePool(_config(tmp_path))
    size = 100_000 if damage == "flip" else 2 * VERIFY_FULL_MAX
    data = os.urandom(size)
    entry = await _store(pool, data)
    bad = _copy(tmp_path, entry.stores[0], entry.digest)
    blob = bytearray(bad.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x10
    elif damage == "truncate":
        del blob[-1000:]
    else:
        blob[8] ^= 0xFF
    bad.write_bytes(blob)
    assert not _every_copy_good(tmp_path, entry)
    uploader = Uploader(pool)
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        stored = await uploader.store(chunkfmt.encode(data))
    assert stored.stores == entry.stores and _every_copy_good(tmp_path, entry)
    assert uploader.statistics().chunks_new == 1
    assert any("rewriting" in r.getMessage() and entry.stores[0] in r.getMessage() for r in caplog.records)
    assert pool.health()[pool.names.index(entry.stores[0])].repairs == 1


async def test_a_copy_a_read_found_corrupt_is_rewritten(tmp_path: Path) -> None:
    """A flipped byte in the middle of a large copy passes the size and header check, but once a read
    has found that copy corrupt, the next write of the chunk rewrites it."""
    pool = StorePool(_config(tmp_path))
    data = os.urandom(2 * VERIFY_FULL_MAX)
    entry = await _store(pool, data)
    bad = _copy(tmp_path, entry.stores[0], entry.digest)
    blob = bytearray(bad.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    bad.write_bytes(blob)
    assert (await pool.store_chunk(chunkfmt.encode(data), list(entry.stores), 2))[:2] == (list(entry.stores), False)
    assert not _every_copy_good(tmp_path, entry)            # not found without a read: the documented limit
    reader = StorePool(_config(tmp_path))     # idle: tries the entry's first copy, the corrupt one
    assert await reader.fetch_chunk(entry, "a read") == data
    held, wrote, _ = await reader.store_chunk(chunkfmt.encode(data), list(entry.stores), 2)
    assert held == list(entry.stores) and wrote and _every_copy_good(tmp_path, entry)


async def test_differently_encoded_copy_is_kept(tmp_path: Path) -> None:
    """A good copy written with another codec (compression "none" vs lz4) differs from the blob in hand
    but decodes to the same chunk: it is verified and kept, not rewritten."""
    pool = StorePool(_config(tmp_path))
    data = b"compressible " * 30_000
    raw, lz4 = chunkfmt.encode(data, "none"), chunkfmt.encode(data, "lz4")
    assert raw.blob != lz4.blob and raw.digest == lz4.digest
    await pool.store_chunk(raw, ["s0", "s1"], 2)
    assert (await pool.store_chunk(lz4, ["s0", "s1"], 2))[:2] == (["s0", "s1"], False)
    assert _copy(tmp_path, "s0", raw.digest).read_bytes() == raw.blob


async def test_corrupt_reads_fall_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """corrupt_rate = 1 on one replica: every read of it is caught by the checksum and served by the
    other, with a warning naming the store."""
    config = _config(tmp_path)
    stores = _folders(config)
    stores[0] = FaultyStore(stores[0], corrupt_rate=1.0, seed=3)
    pool = StorePool(config, stores=stores)
    data = os.urandom(64_000)
    enc = chunkfmt.encode(data)
    for s in _folders(config)[:2]:
        await s.put(chunkfmt.chunk_key(enc.digest), enc.blob)
    entry = _entry(enc, ["s0", "s1"])
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        assert await pool.fetch_chunk(entry, "drill") == data
    assert any("corrupt replica" in r.getMessage() and "'s0'" in r.getMessage() for r in caplog.records)
    assert stores[0].statistics().corrupted == 1


async def test_manifest_raw_len_that_lies_is_unavailable(tmp_path: Path) -> None:
    """A manifest entry whose raw_len disagrees with the verified chunk never yields wrong-length bytes:
    every replica is refused and the read fails with ChunkUnavailable."""
    pool = StorePool(_config(tmp_path))
    entry = await _store(pool, os.urandom(10_000))
    for wrong in (entry.raw_len - 1, entry.raw_len + 4096):
        lying = ChunkEntry(entry.digest, wrong, entry.stored_len, entry.codec, entry.stores)
        with pytest.raises(ChunkUnavailable, match="the manifest says") as e:
            await pool.fetch_chunk(lying, "file /x offset 0 chunk 0")
        assert str(e.value).startswith("file /x offset 0 chunk 0")


# ---- read repair ------------------------------------------------------------------------------------

async def test_read_repair_rewrites_corrupt_and_missing_replicas(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A read that meets a corrupt or a missing replica still answers from the good one, and the bad
    one is rewritten in the background (logged with store, chunk and file)."""
    config = _config(tmp_path)
    data = os.urandom(100_000)
    entry = await _store(StorePool(config), data, ["s0", "s1"])
    copy = _copy(tmp_path, "s0", entry.digest)
    blob = bytearray(copy.read_bytes())
    blob[-1] ^= 0xFF
    copy.write_bytes(bytes(blob))
    repairs = 0
    for damage in ("corrupt", "missing"):
        if damage == "missing":
            copy.unlink()
        # A fresh pool each time: idle, with no latencies measured, it tries s0 (the damaged one) first.
        # (One pool would rank by what the first read measured: a slow moment of s0 could put s1 first.)
        pool = StorePool(config)
        async with trio.open_nursery() as n:
            await n.start(pool.run)
            with trio.fail_after(10):
                assert await pool.fetch_chunk(entry, f"file /ckpt.pt offset 0 chunk 0 ({damage})") == data
                while pool.health()[0].repairs < 1:       # counted once the put returned
                    await trio.sleep(0.01)
            assert _every_copy_good(tmp_path, entry)
            n.cancel_scope.cancel()
        repairs += pool.health()[0].repairs
    assert repairs == 2
    repaired = [r.getMessage() for r in caplog.records if "read repair" in r.getMessage()]
    assert len(repaired) == 2 and all("/ckpt.pt" in m and "'s0'" in m and entry.digest in m for m in repaired)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
async def test_read_repair_rewrites_a_replica_that_a_batch_read_found_bad(tmp_path: Path, damage: str) -> None:
    """A prefetch batch (`fetch_chunks`) reads three chunks from s0, the store that holds all three, and
    finds chunk 0's copy there corrupt or missing: chunk 0 then comes from s1 (not from s0 again), and
    s0's copy is rewritten in the background. The batch only logged it, and the single read that
    followed, not having met the bad copy, repaired nothing (an audit's find)."""
    config = _config(tmp_path, stores=2)
    stores = [FaultyStore(s) for s in _folders(config)]
    pool = StorePool(config, stores=stores)
    datas = [os.urandom(30_000) for _ in range(3)]
    entries = [await _store(pool, d, ["s0", "s1"] if k == 0 else ["s0"]) for k, d in enumerate(datas)]
    passes = trio.Event()
    passes.set()
    reads = stores[0].hold("get", chunkfmt.chunk_key(entries[0].digest), passes)    # counts, holds nothing
    copy = _copy(tmp_path, "s0", entries[0].digest)
    if damage == "missing":
        copy.unlink()
    else:
        copy.write_bytes(copy.read_bytes()[:-1] + bytes([copy.read_bytes()[-1] ^ 1]))
    async with trio.open_nursery() as n:
        await n.start(pool.run)
        with trio.fail_after(10):
            got = await pool.fetch_chunks(entries, [f"file /f chunk {k}" for k in range(3)])
            assert [bytes(g) for g in got] == datas
            while pool.health()[0].repairs < 1:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert pool.replica_statistics().batch_reads == 1 and _every_copy_good(tmp_path, entries[0])
    assert reads.hits == 1                      # the batch's read: chunk 0 not read on s0 again


async def test_a_copy_a_write_could_not_make_is_completed_in_the_background(tmp_path: Path) -> None:
    """write_quorum 1 of 2: the write returns with one copy when the other store fails, and the pool
    completes the missing copy in the background once it can."""

    class FailFirstPut(FaultyStore):
        failed = False

        async def put(self, key: str, data) -> None:
            if not self.failed:
                self.failed = True
                raise StoreError(self.name, "refusing the first put (test)", transient=False)
            await super().put(key, data)

    config = _config(tmp_path)
    stores = _folders(config)
    stores[1] = FailFirstPut(stores[1])
    pool = StorePool(config, stores=stores)
    enc = chunkfmt.encode(os.urandom(60_000))
    async with trio.open_nursery() as n:
        await n.start(pool.run)
        held, *_ = await pool.store_chunk(enc, ["s0", "s1"], quorum=1)
        assert held == ["s0"]
        with trio.fail_after(10):
            while not _copy(tmp_path, "s1", enc.digest).exists():
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert chunkfmt.decode(_copy(tmp_path, "s1", enc.digest).read_bytes(), enc.digest) is not None


async def test_a_store_whose_folder_vanishes_is_marked_down_though_hedges_win(tmp_path: Path) -> None:
    """A store's folder goes away mid-load (no mount: the pool alone). Its reads fail at once and wait
    to retry, a hedge to another replica wins meanwhile and cancels them: those requests failed all the
    same, and a store that keeps failing is marked down (then ranked last, probed until it is back)."""
    config = parse_config('replicas = 2\n[store_defaults]\ntimeout = "30s"\nhedge_min = "1ms"\n'
                          'hedge_max = "2ms"\n'
                          + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(3)),
                          "vanish.toml", tmp_path)
    writer = StorePool(config)
    payloads = [os.urandom(20_000 + i) for i in range(48)]
    entries = [await _store(writer, data, ["s0", "s1"]) for data in payloads]
    limiter = trio.CapacityLimiter(8)
    # Whether a hedge wins before s0 is marked down is a race (on a loaded CI machine the first three
    # failures can come first): up to 3 tries, each on a fresh pool with s0 back in place.
    for attempt in range(3):
        pool = StorePool(config, seed=1 + attempt)
        for entry, data in zip(entries[:8], payloads[:8]):        # s0 answers at first
            assert await pool.fetch_chunk(entry, "drill") == data
        (tmp_path / "s0").rename(tmp_path / "s0.away")

        async def one(entry: ChunkEntry, data: bytes) -> None:
            async with limiter:
                assert await pool.fetch_chunk(entry, "drill") == data

        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                for entry, data in zip(entries[8:], payloads[8:]):
                    n.start_soon(one, entry, data)
        if pool.replica_statistics().hedges_won >= 1:
            break
        (tmp_path / "s0.away").rename(tmp_path / "s0")
    s0 = pool.health()[0]
    assert pool.replica_statistics().hedges_won >= 1
    assert not s0.up and s0.marked_down == 1 and "gone" in s0.reason, s0
    assert pool.rank(["s0", "s1"]) == ["s1", "s0"]


# ---- ranged reads of lost pages -----------------------------------------------------------------------

async def test_blocks_of_a_chunk_are_read_alone_and_checked_and_anything_doubtful_is_left_to_a_whole_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """fetch_blocks brings the blocks around a range of a raw chunk, checked against the manifest's block
    checks. A copy whose block is damaged, a copy stored lz4, a store that fails, an entry without
    checks: None (never wrong bytes), and the whole-chunk read that follows gets it right and repairs."""
    config = _config(tmp_path)
    stores = _folders(config)
    pool = StorePool(config, stores=stores)
    B = chunkfmt.BLOCK
    data = os.urandom(4 * B + 777)
    entry = await _store(pool, data)
    entry = ChunkEntry(entry.digest, entry.raw_len, entry.stored_len, entry.codec, entry.stores,
                       chunkfmt.encode(data).blocks)
    assert entry.codec == "raw" and entry.blocks
    before = pool.replica_statistics()
    assert await pool.fetch_blocks(entry, B + 5, B + 4096, "w") == (B, data[B:2 * B])
    assert await pool.fetch_blocks(entry, 2 * B - 1, 4 * B + 10, "w") == (B, data[B:])     # to the short end
    after = pool.replica_statistics()
    assert (after.block_reads - before.block_reads, after.block_bytes - before.block_bytes) == (2, 4 * B + 777)
    assert await pool.fetch_blocks(ChunkEntry(entry.digest, entry.raw_len, entry.stored_len, entry.codec,
                                              entry.stores), 0, 10, "w") is None          # no checks recorded
    assert await pool.fetch_blocks(entry, 0, 4 * B + 778, "w") is None                  # past the chunk
    # Damage block 1 of every copy: each ranged read of it is refused; the whole read repairs nothing it
    # cannot prove, and fails rather than answer wrong bytes.
    for name in entry.stores:
        path = _copy(tmp_path, name, entry.digest)
        blob = bytearray(path.read_bytes())
        blob[chunkfmt.HEADER_SIZE + B + 100] ^= 0x40
        path.write_bytes(bytes(blob))
    with caplog.at_level(logging.INFO, logger="cpfs.pool"):
        assert await pool.fetch_blocks(entry, B, B + 1, "file /x offset 1 chunk 0") is None
    assert pool.replica_statistics().block_misses == 1
    assert any("file /x offset 1 chunk 0" in r.getMessage() and "block 1" in r.getMessage() for r in caplog.records)
    assert await pool.fetch_blocks(entry, 0, 10, "w") == (0, data[:B])                   # block 0 is fine
    with pytest.raises(ChunkUnavailable):
        await pool.fetch_chunk(entry, "w")
    # A copy stored lz4 under the same name (dedup keeps a copy encoded otherwise) is refused too.
    text = b"compressible " * 60_000
    lz4 = chunkfmt.encode(text, "lz4")
    assert lz4.codec == "lz4"
    await pool.store_chunk(lz4, ["s0", "s1"], 2)
    lying = ChunkEntry(lz4.digest, lz4.raw_len, lz4.stored_len, "raw", ("s0", "s1"), lz4.blocks)
    assert await pool.fetch_blocks(lying, 0, 100, "w") is None
    assert await pool.fetch_chunk(lying, "w") == text


async def test_the_fuse_boundary_maps_our_errors_also_from_a_nursery_and_logs_anything_else(caplog) -> None:
    """An operation's CpfsError becomes its errno with one log line; one that comes from a task of a
    nursery (an ExceptionGroup holding only ours) too, the first one deciding; anything else is EIO,
    logged with its traceback as a bug."""
    class Ops:
        @boundary
        async def read(self, raised: BaseException) -> None:
            raise raised

    cases = [(ChunkUnavailable("file /f offset 0 chunk 0: no replica"), errno.EIO, "no replica"),
             (ExceptionGroup("tasks", [ExceptionGroup("inner", [StoreFull("s0", "disk full")]),
                                       ChunkUnavailable("chunk 1")]), errno.ENOSPC, "disk full"),
             (ExceptionGroup("tasks", [StoreFull("s0", "disk full"), ValueError("a bug")]), errno.EIO,
              "failed unexpectedly")]
    for raised, want, logged in cases:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="cpfs.fs"), pytest.raises(pyfuse3.FUSEError) as e:
            await Ops().read(raised)
        assert e.value.errno == want and len(caplog.records) == 1 and logged in caplog.text


async def test_the_fuse_boundary_logs_a_writes_data_as_its_length(caplog) -> None:
    """A bug in a write is logged with the request's arguments, its data as a length: the whole
    buffer made one line of the daemon's log 1.5 MB long."""
    class Ops:
        @boundary
        async def write(self, fh: int, off: int, buf: bytes) -> int:
            raise KeyError(fh)

    with caplog.at_level(logging.ERROR, logger="cpfs.fs"), pytest.raises(pyfuse3.FUSEError) as e:
        await Ops().write(5, 4096, b"\x00" * (1 << 20))
    assert e.value.errno == errno.EIO
    assert caplog.records[0].getMessage() == "write(5, 4096, <1048576 bytes>) failed unexpectedly"
