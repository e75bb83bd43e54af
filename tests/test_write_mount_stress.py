"""Writes through a real mount against a model: seeded random pwrites (appends, rewrites, several from
threads at once), ftruncates, preads on the writing and on a second descriptor, mmap reads, fsyncs,
stats and whole reads, in four opens of one file (some with O_TRUNC), each step checked against a
bytearray; after each close a whole read, and at the end a fresh mount, must give the same bytes. The
file layer's own model test is tests/test_writer_stress.py; this one adds the kernel's page cache, the
daemon's pushes into it, and FUSE's handling of concurrent writes. `STRESS_SEEDS=30` runs more seeds."""
from __future__ import annotations

import mmap
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

MiB = 1 << 20
SEEDS = range(int(os.environ.get("STRESS_SEEDS", "3")))


def put(model: bytearray, offset: int, data: bytes) -> None:
    if offset > len(model):
        model.extend(bytes(offset - len(model)))
    model[offset:offset + len(data)] = data


@pytest.mark.parametrize("seed", SEEDS)
def test_random_writes_through_a_mount_match_a_model(make_config, mount, seed: int) -> None:
    rng = random.Random(seed)
    cfg = make_config(chunk_size=rng.choice(["1MiB", "4MiB"]))
    m = mount(cfg)
    path = m.path / "f.bin"
    model = bytearray()
    for session in range(4):
        trunc = rng.random() < 0.2
        fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if trunc else 0), 0o644)
        if trunc:
            del model[:]
        reader = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, len(model) + 10, 0) == bytes(model)
            for step in range(rng.randint(20, 80)):
                where = (seed, session, step)
                op = rng.random()
                if op < 0.5:                                     # mostly appends, as savers write
                    offset = len(model) if rng.random() < 0.7 else rng.randrange(len(model) + 1)
                    data = os.urandom(rng.choice([4096, 65536, MiB, 3 * MiB, rng.randrange(1, 2 * MiB)]))
                    assert os.pwrite(fd, data, offset) == len(data)
                    put(model, offset, data)
                elif op < 0.55:                                  # several threads at once, any order
                    parts = [(len(model) + k * 256 * 1024, os.urandom(256 * 1024)) for k in range(rng.randint(2, 16))]
                    rng.shuffle(parts)
                    with ThreadPoolExecutor(4) as pool:
                        assert list(pool.map(lambda p: os.pwrite(fd, p[1], p[0]), parts)) == [256 * 1024] * len(parts)
                    for offset, data in parts:
                        put(model, offset, data)
                elif op < 0.6:
                    size = rng.randrange(len(model) + 2 * MiB)
                    os.ftruncate(fd, size)
                    put(model, size, b"")
                    del model[size:]
                elif op < 0.75:
                    offset, n = rng.randrange(len(model) + 1), rng.randrange(1, 3 * MiB)
                    got = os.pread(reader if rng.random() < 0.5 else fd, n, offset)
                    assert got == bytes(model[offset:offset + n]), where
                elif op < 0.8 and model:
                    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                        assert len(mm) == len(model), where
                        offset = rng.randrange(len(model))
                        assert mm[offset:offset + 100_000] == bytes(model[offset:offset + 100_000]), where
                elif op < 0.88:
                    os.fsync(fd)
                elif op < 0.93:
                    assert os.fstat(fd).st_size == os.stat(path).st_size == len(model), where
                else:
                    assert path.read_bytes() == bytes(model), where
        finally:
            os.close(reader)
            os.close(fd)
        assert path.read_bytes() == bytes(model), (seed, session, "after close")
    assert (mount(cfg, "fresh").path / "f.bin").read_bytes() == bytes(model), (seed, "a fresh mount")
