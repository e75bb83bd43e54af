"""`cpfs put`: import existing files into the stores.

Per file: build the tensor index (a hint), cut the file where `chunking.cut_points` says (as the
mount does), then a fixed set of workers read, hash, compress (in threads) and upload the chunks to
their placement's stores in parallel (`upload`). Memory stays at workers x chunk size.
The manifest is committed only after every chunk is durable on write_quorum stores, and safe from a
gc however long the put of the file took (upload: Renewal).
"""
from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from . import stats
from .catalog import Catalog
from .chunking import cut, cut_points
from .errors import CpfsError, IsADirectory, NotADirectory
from .manifest import NAME_MAX, ChunkEntry, Manifest, Summary, check_room, name_bytes, normalize_path, parent_dirs
from .pool import StorePool
from .tensor_index import TensorIndex, build_index
from .upload import Uploader, encode_span, in_parallel

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PutStats:
    files: int = 0
    logical_bytes: int = 0     # bytes of the imported files
    new_raw_bytes: int = 0     # raw bytes of chunks no store held before
    new_stored_bytes: int = 0  # bytes written to stores (compressed, all replicas)

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes per new raw byte: 1.0 for all-new data, inf when nothing was new."""
        return self.logical_bytes / self.new_raw_bytes if self.new_raw_bytes else float("inf")


@dataclass(frozen=True)
class Tree:
    """What a put of a folder imports, as `cp -a` and `rsync -a` see it: regular files, symbolic links
    (kept as links: a checkpoint's `latest -> step_100`, a Hugging Face snapshot's links to its
    blobs) and empty folders; `skipped`: the other kinds (fifos, sockets, devices), which no put stores.
    With `follow` (`cpfs put -L`) links are followed, as `cp -rL` does: what they point to is imported."""

    files: tuple[Path, ...] = ()
    links: tuple[Path, ...] = ()
    folders: tuple[Path, ...] = ()
    skipped: tuple[Path, ...] = ()

    @classmethod
    def of(cls, src: Path, follow: bool = False) -> Tree:
        """The folder `src`'s tree; CpfsError if a part cannot be read (a dangling link, with `follow`)
        or followed links loop. Before, an unreadable folder was left out without a word, and so was
        every symlink to a folder, dangling links included."""
        try:
            return cls._walk(src, follow)
        except OSError as e:
            raise CpfsError(f"{e.filename}: {e.strerror}; nothing was stored") from None

    @classmethod
    def _walk(cls, src: Path, follow: bool) -> Tree:
        files: list[Path] = []
        links: list[Path] = []
        folders: list[Path] = []
        skipped: list[Path] = []
        ids: dict[Path, tuple[int, int]] = {}      # folder walked -> its (device, inode)

        def fail(e: OSError) -> None:
            raise e
        for root, dirs, names in os.walk(src, onerror=fail, followlinks=follow):
            here = Path(root)
            st = os.stat(here)
            ids[here] = (st.st_dev, st.st_ino)
            if here != src and ids[here] in {ids.get(p) for p in here.parents}:
                raise CpfsError(f"{here}: a link back to a folder above it (a loop); nothing was stored")
            kept = len(files) + len(links)
            for name in dirs + names:
                p = here / name
                st = os.lstat(p)
                if follow and stat.S_ISLNK(st.st_mode):
                    try:
                        st = os.stat(p)
                    except FileNotFoundError:
                        raise CpfsError(f"{p}: a link to {os.readlink(p)}, which does not exist (-L follows "
                                        f"links; without it they are kept as links); nothing was stored") from None
                if stat.S_ISLNK(st.st_mode):
                    links.append(p)
                elif stat.S_ISREG(st.st_mode):
                    files.append(p)
                elif not stat.S_ISDIR(st.st_mode):
                    skipped.append(p)
            if not dirs and len(files) + len(links) == kept:
                folders.append(here)           # nothing in it to import: made empty, as `cp -a` makes it
        return cls(tuple(sorted(files)), tuple(sorted(links)), tuple(sorted(folders)), tuple(sorted(skipped)))

    @property
    def size(self) -> int:
        """The bytes its files hold (a progress bar's total)."""
        return sum(p.stat().st_size for p in self.files)


class Importer:
    def __init__(self, pool: StorePool, catalog: Catalog, progress: Callable[[int], None] | None = None) -> None:
        self.pool = pool
        self.catalog = catalog
        self.cfg = pool.config
        self.progress = progress or (lambda n: None)
        self._uploader = Uploader(pool)
        self._files = self._logical_bytes = 0

    @property
    def stats(self) -> PutStats:
        up = self._uploader.statistics()
        return PutStats(files=self._files, logical_bytes=self._logical_bytes, new_raw_bytes=up.new_raw_bytes,
                        new_stored_bytes=up.stored_bytes)

    def _layout(self, fd: int, size: int, name: str) -> tuple[TensorIndex | None, list[int]]:
        """The file's tensor index and cut points (blocking)."""
        def read_at(offset: int, length: int) -> bytes:
            return os.pread(fd, length, offset)

        index = build_index(read_at, size, name)
        return index, cut_points(read_at, size, index, self.cfg.chunk_size)

    async def _chunk(self, fd: int, name: str, span: tuple[int, int]) -> ChunkEntry:
        offset, length = span
        enc = await trio.to_thread.run_sync(encode_span, fd, offset, length, self.cfg.compression, name,
                                            limiter=self.pool.cpu)
        entry = await self._uploader.store(enc)
        self.progress(length)
        return entry

    async def put_file(self, src: Path, dest: str) -> Manifest:
        dest = normalize_path(dest)
        st = os.stat(src)
        if not stat.S_ISREG(st.st_mode):
            raise CpfsError(f"{src}: not a regular file")
        fd = os.open(src, os.O_RDONLY)
        try:
            index, points = await trio.to_thread.run_sync(self._layout, fd, st.st_size, str(src), limiter=self.pool.cpu)
            spans = cut(st.st_size, self.cfg.chunk_size, points)
            async with trio.open_nursery() as keeper:
                keeper.start_soon(self._uploader.keep_fresh)
                entries = await in_parallel(lambda span: self._chunk(fd, str(src), span), spans,
                                            self.cfg.fetch_concurrency)
                lost = await self._uploader.unsure(e.digest for e in entries)
                if lost:   # copies gone while the put ran (a store wiped): stored again from the file
                    log.warning("put %s: %d chunks lost their copies before the commit: storing them again",
                                src, len(lost))
                    redo = [i for i, e in enumerate(entries) if e.digest in lost]
                    again = await in_parallel(lambda i: self._chunk(fd, str(src), spans[i]), redo,
                                              self.cfg.fetch_concurrency)
                    for i, entry in zip(redo, again):
                        entries[i] = entry
                keeper.cancel_scope.cancel()
        finally:
            os.close(fd)
        after = os.stat(src)
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise CpfsError(f"{src}: changed while importing; nothing was committed")
        manifest = Manifest(path=dest, size=st.st_size, mtime_ns=st.st_mtime_ns, mode=stat.S_IMODE(st.st_mode),
                            chunk_size=self.cfg.chunk_size, chunks=tuple(entries),
                            version=0, tensor_index=index.to_json() if index else None)
        manifest = await self.catalog.commit(manifest)
        self._uploader.settled(e.digest for e in entries)
        self._files += 1
        self._logical_bytes += st.st_size
        log.info("put %s -> %s: %d bytes in %d chunks%s", src, dest, st.st_size, len(spans),
                 f", {len(index.tensors)} tensors indexed" if index else "")
        return manifest

    async def put(self, src: Path, dest: str | None = None, tree: Tree | None = None) -> list[Manifest]:
        """Import a file or, recursively, a folder: `tree`, as `Tree.of(src)` gives it (`cpfs put -L`
        passes the one with links followed). DEST defaults to SRC's base name at the root. A link given
        as SRC is followed. Files first, then the links and empty folders: a link committed before its
        target would dangle in other mounts meanwhile."""
        src = Path(src)
        dest = normalize_path(dest or src.name)
        if tree is None:
            tree = Tree.of(src) if src.is_dir() else Tree(files=(src,))

        def to(p: Path) -> str:
            return dest if p == src else f"{dest}/{p.relative_to(src).as_posix()}"
        targets = {p: os.readlink(p) for p in tree.links}
        for p in tree.files + tree.links + tree.folders:
            _check_showable(to(p), targets.get(p, ""))
        new_folders = set(await self._check_kinds([to(p) for p in tree.files + tree.links],
                                                  [to(p) for p in tree.folders]))
        for p in tree.skipped:
            log.warning("put: %s is no regular file, link or folder (a fifo, socket or device): not imported", p)
        out = [await self.put_file(p, to(p)) for p in tree.files]
        for p in tree.links:
            out.append(await self._put_entry(p, to(p), symlink=targets[p]))
        for p in tree.folders:
            if to(p) in new_folders:
                out.append(await self._put_entry(p, to(p)))
        return out

    async def _put_entry(self, src: Path, dest: str, symlink: str = "") -> Manifest:
        """A symlink (its target as it reads) or else an empty folder: a version with no chunks, as a
        mount's symlink or mkdir commits."""
        st = os.lstat(src)
        manifest = Manifest(path=dest, size=0, mtime_ns=st.st_mtime_ns,
                            mode=0o777 if symlink else stat.S_IMODE(st.st_mode), chunk_size=self.cfg.chunk_size,
                            chunks=(), version=0, symlink=symlink, directory=not symlink)
        manifest = await self.catalog.commit(manifest)
        log.info("put %s -> %s: %s", src, dest, f"a link to {symlink}" if symlink else "a folder")
        return manifest

    async def _check_kinds(self, dests: Sequence[str], folders: Sequence[str] = ()) -> list[str]:
        """Refuse a file (or link) where a folder is, or anything inside a file, before anything is
        stored: a mount shows one of the two and hides the other (an audit's find: a put over a folder's
        name hid the folder and every checkpoint in it). Returns the `folders` (empty ones to make) that
        are not folders yet."""
        existing = await self.catalog.load_all()

        def is_folder(p: str) -> bool:
            m = existing[p]
            return isinstance(m, Summary) and m.directory
        are_folders = {d for p in existing for d in parent_dirs(p)} | {p for p in existing if is_folder(p)}
        for d in list(dests) + list(folders):
            if d in are_folders and d not in folders:
                raise IsADirectory(f"{d}: a folder; remove it first (cpfs rm -r) or put elsewhere; nothing was stored")
            if d in folders and d in existing and d not in are_folders:
                raise NotADirectory(f"{d}: a file, so no folder can go there; nothing was stored")
            for parent in parent_dirs(d):
                if parent in existing and not is_folder(parent):
                    raise NotADirectory(f"{parent}: a file, so {d} cannot go inside it; nothing was stored")
        return [d for d in folders if d not in are_folders]


def _check_showable(path: str, symlink: str = "") -> None:
    """Refuse a path no mount can show, before anything is stored: a name over NAME_MAX bytes (a
    mount's listing of its folder failed with EIO) or the control file's (it hid the mount's figures
    from `cpfs stats`), or a path too long for a manifest (`check_room`). The mount refuses them too."""
    if long := [p for p in path.split("/") if len(name_bytes(p)) > NAME_MAX]:
        raise CpfsError(f"{path}: a name of {len(name_bytes(long[0]))} bytes: at most {NAME_MAX} (NAME_MAX), or "
                        f"no mount could show it; nothing was stored")
    if path == "/" + stats.CONTROL_NAME:
        raise CpfsError(f"{path}: the name of a mount's control file (`cpfs stats`); nothing was stored")
    check_room(path, symlink)
