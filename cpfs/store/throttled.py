"""A wrapper that makes a store behave like a remote one: per-request latency, per-store bandwidth.

Used by tests and benchmarks (`latency`/`bandwidth` keys of a [[store]]) so that the readahead
scheduler's parallelism shows on one machine. Bandwidth is a shared link: transfers queue on it, and
several stores may share one `Link` (folders on one disk, buckets behind one gateway): then they are
slow together, which is what hedged reads must not make worse (cpfs/pool.py, tests/test_hedging.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from .base import ObjectInfo, Sized, Store, StoreWrapper

T = TypeVar("T")


@dataclass
class Link:
    """A link's bandwidth (bytes per second) and when it is next free: what transfers queue on."""
    bandwidth: float
    free_at: float = 0.0


class ThrottledStore(StoreWrapper):
    def __init__(self, inner: Store, latency: float = 0.0, bandwidth: float | None = None,
                 link: Link | None = None) -> None:
        """`bandwidth` gives the store a link of its own; `link` puts it on one that others share."""
        super().__init__(inner)
        self.latency = latency
        self.link = link if link is not None else Link(bandwidth) if bandwidth else None

    async def _delay(self, start: float, nbytes: int) -> None:
        """Sleep until `latency` after the request's `start`, and until `nbytes` have crossed the link."""
        done = start + self.latency
        if self.link is not None:
            self.link.free_at = max(trio.current_time(), self.link.free_at) + nbytes / self.link.bandwidth
            done = max(done, self.link.free_at)
        await trio.sleep_until(done)

    async def get(self, key: str) -> bytes:
        start = trio.current_time()     # the latency covers the inner read: it is part of the request
        data = await self.inner.get(key)
        await self._delay(start, len(data))
        return data

    async def get_with(self, key: str, fn: Callable[[bytes | memoryview], T], limiter: trio.CapacityLimiter) -> T:
        start = trio.current_time()
        sized = Sized(fn)
        result = await self.inner.get_with(key, sized, limiter)
        await self._delay(start, sized.size)
        return result

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        t0 = trio.current_time()
        data = await self.inner.get_range(key, start, length)
        await self._delay(t0, len(data))
        return data

    async def get_range_with(self, key: str, start: int, length: int, fn: Callable[[bytes | memoryview], T],
                             limiter: trio.CapacityLimiter) -> T:
        t0 = trio.current_time()
        sized = Sized(fn)
        result = await self.inner.get_range_with(key, start, length, sized, limiter)
        await self._delay(t0, sized.size)
        return result

    async def head(self, key: str) -> int:
        await self._delay(trio.current_time(), 0)
        return await self.inner.head(key)

    async def stat(self, key: str) -> ObjectInfo:
        await self._delay(trio.current_time(), 0)
        return await self.inner.stat(key)

    async def touch(self, key: str) -> None:
        await self._delay(trio.current_time(), 0)
        await self.inner.touch(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self._delay(trio.current_time(), len(data))
        await self.inner.put(key, data)

    async def put_new(self, key: str, data: bytes | memoryview) -> bool:
        await self._delay(trio.current_time(), len(data))
        return await self.inner.put_new(key, data)

    async def exists(self, key: str) -> bool:
        await self._delay(trio.current_time(), 0)
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        await self._delay(trio.current_time(), 0)
        await self.inner.delete(key)

    async def delete_if_older(self, key: str, before: float) -> bool:
        await self._delay(trio.current_time(), 0)
        return await self.inner.delete_if_older(key, before)

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        await self._delay(trio.current_time(), 0)
        return await self.inner.list(prefix, start_after, limit)

    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        await self._delay(trio.current_time(), 0)
        return await self.inner.list_info(prefix, start_after, limit)

    async def list_temporary(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        await self._delay(trio.current_time(), 0)
        return await self.inner.list_temporary(prefix, start_after, limit)
