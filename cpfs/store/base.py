"""The backing-store interface: a handful of async primitives on opaque keys, and the base wrapper.

Keys are '/'-separated ASCII names ("chunks/ab/ab12...", "manifests/..."). Stores know nothing of
chunks or manifests; everything above builds on these primitives, through the StorePool only.

A store is a stack: a kind (a folder, an S3 bucket) wrapped by behaviours (a simulated link, injected
faults, metering), each a `StoreWrapper` that overrides only what it changes.

Errors: every method raises StoreError subclasses only (NoSuchObject, StoreFull, StoreDenied,
StoreUnavailable), and the kind sets `transient` on the ones a retry may cure. Stores never retry and
never time out on their own: the pool does both, so a store method must be cancellable at any await
(a kind that blocks in a thread abandons the thread on cancellation).
"""
from __future__ import annotations

import abc

from ..errors import NoSuchObject


class Store(abc.ABC):
    """A key/value object store. Implementations must make `put` atomic: a reader sees the old object,
    the new one, or none, never a torn one."""

    name: str

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The whole object; raises NoSuchObject if absent."""

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes [start, start+length) of the object, short at its end (empty past it);
        NoSuchObject if absent."""

    @abc.abstractmethod
    async def head(self, key: str) -> int:
        """The stored size of the object; NoSuchObject if absent."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes | memoryview) -> None:
        """Write atomically and durably (durable once this returns); replaces an existing object."""

    async def exists(self, key: str) -> bool:
        try:
            await self.head(key)
        except NoSuchObject:
            return False
        return True

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove; absent keys are not an error (deletes are retried after partial failures)."""

    @abc.abstractmethod
    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        """One page: the first `limit` keys (sorted) that start with `prefix` and sort after
        `start_after`. A page shorter than `limit` is the last one."""

    async def check(self) -> None:
        """Raise StoreError if the store cannot be used (at startup, and to probe a store marked down):
        transient if it may come back, permanent if the configuration is wrong."""

    async def aclose(self) -> None:
        """Release connections and threads."""


class StoreWrapper(Store):
    """A behaviour around another store. Forwards every method explicitly, so a subclass overrides
    only what it changes and a new Store method cannot be silently skipped by a wrapper."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.name = inner.name

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        return await self.inner.get_range(key, start, length)

    async def head(self, key: str) -> int:
        return await self.inner.head(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self.inner.put(key, data)

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        return await self.inner.list(prefix, start_after, limit)

    async def check(self) -> None:
        await self.inner.check()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def innermost(self) -> Store:
        """The kind at the bottom of the stack (for tests and `repr`)."""
        store = self.inner
        while isinstance(store, StoreWrapper):
            store = store.inner
        return store

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

