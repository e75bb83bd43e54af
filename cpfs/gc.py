"""Garbage collection (`cpfs gc`): delete the chunks no kept version names, and what crashed puts left.

What is garbage. Every key under `manifests/` on every store is a version that is kept: ok, failed and
deleted versions alike, and format-1 manifests. The chunks they name (by digest, whichever store holds
a copy) are referenced. Any other chunk is garbage once it is older than the grace: chunks of retired
versions, of uploads a writer superseded before committing, of commits that failed. So are the
temporary files of puts that a crash interrupted (folder stores). Keys that are neither are left alone.
Except a removed path's history once it has expired: a path whose newest version, alone at its order
and counting, is a removal committed more than keep_removed ago is purged (every version of it
deleted, before the sweep) and its versions name nothing. A path with anything newer is never purged.
After the purge gc lists those folders again and reads what was committed there meanwhile. A restore
of a purged version that read it before the purge touches its chunks' copies before committing
(Catalog.restore), so a sweep that no longer counts them spares them, as it spares dedup's reuse.
The versions that mounts have open are referenced too, retired or not: each mount's holds name them
(cpfs/holds.py). gc lists the holds SETTLE (10 s) after it has read the manifests, so that a hold on
its way to the stores is there, and counts those within their lease.

Order, and why. Commits in other mounts run while gc does: a commit checks that the chunks it will name
are on their stores (dedup, StorePool.store_chunk), then writes its manifest, and gc may look at such a
chunk in between, when nothing names it yet. So gc
  1. notes the time t0 and sets cutoff = t0 - grace (wall clock: ages are store mtimes);
  2. lists every manifest key on every store and reads each once: the referenced digests R; waits
     SETTLE, then adds the digests of the mounts' live holds (cpfs/holds.py) to R;
  3. only then lists the chunks with their mtimes, and deletes each one that is not in R and older than
     the cutoff with `delete_if_older(cutoff)`, which judges the age again at the moment of deletion;
     then the temporary files older than the cutoff.
Transaction records (cpfs/catalog.py) are listed before the manifests, and one that no listed version
names is deleted, with its void marker: all of a transaction's versions are written before its record,
so a record listed first whose versions are not in the listing that follows has had them all retired.
A version of a transaction that has no record in that first listing (or a void marker there) and was
written before the cutoff is abandoned (its writer died before the commit point: assumption 1 bounds
a commit's duration; or its commit failed) and is deleted. A void marker stays while a version names
its transaction, so a record that could not be deleted never counts again.

Invariant: from the moment a commit checks a chunk copy until it writes its manifest at t_m, the copy's
mtime stays after t - grace at every moment t. Mounts keep it: dedup touches a copy it reuses when the
copy is older than gc_grace/2 on its store's clock (StorePool._kept measures that clock with a probe
object, `clock/`, so a mount's own may be off), so after the check its mtime is at most gc_grace/2 old
(a new copy is newer still); while the file stays open, its uploader touches again every copy that
reaches gc_grace/2, looking every gc_grace/8 (cpfs/upload.py: Renewal), so no copy it counts on gets
older than 5/8 of gc_grace (plus a renewal pass); and before writing the manifest it renews what is due,
so at t_m every such copy is younger than gc_grace/2; grace >= gc_grace (assumption 3). Hence a chunk a
commit counts on is never deleted: if the manifest was written before gc listed its folder, the chunk
is in R; if after, the copy's mtime is after t0 - grace = cutoff when gc judges it: delete_if_older
spares it. A mount that could not renew (frozen, or cut off from a store, for longer than the grace)
finds the copies gone at its commit's renewal and stores them again, or fails the commit.
A touch that lands inside delete_if_older, between its age check and the deletion, remains: on folder
stores that moment does not exist (the store claims the file by a rename before it judges the age,
and dedup looks the copy up again after touching it: a copy a claim took is "missing" and written
again); on S3, which has no delete conditional on age, the DELETE is conditional on the ETag the HEAD
saw (If-Match), and a touch changes the ETag (cpfs/store/s3.py), so the moment does not exist there
either, however late the server carries the DELETE out (an unconditional one that an overloaded gateway
carried out after the pool had given up on it deleted a copy a save had touched and committed since:
an audit's find). A server without conditional deletes leaves one request round trip.

A listed version that is gone when gc reads it was retired by a newer commit of its path (or was the
key of a commit that failed and took it back). That newer commit may name the chunks without having
checked them (`cpfs restore` commits an old version's chunks as they are), so gc lists that path's
folder again and reads what is new there. If a store's manifests cannot be listed, or a version cannot
be read from any store that lists it, gc deletes nothing and says which: it cannot know what that
version names.

Assumptions (the caveats):
1. A commit's renewals run: the mount (or `cpfs put`) that holds the file open touches the copies it
   counts on on time (Renewal), or, when it could not, renews them at its commit before the manifest.
   A save may take as long as it takes. What remains is the renewal's own race on S3 (one round trip,
   as for dedup's touch below) and a transaction's duration: a rename's or link's versions are written
   before its record, within gc_grace/2 (abandoned versions, above).
2. The clocks of the stores' hosts (file servers, S3 endpoints) and of the host running gc agree within
   a margin well below gc_grace/2. Writers' clocks need not: a version's age (a removal's, for the
   purge; a transaction's, for abandonment) counts from the later of its `committed_ns` and its
   newest copy's store mtime.
3. gc's grace is at least the gc_grace of every mount's config (a mount touches only copies older than
   half of its own): `cpfs gc` refuses a `--grace` below its own config's gc_grace, and raises it to the
   longest gc_grace the stores' roster holds (cpfs/roster.py: every writer enrolls its config).
4. gc runs with the mounts' stores (their config): it refuses while the roster names a store its config
   lacks, or a store it has lists nothing although the roster names it (an unmounted filesystem).
   And a listing shows every key written before it began (folders; S3 and current RGW/MinIO are
   strongly consistent).
5. A file written through a mount without O_TRUNC commits its unchanged base chunks by reference,
   unchecked, and a session's later commits the chunks its earlier ones named: the mount holds the
   version the session's next commit builds on for as long as the session runs (cpfs/holds.py), so
   those are referenced even once ≥ keep_versions commits of the same path from other mounts have
   retired it. What is left is a hold's own window (its module doc) and a mount stopped for longer
   than its lease.
"""
from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import trio

from . import holds, identity, roster
from .catalog import TXN_PREFIX, VersionRef, txn_key, txns_listed
from .errors import ManifestError, NoSuchObject, StoreError
from .manifest import Manifest
from .pool import StorePool
from .store import ObjectInfo
from .store.directory import is_claim
from .sync import fan_out
from .upload import in_parallel

log = logging.getLogger(__name__)

MANIFESTS = "manifests/"
CHUNKS = "chunks/"
_CHUNK_KEY = re.compile(r"chunks/([0-9a-f]{2})/(\1[0-9a-f]{62})")
_FOLDER = re.compile(r"(manifests/[0-9a-f]{40})(?:/[^/]+|\.json)")
_READS = 32           # manifests read at once
_DELETES = 16         # deletions in flight per store
_RELISTS = 8          # rounds of re-listing folders whose versions vanished, before giving up


@dataclass(frozen=True)
class StoreSweep:
    """What gc did on one store (on a dry run: what it would have deleted)."""
    name: str
    chunks: int               # chunk objects listed
    deleted: int              # unreferenced chunks older than the grace, deleted
    deleted_bytes: int
    young: int                # unreferenced chunks kept: younger than the grace (or touched meanwhile)
    young_bytes: int
    temporary: int            # temporary files of interrupted puts older than the grace, deleted
    temporary_bytes: int
    errors: int               # requests that failed: the objects concerned stay, for the next run


@dataclass(frozen=True)
class GcReport:
    grace: float              # seconds
    dry_run: bool
    manifests: int            # version keys read
    referenced: int           # distinct chunks they name
    refused: str              # why nothing was deleted; "" if the sweep ran
    stores: tuple[StoreSweep, ...]
    transactions: int = 0     # transaction records that no version names any more, deleted
    abandoned: int = 0        # versions of transactions that never committed, older than the grace, deleted
    purged: int = 0           # removed paths whose history (every version) was deleted after keep_removed
    holds: int = 0            # live holds read (cpfs/holds.py: versions mounts have open)
    held: int = 0             # chunks no kept version names that live holds kept
    failed: int = 0           # deletions of records, histories and lapsed holds that failed (logged)

    @property
    def ok(self) -> bool:
        """It ran and every request succeeded (`cpfs gc` exits 1 otherwise: a cron job that cannot
        delete, a full store never freed, is seen)."""
        return not self.refused and not self.failed and not any(s.errors for s in self.stores)

    @property
    def freed_objects(self) -> int:
        return sum(s.deleted + s.temporary for s in self.stores)

    @property
    def freed_bytes(self) -> int:
        return sum(s.deleted_bytes + s.temporary_bytes for s in self.stores)

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "grace": self.grace, "manifests": self.manifests,
                "referenced_chunks": self.referenced, "refused": self.refused or None,
                "freed_objects": self.freed_objects, "freed_bytes": self.freed_bytes,
                "transactions": self.transactions, "abandoned": self.abandoned, "purged": self.purged,
                "holds": self.holds, "held_chunks": self.held, "failed": self.failed,
                "stores": [{f.name: getattr(s, f.name) for f in fields(s)} for s in self.stores]}

    def lines(self, size: Callable[[float], str] = lambda n: f"{int(n)} B") -> list[str]:
        """The report for a terminal; `size` formats byte counts."""
        head = (f"gc: read {self.manifests} version(s), naming {self.referenced} chunk(s); "
                f"grace {_duration(self.grace)}" + ("; dry run, nothing deleted" if self.dry_run else ""))
        if self.refused:
            return [head, f"refused, nothing deleted: {self.refused}"]
        verb = "would delete" if self.dry_run else "deleted"
        out = [head]
        for s in self.stores:
            out.append(f"  {s.name}: {verb} {s.deleted} chunks ({size(s.deleted_bytes)}) and {s.temporary} "
                       f"temporary files ({size(s.temporary_bytes)}); kept {s.young} unreferenced chunks "
                       f"younger than the grace ({size(s.young_bytes)}); {s.chunks} chunks listed"
                       + (f"; {s.errors} requests failed" if s.errors else ""))
        out.append(f"{'would free' if self.dry_run else 'freed'} {self.freed_objects} objects, "
                   f"{size(self.freed_bytes)}; {self.transactions} transaction records no version names, "
                   f"{self.abandoned} versions of transactions that never committed; {self.purged} removed "
                   f"paths' history purged (removed longer than keep_removed ago); {self.held} chunks kept "
                   f"for versions that mounts have open ({self.holds} holds)"
                   + (f"; {self.failed} deletions of records, histories or holds failed" if self.failed else ""))
        return out


def _duration(seconds: float) -> str:
    for unit, n in (("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


class _Tally:
    """A StoreSweep being counted."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.chunks = self.deleted = self.deleted_bytes = self.young = self.young_bytes = 0
        self.temporary = self.temporary_bytes = self.errors = 0

    def snapshot(self) -> StoreSweep:
        return StoreSweep(name=self.name, chunks=self.chunks, deleted=self.deleted,
                          deleted_bytes=self.deleted_bytes, young=self.young, young_bytes=self.young_bytes,
                          temporary=self.temporary, temporary_bytes=self.temporary_bytes, errors=self.errors)


class GarbageCollector:
    """One gc run over the pool's stores (see the module doc); `run()` returns its report.
    `grace` is not checked against any floor here (tests use 0): `cpfs gc` enforces the config's, and
    the stores' roster (cpfs/roster.py) raises it to the longest gc_grace any writer enrolled.
    `forget`: stores retired for good, whose enrollments leave the roster (not in a dry run)."""

    def __init__(self, pool: StorePool, *, grace: float, dry_run: bool = False,
                 forget: Collection[str] = (), keep_removed: float | None = None,
                 settle: float = holds.SETTLE) -> None:
        """`keep_removed`: how long a removed path keeps its history (default: the config's; the
        roster may lengthen it). `settle`: the wait between reading the manifests and listing the
        holds (cpfs/holds.py: tests with no mount pass 0)."""
        self.pool = pool
        self.settle = settle
        self.grace = grace
        self.dry_run = dry_run
        self.forget = frozenset(forget)
        self.keep_removed = pool.config.keep_removed if keep_removed is None else keep_removed
        self.purged = 0                                 # removed paths purged by this run
        self._failed = 0                                # deletions outside the sweep that failed
        self._written: dict[str, float] = {}            # key -> its newest copy's store mtime (`_list`)

    async def _checked_roster(self) -> str:
        """Why gc must not run with this config ("" if it may), after the roster's grace is taken."""
        if why := identity.problem(self.pool, await identity.read(self.pool)):
            return why
        listed, problems = await roster.read(self.pool)
        if problems:
            return "; ".join(problems)
        if wrong := sorted(self.forget & set(self.pool.names)):
            return f"--forget-store {', '.join(wrong)}: in this config, so not retired"
        if missing := sorted(listed.stores - set(self.pool.names) - self.forget):
            return (f"the mounts of these stores also use store(s) {', '.join(missing)} (their roster, "
                    f"{roster.PREFIX}), which this config lacks: versions whose manifests live there would "
                    f"go unseen and their chunks be deleted. Run gc with the mounts' config; once a store "
                    f"is retired for good (`cpfs scrub --repair` moved its copies), `cpfs gc "
                    f"--forget-store NAME`")
        if blank := await roster.blank(self.pool, listed):
            return (f"{roster.describe_blank(self.pool, blank)}: versions whose manifests live there would "
                    f"go unseen and their chunks be deleted")
        if not listed.enrollments:
            log.warning("gc: no store holds a roster yet (no mount or put of this version wrote to them): "
                        "it cannot check that this config names every store the mounts use")
        if listed.gc_grace > self.grace:
            log.info("gc: grace %gs, the longest gc_grace a writer of these stores enrolled (asked: %gs)",
                     listed.gc_grace, self.grace)
            self.grace = listed.gc_grace
        if listed.keep_removed > self.keep_removed:
            log.info("gc: removed paths keep their history %gs, the longest keep_removed a writer of these "
                     "stores enrolled (asked: %gs)", listed.keep_removed, self.keep_removed)
            self.keep_removed = listed.keep_removed
        if self.forget and not self.dry_run:
            n = await roster.forget(self.pool, listed, self.forget)
            log.info("gc: store(s) %s left the roster (%d enrollments deleted)", ", ".join(sorted(self.forget)), n)
        return ""

    async def run(self) -> GcReport:
        """The three steps of the module doc, or a refusal after the second."""
        try:
            refused = await self._checked_roster()
        except StoreError as e:
            refused = str(e)
        if refused:
            log.error("gc refused, nothing deleted: %s", refused)
            return GcReport(grace=self.grace, dry_run=self.dry_run, manifests=0, referenced=0, refused=refused,
                            stores=())
        cutoff = time.time() - self.grace               # before any listing: see the invariant
        records, problems = await self._list([TXN_PREFIX])      # before the manifests: see the doc
        listed, void = txns_listed(records)
        committed = listed - void
        referenced, read, named, abandoned, more = await self._references(committed, cutoff)
        problems += more
        held, more = holds.Held(frozenset(), 0, ()), []
        if not problems:          # SETTLE after the manifests were read: see cpfs/holds.py
            await trio.sleep(self.settle)
            held, more = await holds.read_holds(self.pool, time.time())
        problems += more
        kept = held.chunks - referenced
        referenced |= kept
        report = dict(grace=self.grace, dry_run=self.dry_run, manifests=read, referenced=len(referenced))
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            log.error("gc refused, nothing deleted: %s", shown)
            return GcReport(**report, refused=shown, stores=())
        named_keys = {txn_key(t, void) for t in named for void in (False, True)}
        report["purged"] = self.purged
        report["holds"], report["held"] = held.live, len(kept)
        await self._lapsed(held.lapsed)
        report["transactions"] = await self._delete({k: v for k, v in records.items() if k not in named_keys})
        report["abandoned"] = await self._delete(abandoned)
        tallies = {name: _Tally(name) for name in self.pool.names}
        async with trio.open_nursery() as n:
            for name in self.pool.names:
                n.start_soon(self._sweep, tallies[name], referenced, cutoff)
        out = GcReport(**report, refused="", failed=self._failed, stores=tuple(t.snapshot() for t in tallies.values()))
        log.info("gc%s: %d versions name %d chunks; %s %d objects, %d bytes", " (dry run)" if self.dry_run else "",
                 read, len(referenced), "would free" if self.dry_run else "freed", out.freed_objects,
                 out.freed_bytes)
        return out

    # -- what is referenced ------------------------------------------------------------------------
    async def _list(self, prefixes: Iterable[str]) -> tuple[dict[str, list[str]], list[str]]:
        """key -> the stores listing it, for every prefix on every store; and what could not be listed.
        Notes when each key was last written to a store (`_written`)."""
        where: dict[str, list[str]] = {}
        prefixes = list(prefixes)

        async def one(name: str) -> None:
            for prefix in prefixes:
                async for infos in self.pool.iter_info(name, prefix):
                    for info in infos:
                        where.setdefault(info.key, []).append(name)
                        self._written[info.key] = max(self._written.get(info.key, 0.0), info.mtime)

        out = await fan_out(one, self.pool.names, catch=StoreError)
        return where, [f"store {name!r}: cannot list the manifests: {e.detail}" for name, e in out.errors]

    async def _delete(self, keys: dict[str, list[str]]) -> int:
        """Delete each key on the stores that listed it (transaction records, abandoned versions);
        how many keys."""
        if self.dry_run:
            return len(keys)
        for key, names in keys.items():
            await self._deleted(key, names)
        return len(keys)

    async def _references(self, committed: set[str], cutoff: float
                          ) -> tuple[set[str], int, set[str], dict[str, list[str]], list[str]]:
        """The digests every kept version names, how many versions were read, the transactions the
        listed versions name, the abandoned versions (see the module doc: not in `committed`, older
        than `cutoff`), and the problems that forbid deleting anything."""
        abandoned: dict[str, list[str]] = {}
        referenced: set[str] = set()
        done: set[str] = set()
        where, problems = await self._list([MANIFESTS])
        named = {r.txn for r in map(VersionRef.parse, where) if r is not None and r.txn}
        purge = {} if problems else await self._purgeable(where, committed, problems)
        where = {k: v for k, v in where.items() if k not in purge}
        for _ in range(_RELISTS):
            if problems or not where:
                break
            vanished: set[str] = set()

            async def read(key: str) -> None:
                m = await self._read(key, where[key], problems)
                done.add(key)
                if m is not None:
                    referenced.update(c.digest for c in m.chunks)   # abandoned ones too, this run
                    ref = VersionRef.parse(key)
                    if ref is not None and ref.txn and ref.txn not in committed and self._older(key, m, cutoff):
                        abandoned[key] = where[key]
                elif (folder := _FOLDER.fullmatch(key)) is not None:
                    vanished.add(folder[1] + "/")

            await in_parallel(read, sorted(where), _READS)
            if not vanished or problems:
                break
            log.info("gc: %d versions were retired while gc read them: listing their folders again",
                     len(vanished))
            where, problems = await self._list(sorted(vanished))
            named |= {r.txn for r in map(VersionRef.parse, where) if r is not None and r.txn}
            where = {k: v for k, v in where.items() if k not in done}
        else:
            if where and not problems:
                problems.append("versions kept vanishing while gc read them (commits are retiring them): "
                                "try again")
        self.purged = 0 if problems else await self._purge(purge, done, referenced, problems)
        return referenced, len(done), named, abandoned, problems

    async def _purgeable(self, where: dict[str, list[str]], committed: set[str],
                         problems: list[str]) -> dict[str, list[str]]:
        """The version keys (-> stores) of every path whose history has expired: its newest version,
        alone at that order and counting (a transaction's only once committed), is a removal committed
        more than keep_removed ago. A path with anything newer (a save, a failed save, a re-creation) is
        never purged."""
        if math.isinf(self.keep_removed):
            return {}
        folders: dict[str, list[VersionRef]] = {}
        for ref in map(VersionRef.parse, where):
            if ref is not None:
                folders.setdefault(ref.path_hash, []).append(ref)
        tombs = []
        for refs in folders.values():
            newest = max(refs, key=lambda r: r.order)
            if (newest.state == "deleted" and sum(r.order == newest.order for r in refs) == 1
                    and (not newest.txn or newest.txn in committed)):
                tombs.append(newest)
        before = time.time() - self.keep_removed
        expired: list[VersionRef] = []

        async def check(ref: VersionRef) -> None:
            m = await self._read(ref.key, where[ref.key], problems)
            if m is not None and m.state == "deleted" and self._older(ref.key, m, before):
                expired.append(ref)

        await in_parallel(check, tombs, _READS)
        return {r.key: where[r.key] for t in expired for r in folders[t.path_hash]}

    def _older(self, key: str, m: Manifest, before: float) -> bool:
        """Whether the version under `key` was committed before `before` (gc's wall clock) by both clocks
        that saw it: its writer's (`committed_ns`) and the stores' (the newest copy's mtime; the stores'
        clocks agree with gc's: assumption 2). A writer's clock that is behind made a removal purged at
        once, and a rename's versions abandoned while its record was on its way (an audit's finds)."""
        return m.committed_ns < before * 1e9 and self._written.get(key, math.inf) < before

    async def _purge(self, purge: dict[str, list[str]], done: set[str], referenced: set[str],
                     problems: list[str]) -> int:
        """Delete the expired histories (not in a dry run), then list their folders again: a version
        committed there meanwhile (a new save, a restore), and one a store refused to delete, is read,
        and its chunks referenced (one left undeleted lost them in the same run: `cpfs log` listed it,
        scrub called it lost, restore failed; the gc audit's find). Returns how many paths were purged.
        Each path's versions go oldest first and its removal last, only once every other is gone: a
        purge cut short (a store refusing, a killed gc) leaves the path removed, never an older version
        of it current again."""
        histories: dict[str, list[str]] = {}
        for key in purge:
            histories.setdefault(_FOLDER.fullmatch(key)[1] + "/", []).append(key)   # type: ignore[index]
        if not histories or self.dry_run:
            return len(histories)

        async def one(keys: list[str]) -> None:
            *older, removal = sorted(keys, key=lambda k: VersionRef.parse(k).order)   # type: ignore[union-attr]
            kept = [k for k in older if not await self._deleted(k, purge[k])]
            if not kept:
                await self._deleted(removal, purge[removal])

        await in_parallel(one, list(histories.values()), _READS)
        log.info("gc: purged the history of %d paths removed more than %gs ago", len(histories),
                 self.keep_removed)
        where, more = await self._list(sorted(histories))
        problems += more

        async def read(key: str) -> None:
            m = await self._read(key, where[key], problems)
            done.add(key)
            if m is not None:
                referenced.update(c.digest for c in m.chunks)

        await in_parallel(read, sorted(k for k in where if k not in done), _READS)
        return len(histories)

    async def _lapsed(self, lapsed: Sequence[tuple[str, str, float]]) -> None:
        """Delete hold copies past their lease (their mounts died), unless renewed since."""
        if self.dry_run:
            return
        for name, key, lease in lapsed:
            try:
                if await self.pool.delete_if_older(name, key, time.time() - lease):
                    log.info("gc: deleted hold %s on store %r: past its lease (its mount is gone)", key, name)
            except StoreError as e:
                log.warning("gc: could not delete the lapsed hold %s on store %r: %s", key, name, e)
                self._failed += 1

    async def _deleted(self, key: str, names: list[str]) -> bool:
        """Delete `key` on every store that listed it; whether every deletion succeeded (failures logged)."""
        ok = True
        for name in names:
            try:
                await self.pool.delete(name, key)
            except StoreError as e:
                log.warning("gc: could not delete %s on store %r: %s", key, name, e)
                self._failed += 1
                ok = False
        return ok

    async def _read(self, key: str, names: Sequence[str], problems: list[str]) -> Manifest | None:
        """The version under `key` from the first store with a copy that parses; None if every store
        that listed it says it is gone; a problem is noted if it is there but unreadable."""
        failures = []
        for name in self.pool.rank(names):
            try:
                data = await self.pool.get(name, key)
                return await trio.to_thread.run_sync(Manifest.from_bytes, data, f"store {name!r} {key}",
                                                     limiter=self.pool.cpu)
            except NoSuchObject:
                continue
            except (StoreError, ManifestError) as e:
                failures.append(str(e))
        if failures:
            problems.append(f"version {key} is unreadable on every store that has it ({'; '.join(failures)})")
        return None

    # -- the sweep ---------------------------------------------------------------------------------
    async def _sweep(self, tally: _Tally, referenced: set[str], cutoff: float) -> None:
        """Delete the store's unreferenced chunks older than `cutoff`, then its temporary files; at most
        _DELETES deletions in flight, listing the next page meanwhile."""
        name = tally.name
        slots = trio.Semaphore(_DELETES)

        async def delete(info: ObjectInfo, temporary: bool) -> None:
            try:
                gone = True if self.dry_run else await self.pool.delete_if_older(name, info.key, cutoff)
            except StoreError as e:
                log.warning("gc: could not delete %s on store %r: %s", info.key, name, e)
                tally.errors += 1
                return
            finally:
                slots.release()
            if temporary:
                if gone:
                    tally.temporary += 1
                    tally.temporary_bytes += info.size
            elif gone:
                tally.deleted += 1
                tally.deleted_bytes += info.size
                log.debug("gc: deleted %s on store %r (%d bytes)", info.key, name, info.size)
            else:
                tally.young += 1                # touched since it was listed: a commit reuses it
                tally.young_bytes += info.size

        # Chunks first, temporary files once those deletions are done: a folder store's deletion
        # claims the file under a temporary name for a moment, which is not this sweep's to take.
        for prefix, temporary in ((CHUNKS, False), ("", True)):
            async with trio.open_nursery() as n:
                try:
                    async for page in self.pool.iter_info(name, prefix, temporary=temporary):
                        for info in page:
                            if not temporary:
                                m = _CHUNK_KEY.fullmatch(info.key)
                                if m is None:
                                    continue        # not a chunk of ours: never touched
                                tally.chunks += 1
                                if m[2] in referenced:
                                    continue
                                if info.mtime >= cutoff:
                                    tally.young += 1
                                    tally.young_bytes += info.size
                                    continue
                            elif info.mtime >= cutoff and not is_claim(info.key):
                                continue            # a put in progress, perhaps (claims: whatever age)
                            await slots.acquire()
                            n.start_soon(delete, info, temporary)
                except StoreError as e:
                    log.warning("gc: listing %s on store %r failed, the rest stays for the next run: %s",
                                "temporary files" if temporary else prefix, name, e)
                    tally.errors += 1
