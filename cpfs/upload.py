"""Storing chunks: a span of a local file encoded, put on its placement, each chunk once.

`cpfs put` (importer) and files written through the mount (writer) store chunks alike: read a span,
hash and compress it in a thread (`encode_span`), then put it on the stores placement picks for its
digest, a spare standing in for a store marked down (`StorePool.targets`; once more if a target went
down during the put), reusing the good copies stores hold already (StorePool.store_chunk).
With `write_quorum` < `replicas`, a chunk counts as stored once the quorum holds it: the pool completes
the other copies in the background (bounded: a slow store makes uploads wait, not memory grow), and the
entry names the stores that held it when it returned (readers find later copies through placement).
Within one uploader a chunk is stored once: the same chunk again (zeros, shared tensors) joins the first
upload (a SingleFlight) and reuses its result.
`in_parallel` runs the spans of a file through a fixed set of workers.

Renewal. A gc deletes an unreferenced chunk copy once it is older than its grace, and the chunks of a
file being written are unreferenced until its manifest lands (cpfs/gc.py). A save that runs longer than
gc_grace/2, or a file held open for hours (a log appended to), must not lose the chunks it stored first.
So the uploader remembers, per chunk it stored, the oldest mtime its copies may have, and its owner runs
`keep_fresh` while the file is open: every RENEW_EVERY of gc_grace it touches the copies that reached
RENEW_AGE of gc_grace (at most 5/8 of the grace old, at any moment, plus the time a pass takes). Ages are
counted on the pool's `ticks` (boot time), not the wall clock: a copy's mtime is read against the wall clock
once, when the chunk is stored, and a later step of that clock (NTP correcting a clock that ran fast)
moves no renewal. Before, a step back of more than 3/8 of the grace during a save held its renewals back
past the grace of a gc on a host whose clock was right. The passes count on the ticks too (trio's clock
stops while the host is suspended): a host that wakes renews within TICKS_WATCH. Before a
commit, `unsure` renews what is due and names the chunks whose copies went anyway (a daemon frozen for
longer than the grace, a store wiped, a renewal a store refused): their owner stores them again (from
staging, or from a copy left elsewhere) or fails the commit, so a manifest never names a chunk a gc took.
Once a commit names a chunk, `settled` ends its renewal: the version references it. The same chunk
reused by a later commit of the uploader counts as due at once (the version may have been retired).
"""
from __future__ import annotations

import errno
import functools
import logging
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import trio

from . import chunk as chunkfmt
from .buffers import BufferPool
from .errors import CpfsError, StoreError
from .manifest import ChunkEntry
from .pool import TICKS_WATCH, StorePool
from .sync import SingleFlight

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

RENEW_AGE = 0.5      # of gc_grace: a copy a pending commit counts on is touched once this old ...
RENEW_EVERY = 0.125  # ... looked for this often (see Renewal)

# Buffers a span is read into, reused once its upload lets go (cpfs/buffers.py). A fresh bytearray per
# chunk was zero-filled holding the GIL: ~1 ms per 4 MiB chunk in which no other Python of the daemon
# ran, ~0.3 s per GiB saved. Its own pool, so that chunks the read cache holds never crowd the write path
# out; what it keeps idle is what the uploads in flight needed (the daemon trims it once writes stop).
# Reuse is safe because every holder of a stored blob (a put's thread, a background put, the repair
# queue) holds a Python reference to it, which keeps its buffer from being handed out again.
ENCODE_POOL = BufferPool(128 * 1024**2)


def encode_span(fd: int, offset: int, length: int, compression: str, name: str) -> chunkfmt.EncodedChunk:
    """Bytes [offset, offset+length) of the open file `name`, encoded as a chunk. Blocking: run it in
    a thread. A span the file holds no data in (a hole: `truncate -s 100G`, a sparse write) is the
    zero chunk of its length, encoded once per process: hashing and compressing the zeros of a hole
    cost ~2 s per GiB of a file's apparent size at its close (an 896 GiB ftruncate: 28 min)."""
    if _hole(fd, offset, length):
        return zero_chunk(length, compression)
    framed = memoryview(ENCODE_POOL.take(chunkfmt.HEADER_SIZE + length))[:chunkfmt.HEADER_SIZE + length]
    view = framed[chunkfmt.HEADER_SIZE:]               # read where the stored chunk has its bytes
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise CpfsError(f"{name}: short read at offset {offset}: the file shrank meanwhile")
        view, offset = view[n:], offset + n
    return chunkfmt.encode_framed(framed, compression)


def _hole(fd: int, offset: int, length: int) -> bool:
    """Whether the file holds no data in [offset, offset+length): its next data (SEEK_DATA) starts
    after it. A filesystem that does not track holes answers `offset` (data): no."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) >= offset + length
    except OSError as e:     # ENXIO: no data from `offset` to the end, or `offset` past the end (the file
        # shrank meanwhile: no hole, so that the read says so rather than store zeros)
        return e.errno == errno.ENXIO and os.fstat(fd).st_size >= offset + length


@functools.lru_cache(maxsize=4)
def zero_chunk(length: int, compression: str) -> chunkfmt.EncodedChunk:
    """The encoded chunk of `length` zero bytes (its blob is shared: nobody writes a stored blob)."""
    return chunkfmt.encode(bytes(length), compression)


@dataclass(frozen=True, kw_only=True)
class UploadStats:
    chunks_new: int         # chunks put on at least one store that lacked them
    chunks_deduped: int     # chunks every target store (or an earlier call) held already
    new_raw_bytes: int      # raw bytes of chunks_new
    stored_bytes: int       # compressed bytes of chunks_new sent to stores, all replicas
    renewals: int           # chunks whose copies were touched again because a commit pending counts on them
    lost: int               # chunks whose copies went before the commit that counted on them (stored again)


class Uploader:
    """Puts encoded chunks on their placement, each digest once (identical chunks wait for the first)."""

    def __init__(self, pool: StorePool) -> None:
        self._pool = pool
        self._cfg = pool.config
        self._placed: dict[str, ChunkEntry] = {}
        self._placing: SingleFlight[str, ChunkEntry] = SingleFlight()
        # Renewal: placed chunks no commit names yet -> the oldest mtime their copies may have (as a
        # point on the pool's ticks); and those found gone, until they are placed again.
        self._since: dict[str, float] = {}
        self._lost: set[str] = set()
        self._renewing = trio.Lock()        # one pass at a time (keep_fresh's, a commit's)
        self._new = self._deduped = self._new_raw = self._stored = self._renewals = self._lost_count = 0

    def statistics(self) -> UploadStats:
        return UploadStats(chunks_new=self._new, chunks_deduped=self._deduped, new_raw_bytes=self._new_raw,
                           stored_bytes=self._stored, renewals=self._renewals, lost=self._lost_count)

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
        self._since.setdefault(enc.digest, -math.inf)   # settled by an earlier commit: due at once
        self._deduped += 1
        return known

    async def _place(self, enc: chunkfmt.EncodedChunk) -> ChunkEntry:
        targets = self._pool.targets(enc.digest)
        try:
            held, new, since = await self._pool.store_chunk(enc, targets, self._cfg.write_quorum)
        except StoreError as e:
            # A target went down during the put: once more, with a spare standing in for it, or the
            # save in hand fails for what the next one no longer meets.
            again = self._pool.retarget(enc.digest, targets, e)
            if again is None:
                raise
            log.warning("chunk %s: %s; storing it on %s instead", enc.digest[:16], e, ", ".join(again))
            held, new, since = await self._pool.store_chunk(enc, again, self._cfg.write_quorum)
        if new:
            self._new += 1
            self._new_raw += enc.raw_len
            self._stored += enc.stored_len * len(held)
        else:
            self._deduped += 1
        entry = ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held), enc.blocks)
        self._placed[enc.digest] = entry
        self._since[enc.digest] = self._pool.ticks() - max(0.0, self._pool.clock() - since)   # on ticks
        self._lost.discard(enc.digest)
        return entry

    # ------------------------------------------------------------------ renewal (see the module doc)

    async def keep_fresh(self) -> None:
        """Renew what is due every RENEW_EVERY of gc_grace, until cancelled (the file's close). The interval
        counts on the pool's ticks, looked at every TICKS_WATCH: trio's clock stops while the host is
        suspended, and a host that wakes renews at once, not an interval of trio's clock later."""
        every = self._cfg.gc_grace * RENEW_EVERY
        passed = self._pool.ticks()
        while True:
            await trio.sleep(min(every, TICKS_WATCH))
            now = self._pool.ticks()
            if now - passed >= every:
                passed = now
                await self.renew_due()

    async def renew_due(self) -> None:
        """Touch the copies of every chunk not yet named by a commit that may be RENEW_AGE old."""
        async with self._renewing:
            limit = self._pool.ticks() - self._cfg.gc_grace * RENEW_AGE
            due = [d for d, since in self._since.items() if since <= limit]
            if due:
                await in_parallel(self._renew, due, self._cfg.fetch_concurrency)

    async def _renew(self, digest: str) -> None:
        """Renew one chunk's copies. Fewer than write_quorum renewed: if a copy is gone the chunk is
        lost (stored again before the commit); a store that failed is tried again by the next pass."""
        entry = self._placed[digest]
        start = self._pool.ticks()
        renewed, gone = await self._pool.renew(digest, entry.stores)
        if self._placed.get(digest) is not entry or digest not in self._since:
            return  # placed again, or settled, meanwhile
        if len(renewed) >= self._cfg.write_quorum:
            self._since[digest] = start
            self._renewals += 1
        elif gone:
            log.warning("chunk %s: its copies on %s are gone before the commit that counts on it: it will "
                        "be stored again", digest[:16], ", ".join(gone))
            self._forget(digest)

    def _forget(self, digest: str) -> None:
        del self._placed[digest], self._since[digest]
        self._lost.add(digest)
        self._lost_count += 1

    async def unsure(self, digests: Iterable[str]) -> set[str]:
        """Of these chunks, the ones this uploader stored whose copies may be gone or too old: renews
        what is due first; what is still due after that counts as lost. The caller stores them again
        before committing (`store` does, once asked)."""
        await self.renew_due()
        limit = self._pool.ticks() - self._cfg.gc_grace * RENEW_AGE
        wanted = set(digests)
        for d in [d for d in wanted if self._since.get(d, math.inf) <= limit]:
            self._forget(d)
        return self._lost & wanted

    def settled(self, digests: Iterable[str]) -> None:
        """A commit named these chunks: their version references them, renewal ends."""
        for d in digests:
            self._since.pop(d, None)


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
