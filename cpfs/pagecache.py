"""Feeding the kernel page cache ahead of the reader (FUSE notify_store).

Once a chunk is in the kernel's page cache, the reader's reads (and mmap faults) never reach the
daemon, and the daemon can drop its own copy. But the kernel only marks whole pages valid, and chunk
cuts follow tensor boundaries, not pages. So a chunk's interior pages go to the kernel as soon as the
chunk arrives, and a page that straddles two (or more) chunks goes as soon as every chunk covering it
is at hand. A chunk is dropped from the daemon's cache only when every page it touches is with the
kernel. One `PageFeeder` per version of a file, shared by all its open handles.

The kernel may drop pages it was given (drop_caches, memory pressure, a host reclaiming a VM's cold
pages) without telling us. A read that asks for pages of a chunk whose push completed is the sign.
Once such reads add up to a stretch of the file (STRETCH bytes, each near the last: drop_caches,
fadvise), the feeder forgets every push of the file, so the readahead fetches and pushes again
instead of taking the chunks for the kernel's (the daemon dropped its own copies) and fetching each
on demand, one at a time. A few pages dropped here and there are read on demand, from the blocks
around them when the manifest has block checks (cpfs/chunk.py), else with their chunk: pushing the
rest of the file again for them cost a warm load more than the pages did. The kernel asks for a
page it holds only after dropping it: a read sent before a push of the same pages holds them locked,
and the push (notify_store) waits for the read's reply, so it cannot complete first. So a push counts
from RACE after it completed (a margin, not a measured race: cold loads of 512 MiB with no margin at
all counted no such read), and pages the host takes within the first second are seen as dropped too:
this VM's host pages out untouched file pages (DAMON) while a loader is still on its way to them.

A chunk the readahead holds back to see the reader arrive (a stream's mark, cpfs/readahead.py) may be
*gated*: its interior goes to the kernel but for its first page, the gate, which alone waits for the
reader. Held whole, the chunk was pushed only when the reader's read reached it, and the reader's next
page faults outran that push: each asked the daemon for the pages not yet there (a cold
`torch.load(mmap=True)` of 512 MiB of 0.5-2 MiB tensors: ~6 more FUSE reads per held chunk, 530-600 in
all; gated, 230-330).

Pushes are submitted, not awaited: `push` queues a piece and calls back when the kernel has it (the
Pusher below sends queued pieces from worker threads, many per thread call). A task and an event
per piece cost a load of 0.5-2 MiB tensors more of the daemon's CPU than the page-cache copies did.
"""
from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import pyfuse3
import trio

from .cache import ChunkCache
from .manifest import Manifest

log = logging.getLogger(__name__)

PAGE = 4096
RACE = 0.05     # seconds after a push completes from which a read of its pages means they were dropped
STRETCH = 1 << 20  # lost reads adding up to this, each near the last: the kernel dropped a stretch
GATED_MIN = 3      # whole pages a chunk needs to be gated (`PageFeeder.offer`): its gate and two more
Done = Callable[[OSError | None], None]
# push(inode, file offset, data, done): queue a piece for the kernel page cache; done(None) once it is
# there, done(error) if the kernel refused it; called on the event loop's thread, maybe at once.
Push = Callable[[int, int, bytes | memoryview, Done], None]
# replied(inode, lo, hi): a read of the file's whole pages [lo, hi) is being answered into the page
# cache, so pushes of them still queued may leave them out (Pusher.replied).
Replied = Callable[[int, int, int], None]


class PageFeeder:
    def __init__(self, manifest: Manifest, inode: int, push: Push, cache: ChunkCache,
                 on_reply: Replied | None = None) -> None:
        self.m = manifest
        self.inode = inode
        self.push = push
        self.on_reply = on_reply
        self.cache = cache
        self.sent: set[int] = set()          # chunks whose interior is pushed or being pushed
        self.done: set[int] = set()          # ... and has been pushed
        self.pages_sent: set[int] = set()    # straddling pages pushed or being pushed
        self.gated: dict[int, _Gate] = {}    # chunks pushed but for their first page (`offer(gate=True)`)
        self.pages_done: set[int] = set()
        self.pushes = 0
        self.drops = 0                       # times the kernel was found to have dropped pushed pages
        self.done_at: dict[int, float] = {}  # chunk -> when its interior's push completed
        self.first_done_at: dict[int, float] = {}    # ... the first time (`forget` keeps it)
        self._lost_span = (0, 0)             # file range of the reads of dropped pages lately seen ...
        self._lost_bytes = 0                 # ... and how many bytes they asked for
        # Chunks a loader declared (cpfs/plan.py) stay in the daemon's cache once the kernel has them,
        # as ordinary entries the budget evicts: this VM's host reclaims a few pushed pages within
        # seconds, and each page the loader then faults in would cost a whole chunk's fetch (a
        # declared safetensors stage fetched 1.2x what it read, or 1.6x when ~50 pages of 28,000 went).
        # Only a declaration that fits in the ready read buffers is kept (Scheduler._kept).
        self.keep: frozenset[int] = frozenset()
        self.retired = False                 # the file's pages are another version's now: push nothing

    def _interior(self, i: int) -> tuple[int, int]:
        """The whole pages of chunk i (the last page of the file counts as whole)."""
        start, end = self.m.offsets[i], self.m.offsets[i + 1]
        lo = -(-start // PAGE) * PAGE
        hi = end if end == self.m.size else end - end % PAGE
        return lo, max(lo, hi)

    def _edges(self, i: int) -> set[int]:
        """Page numbers chunk i touches but does not fill."""
        start, end = self.m.offsets[i], self.m.offsets[i + 1]
        lo, hi = self._interior(i)
        pages = set()
        if start < lo or lo == hi:
            pages.add(start // PAGE)
        if hi < end:
            pages.add((end - 1) // PAGE)
        return pages

    def offer(self, i: int, data: bytes | memoryview, on_sent: Callable[[], None] | None = None,
              again: bool = False, gate: bool = False) -> None:
        """Chunk i's bytes are here: push its interior once, and every straddling page it completes.
        `on_sent` runs once the interior is with the kernel (at once if another open pushed it).
        `again`: push them even if they were pushed before (the kernel may have dropped them since).
        `gate`: push the interior but for its first page, which a later offer of i pushes; i is not
        `sent` until then. A chunk of fewer than GATED_MIN whole pages is held whole, its straddling
        pages too: one without a whole page would else never be read through the daemon."""
        if again:
            self.sent.discard(i)
            self.gated.pop(i, None)
            self.pages_sent -= self._edges(i)
        if i not in self.sent:
            lo, hi = self._interior(i)
            view = memoryview(data)[lo - self.m.offsets[i]:hi - self.m.offsets[i]]
            if gate:
                if hi - lo < GATED_MIN * PAGE:
                    return
                if i not in self.gated:
                    g = self.gated[i] = _Gate()
                    self._send(lo + PAGE, view[PAGE:], g.tail_landed)
            else:
                self.sent.add(i)
                g = self.gated.pop(i, None)

                def landed(error: OSError | None) -> None:
                    self._interior_sent(i, error, on_sent)
                if g is None:
                    self._send(lo, view, landed)
                else:
                    self._send(lo, view[:PAGE], g.join(landed))
        elif on_sent is not None:
            on_sent()
        for page in self._edges(i) - self.pages_sent:
            piece = self._assemble(page, i, data)
            if piece is not None:
                self.pages_sent.add(page)
                self._send(page * PAGE, piece, lambda error, page=page: self._page_sent(page, error))

    def _assemble(self, page: int, i: int, data: bytes | memoryview) -> bytes | None:
        """The page's bytes from the chunks covering it, if all are at hand."""
        lo, hi = page * PAGE, min((page + 1) * PAGE, self.m.size)
        parts = []
        for j in self.m.chunk_range(lo, hi - lo):
            chunk = data if j == i else self.cache.peek(self.m.chunks[j].digest, self.m.chunks[j].raw_len)
            if chunk is None:
                return None
            start = self.m.offsets[j]
            parts.append(memoryview(chunk)[max(lo, start) - start:min(hi, self.m.offsets[j + 1]) - start])
        return b"".join(parts)

    def retire(self) -> None:
        """Push nothing from now on: the file is being written, and the kernel caches the written bytes
        in its pages (Scheduler.writing). Pushes already queued are the Pusher's to withdraw. Refused
        pushes leave the chunks to reads through the daemon, as a kernel without notify_store does."""
        self.retired = True

    def _send(self, offset: int, data: bytes | memoryview, done: Done) -> None:
        if self.retired:
            done(OSError(errno.ESTALE, f"{self.m.path} is being written: version {self.m.version} is not pushed"))
            return
        if not len(data):
            done(None)
            return

        def landed(error: OSError | None) -> None:
            if error is None:
                self.pushes += 1
            else:
                log.debug("page cache push of %s at %d failed: %s", self.m.path, offset, error)
            done(error)

        self.push(self.inode, offset, data, landed)

    def _interior_sent(self, i: int, error: OSError | None, on_sent: Callable[[], None] | None) -> None:
        if on_sent is not None:
            on_sent()
        if error is not None:
            return                          # refused: the reader asks us
        self.done.add(i)
        self.done_at[i] = trio.current_time()
        self.first_done_at.setdefault(i, self.done_at[i])
        self._release(i)

    def _page_sent(self, page: int, error: OSError | None) -> None:
        if error is not None:
            return
        self.pages_done.add(page)
        for j in self.m.chunk_range(page * PAGE, PAGE):
            self._release(j)

    def replied(self, offset: int, end: int) -> None:
        """A buffered read of [offset, end) is being answered: the kernel caches its whole pages from
        the reply (the last page of the file counts as whole)."""
        lo = -(-offset // PAGE) * PAGE
        hi = end if end == self.m.size else end - end % PAGE
        if self.on_reply is not None and lo < hi:
            self.on_reply(self.inode, lo, hi)

    def lost(self, offset: int, end: int, ever: bool = False) -> bool:
        """Whether a read of [offset, end) asks the daemon for pages whose push completed: the kernel
        dropped them (it never asks for pages it holds). With `ever`, also pages pushed before a
        `forget` (the daemon then stops counting on them, the reader's statistics do not)."""
        for j in self.m.chunk_range(offset, end - offset):
            if self.lost_chunk(j, ever):
                lo, hi = self._interior(j)
                if offset < hi and lo < end:
                    return True
        return False

    def lost_chunk(self, i: int, ever: bool = False) -> bool:
        """Whether the kernel was given chunk i's interior over RACE ago: a read of it now means the
        kernel dropped some of those pages (FileReader.read then fetches just the blocks around them)."""
        return self.pushed_over(i, RACE, ever)

    def pushed_over(self, i: int, seconds: float, ever: bool = False) -> bool:
        """Whether chunk i's interior went to the kernel at least `seconds` ago (`ever`: also before a
        `forget`); False if it never went."""
        at = (self.first_done_at if ever else self.done_at).get(i)
        return at is not None and trio.current_time() - at >= seconds

    def dropped_stretch(self, offset: int, end: int) -> bool:
        """Count a read that `lost` flagged; whether the reads of dropped pages, each within STRETCH
        of the ones before, now add up to STRETCH bytes: the kernel dropped a stretch of the file, not
        a few pages here and there."""
        lo, hi = self._lost_span
        if self._lost_bytes and lo - STRETCH <= offset <= hi + STRETCH:
            self._lost_span = (min(lo, offset), max(hi, end))
            self._lost_bytes += end - offset
        else:
            self._lost_span, self._lost_bytes = (offset, end), end - offset
        return self._lost_bytes >= STRETCH

    def forget(self) -> None:
        """Take none of this file's pages for the kernel's any more (see the module doc)."""
        self._lost_span, self._lost_bytes = (0, 0), 0
        self.sent.clear()
        self.gated.clear()
        self.done.clear()
        self.pages_sent.clear()
        self.pages_done.clear()
        self.done_at.clear()
        self.drops += 1

    def holds(self, i: int) -> bool:
        """Whether the kernel has every page chunk i touches."""
        return i in self.done and self._edges(i) <= self.pages_done

    def _release(self, i: int) -> None:
        if self.holds(i) and i not in self.keep:
            self.cache.discard(self.m.chunks[i].digest)


class _Gate:
    """A gated chunk (`PageFeeder.offer`): its interior but the first page is on its way to the kernel
    or there; the interior counts as pushed once the first page is too."""
    __slots__ = ("tail_done", "tail_error", "then")

    def __init__(self) -> None:
        self.tail_done = False
        self.tail_error: OSError | None = None
        self.then: Callable[[], None] | None = None     # the first page landed: waiting for the rest

    def tail_landed(self, error: OSError | None) -> None:
        self.tail_done, self.tail_error = True, error
        if self.then is not None:
            self.then()

    def join(self, done: Done) -> Done:
        """The first page's completion: `done` once both parts landed, with the first error of the two."""
        def landed(error: OSError | None) -> None:
            def finish() -> None:
                done(error or self.tail_error)
            if self.tail_done:
                finish()
            else:
                self.then = finish
        return landed


Span = tuple[int, memoryview]          # (file offset, bytes) of a push still to send


def without(spans: tuple[Span, ...], lo: int, hi: int) -> tuple[Span, ...]:
    """`spans` less the file range [lo, hi) (whole pages: the ends of a read the kernel caches)."""
    kept: list[Span] = []
    for offset, data in spans:
        end = offset + len(data)
        if end <= lo or hi <= offset:
            kept.append((offset, data))
            continue
        if offset < lo:
            kept.append((offset, data[:lo - offset]))
        if hi < end:
            kept.append((hi, data[hi - offset:]))
    return tuple(kept)


class _Piece:
    """One page-cache push: where and what (`spans`, which a read answered meanwhile may shrink), and
    whom to tell how it went."""
    __slots__ = ("inode", "offset", "size", "spans", "done", "error", "sent", "withdrawn")

    def __init__(self, inode: int, offset: int, data: bytes | memoryview, done: Done) -> None:
        self.inode, self.offset, self.size, self.done = inode, offset, len(data), done
        self.spans: tuple[Span, ...] = ((offset, memoryview(data)),)
        self.error: OSError | None = None
        self.sent = 0                     # bytes the kernel was given
        self.withdrawn = False            # Pusher.withdraw: refused, whatever a thread sent before


def _store_pieces(notify: Callable[[int, int, bytes | memoryview], None], pieces: list[_Piece]) -> None:
    """notify_store every piece, in a worker thread; each keeps its own error. A piece's spans are
    read once: the event loop may replace them (`Pusher.replied`) while this thread works."""
    for p in pieces:
        try:
            for offset, data in p.spans:
                notify(p.inode, offset, data)
                p.sent += len(data)
        except OSError as e:
            p.error = e


@dataclass(frozen=True, kw_only=True)
class PushStats:
    pieces: int           # pushes asked for
    thread_calls: int     # worker-thread calls that made them
    failed: int           # pushes the kernel refused (the reader then reads through the daemon)
    bytes: int            # bytes the kernel was given
    replied_bytes: int    # bytes of pieces left out because a read's reply gave them to the kernel first


class Pusher:
    """The on_chunk callback (pagecache.Push): stores chunks in the kernel page cache from worker
    threads. Never from the event loop: the kernel may wait for a page lock that one of our replies
    releases. `push` only queues the piece (a memory channel); `run` owns `threads` sender tasks, each
    taking everything queued into one thread call (a chunk's interior and the pages it completes, the
    chunks that landed meanwhile), then telling each piece's `done`. `notify` is pyfuse3.notify_store
    (tests pass a recorder). A kernel without notify_store disables it: every push is refused (ENOSYS),
    so the reader's reads come to the daemon, which keeps the chunks for them.

    A cold load outruns the pushes: the kernel's readahead asks the daemon for pages whose push is
    still queued (a sixth of the bytes of a 512 MiB load, measured), and the reply puts them in the page
    cache. `replied` takes those pages out of the queued pieces, so the kernel is not given them twice;
    a piece a thread has already taken goes whole. Should a reply not reach the page cache after all
    (its request interrupted, O_DIRECT set with fcntl after the open), the kernel asks again for those
    pages, and the reader serves them as pages the kernel dropped: a fetch, never wrong bytes."""

    def __init__(self, threads: int = 2,
                 notify: Callable[[int, int, bytes | memoryview], None] = pyfuse3.notify_store) -> None:
        self.threads = threads
        self.notify = notify
        self.disabled = False
        self._inbox, self._queue = trio.open_memory_channel[_Piece](math.inf)
        self._queued: dict[int, dict[_Piece, None]] = {}     # inode -> its pieces not yet done
        self._drained: dict[int, trio.Event] = {}            # inode -> set once none is (`withdraw`)
        self._pieces = self._calls = self._failed = self._bytes = self._replied = 0

    def statistics(self) -> PushStats:
        return PushStats(pieces=self._pieces, thread_calls=self._calls, failed=self._failed,
                         bytes=self._bytes, replied_bytes=self._replied)

    def __call__(self, inode: int, offset: int, data: bytes | memoryview, done: Done) -> None:
        self._pieces += 1
        if self.disabled:
            self._failed += 1
            done(OSError(errno.ENOSYS, "notify_store is not supported by this kernel"))
            return
        piece = _Piece(inode, offset, data, done)
        self._queued.setdefault(inode, {})[piece] = None
        self._inbox.send_nowait(piece)

    def replied(self, inode: int, lo: int, hi: int) -> None:
        """A read of the file's whole pages [lo, hi) is being answered into the page cache: push them
        no more (a thread that took a piece already pushes what it took)."""
        for p in self._queued.get(inode, ()):
            if p.offset < hi and lo < p.offset + p.size:
                p.spans = without(p.spans, lo, hi)

    async def withdraw(self, inode: int) -> None:
        """No piece of the file pushed so far reaches the kernel once this returns: those still queued
        are sent empty and refused (ESTALE), and a thread call that took one before is waited for. A
        write of the file is about to change its pages (cpfs/fs.py: a write session begins): a push of
        the version read before, landing after the write, would put the old bytes back over it."""
        queued = self._queued.get(inode)
        if not queued:
            return
        for p in queued:
            p.withdrawn = True
            p.spans = ()
        await self._drained.setdefault(inode, trio.Event()).wait()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The sender tasks, until cancelled (with the mount)."""
        async with trio.open_nursery() as n:
            for _ in range(self.threads):
                n.start_soon(self._sender)
            task_status.started()

    async def _sender(self) -> None:
        async for first in self._queue:
            batch = [first]
            while True:
                try:
                    batch.append(self._queue.receive_nowait())
                except trio.WouldBlock:
                    break
            self._calls += 1
            await trio.to_thread.run_sync(_store_pieces, self.notify, batch)
            for p in batch:
                queued = self._queued[p.inode]
                del queued[p]
                if not queued:
                    del self._queued[p.inode]
                    if (drained := self._drained.pop(p.inode, None)) is not None:
                        drained.set()
                self._bytes += p.sent
                if p.withdrawn:
                    p.error = OSError(errno.ESTALE, "withdrawn: the file is being written")
                elif p.error is None:
                    self._replied += p.size - p.sent
                if p.error is not None and not p.withdrawn:
                    self._failed += 1
                    if p.error.errno == errno.ENOSYS and not self.disabled:
                        log.warning("kernel does not support notify_store; page cache push disabled")
                        self.disabled = True
                try:
                    p.done(p.error)
                except Exception:         # a bug in a callback must not end the mount's pushes
                    log.exception("page cache push at %d: completion failed", p.offset)
