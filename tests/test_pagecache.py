"""The page-cache feeder: whole pages only, each once, straddling pages once all their chunks are here."""
from __future__ import annotations

import random

import trio
import trio.testing

from cpfs.cache import ChunkCache
from cpfs.chunk import chunk_hash
from cpfs.manifest import ChunkEntry, Manifest
from cpfs.pagecache import PAGE, RACE, STRETCH, PageFeeder


def layout(seed: int) -> tuple[Manifest, bytes]:
    """A file with chunk cuts anywhere: tiny chunks inside one page, chunks across pages, an odd EOF."""
    rng = random.Random(seed)
    size = rng.randrange(20 * PAGE, 40 * PAGE)
    cuts = sorted({rng.randrange(1, size) for _ in range(12)} | {PAGE * 5, PAGE * 5 + 10, PAGE * 5 + 20})
    data = rng.randbytes(size)
    bounds = [0, *cuts, size]
    chunks = tuple(ChunkEntry(chunk_hash(data[a:b]), b - a, b - a, "raw", ("s",)) for a, b in zip(bounds, bounds[1:]))
    return Manifest("/f", size, 0, 0o644, PAGE * 4, chunks, 1), data


async def test_every_page_pushed_once_whole_and_chunks_dropped_when_held():
    for seed in range(20):
        m, data = layout(seed)
        pushes: list[tuple[int, bytes]] = []

        def push(inode: int, offset: int, piece, done) -> None:
            def land() -> None:               # on the next turn of the loop, as the daemon's do
                pushes.append((offset, bytes(piece)))
                done(None)
            trio.lowlevel.current_trio_token().run_sync_soon(land)

        cache = ChunkCache(1 << 30)
        feeder = PageFeeder(m, 7, push, cache)
        order = list(range(len(m.chunks)))
        random.Random(seed).shuffle(order)
        for i in order:
            piece = data[m.offsets[i]:m.offsets[i + 1]]
            await cache.get(m.chunks[i].digest, len(piece), lambda p=piece: _ret(p))
            feeder.offer(i, piece)
            await trio.sleep(0)
        await trio.testing.wait_all_tasks_blocked()   # the last pushes land (run_sync_soon wakes the loop)
        kernel = bytearray(len(data))
        covered = [0] * (-(-len(data) // PAGE))
        for offset, piece in pushes:
            assert offset % PAGE == 0, "pushes start on a page"
            assert len(piece) % PAGE == 0 or offset + len(piece) == len(data), "and cover whole pages"
            kernel[offset:offset + len(piece)] = piece
            for p in range(offset // PAGE, -(-(offset + len(piece)) // PAGE)):
                covered[p] += 1
        assert covered == [1] * len(covered), f"seed {seed}: every page exactly once"
        assert bytes(kernel) == data
        assert all(feeder.holds(i) for i in range(len(m.chunks)))
        assert cache.statistics().used == 0, "every chunk dropped once the kernel holds all its pages"


async def _ret(piece: bytes) -> bytes:
    return piece


async def test_straddling_page_waits_for_its_other_chunk():
    m, data = layout(3)
    pushes: list[int] = []

    def push(inode: int, offset: int, piece, done) -> None:
        pushes.append(offset)
        done(None)

    cache = ChunkCache(1 << 30)
    feeder = PageFeeder(m, 1, push, cache)
    i = next(k for k in range(1, len(m.chunks)) if m.offsets[k] % PAGE)   # a chunk starting mid-page
    feeder.offer(i, data[m.offsets[i]:m.offsets[i + 1]])
    assert m.offsets[i] // PAGE * PAGE not in pushes        # its first page needs chunk i-1 too
    assert not feeder.holds(i)


async def test_a_gated_chunk_goes_but_for_its_first_page_which_waits_for_the_next_offer():
    """A held chunk gated (a stream's mark): the kernel gets its interior less the first page at once,
    the chunk counts as sent only when that page follows, and as pushed (dropped from the cache, on_sent
    run) once both parts landed, in either order. A push `again` sends it whole."""
    m, data = layout(5)
    big = max(range(len(m.chunks)), key=lambda i: m.chunks[i].raw_len)
    piece = data[m.offsets[big]:m.offsets[big + 1]]
    for tail_first in (True, False):
        cache = ChunkCache(1 << 30)
        for i in range(len(m.chunks)):                 # its neighbours too, for the straddling pages
            got = data[m.offsets[i]:m.offsets[i + 1]]
            await cache.get(m.chunks[i].digest, len(got), lambda got=got: _ret(got))
        queued: list[tuple[int, bytes, object]] = []

        def push(inode: int, offset: int, got, done) -> None:
            queued.append((offset, bytes(got), done))

        feeder = PageFeeder(m, 1, push, cache)
        lo, hi = feeder._interior(big)
        assert hi - lo >= 4 * PAGE
        feeder.offer(big, piece, gate=True)
        interior = [(o, d) for o, d, _ in queued if lo <= o < hi]
        assert interior == [(lo + PAGE, data[lo + PAGE:hi])]
        assert big not in feeder.sent and not feeder.holds(big)
        feeder.offer(big, piece, gate=True)            # gated already: nothing more
        assert len([o for o, _, _ in queued if lo <= o < hi]) == 1
        sent: list[int] = []
        feeder.offer(big, piece, lambda: sent.append(big))
        assert big in feeder.sent
        gate = [(o, d) for o, d, _ in queued if lo <= o < hi][1]
        assert gate == (lo, data[lo:lo + PAGE])
        tail_done = next(done for o, _, done in queued if o == lo + PAGE)
        gate_done = next(done for o, _, done in queued if o == lo)
        first, second = (tail_done, gate_done) if tail_first else (gate_done, tail_done)
        first(None)
        assert sent == [] and big not in feeder.done
        second(None)
        assert sent == [big] and big in feeder.done
        for o, _, done in queued:
            if not lo <= o < hi:
                done(None)                             # the straddling pages
        assert feeder.holds(big) and cache.peek(m.chunks[big].digest, m.chunks[big].raw_len) is None
        queued.clear()
        feeder.offer(big, piece, again=True)
        assert [(o, d) for o, d, _ in queued if lo <= o < hi] == [(lo, data[lo:hi])]
    small = next(i for i in range(len(m.chunks)) if 0 < m.chunks[i].raw_len < 3 * PAGE)
    full = ChunkCache(1 << 30)                          # its neighbours at hand: its straddling pages could go
    for i in range(len(m.chunks)):
        got = data[m.offsets[i]:m.offsets[i + 1]]
        await full.get(m.chunks[i].digest, len(got), lambda got=got: _ret(got))
    queued.clear()
    PageFeeder(m, 1, push, full).offer(small, data[m.offsets[small]:m.offsets[small + 1]], gate=True)
    slo, shi = feeder._interior(small)
    assert not [o for o, _, _ in queued if slo <= o < max(shi, slo + 1)], "too small to gate: held whole"
    # ... its straddling pages too: a chunk without a whole page would else never be read through us
    assert queued == []


async def test_a_gated_chunks_failed_part_leaves_it_with_the_daemon():
    import errno

    m, data = layout(5)
    big = max(range(len(m.chunks)), key=lambda i: m.chunks[i].raw_len)
    piece = data[m.offsets[big]:m.offsets[big + 1]]
    cache = ChunkCache(1 << 30)
    await cache.get(m.chunks[big].digest, len(piece), lambda: _ret(piece))

    def push(inode: int, offset: int, got, done) -> None:
        done(OSError(errno.EIO, "refused") if offset == lo + PAGE else None)

    feeder = PageFeeder(m, 1, push, cache)
    lo, _ = feeder._interior(big)
    feeder.offer(big, piece, gate=True)
    sent: list[int] = []
    feeder.offer(big, piece, lambda: sent.append(big))
    assert sent == [big] and big not in feeder.done and cache.peek(m.chunks[big].digest, m.chunks[big].raw_len) is not None


async def test_a_refused_push_leaves_the_chunk_with_the_daemon_for_the_reader(autojump_clock):
    """The kernel refused the pages (or has no notify_store): the chunk is not taken for the kernel's,
    so the cache keeps it and its reads are not taken for dropped pages; `on_sent` still runs."""
    import errno

    m, data = layout(3)
    big = max(range(len(m.chunks)), key=lambda i: m.chunks[i].raw_len)
    piece = data[m.offsets[big]:m.offsets[big + 1]]
    cache = ChunkCache(1 << 30)
    await cache.get(m.chunks[big].digest, len(piece), lambda: _ret(piece))
    asked: list[int] = []

    def refuse(inode: int, offset: int, data, done) -> None:
        asked.append(offset)
        done(OSError(errno.EIO, "refused"))

    feeder = PageFeeder(m, 7, refuse, cache)
    sent: list[int] = []
    feeder.offer(big, piece, lambda: sent.append(big))
    assert asked and sent == [big]
    assert big not in feeder.done and not feeder.holds(big) and feeder.pushes == 0
    assert cache.peek(m.chunks[big].digest, m.chunks[big].raw_len) is not None
    await trio.sleep(RACE)
    lo, hi = feeder._interior(big)
    assert not feeder.lost(lo, hi), "a read of refused pages is an ordinary read"


# ---------------------------------------------------------------------------------------------------
# the daemon's pusher: notify_store from worker threads, pushes that queue up sent in one thread call

async def test_pushes_that_queue_up_go_in_one_thread_call_and_errors_reach_their_pusher():
    import errno
    import threading

    import trio.testing

    from cpfs.pagecache import Pusher

    stored: list[int] = []
    release = threading.Event()

    def notify(inode: int, offset: int, data) -> None:
        if offset == 0:
            release.wait(10)              # the first push holds the only thread while the others queue
        if offset == 3 * PAGE:
            raise OSError(errno.EIO, "no")
        stored.append(offset)

    push = Pusher(threads=1, notify=notify)
    outcomes: dict[int, int | None] = {}
    all_done = trio.Event()

    def done_for(offset: int):
        def done(error: OSError | None) -> None:
            outcomes[offset] = None if error is None else error.errno
            if len(outcomes) == 5:
                all_done.set()
        return done

    async with trio.open_nursery() as n:
        await n.start(push.run)
        push(1, 0, b"x" * PAGE, done_for(0))
        await trio.testing.wait_all_tasks_blocked()
        for k in range(1, 5):
            push(1, k * PAGE, b"x" * PAGE, done_for(k * PAGE))
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        with trio.fail_after(10):
            await all_done.wait()
        n.cancel_scope.cancel()
    # The first push went alone; the four that queued behind it in one call, each with its own outcome.
    assert sorted(stored) == [0, PAGE, 2 * PAGE, 4 * PAGE]
    assert outcomes == {0: None, PAGE: None, 2 * PAGE: None, 3 * PAGE: errno.EIO, 4 * PAGE: None}
    assert push.statistics().pieces == 5 and push.statistics().thread_calls == 2
    assert push.statistics().failed == 1


async def test_a_kernel_without_notify_store_disables_the_pusher_and_refuses_every_push():
    """The mount works without it: a refused push leaves the chunk with the daemon for the reader."""
    import errno

    from cpfs.pagecache import Pusher

    calls: list[int] = []

    def notify(inode: int, offset: int, data) -> None:
        calls.append(offset)
        raise OSError(errno.ENOSYS, "not supported")

    push = Pusher(threads=2, notify=notify)
    errors: list[int] = []
    first = trio.Event()

    def done(error: OSError | None) -> None:
        assert error is not None
        errors.append(error.errno)
        first.set()

    async with trio.open_nursery() as n:
        await n.start(push.run)
        push(1, 0, b"x", done)
        with trio.fail_after(10):
            await first.wait()
        push(1, PAGE, b"x", done)         # refused at once: no more thread calls
        n.cancel_scope.cancel()
    assert calls == [0] and errors == [errno.ENOSYS, errno.ENOSYS] and push.disabled


async def test_a_read_of_pushed_pages_means_the_kernel_dropped_them_and_everything_is_pushed_again(autojump_clock):
    """drop_caches (or memory pressure) empties the kernel's page cache without telling the daemon: a
    read that reaches the daemon for pages it pushed shows it, and the feeder forgets its pushes."""
    m, data = layout(3)
    pushes: list[int] = []

    def push(inode: int, offset: int, piece, done) -> None:
        pushes.append(offset)
        done(None)

    feeder = PageFeeder(m, 7, push, ChunkCache(1 << 30))
    big = max(range(len(m.chunks)), key=lambda i: m.chunks[i].raw_len)
    lo, hi = feeder._interior(big)
    assert hi - lo >= PAGE
    feeder.offer(big, data[m.offsets[big]:m.offsets[big + 1]])
    assert pushes == [lo] and big in feeder.done
    other = next(i for i in range(len(m.chunks)) if i != big and feeder._interior(i)[1] > feeder._interior(i)[0])
    assert not feeder.lost(*feeder._interior(other))          # never pushed: an ordinary read
    assert not feeder.lost(lo, lo + PAGE)                      # just pushed: the read may predate it
    await trio.sleep(RACE)
    assert feeder.lost(lo, lo + PAGE)                          # pushed a while ago, and asked for again
    feeder.forget()
    assert not feeder.lost(lo, lo + PAGE) and big not in feeder.sent and feeder.drops == 1
    assert feeder.lost(lo, lo + PAGE, ever=True)               # the reader's statistics still count it
    assert not feeder.lost(*feeder._interior(other), ever=True)
    feeder.offer(big, data[m.offsets[big]:m.offsets[big + 1]])
    assert pushes == [lo, lo]                                  # pushed again


def test_reads_of_dropped_pages_mean_a_dropped_stretch_once_they_add_up_nearby():
    """A few pages dropped here and there are fetched with their chunks; reads of dropped pages adding
    up to STRETCH, each near the last, mean the kernel dropped a stretch (then the file is pushed again)."""
    m, data = layout(3)
    feeder = PageFeeder(m, 7, _noop_push, ChunkCache(1 << 30))
    assert not feeder.dropped_stretch(0, 4096)
    assert not feeder.dropped_stretch(50 * STRETCH, 50 * STRETCH + 8192)   # far away: a new run
    step = 128 * 1024
    starts = range(50 * STRETCH + 8192, 50 * STRETCH + 8192 + STRETCH, step)
    assert [feeder.dropped_stretch(o, o + step) for o in starts][-2:] == [False, True]
    feeder.forget()
    assert not feeder.dropped_stretch(0, step)                              # counting starts again


def _noop_push(inode: int, offset: int, piece, done) -> None:
    pass


async def test_a_read_answered_while_its_pages_wait_in_the_queue_takes_them_out_of_the_push():
    """The kernel's readahead outruns the pushes on a cold load; the reply puts the pages it asked for
    in the page cache, so the queued push of them gives the kernel only the rest."""
    import threading

    from cpfs.pagecache import Pusher, without

    data = bytes(range(256)) * (12 * PAGE // 256)
    stored: list[tuple[int, int, bytes]] = []
    entered, release = threading.Event(), threading.Event()

    def notify(inode: int, offset: int, piece) -> None:
        if (inode, offset) == (1, 0):
            entered.set()
            release.wait(10)              # the first piece holds the only thread while the others queue
        stored.append((inode, offset, bytes(piece)))

    push = Pusher(threads=1, notify=notify)
    landed: list[OSError | None] = []
    async with trio.open_nursery() as n:
        await n.start(push.run)
        push(1, 0, data[:4 * PAGE], landed.append)
        await trio.to_thread.run_sync(entered.wait, 10)        # taken: it goes whole
        push(1, 4 * PAGE, data[4 * PAGE:12 * PAGE], landed.append)
        push(2, 4 * PAGE, data[4 * PAGE:12 * PAGE], landed.append)   # another file
        push.replied(1, 0, PAGE)                                # the taken piece's pages
        push.replied(1, 6 * PAGE, 8 * PAGE)                     # the middle of the queued one
        push.replied(1, 11 * PAGE, 13 * PAGE)                   # its end, and past it
        release.set()
        with trio.fail_after(10):
            while len(landed) < 3:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert landed == [None, None, None]
    assert stored == [(1, 0, data[:4 * PAGE]),
                      (1, 4 * PAGE, data[4 * PAGE:6 * PAGE]), (1, 8 * PAGE, data[8 * PAGE:11 * PAGE]),
                      (2, 4 * PAGE, data[4 * PAGE:12 * PAGE])]
    st = push.statistics()
    assert st.pieces == 3 and st.bytes == 17 * PAGE and st.replied_bytes == 3 * PAGE
    # Spans less a range: before, after, across, inside, and nothing left.
    spans = ((0, memoryview(data)[:4 * PAGE]),)
    assert [(o, len(d)) for o, d in without(spans, 4 * PAGE, 8 * PAGE)] == [(0, 4 * PAGE)]
    assert [(o, len(d)) for o, d in without(spans, PAGE, 2 * PAGE)] == [(0, PAGE), (2 * PAGE, 2 * PAGE)]
    assert without(spans, 0, 4 * PAGE) == ()


async def test_the_feeder_tells_the_whole_pages_a_read_fills():
    m, data = layout(5)
    told: list[tuple[int, int, int]] = []
    feeder = PageFeeder(m, 9, lambda *a: None, ChunkCache(1 << 30), on_reply=lambda *a: told.append(a))
    feeder.replied(100, 3 * PAGE + 5)          # a partial page at each end is not the reply's to fill
    feeder.replied(PAGE, PAGE + 10)            # no whole page
    feeder.replied(2 * PAGE, m.size)           # the file's last page counts as whole
    assert told == [(9, PAGE, 3 * PAGE), (9, 2 * PAGE, m.size)]
