"""Storing chunks: a span of a local file encoded, put on its placement, each chunk once.

`cpfs put` (importer) and files written through the mount (writer) store chunks alike: read a span,
hash and compress it in a thread (`encode_span`), then put it on the stores placement picks for its
digest (`Uploader.store`), which reuses the good copies stores hold already (StorePool.store_chunk).
With `write_quorum` < `replicas`, a chunk counts as stored once the quorum holds it: the pool completes
the other copies in the background (bounded: a slow store makes uploads wait, not memory grow), and the
entry names the stores that held it when it returned (readers find later copies through placement).
Within one uploader a chunk is stored once: the same chunk again (zeros, shared tensors) joins the first
upload (a SingleFlight) and reuses its result.
`in_parallel` runs the spans of a file through a fixed set of workers.
"""
from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import trio

from . import chunk as chunkfmt
from .buffers import BufferPool
from .errors import CpfsError
from .manifest import ChunkEntry
from .placement import place
from .pool import StorePool
from .sync import SingleFlight

T = TypeVar("T")
R = TypeVar("R")

# Buffers a span is read into, reused once its upload lets go (cpfs/buffers.py). A fresh bytearray per
# chunk was zero-filled holding the GIL: ~1 ms per 4 MiB chunk in which no other Python of the daemon
# ran, ~0.3 s per GiB saved. Its own pool, so that chunks the read cache holds never crowd the write path
# out; what it keeps idle is what the uploads in flight needed (the daemon trims it once writes stop).
# Reuse is safe because every holder of a stored blob (a put's thread, a background put, the repair
# queue) holds a Python reference to it, which keeps its buffer from being handed out again.
ENCODE_POOL = BufferPool(128 * 1024**2)


def encode_span(fd: int, offset: int, length: int, compression: str, name: str) -> chunkfmt.EncodedChunk:
    """Bytes [offset, offset+length) of the open file `name`, encoded as a chunk. Blocking: run it in
    a thread."""
    framed = memoryview(ENCODE_POOL.take(chunkfmt.HEADER_SIZE + length))[:chunkfmt.HEADER_SIZE + length]
    view = framed[chunkfmt.HEADER_SIZE:]               # read where the stored chunk has its bytes
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise CpfsError(f"{name}: short read at offset {offset}: the file shrank meanwhile")
        view, offset = view[n:], offset + n
    return chunkfmt.encode_framed(framed, compression)


@dataclass(frozen=True, kw_only=True)
class UploadStats:
    chunks_new: int         # chunks put on at least one store that lacked them
    chunks_deduped: int     # chunks every target store (or an earlier call) held already
    new_raw_bytes: int      # raw bytes of chunks_new
    stored_bytes: int       # compressed bytes of chunks_new sent to stores, all replicas


class Uploader:
    """Puts encoded chunks on their placement, each digest once (identical chunks wait for the first)."""

    def __init__(self, pool: StorePool) -> None:
        self._pool = pool
        self._cfg = pool.config
        self._placed: dict[str, ChunkEntry] = {}
        self._placing: SingleFlight[str, ChunkEntry] = SingleFlight()
        self._new = self._deduped = self._new_raw = self._stored = 0

    def statistics(self) -> UploadStats:
        return UploadStats(chunks_new=self._new, chunks_deduped=self._deduped, new_raw_bytes=self._new_raw,
                           stored_bytes=self._stored)

    async def store(self, enc: chunkfmt.EncodedChunk) -> ChunkEntry:
        """The chunk on (at least) write_quorum of its stores; raises the first StoreError below quorum
        (to every caller that joined the same upload)."""
        known = self._placed.get(enc.digest)
        if known is None:
            led = False

            async def place_it() -> ChunkEntry:
                nonlocal led
                led = True
                return await self._place(enc)

            known = await self._placing.run(enc.digest, place_it)
            if led:
                return known
        self._deduped += 1
        return known

    async def _place(self, enc: chunkfmt.EncodedChunk) -> ChunkEntry:
        targets = place(enc.digest, self._pool.names, self._cfg.replicas)
        held, new = await self._pool.store_chunk(enc, targets, self._cfg.write_quorum)
        if new:
            self._new += 1
            self._new_raw += enc.raw_len
            self._stored += enc.stored_len * len(held)
        else:
            self._deduped += 1
        entry = ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held), enc.blocks)
        self._placed[enc.digest] = entry
        return entry


async def in_parallel(fn: Callable[[T], Awaitable[R]], items: Sequence[T], workers: int) -> list[R]:
    """fn over every item, at most `workers` at a time; results in the items' order. The first
    CpfsError cancels the rest and is raised as it is."""
    results: list[R | None] = [None] * len(items)
    failures: list[CpfsError] = []
    send, recv = trio.open_memory_channel[int](0)

    async def worker(recv: trio.MemoryReceiveChannel[int], cancel: trio.CancelScope) -> None:
        async with recv:
            async for i in recv:
                try:
                    results[i] = await fn(items[i])
                except CpfsError as e:
                    failures.append(e)
                    cancel.cancel()
                    return

    async with trio.open_nursery() as n:
        for _ in range(min(len(items), workers)):
            n.start_soon(worker, recv.clone(), n.cancel_scope)
        await recv.aclose()
        async with send:
            for i in range(len(items)):
                await send.send(i)
    if failures:
        raise failures[0]
    return results  # type: ignore[return-value]  # every slot is filled when nothing failed
