"""The set of backing stores as one replicated store: the only door to the stores.

The pool holds replica policy, nothing about any one kind of store:
- every request is bounded by its store's `timeout` and retried here, and only here, while it fails
  transiently (StoreError.transient), with jittered exponential backoff inside that same budget; a
  timeout is not retried on the same store: the caller fails over to the next replica at once;
- health: a store that times out, or fails `DOWN_AFTER` requests in a row, is marked down: it is ranked
  after every store that is up (reads try it last), single-store requests to it fail at once, a write
  that needs it probes it first (`_revive`), and `run()` probes it (`check()`) in the background until
  it answers;
- reads go through one replica iterator (`_read_replicas`): ranked replicas in turn, and *hedged*: a
  read slower than its store's recent p95 (bounded by `hedge_min`/`hedge_max`), and slower than the
  reads queued ahead of it on that store explain (saturated links are not a reason to hedge), also asks
  the next replica, the first answer wins and the other is cancelled; at most `hedges` in flight.
  A read cancelled that way counts twice its elapsed time as a latency sample, so a hung or
  straggling store sinks in the ranking instead of costing a hedge delay on every read. Hedges are
  paid from a budget (`Budget`, cpfs/sync.py) that answered reads fill at HEDGE_RATIO a read and that
  a hedge that wins refills: where the stores are slow together (one disk, one gateway) hedges lose,
  and then cost at most ~HEDGE_RATIO of the reads instead of joining the queue they meant to overtake;
  a read held back that way is hedged anyway once its store has been silent for `hedge_max`;
- prefetch batches of small chunks (`fetch_chunks`) are read with one request per store that holds
  several of them (`Store.get_many_with`), not hedged; what a batch does not bring goes through the
  replica iterator chunk by chunk;
- writes go through one fan-out with quorum (`_put_quorum`). With `write_quorum` < the targets, a write
  returns once the quorum holds the data (manifests too: see `_put_quorum`); the other puts go on in
  `run()`'s nursery as *background puts*, bounded (BACKGROUND_BYTES of blobs, BACKGROUND_WRITES writes:
  beyond that a write waits before returning, so a slow store slows writers instead of growing memory);
  one that fails is retried once through the repair queue, then left to `cpfs scrub --repair`. When
  `run()` is cancelled (unmount), they get `shutdown_grace` seconds, then are abandoned (logged);
- read repair: a replica a read found corrupt or missing is rewritten from the good copy the read got,
  in the background (`run()`), logged with store, chunk and file; a full repair queue drops the job
  (scrub finds it later) rather than hold a read;
- dedup never trusts a replica blindly: `store_chunk` reuses a copy only after checking it against the
  encoded chunk in hand, and rewrites copies that a read found corrupt (`_suspects`); a copy it reuses
  that is older than gc_grace/2 is touched first, so that a concurrent gc spares it (cpfs/gc.py), and
  `renew` touches the copies a commit not yet written counts on (a file open for long: cpfs/upload.py).

Ranking: least expected wait first, (requests in flight + 1) x recent latency (floored, so local
stores of similar speed spread by requests in flight), so concurrent fetches use every store. Except a
*known-slow* store: one whose fastest recent answers (queueing left out; before its first read answers,
the moving average of its requests, e.g. the mount's listings) are SLOW_RATIO times slower than another
candidate's. It is ranked after the others whatever their queues (a straggler at 20x never gets a first
attempt: a reader waiting on it waits its whole latency, since its p95 sets its hedge delay), is asked
along with the first replica once in EXPLORE_EVERY reads that pass it over (so a store that recovered
is found), and a read that does start on it hedges after the other stores' p95, not its own.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
import random
import socket
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import trio

from . import chunk as chunkfmt
from .config import Config
from .errors import (ChunkUnavailable, ConfigError, CorruptChunk, NoSuchObject, StoreDenied, StoreError, StoreFull,
                     StoreUnavailable)
from .manifest import ChunkEntry
from .placement import Layout, place
from .store import MeteredStore, ObjectInfo, Store, StoreStats, open_store
from .store.base import Capacity
from .sync import Budget, FanOut, SingleFlight, fan_out, quorum

log = logging.getLogger(__name__)
T = TypeVar("T")

ATTEMPTS = 4                 # tries of one request that keeps failing transiently
BACKOFF_FIRST = 0.05         # seconds; the n-th retry waits up to BACKOFF_FIRST * 2**(n-1) (full jitter)
BACKOFF_MAX = 2.0
DOWN_AFTER = 3               # requests in a row failing transiently mark a store down
PROBE_INTERVAL = 1.0         # seconds between probes of a store that is down
REPAIR_QUEUE = 64            # read repairs waiting at most (each holds one chunk's bytes)
CHECK_TIMEOUT = 5.0          # a startup check or probe waits at most this (or the store's timeout)
REFUSED_FOR = 30.0           # seconds: after a store refused a write (full, denied), writes go to a spare
REVIVE_AFTER = 0.2           # seconds: a write to a store marked down probes it first, if none did since
RANK_FLOOR = 0.001           # latencies below this rank alike (a local disk is a local disk)
VERIFY_FULL_MAX = 256 * 1024  # dedup compares whole replicas up to this size, size + header above
SUSPECTS_MAX = 100_000       # (store, digest) pairs remembered as read corrupt
CLOCK_KEY = f"clock/{hashlib.sha256(socket.gethostname().encode()).hexdigest()[:16]}"   # this host's probe
CLOCK_EVERY = 1 / 8          # of gc_grace: how long a measure of a store's clock serves (on ticks)
LATENCY_SAMPLES = 64         # recent read latencies kept per store (for the p95 that hedging uses)
ANSWERED_SAMPLES = 16        # recent answered reads kept per store (the fastest: what it takes at best)
SLOW_RATIO = 4.0             # a store this much slower at best than another candidate is known slow
HEDGE_RATIO = 0.05           # hedges that lose may add this share of the reads (Budget), beyond a burst
                             # of `hedges` (a burst of 2 let test_hedging's 20x straggler cost 1.44x, not 1.2x)
HELD_BACK_MIN = 0.001        # seconds at least before a read the budget held back looks again
EXPLORE_EVERY = 32           # a known-slow store is asked along with the first replica once in this many
BACKGROUND_BYTES = 64 * 1024**2  # blob bytes that writes returned at quorum may leave in flight...
BACKGROUND_WRITES = 256      # ... and writes (manifests are small): beyond either, a write waits
SHUTDOWN_GRACE = 10.0        # seconds background puts get when run() is cancelled, then abandoned
TICKS_WATCH = 1.0            # seconds of trio's clock between looks at the boot clock (`ticks`) by a task
#                              that acts on ages: trio's clock (CLOCK_MONOTONIC) stops while the host is suspended


def boottime() -> float:
    """Seconds since boot, suspends included (CLOCK_BOOTTIME); CLOCK_MONOTONIC where there is none."""
    return time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))


class Stored(NamedTuple):
    """What `store_chunk` did: the stores that held the chunk when it returned, whether any was written,
    and the oldest mtime any of those copies may have (the clocks agree: cpfs/gc.py): what a gc judges."""
    held: list[str]
    wrote: bool
    since: float


@dataclass(frozen=True, kw_only=True)
class ReplicaStats:
    reads: int                # replica reads started (first tries, fallbacks and hedges)
    fallbacks: int            # reads moved to the next replica because one failed
    hedges: int               # reads that also asked the next replica because the first was slow
    hedges_won: int           # ... where the hedge answered first
    hedges_in_flight: int
    hedges_skipped: int       # slow reads not hedged because `hedges` were in flight
    hedges_over_budget: int   # slow reads whose hedge waited because hedges had lost lately (Budget)
    hedge_tokens: float       # hedges the budget allows now (HEDGE_RATIO per answered read, at most `hedges`)
    repairs_dropped: int      # read repairs not queued because the queue was full
    touched: int              # old copies dedup reused and touched, so that a gc spares them
    renewed: int              # copies a pending commit counts on, touched again (renew)
    explored: int             # reads that also asked a known-slow store, to see if it still is
    background_puts: int      # puts still running after their write returned at quorum
    background_bytes: int     # blob bytes the writes with background puts hold
    background_done: int      # background puts that stored their copy
    background_failed: int    # ... that failed (retried once by the repair queue, else left to scrub)
    background_abandoned: int  # ... cancelled when the shutdown grace ran out (scrub completes them)
    background_waits: int     # writes that waited for room (BACKGROUND_BYTES/WRITES) before returning
    batch_reads: int = 0      # batch requests of fetch_chunks (one store, several chunks)...
    batched: int = 0          # ... and the chunks they asked for (counted in `reads` too)
    block_reads: int = 0      # ranged reads of a raw chunk's blocks (fetch_blocks: lost pages, parts for slices)
    block_bytes: int = 0      # ... bytes they brought that matched their block checks
    block_misses: int = 0     # ... that failed or did not match (the caller read the whole chunk)


@dataclass(frozen=True)
class StoreHealth:
    name: str
    up: bool
    reason: str               # why it was last marked down ("" if never)
    failures_in_a_row: int    # transient failures since the last answer
    retries: int              # requests tried again after a transient failure
    timeouts: int             # requests that got no answer in time
    marked_down: int          # times marked down
    probes: int               # checks while down (background, and a write's first: `_revive`)
    repairs: int              # chunk copies rewritten because they were corrupt
    refusals: int = 0         # writes it refused (full, denied): then written to a spare for REFUSED_FOR


class _Health:
    def __init__(self) -> None:
        self.up = True
        self.reason = ""
        self.in_a_row = self.retries = self.timeouts = self.marked_down = self.probes = self.repairs = 0
        self.refusals = 0
        self.probed = -math.inf          # when the last probe started (trio time)
        self.refused = -math.inf         # when it last refused a write (trio time)

    def snapshot(self, name: str) -> StoreHealth:
        return StoreHealth(name=name, up=self.up, reason=self.reason, failures_in_a_row=self.in_a_row,
                           retries=self.retries, timeouts=self.timeouts, marked_down=self.marked_down,
                           probes=self.probes, repairs=self.repairs, refusals=self.refusals)


def _decoder(digest: str) -> Callable[[bytes | memoryview], tuple[bytes | memoryview | CorruptChunk, bytes | memoryview]]:
    """The `get_with` fn of a chunk read: (raw bytes, blob), in the store's read thread. A corrupt blob
    is an answer, not a failure of the store: its CorruptChunk is returned."""
    def decode(blob: bytes | memoryview) -> tuple[bytes | memoryview | CorruptChunk, bytes | memoryview]:
        try:
            return chunkfmt.decode(blob, digest), blob
        except CorruptChunk as e:
            return e, blob
    return decode


class StorePool:
    def __init__(self, config: Config, stores: Sequence[Store] | None = None, *,
                 probe_interval: float = PROBE_INTERVAL, seed: int | None = None,
                 background_bytes: int = BACKGROUND_BYTES, shutdown_grace: float = SHUTDOWN_GRACE,
                 clock: Callable[[], float] = time.time, ticks: Callable[[], float] = boottime,
                 hedge_budget: Budget | None = None) -> None:
        """The stores `config` describes, or `stores` (tests inject wrapped stores; each gets a
        MeteredStore around it unless it is one). `clock`: the wall clock that store ages (mtimes) are
        judged against (tests inject one that has moved on). `ticks`: the clock on which the ages of
        copies a pending commit counts on go on (cpfs/upload.py: Renewal): no step of the wall clock
        moves it, and it counts the time the machine was suspended. `hedge_budget`: what pays for hedges
        (by default HEDGE_RATIO per answered read, up to `hedges`; tests inject a spent one)."""
        self.config = config
        self.clock = clock
        self.ticks = ticks
        built = stores if stores is not None else [open_store(s) for s in config.stores]
        self._stores: dict[str, MeteredStore] = {
            s.name: s if isinstance(s, MeteredStore) else MeteredStore(s) for s in built}
        self.names = list(self._stores)
        self.layout = Layout(tuple(sorted(self.names)), config.replicas, config.write_quorum, config.spares)
        self.cpu = trio.CapacityLimiter(config.cpu_threads)
        configured = {s.name: s.timeout for s in config.stores}
        self._timeouts = {n: configured.get(n, config.request_timeout) for n in self.names}
        self._health = {n: _Health() for n in self.names}
        self._suspects: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._probe_interval = probe_interval
        self._rng = random.Random(seed)
        self._went_down = trio.Event()
        self._latency = {n: deque(maxlen=LATENCY_SAMPLES) for n in self.names}
        self._wins = {n: deque(maxlen=ANSWERED_SAMPLES) for n in self.names}   # answered reads only
        self._passed_over = {n: 0 for n in self.names}     # reads that skipped it as known slow
        self._since: dict[str, dict[object, float]] = {n: {} for n in self.names}  # reads in flight: start
        self._explored = 0
        self._picked = {n: 0 for n in self.names}
        self._repair_send, self._repair_recv = trio.open_memory_channel[tuple[str, str, bytes, str]](REPAIR_QUEUE)
        self._repairs_dropped = 0
        self._reads = self._fallbacks = self._hedges = self._hedges_won = 0
        self._hedging = self._hedges_skipped = self._hedges_over_budget = 0
        self._hedge_budget = (hedge_budget if hedge_budget is not None
                              else Budget(HEDGE_RATIO, burst=max(1, config.hedges)))
        self._last_answer = {n: -math.inf for n in self.names}    # when it last answered a request
        self._touched = self._renewed = 0
        self._offsets: dict[str, tuple[float, float]] = {}    # store -> (its clock - ours, measured at ticks)
        self._measuring: SingleFlight[str, float] = SingleFlight()
        self._probing: SingleFlight[str, None] = SingleFlight()   # one probe of a store at a time
        self._batch_reads = self._batched = 0
        self._block_reads = self._block_bytes = self._block_misses = 0
        self._background: trio.Nursery | None = None   # run()'s, while it runs: where writes leave puts
        self._bg_limit = background_bytes
        self._shutdown_grace = shutdown_grace
        self._bg_scopes: set[trio.CancelScope] = set()  # every put of a write that may leave some behind
        self._bg_changed = trio.Event()                 # set (and replaced) whenever one of them ends
        self._bg_puts = self._bg_bytes = self._bg_writes = 0
        self._bg_done = self._bg_failed = self._bg_abandoned = self._bg_waits = 0

    # ------------------------------------------------------------------ state

    def statistics(self) -> list[StoreStats]:
        """Per store, in configuration order: requests, errors, bytes, latency (cpfs.store.metered)."""
        return [self._stores[n].statistics() for n in self.names]

    def replica_statistics(self) -> ReplicaStats:
        return ReplicaStats(reads=self._reads, fallbacks=self._fallbacks, hedges=self._hedges,
                            hedges_won=self._hedges_won, hedges_in_flight=self._hedging,
                            hedges_skipped=self._hedges_skipped, hedges_over_budget=self._hedges_over_budget,
                            hedge_tokens=self._hedge_budget.statistics().tokens,
                            repairs_dropped=self._repairs_dropped,
                            touched=self._touched, renewed=self._renewed, explored=self._explored,
                            background_puts=self._bg_puts,
                            background_bytes=self._bg_bytes, background_done=self._bg_done,
                            background_failed=self._bg_failed, background_abandoned=self._bg_abandoned,
                            background_waits=self._bg_waits, batch_reads=self._batch_reads,
                            batched=self._batched, block_reads=self._block_reads,
                            block_bytes=self._block_bytes, block_misses=self._block_misses)

    def health(self) -> list[StoreHealth]:
        return [self._health[n].snapshot(n) for n in self.names]

    def is_up(self, name: str) -> bool:
        return self._health[name].up

    def targets(self, digest: str, avoid: Container[str] = ()) -> list[str]:
        """Where a write of `digest` (a chunk, a path's version, a transaction's record) goes now: its
        placement, with a spare standing in for each store marked down, that refused a write within
        REFUSED_FOR (full, denied), or in `avoid` (`Layout.targets`)."""
        now = trio.current_time()
        return self.layout.targets(digest, [n for n, h in self._health.items() if not h.up or n in avoid],
                                   [n for n, h in self._health.items() if now - h.refused < REFUSED_FOR])

    def retarget(self, digest: str, targets: Sequence[str], error: BaseException) -> list[str] | None:
        """Where a write of `digest` that failed on `targets` with `error` goes once more: with a spare
        standing in for the store that failed it transiently, or for one marked down or refusing since;
        None where that changes nothing (a cancellation; no spare; a refusal is marked by `_placed_put`)."""
        if not isinstance(error, StoreError):
            return None
        again = self.targets(digest, [error.store] if error.transient else [])
        return again if again != list(targets) else None

    def rank(self, names: Sequence[str]) -> list[str]:
        """Replicas, best first: stores that are up before those that are down, known-slow stores after
        the others, then least expected wait."""
        names = [n for n in names if n in self._stores]
        slow = {n for n in names if self._known_slow(n, names)}

        def score(n: str) -> tuple[bool, bool, float, float]:
            m = self._stores[n]
            latency = max(m.latency_ewma, self._read_latency(n), self._waiting(n), RANK_FLOOR)
            busy = max(m.outstanding, self._picked[n])   # picked: reads chosen, maybe not started yet
            return (not self._health[n].up, n in slow, (busy + 1) * latency, latency)
        return sorted(names, key=score)

    def ranked_up(self, names: Sequence[str]) -> list[str]:
        """The stores of `names` that are up, best first (`rank`): where a read that is not retried
        on other replicas goes."""
        return [n for n in self.rank(names) if self._health[n].up]

    def _floor(self, name: str) -> float:
        """What a read of `name` takes at best lately: its fastest recent answered read (the queueing
        of busy moments left out). Before it answered one, what is known: the moving average of its
        requests (the mount's listings), the median of its lost races once it lost a few (each took
        longer than that), and how long its oldest read in flight has waited; 0 if nothing is."""
        wins = self._wins[name]
        if wins:
            return min(wins)
        lost = self._latency[name]
        return max(self._stores[name].latency_ewma, self._waiting(name),
                   sorted(lost)[len(lost) // 2] if len(lost) >= 3 else 0.0)

    def _waiting(self, name: str) -> float:
        """How long the oldest read of `name` in flight has been waiting (0 if none is)."""
        since = self._since[name]
        return trio.current_time() - min(since.values()) if since else 0.0

    def _known_slow(self, name: str, among: Sequence[str]) -> bool:
        """`name` is up, and at best SLOW_RATIO times slower (and slower than hedge_min) than another
        store of `among` that is up."""
        mine = self._floor(name)
        if not self._health[name].up or mine <= self.config.hedge_min:
            return False
        others = [f for n in among if n != name and n in self._stores and self._health[n].up
                  and (f := self._floor(n)) > 0]
        return bool(others) and mine > SLOW_RATIO * max(min(others), RANK_FLOOR)

    def _mark_down(self, name: str, reason: str) -> None:
        h = self._health[name]
        h.reason = reason
        if h.up:
            h.up = False
            h.marked_down += 1
            log.warning("store %r marked down: %s; probing it every %gs", name, reason, self._probe_interval)
            self._went_down.set()

    def _answered(self, name: str) -> None:
        self._last_answer[name] = trio.current_time()
        h = self._health[name]
        h.in_a_row = 0
        if not h.up:
            h.up = True
            log.warning("store %r is back up", name)

    def _failed(self, name: str, e: StoreError) -> None:
        h = self._health[name]
        h.in_a_row += 1
        if h.in_a_row >= DOWN_AFTER:
            self._mark_down(name, f"{h.in_a_row} requests in a row failed, the last: {e.detail}")

    # ------------------------------------------------------------------ lifecycle

    async def check(self) -> None:
        """Every store usable, or a ConfigError naming the config file and the first store that is not:
        an unusable store is a bad configuration, found before anything is read or written. A store
        that fails transiently (unreachable, timing out) is marked down instead, unless every store does."""
        # A black-holed store must not hold the mount up for a whole request timeout.
        out = await self._fan_out(self.names, lambda n: self._call(
            n, "check", lambda s: s.check(), allow_down=True, timeout=min(CHECK_TIMEOUT, self._timeouts[n])))
        errors = sorted(out.errors, key=lambda ne: self.names.index(ne[0]))
        permanent = [e for _, e in errors if not e.transient]
        if permanent or (errors and len(errors) == len(self.names)):
            e = (permanent or [e for _, e in errors])[0]
            raise ConfigError(f"{self.config.source}: store {e.store!r}.url: {e.detail}")
        for name, e in errors:
            self._mark_down(name, e.detail)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background work: read repairs, probes of every store that is down until it answers, and the
        puts that writes returning at quorum left running. Runs until cancelled; start it in the
        nursery that outlives the pool's users (`await nursery.start(pool.run)`). Cancelled, it gives
        the background puts `shutdown_grace` seconds to end, then abandons them (logged: scrub
        completes their copies); writes from then on wait for every target."""
        async with trio.open_nursery() as puts:
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(self._repairer)
                    self._background = puts
                    task_status.started()
                    await self._prober()
            finally:
                self._background = None
                await self._drain()

    async def _drain(self) -> None:
        """Wait (shielded) up to shutdown_grace for the background puts, then cancel what is left."""
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self._shutdown_grace):
                while self._bg_scopes:
                    await self._bg_changed.wait()
            if self._bg_scopes:
                log.warning("shutting down: abandoning %d puts still running after %gs (%d background); "
                            "`cpfs scrub --repair` completes the copies they were making",
                            len(self._bg_scopes), self._shutdown_grace, self._bg_puts)
                for scope in self._bg_scopes:
                    scope.cancel()

    async def _repairer(self) -> None:
        async for name, key, blob, where in self._repair_recv:
            try:
                await self.put(name, key, blob)
            except StoreError as e:
                log.warning("%s: read repair of %s on store %r failed: %s", where, key, name, e)
                continue
            self._suspects.pop((name, key.rsplit("/", 1)[-1]), None)
            self._health[name].repairs += 1
            log.warning("%s: read repair: rewrote %s on store %r from a good replica", where, key, name)

    async def _prober(self) -> None:
        while True:
            down = [n for n in self.names if not self._health[n].up]
            if not down:
                self._went_down = trio.Event()
                await self._went_down.wait()
                continue
            await trio.sleep(self._probe_interval)
            async with trio.open_nursery() as n:
                for name in down:
                    n.start_soon(self._probing.run, name, functools.partial(self._probe, name))

    async def _revive(self, name: str) -> None:
        """The first step of a write that needs every one of its stores (`_put_quorum` with `need` of
        them, or without run()) on a store marked down: probe it now, unless a probe started within
        REVIVE_AFTER (the writes at that moment share one), instead of failing at once. A save right
        after an outage ended failed, its stores marked down until the next background probe (an
        audit's find: two mounts alternating saves got failures in 0.0 s, 130 ms after the stores
        answered again). A store that is still down costs the write one probe's wait at most. A write
        that may leave a store to the background does not wait: its put there fails at once, as it
        did, and scrub completes the copy (a hung store would hold the background puts, and through
        their bound the writer, a probe's time each)."""
        h = self._health.get(name)         # None: a store this config lacks (`_call` says so)
        if h is None or h.up:
            return
        if name in self._probing or trio.current_time() - h.probed >= REVIVE_AFTER:
            await self._probing.run(name, functools.partial(self._probe, name))     # or join the one running

    async def _probe(self, name: str) -> None:
        h = self._health[name]
        h.probes += 1
        h.probed = trio.current_time()
        with trio.move_on_after(min(CHECK_TIMEOUT, self._timeouts[name])):
            try:
                await self._stores[name].check()
            except StoreError as e:
                log.debug("store %r still down: %s", name, e)
                return
            self._answered(name)

    async def aclose(self) -> None:
        for s in self._stores.values():
            await s.aclose()

    # ------------------------------------------------------------------ one request

    async def _call(self, name: str, what: str, op: Callable[[Store], Awaitable[T]], *,
                    allow_down: bool = False, timeout: float | None = None) -> T:
        """op(store), bounded by the store's timeout (or `timeout`), retried while it fails
        transiently. A store marked down fails at once unless `allow_down` (a last-resort read), and a
        name this config lacks (a manifest's, of a store since retired) is unavailable."""
        h = self._health.get(name)
        if h is None:
            raise StoreUnavailable(name, f"{what}: no store {name!r} in this config")
        if not h.up and not allow_down:
            raise StoreUnavailable(name, f"{what}: store is down ({h.reason})")
        store = self._stores[name]
        timeout = self._timeouts[name] if timeout is None else timeout
        deadline = trio.current_time() + timeout
        attempt = 0
        failure: StoreError | None = None       # the last transient failure, not yet counted
        try:
            with trio.move_on_at(deadline):
                while True:
                    try:
                        result = await op(store)
                    except StoreError as e:
                        if not e.transient:
                            self._answered(name)
                            raise
                        failure = e
                        attempt += 1
                        delay = self._rng.uniform(0, min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (attempt - 1)))
                        if attempt >= ATTEMPTS or trio.current_time() + delay >= deadline:
                            failure = None
                            self._failed(name, e)
                            raise
                        h.retries += 1
                        log.debug("store %r: %s failed (%s), try %d in %.3fs", name, what, e.detail, attempt + 1, delay)
                        await trio.sleep(delay)
                        continue
                    self._answered(name)
                    return result
        except trio.Cancelled:
            if failure is not None:
                # Abandoned after failing, waiting to retry (a hedge won meanwhile): a failed request
                # all the same, or a store that fails every request would never be marked down.
                self._failed(name, failure)
            raise
        h.timeouts += 1
        self._mark_down(name, f"{what} got no answer within {timeout:g}s")
        raise StoreUnavailable(name, f"{what} got no answer within {timeout:g}s")

    async def get(self, name: str, key: str) -> bytes:
        return await self._call(name, f"get {key!r}", lambda s: s.get(key))

    async def get_range(self, name: str, key: str, start: int, length: int) -> bytes:
        return await self._call(name, f"get {key!r} [{start}+{length}]", lambda s: s.get_range(key, start, length))

    async def head(self, name: str, key: str) -> int:
        return await self._call(name, f"head {key!r}", lambda s: s.head(key))

    async def put(self, name: str, key: str, data: bytes | memoryview) -> None:
        await self._call(name, f"put {key!r}", lambda s: s.put(key, data))

    async def _placed_put(self, name: str, key: str, data: bytes | memoryview) -> None:
        """`put` of a write that `targets` placed (a chunk, a manifest): a refusal marks the store so
        that the next writes go to a spare (`targets`). Not other writes (a hold, a clock probe): one
        refused for its own reason would send every chunk and manifest elsewhere."""
        try:
            await self.put(name, key, data)
        except (StoreFull, StoreDenied) as e:
            h = self._health[name]
            if trio.current_time() - h.refused >= REFUSED_FOR:
                log.warning("store %r refuses writes (%s): writes placed on it go to a spare for %gs, if the "
                            "config has one", name, e.detail, REFUSED_FOR)
            h.refused = trio.current_time()
            h.refusals += 1
            raise

    async def put_new(self, name: str, key: str, data: bytes | memoryview) -> bool:
        """`Store.put_new` on one store: False if the key was there. A retry after a put that landed
        but whose answer was lost says False too: read the key back to know whose bytes it holds."""
        return await self._call(name, f"put_new {key!r}", lambda s: s.put_new(key, data))

    async def exists(self, name: str, key: str) -> bool:
        return await self._call(name, f"exists {key!r}", lambda s: s.exists(key))

    async def delete(self, name: str, key: str) -> None:
        await self._call(name, f"delete {key!r}", lambda s: s.delete(key))

    async def stat(self, name: str, key: str) -> ObjectInfo:
        return await self._call(name, f"stat {key!r}", lambda s: s.stat(key))

    async def touch(self, name: str, key: str) -> None:
        await self._call(name, f"touch {key!r}", lambda s: s.touch(key))

    async def delete_if_older(self, name: str, key: str, before: float) -> bool:
        """Delete `key` on store `name` if its mtime is before `before` (cpfs/gc.py); True if deleted."""
        return await self._call(name, f"delete {key!r} if older", lambda s: s.delete_if_older(key, before))

    # ------------------------------------------------------------------ listing

    async def list_page(self, name: str, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        return await self._call(name, f"list {prefix!r} after {start_after!r}",
                                lambda s: s.list(prefix, start_after, limit))

    def _page(self, name: str) -> int:
        """The keys one listing request of store `name` asks for (Store.list_limit)."""
        store = self._stores.get(name)
        return store.list_limit if store is not None else 1000

    async def iter_keys(self, name: str, prefix: str, page: int | None = None) -> AsyncIterator[list[str]]:
        """The keys of store `name` under `prefix`, a sorted page at a time (each page one request,
        with its own timeout and retries; `page` keys, by default the store's list_limit)."""
        page = page or self._page(name)
        after = ""
        while True:
            keys = await self.list_page(name, prefix, after, page)
            if keys:
                yield keys
            if len(keys) < page:
                return
            after = keys[-1]

    async def list_keys(self, name: str, prefix: str) -> list[str]:
        """Every key of store `name` starting with `prefix`, sorted."""
        return [k async for keys in self.iter_keys(name, prefix) for k in keys]

    async def iter_info(self, name: str, prefix: str, page: int | None = None, *,
                        temporary: bool = False) -> AsyncIterator[list[ObjectInfo]]:
        """iter_keys with sizes and ages; with `temporary`, what interrupted puts left instead of objects."""
        page = page or self._page(name)
        after = ""
        while True:
            what = f"list {'temporary files' if temporary else 'info'} {prefix!r} after {after!r}"
            infos = await self._call(name, what, lambda s: (s.list_temporary if temporary else s.list_info)(
                prefix, after, page))
            if infos:
                yield infos
            if len(infos) < page:
                return
            after = infos[-1].key

    # ------------------------------------------------------------------ replicas

    async def _fan_out(self, names: Sequence[str], fn: Callable[[str], Awaitable[T]]) -> FanOut[str, T]:
        return await fan_out(fn, names, catch=StoreError)

    async def _put_quorum(self, names: Sequence[str], fn: Callable[[str], Awaitable[object]], need: int,
                          what: str, *, nbytes: int = 0, failed: Callable[[str], None] | None = None) -> list[str]:
        """fn(name) on every store at once; the names that succeeded, in `names` order. Raises the
        first StoreError if fewer than `need` did. Once the write succeeded, `failed(name)` is called for
        every store whose fn failed (also later, for a background put).

        While run() runs and `need` < len(names), it returns as soon as `need` succeeded (names that
        succeeded by then); the other calls go on in run()'s nursery as background puts, holding the
        write's blob (`nbytes`). Backpressure: before returning, a write that leaves calls behind waits
        until its blob fits within BACKGROUND_BYTES and BACKGROUND_WRITES (or its calls end).
        Below quorum it raises only after every call ended, as without run(): the caller's cleanup
        (a failed manifest commit deletes its key) never races a put that lands afterwards.
        Manifests return at quorum too: a version is immutable and readers take the newest version
        any store lists (cpfs/catalog.py), so a version on `need` stores is found and survives like a
        chunk on `need` stores; a missing copy is a scrub finding, as for chunks."""
        names = list(names)

        def short() -> StoreError:
            return StoreError(",".join(names), f"{what}: {len(names)} stores, {need} needed")

        async def logged(name: str) -> object:
            try:
                await self._revive(name)
                return await fn(name)
            except StoreError as e:
                log.warning("%s: store %r failed: %s", what, name, e)
                raise

        bg = self._background
        if bg is None or need >= len(names):
            out = await quorum(logged, names, need, catch=StoreError, short=short)
            if failed is not None:
                for name, _ in out.errors:
                    failed(name)
            return out.succeeded(names)

        held: set[str] = set()
        errors: list[tuple[str, StoreError]] = []
        pending = len(names)
        left = False              # the write returned (or its caller gave up): running calls are background
        settled = trio.Event()    # quorum reached, or out of reach

        async def one(name: str) -> None:
            nonlocal pending
            error: StoreError | None = None
            with trio.CancelScope(shield=True) as scope:    # run()'s cancellation waits for the grace
                self._bg_scopes.add(scope)
                try:
                    await fn(name)
                except StoreError as e:
                    error = e
                finally:
                    self._bg_scopes.discard(scope)
            pending -= 1
            if error is None and not scope.cancelled_caught:
                held.add(name)
            elif error is not None and not left:
                errors.append((name, error))
                log.warning("%s: store %r failed: %s", what, name, error)
            if left:
                self._bg_puts -= 1
                if scope.cancelled_caught:
                    self._bg_abandoned += 1
                    log.warning("%s: background put on store %r abandoned at shutdown; "
                                "`cpfs scrub --repair` completes the copy", what, name)
                elif error is None:
                    self._bg_done += 1
                else:
                    self._bg_failed += 1
                    log.warning("%s: background put on store %r failed: %s; the copy is left to a repair "
                                "retry and `cpfs scrub --repair`", what, name, error)
                    if failed is not None:
                        failed(name)
                if pending == 0:
                    self._bg_bytes -= nbytes
                    self._bg_writes -= 1
            if len(held) >= need or len(held) + pending < need:
                settled.set()
            self._bg_changed.set()
            self._bg_changed = trio.Event()

        try:
            for name in names:
                bg.start_soon(one, name)
            await settled.wait()
            if len(held) < need:
                while pending:
                    await self._bg_changed.wait()
                if errors:
                    raise errors[0][1]
                raise short()
            waited = False
            while pending and self._bg_writes and (self._bg_bytes + nbytes > self._bg_limit
                                                   or self._bg_writes >= BACKGROUND_WRITES):
                waited = True
                await self._bg_changed.wait()
            self._bg_waits += waited
            if failed is not None:
                for name, _ in errors:
                    failed(name)
            return [n for n in names if n in held]
        finally:
            if pending and not left:
                left = True
                self._bg_puts += pending
                self._bg_bytes += nbytes
                self._bg_writes += 1

    def _read_latency(self, name: str) -> float:
        """Median of the store's recent read latencies (hedge losses included); of all stores' while
        it has none (a store not heard from is not assumed fast), 0 before any read."""
        samples = self._latency[name] or [t for d in self._latency.values() for t in d]
        return sorted(samples)[len(samples) // 2] if samples else 0.0

    def _hedge_after(self, name: str) -> float:
        """How long a read of `name` may take before the next replica is asked too: its recent p95
        (of all stores, while it has few samples), within [hedge_min, hedge_max]."""
        cfg = self.config
        samples = sorted(self._latency[name])
        if self._known_slow(name, self.names):      # hedge when a usual store would have answered
            samples = sorted(t for n, d in self._latency.items() if not self._known_slow(n, self.names) for t in d)
        elif len(samples) < 8:      # a store not heard from yet: what the stores take in general
            samples = sorted(t for d in self._latency.values() for t in d)
        if len(samples) < 4:
            return cfg.hedge_max
        p95 = samples[min(len(samples) - 1, math.ceil(0.95 * len(samples)) - 1)]
        return min(cfg.hedge_max, max(cfg.hedge_min, p95))

    def _queue_wait(self, name: str) -> float:
        """What the reads queued on `name` explain of a new read's wait there."""
        return max(self._stores[name].outstanding, self._picked[name]) * self._read_latency(name)

    def _patience(self, name: str, queued: float) -> float:
        """How long a read of `name` may take before it is slow: its hedge delay, or what the reads
        queued ahead of it explained when it started (`_queue_wait`), at most hedge_max."""
        return max(self._hedge_after(name), min(queued, self.config.hedge_max))

    async def _read_replicas(self, names: Sequence[str], read: Callable[[str], Awaitable[T]],
                             failed: Callable[[str, Exception], None],
                             then: Callable[[], Sequence[str]] | None = None) -> T:
        """read(name) on the replicas in rank order until one succeeds, hedged (see the module doc).
        Stores that are down come last, as a last resort; the stores `then()` names after all of
        `names` (ranked among themselves; asked for only once `names` are: most reads never need it).
        Raises the last failure."""
        order = self.rank(names)
        explore = self._to_explore(order, names)
        ranked = deque(n for n in order if n != explore)      # not asked yet

        def next_store() -> str | None:
            nonlocal then
            if not ranked and then is not None:
                ranked.extend(n for n in self.rank(then()) if n not in names)   # explore is one of names
                then = None
            return ranked.popleft() if ranked else None

        last: Exception | None = None
        send, recv = trio.open_memory_channel[tuple[str, float, bool, object]](len(self._stores) or 1)
        running: dict[str, float] = {}          # replica -> when its read started
        queued: dict[str, float] = {}           # replica -> the wait its queue explained at the start
        hedged: set[str] = set()
        paid: set[str] = set()                  # hedges the budget paid for (refunded if they win)
        held_back = False

        async def attempt(name: str) -> None:
            t0 = trio.current_time()
            token = object()
            self._since[name][token] = t0
            try:
                result: object = await read(name)
                ok = True
            except (StoreError, CorruptChunk) as e:
                result, ok = e, False
            finally:
                self._picked[name] -= 1
                del self._since[name][token]
            send.send_nowait((name, trio.current_time() - t0, ok, result))

        def start(name: str, hedge: bool = False) -> None:
            # What the reads queued ahead of this one explain of its wait: a read no later than that
            # is not slow, only queued (every link saturated: a hedge would spend another store's
            # bandwidth on a copy; measured with 3 throttled stores, a fifth of a load's reads hedged
            # and 10-25% slower). A straggler's own queue explains its wait too: known-slow ranking
            # keeps first attempts off it instead.
            queued[name] = self._queue_wait(name)
            self._reads += 1
            self._picked[name] += 1
            running[name] = trio.current_time()
            if hedge:
                hedged.add(name)
                self._hedges += 1
                self._hedging += 1
            n.start_soon(attempt, name)

        more = True
        hold = -math.inf                  # no hedge before this (the hedge budget was spent)
        first = next_store()
        if first is None:                 # here, not in the nursery: it would come out in an ExceptionGroup
            raise NoSuchObject(",".join(names) or "-", "no replica")
        try:
            async with trio.open_nursery() as n:
                newest = first
                start(newest)
                if explore is not None:
                    self._explored += 1
                    start(explore, hedge=True)
                while running:
                    wait, due = math.inf, math.inf
                    if more and self.config.hedges > 0 and newest in running:
                        due = max(running[newest] + self._patience(newest, queued[newest]), hold)
                        if ranked and self._known_slow(ranked[0], names):
                            # A hedge to a known-slow store cannot answer sooner than it takes at best:
                            # asked earlier, it would only hold a hedge (the read may have hung: then it helps).
                            due = max(due, running[newest] + self._floor(ranked[0]))
                        wait = due - trio.current_time()
                        if len(self._latency[newest]) < 8:
                            # Its p95 is still borrowed from the other stores and moves as their reads
                            # finish: look again soon. With samples of its own, once is enough.
                            wait = min(wait, self.config.hedge_min)
                    with trio.move_on_after(max(0.0, wait)):
                        name, took, ok, result = await recv.receive()
                        del running[name]
                        if ok:
                            self._latency[name].append(took)
                            self._wins[name].append(took)
                            self._hedge_budget.earn()
                            if name in hedged:
                                self._hedges_won += 1
                            if name in paid:
                                self._hedge_budget.refund()
                            for slow, since in running.items():
                                # A loser took longer than this, by how much nobody knows: counted
                                # twice over, so a straggler sinks faster than a store that lost once
                                # by a hair.
                                self._latency[slow].append(2 * (trio.current_time() - since))
                            if running:   # losers to stop; else nothing is (cancel() reprs the task: ~3%
                                n.cancel_scope.cancel()     # of the event loop's time on single reads)
                            return result  # type: ignore[return-value]
                        assert isinstance(result, Exception)
                        failed(name, result)
                        last = result
                        nxt = next_store()
                        if nxt is None:
                            more = False
                        else:
                            self._fallbacks += 1
                            start(nxt)
                            newest = nxt
                        continue
                    if trio.current_time() < due:
                        continue                  # looked again, not slow yet
                    if self._hedging >= self.config.hedges:
                        self._hedges_skipped += 1
                        hold = trio.current_time() + self.config.hedge_max
                        continue
                    nxt = next_store()
                    if nxt is None:
                        more = False
                        continue
                    now, deadline = trio.current_time(), running[newest] + self.config.hedge_max
                    # Past hedge_max, with its store silent since it started, a read may have hung: it
                    # is hedged whatever the budget. (A store that answers other reads meanwhile is
                    # busy, not hung: on a saturated link every read may wait that long.)
                    overdue = now >= deadline and self._last_answer[newest] <= running[newest]
                    if not overdue and not self._hedge_budget.spend():
                        # Hedges have lost lately: look again after another hedge delay.
                        ranked.appendleft(nxt)
                        self._hedges_over_budget += not held_back
                        held_back = True
                        hold = now + max(self._hedge_after(newest), HELD_BACK_MIN)
                        if now < deadline:
                            hold = min(hold, deadline)
                        continue
                    if not overdue:
                        paid.add(nxt)
                    start(nxt, hedge=True)
                    newest = nxt
        finally:
            self._hedging -= len(hedged)
        assert last is not None           # every read that left `running` failed (a success returned)
        raise last

    def _to_explore(self, order: Sequence[str], names: Sequence[str]) -> str | None:
        """The known-slow store of `names` to ask along with the first replica this time (once in
        EXPLORE_EVERY reads that pass it over, if a hedge is free), else None."""
        if len(order) < 2 or self.config.hedges <= 0:
            return None
        for name in order[1:]:
            if name in names and self._known_slow(name, names):
                self._passed_over[name] += 1
                if self._passed_over[name] % EXPLORE_EVERY == 0 and self._hedging < self.config.hedges:
                    return name
        return None

    async def put_quorum(self, names: Sequence[str], key: str, data: bytes, quorum: int) -> list[str]:
        """Put `key` on every store of `names` at once; the names that hold it (in `names` order).
        Raises the first StoreError if fewer than `quorum` succeeded."""
        return await self._put_quorum(names, lambda n: self._placed_put(n, key, data), quorum, f"put {key!r}",
                                      nbytes=len(data))

    async def get_any(self, names: Sequence[str], key: str) -> bytes:
        """An object from the best store of `names` that has it."""
        def failed(name: str, e: Exception) -> None:
            log.debug("get %r from store %r failed: %s", key, name, e)

        return await self._read_replicas(
            names, lambda n: self._call(n, f"get {key!r}", lambda s: s.get(key), allow_down=True), failed)

    # ------------------------------------------------------------------ chunks

    def _suspect(self, name: str, digest: str) -> None:
        self._suspects[(name, digest)] = None
        self._suspects.move_to_end((name, digest))
        while len(self._suspects) > SUSPECTS_MAX:
            self._suspects.popitem(last=False)

    async def fetch_chunk(self, entry: ChunkEntry, where: str, damaged_on: Sequence[str] = ()) -> bytes:
        """Verified raw bytes of a chunk from the best replica that has them, exactly entry.raw_len
        long. `where` ("file F offset O chunk N") goes into every log line about it.
        The stores the manifest lists are tried first, then the chunk's current placement: where
        `cpfs scrub --repair` puts the copies a replaced, removed or too short store list lacks.
        `damaged_on`: listed stores a batch read found without a good copy (`fetch_chunks`): not asked
        again, and repaired like those this read finds."""
        key = chunkfmt.chunk_key(entry.digest)
        placed: list[str] = []

        def placement() -> list[str]:
            placed.extend(n for n in place(entry.digest, self.names, min(self.config.replicas, len(self.names)))
                          if n not in entry.stores)
            return placed
        failures: list[str] = []
        damaged: list[str] = list(damaged_on)    # replicas that are corrupt or missing: to repair
        blobs: dict[str, bytes | memoryview] = {}
        decode = _decoder(entry.digest)

        async def read(name: str) -> bytes | memoryview:
            try:
                raw, blob = await self._call(name, f"get {key!r}",
                                             lambda s: s.get_with(key, decode, self.cpu), allow_down=True)
            except NoSuchObject:
                if name in entry.stores:      # a placement store without a copy is not damaged
                    damaged.append(name)
                raise
            if isinstance(raw, CorruptChunk):
                self._suspect(name, entry.digest)
                damaged.append(name)
                raise raw
            if len(raw) != entry.raw_len:     # the manifest is wrong, not the replica: nothing to repair
                raise CorruptChunk(f"chunk {entry.digest[:16]}: {len(raw)} bytes, the manifest says {entry.raw_len}")
            blobs[name] = blob
            return raw

        def failed(name: str, e: Exception) -> None:
            kind = "corrupt replica" if isinstance(e, CorruptChunk) else "replica failed"
            log.warning("%s: %s %s on store %r: %s", where, kind, entry.digest[:16], name, e)
            failures.append(f"{name}: {e}")

        try:
            raw = await self._read_replicas([n for n in entry.stores if n not in damaged_on], read, failed,
                                            then=placement)
        except (StoreError, CorruptChunk):
            pass
        else:
            if damaged and blobs:
                good = bytes(next(iter(blobs.values())))   # a copy: the blob may be a store's reused buffer
                for name in damaged:
                    try:
                        self._repair_send.send_nowait((name, key, good, where))
                    except trio.WouldBlock:
                        self._repairs_dropped += 1
            return raw
        raise ChunkUnavailable(f"{where}: no replica of chunk {entry.digest[:16]} could be read "
                               f"(stores {', '.join([*entry.stores, *placed])}): "
                               f"{'; '.join(failures) or 'no known store'}")

    async def fetch_blocks(self, entry: ChunkEntry, start: int, end: int, where: str) -> tuple[int, bytes] | None:
        """(offset in the chunk, bytes) of the chunk's blocks that cover raw bytes [start, end), each
        checked against the manifest's block checks, from the best-ranked replica that is up (not
        hedged: a block costs a fraction of a chunk's read, and its latency would mislead the ranking of
        chunk reads). None if the entry has none or is not stored raw, or that replica fails, is slower
        than a hedged read would wait, or does not match: the caller then reads the whole chunk
        (`fetch_chunk`), with its fallbacks, and finds and repairs a corrupt copy. For a few pages the
        kernel lost (cpfs/chunk.py, block checks)."""
        if not entry.blocks or entry.codec != "raw" or not 0 <= start < end <= entry.raw_len:
            return None
        first = start // chunkfmt.BLOCK
        lo, hi = first * chunkfmt.BLOCK, min(entry.raw_len, -(-end // chunkfmt.BLOCK) * chunkfmt.BLOCK)
        up = self.ranked_up(entry.stores)
        if not up:
            return None
        name, key = up[0], chunkfmt.chunk_key(entry.digest)
        self._block_reads += 1

        def check(data: bytes | memoryview) -> bytes | memoryview | CorruptChunk:
            """In the store's read thread. Blocks that do not match are an answer, not a store failure."""
            try:
                if len(data) != hi - lo:
                    raise CorruptChunk(f"chunk {entry.digest[:16]}: {len(data)} bytes at {lo}, expected {hi - lo}")
                chunkfmt.check_blocks(data, entry.digest, entry.blocks, first)
            except CorruptChunk as e:
                return e
            return data
        try:
            # Given up once slower than a chunk read would wait before hedging: the whole-chunk read
            # that follows hedges, so a hung or straggling store delays a lost page by that much, not
            # by the store's timeout.
            patience = self._patience(name, self._queue_wait(name))
            with trio.move_on_after(patience) as waited:
                data = await self._call(name, f"get {key!r} [{lo}:{hi}]", lambda s: s.get_range_with(
                    key, chunkfmt.HEADER_SIZE + lo, hi - lo, check, self.cpu))
            if waited.cancelled_caught:
                raise StoreUnavailable(name, f"no answer within {patience:.3f}s")
            if isinstance(data, CorruptChunk):
                raise data
        except (StoreError, CorruptChunk) as e:
            # Not marked corrupt: a copy stored lz4 (dedup keeps a copy encoded otherwise) does not
            # match either. The whole-chunk read that follows tells the two apart, and repairs.
            self._block_misses += 1
            log.info("%s: blocks [%d, %d) of chunk %s on store %r: %s; reading the whole chunk",
                     where, lo, hi, entry.digest[:16], name, e)
            return None
        self._block_bytes += len(data)
        return lo, data

    async def fetch_chunks(self, entries: Sequence[ChunkEntry],
                           wheres: Sequence[str]) -> list[bytes | memoryview | Exception]:
        """`fetch_chunk` of each entry, in order, with the exception (ChunkUnavailable) in the place of
        a chunk that cannot be read. For prefetches of many small chunks (a zip header between two
        tensors, a tensor of a few hundred KiB): the chunks a store holds are read from it in one batch
        request (`Store.get_many_with`: for a folder store, one worker thread hand-off instead of one,
        plus a task, a nursery and a channel, per chunk); the store is the best-ranked one that holds
        the most of them. A batch is not hedged while it runs: it is as big as one large chunk, whose read
        is not hedged either when it only queues. Whatever a batch does not bring (a missing or corrupt
        replica, a store that fails) and a chunk alone in its batch go through `fetch_chunk`: replicas,
        hedges and read repair as for any read. A batch that takes longer than a read would wait before
        hedging is given up for the same."""
        results: list[bytes | memoryview | Exception | None] = [None] * len(entries)
        damaged: dict[int, list[str]] = {}      # k -> stores the batch found without a good copy of it
        left = [k for k, e in enumerate(entries) if e.stores]
        batches: list[tuple[str, list[int]]] = []
        while len(left) > 1:
            up = self.ranked_up(sorted({n for k in left for n in entries[k].stores}))
            if not up:
                break
            name = max(up, key=lambda n: (sum(n in entries[k].stores for k in left), -up.index(n)))
            ks = [k for k in left if name in entries[k].stores]
            if len(ks) < 2:
                break
            batches.append((name, ks))
            left = [k for k in left if name not in entries[k].stores]

        async def batch(name: str, ks: list[int]) -> None:
            reads = [(chunkfmt.chunk_key(entries[k].digest), _decoder(entries[k].digest)) for k in ks]
            self._reads += len(ks)
            self._batch_reads += 1
            self._batched += len(ks)
            # Given up once slower than a read would wait before hedging (hedge_max at least: a batch
            # is as big as a large chunk): its chunks then go through fetch_chunk, which hedges. A store
            # that began to hang held a batch, and every demand read that joined it, for its whole
            # timeout (an audit's find: 8 s with an 8 s timeout, 30 s by default).
            patience = max(self._patience(name, self._queue_wait(name)), self.config.hedge_max)
            try:
                with trio.move_on_after(patience) as waited:
                    answers = await self._call(name, f"get {len(ks)} chunks",
                                               lambda s: s.get_many_with(reads, self.cpu))
                if waited.cancelled_caught:
                    raise StoreUnavailable(name, f"no answer within {patience:.3f}s")
            except StoreError as e:
                log.warning("%s and %d more: batch read on store %r failed: %s", wheres[ks[0]], len(ks) - 1, name, e)
                return
            for k, answer in zip(ks, answers):
                entry = entries[k]
                if isinstance(answer, StoreError):
                    log.warning("%s: replica failed %s on store %r: %s", wheres[k], entry.digest[:16], name, answer)
                    if isinstance(answer, NoSuchObject):
                        damaged.setdefault(k, []).append(name)
                    continue
                raw = answer[0]
                if isinstance(raw, CorruptChunk):
                    self._suspect(name, entry.digest)
                    damaged.setdefault(k, []).append(name)
                    log.warning("%s: corrupt replica %s on store %r: %s", wheres[k], entry.digest[:16], name, raw)
                elif len(raw) == entry.raw_len:
                    results[k] = raw

        async with trio.open_nursery() as n:
            for name, ks in batches:
                n.start_soon(batch, name, ks)
        rest = [k for k, r in enumerate(results) if r is None]
        alone = await fan_out(lambda k: self.fetch_chunk(entries[k], wheres[k], damaged.get(k, ())), rest,
                              catch=Exception)
        for k, r in zip(rest, alone.outcomes(rest)):
            results[k] = r
        return results  # type: ignore[return-value]  # every None replaced

    async def _copy_state(self, name: str, key: str, enc: chunkfmt.EncodedChunk) -> tuple[str, float]:
        """("good", its mtime), ("missing", 0) or ("bad", 0): the copy of the chunk on store `name`,
        checked against the blob in hand: same size and header (the whole blob when small). A copy that
        differs is decoded and kept only if it verifies (the same chunk, encoded otherwise). A copy a
        read found corrupt is bad.
        Caveat: a flipped byte inside a copy larger than VERIFY_FULL_MAX passes this check; the first
        read of that copy finds it (every read verifies), and the next write of the chunk rewrites it."""
        if (name, enc.digest) in self._suspects:
            log.warning("chunk %s: rewriting the copy on store %r that a read found corrupt", enc.digest[:16], name)
            return "bad", 0.0
        blob = enc.blob
        try:
            info = await self.stat(name, key)
            data = None
            if info.size == len(blob):
                if len(blob) <= VERIFY_FULL_MAX:
                    data = await self.get(name, key)
                    if data == blob:
                        return await self._kept(name, key, info)
                elif await self.get_range(name, key, 0, chunkfmt.HEADER_SIZE) == blob[:chunkfmt.HEADER_SIZE]:
                    return await self._kept(name, key, info)
            if data is None:
                data = await self.get(name, key)
        except NoSuchObject:
            return "missing", 0.0
        try:
            await trio.to_thread.run_sync(chunkfmt.decode, data, enc.digest, limiter=self.cpu)
        except CorruptChunk as e:
            log.warning("chunk %s: the copy on store %r is corrupt (%s): rewriting it", enc.digest[:16], name, e)
            return "bad", 0.0
        return await self._kept(name, key, info)

    async def _kept(self, name: str, key: str, info: ObjectInfo) -> tuple[str, float]:
        """("good", its mtime on our clock) for a copy dedup reuses, once it is safe from a concurrent gc
        (cpfs/gc.py): a copy older than gc_grace/2 is renewed first; ("missing", 0) if a gc took it. Its
        age is judged on the store's clock (`_store_offset`): judged on ours, a host whose clock is
        behind by gc_grace/2 took an old copy for a young one and left it to a gc, and its commit named
        a chunk the gc deleted (an audit's find). A store whose clock cannot be read: renewed."""
        start = self.clock()
        try:
            offset: float | None = await self._store_offset(name)
        except StoreError as e:
            log.warning("store %r: cannot read its clock (%s): renewing the copies dedup reuses", name, e)
            offset = None
        if offset is not None and start + offset - info.mtime < self.config.gc_grace / 2:
            return "good", info.mtime - offset
        try:
            await self._touch_copy(name, key)
        except NoSuchObject:
            log.info("chunk %s: the old copy on store %r went (a gc): writing it again", key, name)
            return "missing", 0.0
        self._touched += 1
        return "good", start

    async def _store_offset(self, name: str) -> float:
        """Store `name`'s wall clock minus ours, in seconds: a probe object (CLOCK_KEY) written there and
        its mtime read back, at most once per CLOCK_EVERY of gc_grace. gc judges ages on the stores'
        clocks (its assumption 2); a mount's own may be off by any amount."""
        sample = self._offsets.get(name)
        if sample is not None and self.ticks() - sample[1] < self.config.gc_grace * CLOCK_EVERY:
            return sample[0]

        async def measure() -> float:
            before = self.clock()
            await self.put(name, CLOCK_KEY, b"")
            mtime = (await self.stat(name, CLOCK_KEY)).mtime
            offset = mtime - (before + self.clock()) / 2
            if abs(offset) > self.config.gc_grace * CLOCK_EVERY and \
                    abs(offset - (sample[0] if sample else 0.0)) > self.config.gc_grace * CLOCK_EVERY:
                log.warning("store %r: its clock is %+.0f s from this host's; ages of copies are judged on "
                            "the store's", name, offset)
            self._offsets[name] = (offset, self.ticks())
            return offset

        return await self._measuring.run(name, measure)

    async def _touch_copy(self, name: str, key: str) -> None:
        """Touch a copy, then look it up again: NoSuchObject if a gc took it meanwhile (on a folder
        store a gc's claim is a rename, so a copy still there after the touch is kept)."""
        await self.touch(name, key)
        await self.stat(name, key)

    async def renew(self, digest: str, names: Sequence[str]) -> tuple[list[str], list[str]]:
        """Touch the copies of a chunk on `names` that a commit not yet written counts on, so that a gc
        spares them however long the file stays open (cpfs/gc.py). Returns the stores whose copy was
        renewed (at `clock()` or later), and those whose copy is gone; a store that fails is in neither
        (logged). Stores this config lacks (a manifest names one since retired) are in neither either."""
        key = chunkfmt.chunk_key(digest)
        names = [n for n in names if n in self._health]
        out = await self._fan_out(names, lambda name: self._touch_copy(name, key))
        for name, e in out.errors:
            log.warning("chunk %s: could not renew its copy on store %r: %s", digest[:16], name, e)
        self._renewed += len(out.results)
        return out.succeeded(names), [name for name, e in out.errors if isinstance(e, NoSuchObject)]

    async def store_chunk(self, enc: chunkfmt.EncodedChunk, targets: Sequence[str], quorum: int) -> Stored:
        """Put a chunk on `targets`, reusing the good copies already there (and rewriting bad ones).
        Raises the first error below quorum. With run() running and quorum < len(targets), it returns
        once `quorum` stores hold it; the other targets are completed in the background (see
        `_put_quorum`), a copy that failed is tried once more through the repair queue, then left to
        scrub."""
        key = chunkfmt.chunk_key(enc.digest)
        wrote = False
        since: dict[str, float] = {}    # store -> the oldest mtime its copy may have

        async def one(name: str) -> None:
            nonlocal wrote
            state, mtime = await self._copy_state(name, key, enc)
            if state == "good":
                since[name] = mtime
                return
            start = self.clock()
            await self._placed_put(name, key, enc.blob)
            since[name] = start
            self._suspects.pop((name, enc.digest), None)
            if state == "bad":
                self._health[name].repairs += 1
            wrote = True

        def retry(name: str) -> None:   # write_quorum < replicas: a copy that failed, tried once more
            try:
                self._repair_send.send_nowait((name, key, enc.blob, f"chunk {enc.digest[:16]} (write)"))
            except trio.WouldBlock:
                self._repairs_dropped += 1

        held = await self._put_quorum(targets, one, quorum, f"chunk {enc.digest[:16]}", nbytes=len(enc.blob),
                                      failed=retry)
        return Stored(held, wrote, min(since[n] for n in held))

    async def capacity(self) -> Capacity | None:
        """What a user can still write (statfs). Each byte written lands on `replicas` of the n stores
        (placement spreads them evenly), so a space takes replicas/n of every byte, times the number of
        stores that share it (folder stores on one filesystem). The space that fills first bounds the
        rest: free = min over spaces of free * n / (replicas * sharing stores); total likewise.
        Stores that report none (S3) or do not answer within CHECK_TIMEOUT are left out; None if
        no store reports a capacity."""
        async def one(name: str) -> Capacity | None:
            return await self._call(name, "capacity", lambda s: s.capacity(),
                                    timeout=min(CHECK_TIMEOUT, self._timeouts[name]))

        out = await self._fan_out(self.names, one)
        spaces: dict[str, tuple[Capacity, int]] = {}
        for name, cap in out.results.items():
            if cap is not None:
                key = cap.shared or f"store:{name}"
                spaces[key] = (cap, spaces[key][1] + 1 if key in spaces else 1)
        if not spaces:
            return None
        n, r = len(self.names), min(self.config.replicas, len(self.names))
        return Capacity(total=min(c.total * n // (r * k) for c, k in spaces.values()),
                        free=min(c.free * n // (r * k) for c, k in spaces.values()))
