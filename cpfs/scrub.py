"""Scrub: read every copy of every chunk and manifest, report what is missing or corrupt, and repair.

Reads verify only the copy they read, and read repair fixes only what readers meet; a copy nobody
reads can rot unnoticed until the other one is gone too. `cpfs scrub` reads all of them:
- manifests: every kept version of every path (every version key any store lists, every state), on
  the stores that list it and on its placement (`place(path hash, stores, replicas)`, where commits
  put it). A copy is good if it parses and matches its key. A version is healthy when every store of
  its placement holds a good copy (readers list every store, but commits and retirement work on the
  placement);
- chunks: every chunk those manifests name, once however many versions share it, on the stores the
  manifests list and on its current placement. A copy is good if it decodes and hashes to its name
  (`chunk.decode`, in `pool.cpu` threads). A chunk is healthy when every manifest naming it can
  reach `replicas` good copies: on the stores its entry lists (that still exist) or on the current
  placement, which `StorePool.fetch_chunk` tries after the listed ones. The block checks a manifest
  records for the chunk (`chunk.block_checks`, read when the kernel loses pages) are compared with
  its good copy: a wrong one costs readers a whole-chunk read, never wrong bytes, and only a bug can
  write one, so it is reported (`block_checks_wrong`), not repaired (versions are immutable).
Repair (`--repair`) rewrites every missing or corrupt copy on a listed store from a good copy, then,
while a chunk is still short (a listed store was removed from the config or replaced, a manifest
lists fewer stores than `replicas`), puts copies on its current placement; manifest copies go to
their placement. Manifests are never rewritten to point at new stores: immutable versions stay
immutable, and readers find the new copies through the placement.
A copy of a failed commit that its twin voids (cpfs/catalog.py: its writer could not delete it, or a
repair put it back) is reported as "voided", never repaired, and deleted by `--repair`, as the next
commit of its path would.
A version of a transaction whose record the listing did not find (one under way, or abandoned: its
writer died before the commit point, or its commit failed) counts for no reader: it is counted as
`uncommitted` and left alone, neither checked nor repaired. Checked, a daemon killed mid-rename left
scrub reporting "missing manifest" copies of paths no one could see, and `--repair` copied them;
`cpfs gc` deletes them once older than the grace.

Bounded: one CapacityLimiter caps the chunks (or versions) being checked at once, each holding at most
two copies in memory; every request goes through the pool (timeouts, retries).

Caveats: a scrub that runs while versions are retired or a garbage collector deletes chunks sees keys
vanish under it. A problem is counted only if a version naming it still exists when it is found (one
extra request per problem); a repair can still restore a copy that was deleted a moment before: an
unreferenced chunk (the next gc frees it) or a retired version (the next commit of that path retires it
again). A manifest copy is re-copied only after the key was seen again on a store that holds it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from . import chunk as chunkfmt
from .catalog import PREFIX, TXN_PREFIX, Catalog, VersionRef, current_of, txn_key, txns_listed, voided
from .errors import CorruptChunk, ManifestError, NoSuchObject, NotFound, StoreError
from .manifest import SUMMARY_MAX, Manifest, Summary, normalize_path, path_hash
from .placement import place
from .pool import StorePool

log = logging.getLogger(__name__)
T = TypeVar("T")

MEMORY = 256 * 1024**2       # chunk bytes a scrub holds at most (two copies per chunk in flight)
CONCURRENCY = 16             # chunks (or versions) checked at once at most
PROBLEMS_MAX = 1000          # problems listed in a report (the counts stay exact)
PROBLEMS_SHOWN = 20          # ... of which the human summary prints


@dataclass(frozen=True, kw_only=True)
class ScrubStats:
    """Counts so far (Scrubber.statistics()) or in the end (ScrubReport.stats)."""
    phase: str = "idle"              # idle, listing, manifests, transactions, chunks, done
    stores: int = 0                  # stores in the config
    stores_unlisted: int = 0         # listings that failed (manifests, transaction records): incomplete
    manifests: int = 0               # paths (a manifest per file, with its kept versions)
    versions: int = 0                # kept versions: version keys, every state
    manifest_copies: int = 0         # manifest copies read
    manifest_missing: int = 0        # ... absent on a placement store
    manifest_corrupt: int = 0        # ... that do not parse or do not match their key
    manifests_under_replicated: int = 0  # versions with good copies on fewer than `replicas` placement stores
    manifests_lost: int = 0          # versions with no good copy at all
    records: int = 0                 # transaction records (and void markers) the scrubbed versions count on
    record_missing: int = 0          # ... copies absent or corrupt on a store of their placement
    records_lost: int = 0            # ... records of committed transactions with no good copy
    chunks_total: int = 0            # distinct chunks the scrubbed versions name
    chunks: int = 0                  # ... checked so far
    replicas: int = 0                # chunk copies checked (read, or found missing on a listed store)
    missing: int = 0                 # chunk copies absent on a store a manifest lists
    corrupt: int = 0                 # chunk copies that do not decode to their hash
    unreachable: int = 0             # copies a store failed to answer for (down, timing out)
    under_replicated: int = 0        # chunks some manifest reaches fewer than `replicas` good copies of
    lost: int = 0                    # chunks with no good copy on any store
    block_checks_wrong: int = 0      # versions whose block checks of a chunk do not match its good copy
    vanished: int = 0                # versions or chunks deleted while the scrub ran (retired, gc)
    voided: int = 0                  # versions of failed commits their twin voids (--repair deletes them)
    uncommitted: int = 0             # versions of transactions not committed (under way or abandoned): left to gc
    repaired: int = 0                # copies written (chunks and manifests)
    unrepaired: int = 0              # chunks and versions short of `replicas` good copies at the end
    bytes_read: int = 0

    @property
    def found(self) -> int:
        """Problems found so far: bad copies, objects with no good copy, wrong block checks."""
        return (self.missing + self.corrupt + self.unreachable + self.lost + self.manifest_missing
                + self.manifest_corrupt + self.manifests_lost + self.block_checks_wrong + self.record_missing
                + self.records_lost)


@dataclass(frozen=True)
class Problem:
    what: str          # "chunk", "manifest" or "transaction"
    kind: str          # "missing", "corrupt", "unreachable", "lost", "under-replicated", "voided", "repair failed"
    key: str
    store: str         # "" when about the object, not one copy
    where: str         # the file and version that name it (the first of them, for a shared chunk)
    detail: str = ""


@dataclass(frozen=True)
class ScrubReport:
    stats: ScrubStats
    repair: bool
    seconds: float
    problems: tuple[Problem, ...]     # the first PROBLEMS_MAX
    lost_files: tuple[str, ...]       # "PATH version V[ (current)]" of versions that cannot be read whole

    @property
    def ok(self) -> bool:
        """Every scrubbed chunk and version has `replicas` good copies (after the repair, if asked),
        and every store could be listed."""
        return self.stats.unrepaired == 0 and self.stats.stores_unlisted == 0

    def to_json(self) -> dict:
        counts = {k: v for k, v in dataclasses.asdict(self.stats).items() if k not in ("phase", "chunks_total")}
        return {**counts, "ok": self.ok, "repair": self.repair, "seconds": round(self.seconds, 3),
                "lost_files": list(self.lost_files), "problems": [dataclasses.asdict(p) for p in self.problems]}


@dataclass
class _Version:
    ref: VersionRef
    holders: list[str]              # stores whose listing has the key
    path: str = ""                  # once known (from a summary or the manifest)
    current: bool = False
    voided: bool = False            # a failed commit's copy that its twin voids

    @property
    def where(self) -> str:
        return f"{self.path or self.ref.key} version {self.ref.version}{' (current)' if self.current else ''}"


@dataclass
class _Chunk:
    """What the scrubbed versions say of one chunk (one record per chunk, however many name it)."""
    stores: set[tuple[str, ...]] = field(default_factory=set)   # the store lists of its entries
    versions: list[_Version] = field(default_factory=list)      # the versions naming it
    blocks: dict[bytes, list[_Version]] = field(default_factory=dict)  # recorded block checks -> versions

    @property
    def where(self) -> str:
        more = len(self.versions) - 1
        return self.versions[0].where + (f" and {more} more version(s)" if more else "")


@dataclass
class _Tally:
    counts: dict[str, int] = field(default_factory=lambda: {
        f.name: 0 for f in dataclasses.fields(ScrubStats) if f.name != "phase"})
    phase: str = "idle"

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n


class Scrubber:
    """Checks (and with repair, restores) `replicas` good copies of everything the catalog's versions
    name. One scrub per instance; `statistics()` may be read while `run` works (a progress bar)."""

    def __init__(self, pool: StorePool, catalog: Catalog, *, concurrency: int | None = None) -> None:
        """`catalog`: the versions to scrub; their keys and order are its (VersionRef, current_of)."""
        self._pool = pool
        self._catalog = catalog
        cfg = pool.config
        self._replicas = min(cfg.replicas, len(pool.names))
        per_chunk = 2 * cfg.chunk_size
        self._limiter = trio.CapacityLimiter(concurrency or max(2, min(CONCURRENCY, MEMORY // per_chunk)))
        self._t = _Tally()
        self._problems: list[Problem] = []
        self._lost_files: set[str] = set()
        self._chunks: dict[str, _Chunk] = {}
        self._listed: set[str] = set()          # stores whose listing succeeded

    def statistics(self) -> ScrubStats:
        return ScrubStats(phase=self._t.phase, **self._t.counts)

    @property
    def limiter(self) -> trio.CapacityLimiter:
        """Bounds the chunks and versions checked at once (its statistics() shows how many)."""
        return self._limiter

    async def run(self, paths: Sequence[str] = (), repair: bool = False) -> ScrubReport:
        """Scrub the versions of every path, or of the paths at or under `paths`; with `repair`,
        restore what can be restored. Problems are in the report; StoreError only if no store lists."""
        t0 = trio.current_time()
        scope = [normalize_path(p) for p in paths if p.strip("/")]
        if len(scope) < len(paths):
            scope = []                                # the root: everything
        self._t.add("stores", len(self._pool.names))
        self._t.phase = "listing"
        # Before the manifests (catalog doc). A store that cannot list its records leaves the scrub
        # incomplete, and then no version is taken for uncommitted: a committed rename's would be
        # left unchecked, and the scrub said ok (the review of 4868400).
        records, listed = await self._where(TXN_PREFIX, "transaction records")
        found, void = txns_listed(records)
        committed = found - void
        groups = await self._groups()
        if scope:
            groups = await self._in_scope(groups, scope)
            if not groups:      # a mistyped path: not a clean bill of health
                raise NotFound(f"{', '.join(scope)}: no file or folder there, nothing scrubbed")
        every = groups                  # the records and void markers of all their transactions are checked
        pending = {id(v) for g in groups.values() for v in g if v.ref.txn and v.ref.txn not in committed} \
            if len(listed) == len(self._pool.names) else set()
        groups = {k: kept for k, g in groups.items() if (kept := [v for v in g if id(v) not in pending])}
        self._t.add("uncommitted", len(pending))
        self._t.add("manifests", len(groups))
        self._t.add("versions", sum(len(g) for g in groups.values()))
        self._t.phase = "manifests"
        for versions in groups.values():
            refs = [v.ref for v in versions]
            cur, void = current_of(refs, committed), voided(refs)
            for v in versions:
                v.current = v.ref == cur
                v.voided = v.ref.state != "failed" and v.ref.order in void
        await self._each([v for g in groups.values() for v in g], lambda v: self._check_version(v, repair))
        self._t.phase = "transactions"
        await self._check_transactions(every, committed, repair)
        self._t.phase = "chunks"
        self._t.add("chunks_total", len(self._chunks))
        await self._each(list(self._chunks.items()), lambda item: self._check_chunk(*item, repair))
        self._t.phase = "done"
        return ScrubReport(stats=self.statistics(), repair=repair, seconds=trio.current_time() - t0,
                           problems=tuple(self._problems), lost_files=tuple(sorted(self._lost_files)))

    # -- plumbing ----------------------------------------------------------------------------------
    async def _each(self, items: Iterable[T], check: Callable[[T], Awaitable[None]]) -> None:
        """check(item) for every item, as many at once as the limiter lets: a task starts only once it
        holds a token, so the tasks alive (and the copies in memory) stay bounded."""
        async def one(item: T, token: object) -> None:
            try:
                await check(item)
            finally:
                self._limiter.release_on_behalf_of(token)

        async with trio.open_nursery() as n:
            for item in items:
                token = object()
                await self._limiter.acquire_on_behalf_of(token)
                n.start_soon(one, item, token)

    def _problem(self, what: str, kind: str, key: str, store: str, where: str, detail: str = "") -> None:
        # INFO: the report lists every problem; the log is for a scrub run by something else.
        log.info("scrub: %s %s %s%s (%s)%s", what, key, kind, f" on store {store!r}" if store else "", where, f": {detail}" if detail else "")
        if len(self._problems) < PROBLEMS_MAX:
            self._problems.append(Problem(what=what, kind=kind, key=key, store=store, where=where, detail=detail))

    async def _get(self, name: str, key: str) -> bytes | str:
        """The copy of `key` on store `name`, or why not: "missing" or "unreachable"."""
        try:
            data = await self._pool.get(name, key)
        except NoSuchObject:
            return "missing"
        except StoreError as e:
            log.warning("scrub: %s on store %r could not be read: %s", key, name, e)
            return "unreachable"
        self._t.add("bytes_read", len(data))
        return data

    async def _put(self, name: str, key: str, data: bytes, what: str, where: str) -> bool:
        try:
            await self._pool.put(name, key, data)
        except StoreError as e:
            self._problem(what, "repair failed", key, name, where, str(e))
            return False
        self._t.add("repaired")
        log.info("scrub: rewrote %s %s on store %r (%s)", what, key, name, where)
        return True

    # -- manifests ---------------------------------------------------------------------------------
    async def _where(self, prefix: str, what: str) -> tuple[dict[str, list[str]], set[str]]:
        """key -> the stores that list it, for every key under `prefix`; and the stores that did."""
        where: dict[str, list[str]] = {}
        listed: set[str] = set()

        async def one(name: str) -> None:
            try:
                keys = await self._pool.list_keys(name, prefix)
            except StoreError as e:
                log.error("scrub: cannot list the %s on store %r: %s", what, name, e)
                self._t.add("stores_unlisted")
                return
            listed.add(name)
            for key in keys:
                where.setdefault(key, []).append(name)

        async with trio.open_nursery() as n:
            for name in self._pool.names:
                n.start_soon(one, name)
        return where, listed

    async def _groups(self) -> dict[str, list[_Version]]:
        """Every version key on every store, by path hash."""
        where, self._listed = await self._where(PREFIX, "manifests")
        if not self._listed:
            raise StoreError(",".join(self._pool.names), "scrub: no store could list its manifests")
        groups: dict[str, list[_Version]] = {}
        for key, holders in sorted(where.items()):
            ref = VersionRef.parse(key)
            if ref is None:
                log.warning("scrub: skipping %s (not a version key; format-1 keys migrate on cpfs ls)", key)
                continue
            order = [n for n in self._pool.names if n in holders]
            groups.setdefault(ref.path_hash, []).append(_Version(ref, order))
        return groups

    async def _in_scope(self, groups: dict[str, list[_Version]], scope: list[str]) -> dict[str, list[_Version]]:
        """The groups of the paths in `scope` or under them: a path's hash names its group; a path
        under a folder is learned from a summary (a ranged read of one version)."""
        exact = {path_hash(p): p for p in scope}
        out: dict[str, list[_Version]] = {}

        async def one(item: tuple[str, list[_Version]]) -> None:
            h, versions = item
            if h in exact:
                path = exact[h]
            else:
                path = await self._path_of(versions)
                if path is None:
                    # No summary to tell where it lives: it may be in scope, so it is scrubbed (and its
                    # unreadable copies reported), never left out of a scrub that then says ok.
                    path = ""
                elif not any(path.startswith(p + "/") for p in scope):
                    return
            for v in versions:
                v.path = path
            out[h] = versions

        await self._each(list(groups.items()), one)
        return out

    async def _path_of(self, versions: list[_Version]) -> str | None:
        for v in sorted(versions, key=lambda v: v.ref.order, reverse=True):
            for name in v.holders:
                try:
                    data = await self._pool.get_range(name, v.ref.key, 0, SUMMARY_MAX)
                    return Summary.from_bytes(data, f"store {name!r} {v.ref.key}").path
                except (StoreError, ManifestError) as e:
                    log.warning("scrub: summary of %s on store %r unreadable: %s", v.ref.key, name, e)
        log.warning("scrub: %s: no readable summary, so its path is unknown", versions[0].ref.key)
        return None

    async def _parse(self, data: bytes, name: str, ref: VersionRef) -> Manifest:
        m = await trio.to_thread.run_sync(Manifest.from_bytes, data, f"store {name!r} {ref.key}",
                                          limiter=self._pool.cpu)
        if (m.version, m.writer, m.state) != (ref.version, ref.writer, ref.state) or path_hash(m.path) != ref.path_hash:
            raise ManifestError(f"store {name!r} {ref.key}: contents do not match the key")
        return m

    async def _check_version(self, v: _Version, repair: bool) -> None:
        """Every copy of one version key on its holders and its placement; collects its chunks."""
        key = v.ref.key
        if v.voided:
            await self._delete_voided(v, repair)
            return
        placement = place(v.ref.path_hash, self._pool.names, self._replicas)
        state: dict[str, str] = {}
        good: bytes | None = None
        m: Manifest | None = None
        for name in [n for n in self._pool.names if n in v.holders or n in placement]:
            if name not in v.holders and name in self._listed:
                state[name] = "missing"              # its listing says so: no request needed
                continue
            got = await self._get(name, key)
            if isinstance(got, str):
                state[name] = got
                continue
            self._t.add("manifest_copies")
            if good is not None and got == good:
                state[name] = "good"
                continue
            try:
                parsed = await self._parse(got, name, v.ref)
            except ManifestError as e:
                state[name] = "corrupt"
                self._t.add("manifest_corrupt")
                self._problem("manifest", "corrupt", key, name, v.where, str(e))
                continue
            state[name] = "good"
            if good is None:
                good, m = got, parsed
        if m is not None:
            v.path = m.path
        if good is None and "corrupt" not in state.values() and "unreachable" not in state.values() \
                and all(state.get(n) == "missing" for n in v.holders):
            self._t.add("vanished")                  # retired since the listing
            return
        if any(state.get(n) == "missing" for n in v.holders) and await self._exists(key, v.holders) is False:
            # Retired while it was read: a writer deletes a version's copies on its stores together,
            # not at once, so one store answered before its delete and one after. It was reported
            # missing and the scrub failed (the busy commits audit: 3 of 6 scrubs during saves).
            self._t.add("vanished")
            return
        for name in placement:
            if state.get(name) == "missing":
                self._t.add("manifest_missing")
                self._problem("manifest", "missing", key, name, v.where)
            elif state.get(name) == "unreachable":
                self._t.add("unreachable")
                self._problem("manifest", "unreachable", key, name, v.where)
        if m is None:
            self._t.add("manifests_lost")
            self._t.add("unrepaired")
            self._lost_files.add(v.where)
            self._problem("manifest", "lost", key, "", v.where, "no good copy on any store")
            return
        if any(state.get(n) != "good" for n in placement):
            self._t.add("manifests_under_replicated")
            if repair:
                await self._repair_version(v, good, state, placement)
            if any(state.get(n) != "good" for n in placement):
                self._t.add("unrepaired")
        elif repair and "corrupt" in state.values():
            await self._repair_version(v, good, state, placement)
        for c in m.chunks:
            chunk = self._chunks.setdefault(c.digest, _Chunk())
            chunk.stores.add(c.stores)
            if not chunk.versions or chunk.versions[-1] is not v:
                chunk.versions.append(v)
            if c.blocks:
                named = chunk.blocks.setdefault(c.blocks, [])
                if not named or named[-1] is not v:
                    named.append(v)

    async def _delete_voided(self, v: _Version, repair: bool) -> None:
        """A voided copy counts for nothing and names nothing a reader needs: reported, and with
        repair deleted (its twin stays until a commit of the path sees the copy gone)."""
        self._t.add("voided")
        v.path = v.path or await self._path_of([v]) or ""
        self._problem("manifest", "voided", v.ref.key, "", v.where, f"listed on {', '.join(v.holders)}")
        for name in v.holders if repair else ():
            try:
                await self._pool.delete(name, v.ref.key)
            except StoreError as e:
                self._problem("manifest", "repair failed", v.ref.key, name, v.where, str(e))
            else:
                log.info("scrub: deleted the voided copy %s on store %r (%s)", v.ref.key, name, v.where)

    async def _repair_version(self, v: _Version, good: bytes, state: dict[str, str], placement: list[str]) -> None:
        # A version deleted since it was read (retired, or a commit that failed below quorum taking
        # its copies back) must not come back: look again right before copying it.
        there = await self._exists(v.ref.key, [n for n, s in state.items() if s == "good"])
        if not there:
            log.warning("scrub: %s %s before its repair: left alone", v.ref.key,
                        "vanished" if there is False else "could not be looked for")
            return
        for name, s in state.items():
            if s == "corrupt" or (s == "missing" and name in placement):
                if await self._put(name, v.ref.key, good, "manifest", v.where):
                    state[name] = "good"

    async def _exists(self, key: str, names: Sequence[str]) -> bool | None:
        """Whether a store holds `key`; None if none said yes and one could not tell."""
        unknown = False
        for name in names:
            try:
                if await self._pool.exists(name, key):
                    return True
            except StoreError as e:
                log.warning("scrub: cannot tell whether %s is on store %r: %s", key, name, e)
                unknown = True
        return None if unknown else False

    # -- transactions ------------------------------------------------------------------------------
    async def _check_transactions(self, groups: dict[str, list[_Version]], committed: set[str], repair: bool) -> None:
        """The record of every transaction the scrubbed versions belong to, and its void marker if it
        has one, on the record's placement (`place(txn, stores, replicas)`, where a commit puts it):
        a version of a transaction counts only while its record can be read and no marker voids it.
        Unscrubbed, two stores replaced (each repaired by scrub) lost a committed folder rename's
        record, its versions stopped counting, and gc deleted them as never committed (an audit's
        find)."""
        txns = sorted({v.ref.txn for g in groups.values() for v in g if v.ref.txn})
        if not txns:
            return
        listing, _ = await self._where(TXN_PREFIX, "transaction records")
        keys = [(t, key) for t in txns for key in (txn_key(t), txn_key(t, void=True))
                if key in listing or (not key.endswith(".failed.json") and t in committed)]
        self._t.add("records", len(keys))
        await self._each(keys, lambda item: self._check_record(*item, listing.get(item[1], []), repair))

    async def _check_record(self, txn: str, key: str, holders: list[str], repair: bool) -> None:
        placement = place(txn, self._pool.names, self._replicas)
        state: dict[str, str] = {}
        good: bytes | None = None
        for name in [n for n in self._pool.names if n in holders or n in placement]:
            got = await self._get(name, key)
            if isinstance(got, str):
                state[name] = got
                continue
            try:
                ok = json.loads(got).get("txn") == txn
            except (ValueError, AttributeError, RecursionError):
                ok = False
            state[name] = "good" if ok else "corrupt"
            if ok and good is None:
                good = got
        where = f"transaction {txn}" + (" (its void marker)" if key.endswith(".failed.json") else "")
        if good is None:
            if "unreachable" not in state.values() and not holders:
                return                                   # deleted since the listing (gc): nothing counts on it
            self._t.add("records_lost")
            self._t.add("unrepaired")
            self._problem("transaction", "lost", key, "", where, "no good copy on any store")
            return
        short = [n for n in placement if state.get(n) != "good"]
        for name in short:
            self._t.add("record_missing")
            self._problem("transaction", state.get(name, "missing"), key, name, where)
        if repair and short and await self._exists(key, [n for n, s in state.items() if s == "good"]):
            for name in short:
                if await self._put(name, key, good, "transaction record", where):
                    state[name] = "good"
        if any(state.get(n) != "good" for n in placement):
            self._t.add("unrepaired")

    # -- chunks ------------------------------------------------------------------------------------
    async def _check_chunk(self, digest: str, chunk: _Chunk, repair: bool) -> None:
        """Every copy of one chunk on the stores its manifests list and on its current placement."""
        pool = self._pool
        key = chunkfmt.chunk_key(digest)
        listed = [n for n in pool.names if any(n in stores for stores in chunk.stores)]
        placement = place(digest, pool.names, self._replicas)
        state: dict[str, str] = {}
        good: bytes | None = None
        for name in [n for n in pool.names if n in listed or n in placement]:
            got = await self._get(name, key)
            if isinstance(got, str):
                # A placement store that no manifest lists may hold no copy: nothing is missing there.
                state[name] = got if name in listed or got == "unreachable" else "absent"
                if name in listed:
                    self._t.add("replicas")
                continue
            self._t.add("replicas")
            if good is not None and got == good:
                state[name] = "good"
                continue
            try:
                checks = await trio.to_thread.run_sync(_verify, got, digest, bool(chunk.blocks), limiter=pool.cpu)
            except CorruptChunk as e:
                state[name] = f"corrupt: {e}"
                continue
            state[name] = "good"
            if good is None:
                good = got
                await self._compare_blocks(digest, chunk, checks)
        self._t.add("chunks")
        bad = {n: s for n, s in state.items() if s not in ("good", "absent")}
        if not bad and self._short(chunk, state, placement) == 0:
            return
        if not await self._referenced(chunk):
            self._t.add("vanished")                  # every version naming it was retired meanwhile
            return
        where = chunk.where
        for name, s in bad.items():
            kind, _, detail = s.partition(": ")
            self._t.add(kind)
            self._problem("chunk", kind, key, name, where, detail)
        if good is None:
            self._t.add("lost")
            self._t.add("unrepaired")
            self._lost_files.update(v.where for v in chunk.versions)
            self._problem("chunk", "lost", key, "", where, f"no good copy (stores {', '.join(state) or 'none'})")
            return
        if self._short(chunk, state, placement) > 0:
            self._t.add("under_replicated")
        if repair:
            await self._repair_chunk(key, good, chunk, state, placement, where)
        if self._short(chunk, state, placement) > 0:
            self._t.add("unrepaired")
            if repair or not bad:       # else the missing or corrupt copies listed say why
                gone = sorted({n for stores in chunk.stores for n in stores} - set(pool.names))
                self._problem("chunk", "under-replicated", key, "", where, "good copies on "
                              + (", ".join(n for n, s in state.items() if s == "good") or "no store")
                              + (f"; listed on {', '.join(gone)}, not in the config" if gone else ""))

    async def _compare_blocks(self, digest: str, chunk: _Chunk, checks: bytes) -> None:
        """Report each version whose block checks of the chunk differ from its good copy's (`checks`)."""
        blocks = len(checks) // chunkfmt.BLOCK_CHECK_SIZE
        for recorded, versions in chunk.blocks.items():
            if recorded == checks:
                continue
            wrong = chunkfmt.differing_blocks(recorded, checks)
            for v in versions:
                if await self._exists(v.ref.key, v.holders) is not False:   # else retired meanwhile
                    self._t.add("block_checks_wrong")
                    self._problem("manifest", "wrong block checks", v.ref.key, "", v.where,
                                  f"chunk {digest[:16]}: block(s) {', '.join(map(str, wrong[:8]))}"
                                  f"{' ...' if len(wrong) > 8 else ''} of {blocks} (reads of "
                                  "pages the kernel lost fall back to the whole chunk)")

    def _short(self, chunk: _Chunk, state: dict[str, str], placement: list[str]) -> int:
        """How many good copies the worst-off manifest naming the chunk lacks: each reaches the stores
        its entry lists and the current placement (StorePool.fetch_chunk)."""
        good = {n for n, s in state.items() if s == "good"}
        return max(self._replicas - len(good & (set(stores) | set(placement))) for stores in chunk.stores)

    async def _repair_chunk(self, key: str, good: bytes, chunk: _Chunk, state: dict[str, str],
                            placement: list[str], where: str) -> None:
        for name in [n for n, s in state.items() if s == "missing" or s.startswith("corrupt")]:
            if await self._put(name, key, good, "chunk", where):
                state[name] = "good"
        for name in placement:
            if self._short(chunk, state, placement) == 0:
                return
            if state.get(name) != "good" and await self._put(name, key, good, "chunk", where):
                state[name] = "good"

    async def _referenced(self, chunk: _Chunk) -> bool:
        """Whether a version that names the chunk still exists (a gc may delete the chunks of versions
        retired while the scrub ran). One that no store could answer for counts: the chunk's problems
        are reported, not taken for a gc's doing (stores that stop answering mid-scrub once made every
        chunk "vanished" and the scrub ok)."""
        for v in chunk.versions:
            if await self._exists(v.ref.key, v.holders) is not False:
                return True
        return False


def _verify(blob: bytes, digest: str, with_checks: bool) -> bytes:
    """Decode a copy and verify it by BLAKE3 (CorruptChunk if bad); its block checks if asked. Blocking."""
    raw = chunkfmt.decode(blob, digest, True)
    return chunkfmt.block_checks(raw, digest) if with_checks else b""


def render(report: ScrubReport) -> str:
    """The human summary `cpfs scrub` prints."""
    s = report.stats
    mib = s.bytes_read / 1024**2
    lines = [f"scrubbed {s.manifests} file(s), {s.versions} version(s) ({s.manifest_copies} manifest copies), "
             f"{s.chunks} chunk(s) ({s.replicas} copies) on {s.stores} store(s): {mib:.1f} MiB read in "
             f"{report.seconds:.1f}s ({mib / max(report.seconds, 1e-9):.1f} MiB/s)"]
    if s.stores_unlisted:
        lines.append(f"  {s.stores_unlisted} store(s) could not be listed: the scrub is incomplete")
    if s.uncommitted:
        lines.append(f"  {s.uncommitted} version(s) of transactions not committed (under way, or abandoned by a "
                     f"writer that died or failed: no reader counts them; `cpfs gc` deletes them) left alone")
    figures = [("missing chunk copies", s.missing), ("corrupt chunk copies", s.corrupt),
               ("under-replicated chunks", s.under_replicated), ("lost chunks", s.lost),
               ("missing manifest copies", s.manifest_missing), ("corrupt manifest copies", s.manifest_corrupt),
               ("under-replicated versions", s.manifests_under_replicated), ("lost versions", s.manifests_lost),
               ("versions with wrong block checks", s.block_checks_wrong),
               ("missing or corrupt transaction record copies", s.record_missing),
               ("lost transaction records", s.records_lost),
               ("copies a store did not answer for", s.unreachable), ("deleted while scrubbing", s.vanished)]
    found = [f"{n} {what}" for what, n in figures if n]
    if found:
        lines.append("found: " + ", ".join(found))
    for p in report.problems[:PROBLEMS_SHOWN]:
        on = f" on {p.store}" if p.store else ""
        name = f" {p.key.rsplit('/', 1)[-1][:16]}" if p.what == "chunk" else ""
        lines.append(f"  {p.kind:<16} {p.what}{name}{on}: {p.where}"
                     f"{': ' + p.detail if p.detail else ''}")
    if len(report.problems) > PROBLEMS_SHOWN:
        lines.append(f"  ... and {len(report.problems) - PROBLEMS_SHOWN} more (--json lists up to {PROBLEMS_MAX})")
    if report.repair:
        lines.append(f"repaired {s.repaired} cop{'y' if s.repaired == 1 else 'ies'}")
    if report.lost_files:
        lines.append("unreadable versions (no good copy of a chunk or of the manifest):")
        lines += [f"  {f}" for f in report.lost_files]
    if report.ok:
        lines.append("ok: every chunk and version has its replicas")
    else:
        lines.append(f"NOT OK: {s.unrepaired} chunk(s) or version(s) short of their replicas"
                     + ("" if report.repair or s.lost + s.manifests_lost == s.unrepaired
                        else "; `cpfs scrub --repair` restores what has a good copy"))
    return "\n".join(lines)
