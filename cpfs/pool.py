"""The set of backing stores as one replicated chunk store.

Reads pick, for every chunk, the replica on the least busy store (fewest requests in flight, then the
lowest recent latency), so that concurrent fetches spread over every store; a failed, slow or corrupt
replica falls through to the next one. Writes go to the stores placement chose, skipping those that
already hold the chunk (content addressing makes that a complete dedup check).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from . import chunk as chunkfmt
from .config import Config
from .errors import ChunkUnavailable, ConfigError, CorruptChunk, NoSuchObject, StoreError, StoreUnavailable
from .manifest import ChunkEntry
from .store import Store, open_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreLoad:
    name: str
    outstanding: int
    peak_outstanding: int
    requests: int
    errors: int
    bytes_read: int
    bytes_written: int
    latency_ewma: float


class _Load:
    def __init__(self) -> None:
        self.outstanding = self.peak = self.requests = self.errors = 0
        self.bytes_read = self.bytes_written = 0
        self.ewma = 0.0

    def snapshot(self, name: str) -> StoreLoad:
        return StoreLoad(name, self.outstanding, self.peak, self.requests, self.errors,
                         self.bytes_read, self.bytes_written, self.ewma)


class StorePool:
    def __init__(self, config: Config, stores: Sequence[Store] | None = None) -> None:
        self.config = config
        built = stores if stores is not None else [open_store(s) for s in config.stores]
        self.stores: dict[str, Store] = {s.name: s for s in built}
        self.names = list(self.stores)
        self.cpu = trio.CapacityLimiter(config.cpu_threads)
        self._load = {name: _Load() for name in self.names}

    def statistics(self) -> list[StoreLoad]:
        return [self._load[n].snapshot(n) for n in self.names]

    async def check(self) -> None:
        """Every store usable, or a ConfigError naming the config file and the first store that is not:
        an unusable store is a bad configuration, found before anything is read or written."""
        errors: list[StoreError] = []

        async def one(store: Store) -> None:
            try:
                with trio.fail_after(self.config.request_timeout):
                    await store.check()
            except StoreError as e:
                errors.append(e)
            except trio.TooSlowError:
                errors.append(StoreUnavailable(store.name, "did not answer in time"))

        async with trio.open_nursery() as n:
            for s in self.stores.values():
                n.start_soon(one, s)
        if errors:
            e = errors[0]
            detail = e.detail if isinstance(e, StoreUnavailable) else str(e)
            raise ConfigError(f"{self.config.source}: store {e.store!r}.url: {detail}")

    async def aclose(self) -> None:
        for s in self.stores.values():
            await s.aclose()

    def rank(self, names: Sequence[str]) -> list[str]:
        """Replicas ordered least busy first."""
        known = [n for n in names if n in self._load]
        return sorted(known, key=lambda n: (self._load[n].outstanding, self._load[n].ewma))

    async def _call(self, name: str, op: str, key: str, data: bytes | None = None):
        """One store request, timed and bounded by the request timeout."""
        load = self._load[name]
        load.outstanding += 1
        load.peak = max(load.peak, load.outstanding)
        load.requests += 1
        t0 = time.monotonic()
        try:
            with trio.fail_after(self.config.request_timeout):
                store = self.stores[name]
                if op == "get":
                    result = await store.get(key)
                    load.bytes_read += len(result)
                elif op == "put":
                    assert data is not None
                    result = await store.put(key, data)
                    load.bytes_written += len(data)
                elif op == "exists":
                    result = await store.exists(key)
                else:
                    result = await store.delete(key)
        except trio.TooSlowError:
            load.errors += 1
            raise StoreUnavailable(name, f"{op} {key!r} took longer than {self.config.request_timeout}s")
        except StoreError:
            load.errors += 1
            raise
        finally:
            load.outstanding -= 1
        load.ewma = 0.8 * load.ewma + 0.2 * (time.monotonic() - t0)
        return result

    async def get(self, name: str, key: str) -> bytes:
        return await self._call(name, "get", key)

    async def put(self, name: str, key: str, data: bytes) -> None:
        await self._call(name, "put", key, data)

    async def exists(self, name: str, key: str) -> bool:
        return await self._call(name, "exists", key)

    async def delete(self, name: str, key: str) -> None:
        await self._call(name, "delete", key)

    async def fetch_chunk(self, entry: ChunkEntry, where: str) -> bytes:
        """Verified raw bytes of a chunk from the least busy healthy replica.
        `where` ("file F offset O chunk N") goes into every log line about it."""
        failures = []
        for name in self.rank(entry.stores):
            try:
                blob = await self.get(name, chunkfmt.chunk_key(entry.digest))
                return await trio.to_thread.run_sync(chunkfmt.decode, blob, entry.digest, limiter=self.cpu)
            except (StoreError, CorruptChunk) as e:
                kind = "corrupt replica" if isinstance(e, CorruptChunk) else "replica failed"
                log.warning("%s: %s %s on store %r: %s", where, kind, entry.digest[:16], name, e)
                failures.append(f"{name}: {e}")
        raise ChunkUnavailable(f"{where}: no replica of chunk {entry.digest[:16]} could be read "
                               f"(stores {', '.join(entry.stores)}): {'; '.join(failures) or 'no known store'}")

    async def store_chunk(self, enc: chunkfmt.EncodedChunk, targets: Sequence[str], quorum: int) -> tuple[list[str], bool]:
        """Put a chunk on `targets` (skipping stores that hold it already).
        Returns (stores holding it, whether it was new anywhere); raises the first error below quorum."""
        key = chunkfmt.chunk_key(enc.digest)
        held: list[str] = []
        errors: list[StoreError] = []
        wrote = False

        async def one(name: str) -> None:
            nonlocal wrote
            try:
                if not await self.exists(name, key):
                    await self.put(name, key, enc.blob)
                    wrote = True
                held.append(name)
            except StoreError as e:
                log.warning("chunk %s: put to store %r failed: %s", enc.digest[:16], name, e)
                errors.append(e)

        async with trio.open_nursery() as n:
            for name in targets:
                n.start_soon(one, name)
        if len(held) < quorum:
            raise errors[0] if errors else StoreError(",".join(targets), "no store took the chunk")
        return [t for t in targets if t in held], wrote

    async def get_any(self, names: Sequence[str], key: str) -> bytes:
        """An object from the first store of `names` that has it."""
        last: StoreError = NoSuchObject(",".join(names), f"no object {key!r}")
        for name in self.rank(names):
            try:
                return await self.get(name, key)
            except StoreError as e:
                last = e
        raise last
