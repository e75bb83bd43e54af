"""The FUSE operations: a thin translation of kernel calls into namespace and reader calls.

Every handler goes through one boundary that turns cpfs errors into their errno (and anything
unexpected into EIO with a traceback in the log): pyfuse3 stops the filesystem on any other exception.
Committed files are immutable, so the kernel may cache names, attributes and pages (keep_cache).
"""
from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from .config import Config
from .errors import CpfsError, NotFound, ReadOnly
from .namespace import Namespace, Node
from .readahead import FileReader, Scheduler

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def boundary(fn: F) -> F:
    """Map our errors to errno at the FUSE boundary, logging what the caller cannot see."""

    @functools.wraps(fn)
    async def wrapper(self: "CpfsOperations", *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except NotFound as e:
            log.debug("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        except CpfsError as e:
            log.error("%s failed: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            log.exception("%s%r failed unexpectedly", fn.__name__, args)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


class CpfsOperations(pyfuse3.Operations):
    supports_dot_lookup = True

    def __init__(self, namespace: Namespace, scheduler: Scheduler, config: Config) -> None:
        super().__init__()
        self.ns = namespace
        self.sched = scheduler
        self.config = config
        self.nursery: trio.Nursery | None = None      # set by the daemon before requests arrive
        self.readers: dict[int, FileReader] = {}
        self._fh = itertools.count(1)
        self._uid, self._gid = os.getuid(), os.getgid()

    def attributes(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = a.attr_timeout = self.config.entry_timeout
        a.st_uid, a.st_gid = self._uid, self._gid
        a.st_blksize = 1024 * 1024
        if node.manifest is None:
            a.st_mode = stat.S_IFDIR | 0o755
            a.st_nlink = 2
            a.st_size = 0
            a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = 0
        else:
            m = node.manifest
            a.st_mode = stat.S_IFREG | (m.mode & 0o7777)
            a.st_nlink = 1
            a.st_size = m.size
            a.st_blocks = (m.size + 511) // 512
            a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = m.mtime_ns
        return a

    @boundary
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attributes(self.ns.lookup(parent_inode, os.fsdecode(name)))

    @boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attributes(self.ns.node(inode))

    @boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self.ns.node(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node = self.ns.node(fh)
        for i, (name, ino) in enumerate(sorted(node.children.items())):
            if i < start_id:
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self.attributes(self.ns.node(ino)), i + 1):
                break

    @boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self.ns.node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise ReadOnly(f"{node.path}: writes are not supported yet")
        assert self.nursery is not None and node.manifest is not None
        reader = await self.sched.open(self.nursery, node.manifest, node.index, inode)
        fh = next(self._fh)
        self.readers[fh] = reader
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @boundary
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        return await self.readers[fh].read(off, size)

    @boundary
    async def release(self, fh: int) -> None:
        reader = self.readers.pop(fh, None)
        if reader is not None:
            await reader.aclose()

    @boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        files = [n.manifest for n in self.ns.nodes.values() if n.manifest is not None]
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = sum(m.size for m in files) // 4096 + 1
        s.f_bfree = s.f_bavail = 0
        s.f_files = len(self.ns.nodes)
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def _read_only(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = create = write = _read_only
    setxattr = removexattr = _read_only
