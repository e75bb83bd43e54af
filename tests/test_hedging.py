"""Hedged reads: a straggling or hung replica costs one hedge delay, not a timeout per chunk.

Stores here are in memory behind the real wrappers (ThrottledStore for latency, FaultyStore for hang),
and time is trio's virtual clock, so the bounds are exact, not wall-clock guesses. The clock jumps only
after 20 ms of real idleness: chunks are verified in worker threads, and a clock that jumped while a
thread worked would skip ahead to the next timeout."""
from __future__ import annotations

import bisect
from pathlib import Path
import os
import time

import pytest
import trio
import trio.testing

from cpfs import chunk as chunkfmt
from cpfs.config import parse_config
from cpfs.errors import NoSuchObject
from cpfs.manifest import ChunkEntry
from cpfs.pool import HEDGE_RATIO, StorePool
from cpfs.store import FaultyStore, Link, ObjectInfo, Store, ThrottledStore
from cpfs.sync import Budget


class MemoryStore(Store):
    """The smallest honest store: a dict."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.objects: dict[str, bytes] = {}
        self.mtimes: dict[str, float] = {}      # objects set up directly in `objects` count as ancient

    async def get(self, key: str) -> bytes:
        try:
            return self.objects[key]
        except KeyError:
            raise NoSuchObject(self.name, key) from None

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        return (await self.get(key))[start:start + length]

    async def head(self, key: str) -> int:
        return len(await self.get(key))

    async def stat(self, key: str) -> ObjectInfo:
        return ObjectInfo(key=key, size=len(await self.get(key)), mtime=self.mtimes.get(key, 0.0))

    async def touch(self, key: str) -> None:
        await self.get(key)
        self.mtimes[key] = time.time()

    async def put(self, key: str, data: bytes | memoryview) -> None:
        self.objects[key] = bytes(data)
        self.mtimes[key] = time.time()

    async def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        keys = sorted(k for k in self.objects if k.startswith(prefix))
        return keys[bisect.bisect_right(keys, start_after):][:limit]

    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        return [await self.stat(k) for k in await self.list(prefix, start_after, limit)]


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """Virtual time for the whole test (pytest-trio uses a Clock fixture as the run's clock)."""
    return trio.testing.MockClock(autojump_threshold=0.02)


def setup(slow_latency: float, hang: bool = False, hedges: int = 8, chunks: int = 200):
    """Three stores at 5 ms, the first at `slow_latency` (or hung); every chunk on s0 and s1."""
    pool, entries, payloads, _ = setup_stores(slow_latency, hang, hedges, chunks)
    return pool, entries, payloads


def setup_stores(slow_latency: float, hang: bool = False, hedges: int = 8, chunks: int = 200,
                 pool_args: dict | None = None):
    """setup(), and the three stores (wrappers whose knobs a test may turn); `pool_args` for StorePool."""
    config = parse_config('replicas = 2\n[store_defaults]\ntimeout = "30s"\nhedge_min = "10ms"\n'
                          f'hedge_max = "500ms"\nhedges = {hedges}\n'
                          + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(3)),
                          "hedge.toml", Path("/nonexistent"))
    mem = [MemoryStore(f"s{i}") for i in range(3)]
    entries, payloads = [], []
    for i in range(chunks):
        data = os.urandom(1000 + i)
        enc = chunkfmt.encode(data)
        for m in mem[:2]:
            m.objects[chunkfmt.chunk_key(enc.digest)] = enc.blob
        entries.append(ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, ("s0", "s1")))
        payloads.append(data)
    faulty = FaultyStore(ThrottledStore(mem[0], latency=slow_latency), hang=hang)
    stores = [faulty, ThrottledStore(mem[1], latency=0.005), ThrottledStore(mem[2], latency=0.005)]
    return StorePool(config, stores=stores, **(pool_args or {})), entries, payloads, stores


async def load(pool: StorePool, entries, payloads, parallel: int = 8) -> float:
    """Fetch every chunk, `parallel` at a time; the virtual seconds it took."""
    t0 = trio.current_time()
    limiter = trio.CapacityLimiter(parallel)

    async def one(entry, data):
        async with limiter:
            assert await pool.fetch_chunk(entry, "hedge test") == data

    async with trio.open_nursery() as n:
        for entry, data in zip(entries, payloads):
            n.start_soon(one, entry, data)
    return trio.current_time() - t0


async def test_a_straggler_at_20x_latency_costs_little(clock) -> None:
    healthy, entries, payloads = setup(slow_latency=0.005)
    base = await load(healthy, entries, payloads)
    slow, entries, payloads = setup(slow_latency=0.100)
    took = await load(slow, entries, payloads)
    assert took <= 1.3 * base, (took, base)            # measured 1.2x (1.4x before known-slow ranking)
    assert slow.replica_statistics().hedges_in_flight == 0


async def test_a_known_slow_store_gets_no_first_attempts_but_is_explored(clock) -> None:
    """Once the straggler is known slow, reads start on the fast replica however busy it is; one read
    in EXPLORE_EVERY that passes it over asks it too (as a hedge), so a store that recovers is found:
    then it wins such a race and gets first attempts again."""
    pool, entries, payloads, stores = setup_stores(slow_latency=0.100)
    await load(pool, entries[:100], payloads[:100])          # it finds the straggler out
    assert pool.rank(["s0", "s1"]) == ["s1", "s0"]

    async def s0_first_attempts(entries, payloads) -> int:
        before, s = pool.statistics()[0].requests, pool.replica_statistics()
        await load(pool, entries, payloads)
        after = pool.replica_statistics()
        assert after.explored > s.explored
        return pool.statistics()[0].requests - before - (after.hedges - s.hedges)   # explorations are hedges

    assert await s0_first_attempts(entries[100:], payloads[100:]) <= 0
    stores[0].inner.latency = 0.005                          # the straggler recovers (ThrottledStore knob)
    assert await s0_first_attempts(entries, payloads) > 50   # first attempts again


async def test_a_hung_replica_costs_one_hedge_delay_not_the_timeout(clock) -> None:
    healthy, entries, payloads = setup(slow_latency=0.005)
    base = await load(healthy, entries, payloads)
    hung, entries, payloads = setup(slow_latency=0.005, hang=True)
    took = await load(hung, entries, payloads)
    assert took < 2 * base, (took, base)                # the store timeout is 30 s
    assert hung.replica_statistics().hedges_won >= 1


async def test_hedges_in_flight_are_capped(clock) -> None:
    hung, entries, payloads = setup(slow_latency=0.005, hang=True, hedges=1)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, hung.replica_statistics().hedges_in_flight)
            # A hedge here lasts the healthy stores' 5 ms at least: sampled every 4 ms, none goes unseen.
            # (Every 1 ms, the virtual clock's jumps, each after 20 ms of real idleness, took 34 s.)
            await trio.sleep(0.004)

    async with trio.open_nursery() as n:
        n.start_soon(watch)
        await load(hung, entries, payloads)
        n.cancel_scope.cancel()
    s = hung.replica_statistics()
    assert peak == 1 and s.hedges_skipped >= 1


async def test_reads_queued_on_saturated_links_are_not_hedged(clock) -> None:
    """Both replicas' links busy (16 reads at once over two 100 kB/s links): every read waits behind
    others, which is no reason to ask the other store, whose link is as full. A hedge there only
    spends bandwidth on a copy: the load takes longer than the links' time for the bytes."""
    config = parse_config('replicas = 2\n[store_defaults]\nhedge_min = "10ms"\nhedge_max = "500ms"\n'
                          + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(2)),
                          "saturated.toml", Path("/nonexistent"))
    mem = [MemoryStore(f"s{i}") for i in range(2)]
    entries, payloads = [], []
    for i in range(200):
        data = os.urandom(1000)
        enc = chunkfmt.encode(data)
        for m in mem:
            m.objects[chunkfmt.chunk_key(enc.digest)] = enc.blob
        entries.append(ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, ("s0", "s1")))
        payloads.append(data)
    bandwidth = 100_000.0
    pool = StorePool(config, stores=[ThrottledStore(m, latency=0.005, bandwidth=bandwidth) for m in mem])
    took = await load(pool, entries, payloads, parallel=16)
    links = sum(map(len, mem[0].objects.values())) / (2 * bandwidth)     # every byte once, over both links
    s = pool.replica_statistics()
    print(f"saturated links: {took:.2f} s for {links:.2f} s of link time, {s.hedges} hedges of {s.reads} reads")
    assert s.hedges <= 0.08 * s.reads, s            # measured 10 of 210 (37 of 237 before)
    assert took <= 1.12 * links, (took, links)      # measured 1.05x (1.19x before)


def shared_link(chunks: int = 300, size: int = 60_000):
    """Three stores behind one 3 MB/s link (folders on one disk, buckets behind one gateway), each chunk on
    two of them, as FaultyStores (knobs) over ThrottledStores; and the link's time for every byte once."""
    config = parse_config('replicas = 2\n[store_defaults]\ntimeout = "30s"\nhedge_min = "10ms"\n'
                          'hedge_max = "500ms"\n'
                          + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(3)),
                          "shared.toml", Path("/nonexistent"))
    mem = [MemoryStore(f"s{i}") for i in range(3)]
    entries, payloads = [], []
    for i in range(chunks):
        data = os.urandom(size)
        enc = chunkfmt.encode(data)
        pair = ((0, 1), (1, 2), (0, 2))[i % 3]
        for j in pair:
            mem[j].objects[chunkfmt.chunk_key(enc.digest)] = enc.blob
        entries.append(ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(f"s{j}" for j in pair)))
        payloads.append(data)
    link = Link(bandwidth=3_000_000.0)
    stores = [FaultyStore(ThrottledStore(m, latency=0.005, link=link)) for m in mem]
    return StorePool(config, stores=stores), entries, payloads, stores, chunks * len(enc.blob) / link.bandwidth


@pytest.mark.parametrize("parallel", [16, 32])
async def test_stores_slow_together_are_not_flooded_with_hedges(clock, parallel: int) -> None:
    """Stores behind one link are slow together: a read there waits for the reads queued on the other
    stores too, which its own store's queue does not explain, so reads pass their hedge delay; and the
    hedge, on the same link, queues behind the read it meant to overtake. Every hedge loses and adds its
    bytes to the queue. Hedges are paid from a budget that answered reads fill (HEDGE_RATIO each) and only
    won hedges refill: here they stay within it. Before the budget: 283 hedges for 300 chunks, none won,
    and the load took 1.90x the link's time for the bytes (16 reads at once). With 16 the budget denies
    0-2 hedges (the first reads spend its burst), which is enough: a denied hedge adds no bytes to the
    queue, so later reads stay within their hedge delays (275 hedges and 1.87x with an endless budget,
    the same code; CI once saw none denied, so the count is not asserted there). With 32, reads wait
    past hedge_max (~0.64 s): their stores answer other reads meanwhile, so they are busy, not hung, and
    are not hedged whatever the budget (216 hedges and 1.59x when every read past hedge_max was; 223 and
    1.61x with an endless budget)."""
    pool, entries, payloads, _, link_time = shared_link()
    took = await load(pool, entries, payloads, parallel=parallel)
    s = pool.replica_statistics()
    print(f"shared link: {took:.2f} s for {link_time:.2f} s of link time, {s.hedges} hedges of {s.reads} reads")
    assert s.hedges_won == 0                                   # they cannot win here
    assert 1 <= s.hedges <= 8 + HEDGE_RATIO * len(entries) + 1, s     # `hedges`, then what reads earned
    if parallel == 32:
        assert s.hedges_over_budget > 100, s                   # measured 257
    assert took <= 1.1 * link_time, (took, link_time)          # measured 1.03x (16), 1.07x (32)


async def test_a_read_on_a_silent_store_is_hedged_at_hedge_max_whatever_the_budget(clock) -> None:
    """A read whose store has answered nothing for hedge_max may have hung: it is hedged even with the
    budget spent (here one that nothing refills), so a hang costs hedge_max per read, not the store's
    30 s timeout."""
    spent = Budget(ratio=0.0, burst=1.0)
    assert spent.spend() and not spent.spend()
    pool, entries, payloads, stores = setup_stores(slow_latency=0.005, pool_args={"hedge_budget": spent})
    await load(pool, entries[:20], payloads[:20], parallel=1)     # latencies known: hedge delays of ~10 ms
    stores[0].hang = True
    took = await load(pool, entries[20:40], payloads[20:40], parallel=1)
    s = pool.replica_statistics()
    assert s.hedges_won >= 1 and s.hedges_over_budget >= 1, s
    assert spent.statistics().tokens == 0.0                  # none of those hedges was paid for
    assert took <= 20 * 0.5 + 1, took                        # at most hedge_max per read


async def test_a_batch_on_a_store_that_begins_to_hang_gives_up_as_a_hedge_would(clock) -> None:
    """s0 begins to hang (a hung NFS server, a black-holed link) after serving reads: a batch of small
    prefetches on it is given up after about hedge_max and its chunks are read from s1, as a single
    chunk's read is. It waited for the store's timeout (30 s here), and every demand read that joined
    its fetches with it (an audit's find)."""
    pool, entries, payloads, stores = setup_stores(slow_latency=0.005, chunks=40)
    await load(pool, entries[:20], payloads[:20])
    stores[0].hang = True
    t0 = trio.current_time()
    assert await pool.fetch_chunks(entries[20:40], [f"/f chunk {k}" for k in range(20, 40)]) == payloads[20:40]
    assert trio.current_time() - t0 < 1.0
    assert stores[0].statistics().hung >= 1            # the batch did go to s0 and hang there
