"""The FUSE operations: a thin translation of kernel calls into namespace, reader and writer calls.

Every handler goes through one boundary that turns cpfs errors into their errno (and anything
unexpected into EIO with a traceback in the log): pyfuse3 stops the filesystem on any other exception.
Committed files are immutable, so the kernel may cache names, attributes and pages (keep_cache).
A version committed by another mount gets a new inode (see cpfs/namespace.py): opening a file checks (at
most every `refresh`) whether another mount committed a newer version, and if so answers ESTALE after
retiring the old inode and dropping the kernel's name for it; the kernel then looks the name up again
and opens the new version. Handles that opened the old version read the old version until they close.
A file opened for writing gets one WriteSession, shared by all its writable handles; flush (every
close) and fsync commit it, so close() returns only once the new version is durable. A failed commit is
reported to that close() and never retried behind the writer's back; the kernel's pages of the
uncommitted bytes are dropped when the session ends.

Owner, group, mode, times and `user.` extended attributes are stored in each version's summary
(cpfs/manifest.py). chmod, chown, utimensat and setxattr commit a new version with the same chunks (a
file open for writing here takes them into its next commit instead); the kernel enforces the
permissions itself (`default_permissions`), so no handler checks them. Versions from before ownership
was stored show the mounting user. The root folder's attributes are this mount's own (never committed),
and a folder's mtime and ctime also follow the names this mount adds and removes in it (not committed:
another mount shows the folder's committed times).

Renames and hard links change several paths, and do so in one transaction (Catalog.transact). A hard-
linked file has one node and a manifest per name, all with one `link` id: every commit of it (a close,
a chmod, a link, an unlink or rename of one name, which changes the others' ctime) writes all its
names at once. Unlike other files, a hard-linked file committed elsewhere keeps its inode here and shows
the newest of its names' versions in place (its pages dropped), since an inode with several names
cannot be swapped for one name's new node.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import logging
import math
import os
import posixpath
import secrets
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pyfuse3
import trio

from . import buffers, openers, plan, stats
from .catalog import Catalog, Snapshot, Unreadable, VersionRef, folders_above
from .chunking import READ_BLOCK
from .config import Config
from .errors import (CpfsError, Exists, IsADirectory, ManifestError, ManifestGone, NameTooLong, NotADirectory,
                     NotEmpty, NotFound, StoreError)
from .manifest import (NAME_MAX, XATTR_NAME_MAX, XATTR_NAMESPACE, XATTR_SIZE_MAX, Manifest, Summary, check_room,
                       check_xattrs, name_bytes, name_text, parent_dirs)
from .holds import Holds
from .learned import Learner
from .namespace import Namespace, Node
from .pagecache import Pusher
from .readahead import FileReader, Scheduler
from .staging import StagingError
from .store.base import Capacity
from .writer import WriteSession

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
_SPECIAL_MODES = {"fifo": stat.S_IFIFO, "socket": stat.S_IFSOCK, "char": stat.S_IFCHR, "block": stat.S_IFBLK}
UNKNOWN_CAPACITY = 2**50         # statfs total when no store reports a capacity (S3 only): 1 PiB
FILES_MAX = 2**32                # statfs f_files: names are not a resource here, but df -i shows used = total - free
STATFS_BLOCK = 4096
REFRESH_SPACING = 3              # a refresh waits 3x as long as the last one took: listings take at most 1/4
WRITE_BLOCK = 1024 * 1024       # st_blksize of a file being written (see attributes); else chunking.READ_BLOCK


def mount_options(config: Config) -> set[str]:
    """The FUSE options these semantics need: the kernel checks permissions against the stored owner,
    group and mode (default_permissions); other users reach the mount only with [mount] allow_other."""
    return {"default_permissions"} | ({"allow_other"} if config.allow_other else set())


def _name(name: bytes) -> str:
    if len(name) > NAME_MAX:
        raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
    return name_text(name)


def _reserved(parent_inode: int, name: str) -> bool:
    """The control file's name at the root (cpfs/stats.py): lookups answer with it, so a file given
    that name (rename, link) was there and never seen."""
    return parent_inode == pyfuse3.ROOT_INODE and name == stats.CONTROL_NAME


def _first_cpfs_error(e: BaseException) -> CpfsError | None:
    """The first CpfsError of an ExceptionGroup holding nothing else; None otherwise."""
    if not isinstance(e, BaseExceptionGroup):
        return None
    ours, rest = e.split(CpfsError)
    if ours is None or rest is not None:
        return None
    while isinstance(ours, BaseExceptionGroup):
        ours = ours.exceptions[0]
    return ours  # type: ignore[return-value]  # split(CpfsError) holds only CpfsErrors


def _shown(args: tuple[Any, ...]) -> str:
    """A request's arguments for a log line: a write's data as its length (a whole buffer, up to
    1 MiB, made one line of the log 1.5 MB long)."""
    return ", ".join(f"<{len(a)} bytes>" if isinstance(a, (bytes, bytearray, memoryview)) else repr(a)
                     for a in args)


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
        except (Exists, IsADirectory, NotADirectory, NotEmpty, NameTooLong) as e:    # the caller's to handle
            log.debug("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except CpfsError as e:
            log.error("%s failed: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception as e:
            # Our errors from tasks of a nursery come in an ExceptionGroup: the first one decides.
            # Callers raise them as they are (sync.fan_out); this keeps a missed one an errno too.
            first = _first_cpfs_error(e)
            if first is not None:
                log.error("%s failed: %s", fn.__name__, first)
                raise pyfuse3.FUSEError(first.errno) from None
            log.exception("%s(%s) failed unexpectedly", fn.__name__, _shown(args))
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


@dataclass
class Handle:
    node: Node
    reader: FileReader | None = None     # read-only handles of committed files
    writable: bool = False
    data: bytes | None = None            # the control file's content, made at open
    direct: bool = False                 # opened O_DIRECT: the kernel caches no read of it
    hold: Hashable | None = None         # the hold on the reader's version (cpfs/holds.py)
    opener: int = 0                      # the thread that opened a writable handle (cpfs/openers.py)
    changed: bool = False                # a write or a truncate came through it (or it was opened O_TRUNC)
    # Taken to open a reader for the version the node shows: two reads at once (the kernel's readahead)
    # would each open one, and the reader of the first, replaced, was never closed (its task and pins).
    reopening: trio.Lock = field(default_factory=trio.Lock)


@dataclass
class Writing:
    """A file's write session and who uses it: its writable handles, and a truncate(2) or a read while
    it runs. The last to leave commits and ends it (`CpfsOperations._leave`)."""
    session: WriteSession
    users: int = 0             # writable handles, and requests that use it meanwhile
    unlinked: bool = False
    failed: bool = False       # the last flush or fsync failed (and its caller was told)
    # Held by a commit of the session (from before its upload to after its transaction) and by a
    # rename, unlink or link of the file: each lands under the names the other left (`_names_changing`).
    naming: trio.Lock = field(default_factory=trio.Lock)
    # The hold on the version its next commit builds on, whose chunks that commit names unchecked
    # (cpfs/holds.py), and that version.
    hold: Hashable | None = None
    held: Manifest | None = None


class CpfsOperations(pyfuse3.Operations):
    supports_dot_lookup = True

    def __init__(self, namespace: Namespace, scheduler: Scheduler, catalog: Catalog, config: Config,
                 staging: Path | None, pusher: Pusher | None = None, learner: Learner | None = None,
                 holds: Holds | None = None, make_staging: Callable[[], Path] | None = None) -> None:
        """`staging`: the daemon's staging folder, or None if the disk had no room for it at mount;
        then the first write makes it with `make_staging` (blocking: cpfs/daemon.py own_staging)."""
        super().__init__()
        self.ns = namespace
        self.sched = scheduler
        self.pusher = pusher                            # the page-cache pushes, for the statistics
        self.catalog = catalog
        self.config = config
        self.staging = staging
        self._make_staging = make_staging
        self._staging_made = trio.Lock()
        self.nursery: trio.Nursery | None = None      # set by the daemon before requests arrive
        self.handles: dict[int, Handle] = {}
        self.writing: dict[int, Writing] = {}           # inode -> its write session
        self._settling: dict[int, trio.Event] = {}      # inode -> set when its commit outside a session ends
        self._fh = itertools.count(1)
        self._uid, self._gid = os.getuid(), os.getgid()
        self._upload_slots = trio.CapacityLimiter(config.fetch_concurrency)
        self._staging_io = trio.CapacityLimiter(4)
        self._proc_reads = trio.CapacityLimiter(2)      # /proc, at closes of files written (openers.py)
        self._refreshed = 0.0
        self._refresh_took = 0.0                        # how long the last refresh's listing took
        self._refresh_lock = trio.Lock()
        self._control = Node(stats.CONTROL_INO, "/" + stats.CONTROL_NAME, False)
        self._busy_paths: list[str] = []          # paths this mount is changing the manifests of
        self._touched: set[str] | None = None     # paths changed here while the stores are listed
        self._capacity: tuple[float, Capacity | None] | None = None   # (when asked, answer) for statfs
        self.plans = plan.Board(scheduler)      # declared prefetch, per file (cpfs/plan.py)
        self.learner = learner                  # learned prefetch, per open (cpfs/learned.py)
        self.holds = holds                      # the versions open here, kept from gc (cpfs/holds.py)
        self.device: int | None = None          # the mount's st_dev, set by the daemon once it is live
        self._closes_not_last = 0               # closes while the writer still held the file (openers.py)
        self._unshown: set[str] = set()         # stored names readdir leaves out (`_unshowable`), logged
        now = time.time_ns()
        root = self.ns.node(pyfuse3.ROOT_INODE)   # attributes of this mount's own (see the module doc)
        root.summary = Summary(path="/", size=0, mtime_ns=now, mode=0o755, version=0, directory=True,
                               uid=self._uid, gid=self._gid, atime_ns=now, ctime_ns=now)

    # -- attributes and names ---------------------------------------------------------------------
    def _implied_mtime(self, node: Node) -> int:
        """A folder implied by its files' paths (`cpfs put`: no manifest of its own) is as new as its
        newest entry (through the implied folders below it), the same in every mount; it showed 1970
        (`ls -l`, `find -newer`, rsync). The kernel caches the answer for entry_timeout."""
        newest, todo = 0, [node]
        while todo:
            for c in todo.pop().children.values():
                n = self.ns.nodes.get(c)
                if n is None:
                    continue
                if n.summary is not None:
                    newest = max(newest, n.summary.mtime_ns)
                elif n.is_dir:
                    todo.append(n)
        return newest

    def attributes(self, node: Node) -> pyfuse3.EntryAttributes:
        """The node's attributes, for a reply to the kernel (which may then hold its inode: `given`)."""
        if node is self._control:
            return self._control_attributes()
        node.given = True
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = a.attr_timeout = self.config.entry_timeout
        m = node.summary
        w = self.writing.get(node.ino)
        # What buffered readers and writers (Python's open(), stdio) move per system call. Small for
        # reading: torch.load(mmap=True) reads every record's zip header through such a buffer, and
        # chunking.LEAD is cut to match, so that read fetches ~24 KiB, not a chunk; sequential readers
        # still get large requests (the kernel's readahead decides those). Large while the file is
        # being written: every write() is a FUSE request (32 KiB writes cost the daemon 2.7x the CPU
        # of 1 MiB writes). Attributes of a file being written are not cached (attr_timeout 0).
        a.st_blksize = WRITE_BLOCK if w is not None else READ_BLOCK
        a.st_uid = m.uid if m is not None and m.uid is not None else self._uid
        a.st_gid = m.gid if m is not None and m.gid is not None else self._gid
        a.st_nlink = len(node.names)      # a file's hard links (a folder's count is set below)
        a.st_size = 0
        mtime = m.mtime_ns if m is not None else self._implied_mtime(node) if node.is_dir else 0
        ctime = m.ctime_ns if m is not None and m.ctime_ns is not None else mtime
        atime = m.atime_ns if m is not None and m.atime_ns is not None else mtime
        if not node.is_dir and m is None and not node.broken:
            a.entry_timeout = 0     # not committed yet: the name may go (a failed first commit)
        if node.is_dir:
            a.st_mode = stat.S_IFDIR | (m.mode if m else 0o755)
            a.st_nlink = 2 + sum(1 for c in node.children.values() if (n := self.ns.nodes.get(c)) and n.is_dir)
            mtime, ctime = max(mtime, node.entries_changed_ns), max(ctime, node.entries_changed_ns)
        elif w is not None:
            s = w.session
            a.st_mode = stat.S_IFREG | s.mode
            if s.attributes.get("uid") is not None:
                a.st_uid = s.attributes["uid"]
            if s.attributes.get("gid") is not None:
                a.st_gid = s.attributes["gid"]
            a.st_size = s.size
            mtime, ctime = s.mtime_ns, time.time_ns()
            atime = s.attributes.get("atime_ns") or mtime
            a.attr_timeout = 0
        else:
            a.st_mode = stat.S_IFREG | ((m.mode if m else 0o644) & 0o7777)
            if m is None:
                mtime = ctime = atime = time.time_ns()
            else:
                a.st_size = m.size
                if m.symlink:
                    a.st_mode, a.st_size = stat.S_IFLNK | 0o777, len(name_bytes(m.symlink))
                elif m.special:
                    a.st_mode = _SPECIAL_MODES[m.special] | (m.mode & 0o7777)
                    a.st_rdev = m.rdev
        a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = atime, mtime, ctime
        if not self.ns.is_current(node):
            a.st_nlink = 0          # unlinked (or replaced) while open: no name leads to this inode
        a.st_blocks = (a.st_size + 511) // 512
        return a

    def _owner(self, parent: Node, ctx: pyfuse3.RequestContext) -> dict[str, int]:
        """Owner and group of a new name: the caller's; the group is the folder's if the folder has the
        set-group-ID bit (as on Linux; a new folder then inherits the bit, see _create_committed)."""
        p = parent.summary
        if p is not None and p.mode & stat.S_ISGID:
            return {"uid": ctx.uid, "gid": p.gid if p.gid is not None else self._gid}
        return {"uid": ctx.uid, "gid": ctx.gid}

    def _entries_changed(self, *folders: Node) -> None:
        """A name was added or removed in these folders: their mtime and ctime in this mount (the
        kernel drops its attributes of the folder itself after such a request)."""
        now = time.time_ns()
        for f in folders:
            f.entries_changed_ns = now

    @contextlib.contextmanager
    def _changing(self, *paths: str) -> Iterator[None]:
        """Around a change this mount makes to the manifests of `paths` (files, or folders with all
        below them). A listing of the stores that overlaps it may have seen them before or after:
        the refresh leaves those paths as this mount has them."""
        self._busy_paths.extend(paths)
        try:
            yield
        finally:
            for p in paths:
                self._busy_paths.remove(p)
            if self._touched is not None:
                self._touched.update(paths)

    async def _refresh(self) -> None:
        """Pick up files other mounts committed: re-read the manifests, at most every `refresh`, and
        at most once per REFRESH_SPACING times as long as the last listing took. A listing lists every
        store whole (keys are per path, not per folder), seconds at tens of thousands of names, and
        every `ls` and create waits for it: an `rm -rf` of 100 folders of 200 files spent most of its
        345 s in refreshes, one per folder (an audit's find)."""
        async with self._refresh_lock:
            now = trio.current_time()
            if now - self._refreshed < max(self.config.refresh, REFRESH_SPACING * self._refresh_took):
                return
            self._touched = touched = set(self._busy_paths)
            try:
                manifests = await self.catalog.load_all()
            finally:
                self._touched = None
            touched.update(self._busy_paths)
            self._refreshed = trio.current_time()
            self._refresh_took = self._refreshed - now
            self._apply(manifests, touched)

    def _apply(self, manifests: Snapshot, touched: set[str]) -> None:
        """Make the tree match a listing of every manifest, except for files being written here,
        paths this mount changed while the listing ran (it may predate those changes), and paths
        whose stores did not answer (a store down hid its files: ENOENT for a checkpoint that is
        there). A newer version gets a new inode; handles of the old one keep reading the old version."""
        def changed_here(path: str) -> bool:
            return any(path == p or path.startswith(p + "/") for p in touched)

        def absent(path: str) -> bool:
            return path not in manifests and not changed_here(path) \
                and self.catalog.listed_enough(path, manifests.missed)

        files_now: list[tuple[Node, Summary]] = []
        for path, m in manifests.items():
            if changed_here(path):
                continue
            try:
                node = self.ns.resolve(path)
            except NotFound:
                try:
                    self.ns.add(m)
                except ManifestError as e:        # a file where this mount has a folder, or so
                    log.warning("not showing %s: %s", path, e)
                continue
            if node.is_dir:
                if isinstance(m, Unreadable) or not _newer(m, node, self.catalog):
                    continue
                if m.directory:
                    node.set_version(m)         # a folder is a folder: same inode, new attributes
                    self._invalidate(node.ino)  # the kernel checks permissions on its cached ones
                else:
                    files_now.append((node, m))     # once what was in it is gone too (below)
                continue
            if node.ino in self.writing:
                continue
            if node.aliases or (node.summary is not None and node.summary.link):
                self._apply_linked(node, path, m)
            elif _newer(m, node, self.catalog):
                parent = self.ns.parent(node)
                self.ns.replace(node, m)
                self._invalidate(node.ino, parent.ino, node.name)
        gone = [(n, p) for n in list(self.ns.nodes.values()) if not n.is_dir and (n.summary is not None or n.broken)
                and n.ino not in self.writing for p in n.names if absent(p)]
        for node, path in gone:
            self._drop(node, path)
        # A folder removed elsewhere and a file made in its place: the file, once the folder is empty
        # here. Kept as a folder, it stayed one for good, and an rmdir of it removed that file.
        for node, m in files_now:
            if not node.children and self.ns.is_current(node):
                self._drop(node)
                self.ns.add(m)
        # Folders: a committed one removed elsewhere, or one that only held files removed elsewhere,
        # goes once empty (deepest first); a folder this mount is using keeps its name.
        emptied = {d for _, p in gone for d in parent_dirs(p)}
        folders = [n for n in self.ns.nodes.values() if n.is_dir and n.path != "/"]
        for node in sorted(folders, key=lambda n: -n.path.count("/")):
            if not node.children and absent(node.path) and (node.summary is not None or node.path in emptied):
                self._drop(node)

    def _apply_linked(self, node: Node, path: str, m: Summary | Unreadable) -> None:
        """A listing's entry for one name of a hard-linked file: the same file newer (committed later
        elsewhere: shown in place, as a folder's attributes are), or the name now leads elsewhere."""
        if isinstance(m, Unreadable) or node.summary is None:
            return
        if m.link and m.link == node.summary.link:
            if m.committed_ns > node.summary.committed_ns:
                node.set_version(m)
                self._invalidate(node.ino)
            return
        self._drop(node, path)
        self.ns.add(m)

    def _drop(self, node: Node, path: str | None = None) -> None:
        """The node (a name of it: `path`) went elsewhere."""
        path = path or node.path
        parent = self.ns.parent_of(path)
        if node.is_dir:
            self.ns.remove(node)
        else:
            self.ns.remove_name(node, path)
        self._invalidate(node.ino, parent.ino, posixpath.basename(path))

    @staticmethod
    def _gone_unless(node: Node | None, path: str) -> Node:
        """`node`, or NotFound (ENOENT) for a file another mount removed (`_caught_up` gave None)."""
        if node is None:
            raise NotFound(f"{path}: removed by another mount")
        return node

    def _invalidate(self, ino: int, parent: int | None = None, name: str | None = None) -> None:
        """Drop the kernel's cached pages/attributes (or name) of a file that changed elsewhere.
        From a thread, not awaited: the kernel may need a lock that the request being handled holds."""
        assert self.nursery is not None
        self.nursery.start_soon(trio.to_thread.run_sync, _kernel_forget, ino, parent, name)

    async def _take_newer(self, node: Node) -> None:
        """If another mount committed a newer version of this file (looked up at most every `refresh`
        per file), give the path a new inode with it and answer ESTALE: the kernel then looks the name
        up again (LOOKUP_REVAL) and opens the new inode, while handles of the old inode read on.
        Only from open, during which the kernel holds no lock on the inode."""
        if not self.ns.is_current(node):
            raise pyfuse3.FUSEError(errno.ESTALE)   # a name looked up before the version changed
        if await self._rechecked(node) is not node:
            raise pyfuse3.FUSEError(errno.ESTALE)     # the kernel looks again: the new inode, or ENOENT

    async def _rechecked(self, node: Node) -> Node | None:
        """`_caught_up`, at most once per `refresh` per inode."""
        now = trio.current_time()
        if now - node.checked < self.config.refresh:
            return node
        node.checked = now
        new = await self._caught_up(node)
        if new is not None:
            new.checked = now
        return new

    async def _caught_up(self, node: Node) -> Node | None:
        """The node of the file's current version: `node`; a new node (inode) for a newer version
        another mount committed since this one looked (the old one retired, its kernel entry dropped:
        the retried lookup revalidates anyway); None if another mount removed it (its name dropped
        here). Before a change that builds on the version shown (a chmod, a truncate, a rename, a
        link): made from a version another mount had replaced, it was committed over the newer one,
        and every mount read the save before again; and a file removed elsewhere stayed openable here
        until a listing (audits' finds). Hard-linked files are shown newer in place by each listing;
        a path this mount is changing now is left as it is."""
        if node.is_dir or node.summary is None or node.ino in self.writing or node.summary.link \
                or not self.ns.is_current(node) or node.path in self._busy_paths:
            return node
        try:
            m: Summary | Unreadable = await self.catalog.current(node.path)
        except NotFound:
            if node.ino in self.writing or not self.ns.is_current(node) or node.path in self._busy_paths:
                return node
            log.info("%s: removed elsewhere (inode %d)", node.path, node.ino)
            self._drop(node)    # open handles read on; the name goes, here and in the kernel
            return None
        except StoreError as e:
            log.warning("%s: cannot check for a newer version, going on with the one listed: %s", node.path, e)
            return node
        except ManifestError as e:
            m = Unreadable(node.path, "(current version)", str(e))
        if not _newer(m, node, self.catalog) or node.ino in self.writing or not self.ns.is_current(node):
            return node
        parent = self.ns.parent(node)
        new = self.ns.replace(node, m)
        self._invalidate(node.ino, parent.ino, node.name)
        log.info("%s: newer version %s committed elsewhere (inode %d -> %d)", node.path,
                 getattr(m, "version", "?"), node.ino, new.ino)
        return new

    @boundary
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if parent_inode == pyfuse3.ROOT_INODE and name == stats.CONTROL_NAME.encode():
            return self._control_attributes()
        text = _name(name)
        try:
            node = self.ns.lookup(parent_inode, text)
            if node.summary is not None and not node.is_dir:
                # `latest -> step_N`, replaced by another mount: resolved as it is now (at most `refresh`
                # old), not as this mount first listed it (an audit's find: until a listing, for good).
                # A file too: its size and mtime, once the kernel's entry expired (`entry_timeout`), are
                # the newest version's for a watcher polling stat (another audit's find: until an open).
                node = self._gone_unless(await self._rechecked(node), node.path)
        except NotFound:
            await self._refresh()
            try:
                node = self.ns.lookup(parent_inode, text)
            except NotFound:
                node = await self._lookup_committed(parent_inode, text)
        return self.attributes(node)

    async def _lookup_committed(self, parent_inode: int, name: str) -> Node:
        """A name this mount does not know, looked up on the stores at once (one folder listing per
        store): a file another mount committed is visible on its first lookup, between refreshes."""
        parent = self.ns.node(parent_inode)
        if not parent.is_dir or name in (".", "..") or "/" in name:
            raise NotFound(f"no {name!r} in {parent.path}")
        path = posixpath.join(parent.path, name)
        try:
            found: Summary | Unreadable = await self.catalog.current(path)
        except ManifestError as e:
            found = Unreadable(path, "(current version)", str(e))
        if path in self.ns.by_path:                  # appeared meanwhile (a refresh, a create here)
            return self.ns.resolve(path)
        if not self.ns.is_current(parent):
            raise NotFound(f"no {name!r} in {parent.path}")
        return self.ns.add(found)

    @boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode == stats.CONTROL_INO:
            return self._control_attributes()
        return self.attributes(self.ns.node(inode))

    # -- the control file (cpfs/stats.py): looked up by name at the root, never listed --------------
    def _control_attributes(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = stats.CONTROL_INO
        a.entry_timeout = a.attr_timeout = 0
        a.st_mode = stat.S_IFREG | 0o444
        a.st_nlink = 1
        a.st_uid, a.st_gid = self._uid, self._gid
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = time.time_ns()
        return a

    def statistics_document(self) -> bytes:
        """Every layer's statistics() as the JSON document `.cpfs-stats` and the metrics server serve."""
        mount = {"files": sum(1 for n in self.ns.nodes.values() if not n.is_dir), "retired": len(self.ns.retired),
                 "open_handles": len(self.handles), "writing": len(self.writing),
                 "closes_not_last": self._closes_not_last}
        return stats.collect(pool=self.catalog.pool, catalog=self.catalog, scheduler=self.sched, mount=mount,
                             plans=self.plans.statistics() + (self.learner.plans() if self.learner else []),
                             learned=self.learner.statistics() if self.learner else None,
                             pushes=self.pusher.statistics() if self.pusher else None,
                             holds=self.holds.statistics() if self.holds else None,
                             buffers=buffers.POOL.statistics())

    @boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self.ns.node(inode).is_dir:
            raise NotADirectory(f"inode {inode}: not a folder")
        await self._refresh()
        return inode

    @boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node = self.ns.node(fh)
        for name, ino, cookie in node.listing(start_id):
            raw = name_bytes(name)
            if len(raw) > NAME_MAX or _reserved(fh, name):
                self._unshowable(posixpath.join(node.path, name))
                continue
            if not pyfuse3.readdir_reply(token, raw, self.attributes(self.ns.node(ino)), cookie):
                break

    def _unshowable(self, path: str) -> None:
        """A stored name no listing may carry: longer than NAME_MAX (the kernel failed the whole
        listing with EIO) or the control file's. Stored by an older `cpfs put`, which let them in;
        logged once per mount. `cpfs ls`, `log` and `restore` still reach it."""
        if path not in self._unshown:
            self._unshown.add(path)
            log.warning("%r: not listed: %s", path, "the control file's name" if path == "/" + stats.CONTROL_NAME
                        else f"a name over {NAME_MAX} bytes (NAME_MAX)")

    @boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """The space a user can still fill: the stores' capacity as StorePool.capacity counts it (each
        byte goes to `replicas` stores), asked at most every `refresh`. With no store reporting one (S3
        only) the total is UNKNOWN_CAPACITY (1 PiB), free that less what the files here hold."""
        now = trio.current_time()
        if self._capacity is None or now - self._capacity[0] >= self.config.refresh:
            self._capacity = (now, await self.catalog.pool.capacity())
        cap = self._capacity[1]
        if cap is None:
            used = sum(n.summary.size for n in self.ns.nodes.values() if n.summary is not None)
            cap = Capacity(total=UNKNOWN_CAPACITY, free=max(0, UNKNOWN_CAPACITY - used))
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = STATFS_BLOCK
        s.f_blocks = cap.total // STATFS_BLOCK
        s.f_bfree = s.f_bavail = cap.free // STATFS_BLOCK
        s.f_files = FILES_MAX
        s.f_ffree = s.f_favail = max(0, FILES_MAX - len(self.ns.nodes))
        s.f_namemax = NAME_MAX
        return s

    # -- reading ----------------------------------------------------------------------------------
    def _new_handle(self, handle: Handle) -> int:
        fh = next(self._fh)
        self.handles[fh] = handle
        return fh

    async def _manifest(self, node: Node) -> Manifest:
        """The whole manifest of the version the node shows, fetched on first need."""
        while node.manifest is None:        # a commit here while we fetch: fetch what it shows now
            if node.summary is None:
                raise ManifestError(f"{node.path}: {node.broken or 'not committed'}")
            node.take_manifest(await self.catalog.manifest(node.summary))
        return node.manifest

    async def _opening(self, node: Node) -> Manifest:
        """`_manifest`, for an open. The version shown may be retired since it was last checked (at most
        `refresh` ago: another mount commits the file several times a second, keep_versions deletes
        it): then the newest is looked up at once and the open answers ESTALE, so that the kernel
        looks the name up again and opens that one. It answered EIO until the next check (the busy
        commits audit: 5,321 of 29,304 opens with keep_versions 1)."""
        try:
            return await self._manifest(node)
        except ManifestGone:
            node.checked = -math.inf
            if await self._rechecked(node) is not node:
                raise pyfuse3.FUSEError(errno.ESTALE) from None
            raise

    async def _stop_pushes(self, ino: int) -> None:
        """A write session of the file begins: the kernel will cache the written bytes in its pages, so
        no page-cache push of a version read so far (a reader's prefetches still in flight) may land
        after this returns, nor any until the session ends (`Scheduler.writing`, `written`). Landing
        after a write, an old push put the version before back over the written bytes, in this open
        and in every later one (found by an audit, with slow stores)."""
        self.sched.writing(ino)
        if self.pusher is not None:
            await self.pusher.withdraw(ino)

    async def _base(self, node: Node, truncate: bool) -> Manifest | None:
        """The version a write session starts from. A truncating open needs it only to tell whether it
        replaces a checkpoint: a version it cannot read then does not keep the file from being written
        over (None: judged no checkpoint)."""
        try:
            return await self._manifest(node) if truncate else await self._opening(node)
        except ManifestError as e:
            if not truncate:
                raise
            log.warning("%s: writing over a version that cannot be read (%s)", node.path, e)
            return None

    async def _session(self, node: Node, truncate: bool, mode: int | None = None,
                       explicit: bool = False) -> Writing:
        """The node's write session, created on first writable open (from the committed version,
        unless truncating; `explicit`: a truncate(2), not an O_TRUNC open), with one use of it held
        for the caller (`Writing.users`), who leaves it with `_leave`.

        The kernel sends a release after close() returned, so the next open of the file may come
        while the last user's `_leave` still commits and ends the session: it waits for that end (as
        for a chmod's commit of the closed file: `_settled`) and starts from what was committed. The
        use is taken before any await, so a release meanwhile cannot end the session under the caller."""
        staging = self.staging or await self._staging()
        await self._settled(node.ino)
        w = self.writing.get(node.ino)
        if w is None:
            assert self.nursery is not None
            await self._stop_pushes(node.ino)
            try:
                # An empty file too starts from its version, unless truncated: without a base a session
                # has nothing committed, so a close with no write would commit an empty version over
                # whatever another mount saved meanwhile.
                base = None if node.summary is None or (truncate and node.summary.size == 0) else \
                    await self._base(node, truncate)
                # Its unchanged chunks are committed by reference, unchecked: held while the session runs.
                hold = self._hold(base, at_once=True) if base and not truncate else None
                if node.ino in self.writing or node.ino in self._settling:     # another open or a chmod meanwhile
                    self._let_go(hold)
                    return await self._session(node, truncate, mode, explicit)
                replaces_checkpoint = bool(truncate and not explicit and base and base.tensor_index)
                base = None if truncate else base
                session = WriteSession(self.catalog.pool, self.catalog, node.path, staging_dir=staging,
                                       base=base, mode=mode if mode is not None else
                                       (node.summary.mode if node.summary else 0o644),
                                       nursery=self.nursery, upload_limiter=self._upload_slots,
                                       io_limiter=self._staging_io, replaces_checkpoint=replaces_checkpoint)
                if node.summary is not None:     # the next commit keeps owner, atime and xattrs
                    m = node.summary
                    session.attributes.update(uid=m.uid, gid=m.gid, atime_ns=m.atime_ns, xattrs=m.xattrs, link=m.link)
                w = self.writing[node.ino] = Writing(session, users=1, hold=hold, held=base if hold else None)
            except BaseException:
                if node.ino not in self.writing:     # none began: the pages hold what they held
                    self.sched.written(node.ino, node.summary.version if node.summary else None)
                raise
            return w
        w.users += 1
        if truncate:
            try:
                await w.session.truncate(0)
            except BaseException:
                await self._leave(node, w)
                raise
        else:
            self._hold_latest(w)      # a close's commit may have left it unheld: the session goes on
        return w

    def _hold_latest(self, w: Writing) -> None:
        """Hold the version the session's next commit builds on, in place of the one held before."""
        m = w.session.committed
        if self.holds is None or m is None or m is w.held:
            return
        token = self._hold(m, at_once=True)
        self._let_go(w.hold)
        w.hold, w.held = token, m

    async def _leave(self, node: Node, w: Writing) -> None:
        """Give back a use of the node's session; the last one commits (normally a no-op: close()
        committed) and ends it, unless a flush failed (its caller was told: never commit behind it)."""
        w.users -= 1
        if w.users:
            return
        # A rename, an unlink or a chmod of it was under way, and an open or a read joined meanwhile:
        # the last of them ends the session (or has already: then a new one may be current).
        if await self._settled(node.ino) and (w.users or self.writing.get(node.ino) is not w):
            return
        with self._settling_commit(node.ino):
            try:
                if not w.failed:
                    await self._commit(node)
            finally:
                # Before any await: a request that follows the close() must not find the session or the name.
                del self.writing[node.ino]
                self.sched.written(node.ino, node.summary.version if node.summary else None)
                if (node.summary is None and not node.broken and not w.unlinked
                        and self.ns.is_current(node)):
                    self.ns.remove(node)   # never committed: it never existed for anyone else
                    if node.hides is not None and node.hides.path == node.path:
                        # It was renamed over a committed file, which is still the current version
                        # there (no commit replaced it): listed again at once, not at the next refresh.
                        try:
                            self.ns.add(node.hides)
                            self._entries_changed(self.ns.parent_of(node.path))
                        except ManifestError as e:    # its folder is a file now: the refresh decides
                            log.warning("%s: the version it was renamed over is not shown again: %s", node.path, e)
                elif w.failed and not w.unlinked:
                    self._invalidate(node.ino)    # the kernel's pages hold bytes that did not commit
                self._let_go(w.hold)
                await w.session.aclose()

    async def _staging(self) -> Path:
        """The staging folder, made now if the disk had no room for it at mount (StagingError, ENOSPC,
        while it still has none: the write fails, the committed version stays)."""
        async with self._staging_made:
            if self.staging is None:
                if self._make_staging is None:
                    raise StagingError("no staging folder", errno.ENOSPC)
                self.staging = await trio.to_thread.run_sync(self._make_staging)
                log.info("staging folder %s made: the disk has room again", self.staging)
            return self.staging

    async def _settled(self, *inos: int | None) -> bool:
        """Wait until no commit of these inodes outside a write session is under way: a session's end,
        a closed file's new attributes, an unlink, a rename, a link. Each such commit starts from the
        version the last one made, so none is lost (a chmod's version made from the version before a
        save would undo the save; one made before a rename would bring back the old name). Whether it
        waited: then what the caller looked up before may have changed."""
        waited = False
        while (done := next((self._settling[i] for i in inos if i in self._settling), None)) is not None:
            await done.wait()
            waited = True
        return waited

    @contextlib.contextmanager
    def _settling_commit(self, *inos: int) -> Iterator[None]:
        """Around such a commit; entered right after `_settled`, with no await between."""
        assert not any(ino in self._settling for ino in inos)
        done = trio.Event()
        self._settling.update((ino, done) for ino in inos)
        try:
            yield
        finally:
            for ino in inos:
                del self._settling[ino]
            done.set()

    @contextlib.asynccontextmanager
    async def _names_changing(self, *nodes: Node) -> AsyncIterator[None]:
        """Around a rename, an unlink or a link of these files; entered right after `_settled` of
        their inodes. Holds off other commits outside a session (`_settling_commit`); then waits for a
        commit of their write sessions under way (it names the file before its transaction; landing
        after our change, it brought back the old name) and holds off the next until our change is
        done. The sessions in inode order, so two of these never wait for each other."""
        with self._settling_commit(*dict.fromkeys(n.ino for n in nodes)):
            sessions = {n.ino: w for n in nodes if (w := self.writing.get(n.ino)) is not None}
            async with contextlib.AsyncExitStack() as held:
                for ino in sorted(sessions):
                    await held.enter_async_context(sessions[ino].naming)
                yield

    @boundary
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode == stats.CONTROL_INO:
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise pyfuse3.FUSEError(errno.EACCES)
            fh = self._new_handle(Handle(self._control, data=self.statistics_document()))
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        node = self.ns.node(inode)
        if node.is_dir:
            raise IsADirectory(f"{node.path}: is a folder")
        # /proc/PID/fd/N of a file unlinked (or replaced) while written: its session, as on a local disk.
        reopened = node.ino in self.writing and not self.ns.is_current(node)
        if not reopened and (self.ns.is_current(node) or flags & os.O_ACCMODE != os.O_RDONLY or node.summary is None):
            await self._take_newer(node)
        # else: a version replaced (a rename over it, an unlink) after the kernel looked its name up.
        # Read-only, it opens that version, as an open racing a rename does on a local filesystem;
        # ESTALE made the kernel look again, and a second replacement meanwhile failed the open.
        if node.broken and not flags & os.O_TRUNC:
            raise ManifestError(f"{node.path}: {node.broken}")
        direct = bool(flags & os.O_DIRECT)       # the kernel caches no read of this open
        if flags & os.O_ACCMODE != os.O_RDONLY:
            await self._session(node, truncate=bool(flags & os.O_TRUNC))
            fh = self._new_handle(Handle(node, writable=True, direct=direct, opener=ctx.pid,
                                         changed=bool(flags & os.O_TRUNC)))
            return pyfuse3.FileInfo(fh=fh, direct_io=False, keep_cache=True)
        if node.ino in self.writing or node.summary is None:
            return pyfuse3.FileInfo(fh=self._new_handle(Handle(node, direct=direct)), keep_cache=True)
        assert self.nursery is not None
        m = await self._opening(node)
        hold = self._hold(m)
        try:
            reader = await self.sched.open(self.nursery, m, node.index, inode, direct)
        except BaseException:
            self._let_go(hold)
            raise
        fh = self._new_handle(Handle(node, reader, direct=direct, hold=hold))
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    def _hold(self, m: Manifest, *, at_once: bool = False) -> Hashable | None:
        """Keep version `m` from gc while it is open here (cpfs/holds.py); `_let_go` of the token ends it."""
        return self.holds.take(m, at_once=at_once) if self.holds is not None else None

    def _let_go(self, hold: Hashable | None) -> None:
        if hold is not None and self.holds is not None:
            self.holds.drop(hold)

    @boundary
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        h = self.handles[fh]
        if h.data is not None:
            return h.data[off:off + size]
        if h.node.ino in self.writing:
            await self._settled(h.node.ino)   # the session's end, if under way: then read what it committed
        w = self.writing.get(h.node.ino)
        if w is not None:                      # read-your-writes; a use, so a release cannot end it meanwhile
            w.users += 1
            try:
                return await w.session.read(off, size)
            finally:
                await self._leave(h.node, w)
        if h.reader is None or h.reader.m is not h.node.manifest:
            async with h.reopening:
                if h.node.summary is None:
                    return b""
                if h.reader is None or h.reader.m is not h.node.manifest:
                    await self._reopen(h)
        assert h.reader is not None
        return await h.reader.read(off, size)

    async def _reopen(self, h: Handle) -> None:
        """A reader of the version the node shows, for a handle opened while the file was being written
        here, or whose file was committed here since (another mount's versions come with a new inode)."""
        if h.reader is not None:
            await h.reader.aclose()
            h.reader = None
        m = await self._manifest(h.node)
        assert self.nursery is not None
        hold = self._hold(m)
        self._let_go(h.hold)
        h.hold = hold
        h.reader = await self.sched.open(self.nursery, m, h.node.index, h.node.ino, h.direct)

    # -- writing ----------------------------------------------------------------------------------
    @boundary
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self.ns.node(parent_inode)
        check_room(posixpath.join(parent.path, _name(name)))     # not at its close, after the writes
        node = self.ns.create(parent, _name(name), is_dir=False)
        try:
            w = await self._session(node, truncate=True, mode=mode & 0o7777)
        except BaseException:
            self.ns.remove(node)
            raise
        w.session.set_attributes(**self._owner(parent, ctx))
        self._entries_changed(parent)
        fh = self._new_handle(Handle(node, writable=True, opener=ctx.pid, changed=True))
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), self.attributes(node)

    @boundary
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handles[fh]
        h.changed = True
        return await self.writing[h.node.ino].session.write(off, buf)

    async def _commit(self, node: Node, closing: bool = True) -> None:
        w = self.writing.get(node.ino)
        if w is None or w.unlinked:
            return
        async with w.naming:
            if not w.unlinked:        # an unlink while we waited: nothing is committed
                await self._commit_named(node, w, closing)

    def _seen(self, node: Node) -> dict[str, tuple[int, str]]:
        """The versions this mount shows of a file and of the folders made with mkdir above it (see
        WriteSession.seen: a commit after another mount removed or renamed one of them fails)."""
        out = {node.path: node.summary.order} if node.summary is not None else {}
        for path in folders_above(node.path):
            folder = self.ns.nodes.get(self.ns.by_path.get(path, -1))
            if folder is not None and folder.summary is not None:
                out[path] = folder.summary.order
        return out

    async def _commit_named(self, node: Node, w: Writing, closing: bool) -> None:
        w.session.path, w.session.also = node.path, list(node.aliases)
        w.session.seen = self._seen(node)
        with self._changing(*node.names):
            commits = w.session.statistics().commits
            try:
                manifest = await w.session.flush(closing=closing)
            except BaseException:
                w.failed = True
                raise
            w.failed = False
            # Only a version this flush made: one with nothing new returns the session's last commit,
            # which a rename since may have replaced (a file written under a temporary name, then
            # renamed while the kernel's release of it was on its way).
            if manifest is not None and w.session.statistics().commits > commits:
                node.set_version(manifest)
                if not closing or w.users > 1:
                    self._hold_latest(w)     # the session goes on from this version

    @boundary
    async def flush(self, fh: int) -> None:
        """The writer's close() of a writable handle commits: close returns once the version is durable.
        A close while the writer still holds the file open for writing commits nothing: a forked child's
        (its exit, an exec's closing of descriptors) or a dup's (cpfs/openers.py)."""
        h = self.handles[fh]
        if h.writable:
            # A handle that changed nothing, while another writes on: a bystander's close (`touch` of a
            # checkpoint being saved) committed the saver's half-written file (EIO for a checkpoint, a
            # version of partial bytes of any other file, which retired a good one).
            if (not h.changed and self._another_writes(h)) or await self._writer_holds(h):
                self._closes_not_last += 1
                return
            await self._commit(h.node)

    def _another_writes(self, h: Handle) -> bool:
        """Whether another writable handle of h's file is open (in this mount)."""
        return any(o.writable and o.node is h.node and o is not h for o in self.handles.values())

    async def _writer_holds(self, h: Handle) -> bool:
        """Whether the process that opened `h` still has the file open for writing (so this close is
        another's); False whenever /proc cannot tell, and for a file with no session (nothing to commit)."""
        device, node = self.device, h.node
        if device is None or not h.opener or node.ino not in self.writing:
            return False
        names = [posixpath.basename(p) for p in node.names]

        def ask() -> bool:
            pid = openers.process_of(h.opener)
            return pid is not None and openers.holds_for_writing(pid, device, node.ino, names) is True
        return await trio.to_thread.run_sync(ask, limiter=self._proc_reads)

    @boundary
    async def fsync(self, fh: int, datasync: bool) -> None:
        """Durable data, but not a commit of a checkpoint still being written (see WriteSession.flush).
        Through any descriptor of the file, as on a local disk: a read-only one's fsync made nothing
        that another handle wrote durable."""
        h = self.handles[fh]
        if h.writable or h.node.ino in self.writing:
            await self._commit(h.node, closing=False)

    @boundary
    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        self._let_go(h.hold)
        if h.reader is not None:
            await h.reader.aclose()
        if h.writable:
            await self._leave(h.node, self.writing[h.node.ino])

    @boundary
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """chmod, chown, utimensat (UTIME_NOW arrives as the time now, UTIME_OMIT as no field) and
        truncate. The kernel has checked who may (default_permissions) and sends the clearing of
        set-user-ID and set-group-ID bits as a mode change."""
        node = self.ns.node(inode)
        changes: dict[str, Any] = {}
        if fields.update_mode:
            changes["mode"] = attr.st_mode & 0o7777
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        if fields.update_size:
            if node.is_dir:
                raise IsADirectory(f"{node.path}: is a folder")
            changes.setdefault("mtime_ns", time.time_ns())
            if fh is not None and fh in self.handles:
                self.handles[fh].changed = True            # ftruncate: its close commits
            else:
                node = self._gone_unless(await self._caught_up(node), node.path)  # its current version
            # A use of the file's session while we truncate: of its own for a closed file, committed
            # as we leave it; else the open one's, whose close commits (as it does if it closes first).
            w = await self._session(node, truncate=attr.st_size == 0, explicit=True)
            try:
                await w.session.truncate(attr.st_size)
                w.session.set_attributes(**changes)
            except BaseException:
                w.failed = w.failed or w.users == 1    # ours alone: commit nothing
                raise
            finally:
                await self._leave(node, w)
            return self.attributes(node)
        if changes:
            await self._change(node, **changes)
        return self.attributes(node)

    async def _change(self, node: Node, **changes: Any) -> None:
        """New attributes (mode, owner, times, xattrs) for a name: a new version with the same content,
        committed now; a file open for writing here takes them into its next commit instead."""
        now = time.time_ns()
        await self._settled(node.ino)
        w = self.writing.get(node.ino)
        if w is not None:
            w.session.set_attributes(**changes)
        elif node.ino == pyfuse3.ROOT_INODE or (node.summary is not None and not self.ns.is_current(node)):
            # The root (this mount's own), or a retired version (fchmod of a file removed or replaced
            # since it was opened): shown to its handles, never committed over the path's new version.
            assert node.summary is not None
            node.summary = dataclasses.replace(node.summary, ctime_ns=now, **changes)
        elif node.summary is not None:
            with self._settling_commit(node.ino):
                await self._rewrite(node, ctime_ns=now, **changes)
        elif node.is_dir:        # a folder implied by its files' paths: committed now, as mkdir does
            first = Manifest(path=node.path, size=0, mtime_ns=now, mode=0o755, chunk_size=self.config.chunk_size,
                             chunks=(), version=0, directory=True, uid=self._uid, gid=self._gid, ctime_ns=now)
            with self._changing(node.path), self._settling_commit(node.ino):
                node.set_version(await self.catalog.commit(dataclasses.replace(first, **changes)))
        else:
            raise ManifestError(f"{node.path}: {node.broken or 'not committed'}")
        if node.is_dir and "mtime_ns" in changes:
            node.entries_changed_ns = 0      # utimensat of a folder sets its mtime (cp -a, rsync -a)

    async def _rewrite(self, node: Node, **changes: Any) -> None:
        """A new version with other attributes and the same chunks (under every name of the file, as
        one transaction); of the file's current version, if another mount committed a newer one."""
        node = self._gone_unless(await self._caught_up(node), node.path)
        m = await self._manifest(node)
        with self._changing(*node.names):
            committed = await self.catalog.transact(m.at(node.names, **changes))
            node.set_version(committed[0])

    # -- extended attributes ("user." only; stored in the summary, see cpfs/manifest.py) -------------
    def _xattr_name(self, inode: int, name: bytes) -> str:
        text = name_text(name)
        if inode == stats.CONTROL_INO or not text.startswith(XATTR_NAMESPACE):
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        if len(name) > XATTR_NAME_MAX:
            raise pyfuse3.FUSEError(errno.ERANGE)
        if text == XATTR_NAMESPACE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return text

    def _xattrs(self, node: Node) -> dict[str, bytes]:
        w = self.writing.get(node.ino)
        if w is not None and "xattrs" in w.session.attributes:
            return dict(w.session.attributes["xattrs"])   # type: ignore[call-overload]
        return dict(node.summary.xattrs) if node.summary is not None else {}

    @boundary
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        key = self._xattr_name(inode, name)
        if key == plan.XATTR:
            p = self.plans.get(inode)
            if p is None:
                raise pyfuse3.FUSEError(errno.ENODATA)
            return p.statistics().to_json()
        try:
            return self._xattrs(self.ns.node(inode))[key]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENODATA) from None

    @boundary
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if inode == stats.CONTROL_INO:
            return []
        return [name_bytes(k) for k in sorted(self._xattrs(self.ns.node(inode)))]

    @boundary
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        key = self._xattr_name(inode, name)
        if len(value) > XATTR_SIZE_MAX:
            raise pyfuse3.FUSEError(errno.E2BIG)
        if key == plan.XATTR:
            await self._declare_prefetch(self.ns.node(inode), value)
            return
        node = self.ns.node(inode)
        await self._settled(inode)     # a commit under way first (another setxattr): add to what it made
        xattrs = self._xattrs(node)
        xattrs[key] = bytes(value)
        try:
            check_xattrs(xattrs.items())
        except ValueError:
            raise pyfuse3.FUSEError(errno.ENOSPC) from None    # as ext4 when a file's block is full
        await self._change(node, xattrs=tuple(sorted(xattrs.items())))

    @boundary
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        key = self._xattr_name(inode, name)
        if key == plan.XATTR:
            if self.plans.stop(inode) is None:
                raise pyfuse3.FUSEError(errno.ENODATA)
            return
        node = self.ns.node(inode)
        await self._settled(inode)     # a commit under way first (another setxattr): take from what it made
        xattrs = self._xattrs(node)
        if xattrs.pop(key, None) is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        await self._change(node, xattrs=tuple(sorted(xattrs.items())))

    async def _declare_prefetch(self, node: Node, value: bytes) -> None:
        """Start the prefetch a loader declared (cpfs/plan.py), replacing the file's previous one."""
        if node.is_dir or node.summary is None or node.ino in self.writing:
            raise plan.PlanError(f"{node.path}: a declared prefetch needs a committed file")
        patterns = plan.parse_patterns(value)
        m = await self._manifest(node)
        assert self.nursery is not None
        self.plans.start(await plan.Plan.declared(self.sched, node.ino, m, node.index, patterns), self.nursery)

    # -- names ------------------------------------------------------------------------------------
    @boundary
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """A folder is committed like a file (a manifest with no chunks), so every mount sees it, empty
        or not."""
        return await self._create_committed(parent_inode, name, ctx, is_dir=True, mode=mode & 0o7777,
                                            directory=True)

    async def _create_committed(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext, *,
                                is_dir: bool, mode: int, **kind: Any) -> pyfuse3.EntryAttributes:
        """A new name whose first version (a folder, a symlink: no chunks) commits at once; the name
        goes again if the commit fails."""
        parent = self.ns.node(parent_inode)
        owner = self._owner(parent, ctx)
        if is_dir and parent.summary is not None and parent.summary.mode & stat.S_ISGID:
            mode |= stat.S_ISGID
        check_room(posixpath.join(parent.path, _name(name)), kind.get("symlink", ""))
        node = self.ns.create(parent, _name(name), is_dir=is_dir)
        now = time.time_ns()
        first = Manifest(path=node.path, size=0, mtime_ns=now, mode=mode, chunk_size=self.config.chunk_size,
                         chunks=(), version=0, ctime_ns=now, **owner, **kind)
        try:
            with self._changing(node.path):
                node.set_version(await self.catalog.commit(first))
        except BaseException:
            self.ns.remove(node)
            raise
        self._entries_changed(parent)
        return self.attributes(node)

    @boundary
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self.ns.node(parent_inode)
        node = self.ns.lookup(parent_inode, _name(name))
        # A commit of it under way (a chmod) goes first: made from the version before, it would undo us.
        if await self._settled(node.ino):
            return await self.unlink(parent_inode, name, ctx)
        async with self._names_changing(node):
            await self._unlink(parent, node, name)

    async def _unlink(self, parent: Node, node: Node, name: bytes) -> None:
        if node.is_dir:
            raise IsADirectory(f"{node.path}: is a folder")
        path = posixpath.join(parent.path, _name(name))
        if node.aliases:
            await self._unlink_name(node, path)
            self._entries_changed(parent)
            return
        with self._changing(node.path):
            if node.summary is not None or node.broken:
                await self.catalog.remove(node.path, folder=False)
            elif (hidden := await self._hidden(node, node.path)) is not None:
                await self.catalog.transact([], [hidden])
            w = self.writing.get(node.ino)
            if w is not None:
                w.unlinked = True            # open handles keep working; nothing is committed
            self.ns.remove(node)
        self._entries_changed(self.ns.node(parent.ino))

    async def _hidden(self, node: Node, path: str) -> Manifest | None:
        """The committed version at `path` that `node` (never committed) was renamed over, if it is
        still the current one there (a newer one committed elsewhere since is not ours to remove)."""
        if node.summary is not None or node.hides is None:
            return None
        try:
            s = await self.catalog.current(path)
        except (NotFound, ManifestError):
            return None
        return await self.catalog.manifest(s) if s.order == node.hides.order else None

    async def _unlink_name(self, node: Node, path: str) -> None:
        """One name of a hard-linked file goes, and its other names show the new ctime: one transaction."""
        m = await self._manifest(node)
        others = [p for p in node.names if p != path]
        now = time.time_ns()
        with self._changing(*node.names):
            committed = await self.catalog.transact(m.at(others, ctime_ns=now), m.at([path]))
            if path in node.names:
                self.ns.remove_name(node, path)
            node.set_version(committed[0])

    @boundary
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        node = self.ns.lookup(parent_inode, _name(name))
        if not node.is_dir:
            raise NotADirectory(f"{node.path}: not a folder")
        if node.children:
            raise NotEmpty(f"{node.path}: not empty")
        with self._changing(node.path):
            if node.summary is not None:
                await self.catalog.remove(node.path, folder=True)
            self.ns.remove(node)
        self._entries_changed(self.ns.node(parent_inode))

    @boundary
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old_parent = self.ns.node(parent_inode_old)
        node = self.ns.lookup(parent_inode_old, _name(name_old))
        new_parent = self.ns.node(parent_inode_new)
        new_name = _name(name_new)
        if not new_parent.is_dir:
            raise NotADirectory(f"{new_parent.path}: not a folder")
        if _reserved(parent_inode_new, new_name):     # a file there would hide behind the control file
            raise pyfuse3.FUSEError(errno.EPERM)
        target = new_parent.children.get(new_name)
        if target == node.ino:
            return                 # two names of one file: nothing to do (POSIX)
        t = None if target is None else self.ns.node(target)
        for f in (node, t):             # a newer version of either, committed elsewhere, is what moves
            if f is not None and await self._caught_up(f) is not f:
                return await self.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx)
        # A commit of either under way (a chmod) goes first: made from the version before, it would undo us.
        # For a folder, of anything below it too, and none starts until we are done: a write session
        # opened meanwhile would commit under the old name.
        files = [*self.ns.walk(node), *([] if t is None else [t])]
        if await self._settled(*(f.ino for f in files)):
            return await self.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx)
        if t is not None:
            if flags & pyfuse3.RENAME_NOREPLACE:
                raise pyfuse3.FUSEError(errno.EEXIST)
            if t.is_dir != node.is_dir:
                raise (IsADirectory if t.is_dir else NotADirectory)(f"{t.path}: cannot replace")
            if t.is_dir and t.children:
                raise NotEmpty(f"{t.path}: not empty")
        old_path, new_path = posixpath.join(old_parent.path, _name(name_old)), posixpath.join(new_parent.path, new_name)
        linked = [*node.names, *(t.names if t is not None and not t.is_dir else [])]
        with self._changing(old_path, new_path, *linked):
            # A commit of a write session of the file, or of one below the folder, goes first.
            async with self._names_changing(*files):
                # One transaction for the file, or the folder and every committed name below it: another
                # mount sees the old tree or the new one, never a mix, and a failure changes nothing.
                now = time.time_ns()
                entries = self.ns.entries(node, old_path)
                for p, f in entries:        # left behind, it would stay under the old name
                    if f.summary is None and f.broken:
                        raise ManifestError(f"{p}: {f.broken}: the folder cannot be moved without it")
                moving = [(p, f) for p, f in entries if f.summary is not None]
                old = [dataclasses.replace(await self._manifest(f), path=p) for p, f in moving]
                # Versions that files never committed were renamed over leave with them.
                hidden = [m for p, f in entries if (m := await self._hidden(f, p)) is not None]
                new = [dataclasses.replace(m, path=new_path + p[len(old_path):],
                                           **({"ctime_ns": now} if f is node else {}))   # as on Linux
                       for (p, f), m in zip(moving, old)]
                # A renamed or replaced file's other names (hard links) show its new ctime.
                touched: list[Manifest] = []
                if moving and moving[0][1] is node:               # entries() lists the node first
                    touched = old[0].at([q for q in node.names if q != old_path], ctime_ns=now)
                replaced: list[Manifest] = []      # the target's other names, if it has some
                if t is not None and not t.is_dir and t.aliases and t.summary is not None:
                    replaced = (await self._manifest(t)).at([q for q in t.names if q != new_path], ctime_ns=now)
                if (old_path not in node.names and not node.is_dir) or not self.ns.is_current(node) \
                        or (node.is_dir and node.path != old_path) or new_parent.children.get(new_name) != target:
                    raise pyfuse3.FUSEError(errno.EAGAIN)     # changed while the manifests were read
                committed = await self.catalog.transact(new + touched + replaced, old + hidden) \
                    if moving or hidden else []
                for _, f in entries:
                    f.hides = None
                if t is not None:
                    # A committed target stays on the stores until something commits under its name: the
                    # renamed file's move, or (never committed yet) its first commit. If that never comes,
                    # the target is still there on the next refresh; nothing is lost to a crash meanwhile.
                    w = self.writing.get(t.ino)
                    if w is not None and not t.aliases:
                        w.unlinked = True        # open handles keep working; nothing is committed
                    if t.is_dir:
                        self.ns.remove(t)
                    else:
                        if node.summary is None:
                            node.hides = t.manifest or t.summary or t.hides
                        self.ns.remove_name(t, new_path)
                        if replaced and committed:
                            t.set_version(committed[len(new) + len(touched)])   # its first name's version
                self.ns.move(node, new_parent, new_name, old_path)
                self._entries_changed(old_parent, new_parent)
                for (_, f), m in zip(moving, committed):
                    f.set_version(m)
                for f in self.ns.walk(node):
                    w = self.writing.get(f.ino)
                    if w is not None:
                        w.session.path, w.session.also = f.path, list(f.aliases)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, _nlookup in inode_list:
            self.ns.forget(ino)
            self.sched.forget(ino)

    @boundary
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """A symbolic link is a version of its own: a manifest with a target and no chunks, committed
        at once (so every mount sees it), relative or absolute as given."""
        return await self._create_committed(parent_inode, name, ctx, is_dir=False, mode=0o777,
                                            symlink=name_text(target))

    @boundary
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self.ns.node(inode)
        if node.summary is None or not node.summary.symlink:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return name_bytes(node.summary.symlink)

    @boundary
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """Fifos, sockets and device nodes are names with attributes and no content, committed at once
        like symlinks; the kernel serves their opens itself (pipes, sockets, drivers: never this
        filesystem; FUSE mounts are nodev, so a device node here opens nothing). A regular file made
        by mknod is an empty file."""
        kind = {v: k for k, v in _SPECIAL_MODES.items()}.get(stat.S_IFMT(mode))
        if kind is None and stat.S_IFMT(mode) != stat.S_IFREG:
            raise pyfuse3.FUSEError(errno.EINVAL)
        special = {"special": kind, "rdev": rdev if kind in ("char", "block") else 0} if kind else {}
        return await self._create_committed(parent_inode, name, ctx, is_dir=False, mode=mode & 0o7777, **special)

    @boundary
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """A hard link: every name of the file gets the same manifest with one `link` id, in one
        transaction (and so does every later commit of the file, see WriteSession.also). The kernel
        refuses folders and checks permissions and the name's absence itself."""
        await self._settled(inode)          # a chmod, rename or session's end first: link what it made
        node = self.ns.node(inode)
        node = self._gone_unless(await self._caught_up(node), node.path)
        parent = self.ns.node(new_parent_inode)
        name = _name(new_name)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EPERM)
        if not parent.is_dir:
            raise NotADirectory(f"{parent.path}: not a folder")
        if name in parent.children or _reserved(new_parent_inode, name):
            raise Exists(f"{posixpath.join(parent.path, name)}: exists")
        if not self.ns.is_current(node):
            raise NotFound(f"{node.path}: removed")
        if node.summary is None:
            log.warning("%s: link refused: the file has no committed version yet (close it first)", node.path)
            raise pyfuse3.FUSEError(errno.EPERM)
        path = posixpath.join(parent.path, name)
        link = node.summary.link or secrets.token_hex(8)
        with self._changing(*node.names, path):
            async with self._names_changing(node):
                m = dataclasses.replace(await self._manifest(node), link=link, ctime_ns=time.time_ns())
                committed = await self.catalog.transact(m.at([*node.names, path]))
                if (other := parent.children.get(name)) is not None:    # a listing showed it meanwhile
                    self._drop(self.ns.node(other), path)
                self.ns.add_name(node, path)
                self.ns.links[link] = node.ino
                node.set_version(committed[0])
                w = self.writing.get(node.ino)
                if w is not None:
                    w.session.set_attributes(link=link)
        self._entries_changed(parent)
        return self.attributes(node)


def _newer(m: Summary | Unreadable, node: Node, catalog: Catalog) -> bool:
    """Whether a listing's entry for a node's path should replace what the node shows: a newer
    version, or any other if the node's was voided since (a failed commit this mount listed in the
    moment before its writer voided it: cpfs/catalog.py)."""
    if isinstance(m, Unreadable):
        if m.unlisted and node.summary is not None:     # what the node shows may be current: kept,
            found = VersionRef.parse(m.key)               # unless the listing found a newer one
            return found is not None and found.order > node.summary.order
        return not node.broken
    return node.summary is None or m.order > node.summary.order \
        or (m.order != node.summary.order and catalog.voids(node.summary))


def _kernel_forget(ino: int, parent: int | None, name: str | None) -> None:
    """Blocking: drop the kernel's attributes and pages of `ino` (or, with `name`, that entry)."""
    try:
        if name is None:
            pyfuse3.invalidate_inode(ino)
        else:
            pyfuse3.invalidate_entry(parent, name_bytes(name))
    except OSError:
        pass          # the kernel did not have it cached
