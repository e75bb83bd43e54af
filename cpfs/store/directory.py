"""A store that is a folder: local NVMe, NFS, Lustre.

Objects are files named by their key. Puts write a unique temporary name, fsync it, rename it over the
final name and fsync the folder, so a crash leaves either the old object or the new one. All blocking
calls run in worker threads under this store's own limiter, so a slow mount never stalls the event loop.
"""
from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import trio

from ..errors import NoSuchObject, StoreDenied, StoreError, StoreFull, StoreUnavailable
from .base import Store

TMP_SUFFIX = ".cpfs-tmp"


class DirectoryStore(Store):
    def __init__(self, name: str, root: Path, limiter: trio.CapacityLimiter | None = None) -> None:
        self.name = name
        self.root = Path(root)
        self.limiter = limiter or trio.CapacityLimiter(8)
        # Once the folder has existed, it is never made again: if it vanishes (an unmounted NFS
        # export, a lost disk), puts must fail rather than start an empty store in its place.
        self._root_seen = self.root.is_dir()

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/") or "\0" in key:
            raise StoreError(self.name, f"invalid key {key!r}")
        return self.root / key

    def _check_prefix(self, prefix: str) -> None:
        """Like a key, but may be empty or end in '/'."""
        if prefix.startswith("/") or ".." in prefix.split("/") or "\0" in prefix:
            raise StoreError(self.name, f"invalid prefix {prefix!r}")

    def _error(self, e: OSError, key: str) -> StoreError:
        if e.errno == errno.ENOENT:
            return NoSuchObject(self.name, f"no object {key!r}")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFull(self.name, f"no space left writing {key!r} under {self.root}")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return StoreDenied(self.name, f"{key!r} under {self.root}: {e.strerror}")
        return StoreError(self.name, f"{key!r}: {e.strerror or e}")

    async def _run(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    @staticmethod
    def _read_sync(path: Path) -> bytes:
        """The whole object, then drop its pages from the page cache: the mount keeps its own cache
        and the kernel caches the files it serves, so a third copy only costs memory."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            data = os.read(fd, size) if size else b""
            while len(data) < size:
                more = os.read(fd, size - len(data))
                if not more:
                    break
                data += more
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return data
        finally:
            os.close(fd)

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await self._run(self._read_sync, path)
        except OSError as e:
            raise self._error(e, key) from None

    def _makedirs(self, folder: Path) -> None:
        """Create the folders between the store's root and `folder`, never the root itself."""
        missing = []
        while folder != self.root and not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise StoreUnavailable(self.name, f"folder {self.root} is gone") from None

    def _put_sync(self, path: Path, data: bytes | memoryview) -> None:
        if not self._root_seen:
            self.root.mkdir(parents=True, exist_ok=True)     # a new store: its first put makes it
            self._root_seen = True
        elif not self.root.is_dir():
            raise StoreUnavailable(self.name, f"folder {self.root} is gone")
        self._makedirs(path.parent)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        try:
            await self._run(self._put_sync, path, data)
        except OSError as e:
            raise self._error(e, key) from None

    async def exists(self, key: str) -> bool:
        path = self._path(key)
        try:
            return await self._run(path.is_file)      # a folder of keys is not an object
        except OSError as e:
            raise self._error(e, key) from None

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await self._run(lambda: path.unlink(missing_ok=True))
        except OSError as e:
            raise self._error(e, key) from None

    def _list_sync(self, prefix: str) -> list[str]:
        head, _, _ = prefix.rpartition("/")
        start = self.root / head if head else self.root
        out = []
        for dirpath, _dirs, files in os.walk(start):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel + "/"
            out.extend(rel + f for f in files if not f.endswith(TMP_SUFFIX) and (rel + f).startswith(prefix))
        return sorted(out)

    async def list(self, prefix: str) -> list[str]:
        self._check_prefix(prefix)
        try:
            return await self._run(self._list_sync, prefix)
        except OSError as e:
            raise self._error(e, prefix) from None

    def _check_sync(self) -> None:
        # Creates nothing, so that a startup that fails on another store leaves no trace: the folder,
        # or the nearest existing folder above it (the first put creates the rest), must be writable.
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        if not path.is_dir():
            raise StoreUnavailable(self.name, f"folder {self.root} is not usable: {path} is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise StoreUnavailable(self.name, f"folder {self.root} is not usable: {path} is not writable")

    async def check(self) -> None:
        try:
            await self._run(self._check_sync)
        except OSError as e:
            raise StoreUnavailable(self.name, f"folder {self.root} is not usable: {e.strerror or e}") from None
