"""Fault injection: a wrapper that makes a healthy store misbehave on purpose, for drills and tests.

Knobs (the [[store]] keys of the same names; all off by default):
- `error_rate`: that fraction of requests fails at once with a transient StoreError (as a throttled
  or flaky remote would), so the pool's retries and failover are exercised;
- `corrupt_rate`: that fraction of reads (get, get_range) returns its bytes with one byte altered, so
  checksums, failover and dedup verification are exercised;
- `down`: every request fails with StoreUnavailable (an unreachable endpoint, an unmounted export);
- `hang`: every request waits forever (a black-holed endpoint, a hung NFS server): only the pool's
  timeout gets the caller out.
`seed` makes the random choices repeatable. The knobs are plain attributes: tests may change them
while the store is in use (a store "going down" mid-write). `check()` obeys them too, so a store
that is down at startup is marked down, not refused, and is probed until it comes back.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import trio

from ..errors import StoreError, StoreUnavailable
from .base import ObjectInfo, Store, StoreWrapper


@dataclass(frozen=True)
class FaultStats:
    requests: int        # requests that reached this wrapper
    errors: int          # transient errors injected (error_rate)
    refused: int         # requests refused because the store is down
    hung: int            # requests that hung (until cancelled)
    corrupted: int       # reads returned altered


class FaultyStore(StoreWrapper):
    def __init__(self, inner: Store, *, error_rate: float = 0.0, corrupt_rate: float = 0.0,
                 down: bool = False, hang: bool = False, seed: int | None = None) -> None:
        super().__init__(inner)
        self.error_rate = error_rate
        self.corrupt_rate = corrupt_rate
        self.down = down
        self.hang = hang
        self._rng = random.Random(seed)
        self._requests = self._errors = self._refused = self._hung = self._corrupted = 0

    def statistics(self) -> FaultStats:
        return FaultStats(requests=self._requests, errors=self._errors, refused=self._refused,
                          hung=self._hung, corrupted=self._corrupted)

    async def _fault(self, op: str, key: str) -> None:
        """Raise or hang as the knobs say; return to let the request through."""
        self._requests += 1
        if self.hang:
            self._hung += 1
            await trio.sleep_forever()
        if self.down:
            self._refused += 1
            raise StoreUnavailable(self.name, f"{op} {key!r}: store is down (fault drill: down = true)")
        if self.error_rate and self._rng.random() < self.error_rate:
            self._errors += 1
            raise StoreError(self.name, f"{op} {key!r}: injected failure (fault drill: error_rate)",
                             transient=True)

    def _alter(self, data: bytes) -> bytes:
        if not data or not self.corrupt_rate or self._rng.random() >= self.corrupt_rate:
            return data
        self._corrupted += 1
        out = bytearray(data)
        out[self._rng.randrange(len(out))] ^= 1 << self._rng.randrange(8)
        return bytes(out)

    async def get(self, key: str) -> bytes:
        await self._fault("get", key)
        return self._alter(await self.inner.get(key))

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        await self._fault("get_range", key)
        return self._alter(await self.inner.get_range(key, start, length))

    async def head(self, key: str) -> int:
        await self._fault("head", key)
        return await self.inner.head(key)

    async def stat(self, key: str) -> ObjectInfo:
        await self._fault("stat", key)
        return await self.inner.stat(key)

    async def touch(self, key: str) -> None:
        await self._fault("touch", key)
        await self.inner.touch(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self._fault("put", key)
        await self.inner.put(key, data)

    async def exists(self, key: str) -> bool:
        await self._fault("exists", key)
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        await self._fault("delete", key)
        await self.inner.delete(key)

    async def delete_if_older(self, key: str, before: float) -> bool:
        await self._fault("delete", key)
        return await self.inner.delete_if_older(key, before)

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        await self._fault("list", prefix)
        return await self.inner.list(prefix, start_after, limit)

    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        await self._fault("list", prefix)
        return await self.inner.list_info(prefix, start_after, limit)

    async def list_temporary(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        await self._fault("list", prefix)
        return await self.inner.list_temporary(prefix, start_after, limit)

    async def check(self) -> None:
        await self._fault("check", "")
        await self.inner.check()
