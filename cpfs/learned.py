"""Prefetch plans learned from earlier loads: a rank that loaded its part of a checkpoint once gets
that part fetched at once, in parallel, the next time it loads that checkpoint or a later one of the
same model.

A rank loading its part (a pipeline stage, its experts, a 1/N row slice of every tensor) shows the
readahead what it reads one tensor at a time: each landing is a round trip before the fetches of that
tensor start. A loader can name its tensors (`user.cpfs.prefetch`, cpfs/plan.py); most do not. So
the mount remembers what each cold load of a file read, per *schema* (the file's tensor units, names
and lengths: every checkpoint of one model has the same), keyed by where the load first landed past the
head (a unit and a fraction into it: stage k starts at its first layer, rank r of N at r/N of the first
tensor). A later load of the same schema that lands at the same place, or inside what a recorded load
read of the tensor it lands in (the kernel's first request after a fault falls a little differently
each time), gets the recorded spans of the units fetched as a plan (cpfs/plan.py: in parallel, pinned
within fetch_concurrency, into the page cache), and that open's readahead prefetches nothing else
(`FileReader.expect`: per open, so ranks of one host reading different parts of one file each follow
their own).

Why this keying: the reader's identity is not known to the mount (ranks are processes on one or many
hosts), but its first landing is, and for the usual partitions it differs between ranks. Two readers
that start alike and then part (stage 0 and a full load both start at the first tensor) are told
apart by their reads away from the plan (`FileReader._watch`): the plan is dropped (`Learner.strayed`),
the readahead follows the reader again, and the recording goes, so the next load learns afresh.

What is recorded: the chunks the open read or prefetched (less a stream's overshoot past where the
reader stopped: `FileReader.used_chunks`), as byte spans of the units they overlap. A
load that read most of the file (FULL) records that the key means "all of it" (no plan: the stream
readahead serves whole loads best). Only cold opens are learned from (they fetched at least COLD of
what they touched: an open that found the file in the kernel's or the daemon's cache shows only what
those lacked), and none that ran under a plan (they read only what the plan missed). A torch or
safetensors loader opens the file twice (the zip or header reader, then the mapping): each open is
recorded by its own landing.

Kept in memory and in one JSON file per store set in the staging folder (local to the host:
`learned/<store set>.json`), so a remount, or another mount of the same stores on the host, knows them;
a file that cannot be read is logged and the mount starts with none (it is a cache: nothing a user
made is in it).

Shared through the stores too (`StoreShared`, `[readahead] learn_shared`), so that a rank restarted on
another host (a replacement node after a failure: the load that must be fast) replays what it read
on the old one: one object per schema and landing unit (`learned/<schema>/<unit hash>.json`, on
`replicas` stores placed by its key), holding the recordings of the loads that landed in that unit
(PER_UNIT, newest first). An open whose landing matches nothing kept here asks the stores for its
unit's object (one GET, bounded by SHARED_WAIT; the reader does not wait: its plan starts when the
object comes, if the open is still there and has no plan, and what it holds is kept either way);
a learned load updates its unit's object (a GET and a PUT, merged with what other hosts put there; a
recording this mount dropped as mis-guessed leaves it). An object that cannot be read or written is
logged and skipped: the stores' copy is a cache as well, and `learned/` may be deleted at any time.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from .config import Config, staging_dir, store_set_id
from .errors import MALFORMED, CpfsError, NoSuchObject
from .manifest import Manifest, name_bytes
from .placement import place
from .plan import KEPT, Plan, PlanStats
from .readahead import SLICE_TOLERANCE, FileReader, Layout, Scheduler, Unit, zip_header_chunks
from .store.directory import reap_temporaries, write_durably
from .tensor_index import TensorIndex

if TYPE_CHECKING:
    from .pool import StorePool

log = logging.getLogger(__name__)

FULL = 0.8                  # a load that read this much of the units' bytes is a whole load
COLD = 0.5                  # ... that fetched this much of what it touched was cold: it is learned from
MAX_RECORDINGS = 512        # kept at most (least recently used schemas go first)
PER_SCHEMA = 64             # ... per schema (the oldest go first): a host's ranks, a few loaders each
SHAPES = 32                 # files whose units (by name) are kept at hand
FORMAT = 1
SHARED_PREFIX = "learned/"  # the stores' copy (StoreShared)
PER_UNIT = 16               # recordings in one shared object: loads that landed in one unit
SHARED_WAIT = 10.0          # seconds a landing asks the stores for its unit's shared recordings
SHARED_AGAIN = 60.0         # ... which are asked for again after this long (other hosts learn meanwhile)
SHARED_MAX = 1 << 20        # bytes: a bigger shared object is not read


@dataclass(frozen=True, kw_only=True)
class Recording:
    """What one cold load of a file read: byte spans of its units, and where it first landed."""
    schema: str
    unit: str                                   # where the load first landed past the head
    at: float                                   # ... a fraction into that unit
    # (unit, from, to): the bytes of each unit it read, counted from the unit's start (the schema fixes
    # the units' lengths); () for a whole load
    spans: tuple[tuple[str, int, int], ...]
    source: str                                 # the path it was learned from

    @property
    def whole(self) -> bool:
        return not self.spans

    def landed(self, unit: str, at: float) -> bool:
        """Whether a load landing in `unit` at `at` (a fraction) landed where this one did."""
        return unit == self.unit and abs(at - self.at) <= SLICE_TOLERANCE

    def holds(self, unit: str, pos: int) -> bool:
        """Whether this load read byte `pos` of `unit`."""
        return any(n == unit and a <= pos < b for n, a, b in self.spans)

    def to_json(self) -> dict:
        """`from_json`'s input. Not `dataclasses.asdict`, which deep-copies every span: the kept file is
        written whole a second after each learned load, and for 30 recordings of 7,863 spans that took
        37 ms of the daemon's CPU per write (2.5 ms this way)."""
        return {"schema": self.schema, "unit": self.unit, "at": self.at, "spans": self.spans, "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> Recording:
        spans = tuple((str(n), int(a), int(b)) for n, a, b in d["spans"])
        if not all(0 <= a < b for _, a, b in spans) or not 0.0 <= float(d["at"]) <= 1.0:
            raise ValueError("a span or a landing out of its unit")
        return cls(schema=str(d["schema"]), unit=str(d["unit"]), at=float(d["at"]), spans=spans,
                   source=str(d["source"]))


@dataclass(frozen=True, kw_only=True)
class LearnedStats:
    recordings: int         # kept now
    learned: int            # loads recorded (partial and whole) since the mount started
    replayed: int           # plans started from a recording
    strayed: int            # ... dropped because the reader landed outside them
    shared_gets: int = 0    # shared objects asked for (a landing no recording here matched)
    shared_got: int = 0     # ... recordings they brought
    shared_puts: int = 0    # shared objects written (learned loads)
    shared_errors: int = 0  # shared objects that could not be read or written (logged)


class Shared(Protocol):
    """Where recordings are shared between hosts: the recordings of the loads that landed in a unit."""

    async def get(self, schema: str, unit: str) -> list[Recording]: ...

    async def put(self, schema: str, unit: str, recs: list[Recording]) -> None: ...


class SharedError(CpfsError):
    """A shared object could not be read or written (the learner logs it and goes on)."""


class StoreShared:
    """Recordings in the stores: `learned/<schema>/<unit hash>.json` on `replicas` stores placed by the
    key (cpfs/placement.py), written to whichever of them take it (quorum 1: a cache)."""

    def __init__(self, pool: StorePool, replicas: int) -> None:
        self.pool = pool
        self.replicas = max(1, min(replicas, len(pool.names)))

    @staticmethod
    def key(schema: str, unit: str) -> str:
        return f"{SHARED_PREFIX}{schema}/{hashlib.blake2b(name_bytes(unit), digest_size=16).hexdigest()}.json"

    async def get(self, schema: str, unit: str) -> list[Recording]:
        """The recordings of `schema` that landed in `unit`; none if there is no object."""
        key = self.key(schema, unit)
        try:
            data = await self.pool.get_any(place(key, self.pool.names, self.replicas), key)
        except NoSuchObject:
            return []
        except CpfsError as e:
            raise SharedError(f"{key}: {e}") from None
        try:
            if len(data) > SHARED_MAX:
                raise ValueError(f"{len(data)} bytes, more than {SHARED_MAX}")
            return [r for r in decode(data) if r.schema == schema and r.unit == unit]
        except MALFORMED as e:
            raise SharedError(f"{key}: not recordings ({e})") from None

    async def put(self, schema: str, unit: str, recs: list[Recording]) -> None:
        key = self.key(schema, unit)
        try:
            await self.pool.put_quorum(place(key, self.pool.names, self.replicas), key, encode(recs), 1)
        except CpfsError as e:
            raise SharedError(f"{key}: {e}") from None


class Shape:
    """A file version's units by name, and its schema: the same for every checkpoint of one model."""

    def __init__(self, manifest: Manifest, index: TensorIndex, layout: Layout) -> None:
        self.m, self.index, self.layout = manifest, index, layout
        if index.format == "safetensors":
            by_span = {(t.offset, t.length): t.name for t in index.tensors}
            names = [by_span.get((u.offset, u.length)) for u in layout.units]
        else:       # torch: a storage record's name after "/data/" (the archive's root is the file's name);
            # torch-dcp: its item's number in the file (each item's one storage is "0")
            dcp = index.format == "torch-dcp"
            by_offset = {r.offset: r.name.split("/", 1)[0] if dcp else r.name.rsplit("/data/", 1)[-1]
                         for r in index.records if "/data/" in r.name}
            names = [by_offset.get(u.offset) for u in layout.units]
        unique = None not in names and len(set(names)) == len(names)     # else no schema: nothing is learned
        self.names: list[str] | None = names if unique else None  # type: ignore[assignment]
        self.units = {n: u for n, u in zip(self.names or (), layout.units)}
        self.schema: str | None = None
        if self.names is not None and self.names:
            h = hashlib.blake2b(index.format.encode(), digest_size=16)
            for n, u in zip(self.names, layout.units):
                h.update(f"\n{n}\0{u.length}".encode())
            self.schema = h.hexdigest()
        self._starts = [u.offset for u in layout.units]

    def name(self, u: Unit) -> str:
        assert self.names is not None
        return self.names[bisect.bisect_left(self._starts, u.offset)]

    def spans(self, chunks: set[int]) -> tuple[tuple[str, int, int], ...] | None:
        """The parts of each unit `chunks` cover (bytes from the unit's start), in file order; None if
        they cover FULL of the units' bytes or more (a whole load)."""
        m, units = self.m, self.layout.units
        parts: dict[int, list[list[int]]] = {}
        for i in sorted(chunks):
            lo, hi = m.offsets[i], m.offsets[i + 1]
            k = max(0, bisect.bisect_right(self._starts, lo) - 1)
            while k < len(units) and units[k].offset < hi:
                u = units[k]
                a, b = max(lo, u.offset), min(hi, u.offset + u.length)
                if a < b:
                    got = parts.setdefault(k, [])
                    if got and got[-1][1] >= a:
                        got[-1][1] = max(got[-1][1], b)
                    else:
                        got.append([a, b])
                k += 1
        total = sum(u.length for u in units)
        covered = sum(b - a for spans in parts.values() for a, b in spans)
        if total == 0 or covered >= FULL * total:
            return None
        assert self.names is not None
        return tuple((self.names[k], a - units[k].offset, b - units[k].offset)
                     for k in sorted(parts) for a, b in parts[k])

    def chunks(self, rec: Recording) -> list[int]:
        """The chunks of this file a recording names, in loader order: the head, the zip headers (a
        torch loader reads them all), and the chunks of each recorded part. Not widened to whole
        pages (as a declared tensor is): a part is the bytes of the chunks the load had, and a page
        past a chunk's end is the neighbour's, which that load did without."""
        m = self.m
        wanted = set(self.layout.head) | zip_header_chunks(m, self.index, self.layout)
        for name, a, b in rec.spans:
            u = self.units.get(name)
            if u is None:
                continue
            lo, hi = u.offset + a, u.offset + min(b, u.length)
            if lo < hi:
                wanted.update(m.chunk_range(lo, hi - lo))
        return [i for i in self.layout.plan if i in wanted]


class Learner:
    """Records cold loads and replays them (the module doc): the scheduler's watcher. `run` in the
    daemon's nursery owns the learned plans' tasks and the writes of the file."""

    def __init__(self, sched: Scheduler, path: Path | None, mode: int = 0o600, dir_mode: int = 0o700,
                 shared: Shared | None = None) -> None:
        self.sched = sched
        self.path = path
        self.shared = shared
        self.modes = (mode, dir_mode)           # of the file and its folder (it names paths: the mount's modes)
        self._recs: OrderedDict[str, list[Recording]] = OrderedDict()   # schema -> its recordings (LRU)
        self._shapes: OrderedDict[tuple[int, int], Shape | None] = OrderedDict()   # the last SHAPES files
        self._plans: dict[FileReader, tuple[Plan, Recording, bool]] = {}  # an open's plan, its source, exact?
        self._ended: deque[Plan] = deque(maxlen=KEPT)    # of closed opens (they may run on)
        self._nursery: trio.Nursery | None = None
        self._dirty = trio.Event()
        self._learned = self._replayed = self._strayed = 0
        # (schema, unit) -> when its shared object was last asked for; and the ones to write, each with
        # the landings dropped here since (left out of the shared object)
        self._asked: OrderedDict[tuple[str, str], float] = OrderedDict()
        # recording -> loads that landed exactly where it did and read within its plan since it was
        # learned or last left (`strayed`: one that served such a load stays when another leaves it)
        self._served: OrderedDict[Recording, int] = OrderedDict()
        self._to_share: dict[tuple[str, str], list[float]] = {}
        self._sharing = trio.Lock()             # one `share` at a time (the loop's, the unmount's)
        self._gets = self._got = self._puts = self._share_errors = 0

    @classmethod
    def for_config(cls, sched: Scheduler, config: Config, pool: StorePool | None = None) -> Learner:
        """The mount's learner; `pool`: share the recordings through its stores (`learn_shared`)."""
        shared = StoreShared(pool, config.replicas) if pool is not None and config.learn_shared else None
        return cls(sched, staging_dir(config) / "learned" / f"{store_set_id(config)}.json", config.file_mode,
                   config.dir_mode, shared)

    def statistics(self) -> LearnedStats:
        return LearnedStats(recordings=sum(len(v) for v in self._recs.values()), learned=self._learned,
                            replayed=self._replayed, strayed=self._strayed, shared_gets=self._gets,
                            shared_got=self._got, shared_puts=self._puts, shared_errors=self._share_errors)

    def plans(self) -> list[PlanStats]:
        """The learned plans of open files, and of the last closed ones."""
        return [p.statistics() for p in (*self._ended, *(p for p, _, _ in self._plans.values()))]

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the kept recordings, then save them whenever they change (one writer, so the file is
        written by one thread at a time), until cancelled."""
        if self.path is not None:
            for rec in await trio.to_thread.run_sync(load, self.path):
                self._keep(rec)
        async with trio.open_nursery() as n:
            self._nursery = n
            task_status.started()
            while True:
                await self._dirty.wait()
                await trio.sleep(1.0)           # at most one write a second
                self._dirty = trio.Event()
                if self.path is not None:
                    recs = [r for v in self._recs.values() for r in v]
                    try:
                        await trio.to_thread.run_sync(save, self.path, recs, *self.modes)
                    except OSError as e:
                        log.warning("cannot keep the learned prefetch plans in %s: %s", self.path, e)
                await self.share()

    async def share(self) -> None:
        """Write what was learned or dropped here since the last time into the shared objects of those
        units, merged with what other hosts put there (the daemon calls it once more at unmount). The
        unmount's call waits for one the loop has under way: that one took what was pending, and the
        daemon cancels the loop right after the unmount's call returns (a recording learned just before
        an unmount was never shared)."""
        if self.shared is None:
            return
        async with self._sharing:
            pending, self._to_share = self._to_share, {}
            for (schema, unit), dropped in pending.items():
                try:
                    theirs = await self.shared.get(schema, unit)
                    mine = [r for r in reversed(self._recs.get(schema, [])) if r.unit == unit]  # newest first
                    keep = mine + [r for r in _newcomers(theirs, mine)
                                   if not any(abs(r.at - at) <= SLICE_TOLERANCE for at in dropped)]
                    await self.shared.put(schema, unit, keep[:PER_UNIT])
                    self._puts += 1
                except SharedError as e:
                    self._share_errors += 1
                    log.warning("cannot share the learned prefetch plans: %s", e)

    def flush(self) -> None:
        """Write the recordings now, if any changed since the last write (blocking: at unmount, when the
        readers closed by it have been recorded and `run` is gone)."""
        if self._dirty.is_set() and self.path is not None:
            try:
                save(self.path, [r for v in self._recs.values() for r in v], *self.modes)
            except OSError as e:
                log.warning("cannot keep the learned prefetch plans in %s: %s", self.path, e)

    def _shape(self, reader: FileReader) -> Shape | None:
        key = (reader.inode, reader.m.version)
        if key in self._shapes:
            self._shapes.move_to_end(key)
            return self._shapes[key]
        shape = Shape(reader.m, reader.index, reader.layout) if reader.index is not None else None
        shape = shape if shape is not None and shape.schema is not None else None
        _remember(self._shapes, key, shape, SHAPES)
        return shape

    def _keep(self, rec: Recording) -> None:
        """Add a recording, replacing the one of the same landing."""
        kept = [r for r in self._recs.pop(rec.schema, []) if not r.landed(rec.unit, rec.at)]
        self._recs[rec.schema] = (kept + [rec])[-PER_SCHEMA:]
        while len(self._recs) > 1 and sum(len(v) for v in self._recs.values()) > MAX_RECORDINGS:
            self._recs.popitem(last=False)      # the least recently used schema, all its recordings

    def _match(self, shape: Shape, unit: Unit, at: float) -> tuple[Recording, bool] | None:
        """(the recording, exact) of a load that landed where this one did: in `unit` at `at` (exact),
        else the newest that landed near (within the first readahead window and the kernel's reach) and
        read the landing's byte. The second is for where the kernel's first request falls: a loader's
        first fault in a tensor reaches the mount as a read around it, or from wherever the pages other
        opens pushed end, not always at one place. Not any recording that read the byte: a stage's first
        tensor is also in the weights-only load's part, which starts elsewhere."""
        name, pos = shape.name(unit), round(at * unit.length)
        recs = self._recs.get(shape.schema or "", [])
        best = min((r for r in recs if r.landed(name, at)), key=lambda r: abs(r.at - at), default=None)
        exact = best is not None
        if best is None:
            cfg = self.sched.config
            near = cfg.readahead_initial + cfg.read_ahead_kb * 1024
            here = unit.offset + pos
            best = next((r for r in reversed(recs) if r.holds(name, pos) and r.unit in shape.units
                         and abs(shape.units[r.unit].offset + r.at * shape.units[r.unit].length - here) <= near),
                        None)
        if best is None:
            return None
        self._recs.move_to_end(shape.schema or "")
        return best, exact

    # -- the scheduler's watcher ------------------------------------------------------------------
    def landed(self, reader: FileReader) -> None:
        """An open's first landing past the head: replay what a load that landed here read."""
        shape = self._shape(reader)
        if shape is None or reader.landing is None or self._nursery is None:
            return
        unit, at = reader.landing
        got = self._match(shape, unit, at)
        key = (shape.schema or "", shape.name(unit))
        if got is None and self.shared is not None and self._ask(key):
            self._nursery.start_soon(self._land_shared, reader, shape, key)
        else:
            self._replay(reader, shape, got)

    def _ask(self, key: tuple[str, str]) -> bool:
        """Whether to ask the stores for the shared recordings of `key` (schema, unit) now: not again
        within SHARED_AGAIN (each landing there would cost a GET)."""
        now = trio.current_time()
        if key in self._asked and now - self._asked[key] < SHARED_AGAIN:
            return False
        _remember(self._asked, key, now, MAX_RECORDINGS)
        return True

    async def _land_shared(self, reader: FileReader, shape: Shape, key: tuple[str, str]) -> None:
        """Keep what other hosts' loads that landed in this open's unit read, then replay as `landed`
        does, unless the open has gone on without (closed, or given a plan meanwhile). The reader
        does not wait: its readahead follows it meanwhile."""
        assert self.shared is not None
        recs: list[Recording] = []
        self._gets += 1
        asked = trio.current_time()
        with trio.move_on_after(SHARED_WAIT) as waited:
            try:
                recs = await self.shared.get(*key)
            except SharedError as e:
                self._share_errors += 1
                log.warning("cannot read the shared learned prefetch plans: %s", e)
        if waited.cancelled_caught:
            self._share_errors += 1
            log.warning("%s: the stores did not answer for the shared learned prefetch plans of %s within %.0f s",
                        reader.m.path, key[1], SHARED_WAIT)
        new = _newcomers(recs, self._recs.get(key[0], []))
        for r in reversed(new):                 # the object lists the newest first
            self._keep(r)
        self._got += len(new)
        if new:
            self._dirty.set()                   # kept in the local file too
            log.info("%s: %d recordings of loads that landed in %s came from the stores in %.2f s%s", reader.m.path,
                     len(new), key[1], trio.current_time() - asked, ", after the open was closed" if reader.closed else "")
        if reader.closed or reader.planned or reader.landing is None:    # planned: it has a plan now
            return
        unit, at = reader.landing
        self._replay(reader, shape, self._match(shape, unit, at))

    def _replay(self, reader: FileReader, shape: Shape, got: tuple[Recording, bool] | None) -> None:
        """Start the plan of a matched recording for this open, which has landed (a whole load's: none)."""
        if got is None or got[0].whole or self._nursery is None or reader.landing is None:
            return
        rec, exact = got
        chunks = shape.chunks(rec)
        p = Plan(self.sched, reader.inode, reader.m, chunks, tensors=len({n for n, _, _ in rec.spans}),
                 patterns=(), learned_from=rec.source)
        reader.expect(frozenset(chunks))
        self._plans[reader] = (p, rec, exact)
        self._nursery.start_soon(p.run)
        self._replayed += 1
        log.info("%s: a load landed at %s (%.3f) as one of %s did: fetching the %d chunks (%.1f MiB) it read",
                 reader.m.path, rec.unit, reader.landing[1], rec.source, len(chunks),
                 sum(reader.m.chunks[i].raw_len for i in chunks) / 2**20)

    def strayed(self, reader: FileReader, offset: int, end: int) -> None:
        """The reader landed outside what its learned plan expected: the guess was wrong. The plan
        stops. If the recording was of a load that landed as this one did, it goes, so the next load
        of this landing learns afresh, unless it served such a load since it was learned or last left:
        then it is right for some loader that lands here (a weights-only load, which a whole load of
        the file starts as), and stays until a second load leaves it with none served between. If this
        load only landed inside what that one read (another rank's neighbouring part), the recording
        stays, and this load is learned from at its close (by its own landing, which then matches
        first)."""
        got = self._plans.pop(reader, None)
        if got is None:
            return
        p, rec, exact = got
        p.cancel()
        self._ended.append(p)
        self._strayed += 1
        if exact and self._served.pop(rec, 0):     # not learned from at its close: it would replace it
            log.info("%s: a read of [%d, %d) left the plan learned from %s (landed at %s %.3f): dropped; the "
                     "recording stays (it served a load that landed there), the readahead follows the reader",
                     reader.m.path, offset, end, rec.source, rec.unit, rec.at)
            return
        if exact:
            left = [r for r in self._recs.get(rec.schema, []) if r is not rec]
            if left:
                self._recs[rec.schema] = left
            else:
                self._recs.pop(rec.schema, None)
            if self.shared is not None:
                self._to_share.setdefault((rec.schema, rec.unit), []).append(rec.at)
            self._dirty.set()
        else:
            reader.unplan()
        log.info("%s: a read of [%d, %d) left the plan learned from %s (landed at %s %.3f): dropped%s, the "
                 "readahead follows the reader", reader.m.path, offset, end, rec.source, rec.unit, rec.at,
                 " with its recording" if exact else "")

    def closed(self, reader: FileReader) -> None:
        """Record what a cold load read, for the next load that lands where it did. An open's learned
        plan runs on to its end (a mapping outlives the open)."""
        got = self._plans.pop(reader, None)
        if got is not None:
            self._ended.append(got[0])
            if got[2]:                          # an exact replay its reader did not leave: it served
                _remember(self._served, got[1], self._served.get(got[1], 0) + 1, MAX_RECORDINGS)
        if reader.planned or reader.landing is None:
            return
        used = reader.used_chunks()
        if reader.fetched < COLD * sum(reader.m.chunks[i].raw_len for i in used):
            return                  # the kernel or the cache had most of it: what it read is what they lacked
        shape = self._shape(reader)
        if shape is None:
            return
        unit, at = reader.landing
        spans = shape.spans(used)
        if spans is not None and not spans:
            return
        self._keep(Recording(schema=shape.schema or "", unit=shape.name(unit), at=at, spans=spans or (),
                             source=reader.m.path))
        if self.shared is not None:
            self._to_share.setdefault((shape.schema or "", shape.name(unit)), [])
        self._learned += 1
        self._dirty.set()


def _newcomers(theirs: list[Recording], mine: list[Recording]) -> list[Recording]:
    """Those of `theirs` (another host's) that landed where none of `mine` did: for a landing, the
    recording made here wins."""
    return [r for r in theirs if not any(m.landed(r.unit, r.at) for m in mine)]


def _remember(table: OrderedDict, key: object, value: object, limit: int) -> None:
    """Put `key` at the recent end of `table`, and the least recent entries beyond `limit` out."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


def encode(recs: list[Recording]) -> bytes:
    """The kept file's bytes, and a shared object's."""
    return json.dumps({"format": FORMAT, "recordings": [r.to_json() for r in recs]}).encode()


def decode(data: bytes) -> list[Recording]:
    """`encode`'s recordings; one of errors.MALFORMED if it is not that."""
    doc = json.loads(data)
    if doc.get("format") != FORMAT:
        raise ValueError(f"format {doc.get('format')!r}, not {FORMAT}")
    return [Recording.from_json(d) for d in doc["recordings"]]


def load(path: Path) -> list[Recording]:
    """The recordings kept in `path`; none (and a log line) if it is missing or cannot be read. Old
    temporary files beside it (a daemon killed while writing it) go."""
    reap_temporaries(path.parent)
    try:
        return decode(path.read_bytes())
    except FileNotFoundError:
        return []
    except (OSError, *MALFORMED) as e:
        log.warning("%s: cannot read the learned prefetch plans (%s): starting with none", path, e)
        return []


def save(path: Path, recs: list[Recording], mode: int = 0o600, dir_mode: int = 0o700) -> None:
    """Write the recordings whole or not at all, in exactly `mode` (`write_durably`)."""
    path.parent.mkdir(mode=dir_mode, exist_ok=True)
    write_durably(path, encode(recs), mode)
