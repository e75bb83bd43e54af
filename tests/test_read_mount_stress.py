"""Reads through a real mount under stress: four threads on one imported file, each a seeded random mix
of preads (4 KiB to 3 MiB), sequential runs that start streams (and pushes into the page cache), pages
dropped with fadvise and read again, mmap reads and pauses, and a fifth reading it through an O_DIRECT
open, with a daemon cache smaller than the file.
Every read must equal the source's bytes. Dropped pages of pushed chunks come back as lost pages, read
from their blocks (StorePool.fetch_blocks) when the cache let their chunk go: the test requires that
path taken, and every block read that fell back to the whole chunk to be one that took longer than
a hedged read waits (a loaded machine), never blocks that did not match. `STRESS_SEEDS=10` runs more
seeds."""
from __future__ import annotations

import json
import mmap
import os
import random
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import cpfs

MiB = 1 << 20
PAGE = 4096
SEEDS = range(int(os.environ.get("STRESS_SEEDS", "2")))


def reader(path: Path, data: bytes, seed: int, errors: list[BaseException]) -> None:
    rng, size = random.Random(seed), len(data)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            for step in range(300):
                op = rng.random()
                if op < 0.3:
                    offset, n = rng.randrange(size), rng.choice([PAGE, 65536, MiB, 3 * MiB])
                    assert os.pread(fd, n, offset) == data[offset:offset + n], (seed, step, offset, n)
                elif op < 0.5:
                    offset = rng.randrange(size // PAGE) * PAGE
                    os.posix_fadvise(fd, offset, PAGE * rng.choice([1, 2, 8, 64]), os.POSIX_FADV_DONTNEED)
                elif op < 0.6:
                    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
                        offset = rng.randrange(size)
                        assert mm[offset:offset + 200_000] == data[offset:offset + 200_000], (seed, step, offset)
                elif op < 0.8:                                # a sequential run: a stream, pushes
                    start = rng.randrange(size)
                    for offset in range(start, start + rng.randint(1, 200) * 131072, 131072):
                        assert os.pread(fd, 131072, offset) == data[offset:offset + 131072], (seed, step, offset)
                elif op < 0.82:
                    time.sleep(0.3)                           # pushed pages age past pagecache.RACE
                else:
                    offset = rng.randrange(size // PAGE) * PAGE
                    assert os.pread(fd, PAGE, offset) == data[offset:offset + PAGE], (seed, step, offset)
        finally:
            os.close(fd)
    except BaseException as e:                                # reported by the test, not lost in the thread
        errors.append(e)


def direct_reader(path: Path, data: bytes, seed: int, errors: list[BaseException]) -> None:
    """An O_DIRECT open beside the others: its reads bypass the page cache they fill and drop, so
    each comes to the daemon, scattered or in sequential runs (a stream of its own)."""
    rng, size = random.Random(seed), len(data)
    buf = mmap.mmap(-1, 3 * MiB)                              # page-aligned, as O_DIRECT wants
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for step in range(150):
                if rng.random() < 0.5:
                    offset, n = rng.randrange(size // PAGE) * PAGE, rng.choice([PAGE, 65536, MiB, 3 * MiB])
                    runs = [(offset, n)]
                else:
                    start = rng.randrange(size // MiB) * MiB
                    runs = [(o, MiB) for o in range(start, min(size, start + rng.randint(1, 24) * MiB), MiB)]
                for offset, n in runs:
                    got = os.preadv(fd, [memoryview(buf)[:n]], offset)
                    assert buf[:got] == data[offset:offset + n], (seed, step, offset, n)
        finally:
            os.close(fd)
    except BaseException as e:
        errors.append(e)
    finally:
        buf.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_concurrent_random_reads_and_lost_pages_through_a_mount_give_the_source_bytes(
        make_config, mount, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    cfg = make_config(chunk_size="1MiB", cache="8MiB")
    data = os.urandom(rng.randrange(20 * MiB, 60 * MiB))
    (tmp_path / "src.bin").write_bytes(data)
    cpfs("put", str(tmp_path / "src.bin"), "/d.bin", config=cfg)
    m = mount(cfg)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=reader, args=(m.path / "d.bin", data, seed * 100 + k, errors))
               for k in range(4)]
    threads.append(threading.Thread(target=direct_reader, args=(m.path / "d.bin", data, seed * 100 + 4, errors)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert (m.path / "d.bin").read_bytes() == data
    replicas = json.loads(cpfs("stats", str(m.path), "--json", config=cfg).stdout)["replicas"]
    assert replicas["block_reads"] > replicas["block_misses"], replicas
    misses = [line for line in m.log.read_text().splitlines() if "reading the whole chunk" in line]
    assert len(misses) == replicas["block_misses"], replicas
    assert all("no answer within" in line for line in misses), misses[:3]
