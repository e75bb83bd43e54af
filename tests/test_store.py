"""The store contract over every kind and wrapper (tests/storekinds.py), the folder store's own
guarantees, the simulated link (ThrottledStore), store tables and the kind registry, and the StorePool's
replica fallback, listing and dedup, all on real folders under tmp_path."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from cpfs import chunk as chunkfmt
from cpfs.config import parse_config
from cpfs.errors import ChunkUnavailable, ConfigError, NoSuchObject, StoreError, StoreUnavailable
from cpfs.manifest import ChunkEntry
from cpfs.placement import place
from cpfs.pool import CLOCK_KEY, StorePool
from cpfs.store import (DirectoryStore, FaultyStore, MeteredStore, Store, StoreWrapper, ThrottledStore, open_store,
                        registry)
from cpfs.store.metered import FETCH_SAMPLES
from cpfs.store.directory import TMP_SUFFIX
from cpfs.store.s3 import S3Store
from tests.storekinds import STORE_FACTORIES, folder_without_o_direct


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _temps(root: Path) -> list[str]:
    return [f for f in _files(root) if f.endswith(TMP_SUFFIX)]


# ---- the store contract, over every kind and wrapper -------------------------------------------------

@pytest.fixture(params=STORE_FACTORIES)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    async with request.param(tmp_path, "s0") as s:
        await s.check()
        yield s


async def test_contract_get_put_head_exists_delete(store: Store) -> None:
    """Objects round-trip byte for byte (empty ones too); head is the size; delete of an absent key is
    fine; every read of an absent key is NoSuchObject naming the store."""
    assert await store.list("") == []
    for op in (store.get("chunks/ab/missing"), store.head("chunks/ab/missing"),
               store.get_range("chunks/ab/missing", 0, 10)):
        with pytest.raises(NoSuchObject) as e:
            await op
        assert e.value.store == "s0" and "s0" in str(e.value) and not e.value.transient
    assert not await store.exists("chunks/ab/missing")

    payload = os.urandom(300_000)
    await store.put("chunks/ab/ab01", payload)
    await store.put("chunks/ab/ab02", memoryview(b"two"))
    await store.put("chunks/cd/cd01", b"")
    assert await store.get("chunks/ab/ab01") == payload
    assert await store.get("chunks/ab/ab02") == b"two"
    assert await store.get("chunks/cd/cd01") == b""
    assert [await store.head(k) for k in ("chunks/ab/ab01", "chunks/ab/ab02", "chunks/cd/cd01")] == [300_000, 3, 0]
    assert await store.exists("chunks/ab/ab01") and await store.exists("chunks/cd/cd01")
    assert not await store.exists("chunks/ab")           # a "folder" of keys is not an object

    await store.delete("chunks/ab/ab01")
    await store.delete("chunks/ab/ab01")                 # absent: not an error
    assert not await store.exists("chunks/ab/ab01")
    with pytest.raises(NoSuchObject):
        await store.get("chunks/ab/ab01")
    assert await store.list("chunks/") == ["chunks/ab/ab02", "chunks/cd/cd01"]


async def test_contract_get_many_with(store: Store) -> None:
    """A batch read gives each key's fn(object) in order, and a missing key its NoSuchObject in its
    place without failing the others; the same bytes as get."""
    limiter = trio.CapacityLimiter(2)
    payloads = {f"chunks/ab/ab0{i}": os.urandom(1000 * (i + 1)) for i in range(4)}
    for k, v in payloads.items():
        await store.put(k, v)
    keys = [*payloads, "chunks/ab/missing"]
    got = await store.get_many_with([(k, lambda data, k=k: (k, bytes(data))) for k in keys], limiter)
    assert got[:4] == list(payloads.items())
    assert isinstance(got[4], NoSuchObject) and got[4].store == "s0"


async def test_contract_get_range(store: Store) -> None:
    """get_range returns exactly the asked bytes, short at the end, empty past it; get_range_with and
    get_with hand them to a function in a worker thread."""
    data = os.urandom(100_000)
    await store.put("k/r", data)
    assert await store.get_range("k/r", 0, 32) == data[:32]
    assert await store.get_range("k/r", 12_345, 54_321) == data[12_345:12_345 + 54_321]
    assert await store.get_range("k/r", 99_990, 100) == data[99_990:]
    assert await store.get_range("k/r", 100_000, 10) == b""
    assert await store.get_range("k/r", 5, 0) == b""

    # get_range_with: fn gets the same bytes, in a worker thread; what it raises comes out as it is.
    limiter = trio.CapacityLimiter(2)
    seen: list[int] = []

    def fn(view: bytes | memoryview) -> bytes:
        seen.append(threading.get_ident())
        return bytes(view)
    assert await store.get_range_with("k/r", 12_345, 54_321, fn, limiter) == data[12_345:12_345 + 54_321]
    assert await store.get_range_with("k/r", 99_990, 100, fn, limiter) == data[99_990:]
    assert threading.get_ident() not in seen and len(seen) == 2

    def refuse(view: bytes | memoryview) -> None:
        raise ValueError(len(view))
    with pytest.raises(ValueError, match="32"):
        await store.get_range_with("k/r", 0, 32, refuse, limiter)
    with pytest.raises(NoSuchObject):
        await store.get_range_with("k/missing", 0, 32, fn, limiter)
    assert await store.get_range_with("k/r", 5, 0, fn, limiter) == b""

    # get_with: the same for the whole object (what a chunk read does: decode and check it).
    assert await store.get_with("k/r", fn, limiter) == data and len(seen) == 4
    assert threading.get_ident() not in seen
    with pytest.raises(ValueError, match="100000"):
        await store.get_with("k/r", refuse, limiter)
    with pytest.raises(NoSuchObject):
        await store.get_with("k/missing", fn, limiter)


async def test_contract_list_is_sorted_and_paged(store: Store) -> None:
    """list is one sorted page after start_after; keys sort as strings ("a-b" < "a.c" < "a/b")."""
    keys = ["a/c/d", "b", "a-b", "a/b", "a.c", "manifests/m1.json", "a/c/e"]
    for k in keys:
        await store.put(k, k.encode())
    everything = sorted(keys)
    assert everything == ["a-b", "a.c", "a/b", "a/c/d", "a/c/e", "b", "manifests/m1.json"]
    assert await store.list("") == everything
    assert await store.list("a") == everything[:5]
    assert await store.list("a/") == ["a/b", "a/c/d", "a/c/e"]
    assert await store.list("a/c") == ["a/c/d", "a/c/e"]
    assert await store.list("manifests/") == ["manifests/m1.json"]
    assert await store.list("nothing/here/") == []
    pages, after = [], ""
    while True:
        page = await store.list("", start_after=after, limit=2)
        pages.append(page)
        if len(page) < 2:
            break
        after = page[-1]
    assert pages == [everything[0:2], everything[2:4], everything[4:6], everything[6:]]
    assert await store.list("a", start_after="a.c", limit=10) == ["a/b", "a/c/d", "a/c/e"]
    assert await store.list("a/", start_after="a/c/d") == ["a/c/e"]
    assert await store.list("a/", start_after="zzz") == []


async def test_contract_overwrite_is_atomic(store: Store) -> None:
    """A put replaces the object whole; concurrent puts of one key leave exactly one of them."""
    await store.put("k/same", b"old")
    await store.put("k/same", b"replaced")
    assert await store.get("k/same") == b"replaced"
    payloads = [bytes([i]) * (50_000 + i) for i in range(8)]

    async def put(data: bytes) -> None:
        try:
            await store.put("k/same", data)
        except StoreError as e:      # allowed, if transient (the pool retries): moto answers 500 at times
            assert e.transient, e

    async with trio.open_nursery() as n:
        for data in payloads:
            n.start_soon(put, data)
    assert await store.get("k/same") in payloads
    assert await store.list("k/") == ["k/same"]


async def test_contract_put_new_writes_only_a_new_key(store: Store) -> None:
    """put_new writes a key no object has (True) and leaves an existing object as it is (False); of
    writers racing on a new key exactly one lands, and it is the one that says True (the deployment's
    identity is minted that way: cpfs/identity.py)."""
    assert await store.put_new("k/one", b"first")
    assert not await store.put_new("k/one", b"second")
    assert await store.get("k/one") == b"first"
    payloads = [bytes([i]) * (50_000 + i) for i in range(8)]
    wrote: list[bytes] = []

    async def put_new(data: bytes) -> None:
        try:
            if await store.put_new("k/race", data):
                wrote.append(data)
        except StoreError as e:      # allowed, if transient (the pool retries): moto answers 409/500 at times
            assert e.transient, e

    async with trio.open_nursery() as n:
        for data in payloads:
            n.start_soon(put_new, data)
    landed = await store.get("k/race")
    assert landed in payloads and wrote in ([landed], [])
    assert await store.list("k/") == ["k/one", "k/race"]
    if (root := _folder_root(store)) is not None:
        assert _temps(root) == []


CLOCK_SLACK = 2.0       # seconds: S3 keeps LastModified to the second


def _folder_root(store: Store) -> Path | None:
    """The folder under a folder store (wrapped or not), to age its files; None for other kinds."""
    inner = store.innermost() if isinstance(store, StoreWrapper) else store
    return inner.root if isinstance(inner, DirectoryStore) else None


async def test_contract_every_object_has_an_age(store: Store) -> None:
    """stat and list_info give each object's size and mtime (the store's clock, here this host's);
    list_info pages like list; a folder of keys is no object; there are no temporary leftovers to list."""
    t0 = time.time()
    for key, data in (("chunks/ab/ab01", b"x" * 1000), ("chunks/ab/ab02", b""), ("chunks/cd/cd01", b"yy")):
        await store.put(key, data)
    info = await store.stat("chunks/ab/ab01")
    assert (info.key, info.size) == ("chunks/ab/ab01", 1000)
    assert t0 - CLOCK_SLACK <= info.mtime <= time.time() + CLOCK_SLACK
    for key in ("chunks/ab/missing", "chunks/ab"):
        with pytest.raises(NoSuchObject) as e:
            await store.stat(key)
        assert e.value.store == "s0"
    infos = await store.list_info("chunks/")
    assert [(i.key, i.size) for i in infos] == [("chunks/ab/ab01", 1000), ("chunks/ab/ab02", 0), ("chunks/cd/cd01", 2)]
    assert all(t0 - CLOCK_SLACK <= i.mtime <= time.time() + CLOCK_SLACK for i in infos)
    assert [i.key for i in await store.list_info("chunks/", start_after="chunks/ab/ab01", limit=1)] == ["chunks/ab/ab02"]
    assert [i.key for i in await store.list_info("chunks/c")] == ["chunks/cd/cd01"]
    assert await store.list_info("nothing/") == []
    assert await store.list_temporary("") == []


async def test_contract_touch_and_delete_if_older(store: Store) -> None:
    """touch renews an object's mtime and keeps its bytes; delete_if_older deletes only an object older
    than asked, and says whether it did; both take absent keys (NoSuchObject, False)."""
    await store.put("chunks/ab/ab01", b"payload")
    root = _folder_root(store)
    if root is not None:                  # a folder's files can be aged; an S3 object cannot
        old = time.time() - 7200
        os.utime(root / "chunks/ab/ab01", (old, old))
        assert (await store.stat("chunks/ab/ab01")).mtime == pytest.approx(old)
    before = time.time()
    await store.touch("chunks/ab/ab01")
    info = await store.stat("chunks/ab/ab01")
    assert info.mtime >= before - CLOCK_SLACK and info.size == 7
    assert await store.get("chunks/ab/ab01") == b"payload"
    with pytest.raises(NoSuchObject):
        await store.touch("chunks/ab/missing")

    assert not await store.delete_if_older("chunks/ab/ab01", time.time() - 3600)      # younger: kept
    assert await store.get("chunks/ab/ab01") == b"payload"
    assert await store.delete_if_older("chunks/ab/ab01", time.time() + 3600)
    assert not await store.exists("chunks/ab/ab01")
    assert not await store.delete_if_older("chunks/ab/ab01", time.time() + 3600)      # absent
    assert await store.list("") == [] and await store.list_temporary("") == []


# ---- DirectoryStore -------------------------------------------------------------------------------------

async def test_directory_store_objects_are_files(tmp_path: Path) -> None:
    """A key is a file of the same path under the folder; folders of keys are no objects."""
    store = DirectoryStore("d0", tmp_path / "d0")
    await store.put("chunks/ab/ab01", b"one")
    assert (tmp_path / "d0" / "chunks" / "ab" / "ab01").read_bytes() == b"one"
    assert await store.list("chunk") == ["chunks/ab/ab01"]
    with pytest.raises(NoSuchObject):
        await store.head("chunks/ab")


async def test_a_folder_that_refuses_o_direct_is_read_through_the_page_cache(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Chunk reads open with O_DIRECT where the folder's filesystem takes it. ramfs refuses it at the
    open: the store says so once and reads every object after through the page cache, alone and in a
    batch, with the bytes put (the contract suite runs over this kind too: `folder-no-odirect`)."""
    caplog.set_level(logging.INFO, logger="cpfs.store.directory")
    async with folder_without_o_direct(tmp_path, "s0") as store:
        payloads = {f"chunks/ab/ab{i:02}": os.urandom(100_000 + 4097 * i) for i in range(6)}
        for k, v in payloads.items():
            await store.put(k, v)
        limiter = trio.CapacityLimiter(2)
        assert [await store.get_with(k, bytes, limiter) for k in payloads] == list(payloads.values())
        assert await store.get_many_with([(k, bytes) for k in payloads], limiter) == list(payloads.values())
    refused = [r for r in caplog.records if "O_DIRECT opens refused" in r.getMessage()]
    assert len(refused) == 1 and "'s0'" in refused[0].getMessage()


class RefusesDirectReads(DirectoryStore):
    """A folder whose filesystem takes O_DIRECT opens but refuses the reads (EINVAL), as one that wants
    a larger alignment than a page would; after 50 ms, so that reads in several threads all open their
    files with O_DIRECT before the first refusal."""

    def _fill(self, fd: int, into: memoryview, size: int, direct: bool) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            time.sleep(0.05)
            raise OSError(errno.EINVAL, "Invalid argument")
        return super()._fill(fd, into, size, direct)


@pytest.mark.parametrize("first", ["alone", "batch", "together"])
async def test_a_folder_that_refuses_o_direct_reads_after_the_open_is_read_through_the_page_cache(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, first: str) -> None:
    """The refusal comes at the read, not the open: that read is made again through the page cache (a
    read alone, or a batch's), the store says so once, and every read after goes that way. So are the
    reads opened with O_DIRECT before the first refusal: the rest of the batch (they failed with EINVAL
    once the first had turned O_DIRECT off), and reads in other threads."""
    caplog.set_level(logging.INFO, logger="cpfs.store.directory")
    store = RefusesDirectReads("s0", tmp_path / "s0", trio.CapacityLimiter(6))
    payloads = {f"chunks/ab/ab{i:02}": os.urandom(100_000 + 4097 * i) for i in range(6)}
    for k, v in payloads.items():
        await store.put(k, v)
    limiter = trio.CapacityLimiter(6)
    reads = [(k, bytes) for k in payloads]
    if first == "batch":
        assert await store.get_many_with(reads, limiter) == list(payloads.values())
    elif first == "together":
        got: dict[str, bytes] = {}

        async def one(k: str) -> None:
            got[k] = await store.get_with(k, bytes, limiter)
        async with trio.open_nursery() as n:
            for k in payloads:
                n.start_soon(one, k)
        assert got == payloads
    assert [await store.get_with(k, bytes, limiter) for k in payloads] == list(payloads.values())
    assert await store.get_many_with(reads, limiter) == list(payloads.values())
    refused = [r for r in caplog.records if "O_DIRECT reads refused" in r.getMessage()]
    assert len(refused) == 1 and "'s0'" in refused[0].getMessage()


async def test_puts_leave_no_temp_files(tmp_path: Path) -> None:
    """Many concurrent puts, also of the same key, leave only final objects, each one whole."""
    store = DirectoryStore("d0", tmp_path / "d0", trio.CapacityLimiter(8))
    payloads = {i: bytes([i]) * (100_000 + i) for i in range(16)}
    async with trio.open_nursery() as n:
        for i, data in payloads.items():
            n.start_soon(store.put, f"k/{i}", data)
            n.start_soon(store.put, "k/same", data)
    assert _temps(tmp_path / "d0") == []
    assert await store.list("k/") == sorted([f"k/{i}" for i in payloads] + ["k/same"])
    assert await store.get("k/same") in payloads.values()
    for i, data in payloads.items():
        assert await store.get(f"k/{i}") == data


async def test_failed_write_keeps_old_object(tmp_path: Path) -> None:
    """A put whose write fails inside the worker thread (the file size limit: EFBIG) leaves the old
    object and no temp file."""
    store = DirectoryStore("d0", tmp_path / "d0")
    await store.put("chunks/ab/x", b"old contents")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))   # Python ignores SIGXFSZ: write fails
    try:
        with pytest.raises(StoreError, match="d0") as e:
            await store.put("chunks/ab/x", os.urandom(1 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not isinstance(e.value, NoSuchObject)
    assert await store.get("chunks/ab/x") == b"old contents"
    assert _files(tmp_path / "d0") == ["chunks/ab/x"]


async def test_failed_rename_leaves_no_temp_file(tmp_path: Path) -> None:
    """A put whose rename fails (a non-empty folder sits at the key) raises and removes its temp file."""
    store = DirectoryStore("d0", tmp_path / "d0")
    await store.put("k/x/inner", b"inner")
    with pytest.raises(StoreError, match="d0"):
        await store.put("k/x", b"cannot replace a folder")
    assert _files(tmp_path / "d0") == ["k/x/inner"]


async def test_vanished_folder_is_unavailable_not_missing(tmp_path: Path) -> None:
    """Once the folder has existed, its disappearance (an unmounted export) makes requests fail as a
    transient StoreUnavailable, never as 'no such object' or an empty listing."""
    root = tmp_path / "d0"
    root.mkdir()
    store = DirectoryStore("d0", root)
    await store.put("k/a", b"x")
    root.rename(tmp_path / "elsewhere")
    for op in (store.get("k/a"), store.head("k/a"), store.exists("k/a"), store.list("k/"), store.check(),
               store.put("k/b", b"y")):
        with pytest.raises(StoreUnavailable) as e:
            await op
        assert e.value.transient
    assert not root.exists()


@pytest.mark.parametrize("key", ["../escape", "/etc/passwd", "a/../../b", "chunks/..", "", "a\0b"])
async def test_bad_keys_refused(tmp_path: Path, key: str) -> None:
    """Keys that could leave the store's folder are refused by every operation; nothing is written."""
    (tmp_path / "d0").mkdir()
    (tmp_path / "outside").write_bytes(b"secret")
    store = DirectoryStore("d0", tmp_path / "d0")
    with pytest.raises(StoreError, match="invalid key"):
        await store.put(key, b"x")
    with pytest.raises(StoreError, match="invalid key"):
        await store.get(key)
    with pytest.raises(StoreError, match="invalid key"):
        await store.exists(key)
    with pytest.raises(StoreError, match="invalid key"):
        await store.delete(key)
    with pytest.raises(StoreError, match="invalid key"):
        await store.head(key)
    with pytest.raises(StoreError, match="invalid key"):
        await store.get_range(key, 0, 1)
    assert (tmp_path / "outside").read_bytes() == b"secret"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d0", "outside"]
    assert _files(tmp_path / "d0") == []


@pytest.mark.parametrize("prefix", ["../", "/", "a/../../", ".."])
async def test_list_refuses_escaping_prefix(tmp_path: Path, prefix: str) -> None:
    """list() never walks outside the store's folder."""
    (tmp_path / "outside").write_bytes(b"secret")
    store = DirectoryStore("d0", tmp_path / "d0")
    await store.put("a/b", b"x")
    with pytest.raises(StoreError, match="invalid"):
        await store.list(prefix)


async def test_temporary_files_are_listed_apart_and_reaped_by_age(tmp_path: Path) -> None:
    """What a crashed put leaves (a temporary file beside its key) is never an object (list, list_info),
    list_temporary shows it with its age, and delete_if_older removes it once it is old enough."""
    store = DirectoryStore("d0", tmp_path / "d0")
    await store.put("chunks/ab/ab01", b"done")
    folder = tmp_path / "d0" / "chunks" / "ab"
    (folder / f"ab02.1234{TMP_SUFFIX}").write_bytes(b"crashed")
    (folder / f"ab03.5678{TMP_SUFFIX}").write_bytes(b"in progress")
    old = time.time() - 7200
    os.utime(folder / f"ab02.1234{TMP_SUFFIX}", (old, old))
    assert await store.list("") == ["chunks/ab/ab01"]
    assert [i.key for i in await store.list_info("")] == ["chunks/ab/ab01"]
    temps = await store.list_temporary("")
    assert [(i.key, i.size) for i in temps] == [(f"chunks/ab/ab02.1234{TMP_SUFFIX}", 7),
                                                 (f"chunks/ab/ab03.5678{TMP_SUFFIX}", 11)]
    assert temps[0].mtime == pytest.approx(old)
    cutoff = time.time() - 3600
    assert [await store.delete_if_older(i.key, cutoff) for i in temps] == [True, False]
    assert _files(tmp_path / "d0") == ["chunks/ab/ab01", f"chunks/ab/ab03.5678{TMP_SUFFIX}"]


async def test_check(tmp_path: Path) -> None:
    """check() passes for a usable folder (without creating anything) and names an unusable one."""
    await DirectoryStore("fresh", tmp_path / "not" / "yet").check()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_bytes(b"")
    for root in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(StoreUnavailable, match=r"store 'bad'.*" + str(tmp_path / "file")) as e:
            await DirectoryStore("bad", root).check()
        assert not e.value.transient          # a configuration error: retrying will not help
    assert _files(tmp_path) == ["file"]


# ---- ThrottledStore -------------------------------------------------------------------------------------

async def _filled(tmp_path: Path, n: int, size: int) -> DirectoryStore:
    inner = DirectoryStore("remote", tmp_path / "remote", trio.CapacityLimiter(16))
    for i in range(n):
        await inner.put(f"k/{i}", bytes([i]) * size)
    return inner


async def test_throttled_latency_overlaps(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """8 concurrent gets with 10 ms latency take ~10 ms in all, not 80 ms; a lone get takes 10 ms."""
    store = ThrottledStore(await _filled(tmp_path, 8, 1000), latency=0.010)
    t0 = trio.current_time()
    assert await store.get("k/0") == bytes([0]) * 1000
    assert trio.current_time() - t0 == pytest.approx(0.010, abs=1e-6)
    got = {}

    async def one(i: int) -> None:
        got[i] = await store.get(f"k/{i}")

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(one, i)
    assert trio.current_time() - t0 == pytest.approx(0.010, abs=1e-6)
    assert got == {i: bytes([i]) * 1000 for i in range(8)}


async def test_throttled_bandwidth_is_shared(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """Two concurrent 1 MiB gets over a 1 MiB/s link take ~2 s: transfers queue on the link."""
    store = ThrottledStore(await _filled(tmp_path, 2, 1 << 20), latency=0.001, bandwidth=float(1 << 20))
    done = []

    async def one(i: int) -> None:
        assert await store.get(f"k/{i}") == bytes([i]) * (1 << 20)
        done.append(trio.current_time() - t0)

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(one, 0)
        n.start_soon(one, 1)
    assert sorted(done) == [pytest.approx(1.0, abs=0.01), pytest.approx(2.0, abs=0.01)]
    t0 = trio.current_time()                     # the link is idle again: one get takes 1 s
    await one(0)
    assert done[-1] == pytest.approx(1.0, abs=0.01)


async def test_metered_store_keeps_the_slowest_fetch_the_quantiles_forget(tmp_path: Path,
                                                                         autojump_clock: trio.abc.Clock) -> None:
    """A 5 s stall of one get and a 7 s one of a batch read, then a few hundred 1 ms fetches: the stalls have
    left the p50/p99 window (and would be under its p99 anyway), but `latency_max` still shows the worst,
    so a slow load can be told after the fact."""
    link = ThrottledStore(await _filled(tmp_path, 2, 100), latency=5.0)
    store = MeteredStore(link)
    await store.get("k/0")
    assert store.statistics().latency_max == pytest.approx(5.0, abs=1e-3)
    link.latency = 7.0
    got = await store.get_many_with([("k/0", bytes), ("k/1", bytes)], trio.CapacityLimiter(2))
    assert got == [bytes([0]) * 100, bytes([1]) * 100]
    link.latency = 0.001
    for _ in range(FETCH_SAMPLES + 10):
        await store.get("k/0")
    st = store.statistics()
    assert st.latency_p50 == pytest.approx(0.001, abs=1e-4) and st.latency_p99 == pytest.approx(0.001, abs=1e-4)
    assert st.latency_max == pytest.approx(7.0, abs=1e-3)


async def test_metered_store_counts_no_such_object_apart_from_failures(tmp_path: Path) -> None:
    """A save probes every new chunk's key before its put, and a read may ask a replica not yet written:
    "no such object" is an answer, counted in `missing`; only real failures (here a refused get, single
    and in a batch) count as `errors`, which an operator alerts on."""
    faulty = FaultyStore(await _filled(tmp_path, 2, 100))
    store = MeteredStore(faulty)
    for op in (store.get("absent"), store.head("absent"), store.stat("absent")):
        with pytest.raises(NoSuchObject):
            await op
    got = await store.get_many_with([("k/0", bytes), ("absent", bytes)], trio.CapacityLimiter(2))
    assert got[0] == bytes([0]) * 100 and isinstance(got[1], NoSuchObject)
    st = store.statistics()
    assert (st.requests, st.missing, st.errors) == (5, 4, 0)
    faulty.refuse("get", "k/1")
    with pytest.raises(StoreError) as refused:
        await store.get("k/1")
    assert not isinstance(refused.value, NoSuchObject)
    got = await store.get_many_with([("k/0", bytes), ("k/1", bytes)], trio.CapacityLimiter(2))
    assert got[0] == bytes([0]) * 100 and isinstance(got[1], StoreError)
    st = store.statistics()
    assert (st.requests, st.missing, st.errors) == (8, 4, 2)


async def test_a_folder_store_lists_thousands_of_paths_in_one_request(tmp_path: Path) -> None:
    """manifests/ holds a folder per path. The pool lists a folder store in requests of its list_limit
    (100,000 keys), each of which scans the folders on its way again: in S3's pages of 1000, listing
    N paths scanned manifests/ N/1000 times (80,000 paths: 17.7 s for one store, an audit's find). Wrapped
    stores (a simulated link) list in the same requests; an S3 store keeps pages of 1000."""
    cfg = parse_config('replicas = 1\n[[store]]\nname = "a"\nurl = "a"\n'
                       '[[store]]\nname = "b"\nurl = "b"\nlatency = "1ms"\n', "test.toml", tmp_path)
    keys = sorted(f"manifests/{i:040x}/{1:020d}.ab.ok.json" for i in range(2500))
    for name in "ab":
        for k in keys:
            (tmp_path / name / k).parent.mkdir(parents=True)
            (tmp_path / name / k).write_bytes(b"{}")
    pool = StorePool(cfg)
    for i, name in enumerate("ab"):
        before = pool.statistics()[i].requests
        assert await pool.list_keys(name, "manifests/") == keys
        assert pool.statistics()[i].requests - before == 1
    assert S3Store.list_limit == 1000


async def test_open_store_builds_the_stack(tmp_path: Path) -> None:
    """A [[store]] table gets its kind, wrapped in a ThrottledStore if it simulates a link and in a
    FaultyStore if a drill is on; plain tables get the bare kind."""
    cfg = parse_config('replicas = 1\n[store_defaults]\ntimeout = "5s"\n'
                       '[[store]]\nname = "a"\nurl = "a"\n'
                       '[[store]]\nname = "b"\nurl = "b"\nlatency = "5ms"\nbandwidth = "300MiB/s"\nconcurrency = 3\n'
                       '[[store]]\nname = "c"\nurl = "c"\nerror_rate = 0.25\ncorrupt_rate = 0.5\nfault_seed = 7\n'
                       'latency = "1ms"\ntimeout = "250ms"\n', "test.toml", tmp_path)
    a, b, c = (open_store(s) for s in cfg.stores)
    assert isinstance(a, DirectoryStore) and a.root == tmp_path / "a"
    assert isinstance(b, ThrottledStore) and b.latency == 0.005
    assert b.link is not None and b.link.bandwidth == 300 * 1024**2
    assert isinstance(b.inner, DirectoryStore) and b.inner.limiter.total_tokens == 3
    assert isinstance(c, FaultyStore) and (c.error_rate, c.corrupt_rate, c.down, c.hang) == (0.25, 0.5, False, False)
    assert isinstance(c.inner, ThrottledStore) and isinstance(c.innermost(), DirectoryStore)
    assert [s.timeout for s in cfg.stores] == [5.0, 5.0, 0.25]


# ---- store tables and the kind registry -------------------------------------------------------------------

def _one_store(tmp_path: Path, table: str) -> str:
    return f'replicas = 1\n[[store]]\nname = "s"\n{table}\n'


@pytest.mark.parametrize("table, key, what", [
    ('url = "a"\nerror_rate = 1.5', "store 's'.error_rate", "between 0 and 1"),
    ('url = "a"\ncorrupt_rate = "often"', "store 's'.corrupt_rate", "between 0 and 1"),
    ('url = "a"\ndown = "yes"', "store 's'.down", "true or false"),
    ('url = "a"\nhang = 1', "store 's'.hang", "true or false"),
    ('url = "a"\nfault_seed = 1.5', "store 's'.fault_seed", "integer"),
    ('url = "a"\ntimeout = "soon"', "store 's'.timeout", "duration"),
    ('url = "a"\ntimeout = 0', "store 's'.timeout", "more than 0"),
    ('url = "a"\nendpoint = "http://x"', "store[0].endpoint", "unknown key (for a dir store)"),
    ('url = "ftp://host/x"', "store 's'.url", "unsupported scheme"),
])
def test_store_table_errors_name_the_key(tmp_path: Path, table: str, key: str, what: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(_one_store(tmp_path, table), "test.toml", tmp_path)
    assert str(e.value).startswith(f"test.toml: {key}: ") and what in str(e.value)


@pytest.mark.parametrize("entry, why", [("cpfs.store.no_such_module:S3Store", "cannot be imported"),
                                        ("cpfs.store.base:NoSuchClass", "has no NoSuchClass"),
                                        ("cpfs.store.base:Store", "is not a store kind yet")])
def test_unavailable_kind_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            entry: str, why: str) -> None:
    """An s3:// store whose module is missing or not ready is a ConfigError on its url, not a crash."""
    monkeypatch.setitem(registry.KINDS, "s3", entry)
    with pytest.raises(ConfigError) as e:
        parse_config(_one_store(tmp_path, 'url = "s3://bucket/prefix"'), "test.toml", tmp_path)
    assert str(e.value).startswith("test.toml: store 's'.url: s3 stores are not supported yet") and why in str(e.value)


class FlavouredStore(DirectoryStore):
    """A kind registered by the test: a folder with one option of its own."""

    kind = "flavoured"
    option_keys = frozenset({"flavour"})

    @classmethod
    def parse_options(cls, url, raw, ctx):
        flavour = ctx.convert("flavour", str, raw.get("flavour", "plain"))
        if flavour not in ("plain", "salted"):
            raise ctx.fail("flavour", f"expected 'plain' or 'salted', got {flavour!r}")
        return {"path": ctx.base / url.split("://", 1)[1], "flavour": flavour}

    @classmethod
    def from_config(cls, cfg):
        store = cls(cfg.name, cfg.options["path"], trio.CapacityLimiter(cfg.concurrency))
        store.flavour = cfg.options["flavour"]
        return store


async def test_registered_kind_parses_its_own_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind adds its own [[store]] keys and validates them with errors naming the key; the common keys
    still apply to it, and open_store builds it."""
    monkeypatch.setitem(registry.KINDS, "flavoured", FlavouredStore)
    monkeypatch.setitem(registry.SCHEMES, "flav", "flavoured")
    cfg = parse_config(_one_store(tmp_path, 'url = "flav://x"\nflavour = "salted"\nconcurrency = 2\nlatency = "1ms"'),
                       "test.toml", tmp_path)
    [sc] = cfg.stores
    assert (sc.kind, sc.options["flavour"], sc.concurrency, sc.latency) == ("flavoured", "salted", 2, 0.001)
    store = open_store(sc)
    assert isinstance(store, ThrottledStore) and store.inner.flavour == "salted" and store.inner.root == tmp_path / "x"
    await store.put("k", b"v")
    assert await store.get("k") == b"v"
    with pytest.raises(ConfigError, match=r"test.toml: store 's'.flavour: expected 'plain' or 'salted'"):
        parse_config(_one_store(tmp_path, 'url = "flav://x"\nflavour = "sour"'), "test.toml", tmp_path)
    with pytest.raises(ConfigError, match=r"store\[0\].endpoint: unknown key \(for a flavoured store\)"):
        parse_config(_one_store(tmp_path, 'url = "flav://x"\nendpoint = "e"'), "test.toml", tmp_path)


# ---- StorePool ------------------------------------------------------------------------------------------

async def test_pool_works_over_every_kind(store: Store, tmp_path: Path) -> None:
    """The pool's chunk path and paged listing over one store of each kind and wrapper."""
    pool = StorePool(parse_config('replicas = 1\n[[store]]\nname = "s0"\nurl = "unused"\n', "t.toml", tmp_path),
                     stores=[store])
    data = os.urandom(200_000)
    enc = chunkfmt.encode(data)
    assert (await pool.store_chunk(enc, ["s0"], quorum=1))[:2] == (["s0"], True)
    entry = ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, ("s0",))
    assert await pool.fetch_chunk(entry, "file f offset 0 chunk 0") == data
    assert (await pool.store_chunk(enc, ["s0"], quorum=1))[:2] == (["s0"], False)
    keys = [f"manifests/{i:03d}" for i in range(7)]
    assert await pool.put_quorum(["s0"], keys[0], b"m", 1) == ["s0"]
    for k in keys[1:]:
        await pool.put("s0", k, b"m")
    assert [page async for page in pool.iter_keys("s0", "manifests/", page=3)] == [keys[0:3], keys[3:6], keys[6:]]
    assert await pool.list_keys("s0", "manifests/") == keys
    # The dedup above judged the copy's age on the store's clock: its probe object (cpfs/pool.py).
    assert await pool.list_keys("s0", "") == [chunkfmt.chunk_key(enc.digest), CLOCK_KEY] + keys
    pages = [[(i.key, i.size) for i in page] async for page in pool.iter_info("s0", "manifests/", page=3)]
    assert pages == [[(k, 1) for k in keys[0:3]], [(k, 1) for k in keys[3:6]], [(keys[6], 1)]]
    assert (await pool.stat("s0", chunkfmt.chunk_key(enc.digest))).size == enc.stored_len
    assert [page async for page in pool.iter_info("s0", "", temporary=True)] == []


def _pool(tmp_path: Path, stores: int = 2) -> StorePool:
    text = "replicas = 2\n" + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(stores))
    return StorePool(parse_config(text, "test.toml", tmp_path))


async def _stored(pool: StorePool, data: bytes) -> ChunkEntry:
    enc = chunkfmt.encode(data)
    held, new, _ = await pool.store_chunk(enc, pool.names, quorum=2)
    assert new and held == pool.names
    return ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held))


def _chunk_file(tmp_path: Path, store: str, entry: ChunkEntry) -> Path:
    return tmp_path / store / chunkfmt.chunk_key(entry.digest)


async def test_pool_store_chunk_dedups(tmp_path: Path) -> None:
    """A chunk is written once per store; storing it again writes nothing."""
    pool = _pool(tmp_path)
    data = os.urandom(100_000)
    entry = await _stored(pool, data)
    before = [s.bytes_written for s in pool.statistics()]
    held, new, _ = await pool.store_chunk(chunkfmt.encode(data), pool.names, quorum=2)
    assert held == ["s0", "s1"] and not new
    assert [s.bytes_written for s in pool.statistics()] == before == [entry.stored_len] * 2


@pytest.mark.parametrize("damage", ["corrupt", "missing", "truncated"])
async def test_pool_falls_back_to_other_replica(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                damage: str) -> None:
    """A corrupt, missing or truncated replica is skipped with a WARNING naming the store; the bytes
    come from the other replica."""
    data = os.urandom(200_000)
    entry = await _stored(_pool(tmp_path), data)
    pool = _pool(tmp_path)       # a fresh, idle pool tries the replicas in the manifest's order
    bad = entry.stores[0]
    path = _chunk_file(tmp_path, bad, entry)
    blob = bytearray(path.read_bytes())
    if damage == "corrupt":
        blob[len(blob) // 2] ^= 1
        path.write_bytes(blob)
    elif damage == "truncated":
        path.write_bytes(blob[:1000])
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        assert await pool.fetch_chunk(entry, "file /run/x.pt offset 0 chunk 0") == data
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"store {bad!r}" in warnings[0] and "file /run/x.pt offset 0 chunk 0" in warnings[0]
    assert ("corrupt replica" if damage != "missing" else "replica failed") in warnings[0]


async def test_pool_all_replicas_bad(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With every replica bad, fetch_chunk raises ChunkUnavailable naming the place and every store."""
    pool = _pool(tmp_path, stores=3)
    data = os.urandom(50_000)
    enc = chunkfmt.encode(data)
    held, *_ = await pool.store_chunk(enc, ["s1", "s2"], quorum=2)
    entry = ChunkEntry(enc.digest, enc.raw_len, enc.stored_len, enc.codec, tuple(held))
    _chunk_file(tmp_path, "s1", entry).write_bytes(b"CPFC garbage")
    _chunk_file(tmp_path, "s2", entry).unlink()
    where = "file /run/x.pt offset 4194304 chunk 1"
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        with pytest.raises(ChunkUnavailable) as e:
            await pool.fetch_chunk(entry, where)
    msg = str(e.value)
    assert msg.startswith(where) and enc.digest[:16] in msg
    # The listed replicas, then the chunk's current placement (where scrub --repair puts copies).
    tried = {"s1", "s2"} | set(place(enc.digest, pool.names, 2))
    assert all(f"'{n}'" in msg or f"{n}:" in msg for n in tried)
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == len(tried)


class CountingReads(StoreWrapper):
    """Counts the batch reads and the single reads that reach the store below it."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.batches: list[int] = []
        self.singles = 0

    async def get_with(self, key, fn, limiter):
        self.singles += 1
        return await self.inner.get_with(key, fn, limiter)

    async def get_many_with(self, reads, limiter):
        self.batches.append(len(reads))
        return await self.inner.get_many_with(reads, limiter)


async def test_pool_fetch_chunks_reads_a_batch_per_store_and_each_bad_replica_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """fetch_chunks reads the chunks one store holds with one batch request (not one read each), and
    a chunk the batch does not bring (corrupt, missing on that store) from its other replica, with a
    WARNING naming file, chunk and store; a chunk no store can give is its ChunkUnavailable."""
    payloads = [os.urandom(20_000 + 1000 * i) for i in range(8)]
    entries = [await _stored(_pool(tmp_path), p) for p in payloads]
    text = "replicas = 2\n" + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(2))
    counted = [CountingReads(DirectoryStore(f"s{i}", tmp_path / f"s{i}")) for i in range(2)]
    pool = StorePool(parse_config(text, "test.toml", tmp_path), stores=counted)
    wheres = [f"file /run/x.pt offset {i * 100} chunk {i}" for i in range(8)]
    assert await pool.fetch_chunks(entries, wheres) == payloads
    assert [c.batches for c in counted] == [[8], []] and [c.singles for c in counted] == [0, 0]
    stats = pool.replica_statistics()
    assert (stats.batch_reads, stats.batched, stats.reads) == (1, 8, 8)

    first, other = pool.rank(["s0", "s1"])       # the store the next batch goes to
    blob = bytearray(_chunk_file(tmp_path, first, entries[2]).read_bytes())
    blob[-1] ^= 1
    _chunk_file(tmp_path, first, entries[2]).write_bytes(blob)
    _chunk_file(tmp_path, first, entries[5]).unlink()
    for store in ("s0", "s1"):
        _chunk_file(tmp_path, store, entries[7]).unlink()
    with caplog.at_level(logging.WARNING, logger="cpfs.pool"):
        got = await pool.fetch_chunks(entries, wheres)
    assert got[:7] == payloads[:7]
    assert isinstance(got[7], ChunkUnavailable) and wheres[7] in str(got[7])
    by_name = {c.name: c for c in counted}
    assert sorted(by_name["s0"].batches + by_name["s1"].batches) == [8, 8]
    assert by_name[first].batches[-1] == 8 and by_name[other].singles >= 3   # 2, 5 and 7 alone
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(wheres[2] in w and "corrupt replica" in w and f"'{first}'" in w for w in warned)
    assert any(wheres[5] in w and "replica failed" in w and f"'{first}'" in w for w in warned)
