"""The chunk cache with a fake loader: budget, LRU, single-flight, pins, errors, cancellation."""
from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from cpfs.cache import ChunkCache


def loader_for(data: bytes, calls: list[str], key: str, delay: float = 0.0):
    async def load() -> bytes:
        calls.append(key)
        await trio.sleep(delay)
        return data
    return load


async def test_hit_after_miss_and_lru_eviction_within_budget():
    cache = ChunkCache(budget=300)
    calls: list[str] = []
    for k in "abc":
        assert await cache.get(k, 100, loader_for(k.encode() * 100, calls, k)) == k.encode() * 100
    assert await cache.get("a", 100, loader_for(b"x", calls, "a")) == b"a" * 100   # hit, refreshes a
    await cache.get("d", 100, loader_for(b"d" * 100, calls, "d"))                  # evicts b (LRU)
    assert "b" not in cache and "a" in cache and "d" in cache
    s = cache.statistics()
    assert (s.hits, s.misses, s.evictions, s.used) == (1, 4, 1, 300)
    assert calls == ["a", "b", "c", "d"]


async def test_concurrent_misses_of_one_chunk_fetch_once(autojump_clock):
    cache = ChunkCache(budget=1000)
    calls: list[str] = []
    results = []

    async def reader():
        results.append(await cache.get("k", 10, loader_for(b"0123456789", calls, "k", delay=1)))

    async with trio.open_nursery() as n:
        for _ in range(10):
            n.start_soon(reader)
    assert calls == ["k"]
    assert results == [b"0123456789"] * 10
    assert cache.statistics().joined == 9


async def test_pinned_entries_survive_eviction_and_room_accounts_for_them():
    cache = ChunkCache(budget=200)
    calls: list[str] = []
    await cache.get("p", 100, loader_for(b"p" * 100, calls, "p"), pin=True)
    assert cache.room(100) and not cache.room(101)
    await cache.get("a", 100, loader_for(b"a" * 100, calls, "a"))
    await cache.get("b", 100, loader_for(b"b" * 100, calls, "b"))
    assert "p" in cache and "a" not in cache
    cache.unpin("p")
    await cache.get("c", 100, loader_for(b"c" * 100, calls, "c"))
    assert "p" not in cache
    assert cache.statistics().pinned == 0


async def test_loader_error_reaches_every_waiter_and_is_not_cached(autojump_clock):
    cache = ChunkCache(budget=100)

    async def bad() -> bytes:
        await trio.sleep(1)
        raise OSError("boom")

    errors = []

    async def reader():
        try:
            await cache.get("k", 10, bad)
        except OSError as e:
            errors.append(e)

    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(reader)
    assert len(errors) == 3
    assert "k" not in cache and cache.statistics().inflight == 0


async def test_cancelled_fetch_lets_a_waiter_fetch_again(autojump_clock):
    cache = ChunkCache(budget=100)
    calls: list[str] = []
    got = []
    async with trio.open_nursery() as n:
        first = trio.CancelScope()

        async def first_reader():
            with first:
                await cache.get("k", 3, loader_for(b"abc", calls, "k", delay=10))

        async def second_reader():
            got.append(await cache.get("k", 3, loader_for(b"abc", calls, "k", delay=10)))

        n.start_soon(first_reader)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(second_reader)
        await trio.testing.wait_all_tasks_blocked()
        first.cancel()
    assert got == [b"abc"] and calls == ["k", "k"]
    assert cache.statistics().inflight == 0


async def test_clear_drops_unpinned_only():
    cache = ChunkCache(budget=1000)
    await cache.get("a", 1, loader_for(b"a", [], "a"))
    await cache.get("b", 1, loader_for(b"b", [], "b"), pin=True)
    cache.clear()
    assert "a" not in cache and "b" in cache


@pytest.mark.parametrize("budget", [0, 50])
async def test_demand_reads_work_even_when_budget_is_tiny(budget):
    cache = ChunkCache(budget=budget)
    assert await cache.get("a", 100, loader_for(b"a" * 100, [], "a")) == b"a" * 100
    assert cache.statistics().used == 0


# ---------------------------------------------------------------------------------------------------
# read buffers (cpfs/buffers.py): what the cache holds of a raw chunk is a view of one

def test_a_read_buffer_is_reused_only_once_nothing_refers_to_it():
    from cpfs.buffers import PAGE, BufferPool, size_class

    pool = BufferPool(max_bytes=64 * PAGE)
    a = pool.take(5000)
    view = memoryview(a)[10:20]            # a cached chunk is a view of its buffer
    del a
    b = pool.take(5000)
    assert b is not view.obj, "a buffer a view still refers to was handed out again"
    b[:4] = b"beef"
    del view
    c = pool.take(5000)                    # the first buffer is free now: reused, not a new one
    assert c is not b and pool.statistics().reused == 1
    assert len(pool.take(3 * PAGE + 1)) == size_class(3 * PAGE + 1) == 4 * PAGE
    del b, c
    assert pool.trim() > 0 and pool.statistics().bytes == 0


def test_a_read_takes_an_idle_larger_buffer_before_mapping_a_new_one():
    """A new buffer's pages cost a first touch each; an idle larger one's are backed (cpfs/buffers.py)."""
    from cpfs.buffers import PAGE, BufferPool

    pool = BufferPool(max_bytes=64 * PAGE)
    big = pool.take(16 * PAGE)
    held = memoryview(big)[:PAGE]          # a cached chunk's view keeps the big buffer in use
    del big
    small = pool.take(PAGE)
    assert small is not held.obj and pool.statistics().larger == 0 and pool.statistics().allocated == 2
    del held
    other = pool.take(2 * PAGE)            # no idle buffer of its class: the idle big one
    assert len(other) == 16 * PAGE and pool.statistics().larger == 1
    again = pool.take(2 * PAGE)            # the big one is in use now: a buffer of its own class
    assert len(again) == 2 * PAGE and pool.statistics().allocated == 3
    del small, other, again


def test_prefilled_buffers_are_backed_and_trim_keeps_them_freeing_smaller_ones_first():
    from cpfs.buffers import PAGE, BufferPool, size_class

    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

    size = 1024 * 1024
    pool = BufferPool(max_bytes=64 * size, keep=8 * size)
    before = rss_kib()
    assert size_class(size) == size and pool.prefill(size) == 8 * size
    assert rss_kib() - before >= 8 * size // 1024 * 9 // 10, "prefilled pages were not touched"
    assert pool.prefill(size) == 0                                   # already `keep` bytes
    small = [pool.take(PAGE) for _ in range(4)]                      # 4 idle big ones serve these...
    extra = [pool.take(size) for _ in range(6)]                      # ...the other 4 and 2 new ones these
    st = pool.statistics()
    assert (st.larger, st.reused, st.allocated) == (4, 8, 2)
    del small, extra
    assert pool.statistics().bytes == 10 * size
    assert pool.trim() == 2 * size and pool.statistics().bytes == 8 * size     # back to keep
    busy = [pool.take(size) for _ in range(8)]
    page = pool.take(PAGE)                                           # every big one busy: a small one
    del busy, page
    assert pool.trim() == PAGE and pool.statistics().bytes == 8 * size         # the small one goes first
    pool.keep = 0
    pool.trim()
    assert pool.statistics().bytes == 0


def test_size_classes_waste_at_most_a_quarter():
    from cpfs.buffers import PAGE, size_class

    for size in [1, PAGE, PAGE + 1, 40_000, 512 * 1024, 700_000, 4 * 1024**2 + 32, 7 * 1024**2 + 5]:
        c = size_class(size)
        assert c % PAGE == 0 and c >= size and (c <= 1.25 * size or c <= 4 * PAGE)


async def test_folder_store_get_with_reads_what_get_reads_and_views_stay_intact(tmp_path):
    from cpfs.store.directory import DirectoryStore

    store = DirectoryStore("d", tmp_path / "s")
    blobs = {f"k/{i}": bytes([i]) * (100_000 + 4097 * i) for i in range(6)}
    for k, v in blobs.items():
        await store.put(k, v)
    limiter = trio.CapacityLimiter(2)
    held = [(k, await store.get_with(k, lambda data: data, limiter)) for k in blobs]   # views, kept
    for k, v in blobs.items():              # more reads: none may land in a buffer still held above
        assert bytes(await store.get_with(k, lambda data: data, limiter)) == v == await store.get(k)
    for k, view in held:
        assert bytes(view) == blobs[k]


async def test_folder_store_reads_a_batch_into_one_buffer_and_its_views_stay_intact(tmp_path):
    """A batch of small chunks takes one (chunk-sized, ready) buffer, not one each; every object sits
    at a page boundary of it, and a view of one keeps the whole buffer from the next batches."""
    from cpfs.buffers import POOL
    from cpfs.errors import NoSuchObject
    from cpfs.store.directory import DirectoryStore

    store = DirectoryStore("d", tmp_path / "s")
    blobs = {f"k/{i}": os.urandom(5000 + 40_000 * i) for i in range(5)}      # not page multiples
    for k, v in blobs.items():
        await store.put(k, v)
    limiter = trio.CapacityLimiter(2)
    keys = [*blobs, "k/absent"]

    def takes() -> int:
        st = POOL.statistics()
        return st.reused + st.allocated

    before = takes()
    first = await store.get_many_with([(k, lambda data: data) for k in keys], limiter)     # views, kept
    assert takes() - before == 1
    assert [bytes(v) for v in first[:5]] == list(blobs.values()) and isinstance(first[5], NoSuchObject)
    assert len({v.obj for v in first[:5]}) == 1                               # one buffer under them all
    for _ in range(3):                      # more batches: none may land in the buffer still viewed
        again = await store.get_many_with([(k, bytes) for k in keys], limiter)
        assert again[:5] == list(blobs.values())
    assert [bytes(v) for v in first[:5]] == list(blobs.values())
