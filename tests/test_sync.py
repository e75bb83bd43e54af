"""cpfs.sync: fan_out, quorum and SingleFlight keep the invariants their docstrings state."""
from __future__ import annotations

import pytest
import trio
import trio.testing

from cpfs.sync import Budget, SingleFlight, fan_out, quorum


class Refused(Exception):
    pass


async def test_fan_out_runs_all_at_once_and_collects_outcomes(autojump_clock: trio.abc.Clock) -> None:
    async def call(i: int) -> int:
        await trio.sleep(1)
        if i % 2:
            raise Refused(i)
        return i * 10

    t0 = trio.current_time()
    out = await fan_out(call, [4, 3, 2, 1], catch=Refused)
    assert trio.current_time() - t0 == 1                      # concurrent, not 4 s
    assert out.results == {4: 40, 2: 20} and out.succeeded([4, 3, 2, 1]) == [4, 2]
    assert sorted(i for i, _ in out.errors) == [1, 3]


async def test_fan_out_propagates_what_it_does_not_catch() -> None:
    async def call(i: int) -> None:
        if i == 1:
            raise KeyError("a bug")
        await trio.sleep_forever()                         # cancelled by the bug

    with pytest.raises(BaseExceptionGroup) as e:
        await fan_out(call, [0, 1, 2], catch=Refused)
    assert e.group_contains(KeyError)


async def test_quorum_raises_the_first_failure_below_need(autojump_clock: trio.abc.Clock) -> None:
    async def call(i: int) -> int:
        await trio.sleep(i)
        if i > 0:
            raise Refused(i)
        return i

    assert (await quorum(call, [0, 1], 1, catch=Refused, short=lambda: Refused("short"))).succeeded([0, 1]) == [0]
    with pytest.raises(Refused) as e:
        await quorum(call, [0, 2, 1], 2, catch=Refused, short=lambda: Refused("short"))
    assert e.value.args == (1,)                            # the first to fail, not the first listed
    with pytest.raises(Refused, match="short"):
        await quorum(call, [0], 2, catch=Refused, short=lambda: Refused("short"))


async def test_single_flight_shares_one_call_per_key() -> None:
    flights: SingleFlight[str, int] = SingleFlight()
    release = trio.Event()
    calls: list[str] = []
    got: list[tuple[str, int]] = []

    async def slow(key: str, value: int) -> int:
        calls.append(key)
        await release.wait()
        return value

    async def caller(key: str, value: int) -> None:
        got.append((key, await flights.run(key, lambda: slow(key, value))))

    async with trio.open_nursery() as n:
        for i in range(5):
            n.start_soon(caller, "a", i)
        n.start_soon(caller, "b", 100)
        await trio.testing.wait_all_tasks_blocked()
        assert "a" in flights and flights.statistics().in_flight == 2
        release.set()
    assert sorted(calls) == ["a", "b"] and len(got) == 6
    assert len({v for k, v in got if k == "a"}) == 1 and ("b", 100) in got    # the leader's value, shared
    assert flights.statistics().calls == 2 and flights.statistics().joined == 4
    assert "a" not in flights                              # nothing is remembered after the call


async def test_single_flight_shares_failures_and_survives_a_cancelled_leader() -> None:
    flights: SingleFlight[str, int] = SingleFlight()
    started = trio.Event()

    async def failing() -> int:
        started.set()
        await trio.sleep(0.01)
        raise Refused("full")

    async def joiner(results: list) -> None:
        try:
            results.append(await flights.run("k", failing))
        except Refused as e:
            results.append(e)

    results: list = []
    async with trio.open_nursery() as n:
        n.start_soon(joiner, results)
        await started.wait()
        n.start_soon(joiner, results)
    assert [type(r) for r in results] == [Refused, Refused] and flights.statistics().calls == 1

    # A leader cancelled by its own caller: the waiter is not cancelled, it makes the call itself.
    async def ok() -> int:
        await trio.sleep(0.01)
        return 7

    got: list[int] = []
    leader_scope = trio.CancelScope()

    async def leader() -> None:
        with leader_scope:
            await flights.run("j", trio.sleep_forever)

    async def waiter() -> None:
        got.append(await flights.run("j", ok))

    async with trio.open_nursery() as n:
        n.start_soon(leader)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        leader_scope.cancel()
    assert got == [7] and flights.statistics().calls == 3    # the failing one, the cancelled one, the waiter's


def test_budget_bounds_what_does_not_pay_off_and_refunds_what_does() -> None:
    b = Budget(ratio=0.25, burst=2)
    assert b.spend() and b.spend() and not b.spend()           # full at the start: the burst
    for _ in range(3):
        b.earn()
    assert not b.spend()                                       # 0.75 of a token: not one yet
    b.earn()
    assert b.spend() and not b.spend()                         # four earns, one spend
    b.refund()                                                 # it paid off: the token back
    assert b.spend()
    for _ in range(100):
        b.earn()
    assert b.statistics().tokens == 2                          # never beyond the burst
    s = b.statistics()
    assert (s.spent, s.refunded, s.denied) == (4, 1, 3)
