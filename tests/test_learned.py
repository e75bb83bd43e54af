"""Learned prefetch (cpfs/learned.py): what a cold load read is fetched at once for the next load that
lands where it did, in the same checkpoint or a later one of the same model. Without a mount here (fake
stores, the kernel's page cache modelled, exact virtual time); through a real mount in
test_partial_mount."""
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest
import trio

from cpfs.cache import ChunkCache
from cpfs.learned import SHARED_WAIT, Learner, Recording, Shape, SharedError, StoreShared, encode, load, save
from cpfs.config import parse_config
from cpfs.manifest import Manifest
from cpfs.pool import StorePool
from cpfs.readahead import Scheduler, layout_for
from cpfs.tensor_index import Record, TensorEntry, TensorIndex
from tests.conftest import stale_and_fresh_temporaries
from tests.storekinds import STORE_FACTORIES
from test_readahead import (CHUNK, FakeStore, Kernel, config, cut_checkpoint, fetched, header_read, make_file,
                            read_tensor)

TENSORS, PER = 8, 8          # tensors of 8 chunks each


def step(store: FakeStore, seed: int) -> tuple[Manifest, bytes, TensorIndex]:
    """One checkpoint of the model: the same tensors (names, lengths, layout) for every seed, other bytes."""
    n = 2 + TENSORS * PER
    m, data = make_file(store, n, seed=seed)
    ts = tuple(TensorEntry(f"t{k}", "float32", (PER * CHUNK // 4,), (1,), str(k), (1 + k * PER) * CHUNK, PER * CHUNK)
               for k in range(TENSORS))
    records = (Record(f"step{seed}/data.pkl", 0, CHUNK),) + tuple(
        Record(f"step{seed}/data/{k}", t.offset, t.length) for k, t in enumerate(ts))
    return m, data, TensorIndex("torch-zip", records, ts, file_size=n * CHUNK, directory_offset=(n - 1) * CHUNK)


def chunks_of(k: int) -> set[int]:
    return set(range(1 + k * PER, 1 + (k + 1) * PER))


HEAD = {0, 1 + TENSORS * PER}


def mount_scheduler(store: FakeStore, kernel: Kernel) -> Scheduler:
    """A fresh mount's scheduler; the kernel's readahead reach one chunk (1 MiB of 4 MiB chunks on a mount)."""
    return Scheduler(ChunkCache(128 * CHUNK), store.fetch, config(cache="8MiB", max=16 * CHUNK, read_ahead_kb=64),
                     on_chunk=kernel.push)


class MemoryShared:
    """The stores' shared objects (learned.Shared) in memory, a round trip of `latency` each; `down`:
    every request fails as a store that is down would."""

    def __init__(self, latency: float = 0.008) -> None:
        self.latency = latency
        self.objects: dict[tuple[str, str], list[Recording]] = {}
        self.down = False
        self.gets = self.puts = 0

    async def _trip(self) -> None:
        await trio.sleep(self.latency)
        if self.down:
            raise SharedError("learned/...: store 's0' is down")

    async def get(self, schema: str, unit: str) -> list[Recording]:
        self.gets += 1
        await self._trip()
        return list(self.objects.get((schema, unit), []))

    async def put(self, schema: str, unit: str, recs: list[Recording]) -> None:
        self.puts += 1
        await self._trip()
        self.objects[(schema, unit)] = list(recs)


async def read_parts(kernel: Kernel, reader, ckpt, parts: list[tuple[int, float, float]],
                     compute: float = 0.0) -> None:
    """Read `parts` ((tensor, from, to) fractions) of `ckpt` through `reader`, each equal to the
    checkpoint's bytes, computing `compute` seconds after each."""
    _, data, index = ckpt
    for k, lo, hi in parts:
        t = index.tensors[k]
        got = await read_tensor(kernel, reader, t, lo, hi)
        assert got == data[t.offset + int(lo * t.length):t.offset + int(hi * t.length)]
        await trio.sleep(compute)


async def run_load(store: FakeStore, path: Path, ckpt, parts: list[tuple[int, float, float]], inode: int = 1,
                   compute: float = 0.02, shared: MemoryShared | None = None) -> tuple[float, Learner, Scheduler]:
    """A fresh mount (scheduler, cache, page cache; the learner reading `path`, sharing through `shared`)
    and a reader of `parts` ((tensor, from, to) fractions), computing between parts; (seconds the load
    took, learner, scheduler)."""
    m, data, index = ckpt
    kernel = Kernel(len(data))
    sched = mount_scheduler(store, kernel)
    learner = Learner(sched, path, shared=shared)
    sched.watcher = learner
    async with trio.open_nursery() as n:
        await n.start(learner.run)
        reader = await sched.open(n, m, index, inode)
        await trio.sleep(0.1)                  # open: the head arrives
        t0 = trio.current_time()
        await read_parts(kernel, reader, ckpt, parts, compute)
        took = trio.current_time() - t0
        await reader.aclose()
        await trio.sleep(2)                    # the recording is kept and written
        await learner.share()                  # as the daemon does at unmount
        n.cancel_scope.cancel()
    return took, learner, sched


async def test_a_stage_learned_from_one_checkpoint_is_fetched_at_once_for_the_next(autojump_clock, tmp_path: Path):
    """A pipeline stage (tensors 2, 5 and 6 of 8) loaded from step 1 is recorded; a fresh mount (the
    recordings read back from the file) loading step 2 lands at tensor 2 as step 1's load did: every
    chunk of the stage is fetched at once, nothing else, and the load takes less time than the first."""
    store = FakeStore(latency=0.008)
    path = tmp_path / "learned.json"
    stage = [(2, 0.0, 1.0), (5, 0.0, 1.0), (6, 0.0, 1.0)]
    first, learner, _ = await run_load(store, path, step(store, 1), stage)
    assert learner.statistics().learned == 1
    [rec] = load(path)
    assert (rec.unit, rec.at) == ("2", 0.0) and {n for n, _, _ in rec.spans} == {"2", "5", "6"}

    ckpt = step(store, 2)
    store.log.clear()
    second, learner, sched = await run_load(store, path, ckpt, stage)
    got = fetched(store, ckpt[0])
    print(f"stage: first load {first:.3f} s, learned {second:.3f} s; fetched {sorted(got)}")
    assert learner.statistics().replayed == 1 and learner.statistics().strayed == 0
    assert set(got) == HEAD | chunks_of(2) | chunks_of(5) | chunks_of(6) and len(got) == len(set(got))
    assert second < 0.8 * first
    [p] = learner.plans()
    assert p.done and p.failed_chunks == 0 and p.learned_from == "/f" and p.tensors == 3
    assert learner.statistics().learned == 0       # a load under a plan records nothing


async def test_a_stage_learned_on_one_host_is_fetched_at_once_on_another(autojump_clock, tmp_path: Path):
    """A rank's stage loaded on host A is shared through the stores; the rank restarted on host B (a
    replacement node: nothing learned there) lands where it did on A, asks the stores for that unit's
    recordings (one GET), and gets the stage fetched at once, nothing else. A store that is down costs
    the plan, not the load."""
    store, shared = FakeStore(latency=0.008), MemoryShared()
    stage = [(2, 0.0, 1.0), (5, 0.0, 1.0), (6, 0.0, 1.0)]
    first, a, _ = await run_load(store, tmp_path / "a.json", step(store, 1), stage, shared=shared)
    assert a.statistics().shared_puts == 1 and [r.unit for [r] in shared.objects.values()] == ["2"]

    ckpt = step(store, 2)
    store.log.clear()
    second, b, _ = await run_load(store, tmp_path / "b.json", ckpt, stage, shared=shared)
    print(f"stage on another host: first load {first:.3f} s, learned {second:.3f} s")
    s = b.statistics()
    assert s.shared_gets == 1 and s.shared_got == 1 and s.replayed == 1 and s.strayed == 0
    assert set(fetched(store, ckpt[0])) == HEAD | chunks_of(2) | chunks_of(5) | chunks_of(6)
    assert second < 0.8 * first
    [p] = b.plans()
    assert p.learned_from == "/f" and p.done
    assert [(r.unit, r.at) for r in load(tmp_path / "b.json")] == [("2", 0.0)]     # B keeps it too

    shared.down = True
    store.log.clear()
    _, c, _ = await run_load(store, tmp_path / "c.json", ckpt, stage, shared=shared)
    s = c.statistics()
    assert s.shared_errors == 2 and s.replayed == 0         # its GET at the landing, its PUT after the load
    assert set(fetched(store, ckpt[0])) >= chunks_of(2) | chunks_of(5) | chunks_of(6)


async def test_shared_recordings_that_come_late_still_plan_the_open_and_a_silent_store_is_an_error(
        autojump_clock, tmp_path: Path):
    """A busy host's stores answer the landing's GET after a second: the reader went on without waiting
    and is still loading, so the plan starts then (an earlier cut-off at half a second dropped the
    recordings and left the rank with none). Stores that do not answer within SHARED_WAIT are counted
    as an error and the load goes on with its readahead; the tensors are right either way."""
    store, shared = FakeStore(latency=0.008), MemoryShared()
    stage = [(2, 0.0, 1.0), (5, 0.0, 1.0), (6, 0.0, 1.0)]
    await run_load(store, tmp_path / "a.json", step(store, 1), stage, shared=shared)
    ckpt = step(store, 2)

    shared.latency = 1.0
    _, b, _ = await run_load(store, tmp_path / "b.json", ckpt, stage, compute=0.6, shared=shared)
    s = b.statistics()
    assert (s.shared_gets, s.shared_got, s.replayed, s.strayed, s.shared_errors) == (1, 1, 1, 0, 0)
    [p] = b.plans()
    assert p.learned_from == "/f" and p.done and p.failed_chunks == 0

    shared.latency = SHARED_WAIT + 1
    store.log.clear()
    _, c, _ = await run_load(store, tmp_path / "c.json", ckpt, stage, compute=0.6, shared=shared)
    s = c.statistics()
    assert (s.shared_gets, s.shared_got, s.replayed) == (1, 0, 0) and s.shared_errors >= 1
    assert set(fetched(store, ckpt[0])) >= chunks_of(2) | chunks_of(5) | chunks_of(6)


async def test_an_unmount_during_the_loops_share_still_shares_what_was_learned(autojump_clock, tmp_path: Path):
    """The learner's loop shares a learned load a second after it (a GET and a PUT on slow stores); the
    mount is unmounted meanwhile. The unmount's own share waits for the loop's before the daemon
    cancels the loop: an unmount-time share that found nothing pending (the loop had taken it) and a
    loop cut off mid-PUT left the stores without the recording, and another host without a plan (a
    CI failure: `shared_puts` 0 after a load that was learned)."""
    store, shared = FakeStore(latency=0.008), MemoryShared(latency=0.5)
    ckpt = step(store, 1)
    m, data, index = ckpt
    kernel = Kernel(len(data))
    sched = mount_scheduler(store, kernel)
    learner = Learner(sched, tmp_path / "a.json", shared=shared)
    sched.watcher = learner
    async with trio.open_nursery() as n:
        await n.start(learner.run)
        reader = await sched.open(n, m, index, 1)
        await trio.sleep(0.1)
        await read_parts(kernel, reader, ckpt, [(2, 0.0, 1.0), (5, 0.0, 1.0)], compute=0.02)
        await reader.aclose()
        asked = shared.gets                     # the landing's (nothing was shared yet)
        while shared.gets == asked:             # until the loop's share has begun: its GET is under way
            await trio.sleep(0.05)
        assert learner.statistics().learned == 1 and shared.puts == 0
        await learner.share()                   # as the daemon does at unmount, then it cancels the rest
        n.cancel_scope.cancel()
    s = learner.statistics()
    assert (s.learned, s.shared_puts, s.shared_errors) == (1, 1, 0)
    [recs] = shared.objects.values()
    assert [(r.unit, r.at) for r in recs] == [("2", 0.0)]


async def test_a_shared_recording_a_host_found_mis_guessed_leaves_the_stores(autojump_clock, tmp_path: Path):
    """Host A shares a stage of tensors 1-2 and another landing's part; host B's load of tensors 1-7
    lands at tensor 1, takes the stage's plan, reads on outside it: B drops that recording, and its
    next write of the unit's object leaves it out, keeping what other loads put there."""
    store, shared = FakeStore(latency=0.008), MemoryShared()
    await run_load(store, tmp_path / "a.json", step(store, 1), [(1, 0.0, 1.0), (2, 0.0, 1.0)], shared=shared)
    other = Recording(schema=load(tmp_path / "a.json")[0].schema, unit="1", at=0.5, spans=(("1", 0, 100),),
                      source="/g")
    [key] = shared.objects
    shared.objects[key].append(other)                      # another host's load that landed in tensor 1
    ckpt = step(store, 2)
    _, b, _ = await run_load(store, tmp_path / "b.json", ckpt, [(k, 0.0, 1.0) for k in range(1, TENSORS)],
                             compute=0, shared=shared)
    s = b.statistics()
    assert s.replayed == 1 and s.strayed == 1 and s.shared_puts == 1
    assert shared.objects[key] == [other]


@pytest.mark.parametrize("kind", [STORE_FACTORIES[0], STORE_FACTORIES[-1]])       # folder, s3
async def test_the_stores_keep_shared_recordings_and_a_bad_object_is_an_error_not_a_plan(tmp_path: Path,
                                                                                       kind) -> None:
    """StoreShared over a pool of 3 stores: a unit's recordings round-trip through 2 of them, placed by
    the key; a missing object is none; an object that is not recordings is a SharedError (the learner
    logs it and goes on), and recordings of another unit under the key are not taken."""
    config = parse_config('replicas = 2\n' + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(3)),
                          "test.toml", tmp_path)
    async with contextlib.AsyncExitStack() as stack:
        stores = [await stack.enter_async_context(kind(tmp_path, f"s{i}")) for i in range(3)]
        pool = StorePool(config, stores=stores)
        shared = StoreShared(pool, replicas=2)
        recs = [Recording(schema="s", unit="layers.2.w", at=0.0, spans=(("layers.2.w", 0, 4096),), source="/a")]
        assert await shared.get("s", "layers.2.w") == []
        await shared.put("s", "layers.2.w", recs)
        assert await shared.get("s", "layers.2.w") == recs
        key = StoreShared.key("s", "layers.2.w")
        holders = [n for n in pool.names if await pool.exists(n, key)]
        assert len(holders) == 2 and key.startswith("learned/s/")
        for bad in (b"{not json", b"[" * 100_000 + b"]" * 100_000):      # RecursionError: a SharedError too
            for n in holders:
                await pool.put(n, key, bad)
            with pytest.raises(SharedError, match="not recordings"):
                await shared.get("s", "layers.2.w")
        for n in holders:
            await pool.put(n, key, encode([Recording(**{**recs[0].__dict__, "unit": "x"})]))
        assert await shared.get("s", "layers.2.w") == []
        await pool.aclose()


async def test_a_load_whose_first_request_falls_inside_a_recorded_part_gets_the_plan(autojump_clock, tmp_path: Path):
    """The kernel's first request of the next load comes from halfway into tensor 2 (the pages before
    came with other pushes): inside what the recorded load read of tensor 2, so the plan is its."""
    store = FakeStore(latency=0.008)
    path = tmp_path / "learned.json"
    await run_load(store, path, step(store, 1), [(2, 0.0, 1.0), (5, 0.0, 1.0)])
    ckpt = step(store, 2)
    store.log.clear()
    _, learner, _ = await run_load(store, path, ckpt, [(2, 0.5, 1.0), (5, 0.0, 1.0)])
    assert learner.statistics().replayed == 1
    assert set(fetched(store, ckpt[0])) == HEAD | chunks_of(2) | chunks_of(5)
    # ... but not a load landing in a part of a tensor that the recorded load did not read: rank 3 of 8
    # read its eighth of each tensor, rank 6 lands at 6/8
    await run_load(store, path, step(store, 1), [(k, 3 / 8, 4 / 8) for k in range(TENSORS)])
    _, learner, _ = await run_load(store, path, ckpt, [(k, 6 / 8, 7 / 8) for k in range(TENSORS)], inode=2)
    assert learner.statistics().replayed == 0


async def test_a_slice_learned_is_replayed_for_a_rank_landing_at_the_same_fraction(autojump_clock, tmp_path: Path):
    """Rank 3 of 8 reads its eighth of every tensor; the next load of rank 3 gets every slice at once,
    and nothing of the other ranks' slices."""
    store = FakeStore(latency=0.008)
    path = tmp_path / "learned.json"
    rank3 = [(k, 3 / 8, 4 / 8) for k in range(TENSORS)]
    first, _, _ = await run_load(store, path, step(store, 1), rank3)
    ckpt = step(store, 2)
    store.log.clear()
    second, learner, _ = await run_load(store, path, ckpt, rank3)
    got = fetched(store, ckpt[0])
    print(f"rank 3 of 8: first load {first:.3f} s, learned {second:.3f} s; fetched {sorted(got)}")
    assert learner.statistics().replayed == 1
    assert set(got) == HEAD | {1 + k * PER + 3 for k in range(TENSORS)}
    assert second < first


async def test_a_reader_that_leaves_its_learned_plan_gets_the_readahead_back_and_the_recording_goes(
        autojump_clock, tmp_path: Path):
    """Stage 0 and a whole load both start at tensor 0. A whole load that finds stage 0's recording
    lands outside it at tensor 2: the plan stops, the readahead follows the reader (its bytes all
    right), and the recording is dropped, so the next load learns afresh."""
    store = FakeStore(latency=0.008)
    path = tmp_path / "learned.json"
    await run_load(store, path, step(store, 1), [(0, 0.0, 1.0), (1, 0.0, 1.0)])
    assert len(load(path)) == 1
    ckpt = step(store, 2)
    store.log.clear()
    _, learner, sched = await run_load(store, path, ckpt, [(k, 0.0, 1.0) for k in range(TENSORS)], compute=0)
    s = learner.statistics()
    assert s.replayed == 1 and s.strayed == 1 and s.recordings == 0
    assert load(path) == []
    got = fetched(store, ckpt[0])
    assert sorted(got) == sorted(set(got)) == list(range(len(ckpt[0].chunks)))     # each chunk once
    f = sched.statistics().files[0]
    assert f.prefetched_bytes >= 3 * PER * CHUNK       # the readahead took over: most of tensors 3-7 prefetched


async def test_a_recording_that_served_its_landing_stays_when_a_whole_load_leaves_it(autojump_clock,
                                                                                   tmp_path: Path):
    """A stage of tensors 1-2 is learned and then replayed for a load of it (it served). A load of
    tensors 1-7 lands at tensor 1 as well (a whole load starts as a part load does), takes the plan and
    leaves it: the readahead follows that reader, but the recording stays, so the next load of the
    stage still gets it at once. A second load that leaves it with none served between drops it."""
    store = FakeStore(latency=0.008)
    path = tmp_path / "learned.json"
    stage, rest = [(1, 0.0, 1.0), (2, 0.0, 1.0)], [(k, 0.0, 1.0) for k in range(1, TENSORS)]
    await run_load(store, path, step(store, 1), stage)
    _, learner, _ = await run_load(store, path, step(store, 2), stage)
    assert learner.statistics().replayed == 1 and learner.statistics().strayed == 0
    # one mount from here on: what a recording served is known to the mount that saw it
    ckpt = step(store, 2)
    kernel = Kernel(len(ckpt[1]))
    sched = mount_scheduler(store, kernel)
    learner = Learner(sched, path)
    sched.watcher = learner
    m, _, index = ckpt

    async def load_parts(n: trio.Nursery, inode: int, parts: list[tuple[int, float, float]]) -> None:
        reader = await sched.open(n, m, index, inode)
        await trio.sleep(0.1)
        await read_parts(kernel, reader, ckpt, parts)
        await reader.aclose()
        kernel.pages.clear()                          # the next load is cold again
        sched.cache.clear()
        await trio.sleep(2)

    async with trio.open_nursery() as n:
        await n.start(learner.run)
        await load_parts(n, 1, stage)                 # served
        await load_parts(n, 2, rest)                  # leaves it: it stays
        s = learner.statistics()
        assert (s.replayed, s.strayed, s.recordings) == (2, 1, 1)
        store.log.clear()
        await load_parts(n, 3, stage)                 # the stage at once again
        assert learner.statistics().replayed == 3 and learner.statistics().strayed == 1
        assert set(fetched(store, m)) == HEAD | chunks_of(1) | chunks_of(2)
        await load_parts(n, 4, rest)                  # leaves it: served once since, it stays
        await load_parts(n, 5, rest)                  # leaves it again, none served between: it goes
        assert learner.statistics().strayed == 3 and learner.statistics().recordings == 0
        n.cancel_scope.cancel()


async def test_a_whole_load_is_recorded_as_such_and_replays_nothing(autojump_clock, tmp_path: Path):
    store = FakeStore(latency=0.008)
    path = tmp_path / "learned.json"
    await run_load(store, path, step(store, 1), [(k, 0.0, 1.0) for k in range(TENSORS)], compute=0)
    [rec] = load(path)
    assert rec.whole
    _, learner, _ = await run_load(store, path, step(store, 2), [(k, 0.0, 1.0) for k in range(TENSORS)], compute=0)
    assert learner.statistics().replayed == 0


async def test_two_ranks_reading_one_file_each_follow_their_own_learned_plan(autojump_clock, tmp_path: Path):
    """Two stages of one file, loaded by two processes on one host at once: each open gets its own
    plan, and neither's reads count as leaving the other's."""
    store = FakeStore(latency=0.008)
    path = tmp_path / "learned.json"
    stages = {0: [(1, 0.0, 1.0), (2, 0.0, 1.0)], 1: [(5, 0.0, 1.0), (6, 0.0, 1.0)]}
    for parts in stages.values():
        await run_load(store, path, step(store, 1), parts)
    assert len(load(path)) == 2
    m, data, index = ckpt = step(store, 2)
    store.log.clear()
    kernel = Kernel(len(data))
    sched = mount_scheduler(store, kernel)
    learner = Learner(sched, path)
    sched.watcher = learner

    async def rank(parts) -> None:
        reader = await sched.open(n, m, index, 1)
        await read_parts(kernel, reader, ckpt, parts, compute=0.02)
        await reader.aclose()

    async with trio.open_nursery() as n:
        await n.start(learner.run)
        async with trio.open_nursery() as ranks:
            for parts in stages.values():
                ranks.start_soon(rank, parts)
        n.cancel_scope.cancel()
    s = learner.statistics()
    assert s.replayed == 2 and s.strayed == 0
    got = fetched(store, ckpt[0])
    assert set(got) == HEAD | chunks_of(1) | chunks_of(2) | chunks_of(5) | chunks_of(6)


async def test_torch_loads_zip_header_reads_are_learned_and_replayed_all_at_once(autojump_clock, tmp_path: Path):
    """torch.load(mmap=True) reads every record's zip header through an open of its own, one small read
    after another (a store round trip each when cold). That open is learned too: the next one gets
    every header's chunk at once at its first header read, and its later header reads find them with
    the kernel. (Unlearned, the readahead fetches them all at the second header read: the plan saves
    that one round trip.)"""
    store = FakeStore(latency=0.008)
    path = tmp_path / "learned.json"
    m, data, index, headers = cut_checkpoint(store)

    async def read_headers() -> tuple[float, int, Learner]:
        kernel = Kernel(len(data))
        sched = Scheduler(ChunkCache(256 * CHUNK), store.fetch, config(max=64 * CHUNK, read_ahead_kb=64),
                          on_chunk=kernel.push)
        learner = Learner(sched, path)
        sched.watcher = learner
        async with trio.open_nursery() as n:
            await n.start(learner.run)
            reader = await sched.open(n, m, index)
            await trio.sleep(0.1)
            t0 = trio.current_time()
            for h in headers:
                lo, size = header_read(h)
                assert await kernel.read(reader, lo, size) == data[lo:lo + size]
            took = trio.current_time() - t0
            reads = reader.reads
            await reader.aclose()
            await trio.sleep(2)
            n.cancel_scope.cancel()
        return took, reads, learner

    first, first_reads, learner = await read_headers()
    assert learner.statistics().learned == 1
    store.log.clear()
    second, second_reads, learner = await read_headers()
    print(f"zip headers: first {first:.3f} s in {first_reads} reads, learned {second:.3f} s in {second_reads} reads")
    assert learner.statistics().replayed == 1
    touched = {i for h in headers for i in m.chunk_range(*header_read(h))}
    assert touched <= set(fetched(store, m))
    assert second_reads <= 2 and second_reads < first_reads and second < first


def test_the_schema_is_the_models_not_the_files_and_spans_map_back_to_chunks() -> None:
    store = FakeStore()
    a, b = step(store, 1), step(store, 2)
    sa, sb = (Shape(m, index, layout_for(m, index)) for m, _, index in (a, b))
    assert sa.schema == sb.schema and sa.schema is not None
    other = TensorIndex("torch-zip", a[2].records[:-1], a[2].tensors[:-1], file_size=a[2].file_size,
                        directory_offset=a[2].directory_offset)
    assert Shape(a[0], other, layout_for(a[0], other)).schema != sa.schema
    touched = chunks_of(3) | {1 + 5 * PER + 2}          # tensor 3 whole, one chunk of tensor 5
    spans = sa.spans(touched)
    assert spans == (("3", 0, PER * CHUNK), ("5", 2 * CHUNK, 3 * CHUNK))
    rec = Recording(schema=sa.schema, unit="3", at=0.0, spans=spans, source="/a")
    assert set(sb.chunks(rec)) == HEAD | touched
    assert sa.spans(set(range(len(a[0].chunks)))) is None       # a whole load


def test_the_kept_file_round_trips_and_a_bad_one_is_skipped_and_old_temporaries_go(tmp_path: Path, caplog) -> None:
    path = tmp_path / "learned.json"
    recs = [Recording(schema="s", unit="3", at=0.375, spans=(("3", 0, 100), ("5", 4096, 8192)), source="/a")]
    save(path, recs, 0o640)
    old, young = stale_and_fresh_temporaries(tmp_path)     # daemons killed while writing it, or writing now
    assert load(path) == recs and path.stat().st_mode & 0o777 == 0o640
    # the same document as the dataclass's own (files kept by earlier versions read alike)
    assert json.loads(path.read_bytes()) == json.loads(json.dumps({"format": 1, "recordings": [asdict(recs[0])]}))
    assert not old.exists() and young.exists()
    assert load(tmp_path / "missing.json") == []
    for bad in (b"{", b'{"format": 99, "recordings": []}', b'{"format": 1, "recordings": [{"schema": 1}]}',
                b"[" * 100_000 + b"]" * 100_000,
                json.dumps({"format": 1, "recordings": [{**recs[0].__dict__, "spans": [["3", 9, 2]]}]}).encode()):
        path.write_bytes(bad)
        with caplog.at_level(logging.WARNING, logger="cpfs.learned"):
            caplog.clear()
            assert load(path) == []
        assert "cannot read the learned prefetch plans" in caplog.text
        assert path.read_bytes() == bad                 # left as it was
