"""The catalog: immutable versions, history, failed commits, tombstones, clocks, bad manifests.

Stores are real folder stores; faults come from a wrapper injected into the pool (never a patched store).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import trio

from cpfs import chunk as chunkfmt
from cpfs.catalog import Catalog, Unreadable, VersionRef
from cpfs.config import parse_config
from cpfs.errors import ManifestError, NotFound, StoreError, StoreUnavailable
from cpfs.manifest import ChunkEntry, Manifest, path_hash
from cpfs.placement import place
from cpfs.pool import StorePool
from cpfs.store.directory import DirectoryStore
from cpfs.store.faulty import FaultyStore
from cpfs.voidjournal import VoidJournal
from tests.conftest import stale_and_fresh_temporaries


MANIFESTS, TWINS = "manifests/*", "*.failed.json"    # the keys the tests' fault rules pick


def make_pool(tmp_path: Path, stores: int = 2, replicas: int = 2, keep: int = 3, quorum: int | None = None,
              wrap=None, spares: int | None = None) -> StorePool:
    text = (f"replicas = {replicas}\nkeep_versions = {keep}\n"
            + (f"write_quorum = {quorum}\n" if quorum else "") + (f"spares = {spares}\n" if spares is not None else "")
            + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(stores)))
    config = parse_config(text, "test.toml", tmp_path)
    built = [DirectoryStore(s.name, s.path) for s in config.stores]
    return StorePool(config, stores=[wrap(s) for s in built] if wrap else built)


async def commit_bytes(catalog: Catalog, path: str, data: bytes) -> Manifest:
    enc = chunkfmt.encode(data)
    held, *_ = await catalog.pool.store_chunk(enc, catalog.pool.names[:2], quorum=1)
    m = Manifest(path=path, size=len(data), mtime_ns=1, mode=0o644, chunk_size=1 << 20,
                 chunks=(ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held)),),
                 version=0)
    return await catalog.commit(m)


def version_files(tmp_path: Path, store: str, path: str) -> list[str]:
    folder = tmp_path / store / "manifests" / path_hash(path)
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


async def test_versions_count_up_and_history_keeps_the_newest(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path, keep=3))
    committed = [await commit_bytes(cat, "/run/a.pt", f"v{i}".encode()) for i in range(5)]
    assert [m.version for m in committed] == [1, 2, 3, 4, 5]
    assert (await cat.get("/run/a.pt")).version == 5
    hist = await cat.history("/run/a.pt")
    assert [i.ref.version for i in hist] == [5, 4, 3] and [i.current for i in hist] == [True, False, False]
    assert (await cat.get_version("/run/a.pt", 3)).chunks == committed[2].chunks
    with pytest.raises(NotFound):
        await cat.get_version("/run/a.pt", 1)     # retired
    assert len(version_files(tmp_path, "s0", "/run/a.pt")) == 3


def faulty_catalog(tmp_path: Path, stores: int = 2, kind=FaultyStore, keep: int = 3,
                   quorum: int | None = None, spares: int | None = None) -> tuple[Catalog, list]:
    """A catalog (writer "ab") whose folder stores are each in a `kind` of FaultyStore (the wrappers, in
    store order), whose rules the test sets: `refuse("put", MANIFESTS)` (a full or read-only store),
    `refuse("delete", MANIFESTS)`, `refuse("put", TWINS)`, `refuse("list", MANIFESTS)` (a store that
    is down); `allow()` ends them."""
    wrappers: list = []

    def wrap(store):
        wrappers.append(kind(store))
        return wrappers[-1]

    return Catalog(make_pool(tmp_path, stores=stores, keep=keep, quorum=quorum, wrap=wrap, spares=spares),
                   writer="ab"), wrappers


async def test_a_failed_manifest_commit_keeps_the_previous_version_on_every_store(tmp_path: Path) -> None:
    """Below write_quorum nothing of the new version stays, and nothing of the old one is lost: the
    old design overwrote one key per path, so the copies that landed had already replaced it."""
    cat, wrappers = faulty_catalog(tmp_path)
    v1 = await commit_bytes(cat, "/ckpt.pt", b"good checkpoint")
    before = {s: version_files(tmp_path, s, "/ckpt.pt") for s in ("s0", "s1")}
    wrappers[1].refuse("put", MANIFESTS)      # s0 takes the new manifest, s1 refuses: below quorum
    with pytest.raises(StoreError):
        await commit_bytes(cat, "/ckpt.pt", b"new bytes")
    with pytest.raises(StoreError):    # a chmod/touch-like rewrite takes the same path
        await cat.commit(dataclasses.replace(v1, mode=0o600))
    twins = ["00000000000000000002.ab.failed.json", "00000000000000000003.ab.failed.json"]
    assert {s: version_files(tmp_path, s, "/ckpt.pt") for s in ("s0", "s1")} \
        == {"s0": sorted(before["s0"] + twins), "s1": before["s1"]}    # each failed one voided (s1 refused)
    assert (await Catalog(make_pool(tmp_path)).get("/ckpt.pt")).chunks == v1.chunks
    wrappers[1].allow()
    assert (await commit_bytes(cat, "/ckpt.pt", b"new bytes")).version == 4     # 2 and 3 failed: never reused
    assert cat.statistics().voided == 2


async def test_a_copy_of_a_failed_commit_that_comes_back_never_shares_a_key_with_a_later_one(tmp_path: Path) -> None:
    """A failed commit's copy is taken back, then comes back (a put the store carried out late, a store
    restored from a snapshot). The next commit took the same version number, so the same key, for
    other bytes: readers got either checkpoint under one version, by replica (the rollback audit). The
    number is never used again: the newer commit stays current, its copies alike."""
    cat, wrappers = faulty_catalog(tmp_path)
    await commit_bytes(cat, "/ckpt.pt", b"good checkpoint")
    wrappers[1].refuse("put", MANIFESTS)                  # s0 takes the new manifest, s1 refuses
    release, reached = trio.Event(), trio.Event()
    wrappers[0].hold("delete", MANIFESTS, until=release, reached=reached)
    kept: dict[str, bytes] = {}

    async def failing() -> None:
        with pytest.raises(StoreError):
            await commit_bytes(cat, "/ckpt.pt", b"the failed save")
    async with trio.open_nursery() as n:
        n.start_soon(failing)
        await reached.wait()                              # the take-back is about to delete s0's copy
        folder = tmp_path / "s0" / "manifests" / path_hash("/ckpt.pt")
        kept = {p.name: p.read_bytes() for p in folder.iterdir()}
        release.set()
    wrappers[0].allow()
    wrappers[1].allow()
    retry = await commit_bytes(cat, "/ckpt.pt", b"the retried save")
    for name, data in kept.items():                       # the failed copy comes back
        (folder / name).write_bytes(data)
    cur = await Catalog(make_pool(tmp_path)).get("/ckpt.pt")
    assert cur.version == retry.version == 3 and cur.chunks == retry.chunks
    copies = {s: {p.name: p.read_bytes() for p in (tmp_path / s / "manifests" / path_hash("/ckpt.pt")).iterdir()}
              for s in ("s0", "s1")}
    for name in copies["s0"].keys() & copies["s1"].keys():
        assert copies["s0"][name] == copies["s1"][name], name


async def test_a_failed_commit_whose_copy_cannot_be_taken_back_is_voided_by_its_twin(tmp_path: Path) -> None:
    """As above, but the store that took the new manifest then refuses to delete it (a flaky store;
    the fault stress's injected errors found it). The writer was told the commit failed, so no reader
    may count that copy: a failed twin of the same version voids it, in a fresh catalog's current
    version, listing and history alike; the next commit deletes the copy, and only then its twin."""
    cat, wrappers = faulty_catalog(tmp_path, stores=3)
    v1 = await commit_bytes(cat, "/ckpt.pt", b"good checkpoint")
    for w in wrappers[1:]:
        w.refuse("put", MANIFESTS)     # s0 takes the new manifest, the others refuse: below quorum
    wrappers[0].refuse("delete", MANIFESTS)
    with pytest.raises(StoreError):
        await commit_bytes(cat, "/ckpt.pt", b"new bytes")
    assert "00000000000000000002.ab.ok.json" in version_files(tmp_path, "s0", "/ckpt.pt")
    fresh = Catalog(make_pool(tmp_path, stores=3))
    assert (await fresh.get("/ckpt.pt")).chunks == v1.chunks
    assert (await fresh.load_all())["/ckpt.pt"].version == 1
    hist = await fresh.history("/ckpt.pt")
    assert [(i.ref.version, i.ref.state, i.current) for i in hist] == [(2, "failed", False), (1, "ok", True)]
    assert hist[0].summary is not None and "commit failed" in hist[0].summary.reason
    assert cat.statistics().voided == 1
    for w in wrappers:
        w.allow()
    v3 = await commit_bytes(cat, "/ckpt.pt", b"new bytes")
    assert v3.version == 3             # a voided version is never used again
    assert [f.split(".")[0][-1] + "." + f.split(".")[2] for f in version_files(tmp_path, "s0", "/ckpt.pt")] \
        == ["1.ok", "2.failed", "3.ok"]                   # the copy is gone, its twin still there
    assert (await Catalog(make_pool(tmp_path, stores=3)).get("/ckpt.pt")).chunks == v3.chunks


async def test_a_failed_commit_that_no_store_lets_us_void_says_so_and_is_voided_by_the_next_commit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """If the twin cannot be written anywhere either, the copy counts for now: the writer logs an error
    naming the path, the version and the store, and its next commit (of any path) tries the twin again."""
    cat, wrappers = faulty_catalog(tmp_path)
    v1 = await commit_bytes(cat, "/ckpt.pt", b"good checkpoint")
    wrappers[1].refuse("put", MANIFESTS)
    wrappers[0].refuse("delete", MANIFESTS)
    twins = wrappers[0].refuse("put", TWINS)
    with pytest.raises(StoreError):
        await commit_bytes(cat, "/ckpt.pt", b"new bytes")
    assert any(r.levelname == "ERROR" and "/ckpt.pt: version 2 failed to commit" in r.getMessage()
               and "s0" in r.getMessage() for r in caplog.records)
    assert (await Catalog(make_pool(tmp_path)).get("/ckpt.pt")).version == 2        # the hole, for now
    assert cat.statistics().unvoided == 1
    wrappers[1].allow()
    wrappers[0].allow(twins)
    await commit_bytes(cat, "/other.pt", b"another file")
    assert cat.statistics().unvoided == 0 and cat.statistics().voided == 1
    assert (await Catalog(make_pool(tmp_path)).get("/ckpt.pt")).chunks == v1.chunks


async def test_a_twin_no_store_took_outlives_its_writer(tmp_path: Path) -> None:
    """The writer whose failed commit no store let it void is gone (a crash, an unmount) before any store
    takes the twin. Kept only in its memory, that duty died with it and the failed save stayed current
    for good; its journal on local disk hands it to the next catalog over the same stores."""
    journal = VoidJournal(tmp_path / "journal")
    cat, wrappers = faulty_catalog(tmp_path)
    cat = Catalog(cat.pool, writer="ab", journal=journal)
    v1 = await commit_bytes(cat, "/ckpt.pt", b"good checkpoint")
    wrappers[1].refuse("put", MANIFESTS)
    wrappers[0].refuse("delete", MANIFESTS)
    wrappers[0].refuse("put", TWINS)
    with pytest.raises(StoreError):
        await commit_bytes(cat, "/ckpt.pt", b"new bytes")
    assert list(journal.pending()) == [VersionRef.key_of(path_hash("/ckpt.pt"), 2, "ab", "failed")]
    del cat                                             # the writer is gone; the stores take puts again
    assert (await Catalog(make_pool(tmp_path)).get("/ckpt.pt")).version == 2        # the hole, for now
    again = Catalog(make_pool(tmp_path), journal=VoidJournal(tmp_path / "journal"))
    assert again.statistics().unvoided == 1
    await again.retry_voids()
    assert again.statistics().unvoided == 0 and again.statistics().voided == 1
    assert journal.pending() == {} and not list((tmp_path / "journal").iterdir())
    assert (await Catalog(make_pool(tmp_path)).get("/ckpt.pt")).chunks == v1.chunks


async def test_a_mount_voids_what_no_store_took_without_waiting_for_a_commit(tmp_path: Path) -> None:
    """A writer that commits nothing more (a mount only read from now on) used to leave the copy counting
    until its next commit. `keep_voiding` tries its pending twins every few seconds, and the ones other
    processes on the host left in the journal (a `cpfs put` that failed and exited)."""
    cat, wrappers = faulty_catalog(tmp_path)
    mount = Catalog(cat.pool, writer="ab", journal=VoidJournal(tmp_path / "journal"))
    v1 = await commit_bytes(mount, "/ckpt.pt", b"good checkpoint")
    await commit_bytes(mount, "/other.pt", b"good checkpoint")
    wrappers[1].refuse("put", MANIFESTS)
    wrappers[0].refuse("delete", MANIFESTS)
    wrappers[0].refuse("put", TWINS)
    with pytest.raises(StoreError):
        await commit_bytes(mount, "/ckpt.pt", b"new bytes")
    cli = Catalog(cat.pool, writer="cd", journal=VoidJournal(tmp_path / "journal"))   # another process
    with pytest.raises(StoreError):
        await commit_bytes(cli, "/other.pt", b"new bytes")
    del cli
    for w in wrappers:
        w.allow()
    async with trio.open_nursery() as n:
        await n.start(mount.keep_voiding, 0.05)
        with trio.fail_after(10):
            while mount.statistics().unvoided or VoidJournal(tmp_path / "journal").pending():
                await trio.sleep(0.05)
        n.cancel_scope.cancel()
    assert mount.statistics().voided == 2
    fresh = Catalog(make_pool(tmp_path))
    assert (await fresh.get("/ckpt.pt")).chunks == v1.chunks and (await fresh.get("/other.pt")).version == 1


async def test_a_journal_file_that_cannot_be_read_is_kept_and_said(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A damaged journal file is the only record of its duty: it is logged and left, never removed. An
    hour-old temporary file is a killed writer's and goes."""
    journal = VoidJournal(tmp_path / "journal")
    await journal.add("manifests/x", b"twin bytes")
    (tmp_path / "journal" / "0123.void").write_bytes(b"no key line")
    old, young = stale_and_fresh_temporaries(tmp_path / "journal")       # writers killed mid-write
    assert journal.pending() == {"manifests/x": b"twin bytes"}
    assert not old.exists() and young.exists()                           # another's write may be under way
    assert journal.pending() == {"manifests/x": b"twin bytes"}           # a mount reads it every 10 s
    assert [r.levelname for r in caplog.records if "0123.void" in r.getMessage()] == ["ERROR"]   # said once
    assert (tmp_path / "journal" / "0123.void").exists()
    await journal.remove("manifests/x")
    assert journal.pending() == {}


async def test_a_twin_is_not_retired_while_a_store_that_may_hold_its_copy_cannot_be_listed(tmp_path: Path) -> None:
    """The store that kept the copy refused the twin too, so the twin is on another store only. Then
    the copy's store is down while failed saves push the twin past keep_versions: retiring it then
    would let the copy count again once that store is back (a failed save, current). No spare: with
    one, the commit refused by `other` is made again on it."""
    cat, wrappers = faulty_catalog(tmp_path, stores=3, keep=1, spares=0)
    by_name = {w.name: w for w in wrappers}
    copy, other = (by_name[n] for n in place(path_hash("/ckpt.pt"), list(by_name), 2))
    v1 = await commit_bytes(cat, "/ckpt.pt", b"good checkpoint")
    other.refuse("put", MANIFESTS)             # below quorum; the copy stays on `copy`, the twin elsewhere
    copy.refuse("delete", MANIFESTS)
    twins = copy.refuse("put", TWINS)
    with pytest.raises(StoreError):
        await commit_bytes(cat, "/ckpt.pt", b"new bytes")
    other.allow()
    copy.allow(twins)
    down = copy.refuse("list", MANIFESTS)
    for _ in range(3):
        await cat.commit_failed(v1, "an incomplete save")
    copy.allow(down)                           # back
    assert (await Catalog(make_pool(tmp_path, stores=3)).get("/ckpt.pt")).chunks == v1.chunks


async def test_a_cancelled_commit_is_voided_in_case_its_put_still_lands(tmp_path: Path) -> None:
    """A commit cancelled while its put is in flight (an unmount, a timeout) cannot know whether the
    copy lands: it takes it back and voids it, so the previous version stays current everywhere."""
    class KeepsPuts(FaultyStore):
        """Keeps the bytes of every put, so the test can land a held one after all."""
        kept: dict[str, bytes] = {}

        async def put(self, key: str, data) -> None:
            self.kept[key] = bytes(data)
            await super().put(key, data)

    cat, wrappers = faulty_catalog(tmp_path, kind=KeepsPuts)
    v1 = await commit_bytes(cat, "/ckpt.pt", b"good checkpoint")
    wrappers[1].hold("put", "*.ok.json", until=trio.Event())          # forever
    with trio.move_on_after(0.5):
        await commit_bytes(cat, "/ckpt.pt", b"new bytes")
    key = VersionRef.key_of(path_hash("/ckpt.pt"), 2, "ab", "ok")
    data = KeepsPuts.kept[key]
    assert (await Catalog(make_pool(tmp_path)).get("/ckpt.pt")).chunks == v1.chunks
    (tmp_path / "s1" / key).write_bytes(data)         # the held put lands after all: its twin voids it
    assert "00000000000000000002.ab.failed.json" in version_files(tmp_path, "s1", "/ckpt.pt")
    assert (await Catalog(make_pool(tmp_path)).get("/ckpt.pt")).chunks == v1.chunks


@pytest.mark.parametrize("how", ["listing", "lookup", "history", "get", "get_version"])
async def test_a_version_retired_between_listing_and_read_is_looked_for_again(tmp_path: Path, how: str) -> None:
    """A path committed several times a second (a log, a `touch` loop): between another catalog's
    listing and its read of the current version, keep_versions deleted that version. The catalog lists
    the path again and shows the newest. A refresh left the file out (a mount took it for removed:
    `rsync --delete` from that mount deleted its copy) and a lookup failed (the tools audit's find)."""
    writer = Catalog(make_pool(tmp_path, keep=1), writer="aa")
    await commit_bytes(writer, "/hot.log", b"line 1")
    wrappers: list[FaultyStore] = []
    reader = Catalog(make_pool(tmp_path, keep=1, wrap=lambda s: wrappers.append(FaultyStore(s)) or wrappers[-1]),
                     writer="bb")
    release, reached = trio.Event(), trio.Event()
    for w in wrappers:       # get_range: a summary (listing, lookup, history); get: a whole manifest
        w.hold("get" if how.startswith("get") else "get_range", "manifests/*.ok.json", until=release,
               reached=reached)
    got: dict[str, object] = {}

    async def read() -> None:
        if how == "listing":
            got["summary"] = (await reader.load_all()).get("/hot.log")
        elif how == "lookup":
            got["summary"] = await reader.current("/hot.log")
        elif how == "get":
            got["summary"] = await reader.get("/hot.log")
        elif how == "get_version":
            with pytest.raises(NotFound, match="no version 1"):
                await reader.get_version("/hot.log", 1)
            got["summary"] = await reader.get_version("/hot.log", 4)
        else:
            got["versions"] = [i.ref.version for i in await reader.history("/hot.log")]

    async with trio.open_nursery() as n:
        n.start_soon(read)
        await reached.wait()                    # listed version 1, its read held
        for i in (2, 3, 4):
            await commit_bytes(writer, "/hot.log", f"line {i}".encode())   # keep 1: version 1 goes
        release.set()
    if how == "history":
        assert got["versions"] == []            # the one listed is gone; no error row for it
    else:
        assert got["summary"] is not None and got["summary"].version == 4


async def test_a_reader_keeps_no_summaries_of_versions_retired_since(tmp_path: Path) -> None:
    """A mount that only reads another's busy file cached the summary of every version it ever listed
    (the soak audit: 29,000 an hour); a full listing lets go of those no store lists any more."""
    writer = Catalog(make_pool(tmp_path, keep=1), writer="aa")
    reader = Catalog(make_pool(tmp_path, keep=1), writer="bb")
    for i in range(20):
        await commit_bytes(writer, "/hot.log", f"line {i}".encode())
        assert (await reader.load_all())["/hot.log"].version == i + 1
    assert reader.statistics().cached <= 2


async def test_versions_are_counters_not_clocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose clock is years behind still commits a newer version that everyone sees."""
    ahead, behind = Catalog(make_pool(tmp_path), writer="aa"), Catalog(make_pool(tmp_path), writer="bb")
    await commit_bytes(ahead, "/f", b"from the host with the right clock")
    monkeypatch.setattr(time, "time_ns", lambda: 1_000_000_000)      # 1970
    m = await commit_bytes(behind, "/f", b"from the host whose clock is behind")
    assert m.version == 2
    assert (await Catalog(make_pool(tmp_path)).get("/f")).writer == "bb"


async def test_two_commits_of_one_version_one_wins_whole(tmp_path: Path) -> None:
    a, b = Catalog(make_pool(tmp_path), writer="a1"), Catalog(make_pool(tmp_path), writer="b2")
    async with trio.open_nursery() as n:
        n.start_soon(commit_bytes, a, "/f", b"A" * 1000)
        n.start_soon(commit_bytes, b, "/f", b"B" * 1000)
    cur = await Catalog(make_pool(tmp_path)).get("/f")
    assert cur.writer in ("a1", "b2") and cur.size == 1000


async def test_remove_is_a_tombstone_and_restore_brings_a_version_back(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path))
    v1 = await commit_bytes(cat, "/x", b"one")
    await commit_bytes(cat, "/x", b"two")
    await cat.remove("/x")
    with pytest.raises(NotFound):
        await cat.get("/x")
    assert "/x" not in await cat.load_all()
    states = [i.ref.state for i in await cat.history("/x")]
    assert states == ["deleted", "ok", "ok"]
    restored = await cat.restore("/x", 1)
    assert restored.version == 4 and restored.chunks == v1.chunks
    assert (await cat.get("/x")).chunks == v1.chunks


async def test_a_failed_version_is_kept_but_never_current(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path))
    good = await commit_bytes(cat, "/m.pt", b"complete")
    partial = dataclasses.replace(good, size=0, chunks=())
    failed = await cat.commit_failed(partial, "torch zip without its central directory")
    assert failed.version == 2 and failed.state == "failed"
    assert (await cat.get("/m.pt")).version == 1
    assert (await cat.load_all())["/m.pt"].version == 1
    hist = await cat.history("/m.pt")
    assert [(i.ref.state, i.current) for i in hist] == [("failed", False), ("ok", True)]
    assert hist[0].summary.reason == "torch zip without its central directory"
    assert (await cat.get_version("/m.pt", 2)).state == "failed"


async def test_an_unreadable_manifest_hides_only_its_own_file(tmp_path: Path) -> None:
    """Corrupt or out-of-range manifests on every replica: that file is Unreadable (EIO when opened),
    its neighbours list and read as before."""
    cat = Catalog(make_pool(tmp_path))
    for name in ("a", "b", "c"):
        await commit_bytes(cat, f"/dir/{name}", name.encode())
    await commit_bytes(cat, "/dir/b", b"b2")
    for store in ("s0", "s1"):
        folder = tmp_path / store / "manifests" / path_hash("/dir/b")
        newest = sorted(folder.iterdir())[-1]
        head, body = newest.read_bytes().split(b"\n")
        doc = json.loads(head)
        del doc["check"], doc["body_check"]       # as written before checks: the size check is the test
        doc["size"] = 2**64                       # out of range: once made the whole folder unlistable
        newest.write_bytes(json.dumps(doc).encode() + b"\n" + body)
    fresh = Catalog(make_pool(tmp_path))
    listing = await fresh.load_all()
    assert isinstance(listing["/dir/b"], Unreadable) and "size" in listing["/dir/b"].reason
    assert listing["/dir/a"].size == 1 and listing["/dir/c"].size == 1
    with pytest.raises(ManifestError):
        await fresh.get("/dir/b")
    await fresh.remove("/dir/b")                  # and it can still be removed
    assert "/dir/b" not in await fresh.load_all()


async def test_one_corrupt_replica_of_a_manifest_is_read_from_the_other(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path))
    m = await commit_bytes(cat, "/f", b"data")
    (f,) = (tmp_path / "s0" / "manifests" / path_hash("/f")).iterdir()
    f.write_bytes(b"{not json")
    assert (await Catalog(make_pool(tmp_path)).get("/f")).chunks == m.chunks


async def test_format_1_manifests_are_migrated_to_version_keys(tmp_path: Path) -> None:
    cat = Catalog(make_pool(tmp_path))
    m = await commit_bytes(cat, "/old.pt", b"from an older cpfs")
    head, body = m.to_bytes().split(b"\n")
    doc = {**json.loads(body), **json.loads(head)}
    doc.update(format=1, version=1_700_000_000_000_000_000)
    for k in ("writer", "host", "committed_ns", "state", "reason", "check", "body_check"):
        doc.pop(k)
    for store in ("s0", "s1"):
        folder = tmp_path / store / "manifests"
        for p in (folder / path_hash("/old.pt")).iterdir():
            p.unlink()
        (folder / path_hash("/old.pt")).rmdir()
        (folder / f"{path_hash('/old.pt')}.json").write_text(json.dumps(doc))
    fresh = Catalog(make_pool(tmp_path))
    assert (await fresh.manifest((await fresh.load_all())["/old.pt"])).chunks == m.chunks
    for store in ("s0", "s1"):
        assert not (tmp_path / store / "manifests" / f"{path_hash('/old.pt')}.json").exists()
        assert version_files(tmp_path, store, "/old.pt") == ["01700000000000000000..ok.json"]
    assert (await commit_bytes(fresh, "/old.pt", b"newer")).version == 1_700_000_000_000_000_001


async def test_files_are_listed_without_refetching_known_versions(tmp_path: Path) -> None:
    """Keys are immutable: a second listing reads only the summaries it has not seen, and a listing
    never reads a whole manifest."""
    cat = Catalog(make_pool(tmp_path))
    for i in range(5):
        await commit_bytes(cat, f"/f{i}", os.urandom(10))
    reader = Catalog(make_pool(tmp_path))
    await reader.load_all()
    first = reader.statistics()
    assert first.summaries == 5 and first.fetched == 0
    await commit_bytes(cat, "/f0", b"new")
    assert (await reader.load_all())["/f0"].size == 3
    assert reader.statistics().summaries == 6 and reader.statistics().fetched == 0


async def test_a_file_removed_while_a_store_is_down_stays_removed_when_it_returns(tmp_path: Path) -> None:
    """write_quorum 1: rm while one store refuses writes; when that store is back (with the old version
    still on it), the file stays removed, because the removal is a newer version, not a deletion."""
    cat, wrappers = faulty_catalog(tmp_path, quorum=1)
    await commit_bytes(cat, "/ckpt.pt", b"soon removed")
    wrappers[1].refuse("put", MANIFESTS)
    await cat.remove("/ckpt.pt")
    wrappers[1].allow()
    fresh = Catalog(make_pool(tmp_path, quorum=1))
    assert "/ckpt.pt" not in await fresh.load_all()
    with pytest.raises(NotFound):
        await fresh.get("/ckpt.pt")
    assert any(f.endswith(".ok.json") for f in version_files(tmp_path, "s1", "/ckpt.pt"))   # the old one is there


async def test_a_commit_that_cannot_list_enough_stores_to_number_its_version_fails(tmp_path: Path) -> None:
    """write_quorum 1 of 2: A's versions 2 and 3 land on store X alone (Y refused them). With X down, B's
    save lists Y alone, which cannot tell the newest version: the commit fails (StoreUnavailable, EIO)
    instead of taking version 2 again, below A's 3. Once X is back, B's save takes version 4 and is
    current on every mount. Before, B's save succeeded as version 2, and once X was back A's older
    save was current again (an audit's find)."""
    faulty: list[FaultyStore] = []

    def wrap(store):
        faulty.append(FaultyStore(store))
        return faulty[-1]
    pool = make_pool(tmp_path, stores=2, replicas=2, quorum=1, wrap=wrap)
    x, y = faulty
    a = Catalog(pool, writer="aa")
    await commit_bytes(a, "/p", b"v1 by A")
    rule = y.refuse("put", "manifests/*")
    await commit_bytes(a, "/p", b"v2 by A")
    await commit_bytes(a, "/p", b"v3 by A")
    y.allow(rule)
    x.down = True
    b = Catalog(pool, writer="bb")
    with pytest.raises(StoreUnavailable, match="on enough stores"):
        await commit_bytes(b, "/p", b"B's save")
    x.down = False
    saved = await commit_bytes(b, "/p", b"B's save")
    assert saved.version == 4
    fresh = Catalog(make_pool(tmp_path, stores=2, replicas=2, quorum=1), writer="cc")
    assert (await fresh.current("/p")).writer == "bb"
