"""Spares: one store down does not stop saves under the default write_quorum (= replicas).

A write whose placement holds a store marked down (or one that just failed it transiently) goes to the
next store in rendezvous order; listings then must reach more stores to meet every version, so
numbering stays right. Stores are real folder stores; a store is taken down by a FaultyStore wrapper
injected into the pool (`down`), as the config drill `down = true` does in a mount."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from cpfs import roster
from cpfs.catalog import Catalog, Unreadable
from cpfs.config import ConfigError, parse_config
from cpfs.errors import StoreFull, StoreUnavailable
from cpfs.importer import Importer
from cpfs.manifest import path_hash
from cpfs.placement import Layout, place
from cpfs.pool import StorePool
from cpfs.scrub import Scrubber
from cpfs.store import DirectoryStore, FaultyStore

NAMES = ("s0", "s1", "s2")


def _config(tmp_path: Path, extra: str = "", stores: int = 3, replicas: int = 2):
    return parse_config(f'replicas = {replicas}\nchunk_size = "64KiB"\n' + extra
                        + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(stores)),
                        "test.toml", tmp_path)


def _pool(tmp_path: Path, down: str = "", extra: str = "") -> tuple[StorePool, dict[str, FaultyStore]]:
    config = _config(tmp_path, extra)
    wrapped = {s.name: FaultyStore(DirectoryStore(s.name, s.path), down=s.name == down) for s in config.stores}
    return StorePool(config, stores=list(wrapped.values())), wrapped


def _a_path_placed_on(store: str) -> str:
    """A path whose versions' placement holds `store` (2 in 3 do)."""
    return next(p for i in range(100) if store in place(path_hash(p := f"/ck{i}.pt"), NAMES, 2))


def test_a_layout_puts_a_spare_in_for_a_store_down_and_lists_more_stores() -> None:
    layout = Layout(NAMES, replicas=2, write_quorum=2, spares=1)
    h = path_hash("/ck.pt")
    first, second = place(h, NAMES, 2)
    spare, = set(NAMES) - {first, second}
    assert layout.targets(h, ()) == [first, second]                  # all up: the placement
    assert layout.targets(h, [second]) == [first, spare]
    assert layout.targets(h, [first, second, spare]) == [first, second]   # none up: the placement
    assert layout.needed(h) == 2 and layout.reached(h, [spare]) and not layout.reached(h, [first, spare])
    plain = Layout(NAMES, replicas=2, write_quorum=2)                  # no spare: 1 of the 2 placement stores
    assert plain.needed(h) == 1 and plain.reached(h, [first, spare])


def test_spares_default_to_one_where_every_copy_must_land(tmp_path: Path) -> None:
    assert _config(tmp_path).spares == 1
    assert _config(tmp_path, "write_quorum = 1\n").spares == 0        # the quorum already lets one store go
    assert _config(tmp_path, stores=2).spares == 0                    # no store to spare
    assert _config(tmp_path, "spares = 0\n").spares == 0
    with pytest.raises(ConfigError, match="spares: must be between 0 and the stores beyond replicas"):
        _config(tmp_path, "spares = 2\n")
    with pytest.raises(ConfigError, match="spares: must be 0 with write_quorum 1"):
        _config(tmp_path, "write_quorum = 1\nspares = 1\n")


async def test_a_save_placed_on_a_store_that_is_down_lands_on_the_spare(tmp_path: Path) -> None:
    """s1 down from the start (marked down by the pool's check): a put of a file placed on it stores
    its chunks and manifest on the spare; another mount with every store up reads it, scrub reports
    the copies off their placement and --repair puts them there."""
    pool, _ = _pool(tmp_path, down="s1")
    await pool.check()
    assert not pool.is_up("s1")
    path = _a_path_placed_on("s1")
    src = tmp_path / "src.bin"
    src.write_bytes(data := os.urandom(300_000))
    m, = await Importer(pool, Catalog(pool, writer="ab")).put(src, path)
    assert m.version == 1 and all("s1" not in c.stores and len(c.stores) == 2 for c in m.chunks)
    assert not list((tmp_path / "s1").glob("manifests/*/*"))
    up, _ = _pool(tmp_path)
    assert (await Catalog(up).get(path)).chunks == m.chunks
    assert b"".join([await up.fetch_chunk(c, path) for c in m.chunks]) == data
    report = await Scrubber(up, Catalog(up)).run()
    assert not report.ok and report.stats.manifests_under_replicated == 1
    assert (await Scrubber(up, Catalog(up)).run(repair=True)).stats.repaired > 0
    assert (await Scrubber(up, Catalog(up)).run()).ok
    assert list((tmp_path / "s1").glob("manifests/*/*"))


async def test_a_store_that_goes_down_during_a_save_is_stood_in_for(tmp_path: Path) -> None:
    """s1 fails every request from the middle of a mount's life, not yet marked down: the chunk puts
    and the manifest put that fail on it are tried once more with the spare in its place. The first
    manifest put's version is voided (its twin), the save commits the next number, and readers with
    every store back see the save, never the voided one."""
    pool, wrapped = _pool(tmp_path)
    await pool.check()
    cat = Catalog(pool, writer="ab")
    path = _a_path_placed_on("s1")
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    await Importer(pool, cat).put(src, path)
    wrapped["s1"].down = True
    src.write_bytes(data := os.urandom(300_000))
    m, = await Importer(pool, cat).put(src, path)
    assert all("s1" not in c.stores for c in m.chunks)
    up, _ = _pool(tmp_path)
    wrapped["s1"].down = False
    cur = await Catalog(up).get(path)
    assert cur.version == m.version and cur.chunks == m.chunks
    assert b"".join([await up.fetch_chunk(c, path) for c in cur.chunks]) == data


async def test_a_listing_that_misses_the_spare_and_a_placement_store_numbers_nothing(tmp_path: Path) -> None:
    """A version on the spare and one placement store (the other was down): a commit whose listing
    reached only that other store would number below it; it fails instead, naming the stores."""
    pool, _ = _pool(tmp_path, down="s1")
    await pool.check()
    path = _a_path_placed_on("s1")
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1000))
    m, = await Importer(pool, Catalog(pool, writer="ab")).put(src, path)
    holders = [n for n in NAMES if list((tmp_path / n).glob(f"manifests/{path_hash(path)}/*"))]
    assert "s1" not in holders and len(holders) == 2
    others, wrapped = _pool(tmp_path)
    for n in holders:
        wrapped[n].down = True
    with pytest.raises(StoreUnavailable, match="on enough stores to number a new one: 1 of its 3 answered"):
        await Catalog(others, writer="cd").commit(m)          # a chmod's commit: no chunk to write
    for n in holders:
        wrapped[n].down = False
    assert (await Catalog(others, writer="cd").commit(m)).version == m.version + 1


async def test_the_roster_tells_every_writer_of_a_spare(tmp_path: Path) -> None:
    """A writer whose own config has no spare lists as a spare's layout needs once the roster names
    it: else, with the spare and a placement store missed, it would number below a version there.
    An enrollment without a spare keeps the bytes (and key) it had before spares existed."""
    pool, _ = _pool(tmp_path)
    await roster.enroll(pool)
    plain, _ = _pool(tmp_path, extra="spares = 0\n")
    assert b"spares" not in roster.Enrollment.of(plain).to_bytes()
    listed, _ = await roster.read(plain)
    assert Layout(NAMES, 2, 2, 1) in listed.layouts(2, 2)
    cat = Catalog(plain)
    path = _a_path_placed_on("s1")
    first, spare = place(path_hash(path), NAMES, 2)[0], place(path_hash(path), NAMES, 3)[2]
    assert cat.listed_enough(path, [first, spare])                       # its own layout: 1 of 2
    roster.take(cat, listed)
    assert not cat.listed_enough(path, [first, spare])                   # the spare's: 2 of 3


async def test_a_store_that_refuses_writes_is_stood_in_for_a_while(tmp_path: Path) -> None:
    """s1 full (or denied: a disk remounted read-only): the first write it refuses marks it for
    REFUSED_FOR, the write is tried once more with the spare in its place, and later writes go to the
    spare at once. Reads of what s1 held go on."""
    pool, wrapped = _pool(tmp_path)
    await pool.check()
    cat = Catalog(pool, writer="ab")
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    before, = await Importer(pool, cat).put(src, "/before.pt")
    wrapped["s1"].refuse("put", "*", error=StoreFull)
    saved = {}
    for i in range(4):
        src.write_bytes(data := os.urandom(300_000))
        m, = await Importer(pool, cat).put(src, path := f"/ck{i}.pt")
        assert all("s1" not in c.stores for c in m.chunks)
        saved[path] = (m, data)
    assert pool.health()[1].refusals == wrapped["s1"].statistics().ruled >= 1
    assert pool.health()[1].up                                   # reads still use it
    up, _ = _pool(tmp_path)
    for path, (m, data) in saved.items():
        cur = await Catalog(up).get(path)
        assert cur.version == m.version and b"".join([await up.fetch_chunk(c, path) for c in cur.chunks]) == data
    assert (await Catalog(up).get("/before.pt")).chunks == before.chunks


async def test_replicas_1_gets_no_spare(tmp_path: Path) -> None:
    """With replicas 1 a spare makes a listing need both the placement store and the spare: one store
    down would stop commits it did not stop before (the review's find), so none by default."""
    config = _config(tmp_path, replicas=1)
    assert config.spares == 0 and StorePool(config).layout.needed(path_hash("/ck.pt")) == 1


async def test_a_reader_that_misses_the_stores_of_the_newest_version_does_not_serve_an_older(tmp_path: Path) -> None:
    """v2 saved while placement store b was down lands on a and the spare c. A reader that can list
    only b would find v1 alone and serve it as current (the review's find: a fresh mount or `cpfs cat`
    went back a checkpoint): it fails (EIO) instead, and a snapshot shows the path unreadable."""
    path = "/ck0.pt"
    a, b = place(path_hash(path), NAMES, 2)
    c, = set(NAMES) - {a, b}
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1000))
    pool, _ = _pool(tmp_path)
    await Importer(pool, Catalog(pool, writer="aa")).put(src, path)
    pool, _ = _pool(tmp_path, down=b)
    await pool.check()
    src.write_bytes(os.urandom(1000))
    v2, = await Importer(pool, Catalog(pool, writer="ab")).put(src, path)
    assert v2.version == 2
    reader, wrapped = _pool(tmp_path)
    wrapped[a].down = wrapped[c].down = True
    with pytest.raises(StoreUnavailable, match="to tell which version is current"):
        await Catalog(reader).get(path)
    shown = (await Catalog(reader).load_all())[path]        # shown (no put or create replaces it), EIO
    assert isinstance(shown, Unreadable) and shown.unlisted and "to tell which version is current" in shown.reason
    reader, _ = _pool(tmp_path)
    assert (await Catalog(reader).get(path)).version == 2


async def test_a_retried_commit_numbers_above_one_committed_meanwhile(tmp_path: Path) -> None:
    """Writer aa's manifest put on placement store b is held, then refused; meanwhile writer ff commits
    the path. aa's retry (on the spare) numbered from its listing before the put, took ff's number,
    and lost the tie to ff: the save done last was hidden (the review's find). It lists again."""
    path = "/ck0.pt"
    h = path_hash(path)
    a, b = place(h, NAMES, 2)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1000))
    pool, wrapped = _pool(tmp_path)
    m, = await Importer(pool, Catalog(pool, writer="e0")).put(src, path)
    go, reached = trio.Event(), trio.Event()
    wrapped[b].hold("put", lambda k: k.startswith(f"manifests/{h}/") and ".aa.ok" in k, until=go, refuse=True,
                    reached=reached)
    done: dict[str, int] = {}

    async def aa() -> None:
        done["aa"] = (await Catalog(pool, writer="aa").commit(m)).version

    async with trio.open_nursery() as n:
        n.start_soon(aa)
        await reached.wait()
        while not list((tmp_path / a).glob(f"manifests/{h}/*.aa.ok.json")):   # aa's put on a landed
            await trio.sleep(0.01)
        other, _ = _pool(tmp_path)
        done["ff"] = (await Catalog(other, writer="ff").commit(m)).version
        go.set()
    assert done["aa"] > done["ff"]
    reader, _ = _pool(tmp_path)
    cur = await Catalog(reader).current(path)
    assert (cur.version, cur.writer) == (done["aa"], "aa")

