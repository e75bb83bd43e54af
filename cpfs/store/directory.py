"""A store that is a folder: local NVMe, NFS, Lustre.

Objects are files named by their key. Puts write a unique temporary name, fsync it, rename it over the
final name and fsync the folder, so a crash leaves either the old object or the new one; a crash
before the rename leaves the temporary file (`list_temporary`, removed by gc once old). An object's age
is its file's mtime; `delete_if_older` renames the file to a temporary name before it judges the age,
so a `touch` either lands before (the file is put back) or finds no object. All blocking calls run in
worker threads under this store's own limiter, so a slow mount never stalls the event loop.

Names that start with a dot are other tools' files (cpfs/store/base.py: `foreign`), never objects.

Caveat: a thread stuck in a hung NFS call cannot be stopped. On cancellation (the pool's timeout) the
thread is abandoned: the caller moves on at once, the thread finishes (or not) on its own and keeps its
limiter token until then, so a hung folder can tie up at most `concurrency` threads.
"""
from __future__ import annotations

import errno
import inspect
import itertools
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from ..buffers import PAGE, POOL
from ..errors import NoSuchObject, StoreDenied, StoreError, StoreFull, StoreUnavailable
from .base import Capacity, ObjectInfo, Store, foreign, foreign_prefix

if TYPE_CHECKING:
    from ..config import StoreConfig
    from .registry import OptionContext

# trio >= 0.23 calls it abandon_on_cancel; older versions cancellable.
_ABANDON = ("abandon_on_cancel" if "abandon_on_cancel" in inspect.signature(trio.to_thread.run_sync).parameters
            else "cancellable")
# errnos after which the same request may well succeed: a busy or flaky NFS/Lustre server.
_TRANSIENT = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE,
              errno.ENOTCONN, errno.ECONNRESET, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETUNREACH}

log = logging.getLogger(__name__)
T = TypeVar("T")
TMP_SUFFIX = ".cpfs-tmp"
# A file a deletion claimed (see _reap_sync): still a temporary file to listings, but complete, so a
# claim left by a killed gc is put back under its name by the next sweep, never reaped as garbage.
_CLAIM = re.compile(r"(.+)\.[0-9a-f]{32}\.claim" + re.escape(TMP_SUFFIX))


def is_claim(key: str) -> bool:
    return _CLAIM.fullmatch(key.rsplit("/", 1)[-1]) is not None


def _fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a new name, a rename) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reap_temporaries(folder: Path, older_than: float = 3600.0) -> int:
    """Remove the temporary files that `write_durably` left in `folder` (a process killed mid-write)
    once they are `older_than` seconds old: younger ones may be another process's write under way.
    Returns how many went; a folder that cannot be listed reaps nothing. Blocking."""
    reaped = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    now = time.time()
    for entry in entries:
        if not entry.name.endswith(TMP_SUFFIX):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime >= older_than:
                os.unlink(entry.path)
                reaped += 1
                log.info("%s: removed a temporary file left by an interrupted write", entry.path)
        except OSError:
            continue                     # gone meanwhile, or not ours to remove: left as it is
    return reaped


def write_durably(path: Path, data: bytes | memoryview, mode: int, drop_pages: bool = False,
                  replace: bool = True) -> bool:
    """Write the file at `path` whole or not at all: under a temporary name beside it (TMP_SUFFIX),
    fsynced, renamed over `path`, and its folder fsynced; a failure removes the temporary file. With
    `drop_pages`, its pages leave the page cache once clean. Without `replace`, a file already at
    `path` stays: the temporary file is hard-linked to `path` instead of renamed (atomic on local
    filesystems, NFS and Lustre), then removed. True if this call wrote `path`."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)                # exactly this mode, whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            if drop_pages:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, path)
        elif not _link_new(tmp, path):
            return False
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return True


def _link_new(tmp: Path, path: Path) -> bool:
    """Give the written `tmp` the name `path` unless a file has it (False); `tmp` is gone after. A
    filesystem without hard links (vfat, some FUSE filesystems) fails it (EPERM, EOPNOTSUPP)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _whole_pages(n: int) -> int:
    """n rounded up to whole pages: what an O_DIRECT read of n bytes asks for, into a page-aligned place."""
    return -(-n // PAGE) * PAGE


class DirectoryStore(Store):
    """The `dir` kind: file:///abs/path URLs, or plain paths (relative to the config file's folder)."""

    kind = "dir"
    option_keys: frozenset[str] = frozenset()
    # Each request scans the folders on the way to its first key again: in pages of 1000, a listing
    # of manifests/ (a folder per path) scanned it once per 1000 keys, so mount, refresh, gc and scrub
    # grew with the square of the paths (80,000 paths: 17.7 s, 6.6M entries visited, for one store).
    list_limit = 100_000

    @classmethod
    def parse_options(cls, url: str, raw: Mapping[str, Any], ctx: OptionContext) -> dict[str, Any]:
        """{"path": the folder}; the errors name the [[store]]'s url key."""
        local = url[len("file://"):] if url.startswith("file://") else url
        try:
            path = Path(ctx.expand(local)).expanduser()
        except KeyError as e:
            raise ctx.fail("url", f"${e.args[0]} is not set (in {url!r})") from None
        if url.startswith("file://") and not path.is_absolute():
            raise ctx.fail("url", f"file:// URLs need an absolute path, got {url!r}")
        return {"path": path if path.is_absolute() else ctx.base / path}

    @classmethod
    def from_config(cls, cfg: StoreConfig) -> DirectoryStore:
        return cls(cfg.name, cfg.options["path"], trio.CapacityLimiter(cfg.concurrency),
                   file_mode=cfg.file_mode, dir_mode=cfg.dir_mode)

    def __init__(self, name: str, root: Path, limiter: trio.CapacityLimiter | None = None, *,
                 file_mode: int = 0o600, dir_mode: int = 0o700) -> None:
        self.name = name
        self.root = Path(root)
        self.limiter = limiter or trio.CapacityLimiter(8)
        # Objects are private to the owner unless configured otherwise: the mount applies its own
        # permissions, and a world-readable chunk would bypass them.
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        # Once the folder has existed, it is never made again: if it vanishes (an unmounted NFS
        # export, a lost disk), puts must fail rather than start an empty store in its place.
        # Whether the folder existed when first looked at (or we made it): looked at by the first
        # request, in its thread, not here: on a hung filesystem a stat here hung the process for good.
        self._root_seen: bool | None = None
        self._direct = True           # O_DIRECT chunk reads, until the filesystem refuses them
        self._direct_lock = threading.Lock()

    def _path(self, key: str) -> Path:
        if foreign(key) or "\0" in key:
            raise StoreError(self.name, f"invalid key {key!r}")
        return self.root / key

    def _check_prefix(self, prefix: str) -> None:
        """Like a key, but may be empty or end in '/'."""
        if foreign_prefix(prefix) or "\0" in prefix:
            raise StoreError(self.name, f"invalid prefix {prefix!r}")

    def _error(self, e: OSError, key: str) -> StoreError:
        if e.errno == errno.ENOENT:
            return NoSuchObject(self.name, f"no object {key!r}")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFull(self.name, f"no space left writing {key!r} under {self.root}")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return StoreDenied(self.name, f"{key!r} under {self.root}: {e.strerror}")
        return StoreError(self.name, f"{key!r}: {e.strerror or e}", transient=e.errno in _TRANSIENT)

    async def _run(self, fn, *args):
        """fn(*args) in a worker thread; abandoned (not waited for) if the caller is cancelled."""
        return await trio.to_thread.run_sync(self._guarded, fn, *args, limiter=self.limiter, **{_ABANDON: True})

    def _guarded(self, fn, *args):
        """A missing file is a missing object, unless the whole folder is gone: then the store is."""
        self._saw_root()
        try:
            return fn(*args)
        except FileNotFoundError:
            if self._gone():
                raise StoreUnavailable(self.name, f"folder {self.root} is gone") from None
            raise

    def _gone(self) -> bool:
        """The folder existed and has vanished (an unmounted export, a lost disk). Blocking."""
        return self._saw_root() and not self.root.is_dir()

    def _saw_root(self) -> bool:
        if self._root_seen is None:
            self._root_seen = self.root.is_dir()
        return self._root_seen

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

    def _read_into_sync(self, path: Path) -> memoryview:
        """The whole object in a reused buffer (cpfs.buffers). With O_DIRECT where the folder's
        filesystem takes it: from the disk straight into the buffer, no copy, and no page-cache pages
        to add and drop again; elsewhere a plain read, its pages dropped as in `_read_sync`."""
        fd, direct = self._open_read(path)
        try:
            size = os.fstat(fd).st_size
            view = memoryview(POOL.take(size))
            try:
                got = self._fill(fd, view[:_whole_pages(size)], size, direct)
            except OSError as e:
                if not direct or e.errno != errno.EINVAL:
                    raise
                return self._no_direct(path, e)
            return view[:got]
        finally:
            os.close(fd)

    def _no_direct(self, path: Path, e: OSError) -> memoryview:
        """The folder's filesystem refused an O_DIRECT read (or its alignment) after the open: plain
        reads from now on, this one first. Reads opened with O_DIRECT before the first refusal (other
        threads, the rest of a batch) come here too, and are read again the same way."""
        self._no_more_direct("reads", e)
        return self._read_into_sync(path)

    def _no_more_direct(self, what: str, e: OSError) -> None:
        """Plain reads from now on; said once, whichever of the threads that met the refusal comes first."""
        with self._direct_lock:
            was, self._direct = self._direct, False
        if was:
            log.info("store %r: O_DIRECT %s refused (%s); reading through the page cache", self.name, what,
                     e.strerror)

    def _read_with_sync(self, path: Path, fn: Callable[[bytes | memoryview], T]) -> T:
        return fn(self._read_into_sync(path))

    async def get_with(self, key: str, fn: Callable[[bytes | memoryview], T], limiter: trio.CapacityLimiter) -> T:
        """The read and fn in one worker thread, under this store's limiter (`limiter` is not taken:
        the store's own bounds the threads), into a reused buffer (see `_read_into_sync`)."""
        path = self._path(key)
        try:
            return await self._run(self._read_with_sync, path, fn)
        except OSError as e:
            raise self._error(e, key) from None

    def _read_many_sync(self, reads: Sequence[tuple[str, Callable[[bytes | memoryview], T]]]) -> list[T | StoreError]:
        """Every object of a batch into one reused buffer, each at a page boundary (O_DIRECT reads whole
        pages into aligned places): a batch of small chunks takes one chunk-sized buffer, whose pages the
        pool keeps backed (cpfs/buffers.py), instead of a fresh one per chunk. The buffer stays taken
        while any of its objects' views lives (the cache holds raw chunks as views)."""
        self._saw_root()
        opened: list[tuple[int, int, bool] | StoreError] = []   # (fd, size, O_DIRECT), or why not read
        try:
            for key, _ in reads:
                path = self._path(key)
                try:
                    fd, direct = self._open_read(path)
                    opened.append((fd, os.fstat(fd).st_size, direct))
                except FileNotFoundError as e:
                    if self._gone():
                        raise StoreUnavailable(self.name, f"folder {self.root} is gone") from None
                    opened.append(self._error(e, key))
                except OSError as e:
                    opened.append(self._error(e, key))
            places: list[int] = []
            total = 0
            for o in opened:
                places.append(total)
                if isinstance(o, tuple):
                    total += _whole_pages(o[1])
            view = memoryview(POOL.take(max(total, PAGE)))
            results: list[T | StoreError] = []
            for (key, fn), o, at in zip(reads, opened, places):
                if not isinstance(o, tuple):
                    results.append(o)
                    continue
                fd, size, direct = o
                try:
                    data = view[at:at + self._fill(fd, view[at:at + _whole_pages(size)], size, direct)]
                except OSError as e:
                    if not (direct and e.errno == errno.EINVAL):
                        results.append(self._error(e, key))
                        continue
                    try:                                  # O_DIRECT refused after the open: as a single read
                        data = self._no_direct(self._path(key), e)
                    except OSError as e2:
                        results.append(self._error(e2, key))
                        continue
                results.append(fn(data))
            return results
        finally:
            for o in opened:
                if isinstance(o, tuple):
                    os.close(o[0])

    def _open_read(self, path: Path) -> tuple[int, bool]:
        """An fd to read `path` with, and whether it is O_DIRECT (where the folder's filesystem takes it)."""
        if self._direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._no_more_direct("opens", e)
        return os.open(path, os.O_RDONLY), False

    def _fill(self, fd: int, into: memoryview, size: int, direct: bool) -> int:
        """Read the `size` bytes of fd into `into` (whole pages for O_DIRECT); the bytes read. Without
        O_DIRECT the file's pages are dropped after, as in `_read_sync`."""
        got = 0
        while got < size:
            n = os.preadv(fd, [into[got:]], got)
            if not n:
                break
            got += n
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return got

    async def get_many_with(self, reads: Sequence[tuple[str, Callable[[bytes | memoryview], T]]],
                            limiter: trio.CapacityLimiter) -> list[T | StoreError]:
        """Every read and its fn, one after another, in one worker thread under one token of this
        store's limiter: a batch of small chunks costs one hand-off, not one each."""
        return await trio.to_thread.run_sync(self._read_many_sync, reads, limiter=self.limiter, **{_ABANDON: True})

    @staticmethod
    def _read_range_sync(path: Path, start: int, length: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            parts = []
            want, pos = length, start
            while want > 0:
                got = os.pread(fd, want, pos)      # pread: concurrent ranges share no seek position
                if not got:
                    break
                parts.append(got)
                want -= len(got)
                pos += len(got)
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
            return b"".join(parts)
        finally:
            os.close(fd)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        return await self.get_range_with(key, start, length, lambda data: data, self.limiter)

    async def get_range_with(self, key: str, start: int, length: int, fn: Callable[[bytes | memoryview], T],
                             limiter: trio.CapacityLimiter) -> T:
        """The read and fn in one worker thread, under this store's limiter (as `get_with`)."""
        path = self._path(key)
        if start < 0 or length < 0:
            raise StoreError(self.name, f"invalid range {start}+{length} of {key!r}")
        try:
            return await self._run(lambda: fn(self._read_range_sync(path, start, length)))
        except OSError as e:
            raise self._error(e, key) from None

    def _size_sync(self, path: Path) -> int | None:
        """Size of the regular file at `path`; None if there is none (a folder of keys is no object)."""
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            if self._gone():
                raise StoreUnavailable(self.name, f"folder {self.root} is gone") from None
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    async def head(self, key: str) -> int:
        path = self._path(key)
        try:
            size = await self._run(self._size_sync, path)
        except OSError as e:
            raise self._error(e, key) from None
        if size is None:
            raise NoSuchObject(self.name, f"no object {key!r}")
        return size

    def _stat_sync(self, path: Path) -> os.stat_result:
        """The regular file's stat; FileNotFoundError for a folder of keys (no object)."""
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(errno.ENOENT, "not an object", str(path))
        return st

    async def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = await self._run(self._stat_sync, path)
        except OSError as e:
            raise self._error(e, key) from None
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def _touch_sync(self, path: Path) -> None:
        self._stat_sync(path)
        os.utime(path)           # now, by the file server's clock (NFS sets the server's time)

    async def touch(self, key: str) -> None:
        path = self._path(key)
        try:
            await self._run(self._touch_sync, path)
        except OSError as e:
            raise self._error(e, key) from None

    def _reap_sync(self, path: Path, before: float) -> bool:
        """Delete the file if it is older than `before`, atomically against `touch`: claim it by a rename
        first (a touch or read after that finds no object), then judge its age; a file touched before
        the claim is renamed back. The open before the fstat makes NFS revalidate the attributes."""
        m = _CLAIM.fullmatch(path.name)
        if m is not None:
            return self._settle_claim(path, path.with_name(m[1]))
        try:
            if self._stat_sync(path).st_mtime >= before:
                return False
            claim = path.with_name(f"{path.name}.{uuid.uuid4().hex}.claim{TMP_SUFFIX}")
            os.rename(path, claim)
        except FileNotFoundError:
            return False
        try:
            fd = os.open(claim, os.O_RDONLY)
            try:
                young = os.fstat(fd).st_mtime >= before
            finally:
                os.close(fd)
            if young:
                os.rename(claim, path)  # a put of the same key meanwhile wrote the same bytes
                return False
            os.unlink(claim)
        except FileNotFoundError:
            # Another gc's sweep of temporary files took the claim: it judged the same mtime old too.
            return False
        return True

    @staticmethod
    def _settle_claim(claim: Path, original: Path) -> bool:
        """A claim a deletion left (its gc was killed between claiming and judging): put it back, whatever
        its age, unless a put wrote the name again meanwhile. Never a loss: an unreferenced chunk put
        back goes at the next gc."""
        try:
            if original.exists():
                os.unlink(claim)
                return True
            os.rename(claim, original)
        except FileNotFoundError:
            pass                        # the claim of a gc still running: it settles it itself
        return False

    async def delete_if_older(self, key: str, before: float) -> bool:
        path = self._path(key)
        try:
            return await self._run(self._reap_sync, path, before)
        except OSError as e:
            raise self._error(e, key) from None

    def _makedirs(self, folder: Path, top: Path | None = None) -> None:
        """Create the folders between `top` (default: the store's root, never made again once it
        existed) and `folder`, each with dir_mode (exactly: chmod, whatever the umask) and fsynced into
        its parent, so that a crash cannot lose a folder whose files were fsynced."""
        top = self.root if top is None else top
        missing = []
        while folder != top and folder != folder.parent and not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, self.dir_mode)
                os.chmod(d, self.dir_mode)
            except FileExistsError:
                pass      # another put made it: its parent is fsynced below all the same, before our file
            except FileNotFoundError:
                raise StoreUnavailable(self.name, f"folder {self.root} is gone") from None
            _fsync_dir(d.parent)

    def _put_sync(self, path: Path, data: bytes | memoryview, replace: bool = True) -> bool:
        if not self._saw_root():
            self._makedirs(self.root, Path(self.root.anchor))   # a new store: its first put makes it
            self._root_seen = True
        elif not self.root.is_dir():
            raise StoreUnavailable(self.name, f"folder {self.root} is gone")
        self._makedirs(path.parent)
        # Pages dropped once clean, and never read through the page cache (reads are O_DIRECT or drop
        # theirs too): freed at once, the next put reuses these pages instead of faulting in fresh
        # ones, which costs this VM's host ~1.5 s/GiB and any host the page-cache churn.
        return write_durably(path, data, self.file_mode, drop_pages=True, replace=replace)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        try:
            await self._run(self._put_sync, path, data)
        except OSError as e:
            raise self._error(e, key) from None

    async def put_new(self, key: str, data: bytes | memoryview) -> bool:
        path = self._path(key)
        try:
            return await self._run(self._put_sync, path, data, False)
        except OSError as e:
            raise self._error(e, key) from None

    async def exists(self, key: str) -> bool:
        path = self._path(key)
        try:
            return await self._run(self._size_sync, path) is not None
        except OSError as e:
            raise self._error(e, key) from None

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await self._run(lambda: path.unlink(missing_ok=True))
        except OSError as e:
            raise self._error(e, key) from None

    def _walk(self, folder: str, prefix: str, start_after: str,
              temporary: bool = False) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Keys under `folder` ("" or "a/b/") in sorted order, with their entries, pruned to those that
        can start with `prefix` and sort after `start_after`; temporary files instead of objects if
        `temporary`. Siblings sort by name, folders as "name/", so that the depth-first order is the
        order of the whole keys ("a-b" < "a/c" since "-" < "/")."""
        try:
            with os.scandir(self.root / folder if folder else self.root) as it:
                entries = [(e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e) for e in it
                           if not e.name.startswith(".")]          # other tools' files (`foreign`)
        except (FileNotFoundError, NotADirectoryError):
            return
        for name, entry in sorted(entries, key=lambda ne: ne[0]):
            key = folder + name
            if not (key.startswith(prefix) or prefix.startswith(key)):
                continue
            if name.endswith("/"):
                # Every key below sorts after start_after, or none does, unless start_after is below.
                if key <= start_after and not start_after.startswith(key):
                    continue
                yield from self._walk(key, prefix, start_after, temporary)
            elif key > start_after and key.startswith(prefix) and name.endswith(TMP_SUFFIX) == temporary:
                yield key, entry

    def _list_sync(self, prefix: str, start_after: str, limit: int) -> list[str]:
        if self._gone():
            raise StoreUnavailable(self.name, f"folder {self.root} is gone")
        head, _, _ = prefix.rpartition("/")
        keys = self._walk(head + "/" if head else "", prefix, start_after)
        return [k for k, _ in itertools.islice(keys, limit)]

    def _list_info_sync(self, prefix: str, start_after: str, limit: int, temporary: bool) -> list[ObjectInfo]:
        if self._gone():
            raise StoreUnavailable(self.name, f"folder {self.root} is gone")
        head, _, _ = prefix.rpartition("/")
        out: list[ObjectInfo] = []
        for key, entry in self._walk(head + "/" if head else "", prefix, start_after, temporary):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue                  # deleted since the folder was read
            out.append(ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime))
            if len(out) == limit:
                break
        return out

    async def _list_info(self, prefix: str, start_after: str, limit: int, temporary: bool) -> list[ObjectInfo]:
        self._check_prefix(prefix)
        if limit < 1:
            raise StoreError(self.name, f"invalid list limit {limit}")
        try:
            return await self._run(self._list_info_sync, prefix, start_after, limit, temporary)
        except OSError as e:
            raise self._error(e, prefix) from None

    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        return await self._list_info(prefix, start_after, limit, False)

    async def list_temporary(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        return await self._list_info(prefix, start_after, limit, True)

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        self._check_prefix(prefix)
        if limit < 1:
            raise StoreError(self.name, f"invalid list limit {limit}")
        try:
            return await self._run(self._list_sync, prefix, start_after, limit)
        except OSError as e:
            raise self._error(e, prefix) from None

    def _check_sync(self) -> None:
        # Creates nothing, so that a startup that fails on another store leaves no trace: the folder,
        # or the nearest existing folder above it (the first put creates the rest), must be writable.
        # A folder that existed and vanished may come back (a remount): that failure is transient;
        # a path that is not a usable folder is a configuration error.
        if self._gone():
            raise StoreUnavailable(self.name, f"folder {self.root} is gone")
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        if not path.is_dir():
            raise StoreUnavailable(self.name, f"folder {self.root} is not usable: {path} is not a directory",
                                   transient=False)
        if not os.access(path, os.W_OK | os.X_OK):
            raise StoreUnavailable(self.name, f"folder {self.root} is not usable: {path} is not writable",
                                   transient=False)

    async def check(self) -> None:
        try:
            await self._run(self._check_sync)
        except OSError as e:
            raise StoreUnavailable(self.name, f"folder {self.root} is not usable: {e.strerror or e}",
                                   transient=e.errno in _TRANSIENT) from None

    def _capacity_sync(self) -> Capacity:
        path = self.root      # before the first put, the nearest existing folder above it
        while not path.exists() and path != path.parent:
            path = path.parent
        st = os.statvfs(path)
        return Capacity(total=st.f_blocks * st.f_frsize, free=st.f_bavail * st.f_frsize,
                        shared=f"dev:{os.stat(path).st_dev}")

    async def capacity(self) -> Capacity:
        """The space of the filesystem holding the folder (statvfs; free: f_bavail, what we may use)."""
        try:
            return await self._run(self._capacity_sync)
        except OSError as e:
            raise self._error(e, "(capacity)") from None

    def __repr__(self) -> str:
        return f"DirectoryStore({self.name!r}, {str(self.root)!r})"
