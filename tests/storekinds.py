"""Every kind of store and wrapper the store contract suite runs over (tests/test_store.py).

A factory takes a fresh folder and a store name and opens a store as an async context manager, so a
kind that needs a server (S3 on a loopback moto server) can start or share one and clean up after.
Add a kind by appending a `pytest.param(factory, id=...)` to STORE_FACTORIES.
"""
from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest
import trio

from cpfs.store import DirectoryStore, FaultyStore, MeteredStore, Store, ThrottledStore
from tests.s3server import open_s3_store

StoreFactory = Callable[[Path, str], AbstractAsyncContextManager[Store]]


def _folder(tmp_path: Path, name: str) -> DirectoryStore:
    return DirectoryStore(name, tmp_path / name, trio.CapacityLimiter(8))


def wrapped(wrap: Callable[[Store], Store]) -> StoreFactory:
    """A folder store inside `wrap`."""
    @asynccontextmanager
    async def factory(tmp_path: Path, name: str) -> AsyncIterator[Store]:
        store = wrap(_folder(tmp_path, name))
        try:
            yield store
        finally:
            await store.aclose()
    return factory


@asynccontextmanager
async def folder_without_o_direct(tmp_path: Path, name: str) -> AsyncIterator[Store]:
    """A folder store on ramfs, which refuses O_DIRECT opens (EINVAL; tmpfs takes them since Linux 6.6):
    every read goes through the store's fallback to page-cache reads. Mounting needs root (CI is);
    elsewhere the kind is skipped. Unmounted at the end, also on failure."""
    where = tmp_path / f"ramfs-{name}"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a ramfs (needs root): {r.stderr.strip()}")
    store = DirectoryStore(name, where / name, trio.CapacityLimiter(8))
    try:
        yield store
    finally:
        await store.aclose()
        subprocess.run(["umount", "-l", str(where)], check=True)


STORE_FACTORIES = [
    pytest.param(wrapped(lambda s: s), id="folder"),
    pytest.param(wrapped(lambda s: ThrottledStore(s, latency=0.001, bandwidth=1e9)), id="folder+throttle"),
    pytest.param(wrapped(lambda s: FaultyStore(s, error_rate=0.0, corrupt_rate=0.0, seed=1)), id="folder+faults0"),
    pytest.param(wrapped(MeteredStore), id="metered"),
    pytest.param(wrapped(lambda s: MeteredStore(FaultyStore(ThrottledStore(s, latency=0.001)))), id="full-stack"),
    pytest.param(open_s3_store, id="s3"),
    pytest.param(folder_without_o_direct, id="folder-no-odirect"),
]
