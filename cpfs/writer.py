"""Files written through the mount: staged locally, uploaded behind the writer, committed on flush.

A WriteSession is one file open for writing. Every write lands in a sparse staging file, never in
memory. A background task (write-behind) follows the writer and stores each chunk as soon as its bytes
are complete, so that flush (fsync, close) finds little left to do. Flush cuts the final layout, stores
what is still missing, and commits the manifest once every chunk is on write_quorum stores.

Chunk cuts. The layout is the importer's, a pure function of the file's bytes:
`cut(size, chunk_size, tensor_boundaries(index))`. So a checkpoint written through the mount shares the
chunks of its unchanged tensors with its predecessors, and with the same file put by `cpfs put`. While
the file is being written there is no index yet (the zip directory comes last), so a BoundaryScanner
predicts the same cut points from the bytes in file order: zip local headers and data descriptors
(torch.save writes a member's size only after its data), or the safetensors header. If the finished
file has no index (a zip whose pickle the indexer rejects), the scanner's cut points are the layout.

A prediction that turns out wrong (the writer went back and changed bytes, or truncated) costs an
upload, never correctness: flush stores exactly the final layout, and reuses an earlier upload only if
its span is in the layout and no byte of it changed since. Such superseded uploads stay on the stores as
unreferenced chunks, garbage for a later collector (`statistics().chunks_discarded` counts them).

Base versions. Opened without O_TRUNC, a session starts from the committed version. Base chunks are
fetched into the staging file only when a read or a partial overwrite needs their bytes, and chunks the
new layout keeps unchanged are committed by reference, never read. Write-behind is off for such
sessions (until they are truncated to zero): their bytes are not written in file order.

Concurrency. write, truncate and flush run one at a time (one lock); reads do not wait for them. Staging
I/O runs in threads under the io limiter, hashing, compression and scanning under pool.cpu. At most
`fetch_concurrency` chunks (upload slots, shareable between sessions) are in memory being encoded or
stored, whether by write-behind or by flush.
"""
from __future__ import annotations

import bisect
import copy
import errno
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from . import chunk as chunkfmt
from .catalog import Catalog, new_version
from .chunking import cut, tensor_boundaries
from .errors import CpfsError
from .manifest import ChunkEntry, Manifest, normalize_path
from .placement import place
from .pool import StorePool
from .tensor_index import TensorIndex, build_index, index_file

log = logging.getLogger(__name__)

ReadAt = Callable[[int, int], bytes]
Span = tuple[int, int]  # (offset, length)

_INF = 1 << 62                     # beyond any file
_U32 = 0xFFFFFFFF
_LOCAL = b"PK\x03\x04"             # zip local file header
_DESCRIPTOR = b"PK\x07\x08"        # zip data descriptor
_AFTER_MEMBER = (_LOCAL, b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06")
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_SCAN_BLOCK = 1 << 20
_MAX_SAFETENSORS_HEADER = 100 << 20
_MAX_AHEAD = 1024                  # written ranges remembered beyond the contiguous frontier
_IO_THREADS = 4                    # default staging I/O limiter of a session


class StagingError(CpfsError):
    """The local staging file failed (disk full, I/O error), or the session is closed."""

    def __init__(self, message: str, err: int = errno.EIO) -> None:
        super().__init__(message)
        self.errno = err


class _ShortRead(Exception):
    """The file is shorter than the scanner was told (truncated under it)."""


class BoundaryScanner:
    """Predicts a checkpoint's chunk cut points from its bytes, read in file order as they are written.

    The cut points are those `chunking.tensor_boundaries` derives from the finished file's index: start
    and end of every record of at least chunk_size/8 bytes, records being zip members (torch) or
    safetensors tensors. Zip members are followed through their local headers; a member written with
    a data descriptor (flag bit 3, as torch.save does) ends where a descriptor signature is followed by
    the member's own length, the only way to learn where it ends before the zip directory exists.
    Anything else yields no cut points (fixed-size chunks).

    `advance` is blocking (it reads through `read_at`): run it in a thread. It decides only on bytes
    that exist, so advancing in steps over a growing file gives what one pass over the finished file
    gives, as long as the bytes it has read (below `read_upto`) do not change afterwards.
    """

    def __init__(self, chunk_size: int) -> None:
        self.min_len = max(1, chunk_size // 8)
        self.boundaries: list[int] = []   # sorted
        self.known_upto = 0               # every cut point below this offset is in `boundaries`
        self.need = 9                     # no progress until the file holds this many bytes
        self.read_upto = 0                # set before reading: bytes below it may have been used
        self._state = "detect"
        self._at = 0                      # next local header, or scan position in a member's data
        self._member = 0                  # data offset of the member being scanned
        self._big = False                 # that member is known to reach min_len

    @property
    def done(self) -> bool:
        return self._state == "done"

    def copy(self) -> BoundaryScanner:
        clone = copy.copy(self)
        clone.boundaries = list(self.boundaries)
        return clone

    def advance(self, read_at: ReadAt, limit: int, eof: bool = False, budget: int = 8 << 20) -> None:
        """Consume bytes below `limit` (with `eof`, the file ends there) until more are needed or
        about `budget` bytes were read."""
        start = self.read_upto
        try:
            while not self.done and (eof or self.need <= limit) and self.read_upto - start < budget:
                if not getattr(self, f"_{self._state}")(read_at, limit, eof):
                    break
        except _ShortRead:
            self.need = limit + 1  # a truncate raced us; the session restarts with a new scanner

    def _read(self, read_at: ReadAt, offset: int, length: int) -> bytes:
        self.read_upto = max(self.read_upto, offset + length)
        data = read_at(offset, length)
        if len(data) != length:
            raise _ShortRead
        return data

    def _finish(self) -> None:
        self._state = "done"
        self.need = self.known_upto = _INF

    def _have(self, end: int, limit: int, eof: bool) -> bool:
        """Whether bytes up to `end` exist; if the file ends before, scanning is over."""
        if end <= limit:
            return True
        if eof:
            self._finish()
        else:
            self.need = end
        return False

    def _add(self, start: int, length: int) -> None:
        if length >= self.min_len:
            if not self.boundaries or self.boundaries[-1] < start:
                self.boundaries.append(start)
            self.boundaries.append(start + length)

    def _detect(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        if not self._have(9, limit, eof):
            return False
        head = self._read(read_at, 0, 9)
        if head[:4] == _LOCAL:
            self._state, self._at = "zip_header", 0
        elif head[8:9] == b"{":
            self._state = "safetensors"
        else:
            self._finish()
        return True

    def _safetensors(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        (n,) = struct.unpack("<Q", self._read(read_at, 0, 8))
        if not 0 < n <= _MAX_SAFETENSORS_HEADER:
            self._finish()
            return True
        if not self._have(8 + n, limit, eof):
            return False
        points: set[int] = set()
        try:
            header = json.loads(self._read(read_at, 8, n))
            for name, info in header.items():
                if name != "__metadata__":
                    begin, end = info["data_offsets"]
                    if (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
                            and end - begin >= self.min_len):
                        points.update((8 + n + begin, 8 + n + end))
        except (ValueError, TypeError, KeyError, AttributeError):
            points = set()  # not safetensors after all: fixed-size chunks
        self.boundaries = sorted(points)
        self._finish()
        return True

    def _zip_header(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        h = self._at
        self.known_upto = h
        if not self._have(h + 30, limit, eof):
            return False
        fixed = self._read(read_at, h, 30)
        if fixed[:4] != _LOCAL:  # the central directory, or not a zip we understand: no more cuts
            self._finish()
            return True
        _, _, flags, _, _, _, _, comp, uncomp, nlen, elen = _LOCAL_HEADER.unpack(fixed)
        data = h + 30 + nlen + elen
        if not self._have(data, limit, eof):
            return False
        if flags & 8:  # sizes follow the data in a descriptor
            self._state, self._member, self._at, self._big = "zip_data", data, data, False
            return True
        if _U32 in (comp, uncomp):
            comp = _zip64_local_size(self._read(read_at, h + 30 + nlen, elen), comp, uncomp)
        self._add(data, comp)
        self._at = data + comp
        return True

    def _zip_data(self, read_at: ReadAt, limit: int, eof: bool) -> bool:
        start, pos = self._member, self._at
        end = min(limit, pos + _SCAN_BLOCK)
        block = self._read(read_at, pos, end - pos) if end > pos else b""
        q = block.find(_DESCRIPTOR)
        while q >= 0:
            at = pos + q
            if at + 28 > limit and not eof:  # cannot tell yet: wait for the bytes after it
                self._scanned(at)
                self.need = at + 28
                return at > pos
            tail = block[q:q + 28] if q + 28 <= len(block) else self._read(read_at, at, min(28, limit - at))
            size = _descriptor_size(tail, at - start)
            if size:
                self._add(start, at - start)
                self._state, self._at = "zip_header", at + size
                return True
            q = block.find(_DESCRIPTOR, q + 1)
        if eof and end >= limit:  # the member runs to the end of the file
            self._finish()
            return True
        self._scanned(max(pos, end - 3))  # a signature may straddle the block's end
        self.need = end + 1
        return self._at > pos

    def _scanned(self, pos: int) -> None:
        """Bytes below `pos` of the current member hold no descriptor."""
        self._at = pos
        if not self._big and pos - self._member >= self.min_len:
            self._big = True
            self.boundaries.append(self._member)
        self.known_upto = pos if self._big else self._member


def _zip64_local_size(extra: bytes, comp: int, uncomp: int) -> int:
    """A local header's compressed size when its 32-bit field is the zip64 sentinel."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = list(struct.unpack_from(f"<{min(n, len(extra) - pos - 4) // 8}Q", extra, pos + 4))
            if uncomp == _U32 and values:
                values.pop(0)
            if comp == _U32 and values:
                return values[0]
            break
        pos += 4 + n
    return comp


def _descriptor_size(tail: bytes, length: int) -> int:
    """16 or 24 if `tail` starts a data descriptor for a member of `length` bytes, else 0.
    A false match needs the signature and the exact length at the same place: 64 bits by chance."""
    if len(tail) < 16 or tail[:4] != _DESCRIPTOR:
        return 0
    comp32, uncomp32 = struct.unpack_from("<II", tail, 8)
    if comp32 == length and (uncomp32 != 0 or tail[16:20] in _AFTER_MEMBER):
        return 16
    if len(tail) >= 24 and struct.unpack_from("<Q", tail, 8)[0] == length:
        return 24  # zip64 descriptor
    return 0


@dataclass(frozen=True)
class WriterStats:
    size: int                   # current file size
    bytes_written: int          # bytes passed to write()
    chunks_uploaded: int        # chunks this session put on at least one store (new data)
    chunks_deduped: int         # chunks encoded that every target store (or this session) held already
    chunks_reused: int          # layout chunks commits took as they were (base, earlier commit, write-behind)
    chunks_streamed: int        # chunks stored by write-behind, before a flush asked for them
    chunks_discarded: int       # chunks stored by this session that no commit will name (overwritten later)
    bytes_uploaded: int         # stored (compressed) bytes sent to stores, all replicas
    new_raw_bytes: int          # raw bytes of chunks_uploaded: what this session added to the stores
    base_chunks_fetched: int    # base chunks copied into the staging file
    buffered_bytes: int         # chunk bytes in memory now (encoding, uploading, fetching)
    peak_buffered_bytes: int
    uploads_in_flight: int      # write-behind uploads running
    commits: int


class _Signal:
    """Wakes every task waiting on it at the next fire()."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class _Flight:
    """A write-behind upload; stale once a byte of its span changed after the upload began."""

    __slots__ = ("stale",)

    def __init__(self) -> None:
        self.stale = False


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


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
                 io_limiter: trio.CapacityLimiter | None = None) -> None:
        self._pool = pool
        self._catalog = catalog
        self._cfg = pool.config
        self._cs = self._cfg.chunk_size
        self.path = normalize_path(path)  # the FUSE layer may reassign it (rename while open)
        self.mode = mode & 0o7777
        self.staging_path = Path(staging_dir) / f"cpfs-write-{uuid.uuid4().hex}.stage"
        self._base = base
        self._fetch = fetch or self._fetch_base
        self._slots = upload_limiter or trio.CapacityLimiter(self._cfg.fetch_concurrency)
        self._io_limiter = io_limiter or trio.CapacityLimiter(_IO_THREADS)
        self._lock = trio.Lock()

        # The staging file and what uses it.
        self._fd: int | None = None
        self._creating: trio.Event | None = None
        self._closed = False
        self._busy = 0                        # threads using the staging file
        self._idle = _Signal()                # fires when a thread or a background job ends

        # Content. A "clean" span's bytes are stored as its entry says; `pending`: stored by this
        # session and not yet named by a commit.
        self._size = base.size if base else 0
        self._mtime_ns = base.mtime_ns if base else time.time_ns()
        self._mod = 0                         # bumped by every change
        self._committed: Manifest | None = base
        self._committed_mod = 0 if base else -1
        self._clean: dict[Span, tuple[ChunkEntry, bool]] = {}
        self._clean_keys: list[Span] = []     # sorted
        self._max_span = self._cs
        self._placed: dict[str, ChunkEntry] = {}
        self._placing: dict[str, trio.Event] = {}
        self._unfetched: set[int] = set()     # base chunks not in the staging file yet
        self._fetching: dict[int, trio.Event] = {}
        if base is not None:
            for i, c in enumerate(base.chunks):
                self._add_clean((base.offsets[i], c.raw_len), c, pending=False)
            self._unfetched = set(range(len(base.chunks)))

        # Write-behind.
        self._streaming = base is None or base.size == 0
        self._scanner = BoundaryScanner(self._cs)
        self._scan_dirty = False              # a byte the scanner read has changed since
        self._frontier = 0                    # bytes [0, frontier) have all been written
        self._ahead: list[Span] = []          # written ranges beyond it, as (start, end)
        self._next_cut = 0
        self._inflight: dict[Span, _Flight] = {}
        self._background = 0                  # write-behind uploads and scans running
        self._paused = 0
        self._stream_error: Exception | None = None
        self._wake = _Signal()
        self._pump_scope = trio.CancelScope()
        self._pump_done = trio.Event()

        self._bytes_written = self._uploaded = self._deduped = self._reused = 0
        self._streamed = self._discarded = self._bytes_uploaded = self._new_raw = 0
        self._fetched = self._buffered = self._peak = self._commits = 0
        nursery.start_soon(self._pump)

    # ------------------------------------------------------------------ public

    @property
    def size(self) -> int:
        return self._size

    def statistics(self) -> WriterStats:
        return WriterStats(
            size=self._size, bytes_written=self._bytes_written, chunks_uploaded=self._uploaded,
            chunks_deduped=self._deduped, chunks_reused=self._reused, chunks_streamed=self._streamed,
            chunks_discarded=self._discarded, bytes_uploaded=self._bytes_uploaded,
            new_raw_bytes=self._new_raw, base_chunks_fetched=self._fetched,
            buffered_bytes=self._buffered, peak_buffered_bytes=self._peak,
            uploads_in_flight=len(self._inflight), commits=self._commits)

    async def write(self, offset: int, data: bytes | memoryview) -> int:
        if offset < 0:
            raise StagingError(f"{self.path}: write at negative offset {offset}", errno.EINVAL)
        if not data:
            return 0
        async with self._lock:
            self._check_open()
            end = offset + len(data)
            if self._unfetched:
                await self._before_change(offset, end)
            fd = await self._staging()
            await self._thread(_pwrite_all, fd, data, offset, limiter=self._io_limiter)
            self._size = max(self._size, end)
            self._changed(offset, end)
            self._bytes_written += len(data)
            self._advance_frontier(offset, end)
        return len(data)

    async def read(self, offset: int, size: int) -> bytes:
        """Current bytes, including writes not committed yet."""
        self._check_open()
        end = min(offset + size, self._size)
        if offset < 0 or offset >= end:
            return b""
        if self._unfetched:
            assert self._base is not None
            for i in self._base.chunk_range(offset, end - offset):
                await self._materialise(i)
        fd = await self._staging()
        return await self._thread(os.pread, fd, end - offset, offset, limiter=self._io_limiter)

    async def truncate(self, size: int) -> None:
        if size < 0:
            raise StagingError(f"{self.path}: truncate to negative size {size}", errno.EINVAL)
        async with self._lock:
            self._check_open()
            old = self._size
            if size == old:
                return
            if size < old and self._unfetched:
                await self._before_change(size, old, shrink=True)
            fd = await self._staging()
            await self._thread(os.ftruncate, fd, size, limiter=self._io_limiter)
            self._size = size
            self._changed(min(old, size), max(old, size))
            if size < old:
                self._restart_stream(size)

    async def flush(self) -> Manifest:
        """Store every chunk of the current content and commit it as the path's new version; a no-op
        (returning the last commit) if nothing changed since. If a store fails below quorum this
        raises its StoreError and the previously committed version stays current."""
        async with self._lock:
            self._check_open()
            if self._committed is not None and self._committed_mod == self._mod:
                return self._committed
            self._paused += 1
            try:
                while self._background:  # let write-behind settle; it resumes after the commit
                    await self._idle.wait()
                self._stream_error = None
                return await self._commit()
            except CpfsError as e:
                log.error("%s: flush failed, the last committed version stays current: %s", self.path, e)
                raise
            finally:
                self._paused -= 1
                self._wake.fire()

    async def abort(self) -> None:
        """Drop the staging file and the uploads in progress; commit nothing."""
        if not self._closed and self._mod != self._committed_mod:
            log.info("%s: write aborted, uncommitted changes dropped", self.path)
        await self.aclose()

    async def aclose(self) -> None:
        """Stop write-behind and delete the staging file. Commits nothing: flush first to keep data."""
        self._pump_scope.cancel()
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            with trio.CancelScope(shield=True):  # brief, and must not leave the staging file behind
                await self._pump_done.wait()
                while self._busy:
                    await self._idle.wait()
                fd, self._fd = self._fd, None
                await trio.to_thread.run_sync(self._remove_staging, fd, limiter=self._io_limiter)

    # ------------------------------------------------------------------ staging file

    def _check_open(self) -> None:
        if self._closed:
            raise StagingError(f"{self.path}: write session is closed", errno.EBADF)

    async def _thread(self, fn: Callable, *args: object, limiter: trio.CapacityLimiter):
        """Run blocking staging work in a thread; OSErrors become StagingError with their errno."""
        self._check_open()
        self._busy += 1
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
        except OSError as e:
            raise StagingError(f"{self.path}: staging file {self.staging_path}: {e.strerror or e}",
                               e.errno or errno.EIO) from None
        finally:
            self._busy -= 1
            self._idle.fire()

    async def _staging(self) -> int:
        """The staging file's descriptor, created on first use."""
        while self._fd is None:
            if self._creating is not None:
                await self._creating.wait()  # if that attempt failed, the loop tries again
                continue
            self._creating = trio.Event()
            try:
                self._fd = await self._thread(self._create_staging, limiter=self._io_limiter)
            finally:
                self._creating.set()
                self._creating = None
        return self._fd

    def _create_staging(self) -> int:
        self.staging_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.staging_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if self._size:
            os.ftruncate(fd, self._size)  # the base version's bytes arrive as they are needed
        return fd

    def _remove_staging(self, fd: int | None) -> None:
        if fd is not None:
            os.close(fd)
        self.staging_path.unlink(missing_ok=True)

    def _pread(self, offset: int, length: int) -> bytes:
        assert self._fd is not None
        return os.pread(self._fd, length, offset)

    def _read_via_session(self, offset: int, length: int) -> bytes:
        """read_at for worker threads that may need base chunks fetched first."""
        return trio.from_thread.run(self.read, offset, length)

    # ------------------------------------------------------------------ base version

    async def _fetch_base(self, i: int) -> bytes:
        assert self._base is not None
        where = f"file {self.path} offset {self._base.offsets[i]} chunk {i}"
        return await self._pool.fetch_chunk(self._base.chunks[i], where)

    async def _materialise(self, i: int) -> None:
        """Copy base chunk i into the staging file, once; concurrent callers wait for the first."""
        assert self._base is not None
        while i in self._unfetched:
            if i in self._fetching:
                await self._fetching[i].wait()
                continue
            done = self._fetching[i] = trio.Event()
            try:
                offset, length = self._base.offsets[i], self._base.chunks[i].raw_len
                self._hold(length)
                try:
                    data = await self._fetch(i)
                    if len(data) != length:
                        raise CpfsError(f"{self.path}: base chunk {i} has {len(data)} bytes, expected {length}")
                    keep = min(length, self._size - offset)
                    if keep > 0:
                        fd = await self._staging()
                        await self._thread(_pwrite_all, fd, memoryview(data)[:keep], offset,
                                           limiter=self._io_limiter)
                finally:
                    self._release(length)
                self._unfetched.discard(i)
                self._fetched += 1
            finally:
                del self._fetching[i]
                done.set()

    async def _before_change(self, start: int, end: int, shrink: bool = False) -> None:
        """Base chunks that bytes [start, end) cover partly are fetched before those bytes change;
        those covered wholly (or cut off by a shrink) are never needed again."""
        assert self._base is not None
        for i in self._base.chunk_range(start, end - start):
            if i not in self._unfetched:
                continue
            lo, hi = self._base.offsets[i], self._base.offsets[i + 1]
            gone = lo >= start if shrink else (start <= lo and hi <= end)
            if gone:
                while i in self._fetching:  # a read is copying it: let it finish first
                    await self._fetching[i].wait()
                self._unfetched.discard(i)
            else:
                await self._materialise(i)

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
        if self._scanner.read_upto > size or self._next_cut > size:
            self._scanner = BoundaryScanner(self._cs)
            self._scan_dirty = False
            self._next_cut = 0  # spans still stored as they are are skipped, not uploaded again
        if size == 0:
            self._streaming = True  # no base bytes remain: the file is written from scratch
        self._wake.fire()

    def _ready_span(self) -> Span | None:
        """The next span of the predicted layout if all its bytes are written (as chunking.cut)."""
        pos, points = self._next_cut, self._scanner.boundaries
        end = pos + self._cs
        i = bisect.bisect_right(points, pos)
        if i < len(points) and points[i] < end:
            end = points[i]
        if end > min(self._frontier, self._scanner.known_upto):
            return None
        return pos, end - pos

    async def _pump(self) -> None:
        """Write-behind: walk the predicted layout behind the writer, storing each complete span."""
        try:
            with self._pump_scope:
                async with trio.open_nursery() as uploads:
                    while not self._closed:
                        if self._paused or not self._streaming or self._stream_error is not None:
                            await self._wake.wait()
                            continue
                        span = self._ready_span()
                        if span is not None:
                            await self._start_upload(uploads, span)
                            continue
                        scanner = self._scanner
                        if not scanner.done and scanner.need <= self._frontier:
                            await self._scan(scanner)
                            continue
                        await self._wake.wait()
        except Exception:
            log.exception("%s: write-behind stopped; flush will store the rest", self.path)
        finally:
            self._pump_done.set()

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
        try:
            entry = await self._store_span(*span)
        except Exception as e:
            if not (flight.stale or self._closed):
                if isinstance(e, CpfsError):
                    log.warning("%s: write-behind of bytes %d+%d failed, flush will retry: %s",
                                self.path, span[0], span[1], e)
                else:
                    log.exception("%s: write-behind of bytes %d+%d failed", self.path, *span)
                self._stream_error = e
        else:
            if flight.stale:
                self._discarded += 1
            else:
                self._add_clean(span, entry, pending=True)
                self._streamed += 1
        finally:
            del self._inflight[span]
            self._slots.release_on_behalf_of(token)
            self._background -= 1
            self._idle.fire()

    async def _scan(self, scanner: BoundaryScanner) -> None:
        self._background += 1
        try:
            await self._staging()
            await self._thread(scanner.advance, self._pread, self._frontier, limiter=self._pool.cpu)
        except CpfsError as e:
            if not self._closed:
                log.warning("%s: write-behind stopped: %s", self.path, e)
            self._stream_error = e
        finally:
            self._background -= 1
            self._idle.fire()

    # ------------------------------------------------------------------ storing and committing

    async def _store_span(self, offset: int, length: int) -> ChunkEntry:
        """Read, encode and store bytes [offset, offset+length). The caller holds an upload slot."""
        if self._unfetched:
            assert self._base is not None
            for i in self._base.chunk_range(offset, length):
                await self._materialise(i)
        fd = await self._staging()
        self._hold(2 * length)  # raw bytes and their compressed copy, inside the thread
        try:
            enc = await self._thread(self._encode, fd, offset, length, limiter=self._pool.cpu)
        finally:
            self._release(2 * length)
        self._hold(enc.stored_len)
        try:
            return await self._put(enc)
        finally:
            self._release(enc.stored_len)

    def _encode(self, fd: int, offset: int, length: int) -> chunkfmt.EncodedChunk:
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise StagingError(f"{self.path}: short read at {offset} from the staging file (truncated meanwhile)")
        return chunkfmt.encode(data, self._cfg.compression)

    async def _put(self, enc: chunkfmt.EncodedChunk) -> ChunkEntry:
        """Store a chunk on its placement (once per session: identical chunks wait for the first)."""
        while enc.digest in self._placing:
            await self._placing[enc.digest].wait()
        known = self._placed.get(enc.digest)
        if known is not None:
            self._deduped += 1
            return known
        done = self._placing[enc.digest] = trio.Event()
        try:
            targets = place(enc.digest, self._pool.names, self._cfg.replicas)
            held, new = await self._pool.store_chunk(enc, targets, self._cfg.write_quorum)
        finally:
            del self._placing[enc.digest]
            done.set()
        if new:
            self._uploaded += 1
            self._new_raw += enc.raw_len
            self._bytes_uploaded += enc.stored_len * len(held)
        else:
            self._deduped += 1
        entry = ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held))
        self._placed[enc.digest] = entry
        return entry

    async def _layout(self, size: int) -> tuple[TensorIndex | None, list[int]]:
        """Tensor index and cut points of the staged content (the importer's, see the module doc)."""
        if size == 0:
            return None, []
        if self._unfetched:  # reading goes through the session, which may fetch base chunks
            read_at: ReadAt = self._read_via_session
            limiter = trio.CapacityLimiter(1)  # not a shared one: its nested reads need those
            index = await self._thread(build_index, read_at, size, limiter=limiter)
        else:
            read_at, limiter = self._pread, self._pool.cpu
            index = await self._thread(index_file, self.staging_path, limiter=limiter)
        if index is not None:
            return index, tensor_boundaries(index, self._cs)
        scanner = BoundaryScanner(self._cs) if self._scan_dirty else self._scanner.copy()
        await self._thread(scanner.advance, read_at, size, True, _INF, limiter=limiter)
        return None, scanner.boundaries

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
        failures: list[CpfsError] = []
        if todo:
            send, recv = trio.open_memory_channel[int](0)

            async def worker(recv: trio.MemoryReceiveChannel[int], cancel: trio.CancelScope) -> None:
                async with recv:
                    async for i in recv:
                        try:
                            async with self._slots:
                                entries[i] = entry = await self._store_span(*spans[i])
                        except CpfsError as e:
                            failures.append(e)
                            cancel.cancel()
                            return
                        self._add_clean(spans[i], entry, pending=True)  # a retry after a failure reuses it

            async with trio.open_nursery() as n:
                for _ in range(min(len(todo), self._cfg.fetch_concurrency)):
                    n.start_soon(worker, recv.clone(), n.cancel_scope)
                await recv.aclose()
                async with send:
                    for i in todo:
                        await send.send(i)
        if failures:
            raise failures[0]
        return [e for e in entries if e is not None]

    async def _commit(self) -> Manifest:
        size, mod = self._size, self._mod
        index, points = await self._layout(size)
        spans = cut(size, self._cs, points)
        entries = await self._store_all(spans)
        version = new_version()
        if self._committed is not None:
            version = max(version, self._committed.version + 1)
        manifest = Manifest(path=self.path, size=size, mtime_ns=self._mtime_ns, mode=self.mode,
                            chunk_size=self._cs, chunks=tuple(entries), version=version,
                            tensor_index=index.to_json() if index else None)
        await self._catalog.commit(manifest)
        layout = set(spans)  # uploads outside it: overwritten, or the final layout cut differently
        self._discarded += sum(1 for key, (_, pending) in self._clean.items() if pending and key not in layout)
        self._clean = {span: (entry, False) for span, entry in zip(spans, entries)}
        self._clean_keys = list(spans)
        self._committed, self._committed_mod = manifest, mod
        self._commits += 1
        log.info("%s: committed %d bytes in %d chunks (%d new this session, %d streamed)%s", self.path,
                 size, len(entries), self._uploaded, self._streamed,
                 f", {len(index.tensors)} tensors indexed" if index else "")
        return manifest
