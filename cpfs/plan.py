"""Prefetch a loader declares: it names the tensors it will read, and they are fetched now.

The readahead scheduler learns what a reader does from its reads, so a rank that loads a slice of a
checkpoint (one pipeline stage, its experts, the model weights without the optimizer state) fetches
each tensor only as its reads arrive. A loader that knows what it will read says so before it reads:

    os.setxattr(path, "user.cpfs.prefetch", b"layers.1.*\\nlayers.2.*\\nembed.weight")

The value is a list of tensor names, one per line (or comma-separated), each matched as a glob
(`fnmatch.fnmatchcase`: `*` spans dots too). The mount then fetches the chunks that hold the matching
tensors, at once and in parallel from every store (fetch_concurrency at a time, each chunk from its
best replica), into the kernel's page cache, so the loader's reads and mmap faults find them there.
- A torch file's tensors are read as whole storages: a match fetches its storage record.
- torch.load reads the zip local header of every storage (also with mmap=True, also of tensors never
  used): a torch plan fetches the small chunks that hold them.
- Every plan fetches the file's head (zip directory and data.pkl, the safetensors header), which every
  loader reads first.
- The kernel caches whole pages: the chunk of a neighbour that shares a page with a matched tensor comes
  too (else reading that page would fetch it then, a round trip later).

The attribute is not stored: setting it starts the plan and returns (EINVAL with a log line if the
file has no tensor index or no tensor matches). Reading it back gives the plan's progress as JSON
(`Plan.statistics()`); removing it stops the plan; setting it again replaces it, and pushes again
what the kernel was given over a second ago and the daemon still holds (the kernel may have dropped it
since; `Plan.run`). It is never listed.
A plan fetches runs of small chunks together (batches of up to chunk_size bytes) and pins at most
fetch_concurrency batches in the daemon's cache at a time: each chunk is released once the kernel
holds its pages, so a plan as large as the checkpoint keeps the daemon's memory bounded. Its chunks
stay cached after that only if the whole declaration fits in the ready read buffers
(`Scheduler._kept`).
While a file's plan stands (done or not, until removed or replaced), its readers prefetch nothing
outside it (`Scheduler.declare`): the declaration replaces the readahead's guesses, which ran past the
declared tensors, and what a loader reads beyond it is fetched on demand.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

import trio

from .errors import CpfsError
from .manifest import Manifest
from .pagecache import PageFeeder
from .readahead import Scheduler, layout_for, page_chunks, zip_header_chunks
from .sync import fan_out
from .tensor_index import TensorIndex

log = logging.getLogger(__name__)

XATTR = "user.cpfs.prefetch"
STALE = 1.0        # seconds: a plan set again pushes again what went to the kernel this long ago (Plan.run)
KEPT = 64          # finished plans whose figures stay readable (the attribute, `cpfs stats`)
THREAD_PATTERNS = 64   # a declaration of more names than this is matched in a worker thread
_GLOB = re.compile(r"[*?\[]")


class PlanError(CpfsError):
    """A prefetch request that names nothing fetchable: bad text, no index, no matching tensor."""
    errno = errno.EINVAL


def parse_patterns(value: bytes) -> tuple[str, ...]:
    """The tensor-name globs of an attribute value (lines or commas; blanks ignored)."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanError("the tensor names are not UTF-8") from None
    patterns = tuple(dict.fromkeys(p.strip() for p in re.split(r"[\n,]", text) if p.strip()))
    if not patterns:
        raise PlanError("no tensor names given")
    return patterns


def matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a name matches any of the globs (as fnmatch.fnmatchcase): plain names by a set, `prefix*`
    (a rank's layers) by a set of prefixes, other globs by one compiled expression. Each name tried
    against each glob in turn cost 1.9 s of the daemon's event loop for 1,000 names of a 5,000-tensor
    checkpoint, and every request of the mount waited (an audit's find)."""
    plain = {p for p in patterns if not _GLOB.search(p)}
    prefixes = {p[:-1] for p in patterns if p.endswith("*") and not _GLOB.search(p[:-1])}
    globs = [p for p in patterns if p not in plain and p[:-1] not in prefixes]
    rx = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in globs)) if globs else None

    def match(name: str) -> bool:
        return name in plain or (bool(prefixes) and any(name[:k] in prefixes for k in range(len(name) + 1))) \
            or (rx is not None and rx.match(name) is not None)
    return match


def shown(patterns: tuple[str, ...], most: int = 16, width: int = 120) -> list[str]:
    """The patterns as figures and log lines show them: the first `most`, each cut at `width`, and how
    many more."""
    out = [p if len(p) <= width else p[:width] + "..." for p in patterns[:most]]
    return out + ([f"(and {len(patterns) - most} more)"] if len(patterns) > most else [])


def chunks_for(manifest: Manifest, index: TensorIndex | None, patterns: tuple[str, ...]) -> tuple[list[int], int]:
    """(chunk indices in loader order, tensors matched): the head, each matched tensor's bytes (a torch
    tensor's whole storage record) and, in a torch file, the chunks of the zip headers."""
    if index is None:
        raise PlanError(f"{manifest.path}: no tensor index (not a torch or safetensors checkpoint)")
    match = matcher(patterns)
    matched = [t for t in index.tensors if match(t.name)]
    if not matched:
        raise PlanError(f"{manifest.path}: no tensor matches {', '.join(shown(patterns))}")
    layout = layout_for(manifest, index)
    wanted: set[int] = set(layout.head)
    if index.format == "torch-zip":
        records = {r.name.rsplit("/", 1)[-1]: r for r in index.records if "/data/" in r.name}
        spans = {(r.offset, r.length) for t in matched if (r := records.get(t.storage_key)) is not None}
    else:
        spans = {(t.offset, t.length) for t in matched}
    for offset, length in spans:
        wanted.update(page_chunks(manifest, offset, length))
    wanted.update(zip_header_chunks(manifest, index, layout))
    return [i for i in layout.plan if i in wanted], len(matched)


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    path: str
    patterns: tuple[str, ...]   # as `shown`: an echo of a long declaration made the attribute unreadable (E2BIG)
    tensors: int            # tensors the patterns matched
    chunks: int             # chunks that hold them (and the head)
    bytes: int
    fetched_chunks: int     # fetched by the plan (or found in the daemon's cache)
    fetched_bytes: int
    in_kernel_chunks: int   # already with the kernel when the plan reached them
    pushed_again_chunks: int  # pushed long enough ago that the kernel may have dropped them: pushed again
    failed_chunks: int      # no replica could be read (logged; a read of them reports the error)
    done: bool
    seconds: float          # since the plan started (until it ended, once done)
    learned_from: str | None = None     # a plan learned from an earlier load of this path (cpfs/learned.py)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()


class Plan:
    """One prefetch of one version of a file, declared (`Plan.declared`) or learned from an earlier load
    (cpfs/learned.py). `run` in a nursery that outlives the request (`Board.start`, `Learner.landed`)."""

    def __init__(self, sched: Scheduler, inode: int, manifest: Manifest, chunks: list[int], *, tensors: int,
                 patterns: tuple[str, ...], learned_from: str | None = None) -> None:
        self.sched = sched
        self.inode = inode
        self.m = manifest
        self.patterns = patterns
        self.learned_from = learned_from
        self.chunks, self.tensors = chunks, tensors
        self._bytes = sum(manifest.chunks[i].raw_len for i in self.chunks)
        self.scope = trio.CancelScope()
        self._started = trio.current_time()
        self._ended: float | None = None
        self._fetched = self._fetched_bytes = self._in_kernel = self._again = self._failed = 0

    @classmethod
    async def declared(cls, sched: Scheduler, inode: int, manifest: Manifest, index: TensorIndex | None,
                       patterns: tuple[str, ...]) -> Plan:
        """The plan of a loader's `user.cpfs.prefetch` (PlanError if it names nothing fetchable). Many
        names are matched in a worker thread: thousands of globs take a while (0.8 s for 4,400 against
        5,000 tensors), and the event loop answers every other request of the mount meanwhile."""
        if len(patterns) > THREAD_PATTERNS:
            chunks, tensors = await trio.to_thread.run_sync(chunks_for, manifest, index, patterns)
        else:
            chunks, tensors = chunks_for(manifest, index, patterns)
        return cls(sched, inode, manifest, chunks, tensors=tensors, patterns=patterns)

    def statistics(self) -> PlanStats:
        end = self._ended if self._ended is not None else trio.current_time()
        return PlanStats(
            path=self.m.path, patterns=tuple(shown(self.patterns)), tensors=self.tensors, chunks=len(self.chunks),
            bytes=self._bytes, fetched_chunks=self._fetched,
            fetched_bytes=self._fetched_bytes, in_kernel_chunks=self._in_kernel,
            pushed_again_chunks=self._again, failed_chunks=self._failed,
            done=self._ended is not None, seconds=end - self._started, learned_from=self.learned_from)

    @property
    def done(self) -> bool:
        return self._ended is not None

    def cancel(self) -> None:
        self.scope.cancel()

    async def run(self) -> None:
        """Fetch the chunks in loader order, consecutive ones in batches of up to chunk_size bytes, as
        the readahead's prefetches are: one fetch slot and one request per store for a run of small
        chunks, not a task, a hedged read and a thread hand-off each (a declared torch.load of a whole
        512 MiB checkpoint of 0.5-2 MiB tensors: daemon 0.59-0.77 -> 0.44-0.49 CPU-s, hedges 15-26 ->
        0-5). A batch's chunks are pinned until the kernel holds them (or, without a page-cache
        feeder, until fetched), so at most fetch_concurrency batches, fetch_concurrency x chunk_size
        bytes, are in the daemon at once.
        A chunk pushed before is skipped, unless its push is over STALE old and the daemon still holds
        it (a declaration that fits in the ready read buffers stays cached: `Scheduler._kept`): the
        kernel may have dropped its pages since without a word (this VM's host reclaims untouched
        pages in seconds), and an earlier plan of the same tensors then pushed nothing, so the loader
        faulted each page in on demand. Pushing the cached bytes again costs a copy, no fetch."""
        feeder = self.sched.feeder(self.inode, self.m)
        slots = trio.CapacityLimiter(self.sched.config.fetch_concurrency)
        limit = self.sched.config.chunk_size
        try:
            with self.scope:
                async with trio.open_nursery() as n:
                    batch: list[tuple[int, bool]] = []
                    nbytes = 0
                    for i in self.chunks:
                        again = False
                        if feeder is not None and i in feeder.sent:
                            again = feeder.pushed_over(i, STALE) and self.m.chunks[i].digest in self.sched.cache
                            if not again:
                                self._in_kernel += 1
                                continue
                            self._again += 1
                        size = self.m.chunks[i].raw_len
                        if batch and nbytes + size > limit:
                            await self._start(n, batch, feeder, slots)
                            batch, nbytes = [], 0
                        batch.append((i, again))
                        nbytes += size
                    if batch:
                        await self._start(n, batch, feeder, slots)
        finally:
            self._ended = trio.current_time()
            s = self.statistics()
            log.info("%s: %s prefetch (%s) %s: %d tensors, %d of %d chunks fetched (%.1f MiB), %d already "
                     "with the kernel, %d pushed again, %d failed, %.2f s", self.m.path,
                     "learned" if self.learned_from else "declared",
                     self.learned_from or ", ".join(shown(self.patterns)),
                     "cancelled" if self.scope.cancelled_caught else "done", s.tensors, s.fetched_chunks,
                     s.chunks, s.fetched_bytes / 2**20, s.in_kernel_chunks, s.pushed_again_chunks, s.failed_chunks,
                     s.seconds)

    async def _start(self, n: trio.Nursery, batch: list[tuple[int, bool]], feeder: PageFeeder | None,
                     slots: trio.CapacityLimiter) -> None:
        """Start a batch's fetch once a slot is free; the slot is its until its last chunk landed."""
        token = object()
        await slots.acquire_on_behalf_of(token)
        n.start_soon(self._batch, batch, feeder, slots, token)

    async def _batch(self, batch: list[tuple[int, bool]], feeder: PageFeeder | None,
                     slots: trio.CapacityLimiter, token: object) -> None:
        cache = self.sched.cache
        indices = [i for i, _ in batch]
        left = len(batch)
        handed = trio.Event()                   # every chunk with the kernel (or refused by it), or failed

        def landed(i: int, pinned: bool) -> None:
            nonlocal left
            if pinned:
                cache.unpin(self.m.chunks[i].digest)
            left -= 1
            if left == 0:
                slots.release_on_behalf_of(token)
                handed.set()

        try:
            async with self.sched.limiter:         # shared with the readers' prefetch
                # Pinned if the budget has room, else (the cache is full of readers' pins) not.
                pinned = cache.reserve(sum(self.m.chunks[i].raw_len for i in indices))
                if pinned:
                    got = await self.sched.prefetch_chunks(self.m, indices)
                else:
                    got = (await fan_out(lambda i: self.sched.get_chunk(self.m, i, demand=False), indices,
                                         catch=Exception)).outcomes(indices)
        except Exception as e:                      # not a chunk's failure (those come back in `got`)
            self._failed += len(batch)
            log.warning("%s: the prefetch of chunks %s by its plan failed: %s", self.m.path, indices, e)
            slots.release_on_behalf_of(token)
            return
        except BaseException:                       # cancelled: prefetch_chunks pins nothing then
            slots.release_on_behalf_of(token)
            raise
        for (i, again), data in zip(batch, got):
            if isinstance(data, Exception):         # the pool logged which stores failed and why
                self._failed += 1
                log.debug("%s: prefetch of chunk %d by its plan failed: %s", self.m.path, i, data)
                landed(i, False)
                continue
            self._fetched += 1
            self._fetched_bytes += self.m.chunks[i].raw_len
            if feeder is None:
                landed(i, pinned)
            else:
                feeder.offer(i, data, lambda i=i: landed(i, pinned), again)
        await handed.wait()


class Board:
    """The declared plans that stand, one per file (inode): a new one replaces the file's last, and the newest
    KEPT finished ones stay readable (the attribute, `cpfs stats`). While a plan stands, the file's
    readers prefetch nothing outside it (`Scheduler.declare`)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self._plans: dict[int, Plan] = {}

    def get(self, inode: int) -> Plan | None:
        return self._plans.get(inode)

    def start(self, p: Plan, nursery: trio.Nursery) -> None:
        self.stop(p.inode)
        self.sched.declare(p.inode, p.m, frozenset(p.chunks))
        for ino in [i for i, q in self._plans.items() if q.done][:max(0, len(self._plans) - KEPT)]:
            self.stop(ino)                  # the oldest finished plans go first
        self._plans[p.inode] = p
        nursery.start_soon(p.run)

    def stop(self, inode: int) -> Plan | None:
        """Cancel the file's plan and drop its declaration; the plan, or None if it had none."""
        old = self._plans.pop(inode, None)
        if old is not None:
            old.cancel()
            self.sched.declare(inode, old.m, None)
        return old

    def statistics(self) -> list[PlanStats]:
        return [p.statistics() for p in self._plans.values()]
