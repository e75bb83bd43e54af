"""A write session's staging file: the sparse local file that holds a file's bytes until they are stored.

It is created on first use, with the size of the version it starts from (whose bytes arrive only as
they are needed), and removed on close. Every blocking call that uses it runs in a worker thread
under a limiter, and is counted, so that close waits for the threads still using the descriptor.
OSErrors come back as StagingError carrying their errno.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import trio

from .errors import CpfsError


V = TypeVar("V")
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _punch(fd: int, spans: list[tuple[int, int]]) -> int:
    """Free the blocks and pages of each (offset, length), in order; how many were freed before a
    refusal (EOPNOTSUPP: a filesystem without hole punching)."""
    for done, (offset, length) in enumerate(spans):
        if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
            err = ctypes.get_errno()
            if err in (errno.EOPNOTSUPP, errno.ENOSYS):
                return done
            raise OSError(err, os.strerror(err))
    return len(spans)


class Spans(Generic[V]):
    """Non-overlapping byte ranges (offset -> length and a value), sorted: which parts of a staging
    file hold no bytes because they live elsewhere (a base version's chunks, stored chunks dropped)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: dict[int, tuple[int, V]] = {}

    def __bool__(self) -> bool:
        return bool(self._starts)

    def add(self, offset: int, length: int, value: V) -> None:
        assert offset not in self._spans and not self.overlapping(offset, offset + length)
        bisect.insort(self._starts, offset)
        self._spans[offset] = (length, value)

    def get(self, offset: int) -> tuple[int, V] | None:
        return self._spans.get(offset)

    def pop(self, offset: int) -> None:
        if self._spans.pop(offset, None) is not None:
            del self._starts[bisect.bisect_left(self._starts, offset)]

    def overlapping(self, start: int, end: int) -> list[int]:
        """Offsets of the ranges holding any byte of [start, end)."""
        starts, out = self._starts, []
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while i < len(starts) and starts[i] < end:
            if starts[i] + self._spans[starts[i]][0] > start:
                out.append(starts[i])
            i += 1
        return out

    def copy(self) -> Spans[V]:
        """A snapshot, for a worker thread to consult while the event loop changes the original."""
        clone: Spans[V] = Spans()
        clone._starts, clone._spans = list(self._starts), dict(self._spans)
        return clone


class StagingError(CpfsError):
    """The local staging file failed (disk full, I/O error), or the session is closed."""

    def __init__(self, message: str, err: int = errno.EIO) -> None:
        super().__init__(message)
        self.errno = err

    @property
    def full(self) -> bool:
        """The disk is full, or the user's quota on it (EDQUOT: a staging folder under a cluster's home
        directories): room may come once write-behind drops stored chunks."""
        return self.errno in (errno.ENOSPC, errno.EDQUOT)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class StagingFile:
    """`label()` names the file being written in error messages; `io_limiter` bounds reads and writes.
    `mode` and `dir_mode` are the store's ([store_defaults] file_mode, dir_mode): staged bytes are the
    file's content and as private as its chunks."""

    def __init__(self, path: Path, size: int, io_limiter: trio.CapacityLimiter, label: Callable[[], str], *,
                 mode: int = 0o600, dir_mode: int = 0o700) -> None:
        self.path = path
        self._mode = mode
        self._dir_mode = dir_mode
        self.closed = False  # set by the session as it starts closing: nothing new may start
        self._size = size
        self._io = io_limiter
        self._label = label
        self._fd: int | None = None
        self._creating: trio.Event | None = None
        self._busy = 0  # threads using the file
        self._drained = trio.Event()

    def check_open(self) -> None:
        if self.closed:
            raise StagingError(f"{self._label()}: write session is closed", errno.EBADF)

    async def run(self, fn: Callable[..., Any], *args: object, limiter: trio.CapacityLimiter) -> Any:
        """Run blocking work that uses the file in a thread; OSErrors become StagingError."""
        self.check_open()
        self._busy += 1
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
        except OSError as e:
            raise StagingError(f"{self._label()}: staging file {self.path}: {e.strerror or e}",
                               e.errno or errno.EIO) from None
        finally:
            self._busy -= 1
            if self.closed and not self._busy:
                self._drained.set()

    async def fd(self) -> int:
        """The descriptor, the file created on first use."""
        while self._fd is None:
            if self._creating is not None:
                await self._creating.wait()  # if that attempt failed, the loop tries again
                continue
            self._creating = trio.Event()
            try:
                self._fd = await self.run(self._create, limiter=self._io)
            finally:
                self._creating.set()
                self._creating = None
        return self._fd

    async def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        await self.run(_pwrite_all, await self.fd(), data, offset, limiter=self._io)

    async def pread(self, offset: int, length: int) -> bytes:
        return await self.run(os.pread, await self.fd(), length, offset, limiter=self._io)

    async def truncate(self, size: int) -> None:
        await self.run(os.ftruncate, await self.fd(), size, limiter=self._io)

    async def punch(self, spans: list[tuple[int, int]]) -> int:
        """Drop these byte ranges (their blocks and page-cache pages; they read as zeros after); how many,
        in order, before the filesystem refused (no hole punching)."""
        return await self.run(_punch, await self.fd(), spans, limiter=self._io)

    def read_at(self, offset: int, length: int) -> bytes:
        """Blocking read of the file once created, for work in `run`."""
        assert self._fd is not None
        return os.pread(self._fd, length, offset)

    async def aclose(self) -> None:
        """Wait for the threads using the file, then close and delete it."""
        self.closed = True
        if self._busy:
            await self._drained.wait()
        fd, self._fd = self._fd, None
        await trio.to_thread.run_sync(self._remove, fd, limiter=self._io)

    def _create(self) -> int:
        if not self.path.parent.is_dir():       # the daemon made it; a session on its own makes it here
            self.path.parent.mkdir(self._dir_mode, parents=True, exist_ok=True)
            os.chmod(self.path.parent, self._dir_mode)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._mode)
        os.fchmod(fd, self._mode)               # exactly the configured mode, whatever the umask
        if self._size:
            os.ftruncate(fd, self._size)  # the base version's bytes arrive as they are needed
        return fd

    def _remove(self, fd: int | None) -> None:
        if fd is not None:
            os.close(fd)
        self.path.unlink(missing_ok=True)
