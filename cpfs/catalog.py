"""Manifests on the stores: commit, look up, list, remove.

A manifest lives under a key derived from its path, on `replicas` stores chosen by placement; it is
written after every chunk it names is durable, so no manifest ever points at missing chunks. Readers
take the highest `version` among the copies they find, so a partially replicated commit still reads as
either the old or the new file, never a mix.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import trio

from .errors import ManifestError, NoSuchObject, NotFound, StoreError
from .manifest import Manifest, manifest_key
from .placement import place
from .pool import StorePool

log = logging.getLogger(__name__)
PREFIX = "manifests/"


def new_version() -> int:
    """Commit time in ns: later commits of a path win."""
    return time.time_ns()


class Catalog:
    def __init__(self, pool: StorePool) -> None:
        self.pool = pool

    async def commit(self, manifest: Manifest) -> None:
        """Make `manifest` the current version of its path (on write_quorum stores at least)."""
        key = manifest_key(manifest.path)
        data = manifest.to_bytes()
        targets = place(key, self.pool.names, self.pool.config.replicas)
        done: list[str] = []
        errors: list[StoreError] = []

        async def one(name: str) -> None:
            try:
                await self.pool.put(name, key, data)
                done.append(name)
            except StoreError as e:
                errors.append(e)

        async with trio.open_nursery() as n:
            for name in targets:
                n.start_soon(one, name)
        if len(done) < self.pool.config.write_quorum:
            # Below quorum the commit failed: take back the copies that landed, or a reader that finds
            # one would see a version the writer was told did not commit.
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as n:
                    for name in done:
                        n.start_soon(self._delete_quietly, name, key)
            raise errors[0]

    async def _delete_quietly(self, name: str, key: str) -> None:
        try:
            await self.pool.delete(name, key)
        except StoreError as e:
            log.warning("could not take back manifest %s on store %r: %s", key, name, e)

    async def _copies(self, key: str, names: list[str]) -> list[Manifest]:
        found: list[Manifest] = []

        async def one(name: str) -> None:
            try:
                data = await self.pool.get(name, key)
                # A manifest of a 100 GB file is megabytes of JSON: parse it off the event loop.
                found.append(await trio.to_thread.run_sync(Manifest.from_bytes, data, f"store {name!r} {key}",
                                                           limiter=self.pool.cpu))
            except NoSuchObject:
                pass
            except (StoreError, ManifestError) as e:
                log.warning("manifest %s on store %r unreadable: %s", key, name, e)

        async with trio.open_nursery() as n:
            for name in names:
                n.start_soon(one, name)
        return found

    async def get(self, path: str) -> Manifest:
        copies = await self._copies(manifest_key(path), self.pool.names)
        copies = [m for m in copies if m.path == path]
        if not copies:
            raise NotFound(f"no file {path!r}")
        return max(copies, key=lambda m: m.version)

    async def load_all(self) -> dict[str, Manifest]:
        """Every committed file: path -> newest manifest. Unreadable stores or manifests are logged
        and skipped, as long as some replica answers."""
        where: dict[str, list[str]] = {}

        async def scan(name: str) -> None:
            try:
                for key in await self.pool.stores[name].list(PREFIX):
                    where.setdefault(key, []).append(name)
            except StoreError as e:
                log.warning("cannot list manifests on store %r: %s", name, e)

        async with trio.open_nursery() as n:
            for name in self.pool.names:
                n.start_soon(scan, name)
        out: dict[str, Manifest] = {}
        limiter = trio.CapacityLimiter(32)

        async def fetch(key: str, names: list[str]) -> None:
            async with limiter:
                for m in await self._copies(key, names):
                    if m.path not in out or m.version > out[m.path].version:
                        out[m.path] = m

        async with trio.open_nursery() as n:
            for key, names in where.items():
                n.start_soon(fetch, key, names)
        return out

    async def remove(self, path: str) -> None:
        """Delete every copy of a path's manifest (its chunks stay for other files that share them)."""
        key = manifest_key(path)
        await self.get(path)
        async with trio.open_nursery() as n:
            for name in self.pool.names:
                n.start_soon(self.pool.delete, name, key)

    async def move(self, manifest: Manifest, path: str) -> Manifest:
        """Commit `manifest` under a new path (same chunks, new version), then drop the old path.
        A crash in between leaves both paths, never neither."""
        moved = dataclasses.replace(manifest, path=path, version=max(new_version(), manifest.version + 1))
        await self.commit(moved)
        await self.remove(manifest.path)
        return moved
