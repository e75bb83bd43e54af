"""The backing-store interface: a handful of async primitives on opaque keys, and the base wrapper.

Keys are '/'-separated ASCII names ("chunks/ab/ab12...", "manifests/..."). Stores know nothing of
chunks or manifests; everything above builds on these primitives, through the StorePool only.
No part of a key is empty or starts with a dot (`foreign`): names like that in a folder or bucket are
other tools' (Finder's .DS_Store, rsync's temporaries, NFS's .nfsXXXX, a filer's .snapshot, an S3
console's "folder/" marker). Stores refuse them as keys and leave them out of listings, so that
gc does not refuse to run while one sits among the manifests, holds or roster.
Every object has an age (`stat`, `list_info`: its mtime by the store's clock), which `touch` renews
and `delete_if_older` judges: the garbage collector's primitives (cpfs/gc.py).

A store is a stack: a kind (a folder, an S3 bucket) wrapped by behaviours (a simulated link, injected
faults, metering), each a `StoreWrapper` that overrides only what it changes.

Errors: every method raises StoreError subclasses only (NoSuchObject, StoreFull, StoreDenied,
StoreUnavailable), and the kind sets `transient` on the ones a retry may cure. Stores never retry and
never time out on their own: the pool does both, so a store method must be cancellable at any await
(a kind that blocks in a thread abandons the thread on cancellation).
"""
from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

from ..errors import NoSuchObject, StoreError
from ..sync import fan_out

T = TypeVar("T")


def foreign(key: str) -> bool:
    """Whether a name in a store can be no key of ours: a part of it is empty or starts with a dot."""
    return any(not part or part.startswith(".") for part in key.split("/"))


def foreign_prefix(prefix: str) -> bool:
    """Like `foreign` for a listing's prefix, which may be empty or end in '/'."""
    return bool(prefix) and foreign(prefix[:-1] if prefix.endswith("/") else prefix)


@dataclass(frozen=True)
class ObjectInfo:
    """An object as `stat` and `list_info` see it. `mtime` (seconds since the epoch, by the store's
    clock) is when it was last written or touched: the garbage collector's measure of age (cpfs/gc.py)."""
    key: str
    size: int
    mtime: float
    tag: str = ""       # the store's entity tag of these bytes and this age (S3's ETag); "" if none


@dataclass(frozen=True)
class Capacity:
    """A store's space as `capacity` sees it: `total` and `free` bytes (free: what this process may
    still write, e.g. statvfs f_bavail). `shared` names the space when several stores may draw on the
    same one (a folder store: its filesystem's device), so the pool counts that space once."""
    total: int
    free: int
    shared: str = ""


class Sized(Generic[T]):
    """A `get_with` fn that remembers the size of the object it was given: for wrappers that count
    or pace the bytes of a read whose object they never hold."""

    def __init__(self, fn: Callable[[bytes | memoryview], T]) -> None:
        self.fn = fn
        self.size = 0

    def __call__(self, data: bytes | memoryview) -> T:
        self.size = len(data)
        return self.fn(data)


class Store(abc.ABC):
    """A key/value object store. Implementations must make `put` atomic: a reader sees the old object,
    the new one, or none, never a torn one."""

    name: str
    # The keys one listing request asks for (the pool's pages): S3 answers 1000 at most.
    list_limit: int = 1000

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The whole object; raises NoSuchObject if absent."""

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes [start, start+length) of the object, short at its end (empty past it);
        NoSuchObject if absent."""

    async def get_with(self, key: str, fn: Callable[[bytes | memoryview], T], limiter: trio.CapacityLimiter) -> T:
        """fn(the whole object), computed in a worker thread: e.g. decode and verify a chunk. Here `get`,
        then fn in a thread under `limiter`. A kind that reads in a worker thread anyway overrides it
        to run fn in that same thread right after the read (one hand-off per object instead of two),
        maybe on a reused buffer: fn may keep views of its argument (a buffer is reused only once
        nothing refers to it), but must not write to it. Exceptions of fn propagate as they are.
        NoSuchObject if absent."""
        data = await self.get(key)
        return await trio.to_thread.run_sync(fn, data, limiter=limiter)

    async def get_range_with(self, key: str, start: int, length: int, fn: Callable[[bytes | memoryview], T],
                             limiter: trio.CapacityLimiter) -> T:
        """fn(`get_range`'s bytes), computed in a worker thread: e.g. check a chunk's blocks. As
        `get_with`: here the range, then fn in a thread under `limiter`; a kind that reads in a worker
        thread overrides it to run fn in that thread (one hand-off instead of two: a 256 KiB block
        from a folder store in memory took 0.45 ms instead of 0.56)."""
        data = await self.get_range(key, start, length)
        return await trio.to_thread.run_sync(fn, data, limiter=limiter)

    async def get_many_with(self, reads: Sequence[tuple[str, Callable[[bytes | memoryview], T]]],
                            limiter: trio.CapacityLimiter) -> list[T | StoreError]:
        """For each (key, fn), fn(the whole object), in order; a key that fails has its StoreError in
        its place (one missing object does not fail the others). The batch read behind prefetches of
        many small chunks: a kind that can read several objects in one worker thread overrides it (one
        hand-off per batch instead of one per object). Here each key's `get_with`, all at once."""
        out = await fan_out(lambda k: self.get_with(reads[k][0], reads[k][1], limiter), range(len(reads)),
                            catch=StoreError)
        return out.outcomes(range(len(reads)))  # type: ignore[return-value]  # only StoreErrors caught

    async def head(self, key: str) -> int:
        """The stored size of the object; NoSuchObject if absent."""
        return (await self.stat(key)).size

    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo:
        """Size and age of the object; NoSuchObject if absent."""

    @abc.abstractmethod
    async def touch(self, key: str) -> None:
        """Make the object's mtime now (the store's clock), its bytes unchanged; NoSuchObject if absent.
        Dedup touches an old copy it reuses, so that a concurrent gc spares it (cpfs/gc.py)."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes | memoryview) -> None:
        """Write atomically and durably (durable once this returns); replaces an existing object."""

    async def put_new(self, key: str, data: bytes | memoryview) -> bool:
        """`put` only if no object has the key: True if this call wrote it, False if one was there
        (left as it is). For the few objects whose first writer wins (a deployment's identity, minted
        once: cpfs/identity.py). Here `exists`, then `put`: two callers racing may both write. The
        kinds do it atomically (a hard link on a folder, If-None-Match on S3)."""
        if await self.exists(key):
            return False
        await self.put(key, data)
        return True

    async def exists(self, key: str) -> bool:
        try:
            await self.head(key)
        except NoSuchObject:
            return False
        return True

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove; absent keys are not an error (deletes are retried after partial failures)."""

    async def delete_if_older(self, key: str, before: float) -> bool:
        """Delete the object if its mtime is before `before` (seconds since the epoch); True if this call
        deleted it, False if it is absent or younger. Here a stat, then a delete: a touch that lands
        between the two is lost with the object. Kinds that can do better override it (the folder store
        claims the object by a rename and checks its age after that; S3 deletes only while the ETag
        is the one judged old)."""
        if await self.older(key, before) is None:
            return False
        await self.delete(key)
        return True

    async def older(self, key: str, before: float) -> ObjectInfo | None:
        """The object's info if its mtime is before `before`; None if it is absent or younger: the
        judgement of `delete_if_older`."""
        try:
            info = await self.stat(key)
        except NoSuchObject:
            return None
        return info if info.mtime < before else None

    @abc.abstractmethod
    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        """One page: the first `limit` keys (sorted) that start with `prefix` and sort after
        `start_after`. A page shorter than `limit` is the last one."""

    @abc.abstractmethod
    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        """`list`, with each key's size and mtime."""

    async def list_temporary(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        """One page, as `list_info`, of what interrupted puts left behind (the folder store's temporary
        files), named so that `delete_if_older` removes them. Kinds whose puts leave nothing have none."""
        return []

    async def capacity(self) -> Capacity | None:
        """The store's total and free space, or None when it has none to report (an S3 bucket has no
        quota). Read by statfs (cpfs/pool.py StorePool.capacity)."""
        return None

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
        self.list_limit = inner.list_limit

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        return await self.inner.get_range(key, start, length)

    async def get_with(self, key: str, fn: Callable[[bytes | memoryview], T], limiter: trio.CapacityLimiter) -> T:
        """The inner store's `get_with`, unless this wrapper changes `get` (faults, latency, metering):
        then its `get` and fn in a second thread, so that what `get` does is never skipped. A wrapper
        that can do better overrides this (MeteredStore, ThrottledStore)."""
        if type(self).get is not StoreWrapper.get:
            return await Store.get_with(self, key, fn, limiter)
        return await self.inner.get_with(key, fn, limiter)

    async def get_range_with(self, key: str, start: int, length: int, fn: Callable[[bytes | memoryview], T],
                             limiter: trio.CapacityLimiter) -> T:
        """As `get_with`, for `get_range`: the inner store's, unless this wrapper changes `get_range`."""
        if type(self).get_range is not StoreWrapper.get_range:
            return await Store.get_range_with(self, key, start, length, fn, limiter)
        return await self.inner.get_range_with(key, start, length, fn, limiter)

    async def get_many_with(self, reads: Sequence[tuple[str, Callable[[bytes | memoryview], T]]],
                            limiter: trio.CapacityLimiter) -> list[T | StoreError]:
        """The inner store's batch read, unless this wrapper changes `get` or `get_with`: then each
        key through this wrapper's `get_with`, so that what it does to a read happens to every key."""
        if type(self).get is not StoreWrapper.get or type(self).get_with is not StoreWrapper.get_with:
            return await Store.get_many_with(self, reads, limiter)
        return await self.inner.get_many_with(reads, limiter)

    async def head(self, key: str) -> int:
        return await self.inner.head(key)

    async def stat(self, key: str) -> ObjectInfo:
        return await self.inner.stat(key)

    async def touch(self, key: str) -> None:
        await self.inner.touch(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self.inner.put(key, data)

    async def put_new(self, key: str, data: bytes | memoryview) -> bool:
        """The inner store's (atomic there): a wrapper that changes `put` overrides this too."""
        return await self.inner.put_new(key, data)

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def delete_if_older(self, key: str, before: float) -> bool:
        return await self.inner.delete_if_older(key, before)

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        return await self.inner.list(prefix, start_after, limit)

    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        return await self.inner.list_info(prefix, start_after, limit)

    async def list_temporary(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        return await self.inner.list_temporary(prefix, start_after, limit)

    async def capacity(self) -> Capacity | None:
        return await self.inner.capacity()

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

