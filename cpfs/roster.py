"""The stores' roster: which stores, gc_grace and keep_removed the writers of these stores use.

Why. `cpfs gc` takes a chunk for garbage when no manifest it can read names it, and it reads the
manifests on the stores of its own config. Run with a config that lacks some of the mounts' stores, it
misses the versions whose manifests live only there and deletes their chunks; run with a gc_grace
shorter than a mount's, it deletes copies that mount reuses without touching (cpfs/gc.py, assumption
3). Either is one config mistake away (a cron job's config that did not get the new store).

So every writer (a mount, `cpfs put`, `rm`, `restore`, `scrub --repair`) enrolls its config on its
stores before it writes (and copies the enrollments it read to those of its stores that lack them): one
object per distinct config, `roster/<hash>.json`, holding the config's store names, gc_grace and
keep_removed. Writers with different configs write different keys, so none overwrites another's (no
read-modify-write to race). gc reads every enrollment on every store it has and refuses while one names
a store its own config lacks; it takes the longest gc_grace one names as its grace, and the longest
keep_removed as how long removed paths keep their history. A store retired for good (`cpfs scrub
--repair` moved its copies to the current placement) leaves the roster by `cpfs gc --forget-store
NAME`, which deletes the enrollments naming it and enrolls gc's own config; a mount that still lists it
enrolls it again at its next start.

The roster also tells a store in use from an empty folder or bucket in its place. Every writer
enrolls on every store of its config, so a store that lists no enrollment and no manifest while an
enrollment on another store names it is not the store the mounts wrote to: a network filesystem not
mounted (its empty mountpoint, or no folder at all: the first put created one on the local disk, and
the copies written there vanished under the remount), another bucket, a disk swapped for a blank one.
Writers refuse to start on it (`enroll`), and gc refuses to run: with two such stores the
versions whose manifests live only there go unseen and gc deleted their chunks on the others (an
audit's find). A blank store put in on purpose is taken in by `cpfs scrub --repair`, which refills it.

Enrollments also record each config's replicas, write_quorum, spares and keep_versions. Writers take
every layout the roster names (stores, replicas, write_quorum, spares), not only their own: after stores were added
or removed, a path's versions sit where the config that committed them placed them until `cpfs scrub
--repair` copies them, and a listing that missed those stores (down) numbered a new save below them and
showed the path absent (an audit's find: the save, said done, was hidden by the older version and then
retired). And they keep as many versions per path as the most any writer keeps: a cron job's config
with keep_versions = 1 retired the mounts' history with its first commit.

Caveats: a roster is only as complete as its writers' enrollments. Stores written before rosters
existed have none until a writer starts; an enrollment that no store took is logged by its writer. A
config whose store names differ from the mounts' for the same folders or buckets is refused by the
stores' identities (cpfs/identity.py), as is one whose URL points at another deployment's store.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection
from contextlib import aclosing
from dataclasses import dataclass

from . import identity
from .catalog import PREFIX as MANIFESTS, Catalog
from .errors import MALFORMED, ConfigError, ManifestError, NoSuchObject, StoreError
from .manifest import metadata_check
from .placement import Layout
from .pool import StorePool
from .sync import fan_out

log = logging.getLogger(__name__)

PREFIX = "roster/"
FORMAT = 1


def _key_of(data: bytes) -> str:
    """An enrollment's key: named by its bytes' check, so that a copy is verified by its name."""
    return f"{PREFIX}{metadata_check(data)}.json"


@dataclass(frozen=True)
class Enrollment:
    """One config's store names (sorted), gc_grace and keep_removed (seconds; inf: forever), and its
    replicas, write_quorum and keep_versions (None in enrollments written before they were recorded)
    and spares (0 if not recorded: written before spares, or a config without them, whose enrollment
    keeps its bytes and so its key)."""

    stores: tuple[str, ...]
    gc_grace: float
    keep_removed: float = math.inf
    replicas: int | None = None
    write_quorum: int | None = None
    keep_versions: int | None = None
    spares: int = 0

    @classmethod
    def of(cls, pool: StorePool) -> Enrollment:
        c = pool.config
        return cls(tuple(sorted(pool.names)), c.gc_grace, c.keep_removed, c.replicas, c.write_quorum, c.keep_versions,
                   pool.layout.spares)

    def to_bytes(self) -> bytes:
        keep = None if math.isinf(self.keep_removed) else self.keep_removed
        doc = {"format": FORMAT, "stores": list(self.stores), "gc_grace": self.gc_grace, "keep_removed": keep}
        if self.replicas is not None:
            doc |= {"replicas": self.replicas, "write_quorum": self.write_quorum, "keep_versions": self.keep_versions}
        if self.spares:
            doc["spares"] = self.spares
        return json.dumps(doc, sort_keys=True).encode()

    @property
    def key(self) -> str:
        return _key_of(self.to_bytes())

    @classmethod
    def parse(cls, key: str, data: bytes) -> Enrollment:
        """ManifestError (bad stored metadata) if the object is not an enrollment of this format, or
        its bytes do not hash to its key (a copy that rotted: `read` takes another store's; one whose
        digits flipped parsed, and a shorter gc_grace would have let gc delete what mounts count on)."""
        if key != _key_of(data):
            raise ManifestError(f"roster object {key}: its bytes do not match its name: a damaged copy")
        try:
            doc = json.loads(data)
            stores, grace, keep = doc["stores"], doc["gc_grace"], doc.get("keep_removed")
            counts = [doc.get(k) for k in ("replicas", "write_quorum", "keep_versions")]
            spares = doc.get("spares", 0)
            ok = (doc.get("format") == FORMAT and isinstance(stores, list) and stores
                  and all(isinstance(s, str) and s for s in stores)
                  and isinstance(grace, (int, float)) and math.isfinite(grace) and grace > 0
                  and (keep is None or isinstance(keep, (int, float)) and math.isfinite(keep) and keep >= 0)
                  and (counts == [None] * 3 or all(type(n) is int and n >= 1 for n in counts)
                       and counts[1] <= counts[0] <= len(stores))
                  and type(spares) is int and spares >= 0 and (spares == 0 or counts[0] is not None
                                                               and counts[0] + spares <= len(stores)))
        except MALFORMED:
            ok = False
        if not ok:
            raise ManifestError(f"roster object {key}: not a store enrollment of format {FORMAT}")
        return cls(tuple(sorted(stores)), float(grace), math.inf if keep is None else float(keep), *counts, spares)

    def layout(self, replicas: int, write_quorum: int) -> Layout:
        """Where this config placed versions; one enrolled without its replicas is taken to use
        `replicas` and `write_quorum` (the reader's), as far as its stores allow."""
        r = self.replicas or min(replicas, len(self.stores))
        return Layout(self.stores, r, self.write_quorum or min(write_quorum, r), self.spares)


@dataclass(frozen=True)
class Roster:
    """Every enrollment the stores hold, and which stores list each."""

    enrollments: dict[str, Enrollment]
    where: dict[str, list[str]]

    @property
    def stores(self) -> frozenset[str]:
        return frozenset(s for e in self.enrollments.values() for s in e.stores)

    @property
    def gc_grace(self) -> float:
        """The longest gc_grace of any writer: 0 if there is no enrollment."""
        return max((e.gc_grace for e in self.enrollments.values()), default=0.0)

    @property
    def keep_removed(self) -> float:
        """The longest keep_removed of any writer: 0 if there is no enrollment."""
        return max((e.keep_removed for e in self.enrollments.values()), default=0.0)

    @property
    def keep_versions(self) -> int:
        """The most versions per path any writer keeps: 0 if none enrolled it."""
        return max((e.keep_versions or 0 for e in self.enrollments.values()), default=0)

    def layouts(self, replicas: int, write_quorum: int) -> set[Layout]:
        """Every layout (stores, replicas, write_quorum) a writer of these stores used (`Enrollment.layout`)."""
        return {e.layout(replicas, write_quorum) for e in self.enrollments.values()}

    def naming(self, store: str) -> list[str]:
        """The keys of the enrollments that name `store`."""
        return [k for k, e in self.enrollments.items() if store in e.stores]


async def blank(pool: StorePool, listed: Roster) -> dict[str, list[str]]:
    """The pool's stores that hold no enrollment and no manifest although an enrollment held elsewhere
    names them (see the module doc) -> the stores holding such enrollments. A store that lists
    manifests but no enrollment (its writer's enrollment failed there) is in use: not blank."""
    holding = {s for names in listed.where.values() for s in names}
    out: dict[str, list[str]] = {}
    for name in pool.names:
        keys = listed.naming(name)
        if name in holding or not keys:
            continue
        try:
            async with aclosing(pool.iter_keys(name, MANIFESTS, page=1)) as pages:
                if [page async for page in pages if page]:
                    continue
        except StoreError as e:     # down: what it holds is unknown (read() logged its roster listing)
            log.debug("roster: cannot tell whether store %r is blank: %s", name, e)
            continue
        out[name] = sorted({s for k in keys for s in listed.where[k]})
    return out


def describe_blank(pool: StorePool, blank_stores: dict[str, list[str]]) -> str:
    """Why a blank store must not be used, and what to do (see `blank`)."""
    where = "; ".join(f"store {n!r} ({pool.config.store(n).url}) is empty, but the roster on "
                      f"{', '.join(map(repr, names))} names it" for n, names in sorted(blank_stores.items()))
    return (f"{where}. It is not the store these mounts wrote to: mount its filesystem (or fix its URL); "
            f"if it was replaced by a blank one on purpose, `cpfs scrub --repair` refills it first")


async def enroll(pool: StorePool, *, refill: bool = False) -> Roster:
    """Put this config's enrollment on each of its stores that lacks it; first, ConfigError if a store
    is blank (`blank`), unless `refill` (`cpfs scrub --repair` takes it in, logged). Best effort: a
    store that fails is logged (gc reads the enrollment from any store that holds it). Returns the
    roster as read before (the writer's catalog takes its layouts: `take`). Before all that, the
    stores' identities: ConfigError if one is another deployment's (cpfs/identity.py)."""
    found = await identity.check(pool)
    listed, problems = await read(pool)
    for p in problems:
        log.warning("roster: %s", p)
    if blank_stores := await blank(pool, listed):
        if not refill:
            raise ConfigError(f"{pool.config.source}: {describe_blank(pool, blank_stores)}")
        log.warning("%s: taken in as a replacement, to be refilled", describe_blank(pool, blank_stores))
    await identity.claim(pool, found)
    mine = Enrollment.of(pool)
    # Every enrollment goes to every store of this config, not only ours: one written by a config of
    # fewer stores is else only on those, and a writer that finds them down misses its layout.
    known = {**listed.enrollments, mine.key: mine}

    async def one(name: str) -> None:
        for key, e in known.items():
            if name not in listed.where.get(key, ()) and not await pool.exists(name, key):
                await pool.put(name, key, e.to_bytes())

    out = await fan_out(one, pool.names, catch=StoreError)
    for name, e in out.errors:
        log.warning("store %r: could not enroll this config's stores in its roster (%s): a `cpfs gc` with "
                    "a config that lacks some of them could not tell", name, e)
    return listed


def take(catalog: Catalog, listed: Roster) -> None:
    """Give a writer's catalog the layouts and the most versions kept that the roster names (its
    config's replicas stand in where an enrollment lacks them)."""
    c = catalog.pool.config
    catalog.take_roster(listed.layouts(c.replicas, c.write_quorum), listed.keep_versions)


async def read(pool: StorePool) -> tuple[Roster, list[str]]:
    """The roster from every store of the pool, and what could not be read (store, key: why)."""
    where: dict[str, list[str]] = {}
    problems: list[str] = []

    async def listing(name: str) -> None:
        for key in await pool.list_keys(name, PREFIX):
            where.setdefault(key, []).append(name)

    out = await fan_out(listing, pool.names, catch=StoreError)
    problems += [f"store {name!r}: cannot list its roster: {e.detail}" for name, e in out.errors]
    enrollments: dict[str, Enrollment] = {}

    async def get(key: str) -> None:
        errors = []
        for name in where[key]:
            try:
                enrollments[key] = Enrollment.parse(key, await pool.get(name, key))
                return
            except NoSuchObject:
                continue        # gone from this store (a forget since the listing, or a store wiped):
                                # another copy still counts (gc missed the enrollment and its stores)
            except (StoreError, ManifestError) as e:
                errors.append(f"{name}: {e}")
        if errors:              # else gone from every store that listed it: a forget, it no longer counts
            problems.append(f"roster object {key} cannot be read: {'; '.join(errors)}")

    await fan_out(get, list(where), catch=())
    return Roster(enrollments, {k: where[k] for k in enrollments}), problems


async def forget(pool: StorePool, roster: Roster, stores: Collection[str]) -> int:
    """Delete every enrollment that names one of `stores` from every store that lists it, then enroll
    this config: the stores it names are the roster's again. Returns how many enrollments went."""
    gone = {k for s in stores for k in roster.naming(s)}
    for key in gone:
        for name in roster.where[key]:
            try:
                await pool.delete(name, key)
            except StoreError as e:
                raise StoreError(name, f"could not delete roster object {key}: {e.detail}") from None
    await enroll(pool)
    return len(gone)
