"""Concurrency primitives, one per pattern that recurs in cpfs (in the manner of trio's _sync.py).

- `fan_out`: one call per item, all at once, every outcome collected (replicated puts, listings).
- `quorum`: fan_out that succeeds when at least `need` calls did (a chunk or manifest put).
- `SingleFlight`: concurrent callers of the same key share one call (a chunk uploaded once).
- `Budget`: extra work that may not pay off (hedged reads) allowed as a fraction of the useful work,
  given back when it does pay off.

Each states its invariants where it is defined; none hides a task beyond the caller's lifetime.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

T = TypeVar("T", bound=Hashable)
R = TypeVar("R")
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class FanOut(Generic[T, R]):
    """What a fan_out did: results of the calls that returned, errors of those that raised."""

    results: dict[T, R] = field(default_factory=dict)
    errors: list[tuple[T, Exception]] = field(default_factory=list)     # in the order they happened

    def succeeded(self, items: Iterable[T]) -> list[T]:
        """The items whose call returned, in `items` order (not completion order: deterministic)."""
        return [i for i in items if i in self.results]

    def outcomes(self, items: Iterable[T]) -> list[R | Exception]:
        """Per item, in `items` order, its call's result or the exception it raised (a batch of
        reads whose failures are answers, one per item)."""
        errors = dict(self.errors)
        return [self.results[i] if i in self.results else errors[i] for i in items]


async def fan_out(fn: Callable[[T], Awaitable[R]], items: Iterable[T], *,
                  catch: type[Exception] | tuple[type[Exception], ...]) -> FanOut[T, R]:
    """fn(item) for every (distinct) item at once; returns once every call ended.

    Invariant: exceptions of the `catch` types are outcomes, collected, never raised here; any other
    exception is a bug or a cancellation: it cancels the other calls and propagates."""
    out: FanOut[T, R] = FanOut()

    async def one(item: T) -> None:
        try:
            out.results[item] = await fn(item)
        except catch as e:
            out.errors.append((item, e))

    async with trio.open_nursery() as n:
        for item in items:
            n.start_soon(one, item)
    return out


async def quorum(fn: Callable[[T], Awaitable[R]], items: Iterable[T], need: int, *,
                 catch: type[Exception] | tuple[type[Exception], ...],
                 short: Callable[[], Exception]) -> FanOut[T, R]:
    """fan_out, then: at least `need` calls returned, or raise the first caught error (`short()` if
    nothing failed but there were too few items). Every call runs to its end either way: a put that
    reached quorum still lands on every store that answers."""
    items = list(items)
    out = await fan_out(fn, items, catch=catch)
    if len(out.results) < need:
        raise out.errors[0][1] if out.errors else short()
    return out


@dataclass(frozen=True, kw_only=True)
class SingleFlightStats:
    in_flight: int       # keys with a call running
    calls: int           # calls made
    joined: int          # callers that shared a running call instead of making one


class _Flight(Generic[V]):
    __slots__ = ("done", "value", "error", "ok")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.ok = False
        self.value: V | None = None
        self.error: Exception | None = None


class SingleFlight(Generic[K, V]):
    """Concurrent callers of the same key share one call.

    Invariants: at most one call per key runs at a time. A caller that finds one running waits for it
    and gets its value, or its exception (a failure is shared, not retried: retrying is the pool's
    job). If the running call was cancelled (its caller gave up), the waiters are not: one of them
    makes the call anew. Nothing is remembered once a call ends: caching is the caller's business.
    """

    def __init__(self) -> None:
        self._flights: dict[K, _Flight[V]] = {}
        self._calls = self._joined = 0

    def statistics(self) -> SingleFlightStats:
        return SingleFlightStats(in_flight=len(self._flights), calls=self._calls, joined=self._joined)

    def __contains__(self, key: K) -> bool:
        return key in self._flights

    async def run(self, key: K, fn: Callable[[], Awaitable[V]]) -> V:
        while (flight := self._flights.get(key)) is not None:
            self._joined += 1
            await flight.done.wait()
            if flight.ok:
                return flight.value  # type: ignore[return-value]  # set together with ok
            if flight.error is not None:
                raise flight.error
            # cancelled: loop, and lead a new call unless another waiter already does
        flight = self._flights[key] = _Flight()
        self._calls += 1
        try:
            flight.value = await fn()
            flight.ok = True
            return flight.value
        except Exception as e:
            flight.error = e
            raise
        finally:
            del self._flights[key]
            flight.done.set()


@dataclass(frozen=True, kw_only=True)
class BudgetStats:
    tokens: float        # what may be spent now (at most `burst`)
    spent: int           # spends allowed
    refunded: int        # ... given back because they paid off
    denied: int          # spends refused: no token left


class Budget:
    """Tokens for extra work that pays off only sometimes: useful work earns `ratio` of a token
    (`earn`), the extra work costs one (`spend`), and extra work that paid off gives it back (`refund`).

    Why (hedged reads, cpfs/pool.py): a hedge pays off only when the replicas are slow independently.
    Stores that share a bottleneck (folders on one disk, buckets behind one gateway or link) are slow
    together: a hedge then queues behind the read it meant to overtake, loses, and adds its bytes to the
    queue, which makes more reads slow. A budget bounds that at `ratio` of the reads (the extra load
    that hedging at the p95 is meant to add: "The Tail at Scale"; gRPC throttles retries and hedges
    with the same kind of token bucket), while hedges that win, as against a straggler, cost nothing.

    Invariant: the extra work that did not pay off is at most `burst` + `ratio` x the earns. Not
    thread-safe: the event loop's.
    """

    def __init__(self, ratio: float, burst: float) -> None:
        self.ratio = ratio
        self.burst = burst
        self._tokens = burst            # full at the start: the first slow reads need no history
        self._spent = self._refunded = self._denied = 0

    def statistics(self) -> BudgetStats:
        return BudgetStats(tokens=self._tokens, spent=self._spent, refunded=self._refunded, denied=self._denied)

    def earn(self) -> None:
        self._tokens = min(self.burst, self._tokens + self.ratio)

    def spend(self) -> bool:
        """Take a token if there is one; False (counted as denied) if not."""
        if self._tokens < 1:
            self._denied += 1
            return False
        self._tokens -= 1
        self._spent += 1
        return True

    def refund(self) -> None:
        """A spend paid off: its token back."""
        self._tokens = min(self.burst, self._tokens + 1)
        self._refunded += 1
