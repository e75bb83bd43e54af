"""A killed saver or a full staging disk never commits a truncated file over the previous version.

Three layers: `incomplete_reason` on the bytes of real torch.save / safetensors files cut at every
interesting point; WriteSession without a kernel (poisoned sessions, failed versions, fsync mid-save);
and real mounts, where the kernel closes a killed saver's file and the staging folder is a small tmpfs.
"""
from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
import trio

from conftest import write_config
from cpfs.catalog import Catalog
from cpfs.completeness import incomplete_reason
from cpfs.config import load_config
from cpfs.errors import ChunkUnavailable, IncompleteFile, NotFound, WriteFailed
from cpfs.pool import StorePool
from cpfs.store import FaultyStore, open_store
from cpfs.staging import StagingFile
from cpfs.tensor_index import build_index
from cpfs.writer import StagingError
from test_write_mount import assert_same, config, expected_of_save, rand_bytes, wait_for
from test_writer import Env, commit_bytes, make_env, model, open_session, stored_bytes
from tests.conftest import ROOT, cpfs

MiB = 1024 * 1024


def torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def reader(data: bytes, counter: list[int] | None = None) -> Callable[[int, int], bytes]:
    def read_at(offset: int, length: int) -> bytes:
        if counter is not None:
            counter.append(length)
        return data[offset:offset + length]
    return read_at


@pytest.fixture
async def env(tmp_path: Path) -> Env:
    return await make_env(tmp_path / "cpfs")


@pytest.fixture
def tmpfs() -> Iterator[Callable[[Path, int], Path]]:
    """tmpfs(path, size): a tmpfs of `size` bytes mounted at `path` (root only), unmounted at teardown.
    Request it before `mount`, so that it comes down after the mounts that stage on it."""
    mounted: list[Path] = []

    def make(path: Path, size: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ---------------------------------------------------------------------------------------------------
# incomplete_reason on real files

def test_every_prefix_of_a_torch_zip_is_incomplete_and_the_whole_file_is_not() -> None:
    blob = torch_bytes(model(layers=2, width=64))
    index = build_index(reader(blob), len(blob))
    assert index is not None
    cuts = {4, 30, 100, len(blob) // 2, index.directory_offset, len(blob) - 22, len(blob) - 1}
    cuts |= {r.offset for r in index.records} | {r.offset + r.length for r in index.records}
    cuts |= set(range(index.directory_offset - 64, len(blob)))       # every byte of the directory and tail
    cuts |= set(random.Random(1).sample(range(4, len(blob)), 300))
    complete = [n for n in sorted(cuts) if 4 <= n < len(blob) and incomplete_reason(reader(blob[:n]), n) is None]
    assert complete == []
    assert incomplete_reason(reader(blob), len(blob)) is None
    assert "end-of-central-directory" in incomplete_reason(reader(blob[:-22]), len(blob) - 22)


def test_every_prefix_of_a_safetensors_file_is_incomplete_and_the_whole_file_is_not() -> None:
    blob = safetensors.torch.save(model(layers=2, width=64))
    header = 8 + int.from_bytes(blob[:8], "little")
    cuts = set(range(9, header + 16)) | set(range(len(blob) - 16, len(blob)))
    cuts |= set(random.Random(2).sample(range(9, len(blob)), 300))
    reasons = {n: incomplete_reason(reader(blob[:n]), n) for n in sorted(cuts) if n < len(blob)}
    assert [n for n, why in reasons.items() if why is None] == []
    assert "header" in reasons[header - 1] and "tensors end at" in reasons[header + 1]
    assert incomplete_reason(reader(blob), len(blob)) is None


def npy_bytes(arr: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    if version is None:
        np.save(buf, arr, allow_pickle=False)
    else:
        np.lib.format.write_array(buf, arr, version=version, allow_pickle=False)
    return buf.getvalue()


NPY_SAMPLES = {
    "float32 2-D": np.arange(3000, dtype=np.float32).reshape(50, 60),
    "fortran order": np.asfortranarray(np.arange(600, dtype=">i8").reshape(20, 30)),
    "bool": np.arange(999) % 3 == 0,
    "complex": np.arange(100, dtype=np.complex128) * 1j,
    "unicode": np.array(["adam", "sgd", "lion"] * 50),
    "bytes": np.array([b"m", b"v", b"step"] * 50),
    "datetime": np.arange(200).astype("datetime64[ms]"),
    "structured": np.zeros(300, dtype=[("step", "<i8"), ("lr", "<f4"), ("m", "<f2", (3, 2))]),
    "aligned structure": np.zeros(100, dtype=np.dtype([("a", "u1"), ("b", "<f8")], align=True)),
    "void": np.zeros(64, dtype="V12"),
    "zero elements": np.zeros((0, 5), dtype=np.float16),
    "scalar": np.array(2.5),
}


@pytest.mark.parametrize("name", NPY_SAMPLES)
def test_every_prefix_of_a_npy_file_is_incomplete_and_the_whole_file_is_not(name: str) -> None:
    """numpy.save killed mid-write committed ok (the ML workflows audit noticed it): the header names the
    dtype and shape, so the file's end is known, as a safetensors file's is."""
    arr = NPY_SAMPLES[name]
    for version in (None, (2, 0), (3, 0)):
        blob = npy_bytes(arr, version)
        assert incomplete_reason(reader(blob), len(blob)) is None
        cuts = set(range(6, min(len(blob), 300))) | set(range(max(6, len(blob) - 64), len(blob)))
        cuts.discard(len(blob) - arr.nbytes)        # the header alone: open_memmap's first close
        assert [n for n in sorted(cuts) if incomplete_reason(reader(blob[:n]), n) is None] == [], version
        with_more = blob + b"\0" * 10               # an r+b save of a smaller array over a larger one
        assert incomplete_reason(reader(with_more), len(with_more)) is None
    if arr.size:
        blob = npy_bytes(arr)
        assert "elements end at byte" in incomplete_reason(reader(blob[:-1]), len(blob) - 1)


def test_an_npy_header_alone_is_not_judged_and_open_memmap_saves_through_a_mount(make_config, tmp_path, mount) -> None:
    """np.lib.format.open_memmap(mode="w+") writes the header, closes the file, then extends it by a
    mapping and fills it: its first close, the header alone, was judged a cut np.save, and every such
    save failed with EIO (the completeness audit)."""
    header = npy_bytes(np.zeros((1000, 7), dtype=np.float32))[:128]
    assert incomplete_reason(reader(header), len(header)) is None
    assert incomplete_reason(reader(header + b"\0"), len(header) + 1) is not None
    m = mount(config(make_config, tmp_path))
    want = np.arange(7000, dtype=np.float32).reshape(1000, 7)
    arr = np.lib.format.open_memmap(m.path / "features.npy", mode="w+", dtype=np.float32, shape=(1000, 7))
    arr[:] = want
    arr.flush()
    del arr
    assert np.array_equal(np.load(m.path / "features.npy"), want)
    assert np.array_equal(np.load(mount(config(make_config, tmp_path), "fresh").path / "features.npy"), want)


def test_npy_files_numpy_cannot_size_here_are_not_judged() -> None:
    """An object array is pickled after its header: its length is not the header's to say."""
    buf = io.BytesIO()
    np.save(buf, np.array([{"step": 1}, None], dtype=object), allow_pickle=True)
    blob = buf.getvalue()
    assert incomplete_reason(reader(blob[:-1]), len(blob) - 1) is None
    odd = b"\x93NUMPY\x01\x00" + (20).to_bytes(2, "little") + b"{'shape': (1,)} \n"[:20].ljust(20)
    assert incomplete_reason(reader(odd), len(odd)) is None               # no descr: not numpy's header
    wrong_version = b"\x93NUMPY\x09\x00" + b"\0" * 100
    assert incomplete_reason(reader(wrong_version), len(wrong_version)) is None


class Writes(io.RawIOBase):
    """A file object that remembers where each write of its writer ended: where a kill leaves the file."""

    def __init__(self) -> None:
        self.data, self.ends = bytearray(), []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.data += memoryview(b).cast("B")
        self.ends.append(len(self.data))
        return len(self.data) - (self.ends[-2] if len(self.ends) > 1 else 0)


PICKLED = {
    "optimizer state": {f"layer{i}": {"m": np.arange(2000, dtype=np.float32) * i, "step": i} for i in range(40)},
    "many small objects": [{"id": i, "token": f"tok{i}", "score": i * 0.5} for i in range(20_000)],
    "one large array": {"w": np.random.default_rng(0).standard_normal(300_000), "note": "x"},
}


@pytest.mark.parametrize("protocol", [4, 5])
def test_a_pickle_cut_where_its_writer_stopped_is_incomplete(protocol: int) -> None:
    """pickle.dump (a JAX optimizer state, dcp's .metadata) killed mid-write committed ok. A whole pickle
    ends with STOP: every cut between two of its writer's writes is refused, and all but a few random cuts
    (whose last byte is b"." by chance)."""
    for name, obj in PICKLED.items():
        w = Writes()
        pickle.dump(obj, w, protocol=protocol)
        blob = bytes(w.data)
        assert incomplete_reason(reader(blob), len(blob), "/run/opt_state.pkl") is None
        assert len(w.ends) > 2, name
        assert [n for n in w.ends[:-1] if incomplete_reason(reader(blob[:n]), n, "opt_state.pkl") is None] == [], name
        cuts = random.Random(protocol).sample(range(1, len(blob)), 2000)
        passed = [n for n in cuts if incomplete_reason(reader(blob[:n]), n, "opt_state.pickle") is None]
        assert all(blob[n - 1:n] == b"." for n in passed) and len(passed) < 20, (name, len(passed))
        assert incomplete_reason(reader(blob[:-1]), len(blob) - 1, "/ckpt/.metadata") is not None   # dcp's
    two = pickle.dumps(PICKLED["optimizer state"]) + pickle.dumps([1, 2, 3])     # records back to back
    assert incomplete_reason(reader(two), len(two), "records.pkl") is None


def test_a_pickle_is_judged_only_under_a_pickle_files_name() -> None:
    """A pickled header followed by other bytes (np.save or raw data into the same file) is a format of
    its own: under another name than a pickle file's it is not judged (its saves failed with EIO: the
    completeness audit). Under *.pkl it is, and fails (README: Known limits)."""
    buf = io.BytesIO()
    pickle.dump({"shape": (100,)}, buf)
    np.save(buf, np.arange(100.0))
    blob = buf.getvalue()
    for name in ("/data/features.bin", "/data/features.npy", "/x/metadata", ""):
        assert incomplete_reason(reader(blob), len(blob), name) is None, name
    assert incomplete_reason(reader(blob), len(blob), "/data/features.pkl") is not None


def test_pickles_without_frames_are_not_judged() -> None:
    """Protocols 2 and 3 have no frame header to recognise them by (torch's legacy format is judged on
    its own); nor is a file whose first "frame" is longer than any pickle writes."""
    for protocol in (2, 3):
        blob = pickle.dumps(PICKLED["many small objects"], protocol=protocol)
        assert incomplete_reason(reader(blob[:-100]), len(blob) - 100, "state.pkl") is None
    odd = b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + os.urandom(1000)
    assert incomplete_reason(reader(odd), len(odd), "state.pkl") is None


def test_other_files_are_not_judged() -> None:
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("notes.txt", b"words " * 10_000)
    samples = {
        "random bytes": rand_bytes(MiB, 3),
        "text with a brace at byte 8": b"abcdefgh{ not a header } " * 100,
        "tiny": b"PK\x03",
        "a complete deflated zip": zipped.getvalue(),
        "a JSON document": json.dumps({"a": list(range(1000))}).encode(),
    }
    assert {name: incomplete_reason(reader(b), len(b)) for name, b in samples.items()} == \
           {name: None for name in samples}
    cut = zipped.getvalue()[:-1]
    assert incomplete_reason(reader(cut), len(cut)) is not None     # any zip counts, not only torch's


def test_the_check_reads_only_headers_and_the_tail() -> None:
    """A 64 MiB checkpoint: about 64 KiB read, whatever the file's size."""
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(4 * MiB // 4, generator=g) for i in range(16)}
    for blob in (torch_bytes(sd), safetensors.torch.save(sd)):
        for size in (len(blob), len(blob) // 2):
            reads: list[int] = []
            incomplete_reason(reader(blob[:size], reads), size)
            assert sum(reads) <= 70_000, (size, reads)


# ---------------------------------------------------------------------------------------------------
# WriteSession: a failed write poisons the open file

async def test_a_write_that_fills_the_staging_disk_poisons_the_session(tmp_path: Path, tmpfs) -> None:
    env = await make_env(tmp_path / "cpfs")
    v1 = await commit_bytes(env, "/ckpt.bin", rand_bytes(MiB, 1))
    env = dataclasses.replace(env, staging=tmpfs(tmp_path / "small", 4 * MiB))
    data = rand_bytes(8 * MiB, 2)
    async with open_session(env, "/ckpt.bin") as s:
        with pytest.raises(StagingError) as full:
            # Backwards: written in order, write-behind would store chunks and drop them from the staging
            # file as the writer goes, and the writer would wait for that room (the next test).
            for off in range(len(data) - MiB, -1, -MiB):
                await s.write(off, data[off:off + MiB])
        assert full.value.errno == errno.ENOSPC
        for attempt in (lambda: s.flush(closing=False), s.flush, s.flush,     # fsync, close, close
                        lambda: s.write(0, b"x"), lambda: s.truncate(0)):
            with pytest.raises(WriteFailed) as refused:
                await attempt()
            assert refused.value.errno == errno.ENOSPC
        assert await s.read(len(data) - 100, 100) == data[-100:]     # reads still see what was written
    assert (await env.catalog.get("/ckpt.bin")).version == v1.version
    assert [i.ref.state for i in await env.catalog.history("/ckpt.bin")] == ["ok"]


async def test_a_writer_faster_than_write_behind_waits_for_staging_room(tmp_path: Path, tmpfs) -> None:
    """A torch.save six times the staging disk, written in order as fast as it goes, to stores that
    take 24 MiB/s each: the writes that find staging full wait for write-behind to store and drop
    chunks, and the file commits whole. Before, such a write failed with ENOSPC."""
    env = await make_env(tmp_path / "cpfs", store_extra='bandwidth = "24MiB/s"')
    env = dataclasses.replace(env, staging=tmpfs(tmp_path / "small", 4 * MiB))
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(196_608, generator=g) for i in range(32)}      # 0.75 MiB each
    blob = torch_bytes(sd)
    assert len(blob) >= 6 * 4 * MiB
    async with open_session(env, "/ckpt.pt") as s:
        for off in range(0, len(blob), 256 * 1024):
            await s.write(off, blob[off:off + 256 * 1024])
        m = await s.flush()
        st = s.statistics()
    assert st.room_waits > 0, st          # the disk did fill: the case under test happened
    assert st.chunks_dropped > 0
    assert m is not None and await stored_bytes(env.pool, m) == blob
    assert (await env.catalog.get("/ckpt.pt")).version == m.version


class OverQuota(StagingFile):
    """A staging file under a user quota: the full disk answers EDQUOT, as a cluster's quota'd home
    directory does (this kernel's tmpfs has no quotas, and root passes ext4's)."""

    async def run(self, fn: Callable[..., Any], *args: object, limiter: trio.CapacityLimiter) -> Any:
        try:
            return await super().run(fn, *args, limiter=limiter)
        except StagingError as e:
            if e.errno == errno.ENOSPC:
                e.errno = errno.EDQUOT
            raise


async def test_a_writer_over_its_staging_quota_waits_for_room_as_on_a_full_disk(tmp_path: Path, tmpfs) -> None:
    """The same save with the staging folder under a quota (EDQUOT instead of ENOSPC): its writes wait
    for write-behind too, and the file commits whole. The first write over the quota failed the save (an
    audit's find), where a full disk made it wait."""
    env = await make_env(tmp_path / "cpfs", store_extra='bandwidth = "24MiB/s"')
    env = dataclasses.replace(env, staging=tmpfs(tmp_path / "small", 4 * MiB))
    blob = torch_bytes({f"t{i}": torch.randn(196_608, generator=torch.Generator().manual_seed(i)) for i in range(32)})
    async with open_session(env, "/ckpt.pt", staging_file=OverQuota) as s:
        for off in range(0, len(blob), 256 * 1024):
            await s.write(off, blob[off:off + 256 * 1024])
        m = await s.flush()
        st = s.statistics()
    assert st.room_waits > 0, st
    assert m is not None and await stored_bytes(env.pool, m) == blob


async def _faulty_env(folder: Path, **kw) -> tuple[Env, list[FaultyStore]]:
    config = load_config(write_config(folder, **kw))
    stores = [FaultyStore(open_store(s)) for s in config.stores]
    pool = StorePool(config, stores=stores)
    await pool.check()
    return Env(config, pool, Catalog(pool), folder / "staging", folder / "stores"), stores


async def test_stores_that_refuse_puts_a_moment_mid_save_do_not_stop_write_behind(tmp_path: Path, tmpfs) -> None:
    """Every store refuses chunk puts for 0.3 s in the middle of a save four times the staging disk,
    once the disk has filled: write-behind tries again after a pause (the failed spans too), the writes
    wait meanwhile, and the file commits whole. One failed upload stopped write-behind until the close,
    and the next write that found staging full failed with ENOSPC (an audit's find)."""
    env, stores = await _faulty_env(tmp_path / "cpfs", store_extra='bandwidth = "24MiB/s"')
    env = dataclasses.replace(env, staging=tmpfs(tmp_path / "small", 4 * MiB))
    blob = torch_bytes({f"t{i}": torch.randn(196_608, generator=torch.Generator().manual_seed(i)) for i in range(24)})
    async with open_session(env, "/ckpt.pt") as s:
        async def outage() -> None:
            while s.statistics().room_waits == 0:
                await trio.sleep(0.005)
            rules = [(f, f.refuse("put", "chunks/*")) for f in stores]
            await trio.sleep(0.3)
            for f, rule in rules:
                f.allow(rule)
        async with trio.open_nursery() as n:
            n.start_soon(outage)
            for off in range(0, len(blob), 256 * 1024):
                await s.write(off, blob[off:off + 256 * 1024])
        m = await s.flush()
        st = s.statistics()
    assert sum(f.statistics().ruled for f in stores) > 0 and st.chunks_dropped > 0, st
    assert m is not None and await stored_bytes(env.pool, m) == blob


@pytest.mark.parametrize("every", [4, 2])
async def test_a_saver_that_fsyncs_as_it_goes_needs_no_more_staging_than_one_that_does_not(
        tmp_path: Path, tmpfs, every: int) -> None:
    """An fsync every `every` writes of 256 KiB while a checkpoint four times the staging disk is saved:
    the chunks a flush stored leave staging as write-behind's do, and the file commits whole. They
    stayed, and the save failed with ENOSPC at 14 of 18 MiB (an audit's find)."""
    env = await make_env(tmp_path / "cpfs", store_extra='bandwidth = "24MiB/s"')
    env = dataclasses.replace(env, staging=tmpfs(tmp_path / "small", 4 * MiB))
    blob = torch_bytes({f"t{i}": torch.randn(196_608, generator=torch.Generator().manual_seed(i)) for i in range(24)})
    async with open_session(env, "/ckpt.pt") as s:
        for i, off in enumerate(range(0, len(blob), 256 * 1024)):
            await s.write(off, blob[off:off + 256 * 1024])
            if i % every == every - 1:
                assert await s.flush(closing=False) is None        # incomplete: stored, not committed
        m = await s.flush()
        st = s.statistics()
    assert st.chunks_dropped > 0, st
    assert m is not None and await stored_bytes(env.pool, m) == blob


async def test_a_full_staging_disk_that_write_behind_cannot_free_still_fails_the_write(tmp_path: Path,
                                                                                      tmpfs) -> None:
    """One record larger than the staging disk: nothing inside it can drop before the record ends, so
    once write-behind has stored what it can, the write fails with ENOSPC and never commits."""
    env = await make_env(tmp_path / "cpfs")
    env = dataclasses.replace(env, staging=tmpfs(tmp_path / "small", 4 * MiB))
    blob = torch_bytes({"big": torch.randn(2 * MiB, generator=torch.Generator().manual_seed(4))})  # 8 MiB
    async with open_session(env, "/big.pt") as s:
        with pytest.raises(StagingError) as full:
            for off in range(0, len(blob), 256 * 1024):
                await s.write(off, blob[off:off + 256 * 1024])
        assert full.value.errno == errno.ENOSPC
        with pytest.raises(WriteFailed):
            await s.flush()
    with pytest.raises(NotFound):
        await env.catalog.get("/big.pt")


@pytest.mark.parametrize("change", ["write", "truncate"])
async def test_a_base_chunk_that_cannot_be_fetched_poisons_the_session(env: Env, change: str) -> None:
    """Overwriting part of a chunk of the committed version needs that chunk; if no store gives it, the
    write or truncate fails, and so does every later fsync and close. A failed read poisons nothing."""
    old = rand_bytes(3 * MiB, 1)
    v1 = await commit_bytes(env, "/m.bin", old)

    async def fetch(i: int) -> bytes:
        raise ChunkUnavailable(f"/m.bin chunk {i}: no store has it (test)")

    async with open_session(env, "/m.bin", base=v1, fetch=fetch) as s:
        with pytest.raises(ChunkUnavailable):
            await s.read(0, 10)
        assert await s.flush() is v1                      # nothing changed: the no-op it always was
        with pytest.raises(ChunkUnavailable):
            if change == "write":
                await s.write(MiB + 10, b"patch")
            else:
                await s.truncate(MiB + 10)
        for closing in (False, True):
            with pytest.raises(WriteFailed) as refused:
                await s.flush(closing=closing)
            assert refused.value.errno == errno.EIO and "previous version stays current" in str(refused.value)
    assert (await env.catalog.get("/m.bin")).version == v1.version


async def test_a_dropped_chunk_no_store_gives_back_poisons_the_change_not_the_old_version(env: Env) -> None:
    """A chunk that write-behind stored and dropped from the staging file is gone from every store (a
    store lost it, gc raced) when the writer comes back to change part of it: the write fails, nothing
    of this open file commits, and the previous version stays current."""
    v1 = await commit_bytes(env, "/shard.bin", rand_bytes(2 * MiB, 1))
    data = rand_bytes(12 * MiB, 2)
    async with open_session(env, "/shard.bin") as s:
        for off in range(0, len(data), 256 * 1024):
            await s.write(off, data[off:off + 256 * 1024])
        with trio.fail_after(120):     # a hang guard: stores' fsyncs share a disk with the whole suite
            while s.statistics().chunks_dropped < 8:
                await trio.sleep(0.01)
        keep = {c.digest for c in v1.chunks}
        for chunk in env.stores.rglob("chunks/*/*"):
            if chunk.name not in keep:
                chunk.unlink()                                 # every copy of this session's chunks
        with pytest.raises(ChunkUnavailable):
            await s.read(6 * MiB, 100)
        with pytest.raises(ChunkUnavailable):
            await s.write(6 * MiB + 10, b"patch")              # inside a dropped 1 MiB chunk
        for closing in (False, True):
            with pytest.raises(WriteFailed) as refused:
                await s.flush(closing=closing)
            assert "previous version stays current" in str(refused.value)
    assert (await env.catalog.get("/shard.bin")).version == v1.version
    assert await stored_bytes(env.pool, v1) == rand_bytes(2 * MiB, 1)


# ---------------------------------------------------------------------------------------------------
# WriteSession: format-aware commit

def cut_torch(fraction: str) -> Callable[[bytes], int]:
    def where(blob: bytes) -> int:
        index = build_index(reader(blob), len(blob))
        return {"half": len(blob) // 2, "no end record": len(blob) - 22,
                "in the directory": index.directory_offset + 10}[fraction]
    return where


def cut_safetensors(fraction: str) -> Callable[[bytes], int]:
    def where(blob: bytes) -> int:
        header = 8 + int.from_bytes(blob[:8], "little")
        return {"in the header": header // 2, "half": len(blob) // 2, "last byte": len(blob) - 1}[fraction]
    return where


CUTS = [("torch", cut_torch(f), f) for f in ("half", "no end record", "in the directory")] + \
       [("safetensors", cut_safetensors(f), f) for f in ("in the header", "half", "last byte")]


@pytest.mark.parametrize("fmt, where, label", CUTS, ids=[f"{c[0]}-{c[2]}" for c in CUTS])
async def test_an_incomplete_checkpoint_is_kept_as_a_failed_version(env: Env, caplog, fmt, where, label) -> None:
    save = torch_bytes if fmt == "torch" else safetensors.torch.save
    path = "/run/ckpt.pt" if fmt == "torch" else "/run/model.safetensors"
    v1 = await commit_bytes(env, path, save(model(layers=3, width=128, seed=1)))
    new = save(model(layers=3, width=128, seed=2))
    partial = new[:where(new)]
    async with open_session(env, path) as s:
        for off in range(0, len(partial), 128 * 1024):         # as the kernel hands it over
            await s.write(off, partial[off:off + 128 * 1024])
        with pytest.raises(IncompleteFile) as refused:
            await s.flush()
        assert refused.value.errno == errno.EIO
        with pytest.raises(IncompleteFile):                     # a second close: refused, not recorded again
            await s.flush()
    assert (await env.catalog.get(path)).version == v1.version
    history = await env.catalog.history(path)
    assert [(i.ref.state, i.current) for i in history] == [("failed", False), ("ok", True)]
    failed = await env.catalog.get_version(path, history[0].ref.version)
    assert failed.state == "failed" and failed.size == len(partial) and failed.reason in str(refused.value)
    assert ("zip" if fmt == "torch" else "safetensors") in failed.reason
    assert await stored_bytes(env.pool, failed) == partial     # the partial bytes, kept for inspection
    assert f"{path}: not committed, the file is incomplete" in caplog.text


async def test_fsync_of_a_half_written_zip_stores_chunks_and_commits_nothing(env: Env) -> None:
    blob = torch_bytes(model(layers=4, width=192, seed=3))
    half = len(blob) // 2
    async with open_session(env, "/run/step_1.pt") as s:
        await s.write(0, blob[:half])
        assert await s.flush(closing=False) is None             # fsync mid-save: success, no version
        mid = s.statistics()
        assert mid.commits == 0 and mid.chunks_uploaded >= half // env.config.chunk_size
        assert await env.catalog.history("/run/step_1.pt") == []
        with pytest.raises(NotFound):
            await env.catalog.get("/run/step_1.pt")
        await s.write(half, blob[half:])
        m = await s.flush()                                      # close: the complete file commits
        end = s.statistics()
    assert m is not None and m.tensor_index is not None
    assert await stored_bytes(env.pool, m) == blob
    # The fsync's chunks were not stored again: at most its last one (cut at the half) was superseded.
    assert end.commits == 1 and end.chunks_discarded <= 1 and end.chunks_uploaded <= len(m.chunks) + 1
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert_same(torch.load(io.BytesIO(await stored_bytes(env.pool, m)), weights_only=True), loaded)


async def test_a_plain_file_cut_short_still_commits(env: Env) -> None:
    """POSIX for everything that is not a checkpoint: what was written is the file, at fsync and close.
    The close's version replaces the fsync's in the history; the version before the session stays."""
    v1 = await commit_bytes(env, "/logs/train.log", b"step 1 loss 2.0\n" * 100_000)
    new = b"step 2 loss 1.5\n" * 200_000
    async with open_session(env, "/logs/train.log") as s:
        await s.write(0, new[:MiB])
        synced = await s.flush(closing=False)
        assert synced is not None and synced.size == MiB
        await s.write(MiB, new[MiB:MiB + 1000])
        m = await s.flush()
    assert (await env.catalog.get("/logs/train.log")).version == m.version > synced.version > v1.version
    assert await stored_bytes(env.pool, m) == new[:MiB + 1000]
    assert [(i.ref.version, i.ref.state, i.current) for i in await env.catalog.history("/logs/train.log")] == \
           [(m.version, "ok", True), (v1.version, "ok", False)]


# ---------------------------------------------------------------------------------------------------
# real mounts

STALL = """
import os, pickle, sys, time
import numpy as np
import safetensors.torch
import torch
import trio
sys.path.insert(0, "tests")
from test_write_mount import expected_of_save
kind, path, seed, nbytes, stall_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])


class Stalling:
    '''A file on the mount whose writer stops for good once `stall_at` bytes are written.'''

    def __init__(self):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.n = 0

    def write(self, data):
        view = memoryview(data).cast("B")
        room = stall_at - self.n
        part = view[:room] if len(view) >= room else view
        while part:
            done = os.write(self.fd, part)
            part, self.n = part[done:], self.n + done
        if self.n >= stall_at:
            print("stalled", flush=True)
            time.sleep(600)
        return len(view)

    def flush(self):
        pass


f = Stalling()
if kind == "torch":
    torch.save(expected_of_save(nbytes, seed, per=4 << 20), f)
elif kind == "legacy":                  # torch.save's format before zip files (still an option)
    torch.save(expected_of_save(nbytes, seed, per=4 << 20), f, _use_new_zipfile_serialization=False)
elif kind == "pickle":                  # pickle.dump of numpy arrays (a JAX optimizer state)
    pickle.dump({k: v.float().numpy() for k, v in expected_of_save(nbytes, seed, per=4 << 20).items()}, f)
elif kind == "npy":                     # numpy.save of one large array (optimizer states)
    np.save(f, np.random.default_rng(seed).standard_normal(nbytes // 8))
elif kind == "dcp":                     # a .distcp data file: one torch.save per item, back to back
    for t in expected_of_save(nbytes, seed, per=4 << 20).values():
        torch.save(t, f)
elif kind == "safetensors":
    blob = safetensors.torch.save(expected_of_save(nbytes, seed, per=4 << 20))
    for off in range(0, len(blob), 1 << 20):
        f.write(blob[off:off + (1 << 20)])
else:
    f.write(np.random.default_rng(seed).bytes(nbytes))
print("finished", flush=True)
"""


def stalled_writer(kind: str, path: Path, seed: int, nbytes: int, stall_at: int) -> subprocess.Popen:
    """A child that writes `path` (a torch.save, a safetensors file in 1 MiB pieces, a DCP data file, or
    plain bytes)
    and stops for good after `stall_at` bytes, saying "stalled": then the test kills it."""
    return subprocess.Popen([sys.executable, "-c", STALL, kind, str(path), str(seed), str(nbytes), str(stall_at)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def kill_when_stalled(child: subprocess.Popen) -> None:
    try:
        assert child.stdout.readline().strip() == "stalled", child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)                 # the kernel closes its file: flush, release
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL


def log(cfg: Path, path: str) -> list[dict]:
    return json.loads(cpfs("log", path, "--json", config=cfg).stdout)


def test_a_save_over_a_zip_in_place_cut_short_is_incomplete() -> None:
    """torch.save into the old file opened "r+b" (no truncate), stopped partway: the old central
    directory still ends the file, over members the new save rewrote. It passed as complete (the ML
    workflows audit's find: committed ok, then torch.load failed). A cut before the first member
    that differs leaves the old file as it was: complete."""
    old = torch_bytes(model(layers=2, width=64, seed=1))
    new = torch_bytes(model(layers=2, width=64, seed=2))
    assert len(new) == len(old)
    first_change = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    index = build_index(reader(new), len(new))
    assert index is not None
    cuts = [r.offset + r.length // 2 for r in index.records if r.offset > first_change]
    cuts += [index.records[-1].offset + index.records[-1].length, index.directory_offset - 1]
    for cut in cuts:
        mixed = new[:cut] + old[cut:]
        reason = incomplete_reason(reader(mixed), len(mixed))
        assert reason is not None and "is not the one its directory describes" in reason, cut
    for whole in (old, new, new[:first_change] + old[first_change:]):
        assert incomplete_reason(reader(whole), len(whole)) is None


@pytest.mark.mount
def test_a_save_in_place_over_a_checkpoint_cut_short_leaves_the_previous_version(make_config, tmp_path, mount) -> None:
    """Through a mount: half a torch.save written over the checkpoint opened "r+b", then closed. The
    close fails (EIO) and the previous version stays current; it committed the mixed file as ok."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    v1 = model(layers=3, width=128, seed=1)
    torch.save(v1, m.path / "ckpt.pt")
    new = torch_bytes(model(layers=3, width=128, seed=2))
    f = open(m.path / "ckpt.pt", "r+b")
    f.write(new[:len(new) // 2])
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno == errno.EIO
    rows = log(cfg, "/ckpt.pt")
    assert [(r["state"], r["current"]) for r in rows] == [("failed", False), ("ok", True)]
    assert_same(torch.load(m.path / "ckpt.pt", weights_only=True), v1)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_every_prefix_of_a_legacy_torch_file_is_incomplete_and_the_whole_file_is_not(protocol: int) -> None:
    """torch.save(..., _use_new_zipfile_serialization=False): five pickles, then the storages. A cut
    anywhere after the first pickle's 15 bytes is incomplete (it committed ok: the ML workflows audit).
    At pickle_protocol 4 or 5 (the workaround for objects over 4 GB) its first pickle is framed: every
    whole one of those was judged a cut pickle, and its save failed (the completeness audit)."""
    buf = io.BytesIO()
    torch.save(model(layers=2, width=64), buf, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    blob = buf.getvalue()
    cuts = set(range(24, 2000)) | set(range(len(blob) - 2000, len(blob)))
    cuts |= set(random.Random(2).sample(range(24, len(blob)), 300))
    for name in ("ckpt.pt", "ckpt.pkl"):
        assert [n for n in sorted(cuts) if incomplete_reason(reader(blob[:n]), n, name) is None] == []
        assert incomplete_reason(reader(blob), len(blob), name) is None
        assert "storages end at byte" in incomplete_reason(reader(blob[:-1]), len(blob) - 1, name)


@pytest.mark.mount
@pytest.mark.parametrize("kind", ["torch", "legacy", "safetensors", "dcp", "npy", "pickle"])
def test_a_saver_killed_mid_save_leaves_the_previous_version(make_config, tmp_path, mount, kind) -> None:
    """`dcp`: a torch.distributed.checkpoint data file (a torch.save per item, back to back), killed
    inside an item. `legacy`: torch.save's format before zip files. `npy`: numpy.save. `pickle`: pickle.dump."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    name = {"torch": "ckpt.pt", "legacy": "ckpt.pt", "safetensors": "model.safetensors",
            "dcp": "__0_0.distcp", "npy": "adam_m.npy", "pickle": "opt_state.pkl"}[kind]
    v1 = expected_of_save(16 * MiB, seed=1, per=4 * MiB)
    items = b"".join(torch_bytes(t) for t in v1.values())
    first_npy = np.random.default_rng(1).standard_normal(2 * MiB)
    if kind == "npy":
        np.save(m.path / name, first_npy)
    elif kind == "pickle":
        (m.path / name).write_bytes(pickle.dumps({k: v.float().numpy() for k, v in v1.items()}))
    elif kind == "torch":
        torch.save(v1, m.path / name)
    elif kind == "legacy":
        torch.save(v1, m.path / name, _use_new_zipfile_serialization=False)
    elif kind == "dcp":
        (m.path / name).write_bytes(items)
    else:
        safetensors.torch.save_file(v1, m.path / name)
    first = log(cfg, name)
    kill_when_stalled(stalled_writer(kind, m.path / name, seed=2, nbytes=48 * MiB, stall_at=24 * MiB))

    assert wait_for(lambda: log(cfg, name)[0]["state"] == "failed", timeout=30), log(cfg, name)
    rows = log(cfg, name)
    assert [(r["state"], r["current"]) for r in rows] == [("failed", False), ("ok", True)]
    assert rows[1]["version"] == first[0]["version"]
    assert rows[0]["size"] == 24 * MiB and rows[0]["reason"]
    print(f"\nkilled {kind} save: {rows[0]['reason']}")
    if kind == "dcp":
        assert (m.path / name).read_bytes() == items
        assert (mount(cfg, "fresh").path / name).read_bytes() == items
    elif kind == "pickle":
        for where in (m.path, mount(cfg, "fresh").path):
            got = pickle.loads((where / name).read_bytes())
            assert sorted(got) == sorted(v1) and all(np.array_equal(got[k], v1[k].float().numpy()) for k in v1)
    elif kind == "npy":
        assert np.array_equal(np.load(m.path / name), first_npy)
        assert np.array_equal(np.load(mount(cfg, "fresh").path / name), first_npy)
    else:
        load = ((lambda p: torch.load(p, weights_only=True)) if kind in ("torch", "legacy")
                else safetensors.torch.load_file)
        assert_same(load(m.path / name), v1)
        assert_same(load(mount(cfg, "fresh").path / name), v1)
    assert "not committed, the file is incomplete" in m.log.read_text()


@pytest.mark.mount
def test_a_saver_killed_before_its_first_byte_leaves_the_previous_version(make_config, tmp_path, mount) -> None:
    """open(O_TRUNC) over a checkpoint, then killed before writing: the empty file is a failed version,
    the checkpoint stays current. An explicit truncate(2) to zero still empties the file (POSIX)."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    v1 = expected_of_save(8 * MiB, seed=1, per=4 * MiB)
    torch.save(v1, m.path / "ckpt.pt")
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'wb'); "
                              "print('opened', flush=True); time.sleep(60)", str(m.path / "ckpt.pt")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "opened"
    finally:
        child.kill()
        child.wait()
    assert wait_for(lambda: log(cfg, "ckpt.pt")[0]["state"] == "failed", timeout=30), log(cfg, "ckpt.pt")
    assert [(r["state"], r["size"]) for r in log(cfg, "ckpt.pt")][:2] == [("failed", 0), ("ok", (m.path / "ckpt.pt").stat().st_size)]
    assert_same(torch.load(m.path / "ckpt.pt", weights_only=True), v1)
    os.truncate(m.path / "ckpt.pt", 0)
    assert (m.path / "ckpt.pt").stat().st_size == 0 and log(cfg, "ckpt.pt")[0]["state"] == "ok"


@pytest.mark.mount
def test_a_full_staging_disk_gives_enospc_at_write_and_close(make_config, tmp_path, tmpfs, mount) -> None:
    tmpfs(tmp_path / "staging", 16 * MiB)
    cfg = config(make_config, tmp_path)                  # stages under tmp_path/staging: the tmpfs
    m = mount(cfg)
    old = rand_bytes(8 * MiB, 1)
    (m.path / "ckpt.bin").write_bytes(old)
    first = log(cfg, "ckpt.bin")
    new = rand_bytes(64 * MiB, 2)
    fd = os.open(m.path / "ckpt.bin", os.O_WRONLY | os.O_TRUNC)
    written = 0
    try:
        with pytest.raises(OSError) as full:
            # Backwards: written in order, chunks would be stored and leave the staging file as the
            # writer goes (cpfs/writer.py, dropped spans), and it would never fill.
            for off in range(len(new) - MiB, -1, -MiB):
                written += os.pwrite(fd, new[off:off + MiB], off)
    finally:
        with pytest.raises(OSError) as closing:
            os.close(fd)
    assert full.value.errno == errno.ENOSPC and written <= 16 * MiB
    print(f"\nstaging full after {written / MiB:.1f} MiB: write {full.value!r}, close {closing.value!r}")
    assert closing.value.errno == errno.ENOSPC

    assert (m.path / "ckpt.bin").read_bytes() == old
    assert log(cfg, "ckpt.bin") == first                 # no new version of any kind
    (m.path / "small.bin").write_bytes(b"fits")          # the staging space came back
    fresh = mount(cfg, "fresh")
    assert (fresh.path / "ckpt.bin").read_bytes() == old and (fresh.path / "small.bin").read_bytes() == b"fits"
    assert "will not commit" in m.log.read_text()


@pytest.mark.mount
def test_a_save_renamed_over_a_checkpoint_while_open_that_fails_leaves_it_listed(make_config, tmp_path, tmpfs,
                                                                                 mount) -> None:
    """A saver writes ck.new and renames it over ck.pt while the file is still open; the stores are full,
    so its close fails (ENOSPC). ck.pt is the checkpoint it was, and listings show it at once: it was
    left out of them until the next refresh (an audit's find), so a cleanup job listing the folder
    then missed the last good checkpoint."""
    stores = tmpfs(tmp_path / "cfg" / "stores", 24 * MiB)
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\nrefresh = "1h"\n')
    m = mount(cfg)
    old = rand_bytes(3 * MiB, 1)
    (m.path / "ck.pt").write_bytes(old)
    with open(m.path / "ck.new", "wb") as f:
        f.write(rand_bytes(3 * MiB, 2))
        os.rename(m.path / "ck.new", m.path / "ck.pt")
        with open(stores / "filler", "wb", buffering=0) as filler:      # the stores' disk fills meanwhile
            with pytest.raises(OSError):
                while True:
                    filler.write(bytes(MiB))
        with pytest.raises(OSError) as closing:
            f.close()
    assert closing.value.errno == errno.ENOSPC
    assert os.listdir(m.path) == ["ck.pt"]
    assert (m.path / "ck.pt").read_bytes() == old
    (stores / "filler").unlink()
    assert os.listdir(mount(cfg, "fresh").path) == ["ck.pt"]


@pytest.mark.mount
def test_a_mount_over_a_full_staging_disk_reads_and_writes_once_there_is_room(make_config, tmp_path, tmpfs,
                                                                              mount) -> None:
    """The disk that holds staging filled up while no mount ran (logs, a core dump on the node). The next
    mount comes up and reads the committed checkpoint; a save fails with ENOSPC and the checkpoint stays;
    once the disk has room, a save through the same mount commits. The mount did not start at all (a
    traceback in its log), so a job restarted after a failure could not load its checkpoint."""
    staging = tmpfs(tmp_path / "staging", 4 * MiB)
    cfg = config(make_config, tmp_path)
    old = rand_bytes(6 * MiB, 1)
    (tmp_path / "ck.pt").write_bytes(old)
    cpfs("put", str(tmp_path / "ck.pt"), "ck.pt", config=cfg)       # the CLI stages nothing
    with open(staging / "filler", "wb", buffering=0) as filler:
        with pytest.raises(OSError):
            while True:
                filler.write(bytes(64 * 1024))
    m = mount(cfg)
    assert (m.path / "ck.pt").read_bytes() == old
    with pytest.raises(OSError) as full:
        (m.path / "ck.pt").write_bytes(rand_bytes(MiB, 2))
    assert full.value.errno == errno.ENOSPC
    assert (m.path / "ck.pt").read_bytes() == old
    (staging / "filler").unlink()
    new = rand_bytes(MiB, 3)
    (m.path / "ck.pt").write_bytes(new)
    assert (mount(cfg, "fresh").path / "ck.pt").read_bytes() == new
    assert "writes fail (ENOSPC) until the disk has room" in m.log.read_text()


@pytest.mark.mount
def test_files_written_in_order_need_staging_for_about_a_record(make_config, tmp_path, tmpfs, mount) -> None:
    """Stored chunks leave the staging file as the writer goes: a 64 MiB file and a 48 MiB torch.save,
    both written in order as fast as they go to stores of 16 MiB/s each, commit through a 16 MiB staging
    tmpfs and read back equal. The writer outruns write-behind (24 MiB/s for 2 replicas): its writes
    wait for room. With stores of 64 MiB/s (96 MiB/s for 2 replicas) a writer slowed by a busy host
    (~48 MiB/s seen) never filled the staging disk and the last assertion failed."""
    tmpfs(tmp_path / "staging", 16 * MiB)
    m = mount(config(make_config, tmp_path, store_extra='bandwidth = "16MiB/s"'))
    data = rand_bytes(64 * MiB, 3)
    with open(m.path / "shard.bin", "wb") as f:
        for off in range(0, len(data), MiB):
            f.write(data[off:off + MiB])
    sd = {f"t{i}": torch.randn(1_500_000, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    torch.save(sd, m.path / "ckpt.pt")
    assert (m.path / "shard.bin").read_bytes() == data
    loaded = torch.load(m.path / "ckpt.pt", weights_only=True)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert "the write waits for write-behind" in m.log.read_text()


@pytest.mark.mount
def test_a_plain_file_cut_short_by_a_killed_writer_commits(make_config, tmp_path, mount) -> None:
    """Not a checkpoint: POSIX. What the killed writer wrote is the new version; history keeps the old."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    old = rand_bytes(6 * MiB, 1)
    (m.path / "data.bin").write_bytes(old)
    kill_when_stalled(stalled_writer("plain", m.path / "data.bin", seed=2, nbytes=12 * MiB, stall_at=5 * MiB))
    assert wait_for(lambda: len(log(cfg, "data.bin")) == 2, timeout=30), log(cfg, "data.bin")
    rows = log(cfg, "data.bin")
    assert [(r["state"], r["current"], r["size"]) for r in rows] == [("ok", True, 5 * MiB), ("ok", False, 6 * MiB)]
    want = rand_bytes(12 * MiB, 2)[:5 * MiB]
    assert (m.path / "data.bin").read_bytes() == want
    assert cpfs("cat", "data.bin", "--version", str(rows[1]["version"]), config=cfg).stdout == old


FSYNCING_WRITER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC)
for i in range(10):
    os.write(fd, bytes([65 + i]) * 100_000)
    os.fsync(fd)                      # a careful writer: durable as it goes
print("half", flush=True)
time.sleep(60)                        # killed here, mid-save
"""


@pytest.mark.mount
def test_a_plain_file_fsynced_as_it_goes_keeps_the_version_before_its_save(make_config, tmp_path, mount) -> None:
    """Ten fsyncs of a plain file, then the writer is killed: the history still holds the whole version
    before the save, and what the last fsync made is current. Each fsync was a version that counted
    toward keep_versions, so the third retired the version before the save (an audit's find): now
    each fsync's version replaces the one before it in the same session."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    old = rand_bytes(3_000_000, 1)
    (m.path / "data.bin").write_bytes(old)
    w = subprocess.Popen([sys.executable, "-c", FSYNCING_WRITER, str(m.path / "data.bin")], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert w.stdout.readline().strip() == "half"
    finally:
        w.kill()
        w.wait()
    want = b"".join(bytes([65 + i]) * 100_000 for i in range(10))
    assert wait_for(lambda: (m.path / "data.bin").read_bytes() == want, timeout=30)
    rows = log(cfg, "data.bin")
    assert [(r["state"], r["current"], r["size"]) for r in rows] == [("ok", True, len(want)), ("ok", False, len(old))]
    assert cpfs("cat", "data.bin", "--version", str(rows[1]["version"]), config=cfg).stdout == old


SYNC_WRITER = """
import os, sys
src, dst = sys.argv[1], sys.argv[2]
blob = open(src, "rb").read()
half = len(blob) // 2
with open(dst, "wb", buffering=0) as f:
    for off in range(0, half, 1 << 20):
        f.write(blob[off:min(off + (1 << 20), half)])
    os.fsync(f.fileno())
    print("synced", flush=True)
    sys.stdin.readline()
    for off in range(half, len(blob), 1 << 20):
        f.write(blob[off:off + (1 << 20)])
print("closed", flush=True)
"""


@pytest.mark.mount
def test_fsync_mid_save_commits_nothing_and_close_commits(make_config, tmp_path, mount) -> None:
    """The writer is another process: the test's own children (cpfs log) would close an fd it held,
    and every close of a descriptor is a flush."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    v1, v2 = expected_of_save(8 * MiB, seed=1, per=2 * MiB), expected_of_save(24 * MiB, seed=2, per=2 * MiB)
    torch.save(v1, m.path / "ckpt.pt")
    first = log(cfg, "ckpt.pt")
    src = tmp_path / "v2.pt"
    src.write_bytes(torch_bytes(v2))
    writer = subprocess.Popen([sys.executable, "-c", SYNC_WRITER, str(src), str(m.path / "ckpt.pt")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "synced", writer.stderr.read()   # fsync: no error
        assert log(cfg, "ckpt.pt") == first               # and no version, not even a failed one
        assert_same(torch.load(mount(cfg, "other").path / "ckpt.pt", weights_only=True), v1)
        out, err = writer.communicate("go on\n", timeout=60)
        assert writer.returncode == 0 and out.strip() == "closed", err
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    rows = log(cfg, "ckpt.pt")
    assert [(r["state"], r["current"]) for r in rows] == [("ok", True), ("ok", False)]
    assert rows[0]["size"] == src.stat().st_size
    assert_same(torch.load(m.path / "ckpt.pt", weights_only=True), v2)
    assert_same(torch.load(mount(cfg, "fresh").path / "ckpt.pt", weights_only=True), v2)
    assert "fsync of an incomplete file" in m.log.read_text()
