"""Reused read buffers: page-aligned, already backed by memory, handed out again once nobody holds them.

A fresh 4 MiB buffer for every chunk read costs a page fault and a zeroed page per 4 KiB (about a tenth
of the daemon's CPU on a cold load), and the pages go back to the kernel when it is freed. A pool keeps
the buffers instead. Whoever reads into one may keep views of it for as long as it likes (the chunk
cache holds a raw chunk as a view of the buffer it was read into, the page-cache feeder pushes from
it): a buffer is handed out again only when the pool holds the last reference to it, which a
`memoryview` of it, or of a slice of it, keeps from happening (a view refers to its buffer).

Buffers are anonymous private mappings (page-aligned, as O_DIRECT wants); a take() the pool cannot
serve from a free buffer gets a new one, kept if the pool is under `max_bytes`, else not tracked (freed
by the garbage collector as any object). So the pool holds at most `max_bytes` beyond what the cache
and the readers hold.

Invariant: a buffer is written only by the thread that took it, before it hands out any view of it.
"""
from __future__ import annotations

import mmap
import sys
import threading
from dataclasses import dataclass

PAGE = mmap.PAGESIZE
DEFAULT_MAX = 128 * 1024**2


@dataclass(frozen=True)
class BufferStats:
    buffers: int          # buffers the pool tracks
    bytes: int            # ... and their size
    reused: int           # take() served by a free buffer
    allocated: int        # take() that mapped a new buffer (tracked or not)


def _refs(items: list[mmap.mmap], i: int) -> int:
    return sys.getrefcount(items[i])


class BufferPool:
    def __init__(self, max_bytes: int = DEFAULT_MAX) -> None:
        self.max_bytes = max_bytes
        self._bufs: list[mmap.mmap] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self._reused = self._allocated = 0
        # What _refs() counts for a buffer only the pool holds (the list, plus what the call adds).
        self._idle = _refs([mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE)], 0)

    def statistics(self) -> BufferStats:
        return BufferStats(len(self._bufs), self._bytes, self._reused, self._allocated)

    def take(self, size: int) -> mmap.mmap:
        """A page-aligned buffer of at least `size` bytes (rounded up to whole pages), contents
        undefined. Thread-safe; call from worker threads."""
        want = max(PAGE, -(-size // PAGE) * PAGE)
        with self._lock:
            bufs, best = self._bufs, -1
            for i in range(len(bufs)):        # no loop variable: it would hold a reference
                n = len(bufs[i])
                if n >= want and (best < 0 or n < len(bufs[best])) and _refs(bufs, i) == self._idle:
                    best = i
                    if n == want:
                        break
            if best >= 0:
                self._reused += 1
                return self._bufs[best]
            self._allocated += 1
            buf = mmap.mmap(-1, want, flags=mmap.MAP_PRIVATE)
            if self._bytes + want <= self.max_bytes:
                self._bufs.append(buf)
                self._bytes += want
            elif self._bufs:
                # Full: replace a free buffer of another size (chunks of files cut elsewhere), if any.
                for i in range(len(bufs)):
                    if _refs(bufs, i) == self._idle and self._bytes - len(bufs[i]) + want <= self.max_bytes:
                        self._bytes += want - len(bufs[i])
                        bufs[i] = buf
                        break
            return buf

    def clear(self) -> None:
        """Forget every buffer (those in use are freed when their holders let go)."""
        with self._lock:
            self._bufs.clear()
            self._bytes = 0


# One pool per process: the folder stores of a mount share it.
POOL = BufferPool()
