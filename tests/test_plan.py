"""Declared prefetch (cpfs/plan.py): a loader names the tensors it will read, and exactly their chunks
are fetched at once. Without a mount here (fake stores, exact virtual time); through a real mount in
test_partial_mount."""
from __future__ import annotations

import fnmatch

import pytest
import trio
import trio.testing

from cpfs.cache import ChunkCache
from cpfs.plan import STALE, Plan, PlanError, chunks_for, matcher, parse_patterns
from cpfs.readahead import PAGE, Scheduler
from cpfs.tensor_index import EOCD_SEARCH, TensorEntry
from test_readahead import (CHUNK, FakeStore, Kernel, checkpoint, config, cut_checkpoint, fetched, make_file,
                            zip_index)


def test_patterns_are_lines_or_commas_and_bad_text_is_refused() -> None:
    assert parse_patterns(b"layers.1.*\nembed.weight, lm_head.*\n\n") == ("layers.1.*", "embed.weight", "lm_head.*")
    for bad in (b"", b" \n, ", b"\xff\xfe"):
        with pytest.raises(PlanError):
            parse_patterns(bad)


def test_a_torch_plan_is_the_head_every_zip_header_and_each_matched_storage() -> None:
    """Cut as chunking.py cuts a torch file: each record's zip header in a small chunk with the ends of
    both neighbouring records. A plan takes the matched records whole, and the small chunk of every
    record's header (torch.load reads them all), nothing else."""
    store = FakeStore()
    m, _, index, headers = cut_checkpoint(store, tensors=8, length=768 * 1024)
    chunks, n = chunks_for(m, index, ("t2", "t5"))
    assert n == 2
    # The zip reader's first read (the end record's search, whole pages: the last record's end with
    # it), the zip directory, data.pkl.
    eocd = (m.size - EOCD_SEARCH) // PAGE * PAGE
    head = [*m.chunk_range(eocd, m.size - eocd), m.chunk_at(64)]
    assert m.chunk_at(eocd) < m.chunk_at(index.directory_offset) == len(m.chunks) - 1
    records = [index.records[1 + k] for k in (2, 5)]
    data = {i for r in records for i in m.chunk_range(r.offset, r.length)}
    small = {m.chunk_at(h) for h in headers}
    assert chunks == head + sorted((data | small) - set(head))
    assert len(data) == 6 and all(m.chunks[i].raw_len < 25_000 for i in small)
    big = {i for i in range(len(m.chunks)) if m.chunks[i].raw_len > 100_000}
    assert big & data == {5, 11}                                        # of the big chunks, t2's and t5's
    assert big & set(chunks) == {5, 11, m.chunk_at(eocd)}               # and the one the end record's search takes
    with pytest.raises(PlanError, match="no tensor matches"):
        chunks_for(m, index, ("layers.*",))
    with pytest.raises(PlanError, match="no tensor index"):
        chunks_for(m, None, ("t1",))


def test_a_record_that_starts_a_chunk_brings_the_chunk_of_its_header_not_its_neighbour() -> None:
    store = FakeStore()
    m, _, index = checkpoint(store, tensors=4, per=2)   # records on chunk boundaries, no header chunks
    chunks, _ = chunks_for(m, index, ("t2",))
    assert chunks == [len(m.chunks) - 1, 0, 5, 6]       # not chunk 4: t1's data


async def run_watched(p: Plan, cache: ChunkCache) -> tuple[float, int]:
    """Run a plan to its end: (seconds it took, the most bytes the cache had pinned meanwhile)."""
    peak_pinned = 0

    async def watch() -> None:
        nonlocal peak_pinned
        while True:
            peak_pinned = max(peak_pinned, cache.statistics().pinned)
            await trio.sleep(0.001)

    async with trio.open_nursery() as n:
        n.start_soon(watch)
        t0 = trio.current_time()
        await p.run()
        took = trio.current_time() - t0
        await trio.testing.wait_all_tasks_blocked()
        n.cancel_scope.cancel()
    return took, peak_pinned


async def test_a_plan_fetches_its_chunks_in_parallel_into_the_page_cache_with_bounded_pins(autojump_clock):
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store, tensors=8, per=8)               # 66 chunks of 64 KiB
    kernel = Kernel(len(data))
    cache = ChunkCache(64 * CHUNK)
    sched = Scheduler(cache, store.fetch, config(concurrency=4), on_chunk=kernel.push)
    p = await Plan.declared(sched, 7, m, index, ("t1", "t6"))
    took, peak_pinned = await run_watched(p, cache)
    want = {0, len(m.chunks) - 1} | set(range(1 + 8, 1 + 16)) | set(range(1 + 48, 1 + 56))
    assert sorted(fetched(store, m)) == sorted(want)                    # exactly those, each once
    assert store.peak == 4                                              # fetch_concurrency at a time
    assert took == pytest.approx(0.008 * len(want) / 4, abs=0.009)
    assert peak_pinned <= 4 * CHUNK and cache.statistics().pinned == 0  # pins end as pushes land
    for i in want - {len(m.chunks) - 1}:                                # the kernel holds their pages
        lo, hi = m.offsets[i], m.offsets[i + 1]
        assert all(pg in kernel.pages for pg in range(lo // 4096, hi // 4096))
        assert bytes(kernel.data[lo:hi]) == data[lo:hi]
    s = p.statistics()
    assert (s.tensors, s.chunks, s.fetched_chunks, s.failed_chunks, s.done) == (2, len(want), len(want), 0, True)
    assert s.fetched_bytes == s.bytes == len(want) * CHUNK


def small_checkpoint(store: FakeStore, tensors: int, per: int) -> tuple:
    """A torch-zip-like file of chunks an eighth of chunk_size each (tensors of 0.5-2 MiB at 4 MiB
    chunks): data.pkl, `tensors` tensors of `per` chunks, the zip directory."""
    piece, n = CHUNK // 8, 2 + tensors * per
    m, data = make_file(store, n, chunk=piece)
    ts = tuple(TensorEntry(f"t{k}", "float32", (per * piece // 4,), (1,), str(k), (1 + k * per) * piece, per * piece)
               for k in range(tensors))
    return m, data, zip_index(ts, n, piece)


async def test_a_plan_of_small_chunks_fetches_them_a_chunk_size_at_a_time(autojump_clock):
    """A plan of a whole checkpoint of small chunks fetches runs of them together, as the readahead
    does: one fetch slot and one fetch_many call (one request per store) per chunk_size of bytes, not a
    task, a slot and a store request per chunk (a declared whole torch.load of 0.5-2 MiB tensors ran at
    0.66x of the same load undeclared). Each chunk once, pins bounded by fetch_concurrency batches,
    every pin gone once the kernel has the pages, which hold the file's bytes."""
    store = FakeStore(latency=0.008)
    m, data, index = small_checkpoint(store, tensors=8, per=8)             # 66 chunks of 8 KiB
    batches: list[list[str]] = []

    async def fetch_many(entries, wheres):
        batches.append([e.digest for e in entries])
        await trio.sleep(0.008)
        return [store.blobs[e.digest] for e in entries]

    kernel = Kernel(len(data))
    cache = ChunkCache(64 * CHUNK)
    sched = Scheduler(cache, store.fetch, config(concurrency=2), on_chunk=kernel.push, fetch_many=fetch_many)
    p = await Plan.declared(sched, 7, m, index, ("*",))
    took, peak_pinned = await run_watched(p, cache)
    alone = [d for _, event, d in store.log if event == "start"]
    assert sorted(alone + [d for b in batches for d in b]) == sorted(c.digest for c in m.chunks)   # each once
    assert alone == [] and [len(b) for b in batches] == [8] * 8 + [2]
    assert took == pytest.approx(0.008 * 9 / 2, abs=0.009)                 # 2 batches at a time
    assert peak_pinned <= 2 * CHUNK and cache.statistics().pinned == 0
    assert all(pg in kernel.pages for pg in range(len(data) // 4096)) and bytes(kernel.data) == data
    s = p.statistics()
    assert (s.chunks, s.fetched_chunks, s.failed_chunks, s.done) == (len(m.chunks), len(m.chunks), 0, True)


async def test_a_plan_cancelled_while_a_batch_is_half_in_leaves_nothing_pinned(autojump_clock):
    """A batch of a cached chunk (pinned for the batch at once) and chunks whose store hangs: the plan
    is cancelled (the loader removed its declaration) and the cached chunk's pin goes with it, so the
    cache can evict it (a pin left behind would hold its bytes until unmount)."""
    store = FakeStore(latency=0.008)
    m, data, index = small_checkpoint(store, tensors=2, per=4)

    async def fetch_many(entries, wheres):
        await trio.sleep_forever()

    cache = ChunkCache(64 * CHUNK)
    sched = Scheduler(cache, store.fetch, config(), fetch_many=fetch_many)
    p = await Plan.declared(sched, 7, m, index, ("*",))
    async with trio.open_nursery() as n:
        await sched.get_chunk(m, p.chunks[1])          # cached, unpinned
        n.start_soon(p.run)
        await trio.sleep(1)
        assert cache.statistics().pinned == m.chunks[p.chunks[1]].raw_len
        p.cancel()
    s = cache.statistics()
    assert (s.pinned, s.inflight) == (0, 0) and p.statistics().done


async def test_a_plan_skips_what_the_kernel_holds_and_counts_chunks_no_store_gives(autojump_clock):
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store, tensors=4, per=4)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(), on_chunk=kernel.push)
    async with trio.open_nursery() as n:
        first = await Plan.declared(sched, 7, m, index, ("t0",))
        await first.run()
        await trio.testing.wait_all_tasks_blocked()
        del store.blobs[m.chunks[1 + 4 + 2].digest]                     # a chunk of t1 no store has
        second = await Plan.declared(sched, 7, m, index, ("t0", "t1"))
        await second.run()
        n.cancel_scope.cancel()
    s = second.statistics()
    assert s.in_kernel_chunks == 2 + 4                                  # the head and t0, pushed before
    assert (s.fetched_chunks, s.failed_chunks) == (3, 1)


async def test_a_plan_declared_again_after_the_kernel_dropped_its_pages_pushes_them_again(autojump_clock):
    """A loader declares the same tensors again (a restarted rank on the node) after the kernel dropped
    their pages without a word (memory pressure; this VM's host reclaims untouched pages). The feeder
    still takes them for the kernel's; the chunks the daemon kept cached (declared ones are) go to the
    kernel again, without a fetch. A plan right after a push (under STALE) trusts the kernel."""
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store, tensors=4, per=4)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(), on_chunk=kernel.push)
    first = await Plan.declared(sched, 7, m, index, ("t1",))
    sched.declare(7, m, frozenset(first.chunks))
    async with trio.open_nursery() as n:
        await first.run()
        await trio.testing.wait_all_tasks_blocked()
        soon = await Plan.declared(sched, 7, m, index, ("t1",))
        await soon.run()
        assert (soon.statistics().in_kernel_chunks, soon.statistics().pushed_again_chunks) == (len(first.chunks), 0)
        await trio.sleep(2 * STALE)
        kernel.pages.clear()                                # dropped, unseen by the daemon
        fetches = len(store.log)
        again = await Plan.declared(sched, 7, m, index, ("t1",))
        sched.declare(7, m, frozenset(again.chunks))
        await again.run()
        await trio.testing.wait_all_tasks_blocked()
        n.cancel_scope.cancel()
    s = again.statistics()
    assert (s.pushed_again_chunks, s.in_kernel_chunks, s.failed_chunks) == (len(first.chunks), 0, 0)
    assert len(store.log) == fetches                        # from the daemon's cache: nothing fetched
    t1 = index.tensors[1]
    pages = range(-(-t1.offset // 4096), (t1.offset + t1.length) // 4096)
    assert all(p in kernel.pages for p in pages)
    assert bytes(kernel.data[t1.offset:t1.offset + t1.length]) == data[t1.offset:t1.offset + t1.length]


async def test_cancelling_a_plan_stops_its_fetches_and_releases_its_pins(autojump_clock):
    store = FakeStore(latency=0.008)
    m, data = make_file(store, 4)
    _, _, index = checkpoint(FakeStore(), tensors=1, per=2)
    cache = ChunkCache(64 * CHUNK)
    store.hang = {c.digest for c in m.chunks}
    sched = Scheduler(cache, store.fetch, config())
    p = await Plan.declared(sched, 7, m, index, ("t0",))
    async with trio.open_nursery() as n:
        n.start_soon(p.run)
        await trio.sleep(1)
        assert store.inflight > 0
        p.cancel()
    assert store.inflight == 0 and p.statistics().done
    s = cache.statistics()
    assert s.pinned == 0 and s.inflight == 0


async def test_a_declared_file_is_prefetched_only_within_its_declaration(autojump_clock):
    """A reader of tensors t1 to t4 in loader order, through the page cache, with only t1 and t2
    declared: the readahead prefetches nothing of t3 and t4 (their chunks come on demand, one read at a
    time); undeclared, its stream prefetches them ahead of the reader."""
    prefetched = {}
    for declare in (False, True):
        store = FakeStore(latency=0.008)
        m, data, index = checkpoint(store, tensors=8, per=8)
        kernel = Kernel(len(data))
        sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=16 * CHUNK), on_chunk=kernel.push)
        chunks, _ = chunks_for(m, index, ("t1", "t2"))
        if declare:
            sched.declare(7, m, frozenset(chunks))
        async with trio.open_nursery() as n:
            reader = await sched.open(n, m, index, 7)
            lo, hi = index.tensors[1].offset, index.tensors[4].offset + index.tensors[4].length
            for off in range(lo, hi, 16 * 1024):
                assert await kernel.read(reader, off, 16 * 1024) == data[off:off + 16 * 1024]
            await reader.aclose()
        s = sched.statistics()
        prefetched[declare] = s.prefetches
        if declare:
            outside = {i for i in fetched(store, m) if i not in chunks}
            assert outside == set(range(1 + 24, 1 + 40))         # t3 and t4, each chunk once...
            assert s.demand_fetches >= len(outside)              # ... on demand
    assert prefetched[True] < prefetched[False] - 8


async def test_a_declared_chunk_stays_cached_after_its_push_so_a_page_the_kernel_drops_costs_no_fetch(autojump_clock):
    """The host may reclaim a few pushed pages before the loader reads them (this VM does within
    seconds). A declared chunk stays in the daemon's cache after its push, so the loader's fault on such
    a page is served without a fetch; undeclared, the chunk leaves the cache once pushed and the same
    fault costs a fetch of the whole chunk."""
    refetched = {}
    for declare in (False, True):
        store = FakeStore(latency=0.008)
        m, data, index = checkpoint(store, tensors=4, per=4)
        kernel = Kernel(len(data))
        sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(), on_chunk=kernel.push)
        p = await Plan.declared(sched, 7, m, index, ("t1",))
        if declare:
            sched.declare(7, m, frozenset(p.chunks))
        async with trio.open_nursery() as n:
            await p.run()
            await trio.testing.wait_all_tasks_blocked()
            data_chunks = [i for i in p.chunks if index.tensors[1].offset <= m.offsets[i] < index.tensors[2].offset]
            in_cache = [m.chunks[i].digest in sched.cache for i in data_chunks]
            assert len(data_chunks) == 4 and (all(in_cache) if declare else not any(in_cache))
            t1 = index.tensors[1]
            page = (t1.offset + t1.length // 2) // 4096
            kernel.pages.discard(page)                      # the host took one page of t1
            reader = await sched.open(n, m, index, 7)
            await trio.testing.wait_all_tasks_blocked()
            before = len(store.log)                         # the head, fetched at open, left out
            assert await kernel.read(reader, page * 4096, 4096) == data[page * 4096:(page + 1) * 4096]
            refetched[declare] = len(store.log) - before
            await reader.aclose()
    assert refetched == {False: 1, True: 0}


async def test_only_a_declaration_that_fits_in_the_ready_buffers_stays_cached_after_its_push(autojump_clock):
    """Each kept chunk holds a read buffer, so a declaration larger than the ready read buffers ([cache]
    buffers: a whole checkpoint) is not kept: its chunks leave the cache once the kernel holds them, as
    undeclared ones do (kept, the fetches behind them backed fresh memory, and a declared whole
    torch.load ran at 0.66x the speed of the same load undeclared). One tensor fits and is kept."""
    for patterns, kept in ((("t1",), True), (("*",), False)):
        store = FakeStore(latency=0.008)
        m, data, index = checkpoint(store, tensors=4, per=4)            # 18 chunks; 8 fit in the ready buffers
        kernel = Kernel(len(data))
        sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(), on_chunk=kernel.push)
        assert sched.config.ready_buffers == 8 * CHUNK
        p = await Plan.declared(sched, 7, m, index, patterns)
        sched.declare(7, m, frozenset(p.chunks))
        async with trio.open_nursery() as n:
            await p.run()
            await trio.testing.wait_all_tasks_blocked()
            n.cancel_scope.cancel()
        in_cache = [m.chunks[i].digest in sched.cache for i in p.chunks]
        assert (len(p.chunks), all(in_cache) if kept else not any(in_cache)) == ((6 if kept else 18), True)
        for i in set(p.chunks) - {len(m.chunks) - 1}:                    # the kernel has them either way
            lo, hi = m.offsets[i], m.offsets[i + 1]
            assert bytes(kernel.data[lo:hi]) == data[lo:hi]


async def test_thousands_of_globs_match_as_fnmatch_does_and_hold_up_no_other_request() -> None:
    """A rank's declaration may name thousands of tensors or globs. Each name tried against each glob
    in the event loop froze every request of the mount for seconds (an audit's find: 3.6 s for 4,444
    patterns). The names match as fnmatch.fnmatchcase says, and the event loop runs on meanwhile."""
    names = [f"model.layers.{i}.{k}" for i in range(250) for k in ("q", "k", "v", "o", "up", "down", "gate", "norm")]
    patterns = ("model.layers.1*", "*.norm", "model.layers.[0-3].q", "model.layers.7?.k", "model.layers.42.up",
                "[*]", "x*y*", *(f"model.layers.{i}.*x{j}*" for i in range(100) for j in range(44)))
    match = matcher(patterns)
    assert [n for n in names if match(n)] == [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    assert 0 < sum(map(match, names)) < len(names)
    store = FakeStore()
    n = 2 + len(names)
    m, _ = make_file(store, n, chunk=4096)
    index = zip_index(tuple(TensorEntry(name, "float32", (1024,), (1,), str(k), (1 + k) * 4096, 4096)
                            for k, name in enumerate(names)), n, 4096)
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(concurrency=4))
    ticks = 0
    declared: list[Plan] = []

    async def declare() -> None:
        declared.append(await Plan.declared(sched, 7, m, index, patterns))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(declare)
        while not declared:
            ticks += 1                    # another request of the mount, answered meanwhile
            await trio.sleep(0.001)
    assert declared[0].tensors == sum(map(match, names)) and ticks >= 10
