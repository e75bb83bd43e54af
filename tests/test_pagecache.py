"""The page-cache feeder: whole pages only, each once, straddling pages once all their chunks are here."""
from __future__ import annotations

import random

import trio

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

        async def push(inode: int, offset: int, piece) -> None:
            await trio.sleep(0)
            pushes.append((offset, bytes(piece)))

        cache = ChunkCache(1 << 30)
        feeder = PageFeeder(m, 7, push, cache)
        order = list(range(len(m.chunks)))
        random.Random(seed).shuffle(order)
        async with trio.open_nursery() as n:
            for i in order:
                piece = data[m.offsets[i]:m.offsets[i + 1]]
                await cache.get(m.chunks[i].digest, len(piece), lambda p=piece: _ret(p))
                feeder.offer(n, i, piece)
                await trio.sleep(0)
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

    async def push(inode: int, offset: int, piece) -> None:
        pushes.append(offset)

    cache = ChunkCache(1 << 30)
    feeder = PageFeeder(m, 1, push, cache)
    i = next(k for k in range(1, len(m.chunks)) if m.offsets[k] % PAGE)   # a chunk starting mid-page
    async with trio.open_nursery() as n:
        feeder.offer(n, i, data[m.offsets[i]:m.offsets[i + 1]])
    assert m.offsets[i] // PAGE * PAGE not in pushes        # its first page needs chunk i-1 too
    assert not feeder.holds(i)


# ---------------------------------------------------------------------------------------------------
# the daemon's pusher: notify_store from worker threads, pushes that queue up sent in one thread call

async def test_pushes_that_queue_up_go_in_one_thread_call_and_errors_reach_their_pusher():
    import errno
    import threading

    import trio.testing

    from cpfs.daemon import make_pusher

    stored: list[int] = []
    release = threading.Event()

    def notify(inode: int, offset: int, data) -> None:
        if offset == 0:
            release.wait(10)              # the first push holds the only thread while the others queue
        if offset == 3 * PAGE:
            raise OSError(errno.EIO, "no")
        stored.append(offset)

    push = make_pusher(trio.CapacityLimiter(1), notify)
    errors: list[tuple[int, int]] = []

    async def one(offset: int) -> None:
        try:
            await push(1, offset, b"x" * PAGE)
        except OSError as e:
            errors.append((offset, e.errno))

    async with trio.open_nursery() as n:
        n.start_soon(one, 0)
        await trio.testing.wait_all_tasks_blocked()
        for k in range(1, 5):
            n.start_soon(one, k * PAGE)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    # The first push went alone; the four that queued behind it in one call, each with its own outcome.
    assert sorted(stored) == [0, PAGE, 2 * PAGE, 4 * PAGE]
    assert errors == [(3 * PAGE, errno.EIO)]
    assert push.statistics().pieces == 5 and push.statistics().thread_calls == 2
    assert push.statistics().failed == 1


async def test_a_kernel_without_notify_store_disables_the_pusher_quietly():
    import errno

    from cpfs.daemon import make_pusher

    calls: list[int] = []

    def notify(inode: int, offset: int, data) -> None:
        calls.append(offset)
        raise OSError(errno.ENOSYS, "not supported")

    push = make_pusher(trio.CapacityLimiter(2), notify)
    await push(1, 0, b"x")                # no error: the mount works without it
    await push(1, PAGE, b"x")             # and no more thread calls
    assert calls == [0]


async def test_a_read_of_pushed_pages_means_the_kernel_dropped_them_and_everything_is_pushed_again(autojump_clock):
    """drop_caches (or memory pressure) empties the kernel's page cache without telling the daemon: a
    read that reaches the daemon for pages it pushed shows it, and the feeder forgets its pushes."""
    m, data = layout(3)
    pushes: list[int] = []

    async def push(inode: int, offset: int, piece) -> None:
        pushes.append(offset)

    feeder = PageFeeder(m, 7, push, ChunkCache(1 << 30))
    big = max(range(len(m.chunks)), key=lambda i: m.chunks[i].raw_len)
    lo, hi = feeder._interior(big)
    assert hi - lo >= PAGE
    async with trio.open_nursery() as n:
        feeder.offer(n, big, data[m.offsets[big]:m.offsets[big + 1]])
    assert pushes == [lo] and big in feeder.done
    other = next(i for i in range(len(m.chunks)) if i != big and feeder._interior(i)[1] > feeder._interior(i)[0])
    assert not feeder.lost(*feeder._interior(other))          # never pushed: an ordinary read
    assert not feeder.lost(lo, lo + PAGE)                      # just pushed: the read may predate it
    await trio.sleep(RACE)
    assert feeder.lost(lo, lo + PAGE)                          # pushed a while ago, and asked for again
    feeder.forget()
    assert not feeder.lost(lo, lo + PAGE) and big not in feeder.sent and feeder.drops == 1
    async with trio.open_nursery() as n:
        feeder.offer(n, big, data[m.offsets[big]:m.offsets[big + 1]])
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


async def _noop_push(inode: int, offset: int, piece) -> None:
    pass
