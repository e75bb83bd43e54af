"""Writing through a real mount: the savers users run, names, a second mount, crashes and failing stores.

Every test mounts with the conftest fixtures (unmounted in teardown, daemons ended by pid only) and
stages under its own tmp_path. The figures the issue asks for (dedup, the daemon's memory while saving)
are printed; run with -s to see them.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from benchmarks.common import RssSampler
from tests.conftest import cpfs

pytestmark = pytest.mark.mount

MiB = 1024 * 1024
GiB = 1024 * MiB


# ---------------------------------------------------------------------------------------------------
# helpers

def config(make_config: Callable[..., Path], tmp_path: Path, **kw) -> Path:
    """A test config staging under tmp_path, refreshing names every 0.5 s."""
    return make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\nrefresh = "0.5s"\n', **kw)


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 * MiB):
            h.update(block)
    return h.hexdigest()


def rand_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def state_dict(seed: int, layers: int = 4, width: int = 512) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"embed.weight": torch.randn(width, width, generator=g).to(torch.bfloat16)}
    for i in range(layers):
        sd[f"layers.{i}.w"] = torch.randn(width, width, generator=g).to(torch.bfloat16)
        sd[f"layers.{i}.b"] = torch.randn(width, generator=g)
    sd["step"] = torch.tensor(seed)
    return sd


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def wait_for(what: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if what():
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def stores_of(cfg: Path) -> Path:
    return cfg.parent / "stores"


def dangling_chunks(cfg: Path) -> list[str]:
    """Chunks that some manifest on some store names but a store it lists does not hold."""
    stores = stores_of(cfg)
    out = []
    manifests = sorted(stores.glob("*/manifests/*/*.json"))
    assert manifests, f"no manifest under {stores}"
    for mf in manifests:
        summary, body = (json.loads(line) for line in mf.read_bytes().split(b"\n"))
        doc = {**body, **summary}
        for digest, _, _, _, where in doc["chunks"]:
            out += [f"{doc['path']}: {digest[:16]} on {s}" for s in where
                    if not (stores / s / "chunks" / digest[:2] / digest).is_file()]
    return out


def inspect(cfg: Path, path: str) -> dict:
    return json.loads(cpfs("inspect", "--json", path, config=cfg).stdout)


SAVE = """
import sys, torch
n, per, seed, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
g = torch.Generator().manual_seed(seed)
sd = {f"t{i}": torch.randn(per // 2, generator=g).to(torch.bfloat16) for i in range(n)}
print("generated", flush=True)
torch.save(sd, path)
print("saved", flush=True)
"""


def save_in_subprocess(path: Path, nbytes: int, seed: int, per: int = 8 * MiB) -> subprocess.Popen:
    """torch.save of ~nbytes of bf16 tensors in a child; its first line says the tensors exist."""
    return subprocess.Popen([sys.executable, "-c", SAVE, str(nbytes // per), str(per), str(seed), str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def expected_of_save(nbytes: int, seed: int, per: int = 8 * MiB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(per // 2, generator=g).to(torch.bfloat16) for i in range(nbytes // per)}


# ---------------------------------------------------------------------------------------------------
# the savers users run

def test_torch_save_and_safetensors_round_trip(make_config, tmp_path, mount):
    """torch.save / torch.load (plain and mmap) and safetensors save / load through the mount,
    byte-identical to the same saves on local disk, and the same again from a fresh mount."""
    from safetensors.torch import load_file, save_file

    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    sd = state_dict(1)
    (m.path / "run").mkdir()
    torch.save(sd, m.path / "run" / "step_1.pt")
    save_file({k: v.contiguous() for k, v in sd.items()}, m.path / "run" / "model.safetensors")
    local = tmp_path / "local"              # same file name: torch.save names the archive's folder after it
    local.mkdir()
    torch.save(sd, local / "step_1.pt")
    save_file({k: v.contiguous() for k, v in sd.items()}, local / "model.safetensors")

    for mp in (m, mount(cfg, "fresh")):
        assert_same(torch.load(mp.path / "run" / "step_1.pt", weights_only=True), sd)
        assert_same(torch.load(mp.path / "run" / "step_1.pt", weights_only=True, mmap=True), sd)
        assert_same(load_file(mp.path / "run" / "model.safetensors"), sd)
        assert sha(mp.path / "run" / "step_1.pt") == sha(local / "step_1.pt")
        assert sha(mp.path / "run" / "model.safetensors") == sha(local / "model.safetensors")
    # Committed with a tensor index, like `cpfs put` would.
    doc = inspect(cfg, "run/step_1.pt")
    assert doc["tensor_index"] and doc["size"] == (local / "step_1.pt").stat().st_size


@pytest.mark.long
def test_cp_of_one_gib_then_sha256sum(make_config, tmp_path, mount):
    """`cp` of a 1 GiB file into the mount: sha256sum equal through the writer's mount (page cache)
    and through a fresh mount (every byte from the stores)."""
    src = tmp_path / "big.bin"
    with open(src, "wb") as f:
        for i in range(16):
            f.write(rand_bytes(64 * MiB, i))
    cfg = config(make_config, tmp_path, chunk_size="4MiB")
    m = mount(cfg)
    t0 = time.perf_counter()
    subprocess.run(["cp", str(src), str(m.path / "big.bin")], check=True)
    took = time.perf_counter() - t0
    print(f"\ncp of 1 GiB into the mount: {took:.1f} s ({GiB / took / 1e6:.0f} MB/s)")

    def sha256sum(path: Path) -> str:
        return subprocess.run(["sha256sum", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]

    want = sha256sum(src)
    assert sha256sum(m.path / "big.bin") == want
    fresh = mount(cfg, "fresh")
    assert (fresh.path / "big.bin").stat().st_size == GiB
    assert sha256sum(fresh.path / "big.bin") == want


def test_zipfile_with_seeks_and_numpy_savez(make_config, tmp_path, mount):
    """zipfile goes back to patch local headers (a streamed ZIP_STORED member of 24 MiB among deflated
    ones); numpy.savez streams members the same way. Bytes equal the same writes on local disk."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    big = rand_bytes(24 * MiB, 7)

    def write_zip(path: Path) -> None:
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(zipfile.ZipInfo("a.txt", (2024, 1, 1, 0, 0, 0)), b"hello " * 1000)
            with zf.open(zipfile.ZipInfo("big.bin", (2024, 1, 1, 0, 0, 0)), "w", force_zip64=True) as f:
                for off in range(0, len(big), MiB):
                    f.write(big[off:off + MiB])
            info = zipfile.ZipInfo("c.txt", (2024, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, b"deflated " * 50_000)

    write_zip(m.path / "archive.zip")
    write_zip(tmp_path / "archive.zip")
    assert sha(m.path / "archive.zip") == sha(tmp_path / "archive.zip")
    arrays = {f"a{i}": np.random.default_rng(i).standard_normal(300_000 * (i + 1)) for i in range(3)}
    np.savez(m.path / "arrays.npz", **arrays)

    fresh = mount(cfg, "fresh")
    with zipfile.ZipFile(fresh.path / "archive.zip") as zf:
        assert zf.testzip() is None
        assert zf.getinfo("big.bin").compress_type == zipfile.ZIP_STORED
        assert zf.read("big.bin") == big and zf.read("a.txt") == b"hello " * 1000
        assert zf.read("c.txt") == b"deflated " * 50_000
    with np.load(fresh.path / "arrays.npz") as z:
        assert sorted(z.files) == sorted(arrays)
        for k, v in arrays.items():
            assert np.array_equal(z[k], v), k


# ---------------------------------------------------------------------------------------------------
# names

def test_rename_unlink_mkdir_rmdir(make_config, tmp_path, mount):
    """POSIX name semantics in the mount, and what a fresh mount sees afterwards."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    p = m.path
    data = {name: rand_bytes(3 * MiB + i, i) for i, name in enumerate(["a", "b", "c", "d", "e"])}

    (p / "a").write_bytes(data["a"])
    os.rename(p / "a", p / "a2")                                   # rename a file
    assert not (p / "a").exists() and (p / "a2").read_bytes() == data["a"]

    (p / "b").write_bytes(data["b"])
    (p / "c").write_bytes(data["c"])
    os.rename(p / "b", p / "c")                                    # rename over an existing file
    assert not (p / "b").exists() and (p / "c").read_bytes() == data["b"]

    (p / "dir" / "sub").mkdir(parents=True)                        # rename a folder with files inside
    (p / "dir" / "d").write_bytes(data["d"])
    (p / "dir" / "sub" / "e").write_bytes(data["e"])
    os.rename(p / "dir", p / "moved")
    assert not (p / "dir").exists()
    assert sorted(os.listdir(p / "moved")) == ["d", "sub"]
    assert (p / "moved" / "d").read_bytes() == data["d"] and (p / "moved" / "sub" / "e").read_bytes() == data["e"]

    with pytest.raises(OSError) as e:                              # mkdir of an existing name
        os.mkdir(p / "moved")
    assert e.value.errno == errno.EEXIST
    with pytest.raises(OSError) as e:
        os.mkdir(p / "a2")
    assert e.value.errno == errno.EEXIST
    with pytest.raises(OSError) as e:                              # rmdir of a folder that is not empty
        os.rmdir(p / "moved" / "sub")
    assert e.value.errno == errno.ENOTEMPTY
    os.mkdir(p / "empty")
    os.rmdir(p / "empty")
    assert not (p / "empty").exists()

    os.unlink(p / "moved" / "sub" / "e")                           # unlink, then ENOENT
    for probe in (os.stat, lambda f: open(f, "rb"), os.unlink):
        with pytest.raises(FileNotFoundError):
            probe(p / "moved" / "sub" / "e")
    os.rmdir(p / "moved" / "sub")

    # Renamed over a file still being written (never committed): the writer's bytes go nowhere.
    with open(p / "t", "wb") as w:
        w.write(b"writer's first bytes")
        w.flush()
        (p / "src").write_bytes(data["c"])
        os.rename(p / "src", p / "t")
        w.write(b" and more")
    assert (p / "t").read_bytes() == data["c"]

    # Reading a file while it is open for writing sees what was written (and its size).
    with open(p / "open.bin", "wb") as w:
        w.write(data["a"][:5 * 100_000])
        w.flush()
        assert os.stat(p / "open.bin").st_size == 500_000
        with open(p / "open.bin", "rb") as r:
            assert r.read() == data["a"][:500_000]
        w.seek(10)
        w.write(b"X" * 10)
        w.flush()
        with open(p / "open.bin", "rb") as r:
            assert r.read(30) == data["a"][:10] + b"X" * 10 + data["a"][20:30]
    want_open = data["a"][:10] + b"X" * 10 + data["a"][20:500_000]
    assert (p / "open.bin").read_bytes() == want_open

    fresh = mount(cfg, "fresh")
    q = fresh.path
    assert sorted(os.listdir(q)) == ["a2", "c", "moved", "open.bin", "t"]
    assert os.listdir(q / "moved") == ["d"]
    assert (q / "a2").read_bytes() == data["a"] and (q / "c").read_bytes() == data["b"]
    assert (q / "moved" / "d").read_bytes() == data["d"] and (q / "open.bin").read_bytes() == want_open
    assert (q / "t").read_bytes() == data["c"]


# ---------------------------------------------------------------------------------------------------
# a second mount over the same stores

def test_second_mount_sees_a_new_file_only_after_close(make_config, tmp_path, mount):
    """Written but neither fsynced nor closed: not there for B. Closed: B reads the same bytes.
    (fsync commits too: B sees what was written up to it, and the rest after close.)"""
    cfg = config(make_config, tmp_path)
    a, b = mount(cfg, "a"), mount(cfg, "b")
    data = rand_bytes(20 * MiB + 5, 1)
    with open(a.path / "new.bin", "wb") as f:
        f.write(data)
        f.flush()                                  # in the kernel and the daemon; no fsync, no close
        assert (a.path / "new.bin").stat().st_size == len(data)
        time.sleep(1.5)                            # well past B's refresh interval
        assert not (b.path / "new.bin").exists()
        assert "new.bin" not in os.listdir(b.path)
    assert wait_for(lambda: (b.path / "new.bin").exists()), "B never saw the closed file"
    assert sha(b.path / "new.bin") == hashlib.sha256(data).hexdigest()

    more = rand_bytes(3 * MiB, 2)
    with open(a.path / "synced.bin", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        assert wait_for(lambda: (b.path / "synced.bin").exists()), "B never saw the fsynced file"
        assert sha(b.path / "synced.bin") == hashlib.sha256(data).hexdigest()
        f.write(more)
    assert wait_for(lambda: sha(b.path / "synced.bin") == hashlib.sha256(data + more).hexdigest())


def test_second_mount_sees_old_bytes_until_the_overwrite_is_closed(make_config, tmp_path, mount):
    """A replaces a file B has read (same size, as a checkpoint of the same model is)."""
    cfg = config(make_config, tmp_path)
    a, b = mount(cfg, "a"), mount(cfg, "b")
    old, new = rand_bytes(12 * MiB + 3, 1), rand_bytes(12 * MiB + 3, 2)
    (a.path / "ckpt.bin").write_bytes(old)
    assert wait_for(lambda: (b.path / "ckpt.bin").exists())
    assert (b.path / "ckpt.bin").read_bytes() == old
    with open(a.path / "ckpt.bin", "wb") as f:     # O_TRUNC: replaces the file
        f.write(new)
        f.flush()
        time.sleep(1.5)
        assert (b.path / "ckpt.bin").read_bytes() == old
        assert (b.path / "ckpt.bin").stat().st_size == len(old)
    assert wait_for(lambda: (b.path / "ckpt.bin").read_bytes() == new), "B never saw the new version"
    newer = rand_bytes(5 * MiB, 3)                 # and a size change, which B's kernel must learn
    (a.path / "ckpt.bin").write_bytes(newer)
    assert wait_for(lambda: (b.path / "ckpt.bin").read_bytes() == newer), "B never saw the third version"
    assert (b.path / "ckpt.bin").stat().st_size == len(newer)


@pytest.mark.long
def test_names_changed_here_survive_a_concurrent_refresh(make_config, tmp_path, mount):
    """Another process lists the mount without pause (each listing re-reads every manifest, ~0.5 s
    here): files written, unlinked or renamed meanwhile must not vanish or come back when a listing
    that started before the change is applied."""
    slow = config(make_config, tmp_path, store_extra='latency = "100ms"')
    slow.write_text(slow.read_text().replace('refresh = "0.5s"', 'refresh = "0.1s"'))
    fast = slow.with_name("fast.toml")
    fast.write_text(slow.read_text().replace('latency = "100ms"', ""))
    src = tmp_path / "many"
    src.mkdir()
    for i in range(200):
        (src / f"f{i:03d}").write_bytes(b"x" * (i + 1))
    cpfs("put", str(src), "many", config=fast)
    m = mount(slow)
    stop = threading.Event()

    def lister() -> None:
        while not stop.is_set():
            os.listdir(m.path)

    t = threading.Thread(target=lister)
    t.start()
    problems: list[str] = []
    present: list[Path] = []
    gone: list[Path] = []

    def check() -> None:
        problems.extend(f"{p.name} vanished" for p in present if not p.exists())
        problems.extend(f"{p.name} came back" for p in gone if p.exists())

    try:
        for i in range(6):
            (m.path / f"x{i}").write_bytes(b"hello")
            present.append(m.path / f"x{i}")
            (m.path / "many" / f"f{i:03d}").unlink()
            gone.append(m.path / "many" / f"f{i:03d}")
            os.rename(m.path / "many" / f"f{100 + i}", m.path / "many" / f"r{i}")
            gone.append(m.path / "many" / f"f{100 + i}")
            present.append(m.path / "many" / f"r{i}")
            check()
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            check()
            time.sleep(0.05)
    finally:
        stop.set()
        t.join()
    assert not problems, sorted(set(problems))


# ---------------------------------------------------------------------------------------------------
# a crash of the daemon while saving

def test_kill_9_during_torch_save_leaves_the_previous_version(make_config, tmp_path, mount):
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    v1 = state_dict(1)
    torch.save(v1, m.path / "ckpt.pt")
    target = m.path / "ckpt.pt"
    saver = save_in_subprocess(target, 384 * MiB, seed=2)
    try:
        assert saver.stdout.readline().strip() == "generated", saver.stderr.read()
        # Kill once the new version is well under way (its size as this mount shows it).
        assert wait_for(lambda: target.stat().st_size > 96 * MiB, timeout=60), "the save never got going"
        os.kill(m.pid, signal.SIGKILL)                       # our own daemon, by its pid
        saver.wait(timeout=60)
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    assert saver.returncode != 0, "the save cannot have succeeded"
    assert wait_for(lambda: not m.alive(), timeout=10)
    m.stop()                                                 # fusermount3 -u of the stale mount
    assert not os.path.ismount(m.path)

    [dead] = (tmp_path / "staging").glob(f"cpfs-{m.pid}-*")  # the killed daemon left its staging folder
    again = mount(cfg)
    assert_same(torch.load(again.path / "ckpt.pt", weights_only=True), v1)
    assert dangling_chunks(cfg) == []
    assert not dead.exists(), "the next daemon removed it"


class PausedWrites:
    """A file object that stops its writer once `after` bytes are through, until `resume` is set: a save
    that takes as long as the test says (a slow store, a saver that streams its state as it trains)."""

    def __init__(self, f, after: int) -> None:
        self.f, self.after = f, after
        self.paused, self.resume = threading.Event(), threading.Event()

    def write(self, data) -> int:
        n = self.f.write(data)
        if self.f.tell() >= self.after and not self.paused.is_set():
            self.paused.set()
            self.resume.wait(timeout=300)
        return n

    def flush(self) -> None:
        self.f.flush()


@pytest.mark.long
@pytest.mark.slow
def test_a_save_that_outlasts_the_gc_grace_keeps_its_chunks_through_a_gc(make_config, tmp_path, mount):
    """torch.save into the mount stops half way for longer than gc_grace (60 s, the floor) and
    `cpfs gc` runs meanwhile: the chunks stored so far are named by no version yet and are older than
    the grace. The mount renews them while the file is open, so gc takes none, and the save commits a
    checkpoint that loads whole on a fresh mount. Before, gc deleted them and the loaded checkpoint
    failed with EIO (real time, ~75 s)."""
    cfg = make_config(extra=f'gc_grace = "60s"\n[mount]\nstaging = "{tmp_path / "staging"}"\n')
    m = mount(cfg)
    sd = state_dict(3, layers=8, width=1024)                 # ~17 MiB: 17 chunks of 1 MiB
    out = open(m.path / "ckpt.pt", "wb")
    writes = PausedWrites(out, after=9 * MiB)
    saver = threading.Thread(target=lambda: torch.save(sd, writes))
    saver.start()
    try:
        assert writes.paused.wait(timeout=60), "the save never got half way"
        time.sleep(72)                                       # what it stored is now older than the grace
        # A real `cpfs gc`, forked while the file is open: its close of the descriptor commits nothing
        # (cpfs/openers.py), so no failed version names the chunks stored so far and only renewal spares them.
        report = json.loads(cpfs("gc", "--json", config=cfg).stdout)
    finally:
        writes.resume.set()
        saver.join(timeout=120)
    out.close()
    assert report["refused"] is None and report["manifests"] == 0
    assert sum(s["deleted"] for s in report["stores"]) == 0, report
    assert [r["state"] for r in json.loads(cpfs("log", "/ckpt.pt", "--json", config=cfg).stdout)] == ["ok"]
    assert json.loads((m.path / ".cpfs-stats").read_bytes())["replicas"]["renewed"] >= 2 * 8
    m.stop()
    assert dangling_chunks(cfg) == []
    again = mount(cfg, "again")
    assert_same(torch.load(again.path / "ckpt.pt", weights_only=True), sd)


def test_torch_save_through_the_mount_cuts_like_cpfs_put(make_config, tmp_path, mount):
    """A checkpoint torch.save'd through the mount (cut by the boundary scanner while it is written) and
    the same bytes put with `cpfs put` (cut from the tensor index) have the same chunks, cut LEAD bytes
    into each big record and TAIL bytes before its end; torch.load(mmap=True) of it reads it back."""
    from cpfs.chunking import LEAD, TAIL

    cfg = config(make_config, tmp_path, chunk_size="4MiB", cache="256MiB")
    m = mount(cfg)
    g = torch.Generator().manual_seed(3)
    sizes = [6_000_000, 300_000, 1_500_000, 800_000, 4_500_000, 2_000, 9_000_000]      # bytes of bf16
    sd = {f"layers.{i}.w": torch.randn(n // 2, generator=g).to(torch.bfloat16) for i, n in enumerate(sizes)}
    torch.save(sd, m.path / "step_7.pt")
    stored = {f.name for f in stores_of(cfg).glob("*/chunks/*/*")}
    local = tmp_path / "local"              # same file name: torch.save names the archive's folder after it
    local.mkdir()
    torch.save(sd, local / "step_7.pt")
    cpfs("put", str(local / "step_7.pt"), "/imported/step_7.pt", config=cfg)

    written, imported = inspect(cfg, "step_7.pt"), inspect(cfg, "imported/step_7.pt")
    # Write-behind stored only chunks of the final layout: the scanner predicted every cut in time.
    assert stored == {c[0] for c in written["chunks"]}
    assert written["size"] == imported["size"] == (local / "step_7.pt").stat().st_size
    assert [c[:2] for c in written["chunks"]] == [c[:2] for c in imported["chunks"]]
    offsets = {0}
    for c in written["chunks"]:
        offsets.add(max(offsets) + c[1])
    big = [r for r in written["tensor_index"]["records"] if r["length"] >= 512 * 1024]
    assert len(big) == 5
    for r in big:
        assert {r["offset"] + LEAD, r["offset"] + r["length"] - TAIL} <= offsets, r
    assert_same(torch.load(m.path / "step_7.pt", weights_only=True, mmap=True), sd)


# ---------------------------------------------------------------------------------------------------
# dedup between checkpoints

def test_second_checkpoint_with_frozen_layers_adds_little(make_config, tmp_path, mount):
    """90% of the layers frozen: the second checkpoint adds at most 20% of its size in new chunks."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    layers = 20
    g = torch.Generator().manual_seed(0)
    v1 = {f"layers.{i}.{w}": torch.randn(512, 1024, generator=g).to(torch.bfloat16)
          for i in range(layers) for w in ("attn", "mlp")}
    v1["step"] = torch.tensor(1)
    v2 = dict(v1)
    for i in range(layers // 10):                              # 10% of the layers trained on
        for w in ("attn", "mlp"):
            v2[f"layers.{i * 10 + 3}.{w}"] = v1[f"layers.{i * 10 + 3}.{w}"] + 1
    v2["step"] = torch.tensor(2)

    torch.save(v1, m.path / "step_1.pt")
    stored_before = sum(f.stat().st_size for f in stores_of(cfg).rglob("*") if f.is_file())
    torch.save(v2, m.path / "step_2.pt")
    stored_after = sum(f.stat().st_size for f in stores_of(cfg).rglob("*") if f.is_file())
    assert_same(torch.load(m.path / "step_2.pt", weights_only=True), v2)

    first, second = inspect(cfg, "step_1.pt"), inspect(cfg, "step_2.pt")
    known = {c[0] for c in first["chunks"]}
    new_bytes = sum(c[1] for c in second["chunks"] if c[0] not in known)
    ratio = new_bytes / second["size"]
    growth = (stored_after - stored_before) / 2 / second["size"]   # replicas = 2
    print(f"\ndedup: the second checkpoint ({second['size'] / MiB:.1f} MiB, {len(second['chunks'])} chunks) "
          f"adds {new_bytes / MiB:.1f} MiB of new chunk data = {100 * ratio:.1f}% of its size "
          f"(store growth per replica: {100 * growth:.1f}%)")
    assert ratio <= 0.20
    assert growth <= 0.21       # the manifest adds a little


# ---------------------------------------------------------------------------------------------------
# stores that fail under a writer

@pytest.fixture
def small_tmpfs_stores(tmp_path: Path) -> Iterator[Callable[[Path, int], None]]:
    """mount_stores(cfg, size): every store folder of `cfg` a tmpfs of `size` bytes (root only)."""
    mounted: list[Path] = []

    def mount_stores(cfg: Path, size: int) -> None:
        for i in range(3):
            d = stores_of(cfg) / f"s{i}"
            d.mkdir(parents=True)
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
            mounted.append(d)

    yield mount_stores
    for d in mounted:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_full_stores_give_enospc_at_close_and_keep_the_previous_version(make_config, tmp_path, mount,
                                                                        small_tmpfs_stores):
    """Three 40 MiB stores, replicas 2: a 40 MiB file fits, a second version of it does not."""
    cfg = config(make_config, tmp_path)
    small_tmpfs_stores(cfg, 40 * MiB)
    m = mount(cfg)
    old = rand_bytes(40 * MiB, 1)
    (m.path / "ckpt.bin").write_bytes(old)
    f = open(m.path / "ckpt.bin", "wb")
    f.write(rand_bytes(40 * MiB, 2))             # the same size: the kernel sees no reason to drop pages
    with pytest.raises(OSError) as e:
        f.close()
    print(f"\nclose() with full stores: {e.value!r}")
    assert e.value.errno == errno.ENOSPC

    assert (m.path / "ckpt.bin").read_bytes() == old        # the writer's mount: the previous version
    with pytest.raises(OSError) as e:                       # a new file fails alike, and is gone after
        with open(m.path / "new.bin", "wb") as f:
            f.write(rand_bytes(40 * MiB, 3))
    assert e.value.errno == errno.ENOSPC
    assert not (m.path / "new.bin").exists() and "new.bin" not in os.listdir(m.path)
    (m.path / "new.bin").write_bytes(b"small enough")      # and the name can be used again
    assert (m.path / "new.bin").read_bytes() == b"small enough"

    fresh = mount(cfg, "fresh")
    assert (fresh.path / "ckpt.bin").read_bytes() == old
    assert (fresh.path / "new.bin").read_bytes() == b"small enough"
    assert dangling_chunks(cfg) == []
    assert "flush failed" in m.log.read_text()


@pytest.mark.parametrize("how", [
    "replaced by files",
    "renamed away",
])
def test_vanishing_stores_give_eio_at_close_and_lose_nothing(make_config, tmp_path, mount, how):
    """Two of three stores (replicas 2) vanish mid-write: no chunk reaches its quorum."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    v1 = state_dict(1, layers=16)
    torch.save(v1, m.path / "ckpt.pt")
    (tmp_path / "v2").mkdir()
    torch.save(state_dict(2, layers=16), tmp_path / "v2" / "ckpt.pt")   # same size, other values
    v2 = (tmp_path / "v2" / "ckpt.pt").read_bytes()
    assert len(v2) == (m.path / "ckpt.pt").stat().st_size
    stores = stores_of(cfg)
    f = open(m.path / "ckpt.pt", "wb")
    f.write(v2[:len(v2) // 2])
    f.flush()
    for name in ("s0", "s1"):
        (stores / name).rename(stores / f"{name}.away")
        if how == "replaced by files":
            (stores / name).write_text("not a folder any more")
    f.write(v2[len(v2) // 2:])
    try:
        with pytest.raises(OSError) as e:
            f.close()
        print(f"\nclose() with two stores {how}: {e.value!r}")
        assert e.value.errno == errno.EIO
    finally:
        for name in ("s0", "s1"):
            if (stores / name).is_dir():
                shutil.rmtree(stores / name)
            (stores / name).unlink(missing_ok=True)
            (stores / f"{name}.away").rename(stores / name)
    assert dangling_chunks(cfg) == []
    assert_same(torch.load(m.path / "ckpt.pt", weights_only=True), v1)
    assert_same(torch.load(mount(cfg, "fresh").path / "ckpt.pt", weights_only=True), v1)


# ---------------------------------------------------------------------------------------------------
# memory

@pytest.mark.long
def test_daemon_memory_while_saving_512_mib_stays_near_the_cache_budget(make_config, tmp_path, mount):
    budget, slack = 64 * MiB, 200 * MiB
    cfg = config(make_config, tmp_path, cache="64MiB", chunk_size="4MiB")
    m = mount(cfg)
    size = 512 * MiB
    saver = save_in_subprocess(m.path / "big.pt", size, seed=5)
    try:
        assert saver.stdout.readline().strip() == "generated", saver.stderr.read()
        with RssSampler(m.pid) as rss:
            out, err = saver.communicate(timeout=300)
        assert saver.returncode == 0, err
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    growth = rss.peak - rss.before
    print(f"\ndaemon RSS while saving {size / MiB:.0f} MiB: before {rss.before / MiB:.0f} MiB, "
          f"peak {rss.peak / MiB:.0f} MiB, growth {growth / MiB:.0f} MiB ({rss.samples} samples; "
          f"cache budget {budget / MiB:.0f} MiB)")
    assert growth < budget + slack
    got = torch.load(m.path / "big.pt", weights_only=True, mmap=True)
    want = expected_of_save(size, seed=5)
    for k in ("t0", f"t{len(want) - 1}"):
        assert torch.equal(got[k], want[k]), k


def test_store_permission_errors_give_eacces_at_close_and_lose_nothing(make_config, tmp_path, mount):
    """Two of three stores refuse writes (immutable folders: even root cannot write): close() says
    EACCES, the previous version stays, no manifest points at a missing chunk."""
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr")
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    v1 = state_dict(1)
    torch.save(v1, m.path / "ckpt.pt")
    stores = stores_of(cfg)
    locked = [stores / "s0", stores / "s1"]
    if subprocess.run(["chattr", "-R", "+i", *map(str, locked)], capture_output=True).returncode != 0:
        subprocess.run(["chattr", "-R", "-i", *map(str, locked)], capture_output=True)
        pytest.skip("this filesystem has no immutable attribute")
    torch.save(state_dict(2), tmp_path / "v2.pt")
    try:
        f = open(m.path / "ckpt.pt", "wb")     # torch.save's C++ writer hides the errno: plain writes
        f.write((tmp_path / "v2.pt").read_bytes())
        with pytest.raises(OSError) as e:
            f.close()
        assert e.value.errno == errno.EACCES
    finally:
        subprocess.run(["chattr", "-R", "-i", *map(str, locked)], check=True)
    assert_same(torch.load(m.path / "ckpt.pt", weights_only=True), v1)
    assert dangling_chunks(cfg) == []
    log = m.log.read_text()
    assert "flush failed" in log and ("'s0'" in log or "'s1'" in log)


def test_a_sparse_file_of_16_gib_closes_and_reads_back(make_config, tmp_path, mount):
    """`truncate -s` far past the data (a preallocating downloader, np.lib.format.open_memmap before its
    writes): the close stores the holes as the zero chunk instead of hashing 16 GiB of zeros (~30 s,
    uninterruptible, before), and every mount reads the data where it was written, zeros elsewhere."""
    cfg = config(make_config, tmp_path)
    a = mount(cfg, "a")
    pieces = {0: b"head" * 1000, 5 * 2**30 + 7: rand_bytes(3 * MiB, 1), 16 * 2**30 - 10: b"0123456789"}
    fd = os.open(a.path / "sparse.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.ftruncate(fd, 16 * 2**30)
        for offset, data in pieces.items():
            os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
    for m in (a, mount(cfg, "b")):
        assert (m.path / "sparse.bin").stat().st_size == 16 * 2**30
        with open(m.path / "sparse.bin", "rb") as f:
            for offset, data in pieces.items():
                f.seek(offset - 100 if offset else 0)
                got = f.read(len(data) + 200)
                want = (bytes(100) if offset else b"") + data + bytes(200)
                assert got == want[:len(got)] and len(got) >= len(data), offset
            f.seek(9 * 2**30)
            assert f.read(8 * MiB) == bytes(8 * MiB)
    assert dangling_chunks(cfg) == []


def test_stat_polled_in_another_mount_shows_a_new_save_once_its_entry_expires(make_config, tmp_path, mount):
    """An evaluator on another node polls `os.stat(latest.pt)` for a new save. With `entry_timeout` as
    short as `refresh`, mount B shows the new size within a few seconds; it kept the old one until an
    open or a listing (the failover-reload audit: over 20 s, up to entry_timeout after that)."""
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\nrefresh = "0.5s"\n'
                            f'entry_timeout = "1s"\n')
    a, b = mount(cfg, "a"), mount(cfg, "b")
    (a.path / "latest.pt").write_bytes(b"x" * 1000)
    assert wait_for(lambda: (b.path / "latest.pt").exists(), timeout=10)
    assert (b.path / "latest.pt").stat().st_size == 1000
    (a.path / "latest.pt").write_bytes(b"y" * 5000)
    assert wait_for(lambda: (b.path / "latest.pt").stat().st_size == 5000, timeout=10)
    assert (b.path / "latest.pt").read_bytes() == b"y" * 5000


def test_chmod_utime_truncate_reach_other_mounts(make_config, tmp_path, mount):
    cfg = config(make_config, tmp_path)
    a = mount(cfg, "a")
    (a.path / "f.bin").write_bytes(b"x" * 100_000)
    os.chmod(a.path / "f.bin", 0o600)
    os.utime(a.path / "f.bin", ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    os.truncate(a.path / "f.bin", 1234)
    for m in (a, mount(cfg, "b")):
        st = (m.path / "f.bin").stat()
        assert (st.st_mode & 0o777, st.st_size) == (0o600, 1234)
        assert (m.path / "f.bin").read_bytes() == b"x" * 1234
    st = (mount(cfg, "c").path / "f.bin").stat()
    # truncate after utime commits a new version: its mtime is the truncate's, not older than utime's
    assert st.st_mtime_ns >= 1_600_000_000_000_000_000


@pytest.mark.long
def test_a_file_rewritten_while_another_thread_chmods_it_keeps_every_save(make_config, tmp_path, mount):
    """A saver rewrites one file (open O_TRUNC, write, close) while another thread chmods it. The
    kernel sends each close's RELEASE after close() returned; the next save's open could join the
    session that release was ending, and its write failed (EIO, at once here before the fix); a
    chmod's version made before a save could land after it. Every save reads back as written, and
    the file ends with the last save's bytes and the last chmod's mode."""
    m = mount(make_config(chunk_size="1MiB"))
    f = m.path / "f.bin"
    f.write_bytes(b"x" * MiB)
    stop = threading.Event()
    modes: list[int] = []

    def chmods() -> None:
        while not stop.is_set():
            mode = [0o600, 0o640, 0o644][len(modes) % 3]
            os.chmod(f, mode)
            modes.append(mode)

    t = threading.Thread(target=chmods)
    t.start()
    try:
        for i in range(100):
            data = os.urandom(MiB + i * 4099)
            f.write_bytes(data)
            assert f.read_bytes() == data, i
    finally:
        stop.set()
        t.join()
    assert f.read_bytes() == data and os.stat(f).st_mode & 0o777 == modes[-1] and len(modes) > 10
    assert "unexpectedly" not in m.log.read_text()


@pytest.mark.parametrize("other", ["unlink", "rename"])
def test_a_close_racing_an_unlink_or_a_rename_from_another_thread(make_config, mount, other):
    """One thread closes a file it wrote (close() commits: it uploads, then commits under the file's
    name) while another thread unlinks it or renames it away, a few ms into the close. Whichever the
    daemon ran first, the names left hold the save, in this mount and in the stores (`cpfs ls`, what
    a fresh mount shows): after an unlink no name is left; after a rename the new name has the saved
    bytes. On the code before, the close's commit brought the old name back, which the mount itself
    then showed: after the unlink in round 0 (2 of 2 runs), after the rename in round 2, 3 or 4 (3 of
    3 runs once the save was written through a buffered file and flushed before the close)."""
    cfg = make_config(chunk_size="1MiB")
    m = mount(cfg)
    for i in range(6):
        f, g = m.path / f"f{i}.bin", m.path / f"g{i}.bin"
        data = os.urandom(24 * MiB + i)
        closing = threading.Event()

        def change_names() -> None:
            closing.wait()
            time.sleep(0.002 * i)
            if other == "unlink":
                os.unlink(f)
            else:
                os.rename(f, g)

        t = threading.Thread(target=change_names)
        t.start()
        try:
            with open(f, "wb") as out:
                out.write(data)
                out.flush()          # the bytes are in the daemon: what is left is the close's commit
                closing.set()
        finally:
            closing.set()
            t.join()
        assert not f.exists(), i
        if other == "rename":
            assert g.read_bytes() == data, i
    listed = cpfs("ls", "/", config=cfg, text=True).stdout
    expected = {f"g{i}.bin" for i in range(6)} if other == "rename" else set()
    assert {name for name in listed.split() if name.endswith(".bin")} == expected, listed


def test_saves_by_temporary_name_and_rename_are_atomic_to_readers_and_chmods(make_config, mount):
    """How many savers make a save atomic: write `ckpt.tmp`, close, rename it over `ckpt`, in a loop,
    while one thread reads `ckpt` whole over and over and another chmods it. Each save is
    self-describing (its number, then a BLAKE2 digest of the rest, then random bytes of its own
    length), so a reader can tell a whole save from a torn or mixed one: every read must be one whole
    save, never older than one the reader saw before it; at the end `ckpt` holds the last save, no
    `ckpt.tmp` is left, and the stores (`cpfs ls`, what a fresh mount sees) agree."""
    cfg = make_config(chunk_size="1MiB")
    m = mount(cfg)
    final, tmp = m.path / "ckpt", m.path / "ckpt.tmp"
    stop = threading.Event()
    problems: list[str] = []
    reads = chmods = 0

    def make(i: int) -> bytes:
        body = os.urandom(MiB + (i * 40961) % (3 * MiB))
        return i.to_bytes(8, "little") + hashlib.blake2b(body, digest_size=32).digest() + body

    def whole(data: bytes) -> int | None:
        """The save's number, if `data` is one whole save."""
        if len(data) < 40 or hashlib.blake2b(data[40:], digest_size=32).digest() != data[8:40]:
            return None
        return int.from_bytes(data[:8], "little")

    def reader() -> None:
        nonlocal reads
        last = -1
        while not stop.is_set():
            try:
                data = final.read_bytes()
            except FileNotFoundError:
                continue          # before the first save
            except OSError as e:  # as a local filesystem: an open racing a rename opens old or new
                problems.append(f"read {reads}: {e!r}")
                return
            n = whole(data)
            if n is None or n < last:
                problems.append(f"read {reads}: {len(data)} bytes, save {n} after save {last}")
                return
            last, reads = n, reads + 1

    def chmodder() -> None:
        nonlocal chmods
        while not stop.is_set():
            try:
                os.chmod(final, [0o600, 0o644][chmods % 2])
                chmods += 1
            except FileNotFoundError:
                pass

    threads = [threading.Thread(target=reader), threading.Thread(target=chmodder)]
    for t in threads:
        t.start()
    try:
        for i in range(40):
            data = make(i)
            tmp.write_bytes(data)
            os.rename(tmp, final)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not problems, problems
    assert whole(final.read_bytes()) == 39 and not tmp.exists()
    assert reads > 10 and chmods > 10, (reads, chmods)
    listed = cpfs("ls", "/", config=cfg, text=True).stdout.split()
    assert "ckpt" in listed and "ckpt.tmp" not in listed, listed
    assert "unexpectedly" not in m.log.read_text()


def test_a_file_unlinked_while_written_reopens_through_proc_fd(make_config, tmp_path, mount):
    """A writer unlinks its scratch file and reopens it through /proc/self/fd (as tools that pass an
    unnamed temporary file on do): the open shares the session, both handles read what either wrote,
    and nothing is committed. The open gave ESTALE (an audit's find)."""
    m = mount(config(make_config, tmp_path))
    f = m.path / "scratch.bin"
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"first half ")
        os.unlink(f)
        fd2 = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            os.pwrite(fd2, b"second half", 11)
            assert os.pread(fd, 64, 0) == os.pread(fd2, 64, 0) == b"first half second half"
        finally:
            os.close(fd2)
    finally:
        os.close(fd)
    time.sleep(0.6)                                         # past the mount's refresh
    assert os.listdir(m.path) == [] and os.listdir(mount(config(make_config, tmp_path), "b").path) == []
