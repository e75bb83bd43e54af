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
from collections.abc import Callable
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

    async def put(self, src: Path, dest: str | None = None) -> list[Manifest]:
        """Import a file or, recursively, a folder; DEST defaults to SRC's base name at the root."""
        src = Path(src)
        dest = normalize_path(dest or src.name)
        if src.is_dir():
            files = sorted(p for p in src.rglob("*") if p.is_file())
            pairs = [(p, f"{dest}/{p.relative_to(src).as_posix()}") for p in files]
        else:
            pairs = [(src, dest)]
        for _, d in pairs:
            _check_showable(d)
        await self._check_kinds([d for _, d in pairs])
        return [await self.put_file(p, d) for p, d in pairs]

    async def _check_kinds(self, dests: list[str]) -> None:
        """Refuse a file where a folder is, or inside a file, before anything is stored: a mount shows
        one of the two and hides the other (an audit's find: a put over a folder's name hid the folder
        and every checkpoint in it)."""
        existing = await self.catalog.load_all()

        def is_folder(p: str) -> bool:
            m = existing[p]
            return isinstance(m, Summary) and m.directory
        folders = {d for p in existing for d in parent_dirs(p)} | {p for p in existing if is_folder(p)}
        for d in dests:
            if d in folders:
                raise IsADirectory(f"{d}: a folder; remove it first (cpfs rm -r) or put elsewhere; nothing was stored")
            for parent in parent_dirs(d):
                if parent in existing and not is_folder(parent):
                    raise NotADirectory(f"{parent}: a file, so {d} cannot go inside it; nothing was stored")


def _check_showable(path: str) -> None:
    """Refuse a path no mount can show, before anything is stored: a name over NAME_MAX bytes (a
    mount's listing of its folder failed with EIO) or the control file's (it hid the mount's figures
    from `cpfs stats`), or a path too long for a manifest (`check_room`). The mount refuses them too."""
    if long := [p for p in path.split("/") if len(name_bytes(p)) > NAME_MAX]:
        raise CpfsError(f"{path}: a name of {len(name_bytes(long[0]))} bytes: at most {NAME_MAX} (NAME_MAX), or "
                        f"no mount could show it; nothing was stored")
    if path == "/" + stats.CONTROL_NAME:
        raise CpfsError(f"{path}: the name of a mount's control file (`cpfs stats`); nothing was stored")
    check_room(path)
