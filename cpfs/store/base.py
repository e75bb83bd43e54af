"""The backing-store interface: a handful of async primitives on opaque keys.

Keys are '/'-separated ASCII names ("chunks/ab/ab12...", "manifests/..."). Stores know nothing of
chunks or manifests; everything above builds on these primitives.
"""
from __future__ import annotations

import abc


class Store(abc.ABC):
    """A key/value object store. Implementations must make `put` atomic: a reader sees the old object,
    the new one, or none, never a torn one."""

    name: str

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The whole object; raises NoSuchObject if absent."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes | memoryview) -> None:
        """Write atomically and durably (durable once this returns)."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove; absent keys are not an error (deletes are retried after partial failures)."""

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """All keys starting with `prefix`, sorted."""

    async def check(self) -> None:
        """Raise StoreUnavailable if the store cannot be used at all (checked at startup)."""

    async def aclose(self) -> None:
        """Release connections and threads."""
