"""`cpfs put`: import existing files into the stores.

Per file: build the tensor index (a hint), cut the file on tensor boundaries, then a producer hands
chunk spans over a zero-buffer channel to a fixed set of workers that read, hash, compress (in
threads) and upload to the placement's stores in parallel. Memory stays at workers x chunk size.
The manifest is committed only after every chunk is durable on write_quorum stores.
"""
from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from . import chunk as chunkfmt
from .catalog import Catalog, new_version
from .chunking import cut, tensor_boundaries
from .errors import CpfsError
from .manifest import ChunkEntry, Manifest, normalize_path
from .placement import place
from .pool import StorePool
from .tensor_index import index_file

log = logging.getLogger(__name__)


@dataclass
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
        self.stats = PutStats()
        self.progress = progress or (lambda n: None)
        self._inflight: dict[str, trio.Event] = {}
        self._placed: dict[str, tuple[str, ...]] = {}

    def _encode(self, fd: int, offset: int, length: int) -> chunkfmt.EncodedChunk:
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise CpfsError(f"short read at offset {offset}: file shrank while importing")
        return chunkfmt.encode(data, self.cfg.compression)

    async def _chunk(self, fd: int, offset: int, length: int) -> ChunkEntry:
        enc = await trio.to_thread.run_sync(self._encode, fd, offset, length, limiter=self.pool.cpu)
        # The same chunk twice in one import (zeros, shared tensors): upload once, the rest wait for it.
        while enc.digest in self._inflight:
            await self._inflight[enc.digest].wait()
        if enc.digest not in self._placed:
            self._inflight[enc.digest] = trio.Event()
            try:
                targets = place(enc.digest, self.pool.names, self.cfg.replicas)
                held, new = await self.pool.store_chunk(enc, targets, self.cfg.write_quorum)
                self._placed[enc.digest] = tuple(held)
                if new:
                    self.stats.new_raw_bytes += enc.raw_len
                    self.stats.new_stored_bytes += enc.stored_len * len(held)
            finally:
                self._inflight.pop(enc.digest).set()
        self.progress(length)
        return ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, self._placed[enc.digest])

    async def put_file(self, src: Path, dest: str) -> Manifest:
        dest = normalize_path(dest)
        st = os.stat(src)
        if not stat.S_ISREG(st.st_mode):
            raise CpfsError(f"{src}: not a regular file")
        index = await trio.to_thread.run_sync(index_file, src, limiter=self.pool.cpu)
        spans = cut(st.st_size, self.cfg.chunk_size, tensor_boundaries(index, self.cfg.chunk_size))
        entries: list[ChunkEntry | None] = [None] * len(spans)
        fd = os.open(src, os.O_RDONLY)
        try:
            send, recv = trio.open_memory_channel[tuple[int, int, int]](0)

            async def worker(recv: trio.MemoryReceiveChannel) -> None:
                async with recv:
                    async for i, off, ln in recv:
                        entries[i] = await self._chunk(fd, off, ln)

            async with trio.open_nursery() as n:
                for _ in range(self.cfg.fetch_concurrency):
                    n.start_soon(worker, recv.clone())
                await recv.aclose()
                async with send:
                    for i, (off, ln) in enumerate(spans):
                        await send.send((i, off, ln))
        finally:
            os.close(fd)
        after = os.stat(src)
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise CpfsError(f"{src}: changed while importing; nothing was committed")
        manifest = Manifest(path=dest, size=st.st_size, mtime_ns=st.st_mtime_ns, mode=stat.S_IMODE(st.st_mode),
                            chunk_size=self.cfg.chunk_size, chunks=tuple(e for e in entries if e),
                            version=new_version(), tensor_index=index.to_json() if index else None)
        await self.catalog.commit(manifest)
        self.stats.files += 1
        self.stats.logical_bytes += st.st_size
        log.info("put %s -> %s: %d bytes in %d chunks%s", src, dest, st.st_size, len(spans),
                 f", {len(index.tensors)} tensors indexed" if index else "")
        return manifest

    async def put(self, src: Path, dest: str | None = None) -> list[Manifest]:
        """Import a file or, recursively, a folder; DEST defaults to SRC's base name at the root."""
        src = Path(src)
        dest = normalize_path(dest or src.name)
        if src.is_dir():
            files = sorted(p for p in src.rglob("*") if p.is_file())
            return [await self.put_file(p, f"{dest}/{p.relative_to(src).as_posix()}") for p in files]
        return [await self.put_file(src, dest)]
