"""Files written through the mount: staged locally, uploaded behind the writer, committed on flush.

A WriteSession is one file open for writing. Every write lands in a sparse staging file, never in
memory. A background task (write-behind) follows the writer and stores each chunk as soon as its bytes
are complete, so that flush (fsync, close) finds little left to do. Flush cuts the final layout, stores
what is still missing, and commits the manifest once every chunk is on write_quorum stores.

Chunk cuts. The layout is the importer's, a pure function of the file's bytes:
`cut(size, chunk_size, chunking.cut_points(...))`. So a checkpoint written through the mount shares
the chunks of its unchanged tensors with its predecessors, and with the same file put by `cpfs put`.
While the file is being written there is no index yet, so write-behind follows the cut points a
`chunking.BoundaryScanner` predicts from the bytes in file order.

A prediction that turns out wrong (the writer went back and changed bytes, or truncated) costs an
upload, never correctness: flush stores exactly the final layout, and reuses an earlier upload only if
its span is in the layout and no byte of it changed since. Such superseded uploads stay on the stores as
unreferenced chunks, garbage for a later collector (`statistics().chunks_discarded` counts them).

Dropped spans. Once the scanner has seen a tensor record end (a zip member other than data.pkl, the
data of a safetensors file), write-behind punches the chunks it stored inside that record out of the
staging file. Only the index reads a checkpoint at commit, and it reads headers, never those bytes, so
the staging file holds about one record at a time instead of the whole checkpoint (which cost fresh
page-cache pages for every byte, and disk writes once dirty pages passed ~10% of memory). A dropped
span is recorded as away before it is punched, and is copied back from the stores, like a base
chunk, if the writer reads or changes it; reads and punches of one range exclude each other.

Backpressure. A writer in file order that outruns the stores fills the staging disk. A write that
finds it full (ENOSPC, or EDQUOT: the user's quota) waits, without the session lock, for write-behind's
next step (an upload, a scan or a drop ending), then tries again; it fails with ENOSPC only when
write-behind can free nothing (the file is not written in order, a record larger than the staging
disk), or, with no upload or scan running, takes no step in ROOM_WAIT (a running upload is bounded by
the store's timeout).

Base versions. Opened without O_TRUNC, a session starts from the committed version. Base chunks are
fetched into the staging file only when a read or a partial overwrite needs their bytes, and chunks the
new layout keeps unchanged are committed by reference, never read. Write-behind is off for such
sessions (until they are truncated to zero): their bytes are not written in file order.

What never commits. A write or truncate that fails (disk full, an I/O error of the staging file, a
base chunk that cannot be fetched) leaves content the writer did not mean: the session is poisoned,
and every later write, truncate, fsync and close fails with that error's errno, so the previous version
stays current. A torch zip or safetensors file whose bytes stop before the end its format names (a
saver killed mid-save still has its file closed by the kernel) is not committed at close: its chunks
are stored and recorded as a failed version (`cpfs log` shows it and why), and close fails with EIO.
fsync of such a file (savers that fsync as they go) stores its chunks and records nothing.
See cpfs/completeness.py for what complete means.

Concurrency. write, truncate and flush run one at a time (one lock); reads do not wait for them. Staging
I/O runs in threads under the io limiter, hashing, compression and scanning under pool.cpu. At most
`fetch_concurrency` chunks (upload slots, shareable between sessions) are in memory being encoded or
stored, whether by write-behind or by flush.
"""
from __future__ import annotations

import bisect
import errno
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from .catalog import Catalog
from .chunking import BoundaryScanner, ReadAt, chunk_end, cut, cut_points
from .completeness import incomplete_reason
from .errors import CpfsError, IncompleteFile, Stale, StoreError, WriteFailed
from .manifest import ChunkEntry, Manifest, normalize_path
from .pool import StorePool
from .staging import Spans, StagingError, StagingFile
from .tensor_index import TensorIndex, build_index, index_file
from .upload import Uploader, encode_span, in_parallel

log = logging.getLogger(__name__)

Span = tuple[int, int]  # (offset, length)

_MAX_AHEAD = 1024                  # written ranges remembered beyond the contiguous frontier
_IO_THREADS = 4                    # default staging I/O limiter of a session
ROOM_WAIT = 60.0                   # seconds a write waits for one write-behind step on a full staging disk
STREAM_RETRIES = 5                 # write-behind failures in a row retried (after 0.5, 1, 2, 4, 8 s)


@dataclass(frozen=True, kw_only=True)
class WriterStats:
    size: int                   # current file size
    bytes_written: int          # bytes passed to write()
    chunks_uploaded: int        # chunks this session put on at least one store (new data)
    chunks_deduped: int         # chunks encoded that every target store (or this session) held already
    chunks_reused: int          # layout chunks commits took as they were (base, earlier commit, write-behind)
    chunks_streamed: int        # chunks stored by write-behind, before a flush asked for them
    chunks_discarded: int       # chunks stored by this session that no commit will name (overwritten later)
    chunks_renewed: int         # renewals of stored chunks' copies while the file stayed open (upload: Renewal)
    chunks_lost: int            # stored chunks whose copies went before a commit (stored again, or it failed)
    bytes_uploaded: int         # stored (compressed) bytes sent to stores, all replicas
    new_raw_bytes: int          # raw bytes of chunks_uploaded: what this session added to the stores
    base_chunks_fetched: int    # base chunks copied into the staging file
    chunks_dropped: int         # streamed chunks dropped from the staging file (their bytes are stored)
    dropped_fetched: int        # ... and copied back into it (read, or changed, while the file is open)
    buffered_bytes: int         # chunk bytes in memory now (encoding, uploading, fetching)
    peak_buffered_bytes: int
    uploads_in_flight: int      # write-behind uploads running
    commits: int
    room_waits: int             # times a write found the staging disk full and waited for write-behind


class _Signal:
    """Wakes every task waiting on it at the next fire()."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()

    def next(self) -> trio.Event:
        """The event the next fire() sets: taken before a wait that must not miss a fire meanwhile."""
        return self._event


@dataclass(frozen=True)
class _Away:
    """Bytes of the file that the staging file does not hold: a base chunk (`base`: its index, fetched
    through the session's `fetch`), or a chunk write-behind stored and dropped from staging (None)."""
    entry: ChunkEntry
    base: int | None


class _Flight:
    """A write-behind upload; stale once a byte of its span changed after the upload began."""

    __slots__ = ("stale",)

    def __init__(self) -> None:
        self.stale = False


class WriteSession:
    """A file open for writing: bytes staged locally, full chunks uploaded while the writer writes,
    the new version committed atomically on flush.

    The FUSE layer creates one per file opened for writing (`base`: the committed version when opened
    without O_TRUNC), forwards write/read/truncate, calls flush on fsync and close, then aclose (or
    abort to drop the changes). Background uploads run in `nursery` until aclose or abort.
    `upload_limiter` (upload slots, default fetch_concurrency per session) and `io_limiter` (staging
    I/O threads) may be shared by all sessions of a mount.
    """

    def __init__(self, pool: StorePool, catalog: Catalog, path: str, *, staging_dir: Path,
                 base: Manifest | None = None, mode: int = 0o644, nursery: trio.Nursery,
                 fetch: Callable[[int], Awaitable[bytes]] | None = None,
                 upload_limiter: trio.CapacityLimiter | None = None,
                 io_limiter: trio.CapacityLimiter | None = None, replaces_checkpoint: bool = False,
                 staging_file: type[StagingFile] = StagingFile) -> None:
        """`replaces_checkpoint`: the file was opened with O_TRUNC over a committed torch/safetensors
        checkpoint, so an empty file at close is a saver that died before its first byte, not a
        checkpoint (an explicit truncate(2) to zero passes False). `staging_file`: the kind of staging
        file (tests inject one that fails as a filesystem they cannot make here would)."""
        self._replaces_checkpoint = replaces_checkpoint
        self._pool = pool
        self._catalog = catalog
        self._cfg = pool.config
        self._cs = self._cfg.chunk_size
        self.path = normalize_path(path)  # the FUSE layer may reassign it (rename while open)
        self.also: list[str] = []         # the file's other names (hard links): each commit is theirs too
        # The path and the folders above it -> the order of their versions the writer saw (the FUSE
        # layer sets it before each commit): a commit after another mount removed or renamed one fails.
        self.seen: dict[str, tuple[int, str]] = {}
        self.mode = mode & 0o7777
        # Owner, group, atime and extended attributes of the commits (Manifest fields; the FUSE layer
        # sets them, see set_attributes); ctime is the commit's time.
        self.attributes: dict[str, object] = {}
        self._base = base
        self._fetch = fetch or self._fetch_base
        self._slots = upload_limiter or trio.CapacityLimiter(self._cfg.fetch_concurrency)
        self._lock = trio.Lock()
        self._file = staging_file(Path(staging_dir) / f"cpfs-write-{uuid.uuid4().hex}.stage",
                                 base.size if base else 0, io_limiter or trio.CapacityLimiter(_IO_THREADS),
                                 lambda: self.path, mode=self._cfg.file_mode, dir_mode=self._cfg.dir_mode)
        self._uploader = Uploader(pool)

        # Content. A "clean" span's bytes are stored as its entry says; `pending`: stored by this
        # session and not yet named by a commit.
        self._size = base.size if base else 0
        self._mtime_ns = base.mtime_ns if base else time.time_ns()
        self._mod = 0                         # bumped by every change
        self._committed: Manifest | None = base
        self._committed_mod = 0 if base else -1
        # path -> the version an fsync committed last, while it is the session's last commit: a snapshot
        # the next commit replaces, so that a writer's fsyncs do not retire the versions before it.
        self._snapshot: dict[str, tuple[int, str]] = {}
        self._poisoned: tuple[str, int] | None = None   # why and errno: a write or truncate failed
        self._refused: tuple[int, CpfsError] | None = None   # (mod, why) last recorded as a failed version
        self._clean: dict[Span, tuple[ChunkEntry, bool]] = {}
        self._clean_keys: list[Span] = []     # sorted
        self._max_span = self._cs
        self._away: Spans[_Away] = Spans()     # bytes not in the staging file (see _Away)
        self._fetching: dict[int, trio.Event] = {}   # by offset: away spans being copied back
        if base is not None:
            for i, c in enumerate(base.chunks):
                self._add_clean((base.offsets[i], c.raw_len), c, pending=False)
                self._away.add(base.offsets[i], c.raw_len, _Away(c, i))
        # Dropping stored spans from staging (see _drop_settled); reads of staged bytes count as
        # readers, and no drop punches while one runs nor a read starts on a range being punched.
        self._droppable: list[Span] = []      # streamed spans, waiting for their record to be finished
        self._can_drop = True                 # until the staging filesystem refuses hole punching
        self._readers = 0
        self._no_readers = _Signal()
        self._dropping: Span | None = None    # (start, end) being punched
        self._dropped = _Signal()
        self._room = _Signal()                # write-behind took a step that may free staging room
        self._room_waits = 0                  # writes that found staging full and waited

        # Write-behind.
        self._streaming = base is None or base.size == 0
        self._scanner = BoundaryScanner(self._cs)
        self._scan_dirty = False              # a byte the scanner read has changed since
        self._frontier = 0                    # bytes [0, frontier) have all been written
        self._ahead: list[Span] = []          # written ranges beyond it, as (start, end)
        self._next_cut = 0
        self._inflight: dict[Span, _Flight] = {}
        self._background = 0                  # write-behind uploads and scans running
        self._idle = _Signal()                # fires when one of them ends
        self._paused = 0
        self._stream_error: Exception | None = None
        self._stream_failures = 0             # write-behind uploads that failed in a row
        self._retry_pending = False           # ... and write-behind resumes after a pause (_stream_upload)
        self._wake = _Signal()
        self._pump_scope = trio.CancelScope()
        self._pump_done = trio.Event()

        self._bytes_written = self._reused = self._streamed = self._discarded = 0
        self._fetched = self._buffered = self._peak = self._commits = 0
        self._drops = self._refetched = 0
        nursery.start_soon(self._pump)

    # ------------------------------------------------------------------ public

    @property
    def size(self) -> int:
        return self._size

    @property
    def mtime_ns(self) -> int:
        """The modification time the next commit records (the last write's, or one set_attributes gave)."""
        return self._mtime_ns

    @property
    def staging_path(self) -> Path:
        return self._file.path

    @property
    def committed(self) -> Manifest | None:
        """The version the next commit builds on (its base, then its own last commit): that commit
        names this one's unchanged chunks by reference, unchecked (the FUSE layer holds it: holds.py)."""
        return self._committed

    def statistics(self) -> WriterStats:
        up = self._uploader.statistics()
        return WriterStats(
            size=self._size, bytes_written=self._bytes_written, chunks_uploaded=up.chunks_new,
            chunks_deduped=up.chunks_deduped, chunks_reused=self._reused, chunks_streamed=self._streamed,
            chunks_discarded=self._discarded, chunks_renewed=up.renewals, chunks_lost=up.lost,
            bytes_uploaded=up.stored_bytes,
            new_raw_bytes=up.new_raw_bytes, base_chunks_fetched=self._fetched,
            chunks_dropped=self._drops, dropped_fetched=self._refetched,
            buffered_bytes=self._buffered, peak_buffered_bytes=self._peak,
            uploads_in_flight=len(self._inflight), commits=self._commits, room_waits=self._room_waits)

    async def write(self, offset: int, data: bytes | memoryview) -> int:
        if offset < 0:
            raise StagingError(f"{self.path}: write at negative offset {offset}", errno.EINVAL)
        if not data:
            return 0
        end = offset + len(data)
        while True:
            async with self._lock:
                self._file.check_open()
                self._check_poisoned()
                room = self._room.next()            # before the attempt: a step during it is not missed
                try:
                    if self._away:
                        await self._before_change(offset, end)
                    await self._file.pwrite(data, offset)
                except StagingError as e:
                    if not e.full or not (room.is_set() or self._room_may_come()):
                        self._poison(f"write of {len(data)} bytes at {offset}", e)
                        raise
                    self._changed(offset, end)      # some of it may have landed: not stored as it is
                except BaseException as e:
                    self._poison(f"write of {len(data)} bytes at {offset}", e)
                    raise
                else:
                    self._size = max(self._size, end)
                    self._changed(offset, end)
                    self._bytes_written += len(data)
                    self._advance_frontier(offset, end)
                    return len(data)
            await self._wait_for_room(room, offset, len(data))

    def _room_may_come(self) -> bool:
        """Whether write-behind may still free staging room for a write that found it full: a span is
        being stored or scanned, one is ready to store, or stored ones are ready to drop. Not when the
        file is not written in order (nothing is stored before flush) or staging cannot punch holes."""
        if not (self._streaming and self._can_drop):
            return False
        if self._stream_error is not None:
            return self._retry_pending
        scanner = self._scanner
        return bool(self._background or self._ready_span() is not None
                    or (self._droppable and sum(self._droppable[0]) <= scanner.settled_upto)
                    or (not scanner.done and scanner.need <= self._frontier))

    async def _wait_for_room(self, room: trio.Event, offset: int, length: int) -> None:
        """Backpressure: the staging disk is full and write-behind is behind the writer. The write waits,
        without the lock (write-behind's drops take it), for write-behind's next step, then tries again.
        Only writes still in flight can land meanwhile, and any order of those is one the writer allowed.
        While an upload or scan runs, the write waits for it (the store's timeout bounds each request;
        a failed upload ends write-behind, and the next try fails); with none running, a step that does
        not come within ROOM_WAIT fails the write (ENOSPC) instead of holding it."""
        self._room_waits += 1
        if self._room_waits == 1 or self._room_waits % 100 == 0:
            log.info("%s: staging is full at offset %d (+%d); the write waits for write-behind to store "
                     "and drop chunks (%d waits so far)", self.path, offset, length, self._room_waits)
        try:
            while not room.is_set():
                with trio.move_on_after(ROOM_WAIT):
                    await room.wait()
                if room.is_set():
                    break
                if self._background:
                    log.warning("%s: a write at %d has waited %.0f s for staging room; %d uploads and scans "
                                "of write-behind still run", self.path, offset, ROOM_WAIT, self._background)
                    continue
                e = StagingError(f"{self.path}: staging file {self._file.path} is full and write-behind took "
                                 f"no step in {ROOM_WAIT:.0f} s (write at {offset}, {length} bytes)", errno.ENOSPC)
                self._poison(f"write of {length} bytes at {offset}", e)
                raise e
        except BaseException as e:      # interrupted: part of the write may have landed
            self._poison(f"write of {length} bytes at {offset}", e)
            raise

    def set_attributes(self, **fields: object) -> None:
        """chmod, chown, utimens, setxattr of the open file: the next flush commits them, even if no byte
        changed. `mode` and `mtime_ns` (a later write sets mtime again) or Manifest's other fields."""
        if "mode" in fields:
            self.mode = int(fields.pop("mode")) & 0o7777  # type: ignore[call-overload]
        if "mtime_ns" in fields:
            self._mtime_ns = int(fields.pop("mtime_ns"))  # type: ignore[call-overload]
        self.attributes.update(fields)
        self._mod += 1

    async def read(self, offset: int, size: int) -> bytes:
        """Current bytes, including writes not committed yet."""
        self._file.check_open()
        end = min(offset + size, self._size)
        if offset < 0 or offset >= end:
            return b""
        async with self._reading(offset, end):
            return await self._file.pread(offset, end - offset)

    async def truncate(self, size: int) -> None:
        if size < 0:
            raise StagingError(f"{self.path}: truncate to negative size {size}", errno.EINVAL)
        async with self._lock:
            self._file.check_open()
            self._check_poisoned()
            old = self._size
            if size == old:
                return
            # No upload starts during the cut, and one reading the cut bytes meanwhile finds the file
            # short: an answer to drop (as one that a write overlaps is), not a failure that stops
            # write-behind until the flush.
            self._paused += 1
            self._stale_flights(size, old)
            try:
                if size < old and self._away:
                    await self._before_change(size, old, shrink=True)
                await self._file.truncate(size)
            except BaseException as e:
                self._poison(f"truncate to {size} bytes", e)
                raise
            finally:
                self._paused -= 1
                self._wake.fire()
            self._size = size
            self._changed(min(old, size), max(old, size))
            if size < old:
                self._restart_stream(size)

    async def flush(self, *, closing: bool = True) -> Manifest | None:
        """Store every chunk of the current content and commit it as the path's new version; a no-op
        (returning the last commit) if nothing changed since. If a store fails below quorum this
        raises its StoreError and the previously committed version stays current.

        Never commits a poisoned session (WriteFailed, with the failed write's errno) nor an
        incomplete checkpoint (see the module doc): with `closing` (close) the latter is recorded as a
        failed version and raises IncompleteFile; without (fsync) its chunks are stored, nothing is
        recorded, and it returns None."""
        async with self._lock:
            self._file.check_open()
            try:
                self._check_poisoned()
            except WriteFailed as e:
                log.error("flush refused: %s", e)
                raise
            if self._committed is not None and self._committed_mod == self._mod:
                return self._committed
            self._paused += 1
            try:
                while self._background:  # let write-behind settle; it resumes after the commit
                    await self._idle.wait()
                self._stream_error = None
                return await self._commit(closing)
            except CpfsError as e:
                log.error("%s: flush failed, the last committed version stays current: %s", self.path, e)
                raise
            finally:
                self._paused -= 1
                self._wake.fire()

    async def abort(self) -> None:
        """Drop the staging file and the uploads in progress; commit nothing."""
        if not self._file.closed and self._mod != self._committed_mod:
            log.info("%s: write aborted, uncommitted changes dropped", self.path)
        await self.aclose()

    async def aclose(self) -> None:
        """Stop write-behind and delete the staging file. Commits nothing: flush first to keep data."""
        self._pump_scope.cancel()
        async with self._lock:
            if self._file.closed:
                return
            self._file.closed = True  # nothing new starts while write-behind winds down
            with trio.CancelScope(shield=True):  # brief, and must not leave the staging file behind
                await self._pump_done.wait()
                await self._file.aclose()

    # ------------------------------------------------------------------ failures

    def _poison(self, what: str, e: BaseException) -> None:
        """A write or truncate failed part-way: from now on this open file never commits."""
        if self._poisoned is not None:
            return
        err = getattr(e, "errno", None) if isinstance(e, (CpfsError, OSError)) else None
        cause = str(e) if isinstance(e, (CpfsError, OSError)) else f"interrupted ({type(e).__name__})"
        self._poisoned = (f"{self.path}: an earlier {what} failed, so this open file will not commit "
                          f"and the previous version stays current: {cause}", err or errno.EIO)
        log.error("%s", self._poisoned[0])
        self._wake.fire()  # write-behind stops: nothing of this content will be committed

    def _check_poisoned(self) -> None:
        if self._poisoned is not None:
            raise WriteFailed(*self._poisoned)

    # ------------------------------------------------------------------ base version

    async def _fetch_base(self, i: int) -> bytes:
        assert self._base is not None
        where = f"file {self.path} offset {self._base.offsets[i]} chunk {i}"
        return await self._pool.fetch_chunk(self._base.chunks[i], where)

    async def _materialise(self, offset: int) -> None:
        """Copy the away span at `offset` into the staging file, once; concurrent callers wait for the
        first."""
        while (found := self._away.get(offset)) is not None:
            if offset in self._fetching:
                await self._fetching[offset].wait()
                continue
            done = self._fetching[offset] = trio.Event()
            length, away = found
            try:
                self._hold(length)
                try:
                    if away.base is not None:
                        data = await self._fetch(away.base)
                    else:
                        data = await self._pool.fetch_chunk(
                            away.entry, f"file {self.path} offset {offset} (written, dropped from staging)")
                    if len(data) != length:
                        raise CpfsError(f"{self.path}: chunk at offset {offset} has {len(data)} bytes, "
                                        f"expected {length}")
                    keep = min(length, self._size - offset)
                    if keep > 0:
                        await self._file.pwrite(memoryview(data)[:keep], offset)
                finally:
                    self._release(length)
                self._away.pop(offset)
                if away.base is not None:
                    self._fetched += 1
                else:
                    self._refetched += 1
            finally:
                del self._fetching[offset]
                done.set()

    @asynccontextmanager
    async def _reading(self, start: int, end: int) -> AsyncIterator[None]:
        """Staged bytes [start, end) are all in the staging file while the body reads them: away spans
        copied back, none punched meanwhile."""
        self._readers += 1
        try:
            while self._dropping is not None and self._dropping[0] < end and start < self._dropping[1]:
                await self._dropped.wait()
            for offset in self._away.overlapping(start, end):
                await self._materialise(offset)
            yield
        finally:
            self._readers -= 1
            if not self._readers:
                self._no_readers.fire()

    def _read_via_session(self, away: Spans[_Away]) -> ReadAt:
        """read_at for worker threads: staged bytes directly, a range with away bytes (as of `away`, a
        snapshot: spans leave it, none join while a commit holds the lock) through the session."""
        def read_at(offset: int, length: int) -> bytes:
            if away.overlapping(offset, offset + length):
                return trio.from_thread.run(self.read, offset, length)
            return self._file.read_at(offset, length)
        return read_at

    async def _before_change(self, start: int, end: int, shrink: bool = False) -> None:
        """Away spans that bytes [start, end) cover partly are copied back before those bytes change;
        those covered wholly (or cut off by a shrink) are never needed again."""
        for lo in self._away.overlapping(start, end):
            found = self._away.get(lo)
            if found is None:
                continue
            hi = lo + found[0]
            gone = lo >= start if shrink else (start <= lo and hi <= end)
            if gone:
                while lo in self._fetching:  # a read is copying it: let it finish first
                    await self._fetching[lo].wait()
                self._away.pop(lo)
            else:
                await self._materialise(lo)

    # ------------------------------------------------------------------ change tracking

    def _changed(self, start: int, end: int) -> None:
        """Bytes [start, end) changed: spans holding any of them are no longer stored as they are."""
        self._mod += 1
        self._mtime_ns = time.time_ns()
        if start < self._scanner.read_upto:
            self._scan_dirty = True
        lo = bisect.bisect_left(self._clean_keys, (start - self._max_span + 1, 0))
        hi = bisect.bisect_left(self._clean_keys, (end, 0))
        keep = []
        for key in self._clean_keys[lo:hi]:
            if key[0] + key[1] > start:
                if self._clean.pop(key)[1]:
                    self._discarded += 1
            else:
                keep.append(key)
        self._clean_keys[lo:hi] = keep
        self._stale_flights(start, end)

    def _stale_flights(self, start: int, end: int) -> None:
        """Uploads in flight of spans holding bytes of [start, end) store what is no longer there."""
        for (offset, length), flight in self._inflight.items():
            if offset < end and offset + length > start:
                flight.stale = True

    def _add_clean(self, key: Span, entry: ChunkEntry, pending: bool) -> None:
        if key not in self._clean:
            bisect.insort(self._clean_keys, key)
        self._clean[key] = (entry, pending)
        self._max_span = max(self._max_span, key[1])

    def _hold(self, n: int) -> None:
        self._buffered += n
        self._peak = max(self._peak, self._buffered)

    def _release(self, n: int) -> None:
        self._buffered -= n

    # ------------------------------------------------------------------ write-behind

    def _advance_frontier(self, start: int, end: int) -> None:
        if start > self._frontier:
            self._remember_ahead(start, end)
            return
        if end <= self._frontier:
            return
        self._frontier = end
        while self._ahead and self._ahead[0][0] <= self._frontier:
            self._frontier = max(self._frontier, self._ahead.pop(0)[1])
        self._wake.fire()

    def _remember_ahead(self, start: int, end: int) -> None:
        ahead = self._ahead
        i = bisect.bisect_left(ahead, (start,))
        if i > 0 and ahead[i - 1][1] >= start:
            i -= 1
            start, end = ahead[i][0], max(end, ahead[i][1])
        j = i
        while j < len(ahead) and ahead[j][0] <= end:
            end = max(end, ahead[j][1])
            j += 1
        ahead[i:j] = [(start, end)]
        if len(ahead) > _MAX_AHEAD:
            ahead.pop()  # forgetting a range only costs write-behind: flush stores it

    def _restart_stream(self, size: int) -> None:
        """After a shrink: predictions past the new end are void."""
        self._frontier = min(self._frontier, size)
        self._ahead = [(s, min(e, size)) for s, e in self._ahead if s < size]
        self._droppable = [span for span in self._droppable if sum(span) <= size]
        if self._scanner.read_upto > size or self._next_cut > size:
            self._scanner = BoundaryScanner(self._cs)
            self._scan_dirty = False
            self._next_cut = 0  # spans still stored as they are are skipped, not uploaded again
        if size == 0:
            self._streaming = True  # no base bytes remain: the file is written from scratch
        self._wake.fire()

    def _ready_span(self) -> Span | None:
        """The next span of the predicted layout if all its bytes are written (as chunking.cut)."""
        pos = self._next_cut
        end = chunk_end(pos, self._cs, self._scanner.boundaries)
        if end > min(self._frontier, self._scanner.known_upto):
            return None
        return pos, end - pos

    async def _pump(self) -> None:
        """Write-behind, and the renewal of what it stored, until the session closes."""
        try:
            with self._pump_scope:
                async with trio.open_nursery() as uploads:
                    keeper = trio.CancelScope()
                    uploads.start_soon(self._keep_fresh, keeper)
                    try:
                        await self._write_behind(uploads)
                    finally:
                        keeper.cancel()
        except Exception:
            log.exception("%s: write-behind stopped; flush will store the rest", self.path)
        finally:
            self._pump_done.set()

    async def _keep_fresh(self, scope: trio.CancelScope) -> None:
        """The chunks this session stored stay safe from a gc while the file is open (upload: Renewal)."""
        with scope:
            await self._uploader.keep_fresh()

    async def _write_behind(self, uploads: trio.Nursery) -> None:
        """Walk the predicted layout behind the writer, storing each complete span."""
        while not self._file.closed:
            # Taken first: an upload that ends while this pass awaits (a drop, a slot, a scan) fires
            # it, and the pass runs again instead of sleeping past its span.
            woken = self._wake.next()
            if (self._paused or not self._streaming or self._stream_error is not None
                    or self._poisoned is not None):
                await woken.wait()
                continue
            if self._droppable and sum(self._droppable[0]) <= self._scanner.settled_upto:
                await self._drop_settled()
            span = self._ready_span()
            if span is not None:
                await self._start_upload(uploads, span)
                continue
            scanner = self._scanner
            if not scanner.done and scanner.need <= self._frontier:
                await self._scan(scanner)
                continue
            await woken.wait()

    async def _start_upload(self, uploads: trio.Nursery, span: Span) -> None:
        if span in self._clean or span in self._inflight:
            self._next_cut = sum(span)
            return
        token = object()
        await self._slots.acquire_on_behalf_of(token)
        if (self._paused or self._stream_error is not None or self._ready_span() != span
                or span in self._clean or span in self._inflight):
            self._slots.release_on_behalf_of(token)  # things moved while we waited: look again
            return
        self._next_cut = sum(span)
        flight = self._inflight[span] = _Flight()
        self._background += 1
        uploads.start_soon(self._stream_upload, span, flight, token)

    async def _stream_upload(self, span: Span, flight: _Flight, token: object) -> None:
        failed: Exception | None = None
        try:
            entry = await self._store_span(*span)
        except Exception as e:
            if not (flight.stale or self._file.closed):
                if not self._retry_pending:          # uploads failing together are one failure
                    self._stream_failures += 1
                again = isinstance(e, CpfsError) and self._stream_failures <= STREAM_RETRIES
                if isinstance(e, CpfsError):
                    log.warning("%s: write-behind of bytes %d+%d failed, %s: %s", self.path, span[0], span[1],
                                "retried shortly" if again else "flush will retry", e)
                else:
                    log.exception("%s: write-behind of bytes %d+%d failed", self.path, *span)
                self._stream_error, self._retry_pending = e, again
                failed = e if again else None
        else:
            self._stream_failures = 0
            if flight.stale:
                self._discarded += 1
            else:
                self._add_clean(span, entry, pending=True)
                self._streamed += 1
                if self._can_drop:
                    bisect.insort(self._droppable, span)
                    self._wake.fire()
        finally:
            del self._inflight[span]
            self._slots.release_on_behalf_of(token)
            self._background -= 1
            self._idle.fire()
            self._room.fire()
        if failed is not None:
            # A store refused one put, or was down a moment: write-behind resumes after a pause. Latched
            # until flush, one failure made a save larger than the staging disk fail with ENOSPC at
            # once, the store back or not (an audit's find). A write waits meanwhile (ROOM_WAIT).
            await trio.sleep(0.5 * 2 ** (self._stream_failures - 1))
            if self._stream_error is failed:
                self._stream_error, self._retry_pending = None, False
            if not flight.stale and span not in self._clean:
                self._next_cut = min(self._next_cut, span[0])     # that span again: else it stayed in staging
            self._wake.fire()
            self._room.fire()

    async def _drop_settled(self) -> None:
        """Streamed spans that lie inside finished tensor records leave the staging file: their bytes are
        stored, and nothing reads them again unless the writer goes back (then they are copied back,
        like a base version's chunks). Staging a checkpoint whole cost fresh page-cache pages for every
        byte (and disk writes, once more than ~10% of memory was dirty); now it holds about a record.
        Spans holding a zip header stay: the index at commit reads those."""
        try:
            await self._drop_ready()
        finally:
            self._room.fire()

    async def _drop_ready(self) -> None:
        settled = self._scanner.settled_upto
        ready = list(itertools.takewhile(lambda span: sum(span) <= settled, self._droppable))  # sorted
        self._droppable = self._droppable[len(ready):]
        async with self._lock:
            while self._readers:
                await self._no_readers.wait()
            spans = [span for span in ready if self._scanner.inside_record(span[0], sum(span))
                     and span in self._clean and not self._away.overlapping(span[0], sum(span))]
            if not spans or self._file.closed or self._poisoned is not None:
                return
            # Every one of them is recorded as away, punched or not, even if a punch fails part-way: a
            # clean span's bytes are on the stores, so reading it back from there is always right.
            for offset, length in spans:
                self._away.add(offset, length, _Away(self._clean[(offset, length)][0], None))
            self._dropping = (spans[0][0], sum(spans[-1]))
            try:
                with trio.CancelScope(shield=True):
                    punched = await self._file.punch(spans)
            except StagingError as e:
                log.warning("%s: dropping stored chunks from the staging file failed, they stay there "
                            "too: %s", self.path, e)
                punched = 0
            finally:
                self._dropping = None
                self._dropped.fire()
            self._can_drop = punched == len(spans)   # else the staging filesystem cannot punch holes
            self._drops += punched

    async def _scan(self, scanner: BoundaryScanner) -> None:
        self._background += 1
        try:
            await self._file.fd()
            await self._file.run(scanner.advance, self._file.read_at, self._frontier, limiter=self._pool.cpu)
        except CpfsError as e:
            if not self._file.closed:
                log.warning("%s: write-behind stopped: %s", self.path, e)
            self._stream_error = e
        finally:
            self._background -= 1
            self._idle.fire()
            self._room.fire()

    # ------------------------------------------------------------------ storing and committing

    async def _store_span(self, offset: int, length: int) -> ChunkEntry:
        """Read, encode and store bytes [offset, offset+length). The caller holds an upload slot."""
        fd = await self._file.fd()
        self._hold(2 * length)  # raw bytes and their compressed copy, inside the thread
        try:
            async with self._reading(offset, offset + length):
                enc = await self._file.run(encode_span, fd, offset, length, self._cfg.compression,
                                           f"{self.path} (staging file)", limiter=self._pool.cpu)
        finally:
            self._release(2 * length)
        self._hold(enc.stored_len)
        try:
            return await self._uploader.store(enc)
        finally:
            self._release(enc.stored_len)

    def _reader(self) -> tuple[ReadAt, trio.CapacityLimiter]:
        """read_at over the staged content for work in a thread, and the limiter to run it under."""
        if self._away:  # away bytes are read through the session, which copies them back
            return self._read_via_session(self._away.copy()), trio.CapacityLimiter(1)  # not shared: its
            # nested reads need those
        return self._file.read_at, self._pool.cpu

    async def _layout(self, size: int) -> tuple[TensorIndex | None, list[int]]:
        """Tensor index and cut points of the staged content (the importer's, see the module doc)."""
        if size == 0:
            return None, []
        read_at, limiter = self._reader()
        if self._away:
            index = await self._file.run(build_index, read_at, size, self.path, limiter=limiter)
        else:
            index = await self._file.run(index_file, self._file.path, self.path, limiter=limiter)
        scanner = None if self._scan_dirty else self._scanner  # resumed, if its bytes are unchanged
        return index, await self._file.run(cut_points, read_at, size, index, self._cs, scanner, limiter=limiter)

    async def _incomplete(self, size: int) -> str | None:
        """Why the staged content is an incomplete checkpoint, if it is one (cpfs/completeness.py).
        A file the indexer read whole is checked too: a save into the old file opened "r+b" that
        stopped partway indexes fine (the old directory over the new members) and loads as neither."""
        if size == 0:
            return ("empty: the saver wrote nothing over a checkpoint (opened with O_TRUNC, closed "
                    "before its first byte)") if self._replaces_checkpoint else None
        await self._file.fd()
        read_at, limiter = self._reader()
        return await self._file.run(incomplete_reason, read_at, size, self.path, limiter=limiter)

    async def _store_all(self, spans: list[Span]) -> list[ChunkEntry]:
        """Entries for every span: reused if stored as they are, else encoded and stored now."""
        entries: list[ChunkEntry | None] = [None] * len(spans)
        todo = []
        for i, span in enumerate(spans):
            if span in self._clean:
                entries[i] = self._clean[span][0]
                self._reused += 1
            else:
                todo.append(i)

        async def store(i: int) -> None:
            async with self._slots:
                entries[i] = entry = await self._store_span(*spans[i])
            self._add_clean(spans[i], entry, pending=True)  # a retry after a failure reuses it
            # Stored by a flush (an fsync mid-save): droppable from staging like a streamed span, else
            # a saver that fsyncs as it goes kept the whole file in staging (ENOSPC on a small disk).
            if self._can_drop and self._streaming:
                k = bisect.bisect_left(self._droppable, spans[i])
                if k == len(self._droppable) or self._droppable[k] != spans[i]:
                    self._droppable.insert(k, spans[i])

        await in_parallel(store, todo, self._cfg.fetch_concurrency)
        return [e for e in entries if e is not None]

    async def _vouched(self, spans: list[Span], entries: list[ChunkEntry]) -> list[ChunkEntry]:
        """The entries, once none names a chunk whose copies may be gone (a daemon frozen for longer
        than the gc grace with the file open, a store wiped: Uploader.unsure). Those spans are stored
        again, from staging or, if dropped from it, from a copy left on some store; with none left the
        commit fails and the previous version stays current."""
        lost = await self._uploader.unsure(e.digest for e in entries)
        if not lost:
            return entries
        log.warning("%s: %d chunks stored while the file was open lost their copies before the commit: "
                    "storing them again", self.path, len(lost))
        for span, entry in zip(spans, entries):
            if entry.digest in lost and self._clean.pop(span, None) is not None:
                self._clean_keys.remove(span)
        return await self._store_all(spans)

    async def _commit(self, closing: bool) -> Manifest | None:
        size, mod = self._size, self._mod
        if closing and self._refused is not None and self._refused[0] == mod:
            raise self._refused[1]                  # already recorded as a failed version
        index, points = await self._layout(size)
        reason = await self._incomplete(size)
        spans = cut(size, self._cs, points)
        entries = await self._vouched(spans, await self._store_all(spans))
        manifest = Manifest(path=self.path, size=size, mtime_ns=self._mtime_ns, mode=self.mode,
                            chunk_size=self._cs, chunks=tuple(entries), version=0,
                            tensor_index=index.to_json() if index else None,
                            **{"ctime_ns": time.time_ns(), **self.attributes})  # type: ignore[arg-type]
        if reason is not None:
            return await self._refuse(manifest, mod, reason, closing)
        # One transaction: every name of the file (hard links) shows the new version, or none does. It
        # replaces the snapshot the last fsync committed, if that was the session's last commit.
        try:
            committed = await self._catalog.transact(manifest.at([self.path, *self.also]), replacing=self._snapshot,
                                                     seen=self.seen)
        except Stale as e:
            if not closing:
                raise
            self._refused = (mod, Stale(f"{e}; {await self._keep_failed(manifest, str(e))}"))
            raise self._refused[1] from None
        self._snapshot = {} if closing else {m.path: m.order for m in committed}
        manifest = committed[0]
        self._uploader.settled(e.digest for e in entries)
        layout = set(spans)  # uploads outside it: overwritten, or the final layout cut differently
        self._discarded += sum(1 for key, (_, pending) in self._clean.items() if pending and key not in layout)
        self._clean = {span: (entry, False) for span, entry in zip(spans, entries)}
        self._clean_keys = list(spans)
        self._committed, self._committed_mod = manifest, mod
        self._commits += 1
        log.info("%s: committed %d bytes in %d chunks (%d new this session, %d streamed, %d dropped from "
                 "staging)%s", self.path, size, len(entries), self._uploader.statistics().chunks_new,
                 self._streamed, self._drops,
                 f", {len(index.tensors)} tensors indexed" if index else "")
        return manifest

    async def _refuse(self, manifest: Manifest, mod: int, reason: str, closing: bool) -> None:
        """An incomplete checkpoint, its chunks stored: at fsync say nothing (the saver is not done);
        at close record it as a failed version and fail the close."""
        if not closing:
            log.info("%s: fsync of an incomplete file: %d chunks stored, no version recorded (%s)",
                     self.path, len(manifest.chunks), reason)
            return None
        kept = await self._keep_failed(manifest, reason)
        self._refused = (mod, IncompleteFile(f"{self.path}: not committed, the file is incomplete: {reason}; {kept}"))
        raise self._refused[1]

    async def _keep_failed(self, manifest: Manifest, reason: str) -> str:
        """Record bytes that are not committed as a failed version of the path (never current; `cpfs
        log` lists it, `cpfs restore` brings it back); what became of them, for the error."""
        try:
            failed = await self._catalog.commit_failed(manifest, reason)
            self._uploader.settled(e.digest for e in manifest.chunks)
            return f"its {manifest.size} bytes are kept as failed version {failed.version} (cpfs log {self.path})"
        except StoreError as e:
            log.warning("%s: could not record the bytes not committed as a failed version: %s", self.path, e)
            return "they could not be kept as a failed version"
