"""Holds (cpfs/holds.py): versions a mount has open keep their chunks through gc after retirement.

Folder stores, real gc runs. Each "mount" or "host" is a StorePool of its own over the same folders
(tests/test_gc.py's helpers); ages are set with os.utime; stores misbehave through wrappers
(FaultyStore and small wrappers of this file), never patches. The last three tests run real processes:
two real mounts, then `cpfs cat`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from cpfs.gc import GarbageCollector
from cpfs.holds import DEFER, DROP_DELAY, PREFIX, Holds
from cpfs.errors import StoreUnavailable
from cpfs.pool import TICKS_WATCH
from cpfs.store import FaultyStore, Store, StoreWrapper
from tests.conftest import ROOT, cpfs
from tests.test_gc import (GRACE, SIZE, Clock, Writer, _age_chunks, _chunk_files, _config, _digests, _gc,
                           _missing_copies, _pool, _stores_root)


def _hold_files(tmp_path: Path) -> list[Path]:
    return sorted(_stores_root(tmp_path).glob(f"s*/{PREFIX}*.json"))


def _held_versions(tmp_path: Path) -> list[str]:
    """The versions the stored holds name, a line per copy."""
    return sorted(json.loads(p.read_bytes())["version"] for p in _hold_files(tmp_path))


@asynccontextmanager
async def _running(holds: Holds) -> AsyncIterator[Holds]:
    """The mount's holds service (Holds.run) for the block, as the daemon's nursery runs it."""
    async with trio.open_nursery() as n:
        await n.start(holds.run)
        yield holds
        n.cancel_scope.cancel()


async def _until(cond, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.05)


async def _retired_version(tmp_path: Path, cfg: Path) -> tuple[Writer, bytes, object]:
    """/ckpt.pt's first version, then three more (keep_versions 2): the first is retired."""
    w = Writer(tmp_path, cfg, "a1")
    data = os.urandom(SIZE)
    first = await w.put("/ckpt.pt", data)
    for _ in range(3):
        await w.put("/ckpt.pt", os.urandom(SIZE))
    assert [v.ref.version for v in await w.catalog.history("/ckpt.pt")] == [4, 3]
    return w, data, first


async def test_a_retired_version_a_mount_holds_keeps_its_chunks_until_it_lets_go(tmp_path: Path) -> None:
    """A reader's mount holds version 1 (on the stores DEFER after the open) while three newer commits
    retire it: gc (every chunk aged past the grace) deletes nothing it names and the version still
    reads back whole. Once the mount lets go (its hold deleted DROP_DELAY later), the same gc deletes
    them: the hold is what kept them."""
    cfg = _config(tmp_path)
    w = Writer(tmp_path, cfg, "a1")
    data = os.urandom(SIZE)
    first = await w.put("/ckpt.pt", data)
    async with _running(Holds(_pool(cfg))) as reader:
        token = reader.take(first)
        assert _hold_files(tmp_path) == []              # an open that ends within DEFER writes nothing
        await _until(lambda: len(_hold_files(tmp_path)) == 3)
        for _ in range(3):
            await w.put("/ckpt.pt", os.urandom(SIZE))
        _age_chunks(tmp_path)
        report = await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
        assert not report.refused and report.holds == 3
        assert report.held == len(_digests([first])) and report.freed_objects == 8   # version 2's copies went
        assert _missing_copies(tmp_path, first) == []
        got = b"".join([await w.pool.fetch_chunk(c, f"chunk {i}") for i, c in enumerate(first.chunks)])
        assert got == data
        assert reader.statistics().versions == 1 and reader.statistics().chunks == len(_digests([first]))

        reader.drop(token)
        assert len(_hold_files(tmp_path)) == 3          # not at once: a reopen soon after writes nothing
        # The count follows each store's answer: a file may be gone before its delete returned.
        await _until(lambda: _hold_files(tmp_path) == [] and reader.statistics().deleted == 3)
        assert reader.statistics().deleted == 3 and reader.statistics().objects == 0
    report = await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
    assert report.holds == 0 and report.held == 0
    assert len(_missing_copies(tmp_path, first)) == sum(len(c.stores) for c in first.chunks)


async def test_opens_shorter_than_defer_cost_no_store_request(tmp_path: Path) -> None:
    """A loader that opens a file, reads it and closes it within DEFER writes no hold: gc's SETTLE
    covers it (see the invariant in cpfs/holds.py). Reopening a version still held costs nothing."""
    cfg = _config(tmp_path, keep=10)
    w = Writer(tmp_path, cfg, "a1")
    versions = [await w.put(f"/f{i}.bin", os.urandom(SIZE)) for i in range(20)]
    puts: list[str] = []
    async with _running(Holds(_pool(cfg, lambda s: CountingPuts(s, puts)))) as holds:
        for m in versions:
            holds.drop(holds.take(m))
            await trio.sleep(0.01)
        await trio.sleep(DEFER + 0.2)                   # open again after a break longer than DEFER, but
        again = holds.take(versions[1])                 # within DROP_DELAY (the same object): no write
        await trio.sleep(0.1)
        holds.drop(again)
        long = holds.take(versions[0])
        for _ in range(5):
            holds.drop(holds.take(versions[0]))
        await _until(lambda: len(puts) == 3)
        await _until(lambda: holds.statistics().skipped == 19)   # versions[0]: taken again
        await trio.sleep(DEFER + 0.5)
        assert len(puts) == 3 and holds.statistics().writes == 1 and holds.statistics().versions == 1
        holds.drop(long)


class Gate(StoreWrapper):
    """Puts of holds wait until the test opens the gate (a hold on its way to the stores)."""

    def __init__(self, inner: Store, gate: trio.Event) -> None:
        super().__init__(inner)
        self._gate = gate

    async def put(self, key: str, data) -> None:
        if key.startswith(PREFIX):
            await self._gate.wait()
        await self.inner.put(key, data)


async def test_gc_waits_settle_for_the_holds_of_opens_on_their_way(tmp_path: Path) -> None:
    """The invariant's case: a reader opens version 1 and its hold is not on any store yet; three
    commits retire version 1 and gc starts. gc reads the manifests, waits `settle`, and only then lists
    the holds: the hold that landed meanwhile keeps the chunks. The control, a gc that does not wait,
    deletes the chunks of the version the reader is reading."""
    cfg = _config(tmp_path)
    w = Writer(tmp_path, cfg, "a1")
    data = os.urandom(SIZE)
    first = await w.put("/ckpt.pt", data)
    gate = trio.Event()
    async with _running(Holds(_pool(cfg, lambda s: Gate(s, gate)))) as reader:
        reader.take(first)
        for _ in range(3):
            await w.put("/ckpt.pt", os.urandom(SIZE))
        _age_chunks(tmp_path)
        gc = GarbageCollector(_pool(cfg), grace=GRACE, settle=3.0)
        async with trio.open_nursery() as n:
            async def run() -> None:
                report = await gc.run()
                assert report.held == len(_digests([first])) and report.holds == 3
            n.start_soon(run)
            await trio.sleep(1.0)                       # gc has read the manifests: version 1 is not there
            assert _hold_files(tmp_path) == []
            gate.set()
        assert _missing_copies(tmp_path, first) == []
        got = b"".join([await w.pool.fetch_chunk(c, f"chunk {i}") for i, c in enumerate(first.chunks)])
        assert got == data

    control = tmp_path / "control"
    control.mkdir()
    cfg = _config(control)
    w = Writer(control, cfg, "a1")
    first = await w.put("/ckpt.pt", data)
    gate = trio.Event()
    async with _running(Holds(_pool(cfg, lambda s: Gate(s, gate)))) as reader:
        reader.take(first)
        for _ in range(3):
            await w.put("/ckpt.pt", os.urandom(SIZE))
        _age_chunks(control)
        await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
        gate.set()
    assert len(_missing_copies(control, first)) == sum(len(c.stores) for c in first.chunks)


async def test_a_hold_past_its_lease_no_longer_counts_and_gc_deletes_it(tmp_path: Path) -> None:
    """A mount that died keeps nothing forever: its hold's copies older than their lease count for
    nothing, and gc deletes them; a live mount's hold (renewed: young) still counts."""
    cfg = _config(tmp_path)
    w, data, first = await _retired_version(tmp_path, cfg)
    async with _running(Holds(_pool(cfg), lease=60.0, ident="dead")) as dead:
        dead.take(first, at_once=True)
        await _until(lambda: len(_hold_files(tmp_path)) == 3)
    _age_chunks(tmp_path)
    old = time.time() - 120
    for p in _hold_files(tmp_path):
        os.utime(p, (old, old))
    report = await GarbageCollector(_pool(cfg), grace=GRACE, dry_run=True, settle=0).run()
    assert report.holds == 0 and report.held == 0 and len(_hold_files(tmp_path)) == 3   # dry run: kept
    async with _running(Holds(_pool(cfg), lease=60.0, ident="live")) as live:
        live.take(first, at_once=True)
        await _until(lambda: len(_hold_files(tmp_path)) == 6)
        report = await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
        assert report.holds == 3 and report.held == len(_digests([first]))
        assert sorted({p.name.split(".")[0] for p in _hold_files(tmp_path)}) == ["live"]
        assert _missing_copies(tmp_path, first) == []


async def test_a_hold_is_renewed_while_open_and_written_again_where_a_store_lost_it(tmp_path: Path) -> None:
    """Every lease/RENEW_PARTS the mount touches its holds (their mtime is their lease), so a file open
    for longer than the lease stays held; a store that lost a hold (wiped) gets it again."""
    cfg = _config(tmp_path)
    w, data, first = await _retired_version(tmp_path, cfg)
    lease = 8.0 * 0.3                                   # renewed every 0.3 s
    async with _running(Holds(_pool(cfg), lease=lease)) as holds:
        holds.take(first, at_once=True)
        await _until(lambda: len(_hold_files(tmp_path)) == 3)
        old = time.time() - 3600
        for p in _hold_files(tmp_path):
            os.utime(p, (old, old))
        _hold_files(tmp_path)[0].unlink()
        await _until(lambda: len(_hold_files(tmp_path)) == 3
                     and all(p.stat().st_mtime > time.time() - 60 for p in _hold_files(tmp_path)))
        assert holds.statistics().renewed >= 2
        _age_chunks(tmp_path)
        report = await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
        assert report.held == len(_digests([first])) and _missing_copies(tmp_path, first) == []


class GatedTouch(StoreWrapper):
    """A store whose touches of holds wait while `gate` is closed (a renewal slow to answer)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gate: trio.Event | None = None
        self.waiting = 0

    async def touch(self, key: str) -> None:
        if key.startswith(PREFIX) and self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
        await self.inner.touch(key)


async def test_a_renewal_under_way_when_the_hold_is_let_go_of_does_not_write_it_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The soak audit: a renewal still touching a hold while it was let go of and deleted found no
    object, said the store "lost the hold" and wrote it again: an orphan hold, kept from gc's
    deletion until its lease ran out. Now the renewal leaves a hold let go of alone."""
    cfg = _config(tmp_path)
    w, data, first = await _retired_version(tmp_path, cfg)
    gated: list[GatedTouch] = []

    def gate(s: Store) -> Store:
        gated.append(GatedTouch(s))
        return gated[-1]
    pool = _pool(cfg, gate)
    async with _running(Holds(pool, lease=8.0 * 0.3)) as holds:
        token = holds.take(first, at_once=True)
        await _until(lambda: len(_hold_files(tmp_path)) == 3)
        for g in gated:
            g.gate = trio.Event()
        await _until(lambda: all(g.waiting for g in gated))      # a renewal waits on every store
        holds.drop(token)
        await _until(lambda: _hold_files(tmp_path) == [], timeout=DROP_DELAY + 5)
        for g in gated:
            g.gate.set()
            g.gate = None
        await trio.sleep(1.0)                                    # renewals come every 0.3 s
        assert _hold_files(tmp_path) == []
        assert holds.statistics().objects == 0
    assert "lost the hold" not in caplog.text


async def test_a_host_waking_from_a_suspend_renews_its_holds_at_once(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Renewals count on boot time. trio's clock (CLOCK_MONOTONIC) stops while the host is suspended (or
    its VM paused), so a host that slept for most of a lease renewed its holds an interval of trio's clock
    after waking: past their lease, when a gc may take a retired version open here. Now it renews within
    TICKS_WATCH of waking; a sleep past the lease is counted and logged, naming the version. The suspend: the
    pool's ticks and the stores' ages move on, trio's clock does not."""
    cfg = _config(tmp_path)
    w, data, first = await _retired_version(tmp_path, cfg)
    clock = Clock()
    lease = 80.0                                        # renewed every 10 s of boot time

    def suspend(seconds: float) -> None:
        clock.passed += seconds
        then = time.time() - seconds
        for p in _hold_files(tmp_path):
            os.utime(p, (then, then))

    def fresh() -> bool:
        return all(p.stat().st_mtime > time.time() - 5 for p in _hold_files(tmp_path))

    async with _running(Holds(_pool(cfg, clock=clock), lease=lease)) as holds:
        holds.take(first, at_once=True)
        await _until(lambda: len(_hold_files(tmp_path)) == 3)
        suspend(0.875 * lease)                          # within the lease
        await _until(fresh, timeout=3 * TICKS_WATCH)
        _age_chunks(tmp_path)
        report = await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
        assert report.holds == 3 and report.held == len(_digests([first]))
        assert _missing_copies(tmp_path, first) == [] and holds.statistics().lapsed == 0
        suspend(1.125 * lease)                          # past it: nothing could renew meanwhile
        await _until(fresh, timeout=3 * TICKS_WATCH)
        assert holds.statistics().lapsed == 1
        assert [r for r in caplog.records if r.levelname == "ERROR" and "suspended" in r.getMessage()
                and "/ckpt.pt@1" in r.getMessage()]


async def test_a_hold_written_after_the_host_slept_past_the_settle_counts_as_late(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A host suspended between an open and its hold's write (DEFER of trio's clock, which the suspend
    stopped) wrote the hold after gc's SETTLE may have passed: that is late, counted and logged as one a
    slow store took late is (before, it was measured on trio's clock and looked on time)."""
    cfg = _config(tmp_path)
    w, data, first = await _retired_version(tmp_path, cfg)
    clock = Clock()
    async with _running(Holds(_pool(cfg, clock=clock))) as holds:
        holds.take(first)
        clock.passed += 20.0                            # asleep right after the open
        await _until(lambda: holds.statistics().writes == 1)
        assert holds.statistics().late == 1
        assert [r for r in caplog.records if r.levelname == "ERROR" and "/ckpt.pt@1" in r.getMessage()
                and "after the open" in r.getMessage()]


async def test_a_hold_gc_cannot_read_makes_it_refuse_to_delete_anything(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    await _retired_version(tmp_path, cfg)
    _age_chunks(tmp_path)
    bad = _stores_root(tmp_path) / "s1" / PREFIX / "torn.json"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b'{"format": 1, "lease": 60, "version": "/x@1", "chun')
    chunks = _chunk_files(tmp_path)
    report = await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
    assert "torn.json" in report.refused and report.freed_objects == 0
    assert _chunk_files(tmp_path) == chunks


class CountingPuts(StoreWrapper):
    """Counts the puts of holds (shared list: one per store)."""

    def __init__(self, inner: Store, puts: list[str]) -> None:
        super().__init__(inner)
        self._puts = puts

    async def put(self, key: str, data) -> None:
        if key.startswith(PREFIX):
            self._puts.append(key)
        await self.inner.put(key, data)


async def test_a_hold_is_an_object_per_version_and_a_version_held_twice_costs_nothing(tmp_path: Path) -> None:
    """Five versions held at once: an object each (not one object rewritten with all of them), each
    naming only its own version's chunks; taking one again, even right after letting go of it, writes
    nothing; letting go of one deletes its object and leaves the others."""
    cfg = _config(tmp_path, keep=10)
    w = Writer(tmp_path, cfg, "a1")
    versions = [await w.put(f"/f{i}.bin", os.urandom(SIZE)) for i in range(5)]
    puts: list[str] = []
    async with _running(Holds(_pool(cfg, lambda s: CountingPuts(s, puts)))) as holds:
        tokens = {m.path: holds.take(m) for m in versions}
        await _until(lambda: len(_hold_files(tmp_path)) == 5 * 3 and holds.statistics().writes == 5)
        assert len(set(puts)) == 5
        for p in _hold_files(tmp_path):
            stored = json.loads(p.read_bytes())
            m = next(v for v in versions if f"{v.path}@{v.version}" == stored["version"])
            assert set(stored["chunks"]) == _digests([m])
        holds.drop(tokens["/f0.bin"])
        holds.drop(holds.take(versions[0]))           # within DROP_DELAY: the same object
        holds.drop(holds.take(versions[1]))
        await _until(lambda: "/f0.bin@1" not in _held_versions(tmp_path))
        assert len(_hold_files(tmp_path)) == 4 * 3 and holds.statistics().versions == 4
        assert len(puts) == 5 * 3 and holds.statistics().writes == 5
        await holds.aclose()
        assert _hold_files(tmp_path) == []


async def test_a_store_refusing_the_hold_does_not_fail_the_open(tmp_path: Path) -> None:
    """One store refuses: the hold is on the others, and gc (which reads every store) counts it. All
    refuse: counted and logged, and written again at the next renewal."""
    cfg = _config(tmp_path)
    w, data, first = await _retired_version(tmp_path, cfg)

    def refusing(names: set[str]):
        def wrap(store: Store) -> Store:
            faulty = FaultyStore(store)
            if store.name in names:
                faulty.refuse("put", f"{PREFIX}*")
            return faulty
        return wrap

    async with _running(Holds(_pool(cfg, refusing({"s0"})))) as some:
        some.take(first, at_once=True)
        await _until(lambda: len(_hold_files(tmp_path)) == 2)
        assert some.statistics().failed == 0
        assert sorted(p.parent.parent.name for p in _hold_files(tmp_path)) == ["s1", "s2"]
        _age_chunks(tmp_path)
        report = await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
        assert report.held == len(_digests([first])) and _missing_copies(tmp_path, first) == []
    async with _running(Holds(_pool(cfg, refusing({"s0", "s1", "s2"})), lease=8 * 0.2)) as none:
        none.take(first, at_once=True)
        await _until(lambda: none.statistics().failed >= 2)       # tried again at the renewal
        assert none.statistics().writes == 0


class Unreachable(StoreWrapper):
    """A store that cannot be reached: its check fails, so the pool marks it down."""

    async def check(self) -> None:
        raise StoreUnavailable(self.name, "unreachable")


async def test_a_store_marked_down_is_not_asked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Holds go to the stores that are up: a store the pool marked down (the pool logs that, and
    probes it) is not asked for each hold, so no warning per hold; gc counts the copies on the others."""
    cfg = _config(tmp_path)
    w, data, first = await _retired_version(tmp_path, cfg)
    pool = _pool(cfg, lambda s: Unreachable(s) if s.name == "s0" else s)
    await pool.check()
    assert not pool.is_up("s0")
    async with _running(Holds(pool)) as holds:
        holds.take(first, at_once=True)
        await _until(lambda: holds.statistics().writes == 1 and len(_hold_files(tmp_path)) == 2)
        assert holds.statistics().failed == 0
        assert not [r for r in caplog.records if "could not write the hold" in r.getMessage()]
        _age_chunks(tmp_path)
        report = await GarbageCollector(_pool(cfg), grace=GRACE, settle=0).run()
        assert report.held == len(_digests([first])) and _missing_copies(tmp_path, first) == []


class HangingHolds(StoreWrapper):
    """A store whose puts of holds never answer (until the pool's timeout)."""

    async def put(self, key: str, data) -> None:
        if key.startswith(PREFIX):
            await trio.sleep_forever()
        await self.inner.put(key, data)


async def test_a_hanging_store_delays_nothing(tmp_path: Path) -> None:
    """A store that hangs (30 s timeout) on a hold's put: the other stores hold it within ms, and the
    hold counts as written once the first one took it."""
    cfg = _config(tmp_path)
    w, data, first = await _retired_version(tmp_path, cfg)
    pool = _pool(cfg, lambda s: HangingHolds(s) if s.name == "s0" else s)
    async with _running(Holds(pool)) as holds:
        holds.take(first, at_once=True)
        await _until(lambda: len(_hold_files(tmp_path)) == 2, timeout=5)
        await _until(lambda: holds.statistics().writes == 1, timeout=5)
        assert holds.statistics().late == 0


@pytest.mark.long
def test_a_version_open_through_the_mount_survives_retirement_and_gc(tmp_path: Path, mount) -> None:
    """The evaluator's case, through a real mount: it opens /ckpt.bin; another host (`cpfs put`)
    commits three newer versions, which retire the open one; `cpfs gc` runs with every chunk aged past
    the grace. The open handle still reads the version it opened, byte for byte (none of it was read
    before the gc: every chunk comes from the stores; without the hold that read fails with EIO). Once
    it is closed the mount lets go, and the next gc frees the old version's chunks."""
    cfg = _config(tmp_path)
    with open(cfg, "a") as f:
        f.write(f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    old = os.urandom(2_000_000)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(old)
    cpfs("put", str(src), "/ckpt.bin", config=cfg)
    m = mount(cfg)
    with open(m.path / "ckpt.bin", "rb", buffering=0) as f:
        def holds() -> dict:
            return json.loads((m.path / ".cpfs-stats").read_bytes())["holds"]

        deadline = time.monotonic() + 10
        # DEFER after the open; the write is counted once a store took it, a moment after its file appears
        while (len(_hold_files(tmp_path)) < 3 or holds()["writes"] < 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_hold_files(tmp_path)) == 3
        doc = holds()
        assert doc["versions"] == 1 and doc["objects"] == 1 and doc["writes"] == 1
        assert b"holds (open versions kept from gc): 1 versions" in cpfs("stats", str(m.path)).stdout
        for _ in range(3):
            src.write_bytes(os.urandom(len(old)))
            cpfs("put", str(src), "/ckpt.bin", config=cfg)
        _age_chunks(tmp_path)
        report = json.loads(cpfs("gc", "--json", config=cfg).stdout)
        assert report["refused"] is None and report["held_chunks"] == -(-len(old) // 65536)
        got = b""
        while block := f.read(1 << 20):
            got += block
        assert got == old
    deadline = time.monotonic() + 15
    while _hold_files(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _hold_files(tmp_path) == []
    _age_chunks(tmp_path)
    report = json.loads(cpfs("gc", "--json", config=cfg).stdout)
    assert report["held_chunks"] == 0 and report["freed_bytes"] >= len(old)
    assert (m.path / "ckpt.bin").read_bytes() == src.read_bytes()


def test_a_write_session_keeps_its_base_through_retirement_and_gc(tmp_path: Path, mount) -> None:
    """A file opened for writing without O_TRUNC commits its unchanged chunks by reference: its base
    version is held while the session runs. Here the base is retired by three commits from another
    host and a gc runs (every chunk aged) before the close; the version the close commits reads back
    whole on a fresh mount (its unchanged chunks were not deleted). The other host and the gc run in
    this process."""
    cfg = _config(tmp_path)
    with open(cfg, "a") as f:
        f.write(f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    base = os.urandom(1_000_000)
    other = Writer(tmp_path, cfg, "b1")
    trio.run(other.put, "/log.bin", base)
    m = mount(cfg)
    with open(m.path / "log.bin", "r+b", buffering=0) as f:
        f.seek(0, os.SEEK_END)
        f.write(b"appended")
        for _ in range(3):
            trio.run(other.put, "/log.bin", os.urandom(len(base)))
        _age_chunks(tmp_path)
        report = trio.run(_gc, cfg)
        assert not report.refused and report.held >= len(base) // 65536
    m.stop()
    again = mount(cfg, "again")
    assert (again.path / "log.bin").read_bytes() == base + b"appended"


def test_a_version_cpfs_cat_reads_survives_retirement_and_gc(tmp_path: Path) -> None:
    """`cpfs cat --version` holds the version it reads, as a mount does: here the reader stalls (its
    stdout is a pipe nobody reads) a quarter MiB into an 8 MiB version, three newer commits retire that
    version, and `cpfs gc` runs with every chunk aged past the grace. The rest of the output still equals
    the version, byte for byte (without the hold, gc deleted the chunks the cat had not fetched yet and
    it failed), and the hold is gone once the cat ends."""
    cfg = _config(tmp_path)
    with open(cfg, "a") as f:
        f.write('[readahead]\nmax = "1MiB"\n')         # the cat fetches ~2 MiB ahead of its output, no more
    old = os.urandom(8 << 20)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(old)
    cpfs("put", str(src), "/ckpt.bin", config=cfg)
    proc = subprocess.Popen([sys.executable, "-m", "cpfs.cli", "--config", str(cfg), "cat", "/ckpt.bin",
                             "--version", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        got = proc.stdout.read(256 << 10)
        deadline = time.monotonic() + 10
        while len(_hold_files(tmp_path)) < 3 and time.monotonic() < deadline:   # DEFER after the read began
            time.sleep(0.05)
        assert _held_versions(tmp_path) == ["/ckpt.bin@1"] * 3
        for _ in range(3):
            src.write_bytes(os.urandom(len(old)))
            cpfs("put", str(src), "/ckpt.bin", config=cfg)
        _age_chunks(tmp_path)
        report = json.loads(cpfs("gc", "--json", config=cfg).stdout)
        assert report["refused"] is None and report["held_chunks"] == len(old) // 65536
        got += proc.stdout.read()
        assert proc.wait(30) == 0, proc.stderr.read().decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert got == old
    assert _hold_files(tmp_path) == []
