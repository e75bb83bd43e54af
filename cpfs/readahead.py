"""The readahead scheduler: turns a reader's small reads into parallel batch fetches.

Per open file a `FileReader` watches the access pattern:
- A file with a tensor index gets a *plan* at open: its chunks in the order a loader reads them (zip
  directory, data.pkl, then the records in pickle order); prefetch starts at once with the full window.
- Any other file is prefetched only once its reads look sequential, with a window that doubles, from
  `readahead.initial` up to `readahead.max`, every time the reader consumes a prefetched chunk.
- Every read fetches all the chunks it needs at once, and with a tensor index also the rest of every
  tensor it touches, pinned, because the reader is about to read all of it.
Prefetched chunks stay pinned in the cache until consumed (read past, or pushed to the kernel page cache
by `on_chunk`), and a prefetch starts only if the window and the cache budget have room, so prefetch
never evicts what the reader is about to read. Demand reads bypass the prefetch limiter, so they never
queue behind prefetch. Closing the file cancels its prefetch.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from .cache import ChunkCache
from .config import Config
from .manifest import ChunkEntry, Manifest
from .pagecache import PageFeeder, Push
from .tensor_index import TensorIndex

log = logging.getLogger(__name__)

Fetch = Callable[[ChunkEntry, str], Awaitable[bytes]]
SEQ_SLACK = 4 * 1024**2    # reads this far behind or ahead of the last one still count as sequential


@dataclass(frozen=True)
class SchedulerStats:
    open_files: int
    reads: int               # read requests served
    read_bytes: int
    demand_fetches: int      # chunk fetches a read waited for
    prefetches: int          # chunk fetches started ahead of the reader
    prefetch_failures: int
    pushed: int              # chunks handed to the kernel page cache
    inflight: int            # chunk fetches in flight now
    peak_inflight: int       # most chunk fetches in flight at once


def plan_for(manifest: Manifest, index: TensorIndex | None) -> list[int] | None:
    """Chunk indices in the order a loader reads an indexed file; None without an index."""
    if index is None or not manifest.chunks:
        return None
    seen: dict[int, None] = {}
    for offset, length in index.read_order():
        for i in manifest.chunk_range(offset, length):
            seen.setdefault(i, None)
    for i in range(len(manifest.chunks)):
        seen.setdefault(i, None)
    return list(seen)


class Scheduler:
    """Shared by every open file of a mount: the fetch limiter, the counters, the task owner."""

    def __init__(self, cache: ChunkCache, fetch: Fetch, config: Config, on_chunk: Push | None = None) -> None:
        self.cache = cache
        self.fetch = fetch
        self.config = config
        self.on_chunk = on_chunk
        self.limiter = trio.CapacityLimiter(config.fetch_concurrency)
        self._open = self._reads = self._read_bytes = 0
        self._demand = self._prefetches = self._failures = 0
        self._inflight = self._peak = 0
        self._feeders: dict[tuple[int, int], PageFeeder] = {}

    def feeder(self, inode: int, manifest: Manifest) -> PageFeeder | None:
        """The page-cache feeder of this version of a file, shared by every open of it, so a second
        open does not fetch again what the kernel holds; None without on_chunk."""
        if self.on_chunk is None:
            return None
        key = (inode, manifest.version)
        if key not in self._feeders:
            self._feeders[key] = PageFeeder(manifest, inode, self.on_chunk, self.cache)
        return self._feeders[key]

    def statistics(self) -> SchedulerStats:
        pushed = sum(f.pushes for f in self._feeders.values())
        return SchedulerStats(self._open, self._reads, self._read_bytes, self._demand, self._prefetches,
                              self._failures, pushed, self._inflight, self._peak)

    async def open(self, nursery: trio.Nursery, manifest: Manifest, index: TensorIndex | None,
                   inode: int = 0) -> "FileReader":
        """A reader whose prefetch task lives in `nursery` until `aclose()`."""
        reader = FileReader(self, manifest, index, inode)
        await nursery.start(reader._run)
        return reader

    async def get_chunk(self, manifest: Manifest, i: int, *, pin: bool = False, demand: bool = True,
                        reserved: bool = False) -> bytes:
        entry = manifest.chunks[i]

        async def load() -> bytes:        # only on a miss: hits cost a dict lookup, no formatting
            if demand:
                self._demand += 1
            self._inflight += 1
            self._peak = max(self._peak, self._inflight)
            where = f"file {manifest.path} offset {manifest.offsets[i]} chunk {i} ({entry.digest[:16]})"
            try:
                return await self.fetch(entry, where)
            finally:
                self._inflight -= 1

        return await self.cache.get(entry.digest, entry.raw_len, load, pin=pin, reserved=reserved)


class FileReader:
    def __init__(self, sched: Scheduler, manifest: Manifest, index: TensorIndex | None, inode: int) -> None:
        self.sched = sched
        self.m = manifest
        self.index = index
        self.inode = inode
        cfg = sched.config
        plan = plan_for(manifest, index)
        self.planned = plan is not None
        self.plan = plan if plan is not None else list(range(len(manifest.chunks)))
        self.pos = {c: p for p, c in enumerate(self.plan)}
        self.window = cfg.readahead_max if self.planned else 0
        self.cursor = 0
        self.max_end: int | None = None
        self.ahead = 0                      # bytes prefetched (pinned or in flight) not yet consumed
        self.pinned: set[int] = set()
        self.inflight: set[int] = set()
        self.feeder = sched.feeder(inode, manifest)
        self.closed = False
        self._wake = trio.Event()
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None

    # -- the per-file task ----------------------------------------------------------------------
    async def _run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.sched._open += 1
        try:
            with self._scope:
                async with trio.open_nursery() as n:
                    self._nursery = n
                    task_status.started()
                    while True:
                        self._fill()
                        await self._wake.wait()
                        self._wake = trio.Event()
        finally:
            self.sched._open -= 1
            for i in self.pinned:
                self.sched.cache.unpin(self.m.chunks[i].digest)
            self.pinned.clear()

    def _kick(self) -> None:
        self._wake.set()

    def _fill(self) -> None:
        """Start prefetches along the plan while the window and the cache budget have room."""
        while self.cursor < len(self.plan) and self.window > 0:
            i = self.plan[self.cursor]
            size = self.m.chunks[i].raw_len
            if self._have(i):
                self.cursor += 1
                continue
            if self.ahead + size > self.window or not self.sched.cache.reserve(size):
                break
            self._start_prefetch(i)
            self.cursor += 1

    def _start_prefetch(self, i: int) -> None:
        assert self._nursery is not None
        self.ahead += self.m.chunks[i].raw_len
        self.inflight.add(i)
        self.sched._prefetches += 1
        self._nursery.start_soon(self._prefetch, i)

    async def _prefetch(self, i: int) -> None:
        """Fetch chunk i into the cache, pinned; the caller reserved room for it, which `get` takes over."""
        size = self.m.chunks[i].raw_len
        try:
            await self.sched.limiter.acquire()
        except BaseException:
            self.sched.cache.release(size)
            raise
        try:
            if self._in_kernel(i):    # another open of the file fetched it while this one waited
                self.sched.cache.release(size)
                self.ahead -= size
                return
            data = await self.sched.get_chunk(self.m, i, pin=True, demand=False, reserved=True)
        except Exception as e:                # logged by the store pool; a demand read will report it
            self.sched._failures += 1
            log.debug("prefetch of %s chunk %d failed: %s", self.m.path, i, e)
            self.ahead -= size
            return
        finally:
            self.sched.limiter.release()
            self.inflight.discard(i)
        self.pinned.add(i)
        if self.feeder is not None:
            # Consumed once the kernel has it: the reader will not ask us, and the window bounds
            # what waits to be pushed.
            self.feeder.offer(self._nursery, i, data, lambda: self._consume(i))
        self._kick()

    def _in_kernel(self, i: int) -> bool:
        return self.feeder is not None and i in self.feeder.sent

    def _have(self, i: int) -> bool:
        """Chunk i needs no prefetch: fetched or being fetched here, with the kernel, or cached."""
        return (i in self.pinned or i in self.inflight or self._in_kernel(i)
                or self.m.chunks[i].digest in self.sched.cache)

    def _consume(self, i: int) -> None:
        if i in self.pinned:
            self.pinned.discard(i)
            self.ahead -= self.m.chunks[i].raw_len
            self.sched.cache.unpin(self.m.chunks[i].digest)
            if not self.planned:
                self.window = min(self.sched.config.readahead_max, max(self.sched.config.readahead_initial,
                                                                      self.window * 2))
            self._kick()

    # -- reads ------------------------------------------------------------------------------------
    def _observe(self, offset: int, end: int, chunks: range) -> None:
        """Update the access pattern after a read of [offset, end) over `chunks`."""
        seq = (offset == 0 and self.max_end is None) or (
            self.max_end is not None and self.max_end - SEQ_SLACK <= offset <= self.max_end + SEQ_SLACK)
        self.max_end = end if self.max_end is None or not seq else max(self.max_end, end)
        last_pos = self.pos[chunks[-1]]
        if self.planned or seq:
            # Everything earlier in the plan is behind the reader now; the last chunk once read to its end.
            for i in [i for i in self.pinned if self.pos[i] < last_pos]:
                self._consume(i)
            if end >= self.m.offsets[chunks[-1] + 1]:
                self._consume(chunks[-1])
        if not self.planned:
            if seq:
                self.window = max(self.window, self.sched.config.readahead_initial)
                self.cursor = max(self.cursor, last_pos + 1)
            else:
                for i in list(self.pinned):
                    self._consume(i)
                self.window = 0
                self.cursor = last_pos + 1
        self._kick()

    def _tensor_batch(self, offset: int, size: int, chunks: range) -> None:
        """Prefetch the rest of every tensor this read touches: the reader will want all of it."""
        if self.index is None:
            return
        for t in self.index.tensors_overlapping(offset, size):
            for i in self.m.chunk_range(t.offset, t.length):
                if i in chunks or self._have(i):
                    continue
                if not self.sched.cache.reserve(self.m.chunks[i].raw_len):
                    return
                self._start_prefetch(i)

    async def read(self, offset: int, size: int) -> bytes | memoryview:
        """Bytes [offset, offset+size), short at end of file."""
        if self.closed:
            raise ValueError("read from a closed file")
        end = min(offset + size, self.m.size)
        chunks = self.m.chunk_range(offset, size)
        if not chunks:
            return b""
        self._tensor_batch(offset, size, chunks)
        datas: list[bytes] = [b""] * len(chunks)

        async def one(k: int, i: int) -> None:
            datas[k] = await self.sched.get_chunk(self.m, i)
            if self.feeder is not None:
                self.feeder.offer(self._nursery, i, datas[k])

        if len(chunks) == 1:
            await one(0, chunks[0])
        else:
            async with trio.open_nursery() as n:
                for k, i in enumerate(chunks):
                    n.start_soon(one, k, i)
        self._observe(offset, end, chunks)
        self.sched._reads += 1
        self.sched._read_bytes += end - offset
        pieces = []
        for data, i in zip(datas, chunks):
            start, stop = self.m.offsets[i], self.m.offsets[i + 1]
            pieces.append(memoryview(data)[max(offset, start) - start:min(end, stop) - start])
        # One chunk: a view, no copy; several: only the requested bytes are copied.
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def aclose(self) -> None:
        """Stop this file's prefetch and release its pins."""
        self.closed = True
        self._scope.cancel()
