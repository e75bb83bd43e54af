"""Manifests on the stores: every commit a new immutable version, with history, removal and restore.

Layout: `manifests/<path hash>/<version:020d>.<writer>.<state>.json`, on the `replicas` stores that
placement picks for the path hash (a spare standing in for one marked down: cpfs/placement.py), so one
listing of one folder finds every version of a path.
Invariants, and why:
- Nothing is overwritten. A commit writes a new key after every chunk it names is durable; one that
  fails below `write_quorum` deletes only its own new key. (Overwriting one key per path in place lost
  the previous version on every store a failed commit had reached.)
- A failed commit is voided before its copies are deleted: its writer writes a "failed" key of the
  same version and writer (its twin) to every store that takes it, and never uses that version again.
  A twin voids its ok or deleted key wherever they are listed, so the writer, told that its commit
  failed, is right on every mount, also where a copy stays (a store took the put, then refuses the
  delete; a cancelled put may still land) or is put back after its delete (`cpfs scrub --repair`
  copying the copy it listed a moment before). Only if no store takes the twin either, and a copy
  may remain, can the copy count (logged as an error);
  the writer's next commit, of any path, tries the twin again, and a mount every VOID_RETRY seconds;
  cpfs/voidjournal.py keeps the twin on local disk, so that the next mount or commit of the same stores
  on that host tries it if the writer is gone by then.
- The current version of a path is its highest (version, writer) whose state is not "failed" and that
  no twin voids; if that one is "deleted", the path does not exist. Key names alone decide it, so a
  refresh lists and then reads only the summaries it has not seen (keys are immutable: summaries are
  cached by key), and a summary is a ranged read of a manifest's first line, not its chunks and tensor
  index.
- `version` is a counter: one more than the highest version of the path seen on any store (or
  committed by this process). Clocks never order versions, so a host whose clock is behind still
  commits newer ones; two commits of one version are ordered by writer id, and one of them wins whole.
- Each path keeps its newest `keep_versions` ok versions, and failed or deleted ones newer than the
  oldest of those (at most `keep_versions` failed ones); older manifests are retired (deleted). Their
  chunks stay until a garbage collector frees them.
Format-1 stores (one `manifests/<path hash>.json` per path, overwritten in place) are migrated to
version keys when a full listing meets them.

Transactions: several paths changed as one commit (a folder rename, a hard link: `transact`). Each of
their versions is written under a key that names the transaction,
`<version>.<writer>.<state>.<txn>.json`, and counts for nothing until the transaction's record
`txns/<txn>.json` exists on some store and its void marker `txns/<txn>.failed.json` on none; the
record is written only once every version is durable (the commit point). So a crash before it leaves
every path as it was, and after it every path changed. A transaction that fails writes its void marker,
then deletes its record; if no store takes the marker and a copy of the record may remain, it keeps
its versions, so the transaction counts whole or not at all.
Invariant: a full listing reads `txns/` *before* `manifests/`, so a transaction it finds committed had
all its versions written before its manifests were listed: a listing shows every path of a transaction
old or every path new, never a mix. A transaction's versions are taken back (deleted) only by the
writer whose commit failed; a record stays while a version names it (`cpfs gc` removes it after).
A mount remembers a transaction as committed for good only once it lists its record on `write_quorum`
stores: a failing transaction's record can be listed on fewer, before its writer voids it. It forgets
it once a complete listing shows no version that names it (none can come back: see `_forget_txns`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import trio

from .errors import (MALFORMED, ChunkUnavailable, IsADirectory, ManifestError, ManifestGone, NoSuchObject,
                     NotADirectory, NotFound, Stale, StoreError, StoreUnavailable)
from .manifest import SUMMARY_MAX, ChunkEntry, Manifest, Summary, path_hash
from .placement import Layout, place
from .pool import StorePool
from .sync import fan_out
from .upload import in_parallel
from .voidjournal import VoidJournal

log = logging.getLogger(__name__)
T = TypeVar("T", Manifest, Summary)
PREFIX = "manifests/"
_RELISTS = 3         # fresh listings of a path whose listed current version went before it was read
WRITER_ID = secrets.token_hex(8)          # this process: breaks ties between commits of one version
HOST = socket.gethostname()
_KEY = re.compile(r"manifests/([0-9a-f]{40})/([0-9]{20})\.([0-9a-f]{0,32})\.(ok|failed|deleted)"
                  r"(?:\.([0-9a-f]{16}))?\.json")
TXN_PREFIX = "txns/"
_TXN_KEY = re.compile(r"txns/([0-9a-f]{16})(\.failed)?\.json")
_LEGACY = re.compile(r"manifests/([0-9a-f]{40})\.json")
_FETCHES = 32                             # summaries read at once by a full listing
FOLDERS_SEEN = 1.0                        # seconds a folder checked by a commit below it stays checked
_KEEP_PARSED = 256                        # full manifests kept parsed (the namespace keeps its own)
VOID_RETRY = 10.0                         # seconds between a mount's tries of the keys no store took


@dataclass(frozen=True)
class VersionRef:
    """A version as its key names it: enough to order a path's versions without reading them."""
    path_hash: str
    version: int
    writer: str
    state: str
    key: str
    txn: str = ""           # the transaction it belongs to: it counts once that has committed

    @property
    def order(self) -> tuple[int, str]:
        return (self.version, self.writer)

    @classmethod
    def parse(cls, key: str) -> "VersionRef | None":
        m = _KEY.fullmatch(key)
        return cls(m[1], int(m[2]), m[3], m[4], key, m[5] or "") if m else None

    @staticmethod
    def key_of(h: str, version: int, writer: str, state: str, txn: str = "") -> str:
        return f"{PREFIX}{h}/{version:020d}.{writer}.{state}{'.' + txn if txn else ''}.json"


def _why(error: BaseException) -> str:
    return str(error) or type(error).__name__        # a cancellation says nothing


def txn_key(txn: str, void: bool = False) -> str:
    """The key of a transaction's record, or of its void marker (the transaction failed)."""
    return f"{TXN_PREFIX}{txn}{'.failed' if void else ''}.json"


def parse_txn_key(key: str) -> tuple[str, bool] | None:
    """(transaction, whether the key is its void marker), or None if `key` is neither."""
    m = _TXN_KEY.fullmatch(key)
    return (m[1], bool(m[2])) if m else None


def txns_listed(keys: Iterable[str]) -> tuple[set[str], set[str]]:
    """The transactions whose record and those whose void marker `keys` hold."""
    records: set[str] = set()
    voided: set[str] = set()
    for txn, void in filter(None, map(parse_txn_key, keys)):
        (voided if void else records).add(txn)
    return records, voided


@dataclass(frozen=True)
class VersionInfo:
    """One entry of a path's history (`cpfs log`): the manifest, or why it cannot be read."""
    ref: VersionRef
    summary: Summary | None
    current: bool
    error: str = ""


@dataclass(frozen=True)
class Unreadable:
    """A path whose current version no store can give us intact: listed, but EIO when opened. With
    `unlisted`: one whose listing missed stores that may hold a newer version than `key`."""
    path: str
    key: str
    reason: str
    unlisted: bool = False


@dataclass(frozen=True, kw_only=True)
class CatalogStats:
    listings: int           # folder listings sent to stores
    fetched: int            # whole manifests read from stores
    summaries: int          # summaries read from stores (ranged reads)
    cached: int             # summaries kept (keys are immutable)
    commits: int
    failed_commits: int     # commits that did not reach write_quorum
    retired: int            # old versions deleted
    transactions: int       # multi-path commits (folder renames, hard links) committed here
    voided: int             # failed commits and transactions voided by a twin or marker
    unvoided: int           # ... whose twin or marker no store took yet: they may count (retried)
    remembered: int = 0     # transactions remembered as committed or voided for good (those a version names)


class Listing(dict[str, list[str]]):
    """A listing of every store: key -> the stores that list it."""
    complete = True         # every store answered (else a key may be on a store it missed)
    missed: frozenset[str] = frozenset()     # the stores that did not


class Snapshot(dict[str, "Summary | Unreadable"]):
    """Every path that exists -> its current version (load_all). `missed`: the stores whose listing
    failed; a path whose placement stores they are may exist without being here (listed_enough)."""
    missed: frozenset[str] = frozenset()


def voided(refs: Iterable[VersionRef]) -> set[tuple[int, str]]:
    """The (version, writer) of every failed key: a failed key voids an ok or deleted key of the same
    version and writer (its twin: see the module doc)."""
    return {r.order for r in refs if r.state == "failed"}


def counted(refs: list[VersionRef], committed: Container[str] = ()) -> list[VersionRef]:
    """The versions that count: those no twin voids, outside transactions not known to have committed."""
    void = voided(refs)
    return [r for r in refs if (r.state == "failed" or r.order not in void) and (not r.txn or r.txn in committed)]


def folders_above(path: str) -> list[str]:
    """"/a/b/c" -> ["/a", "/a/b"]: the folders a path lies in, below the root."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _not_removed_since(path: str, cur: VersionRef | None, seen: Mapping[str, tuple[int, str]],
                       below: str | None = None) -> None:
    """Stale if `path`'s current version is a removal newer than the version of it the writer saw."""
    if cur is not None and cur.state == "deleted" and path in seen and cur.order > seen[path]:
        what = f"{below}: not saved: its folder {path} was" if below else f"{path}: not saved: it was"
        raise Stale(f"{what} removed or renamed by another mount while open here (the commit would "
                    f"bring the old name back)")


def current_of(refs: list[VersionRef], committed: Container[str] = ()) -> VersionRef | None:
    """The version that is the path now (None: never committed), by key names alone and the
    transactions known to have committed."""
    live = [r for r in counted(refs, committed) if r.state != "failed"]
    return max(live, key=lambda r: r.order) if live else None


class Catalog:
    def __init__(self, pool: StorePool, writer: str = WRITER_ID, journal: VoidJournal | None = None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        """`writer`: this committer's id (one per process; tests may act as several). `journal`: where
        the twins and markers no store took are kept across restarts (read here, at startup). `clock`:
        the wall clock of the commits' `committed_ns` (tests give a host's that is off)."""
        if not re.fullmatch(r"[0-9a-f]{1,32}", writer):
            raise ValueError(f"writer id {writer!r}: 1 to 32 lowercase hex digits (a version key holds it)")
        self.pool = pool
        self._cfg = pool.config
        self._writer = writer
        self._clock = clock
        self._parsed: OrderedDict[str, Manifest] = OrderedDict()     # LRU of whole manifests
        self._summaries: dict[str, Summary] = {}
        self._highest: dict[str, int] = {}        # path hash -> highest version seen or committed here
        self._txns: set[str] = set()              # transactions on write_quorum stores: committed for good
        self._void_seen: dict[str, set[tuple[int, str]]] = {}   # path hash -> voided orders, last listed
        self._txns_voided: set[str] = set()       # transactions whose void marker a listing showed
        self._listings = self._fetched = self._read_summaries = 0
        self._commits = self._failed = self._retired = 0
        self._transactions = self._voided = 0
        self._journal = journal or VoidJournal(None)
        self._unvoided = self._journal.pending()  # twin or marker key -> bytes: no store took it yet
        self._folders_seen: dict[str, float] = {} # folder -> when a commit below it found it no file
        self._names = frozenset(pool.names)
        self._own = pool.layout
        self.layouts: tuple[Layout, ...] = (self._own,)     # where versions may sit (take_roster), sorted
        self._keep_versions = self._cfg.keep_versions

    def take_roster(self, layouts: Iterable[Layout], keep_versions: int) -> None:
        """The layouts and the most versions per path kept that the stores' roster names (cpfs/roster.py:
        a writer's catalog takes them at startup): listings must reach each layout's stores, and
        commits retire versions only beyond the most any writer keeps."""
        self.layouts = tuple(sorted({*self.layouts, *layouts},
                                    key=lambda la: (la.stores, la.replicas, la.write_quorum, la.spares)))
        self._keep_versions = max(self._keep_versions, keep_versions)

    def statistics(self) -> CatalogStats:
        return CatalogStats(listings=self._listings, fetched=self._fetched, summaries=self._read_summaries,
                            cached=len(self._summaries), commits=self._commits, failed_commits=self._failed,
                            retired=self._retired, transactions=self._transactions, voided=self._voided,
                            unvoided=len(self._unvoided),
                            remembered=len(self._txns) + len(self._txns_voided))

    # -- reading ---------------------------------------------------------------------------------
    async def _list(self, prefix: str) -> "Listing":
        """key -> the stores that list it, over every store; fails only if no store answers."""
        where = Listing()
        errors: list[StoreError] = []

        async def one(name: str) -> None:
            try:
                keys = await self.pool.list_keys(name, prefix)
            except StoreError as e:
                log.warning("cannot list %s on store %r: %s", prefix, name, e)
                errors.append(e)
                return
            for key in keys:
                where.setdefault(key, []).append(name)

        self._listings += len(self.pool.names)
        async with trio.open_nursery() as n:
            for name in self.pool.names:
                n.start_soon(one, name)
        if errors and len(errors) == len(self.pool.names):
            raise errors[0]
        where.complete = not errors
        where.missed = frozenset(e.store for e in errors)
        return where

    async def _fetch(self, key: str, names: Sequence[str]) -> Manifest:
        """The whole manifest under `key` from the first store that has an intact copy."""
        if key in self._parsed:
            self._parsed.move_to_end(key)
            return self._parsed[key]

        async def read(name: str) -> Manifest:
            data = await self.pool.get(name, key)
            self._fetched += 1
            # A 100 GB file's manifest is megabytes of JSON: parse it off the event loop.
            return await trio.to_thread.run_sync(Manifest.from_bytes, data, f"store {name!r} {key}",
                                                 limiter=self.pool.cpu)

        m = await self._first_intact(key, names, read)
        self._parsed[key] = m
        while len(self._parsed) > _KEEP_PARSED:
            self._parsed.popitem(last=False)
        return m

    async def _summary(self, key: str, names: Sequence[str]) -> Summary:
        """The summary of the version under `key` (a ranged read of its first line)."""
        s = self._summaries.get(key)
        if s is None:
            async def read(name: str) -> Summary:
                data = await self.pool.get_range(name, key, 0, SUMMARY_MAX)
                self._read_summaries += 1
                return Summary.from_bytes(data, f"store {name!r} {key}")

            s = self._summaries[key] = await self._first_intact(key, names, read)
        return dataclasses.replace(s, key=key, stores=tuple(names))

    async def _first_intact(self, key: str, names: Sequence[str], read: Callable[[str], Awaitable[T]]) -> T:
        """read(name) over the stores until one gives a copy that parses and matches its key."""
        problems, gone = [], 0
        for name in names:
            try:
                m = await read(name)
            except NoSuchObject as e:
                problems.append(str(e))
                gone += 1
                continue
            except (StoreError, ManifestError) as e:
                log.warning("manifest %s on store %r unreadable: %s", key, name, e)
                problems.append(str(e))
                continue
            ref = VersionRef.parse(key)
            if ref is not None and (ref.version, ref.writer, ref.state) != (m.version, m.writer, m.state) \
                    or path_hash(m.path) != key[len(PREFIX):len(PREFIX) + 40]:
                problems.append(f"store {name!r} {key}: contents do not match the key")
                log.warning("manifest %s on store %r does not match its key", key, name)
                continue
            return m
        error = ManifestGone if names and gone == len(names) else ManifestError
        raise error(f"manifest {key}: no intact copy ({'; '.join(problems) or 'no store lists it'})")

    async def manifest(self, s: Summary) -> Manifest:
        """The whole manifest of a version a listing summarised (chunks, tensor index)."""
        return await self._fetch(s.key, s.stores or self.pool.names)

    async def _refs(self, path: str) -> tuple[list[VersionRef], Listing, set[str]]:
        """Every version key of a path (those of uncommitted transactions too: they take version
        numbers), where each is listed, and which of the transactions they name have committed."""
        return await self._refs_of(path_hash(path))

    async def _current_summary(self, h: str, refs: list[VersionRef], where: Mapping[str, Sequence[str]],
                               committed: set[str]) -> Summary | None:
        """The summary of the current version among `refs` (None: the path is removed). A version
        retired or voided between the listing and the read (a path committed several times a second:
        keep_versions deletes the listed one) is looked for again in a fresh listing of the path, a
        few times. Before, a refresh left such a busy file out of other mounts' listings (they took it
        for removed: `rsync --delete` from one deleted its copy; the tools audit's find) and `open`
        answered EIO."""
        relists = 0
        while True:
            cur = current_of(refs, committed)
            if cur is None or cur.state == "deleted":
                return None
            try:
                return await self._summary(cur.key, where[cur.key])
            except ManifestGone:
                relists += 1
                if relists > _RELISTS:
                    raise
            refs, where, fresh = await self._refs_of(h)
            committed = committed | fresh

    async def _refs_of(self, h: str) -> tuple[list[VersionRef], Listing, set[str]]:
        where = await self._list(f"{PREFIX}{h}/")
        refs = [r for r in map(VersionRef.parse, where) if r is not None]
        if refs:
            self._seen(h, max(r.version for r in refs))
        self._note_voids(h, refs)
        committed = set()
        for txn in {r.txn for r in refs if r.txn} - self._txns_voided:     # voided for good: not listed again
            if txn in self._txns or await self._committed(txn):
                committed.add(txn)
        return refs, where, committed

    def _note_voids(self, h: str, refs: list[VersionRef]) -> None:
        void = voided(refs)
        if void:
            self._void_seen[h] = void
        else:
            self._void_seen.pop(h, None)

    def voids(self, s: Summary) -> bool:
        """Whether a listing showed this version voided: by a twin (the last listing of its path), or
        as part of a transaction with a void marker (see the module doc). A mount that listed it in the
        moment before its writer voided it shows it until then, and must then go back to the version
        before, although that one is older."""
        r = VersionRef.parse(s.key)
        return r is not None and r.state != "failed" and (
            r.order in self._void_seen.get(r.path_hash, ()) or r.txn in self._txns_voided)

    async def _committed(self, txn: str) -> bool:
        """Whether `txn` counts now: its record is listed and its void marker is not."""
        where = await self._list(f"{TXN_PREFIX}{txn}.")
        return txn in self._remember(where)

    def _remember(self, where: dict[str, list[str]]) -> set[str]:
        """The transactions that count by a listing of records (key -> stores); remembers for good
        those on write_quorum stores (see the module doc)."""
        records, void = txns_listed(where)
        self._txns_voided |= void
        counting = records - void
        self._txns |= {t for t in counting if len(where[txn_key(t)]) >= self._cfg.write_quorum}
        return counting

    async def current(self, path: str) -> Summary:
        """The current version's summary; NotFound if there is none, ManifestError if unreadable."""
        refs, where, committed = await self._refs(path)
        s = await self._current_summary(path_hash(path), refs, where, committed)
        if not self.listed_enough(path, where.missed):
            # A newer version (or its removal) may be on the stores that missed: a spare took it while
            # a placement store was down (the spares review: a fresh reader got the version before).
            raise self._unlisted(path, where.missed, "to tell whether it exists" if s is None
                                 else "to tell which version is current")
        if s is None:
            raise NotFound(f"no file {path!r}")
        if s.path != path:
            raise ManifestError(f"manifest {s.key} names {s.path!r}, not {path!r}")
        return s

    async def get(self, path: str) -> Manifest:
        """The current version; NotFound if there is none, ManifestError if it cannot be read. One
        retired between its listing and the read of its manifest is looked up again (`_RELISTS`)."""
        relists = 0
        while True:
            try:
                return await self.manifest(await self.current(path))
            except ManifestGone:
                relists += 1
                if relists > _RELISTS:
                    raise

    async def history(self, path: str) -> list[VersionInfo]:
        """Every kept version, newest first. StoreUnavailable if the listing missed stores that may hold
        some: `cpfs log` and `restore` said the path had no versions while its stores were down (an
        audit's find)."""
        refs, where, committed = await self._refs(path)
        if not self.listed_enough(path, where.missed):
            raise self._unlisted(path, where.missed, "to list them all")
        refs = counted(refs, committed)
        cur = current_of(refs, committed)
        out: list[VersionInfo] = []
        for r in sorted(refs, key=lambda r: r.order, reverse=True):
            try:
                out.append(VersionInfo(r, await self._summary(r.key, where[r.key]), r == cur))
            except ManifestGone:
                continue                        # retired since the listing
            except ManifestError as e:
                out.append(VersionInfo(r, None, r == cur, str(e)))
        return [i for i in out if i.summary is None or i.summary.path == path]

    async def moved(self, txn: str) -> tuple[list[str], list[str]]:
        """The paths a committed transaction wrote and removed, in pairs where it renamed (`cpfs log`
        says where a renamed file went, and where one came from), from its record; ([], []) if no copy
        can be read. A record from before the count of writes gives every path as written."""
        key = txn_key(txn)
        for name in (await self._list(f"{TXN_PREFIX}{txn}.")).get(key, []):
            try:
                doc = json.loads(await self.pool.get(name, key))
                paths, written = doc["paths"], doc.get("written", len(doc["paths"]))
                if isinstance(paths, list) and all(isinstance(p, str) for p in paths) and isinstance(written, int):
                    return paths[:written], paths[written:]
            except StoreError as e:
                log.warning("transaction %s: record on store %r unreadable: %s", txn, name, e)
            except MALFORMED:
                log.warning("transaction %s: record on store %r is not one", txn, name)
        return [], []

    async def get_version(self, path: str, version: int) -> Manifest:
        """One kept version (any state but deleted), e.g. for `cpfs cat --version`."""
        for info in await self.history(path):
            if info.ref.version == version and info.ref.state != "deleted":
                if info.summary is None:
                    raise ManifestError(f"{path} version {version}: {info.error}")
                try:
                    return await self.manifest(info.summary)
                except ManifestGone:
                    break                   # retired since the listing
        raise NotFound(f"{path}: no version {version} (see cpfs log {path})")

    async def load_all(self) -> Snapshot:
        """Every path that exists now -> its current version's summary (or Unreadable). Unreadable
        stores are logged and skipped as long as some store answers; the answer names them.
        A transaction whose record landed between the listing of records and that of manifests, and
        whose writer then retired the versions it replaced (`x.tmp` renamed over `x` several times a
        second, keep_versions 1), left a path with no version this listing counts: the snapshot took
        it for removed, and mounts dropped it from their listings (the busy commits audit: 8,930 of
        82,430 listings without `x`). Such a torn listing is made again, up to `_RELISTS` times."""
        for _ in range(_RELISTS + 1):
            out, torn = await self._load_all_once()
            if not torn:
                break
            log.info("a transaction committed while the stores were listed (%s): listing again", torn)
        return out

    async def _load_all_once(self) -> tuple[Snapshot, str]:
        """The snapshot, and a transaction that tore it ("" if none: see load_all)."""
        known = set(self._txns)          # committed before the listings: known to this snapshot
        committed = known | await self.committed_transactions()   # before manifests: see the module doc
        settled = set(self._txns), set(self._txns_voided)
        where = await self._list(PREFIX)
        by_hash: dict[str, list[VersionRef]] = {}
        legacy = []
        for key in where:
            r = VersionRef.parse(key)
            if r is not None:
                by_hash.setdefault(r.path_hash, []).append(r)
            elif _LEGACY.fullmatch(key):
                legacy.append(key)
        for key in legacy:
            r = await self._migrate(key, where)
            if r is not None:
                by_hash.setdefault(r.path_hash, []).append(r)
        if not where.missed:     # summaries of versions retired since (by other mounts: the soak audit
            # found a reader's cache growing by 29,000 an hour): read again if ever needed
            for key in [k for k in self._summaries if k not in where]:
                del self._summaries[key]
            self._forget_txns(settled, {r.txn for refs in by_hash.values() for r in refs if r.txn})
        out = Snapshot()
        out.missed = where.missed
        limiter = trio.CapacityLimiter(_FETCHES)
        torn = ""
        late: dict[str, bool] = {}      # transactions not counted by the listing -> counted now

        async def counted_late(txn: str) -> bool:
            if txn not in late:
                late[txn] = await self._committed(txn)
            return late[txn]

        async def one(h: str, refs: list[VersionRef]) -> None:
            nonlocal torn
            self._seen(h, max(r.version for r in refs))
            self._note_voids(h, refs)
            cur = current_of(refs, committed)
            if cur is None or cur.state == "deleted":
                pending = {r.txn for r in refs if r.txn and r.txn not in committed} - self._txns_voided
                async with limiter:
                    for txn in sorted(pending):
                        if await counted_late(txn):
                            torn = txn
                            return
                return
            async with limiter:
                try:
                    s = await self._current_summary(h, refs, where, committed)
                    if s is None:
                        return
                    if self.listed_enough(s.path, where.missed) or s.directory or s.link:
                        out[s.path] = s
                    else:
                        # A newer version may be on the stores that missed (a spare took it while a
                        # placement store was down): shown, so that no put or create replaces it
                        # (left out, a folder of such files looked empty), but EIO when opened.
                        out[s.path] = Unreadable(s.path, s.key, self._unlisted(
                            s.path, where.missed, "to tell which version is current").detail, unlisted=True)
                    return
                except ManifestError as e:
                    reason = str(e)
                # The path comes from an older version we can read, if any: the file is shown, and
                # opening it says what is wrong, rather than the file silently going back in time.
                for r in sorted(refs, key=lambda r: r.order, reverse=True):
                    if r != cur and (not r.txn or r.txn in committed):
                        try:
                            path = (await self._summary(r.key, where[r.key])).path
                        except ManifestError:
                            continue
                        log.error("%s: current version unreadable, open gives EIO: %s", path, reason)
                        out[path] = Unreadable(path, cur.key, reason)
                        return
                log.error("skipping a file whose only manifests are unreadable: %s", reason)

        async with trio.open_nursery() as n:
            for h, refs in by_hash.items():
                n.start_soon(one, h, refs)
        return out, torn

    def _forget_txns(self, settled: tuple[set[str], set[str]], named: set[str]) -> None:
        """Forget the transactions remembered before a complete listing of the manifests (`settled`:
        committed, voided) that no version it listed names: all of a transaction's versions are written
        before its record, so none of them is left, and none will be. Kept, a mount remembered every
        transaction it ever saw (a save by temporary name and rename is one) and copied them all at
        each listing. One committed meanwhile is not in `settled`: its versions may be unlisted yet."""
        self._txns -= settled[0] - named
        self._txns_voided -= settled[1] - named

    async def committed_transactions(self) -> set[str]:
        """The transactions that count by a listing of every store's records (see the module doc)."""
        return self._remember(await self._list(TXN_PREFIX))

    async def _migrate(self, key: str, where: dict[str, list[str]]) -> VersionRef | None:
        """Copy a format-1 manifest to its version key on the stores that hold it, then drop the old key."""
        try:
            m = await self._fetch(key, where[key])
        except ManifestError as e:
            log.error("format-1 manifest %s unreadable, left as it is: %s", key, e)
            return None
        new = dataclasses.replace(m, state="ok")
        ref = VersionRef(path_hash(m.path), new.version, new.writer, "ok",
                         VersionRef.key_of(path_hash(m.path), new.version, new.writer, "ok"))
        try:
            await self.pool.put_quorum(where[key], ref.key, new.to_bytes(), len(where[key]))
        except StoreError as e:
            log.warning("could not migrate format-1 manifest %s (kept as it is): %s", key, e)
            self._parsed[ref.key] = new
            self._summaries[ref.key] = new.summary
            where[ref.key] = where[key]
            return ref
        await self._delete(where[key], key)
        log.info("migrated %s to %s", key, ref.key)
        self._parsed[ref.key] = new
        self._summaries[ref.key] = new.summary
        where[ref.key] = where.pop(key)
        return ref

    # -- writing ---------------------------------------------------------------------------------
    async def commit(self, manifest: Manifest) -> Manifest:
        """Make `manifest` the path's new current version (its `version` is assigned here); returns what
        was committed. Below write_quorum this raises the StoreError and every store still holds the
        previous version as it was."""
        return await self._commit(manifest, "ok", "")

    async def commit_failed(self, manifest: Manifest, reason: str) -> Manifest:
        """Record bytes that did not make a complete file: kept in the history, never current."""
        return await self._commit(manifest, "failed", reason)

    async def remove(self, path: str, folder: bool | None = None) -> None:
        """A tombstone version: the path is gone, its history stays (restore brings it back). `folder`:
        the kind the caller removes (rmdir: True, unlink: False). If the current version is the other
        kind, another mount replaced what the caller saw (a folder by a file, or the reverse), and
        nothing is removed: NotADirectory or IsADirectory. An rmdir once removed such a file."""
        try:
            s = await self.current(path)
            if folder is not None and s.directory != folder:
                raise (NotADirectory if folder else IsADirectory)(
                    f"{path}: a {'file' if folder else 'folder'} now (committed elsewhere): not removed")
            m = await self.manifest(s)
        except ManifestError as e:       # an unreadable current version can still be removed
            log.warning("%s: removing a file whose manifest is unreadable: %s", path, e)
            m = Manifest(path=path, size=0, mtime_ns=0, mode=0o644, chunk_size=self._cfg.chunk_size,
                         chunks=(), version=0)
        await self._tombstone(m)

    async def move(self, manifest: Manifest, path: str) -> Manifest:
        """Commit `manifest` under a new path and remove the old path, as one transaction."""
        moved, = await self.transact([dataclasses.replace(manifest, path=path)], [manifest])
        return moved

    async def transact(self, writes: Sequence[Manifest], removes: Sequence[Manifest] = (),
                       replacing: Mapping[str, tuple[int, str]] | None = None,
                       seen: Mapping[str, tuple[int, str]] | None = None) -> list[Manifest]:
        """Commit `writes` and remove the paths of `removes` all at once (see the module doc): returns
        the committed versions of `writes`, in order. On failure (a StoreError, or cancellation) no
        path has changed. `replacing`: path -> the order of a version of it that the new one replaces
        (a snapshot an fsync committed in the same write session): retired once the new one counts,
        and never counted toward keep_versions. `seen`: path of a write or of a folder above one ->
        the order of its version the writer saw; Stale if a removal newer than that is current now
        (another mount removed or renamed it meanwhile: the write would bring the old name back)."""
        replacing, seen = replacing or {}, seen or {}
        plan = [(m, "ok") for m in writes] + [(self._tomb(m), "deleted") for m in removes]
        paths = [m.path for m, _ in plan]
        if len(set(paths)) != len(paths):
            raise ValueError(f"a transaction changes each path once: {sorted(paths)}")
        await self._renew_moved(writes)
        if len(plan) == 1:
            m, state = plan[0]
            return [await self._commit(m, state, "", replacing.get(m.path), seen)][:len(writes)]
        await self._under_folders([m.path for m in writes], seen)
        await self.retry_voids()
        txn = secrets.token_hex(8)
        written: list[tuple[list[str], str]] = []      # (stores, key) of the versions, to take back on failure

        async def stage(item: tuple[Manifest, str]) -> tuple[Manifest, VersionRef, list[VersionRef],
                                                               Listing, set[str]]:
            refs, where, committed = await self._listed_refs(item[0].path)
            if item[1] == "ok":
                _not_removed_since(item[0].path, current_of(refs, committed), seen)
            new, ref, targets = self._next(item[0], refs, item[1], "", txn)
            written.append((targets, ref.key))
            where[ref.key] = await self.pool.put_quorum(targets, ref.key, new.to_bytes(), self._cfg.write_quorum)
            return new, ref, refs, where, committed

        record = json.dumps({"txn": txn, "writer": self._writer, "host": HOST, "committed_ns": self._clock(),
                             "paths": paths, "written": len(writes)}).encode()
        record_stores: list[str] = []
        try:
            staged = await in_parallel(stage, plan, _FETCHES)
            record_stores = self.pool.targets(txn)
            await self.pool.put_quorum(record_stores, txn_key(txn), record, self._cfg.write_quorum)   # commit point
        except BaseException as e:
            self._failed += 1
            with trio.CancelScope(shield=True):
                await self._take_back_transaction(txn, record_stores, written, e)
            raise
        self._txns.add(txn)
        self._transactions += 1
        done: dict[str, Manifest] = {}
        for new, ref, refs, where, committed in staged:
            self._took(new, ref, where[ref.key], where)
            done[new.path] = new
            await self._retire([*refs, ref], where, committed | {txn}, replacing.get(new.path))
        return [done[m.path] for m in writes]

    async def _take_back_transaction(self, txn: str, record_stores: list[str],
                                     written: list[tuple[list[str], str]], error: BaseException) -> None:
        """A transaction failed: its record first (voided, then deleted: then no reader counts the rest);
        then its versions, unless the record may count, so that it counts whole or not at all.
        Their numbers are never used again (as `_take_back_version`'s: a copy that comes back with its
        record must not share its path's version and writer with a later commit's other bytes)."""
        for _, key in written:
            if (r := VersionRef.parse(key)) is not None:
                self._seen(r.path_hash, r.version)
        if record_stores:
            # The marker first, as `_take_back_version` its twin: a record copied back after its delete
            # (a scrub's repair) must not make the failed transaction count.
            marker = json.dumps({"txn": txn, "writer": self._writer, "host": HOST, "failed": _why(error)}).encode()
            marked = await self._void(txn_key(txn, void=True), marker)
            left = await self._delete(record_stores, txn_key(txn))
            if not marked and (left or not isinstance(error, StoreError)):
                await self._pend(txn_key(txn, void=True), marker)
                log.error("transaction %s failed, and its record may remain on %s, which no store let us void: "
                          "its versions are kept, so another mount may count it (whole)", txn, left or record_stores)
                return
        for stores, key in written:
            await self._delete(stores, key)     # a leftover never counts without its record: gc deletes it

    async def restore(self, path: str, version: int) -> Manifest:
        """Make an old version current again, as a new commit (so a restore is itself undoable). Its
        chunks' copies are renewed first: a gc running meanwhile may have found no version naming
        them (a removed path whose history it purges), and spares them only if they are young."""
        old = await self.get_version(path, version)
        await self._renew(old)
        return await self.commit(dataclasses.replace(old, reason=""))

    async def _renew_moved(self, writes: Sequence[Manifest]) -> None:
        """Touch the chunks of versions a rename or link moves that were committed more than gc_grace/4
        ago: the new version names them without storing them, and a gc that listed the new path before
        the rename landed and the old one after it saw neither, and deleted them (an audit's find). A
        commit of written bytes (committed_ns 0: never committed) renews what it reuses itself (the
        write session). A version committed since is young enough: its chunks were stored or renewed
        at its commit, at most gc_grace/2 before it."""
        now = self._clock()
        moved = {c.digest: (m, c) for m in writes if m.committed_ns
                 and now - m.committed_ns > self._cfg.gc_grace * 1e9 / 4 for c in m.chunks}
        if not moved:
            return

        async def one(item: tuple[Manifest, ChunkEntry]) -> None:
            m, c = item
            if not await self._renew_chunk(c):
                log.warning("%s: chunk %s has no copy left to renew; the version moves as it is", m.path,
                            c.digest[:16])
        await in_parallel(one, list(moved.values()), self._cfg.fetch_concurrency)

    async def _renew_chunk(self, c: ChunkEntry) -> bool:
        """Touch a copy of the chunk, on the stores its entry names, else on its placement; whether one was."""
        if (await self.pool.renew(c.digest, c.stores))[0]:
            return True
        others = [n for n in place(c.digest, self.pool.names, self._cfg.replicas) if n not in c.stores]
        return bool(others) and (await self.pool.renew(c.digest, others))[0]

    async def _renew(self, m: Manifest) -> None:
        """Touch a copy of every chunk of `m`; ChunkUnavailable if a chunk has none left."""
        async def one(c: ChunkEntry) -> None:
            if not await self._renew_chunk(c):
                raise ChunkUnavailable(f"{m.path} version {m.version}: chunk {c.digest[:16]} has no copy left "
                                       f"(stores {', '.join(c.stores)}, and its placement): it cannot be restored")

        await in_parallel(one, list({c.digest: c for c in m.chunks}.values()), self._cfg.fetch_concurrency)

    @staticmethod
    def _tomb(m: Manifest) -> Manifest:
        return dataclasses.replace(m, size=0, chunks=(), tensor_index=None)

    async def _tombstone(self, m: Manifest) -> None:
        await self._commit(self._tomb(m), "deleted", "")

    async def _listed_refs(self, path: str) -> tuple[list[VersionRef], Listing, set[str]]:
        """The path's versions, for a commit: its version is one above the highest listed. A version
        lands on write_quorum of the path's placement stores and spares (`Layout.holders`), so the
        listing must reach holders - write_quorum + 1 of them to meet every one (`listed_enough`).
        With write_quorum 1 of 2, a save listed on the one store that missed the newest versions took a
        lower number than they had, and once the other store was back, the older save was current again
        (an audit's find): such a commit now fails (EIO) instead."""
        try:
            refs, where, committed = await self._refs(path)
        except StoreError as e:
            raise StoreUnavailable(e.store, f"cannot list the versions of {path}: {e.detail}") from None
        if not self.listed_enough(path, where.missed):
            raise self._unlisted(path, where.missed, "to number a new one")
        return refs, where, committed

    def listed_enough(self, path: str, missed: Container[str]) -> bool:
        """Whether a listing that the stores `missed` did not answer meets every version of `path`: a
        version lands on write_quorum of the path's placement stores and spares, so the listing must
        reach holders - write_quorum + 1 of them (`Layout.reached`: with the defaults, 1 of 2 stores,
        2 of 3 with a spare), under every layout a writer of these stores used (`layouts`)."""
        return self._short_layout(path, missed) is None

    def _short_layout(self, path: str, missed: Container[str]) -> Layout | None:
        """A layout whose stores the listing did not reach enough of (stores this config lacks count as
        missed), or None."""
        for layout in self.layouts:
            gone = {n for n in layout.stores if n in missed or n not in self._names}
            if gone and not layout.reached(path_hash(path), gone):
                return layout
        return None

    def whole(self, snapshot: Snapshot) -> bool:
        """Whether a load_all shows every path there is: the stores it missed hold fewer than
        write_quorum copies of any version (else some path's versions may all be on them)."""
        return len(snapshot.missed) < self._cfg.write_quorum

    def _unlisted(self, path: str, missed: Container[str], why: str) -> StoreUnavailable:
        layout = self._short_layout(path, missed)
        assert layout is not None
        placement = layout.holders(path_hash(path))
        out = sorted(n for n in placement if n in missed or n not in self._names)
        lacked = [n for n in out if n not in self._names]
        other = "" if layout == self._own else (
            f" where a config of stores {', '.join(layout.stores)} put them (the stores' roster)")
        retired = "" if not lacked else (
            f"; {', '.join(lacked)} not in this config: once `cpfs scrub --repair` has copied what it held, "
            f"`cpfs gc --forget-store NAME` retires it")
        return StoreUnavailable(out[0], f"cannot list the versions of {path} on enough stores {why}: "
                                f"{len(placement) - len(out)} of its {len(placement)} answered ({', '.join(out)} did "
                                f"not){other}, {layout.needed(path_hash(path))} needed with write_quorum "
                                f"{layout.write_quorum}{retired}")

    def _seen(self, h: str, version: int) -> None:
        """Version `version` of path hash `h` exists or existed (listed, committed, or taken back):
        the path's next commit numbers above it, so no key is ever used for two contents."""
        self._highest[h] = max(self._highest.get(h, 0), version)

    def _next(self, manifest: Manifest, refs: list[VersionRef], state: str, reason: str,
              txn: str = "", targets: list[str] | None = None) -> tuple[Manifest, VersionRef, list[str]]:
        """The path's next version: the manifest to store, its key, and the stores it goes to (`targets`,
        else `StorePool.targets`: a spare for one marked down)."""
        h = path_hash(manifest.path)
        version = max([r.version for r in refs] + [self._highest.get(h, 0)]) + 1
        new = dataclasses.replace(manifest, version=version, writer=self._writer, host=HOST,
                                  committed_ns=self._clock(), state=state, reason=reason)
        ref = VersionRef(h, version, self._writer, state, VersionRef.key_of(h, version, self._writer, state, txn),
                         txn)
        return new, ref, targets or self.pool.targets(h)

    def _took(self, new: Manifest, ref: VersionRef, held: list[str], where: dict[str, list[str]]) -> None:
        """A version committed: remember it (keys are immutable)."""
        self._commits += 1
        self._seen(ref.path_hash, ref.version)
        self._parsed[ref.key] = new
        self._summaries[ref.key] = new.summary
        where[ref.key] = held

    async def _under_folders(self, paths: Sequence[str], seen: Mapping[str, tuple[int, str]] = {}) -> None:
        """Whether the folders a version is committed below are still there. NotADirectory if one is a
        file now (another mount removed it and saved a file or a symlink under its name); Stale if
        one the writer saw (`seen`, see transact) was removed or renamed since. Committed anyway, the
        version was hidden below that file in every listing, or brought the old folder back with it
        alone in it (a shard saved into `tmp/` as another host renamed it `step_100/`): a save that
        returned success and was not where its writer put it (audits' finds). Each folder is looked
        up at most every FOLDERS_SEEN s, all at once; a lookup that cannot tell (stores down, an
        unreadable version) lets the commit go on."""
        now = trio.current_time()
        todo = {a for p in paths for a in folders_above(p)
                if now - self._folders_seen.get(a, -math.inf) >= FOLDERS_SEEN}

        async def kind(folder: str) -> tuple[VersionRef | None, Summary | None]:
            refs, where, committed = await self._refs(folder)
            if not self.listed_enough(folder, where.missed):
                return None, None    # its newest versions may be on the stores that missed: cannot tell
            cur = current_of(refs, committed)
            if cur is None or cur.state == "deleted":
                return cur, None     # none, or removed: a folder made by its files' paths shows it still
            return cur, await self._summary(cur.key, where[cur.key])

        out = await fan_out(kind, sorted(todo), catch=(ManifestError, StoreError))
        for folder, (cur, s) in sorted(out.results.items()):
            below = next(p for p in paths if p.startswith(folder + "/"))
            if s is not None and not s.directory:
                raise NotADirectory(f"{below}: not saved: {folder} is a file now (committed elsewhere)")
            _not_removed_since(folder, cur, seen, below)
            self._folders_seen[folder] = now
        if len(self._folders_seen) > 4096:
            self._folders_seen = {f: t for f, t in self._folders_seen.items() if now - t < FOLDERS_SEEN}

    async def _commit(self, manifest: Manifest, state: str, reason: str,
                      replacing: tuple[int, str] | None = None,
                      seen: Mapping[str, tuple[int, str]] = {}) -> Manifest:
        if state == "ok":
            await self._under_folders([manifest.path], seen)
        await self.retry_voids()
        retry: list[str] | None = None
        for again in (False, True):
            # Listed again for the retry: another writer may have taken the next number meanwhile
            # (the retry with its old listing tied with it, and the save done last was hidden).
            refs, where, committed = await self._listed_refs(manifest.path)
            if state == "ok":
                _not_removed_since(manifest.path, current_of(refs, committed), seen)
            new, ref, targets = self._next(manifest, refs, state, reason, targets=retry)
            try:
                held = await self.pool.put_quorum(targets, ref.key, new.to_bytes(), self._cfg.write_quorum)
                break
            except BaseException as e:
                self._failed += 1
                with trio.CancelScope(shield=True):
                    await self._take_back_version(new, ref, targets, e)
                # A target went down during the put: once more, under the next number (this one is
                # voided), a spare standing in for it (cpfs/placement.py: Layout).
                retry = None if again else self.pool.retarget(ref.path_hash, targets, e)
                if retry is None:
                    raise
                log.warning("%s: version %d failed to commit (%s); committing it again on %s", manifest.path,
                            ref.version, _why(e), ", ".join(retry))
        self._took(new, ref, held, where)
        await self._retire([*refs, ref], where, committed, replacing)
        return new

    async def _take_back_version(self, new: Manifest, ref: VersionRef, targets: list[str],
                                 error: BaseException) -> None:
        """Below quorum (or cancelled) the commit failed: take back the copies that landed, or a reader
        that finds one would see a version the writer was told did not commit. Where a copy may remain
        (a delete failed; a cancelled put may still land), void it with its twin (see the module doc).
        Older versions are untouched."""
        # Its number is never used again, even where every copy was deleted: a copy that lands late (a
        # put the store carries out after its timeout) or comes back (a store restored from a snapshot)
        # would share its key, which readers take as immutable, with the next commit's different bytes:
        # the same version read as two checkpoints, by replica (the rollback audit).
        self._seen(ref.path_hash, ref.version)
        if ref.state == "failed":                         # a failed version never counts anyway
            await self._delete(targets, ref.key)
            return
        # The twin first, and also where every delete will succeed: a copy can be put back after it
        # (`cpfs scrub --repair` copying the one it listed a moment before, a put the store carries out
        # late), and without a twin that failed save became the path's current version.
        twin = dataclasses.replace(new, state="failed", reason=f"commit failed: {_why(error)}").to_bytes()
        key = VersionRef.key_of(ref.path_hash, ref.version, ref.writer, "failed")
        twinned = await self._void(key, twin)
        left = await self._delete(targets, ref.key)
        if not twinned and (left or not isinstance(error, StoreError)):
            await self._pend(key, twin)
            log.error("%s: version %d failed to commit, and a copy may remain on %s, which no store let us "
                      "void: another mount may count it", new.path, ref.version, left or targets)

    async def _delete(self, stores: Sequence[str], key: str) -> list[str]:
        """Delete `key` on `stores`, at once; the stores where it may remain (logged)."""
        out = await fan_out(lambda name: self.pool.delete(name, key), stores, catch=StoreError)
        for name, e in out.errors:
            log.warning("could not delete %s on store %r: %s", key, name, e)
        return [name for name, _ in out.errors]

    async def _void(self, key: str, data: bytes, retry: bool = False) -> bool:
        """Put a twin or a void marker on every store that takes it; whether one did. If none did,
        the caller says whether it must be tried again (`_pend`)."""
        try:
            await self.pool.put_quorum(self.pool.names, key, data, 1)
        except StoreError:
            return False
        if self._unvoided.pop(key, None) is not None:
            await self._journal.remove(key)
        elif retry:                                               # not twice for one key
            return True
        self._voided += 1
        log.warning("voided a failed commit with %s%s", key, " on a later try" if retry else "")
        return True

    async def _pend(self, key: str, data: bytes) -> None:
        """A twin or void marker no store took, where a copy may remain: the next commit tries it again
        (`retry_voids`), in this process or, from its journal, a later one."""
        if key not in self._unvoided:
            self._unvoided[key] = data
            await self._journal.add(key, data)

    async def retry_voids(self) -> None:
        """The twins and void markers no store took yet, again: before each commit (a store that refused
        for a moment must not leave a failed commit counting until the path's next commit), and when a
        mount starts (its journal's, left by an earlier process). A key stays pending until a put of it
        succeeds, also if this is cancelled."""
        for key, data in list(self._unvoided.items()):
            if key in self._unvoided:
                await self._void(key, data, retry=True)

    async def keep_voiding(self, interval: float = VOID_RETRY,
                           task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled (with the mount): every `interval` s, the journal's keys (other processes on
        this host add theirs: a `cpfs put` that failed and exited) and those still pending, put again.
        Else a writer that commits nothing more left a failed commit counting until a restart."""
        task_status.started()
        while True:
            await trio.sleep(interval)
            try:
                for key, data in (await self._journal.read()).items():
                    self._unvoided.setdefault(key, data)
                await self.retry_voids()
            except Exception:                 # a bug here must not end the mount; the next round tries again
                log.exception("trying again to void failed commits")

    async def _retire(self, refs: list[VersionRef], where: Listing, committed: Container[str],
                      replacing: tuple[int, str] | None = None) -> None:
        """Delete versions beyond keep_versions (see the module doc), and copies their twin voids, and
        the version `replacing` names (an fsync's snapshot the new version replaces: counted, ten fsyncs
        of a log retired the last whole version before them). Best effort: a leftover old version is
        only clutter, never current. A failed version is deleted only after a listing of every store:
        it may be the twin of a copy on a store this one missed, which would count again."""
        keep = self._keep_versions
        ok = failed = 0
        void = voided(refs)
        doomed = [r for r in refs if r.state != "failed" and r.order in void]
        twins = {r.order for r in doomed}
        # A transaction's version that does not count yet may be one still committing: never retired.
        for r in sorted(counted(refs, committed), key=lambda r: r.order, reverse=True):
            if r.order == replacing and r.state == "ok":
                if r.order not in twins:
                    doomed.append(r)
            elif ok >= keep or (r.state == "failed" and failed >= keep):
                if r.order not in twins and (r.state != "failed" or where.complete):
                    doomed.append(r)            # a twin stays while the copy it voids may be listed
            elif r.state == "ok":
                ok += 1
            elif r.state == "failed":
                failed += 1
        for r in doomed:
            await self._delete(where.get(r.key, []), r.key)
            self._parsed.pop(r.key, None)
            self._summaries.pop(r.key, None)
            self._retired += 1

