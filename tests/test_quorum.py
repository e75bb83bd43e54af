"""Writes with write_quorum < replicas: a write returns once the quorum holds the data, the other puts
go on in the pool's background (bounded: a slow store makes writers wait, not memory grow), a slow store
gets its copy later, a failed background put is left to `cpfs scrub --repair`, and unmount gives the
background puts a grace, then abandons them.

The slow store is a folder store with `latency = "10s"` in its [[store]] table (cpfs/store/throttled.py),
and time is trio's MockClock, frozen unless a test jumps it: the fast stores' folder work runs in threads
in real time while no virtual second passes, so "returned before the slow store answered" is exact, not
a wall-clock guess. (No autojump while threads work: it would jump to the slow store's wake-up whenever a
thread takes 20 ms.)"""
from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import trio
import trio.testing

from conftest import cpfs
from cpfs import chunk as chunkfmt
from cpfs.catalog import Catalog
from cpfs.config import Config, load_config
from cpfs.importer import Importer
from cpfs.manifest import Manifest
from cpfs.pool import StorePool
from cpfs.store import FaultyStore, ThrottledStore, open_store
from cpfs.upload import Uploader

T = TypeVar("T")
SLOW = 10.0          # virtual seconds per request of the slow store (s2)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """Virtual time that moves only when a test jumps it (pytest-trio runs the test on this clock)."""
    return trio.testing.MockClock()


def _config(tmp_path: Path, *, slow: bool = True, name: str = "cpfs.toml") -> Path:
    """Three folder stores, replicas 3, write_quorum 2; s2 at SLOW seconds a request unless not `slow`.
    A timeout of an hour: no virtual jump of a test comes near it."""
    lines = ["replicas = 3", "write_quorum = 2", 'chunk_size = "256KiB"', "[store_defaults]", 'timeout = "1h"']
    for i in range(3):
        lines += ["[[store]]", f'name = "s{i}"', f'url = "stores/s{i}"']
        if i == 2 and slow:
            lines.append(f'latency = "{int(SLOW)}s"')
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _has(tmp_path: Path, store: str, key: str) -> bool:
    return (tmp_path / "stores" / store / key).is_file()


async def _until(cond: Callable[[], bool], what: str) -> None:
    """Let the other tasks and their threads run (no virtual time passes) until `cond` holds."""
    for _ in range(2000):
        if cond():
            return
        await trio.testing.wait_all_tasks_blocked(cushion=0.005)
    raise AssertionError(f"never happened: {what}")


async def _returns(n: trio.Nursery, fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """fn(*args) in `n`; its result once it returned while no virtual time passed (a write that waited
    for the slow store would never return: this fails instead of hanging)."""
    out: list[T] = []

    async def call() -> None:
        out.append(await fn(*args))

    n.start_soon(call)
    await _until(lambda: bool(out), f"{getattr(fn, '__name__', fn)} returns without the slow store")
    return out[0]


async def test_a_write_returns_at_quorum_and_the_slow_store_gets_its_copy_later(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    pool = StorePool(load_config(_config(tmp_path)))
    enc = chunkfmt.encode(os.urandom(200_000))
    key = chunkfmt.chunk_key(enc.digest)
    async with trio.open_nursery() as n:
        await n.start(pool.run)
        entry = await _returns(n, Uploader(pool).store, enc)
        assert trio.current_time() == 0                     # not one virtual second waited for s2
        assert set(entry.stores) == {"s0", "s1"}
        s = pool.replica_statistics()
        assert (s.background_puts, s.background_bytes, s.background_done) == (1, len(enc.blob), 0)
        assert _has(tmp_path, "s0", key) and _has(tmp_path, "s1", key) and not _has(tmp_path, "s2", key)
        clock.jump(SLOW)                                    # s2's dedup check (stat) answers
        await _until(lambda: pool.statistics()[2].requests == 2, "the put on s2 starts")
        clock.jump(SLOW)                                    # ... and its put
        await _until(lambda: pool.replica_statistics().background_done == 1, "the background put ends")
        n.cancel_scope.cancel()
    s = pool.replica_statistics()
    assert (s.background_puts, s.background_bytes, s.background_failed, s.background_abandoned) == (0, 0, 0, 0)
    assert chunkfmt.decode((tmp_path / "stores" / "s2" / key).read_bytes(), enc.digest) is not None


async def test_a_slow_store_makes_writers_wait_instead_of_memory_growing(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """Room for one blob in the background: the second write reaches its quorum but does not return
    until the first write's background put ended (backpressure), and the bytes left never exceed it."""
    first, second = chunkfmt.encode(os.urandom(100_000)), chunkfmt.encode(os.urandom(100_000))
    pool = StorePool(load_config(_config(tmp_path)), background_bytes=len(first.blob) + 1000)
    uploader = Uploader(pool)
    returned = trio.Event()

    async def write_second() -> None:
        await uploader.store(second)
        returned.set()

    async with trio.open_nursery() as n:
        await n.start(pool.run)
        await _returns(n, uploader.store, first)
        n.start_soon(write_second)
        key = chunkfmt.chunk_key(second.digest)
        await _until(lambda: _has(tmp_path, "s0", key) and _has(tmp_path, "s1", key), "quorum of the second")
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        assert not returned.is_set()                         # waits for room, its quorum notwithstanding
        assert pool.replica_statistics().background_bytes == len(first.blob)
        clock.jump(SLOW)                                    # s2: stat of both chunks
        await _until(lambda: pool.statistics()[2].requests == 4, "both puts on s2 start")
        clock.jump(SLOW)                                    # ... and both puts
        await _until(returned.is_set, "the second write returns")
        # the second's put on s2 may end before or after its write returned: a background put or not
        await _until(lambda: pool.replica_statistics().background_puts == 0 and _has(tmp_path, "s2", key),
                     "both puts on s2 end")
        n.cancel_scope.cancel()
    s = pool.replica_statistics()
    assert s.background_waits == 1 and s.background_done >= 1 and s.background_bytes == 0 and s.background_failed == 0


async def test_a_manifest_commit_returns_at_quorum_and_readers_find_it(
        tmp_path: Path, clock: trio.testing.MockClock) -> None:
    """A commit returns once write_quorum stores hold the new version; a reader that lists every
    store finds it meanwhile (the slow store does not have it yet); the slow store gets it later."""
    pool = StorePool(load_config(_config(tmp_path)))
    catalog = Catalog(pool)
    committed: list[Manifest] = []

    async def commit() -> None:
        committed.append(await catalog.commit(Manifest(path="/m.bin", size=0, mtime_ns=0, mode=0o644,
                                                       chunk_size=256 * 1024, chunks=(), version=0)))

    async with trio.open_nursery() as n:
        await n.start(pool.run)
        n.start_soon(commit)
        fast = lambda: all(s.requests >= 1 and s.outstanding == 0 for s in pool.statistics()[:2])  # noqa: E731
        await _until(lambda: fast() and pool.statistics()[2].outstanding == 1, "listings of s0 and s1")
        clock.jump(SLOW)                                    # s2's listing answers
        await _until(lambda: bool(committed), "the commit returns")
        assert trio.current_time() == SLOW                  # the put on s2 was not waited for
        assert pool.replica_statistics().background_puts == 1
        key = next((tmp_path / "stores" / "s0" / "manifests").rglob("*.json")).relative_to(tmp_path / "stores" / "s0")
        assert not _has(tmp_path, "s2", str(key))
        reader = Catalog(StorePool(load_config(_config(tmp_path, slow=False, name="plain.toml"))))
        assert (await reader.get("/m.bin")).version == committed[0].version
        clock.jump(SLOW)
        await _until(lambda: pool.replica_statistics().background_done == 1, "the manifest reaches s2")
        n.cancel_scope.cancel()
    assert _has(tmp_path, "s2", str(key))


async def test_unmount_gives_background_puts_a_grace_then_abandons_them(
        tmp_path: Path, clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    pool = StorePool(load_config(_config(tmp_path)), shutdown_grace=3.0)
    enc = chunkfmt.encode(os.urandom(50_000))
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        async with trio.open_nursery() as n:
            await n.start(pool.run)
            await _returns(n, pool.store_chunk, enc, pool.names, 2)
            assert pool.replica_statistics().background_puts == 1
            clock.autojump_threshold = 0.01         # only virtual sleeps remain: let the grace pass
            n.cancel_scope.cancel()
    assert trio.current_time() == 3.0                # the grace, then no longer (s2 answers at 10 s)
    s = pool.replica_statistics()
    assert (s.background_puts, s.background_abandoned, s.background_bytes) == (0, 1, 0)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("abandoning 1 puts" in m for m in msgs)
    assert any("abandoned at shutdown" in m and "'s2'" in m and enc.digest[:16] in m for m in msgs)


def _failing_slow_s2(config: Config) -> list:
    """s0 and s1 as configured; s2 refusing every request, after 0.3 s each (so only once the
    write has returned: a background put that fails)."""
    stores = [open_store(s) for s in config.stores]
    stores[2] = ThrottledStore(FaultyStore(stores[2], down=True), latency=0.3)
    return stores


async def test_a_failed_background_put_is_left_for_scrub_repair(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Real time (the failing store answers after 0.3 s). The chunk and the manifest return at quorum,
    the chunk's put on s2 fails in the background (logged with store and chunk), the repair retry too;
    the file reads back; `cpfs scrub` reports the missing copies and `cpfs scrub --repair` makes them."""
    plain = _config(tmp_path, slow=False)
    (plain.parent / "stores").mkdir()
    config = load_config(plain)
    pool = StorePool(config, stores=_failing_slow_s2(config))
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(100_000))
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        async with trio.open_nursery() as n:
            await n.start(pool.run)
            manifest = await Importer(pool, Catalog(pool)).put_file(src, "/f.bin")
            n.cancel_scope.cancel()                  # the grace lets the background puts fail
    s = pool.replica_statistics()
    # the chunk's put on s2 for sure; the manifest's too unless s2 was marked down (refused at once) first
    assert s.background_failed >= 1 and s.background_puts == 0 and s.background_abandoned == 0
    (chunk,) = manifest.chunks
    assert set(chunk.stores) == {"s0", "s1"}
    assert any("background put on store 's2' failed" in r.getMessage() and chunk.digest[:16] in r.getMessage()
               for r in caplog.records)
    key = chunkfmt.chunk_key(chunk.digest)
    assert not _has(tmp_path, "s2", key)
    assert cpfs("cat", "/f.bin", config=plain).stdout == src.read_bytes()
    assert cpfs("scrub", config=plain, check=False).returncode == 1
    repaired = cpfs("scrub", "--repair", config=plain, check=False)
    assert repaired.returncode == 0, repaired.stderr
    assert _has(tmp_path, "s2", key) and list((tmp_path / "stores" / "s2" / "manifests").rglob("*.json"))
    assert cpfs("scrub", config=plain, check=False).returncode == 0
