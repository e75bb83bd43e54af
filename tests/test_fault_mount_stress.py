"""Rule one under heavy faults, through a real mount: every store fails or corrupts a large share of its
answers (`error_rate`, `corrupt_rate`: transient errors, altered bytes), and a file imported while
they were healthy is read at random, with the page cache dropped now and then, while another is
rewritten. A read gives the source's bytes, a short read of them (a later part of a long read failed),
or EIO with a log line; never other bytes, never a crash of an operation. A rewrite either commits
whole or fails (EIO) and leaves the previous version current; a fresh mount over the healthy stores
then reads exactly what was last committed. It showed a read over several chunks, one of them
unreadable, logged as a crash (an ExceptionGroup from the reader's nursery), and an open for writing
that met the last release of the file (the kernel sends it after close() returned) left without a
session, after the release had committed the open's truncation (tests/test_fs_ops.py).

`FAULT_STRESS_SEEDS=N` runs N seeds (make test: 3). With those fixes, 200 seeds passed here."""
from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from tests.conftest import cpfs

MiB = 1 << 20
SEEDS = range(int(os.environ.get("FAULT_STRESS_SEEDS", "3")))
FAULTS = {"s0": "error_rate = 0.5\ncorrupt_rate = 0.3", "s1": "corrupt_rate = 0.2",
          "s2": "error_rate = 0.3\ncorrupt_rate = 0.2"}


def faulty_config(clean: Path, seed: int) -> Path:
    """The same stores, each with its faults (FaultyStore, seeded)."""
    text = clean.read_text()
    for k, (name, faults) in enumerate(FAULTS.items()):
        text = text.replace(f'url = "stores/{name}"', f'url = "stores/{name}"\n{faults}\nfault_seed = {seed * 3 + k}')
    path = clean.parent / "faulty.toml"        # beside it: store folders are relative to the config
    path.write_text(text)
    return path


def same(got: bytes, expected: bytes) -> bool:
    """Equal bytes. An `assert` on `==` of megabytes makes pytest diff them when it fails, for hours."""
    return got == expected


def open_eventually(path: Path) -> int:
    """Open the file for reading. Its manifest has 2 copies, each read once per open: when both
    answers fail (~9% here) the open fails with EIO, and the next open reads them again."""
    for _ in range(20):
        try:
            return os.open(path, os.O_RDONLY)
        except OSError as e:
            assert e.errno == errno.EIO, e
    raise AssertionError(f"{path}: 20 opens failed")


@pytest.mark.parametrize("seed", SEEDS)
def test_reads_and_rewrites_over_failing_and_corrupting_stores_never_give_other_bytes(
        make_config, mount, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    clean = make_config(chunk_size="1MiB", cache="8MiB")
    data = os.urandom(24 * MiB)
    (tmp_path / "src.bin").write_bytes(data)
    cpfs("put", str(tmp_path / "src.bin"), "/d.bin", config=clean)
    m = mount(faulty_config(clean, seed))

    answered = failed = 0
    fd = open_eventually(m.path / "d.bin")
    try:
        for _ in range(200):
            offset, n = rng.randrange(len(data)), rng.choice([4096, 65536, MiB, 3 * MiB])
            if rng.random() < 0.3:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            try:
                got = os.pread(fd, n, offset)
            except OSError as e:
                assert e.errno == errno.EIO, e
                failed += 1
                continue
            assert got and same(got, data[offset:offset + len(got)]), (seed, offset, n, len(got))
            answered += 1
    finally:
        os.close(fd)
    assert answered > 100                         # the replicas carry most reads through

    committed = None
    for _ in range(5):
        new = os.urandom(rng.randrange(1, 6 * MiB))
        try:
            (m.path / "w.bin").write_bytes(new)
            committed = new
        except OSError as e:                      # below write quorum: the commit fails
            assert e.errno == errno.EIO, e
    log = m.log.read_text()
    assert "unexpectedly" not in log and "Traceback" not in log
    fresh = mount(clean, "fresh")
    assert same((fresh.path / "d.bin").read_bytes(), data)
    if committed is not None:
        got = (fresh.path / "w.bin").read_bytes()
        assert same(got, committed), (len(got), len(committed))
