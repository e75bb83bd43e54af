"""`cpfs scrub [--repair]`: every copy of every chunk and manifest checked; corrupt, missing, emptied,
added and removed stores found and repaired; readers find the copies a repair placed; lost chunks named
with their files. Damage is done to the store folders themselves, as a failing disk or a person would."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from conftest import cpfs
from cpfs import chunk as chunkfmt
from cpfs.catalog import Catalog, VersionRef
from cpfs.config import load_config
from cpfs.errors import CorruptChunk, StoreError
from cpfs.manifest import ChunkEntry, Manifest, path_hash
from cpfs.placement import place
from cpfs.pool import StorePool
from cpfs.scrub import ScrubReport, Scrubber
from cpfs.store import FaultyStore, open_store

from test_catalog import MANIFESTS, commit_bytes, faulty_catalog, make_pool, version_files

CHUNK = 256 * 1024
FILES = ("/tree/a.bin", "/tree/b.bin", "/tree/sub/c.bin")


def _config(folder: Path, names: tuple[str, ...] = ("s0", "s1", "s2"), replicas: int = 2) -> Path:
    """A config of folder stores folder/stores/NAME (the same folders whatever the list)."""
    lines = [f"replicas = {replicas}", 'chunk_size = "256KiB"']
    for n in names:
        lines += ["[[store]]", f'name = "{n}"', f'url = "stores/{n}"']
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cpfs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _tree(tmp_path: Path, config: Path) -> dict[str, bytes]:
    """Three files (b shares a's first chunk), and a second version of a that shares all but its last
    chunk with the first: dedup across files and versions. Returns the current bytes of each path."""
    rng = random.Random(7)
    a1 = rng.randbytes(4 * CHUNK)
    b = a1[:CHUNK] + rng.randbytes(2 * CHUNK + 1000)
    c = rng.randbytes(100_000)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(a1)
    (src / "b.bin").write_bytes(b)
    (src / "sub" / "c.bin").write_bytes(c)
    cpfs("put", str(src), "tree", config=config)
    a2 = a1[:3 * CHUNK] + rng.randbytes(CHUNK)
    (tmp_path / "a2.bin").write_bytes(a2)
    cpfs("put", str(tmp_path / "a2.bin"), "tree/a.bin", config=config)
    return {"/tree/a.bin": a2, "/tree/b.bin": b, "/tree/sub/c.bin": c}


def _objects(config: Path) -> dict[tuple[str, str], bytes]:
    """(store, key) -> bytes of every chunk and manifest copy in the store folders."""
    out = {}
    for store in sorted((config.parent / "stores").iterdir()):
        for p in store.rglob("*"):
            key = p.relative_to(store).as_posix()
            if p.is_file() and key.startswith(("chunks/", "manifests/")) and not p.name.endswith(".cpfs-tmp"):
                out[(store.name, key)] = p.read_bytes()
    return out


def _scrub(config: Path, *args: str) -> tuple[int, dict]:
    r = cpfs("scrub", "--json", *args, config=config, check=False)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def _entries(config: Path, path: str) -> list[ChunkEntry]:
    doc = json.loads(cpfs("inspect", "--json", path, config=config).stdout)
    return [ChunkEntry(d, r, s, c, tuple(st)) for d, r, s, c, st in doc["chunks"]]


def _copy(config: Path, store: str, digest: str) -> Path:
    return config.parent / "stores" / store / chunkfmt.chunk_key(digest)


def _good(path: Path, digest: str) -> bool:
    try:
        chunkfmt.decode(path.read_bytes(), digest)
    except (OSError, CorruptChunk):
        return False
    return True


def _assert_reads(config: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        assert cpfs("cat", path, config=config).stdout == data, path


CLEAN = {"missing": 0, "corrupt": 0, "unreachable": 0, "under_replicated": 0, "lost": 0, "manifest_missing": 0,
         "manifest_corrupt": 0, "manifests_under_replicated": 0, "manifests_lost": 0, "block_checks_wrong": 0,
         "unrepaired": 0, "ok": True}


def _clean(report: dict) -> bool:
    return {k: report[k] for k in CLEAN} == CLEAN


# ---- a healthy tree -------------------------------------------------------------------------------

def test_healthy_tree_scrubs_clean(tmp_path: Path) -> None:
    """Every copy is read once: a chunk that two files and two versions share counts once, the bytes
    read are every object's bytes, and nothing is written."""
    config = _config(tmp_path / "cfg")
    _tree(tmp_path, config)
    before = _objects(config)
    chunks = {k for _, k in before if k.startswith("chunks/")}
    versions = {k for _, k in before if k.startswith("manifests/")}
    rc, j = _scrub(config)
    assert rc == 0 and _clean(j), j
    assert j["manifests"] == 3 and j["versions"] == len(versions) == 4
    assert j["chunks"] == len(chunks) == 4 + 1 + 3 + 1     # a v1, a v2's new tail, b's own three, c
    assert j["replicas"] == 2 * len(chunks) and j["manifest_copies"] == 2 * len(versions)
    assert j["bytes_read"] == sum(len(b) for b in before.values())
    assert j["repaired"] == 0 and j["problems"] == [] and j["lost_files"] == []
    assert _objects(config) == before
    r = cpfs("scrub", config=config)
    assert r.returncode == 0 and b"ok: every chunk and version has its replicas" in r.stdout
    # A mistyped path is no clean bill of health: it said ok and exited 0 (an audit's find).
    r = cpfs("scrub", "/no/such/run", config=config, check=False, text=True)
    assert r.returncode == 1 and "/no/such/run: no file or folder there" in r.stderr, (r.stdout, r.stderr)


async def test_scrubber_in_process_is_bounded(tmp_path: Path) -> None:
    """The Scrubber as a library: a frozen report, its counts equal to the live statistics, and at
    most `concurrency` requests in flight on any store (each check holds one at a time)."""
    config = _config(tmp_path / "cfg")
    _tree(tmp_path, config)
    pool = StorePool(load_config(str(config)))
    scrubber = Scrubber(pool, Catalog(pool), concurrency=2)
    report = await scrubber.run()
    assert isinstance(report, ScrubReport) and report.ok and report.stats == scrubber.statistics()
    assert report.stats.phase == "done" and report.stats.chunks == report.stats.chunks_total == 9
    with pytest.raises(AttributeError):
        report.stats.lost = 1                                   # type: ignore[misc]
    assert all(s.peak_outstanding <= 2 for s in pool.statistics())
    assert sum(s.bytes_read for s in pool.statistics()) == report.stats.bytes_read
    assert scrubber.limiter.borrowed_tokens == 0


async def test_a_store_that_is_down_is_reported_not_waited_for(tmp_path: Path) -> None:
    """A store that fails every request: each copy it holds is counted unreachable (the scrub is not
    ok, and says its listing failed); --repair cannot make up for it on the placement it is part of,
    and says so, but the scrub ends."""
    config_path = _config(tmp_path / "cfg")
    _tree(tmp_path, config_path)
    on_s2 = [k for s, k in _objects(config_path) if s == "s2"]
    config = load_config(str(config_path))
    stores = [FaultyStore(open_store(s), down=s.name == "s2") for s in config.stores]
    pool = StorePool(config, stores=stores)
    report = await Scrubber(pool, Catalog(pool)).run(repair=True)
    s = report.stats
    assert not report.ok and s.stores_unlisted == 2 and s.unreachable == len(on_s2) > 0   # records, manifests
    assert s.lost == s.manifests_lost == s.missing == s.corrupt == 0
    assert s.unrepaired > 0 and any(p.kind == "repair failed" and p.store == "s2" for p in report.problems)


async def test_stores_that_stop_answering_after_the_manifests_leave_the_scrub_not_ok(tmp_path: Path) -> None:
    """The stores answer the listing and the manifests, then no chunk read and no "is that version still
    there?": nothing was verified. Each copy is unreachable and the scrub is not ok. Once, the failed
    look was taken for "no" (a gc retired every version meanwhile): every chunk "vanished", scrub ok,
    exit 0 (an audit's find)."""
    pool = make_pool(tmp_path, wrap=lambda s: _down_after_manifests(FaultyStore(s)))
    await commit_bytes(Catalog(pool), "/ckpt.pt", os.urandom(100_000))
    report = await Scrubber(pool, Catalog(pool)).run()
    s = report.stats
    assert not report.ok and s.chunks == 1 and s.unreachable == 2 and s.vanished == 0


async def test_a_version_retired_while_its_copies_are_read_is_no_missing_copy(tmp_path: Path) -> None:
    """A save retires a version (keep_versions) while the scrub reads its copies: one store answered
    before its delete, the next after. The version vanished; it was reported as a missing copy and the
    scrub failed (the busy commits audit: 3 of 6 scrubs during saves exited 1)."""
    wrappers: list[FaultyStore] = []
    pool = make_pool(tmp_path, wrap=lambda s: wrappers.append(FaultyStore(s)) or wrappers[-1])
    await commit_bytes(Catalog(pool), "/log.txt", b"step 1")
    key = next(k for k in pool_keys(tmp_path / "s0") if k.startswith("manifests/"))
    release, reached = trio.Event(), trio.Event()
    wrappers[1].hold("get", key, until=release, reached=reached)
    got = {}

    async def scrub() -> None:
        got["report"] = await Scrubber(pool, Catalog(pool)).run()

    async with trio.open_nursery() as n:
        n.start_soon(scrub)
        await reached.wait()                      # s0's copy read, s1's read waits
        for store in ("s0", "s1"):                # the writer's retire
            (tmp_path / store / key).unlink()
        release.set()
    s = got["report"].stats
    assert got["report"].ok and s.vanished == 1 and s.missing == 0, got["report"].problems


def pool_keys(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.json"))


def _down_after_manifests(store: FaultyStore) -> FaultyStore:
    store.refuse("get", "chunks/*", StoreError)
    store.refuse("exists", "manifests/*", StoreError)
    return store


async def test_a_scrub_of_a_folder_reports_a_file_below_it_whose_every_summary_is_unreadable(tmp_path: Path) -> None:
    """`cpfs scrub /run` when every manifest copy of /run/b.pt is damaged (so its path cannot be read):
    the file is scrubbed and reported lost, as a whole-tree scrub does. It was left out, and the
    scrub of /run said ok (an audit's find)."""
    pool = make_pool(tmp_path)
    for path in ("/run/a.pt", "/run/b.pt"):
        await commit_bytes(Catalog(pool), path, os.urandom(1000))
    for p in tmp_path.glob(f"s*/manifests/{path_hash('/run/b.pt')}/*"):
        p.write_bytes(b"\x00 bit rot\n")
    for scope in ((), ["/run"]):
        report = await Scrubber(pool, Catalog(pool)).run(scope)
        assert not report.ok and report.stats.manifests_lost == 1, scope


# ---- corrupt and missing copies ---------------------------------------------------------------------

def test_corrupt_and_deleted_copies_are_reported_and_repaired(tmp_path: Path) -> None:
    """A corrupt and a deleted chunk copy, a deleted and a cut manifest copy: reported with store and
    file (exit 1); --repair rewrites exactly those four from the good copies (exit 0), the files read
    back byte-exact and the next scrub is clean."""
    config = _config(tmp_path / "cfg")
    files = _tree(tmp_path, config)
    c = _entries(config, "/tree/sub/c.bin")[0]
    b = _entries(config, "/tree/b.bin")[-1]
    corrupt, good_c = _copy(config, c.stores[0], c.digest), _copy(config, c.stores[1], c.digest)
    blob = bytearray(corrupt.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    corrupt.write_bytes(blob)
    _copy(config, b.stores[1], b.digest).unlink()
    manifests = sorted(k for k in _objects(config) if k[1].startswith("manifests/"))
    gone, cut = manifests[0], next(m for m in manifests if m[1] != manifests[0][1])
    (config.parent / "stores" / gone[0] / gone[1]).unlink()
    cut_path = config.parent / "stores" / cut[0] / cut[1]
    cut_path.write_bytes(cut_path.read_bytes()[:-20])

    rc, j = _scrub(config)
    assert rc == 1 and not j["ok"]
    assert (j["corrupt"], j["missing"], j["under_replicated"], j["lost"]) == (1, 1, 2, 0)
    assert (j["manifest_missing"], j["manifest_corrupt"], j["manifests_under_replicated"]) == (1, 1, 2)
    assert j["unrepaired"] == 4 and j["repaired"] == 0
    kinds = {(p["what"], p["kind"], p["store"]) for p in j["problems"]}
    assert {("chunk", "corrupt", c.stores[0]), ("chunk", "missing", b.stores[1]),
            ("manifest", "missing", gone[0]), ("manifest", "corrupt", cut[0])} <= kinds
    where = {p["key"]: p["where"] for p in j["problems"] if p["what"] == "chunk"}
    assert where[chunkfmt.chunk_key(c.digest)] == "/tree/sub/c.bin version 1 (current)"
    assert where[chunkfmt.chunk_key(b.digest)] == "/tree/b.bin version 1 (current)"

    rc, j = _scrub(config, "--repair")
    assert rc == 0 and j["ok"] and j["repaired"] == 4 and j["unrepaired"] == 0
    assert corrupt.read_bytes() == good_c.read_bytes() and _good(corrupt, c.digest)
    assert _copy(config, b.stores[1], b.digest).read_bytes() == _copy(config, b.stores[0], b.digest).read_bytes()
    for store, key in (gone, cut):
        other = next(s for s, k in _objects(config) if k == key and s != store)
        assert (config.parent / "stores" / store / key).read_bytes() == \
            (config.parent / "stores" / other / key).read_bytes()
    rc, j = _scrub(config)
    assert rc == 0 and _clean(j) and j["repaired"] == 0
    _assert_reads(config, files)


def test_emptied_store_is_refilled(tmp_path: Path) -> None:
    """A store replaced by an empty one (its folder's content deleted): scrub counts every copy it
    held as missing; --repair puts every chunk and manifest copy back, byte-equal to the good one."""
    config = _config(tmp_path / "cfg")
    files = _tree(tmp_path, config)
    before = _objects(config)
    held = [k for s, k in before if s == "s1"]
    folder = config.parent / "stores" / "s1"
    for p in folder.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    rc, j = _scrub(config)
    assert rc == 1
    assert j["missing"] == j["under_replicated"] == sum(k.startswith("chunks/") for k in held) > 0
    assert j["manifest_missing"] == sum(k.startswith("manifests/") for k in held) > 0
    rc, j = _scrub(config, "--repair")
    assert rc == 0 and j["repaired"] == len(held)
    assert _objects(config) == before
    assert _clean(_scrub(config)[1])
    _assert_reads(config, files)


# ---- stores added and removed -------------------------------------------------------------------------

@pytest.mark.long
def test_added_store_then_removed_store(tmp_path: Path, mount) -> None:
    """A 4th store added: chunks keep their listed copies, manifest versions whose placement moved to
    the new store are copied there. Then a store removed from the config (its folder gone): chunks it
    held are short, --repair puts copies on their current placement, and `cpfs cat` and a mount read
    every file (and the older version) byte-exact from where the manifests do not say."""
    cfg = tmp_path / "cfg"
    config = _config(cfg)
    files = _tree(tmp_path, config)
    old_a = cpfs("cat", "--version", "1", "/tree/a.bin", config=config).stdout

    # A name whose arrival moves some path's manifest placement (rendezvous hashing moves ~half).
    new = next(n for n in (f"n{i}" for i in range(100))
               if any(n in place(path_hash(p), ("s0", "s1", "s2", n), 2) for p in FILES))
    four = ("s0", "s1", "s2", new)
    config = _config(cfg, four)
    before = _objects(config)
    need = 0
    for key in {k for _, k in before if k.startswith("manifests/")}:
        ref = VersionRef.parse(key)
        need += sum((s, key) not in before for s in place(ref.path_hash, four, 2))
    rc, j = _scrub(config)
    assert need > 0 and (rc, j["manifest_missing"], j["missing"], j["under_replicated"]) == (1, need, 0, 0)
    rc, j = _scrub(config, "--repair")
    assert rc == 0 and j["repaired"] == need
    assert _clean(_scrub(config)[1])
    _assert_reads(config, files)

    three = ("s1", "s2", new)
    config = _config(cfg, three)
    shutil.rmtree(cfg / "stores" / "s0")
    rc, j = _scrub(config)
    assert rc == 1 and j["under_replicated"] > 0 and j["lost"] == 0 and j["missing"] == 0
    rc, j = _scrub(config, "--repair")
    assert rc == 0 and j["repaired"] >= j["under_replicated"] > 0
    assert _clean(_scrub(config)[1])
    relies = 0          # entries that read a copy from a store they do not list
    for path in FILES:
        for e in _entries(config, path):
            reachable = (set(e.stores) & set(three)) | set(place(e.digest, three, 2))
            assert sum(_good(_copy(config, s, e.digest), e.digest) for s in reachable) >= 2, (path, e)
            relies += sum(_good(_copy(config, s, e.digest), e.digest) for s in set(e.stores) & set(three)) < 2
    assert relies > 0
    for key in {k for _, k in _objects(config) if k.startswith("manifests/")}:
        ref = VersionRef.parse(key)
        assert all((cfg / "stores" / s / key).is_file() for s in place(ref.path_hash, three, 2))
    _assert_reads(config, files)
    assert cpfs("cat", "--version", "1", "/tree/a.bin", config=config).stdout == old_a
    m = mount(config)
    for path, data in files.items():
        assert (m.path / path.lstrip("/")).read_bytes() == data, path


async def test_readers_find_copies_on_the_current_placement(tmp_path: Path) -> None:
    """fetch_chunk tries the stores an entry lists, then the chunk's current placement: an entry that
    names only stores that are gone, or that lack the copy, still reads from the placement."""
    pool = StorePool(load_config(str(_config(tmp_path / "cfg"))))
    data = os.urandom(70_000)
    enc = chunkfmt.encode(data)
    placement = place(enc.digest, pool.names, 2)
    for name in placement:
        await pool.put(name, chunkfmt.chunk_key(enc.digest), enc.blob)
    other = next(n for n in pool.names if n not in placement)
    for stores in (("gone",), (other,), ("gone", other)):
        entry = ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, stores)
        assert await pool.fetch_chunk(entry, "drill") == data
    assert pool.replica_statistics().repairs_dropped == 0


async def test_a_voided_copy_is_reported_and_repair_deletes_it(tmp_path: Path) -> None:
    """A failed commit whose copy s0 would not take back: scrub names it as voided (not as a version
    to repair), and --repair deletes it; the file stays at its last committed version throughout."""
    cat, wrappers = faulty_catalog(tmp_path, stores=3)
    v1 = await commit_bytes(cat, "/ckpt.pt", b"good checkpoint")
    for w in wrappers[1:]:
        w.refuse("put", MANIFESTS)
    wrappers[0].refuse("delete", MANIFESTS)
    with pytest.raises(StoreError):
        await commit_bytes(cat, "/ckpt.pt", b"new bytes")
    pool = make_pool(tmp_path, stores=3)
    voided = "00000000000000000002.ab.ok.json"
    report = await Scrubber(pool, Catalog(pool)).run()
    assert report.stats.voided == 1 and voided in version_files(tmp_path, "s0", "/ckpt.pt")
    assert [(p.kind, p.where) for p in report.problems if p.key.endswith(voided)] \
        == [("voided", "/ckpt.pt version 2")]
    report = await Scrubber(pool, Catalog(pool)).run(repair=True)
    assert report.stats.voided == 1 and report.ok
    assert all(voided not in version_files(tmp_path, s, "/ckpt.pt") for s in ("s0", "s1", "s2"))
    assert (await Catalog(pool).get("/ckpt.pt")).chunks == v1.chunks
    assert (await Scrubber(pool, Catalog(pool)).run()).stats.voided == 0


async def repair_races(tmp_path: Path, writer_s1: FaultyStore, keys: str, fail: Callable[[], Awaitable[object]],
                       on_s0: Callable[[], bool]) -> None:
    """Run `fail()` (a commit that fails: s1 refuses its put of `keys`, held until the race is set)
    against a `scrub --repair` that lists its copy on s0 (once `on_s0()`) and whose put of that copy
    on s1 lands only after the writer's take-back."""
    release, reached, failed, scrub_put = trio.Event(), trio.Event(), trio.Event(), trio.Event()
    writer_s1.hold("put", keys, until=release, refuse=True, reached=reached)

    def late_on_s1(store):
        wrapped = FaultyStore(store)
        if store.name == "s1":
            wrapped.hold("put", keys, until=failed, reached=scrub_put)
        return wrapped

    async def failing() -> None:
        with pytest.raises(StoreError):
            await fail()
        failed.set()

    async def scrub() -> None:
        pool = make_pool(tmp_path, stores=2, wrap=late_on_s1)
        await Scrubber(pool, Catalog(pool)).run(repair=True)

    async with trio.open_nursery() as n:
        n.start_soon(failing)
        await reached.wait()
        while not on_s0():
            await trio.sleep(0.01)                   # s0's put may land after s1's is held
        n.start_soon(scrub)
        with trio.fail_after(30):
            await scrub_put.wait()
        release.set()


async def test_a_repair_racing_a_failing_commit_does_not_make_it_current(tmp_path: Path) -> None:
    """Scrub lists a commit's copy on s0 while the commit is failing (s1 refuses it), and puts it on
    s1 after the writer took it back there and on s0. The take-back wrote no twin where every delete
    succeeded, so the copy on s1 counted: a save its writer was told failed became current (a review's
    find). Now the twin comes first, whatever the deletes do."""
    cat, wrappers = faulty_catalog(tmp_path, stores=2, keep=3)
    good = await commit_bytes(cat, "/ckpt.pt", b"good")
    copy = "00000000000000000002.ab.ok.json"
    await repair_races(tmp_path, wrappers[1], MANIFESTS, lambda: commit_bytes(cat, "/ckpt.pt", b"the failed save"),
                       lambda: copy in version_files(tmp_path, "s0", "/ckpt.pt"))
    assert copy in version_files(tmp_path, "s1", "/ckpt.pt")     # the race was run
    other = Catalog(make_pool(tmp_path, stores=2))
    assert (await other.get("/ckpt.pt")).chunks == good.chunks
    assert [(i.ref.version, i.ref.state, i.current) for i in await other.history("/ckpt.pt")][:2] \
        == [(2, "failed", False), (1, "ok", True)]
    pool = make_pool(tmp_path, stores=2)
    again = await Scrubber(pool, Catalog(pool)).run(repair=True)
    assert again.stats.voided == 1 and again.ok
    assert (await Catalog(pool).get("/ckpt.pt")).chunks == good.chunks


# ---- lost chunks, and PATH ------------------------------------------------------------------------

def test_lost_chunk_names_its_file_and_stays_an_error(tmp_path: Path) -> None:
    """A chunk with no good copy anywhere: reported as lost with the file and version that need it,
    exit 1 also after --repair (which still repairs everything else)."""
    config = _config(tmp_path / "cfg")
    _tree(tmp_path, config)
    c = _entries(config, "/tree/sub/c.bin")[0]
    for s in c.stores:
        _copy(config, s, c.digest).unlink()
    b = _entries(config, "/tree/b.bin")[-1]
    _copy(config, b.stores[0], b.digest).write_bytes(b"not a chunk")
    rc, j = _scrub(config)
    assert rc == 1 and j["lost"] == 1 and j["lost_files"] == ["/tree/sub/c.bin version 1 (current)"]
    rc, j = _scrub(config, "--repair")
    assert rc == 1 and j["lost"] == 1 and j["unrepaired"] == 1 and j["repaired"] == 1
    assert _good(_copy(config, b.stores[0], b.digest), b.digest)
    r = cpfs("scrub", config=config, check=False)
    out = r.stdout.decode()
    assert r.returncode == 1 and "/tree/sub/c.bin version 1 (current)" in out and "NOT OK" in out


def test_wrong_block_checks_in_a_manifest_are_reported(tmp_path: Path) -> None:
    """A manifest whose block checks of a chunk do not match the chunk (only a bug writes one): scrub
    names the version, the chunk and the block; the chunk itself is healthy and reads stay right."""
    config = _config(tmp_path / "cfg")
    files = _tree(tmp_path, config)
    copies = {}
    for (store, key), data in _objects(config).items():
        if key.startswith("manifests/") and (m := Manifest.from_bytes(data)).path == "/tree/b.bin":
            copies[(store, key)] = m
    m = next(iter(copies.values()))
    assert len(copies) == 2 and all(c.blocks for c in m.chunks)
    checks = bytearray(m.chunks[1].blocks)
    checks[3] ^= 1
    wrong = dataclasses.replace(m, chunks=[dataclasses.replace(c, blocks=bytes(checks)) if i == 1 else c
                                           for i, c in enumerate(m.chunks)])
    for store, key in copies:
        (config.parent / "stores" / store / key).write_bytes(wrong.to_bytes())
    rc, j = _scrub(config)
    assert rc == 0 and j["block_checks_wrong"] == 1 and j["corrupt"] == 0, j
    (p,) = j["problems"]
    assert (p["what"], p["kind"], p["where"]) == ("manifest", "wrong block checks", "/tree/b.bin version 1 (current)")
    assert p["detail"].startswith(f"chunk {m.chunks[1].digest[:16]}: block(s) 0 of 1")
    out = cpfs("scrub", config=config).stdout.decode()
    assert "1 versions with wrong block checks" in out and "ok: every chunk" in out
    _assert_reads(config, files)


def test_path_limits_the_scrub(tmp_path: Path) -> None:
    """PATH scrubs that file, or the files under that folder, and repairs only those."""
    config = _config(tmp_path / "cfg")
    _tree(tmp_path, config)
    c = _entries(config, "/tree/sub/c.bin")[0]
    bad = _copy(config, c.stores[1], c.digest)
    bad.write_bytes(bad.read_bytes()[:-1])
    rc, j = _scrub(config, "/tree/b.bin")
    assert rc == 0 and (j["manifests"], j["versions"], j["chunks"]) == (1, 1, 4)
    rc, j = _scrub(config, "--repair", "/tree/a.bin")
    assert rc == 0 and (j["manifests"], j["versions"], j["chunks"], j["repaired"]) == (1, 2, 5, 0)
    assert not _good(bad, c.digest)
    rc, j = _scrub(config, "/tree/sub")
    assert rc == 1 and (j["manifests"], j["chunks"], j["corrupt"]) == (1, 1, 1)
    rc, j = _scrub(config, "/tree")
    assert rc == 1 and (j["manifests"], j["versions"], j["chunks"], j["corrupt"]) == (3, 4, 9, 1)
    rc, j = _scrub(config, "--repair", "/tree/sub/")
    assert rc == 0 and j["repaired"] == 1 and _good(bad, c.digest)
    assert _scrub(config, "/")[0] == 0


def test_a_manifest_copy_whose_bits_rotted_is_found_and_repaired(tmp_path: Path) -> None:
    """One bit flipped in a chunk's name in one manifest copy: it still parses, but fails its check
    (cpfs/manifest.py), so scrub reports that copy corrupt and --repair rewrites it from the intact one.
    Before the checks scrub took it for a good copy."""
    config = _config(tmp_path / "cfg")
    files = _tree(tmp_path, config)
    c = _entries(config, "/tree/sub/c.bin")[0]
    store, key = next(k for k in _objects(config) if k[1].startswith(f"manifests/{path_hash('/tree/sub/c.bin')}/"))
    path = config.parent / "stores" / store / key
    raw = bytearray(path.read_bytes())
    at = raw.index(c.digest.encode()) + next(i for i, ch in enumerate(c.digest) if ch.isdigit())   # x ^ 1: a digit
    raw[at] ^= 1
    path.write_bytes(raw)
    assert json.loads(bytes(raw).split(b"\n")[1])["chunks"][0][0] != c.digest
    rc, j = _scrub(config)
    assert rc == 1 and j["manifest_corrupt"] == 1
    assert {(p["what"], p["kind"], p["store"], p["key"]) for p in j["problems"]} >= {("manifest", "corrupt", store, key)}
    rc, j = _scrub(config, "--repair")
    assert rc == 0 and j["repaired"] == 1
    other = next(s for s, k in _objects(config) if k == key and s != store)
    assert path.read_bytes() == (config.parent / "stores" / other / key).read_bytes()
    _assert_reads(config, files)


async def test_a_folder_renames_transaction_record_is_scrubbed_and_repaired(tmp_path: Path) -> None:
    """A folder rename is one transaction: its versions count while its record can be read. Two
    stores holding the record replaced one after the other, each followed by `scrub --repair`: the
    scrub reports the record's missing copy and restores it on the record's placement, and the renamed
    files still read. Unscrubbed, the record went with the second store, the rename's versions stopped
    counting (the files were gone from every listing) and gc deleted them as never committed (an
    audit's find)."""
    config = _config(tmp_path / "cfg")
    rng = random.Random(3)
    files = {name: rng.randbytes(300_000) for name in ("a.bin", "b.bin")}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        cpfs("put", str(tmp_path / name), f"/run/tmp/{name}", config=config)
    pool = StorePool(load_config(config))
    await pool.check()
    catalog = Catalog(pool)
    old = [await catalog.get(f"/run/tmp/{name}") for name in files]
    await catalog.transact([dataclasses.replace(m, path=m.path.replace("/tmp/", "/step_1/")) for m in old], old)
    stores = config.parent / "stores"
    holders = sorted(p.parts[-3] for p in stores.glob("*/txns/*.json"))
    assert len(holders) == 2
    for store in holders:
        shutil.rmtree(stores / store)               # its disk replaced
        (stores / store).mkdir()
        rc, j = _scrub(config, "--repair")
        assert rc == 0 and j["record_missing"] == 1 and j["records"] == 1, j
        assert len(list(stores.glob("*/txns/*.json"))) == 2
    rc, j = _scrub(config)
    assert rc == 0 and _clean(j) and j["record_missing"] == 0, j
    _assert_reads(config, {f"/run/step_1/{name}": data for name, data in files.items()})
