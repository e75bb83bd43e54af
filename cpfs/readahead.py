"""The readahead scheduler: turns a reader's small reads into parallel batch fetches, and fetches what
the reader will read, not the rest of the file.

Per open file a `FileReader` follows what the reader does, along the file's *plan* (with a tensor index:
the order a loader reads it, i.e. the zip directory and data.pkl, then the storages in pickle order,
each after the chunk of its zip header when that lies outside every tensor; the
safetensors header, then the tensors by name, as `safe_open().keys()` lists them; a safetensors file is
also followed in file order, for `cat`). Without an index the plan is file order.
- At open it prefetches only the *head*, what every loader reads first (zip directory, data.pkl and the
  small records; the safetensors header). Nothing else moves until the reader asks; reads of the head
  later say nothing about the reader.
- A read that continues the last one along the plan (the next chunk, or the first one after what was
  fetched ahead of it; a little behind counts too, as the kernel's readahead requests arrive out of
  order) extends a *stream*: a window along the plan that grows with what the stream has read:
  `readahead.initial` (at most two chunks from the head, one after a jump), then 1/4 of the run, up to
  `readahead.max`. A reader that stops therefore leaves at most that or a quarter of what it read
  fetched and unread. (A stream from the head, until the reader has shown how it reads tensors, gets
  the whole run: a loader's first tensor is often its biggest, an embedding, and a reader that stops in
  it leaves at most as much as it read.) The window
  crosses into the next tensor only once the reader has shown it reads whole tensors (it went on from
  one tensor into the next beyond the kernel's readahead, or read a tensor of several chunks to its end).
- A read that starts at a torch record's zip local header (less than HEADER_REACH before its data) is
  a loader reading that header: it lands nowhere and leaves the window as it is (a loader that goes on
  into the data extends the stream with its next read). torch.load(mmap=True) reads every record's
  header through a file of its own, and nothing else there: taken for a stream or for landings, those
  reads fetched the tensors behind the headers. chunking.py cuts records so that such a read fetches
  one small chunk. Once the reader has shown that it reads whole tensors, such a read moves its stream
  (it is torch.load's read of the record from the header's page) but is still never a landing.
- A whole-tensor reader's reads inside the tensor it is in, or ahead within what its window fetched,
  continue its stream wherever they fall: torch's ops on a mapped tensor run on several threads, each
  faulting in its own part (`.sum()` reads the two halves at once).
- A read that jumps ends the stream. If it covers a tensor's start (the kernel reads around a page
  fault), the rest of that tensor is fetched at once, in parallel, unless the reader has shown that it
  reads parts of tensors. A landing inside a tensor is judged by the next read: if that one goes on to
  the next tensor's start, the landing was the kernel's read-around; if the reader jumps again, it reads
  parts. Two landings at the same fraction of their tensors are slices: the matching slice of the next
  few tensors (in loader order) is fetched ahead. A read in the next chunk that skipped the start of
  its tensor (bytes neither read nor held here) is a landing too: with tensors smaller than a chunk, a
  rank's slices lie in consecutive chunks and looked like a stream.
- Whether the reader reads whole tensors is learnt from one chunk held back: prefetched chunks go to
  the kernel page cache (`on_chunk`), after which the reader's reads of them never reach us. So the
  last chunk of a tensor fetched at a landing, the chunk a quarter into a stream window and predicted
  slice chunks are *held*: kept pinned in our cache and not pushed, so the reader's arrival there shows
  (a reader that reads it reads whole tensors; one that jumps past it does not), and the stream advances
  when the reader reaches a quarter of its window. A stream's marks are *gated*: all but their first
  page goes to the kernel once fetched (cpfs/pagecache.py), so the reader, once past that page, finds
  the rest there and does not race its push. One more chunk is held every quarter window along
  the stream after it (`marks`), so the window is refilled a quarter at a time while three quarters of
  it are still ahead. With the first alone, the refill resumed at the window's far end, the next marker
  landed there, and the reader emptied the window before the daemon heard of it again: over remote-like
  stores the links stood idle while it did (cold torch.load of 512 MiB over 3 stores at 5 ms / 400
  MiB/s: 0.66 -> 0.63 s for large tensors, 0.90 -> 0.87 s for 0.5-2 MiB ones).
Prefetched chunks stay pinned in the cache until consumed (read, passed by the stream, or pushed to the
kernel), and a prefetch starts only if the window and the cache budget have room, so prefetch never
evicts what the reader is about to read. Demand reads bypass the prefetch limiter, so they never queue
behind prefetch. Closing the file cancels its prefetch.
Prefetches started in one go (a window's worth, a tensor at a landing) are fetched in *batches* of up to
chunk_size bytes: one task and one fetch slot per batch, and one store request for the chunks of a batch
a store holds (`fetch_many`, StorePool.fetch_chunks). A file of many small pieces (1 MiB tensors, the
zip-header chunks between them) then costs about what one of large chunks costs per byte.

A read of pages the kernel was given and has lost since (a host reclaiming a VM's cold pages, memory
pressure) fetches only the blocks around them, checked against the manifest's block checks
(StorePool.fetch_blocks), when the daemon no longer holds their chunk; the chunk itself is loaded into
the cache later, once no read has come for REFILL_IDLE (`Scheduler.run`), for the pages lost beside them.

With `[readahead] slice_parts` on (off by default: a whole-tensor `torch.load(mmap=True)` reader can be
taken for one of slices, and parts, never pushed, made its cold load + read 2.1 -> 2.8 s in `make demo`),
a reader that has shown it reads parts of tensors (two landings at the same fraction: a rank's row slice)
gets *parts* of chunks, not whole chunks: runs of blocks, fetched the same way and checked against the
same block checks, for what it reads and for the matching slices it will read next. With chunks larger
than a slice, whole chunks moved several times the slice (a 1 MiB chunk for a 0.3 MiB slice); parts move
the slice rounded out to blocks. A part is held in the cache's budget until read or passed, like a
prefetched chunk, and never pushed to the kernel: the reader reads it through us, which also tells us
where it is. A landing inside a tensor not yet judged is read in parts too: its chunk pushed whole
would hide the reader's next reads, which judge it. A chunk whose parts fail to fetch is read whole from
then on. A reader judged to read whole tensors again (it read on from its landing to the end of a
tensor) goes back to whole chunks.

Each reader counts bytes read, bytes fetched for it, and prefetched bytes used and wasted (`FileStats`,
in `Scheduler.statistics().files`, open files and the last closed ones). "Used" means read through the
daemon or passed by a later read of the same stream; a prefetched chunk the kernel served that the reader
then left behind without a later read counts as wasted, so the waste figure is an upper bound.
"""
from __future__ import annotations

import bisect
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio

from .cache import ChunkCache
from .chunk import BLOCK
from .chunking import LEAD, TAIL
from .config import Config
from .errors import ChunkUnavailable, CpfsError
from .manifest import ChunkEntry, Manifest
from .pagecache import PageFeeder, Push, Replied
from .sync import fan_out
from .tensor_index import TensorIndex

log = logging.getLogger(__name__)

Fetch = Callable[[ChunkEntry, str], Awaitable[bytes]]
# Several chunks at once, in order, an exception in the place of one that failed (StorePool.fetch_chunks).
FetchMany = Callable[[Sequence[ChunkEntry], Sequence[str]], Awaitable[Sequence[bytes | memoryview | Exception]]]
# The checked blocks of a chunk covering raw bytes [start, end): (their offset, bytes), or None if they
# cannot be had alone (StorePool.fetch_blocks).
FetchBlocks = Callable[[ChunkEntry, int, int, str], Awaitable[tuple[int, bytes] | None]]
RECENT_FILES = 16          # closed files whose statistics stay visible
SLICE_TOLERANCE = 0.01     # landings this close (as a fraction of their tensors) are the same slice
SLICE_AHEAD = 4            # tensors whose predicted slice is fetched ahead
FRONTIER_SCAN = 4096       # chunks a continuity check looks across at most
PAGE = 4096
HEADER_REACH = 2 * PAGE    # a read from this close before a torch record's data starts at its zip header
REFILL_IDLE = 0.25         # seconds without a read before chunks with lost pages are loaded (Scheduler.run)
REFILL_QUEUE = 4096        # such chunks remembered at most
STRAY_CHUNKS = 4           # chunks' worth of reads outside a learned plan before a reader has left it
HEADER_CHUNK_MAX = 4 * (LEAD + TAIL)    # a chunk this small holding a zip header comes with any torch plan
WRITING = -1               # Scheduler._pushable: the file is being written here, push no version


class Watcher(Protocol):
    """Told where each reader first lands past the file's head, when it reads outside a learned plan,
    and when it closes: cpfs/learned.py learns prefetch plans from what readers did."""

    def landed(self, reader: "FileReader") -> None: ...

    def strayed(self, reader: "FileReader", offset: int, end: int) -> None: ...

    def closed(self, reader: "FileReader") -> None: ...


@dataclass(frozen=True, kw_only=True)
class FileStats:
    path: str
    inode: int
    open: bool
    reads: int
    read_bytes: int              # bytes the reader asked for (that reached the daemon)
    lost_read_bytes: int         # ... in reads of pages pushed to the kernel that it dropped since
    fetched_bytes: int           # bytes of chunks fetched from the stores for this open file
    demand_fetches: int          # chunk fetches a read of this file waited for
    prefetched_bytes: int        # bytes of the prefetches this file started
    prefetch_used_bytes: int     # ... later read, or passed by a later read of the same stream
    prefetch_wasted_bytes: int   # ... never seen used by the time the file was closed
    pattern: str                 # "stream", "tensors", "slices" or "unknown": what the reader looks like
    window: int                  # the stream window now


@dataclass(frozen=True, kw_only=True)
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
    fetched_bytes: int = 0           # bytes of chunks fetched from the stores (demand and prefetch)
    prefetched_bytes: int = 0
    prefetch_used_bytes: int = 0     # of closed files (see FileStats)
    prefetch_wasted_bytes: int = 0   # of closed files
    kernel_drops: int = 0            # times the kernel was found to have dropped pages pushed to it
    block_fetches: int = 0           # reads of pages the kernel lost, served by fetching their blocks
    block_bytes: int = 0             # ... bytes those fetches brought (in fetched_bytes too)
    part_fetches: int = 0            # fetches of part of a chunk for a reader of slices (FileReader._read_parts)
    part_bytes: int = 0              # ... bytes they brought (in fetched_bytes too)
    refilled: int = 0                # chunks of those loaded into the cache afterwards, when idle
    refill_queued: int = 0           # ... and waiting for the mount to be idle
    refill_skipped: int = 0          # ... and given up: the queue overflowed, the cache had no room, the
                                     # fetch failed (the reader had its bytes; only the later hits are lost)
    feeders: int = 0                 # file versions whose pushes are tracked now (until the kernel forgets them)
    written_files: int = 0           # files written here, whose pages take pushes of one version (until forgotten)
    files: tuple[FileStats, ...] = ()


@dataclass(frozen=True)
class Unit:
    """A span the loader reads as one piece: a torch storage record or a safetensors tensor."""
    offset: int
    length: int
    first: int               # its first and last chunk
    last: int


@dataclass(frozen=True)
class Layout:
    plan: tuple[int, ...]    # every chunk once, in loader order
    head: tuple[int, ...]    # the chunks every loader reads first
    units: tuple[Unit, ...]  # by file offset
    loader_units: tuple[int, ...]   # indices into units, in loader order


def page_chunks(manifest: Manifest, offset: int, length: int) -> range:
    """The chunks of the whole pages bytes [offset, offset+length) touch: the kernel reads whole pages,
    so a page the range shares with a neighbour brings that neighbour's chunk."""
    lo, hi = offset // PAGE * PAGE, min(manifest.size, -(-(offset + length) // PAGE) * PAGE)
    return manifest.chunk_range(lo, hi - lo)


def layout_for(manifest: Manifest, index: TensorIndex | None) -> Layout:
    """The plan, head and units of a file; without an index the plan is file order and there are none."""
    n = len(manifest.chunks)
    if index is None or not n:
        return Layout(tuple(range(n)), (), (), ())
    data = set(index.record_starts())
    ordered = index.read_order()
    head_ranges = [r for r in ordered if r[0] not in data]
    if index.format == "safetensors":
        spans = {(t.offset, t.length): t.name for t in index.tensors if t.length > 0}
        loader = sorted(spans, key=lambda r: spans[r])
    else:
        loader = list(dict.fromkeys(r for r in ordered if r[0] in data))
    by_offset = sorted(set(loader))
    units = tuple(Unit(o, ln, manifest.chunk_at(o), manifest.chunk_at(min(o + ln, manifest.size) - 1))
                  for o, ln in by_offset if o < manifest.size)
    where = {(u.offset, u.length): k for k, u in enumerate(units)}
    seen: dict[int, None] = {}
    head: dict[int, None] = {}
    for offset, length in head_ranges:
        for i in page_chunks(manifest, offset, length):
            head.setdefault(i, None)
            seen.setdefault(i, None)
    # Chunks outside every tensor and the head (a torch record's zip header between two records) go
    # just before the tensor that follows them in the file: a loader reads a record's header, then its
    # data, and `cat` reads them in that order too, so neither looks like a jump.
    covered = set(head)
    for r in loader:
        covered.update(manifest.chunk_range(*r))
    gaps: dict[tuple[int, int], list[int]] = {}
    starts = [o for o, _ in by_offset]
    offsets = manifest.offsets
    for i in range(n):
        k = bisect.bisect_left(starts, offsets[i + 1])      # the first tensor at or after the chunk's end
        if i not in covered and k < len(by_offset):
            gaps.setdefault(by_offset[k], []).append(i)
    for r in loader:
        for i in gaps.get(r, ()):
            seen.setdefault(i, None)
        for i in manifest.chunk_range(*r):
            seen.setdefault(i, None)
    for i in range(n):
        seen.setdefault(i, None)
    return Layout(tuple(seen), tuple(head), units, tuple(where[r] for r in loader if r in where))


def plan_for(manifest: Manifest, index: TensorIndex | None) -> list[int] | None:
    """Chunk indices in the order a loader reads an indexed file; None without an index."""
    if index is None or not manifest.chunks:
        return None
    return list(layout_for(manifest, index).plan)


def zip_header_chunks(manifest: Manifest, index: TensorIndex, layout: Layout) -> set[int]:
    """The chunks of a torch file's zip local headers that any plan of it takes: torch.load reads the
    header of every storage in data.pkl, the ones never used too (mmap=True as well). The chunk holding
    the bytes before a record's data comes if it is that header's own: outside every record, or a
    small one reaching into the record (chunking.py cuts a big record's header into a chunk of ~LEAD +
    TAIL bytes). A header among small records shares a chunk with their data, and is read on demand.
    None for other formats."""
    if index.format != "torch-zip":
        return set()
    data: set[int] = set()              # chunks holding bytes of some storage
    for u in layout.units:
        data.update(range(u.first, u.last + 1))
    out: set[int] = set()
    for r in index.records:
        if "/data/" in r.name and 0 < r.offset < manifest.size:
            i = manifest.chunk_at(r.offset - 1)
            own = i not in data or manifest.offsets[i + 1] > r.offset
            if own and manifest.chunks[i].raw_len <= HEADER_CHUNK_MAX:
                out.add(i)
    return out


class Scheduler:
    """Shared by every open file of a mount: the fetch limiter, the counters, the task owner."""

    def __init__(self, cache: ChunkCache, fetch: Fetch, config: Config, on_chunk: Push | None = None,
                 fetch_many: FetchMany | None = None, fetch_blocks: FetchBlocks | None = None,
                 on_reply: Replied | None = None) -> None:
        self.cache = cache
        self.fetch = fetch
        self.fetch_many = fetch_many or self._fetch_each
        self.fetch_blocks = fetch_blocks
        self.config = config
        self.on_chunk = on_chunk
        self.on_reply = on_reply
        self.limiter = trio.CapacityLimiter(config.fetch_concurrency)
        self._open = self._reads = self._read_bytes = 0
        self._demand = self._prefetches = self._failures = 0
        self._inflight = self._peak = 0
        self._fetched = self._prefetched = self._used = self._wasted = 0
        self._block_fetches = self._block_bytes = 0
        self._part_fetches = self._part_bytes = 0
        self._to_refill: OrderedDict[str, tuple[Manifest, int]] = OrderedDict()   # see run()
        self._refill_wake = trio.Event()
        self._last_read = -math.inf
        self._refilled = self._refill_skipped = 0
        self._feeders: dict[tuple[int, int], PageFeeder] = {}
        self._gone_pushes = self._gone_drops = 0     # of feeders dropped (their counts stay in the totals)
        # inode -> the one version of the file whose pages may be pushed: the one its pages hold after
        # a write session here (WRITING while one runs); inodes never written here: any version.
        self._pushable: dict[int, int] = {}
        self._declared: dict[tuple[int, int], frozenset[int]] = {}
        self.watcher: Watcher | None = None             # cpfs/learned.py, if the mount learns plans
        self._readers: set[FileReader] = set()
        self._closed: deque[FileStats] = deque(maxlen=RECENT_FILES)

    def feeder(self, inode: int, manifest: Manifest) -> PageFeeder | None:
        """The page-cache feeder of this version of a file, shared by every open of it, so a second
        open does not fetch again what the kernel holds; None without on_chunk."""
        if self.on_chunk is None:
            return None
        key = (inode, manifest.version)
        if self._pushable.get(inode, manifest.version) != manifest.version:
            stale = PageFeeder(manifest, inode, self.on_chunk, self.cache, self.on_reply)
            stale.retire()             # its reads come to the daemon
            return stale
        if key not in self._feeders:
            self._feeders[key] = PageFeeder(manifest, inode, self.on_chunk, self.cache, self.on_reply)
            self._feeders[key].keep = self._kept(manifest, self._declared.get(key, frozenset()))
        return self._feeders[key]

    def writing(self, inode: int) -> None:
        """A write session of the file begins here: from now on no push of a version read before may
        land on its pages, where the kernel caches the written bytes, nor any push until `written`
        (cpfs/fs.py withdraws the pushes already queued)."""
        self._pushable[inode] = WRITING
        self._drop_feeders(inode)

    def forget(self, inode: int) -> None:
        """The kernel dropped the inode, and its pages with it: what was pushed to them, and declared
        for them, goes too. Kept, a feeder per version ever opened held its manifest for the life of
        the mount (megabytes per large checkpoint, one per step an evaluator loaded). So does the version
        its pages held after a write here (none now), unless a write session is still under way: kept,
        an entry per file ever written stayed (the soak audit)."""
        self._drop_feeders(inode)
        if self._pushable.get(inode) != WRITING:
            self._pushable.pop(inode, None)
        for key in [k for k in self._declared if k[0] == inode]:
            del self._declared[key]

    def _drop_feeders(self, inode: int) -> None:
        for key in [k for k in self._feeders if k[0] == inode]:
            f = self._feeders.pop(key)
            f.retire()
            self._gone_pushes += f.pushes
            self._gone_drops += f.drops

    def written(self, inode: int, version: int | None) -> None:
        """The session ended: the file's pages hold `version` (what it committed, or the version it
        started from; None: the file has none), the only one whose pushes may land from now on."""
        self._pushable[inode] = WRITING if version is None else version

    def declare(self, inode: int, manifest: Manifest, chunks: frozenset[int] | None) -> None:
        """The chunks a loader declared it will read (cpfs/plan.py), or None to drop the declaration.
        While a version of a file has one, its readers prefetch nothing outside it: the declaration
        replaces the readahead's guesses, and reads of anything else are fetched on demand. Its chunks
        stay in the cache once the kernel has them (`PageFeeder.keep`) if they fit in the ready read
        buffers (`_kept`), until the budget evicts them."""
        key = (inode, manifest.version)
        if chunks is None:
            self._declared.pop(key, None)
        else:
            self._declared[key] = chunks
        if key in self._feeders:
            self._feeders[key].keep = self._kept(manifest, chunks or frozenset())

    def _kept(self, manifest: Manifest, chunks: frozenset[int]) -> frozenset[int]:
        """The declared chunks that stay cached once pushed: all of them if their bytes fit in the ready
        read buffers ([cache] buffers; a rank's stage, the weights of a small model), else none. Each
        kept chunk holds a read buffer, so the fetches behind a larger declaration had to back fresh
        memory: declaring a whole 512 MiB checkpoint made its torch.load 0.66x as fast as the same load
        undeclared (the daemon's 0.8-1.0 CPU-s against 0.5-0.6). Kept, a chunk is pushed again without a fetch when
        the declaration is set again after the kernel dropped its pages (cpfs/plan.py); not kept, a
        page the kernel dropped is fetched again as in any file (its blocks, else its chunk)."""
        if sum(manifest.chunks[i].raw_len for i in chunks) > self.config.ready_buffers:
            return frozenset()
        return chunks

    def declared(self, inode: int, manifest: Manifest) -> frozenset[int] | None:
        return self._declared.get((inode, manifest.version))

    def refill_later(self, manifest: Manifest, i: int) -> None:
        """Chunk i of `manifest` had pages the kernel lost, served from their blocks: load it into the
        cache once the mount is idle (`run`)."""
        digest = manifest.chunks[i].digest
        if digest in self._to_refill or not self.cache.absent(digest):
            return
        self._to_refill[digest] = (manifest, i)
        while len(self._to_refill) > REFILL_QUEUE:
            self._to_refill.popitem(last=False)
            self._refill_skipped += 1
        self._refill_wake.set()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled (with the mount): loads the chunks `refill_later` named into the cache, one at
        a time, while no read has come for REFILL_IDLE s. A host that reclaims pages takes several of
        a region, in this load and the next: the chunk's other lost pages are then served from memory.
        Not at once: loading each such chunk beside the reads of its blocks slowed a warm load with 300
        holes from 1.0-1.2 s to 1.3-1.7 s (the stores served both)."""
        task_status.started()
        while True:
            if not self._to_refill:
                self._refill_wake = trio.Event()
                await self._refill_wake.wait()
                continue
            idle = trio.current_time() - self._last_read
            if idle < REFILL_IDLE:
                await trio.sleep(REFILL_IDLE - idle)
                continue
            digest, (manifest, i) = self._to_refill.popitem(last=False)
            if not self.cache.absent(digest):
                continue                       # a reader loaded it meanwhile
            if not self.cache.room(manifest.chunks[i].raw_len):
                self._refill_skipped += 1
                continue
            try:
                await self.get_chunk(manifest, i, demand=False)
                self._refilled += 1
            except Exception as e:             # logged by the store pool; the reader had its bytes
                self._refill_skipped += 1
                log.debug("refill of %s chunk %d failed: %s", manifest.path, i, e)

    def statistics(self) -> SchedulerStats:
        pushed = self._gone_pushes + sum(f.pushes for f in self._feeders.values())
        drops = self._gone_drops + sum(f.drops for f in self._feeders.values())
        files = tuple(r.statistics() for r in self._readers) + tuple(self._closed)
        return SchedulerStats(
            open_files=self._open, reads=self._reads, read_bytes=self._read_bytes, demand_fetches=self._demand,
            prefetches=self._prefetches, prefetch_failures=self._failures, pushed=pushed,
            inflight=self._inflight, peak_inflight=self._peak, fetched_bytes=self._fetched,
            prefetched_bytes=self._prefetched, prefetch_used_bytes=self._used,
            prefetch_wasted_bytes=self._wasted, kernel_drops=drops, block_fetches=self._block_fetches,
            block_bytes=self._block_bytes, part_fetches=self._part_fetches, part_bytes=self._part_bytes,
            refilled=self._refilled, refill_queued=len(self._to_refill),
            refill_skipped=self._refill_skipped, feeders=len(self._feeders),
            written_files=len(self._pushable), files=files)

    async def open(self, nursery: trio.Nursery, manifest: Manifest, index: TensorIndex | None,
                   inode: int = 0, direct: bool = False) -> "FileReader":
        """A reader whose prefetch task lives in `nursery` until `aclose()`; `direct`: for an O_DIRECT
        open, whose reads the kernel does not cache."""
        reader = FileReader(self, manifest, index, inode, direct)
        await nursery.start(reader._run)
        return reader

    async def get_chunk(self, manifest: Manifest, i: int, *, pin: bool = False, demand: bool = True,
                        reserved: bool = False, owner: "FileReader | None" = None) -> bytes:
        entry = manifest.chunks[i]
        loaded = False

        async def load() -> bytes:        # only on a miss: hits cost a dict lookup, no formatting
            nonlocal loaded
            loaded = True
            if demand:
                self._demand += 1
                if owner is not None:
                    owner.demand += 1
            self._inflight += 1
            self._peak = max(self._peak, self._inflight)
            where = f"file {manifest.path} offset {manifest.offsets[i]} chunk {i} ({entry.digest[:16]})"
            try:
                data = await self.fetch(entry, where)
            finally:
                self._inflight -= 1
            self._fetched += entry.raw_len
            if owner is not None:
                owner.fetched += entry.raw_len
            return data

        try:
            return await self.cache.get(entry.digest, entry.raw_len, load, pin=pin, reserved=reserved)
        except CpfsError as e:
            if loaded:
                raise
            # Joined another file's fetch of the chunk (or met bytes of another length): its error names
            # that file; the reader's EIO and its log line name this one.
            raise ChunkUnavailable(f"file {manifest.path} offset {manifest.offsets[i]} chunk {i} "
                                   f"({entry.digest[:16]}): {e}") from e

    async def get_blocks(self, manifest: Manifest, i: int, start: int, end: int,
                         owner: "FileReader | None" = None, lost: bool = True) -> tuple[int, bytes] | None:
        """Raw bytes [start, end) of chunk i, with the rest of the blocks they lie in, fetched and
        checked without the rest of the chunk: (offset of the first byte in the chunk, bytes), or None
        if that cannot be done (then `get_chunk`). Not cached: for pages the kernel lost (`lost`), and
        for the part of a chunk a reader of slices reads (FileReader._read_parts)."""
        if self.fetch_blocks is None:
            return None
        entry = manifest.chunks[i]
        where = f"file {manifest.path} offset {manifest.offsets[i] + start} chunk {i} ({entry.digest[:16]})"
        got = await self.fetch_blocks(entry, start, end, where)
        if got is not None:
            if lost:
                self._block_fetches += 1
                self._block_bytes += len(got[1])
            else:
                self._part_fetches += 1
                self._part_bytes += len(got[1])
            self._fetched += len(got[1])
            if owner is not None:
                owner.fetched += len(got[1])
        return got

    async def prefetch_chunks(self, manifest: Manifest, indices: Sequence[int],
                              owner: "FileReader | None" = None) -> list[bytes | memoryview | Exception]:
        """`get_chunk(pin=True, demand=False, reserved=True)` of each chunk, in order, with the exception
        in the place of one that failed: a prefetch batch. The chunks neither cached nor in flight are
        fetched with one `fetch_many` call (one batch request per store), the others as `get_chunk`.
        A batch of one is a `get_chunk`: the per-chunk path, hedged, without the batch's tasks."""
        if len(indices) == 1:
            try:
                return [await self.get_chunk(manifest, indices[0], pin=True, demand=False, reserved=True,
                                             owner=owner)]
            except Exception as e:
                return [e]
        results: list[bytes | memoryview | Exception | None] = [None] * len(indices)
        fresh: list[int] = []
        digests: set[str] = set()
        for k, i in enumerate(indices):
            digest = manifest.chunks[i].digest
            if digest not in digests and self.cache.absent(digest):
                fresh.append(k)
                digests.add(digest)
        entries = [manifest.chunks[indices[k]] for k in fresh]

        async def load() -> Sequence[bytes | memoryview | Exception]:
            self._inflight += len(entries)
            self._peak = max(self._peak, self._inflight)
            wheres = [f"file {manifest.path} offset {manifest.offsets[indices[k]]} chunk {indices[k]} "
                      f"({e.digest[:16]})" for k, e in zip(fresh, entries)]
            try:
                got = await self.fetch_many(entries, wheres)
            finally:
                self._inflight -= len(entries)
            nbytes = sum(e.raw_len for e, g in zip(entries, got) if not isinstance(g, Exception))
            self._fetched += nbytes
            if owner is not None:
                owner.fetched += nbytes
            return got

        others = sorted(set(range(len(indices))) - set(fresh))

        async def join(k: int) -> None:      # each result kept as it comes (see the except below)
            results[k] = await self.get_chunk(manifest, indices[k], pin=True, demand=False, reserved=True,
                                              owner=owner)

        async def join_others() -> None:
            out = await fan_out(join, others, catch=Exception)
            for k, e in out.errors:
                results[k] = e

        try:
            async with trio.open_nursery() as n:
                n.start_soon(join_others)    # starts once load_many below has made its flights
                if entries:
                    got = await self.cache.load_many([(e.digest, e.raw_len) for e in entries], load,
                                                     pin=True, reserved=True)
                    for k, g in zip(fresh, got):
                        results[k] = g
        except BaseException:                # cancelled: the chunks that came are pinned for no one
            for k, r in enumerate(results):
                if r is not None and not isinstance(r, Exception):
                    self.cache.unpin(manifest.chunks[indices[k]].digest)
            raise
        return results  # type: ignore[return-value]  # every None replaced

    async def _fetch_each(self, entries: Sequence[ChunkEntry],
                          wheres: Sequence[str]) -> list[bytes | memoryview | Exception]:
        """`fetch_many` without a batch fetch: `fetch` of each, all at once."""
        ks = range(len(entries))
        out = await fan_out(lambda k: self.fetch(entries[k], wheres[k]), ks, catch=Exception)
        return out.outcomes(ks)


@dataclass(eq=False)
class _Part:
    """Raw bytes [lo, hi) of one chunk (whole blocks), fetched without the rest of it for a reader of
    slices (FileReader._read_parts)."""
    lo: int
    hi: int
    rank: int                          # its tensor's place in loader order (-1: none)
    prefetch: bool                     # fetched ahead of the reader (counted in prefetched bytes)
    reserved: bool = False             # its bytes are reserved in the cache budget
    data: bytes | memoryview | None = None    # once fetched; None after: not to be had alone
    read: int = 0                      # bytes of it the reader has read
    done: trio.Event = field(default_factory=trio.Event)


@dataclass
class _Batch:
    """Prefetches started together, fetched by one task (FileReader._start_prefetch)."""
    chunks: list[int] = field(default_factory=list)
    nbytes: int = 0


class FileReader:
    def __init__(self, sched: Scheduler, manifest: Manifest, index: TensorIndex | None, inode: int,
                 direct: bool = False) -> None:
        self.sched = sched
        self.m = manifest
        self.index = index
        self.inode = inode
        cfg = sched.config
        self.layout = layout_for(manifest, index)
        plan = list(self.layout.plan)
        n = len(plan)
        # A safetensors loader reads by name, `cat` in file order; a torch zip's plan is file order
        # but for its head, so one order serves both there.
        fmt = index.format if index is not None else None
        self.orders: list[list[int]] = [plan, list(range(n))] if fmt == "safetensors" else [plan]
        self.pos: list[list[int]] = []
        self.pref: list[list[int]] = []          # bytes of the order's chunks before each position
        for order in self.orders:
            pos = [0] * n
            pref = [0] * (n + 1)
            for p, c in enumerate(order):
                pos[c] = p
                pref[p + 1] = pref[p] + manifest.chunks[c].raw_len
            self.pos.append(pos)
            self.pref.append(pref)
        self._head = frozenset(self.layout.head)
        self._unit_starts = [u.offset for u in self.layout.units]
        self._zipped = fmt in ("torch-zip", "torch-dcp")    # records have zip local headers (`_at_header`)
        self._zip_headers: list[int] | None = None  # zip header chunks, in file order (`_headers`)
        self._headers_ahead = True                 # ... not yet fetched ahead (`_read_headers`)
        self._last_header: int | None = None       # the chunk of the last header read that landed
        self._loader_rank = {self.layout.units[u]: k for k, u in enumerate(self.layout.loader_units)}
        self.initial = cfg.readahead_initial
        self.slack = cfg.read_ahead_kb * 1024     # the kernel reads this far past what the reader touches
        # parts of chunks for readers of slices (`_slicing`): opt-in, see [readahead] slice_parts
        self.parts_allowed = cfg.slice_parts and sched.fetch_blocks is not None
        self.max_window = cfg.readahead_max
        # the stream
        self.k = 0                          # the order it runs along
        self.last = -1                      # position (in order k) of the last chunk the reader read
        self.last_chunk: int | None = None
        self.run = 0                        # bytes the stream has covered
        self.window = 0
        self.cursor = 0                     # the next position the stream's prefetch looks at
        self.limit = n                      # ... and where it stops
        self.marker: int | None = None      # held chunk a quarter into the window
        self.marks: set[int] = set()        # held chunks after it, a quarter window apart
        self.mark_at = 0                    # stream bytes (order k) up to the last of them
        # what the reader looks like
        self.whole: bool | None = None      # reads whole tensors?
        self.batch_end: int | None = None   # held last chunk of the tensor fetched at a landing
        self.slice_at: float | None = None  # where in its tensor the last landing fell
        self.slice_len = 0.0                # how much of the tensor the last slice covered (a fraction)
        self.slice_unit: Unit | None = None
        self.sliced = False                 # two landings at the same fraction
        self.prev_unit: Unit | None = None  # where the last read of the stream started
        self.from_head = True               # the stream began at the head: no jump yet
        self.mid: Unit | None = None        # the last landing fell inside this tensor, not yet judged
        # chunks
        self.pinned: set[int] = set()
        self.inflight: set[int] = set()
        self.held: set[int] = set()         # prefetched, pinned, not pushed to the kernel
        self.gates: set[int] = set()        # ... but for the first page, once fetched (`_gate`)
        self.pending: dict[int, int] = {}   # prefetched chunk -> bytes, not yet seen used
        # parts of chunks, for a reader of slices (`_read_parts`)
        self.parts: dict[int, list[_Part]] = {}     # chunk -> its parts fetched or in flight, by lo
        self.whole_only: set[int] = set()           # chunks whose parts cannot be had alone
        self.reach = 0                      # the furthest end of a read since the last landing
        self.land = 0                       # ... and where that landing began
        # counters
        self.reads = self.read_bytes = self.lost_read_bytes = self.fetched = self.demand = 0
        self.prefetched = self.used = self.wasted = 0
        # An O_DIRECT open neither reads the kernel's pages nor leaves its replies there: it gets no
        # feeder. With one, its reads of pages the kernel holds looked like pages the kernel dropped
        # (the file was pushed all over again), and chunks with the kernel looked fetched (no prefetch).
        self.feeder = None if direct else sched.feeder(inode, manifest)
        # What the watcher learns from (cpfs/learned.py): the chunks this open read or prefetched, where
        # it first landed past the head (a unit, a fraction into it), and whether a plan stood while it
        # read. `expected`: the chunks a plan learned from an earlier load says this open will read
        # (`expect`).
        self.touched: set[int] = set()
        self.read_units: set[int] = set()   # offsets of the units its reads (past the head) touched
        self.unused: set[int] = set()       # prefetched and never seen used, at close
        self.landing: tuple[Unit, float] | None = None
        self.planned = False
        self.expected: frozenset[int] | None = None
        self.unexpected = 0                 # bytes read away from what it was expected to read
        self.closed = False
        self._wake = trio.Event()
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self._open_batch: _Batch | None = None   # prefetches started since the last await join it

    def statistics(self) -> FileStats:
        if self.window and self.last >= 0:
            pattern = "stream"
        elif self.sliced or self.whole is False:
            pattern = "slices"
        elif self.whole:
            pattern = "tensors"
        else:
            pattern = "unknown"
        return FileStats(path=self.m.path, inode=self.inode, open=not self.closed, reads=self.reads,
                         read_bytes=self.read_bytes, lost_read_bytes=self.lost_read_bytes,
                         fetched_bytes=self.fetched, demand_fetches=self.demand,
                         prefetched_bytes=self.prefetched, prefetch_used_bytes=self.used,
                         prefetch_wasted_bytes=self.wasted + (sum(self.pending.values()) if self.closed else 0),
                         pattern=pattern, window=self.window)

    # -- the per-file task ----------------------------------------------------------------------
    async def _run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.sched._open += 1
        self.sched._readers.add(self)
        try:
            with self._scope:
                async with trio.open_nursery() as n:
                    self._nursery = n
                    task_status.started()
                    self._prefetch_head()
                    while True:
                        self._fill()
                        await self._wake.wait()
                        self._wake = trio.Event()
        finally:
            self.closed = True
            self.sched._open -= 1
            for i in self.pinned:
                self.sched.cache.unpin(self.m.chunks[i].digest)
            self.pinned.clear()
            for i, parts in list(self.parts.items()):
                for part in list(parts):
                    self._drop_part(i, part)
            self.held.clear()
            self.gates.clear()
            self.marks.clear()
            wasted = sum(self.pending.values())
            self.unused = set(self.pending)
            self.pending.clear()
            self.wasted += wasted
            self.sched._used += self.used
            self.sched._wasted += self.wasted
            self.sched._readers.discard(self)
            self.sched._closed.append(self.statistics())
            if self.sched.watcher is not None:
                self.sched.watcher.closed(self)

    def _kick(self) -> None:
        self._wake.set()

    def _prefetch_head(self) -> None:
        """What every loader reads first: fetched at open."""
        for i in self.layout.head:
            if not self._take(i):
                if not self.sched.cache.reserve(self.m.chunks[i].raw_len):
                    break
                self._start_prefetch(i)

    def _fill(self) -> None:
        """Start prefetches along the stream's order while the window and the cache budget have room."""
        if self.window <= 0 or self._nursery is None or self._slicing():
            return                  # a reader of slices: the kernel's readahead and `_predict` lead
        order, pref = self.orders[self.k], self.pref[self.k]
        base = pref[self.last + 1]
        stop = min(self.limit, len(order))
        cur = self.last_chunk
        keep = self.m.chunks[cur].raw_len if cur is not None and cur not in self.pinned else 0
        while self.cursor < stop:
            i = order[self.cursor]
            dist = pref[self.cursor + 1] - base
            if dist > self.window and self.cursor > self.last + 1:
                break
            if not self._may_prefetch(i):
                self.cursor += 1
                continue
            # Room is left for the chunk the reader is in, so prefetch never evicts it mid-read.
            size = self.m.chunks[i].raw_len
            if not self._have(i) and not self.sched.cache.room(size + keep):
                break
            # Held: the chunk a quarter into the window and one more every quarter window after it (the
            # reader's arrival at each moves the window), and, when the reader reads parts of tensors,
            # the tensor's last (a whole-tensor reader shows).
            first_mark = self.marker is None and 4 * dist >= self.window
            more = self.marker is not None and 4 * (pref[self.cursor] - self.mark_at) >= self.window
            last = not self.whole and self.cursor == stop - 1
            hold = first_mark or more or last
            # A mark shows the reader's arrival at its first page as well as at any other: the rest goes
            # to the kernel now (gated, cpfs/pagecache.py), so the reader finds it there. Not so the
            # tensor's last chunk held for a reader not yet seen to read whole tensors, whose reads
            # may begin anywhere in it.
            gate = hold and not last
            if not self._take(i, hold=hold, gate=gate):
                if not self.sched.cache.reserve(size):
                    break
                self._start_prefetch(i, hold=hold, gate=gate)
            elif i not in self.held:
                self.cursor += 1
                continue
            if hold and self.marker is None:
                self.marker = i
            elif more:
                self.marks.add(i)
            if first_mark or more:
                self.mark_at = pref[self.cursor]
            self.cursor += 1

    def used_chunks(self) -> set[int]:
        """What this open read or prefetched (once closed), less the prefetches never seen used that lie
        outside every unit its reads touched: a stream window's overshoot past where the reader stopped."""
        def read_near(i: int) -> bool:
            return any(u.offset in self.read_units for u in self._units_in(self.m.offsets[i], self.m.offsets[i + 1]))
        return {i for i in self.touched if i not in self.unused or read_near(i)}

    def expect(self, chunks: frozenset[int]) -> None:
        """A plan learned from an earlier load fetches `chunks` for this open (cpfs/learned.py): until
        the reader lands outside them, its readahead prefetches nothing else. Per open, not per file
        (a declaration is): ranks of one host reading different parts of one file each get their own."""
        self.expected = chunks
        self.planned = True

    def unplan(self) -> None:
        """The learned plan was another load's (`expect`): this open is learned from at its close after
        all (its reads since show what it reads)."""
        self.expected = None
        self.planned = self.sched.declared(self.inode, self.m) is not None

    def _may_prefetch(self, i: int) -> bool:
        """False for a chunk outside the file's declared prefetch (Scheduler.declare) or, without one,
        outside what this open is expected to read (`expect`)."""
        declared = self.sched.declared(self.inode, self.m)
        if declared is None:
            declared = self.expected
        return declared is None or i in declared

    def _start_prefetch(self, i: int, hold: bool = False, gate: bool = False) -> None:
        """Prefetch chunk i (its room reserved by the caller), `hold`ing it back from the kernel: all of
        it, or (`gate`) its first page. Prefetches started in one go join one batch, up to a chunk_size
        of bytes: one fetch slot and one `prefetch_chunks` call for, say, a run of 1 MiB tensors and the
        small zip-header chunks between them. The batch closes when its task starts, i.e. once the code
        that started it awaits."""
        assert self._nursery is not None
        size = self.m.chunks[i].raw_len
        self.inflight.add(i)
        self.touched.add(i)
        if hold:
            self.held.add(i)
            if gate:
                self.gates.add(i)
        self.pending[i] = size
        self.prefetched += size
        self.sched._prefetches += 1
        self.sched._prefetched += size
        batch = self._open_batch
        if batch is None or batch.nbytes + size > self.sched.config.chunk_size:
            batch = self._open_batch = _Batch()
            self._nursery.start_soon(self._prefetch, batch)
        batch.chunks.append(i)
        batch.nbytes += size

    async def _prefetch(self, batch: _Batch) -> None:
        """Fetch a batch's chunks into the cache, pinned; the caller reserved room for each, which
        `get`/`load_many` take over."""
        if self._open_batch is batch:
            self._open_batch = None
        try:
            await self.sched.limiter.acquire()
        except BaseException:
            self.sched.cache.release(batch.nbytes)
            raise
        try:
            todo = []
            for i in batch.chunks:
                if self._in_kernel(i):    # another open of the file fetched it while this one waited
                    self.sched.cache.release(self.m.chunks[i].raw_len)
                    self.pending.pop(i, None)
                    self.held.discard(i)
                    self.gates.discard(i)
                else:
                    todo.append(i)
            got = await self.sched.prefetch_chunks(self.m, todo, owner=self)
        finally:
            self.sched.limiter.release()
            self.inflight.difference_update(batch.chunks)
        for i, data in zip(todo, got):
            if isinstance(data, Exception):   # logged by the store pool; a demand read will report it
                self.sched._failures += 1
                log.debug("prefetch of %s chunk %d failed: %s", self.m.path, i, data)
                self.pending.pop(i, None)
                self.held.discard(i)
                self.gates.discard(i)
                continue
            self.pinned.add(i)
            if i not in self.held:
                self._push(i, data)
            elif i in self.gates:
                self._gate(i, data)
            self.gates.discard(i)
        self._kick()

    def _push(self, i: int, data: bytes | memoryview) -> None:
        if self.feeder is not None:
            # Consumed once the kernel has it: the reader will not ask us.
            self.feeder.offer(i, data, lambda: self._unpin(i))

    def _gate(self, i: int, data: bytes | memoryview) -> None:
        """Held chunk i to the kernel but for its first page (a later `_push` sends that)."""
        if self.feeder is not None:
            self.feeder.offer(i, data, gate=True)

    def _release_held(self, i: int) -> None:
        """A held chunk the reader went past without reading: to the kernel after all (it is here)."""
        self.held.discard(i)
        if i in self.pinned:
            data = self.sched.cache.peek(self.m.chunks[i].digest, self.m.chunks[i].raw_len)
            if data is not None and self.feeder is not None:
                self._push(i, data)
            else:
                self._unpin(i)

    def _release_marks(self, chunks: range, upto: int | None = None) -> None:
        """Stop holding the stream's `marks` (those up to position `upto` of the stream's order, if
        given), to the kernel; a read of `chunks` is taking those it covers."""
        for i in [i for i in self.marks if upto is None or self.pos[self.k][i] <= upto]:
            self.marks.discard(i)
            if i in self.held and i not in chunks:
                self._release_held(i)

    def _in_kernel(self, i: int) -> bool:
        return self.feeder is not None and i in self.feeder.sent

    def _take(self, i: int, hold: bool = False, gate: bool = False) -> bool:
        """Chunk i is in hand, or is now: a chunk our cache holds is claimed (pinned) and handled as a
        finished prefetch (pushed to the kernel, held, or gated). Unclaimed, the prefetches that follow
        it could evict it (LRU) before the reader comes, who would then wait for a fetch on demand."""
        if i in self.pinned or i in self.inflight or self._in_kernel(i):
            return True
        size = self.m.chunks[i].raw_len
        data = self.sched.cache.claim(self.m.chunks[i].digest, size) if self.sched.cache.room(size) else None
        if data is None:
            return False
        self.pinned.add(i)
        self.touched.add(i)
        if not hold:
            self._push(i, data)
            return True
        self.held.add(i)
        if gate:
            self._gate(i, data)
        return True

    def _have(self, i: int) -> bool:
        """Chunk i needs no prefetch: fetched or being fetched here, with the kernel, or cached."""
        return (i in self.pinned or i in self.inflight or self._in_kernel(i)
                or self.m.chunks[i].digest in self.sched.cache)

    def _unpin(self, i: int) -> None:
        if i in self.pinned:
            self.pinned.discard(i)
            self.sched.cache.unpin(self.m.chunks[i].digest)
            self._kick()

    def _seen(self, i: int) -> None:
        """The reader used chunk i."""
        size = self.pending.pop(i, None)
        if size is not None:
            self.used += size

    # -- the access pattern ---------------------------------------------------------------------
    def _unit(self, offset: int) -> Unit | None:
        k = bisect.bisect_right(self._unit_starts, offset) - 1
        if k >= 0:
            u = self.layout.units[k]
            if offset < u.offset + u.length:
                return u
        return None

    def _units_in(self, offset: int, end: int) -> list[Unit]:
        k = max(0, bisect.bisect_right(self._unit_starts, offset) - 1)
        out = []
        while k < len(self.layout.units) and self.layout.units[k].offset < end:
            u = self.layout.units[k]
            if u.offset + u.length > offset:
                out.append(u)
            k += 1
        return out

    def _starting_in(self, offset: int, end: int) -> list[Unit]:
        """The units that start inside [offset, end): a read covering a unit's start lands there (the
        kernel reads around a page fault at it)."""
        return [t for t in self._units_in(offset, end) if offset <= t.offset]

    def _metadata(self, offset: int, end: int, chunks: range) -> bool:
        """A read of the loader's metadata: from the head, no longer than the kernel's readahead (or
        within the head). A loader reads it at any time; it says nothing of how it reads tensors."""
        return chunks[0] in self._head and (end - offset <= self.slack or all(i in self._head for i in chunks))

    def _continues(self, chunks: range, offset: int) -> tuple[int, int] | None:
        """(order, previous position) if the read continues the last one along an order: it starts at
        the reader's chunk, the next one, or just after what was fetched ahead of the reader there
        (held chunks excepted: the reader shows up at them); from a whole-tensor reader, also a read
        anywhere in the tensor it is in, or ahead within what its window fetched."""
        if self.whole and self.last_chunk is not None:
            # A whole-tensor reader's read anywhere in the tensor it is in, or ahead within what the
            # window has fetched (past the chunks held to see it come; not a zip header read, which
            # torch.load(mmap=True) makes through an open of its own, in file order: it would stream
            # the file): another thread of the loader (see _jump) or the kernel's readahead for it.
            # Behind the stream it is nothing new; ahead, the stream goes on from there (`_observe`
            # leaves the cursor at any bytes it jumped over that were not fetched, to fetch them too).
            # Taken for jumps, these reset the window to a chunk at every turn.
            u = self._unit(self.m.offsets[self.last_chunk])
            q = self.pos[self.k][self.last_chunk]
            if u is not None and u.first <= chunks[0] and chunks[-1] <= u.last:
                return self.k, q
            if q < min(self.pos[self.k][c] for c in chunks) <= self.cursor and not self._at_header(offset):
                return self.k, q
        for k in sorted(range(len(self.orders)), key=lambda k: k != self.k):     # the stream's own first
            order, pos = self.orders[k], self.pos[k]
            q = pos[self.last_chunk] if self.last_chunk is not None else -1
            p0 = min(pos[c] for c in chunks) if len(chunks) > 1 else pos[chunks[0]]
            if p0 < q:
                # A little behind the reader: the kernel's readahead requests arrive out of order.
                if self.pref[k][q] - self.pref[k][p0] <= 2 * (self.slack + self.m.chunk_size):
                    return k, q
                continue
            if p0 <= q + 1:
                return k, q
            f = q
            while f + 1 < p0 and f - q < FRONTIER_SCAN and order[f + 1] not in self.held and self._have(order[f + 1]):
                f += 1
            if p0 <= f + 1:
                return k, q
        return None

    def _observe(self, offset: int, end: int, chunks: range) -> None:
        """Update the access pattern with a read of [offset, end) over `chunks`, and start what it calls for."""
        if self.reads == 0:
            for i in self._head:                    # what every loader reads first (maybe from the kernel)
                self._seen(i)
        if self._metadata(offset, end, chunks):
            for i in chunks:                        # the loader's metadata: read at any time, says nothing
                self._seen(i)
            return
        cont = self._continues(chunks, offset)
        if cont is not None and self._slicing() and offset > self.reach + self.slack:
            cont = None                             # a reader of slices going past the kernel's readahead
        skipped = cont is not None and self._skipped_start(offset)
        if skipped:
            cont = None                             # the next chunk, but not the next bytes: a landing
        if cont is not None:
            self.reach = max(self.reach, end)       # (a landing sets it, after judging the last slice)
            k, q = cont
            pos, order = self.pos[k], self.orders[k]
            p1 = max(pos[c] for c in chunks)
            if p1 <= q:
                for i in chunks:
                    self._seen(i)
                self._read_to_end(offset, end, chunks)
                return                              # not past the reader's furthest read: nothing new
            before = self._unit(self.m.offsets[self.last_chunk]) if self.last_chunk is not None else None
            header = self._at_header(offset)
            if self.mid is not None and not header:
                starts = self._starting_in(offset, end)
                if starts:
                    # The landing inside a tensor was the kernel reading around a fault at the next
                    # tensor's start: this is the landing.
                    self.mid = self.slice_unit = self.slice_at = None
                    before = None
                    if self.whole is not False:
                        self._batch(starts[0], max(chunks[-1] + 1, starts[0].first))
            if k != self.k:
                self.k, self.run, self.cursor, self.marker = k, 0, p1 + 1, None
                self._release_marks(chunks)
            for p in range(q + 1, p1 + 1):          # passed: the reader has them
                i = order[p]
                self._seen(i)
                if i not in self.held and self.feeder is None:
                    self._unpin(i)
            self.run += self.pref[k][p1 + 1] - self.pref[k][q + 1]
            self.last, self.last_chunk = p1, order[p1]
            if min(pos[c] for c in chunks) <= self.cursor:
                self.cursor = max(self.cursor, p1 + 1)
            # else it went on from further ahead than prefetch had reached: `_fill` fetches what lies
            # between from the cursor first (behind the reader, so outside the window's count)
            self._read_to_end(offset, end, chunks)
            # A zip header read says nothing of how the reader goes on and leaves the window as it is: a
            # loader reading headers and data in turn keeps its stream, and one that reads only headers
            # (torch.load(mmap=True) does, in a file of its own) starts none. But a whole-tensor reader's
            # reads from a header's page (this one may have shown it: it read a tensor to its end) are
            # its reads of the record: torch.load's 1 MiB from there, the rest of the record in pages
            # pushed to the kernel. Taken for header reads, they held the window at the tensor the
            # reader had finished, and every record after it waited for a fetch of its own.
            if not header or self.whole:
                now = self._unit(offset)
                before = self.prev_unit if before is not None else None
                if before is not None and now is not None and now != before and end > now.offset + self.slack:
                    self.whole = True               # went on from one tensor into the next
                self.prev_unit = now
                u = self._unit(offset)              # not where the kernel's readahead reached
                # A reader that stops leaves at most the first window unread: two chunks at most.
                # Two chunks for a stream from the head (a loader reading from the start), else one.
                first = min(self.initial, (2 if self.from_head and self.whole is not False else 1) * self.m.chunk_size)
                # From the head, until the reader shows how it reads tensors, the window doubles with the
                # run (limited to the tensor it is in): a loader's first tensor is often its biggest (an
                # embedding), and a quarter of the run kept 2-3 fetches in flight through it.
                doubling = self.from_head and self.whole is None
                self.window = min(self.max_window, max(first, self.run if doubling else self.run // 4))
                self.limit = len(order)
                if not self.whole and u is not None:    # into the next tensor only for whole-tensor readers
                    self.limit = max(pos[u.first], pos[u.last]) + 1
        else:
            self._jump(offset, end, chunks, skipped)
        if self.marker is not None and (self.marker in chunks or self.pos[self.k][self.marker] <= self.last):
            self.marker = None
        self._release_marks(chunks, upto=self.last)     # passed unread
        self._kick()

    def _skipped_start(self, offset: int) -> bool:
        """A read inside a tensor the reader had not read, past the kernel's readahead from its start,
        where the start is not in pages the kernel holds or chunks here: the reader skipped it. With
        tensors smaller than a chunk, a rank's slice of each lies in the chunk after the last, which
        looks like a stream; taken for one, the reader seemed to go on from one tensor into the next
        and was given the whole file (a 1/8 slice of 0.4-0.8 MiB tensors in 1 MiB chunks: 9x)."""
        now = self._unit(offset)
        if now is None or self.last_chunk is None or self._unit(self.m.offsets[self.last_chunk]) == now:
            return False
        return self._skipped(now, offset)

    def _skipped(self, u: Unit, offset: int) -> bool:
        """The bytes of tensor u before `offset` lie past the kernel's readahead from its start, and some
        of them are neither here nor in the kernel: a reader at `offset` has not read u's start."""
        return offset > u.offset + self.slack and not all(
            self._have(i) for i in self.m.chunk_range(u.offset, offset - u.offset))

    def _at_header(self, offset: int) -> bool:
        """Whether a read from `offset` starts at a torch record's zip local header: the kernel reads
        from the header's page, just before the record's data (a loader reading the header)."""
        k = bisect.bisect_right(self._unit_starts, offset)
        return self._zipped and k < len(self._unit_starts) and self._unit_starts[k] - offset < HEADER_REACH

    def _read_to_end(self, offset: int, end: int, chunks: range) -> None:
        for t in self._units_in(offset, end):
            if t.last in chunks and t.first != t.last and end >= t.offset + t.length and self.mid is None:
                if self._skipped(t, offset):
                    continue                        # the kernel reading around a fault past its end
                # A reader of slices reads every byte through us: its reads reach a tensor's end by the
                # kernel's readahead past its slice, unless they began at the tensor's start.
                if not self._slicing() or self.land <= t.offset + PAGE:
                    self.whole = True               # read a tensor of several chunks to its end

    def _jump(self, offset: int, end: int, chunks: range, skipped: bool) -> None:
        """The reader left the stream: judge what it skipped, then what its landing says. `skipped`: it
        read on into the next chunk but skipped the start of the tensor it is in (`_skipped_start`)."""
        # Each rule below judges a reader that left a tensor; a jump inside that same tensor left
        # nothing (a loader's op on a mapped tensor runs on several threads, each faulting in its own
        # part: torch's .sum() reads the two halves at once).
        here = self._unit(offset)
        if (self.batch_end is not None and self.batch_end not in chunks and self.batch_end in self.held
                and self._unit(self.m.offsets[self.batch_end]) != here):
            self.whole = False                      # left a tensor fetched whole before its end
        if self.mid is not None:
            if self.mid != here:
                self.whole = False                  # read from inside a tensor, and left it
            self.mid = None
        if (self.marker is not None and self.marker in self.held and self.marker not in chunks
                and self.last_chunk is not None and self._unit(self.m.offsets[self.marker]) is not None
                and self._unit(self.m.offsets[self.marker]) == self._unit(self.m.offsets[self.last_chunk]) != here):
            self.whole = False                      # left a tensor it was streaming through before its end
        if self.slice_unit is not None and self.last_chunk is not None:
            u = self.slice_unit
            reached = self.m.offsets[self.last_chunk + 1] if self.last_chunk < len(self.m.chunks) else u.offset
            reached = min(reached, self.reach)      # where the reads stopped, inside the chunk
            self.slice_len = max(0.0, min(1.0, (min(reached, u.offset + u.length) - u.offset) / u.length)
                                 - (self.slice_at or 0.0))
        here = self.pos[0][chunks[0]]
        for i in [i for i in self.held if i == self.marker or i == self.batch_end or self.pos[0][i] <= here]:
            if i not in chunks:
                self._release_held(i)
        self._release_marks(chunks)
        self.marker = self.batch_end = None
        self.k, self.run, self.window = 0, 0, 0
        self.from_head = False
        self.land, self.reach = offset, end
        self.prev_unit = self._unit(offset)
        self.last = max(self.pos[0][c] for c in chunks)
        self.last_chunk = self.orders[0][self.last]
        self.cursor = self.last + 1
        self.limit = len(self.orders[0])
        for i in chunks:
            self._seen(i)
        if self._at_header(offset):
            self._read_headers(chunks)
            return                                  # a zip header read lands nowhere (see _observe)
        # A read that covers a tensor's start (the kernel reads around a page fault) lands at that start.
        starts = self._starting_in(offset, end)
        u = starts[0] if starts else self._unit(offset)
        if u is None:
            return
        if not starts and u.offset + u.length - end <= min(self.slack, u.length // 16):
            # Ends just short of the next tensor: the kernel read around a fault at its start.
            nxt = self._unit(u.offset + u.length)
            if nxt is not None:
                u, starts = nxt, [nxt]
        if starts or ((chunks[0] == u.first or self._have(chunks[0] - 1)) and not skipped):
            # At the start of a tensor, or just after what is already here of it (the reader came
            # through the kernel's copy): fetch the rest of it, unless the reader reads parts.
            self.slice_unit = None
            if self.whole is not False:
                self._batch(u, max(chunks[-1] + 1, u.first))
            return
        # Inside a tensor: a slice, or the kernel reading around a fault at the next tensor's start
        # (then the next read shows it). Two landings at the same fraction of their tensors: slices.
        at = (offset - u.offset) / u.length
        self.sliced = self.slice_at is not None and abs(at - self.slice_at) <= SLICE_TOLERANCE
        self.slice_at, self.slice_unit = at, u
        if self.sliced:
            self.whole = False
            self._predict(u, at, end)
        else:
            self.mid = u

    def _read_headers(self, chunks: range) -> None:
        """A header read that landed: from the second in file order on, every zip header chunk after it
        is fetched at once (in batches), once per open. Every torch loader reads the local header of
        every record (torch.load(mmap=True) all of them through an open of its own, in file order,
        before it maps the file), and a header read moves no stream: cold, each was a round trip (512
        MiB of 0.5-2 MiB tensors: 415 header reads took 0.8 s of a 1.9 s mmap load). The header chunks
        are ~24 KiB each (chunking.LEAD, TAIL), ~2% of such a file; a learned or declared plan has them
        already. They count as used prefetches at once: the loader reads them from the kernel."""
        prev, self._last_header = self._last_header, chunks[0]
        if prev is None or chunks[0] <= prev or self.expected is not None or not self._headers_ahead:
            return
        self._headers_ahead = False
        headers = self._headers()
        for i in headers[bisect.bisect_right(headers, chunks[-1]):]:
            if self._have(i) or not self._may_prefetch(i):
                continue
            if not self.sched.cache.reserve(self.m.chunks[i].raw_len):
                break
            self._start_prefetch(i)
            self._seen(i)       # used: the loader reads it (from the kernel, so it never shows here)

    def _headers(self) -> list[int]:
        """The file's zip header chunks (`zip_header_chunks`), in file order; found once per open."""
        if self._zip_headers is None:
            self._zip_headers = sorted(zip_header_chunks(self.m, self.index, self.layout)) if self.index else []
        return self._zip_headers

    def _is_header(self, i: int) -> bool:
        headers = self._headers()
        k = bisect.bisect_left(headers, i)
        return k < len(headers) and headers[k] == i

    def _batch(self, u: Unit, start: int) -> None:
        """Fetch chunks [start, u.last] at once; the last one held."""
        for i in range(start, u.last + 1):
            hold = i == u.last
            if not self._may_prefetch(i):
                continue
            if not self._take(i, hold=hold):
                if not self.sched.cache.reserve(self.m.chunks[i].raw_len):
                    return
                self._start_prefetch(i, hold=hold)
            if hold and i in self.held:
                self.batch_end = i

    def _predict(self, u: Unit, at: float, after: int) -> None:
        """The reader reads the slice starting `at` through each tensor: fetch that slice of the next
        few tensors in loader order, its first chunk held (the landing shows). Where chunks can be read in
        parts (`_slicing`), the slices alone, and the rest of this one (the reader is in it, up to `after`)."""
        rank = self._loader_rank.get(u)
        if rank is None:
            return
        parts = self._slicing()
        if parts:
            self._drop_parts(rank)
            self._prefetch_parts(after, u.offset + min(u.length, int((at + self.slice_len) * u.length)), rank)
        ahead = self.layout.loader_units[rank + 1:rank + 1 + SLICE_AHEAD]
        for r, k in enumerate(ahead, rank + 1):
            v = self.layout.units[k]
            lo = v.offset + int(at * v.length)
            hi = max(lo + 1, v.offset + int((at + self.slice_len) * v.length))
            if parts:
                self._prefetch_parts(lo, min(hi, v.offset + v.length), r)
                continue
            for j, i in enumerate(self.m.chunk_range(lo, min(hi, v.offset + v.length) - lo)):
                if not self._may_prefetch(i) or self._take(i, hold=j == 0):
                    continue
                if not self.sched.cache.reserve(self.m.chunks[i].raw_len):
                    return
                self._start_prefetch(i, hold=j == 0)

    # -- parts of chunks, for a reader of slices ------------------------------------------------
    def _slicing(self) -> bool:
        """The reader reads parts of tensors and chunks can be read in parts: what it has not got of a
        chunk is fetched as the blocks it reads (`_read_parts`), not as the whole chunk. A rank reading
        its 1/8 row slice of each tensor through 4 MiB chunks otherwise moved 7x what it read."""
        return self.whole is False and self.parts_allowed

    def _by_parts(self, i: int) -> bool:
        """Read chunk i in parts: for a reader of slices, and for one that landed inside a tensor and is
        not judged yet (a whole chunk pushed to the kernel would hide where the reader goes next)."""
        judging = self.mid is not None and self.whole is None and self.parts_allowed
        return (self._slicing() or judging) and i not in self.whole_only and not self._have(i)

    def _rank_at(self, offset: int) -> int:
        u = self._unit(offset)
        return self._loader_rank.get(u, -1) if u is not None else -1

    def _add_part(self, i: int, lo: int, hi: int, prefetch: bool, reserved: bool = False) -> _Part:
        """Register the part of chunk i holding raw bytes [lo, hi), widened to whole blocks."""
        lo, hi = lo // BLOCK * BLOCK, min(self.m.chunks[i].raw_len, -(-hi // BLOCK) * BLOCK)
        part = _Part(lo, hi, self._rank_at(self.m.offsets[i] + lo), prefetch, reserved)
        bisect.insort(self.parts.setdefault(i, []), part, key=lambda p: p.lo)
        self.touched.add(i)
        return part

    def _cover(self, i: int, a: int, b: int) -> tuple[list[_Part], list[tuple[int, int]]]:
        """The parts of chunk i that cover raw bytes [a, b) (fetched or in flight), and the gaps between."""
        need: list[_Part] = []
        gaps: list[tuple[int, int]] = []
        pos = a
        for part in self.parts.get(i, ()):
            if part.lo >= b:
                break
            if part.hi <= pos or (part.done.is_set() and part.data is None):
                continue
            if part.lo > pos:
                gaps.append((pos, part.lo))
            need.append(part)
            pos = part.hi
            if pos >= b:
                break
        if pos < b:
            gaps.append((pos, b))
        return need, gaps

    def _prefetch_parts(self, lo: int, hi: int, rank: int) -> None:
        """Fetch the file's bytes [lo, hi) ahead as parts of their chunks, what no part covers yet. Chunks
        that are here or cannot be had in parts are left to the reads."""
        if self._nursery is None:
            return
        for i in self.m.chunk_range(lo, hi - lo) if hi > lo else ():
            if not self._may_prefetch(i) or not self._by_parts(i):
                continue
            start = self.m.offsets[i]
            _, gaps = self._cover(i, max(lo, start) - start, min(hi, self.m.offsets[i + 1]) - start)
            for a, b in gaps:
                size = min(self.m.chunks[i].raw_len, -(-b // BLOCK) * BLOCK) - a // BLOCK * BLOCK
                if not self.sched.cache.reserve(size):
                    return
                part = self._add_part(i, a, b, prefetch=True, reserved=True)
                self.prefetched += part.hi - part.lo
                self.sched._prefetches += 1
                self.sched._prefetched += part.hi - part.lo
                self._nursery.start_soon(self._prefetch_part, i, part)

    async def _prefetch_part(self, i: int, part: _Part) -> None:
        try:
            async with self.sched.limiter:
                await self._fetch_part(i, part)
        finally:
            part.done.set()
            if part.data is None:
                self._drop_part(i, part)

    async def _fetch_part(self, i: int, part: _Part) -> None:
        """Fetch a registered part. One that cannot be had alone (no block checks, a copy stored lz4, a
        replica that fails or is slow: StorePool.fetch_blocks) leaves its chunk to whole-chunk reads."""
        try:
            got = await self.sched.get_blocks(self.m, i, part.lo, part.hi, owner=self, lost=False)
            if got is not None and got[0] == part.lo and len(got[1]) == part.hi - part.lo:
                part.data = got[1]
            else:
                self.whole_only.add(i)
        finally:
            part.done.set()

    async def _read_parts(self, i: int, a: int, b: int, fetch: bool) -> bytes | memoryview | None:
        """Raw bytes [a, b) of chunk i from its parts, fetching what they lack if `fetch` (a demand
        read: the blocks the kernel asked for); None if they cannot serve it (read the chunk)."""
        need, gaps = self._cover(i, a, b)
        if gaps and not fetch:
            return None
        fresh = [self._add_part(i, lo, hi, prefetch=False) for lo, hi in gaps]
        if fresh:
            self.demand += len(fresh)
            self.sched._demand += len(fresh)
            try:
                if len(fresh) == 1:
                    await self._fetch_part(i, fresh[0])
                else:
                    await fan_out(lambda part: self._fetch_part(i, part), fresh, catch=CpfsError)
            finally:
                for part in fresh:
                    part.done.set()
                    if part.data is None:
                        self._drop_part(i, part)
        for part in need:
            await part.done.wait()
        pieces: list[memoryview] = []
        pos = a
        for part in sorted([*need, *fresh], key=lambda p: p.lo):
            if part.hi <= pos:
                continue
            if part.data is None or part.lo > pos:
                return None
            n = min(b, part.hi) - pos
            pieces.append(memoryview(part.data)[pos - part.lo:pos - part.lo + n])
            part.read += n
            if part.prefetch:
                self.used += n
            pos += n
            if part.read >= part.hi - part.lo:
                self._drop_part(i, part)        # read through: the kernel has it
            if pos >= b:
                break
        if pos < b:
            return None
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _drop_part(self, i: int, part: _Part) -> None:
        parts = self.parts.get(i)
        if parts is None or part not in parts:
            return
        parts.remove(part)
        if not parts:
            del self.parts[i]
        if part.reserved:
            part.reserved = False
            self.sched.cache.release(part.hi - part.lo)
        if part.prefetch and part.data is not None:
            self.wasted += max(0, part.hi - part.lo - part.read)

    def _drop_parts(self, rank: int) -> None:
        """Drop the fetched parts of tensors before `rank` in loader order: the reader has passed them."""
        for i, parts in list(self.parts.items()):
            for part in [p for p in parts if p.rank < rank and p.done.is_set()]:
                self._drop_part(i, part)

    def _watch(self, offset: int, end: int, chunks: range) -> None:
        """Tell the watcher of this open's first landing past the head, and of a landing outside what
        a learned plan expects it to read (the guess was wrong: the readahead follows the reader
        again). A read within the kernel's readahead reach (read_ahead_kb) of the expected chunks is the
        kernel reading around a fault in an expected tensor; reads beyond it count, and the reader has
        left the plan once they are over STRAY_CHUNKS chunks and half of what it read: the kernel's
        readahead runs on past a tensor's end by a few MiB more or less each time, and a reader that
        does something else (a whole load where a stage was recorded) reads on and on outside.
        Only the plan's tensor chunks are near in that sense, not the chunks cpfs/learned.py adds to every
        plan (the head, the zip headers): with records of 0.5-2 MiB a zip header lies within the kernel's
        reach of every read, and a whole torch.load given the plan of torch.load(mmap=True)'s
        header-reading open never left it, each of its tensors fetched on demand."""
        assert self.sched.watcher is not None
        declared = self.sched.declared(self.inode, self.m)
        self.planned = self.planned or declared is not None
        if self._metadata(offset, end, chunks):
            return                              # says nothing of what the reader wants
        # A torch zip header read lands (torch.load reads every record's header through an open of its
        # own, which a plan then serves: its chunks come with every plan of the file), but its record
        # is not read.
        header = self._at_header(offset)
        if not header:
            self.read_units.update(u.offset for u in self._units_in(offset, end))
        if self.landing is None:
            starts = self._starting_in(offset, end)
            u = starts[0] if starts else self._unit(offset)
            if u is not None:
                self.landing = (u, 0.0 if starts else (offset - u.offset) / u.length)
                if declared is None:
                    self.sched.watcher.landed(self)
                    return
        expected = self.expected
        lo, hi = max(0, offset - self.slack), min(self.m.size, end + self.slack)
        if expected is None or header:
            return
        if any(i in expected and i not in self._head and not self._is_header(i)
               for i in self.m.chunk_range(lo, hi - lo)):
            return
        self.unexpected += end - offset
        if self.unexpected > max(STRAY_CHUNKS * self.m.chunk_size, self.read_bytes // 2):
            self.expected = None
            self.sched.watcher.strayed(self, offset, end)

    # -- reads ------------------------------------------------------------------------------------
    async def read(self, offset: int, size: int) -> bytes | memoryview:
        """Bytes [offset, offset+size), short at end of file."""
        if self.closed:
            raise ValueError("read from a closed file")
        self.sched._last_read = trio.current_time()     # the mount is not idle (Scheduler.run)
        end = min(offset + size, self.m.size)
        chunks = self.m.chunk_range(offset, size)
        if not chunks:
            return b""
        # Pages pushed since the last `forget` were pushed ever, so the second look is only for those.
        ever = self.feeder is not None and self.feeder.lost(offset, end, ever=True)
        if ever:
            self.lost_read_bytes += end - offset
        if ever and self.feeder.lost(offset, end) and self.feeder.dropped_stretch(offset, end):
            log.info("%s: the kernel dropped pages pushed to it (reads up to %d): pushing the file again as "
                     "it is read", self.m.path, end)
            self.feeder.forget()
        self._observe(offset, end, chunks)
        self.touched.update(chunks)
        if self.sched.watcher is not None:
            self._watch(offset, end, chunks)
        datas: list[bytes | memoryview] = [b""] * len(chunks)
        bases = [0] * len(chunks)           # where in its chunk each of datas starts

        async def one(k: int, i: int) -> None:
            start, stop = self.m.offsets[i], self.m.offsets[i + 1]
            lost = self.feeder is not None and self.feeder.lost_chunk(i)
            if lost and i not in self.inflight and self.m.chunks[i].digest not in self.sched.cache:
                got = await self.sched.get_blocks(self.m, i, max(offset, start) - start, min(end, stop) - start,
                                                  owner=self)
                if got is not None:
                    bases[k], datas[k] = got
                    self.sched.refill_later(self.m, i)
                    return
            if i in self.parts or self._by_parts(i):
                a = max(offset, start) - start
                part = await self._read_parts(i, a, min(end, stop) - start, self._by_parts(i))
                if part is not None:
                    bases[k], datas[k] = a, part
                    return
            datas[k] = await self.sched.get_chunk(self.m, i, owner=self)
            if self.feeder is not None:
                self.feeder.offer(i, datas[k])

        if len(chunks) == 1:
            await one(0, chunks[0])
        else:
            # A chunk that cannot be read fails the read with its own error (file, offset, chunk, stores:
            # the errno at the FUSE boundary), not inside a nursery's ExceptionGroup; the others finish.
            done = await fan_out(lambda k: one(k, chunks[k]), range(len(chunks)), catch=CpfsError)
            if done.errors:
                raise done.errors[0][1]
        for i in chunks:
            if i in self.held:                  # read: the kernel has it now (offered above)
                self.held.discard(i)
                self.marks.discard(i)
                if i == self.batch_end:
                    self.batch_end = None
                self._unpin(i)
            elif self.feeder is None and i in self.pinned and end >= self.m.offsets[i + 1]:
                self._unpin(i)
        self.reads += 1
        self.read_bytes += end - offset
        self.sched._reads += 1
        self.sched._read_bytes += end - offset
        self.sched._last_read = trio.current_time()      # and after it, should it have waited long
        if self.feeder is not None:
            self.feeder.replied(offset, end)    # the reply fills the kernel's pages: push them no more
        pieces = []
        for data, base, i in zip(datas, bases, chunks):
            start, stop = self.m.offsets[i] + base, self.m.offsets[i + 1]
            pieces.append(memoryview(data)[max(offset, start) - start:min(end, stop) - start])
        # One chunk: a view, no copy; several: only the requested bytes are copied.
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def aclose(self) -> None:
        """Stop this file's prefetch and release its pins."""
        self.closed = True
        self._scope.cancel()
