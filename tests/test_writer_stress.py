"""The write path against a model: seeded random sequences of writes (in order, out of order, several at
once as FUSE handlers run them), truncates, reads, fsyncs and pauses on one open file, over stores with
a little latency, each step checked against a bytearray holding what the file must contain; every
commit read back from the stores. Fixed scenarios miss interleavings: write-behind once slept through
uploads that ended while it was busy (test_writer), which only timing exposed. `STRESS_SEEDS=200` runs
more seeds."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import trio

from conftest import write_config
from cpfs.catalog import Catalog
from cpfs.config import load_config
from cpfs.manifest import Manifest
from cpfs.pool import StorePool
from cpfs.store import ThrottledStore, open_store
from test_writer import MiB, Env, open_session, stored_bytes

SEEDS = range(int(os.environ.get("STRESS_SEEDS", "6")))


async def random_env(tmp_path: Path, rng: random.Random) -> Env:
    """Folder stores behind a link of 0-3 ms, so uploads end at varied moments."""
    config = load_config(write_config(tmp_path / "cpfs"))
    latency = rng.choice([0, 0.001, 0.003])
    pool = StorePool(config, [ThrottledStore(open_store(s), latency=latency) for s in config.stores])
    await pool.check()
    return Env(config, pool, Catalog(pool), tmp_path / "cpfs" / "staging", tmp_path / "cpfs" / "stores")


def put(model: bytearray, offset: int, data: bytes) -> None:
    if offset > len(model):
        model.extend(bytes(offset - len(model)))
    model[offset:offset + len(data)] = data


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_writes_truncates_reads_and_fsyncs_match_a_model(tmp_path: Path, seed: int) -> None:
    """Any file: three sessions on one path, each opened on the last commit."""
    rng = random.Random(seed)
    env = await random_env(tmp_path, rng)
    model = bytearray()
    committed: Manifest | None = None
    for session in range(3):
        async with open_session(env, "/f.bin", base=committed) as s:
            assert await s.read(0, len(model) + 10) == bytes(model)
            for step in range(rng.randint(10, 60)):
                where = (seed, session, step)
                op = rng.random()
                if op < 0.55:                                   # mostly appends, as savers write
                    offset = len(model) if rng.random() < 0.7 else rng.randrange(len(model) + 1)
                    data = os.urandom(rng.choice([4096, 65536, MiB, 3 * MiB, rng.randrange(1, 2 * MiB)]))
                    await s.write(offset, data)
                    put(model, offset, data)
                elif op < 0.65:                                 # several at once, in any order
                    parts = [(len(model) + k * 256 * 1024, os.urandom(256 * 1024)) for k in range(rng.randint(2, 12))]
                    rng.shuffle(parts)
                    async with trio.open_nursery() as n:
                        for offset, data in parts:
                            n.start_soon(s.write, offset, data)
                    for offset, data in parts:
                        put(model, offset, data)
                elif op < 0.72:
                    size = rng.randrange(len(model) + 2 * MiB)
                    await s.truncate(size)
                    put(model, size, b"")
                    del model[size:]
                elif op < 0.9:
                    offset, n = rng.randrange(len(model) + 1), rng.randrange(1, 3 * MiB)
                    assert await s.read(offset, n) == bytes(model[offset:offset + n]), where
                elif op < 0.95:                                 # fsync: commits what is there now
                    committed = await s.flush(closing=False)
                    assert committed is not None and await stored_bytes(env.pool, committed) == bytes(model), where
                else:
                    await trio.sleep(rng.choice([0, 0.001, 0.01, 0.05]))
            committed = await s.flush()
            assert await stored_bytes(env.pool, committed) == bytes(model), (seed, session)
        current = await env.catalog.get("/f.bin")
        assert current.version == committed.version and await stored_bytes(env.pool, current) == bytes(model)


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_checkpoint_written_in_random_pieces_with_reads_patches_and_fsyncs(tmp_path: Path, seed: int) -> None:
    """A safetensors file written in file order in pieces of random size, with reads of what came before
    (bytes write-behind may have dropped from staging come back), patches inside tensor data, fsyncs of
    the incomplete file and pauses; twice on one path, the second from scratch (truncate to 0)."""
    rng = random.Random(seed)
    env = await random_env(tmp_path, rng)
    tensors = {f"t{i:03d}": np.frombuffer(os.urandom(rng.choice([4096, 300_000, MiB // 2, MiB, 3 * MiB])), np.float32)
               for i in range(rng.randint(10, 30))}
    blob = safetensors.numpy.save(tensors)
    data_start = 8 + int.from_bytes(blob[:8], "little")
    committed: Manifest | None = None
    for session in range(2):
        model = bytearray(blob)
        async with open_session(env, "/c.safetensors", base=committed) as s:
            await s.truncate(0)
            pos = 0
            while pos < len(model):
                n = min(len(model) - pos, rng.choice([4096, 65536, MiB, rng.randrange(1, 3 * MiB)]))
                await s.write(pos, bytes(model[pos:pos + n]))
                pos += n
                op = rng.random()
                if op < 0.2:
                    offset, n = rng.randrange(pos), rng.randrange(1, 2 * MiB)
                    assert await s.read(offset, n) == bytes(model[offset:min(pos, offset + n)]), (seed, offset, n)
                elif op < 0.3 and pos > data_start:
                    offset = rng.randrange(data_start, pos)
                    patch = os.urandom(min(pos - offset, rng.choice([7, 4096, 200_000])))
                    await s.write(offset, patch)
                    model[offset:offset + len(patch)] = patch
                elif op < 0.35:
                    fsynced = await s.flush(closing=False)         # incomplete: stored, not committed
                    assert (fsynced is None) == (pos < len(model)), (seed, pos)
                elif op < 0.5:
                    await trio.sleep(rng.choice([0, 0.001, 0.01, 0.03]))
            committed = await s.flush()
            assert await stored_bytes(env.pool, committed) == bytes(model), (seed, session)
            assert committed.tensor_index is not None
        loaded = safetensors.numpy.load(await stored_bytes(env.pool, await env.catalog.get("/c.safetensors")))
        assert loaded.keys() == tensors.keys()
