"""The readahead scheduler without a mount: fake stores with injected latency, exact virtual time."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing

from cpfs.cache import ChunkCache
from cpfs.chunk import BLOCK, chunk_hash
from cpfs.chunking import LEAD, PAGE, READ_BLOCK, TAIL, cut, tensor_boundaries
from cpfs.config import parse_config
from cpfs.errors import ChunkUnavailable
from cpfs.manifest import ChunkEntry, Manifest
from cpfs.pagecache import RACE
from cpfs.readahead import REFILL_IDLE, FileReader, Scheduler, layout_for, plan_for
from cpfs.tensor_index import Record, TensorEntry, TensorIndex

CHUNK = 64 * 1024


def config(cache: str = "4MiB", initial: int = 4 * CHUNK, max: int = 32 * CHUNK, concurrency: int = 16,
           read_ahead_kb: int = 1024, slice_parts: bool = False):
    text = (f'replicas = 1\nchunk_size = "64KiB"\n[cache]\nmemory = "{cache}"\n[readahead]\n'
            f'initial = {initial}\nmax = {max}\nconcurrency = {concurrency}\n'
            f'slice_parts = {str(slice_parts).lower()}\n'
            f'[mount]\nread_ahead_kb = {read_ahead_kb}\n[[store]]\nname = "s"\nurl = "/nonexistent"\n')
    return parse_config(text, "test", Path("/"))


class FakeStore:
    """Chunks by digest, each fetch taking `latency` seconds of (virtual) time; records what it served."""

    def __init__(self, latency: float = 0.008, hang: set[str] = frozenset()) -> None:
        self.latency = latency
        self.hang = hang          # digests whose fetch never completes
        self.blobs: dict[str, bytes] = {}
        self.log: list[tuple[float, str, str]] = []    # (time, event, digest)
        self.inflight = self.peak = 0
        self.cancelled = 0

    async def fetch(self, entry: ChunkEntry, where: str) -> bytes:
        self.log.append((trio.current_time(), "start", entry.digest))
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            await trio.sleep(self.latency)
            if entry.digest in self.hang:
                await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        finally:
            self.inflight -= 1
        return self.blobs[entry.digest]


def make_file(store: FakeStore, n: int, index: TensorIndex | None = None, seed: int = 0,
              chunk: int = CHUNK) -> tuple[Manifest, bytes]:
    """n raw chunks of `chunk` random bytes, each held by `store` (as store "s"), and their manifest."""
    rng = random.Random(seed)
    data = rng.randbytes(n * chunk)
    chunks = []
    for i in range(n):
        piece = data[i * chunk:(i + 1) * chunk]
        d = chunk_hash(piece)
        store.blobs[d] = piece
        chunks.append(ChunkEntry(d, chunk, chunk, "raw", ("s",)))
    return Manifest("/f", len(data), 0, 0o644, chunk, tuple(chunks), 1, index), data


async def read_all(reader, size: int, step: int = 16 * 1024) -> bytes:
    out = bytearray()
    for off in range(0, size, step):
        out += await reader.read(off, step)
    return bytes(out)


async def test_sequential_read_of_64_chunks_runs_fetches_in_parallel(autojump_clock):
    store = FakeStore(latency=0.008)
    m, data = make_file(store, 64)
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config())
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, None)
        t0 = trio.current_time()
        got = await read_all(reader, m.size)
        elapsed = trio.current_time() - t0
        await reader.aclose()
    assert got == data
    serial = 64 * 0.008
    print(f"sequential 64 x 8 ms: {elapsed * 1000:.0f} ms ({elapsed / serial:.2f} of serial), "
          f"peak concurrency {store.peak}, {sched.statistics()}")
    assert elapsed < serial / 4
    assert store.peak >= 8
    assert sched.statistics().prefetches >= 50
    assert len(store.log) == 64          # every chunk fetched exactly once


async def test_window_grows_from_initial_to_max(autojump_clock):
    store = FakeStore(latency=0.008)
    m, _ = make_file(store, 64)
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(initial=2 * CHUNK, max=8 * CHUNK))
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, None)
        windows = []
        for off in range(0, m.size, CHUNK):
            await reader.read(off, CHUNK)
            windows.append(reader.window)
        await reader.aclose()
    assert windows[0] == 2 * CHUNK
    assert max(windows) == 8 * CHUNK
    assert windows == sorted(windows)


async def test_prefetch_never_exceeds_cache_budget(autojump_clock):
    store = FakeStore(latency=0.004)
    m, data = make_file(store, 64)
    cache = ChunkCache(8 * CHUNK)
    sched = Scheduler(cache, store.fetch, config(max=32 * CHUNK))
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, None)
        out = bytearray()
        for off in range(0, m.size, 16 * 1024):
            out += await reader.read(off, 16 * 1024)
            await trio.sleep(0.001)             # a slow consumer: prefetch would like to run far ahead
            assert cache.statistics().used + cache.statistics().inflight <= cache.budget
        await reader.aclose()
    assert bytes(out) == data
    assert cache.statistics().peak_used <= cache.budget


async def test_closing_cancels_prefetch_and_releases_pins(autojump_clock):
    store = FakeStore(latency=0.001)
    m, _ = make_file(store, 64)
    store.hang = {c.digest for c in m.chunks[2:]}
    cache = ChunkCache(64 * CHUNK)
    sched = Scheduler(cache, store.fetch, config())
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, None)
        await reader.read(0, CHUNK)
        await reader.read(CHUNK, CHUNK)
        await trio.testing.wait_all_tasks_blocked()
        assert store.inflight > 0               # prefetches are running
        await reader.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert store.inflight == 0 and store.cancelled > 0
    assert sched.statistics().open_files == 0
    assert cache.statistics().pinned == 0 and cache.statistics().inflight == 0


def tensor_index(m: Manifest) -> TensorIndex:
    """An index of 4 tensors of 8 chunks each, in file order."""
    tensors = tuple(TensorEntry(f"t{k}", "float32", (8 * CHUNK // 4,), (1,), str(k), k * 8 * CHUNK, 8 * CHUNK)
                    for k in range(4))
    records = tuple(Record(f"archive/data/{k}", t.offset, t.length) for k, t in enumerate(tensors))
    return TensorIndex("torch-zip", records, tensors)


async def test_scattered_read_of_one_tensor_fetches_its_chunks_as_one_batch(autojump_clock):
    store = FakeStore(latency=0.008)
    m, data = make_file(store, 32)
    index = tensor_index(m)
    # A window smaller than a chunk keeps open-time prefetch out of the way: only the batch remains.
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=CHUNK // 2))
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        t0 = trio.current_time()
        assert await reader.read(16 * CHUNK + 100, 4096) == data[16 * CHUNK + 100:16 * CHUNK + 4196]
        await trio.testing.wait_all_tasks_blocked()
        starts = {d: t for t, ev, d in store.log if ev == "start"}
        tensor2 = {m.chunks[i].digest for i in range(16, 24)}
        assert set(starts) == tensor2               # exactly the touched tensor's chunks
        assert all(t == t0 for t in starts.values())  # all started at once: one batch
        before = len(store.log)
        assert await read_all_range(reader, 16 * CHUNK, 8 * CHUNK) == data[16 * CHUNK:24 * CHUNK]
        assert len(store.log) == before             # the rest of the tensor was already there
        await reader.aclose()


async def read_all_range(reader, off: int, length: int) -> bytes:
    return bytes(await reader.read(off, length))


class Kernel:
    """The kernel page cache of one file: pushed and read pages are served without asking the daemon,
    as a mounted file's are, so the scheduler sees only what a real reader would show it."""

    PAGE = 4096

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.pages: set[int] = set()
        self.size = size

    def _mark(self, offset: int, n: int) -> None:
        lo, hi = offset // self.PAGE, -(-(offset + n) // self.PAGE)
        self.pages.update(p for p in range(lo, hi)
                          if (p + 1) * self.PAGE <= offset + n or offset + n == self.size)

    def push(self, inode: int, offset: int, piece, done) -> None:
        """Lands on the next turn of the event loop, as the daemon's pushes land after a thread call."""
        def land() -> None:
            self.data[offset:offset + len(piece)] = piece
            lo = -(-offset // self.PAGE) * self.PAGE
            self._mark(lo, max(0, offset + len(piece) - lo))
            done(None)

        trio.lowlevel.current_trio_token().run_sync_soon(land)

    async def read(self, reader, offset: int, size: int) -> bytes:
        """Like the kernel: the daemon is asked for each run of missing pages the read touches. Pushes
        under way land first (a reader takes time between reads)."""
        await trio.testing.wait_all_tasks_blocked()
        size = min(size, self.size - offset)
        end = offset + size
        missing = [p for p in range(offset // self.PAGE, -(-end // self.PAGE)) if p not in self.pages]
        runs: list[list[int]] = []
        for p in missing:
            if runs and runs[-1][1] == p:
                runs[-1][1] = p + 1
            else:
                runs.append([p, p + 1])
        for lo, hi in runs:
            start, stop = lo * self.PAGE, min(self.size, hi * self.PAGE)
            got = bytes(await reader.read(start, stop - start))
            self.data[start:start + len(got)] = got
            self._mark(start, len(got))
        return bytes(self.data[offset:end])


def checkpoint(store: FakeStore, tensors: int = 8, per: int = 8) -> tuple[Manifest, bytes, TensorIndex]:
    """A torch-zip-like file: data.pkl in chunk 0, `tensors` tensors of `per` chunks, the zip directory
    in the last chunk; the tensors are read in file order."""
    n = 2 + tensors * per
    m, data = make_file(store, n)
    ts = tuple(TensorEntry(f"t{k}", "float32", (per * CHUNK // 4,), (1,), str(k), (1 + k * per) * CHUNK, per * CHUNK)
               for k in range(tensors))
    return m, data, zip_index(ts, n, CHUNK)


def zip_index(ts: tuple[TensorEntry, ...], n: int, chunk: int) -> TensorIndex:
    """The index of a torch-zip-like file of n chunks: data.pkl in chunk 0, the tensors `ts` (a record
    each), the zip directory in the last chunk."""
    records = (Record("archive/data.pkl", 0, chunk),) + tuple(
        Record(f"archive/data/{k}", t.offset, t.length) for k, t in enumerate(ts))
    return TensorIndex("torch-zip", records, ts, file_size=n * chunk, directory_offset=(n - 1) * chunk)


def fetched(store: FakeStore, m: Manifest) -> list[int]:
    """Chunk indices the store served, in order."""
    where = {c.digest: i for i, c in enumerate(m.chunks)}
    return [where[d] for _, ev, d in store.log if ev == "start"]


async def test_open_fetches_only_the_head_and_a_reader_in_plan_order_gets_a_growing_window(autojump_clock):
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store)
    plan = plan_for(m, index)
    assert plan[:2] == [len(m.chunks) - 1, 0] and sorted(plan) == list(range(len(m.chunks)))
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=16 * CHUNK), on_chunk=kernel.push)
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        await trio.sleep(1)
        assert sorted(fetched(store, m)) == [0, len(m.chunks) - 1]     # the zip directory and data.pkl only
        t0 = trio.current_time()
        out = bytearray()
        for off in range(0, m.size, 16 * 1024):
            out += await kernel.read(reader, off, 16 * 1024)
        elapsed = trio.current_time() - t0
        windows = reader.window
        await reader.aclose()
    assert bytes(out) == data
    assert sorted(fetched(store, m)) == list(range(len(m.chunks)))      # each chunk once
    serial = (len(m.chunks) - 2) * 0.008
    print(f"plan-order read: {elapsed / serial:.2f} of serial, peak {store.peak}, window {windows // CHUNK} chunks, "
          f"{sched.statistics().files}")
    assert elapsed < serial / 3 and store.peak >= 4
    assert windows >= 12 * CHUNK           # grew with the run: a quarter of 64 chunks, up to max
    stats = sched.statistics().files[0]
    assert not stats.open and stats.fetched_bytes == m.size - 2 * CHUNK + 2 * CHUNK
    assert stats.prefetch_used_bytes >= stats.prefetched_bytes // 2


async def test_open_fetches_the_pages_the_zip_reader_reads_first_with_their_chunks(autojump_clock):
    """torch's zip reader first reads the file's last 4 KiB, for the end record. With a directory shorter
    than that, those pages hold the last tensor's end too, and the kernel reads whole pages: that chunk
    is fetched at open with the rest of the head (it cost a cold load over remote-like stores a round
    trip of its own). The page the data.pkl record starts in comes with it."""
    store = FakeStore(latency=0.008)
    size = 4 * CHUNK + 1500
    data = random.Random(3).randbytes(size)
    cuts = [0, CHUNK, 2 * CHUNK, 3 * CHUNK, 4 * CHUNK, size]
    chunks = []
    for a, b in zip(cuts, cuts[1:]):
        store.blobs[chunk_hash(data[a:b])] = data[a:b]
        chunks.append(ChunkEntry(chunk_hash(data[a:b]), b - a, b - a, "raw", ("s",)))
    tensor = TensorEntry("t", "float32", ((3 * CHUNK + 500) // 4,), (1,), "0", CHUNK, 3 * CHUNK + 500)
    records = (Record("archive/data.pkl", 100, CHUNK - 200), Record("archive/data/0", tensor.offset, tensor.length))
    index = TensorIndex("torch-zip", records, (tensor,), file_size=size, directory_offset=4 * CHUNK + 500)
    m = Manifest("/f", size, 0, 0o644, CHUNK, tuple(chunks), 1, index)
    assert size - 4096 < 4 * CHUNK and layout_for(m, index).head == (3, 4, 0)
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config())
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        await trio.sleep(1)
        assert sorted(fetched(store, m)) == [0, 3, 4]
        store.log.clear()
        assert await reader.read(size - 4096, 4096) == data[size - 4096:]     # from the cache
        assert await reader.read(0, 4096) == data[:4096]
        assert store.log == []
        await reader.aclose()


async def test_a_sequential_reader_of_a_zip_with_record_headers_between_tensors_is_one_stream(autojump_clock):
    """torch.save puts each record's zip header (a small chunk of its own here) before its data: the plan
    has it just before its tensor, so a reader in file order (torch.load, cat, cp) is one stream whose
    window grows, not a jump at every header (which fetched tensor by tensor: a third of the bandwidth)."""
    store = FakeStore(latency=0.008)
    tensors, per = 16, 4
    n = 2 + tensors * (per + 1)            # data.pkl, (header + tensor) x 16, the zip directory
    m, data = make_file(store, n)
    ts = tuple(TensorEntry(f"t{k}", "float32", (per * CHUNK // 4,), (1,), str(k), (2 + k * (per + 1)) * CHUNK,
                           per * CHUNK) for k in range(tensors))
    records = (Record("archive/data.pkl", 0, CHUNK),) + tuple(
        Record(f"archive/data/{k}", t.offset, t.length) for k, t in enumerate(ts))
    index = TensorIndex("torch-zip", records, ts, file_size=n * CHUNK, directory_offset=(n - 1) * CHUNK)
    assert plan_for(m, index) == [n - 1] + list(range(n - 1))     # the head, then file order
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=16 * CHUNK), on_chunk=kernel.push)
    async with trio.open_nursery() as nursery:
        reader = await sched.open(nursery, m, index)
        await trio.sleep(1)
        t0 = trio.current_time()
        out = bytearray()
        for off in range(0, m.size, 16 * 1024):
            out += await kernel.read(reader, off, 16 * 1024)
        elapsed = trio.current_time() - t0
        await reader.aclose()
    assert bytes(out) == data
    assert sorted(fetched(store, m)) == list(range(n))                  # each chunk once
    stats = sched.statistics().files[0]
    serial = (n - 2) * 0.008
    print(f"file-order read with record headers: {elapsed / serial:.2f} of serial, {stats}")
    # Before: a jump at every header, 46 demand fetches, 0.58 of the serial time.
    assert stats.pattern == "stream" and stats.demand_fetches < tensors
    assert elapsed < serial / 4


async def test_a_whole_file_reader_finds_the_window_filled_ahead_a_quarter_at_a_time(autojump_clock):
    """A reader that takes time between reads (2 ms per chunk, fetches take 8 ms) never waits once its
    window is full: held chunks a quarter window apart tell the daemon where it is while most of the window
    is still ahead. With one such chunk, at the window's far end, the reader emptied the window, then
    waited for every refill."""
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store)
    kernel = Kernel(len(data))
    # Reads of a chunk and the kernel's readahead (the stream's slack) scaled down with the chunks, as
    # tensors are to them: its first read into the second tensor shows a whole-tensor reader.
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=8 * CHUNK, read_ahead_kb=16),
                      on_chunk=kernel.push)
    waited: dict[int, float] = {}
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        await trio.sleep(1)
        out = bytearray()
        for off in range(0, m.size, CHUNK):
            t0 = trio.current_time()
            out += await kernel.read(reader, off, CHUNK)
            waited[off] = trio.current_time() - t0
            await trio.sleep(0.002)                         # the reader's own work
        assert reader.window == 8 * CHUNK
        await reader.aclose()
    assert bytes(out) == data
    assert sorted(fetched(store, m)) == list(range(len(m.chunks)))      # each chunk once
    late = sum(w for off, w in waited.items() if off >= m.size // 2)   # the window is full from a half on
    print(f"waits: {sum(waited.values()) * 1000:.0f} ms in all, {late * 1000:.0f} ms in the second half")
    assert late == 0


async def test_a_reader_at_a_mark_finds_the_rest_of_its_chunk_with_the_kernel(autojump_clock):
    """Page faults come faster than a push lands (a thread call, the kernel's copy). A stream's mark was
    held whole, pushed only once the reader's read reached it, and the reader's next faults in that
    chunk outran the push: each asked the daemon. Gated, the mark's pages but the first went to the
    kernel when it was fetched: the reader asks for that one page, and for nothing else once the
    window is full."""
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store)
    asked: list[tuple[int, int]] = []
    async with trio.open_nursery() as n:
        kernel = SlowKernel(len(data), n, delay=0.003)
        sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=8 * CHUNK, read_ahead_kb=16),
                          on_chunk=kernel.push)
        reader = Asked(await sched.open(n, m, index), asked)
        await trio.sleep(1)
        out = bytearray()
        for off in range(0, m.size, 16 * 1024):       # a fault every millisecond, 16 KiB around it
            out += await kernel.read(reader, off, 16 * 1024)
            await trio.sleep(0.001)
        assert reader.reader.window == 8 * CHUNK
        await reader.reader.aclose()
    assert bytes(out) == data
    assert sorted(fetched(store, m)) == list(range(len(m.chunks)))      # each chunk once
    late = [(off, size) for off, size in asked if off >= m.size // 2]   # the window is full from a half on
    print(f"{len(asked)} reads reached the daemon, {len(late)} in the second half: {late}")
    assert late and all(off % CHUNK == 0 and size == 4096 for off, size in late)


class SlowKernel(Kernel):
    """A page cache whose pushes land `delay` seconds after they are made."""

    def __init__(self, size: int, nursery: trio.Nursery, delay: float) -> None:
        super().__init__(size)
        self.nursery, self.delay = nursery, delay

    def push(self, inode: int, offset: int, piece, done) -> None:
        async def land() -> None:
            await trio.sleep(self.delay)
            super(SlowKernel, self).push(inode, offset, piece, done)
        self.nursery.start_soon(land)


class Asked:
    """A reader whose reads (what reached the daemon) are logged."""

    def __init__(self, reader, log: list[tuple[int, int]]) -> None:
        self.reader, self.log = reader, log

    async def read(self, offset: int, size: int):
        self.log.append((offset, size))
        return await self.reader.read(offset, size)


@pytest.mark.parametrize("per", [8, 32])
async def test_a_loader_whose_threads_read_each_tensors_halves_at_once_keeps_one_stream(autojump_clock, per: int):
    """torch's ops on a mapped tensor run on several threads: `.sum()` of a tensor read through
    safetensors' mapping faults in its two halves at once, so the mount sees reads alternate between
    the tensor's first and second half. Those jumps inside one tensor (behind the stream, or ahead
    within what its window fetched) are one whole-tensor reader, not one leaving its tensor: its window
    grows across tensors as a single reader's does. Taken for jumps, each reset the window to a chunk
    and the reader was judged to read parts, so every tensor came with a fetch on demand (a 512 MiB
    safetensors checkpoint: 31-46 demand fetches, 7-10 now; 610 FUSE reads, 370-420 now). Tensors of
    32 chunks: the second thread's first read lies past the first window, a landing inside the tensor,
    and the first thread's next read there is no reader leaving it either."""
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store, tensors=128 // per, per=per)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(256 * CHUNK), store.fetch, config(max=32 * CHUNK, read_ahead_kb=16),
                      on_chunk=kernel.push)
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        await trio.sleep(1)
        for t in index.tensors:
            half = t.length // 2
            for off in range(t.offset, t.offset + half, CHUNK):       # the two threads, a chunk each in turn
                for at in (off, off + half):
                    assert await kernel.read(reader, at, CHUNK) == data[at:at + CHUNK]
                await trio.sleep(0.001)
        window, demand = reader.window, reader.demand
        await reader.aclose()
    got = fetched(store, m)
    print(f"window {window // CHUNK} chunks, {demand} fetches on demand")
    assert sorted(got) == list(range(len(m.chunks)))                    # each chunk once
    assert window >= 16 * CHUNK and demand <= 8


async def test_a_loader_from_the_head_gets_a_doubling_window_in_its_first_tensor(autojump_clock):
    """A loader's first tensor is often its biggest (an embedding). From the head, until the reader shows
    how it reads tensors, the window is all it has read, not a quarter: the reader (1 ms per chunk,
    fetches of 8 ms) waits for nothing after its 16th chunk of 64 (with a quarter, it waited up to the
    40th). A reader that stops in that tensor leaves at most as much as it read fetched and unused."""
    async def load(stop: int) -> tuple[list[float], list[int], int]:
        """Read the first tensor's first `stop` chunks: waits, chunks fetched, how many at open."""
        store = FakeStore(latency=0.008)
        m, data, index = checkpoint(store, tensors=2, per=64)
        kernel = Kernel(len(data))
        sched = Scheduler(ChunkCache(256 * CHUNK), store.fetch, config(max=64 * CHUNK, read_ahead_kb=16),
                          on_chunk=kernel.push)
        waited = []
        async with trio.open_nursery() as n:
            reader = await sched.open(n, m, index)
            await trio.sleep(1)
            head = len(fetched(store, m))
            for off in range(CHUNK, (1 + stop) * CHUNK, CHUNK):
                t0 = trio.current_time()
                assert await kernel.read(reader, off, CHUNK) == data[off:off + CHUNK]
                waited.append(trio.current_time() - t0)
                await trio.sleep(0.001)                     # the loader's copy of a chunk
            await trio.sleep(0.1)
            await reader.aclose()
        return waited, fetched(store, m), head

    waited, got, _ = await load(64)
    print(f"waits in the first tensor: {[round(w * 1000) for w in waited]} ms")
    assert len(got) == len(set(got)) and sum(waited[16:]) == 0
    _, got, head = await load(8)                              # a reader that stops an eighth in
    assert len(got) - head <= 2 * 8 + 2


async def read_tensor(kernel: Kernel, reader, t: TensorEntry, lo: float = 0.0, hi: float = 1.0,
                      step: int = 16 * 1024) -> bytes:
    out = bytearray()
    start, end = t.offset + int(lo * t.length), t.offset + int(hi * t.length)
    for off in range(start, end, step):
        out += await kernel.read(reader, off, min(step, end - off))
    return bytes(out)


async def test_a_reader_that_skips_tensors_gets_what_it_touches(autojump_clock):
    """A pipeline stage: whole tensors 1, 4 and 6 of 8; nothing of the others but a stream's overshoot."""
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=16 * CHUNK), on_chunk=kernel.push)
    wanted = [1, 4, 6]
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        for k in wanted:
            t = index.tensors[k]
            assert await read_tensor(kernel, reader, t) == data[t.offset:t.offset + t.length]
        await trio.sleep(1)
        await reader.aclose()
    got = set(fetched(store, m))
    read = 2 * CHUNK + len(wanted) * 8 * CHUNK
    print(f"stage of 3 tensors: fetched chunks {sorted(got)}")
    assert len(fetched(store, m)) == len(got)                     # nothing twice
    assert not got & {c for k in (0, 3) for c in range(1 + 8 * k, 9 + 8 * k)}   # the skipped ones: untouched
    assert len(got) * CHUNK <= 1.3 * read + 2 * CHUNK * 2 * len(wanted)
    f = sched.statistics().files[0]
    assert f.fetched_bytes == len(got) * CHUNK and f.prefetch_wasted_bytes <= f.prefetched_bytes


async def test_a_reader_of_the_start_of_each_tensor_stops_getting_whole_tensors(autojump_clock):
    """Rank 0 of a tensor-parallel group: the first eighth of every tensor. The first tensor is fetched
    whole (nothing says otherwise yet); once the reader leaves it early, only what it touches."""
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=16 * CHUNK), on_chunk=kernel.push)
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        for t in index.tensors:
            assert await read_tensor(kernel, reader, t, 0, 1 / 8) == data[t.offset:t.offset + t.length // 8]
        await trio.sleep(1)
        await reader.aclose()
    got = set(fetched(store, m))
    firsts = {1 + 8 * k for k in range(8)}
    assert firsts <= got
    extra = got - firsts - {0, len(m.chunks) - 1}
    print(f"rank 0 of 8: fetched {sorted(got)}; beyond the slices: {sorted(extra)}")
    assert extra <= set(range(2, 9)) | {10}      # the rest of the first tensor, at most a chunk more
    assert reader.whole is False


async def test_a_slice_reader_gets_its_slices_and_the_next_ones_ahead(autojump_clock):
    """Rank 3 of 8 reads its eighth (one chunk) of each tensor: only those chunks are fetched, and after
    two landings at the same fraction the next tensors' slices arrive before the reader asks."""
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=16 * CHUNK), on_chunk=kernel.push)
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        await trio.sleep(1)
        waits = []
        for t in index.tensors:
            t0 = trio.current_time()
            assert await read_tensor(kernel, reader, t, 3 / 8, 4 / 8) == \
                data[t.offset + 3 * t.length // 8:t.offset + 4 * t.length // 8]
            waits.append(trio.current_time() - t0)
            await trio.sleep(0.02)                 # the rank computes between tensors
        await reader.aclose()
    got = fetched(store, m)
    slices = {1 + 8 * k + 3 for k in range(8)}
    print(f"rank 3 of 8: fetched {sorted(got)}; waits {[round(w * 1000) for w in waits]} ms")
    assert set(got) == slices | {0, len(m.chunks) - 1} and len(got) == len(set(got))
    assert all(w == 0 for w in waits[3:])     # predicted: there before the reader came
    f = sched.statistics().files[0]
    assert f.prefetch_wasted_bytes == 0 and f.prefetch_used_bytes >= 5 * CHUNK


def cut_checkpoint(store: FakeStore, tensors: int = 8, length: int = 768 * 1024, first: int | None = None
                   ) -> tuple[Manifest, bytes, TensorIndex, list[int]]:
    """A torch-zip-like file cut as chunking cuts it with 1 MiB chunks: data.pkl, then `tensors` records
    of `length` bytes (the first of `first`, if given), each after its zip local header (and the previous
    record's data descriptor), then the zip directory. Also returns the local header offsets."""
    chunk_size = 1024 * 1024
    records, headers, pos = [Record("archive/data.pkl", 64, 2000)], [], 2064
    for k in range(tensors):
        start = -(-(pos + 16 + 90) // 64) * 64       # descriptor, header; torch aligns data to 64 bytes
        headers.append(pos + 16)
        records.append(Record(f"archive/data/{k}", start, first if k == 0 and first else length))
        pos = start + records[-1].length
    size = pos + 16 + 1000
    ts = tuple(TensorEntry(f"t{k}", "float32", (r.length // 4,), (1,), str(k), r.offset, r.length)
               for k, r in enumerate(records[1:]))
    index = TensorIndex("torch-zip", tuple(records), ts, file_size=size, directory_offset=pos + 16)
    data = random.Random(0).randbytes(size)
    chunks = []
    for off, n in cut(size, chunk_size, tensor_boundaries(index, chunk_size)):
        piece = data[off:off + n]
        store.blobs[chunk_hash(piece)] = piece
        chunks.append(ChunkEntry(chunk_hash(piece), n, n, "raw", ("s",)))
    return Manifest("/f", size, 0, 0o644, chunk_size, tuple(chunks), 1, None), data, index, headers


def header_read(h: int) -> tuple[int, int]:
    """What the kernel asks for when a buffered reader (st_blksize READ_BLOCK) reads a local header at h."""
    lo = h // PAGE * PAGE
    return lo, -(-(h + READ_BLOCK) // PAGE) * PAGE - lo


async def test_reading_every_zip_header_fetches_the_header_chunks_at_once_and_nothing_else(autojump_clock):
    """torch.load(mmap=True) reads the local header of every record through a buffered file (and the
    data through a mapping of its own): the header reads land nowhere and move no stream, so nothing
    is fetched but the chunks they touch, the header's and the record's small first one (LEAD). From
    the second header read in file order past the head on, the header chunks after it come at once (a
    round trip each before), so the reads after it wait for nothing."""
    store = FakeStore(latency=0.008)
    m, data, index, headers = cut_checkpoint(store, tensors=16)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(256 * CHUNK), store.fetch, config(max=64 * CHUNK), on_chunk=kernel.push)
    waits = []
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        await trio.sleep(1)
        head = set(fetched(store, m))
        for h in headers:
            lo, size = header_read(h)
            t0 = trio.current_time()
            assert await kernel.read(reader, lo, size) == data[lo:lo + size]
            waits.append(trio.current_time() - t0)
            await trio.sleep(0.02)
        await trio.sleep(1)
        await reader.aclose()
    touched = {i for h in headers for i in m.chunk_range(*header_read(h))}
    got = fetched(store, m)
    assert set(got) == head | touched and len(got) == len(set(got))
    assert sum(m.chunks[i].raw_len for i in touched) <= len(headers) * (LEAD + TAIL + 2 * PAGE)
    # The first header lies in the head (fetched at open); the next two are fetched as read.
    assert [w > 0 for w in waits[:3]] == [False, True, True] and not any(waits[3:]), waits
    ahead = {i for h in headers[3:] for i in m.chunk_range(*header_read(h))}
    f = sched.statistics().files[0]
    assert f.prefetched_bytes == sum(m.chunks[i].raw_len for i in head | ahead) and f.pattern != "stream"
    assert f.prefetch_wasted_bytes == 0 and f.demand_fetches == 2


async def test_a_loader_reading_headers_and_data_in_file_order_is_one_stream(autojump_clock):
    """torch.load without mmap on the same layout: each record's header read, then its data. The header
    reads (the first of each record) do not break the stream: each chunk is fetched once, most ahead."""
    store = FakeStore(latency=0.008)
    m, data, index, headers = cut_checkpoint(store, tensors=16)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(256 * CHUNK), store.fetch, config(max=64 * CHUNK), on_chunk=kernel.push)
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        await trio.sleep(1)
        t0 = trio.current_time()
        for h, r in zip(headers, index.records[1:]):
            lo, size = header_read(h)
            assert await kernel.read(reader, lo, size) == data[lo:lo + size]
            for off in range(lo + size, r.offset + r.length, 16 * 1024):
                n_ = min(16 * 1024, r.offset + r.length - off)
                assert await kernel.read(reader, off, n_) == data[off:off + n_]
        elapsed = trio.current_time() - t0
        await reader.aclose()
    got = fetched(store, m)
    assert len(got) == len(set(got)) and set(range(len(m.chunks) - 1)) <= set(got)
    f = sched.statistics().files[0]
    serial = len(m.chunks) * 0.008
    print(f"headers and data in file order: {elapsed / serial:.2f} of serial, {f}")
    assert f.pattern == "stream" and f.demand_fetches <= 8 and elapsed < serial / 3


async def test_a_whole_tensor_reader_whose_reads_start_at_record_headers_keeps_its_window(autojump_clock):
    """torch.load reads each storage whole: the kernel asks for 1 MiB from the page of the record's zip
    header, and the rest of the record is in pages the daemon pushed. After a big first tensor (an
    embedding), the reads that reach the daemon start at header pages; the first of them reads that
    tensor to its end, which shows a whole-tensor reader, and from then on such reads move the stream:
    the records after it are fetched ahead. Before, header reads left the window held at the first
    tensor's end, and the next 12 records waited 8 ms each for a fetch of their own (a 988 MiB
    checkpoint over remote-like stores: five serial fetches of ~11 ms after its embedding)."""
    store = FakeStore(latency=0.008)
    m, data, index, headers = cut_checkpoint(store, tensors=40, first=16 * 1024 * 1024 + 4096)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(256 * CHUNK), store.fetch, config(max=256 * CHUNK), on_chunk=kernel.push)
    first = index.records[1]
    waited: list[float] = []
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, index)
        await trio.sleep(1)
        reads = [(off, 1024 * 1024) for off in range(headers[0] // PAGE * PAGE, first.offset + first.length - PAGE,
                                                     1024 * 1024)]
        reads += [(h // PAGE * PAGE, 1024 * 1024) for h in headers[1:]]
        for off, size in reads:
            t0 = trio.current_time()
            assert await kernel.read(reader, off, size) == data[off:off + size]
            waited.append(trio.current_time() - t0)
            await trio.sleep(0.002)                     # the loader's copy of a record from the page cache
        await reader.aclose()
    assert reader.whole
    got = fetched(store, m)
    assert len(got) == len(set(got))                    # each chunk once
    late = waited[len(waited) // 3:]
    print(f"waits: {sum(waited) * 1000:.0f} ms in all, {sum(late) * 1000:.0f} ms after the first third")
    assert sum(late) == 0


async def test_demand_reads_do_not_queue_behind_prefetch(autojump_clock):
    store = FakeStore(latency=0.008)
    m, data = make_file(store, 64)
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=64 * CHUNK, concurrency=2))
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, tensor_index(make_file(FakeStore(), 64)[0]))
        for off in range(0, 24 * CHUNK, 16 * 1024):      # a stream: its window keeps 2-wide prefetch busy
            await reader.read(off, 16 * 1024)
        await trio.testing.wait_all_tasks_blocked()
        assert store.inflight == 2 and reader.window >= 3 * CHUNK
        t0 = trio.current_time()
        assert await reader.read(60 * CHUNK, 100) == data[60 * CHUNK:60 * CHUNK + 100]
        assert trio.current_time() - t0 <= 0.008 + 1e-9   # one fetch latency, not behind 2-wide prefetch
        await reader.aclose()


async def test_failing_replica_falls_back_to_the_other(tmp_path, caplog):
    """Through the real StorePool: one store's copy is corrupt, the read still returns the right bytes."""
    from cpfs.catalog import Catalog
    from cpfs.config import load_config
    from cpfs.importer import Importer
    from cpfs.chunk import chunk_key
    from cpfs.pool import StorePool
    from cpfs.store import ThrottledStore, open_store
    from tests.conftest import write_config

    cfg = load_config(write_config(tmp_path, stores=2, replicas=2, chunk_size="64KiB"))
    src = tmp_path / "f.bin"
    payload = random.Random(1).randbytes(5 * CHUNK)
    src.write_bytes(payload)
    pool = StorePool(cfg)
    [m] = await Importer(pool, Catalog(pool)).put(src, "f.bin")
    victim = m.chunks[2]
    bad = tmp_path / "stores" / victim.stores[0] / "chunks" / victim.digest[:2] / victim.digest
    blob = bytearray(bad.read_bytes())
    blob[-1] ^= 0xFF
    bad.write_bytes(bytes(blob))
    # The store with the good copy sits behind a slow link (and has shown it): the corrupt copy's
    # store ranks first, so the corrupt copy is tried first.
    good = victim.stores[1]
    pool = StorePool(cfg, stores=[ThrottledStore(s, latency=0.5) if s.name == good else s
                                  for s in map(open_store, cfg.stores)])
    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(pool.head, good, chunk_key(victim.digest))
    sched = Scheduler(ChunkCache(cfg.cache_memory), pool.fetch_chunk, cfg)
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, None)
        got = await read_all(reader, m.size)
        await reader.aclose()
    assert got == payload
    assert any("corrupt replica" in r.message and victim.stores[0] in r.message and "offset 131072" in r.message
               for r in caplog.records)


async def test_no_replica_gives_chunk_unavailable_naming_file_offset_chunk_and_stores(tmp_path):
    store = FakeStore()
    m, _ = make_file(store, 4)

    async def broken(entry: ChunkEntry, where: str) -> bytes:
        raise ChunkUnavailable(f"{where}: no replica (stores {', '.join(entry.stores)})")

    sched = Scheduler(ChunkCache(64 * CHUNK), broken, config())
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, None)
        try:
            await reader.read(2 * CHUNK + 5, 10)
        except ChunkUnavailable as e:
            msg = str(e)
        # A read over several chunks raises one chunk's error as it is, not an ExceptionGroup (which
        # the FUSE boundary would log as a crash).
        with pytest.raises(ChunkUnavailable, match=r"file /f offset \d+ chunk [0-3]"):
            await reader.read(CHUNK - 5, 2 * CHUNK + 10)
        await reader.aclose()
    assert "file /f" in msg and f"offset {2 * CHUNK}" in msg and "chunk 2" in msg and "stores s" in msg


async def test_two_opens_of_one_file_fetch_each_chunk_once(autojump_clock):
    """torch.load(mmap=True) opens a checkpoint twice: the second open must not fetch again what the
    first pushed to the kernel (and dropped from the cache)."""
    store = FakeStore(latency=0.008)
    m, data, index = checkpoint(store, tensors=4)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=8 * CHUNK, concurrency=2),
                      on_chunk=kernel.push)

    async def read_all_through_kernel(reader) -> bytes:
        out = bytearray()
        for off in range(0, m.size, 16 * 1024):
            out += await kernel.read(reader, off, 16 * 1024)
        return bytes(out)

    async with trio.open_nursery() as n:
        first = await sched.open(n, m, index, inode=5)
        second = await sched.open(n, m, index, inode=5)
        async with trio.open_nursery() as readers:
            readers.start_soon(read_all_through_kernel, first)
            await trio.sleep(0.004)
            readers.start_soon(read_all_through_kernel, second)
        await trio.sleep(1)
        await first.aclose()
        await second.aclose()
    assert bytes(kernel.data) == data
    assert sorted(fetched(store, m)) == list(range(len(m.chunks))), "every chunk fetched exactly once"
    assert sched.cache.statistics().pinned == 0 and sched.cache.statistics().inflight == 0


async def test_prefetches_started_together_go_to_fetch_many_a_chunk_size_at_a_time(autojump_clock):
    """Small chunks that the stream prefetches in one go are fetched together (fetch_many: one batch
    request per store), at most chunk_size bytes per batch, so a file of many small pieces costs a
    fetch slot and a store request per chunk_size, not per piece; each chunk is fetched once and the
    bytes read are the file's."""
    store = FakeStore(latency=0.008)
    piece, n = CHUNK // 8, 256
    data = random.Random(3).randbytes(piece * n)
    chunks = []
    for i in range(n):
        d = chunk_hash(data[i * piece:(i + 1) * piece])
        store.blobs[d] = data[i * piece:(i + 1) * piece]
        chunks.append(ChunkEntry(d, piece, piece, "raw", ("s",)))
    m = Manifest("/f", len(data), 0, 0o644, CHUNK, tuple(chunks), 1, None)
    batches: list[list[str]] = []

    async def fetch_many(entries, wheres):
        batches.append([e.digest for e in entries])
        assert all(f"chunk {m.chunks.index(e)} " in w for e, w in zip(entries, wheres))
        await trio.sleep(0.008)
        return [store.blobs[e.digest] for e in entries]

    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(), fetch_many=fetch_many)
    async with trio.open_nursery() as nursery:
        reader = await sched.open(nursery, m, None)
        t0 = trio.current_time()
        got = await read_all(reader, m.size, step=4096)
        elapsed = trio.current_time() - t0
        await reader.aclose()
    assert got == data
    alone = [d for _, event, d in store.log if event == "start"]
    together = [d for b in batches for d in b]
    assert sorted(alone + together) == sorted(c.digest for c in chunks), "each chunk fetched once"
    assert max(map(len, batches)) == 8 and len(together) > n * 3 // 4
    print(f"{n} pieces of {piece} bytes: {len(batches)} batches, {len(alone)} alone, {elapsed * 1000:.0f} ms")
    assert elapsed < n * 0.008 / 8
    assert sched.cache.statistics().pinned == 0 and sched.cache.statistics().inflight == 0


class BlockStore(FakeStore):
    """A FakeStore that also serves the blocks around a range (StorePool.fetch_blocks), or refuses to
    (None: no block checks, a copy stored lz4) when `blocks` is False."""

    def __init__(self, latency: float = 0.008, blocks: bool = True) -> None:
        super().__init__(latency)
        self.blocks = blocks

    async def fetch_blocks(self, entry: ChunkEntry, start: int, end: int, where: str) -> tuple[int, bytes] | None:
        if not self.blocks:
            return None
        self.log.append((trio.current_time(), "blocks", entry.digest))
        await trio.sleep(self.latency / 4)
        lo, hi = start // BLOCK * BLOCK, min(entry.raw_len, -(-end // BLOCK) * BLOCK)
        return lo, self.blobs[entry.digest][lo:hi]


def _block_file(store: BlockStore, n: int, seed: int, window: int) -> tuple[Manifest, bytes, Kernel, Scheduler]:
    """A file of n raw chunks of 4 blocks of random bytes, each held by `store` (as store "s"), and a
    scheduler over `store` that pushes to a Kernel, reads blocks, and prefetches `window` chunks ahead."""
    size = 4 * BLOCK
    m, data = make_file(store, n, seed=seed, chunk=size)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * size), store.fetch, config(cache="64MiB", max=window * size),
                      on_chunk=kernel.push, fetch_blocks=store.fetch_blocks)
    return m, data, kernel, sched


async def _read_through(kernel: Kernel, reader: FileReader, data: bytes) -> None:
    """Read the whole file in 64 KiB reads, then wait until a read of a pushed page would count as lost."""
    for off in range(0, len(data), 64 * 1024):
        assert await kernel.read(reader, off, 64 * 1024) == data[off:off + 64 * 1024]
    await trio.sleep(RACE + 0.1)


async def test_pages_the_kernel_lost_are_read_from_their_blocks_and_their_chunks_cached_once_idle(autojump_clock):
    """A page the kernel was given and lost (a host reclaiming cold pages) costs the reader the blocks
    around it, not its chunk; once no read has come for REFILL_IDLE, the chunk is loaded into the cache,
    so the next page lost beside it costs no fetch. Without blocks to be had, the chunk is read."""
    for blocks in (True, False):
        store = BlockStore(blocks=blocks)
        big = 4 * BLOCK
        m, data, kernel, sched = _block_file(store, 6, seed=5, window=2)
        async with trio.open_nursery() as n:
            await n.start(sched.run)
            reader = await sched.open(n, m, None, inode=3)
            await _read_through(kernel, reader, data)
            assert len(kernel.pages) == len(data) // Kernel.PAGE and sched.cache.statistics().used == 0
            store.log.clear()
            demand = sched.statistics().demand_fetches
            lost = [big + BLOCK + 3 * Kernel.PAGE, 4 * big + 5 * Kernel.PAGE, 4 * big + 3 * BLOCK]
            kernel.pages -= {off // Kernel.PAGE for off in lost}
            before = reader.statistics().lost_read_bytes
            for off in lost:                     # read back to back: no idle moment between them
                assert await kernel.read(reader, off, 100) == data[off:off + 100]
            assert before == 0 and reader.statistics().lost_read_bytes == 3 * Kernel.PAGE   # a page each
            events = [(ev, m.chunks.index(next(c for c in m.chunks if c.digest == d))) for _, ev, d in store.log]
            if blocks:
                assert events == [("blocks", 1), ("blocks", 4), ("blocks", 4)]
                st = sched.statistics()
                assert (st.block_fetches, st.block_bytes, st.demand_fetches - demand) == (3, 3 * BLOCK, 0)
                await trio.sleep(REFILL_IDLE + 0.1)
                assert [e for _, e, _ in store.log[3:]] == ["start", "start"] and sched.statistics().refilled == 2
                store.log.clear()
                again = 4 * big + 2 * BLOCK
                kernel.pages.discard(again // Kernel.PAGE)
                assert await kernel.read(reader, again, 100) == data[again:again + 100]
                assert store.log == [], "the chunk was loaded: a page lost beside the first costs no fetch"
            else:
                assert events == [("start", 1), ("start", 4)]     # the second page of chunk 4: a cache hit
            await reader.aclose()
            n.cancel_scope.cancel()


async def test_a_lost_pages_chunk_that_cannot_be_loaded_is_counted_as_given_up(autojump_clock):
    """The idle-time load of a chunk with lost pages is a bonus: the reader already had its bytes. When
    it fails (here the store no longer has the chunk) it is counted in `refill_skipped`, the queue
    empties, and the other chunk still loads: `refilled` + `refill_skipped` account for every chunk."""
    store = BlockStore()
    m, data, kernel, sched = _block_file(store, 6, seed=7, window=2)
    async with trio.open_nursery() as n:
        await n.start(sched.run)
        reader = await sched.open(n, m, None, inode=3)
        await _read_through(kernel, reader, data)
        lost = [m.chunks[0].raw_len + 5 * Kernel.PAGE, 3 * m.chunks[0].raw_len + BLOCK]     # in chunks 1 and 3
        kernel.pages -= {off // Kernel.PAGE for off in lost}
        for off in lost:
            assert await kernel.read(reader, off, 100) == data[off:off + 100]
        st = sched.statistics()
        assert (st.block_fetches, st.refill_queued, st.refilled, st.refill_skipped) == (2, 2, 0, 0)
        del store.blobs[m.chunks[1].digest]
        await trio.sleep(REFILL_IDLE + 0.1)
        st = sched.statistics()
        assert (st.refill_queued, st.refilled, st.refill_skipped) == (0, 1, 1)
        assert not sched.cache.absent(m.chunks[3].digest) and sched.cache.absent(m.chunks[1].digest)
        await reader.aclose()
        n.cancel_scope.cancel()


async def test_a_page_lost_in_the_first_second_after_its_push_is_a_lost_page(autojump_clock):
    """This VM's host pages out untouched file pages within a second of their push, while the loader is
    on its way to them. The kernel asks for a page it holds only after dropping it (a read sent before
    the push holds the pages locked, and the push waits for it), so such a read is a drop from RACE
    after the push on: counted lost and served from the blocks around it, not a whole chunk fetched."""
    store = BlockStore()
    big = 4 * BLOCK
    m, data, kernel, sched = _block_file(store, 4, seed=6, window=4)
    async with trio.open_nursery() as n:
        reader = await sched.open(n, m, None, inode=3)
        for o in range(0, len(data), 64 * 1024):
            assert await kernel.read(reader, o, 64 * 1024) == data[o:o + 64 * 1024]
        await trio.sleep(0.3)
        assert len(kernel.pages) == len(data) // Kernel.PAGE and sched.cache.statistics().used == 0
        store.log.clear()
        off = 2 * big + BLOCK + 5 * Kernel.PAGE
        kernel.pages.discard(off // Kernel.PAGE)
        assert await kernel.read(reader, off, 100) == data[off:off + 100]
        assert reader.statistics().lost_read_bytes == Kernel.PAGE
        assert [ev for _, ev, _ in store.log] == ["blocks"]
        await reader.aclose()
        n.cancel_scope.cancel()


async def test_a_reply_takes_its_pages_out_of_queued_pushes_but_not_a_reply_to_an_o_direct_open(autojump_clock):
    """A buffered read's reply fills the kernel's pages (Pusher.replied leaves them out of pushes still
    queued); an O_DIRECT open's does not, so its reads must not take anything out."""
    store = FakeStore(latency=0.008)
    m, data = make_file(store, 8)
    kernel = Kernel(len(data))
    told: list[tuple[int, int, int]] = []
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(), on_chunk=kernel.push,
                      on_reply=lambda *a: told.append(a))
    async with trio.open_nursery() as n:
        direct = await sched.open(n, m, None, inode=3, direct=True)
        assert bytes(await direct.read(CHUNK + 10, 2 * CHUNK)) == data[CHUNK + 10:3 * CHUNK + 10]
        await direct.aclose()
        assert told == []
        buffered = await sched.open(n, m, None, inode=3)
        assert bytes(await buffered.read(CHUNK + 10, 2 * CHUNK)) == data[CHUNK + 10:3 * CHUNK + 10]
        assert bytes(await buffered.read(7 * CHUNK, CHUNK + 99)) == data[7 * CHUNK:]
        await buffered.aclose()
    assert told == [(3, CHUNK + 4096, 3 * CHUNK), (3, 7 * CHUNK, 8 * CHUNK)]


async def test_an_o_direct_reader_of_a_file_the_kernel_holds_gets_a_stream_and_leaves_the_pushes_alone(autojump_clock):
    """O_DIRECT reads bypass the kernel's pages: they come to the daemon although every page of the file
    was pushed long ago. They are not pages the kernel dropped (the file is not pushed again, nothing
    is counted lost), and the chunks the kernel holds are fetched for this reader, ahead of it and in
    parallel, each once."""
    store = FakeStore(latency=0.008)
    m, data = make_file(store, 32)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config(max=8 * CHUNK), on_chunk=kernel.push)
    async with trio.open_nursery() as n:
        buffered = await sched.open(n, m, None, inode=3)
        out = bytearray()
        for off in range(0, m.size, 16 * 1024):
            out += await kernel.read(buffered, off, 16 * 1024)
        assert bytes(out) == data
        await buffered.aclose()
        await trio.sleep(RACE + 1)
        assert len(kernel.pages) * Kernel.PAGE == m.size and sched.cache.statistics().used == 0
        pushed, store.log, store.peak = sched.statistics().pushed, [], 0

        direct = await sched.open(n, m, None, inode=3, direct=True)
        t0 = trio.current_time()
        assert await read_all(direct, m.size, step=CHUNK // 4) == data     # dd iflag=direct bs=1M, 4 MiB chunks
        took = trio.current_time() - t0
        st = direct.statistics()
        await direct.aclose()
    assert st.lost_read_bytes == 0 and sched.statistics().kernel_drops == 0
    assert sched.statistics().pushed == pushed, "an O_DIRECT reader pushes nothing: its reads do not fill the page cache"
    assert sorted(fetched(store, m)) == list(range(32)), "each chunk fetched once"
    assert store.peak >= 4 and st.demand_fetches <= 8 and took < 32 * store.latency / 2
    assert sched.cache.statistics().pinned == 0


class SizedBlockStore(BlockStore):
    """A BlockStore that records the bytes of each fetch: ("chunk" | "blocks", digest, bytes)."""

    def __init__(self, latency: float = 0.008) -> None:
        super().__init__(latency)
        self.moved: list[tuple[str, str, int]] = []

    async def fetch(self, entry: ChunkEntry, where: str) -> bytes:
        data = await super().fetch(entry, where)
        self.moved.append(("chunk", entry.digest, len(data)))
        return data

    async def fetch_blocks(self, entry: ChunkEntry, start: int, end: int, where: str) -> tuple[int, bytes] | None:
        got = await super().fetch_blocks(entry, start, end, where)
        if got is not None:
            self.moved.append(("blocks", entry.digest, len(got[1])))
        return got


async def test_a_slice_reader_of_large_chunks_fetches_its_slices_not_their_chunks(autojump_clock):
    """Rank 3 of 8 reads its eighth (two of a chunk's four blocks) of each tensor. From its first
    landing inside a tensor, what it reads of a chunk is fetched as those blocks (checked alone), not as
    the chunk; once its second landing shows it reads parts of tensors, the next tensors' slices arrive
    as blocks ahead of it. The bytes are the file's."""
    store = SizedBlockStore()
    chunk, per, tensors = 4 * BLOCK, 4, 8
    n = 2 + tensors * per
    ts = tuple(TensorEntry(f"t{k}", "float32", (per * chunk // 4,), (1,), str(k), (1 + k * per) * chunk,
                           per * chunk) for k in range(tensors))
    index = zip_index(ts, n, chunk)
    m, data = make_file(store, n, index, seed=5, chunk=chunk)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * chunk), store.fetch, config(cache="64MiB", max=16 * chunk, slice_parts=True),
                      on_chunk=kernel.push, fetch_blocks=store.fetch_blocks)
    async with trio.open_nursery() as nursery:
        reader = await sched.open(nursery, m, index)
        await trio.sleep(1)
        waits = []
        for t in index.tensors:
            t0 = trio.current_time()
            assert await read_tensor(kernel, reader, t, 3 / 8, 4 / 8, step=64 * 1024) == \
                data[t.offset + 3 * t.length // 8:t.offset + 4 * t.length // 8]
            waits.append(trio.current_time() - t0)
            await trio.sleep(0.02)                 # the rank computes between tensors
        stats = sched.statistics()
        await reader.aclose()
    where = {c.digest: i for i, c in enumerate(m.chunks)}
    whole = sorted(where[d] for kind, d, _ in store.moved if kind == "chunk")
    blocks = sum(size for kind, _, size in store.moved if kind == "blocks")
    print(f"rank 3 of 8: chunks {whole}, {blocks // 1024} KiB of blocks; waits {[round(w * 1000) for w in waits]} ms")
    slice_chunks = {1 + per * k + 1 for k in range(tensors)}      # 3/8..4/8 of a tensor: its second chunk
    # The first landing, inside a tensor, is judged by where the reader goes next: its chunk comes in
    # blocks too (a whole chunk pushed to the kernel would hide the reader's next reads). Only the head
    # (data.pkl, the zip directory) comes whole.
    assert set(whole) == {0, n - 1} and len(whole) == len(set(whole))
    assert blocks == tensors * chunk // 2
    assert stats.part_fetches >= tensors and stats.part_bytes == blocks
    assert all(w == 0 for w in waits[3:])         # predicted: there before the reader came
    assert not set(whole) & slice_chunks
    await trio.testing.wait_all_tasks_blocked()
    assert sched.cache.room(64 * chunk)           # no pin, no reservation left behind
    f = sched.statistics().files[0]
    assert f.pattern == "slices" and f.prefetch_wasted_bytes == 0 and f.fetched_bytes == 2 * chunk + blocks


async def test_a_slice_reader_of_tensors_smaller_than_a_chunk_is_seen_to_read_slices(autojump_clock):
    """24 tensors of 768 KiB in 1 MiB chunks, rank 3 of 8 reading its 96 KiB of each. Each slice lies in
    the chunk after the last one's: it looked like a stream, the reader seemed to go on from one
    tensor into the next, and the whole file was fetched (8.9x what it read). A read that skipped a
    tensor's start (neither read nor held here) is a landing: the reader is seen to read slices and
    gets the blocks they lie in, plus the head. The estimate of a slice's length no longer counts the
    next slice's read (the predicted slices were 2-5x too long)."""
    store = SizedBlockStore()
    chunk, tensors = 4 * BLOCK, 24
    tlen = 3 * BLOCK
    n = 2 + -(-tensors * tlen // chunk)
    ts = tuple(TensorEntry(f"t{k:02d}", "float32", (tlen // 4,), (1,), str(k), chunk + k * tlen, tlen)
               for k in range(tensors))
    index = zip_index(ts, n, chunk)
    m, data = make_file(store, n, index, seed=7, chunk=chunk)
    kernel = Kernel(len(data))
    sched = Scheduler(ChunkCache(64 * chunk), store.fetch, config(cache="64MiB", max=16 * chunk, read_ahead_kb=64,
                                                                  slice_parts=True),
                      on_chunk=kernel.push, fetch_blocks=store.fetch_blocks)
    blocks_read: set[int] = set()
    async with trio.open_nursery() as nursery:
        reader = await sched.open(nursery, m, index)
        await trio.sleep(1)
        for t in index.tensors:
            lo, hi = t.offset + 3 * t.length // 8, t.offset + 4 * t.length // 8
            assert await read_tensor(kernel, reader, t, 3 / 8, 4 / 8) == data[lo:hi]
            blocks_read.update(range(lo // BLOCK, -(-hi // BLOCK)))
            await trio.sleep(0.02)
        st = reader.statistics()
        await reader.aclose()
    whole = sum(size for kind, _, size in store.moved if kind == "chunk")
    blocks = sum(size for kind, _, size in store.moved if kind == "blocks")
    print(f"read {tensors * tlen // 8 // 1024} KiB: whole chunks {whole // 1024} KiB, blocks {blocks // 1024} KiB "
          f"(the slices lie in {len(blocks_read) * BLOCK // 1024} KiB of blocks), file {len(data) // 1024} KiB")
    assert st.pattern == "slices"
    assert whole <= 3 * chunk                     # the head, the zip directory, the first landing's chunk
    assert blocks <= len(blocks_read) * BLOCK + 4 * BLOCK
    assert whole + blocks < len(data) * 0.45


class LostStore(FakeStore):
    """A FakeStore with no copy of the chunks in `lost`: their fetch fails after the latency, naming
    whoever asked (as the pool does)."""

    def __init__(self, lost: set[str], latency: float = 0.008) -> None:
        super().__init__(latency)
        self.lost = lost

    async def fetch(self, entry: ChunkEntry, where: str) -> bytes:
        if entry.digest in self.lost:
            await trio.sleep(self.latency)
            raise ChunkUnavailable(f"{where}: no replica")
        return await super().fetch(entry, where)


def _file(path: str, chunks: list[ChunkEntry]) -> Manifest:
    return Manifest(path, sum(c.raw_len for c in chunks), 0, 0o644, CHUNK, tuple(chunks), 1, None)


async def test_a_read_that_joins_another_files_failing_fetch_fails_naming_its_own_file(autojump_clock):
    """Two files share a chunk that no store can give; the second read joins the first's fetch. Its
    error (the EIO's log line) names its own file and offset, not the other's (an audit's find)."""
    m, _ = make_file(FakeStore(), 2)
    x = m.chunks[1]
    store = LostStore({x.digest}, latency=0.05)
    a, b = _file("/a", [x]), _file("/b", [m.chunks[0], x])
    store.blobs[m.chunks[0].digest] = b"\0" * CHUNK
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config())
    errors: dict[str, str] = {}
    async with trio.open_nursery() as n:
        ra, rb = await sched.open(n, a, None), await sched.open(n, b, None)

        async def read(name: str, reader, off: int) -> None:
            with pytest.raises(ChunkUnavailable) as e:
                await reader.read(off, CHUNK)
            errors[name] = str(e.value)
        async with trio.open_nursery() as m2:
            m2.start_soon(read, "/a", ra, 0)
            await trio.sleep(0.01)
            m2.start_soon(read, "/b", rb, CHUNK)
        await ra.aclose()
        await rb.aclose()
    assert sched.cache.statistics().joined == 1
    assert errors["/a"].startswith("file /a offset 0 chunk 0")
    assert errors["/b"].startswith(f"file /b offset {CHUNK} chunk 1"), errors["/b"]


async def test_a_chunk_cached_for_one_file_is_refused_to_a_manifest_that_gives_it_another_length(autojump_clock):
    """/a names chunk X rightly; /b names X with a page more than it has. Once /a's read cached X, a read
    of /b gets EIO naming /b, never X's bytes sliced at the wrong length (an audit found /b's read
    answered short, the next chunk's bytes a page early)."""
    store = FakeStore()
    m, data = make_file(store, 2)
    x, y = m.chunks
    wrong = ChunkEntry(x.digest, x.raw_len + PAGE, x.stored_len, "raw", ("s",))
    a, b = _file("/a", [x]), _file("/b", [wrong, y])
    sched = Scheduler(ChunkCache(64 * CHUNK), store.fetch, config())
    async with trio.open_nursery() as n:
        ra = await sched.open(n, a, None)
        assert await ra.read(0, CHUNK) == data[:CHUNK]
        rb = await sched.open(n, b, None)
        with pytest.raises(ChunkUnavailable, match="file /b offset 0 chunk 0.*a manifest says"):
            await rb.read(0, b.size)
        await ra.aclose()
        await rb.aclose()
