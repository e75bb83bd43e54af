"""Reused read buffers: page-aligned, already backed by memory, handed out again once nobody holds them.

A fresh 4 MiB buffer for every chunk read costs a page fault and a zeroed page per 4 KiB (about a tenth
of the daemon's CPU on a cold load), and the pages go back to the kernel when it is freed. A pool keeps
the buffers instead. Whoever reads into one may keep views of it for as long as it likes (the chunk
cache holds a raw chunk as a view of the buffer it was read into, the page-cache feeder pushes from
it): a buffer is handed out again only when the pool holds the last reference to it, which a
`memoryview` of it, or of a slice of it, keeps from happening (a view refers to its buffer).
Buffers come in size classes (`size_class`): one of a class serves any object of that class.

Buffers are anonymous private mappings (page-aligned, as O_DIRECT wants); a take() the pool cannot
serve from a free buffer of its class takes an idle one of a larger class (its pages are backed
already), else gets a new one, kept if the pool is under `max_bytes` (after freeing idle buffers of
other classes), else not tracked (freed as any object once unreferenced). Buffers in use are what the
cache and the readers hold anyway; tracked ones, in use or idle, are at most `max_bytes`: a larger
buffer holding a smaller chunk moves no bound. `trim()` (the daemon calls it once reads stop for a few
seconds) frees the idle ones beyond `keep` bytes, smallest first.

Ready buffers (`prefill`, `keep`): the first touch of a fresh page is the costly part of a new buffer
(a fault and a zeroed page; on a VM that hands freed memory back to its host, a trip to the host as
well), and a load after an idle spell found none: trim had freed them. The daemon fills `keep` bytes
of chunk-sized buffers at mount, every page touched, and trim leaves them, so every cold load starts
with backed buffers; a chunk of any size may take one. Measured on this 2-core VM (fresh mount, cold
torch.load of 512 MiB from 3 folder stores, the code before and after alternated, 4 rounds, medians):
daemon CPU 0.84 -> 0.72 CPU-s per GiB for 64 MiB tensors (load 0.57 -> 0.50 s); 0.5-2 MiB tensors
unchanged (1.13 / 1.14: ~100 chunks in flight outnumber the 25 ready buffers of 5 MiB). The cost:
`keep` bytes resident while the mount is idle (default [cache] memory / 8, 128 MiB).

Buffers of HUGE bytes or more ask for transparent huge pages (madvise; the kernel's default THP mode
is "madvise"): an O_DIRECT read into a 4 MiB chunk's buffer then pins 2 MiB pages, not 4 KiB ones, and
a fresh buffer faults in a page per 2 MiB instead of one per 4 KiB. Cold torch.load of 8 tensors of 64 MiB
through a mount over 3 folder stores, 6 alternated rounds of 3 loads: 0.56 s median against 0.68 s
without (fresh mount 0.62 against 0.73), for the same daemon CPU (0.83-0.85 CPU-s per GiB); 0.5-2 MiB
tensors (buffers below HUGE) move within noise (0.68 against 0.70 s).

Invariant: a buffer is written only by the thread that took it, before it hands out any view of it.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

PAGE = mmap.PAGESIZE
DEFAULT_MAX = 256 * 1024**2     # the default readahead window: what may be in flight and pinned
MMAP_THRESHOLD = 32 * 1024**2   # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 512 * 1024**2
HUGE = 2 * 1024**2              # buffers this large ask for transparent huge pages (see take)
HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
log = logging.getLogger(__name__)


def keep_freed_memory() -> bool:
    """Let freed chunk-sized objects be reused instead of going back to the kernel (glibc mallopt).

    The pool above covers reads; the write path makes chunk-sized bytes objects of its own (a chunk
    and its encoded blob, lz4 output). glibc serves those by mmap and unmaps them when freed, so every
    chunk written faulted in fresh zeroed pages: ~0.6 CPU-s per GiB for the copies alone (more on a VM
    that hands freed memory back to its host). With the thresholds raised they come from the heap,
    which keeps up to TRIM_THRESHOLD of free memory: the daemon's memory then stays at its peak use
    instead of falling back after a save. Returns False where mallopt does not exist (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, TRIM_THRESHOLD))
    if not ok:
        log.info("mallopt refused the thresholds: freed chunk buffers go back to the kernel")
    return ok


@dataclass(frozen=True, kw_only=True)
class BufferStats:
    buffers: int          # buffers the pool tracks
    bytes: int            # ... and their size
    keep: int             # bytes of idle buffers trim() leaves (filled at mount: `prefill`)
    reused: int           # take() served by a free buffer (of its class or a larger one)
    larger: int           # ... of those, by a buffer of a larger class
    allocated: int        # take() that mapped a new buffer (tracked or not)


def _refs(items: list[mmap.mmap], i: int) -> int:
    return sys.getrefcount(items[i])


def size_class(size: int) -> int:
    """Buffers come in sizes of whole pages, four per doubling (at most a quarter more than asked),
    so that a buffer fits the next object of about its size: chunks cut on tensor boundaries vary."""
    pages = max(1, -(-size // PAGE))
    if pages <= 4:
        return pages * PAGE
    step = 1 << (pages.bit_length() - 3)     # a quarter of the power of two below
    return -(-pages // step) * step * PAGE


class BufferPool:
    def __init__(self, max_bytes: int = DEFAULT_MAX, keep: int = 0) -> None:
        self.max_bytes = max_bytes            # buffers tracked, in use or not
        self.keep = keep                      # idle bytes trim() leaves
        self._classes: dict[int, list[mmap.mmap]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._reused = self._larger = self._allocated = 0
        # What _refs() counts for a buffer only the pool holds (the list, plus what the call adds).
        self._idle = _refs([mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE)], 0)

    def statistics(self) -> BufferStats:
        with self._lock:                  # worker threads add size classes meanwhile
            return BufferStats(buffers=sum(map(len, self._classes.values())), bytes=self._bytes, keep=self.keep,
                               reused=self._reused, larger=self._larger, allocated=self._allocated)

    def _free_index(self, cls: int) -> int | None:
        """Where an idle buffer of class `cls` is in its list (an index: a name would hold a reference)."""
        bufs = self._classes.get(cls, [])
        for i in range(len(bufs)):
            if _refs(bufs, i) == self._idle:
                return i
        return None

    def take(self, size: int) -> mmap.mmap:
        """A page-aligned buffer of at least `size` bytes (see size_class), contents undefined; only
        the pages written to are backed by memory. Thread-safe; call from worker threads."""
        want = size_class(size)
        with self._lock:
            bufs = self._classes.setdefault(want, [])
            i = self._free_index(want)
            if i is not None:
                self._reused += 1
                return bufs[i]
            for cls in sorted(c for c in self._classes if c > want):    # backed already: see the module doc
                i = self._free_index(cls)
                if i is not None:
                    self._reused += 1
                    self._larger += 1
                    return self._classes[cls][i]
            self._allocated += 1
            buf = self._map(want)
            if self._bytes + want > self.max_bytes:
                self._trim(want)
            if self._bytes + want <= self.max_bytes:
                bufs.append(buf)
                self._bytes += want
            return buf

    @staticmethod
    def _map(size: int) -> mmap.mmap:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        if size >= HUGE and HUGEPAGE is not None:
            buf.madvise(HUGEPAGE)
        return buf

    def prefill(self, size: int) -> int:
        """Add buffers of `size`'s class, every page written, until the pool tracks `keep` bytes (within
        `max_bytes`): the ready buffers of the module doc. Blocking (a worker thread, at mount); returns
        the bytes added."""
        want = size_class(size)
        added = 0
        while True:
            with self._lock:
                if self._bytes + want > min(self.keep, self.max_bytes):
                    return added
                self._bytes += want              # counted before the touch, so no other call overfills
            buf = self._map(want)
            for off in range(0, want, PAGE):     # a write, not a read: a read maps the shared zero page
                buf[off] = 0
            with self._lock:
                self._classes.setdefault(want, []).append(buf)
            del buf
            added += want

    def trim(self) -> int:
        """Free the buffers nobody holds beyond `keep` bytes, smallest first (the daemon calls it once
        reads have stopped for a while); the bytes freed."""
        with self._lock:
            return self._free(lambda: self._bytes > self.keep)

    def _trim(self, need: int) -> int:
        """Free idle buffers until `need` more bytes fit under max_bytes."""
        return self._free(lambda: self._bytes + need > self.max_bytes)

    def _free(self, more: Callable[[], bool]) -> int:
        """Free idle buffers, smallest class first (a larger one serves any size), while more()."""
        freed = 0
        for cls in sorted(self._classes):
            bufs = self._classes[cls]
            i = 0
            while i < len(bufs) and more():
                if _refs(bufs, i) == self._idle:
                    n = len(bufs.pop(i))
                    self._bytes -= n
                    freed += n
                else:
                    i += 1
        return freed

    def clear(self) -> None:
        """Forget every buffer (those in use are freed when their holders let go)."""
        with self._lock:
            self._classes.clear()
            self._bytes = 0


# One pool per process: the folder stores of a mount share it.
POOL = BufferPool()
