"""A naive pyfuse3 pass-through: serves a source folder read-only. The baseline peer of bench_cpu.

What the simplest pyfuse3 filesystem costs per byte: every FUSE read is answered by an `os.pread` of the
source file, on the event loop, like pyfuse3's own `examples/passthroughfs.py`; no cache, no prefetch, no
checksums, default open flags. The daemon's CPU per GiB on a cold load is the number cpfs is held to.

    python -m benchmarks.passthrough SOURCE MOUNTPOINT      (unmount: fusermount3 -u MOUNTPOINT)

Prints "READY" on stdout once mounted.
"""
from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

import pyfuse3
import trio


class Passthrough(pyfuse3.Operations):
    def __init__(self, source: Path) -> None:
        super().__init__()
        self._paths: dict[int, str] = {pyfuse3.ROOT_INODE: str(source)}
        self._inodes: dict[str, int] = {str(source): pyfuse3.ROOT_INODE}
        self._fds: dict[int, int] = {}
        self._next = pyfuse3.ROOT_INODE + 1

    def _inode(self, path: str) -> int:
        ino = self._inodes.get(path)
        if ino is None:
            ino = self._inodes[path] = self._next
            self._paths[ino] = path
            self._next += 1
        return ino

    def _attr(self, path: str) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        a = pyfuse3.EntryAttributes()
        a.st_ino = self._inode(path)
        a.st_mode = st.st_mode & ~0o222
        a.st_nlink = st.st_nlink
        a.st_uid, a.st_gid = st.st_uid, st.st_gid
        a.st_size = st.st_size
        a.st_blksize = 4096
        a.st_blocks = st.st_blocks
        a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        a.entry_timeout = a.attr_timeout = 300
        return a

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(os.path.join(self._paths[parent_inode], os.fsdecode(name)))

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(self._paths[inode])

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        names = sorted(os.listdir(self._paths[fh]))
        for i, name in enumerate(names[start_id:], start_id):
            attr = self._attr(os.path.join(self._paths[fh], name))
            if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, i + 1):
                break

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        fd = os.open(self._paths[inode], os.O_RDONLY)
        self._fds[fd] = inode
        return pyfuse3.FileInfo(fh=fd)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    async def release(self, fh: int) -> None:
        self._fds.pop(fh, None)
        os.close(fh)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self._paths[pyfuse3.ROOT_INODE])
        s = pyfuse3.StatvfsData()
        for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail"):
            setattr(s, k, getattr(st, k))
        return s


async def serve(source: Path, mountpoint: Path) -> None:
    ops = Passthrough(source)
    options = set(pyfuse3.default_options) | {"fsname=passthrough", "ro"}
    pyfuse3.init(ops, str(mountpoint), options)
    try:
        async with trio.open_nursery() as n:
            async def announce() -> None:
                await trio.to_thread.run_sync(os.stat, mountpoint)
                print("READY", flush=True)
            n.start_soon(announce)
            await pyfuse3.main()
    finally:
        pyfuse3.close(unmount=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    source, mountpoint = Path(args[0]).absolute(), Path(args[1]).absolute()
    if not source.is_dir() or not mountpoint.is_dir() or stat.S_ISLNK(os.lstat(mountpoint).st_mode):
        print(f"passthrough: {source} and {mountpoint} must be folders", file=sys.stderr)
        return 2
    trio.run(serve, source, mountpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
