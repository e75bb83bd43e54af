"""Fault injection: a wrapper that makes a healthy store misbehave on purpose, for drills and tests.

Knobs (the [[store]] keys of the same names; all off by default):
- `error_rate`: that fraction of requests fails at once with a transient StoreError (as a throttled
  or flaky remote would), so the pool's retries and failover are exercised;
- `corrupt_rate`: that fraction of reads (get, get_range) returns its bytes with one byte altered, so
  checksums, failover and dedup verification are exercised;
- `down`: every request fails with StoreUnavailable (an unreachable endpoint, an unmounted export);
- `hang`: every request waits forever (a black-holed endpoint, a hung NFS server): only the pool's
  timeout gets the caller out.
`seed` makes the random choices repeatable. The knobs are plain attributes: tests may change them
while the store is in use (a store "going down" mid-write). `check()` obeys them too, so a store
that is down at startup is marked down, not refused, and is probed until it comes back.

Tests also pick requests by rule (as mountpoint-s3's failure_client does), to stage a sequence the
knobs cannot: a store that takes a put and then refuses to delete it, a put held until the test lets
it land. `refuse(op, keys)` fails the requests of `op` on matching keys (StoreDenied: a full,
read-only or refusing store; another StoreError class if given); `hold(op, keys, until)` makes them
wait until an event is set, then go through (or fail, with `refuse=True`); `allow(rule)` drops a rule
(`allow()` all). `keys` is a glob (`fnmatch`, `*` spans slashes) or a callable. The first rule that
matches decides; rules apply before the knobs.
"""
from __future__ import annotations

import fnmatch
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ..errors import StoreDenied, StoreError, StoreUnavailable
from .base import ObjectInfo, Store, StoreWrapper

OPS = frozenset({"get", "get_range", "head", "stat", "touch", "put", "exists", "delete", "delete_if_older",
                 "list", "check"})


@dataclass(eq=False)
class Rule:
    """Requests of `op` on the keys `match` picks: held until `until` is set (if given), then refused
    with `error` (if given), else let through. `reached` is set by the first one; `hits` counts them."""
    op: str
    match: Callable[[str], bool]
    error: type[StoreError] | None = StoreDenied
    until: trio.Event | None = None
    hits: int = 0
    held: int = 0                # requests waiting at this rule now
    reached: trio.Event = field(default_factory=trio.Event)


def _matcher(keys: str | Callable[[str], bool]) -> Callable[[str], bool]:
    return keys if callable(keys) else (lambda key: fnmatch.fnmatchcase(key, keys))


@dataclass(frozen=True, kw_only=True)
class FaultStats:
    requests: int        # requests that reached this wrapper
    errors: int          # transient errors injected (error_rate)
    refused: int         # requests refused because the store is down
    hung: int            # requests that hung (until cancelled)
    corrupted: int       # reads returned altered
    ruled: int = 0       # requests a rule refused
    held: int = 0        # requests a rule holds now


class FaultyStore(StoreWrapper):
    def __init__(self, inner: Store, *, error_rate: float = 0.0, corrupt_rate: float = 0.0,
                 down: bool = False, hang: bool = False, seed: int | None = None) -> None:
        super().__init__(inner)
        self.error_rate = error_rate
        self.corrupt_rate = corrupt_rate
        self.down = down
        self.hang = hang
        self._rng = random.Random(seed)
        self._requests = self._errors = self._refused = self._hung = self._corrupted = self._ruled = 0
        self.rules: list[Rule] = []

    def statistics(self) -> FaultStats:
        return FaultStats(requests=self._requests, errors=self._errors, refused=self._refused,
                          hung=self._hung, corrupted=self._corrupted, ruled=self._ruled,
                          held=sum(r.held for r in self.rules))

    def refuse(self, op: str, keys: str | Callable[[str], bool] = "*",
               error: type[StoreError] = StoreDenied) -> Rule:
        """Fail the requests of `op` on `keys` with `error`, until `allow`ed."""
        return self._add(Rule(op, _matcher(keys), error))

    def hold(self, op: str, keys: str | Callable[[str], bool], until: trio.Event, refuse: bool = False,
             reached: trio.Event | None = None) -> Rule:
        """Hold the requests of `op` on `keys` until `until` is set; then let them through, or refuse them.
        `reached`: an event the first of them sets (one the test shares between stores)."""
        return self._add(Rule(op, _matcher(keys), StoreDenied if refuse else None, until,
                              reached=trio.Event() if reached is None else reached))

    def allow(self, rule: Rule | None = None) -> None:
        """Drop `rule`, or every rule (requests held by it stay held until its event)."""
        self.rules = [r for r in self.rules if rule is not None and r is not rule]

    def _add(self, rule: Rule) -> Rule:
        if rule.op not in OPS:
            raise ValueError(f"no store operation {rule.op!r} (one of {', '.join(sorted(OPS))})")
        self.rules.append(rule)
        return rule

    async def _fault(self, op: str, key: str) -> None:
        """Raise or hang as the rules and knobs say; return to let the request through."""
        self._requests += 1
        for rule in self.rules:
            if rule.op == op and rule.match(key):
                rule.hits += 1
                rule.reached.set()
                if rule.until is not None:
                    rule.held += 1
                    try:
                        await rule.until.wait()
                    finally:
                        rule.held -= 1
                if rule.error is not None:
                    self._ruled += 1
                    raise rule.error(self.name, f"{op} {key!r}: refused (fault rule)")
                break
        if self.hang:
            self._hung += 1
            await trio.sleep_forever()
        if self.down:
            self._refused += 1
            raise StoreUnavailable(self.name, f"{op} {key!r}: store is down (fault drill: down = true)")
        if self.error_rate and self._rng.random() < self.error_rate:
            self._errors += 1
            raise StoreError(self.name, f"{op} {key!r}: injected failure (fault drill: error_rate)",
                             transient=True)

    def _alter(self, data: bytes) -> bytes:
        if not data or not self.corrupt_rate or self._rng.random() >= self.corrupt_rate:
            return data
        self._corrupted += 1
        out = bytearray(data)
        out[self._rng.randrange(len(out))] ^= 1 << self._rng.randrange(8)
        return bytes(out)

    async def get(self, key: str) -> bytes:
        await self._fault("get", key)
        return self._alter(await self.inner.get(key))

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        await self._fault("get_range", key)
        return self._alter(await self.inner.get_range(key, start, length))

    async def head(self, key: str) -> int:
        await self._fault("head", key)
        return await self.inner.head(key)

    async def stat(self, key: str) -> ObjectInfo:
        await self._fault("stat", key)
        return await self.inner.stat(key)

    async def touch(self, key: str) -> None:
        await self._fault("touch", key)
        await self.inner.touch(key)

    async def put(self, key: str, data: bytes | memoryview) -> None:
        await self._fault("put", key)
        await self.inner.put(key, data)

    async def put_new(self, key: str, data: bytes | memoryview) -> bool:
        await self._fault("put", key)         # a put's rules and knobs hold for it alike
        return await self.inner.put_new(key, data)

    async def exists(self, key: str) -> bool:
        await self._fault("exists", key)
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        await self._fault("delete", key)
        await self.inner.delete(key)

    async def delete_if_older(self, key: str, before: float) -> bool:
        await self._fault("delete_if_older", key)
        return await self.inner.delete_if_older(key, before)

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        await self._fault("list", prefix)
        return await self.inner.list(prefix, start_after, limit)

    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        await self._fault("list", prefix)
        return await self.inner.list_info(prefix, start_after, limit)

    async def list_temporary(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        await self._fault("list", prefix)
        return await self.inner.list_temporary(prefix, start_after, limit)

    async def check(self) -> None:
        await self._fault("check", "")
        await self.inner.check()
