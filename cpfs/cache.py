"""The in-memory chunk cache: a byte budget, LRU eviction, single-flight, and pins.

It never sees a store: callers hand `get` a loader (an async function returning the chunk's bytes), so
tests drive it with fakes. Chunks are content-addressed, so one entry serves every file that shares it.

Pins protect what a running readahead has fetched but the reader has not consumed yet: eviction skips
pinned entries, and prefetch asks `room()` before starting, so prefetch never pushes the cache past its
budget. Demand reads always proceed; if everything is pinned they may exceed the budget by what is in
flight, which `statistics().peak_used` makes visible.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from .errors import CorruptChunk


def _check_size(key: str, data: bytes | memoryview, size: int) -> None:
    if len(data) != size:
        raise CorruptChunk(f"chunk {key[:16]}: {len(data)} bytes, and a manifest says {size}: that manifest is wrong")


@dataclass(frozen=True, kw_only=True)
class CacheStats:
    budget: int
    used: int            # bytes held by entries
    inflight: int        # bytes being fetched (reserved)
    pinned: int          # bytes held by pinned entries
    peak_used: int       # highest used + inflight seen
    hits: int
    misses: int          # loader calls
    joined: int          # requests that waited for another request's fetch of the same chunk
    evictions: int
    bytes_loaded: int


class _Entry:
    __slots__ = ("data", "pins")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pins = 0


class _Flight:
    __slots__ = ("done", "data", "error", "pins")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None
        self.error: Exception | None = None
        self.pins = 0


class ChunkCache:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._used = self._inflight = self._pinned = self._reserved = self._peak = 0
        self._hits = self._misses = self._joined = self._evictions = self._loaded = 0

    def statistics(self) -> CacheStats:
        return CacheStats(budget=self.budget, used=self._used, inflight=self._inflight, pinned=self._pinned,
                          peak_used=self._peak, hits=self._hits, misses=self._misses, joined=self._joined,
                          evictions=self._evictions, bytes_loaded=self._loaded)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def peek(self, key: str, size: int) -> bytes | None:
        """The cached bytes without waiting or counting; None if absent, or of another `size` than the
        caller's manifest gives the chunk (see `get`)."""
        e = self._entries.get(key)
        return e.data if e and len(e.data) == size else None

    def claim(self, key: str, size: int) -> bytes | None:
        """The cached bytes, pinned (as `get(..., pin=True)` would, counted as a hit); None if absent
        or of another size (see `peek`). A readahead claims what it will hand the reader soon, so its
        later prefetches cannot evict it."""
        e = self._entries.get(key)
        if e is None or len(e.data) != size:
            return None
        self._hits += 1
        self._entries.move_to_end(key)
        self._pin(e)
        return e.data

    def room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit in the budget if every unpinned entry were evicted."""
        return self._pinned + self._inflight + self._reserved + nbytes <= self.budget

    def reserve(self, nbytes: int) -> bool:
        """Claim room for a prefetch that will call `get(..., reserved=True)`; False if it does not fit.
        Prefetches queue on a limiter before they fetch: without the claim they would all see room."""
        if not self.room(nbytes):
            return False
        self._reserved += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Give back a reservation that will not be used."""
        self._reserved -= nbytes

    async def get(self, key: str, size: int, loader: Callable[[], Awaitable[bytes]], *,
                  pin: bool = False, reserved: bool = False) -> bytes:
        """The chunk's bytes, loading it at most once however many tasks ask at the same time.
        With pin=True the entry stays until `unpin(key)`; reserved=True hands over a `reserve(size)`.
        Bytes of another length than `size` (a manifest that gives a chunk the wrong length, where another
        gave it the right one that loaded it) raise CorruptChunk: sliced by the wrong length, they were
        wrong bytes; loaded alone, the pool refuses them."""
        if reserved:
            self._reserved -= size
        while True:
            entry = self._entries.get(key)
            if entry is not None:
                self._hits += 1
                self._entries.move_to_end(key)
                _check_size(key, entry.data, size)
                if pin:
                    self._pin(entry)
                return entry.data
            flight = self._flights.get(key)
            if flight is None:
                return await self._load(key, size, loader, pin)
            self._joined += 1
            if pin:
                flight.pins += 1
            try:
                await flight.done.wait()
            except BaseException:
                if pin:
                    self._drop_flight_pin(key, flight)
                raise
            if flight.error is not None:
                if pin:
                    self._drop_flight_pin(key, flight)
                raise flight.error
            if flight.data is not None:
                if len(flight.data) != size:
                    if pin:
                        self._drop_flight_pin(key, flight)
                    _check_size(key, flight.data, size)
                return flight.data
            # The fetching task was cancelled: whoever is still waiting tries again.
            if pin:
                flight.pins -= 1

    def _drop_flight_pin(self, key: str, flight: _Flight) -> None:
        flight.pins -= 1
        if flight.done.is_set() and flight.data is not None:
            self.unpin(key)

    async def _load(self, key: str, size: int, loader: Callable[[], Awaitable[bytes]], pin: bool) -> bytes:
        flight = self._flights[key] = _Flight()
        flight.pins = int(pin)
        self._misses += 1
        self._inflight += size
        self._evict()
        self._note_peak()
        try:
            data = await loader()
        except BaseException as e:
            if isinstance(e, Exception):
                flight.error = e
            self._land(key, size, flight)
            raise
        flight.data = data
        self._land(key, size, flight)
        return data

    def absent(self, key: str) -> bool:
        """Neither cached nor being loaded: what `load_many` may load."""
        return key not in self._entries and key not in self._flights

    async def load_many(self, items: Sequence[tuple[str, int]],
                        loader: Callable[[], Awaitable[Sequence[bytes | Exception]]], *,
                        pin: bool = False, reserved: bool = False) -> list[bytes | Exception]:
        """Load several absent chunks ((key, size) pairs, distinct) with one loader call that returns
        them in order, an exception in the place of one that failed. Single-flight as `get`: a `get` of
        any of them meanwhile waits for this load. pin and reserved as for `get`, for every chunk."""
        flights = []
        for key, size in items:
            assert self.absent(key), key
            if reserved:
                self._reserved -= size
            flight = self._flights[key] = _Flight()
            flight.pins = int(pin)
            self._misses += 1
            self._inflight += size
            flights.append(flight)
        self._evict()
        self._note_peak()
        try:
            got = await loader()
        except BaseException as e:
            for (key, size), flight in zip(items, flights):
                if isinstance(e, Exception):
                    flight.error = e
                self._land(key, size, flight)
            raise
        for (key, size), flight, data in zip(items, flights, got):
            if isinstance(data, Exception):
                flight.error = data
            else:
                flight.data = data
            self._land(key, size, flight)
        return list(got)

    def _land(self, key: str, size: int, flight: _Flight) -> None:
        self._inflight -= size
        del self._flights[key]
        if flight.data is not None:
            self._insert(key, flight.data, flight.pins)
        flight.done.set()

    def _insert(self, key: str, data: bytes, pins: int) -> None:
        entry = _Entry(data)
        self._entries[key] = entry
        self._used += len(data)
        self._loaded += len(data)
        for _ in range(pins):
            self._pin(entry)
        self._note_peak()
        self._evict()

    def _pin(self, entry: _Entry) -> None:
        if entry.pins == 0:
            self._pinned += len(entry.data)
        entry.pins += 1

    def unpin(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.pins == 0:
            return
        entry.pins -= 1
        if entry.pins == 0:
            self._pinned -= len(entry.data)
            self._evict()

    def _evict(self) -> None:
        if self._used + self._inflight <= self.budget:
            return
        for key in list(self._entries):
            if self._used + self._inflight <= self.budget:
                break
            entry = self._entries[key]
            if entry.pins:
                continue
            del self._entries[key]
            self._used -= len(entry.data)
            self._evictions += 1

    def _note_peak(self) -> None:
        self._peak = max(self._peak, self._used + self._inflight)

    def discard(self, key: str) -> None:
        """Drop an unpinned entry now: its bytes live on elsewhere (e.g. in the kernel page cache)."""
        entry = self._entries.get(key)
        if entry is not None and entry.pins == 0:
            del self._entries[key]
            self._used -= len(entry.data)

    def clear(self) -> None:
        """Drop every unpinned entry (used on unmount and by benchmarks for a cold start)."""
        budget, self.budget = self.budget, 0
        self._evict()
        self.budget = budget
