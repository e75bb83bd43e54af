"""Garbage collection (cpfs/gc.py): what it frees, what it keeps, and commits of other mounts racing it.

Stores are real folder stores; each "mount" or "host" is a StorePool of its own over the same folders.
Ages are file mtimes set with os.utime (never sleeps); interleavings are driven by store wrappers that
pause a chosen request until the test releases it (never by patching). The S3 side of the age
primitives (stat, list_info, touch, delete_if_older) is in the store contract suite (test_store.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import posixpath
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch
import trio

from cpfs import chunk as chunkfmt
from cpfs import roster
from cpfs.catalog import Catalog
from cpfs.config import load_config, parse_config
from cpfs.errors import (ChunkUnavailable, ConfigError, CorruptChunk, CpfsError, NoSuchObject, NotFound,
                         StoreError)
from cpfs.gc import GarbageCollector, GcReport
from cpfs.holds import Hold
from cpfs.importer import Importer
from cpfs.manifest import Manifest, path_hash
from cpfs.placement import place
from cpfs.pool import TICKS_WATCH, StorePool, boottime
from cpfs.store import FaultyStore, Store, StoreWrapper, ThrottledStore, open_store
from cpfs.store.directory import TMP_SUFFIX
from cpfs.upload import RENEW_EVERY
from cpfs.writer import WriteSession
from tests.conftest import ROOT, cpfs

T = TypeVar("T")
AGE = 7200.0                    # seconds: "old" chunks are aged this much, far beyond any grace here
GRACE = 60.0                    # the gc's grace, as a real run would use (the floor)
SIZE = 200_000                  # 4 chunks of 64 KiB (the last one short)


def _config(tmp_path: Path, *, keep: int = 2, gc_grace: str = "60s", name: str = "cpfs.toml",
            stores: Iterable[int] = range(3)) -> Path:
    """A config over folder stores s0, s1, s2 (or `stores`) under tmp_path/cfg/stores (every config of
    a test shares them)."""
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f'replicas = 2\nchunk_size = "64KiB"\nkeep_versions = {keep}\ngc_grace = "{gc_grace}"\n'
                    '[cache]\nmemory = "64MiB"\n'
                    + "".join(f'[[store]]\nname = "s{i}"\nurl = "stores/s{i}"\n' for i in stores))
    return path


def _pool(cfg: Path, wrap: Callable[[Store], Store] | None = None, clock: Clock | None = None) -> StorePool:
    """A pool of its own over the config's folders: another mount, or the host that runs gc."""
    config = load_config(cfg)
    stores = [open_store(s) for s in config.stores]
    return StorePool(config, stores=[wrap(s) for s in stores] if wrap else stores,
                     **({"clock": clock, "ticks": clock.ticks} if clock else {}))


class Clock:
    """The clocks of a mount whose file stayed open while hours passed: its wall clock `ahead` of the
    real one, and its ticks (boot time: cpfs/pool.py) `passed` on. `hours_pass` moves both; the test
    ages the stores' copies by as much (os.utime), so all agree on what is old."""

    def __init__(self) -> None:
        self.ahead = 0.0
        self.passed = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead

    def ticks(self) -> float:
        return boottime() + self.passed

    def hours_pass(self, seconds: float = AGE) -> None:
        self.ahead += seconds
        self.passed += seconds


def _stores_root(tmp_path: Path) -> Path:
    return tmp_path / "cfg" / "stores"


def _chunk_files(tmp_path: Path) -> dict[Path, int]:
    """Every chunk copy on every store -> its size."""
    return {p: p.stat().st_size for p in _stores_root(tmp_path).glob("s*/chunks/*/*")
            if not p.name.endswith(TMP_SUFFIX)}


def _age_chunks(tmp_path: Path, age: float = AGE) -> None:
    old = time.time() - age
    for p in _chunk_files(tmp_path):
        os.utime(p, (old, old))


def _missing_copies(tmp_path: Path, m: Manifest) -> list[tuple[str, str]]:
    """(store, digest) of every copy the manifest names that is not intact on its store."""
    out = []
    for c in m.chunks:
        for name in c.stores:
            p = _stores_root(tmp_path) / name / chunkfmt.chunk_key(c.digest)
            try:
                chunkfmt.decode(p.read_bytes(), c.digest)
            except (OSError, CorruptChunk):
                out.append((name, c.digest))
    return out


def _digests(manifests: list[Manifest]) -> set[str]:
    return {c.digest for m in manifests for c in m.chunks}


class Writer:
    """A mount that commits files: its own pool, catalog (writer id) and importer."""

    def __init__(self, tmp_path: Path, cfg: Path, writer: str, wrap: Callable[[Store], Store] | None = None,
                 behind: float = 0.0):
        """`behind`: seconds its host's wall clock is behind (its pool's, and its commits' committed_ns)."""
        clock = Clock()
        clock.ahead = -behind
        self.pool = _pool(cfg, wrap, clock if behind else None)
        self.catalog = Catalog(self.pool, writer=writer, clock=lambda: time.time_ns() - int(behind * 1e9))
        self.importer = Importer(self.pool, self.catalog)      # a new one per put, as `cpfs put` has
        self._src = tmp_path / "src"
        self._src.mkdir(exist_ok=True)

    async def put(self, path: str, data: bytes) -> Manifest:
        src = self._src / uuid.uuid4().hex
        src.write_bytes(data)
        self.importer = Importer(self.pool, self.catalog)
        return await self.importer.put_file(src, path)

    async def read(self, path: str, version: int | None = None) -> bytes:
        m = await (self.catalog.get(path) if version is None else self.catalog.get_version(path, version))
        return b"".join([await self.pool.fetch_chunk(c, f"{path} chunk {i}") for i, c in enumerate(m.chunks)])


async def _gc(cfg: Path, grace: float = GRACE, dry_run: bool = False,
              wrap: Callable[[Store], Store] | None = None) -> GcReport:
    return await GarbageCollector(_pool(cfg, wrap), grace=grace, dry_run=dry_run, settle=0).run()


async def _run_cli(*args: str, config: Path):
    return await trio.to_thread.run_sync(lambda: cpfs(*args, config=config, check=False))


class Checked(StoreWrapper):
    """Sets `event[0]` once a stat of a chunk (dedup's first look at a copy) has answered."""

    def __init__(self, inner: Store, event: list[trio.Event]) -> None:
        super().__init__(inner)
        self._event = event

    async def stat(self, key: str):
        try:
            return await self.inner.stat(key)
        finally:
            if key.startswith("chunks/"):
                self._event[0].set()


def _pausing(method: str, prefix: str) -> tuple[Callable[[Store], Store], trio.Event, trio.Event]:
    """A wrap for each store that holds every call of `method` on keys starting with `prefix` until
    `release` is set; `reached` is set when the first one arrives."""
    reached, release = trio.Event(), trio.Event()

    def wrap(store: Store) -> Store:
        faulty = FaultyStore(store)
        faulty.hold(method, lambda key: key.startswith(prefix), release, reached=reached)
        return faulty
    return wrap, reached, release


async def _start_until_paused(nursery: trio.Nursery, fn: Callable[[], Awaitable[T]],
                              reached: trio.Event) -> list[T]:
    """Start fn() in `nursery` and return once it is held by a Pause; its result lands in the list
    returned. Fails (instead of waiting forever) if fn() ends without ever reaching the pause."""
    out: list[T] = []
    finished = trio.Event()

    async def run() -> None:
        try:
            out.append(await fn())
        finally:
            finished.set()

    nursery.start_soon(run)
    async with trio.open_nursery() as watch:
        async def first(event: trio.Event) -> None:
            await event.wait()
            watch.cancel_scope.cancel()
        watch.start_soon(first, reached)
        watch.start_soon(first, finished)
    assert reached.is_set(), "it ended without reaching the pause"
    return out


# ---- what gc frees and what it keeps -----------------------------------------------------------------

async def test_gc_frees_retired_versions_and_orphans_and_keeps_every_kept_version(tmp_path: Path) -> None:
    """Four versions of a file with keep_versions = 2, a removed file, an upload no commit names; all
    of it old. `cpfs gc --json` deletes exactly the copies of the chunks no kept version names (a chunk
    shared by every version stays), reports them per store, and every kept version, also of the
    removed file, still reads byte-exact with `cpfs cat --version`."""
    cfg = _config(tmp_path, keep=2)
    w = Writer(tmp_path, cfg, "a1")
    shared = os.urandom(65536)                               # one chunk every version has
    contents = [shared + os.urandom(SIZE - 65536) for _ in range(4)]
    versions = [await w.put("/run/a.bin", data) for data in contents]
    removed = os.urandom(SIZE)
    gone = await w.put("/run/b.bin", removed)
    await w.catalog.remove("/run/b.bin")
    orphan = chunkfmt.encode(os.urandom(50_000))             # uploaded, never committed
    await w.pool.store_chunk(orphan, w.pool.names[:2], 2)
    _age_chunks(tmp_path)

    kept = versions[2:] + [gone]                             # b.bin's history stays: `cpfs restore` may want it
    garbage = (_digests(versions[:2]) - _digests(kept)) | {orphan.digest}
    before = _chunk_files(tmp_path)
    doomed = {p: n for p, n in before.items() if p.name in garbage}
    assert len(doomed) == 2 * len(garbage) == 2 * 7         # 3 own chunks of each retired version, the orphan

    r = await _run_cli("gc", "--json", config=cfg)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["refused"], report["dry_run"], report["grace"]) == (None, False, 60.0)
    assert report["manifests"] == 2 + 2                      # a.bin's two kept, b.bin's version and tombstone
    assert report["referenced_chunks"] == len(_digests(kept))
    assert (report["freed_objects"], report["freed_bytes"]) == (len(doomed), sum(doomed.values()))
    per_store = {s["name"]: s for s in report["stores"]}
    for name in w.pool.names:
        mine = [n for p, n in doomed.items() if p.parts[-4] == name]
        assert (per_store[name]["deleted"], per_store[name]["deleted_bytes"]) == (len(mine), sum(mine))
        assert per_store[name]["young"] == per_store[name]["errors"] == 0
    assert _chunk_files(tmp_path) == {p: n for p, n in before.items() if p not in doomed}

    for m, data in [(versions[2], contents[2]), (versions[3], contents[3]), (gone, removed)]:
        out = await _run_cli("cat", m.path, "--version", str(m.version), config=cfg)
        assert out.returncode == 0, out.stderr
        assert out.stdout == data
    again = await _gc(cfg)
    assert again.freed_objects == 0 and sum(s.chunks for s in again.stores) == len(before) - len(doomed)


async def test_a_removed_file_is_freed_once_its_versions_are_retired(tmp_path: Path) -> None:
    """`cpfs rm` keeps the file's history (restore brings it back), so its chunks stay; once newer
    commits of the path retire those versions, gc frees them."""
    cfg = _config(tmp_path, keep=1)
    w = Writer(tmp_path, cfg, "a1")
    content = os.urandom(SIZE)
    old = await w.put("/b.bin", content)
    r = await _run_cli("rm", "/b.bin", config=cfg)
    assert r.returncode == 0, r.stderr
    _age_chunks(tmp_path)
    assert (await _gc(cfg)).freed_objects == 0
    assert await w.read("/b.bin", old.version) == content
    new = await w.put("/b.bin", b"small and new")            # retires the old version (keep_versions = 1)
    _age_chunks(tmp_path)
    report = await _gc(cfg)
    assert report.freed_objects == 2 * len(old.chunks)
    assert {p.name for p in _chunk_files(tmp_path)} == _digests([new])
    assert await w.read("/b.bin") == b"small and new"


async def test_dry_run_deletes_nothing_and_reports_what_it_would(tmp_path: Path) -> None:
    """--dry-run reports the same figures as the real run would, and no file changes."""
    cfg = _config(tmp_path, keep=1)
    w = Writer(tmp_path, cfg, "a1")
    await w.put("/a.bin", os.urandom(SIZE))
    await w.put("/a.bin", os.urandom(SIZE))
    _age_chunks(tmp_path)
    before = _chunk_files(tmp_path)
    r = await _run_cli("gc", "--dry-run", config=cfg)
    assert r.returncode == 0, r.stderr
    assert _chunk_files(tmp_path) == before
    text = r.stdout.decode()
    assert "dry run, nothing deleted" in text and "would free 8 objects" in text, text
    dry = await _gc(cfg, dry_run=True)
    assert _chunk_files(tmp_path) == before
    real = await _gc(cfg)
    assert (dry.freed_objects, dry.freed_bytes) == (real.freed_objects, real.freed_bytes)
    assert real.freed_objects == 8 and len(_chunk_files(tmp_path)) == len(before) - 8


async def test_young_unreferenced_chunks_survive_the_grace(tmp_path: Path) -> None:
    """Unreferenced chunks younger than the grace stay (reported as kept); once old enough they go."""
    cfg = _config(tmp_path, keep=1)
    w = Writer(tmp_path, cfg, "a1")
    first = await w.put("/a.bin", os.urandom(SIZE))
    await w.put("/a.bin", os.urandom(SIZE))                  # first's chunks: unreferenced, but new
    report = await _gc(cfg)
    assert report.freed_objects == 0
    assert sum(s.young for s in report.stores) == 2 * len(first.chunks)
    assert sum(s.young_bytes for s in report.stores) == 2 * first.stored_bytes
    _age_chunks(tmp_path, age=GRACE - 30)                    # still inside the grace
    assert (await _gc(cfg)).freed_objects == 0
    _age_chunks(tmp_path, age=GRACE + 30)
    assert (await _gc(cfg)).freed_objects == 2 * len(first.chunks)
    assert len(await w.read("/a.bin")) == SIZE


async def test_old_temporary_files_go_young_ones_stay(tmp_path: Path) -> None:
    """Temporary files of interrupted puts (chunks and manifests alike) older than the grace are
    deleted and counted; young ones (a put in progress, perhaps) stay; committed objects are untouched."""
    cfg = _config(tmp_path)
    w = Writer(tmp_path, cfg, "a1")
    content = os.urandom(SIZE)
    await w.put("/a.bin", content)
    s0 = _stores_root(tmp_path) / "s0"
    folders = [s0 / "chunks" / "ab", s0 / "manifests" / path_hash("/a.bin")]
    old = time.time() - AGE
    made = {}
    for i, folder in enumerate(folders):
        folder.mkdir(parents=True, exist_ok=True)
        for age in ("old", "young"):
            p = folder / f"{i:02x}{age}.{uuid.uuid4().hex}{TMP_SUFFIX}"
            p.write_bytes(b"x" * (100 + i))
            if age == "old":
                os.utime(p, (old, old))
            made[p] = age
    _age_chunks(tmp_path)                                    # old, but referenced: never touched
    chunks = _chunk_files(tmp_path)
    report = await _gc(cfg)
    s = {x.name: x for x in report.stores}
    assert (s["s0"].temporary, s["s0"].temporary_bytes) == (2, 100 + 101)
    assert s["s1"].temporary == s["s2"].temporary == 0
    assert {p for p in made if p.exists()} == {p for p, age in made.items() if age == "young"}
    assert _chunk_files(tmp_path) == chunks
    assert await w.read("/a.bin") == content


async def test_dedup_touches_an_old_copy_it_reuses_and_only_an_old_one(tmp_path: Path) -> None:
    """Storing a chunk whose copies are older than gc_grace/2 renews their mtime (without rewriting
    them); copies younger than that are left as they are."""
    cfg = _config(tmp_path, gc_grace="1h")
    pool = _pool(cfg)
    enc = chunkfmt.encode(os.urandom(100_000))
    await pool.store_chunk(enc, ["s0", "s1"], 2)
    copies = [p for p in _chunk_files(tmp_path) if p.name == enc.digest]
    _age_chunks(tmp_path, age=1000)                          # < 30 min: no touch
    assert (await pool.store_chunk(enc, ["s0", "s1"], 2))[:2] == (["s0", "s1"], False)
    assert pool.replica_statistics().touched == 0
    assert all(p.stat().st_mtime < time.time() - 900 for p in copies)
    _age_chunks(tmp_path, age=2000)                          # > 30 min: touched
    written = [s.bytes_written for s in pool.statistics()]
    t0 = time.time()
    assert (await pool.store_chunk(enc, ["s0", "s1"], 2))[:2] == (["s0", "s1"], False)
    assert pool.replica_statistics().touched == 2
    assert all(p.stat().st_mtime >= t0 - 1 for p in copies)
    assert [s.bytes_written for s in pool.statistics()] == written


# ---- commits racing gc -------------------------------------------------------------------------------

async def _retired(tmp_path: Path, cfg: Path) -> tuple[Writer, bytes, Manifest]:
    """A file whose first content was retired (keep_versions = 1) and whose chunks are all old:
    re-saving that content dedups against old, unreferenced copies."""
    w = Writer(tmp_path, cfg, "a1")
    content = os.urandom(SIZE)
    first = await w.put("/ckpt.bin", content)
    await w.put("/ckpt.bin", os.urandom(SIZE))
    _age_chunks(tmp_path)
    return w, content, first


@pytest.mark.parametrize("writer_gc_grace, survives", [("60s", True), ("10h", False)])
async def test_gc_between_a_commits_chunk_check_and_its_manifest(tmp_path: Path, writer_gc_grace: str,
                                                                  survives: bool) -> None:
    """A mount re-saves content identical to a retired version (its chunks old and unreferenced); a gc
    runs after the mount checked (and touched) the chunks and before its manifest is written. The
    committed file reads back byte-exact. Control: a mount whose gc_grace is far longer than the gc's
    grace does not touch 2-hour-old copies, and the same gc takes them: why `cpfs gc` refuses a
    --grace below gc_grace."""
    cfg = _config(tmp_path, keep=1)
    _, content, first = await _retired(tmp_path, cfg)
    writer_cfg = _config(tmp_path, keep=1, gc_grace=writer_gc_grace, name="writer.toml")
    wrap, reached, release = _pausing("put", "manifests/")
    w = Writer(tmp_path, writer_cfg, "b2", wrap)
    async with trio.open_nursery() as n:
        done = await _start_until_paused(n, lambda: w.put("/ckpt.bin", content), reached)
        report = await _gc(cfg)                              # every chunk checked, the manifest not written
        release.set()
    assert report.refused == ""
    taken = sum(s.deleted for s in report.stores)
    if survives:
        assert w.pool.replica_statistics().touched == 2 * len(first.chunks)
        assert taken == 0 and sum(s.young for s in report.stores) == 2 * len(first.chunks)
        assert await w.read("/ckpt.bin") == content
        assert await Writer(tmp_path, cfg, "c3").read("/ckpt.bin", done[0].version) == content
    else:
        assert w.pool.replica_statistics().touched == 0 and taken == 2 * len(first.chunks)
        with pytest.raises(ChunkUnavailable):
            await w.read("/ckpt.bin")


async def test_gc_paused_between_its_age_check_and_the_deletion(tmp_path: Path) -> None:
    """gc has listed a chunk as old and unreferenced and is about to delete it; meanwhile a mount
    reuses it (touch) and commits. The deletion judges the age again at the moment of deleting (the
    folder store claims the file first): the chunk stays and the file reads back byte-exact."""
    cfg = _config(tmp_path, keep=1)
    _, content, first = await _retired(tmp_path, cfg)
    wrap, reached, release = _pausing("delete_if_older", "chunks/")
    async with trio.open_nursery() as n:
        reports = await _start_until_paused(n, lambda: _gc(cfg, wrap=wrap), reached)
        w = Writer(tmp_path, cfg, "b2")
        m = await w.put("/ckpt.bin", content)                # checks, touches, commits: all while gc waits
        release.set()
    assert {c.digest for c in m.chunks} == _digests([first])
    assert sum(s.deleted for s in reports[0].stores) == 0
    assert sum(s.young for s in reports[0].stores) == 2 * len(first.chunks)
    assert await w.read("/ckpt.bin") == content
    assert await Writer(tmp_path, cfg, "c3").read("/ckpt.bin") == content


async def test_a_commit_paused_between_its_check_and_its_touch_writes_the_chunk_again(tmp_path: Path) -> None:
    """A mount found an old copy good, and before it touches it a whole gc runs and deletes it. The
    touch finds the copy gone, so the mount writes it again: the commit reads back byte-exact."""
    cfg = _config(tmp_path, keep=1)
    _, content, first = await _retired(tmp_path, cfg)
    wrap, reached, release = _pausing("touch", "chunks/")
    w = Writer(tmp_path, cfg, "b2", wrap)
    async with trio.open_nursery() as n:
        done = await _start_until_paused(n, lambda: w.put("/ckpt.bin", content), reached)
        report = await _gc(cfg)
        release.set()
    assert sum(s.deleted for s in report.stores) == 2 * len(first.chunks)
    assert w.importer.stats.new_raw_bytes == SIZE            # every chunk written again
    assert await Writer(tmp_path, cfg, "c3").read("/ckpt.bin", done[0].version) == content


async def test_a_version_retired_while_gc_reads_it_is_followed_to_its_successor(tmp_path: Path) -> None:
    """`cpfs restore` commits an old version's chunks as they are (no check, no touch), and retires that
    version. gc listed it and reads it only after it is gone: gc lists the path's folder again, finds
    the restored version and keeps its chunks."""
    cfg = _config(tmp_path, keep=2)
    w = Writer(tmp_path, cfg, "a1")
    content = os.urandom(SIZE)
    v1 = await w.put("/ckpt.bin", content)
    v2 = await w.put("/ckpt.bin", os.urandom(SIZE))
    _age_chunks(tmp_path)
    h = path_hash("/ckpt.bin")
    wrap, reached, release = _pausing("get", f"manifests/{h}/{v1.version:020d}.")
    async with trio.open_nursery() as n:
        reports = await _start_until_paused(n, lambda: _gc(cfg, wrap=wrap), reached)   # gc listed v1, reads it
        restored = await w.catalog.restore("/ckpt.bin", v1.version)   # v3: v1's chunks; v1 retired
        release.set()
    left = [p.name for p in _stores_root(tmp_path).glob(f"s*/manifests/{h}/*")]
    assert not any(name.startswith(f"{v1.version:020d}.") for name in left)     # v1 was retired
    assert reports[0].refused == "" and sum(s.deleted for s in reports[0].stores) == 0
    assert reports[0].referenced == len(_digests([v1, v2]))  # v2, and v3 (v1's chunks) found on the second look
    assert await w.read("/ckpt.bin", restored.version) == content


async def test_gc_next_to_concurrent_writers_loses_nothing(tmp_path: Path) -> None:
    """Rounds of: fresh contents committed and retired (their chunks then made old: unreferenced garbage
    as far as gc can tell), then two mounts re-save them to two paths while gc runs again and again.
    Every commit finds each copy it names intact; after every round each path's current version reads
    back byte-exact, and after a last gc too."""
    cfg = _config(tmp_path, keep=1)
    seed = Writer(tmp_path, cfg, "a1")
    paths = ["/p0.bin", "/p1.bin"]
    commits: dict[str, list[tuple[int, str, bytes]]] = {p: [] for p in paths}
    # Slow links for the writers, and gc starts once a writer has checked a chunk: gc's deletions land
    # between commits' chunk checks and their manifests.
    checked = [trio.Event()]
    writers = [Writer(tmp_path, cfg, w, lambda s: Checked(ThrottledStore(s, latency=0.02), checked))
               for w in ("b2", "c3")]
    reports: list[GcReport] = []
    reader = Writer(tmp_path, cfg, "d4")

    async def check() -> None:
        for path in paths:
            version, writer, data = max(commits[path], key=lambda c: c[:2])   # the highest (version, writer)
            m = await reader.catalog.get(path)
            assert (m.version, m.writer) == (version, writer)
            assert await reader.read(path) == data
            assert _missing_copies(tmp_path, m) == []         # not one copy the commit counted on is gone

    for gc_latency in (0.0, 0.005, 0.01, 0.02):             # gc's deletions land at various points
        contents = [os.urandom(SIZE) for _ in range(4)]
        garbage = [await seed.put("/seed.bin", data) for data in contents]
        await seed.put("/seed.bin", b"seed")                 # every content above retired
        old = time.time() - AGE
        for p in _chunk_files(tmp_path):
            if p.name in _digests(garbage):
                os.utime(p, (old, old))

        async def writer(i: int, w: Writer) -> None:
            for step in range(2):
                path, data = paths[(i + step) % 2], contents[i * 2 + step]
                m = await w.put(path, data)
                commits[path].append((m.version, m.writer, data))
                assert _missing_copies(tmp_path, m) == []     # every copy it counted on is there

        async def collector(done: trio.Event) -> None:
            await checked[0].wait()
            while not done.is_set():
                reports.append(await _gc(cfg, wrap=lambda s: ThrottledStore(s, latency=gc_latency)))

        done, checked[0] = trio.Event(), trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(collector, done)
            async with trio.open_nursery() as wn:
                for i, w in enumerate(writers):
                    wn.start_soon(writer, i, w)
            done.set()
        await check()
    assert all(r.refused == "" for r in reports) and sum(r.freed_objects for r in reports) > 0
    _age_chunks(tmp_path)
    assert (await _gc(cfg)).refused == ""
    await check()


# ---- refusals, configuration and the command ---------------------------------------------------------

async def test_an_unreadable_version_makes_gc_refuse_to_delete_anything(tmp_path: Path) -> None:
    """A version whose every copy is corrupt could name any chunk: gc deletes nothing, says which key,
    and `cpfs gc` exits 1. A store whose manifests cannot be listed (down) refuses it the same way."""
    cfg = _config(tmp_path, keep=1)
    w = Writer(tmp_path, cfg, "a1")
    m = await w.put("/a.bin", os.urandom(SIZE))
    await w.put("/a.bin", os.urandom(SIZE))
    await w.put("/b.bin", os.urandom(SIZE))
    _age_chunks(tmp_path)
    before = _chunk_files(tmp_path)
    h = path_hash("/b.bin")
    bad = sorted(_stores_root(tmp_path).glob(f"s*/manifests/{h}/*"))
    assert len(bad) == 2
    for p in bad:
        p.write_bytes(b'{"format": 2, "path": "/b.bin"')
    report = await _gc(cfg)
    assert report.stores == () and f"manifests/{h}/" in report.refused and "unreadable" in report.refused
    r = await _run_cli("gc", config=cfg)
    assert r.returncode == 1 and b"refused, nothing deleted" in r.stdout and f"manifests/{h}/".encode() in r.stdout
    assert _chunk_files(tmp_path) == before
    for p in bad:
        p.unlink()

    down = await _gc(cfg, wrap=lambda s: FaultyStore(s, down=True) if s.name == "s2" else s)
    assert down.stores == () and "store 's2': cannot list its roster" in down.refused    # read first
    assert _chunk_files(tmp_path) == before
    assert (await _gc(cfg)).freed_objects == 2 * len(m.chunks) + 2 * 4     # a.bin v1, and b.bin's chunks


async def test_other_tools_dotfiles_in_a_folder_store_are_no_objects_and_gc_runs(tmp_path: Path) -> None:
    """Files other tools leave among a folder store's objects (Finder's .DS_Store, an rsync temporary, an
    NFS silly-rename file, a filer's .snapshot copy of the store) are not objects: listings pass them by,
    gc runs (it refused while one sat among the manifests, holds or roster: an audit's find), frees the
    old versions and leaves those files alone; every kept version still reads."""
    cfg = _config(tmp_path, keep=1)
    w = Writer(tmp_path, cfg, "a1")
    old = await w.put("/a.bin", os.urandom(SIZE))
    data = os.urandom(SIZE)
    m = await w.put("/a.bin", data)
    _age_chunks(tmp_path)
    root = _stores_root(tmp_path)
    junk = []
    for store in ("s0", "s1", "s2"):
        for folder in ("manifests", "holds", "roster", "txns", "chunks", f"manifests/{path_hash('/a.bin')}"):
            for name in (".DS_Store", ".a.bin.Xy12Ab", ".nfs000000000012345600000001"):
                (root / store / folder).mkdir(parents=True, exist_ok=True)
                junk.append(root / store / folder / name)
                junk[-1].write_bytes(b"not an object")
        snapshot = root / store / ".snapshot" / "hourly.0"
        shutil.copytree(root / store / "manifests", snapshot / "manifests")
        shutil.copytree(root / store / "chunks", snapshot / "chunks")
        junk += [p for p in snapshot.rglob("*") if p.is_file()]
    old_time = time.time() - AGE
    for p in junk:
        os.utime(p, (old_time, old_time))
    contents = {p: p.read_bytes() for p in junk}
    for store in map(open_store, load_config(cfg).stores):
        for prefix in ("", "manifests/", "holds/", "roster/", "chunks/"):
            assert not [k for k in await store.list(prefix) if "/." in "/" + k]
        with pytest.raises(StoreError):
            await store.put(".DS_Store", b"x")
    before = _chunk_files(tmp_path)

    report = await _gc(cfg)
    assert report.ok and report.manifests == 1, report.refused
    assert report.freed_objects == 2 * len(_digests([old]) - _digests([m]))
    assert {p: p.read_bytes() for p in junk} == contents
    assert set(_chunk_files(tmp_path)) == {p for p in before if p.name in _digests([m])}
    assert await w.read("/a.bin") == data


def test_gc_grace_is_a_duration_of_at_least_a_minute(tmp_path: Path) -> None:
    """gc_grace: default 1h; durations take s, m and h; below 60 s is a config error naming the key."""
    def parse(extra: str):
        return parse_config(f'replicas = 1\n{extra}\n[[store]]\nname = "s"\nurl = "s"\n', "t.toml", tmp_path)
    assert parse("").gc_grace == 3600.0
    assert parse('gc_grace = "90m"').gc_grace == 5400.0
    assert parse('gc_grace = "2h"').gc_grace == 7200.0
    assert parse('gc_grace = 60').gc_grace == 60.0
    for bad, what in (('gc_grace = "30s"', "at least 60s"), ('gc_grace = "soon"', "duration")):
        with pytest.raises(ConfigError) as e:
            parse(bad)
        assert str(e.value).startswith("t.toml: gc_grace: ") and what in str(e.value)


async def test_gc_command_refuses_a_grace_below_the_floor_or_the_config(tmp_path: Path) -> None:
    """`--grace` below 60 s is a usage error; below the config's gc_grace a config error that says why
    (mounts touch reused chunks only past gc_grace/2); nothing is deleted either way."""
    cfg = _config(tmp_path, gc_grace="1h")
    w = Writer(tmp_path, cfg, "a1")
    await w.put("/a.bin", os.urandom(SIZE))
    await w.put("/a.bin", os.urandom(SIZE))
    await w.put("/a.bin", os.urandom(SIZE))
    _age_chunks(tmp_path)
    before = _chunk_files(tmp_path)
    r = await _run_cli("gc", "--grace", "10s", config=cfg)
    assert r.returncode == 2 and b"--grace: must be at least 60s" in r.stderr
    r = await _run_cli("gc", "--grace", "5m", config=cfg)
    assert r.returncode == 2 and b"config error" in r.stderr and b"below gc_grace" in r.stderr
    assert _chunk_files(tmp_path) == before
    r = await _run_cli("gc", "--grace", "90m", "--json", config=cfg)
    assert r.returncode == 0 and json.loads(r.stdout)["grace"] == 5400.0
    assert len(_chunk_files(tmp_path)) == len(before) - 2 * 4


async def test_a_claim_left_by_a_killed_gc_is_put_back(tmp_path: Path) -> None:
    """A gc killed between claiming a chunk file (renamed aside to judge its age) and settling it left
    the copy under a temporary name: the next gc puts it back, young or old, so a version that counts
    on it reads again; a claim whose name a put wrote again meanwhile is simply removed."""
    cfg = _config(tmp_path)
    w = Writer(tmp_path, cfg, "a1")
    data = os.urandom(SIZE)
    m = await w.put("/kept.bin", data)
    copies = sorted(p for p in _chunk_files(tmp_path) if p.name in {c.digest for c in m.chunks})
    claimed, rewritten = copies[0], copies[1]
    claim = claimed.with_name(f"{claimed.name}.{uuid.uuid4().hex}.claim.cpfs-tmp")
    claimed.rename(claim)                                    # what the killed gc left
    stale = rewritten.with_name(f"{rewritten.name}.{uuid.uuid4().hex}.claim.cpfs-tmp")
    stale.write_bytes(rewritten.read_bytes())                # a claim whose name came back
    assert _missing_copies(tmp_path, m)
    await _gc(cfg)
    assert claimed.exists() and not claim.exists() and not stale.exists() and rewritten.exists()
    assert _missing_copies(tmp_path, m) == [] and await w.read("/kept.bin") == data


# ---- files open for longer than the grace ---------------------------------------------------------------

class OpenFile:
    """A file written through the file layer (cpfs/writer.py) by a mount whose clock the test moves on."""

    def __init__(self, tmp_path: Path, cfg: Path, path: str) -> None:
        self.tmp_path, self.path = tmp_path, path
        self.clock = Clock()
        self.pool = _pool(cfg, clock=self.clock)
        self.catalog = Catalog(self.pool, writer="d4")

    def session(self, nursery: trio.Nursery) -> WriteSession:
        return WriteSession(self.pool, self.catalog, self.path, staging_dir=self.tmp_path / "staging",
                            nursery=nursery)

    def hours_pass(self, copies: set[Path], seconds: float = AGE) -> None:
        """`seconds` go by (AGE: two hours): on this mount's clocks, and for the copies' mtimes."""
        self.clock.hours_pass(seconds)
        for p in copies:
            st = p.stat()
            os.utime(p, (st.st_atime - seconds, st.st_mtime - seconds))


async def _until(condition: Callable[[], bool], seconds: float) -> None:
    with trio.move_on_after(seconds):
        while not condition():
            await trio.sleep(0.05)


@pytest.mark.parametrize("step_back", [False, True], ids=["clock right", "wall clock stepped back"])
async def test_a_file_open_for_hours_keeps_what_it_stored_while_gc_runs(tmp_path: Path, step_back: bool) -> None:
    """A file held open for writing for two hours (a slow save, a log appended to) while gc runs. The
    chunks write-behind stored first are named by no version until the close commits, and they are
    older than the grace; the session renews them while the file is open (upload: Renewal), so gc
    spares them and the commit reads back whole. Before, gc took them and the committed file was lost.
    `step_back`: meanwhile NTP stepped the mount's wall clock back by as much (it ran two hours fast),
    so on that clock the copies look new; gc runs on a host whose clock is right. Renewal counts ages
    on boot time, not on the wall clock; when it did, no renewal came, and the commit named chunks gc
    had taken."""
    cfg = _config(tmp_path)
    f = OpenFile(tmp_path, cfg, "/run/train.log")
    # A short last chunk, which waits for more bytes: with 16 whole ones, the 16th could be stored while
    # the test aged the copies, and its renewal then counted from after the clock step (CI saw it).
    first, second = os.urandom(15 * 65536 + 1000), os.urandom(100_000)
    async with trio.open_nursery() as n:
        s = f.session(n)
        await s.write(0, first)
        await _until(lambda: s.statistics().chunks_streamed >= 15, 120)
        stored = set(_chunk_files(tmp_path))
        assert s.statistics().chunks_streamed == 15 and len(stored) == 2 * 15
        f.hours_pass(stored)
        if step_back:
            f.clock.ahead -= AGE
        # The session looks for due renewals every RENEW_EVERY of the grace (7.5 s here).
        await _until(lambda: s.statistics().chunks_renewed >= 15, RENEW_EVERY * GRACE + 20)
        report = await _gc(cfg)
        await s.write(len(first), second)
        m = await s.flush()
        await s.aclose()
    assert report.refused == ""
    assert _missing_copies(tmp_path, m) == []
    assert await Writer(tmp_path, cfg, "e5").read("/run/train.log") == first + second
    assert s.statistics().chunks_renewed >= 15 and s.statistics().chunks_lost == 0
    assert f.pool.replica_statistics().renewed >= 2 * 15


async def test_a_file_open_for_writing_renews_at_once_when_its_host_wakes(tmp_path: Path) -> None:
    """Renewal passes count on boot time, looked at every TICKS_WATCH: trio's clock stops while the host
    is suspended, so a host that slept through most of the grace renewed gc_grace/8 of trio's clock after
    waking, while a gc elsewhere could take the copies. gc_grace 10 min: a sleep of 6 min (the copies
    past RENEW_AGE, within the grace) is followed by their renewal within 3 s (before: up to 75 s)."""
    cfg = _config(tmp_path, gc_grace="10m")
    f = OpenFile(tmp_path, cfg, "/run/train.log")
    data = os.urandom(15 * 65536 + 1000)    # the short last chunk waits for the close (see above)
    async with trio.open_nursery() as n:
        s = f.session(n)
        await s.write(0, data)
        await _until(lambda: s.statistics().chunks_streamed >= 15, 120)
        assert s.statistics().chunks_streamed == 15
        f.hours_pass(set(_chunk_files(tmp_path)), 0.6 * 600)
        await _until(lambda: s.statistics().chunks_renewed >= 15, 3 * TICKS_WATCH)
        assert s.statistics().chunks_renewed >= 15
        m = await s.flush()
        await s.aclose()
    assert _missing_copies(tmp_path, m) == []
    assert await Writer(tmp_path, cfg, "e6").read("/run/train.log") == data


def _checkpoint(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    torch.save({f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(6)}, buf)
    return buf.getvalue()


def _plain(seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(10 * 65536 + 1000)


@pytest.mark.parametrize("make", [_checkpoint, _plain], ids=["checkpoint", "plain"])
@pytest.mark.parametrize("left", ["one copy", "no copy"])
async def test_a_file_whose_stored_chunks_went_while_it_was_open(tmp_path: Path, left: str,
                                                                  make: Callable[[int], bytes]) -> None:
    """A file written in order through the file layer (a torch.save, or any file): write-behind stored
    its chunks and dropped them from staging. The daemon is then frozen with the file open for longer
    than the grace, and a gc, or a store's loss, takes the copies (one of each chunk's two, or both).
    The commit renews what is due first and finds them gone. With one copy left it copies each lost
    chunk back from it and stores it again: the file reads back whole. With none, the close fails, and
    the previous version stays current and whole (rule one)."""
    cfg = _config(tmp_path)
    before_data = make(1)
    before = await Writer(tmp_path, cfg, "a1").put("/f", before_data)
    kept = set(_chunk_files(tmp_path))
    f = OpenFile(tmp_path, cfg, "/f")
    data = make(2)
    async with trio.open_nursery() as n:
        s = f.session(n)
        for at in range(0, len(data), 100_000):
            await s.write(at, data[at:at + 100_000])
        await _until(lambda: s.statistics().chunks_dropped >= 4, 120)
        assert s.statistics().chunks_dropped >= 4
        new = set(_chunk_files(tmp_path)) - kept
        f.hours_pass(new)
        by_digest: dict[str, list[Path]] = {}
        for p in sorted(new):
            by_digest.setdefault(p.name, []).append(p)
        for copies in by_digest.values():
            for p in copies[1:] if left == "one copy" else copies:
                p.unlink()
        if left == "one copy":
            m = await s.flush()
        else:
            with pytest.raises(CpfsError, match="no replica of chunk"):
                await s.flush()
        await s.aclose()
    if left == "one copy":
        assert _missing_copies(tmp_path, m) == []
        assert await Writer(tmp_path, cfg, "e5").read("/f") == data
    else:
        assert (await Writer(tmp_path, cfg, "e5").catalog.get("/f")).version == before.version
        assert await Writer(tmp_path, cfg, "f6").read("/f") == before_data
    assert s.statistics().chunks_lost >= 4


async def test_a_put_that_outlasts_the_grace_stores_again_what_went_meanwhile(tmp_path: Path) -> None:
    """`cpfs put` of a file whose last chunk's upload stalls for hours (a store that hangs, then
    answers): meanwhile the chunks it stored first age past the grace and a gc takes them. Before the
    commit the importer renews what is due, finds them gone and stores them again from the file: the
    committed file reads back whole."""
    cfg = _config(tmp_path)
    data = os.urandom(5 * 65536)
    last = chunkfmt.chunk_key(chunkfmt.encode(data[4 * 65536:]).digest)
    wrap, reached, release = _pausing("put", last)
    clock = Clock()
    pool = _pool(cfg, wrap, clock)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    async with trio.open_nursery() as n:
        done = await _start_until_paused(n, lambda: Importer(pool, Catalog(pool, writer="a1")).put_file(src, "/p"),
                                         reached)
        await _until(lambda: len(_chunk_files(tmp_path)) == 2 * 4, 60)
        clock.hours_pass()
        _age_chunks(tmp_path)
        report = await _gc(cfg)
        assert sum(s.deleted for s in report.stores) == 2 * 4
        release.set()
    assert _missing_copies(tmp_path, done[0]) == []
    assert await Writer(tmp_path, cfg, "e5").read("/p") == data


# ---- the stores' roster: a gc with another config than the mounts' ---------------------------------------

def _lost_to_a_partial_gc(seed: int = 7) -> tuple[str, bytes]:
    """A path whose manifests go to stores s2 and s3 and content (one chunk) whose copies go to s0 and
    s1, of stores s0-s3: a gc that knows only s0 and s1 sees no version naming the chunk."""
    rng = np.random.default_rng(seed)
    names = [f"s{i}" for i in range(4)]
    path = next(p for p in (f"/run/step_{i}.pt" for i in range(1000))
                if set(place(path_hash(p), names, 2)) == {"s2", "s3"})
    data = next(d for d in (rng.bytes(50_000) for _ in range(1000))
                if set(place(chunkfmt.encode(d).digest, names, 2)) == {"s0", "s1"})
    return path, data


@pytest.mark.parametrize("enrolled", [True, False])
async def test_gc_with_a_config_that_lacks_stores_the_mounts_use_refuses(tmp_path: Path, enrolled: bool) -> None:
    """Mounts use stores s0-s3; a cron job's `cpfs gc` has an old config that knows only s0 and s1. A
    checkpoint whose manifests live on s2 and s3 names chunks on s0 and s1: that gc sees no version
    naming them. With the stores' roster (every writer enrolls its config) gc refuses, names the
    stores it lacks and deletes nothing. Control: stores that hold no roster (written before it
    existed) give gc nothing to check, and the checkpoint is lost."""
    full = _config(tmp_path, stores=range(4))
    partial = _config(tmp_path, stores=range(2), name="old-cron.toml")
    w = Writer(tmp_path, full, "a1")
    if enrolled:
        await roster.enroll(w.pool)
    path, data = _lost_to_a_partial_gc()
    await w.put(path, data)
    _age_chunks(tmp_path)
    report = await _gc(partial)
    if enrolled:
        assert "s2, s3" in report.refused and "--forget-store" in report.refused
        assert report.stores == ()
        assert await Writer(tmp_path, full, "b2").read(path) == data
    else:
        assert report.refused == "" and sum(s.deleted for s in report.stores) == 2
        with pytest.raises(ChunkUnavailable):
            await Writer(tmp_path, full, "b2").read(path)


def _stores_config(tmp_path: Path, name: str, stores: Iterable[int], *, keep: int = 5,
                   down: Iterable[str] = ()) -> Path:
    """A config over folder stores s<i> under tmp_path/cfg/stores (shared by every config of a test);
    the stores in `down` fail every request (an NFS server gone)."""
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f'replicas = 2\nchunk_size = "64KiB"\nkeep_versions = {keep}\n[cache]\nmemory = "64MiB"\n' + "".join(
        f'[[store]]\nname = "s{i}"\nurl = "stores/s{i}"\n' + ("down = true\n" if f"s{i}" in down else "")
        for i in stores))
    return path


def _versions(cfg: Path, path: str) -> list[tuple[int, str]]:
    out = cpfs("log", path, "--json", config=cfg)
    return [(v["version"], v["state"]) for v in json.loads(out.stdout)]


def test_a_save_after_stores_were_added_lists_where_the_old_config_put_versions(tmp_path: Path) -> None:
    """Stores s3 and s4 join s0-s2: a path's versions stay where the old config put them until a scrub
    --repair. With those stores down, a save of the path fails (it cannot number its version) and says
    where they are. It succeeded as version 1, below the 3 there: once the stores came back the old
    version was current again, and two more saves retired the new one (an audit's find)."""
    old = _stores_config(tmp_path, "old.toml", range(3))
    path = next(f"/ck{i}.pt" for i in range(200)
                if not set(place(path_hash(f"/ck{i}.pt"), ["s0", "s1", "s2"], 2))
                & set(place(path_hash(f"/ck{i}.pt"), [f"s{j}" for j in range(5)], 2)))
    holders = place(path_hash(path), ["s0", "s1", "s2"], 2)
    src = tmp_path / "src.bin"
    for i in range(3):
        src.write_bytes(os.urandom(100_000))
        cpfs("put", str(src), path, config=old)
    last = src.read_bytes()
    new = _stores_config(tmp_path, "new.toml", range(5))
    cpfs("put", str(src), "/other.bin", config=new)                  # the new config's first writer
    roster_keys = {p.name for p in (_stores_root(tmp_path) / "s0" / "roster").iterdir()}
    assert len(roster_keys) == 2
    for i in range(5):                       # every enrollment on every store: the old one too
        assert {p.name for p in (_stores_root(tmp_path) / f"s{i}" / "roster").iterdir()} == roster_keys

    down = _stores_config(tmp_path, "down.toml", range(5), down=holders)
    while set(place(chunkfmt.encode(data := os.urandom(50_000)).digest, [f"s{j}" for j in range(5)], 2)) & set(holders):
        pass                                 # a chunk that lands on stores that answer: stored, as in the find
    src.write_bytes(data)
    r = cpfs("put", str(src), path, config=down, check=False)
    assert r.returncode == 1 and b"cannot list the versions of" in r.stderr, r.stderr
    assert b"where a config of stores s0, s1, s2 put them" in r.stderr
    assert _versions(new, path) == [(3, "ok"), (2, "ok"), (1, "ok")]
    assert cpfs("cat", path, config=new).stdout == last


def test_a_config_that_keeps_fewer_versions_retires_none_the_mounts_keep(tmp_path: Path) -> None:
    """The mounts keep 5 versions per path; a cron job's config keeps 1 and removes the file. Its
    removal retires nothing the mounts keep (`cpfs restore` can bring any back): writers keep as many
    as the most any writer enrolled. It retired versions 1-4 at once (an audit's find)."""
    mounts = _stores_config(tmp_path, "mounts.toml", range(3), keep=5)
    cron = _stores_config(tmp_path, "cron.toml", range(3), keep=1)
    src = tmp_path / "src.bin"
    for _ in range(5):
        src.write_bytes(os.urandom(50_000))
        cpfs("put", str(src), "/ck.pt", config=mounts)
    cpfs("rm", "/ck.pt", config=cron)
    assert _versions(mounts, "/ck.pt") == [(6, "deleted"), (5, "ok"), (4, "ok"), (3, "ok"), (2, "ok"), (1, "ok")]


def test_restore_with_a_config_that_retired_a_store_its_versions_name(tmp_path: Path) -> None:
    """Store s2 left the config (retired; its copies have replicas elsewhere): `cpfs restore` of a
    version whose chunk entries name s2 renews the copies on the stores it has and commits. It failed
    with a traceback (KeyError: 's2'; an audit's find), and so did renames of old files in a mount."""
    old = _stores_config(tmp_path, "old.toml", range(3))
    src = tmp_path / "src.bin"
    contents = []
    for _ in range(2):
        contents.append(os.urandom(300_000))
        src.write_bytes(contents[-1])
        cpfs("put", str(src), "/ck.pt", config=old)
    assert any("s2" in c[4] for c in json.loads(cpfs("inspect", "/ck.pt", "--json", config=old).stdout)["chunks"])
    retired = _stores_config(tmp_path, "retired.toml", range(2))
    r = cpfs("restore", "/ck.pt", "1", config=retired, check=False)
    assert r.returncode == 0, r.stderr
    assert cpfs("cat", "/ck.pt", config=retired).stdout == contents[0]


async def test_an_enrollment_gone_from_one_store_still_counts_from_another(tmp_path: Path) -> None:
    """Store s0 lost its copy of a mount's enrollment (wiped, replaced) and s1 holds one: a gc with an
    old config that knows only s0 and s1 still refuses (the mounts use s2 and s3 too). roster.read
    stopped at the first store with no such object (an audit's find), that gc ran, and a checkpoint
    whose manifests live on s2 and s3 lost its chunks. Gone from every store that listed it (a
    forget), an enrollment no longer counts."""
    full = _config(tmp_path, stores=range(4))
    w = Writer(tmp_path, full, "a1")
    await roster.enroll(w.pool)
    path, data = _lost_to_a_partial_gc()
    await w.put(path, data)
    _age_chunks(tmp_path)

    def s0_lost_it(store: Store) -> Store:
        if store.name == "s0":
            f = FaultyStore(store)
            f.refuse("get", "roster/*", error=NoSuchObject)
            return f
        return ThrottledStore(store, latency=0.05)          # listed after s0
    report = await _gc(_config(tmp_path, stores=range(2), name="old-cron.toml"), wrap=s0_lost_it)
    assert "s2, s3" in report.refused and report.stores == ()
    assert await Writer(tmp_path, full, "b2").read(path) == data

    def gone(store: Store) -> Store:
        f = FaultyStore(store)
        f.refuse("get", "roster/*", error=NoSuchObject)
        return f
    listed, problems = await roster.read(_pool(full, wrap=gone))
    assert problems == [] and listed.stores == set()


@pytest.mark.parametrize("how", ["folder gone", "empty mountpoint"])
def test_stores_whose_filesystem_is_not_mounted_are_neither_written_nor_collected(tmp_path: Path, how: str) -> None:
    """Stores s1 and s2 live on one file server, which is not mounted on this host: their folders are
    gone, or are empty mountpoints. `cpfs put` and a mount refuse to start, naming both and what to
    do, and write nothing (a put created the folders on the local disk and stored copies there, which
    the remount hid); gc refuses and deletes nothing (it saw no version whose manifests live on s1 and
    s2, and deleted their chunks on s0). Mounted again, every file reads back and gc runs; a blank
    store put in on purpose is taken in by `cpfs scrub --repair`, after which a put works."""
    cfg = _config(tmp_path)
    names = ["s0", "s1", "s2"]
    files = {f"/d/f{i}.bin": os.urandom(8 * 65536 + i) for i in range(12)
             if set(place(path_hash(f"/d/f{i}.bin"), names, 2)) == {"s1", "s2"} or i < 2}
    assert len(files) > 2
    src = tmp_path / "d"
    src.mkdir()
    for path, data in files.items():
        (src / posixpath.basename(path)).write_bytes(data)
    cpfs("put", str(src), "/d", config=cfg)
    _age_chunks(tmp_path)
    stores = _stores_root(tmp_path)
    for name in ("s1", "s2"):
        (stores / name).rename(stores / f"{name}.server")
        if how == "empty mountpoint":
            (stores / name).mkdir()
    on_s0 = sorted(p.relative_to(stores) for p in stores.glob("s0/**/*") if p.is_file())

    r = cpfs("put", str(src / "f0.bin"), "/new.bin", config=cfg, check=False, text=True)
    assert r.returncode != 0 and "store 's1'" in r.stderr and "store 's2'" in r.stderr, r.stderr
    assert "is empty, but the roster on 's0' names it" in r.stderr and "scrub --repair" in r.stderr, r.stderr
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "mount.py"), "--config", str(cfg), str(tmp_path / "mnt"),
                        "--log-file", str(tmp_path / "mount.log")], capture_output=True, text=True, timeout=120)
    if os.path.ismount(tmp_path / "mnt"):
        subprocess.run(["fusermount3", "-u", str(tmp_path / "mnt")], capture_output=True)
        pytest.fail("mounted over stores whose filesystem is not mounted")
    assert r.returncode != 0 and "store 's1'" in r.stderr and "is empty" in r.stderr, r.stderr
    r = cpfs("gc", config=cfg, check=False, text=True)
    assert r.returncode == 1 and "is empty, but the roster" in r.stderr, r.stderr
    for name in ("s1", "s2"):
        assert not (stores / name).exists() if how == "folder gone" else not any((stores / name).iterdir())
    assert sorted(p.relative_to(stores) for p in stores.glob("s0/**/*") if p.is_file()) == on_s0

    for name in ("s1", "s2"):             # mounted again
        if how == "empty mountpoint":
            (stores / name).rmdir()
        (stores / f"{name}.server").rename(stores / name)
    for path, data in files.items():
        assert cpfs("cat", path, config=cfg).stdout == data
    assert cpfs("gc", config=cfg, check=False).returncode == 0

    shutil.rmtree(stores / "s2")          # its disk replaced by a blank one, on purpose
    (stores / "s2").mkdir()
    assert cpfs("put", str(src / "f0.bin"), "/new.bin", config=cfg, check=False).returncode != 0
    assert cpfs("scrub", "--repair", config=cfg, check=False).returncode == 0
    cpfs("put", str(src / "f0.bin"), "/new.bin", config=cfg)
    for path, data in [*files.items(), ("/new.bin", files["/d/f0.bin"])]:
        assert cpfs("cat", path, config=cfg).stdout == data


async def test_gc_takes_the_longest_gc_grace_a_writer_enrolled(tmp_path: Path) -> None:
    """A mount whose gc_grace is 10 h reuses copies up to 5 h old without touching them; a gc with a
    config of 60 s would take them (test_gc_between_a_commits_chunk_check_and_its_manifest). The
    mount's enrollment makes gc's grace 10 h: a 2-hour-old unreferenced chunk stays. Without it, the
    same gc deletes it."""
    cfg = _config(tmp_path)
    orphan = chunkfmt.encode(os.urandom(5000))
    pool = _pool(cfg)
    await pool.store_chunk(orphan, ["s0", "s1"], 2)
    _age_chunks(tmp_path)
    await roster.enroll(_pool(_config(tmp_path, gc_grace="10h", name="mount.toml")))
    report = await _gc(cfg)
    assert report.refused == "" and report.grace == 36000
    assert sum(s.deleted for s in report.stores) == 0 and sum(s.young for s in report.stores) == 2
    for p in _stores_root(tmp_path).glob("s*/roster/*.json"):
        p.unlink()
    report = await _gc(cfg)
    assert report.grace == GRACE and sum(s.deleted for s in report.stores) == 2


async def test_a_retired_store_leaves_the_roster_by_forget_store(tmp_path: Path) -> None:
    """Store s3 is retired: the mounts' config drops it (scrub --repair moved its copies). gc with the
    new config refuses while the roster names s3; `--forget-store s3` in a dry run still changes
    nothing; for real it deletes the enrollments naming s3, enrolls its own config and runs; the next
    gc runs without it. Forgetting a store the config has is refused."""
    old, new = _config(tmp_path, stores=range(4)), _config(tmp_path, name="new.toml")
    await roster.enroll(_pool(old))
    assert "s3" in (await _gc(new)).refused
    dry = await GarbageCollector(_pool(new), grace=GRACE, dry_run=True, forget=["s3"], settle=0).run()
    assert dry.refused == "" and "s3" in (await _gc(new)).refused
    assert "in this config" in (await GarbageCollector(_pool(new), grace=GRACE, forget=["s2"], settle=0).run()).refused
    done = await GarbageCollector(_pool(new), grace=GRACE, forget=["s3"], settle=0).run()
    assert done.refused == ""
    listed, problems = await roster.read(_pool(new))
    assert problems == [] and listed.stores == {"s0", "s1", "s2"}
    assert (await _gc(new)).refused == ""


async def test_a_roster_object_that_is_not_an_enrollment_makes_gc_refuse(tmp_path: Path) -> None:
    """Bad stored metadata is an error that loses nothing: gc cannot tell which stores the mounts use."""
    cfg = _config(tmp_path)
    pool = _pool(cfg)
    await roster.enroll(pool)
    [key] = {p.name for p in _stores_root(tmp_path).glob("s*/roster/*.json")}
    for p in _stores_root(tmp_path).glob(f"s*/roster/{key}"):
        p.write_text('{"format": 1, "stores": "s0"}')
    report = await _gc(cfg)
    assert "its bytes do not match its name" in report.refused and report.stores == ()


async def test_a_rotten_copy_of_an_enrollment_is_passed_over_for_an_intact_one(tmp_path: Path) -> None:
    """One store's copy of the mounts' enrollment rots into JSON that still parses, its gc_grace of 10 h
    now 1 h: gc takes another store's copy and keeps the 10 h. It took the rotten copy when that store
    answered first, and would have deleted chunks a mount counts on (an enrollment's name is the hash of
    its bytes: a copy that does not hash to it is damaged)."""
    cfg = _config(tmp_path)
    await roster.enroll(_pool(_config(tmp_path, gc_grace="10h", name="mount.toml")))
    for p in _stores_root(tmp_path).glob("s[01]/roster/*.json"):     # s2's copy stays intact
        if b"36000.0" in p.read_bytes():
            rotten = p.read_bytes().replace(b"36000.0", b"3600.00")
            assert json.loads(rotten)["gc_grace"] == 3600
            p.write_bytes(rotten)
    # s2 answers its listing last, so its copy is the last one read.
    report = await _gc(cfg, wrap=lambda s: ThrottledStore(s, latency=0.2, bandwidth=1e9) if s.name == "s2" else s)
    assert report.refused == "" and report.grace == 36000


GARBAGE = {"huge-number": b'{"format":1,"lease":' + b"9" * 400 + b',"gc_grace":' + b"9" * 400
                          + b',"stores":["s0"],"version":"x@1","chunks":[]}',
           "deep-nesting": b"[" * 100_000 + b"]" * 100_000}


@pytest.mark.parametrize("what", sorted(GARBAGE))
@pytest.mark.parametrize("folder", ["holds", "roster"])
async def test_a_hold_or_roster_object_of_garbage_makes_gc_refuse_not_crash(tmp_path: Path, folder: str,
                                                                            what: str) -> None:
    """JSON that parses into a number beyond a float (OverflowError) or nests beyond Python's stack
    (RecursionError) is bad stored metadata like any other: gc refuses, naming it. It raised out of gc
    (`cpfs gc` printed a traceback, on every run; an audit's find)."""
    cfg = _config(tmp_path)
    await Writer(tmp_path, cfg, "a1").put("/a.pt", os.urandom(SIZE))
    where = _stores_root(tmp_path) / "s0" / folder
    where.mkdir(exist_ok=True)
    # A roster object named by the hash of its bytes, as enrollments are: the parser has to judge it.
    name = "ffff.1.json" if folder == "holds" else hashlib.sha256(GARBAGE[what]).hexdigest()[:32] + ".json"
    (where / name).write_bytes(GARBAGE[what])
    report = await _gc(cfg)
    assert ("not a hold" if folder == "holds" else "not a store enrollment") in report.refused


async def test_a_hold_whose_digests_rotted_makes_gc_refuse(tmp_path: Path) -> None:
    """A hold copy whose digest lost a character still parsed, and gc would have counted a chunk nobody
    names instead of the held one (and deleted that). Holds carry a check: gc refuses, naming it."""
    cfg = _config(tmp_path)
    m = await Writer(tmp_path, cfg, "a1").put("/a.pt", os.urandom(SIZE))
    hold = Hold(3600.0, "/a.pt@1", frozenset(c.digest for c in m.chunks)).to_bytes()
    digest = m.chunks[0].digest
    for i in range(3):
        where = _stores_root(tmp_path) / f"s{i}" / "holds"
        where.mkdir(parents=True, exist_ok=True)      # a store the put did not place on has no folder yet
        (where / "ffff.1.json").write_bytes(hold if i else hold.replace(digest.encode(), digest[:-1].encode() + b"x"))
    report = await _gc(cfg)
    assert "does not match its check" in report.refused and report.stores == ()


def test_writers_enroll_and_cpfs_gc_with_an_old_config_refuses(tmp_path: Path, mount) -> None:
    """Through the tools: a mount and `cpfs put` enroll their config; `cpfs gc` with a config that
    lacks a store they use exits 1, says why, and deletes nothing (also with --dry-run)."""
    full = _config(tmp_path, stores=range(4))
    with open(full, "a") as f:
        f.write(f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    partial = _config(tmp_path, stores=range(3), name="old-cron.toml")
    m = mount(full)
    (m.path / "a.bin").write_bytes(os.urandom(200_000))
    m.stop()
    assert sorted(p.parent.parent.name for p in _stores_root(tmp_path).glob("s*/roster/*.json")) == \
        ["s0", "s1", "s2", "s3"]
    src = tmp_path / "b.bin"
    src.write_bytes(os.urandom(100_000))
    cpfs("put", str(src), "b.bin", config=partial)      # a writer with the old config enrolls it too
    assert len({p.name for p in _stores_root(tmp_path).glob("s*/roster/*.json")}) == 2
    _age_chunks(tmp_path)
    chunks = _chunk_files(tmp_path)
    for extra in ([], ["--dry-run"]):
        r = cpfs("gc", *extra, config=partial, check=False)
        assert r.returncode == 1 and b"s3" in r.stdout + r.stderr and b"refused" in r.stdout + r.stderr
    assert _chunk_files(tmp_path) == chunks
    assert cpfs("gc", config=full).returncode == 0


# ---- removed paths: their history expires after keep_removed ---------------------------------------------

def test_keep_removed_is_a_duration_or_forever(tmp_path: Path) -> None:
    """keep_removed: default 7 days; durations take d too; "forever" keeps every removed path's
    history; anything else is a config error naming the key."""
    def parse(extra: str):
        return parse_config(f'replicas = 1\n{extra}\n[[store]]\nname = "s"\nurl = "s"\n', "t.toml", tmp_path)
    assert parse("").keep_removed == 7 * 86400
    assert parse('keep_removed = "36h"').keep_removed == 36 * 3600
    assert parse('keep_removed = "forever"').keep_removed == float("inf")
    with pytest.raises(ConfigError) as e:
        parse('keep_removed = "later"')
    assert str(e.value).startswith("t.toml: keep_removed: ") and "forever" in str(e.value)


async def test_gc_purges_a_removed_paths_history_once_keep_removed_has_passed(tmp_path: Path) -> None:
    """A training run's checkpoint rotation removes old checkpoints; their history (two versions and
    the removal) stays for `cpfs restore` while younger than keep_removed, then gc purges it and frees
    the chunks no other version names. Never purged: a live path, a path saved again after its
    removal, a path whose newest version is a failed save after its removal."""
    cfg = _config(tmp_path, keep=3)
    w = Writer(tmp_path, cfg, "a1")
    contents = [os.urandom(SIZE) for _ in range(2)]
    old = [await w.put("/run/step_100.pt", data) for data in contents]
    await w.catalog.remove("/run/step_100.pt")
    again = os.urandom(SIZE)
    await w.put("/run/step_200.pt", os.urandom(SIZE))
    await w.catalog.remove("/run/step_200.pt")
    await w.put("/run/step_200.pt", again)                   # saved again after its removal
    tried = await w.put("/run/step_300.pt", os.urandom(SIZE))
    await w.catalog.remove("/run/step_300.pt")
    await w.catalog.commit_failed(dataclasses.replace(tried, path="/run/step_300.pt"), "a save cut short")
    live = os.urandom(SIZE)
    await w.put("/run/latest.pt", live)
    _age_chunks(tmp_path)

    young = await GarbageCollector(_pool(cfg), grace=GRACE, keep_removed=3600, settle=0).run()
    assert young.purged == 0 and sum(s.deleted for s in young.stores) == 0
    assert await Writer(tmp_path, cfg, "b2").read("/run/step_100.pt", old[0].version) == contents[0]  # restorable

    report = await GarbageCollector(_pool(cfg), grace=GRACE, keep_removed=0, settle=0).run()
    assert report.refused == "" and report.purged == 1
    assert not list(_stores_root(tmp_path).glob(f"s*/manifests/{path_hash('/run/step_100.pt')}/*"))
    assert sum(s.deleted for s in report.stores) == 2 * len(_digests(old))
    assert await Writer(tmp_path, cfg, "c3").read("/run/step_200.pt") == again
    assert await Writer(tmp_path, cfg, "c3").read("/run/latest.pt") == live
    assert len(await w.catalog.history("/run/step_300.pt")) == 3
    assert await w.catalog.history("/run/step_100.pt") == []
    assert (await GarbageCollector(_pool(cfg), grace=GRACE, keep_removed=0, settle=0).run()).purged == 0


async def test_a_restore_racing_the_purge_of_its_path_keeps_its_chunks(tmp_path: Path) -> None:
    """`cpfs restore` of a removed path read its old version and touched its chunks' copies; before
    its commit lands, a gc purges the path's history, and no version names those chunks. The copies
    are young, so the gc spares them, and the restored version reads back whole."""
    cfg = _config(tmp_path)
    w = Writer(tmp_path, cfg, "a1")
    content = os.urandom(SIZE)
    v1 = await w.put("/ckpt.pt", content)
    await w.catalog.remove("/ckpt.pt")
    _age_chunks(tmp_path)
    wrap, reached, release = _pausing("put", f"manifests/{path_hash('/ckpt.pt')}/")
    r = Writer(tmp_path, cfg, "b2", wrap)
    async with trio.open_nursery() as n:
        done = await _start_until_paused(n, lambda: r.catalog.restore("/ckpt.pt", v1.version), reached)
        report = await GarbageCollector(_pool(cfg), grace=GRACE, keep_removed=0, settle=0).run()
        release.set()
    assert report.purged == 1 and sum(s.deleted for s in report.stores) == 0
    assert await Writer(tmp_path, cfg, "c3").read("/ckpt.pt", done[0].version) == content


async def test_gc_keeps_removed_paths_as_long_as_the_longest_keep_removed_enrolled(tmp_path: Path) -> None:
    """A mount whose config keeps removed paths forever enrolls it: a gc whose own config says 0 purges
    nothing; once that enrollment is gone it does."""
    cfg = _config(tmp_path)
    w = Writer(tmp_path, cfg, "a1")
    await w.put("/a.pt", os.urandom(SIZE))
    await w.catalog.remove("/a.pt")
    forever = _config(tmp_path, name="forever.toml")
    forever.write_text('keep_removed = "forever"\n' + forever.read_text())
    await roster.enroll(_pool(forever))
    assert (await GarbageCollector(_pool(cfg), grace=GRACE, keep_removed=0, settle=0).run()).purged == 0
    for p in _stores_root(tmp_path).glob("s*/roster/*.json"):
        p.unlink()
    assert (await GarbageCollector(_pool(cfg), grace=GRACE, keep_removed=0, settle=0).run()).purged == 1


def test_a_rotation_through_the_mount_frees_its_space_once_keep_removed_has_passed(tmp_path: Path, mount) -> None:
    """A trainer's checkpoint rotation: `shutil.rmtree` of an old checkpoint folder through a real
    mount. `cpfs gc` with keep_removed = "0s" purges the removed paths and frees their chunks; the
    kept checkpoint still reads back whole on a fresh mount."""
    cfg = _config(tmp_path)
    cfg.write_text('keep_removed = "0s"\n' + cfg.read_text() + f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    m = mount(cfg)
    old, kept = os.urandom(300_000), os.urandom(300_000)
    (m.path / "checkpoint-100").mkdir()
    (m.path / "checkpoint-100" / "model.safetensors").write_bytes(old)
    (m.path / "checkpoint-200").mkdir()
    (m.path / "checkpoint-200" / "model.safetensors").write_bytes(kept)
    shutil.rmtree(m.path / "checkpoint-100")
    m.stop()
    _age_chunks(tmp_path)
    r = cpfs("gc", "--json", config=cfg)
    report = json.loads(r.stdout)
    assert report["purged"] == 2 and report["freed_bytes"] >= 2 * len(old)       # the file and its folder
    again = mount(cfg, "again")
    assert not (again.path / "checkpoint-100").exists()
    assert (again.path / "checkpoint-200" / "model.safetensors").read_bytes() == kept


async def test_a_purge_cut_short_leaves_the_path_removed(tmp_path: Path) -> None:
    """One store refuses to delete the oldest version of an expired history: the purge deletes what it
    can but keeps the removal, so the path stays removed (no older version comes back as current), and
    the version it could not delete keeps its chunks: `cpfs log` lists it, `restore` brings it back.
    They were swept in the same run: scrub called them lost and restore failed (the gc audit's find).
    The next gc, with the store willing, finishes the purge and frees them."""
    cfg = _config(tmp_path, keep=3)
    w = Writer(tmp_path, cfg, "a1")
    data = os.urandom(SIZE)
    first = await w.put("/old.pt", data)
    await w.put("/old.pt", os.urandom(SIZE))
    await w.catalog.remove("/old.pt")
    _age_chunks(tmp_path)
    h = path_hash("/old.pt")
    oldest = f"manifests/{h}/{first.version:020d}.*"

    def refusing(store: Store) -> Store:
        faulty = FaultyStore(store)
        faulty.refuse("delete", oldest)
        return faulty

    report = await GarbageCollector(_pool(cfg, refusing), grace=GRACE, keep_removed=0, settle=0).run()
    assert report.purged == 1
    assert report.failed == 2 and not report.ok     # `cpfs gc` exits 1: it exited 0 (an audit's find)
    assert "2 deletions of records, histories or holds failed" in report.lines()[-1]
    with pytest.raises(NotFound):
        await Writer(tmp_path, cfg, "b2").catalog.get("/old.pt")
    assert [i.ref.state for i in await Writer(tmp_path, cfg, "c3").catalog.history("/old.pt")] == ["deleted", "ok"]
    assert _missing_copies(tmp_path, first) == []
    assert await Writer(tmp_path, cfg, "d4").read("/old.pt", first.version) == data
    again = await GarbageCollector(_pool(cfg), grace=GRACE, keep_removed=0, settle=0).run()
    assert again.purged == 1 and again.ok
    assert not list(_stores_root(tmp_path).glob(f"s*/manifests/{h}/*"))
    assert len(_missing_copies(tmp_path, first)) == 2 * len(first.chunks)       # freed now


def test_gc_whose_deletions_fail_exits_1(tmp_path: Path) -> None:
    """A store that refuses every deletion (read-only, full of a quota's errors): `cpfs gc` reports the
    failed requests and exits 1, so that the cron job that runs it is seen to fail. It exited 0 while
    nothing was ever freed (an audit's find). With the store writable again it exits 0."""
    cfg = _config(tmp_path)
    src = tmp_path / "x.bin"
    src.write_bytes(os.urandom(SIZE))
    cpfs("put", str(src), "/x.bin", config=cfg)
    cpfs("rm", "/x.bin", config=cfg)
    cpfs("put", str(src), "/y.bin", config=cfg)     # a roster, and a version: gc runs
    src.write_bytes(os.urandom(SIZE))
    cpfs("put", str(src), "/y.bin", config=cfg)
    cpfs("put", str(src), "/y.bin", config=cfg)
    (tmp_path / "z.bin").write_bytes(os.urandom(SIZE))
    cpfs("put", str(tmp_path / "z.bin"), "/z.bin", config=cfg)
    cpfs("put", str(src), "/z.bin", config=cfg)
    cpfs("put", str(src), "/z.bin", config=cfg)     # z's first version retired: its chunks unreferenced
    _age_chunks(tmp_path)
    # Every store's: z's first version may have no chunk on a given one (1 in 81 for four chunks).
    folders = [f for s in ("s0", "s1", "s2") for chunks in [_stores_root(tmp_path) / s / "chunks"]
               for f in (chunks, *chunks.iterdir())]
    try:
        for d in folders:
            subprocess.run(["chattr", "+i", str(d)], check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"chattr +i: {e.stderr.decode().strip()} (a filesystem without immutable folders)")
    try:
        r = cpfs("gc", "--json", config=cfg, check=False, text=True)
    finally:
        for d in folders:
            subprocess.run(["chattr", "-i", str(d)], check=True, capture_output=True)
    report = json.loads(r.stdout)
    assert r.returncode == 1 and sum(s["errors"] for s in report["stores"]) > 0, (r.stdout, r.stderr)
    assert all(s["deleted"] == 0 for s in report["stores"]), r.stdout
    r = cpfs("gc", "--json", config=cfg, check=False, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["freed_objects"] > 0


@pytest.mark.parametrize("rotten", [0, 1])
async def test_a_manifest_copy_whose_bits_rotted_does_not_lead_gc_astray(tmp_path: Path, rotten: int) -> None:
    """One bit flips in one copy of a manifest, inside a chunk's name: the copy still parses, and names
    a chunk that does not exist instead of one that does. The copy fails its check (cpfs/manifest.py),
    so gc reads the intact copy and keeps the chunk; before the checks it read whichever copy came first
    (here the rotten one: the intact copy's store answers 30 ms later) and deleted every copy of it.
    Found by an audit; the rotten copy, the other way round, changes nothing either."""
    cfg = _config(tmp_path)
    w = Writer(tmp_path, cfg, "a1")
    data = os.urandom(SIZE)
    m = await w.put("/ckpt.pt", data)
    _age_chunks(tmp_path)
    victim = m.chunks[0].digest
    copies = sorted(_stores_root(tmp_path).glob(f"s*/manifests/{path_hash('/ckpt.pt')}/*"))
    assert len(copies) == 2
    bad, good = copies[rotten], copies[1 - rotten]
    raw = bytearray(bad.read_bytes())
    at = next(i for i in range(raw.index(victim.encode()), len(raw)) if raw[i] in b"0123456789abcdef"
              and raw[i] ^ 1 in b"0123456789abcdef")
    raw[at] ^= 1
    bad.write_bytes(raw)
    assert json.loads(bytes(raw).split(b"\n")[1])["chunks"][0][0] != victim     # parses, names another chunk
    intact = good.relative_to(_stores_root(tmp_path)).parts[0]
    report = await _gc(cfg, wrap=lambda s: ThrottledStore(s, latency=0.03) if s.name == intact else s)
    assert not report.refused
    assert _missing_copies(tmp_path, m) == []
    assert await Writer(tmp_path, cfg, "b2").read("/ckpt.pt") == data


async def test_a_removal_from_a_host_whose_clock_is_behind_keeps_its_history(tmp_path: Path) -> None:
    """`cpfs rm` on a host whose clock is 8 days behind: the removal's committed_ns is 8 days old, its
    copies seconds old. gc judges the age by both clocks, so the history stays for keep_removed (7 days)
    and the version before can be restored. By the writer's clock alone, the next gc purged it at once
    (an audit's find)."""
    cfg = _config(tmp_path)
    data = os.urandom(SIZE)
    v1 = await Writer(tmp_path, cfg, "a1").put("/ckpt.pt", data)
    _age_chunks(tmp_path)
    await Writer(tmp_path, cfg, "b2", behind=8 * 86400).catalog.remove("/ckpt.pt")
    report = await GarbageCollector(_pool(cfg), grace=GRACE, keep_removed=7 * 86400, settle=0).run()
    assert report.purged == 0 and not report.refused
    assert await Writer(tmp_path, cfg, "c3").read("/ckpt.pt", v1.version) == data


async def test_a_rename_from_a_host_whose_clock_is_behind_is_not_taken_for_abandoned(tmp_path: Path) -> None:
    """A folder rename (both names' versions, then the transaction record) from a host whose clock is
    2 h behind, and gc (grace 60 s) running while the record is on its way: the versions are seconds old
    on the stores, so gc leaves them, and once the record lands the new names read back. By the
    writer's clock alone gc deleted them as abandoned, and the committed rename lost both names
    (an audit's find)."""
    cfg = _config(tmp_path, keep=3)
    w = Writer(tmp_path, cfg, "a1")
    a, b = os.urandom(SIZE), os.urandom(SIZE)
    ma, mb = await w.put("/run/tmp/a.pt", a), await w.put("/run/tmp/b.pt", b)
    wrap, reached, release = _pausing("put", "txns/")
    slow = Writer(tmp_path, cfg, "b2", wrap, behind=7200)
    async with trio.open_nursery() as n:
        n.start_soon(slow.catalog.transact, [dataclasses.replace(ma, path="/run/final/a.pt"),
                                             dataclasses.replace(mb, path="/run/final/b.pt")], [ma, mb])
        await reached.wait()                      # the versions are written, the record on its way
        report = await _gc(cfg)
        release.set()
    assert report.abandoned == 0 and not report.refused
    r = Writer(tmp_path, cfg, "c3")
    assert await r.read("/run/final/a.pt") == a and await r.read("/run/final/b.pt") == b


@pytest.mark.parametrize("behind", [0.0, GRACE])
async def test_a_mount_whose_clock_is_behind_renews_the_old_copies_it_reuses(tmp_path: Path, behind: float) -> None:
    """Content identical to a retired version is saved again; its chunks are 72 s old on the stores'
    clocks, past gc's grace (60 s). A gc runs after the mount checked them and before its manifest. The
    mount judges their age on the stores' clocks (a probe's mtime), so it renews them however far its
    own clock is behind, and the commit reads back. With its clock 60 s behind it took them for 12 s
    old, left them, and the gc deleted what the commit names (an audit's find)."""
    cfg = _config(tmp_path, keep=1)
    _, content, first = await _retired(tmp_path, cfg)
    _age_chunks(tmp_path, age=1.2 * GRACE)
    wrap, reached, release = _pausing("put", "manifests/")
    w = Writer(tmp_path, cfg, "b2", wrap, behind=behind)
    async with trio.open_nursery() as n:
        await _start_until_paused(n, lambda: w.put("/ckpt.bin", content), reached)
        report = await _gc(cfg)
        release.set()
    assert report.refused == "" and sum(s.deleted for s in report.stores) == 0
    assert w.pool.replica_statistics().touched == 2 * len(first.chunks)
    assert await Writer(tmp_path, cfg, "c3").read("/ckpt.bin") == content


@pytest.mark.parametrize("saved_ago", [0.0, 7200.0])
async def test_a_rename_of_a_version_saved_long_ago_renews_its_chunks(tmp_path: Path, saved_ago: float) -> None:
    """A rotation renames a checkpoint saved 2 h ago (mv ckpt.pt ckpt.prev.pt: one transaction). The new
    name's version names the old chunks without storing them, so the rename touches their copies: a gc
    that saw neither name's version (it listed the new path before the rename landed and the old one
    after) judges them young at deletion and leaves them. Nothing touched them, and such a gc deleted
    them (an audit's find). A version saved moments ago is young enough: nothing is touched."""
    cfg = _config(tmp_path, keep=1)
    data = os.urandom(SIZE)
    m = await Writer(tmp_path, cfg, "a1", behind=saved_ago).put("/ckpt.pt", data)
    _age_chunks(tmp_path)
    w = Writer(tmp_path, cfg, "b2")
    await w.catalog.move(m, "/ckpt.prev.pt")
    ages = [time.time() - p.stat().st_mtime for p in _chunk_files(tmp_path)]
    if saved_ago:
        assert w.pool.replica_statistics().renewed == 2 * len(m.chunks) and max(ages) < GRACE / 2
    else:
        assert w.pool.replica_statistics().renewed == 0 and min(ages) > GRACE
    assert await w.read("/ckpt.prev.pt") == data


def test_log_and_restore_say_when_the_stores_that_hold_a_paths_versions_are_down(tmp_path: Path) -> None:
    """With the stores of a path's placement down, `cpfs log`, `restore` and `cat --version` fail
    naming them, as `cat` does. They said the path had no versions (an audit's find: an operator told
    that the checkpoint is gone)."""
    up = _stores_config(tmp_path, "up.toml", range(3))
    src = tmp_path / "src.bin"
    for _ in range(2):
        src.write_bytes(os.urandom(50_000))
        cpfs("put", str(src), "/ck.pt", config=up)
    down = _stores_config(tmp_path, "down.toml", range(3), down=place(path_hash("/ck.pt"), ["s0", "s1", "s2"], 2))
    for args in (["log", "/ck.pt"], ["restore", "/ck.pt", "1"], ["cat", "/ck.pt", "--version", "1"]):
        r = cpfs(*args, config=down, check=False)
        assert r.returncode == 1 and b"cannot list the versions of /ck.pt on enough stores" in r.stderr, (args, r.stderr)
        assert b"no version" not in r.stderr
    assert _versions(up, "/ck.pt") == [(2, "ok"), (1, "ok")]
