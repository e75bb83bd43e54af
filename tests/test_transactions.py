"""Transactions: several paths changed as one commit (a folder rename, a hard link).

Another catalog (another mount) sees every path of a transaction old or every path new, never a mix;
a transaction that fails, or whose writer dies before its record, changes nothing. Stores are real
folder stores; the record's put is held or refused by a wrapper injected into the pool.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import trio

from cpfs.catalog import TXN_PREFIX, Catalog, VersionRef
from cpfs.errors import NotFound, StoreDenied, StoreError
from cpfs.gc import GarbageCollector
from cpfs.store.base import StoreWrapper

from test_catalog import commit_bytes, make_pool


class HoldRecords(StoreWrapper):
    """Holds (until `release` is set) or refuses the puts of transaction records."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.refuse = False
        self.release: trio.Event | None = None
        self.waiting = 0

    async def put(self, key: str, data) -> None:
        if key.startswith(TXN_PREFIX):
            if self.refuse:
                raise StoreDenied(self.name, f"refusing {key} (test)")
            if self.release is not None:
                self.waiting += 1
                await self.release.wait()
        await self.inner.put(key, data)


FILES = {"/run/step_1/model.pt": b"model bytes", "/run/step_1/optim.pt": b"optimizer bytes",
         "/run/step_1/sub/rng.pt": b"rng"}


async def moved(cat: Catalog, src: str, dst: str) -> list:
    old = [await cat.get(p) for p in sorted(FILES)]
    return await cat.transact([dataclasses.replace(m, path=dst + m.path[len(src):]) for m in old], old)


async def paths(tmp_path: Path) -> set[str]:
    """What another mount (a fresh catalog over the same store folders) lists."""
    return set(await Catalog(make_pool(tmp_path, stores=3)).load_all())


def txn_version_keys(tmp_path: Path) -> list[str]:
    """The version keys (on any store) that name a transaction."""
    keys = {f"manifests/{p.parent.name}/{p.name}" for p in tmp_path.glob("s*/manifests/*/*")}
    return sorted(k for k in keys if (r := VersionRef.parse(k)) is not None and r.txn)


async def test_other_catalogs_see_the_old_tree_until_the_record_then_the_new_one(tmp_path: Path) -> None:
    wrappers: list[HoldRecords] = []
    cat = Catalog(make_pool(tmp_path, stores=3, wrap=lambda s: wrappers.append(HoldRecords(s)) or wrappers[-1]))
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    release = trio.Event()
    for w in wrappers:
        w.release = release
    result: list = []
    async with trio.open_nursery() as n:
        async def run() -> None:
            result.extend(await moved(cat, "/run/step_1", "/run/final"))
        n.start_soon(run)
        while not any(w.waiting for w in wrappers):
            await trio.sleep(0.01)
        # Every new version and tombstone is on the stores; without the record they count for nothing.
        assert len(txn_version_keys(tmp_path)) >= 2 * len(FILES)
        assert await paths(tmp_path) == set(FILES)
        other = Catalog(make_pool(tmp_path, stores=3))
        with pytest.raises(NotFound):
            await other.current("/run/final/model.pt")
        assert [i.ref.version for i in await other.history("/run/step_1/model.pt")] == [1]
        release.set()
    assert await paths(tmp_path) == {p.replace("/run/step_1", "/run/final") for p in FILES}
    assert [m.path for m in result] == sorted(p.replace("/run/step_1", "/run/final") for p in FILES)
    assert (await Catalog(make_pool(tmp_path, stores=3)).current("/run/final/sub/rng.pt")).size == 3
    assert cat.statistics().transactions == 1


async def test_a_transaction_whose_record_fails_changes_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    wrappers: list[HoldRecords] = []
    cat = Catalog(make_pool(tmp_path, stores=3, wrap=lambda s: wrappers.append(HoldRecords(s)) or wrappers[-1]))
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    for w in wrappers:
        w.refuse = True
    with pytest.raises(StoreError):
        await moved(cat, "/run/step_1", "/run/final")
    assert await paths(tmp_path) == set(FILES)
    assert txn_version_keys(tmp_path) == []           # taken back
    assert not list(tmp_path.glob("s*/txns/*"))
    for path, data in FILES.items():                  # and this catalog goes on as before
        assert (await cat.get(path)).size == len(data)
    assert cat.statistics().failed_commits == 1


async def test_a_writer_that_dies_before_the_record_leaves_the_old_tree(tmp_path: Path) -> None:
    """The stores as a kill -9 between the versions and the record leaves them (a copy taken while the
    record's put is held): the old tree, and commits to those paths go on; the dead transaction's
    versions are never current and never retired by others; gc deletes them once past its grace."""
    wrappers: list[HoldRecords] = []
    cat = Catalog(make_pool(tmp_path, stores=3, wrap=lambda s: wrappers.append(HoldRecords(s)) or wrappers[-1]))
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    release = trio.Event()
    for w in wrappers:
        w.release = release
    crashed = tmp_path / "crashed"
    async with trio.open_nursery() as n:
        n.start_soon(moved, cat, "/run/step_1", "/run/final")
        while not any(w.waiting for w in wrappers):
            await trio.sleep(0.01)
        crashed.mkdir()
        for store in ("s0", "s1", "s2"):
            shutil.copytree(tmp_path / store, crashed / store)
        release.set()
    assert await paths(crashed) == set(FILES)
    after = Catalog(make_pool(crashed, stores=3, keep=1))
    again = await commit_bytes(after, "/run/step_1/model.pt", b"model bytes, saved again")
    assert again.version == 3                 # above the dead transaction's version 2
    assert (await Catalog(make_pool(crashed, stores=3)).get("/run/step_1/model.pt")).size == 24
    assert len(txn_version_keys(crashed)) == 2 * len(FILES)   # keep=1 retired v1 only
    report = await GarbageCollector(make_pool(crashed, stores=3), grace=3600).run()
    assert report.abandoned == 0 and len(txn_version_keys(crashed)) == 2 * len(FILES)   # perhaps committing
    report = await GarbageCollector(make_pool(crashed, stores=3), grace=0).run()
    assert report.refused == "" and report.abandoned == 2 * len(FILES) and txn_version_keys(crashed) == []
    assert await paths(crashed) == set(FILES)
    assert (await Catalog(make_pool(crashed, stores=3)).get("/run/step_1/optim.pt")).size == 15


async def test_gc_removes_records_no_version_names(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path, stores=3, keep=1))
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    await moved(cat, "/run/step_1", "/run/final")
    records = list(tmp_path.glob("s*/txns/*.json"))
    assert len(records) == 2
    await GarbageCollector(make_pool(tmp_path, stores=3), grace=0).run()
    assert len(list(tmp_path.glob("s*/txns/*.json"))) == 2            # still named by current versions
    for path in FILES:       # newer versions of every path retire the transaction's (keep=1)
        await commit_bytes(cat, path.replace("/run/step_1", "/run/final"), b"new")
        await commit_bytes(cat, path, b"again")
    assert txn_version_keys(tmp_path) == []
    report = await GarbageCollector(make_pool(tmp_path, stores=3), grace=0).run()
    assert list(tmp_path.glob("s*/txns/*.json")) == [] and report.transactions == 1
    assert await paths(tmp_path) == set(FILES) | {p.replace("/run/step_1", "/run/final") for p in FILES}


async def test_a_transaction_changes_each_path_once(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path, stores=3))
    m = await commit_bytes(cat, "/a", b"x")
    with pytest.raises(ValueError):
        await cat.transact([m], [m])
