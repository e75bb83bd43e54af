"""Metering: a wrapper that counts what one store is asked and how it answers.

The pool puts one around every store and ranks replicas on its live numbers (`outstanding`,
`latency_ewma`); `statistics()` is the snapshot tests, benchmarks and the stats command read.
A request counts once per call that reaches this wrapper: the pool's retries are separate requests.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import trio

from ..errors import NoSuchObject, StoreError
from .base import ObjectInfo, Sized, Store, StoreWrapper

T = TypeVar("T")
EWMA_WEIGHT = 0.2       # weight of the newest latency sample
FETCH_SAMPLES = 256     # recent fetch latencies (get, get_range and their _with) kept for statistics()' p50/p99


@dataclass(frozen=True, kw_only=True)
class StoreStats:
    name: str
    requests: int           # calls made
    errors: int             # calls that failed with a StoreError other than NoSuchObject
    missing: int            # calls answered "no such object": a dedup probe or a replica not yet written,
                            # an answer rather than a failure, so a save's probes do not read as errors
    cancelled: int          # calls abandoned by their caller (timeouts, a reader gone)
    outstanding: int        # calls in flight now
    peak_outstanding: int
    bytes_read: int
    bytes_written: int
    latency_ewma: float     # seconds, moving average over calls that answered
    latency_p50: float = 0.0   # seconds, median of the recent fetches that answered
    latency_p99: float = 0.0   # seconds, their 99th percentile
    latency_max: float = 0.0   # seconds, the slowest fetch that answered since the start: one stall among
                               # hundreds of reads shows here, not in the quantiles


class _Request:
    """One call: in flight from `with` to its end; its outcome decides which counter moves."""

    def __init__(self, meter: MeteredStore, fetch: bool = False) -> None:
        self._m = meter
        self._fetch = fetch     # a get: its latency joins the p50/p99 samples

    def __enter__(self) -> _Request:
        m = self._m
        m.requests += 1
        m.outstanding += 1
        m.peak_outstanding = max(m.peak_outstanding, m.outstanding)
        self._t0 = trio.current_time()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        m = self._m
        m.outstanding -= 1
        if exc_type is None or issubclass(exc_type, StoreError):
            # An error is an answer too (a NoSuchObject is as fast as a hit): both time the store.
            m._answered(trio.current_time() - self._t0, fetch=self._fetch, error=exc_type)
        else:
            m.cancelled += 1


class MeteredStore(StoreWrapper):
    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.requests = self.errors = self.missing = self.cancelled = 0
        self.outstanding = self.peak_outstanding = 0
        self.bytes_read = self.bytes_written = 0
        self.latency_ewma = self.latency_max = 0.0
        self._fetches: deque[float] = deque(maxlen=FETCH_SAMPLES)

    def statistics(self) -> StoreStats:
        return StoreStats(name=self.name, requests=self.requests, errors=self.errors, missing=self.missing,
                          cancelled=self.cancelled, outstanding=self.outstanding,
                          peak_outstanding=self.peak_outstanding, bytes_read=self.bytes_read,
                          bytes_written=self.bytes_written,
                          latency_ewma=self.latency_ewma, latency_p50=self._quantile(0.5),
                          latency_p99=self._quantile(0.99), latency_max=self.latency_max)

    def _answered(self, took: float, *, fetch: bool, error: type[BaseException] | None) -> None:
        """A call answered after `took` seconds (a batch's keys each count, with the batch's time):
        the moving average; a fetch's time joins the quantiles' samples and the maximum; a StoreError
        counts as `missing` (no such object) or `errors`."""
        self.latency_ewma += EWMA_WEIGHT * (took - self.latency_ewma)
        if fetch:
            self._fetches.append(took)
            self.latency_max = max(self.latency_max, took)
        if error is not None:
            if issubclass(error, NoSuchObject):
                self.missing += 1
            else:
                self.errors += 1

    def _quantile(self, q: float) -> float:
        recent = sorted(self._fetches)
        return recent[min(len(recent) - 1, int(q * len(recent)))] if recent else 0.0

    async def get(self, key: str) -> bytes:
        with _Request(self, fetch=True):
            data = await self.inner.get(key)
        self.bytes_read += len(data)
        return data

    async def get_with(self, key: str, fn: Callable[[bytes | memoryview], T], limiter: trio.CapacityLimiter) -> T:
        sized = Sized(fn)
        with _Request(self, fetch=True):
            result = await self.inner.get_with(key, sized, limiter)
        self.bytes_read += sized.size
        return result

    async def get_many_with(self, reads: Sequence[tuple[str, Callable[[bytes | memoryview], T]]],
                            limiter: trio.CapacityLimiter) -> list[T | StoreError]:
        """One request per key, each in flight for the whole batch, its latency the batch's: the time
        its answer took (a folder store reads a batch one object after another, a remote one all at
        once; which, this wrapper does not know)."""
        n = len(reads)
        sized = [(key, Sized(fn)) for key, fn in reads]
        self.requests += n
        self.outstanding += n
        self.peak_outstanding = max(self.peak_outstanding, self.outstanding)
        t0 = trio.current_time()
        try:
            results = await self.inner.get_many_with(sized, limiter)
        except StoreError as e:                  # the whole batch failed: an answer for every key
            self._batch_answered([e] * n, t0)
            raise
        except BaseException:
            self.cancelled += n
            raise
        finally:
            self.outstanding -= n
        self._batch_answered(results, t0)
        self.bytes_read += sum(s.size for _, s in sized)
        return results

    def _batch_answered(self, results: Sequence[object], t0: float) -> None:
        """Each key of a batch started at `t0` answered now (`_answered` per key)."""
        took = trio.current_time() - t0
        for r in results:
            self._answered(took, fetch=True, error=type(r) if isinstance(r, StoreError) else None)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        with _Request(self, fetch=True):
            data = await self.inner.get_range(key, start, length)
        self.bytes_read += len(data)
        return data

    async def get_range_with(self, key: str, start: int, length: int, fn: Callable[[bytes | memoryview], T],
                             limiter: trio.CapacityLimiter) -> T:
        sized = Sized(fn)
        with _Request(self, fetch=True):
            result = await self.inner.get_range_with(key, start, length, sized, limiter)
        self.bytes_read += sized.size
        return result

    async def head(self, key: str) -> int:
        with _Request(self):
            return await self.inner.head(key)

    async def stat(self, key: str) -> ObjectInfo:
        with _Request(self):
            return await self.inner.stat(key)

    async def touch(self, key: str) -> None:
        with _Request(self):
            await self.inner.touch(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        with _Request(self):
            await self.inner.put(key, data)
        self.bytes_written += len(data)

    async def put_new(self, key: str, data: bytes | memoryview) -> bool:
        with _Request(self):
            wrote = await self.inner.put_new(key, data)
        self.bytes_written += len(data) if wrote else 0
        return wrote

    async def exists(self, key: str) -> bool:
        with _Request(self):
            return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        with _Request(self):
            await self.inner.delete(key)

    async def delete_if_older(self, key: str, before: float) -> bool:
        with _Request(self):
            return await self.inner.delete_if_older(key, before)

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        with _Request(self):
            return await self.inner.list(prefix, start_after, limit)

    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        with _Request(self):
            return await self.inner.list_info(prefix, start_after, limit)

    async def list_temporary(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        with _Request(self):
            return await self.inner.list_temporary(prefix, start_after, limit)

    async def check(self) -> None:
        with _Request(self):
            await self.inner.check()
