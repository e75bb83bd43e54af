"""Transactions: several paths changed as one commit (a folder rename, a hard link).

Another catalog (another mount) sees every path of a transaction old or every path new, never a mix;
a transaction that fails, or whose writer dies before its record, changes nothing. Stores are real
folder stores; the record's put is held or refused by a wrapper injected into the pool.
"""
from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from cpfs.catalog import TXN_PREFIX, Catalog, VersionRef
from cpfs.errors import NotFound, StoreError
from cpfs.gc import GarbageCollector
from cpfs.manifest import path_hash
from cpfs.scrub import Scrubber, render
from cpfs.store.faulty import FaultyStore, Rule

from test_catalog import commit_bytes, faulty_catalog, make_pool
from test_scrub import repair_races


RECORDS, MARKERS = "txns/*", "txns/*.failed.json"      # transaction records, void markers (FaultyStore rules)


FILES = {"/run/step_1/model.pt": b"model bytes", "/run/step_1/optim.pt": b"optimizer bytes",
         "/run/step_1/sub/rng.pt": b"rng"}


async def moved(cat: Catalog, src: str, dst: str) -> list:
    old = [await cat.get(p) for p in sorted(FILES)]
    return await cat.transact([dataclasses.replace(m, path=dst + m.path[len(src):]) for m in old], old)


async def paths(tmp_path: Path, stores: int = 3) -> set[str]:
    """What another mount (a fresh catalog over the same store folders) lists."""
    return set(await Catalog(make_pool(tmp_path, stores=stores)).load_all())


def txn_version_keys(tmp_path: Path) -> list[str]:
    """The version keys (on any store) that name a transaction."""
    keys = {f"manifests/{p.parent.name}/{p.name}" for p in tmp_path.glob("s*/manifests/*/*")}
    return sorted(k for k in keys if (r := VersionRef.parse(k)) is not None and r.txn)


async def test_other_catalogs_see_the_old_tree_until_the_record_then_the_new_one(tmp_path: Path) -> None:
    cat, wrappers = faulty_catalog(tmp_path, stores=3)
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    release = trio.Event()
    for w in wrappers:
        w.hold("put", RECORDS, release)
    result: list = []
    async with trio.open_nursery() as n:
        async def run() -> None:
            result.extend(await moved(cat, "/run/step_1", "/run/final"))
        n.start_soon(run)
        while not any(w.statistics().held for w in wrappers):
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
    cat, wrappers = faulty_catalog(tmp_path, stores=3)
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    for w in wrappers:
        w.refuse("put", RECORDS)
    with pytest.raises(StoreError):
        await moved(cat, "/run/step_1", "/run/final")
    assert await paths(tmp_path) == set(FILES)
    assert txn_version_keys(tmp_path) == []           # taken back
    assert not list(tmp_path.glob("s*/txns/*"))
    for path, data in FILES.items():                  # and this catalog goes on as before
        assert (await cat.get(path)).size == len(data)
    assert cat.statistics().failed_commits == 1


async def record_on_s0_only(tmp_path: Path, voids: bool,
                            refuse_deletes: Callable[[str], bool]) -> tuple[Catalog, FaultyStore, Rule | None]:
    """FILES committed on 2 stores (each record goes to both), then a move of them whose record lands
    on s0 alone (s1 refuses it: below quorum) and which s0 refuses to take back, as it refuses every
    delete `refuse_deletes` picks; with `voids`, s0 takes the void marker, else its rule refusing the
    marker is returned with s0. The move must have failed."""
    cat, (s0, s1) = faulty_catalog(tmp_path, stores=2)
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    s1.refuse("put", RECORDS)
    s0.refuse("delete", refuse_deletes)
    markers = None if voids else s0.refuse("put", MARKERS)
    with pytest.raises(StoreError):
        await moved(cat, "/run/step_1", "/run/final")
    assert len([p for p in tmp_path.glob("s0/txns/*.json") if ".failed" not in p.name]) == 1   # the record stayed
    return cat, s0, markers


async def test_a_failed_transaction_whose_record_cannot_be_taken_back_is_voided(tmp_path: Path) -> None:
    """The record landed on one store, which then refuses to delete it: the void marker makes every
    mount see the old tree; gc deletes the versions left behind, then the record and its marker."""
    cat, _, _ = await record_on_s0_only(tmp_path, voids=True, refuse_deletes=lambda key: True)
    assert len(list(tmp_path.glob("s0/txns/*.failed.json"))) == 1
    assert cat.statistics().voided == 1
    assert await paths(tmp_path, stores=2) == set(FILES)
    other = Catalog(make_pool(tmp_path))
    with pytest.raises(NotFound):
        await other.current("/run/final/model.pt")
    assert [i.ref.version for i in await other.history("/run/step_1/model.pt")] == [1]
    # A mount that showed the move's versions before the marker goes back (CpfsOperations._apply).
    s = await other.current("/run/step_1/model.pt")
    assert not other.voids(s) and all(other.voids(dataclasses.replace(s, key=k)) for k in txn_version_keys(tmp_path))
    left = len(txn_version_keys(tmp_path))
    assert left == 2 * len(FILES)          # s0 refused their deletes as well
    report = await GarbageCollector(make_pool(tmp_path), grace=0, settle=0).run()
    assert report.abandoned == left and txn_version_keys(tmp_path) == []
    assert len(list(tmp_path.glob("s0/txns/*"))) == 2                  # named by versions in that run
    assert await paths(tmp_path, stores=2) == set(FILES)
    report = await GarbageCollector(make_pool(tmp_path), grace=0, settle=0).run()
    assert report.transactions == 2 and list(tmp_path.glob("s*/txns/*")) == []
    assert await paths(tmp_path, stores=2) == set(FILES)


async def test_a_failed_transaction_that_cannot_be_voided_counts_whole_or_not_at_all(tmp_path: Path) -> None:
    """If no store takes the void marker either, the record may count: the versions are kept, so a
    mount sees every path of the move new, never a mix (and the writer logged an error). Here s0 also
    refuses to delete the tombstones: taking back the rest would lose every file of the move. The
    writer's next commit tries the marker again: then every path is old again."""
    cat, s0, markers = await record_on_s0_only(
        tmp_path, voids=False, refuse_deletes=lambda key: key.startswith(TXN_PREFIX) or ".deleted." in key)
    assert list(tmp_path.glob("s*/txns/*.failed.json")) == []
    assert await paths(tmp_path, stores=2) == {p.replace("/run/step_1", "/run/final") for p in FILES}
    s0.allow(markers)
    await commit_bytes(cat, "/elsewhere.pt", b"another file")
    assert len(list(tmp_path.glob("s0/txns/*.failed.json"))) == 1
    assert await paths(tmp_path, stores=2) == set(FILES) | {"/elsewhere.pt"}


async def test_a_record_a_repair_puts_back_does_not_make_a_failed_transaction_count(tmp_path: Path) -> None:
    """A scrub lists the record of a failing move on s0 and puts it on s1 after the writer deleted it
    on both (s1 refused it: below quorum); s0 would not delete the move's versions, which count for
    nothing without a record. The take-back wrote no void marker where the record's deletes succeeded,
    so the record put back made the failed move count: the new tree, though the rename got EIO."""
    cat, (s0, s1) = faulty_catalog(tmp_path, stores=2)
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    s0.refuse("delete", lambda key: key.startswith("manifests/"))
    await repair_races(tmp_path, s1, RECORDS, lambda: moved(cat, "/run/step_1", "/run/final"),
                       lambda: bool(list(tmp_path.glob("s0/txns/*.json"))))
    assert [p.name for p in tmp_path.glob("s1/txns/*.json") if ".failed" not in p.name]    # the race was run
    assert len(txn_version_keys(tmp_path)) >= len(FILES)
    assert await paths(tmp_path, stores=2) == set(FILES)


async def crashed_before_the_record(tmp_path: Path) -> Path:
    """FILES, then the folder renamed to /run/final: the three stores as a kill -9 between the
    transaction's versions and its record leaves them (copied to the folder returned while the
    record's put is held)."""
    cat, wrappers = faulty_catalog(tmp_path, stores=3)
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    release = trio.Event()
    for w in wrappers:
        w.hold("put", RECORDS, release)
    crashed = tmp_path / "crashed"
    async with trio.open_nursery() as n:
        n.start_soon(moved, cat, "/run/step_1", "/run/final")
        while not any(w.statistics().held for w in wrappers):
            await trio.sleep(0.01)
        crashed.mkdir()
        for store in ("s0", "s1", "s2"):
            shutil.copytree(tmp_path / store, crashed / store)
        release.set()
    return crashed


async def test_a_writer_that_dies_before_the_record_leaves_the_old_tree(tmp_path: Path) -> None:
    """The stores as a kill -9 between the versions and the record leaves them (a copy taken while the
    record's put is held): the old tree, and commits to those paths go on; the dead transaction's
    versions are never current and never retired by others; gc deletes them once past its grace."""
    crashed = await crashed_before_the_record(tmp_path)
    assert await paths(crashed) == set(FILES)
    after = Catalog(make_pool(crashed, stores=3, keep=1))
    again = await commit_bytes(after, "/run/step_1/model.pt", b"model bytes, saved again")
    assert again.version == 3                 # above the dead transaction's version 2
    assert (await Catalog(make_pool(crashed, stores=3)).get("/run/step_1/model.pt")).size == 24
    assert len(txn_version_keys(crashed)) == 2 * len(FILES)   # keep=1 retired v1 only
    report = await GarbageCollector(make_pool(crashed, stores=3), grace=3600, settle=0).run()
    assert report.abandoned == 0 and len(txn_version_keys(crashed)) == 2 * len(FILES)   # perhaps committing
    report = await GarbageCollector(make_pool(crashed, stores=3), grace=0, settle=0).run()
    assert report.refused == "" and report.abandoned == 2 * len(FILES) and txn_version_keys(crashed) == []
    assert await paths(crashed) == set(FILES)
    assert (await Catalog(make_pool(crashed, stores=3)).get("/run/step_1/optim.pt")).size == 15


async def test_scrub_leaves_the_versions_of_a_transaction_that_never_committed_to_gc(tmp_path: Path) -> None:
    """A writer killed mid-rename leaves versions of a transaction with no record, which no reader
    counts: scrub reported their missing copies as NOT OK ("missing manifest" of a path no one could
    see) and --repair copied them (the frameworks audit). It counts them as uncommitted and leaves them
    to gc; the rest of the tree scrubs clean."""
    crashed = await crashed_before_the_record(tmp_path)
    dead = txn_version_keys(crashed)
    one = next(p for p in crashed.glob("s*/" + dead[0]))
    one.unlink()                                          # a copy the killed writer never wrote
    pool = make_pool(crashed, stores=3)
    assert (await Scrubber(pool, Catalog(pool)).run()).ok
    report = await Scrubber(pool, Catalog(pool)).run(repair=True)
    assert report.ok and report.stats.uncommitted == len(dead) == 2 * len(FILES), report.problems
    assert report.stats.repaired == 0 and not one.exists()
    assert report.stats.versions == len(FILES)            # the tree's own versions, checked
    assert "left alone" in render(report)


async def test_a_failed_transaction_s_numbers_are_never_used_again(tmp_path: Path) -> None:
    """A rename of /a over /b fails at its record and is taken back; the next commit of /b took the
    same number, so the same version and writer as the taken-back copy: if that copy and its record
    came back (a store restored from a snapshot taken mid-commit), two versions shared one order and
    which was current depended on the listing (the review of b3c70af). The next commit numbers above."""
    cat, wrappers = faulty_catalog(tmp_path, stores=2)
    await commit_bytes(cat, "/b", b"b v1")
    a = await commit_bytes(cat, "/a", b"a v1")
    wrappers[1].refuse("put", RECORDS)
    with pytest.raises(StoreError):
        await cat.transact([dataclasses.replace(a, path="/b")], [a])
    wrappers[1].allow()
    retry = await commit_bytes(cat, "/b", b"b v2, the retried save")
    assert retry.version == 3                    # 2 went to the failed rename
    assert (await Catalog(make_pool(tmp_path, stores=2)).get("/b")).chunks == retry.chunks


async def test_scrub_checks_every_version_when_a_store_cannot_list_the_records(tmp_path: Path) -> None:
    """A store that fails to list `txns/` at the scrub's start: a committed rename's versions were
    taken for uncommitted and left unchecked (a missing copy unrepaired), and the scrub said ok (the
    review of 4868400). Now none is taken for uncommitted then, the copy is repaired, and the scrub
    says it was incomplete."""
    cat, wrappers = faulty_catalog(tmp_path, stores=3)
    old = [await commit_bytes(cat, path, data) for path, data in FILES.items()]
    await cat.transact([dataclasses.replace(m, path=m.path.replace("/step_1/", "/final/")) for m in old], old)
    folder = next(p for p in tmp_path.glob("s*/manifests/" + path_hash("/run/final/model.pt")))
    lost = sorted(folder.iterdir())
    for p in lost:
        p.unlink()                                        # one copy of a committed rename's version
    for w in wrappers:
        w.refuse("list", TXN_PREFIX)
    report = await Scrubber(cat.pool, Catalog(cat.pool)).run(repair=True)
    assert not report.ok and report.stats.stores_unlisted >= 3 and report.stats.uncommitted == 0
    assert sorted(folder.iterdir()) == lost and report.stats.repaired >= 1


async def test_gc_removes_records_no_version_names(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path, stores=3, keep=1))
    for path, data in FILES.items():
        await commit_bytes(cat, path, data)
    await moved(cat, "/run/step_1", "/run/final")
    records = list(tmp_path.glob("s*/txns/*.json"))
    assert len(records) == 2
    await GarbageCollector(make_pool(tmp_path, stores=3), grace=0, settle=0).run()
    assert len(list(tmp_path.glob("s*/txns/*.json"))) == 2            # still named by current versions
    for path in FILES:       # newer versions of every path retire the transaction's (keep=1)
        await commit_bytes(cat, path.replace("/run/step_1", "/run/final"), b"new")
        await commit_bytes(cat, path, b"again")
    assert txn_version_keys(tmp_path) == []
    report = await GarbageCollector(make_pool(tmp_path, stores=3), grace=0, settle=0).run()
    assert list(tmp_path.glob("s*/txns/*.json")) == [] and report.transactions == 1
    assert await paths(tmp_path) == set(FILES) | {p.replace("/run/step_1", "/run/final") for p in FILES}


async def test_a_transaction_changes_each_path_once(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path, stores=3))
    m = await commit_bytes(cat, "/a", b"x")
    with pytest.raises(ValueError):
        await cat.transact([m], [m])


async def test_a_mount_forgets_transactions_no_version_names_any_more(tmp_path: Path) -> None:
    """A save by temporary name and rename is a transaction; a mount remembered every one it saw for
    good and copied them all at each listing (a mount watching a busy writer grew without bound). A
    complete listing forgets those whose versions are all retired, and the path stays listed."""
    writer, reader = Catalog(make_pool(tmp_path, keep=1), writer="aa"), Catalog(make_pool(tmp_path, keep=1), writer="bb")
    for i in range(12):
        tmp = await commit_bytes(writer, "/x.tmp", f"save {i}".encode())
        await writer.transact([dataclasses.replace(tmp, path="/x")], [tmp])
        listed = await reader.load_all()
        assert "/x.tmp" not in listed and listed["/x"].size == len(f"save {i}")
        assert (await reader.get("/x")).size == len(f"save {i}")
    assert writer.statistics().transactions == 12
    await writer.load_all()
    assert writer.statistics().remembered <= 3 and reader.statistics().remembered <= 3
