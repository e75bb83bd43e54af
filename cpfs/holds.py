"""Holds: the versions a mount has open, kept from gc for as long as they stay open.

Why. A path keeps its newest keep_versions versions; the commit that makes a version too old retires it
(deletes its manifest, cpfs/catalog.py), and gc then deletes the chunks no kept version names. A process
that opened the version before that still reads it through its handle: an evaluator that holds
`latest.pt` open (or mapped, `mmap=True`) for hours while training saves it again every few minutes.
Without a hold, the first gc after the retirement deleted the chunks it had not read yet, and its next
read failed with EIO (SIGBUS under mmap). A write session is the same case: its commits name its base
version's unchanged chunks, and those of its own earlier commits, by reference, unchecked (cpfs/gc.py,
assumption 5).

What a mount does. One object per version it has open, `holds/<mount>.<n>.json` on every store: the
version's name (for people: "path@N") and the digests it names. So a hold costs what its version
weighs, and a mount with a 100 GB checkpoint open does not rewrite its 25,000 digests at every other
open.
- `take(manifest)` never waits: the open goes on at once. The hold is written DEFER seconds later if
  the version is still open then (`at_once`: now, for a write session's base), to every store in the
  background. So an open that lasts less than DEFER (a loader that reads a file and closes it, `ls`,
  `cp` of small files) costs no store request at all; a version already held costs nothing.
- `drop(token)` at the last close: the object is deleted DROP_DELAY later unless the version is taken
  again meanwhile.
- `run()` (the daemon's nursery) owns the writes and deletions, and renews every hold each
  lease/RENEW_PARTS (a touch: its mtime is its lease; a store that lost it gets it again). At unmount
  `aclose()` deletes them all.
- Renewals count on the pool's `ticks` (boot time), not trio's clock (CLOCK_MONOTONIC, which stops while
  the host is suspended, or a VM paused): a host that slept for most of a lease renews its holds within
  TICKS_WATCH of waking, not an interval of trio's clock later, when every hold's lease may have run out.
  A sleep longer than the lease cannot be helped (nothing runs to renew): it is counted and logged as an
  error naming the versions a gc meanwhile may have taken, as a hold no store took is. Likewise a hold
  whose write came late because the host slept after the open counts as late (below).
- Best effort: a store that refuses a write is logged and the others hold it (a store marked down is
  not asked: the pool logs it and probes it); gc reads every store. A hold no store took, or took
  later than SETTLE - DEFER after the open, is logged as an error: gc may take the version's chunks
  once newer commits retire it.

What gc does (`read_holds`). After it has read the manifests it waits SETTLE, then lists and reads every
hold on every store and counts its digests as referenced while the copy's mtime is within its lease. A
copy past its lease (its mount died, or stopped renewing for longer than that) no longer counts, and gc
deletes it. A hold it cannot list or read makes gc refuse to delete anything, as an unreadable manifest
does.

Why that is enough (the invariant). gc deletes a version's chunks only if it did not list the version:
the version was retired (at R) before gc listed its folder, so before gc finished reading (L), and gc
lists the holds at H >= L + SETTLE and deletes after that. A mount opened the version at O < R (it was
current then). If the handle is still open at O + DEFER, the hold is written then and on a store by
O + DEFER + d < O + SETTLE < H (d, the write's time, under SETTLE - DEFER: else the error above), so gc
counts it. If the handle closed before O + DEFER < H, the reader was done before gc deleted anything.
A write session's commits name its base's chunks after its close, so its base is held at once (lands
by O + d < H), and until the session ends. What is left: an open at O > R, of a version already retired
before gc listed the manifests, which the mount still showed because it had not looked at the stores
since (at most `[mount] refresh`: an open looks for newer versions that often).
"""
from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Hashable
from dataclasses import dataclass

import trio

from .errors import MALFORMED, ManifestError, NoSuchObject, StoreError
from .manifest import Manifest, metadata_check
from .pool import TICKS_WATCH, StorePool
from .sync import fan_out
from .upload import in_parallel

log = logging.getLogger(__name__)

PREFIX = "holds/"
FORMAT = 1
DEFER = 1.0               # seconds: a version still open this long after its open is held on the stores
SETTLE = 10.0             # seconds gc waits after reading the manifests before it lists the holds
DROP_DELAY = 2.0          # seconds: a version let go of is deleted this late (unless taken again)
RENEW_PARTS = 8           # every hold is touched again each lease / RENEW_PARTS
READS = 32                # holds gc reads at once


@dataclass(frozen=True)
class Hold:
    """One version's hold as stored: the lease (seconds) of the mount that holds it, the version (for
    people: "path@N") and the digests it names."""

    lease: float
    version: str
    chunks: frozenset[str]

    def to_bytes(self) -> bytes:
        fields = {"format": FORMAT, "lease": self.lease, "version": self.version, "chunks": sorted(self.chunks)}
        return json.dumps(fields | {"check": _check(fields)}, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, key: str, data: bytes) -> Hold:
        """ManifestError (bad stored metadata) if the object is not a hold of this format, or does not
        match its check (holds written before it had one have none): a digest with a flipped character
        passed, and gc deleted the chunk the held version names (gc refuses instead)."""
        try:
            doc = json.loads(data)
            lease, version, chunks = doc["lease"], doc["version"], doc["chunks"]
            ok = (doc.get("format") == FORMAT and isinstance(lease, (int, float)) and math.isfinite(lease)
                  and lease > 0 and isinstance(version, str) and isinstance(chunks, list)
                  and all(isinstance(c, str) and len(c) == 64 for c in chunks))
        except MALFORMED:
            ok = False
        if not ok:
            raise ManifestError(f"hold {key}: not a hold of format {FORMAT}")
        if "check" in doc and doc["check"] != _check({k: doc[k] for k in ("format", "lease", "version", "chunks")}):
            raise ManifestError(f"hold {key}: does not match its check: a damaged copy")
        return cls(float(lease), version, frozenset(chunks))


def _check(fields: dict[str, object]) -> str:
    return metadata_check(json.dumps(fields, separators=(",", ":")).encode())


@dataclass(frozen=True, kw_only=True)
class HoldStats:
    versions: int        # versions held now (open here)
    chunks: int          # distinct chunks they name
    objects: int         # holds written or being written (one let go of stays until DROP_DELAY ends)
    writes: int          # holds written (a store took them)
    skipped: int         # versions let go of before DEFER: no hold was written
    failed: int          # holds no store took: those versions were not protected from gc
    late: int            # holds a store took only after SETTLE - DEFER: a gc meanwhile may not have seen them
    renewed: int         # holds touched again (per store)
    deleted: int         # holds deleted once let go of (per store)
    lapsed: int          # renewals that came later than the lease (the host slept): holds gc may have missed


class _Held:
    """A version held: its object's key, users (takes not yet dropped), when its write is due, the
    write's end, and the stores that hold it."""

    __slots__ = ("manifest", "key", "users", "taken_at", "due", "writing", "settled", "stores", "left_at", "gone")

    def __init__(self, manifest: Manifest, key: str, now: float, tick: float) -> None:
        self.manifest = manifest
        self.key = key
        self.users = 0
        self.taken_at = tick              # the open, on the pool's ticks (boot time: a suspend counts)
        self.due = now + DEFER
        self.writing = False              # its write has started (then the stores may hold it)
        self.settled = trio.Event()       # set once every store's put of its latest write ended (a new
        #                                   one for each write, made when it is started)
        self.stores: set[str] = set()
        self.left_at: float | None = None   # trio time of the last drop, while no one uses it
        self.gone = False                   # let go of for good: its deletion has begun (`Holds._gone`)


def token_of(m: Manifest) -> Hashable:
    """What identifies a committed version (a path's version counter, its writer, its commit time)."""
    return (m.path, m.version, m.writer, m.committed_ns)


class Holds:
    """One mount's holds (see the module doc). `take` and `drop` from the event loop; `run` in the
    daemon's nursery writes them; `aclose` at unmount."""

    def __init__(self, pool: StorePool, *, lease: float | None = None, ident: str | None = None) -> None:
        self.pool = pool
        self.lease = pool.config.gc_grace if lease is None else lease
        self.ident = ident or secrets.token_hex(8)
        self._held: dict[Hashable, _Held] = {}
        self._serial = 0              # each held version's object gets a key of its own: a delete of
        #                               one let go of never races a put of the same version taken again
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self._writes = self._skipped = self._failed = self._late = self._renewed = self._deleted = 0
        self._lapsed = 0

    def statistics(self) -> HoldStats:
        used = [h for h in self._held.values() if h.users]
        return HoldStats(versions=len(used), chunks=len({c.digest for h in used for c in h.manifest.chunks}),
                         objects=sum(1 for h in self._held.values() if h.writing), writes=self._writes,
                         skipped=self._skipped, failed=self._failed, late=self._late,
                         renewed=self._renewed, deleted=self._deleted, lapsed=self._lapsed)

    def take(self, m: Manifest, *, at_once: bool = False) -> Hashable:
        """Hold version `m` until `drop` of the token returned: on the stores once it has been open
        for DEFER without a break (`at_once`: from now: a write session's base, see the module doc)."""
        token = token_of(m)
        now, tick = trio.current_time(), self.pool.ticks()
        h = self._held.get(token)
        if h is None:
            self._serial += 1
            h = self._held[token] = _Held(m, f"{PREFIX}{self.ident}.{self._serial}.json", now, tick)
        elif h.users == 0 and not h.writing:
            # Let go of and taken again before its write: DEFER counts from this open (the invariant
            # is about how long a version stays open without a break).
            h.taken_at, h.due = tick, now + DEFER
        h.users += 1
        h.left_at = None
        if at_once and not h.writing:
            h.due = min(h.due, now)
        self._wake.set()
        return token

    def drop(self, token: Hashable) -> None:
        """Let go of a take; the last one's hold is deleted DROP_DELAY later, unless taken again."""
        h = self._held[token]
        h.users -= 1
        if h.users == 0:
            h.left_at = trio.current_time()
            self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the holds that are due, renew every hold each lease/RENEW_PARTS, delete those let go of."""
        async with trio.open_nursery() as n:
            self._nursery = n
            task_status.started()
            every = self.lease / RENEW_PARTS
            renewed_at = self.pool.ticks()           # boot time (see the module doc)
            while True:
                self._wake = trio.Event()
                now, tick = trio.current_time(), self.pool.ticks()
                if tick - renewed_at >= every:
                    held = [h for h in self._held.values() if h.writing]
                    if tick - renewed_at > self.lease and held:
                        self._lapse(held, tick - renewed_at)
                    renewed_at = tick
                    n.start_soon(self._renew, held)
                times = [now + min(renewed_at + every - tick, TICKS_WATCH)]
                for token, h in list(self._held.items()):
                    if h.users == 0 and h.left_at is not None:
                        if h.left_at + DROP_DELAY > now:
                            times.append(h.left_at + DROP_DELAY)
                        elif h.writing:
                            n.start_soon(self._delete, self._gone(token))
                        else:
                            del self._held[token]
                            self._skipped += 1       # closed before DEFER: nothing to write or delete
                    elif not h.writing:
                        if h.due <= now:
                            h.writing = True
                            n.start_soon(self._write, h)
                        else:
                            times.append(h.due)
                with trio.move_on_at(min(times)):
                    await self._wake.wait()

    def _lapse(self, held: list[_Held], since: float) -> None:
        """Renewals came `since` seconds (boot time) after the last ones, past the lease: the host slept."""
        self._lapsed += 1
        log.error("the holds of this mount were last renewed %.0fs ago (the host was suspended or paused), past "
                  "their lease of %gs: a gc meanwhile may have deleted the chunks of %s, once newer commits retired "
                  "them; renewing them now", since, self.lease,
                  ", ".join(sorted(f"{h.manifest.path}@{h.manifest.version}" for h in held)))

    async def aclose(self) -> None:
        """At unmount: nothing is open any more, every hold goes."""
        held = [self._gone(token) for token, h in list(self._held.items()) if h.writing]
        self._held.clear()
        async with trio.open_nursery() as n:
            for h in held:
                n.start_soon(self._delete, h)

    def _gone(self, token: Hashable) -> _Held:
        """Let go of the hold for good, before its deletion starts: a renewal under way when it was
        let go of then neither writes it again (where the deletion came first, the touch finds no
        object) nor says a store lost it. Both did: the hold came back as an orphan until its lease
        ran out, after a false warning (the soak audit)."""
        h = self._held.pop(token)
        h.gone = True
        return h

    async def _write(self, h: _Held) -> None:
        """Put the version's hold on every store (logged: none took it, or too late for gc's SETTLE).
        Its caller gave it a fresh `settled`, before starting it."""
        m = h.manifest
        hold = Hold(self.lease, f"{m.path}@{m.version}", frozenset(c.digest for c in m.chunks))
        try:
            data = await trio.to_thread.run_sync(hold.to_bytes, limiter=self.pool.cpu)

            async def put(name: str) -> None:
                try:
                    await self.pool.put(name, h.key, data)
                except StoreError as e:
                    log.warning("store %r: could not write the hold %s of %s (%s)", name, h.key, hold.version, e)
                    return
                if not h.stores:          # the first store to take it (no store held it before)
                    self._writes += 1
                    took = self.pool.ticks() - h.taken_at
                    if took > SETTLE - DEFER:
                        self._late += 1
                        log.error("the hold %s of %s reached a store %.1fs after the open: a gc meanwhile "
                                  "may have missed it", h.key, hold.version, took)
                h.stores.add(name)
            await fan_out(put, self._up(), catch=())
            if not h.stores:
                self._failed += 1
                log.error("no store took the hold %s: gc may delete the chunks of %s once newer commits "
                          "retire it, while it is open here", h.key, hold.version)
        finally:
            h.settled.set()

    def _up(self) -> list[str]:
        """The stores to write holds to: those not marked down (the pool logs those, and probes them),
        or every store if all are."""
        return [n for n in self.pool.names if self.pool.is_up(n)] or list(self.pool.names)

    async def _renew(self, held: list[_Held]) -> None:
        """Touch every hold on the stores that have it (its mtime is its lease); put it again where a
        store lost it, or where no store took it."""
        again: set[_Held] = {h for h in held if not h.stores and h.settled.is_set()}

        async def renew(item: tuple[_Held, str]) -> None:
            h, name = item
            try:
                await self.pool.touch(name, h.key)
                self._renewed += 1
            except NoSuchObject:
                if h.gone:
                    return          # deleted meanwhile, as it should be
                log.warning("store %r lost the hold %s: writing it again", name, h.key)
                h.stores.discard(name)
                again.add(h)
            except StoreError as e:
                log.warning("store %r: could not renew the hold %s (%s): it lapses %gs after its last write",
                            name, h.key, e, self.lease)
        up = set(self._up())
        await fan_out(renew, [(h, name) for h in held for name in sorted(h.stores & up)], catch=())
        for h in again:
            if not h.gone and h.settled.is_set() and self._nursery is not None:
                h.settled = trio.Event()
                self._nursery.start_soon(self._write, h)

    async def _delete(self, h: _Held) -> None:
        """Delete a hold let go of, once no put of it is under way (else one could land after)."""
        await h.settled.wait()

        async def delete(name: str) -> None:
            try:
                await self.pool.delete(name, h.key)
                self._deleted += 1
            except NoSuchObject:
                pass
            except StoreError as e:
                log.warning("store %r: could not delete the hold %s (%s): it lapses after %gs", name, h.key,
                            e, self.lease)
        await fan_out(delete, sorted(h.stores), catch=())


@dataclass(frozen=True)
class Held:
    """What gc read from the holds: the digests live holds name, how many live copies, and the copies
    past their lease (store, key, lease)."""

    chunks: frozenset[str]
    live: int
    lapsed: tuple[tuple[str, str, float], ...]


async def read_holds(pool: StorePool, now: float) -> tuple[Held, list[str]]:
    """Every hold copy on every store of the pool (see the module doc), and what could not be listed or
    read (a problem: gc must not delete anything then). `now`: the wall clock that judges leases."""
    listed: list[tuple[str, str, float]] = []
    problems: list[str] = []

    async def listing(name: str) -> None:
        async for page in pool.iter_info(name, PREFIX):
            listed.extend((name, info.key, info.mtime) for info in page)

    out = await fan_out(listing, pool.names, catch=StoreError)
    problems += [f"store {name!r}: cannot list its holds: {e.detail}" for name, e in out.errors]
    chunks: set[str] = set()
    live = 0
    lapsed: list[tuple[str, str, float]] = []

    async def get(item: tuple[str, str, float]) -> None:
        nonlocal live
        name, key, mtime = item
        try:
            hold = Hold.parse(key, await pool.get(name, key))
        except NoSuchObject:
            return              # its mount let go of it since the listing
        except (StoreError, ManifestError) as e:
            problems.append(f"store {name!r}: hold {key} cannot be read: {e}")
            return
        if mtime + hold.lease < now:
            lapsed.append((name, key, hold.lease))
        else:
            live += 1
            chunks.update(hold.chunks)

    await in_parallel(get, listed, READS)
    return Held(frozenset(chunks), live, tuple(lapsed)), problems
