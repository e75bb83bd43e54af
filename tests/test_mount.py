"""Through a real mount: bytes, torch.load, safetensors, concurrency, errors, mount lifecycle."""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, cpfs, write_config
from tests.s3server import S3_LAYOUTS, s3_server, write_s3_config  # noqa: F401  (s3_server: a fixture)

pytestmark = pytest.mark.mount


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def state_dict(seed: int = 0, layers: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(2048, 256, generator=g).to(torch.bfloat16)}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = torch.randn(768, 256, generator=g).to(torch.bfloat16)
        sd[p + "mlp.up.weight"] = torch.randn(1024, 256, generator=g).to(torch.bfloat16)
        sd[p + "norm.weight"] = torch.ones(256)
        sd[p + "exp_avg"] = torch.zeros(1024, 256)
    sd["step"] = torch.tensor(100)
    return sd


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A folder of files of every shape: checkpoints, safetensors, odd sizes, empty, nested."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    (src / "run1" / "deep" / "er").mkdir(parents=True)
    torch.save(state_dict(0), src / "run1" / "step_100.pt")
    torch.save(state_dict(1), src / "run1" / "step_200.pt")
    save_file({k: v.contiguous() for k, v in state_dict(2).items()}, src / "run1" / "model.safetensors")
    rng = random.Random(3)
    (src / "run1" / "deep" / "er" / "odd.bin").write_bytes(rng.randbytes(3 * 1024 * 1024 + 12345))
    (src / "run1" / "empty").write_bytes(b"")
    (src / "tiny.txt").write_bytes(b"hello\n")
    return src


@pytest.fixture
def imported(make_config, source: Path) -> Path:
    cfg = make_config()
    cpfs("put", str(source / "run1"), "run1", config=cfg)
    cpfs("put", str(source / "tiny.txt"), config=cfg)
    return cfg


@pytest.fixture(params=["folders", *S3_LAYOUTS])
def imported_any(request: pytest.FixtureRequest, make_config, source: Path, tmp_path: Path) -> Path:
    """The same files on three folder stores, on two buckets of a loopback S3 server, or on a folder
    and a bucket: the read tests run over each."""
    if request.param == "folders":
        cfg = make_config()
    else:
        cfg, _ = write_s3_config(request.getfixturevalue("s3_server"), tmp_path / "s3cfg", request.param)
    cpfs("put", str(source / "run1"), "run1", config=cfg)
    cpfs("put", str(source / "tiny.txt"), config=cfg)
    return cfg


def test_every_file_reads_back_byte_exact(imported_any, source, mount):
    m = mount(imported_any)
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = f.relative_to(source)
        assert sha(m.path / rel) == sha(f), rel
        st = (m.path / rel).stat()
        assert st.st_size == f.stat().st_size and st.st_mtime_ns == f.stat().st_mtime_ns
    assert sorted(os.listdir(m.path)) == ["run1", "tiny.txt"]
    assert sorted(os.listdir(m.path / "run1")) == ["deep", "empty", "model.safetensors", "step_100.pt",
                                                   "step_200.pt"]
    # The tools users reach for.
    out = subprocess.run(["sha256sum", str(m.path / "run1" / "step_100.pt")], capture_output=True, text=True)
    assert out.stdout.split()[0] == sha(source / "run1" / "step_100.pt")
    dst = m.path.parent / "copy.bin"
    shutil.copyfile(m.path / "run1" / "deep" / "er" / "odd.bin", dst)
    assert dst.read_bytes() == (source / "run1" / "deep" / "er" / "odd.bin").read_bytes()
    dd = subprocess.run(["dd", f"if={m.path / 'run1/deep/er/odd.bin'}", "bs=1M", "skip=1", "count=1",
                         "status=none"], capture_output=True)
    assert dd.stdout == (source / "run1/deep/er/odd.bin").read_bytes()[1 << 20:2 << 20]


def test_torch_load_equals_originals_plain_and_mmap(imported_any, source, mount):
    m = mount(imported_any)
    for name, seed in (("step_100.pt", 0), ("step_200.pt", 1)):
        want = state_dict(seed)
        for use_mmap in (False, True):
            got = torch.load(m.path / "run1" / name, weights_only=True, mmap=use_mmap)
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (name, k, use_mmap)


def test_mmap_of_a_mounted_file(imported, source, mount):
    m = mount(imported)
    src = (source / "run1/deep/er/odd.bin").read_bytes()
    with open(m.path / "run1/deep/er/odd.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        for off in (0, 4095, 1 << 20, len(src) - 10):
            assert mm[off:off + 10] == src[off:off + 10]


def test_o_direct_reads_and_buffered_reads_after_them_are_byte_exact(imported, source, mount):
    """An O_DIRECT open's replies do not reach the page cache: its reads must not take pages out of the
    pushes (cpfs/pagecache.py: Pusher.replied), or the buffered reads after them would miss those."""
    m = mount(imported)
    for rel in ("run1/step_100.pt", "run1/deep/er/odd.bin"):
        want = (source / rel).read_bytes()
        dd = subprocess.run(["dd", f"if={m.path / rel}", "iflag=direct", "bs=1M", "status=none"],
                            capture_output=True, check=True)
        assert dd.stdout == want, rel
        assert (m.path / rel).read_bytes() == want, rel


def test_an_o_direct_reader_after_a_buffered_one_is_served_without_pushing_the_file_again(make_config, tmp_path,
                                                                                            mount):
    """Once a buffered read put a file in the kernel's page cache, an O_DIRECT reader's reads still come
    to the daemon (they bypass those pages): served byte-exact from chunks fetched ahead of it, with
    nothing counted as pages the kernel dropped and nothing pushed to the kernel again."""
    import json

    from cpfs.pagecache import RACE

    src = tmp_path / "big.bin"
    src.write_bytes(random.Random(7).randbytes(12 * 1024 * 1024 + 4321))
    cfg = make_config()
    cpfs("put", str(src), "/big.bin", config=cfg)
    m = mount(cfg)
    want = src.read_bytes()
    assert (m.path / "big.bin").read_bytes() == want
    time.sleep(RACE + 0.2)                  # the pushes are old: a read of their pages now means a drop
    before = json.loads((m.path / ".cpfs-stats").read_bytes())
    dd = subprocess.run(["dd", f"if={m.path / 'big.bin'}", "iflag=direct", "bs=256K", "status=none"],
                        capture_output=True, check=True)
    assert dd.stdout == want
    after = json.loads((m.path / ".cpfs-stats").read_bytes())
    direct = after["scheduler"]["files"][-1]
    assert direct["read_bytes"] == len(want) and direct["lost_read_bytes"] == 0
    assert direct["fetched_bytes"] <= len(want) + 1024 * 1024 and direct["demand_fetches"] <= 3
    # (The buffered read may have seen a stretch the host took meanwhile: only the O_DIRECT reads must add none.)
    assert after["scheduler"]["kernel_drops"] == before["scheduler"]["kernel_drops"]
    assert after["pushes"]["pieces"] == before["pushes"]["pieces"]


def test_safetensors_random_tensors(imported_any, mount):
    from safetensors import safe_open

    m = mount(imported_any)
    want = state_dict(2)
    keys = list(want)
    random.Random(5).shuffle(keys)
    with safe_open(str(m.path / "run1" / "model.safetensors"), framework="pt") as f:
        for k in keys[:10]:
            assert torch.equal(f.get_tensor(k), want[k]), k


def test_sixteen_threads_of_random_preads(imported_any, source, mount):
    m = mount(imported_any)
    src = (source / "run1" / "step_200.pt").read_bytes()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        fd = os.open(m.path / "run1" / "step_200.pt", os.O_RDONLY)
        try:
            for _ in range(200):
                off = rng.randrange(len(src))
                n = rng.choice((1, 100, 4096, 65536, 1 << 20, 3 << 20))
                if os.pread(fd, n, off) != src[off:off + n]:
                    errors.append(f"thread {seed}: offset {off} length {n}")
        finally:
            os.close(fd)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


LOAD = """
import sys, torch
sd = torch.load(sys.argv[1], weights_only=True)
torch.save(sd, sys.argv[2])
"""


def test_two_processes_load_the_same_checkpoint_at_once(imported, mount, tmp_path):
    m = mount(imported)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD, str(m.path / "run1/step_100.pt"),
                               str(tmp_path / f"out{i}.pt")]) for i in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    want = state_dict(0)
    for i in range(2):
        got = torch.load(tmp_path / f"out{i}.pt", weights_only=True)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_unknown_names_are_enoent(imported, mount):
    m = mount(imported)
    with pytest.raises(FileNotFoundError):
        (m.path / "nope").stat()
    with pytest.raises(FileNotFoundError):
        open(m.path / "run1" / "nope.pt", "rb")


def test_lost_chunk_gives_eio_and_a_log_line_naming_file_offset_chunk_and_stores(imported, mount, tmp_path):
    info = cpfs("inspect", "--json", "run1/deep/er/odd.bin", config=imported).stdout
    import json

    doc = json.loads(info)
    digest, raw_len, _, _, stores = doc["chunks"][1]
    for s in stores:
        (imported.parent / "stores" / s / "chunks" / digest[:2] / digest).unlink()
    m = mount(imported)
    fd = os.open(m.path / "run1/deep/er/odd.bin", os.O_RDONLY)
    try:
        assert len(os.pread(fd, 4096, 0)) == 4096                     # chunk 0 is fine
        with pytest.raises(OSError) as e:
            os.pread(fd, 4096, doc["chunks"][0][1] + 10)              # inside chunk 1
        assert e.value.errno == errno.EIO
    finally:
        os.close(fd)
    log = m.log.read_text()
    line = next(ln for ln in log.splitlines() if "no replica of chunk" in ln)
    assert "/run1/deep/er/odd.bin" in line and f"offset {doc['chunks'][0][1]}" in line
    assert "chunk 1" in line and digest[:16] in line and all(s in line for s in stores)
    assert "unexpectedly" not in log and "Traceback" not in log


def test_unmount_ends_the_daemon_with_status_zero(imported, tmp_path):
    """Foreground daemon: fusermount3 -u ends it (exit 0); so does SIGTERM, which also unmounts."""
    mp = tmp_path / "fg"
    mp.mkdir()
    for how in ("fusermount", "sigterm"):
        proc = subprocess.Popen([sys.executable, str(ROOT / "mount.py"), "--config", str(imported), str(mp),
                                 "--foreground", "--log-file", str(tmp_path / "fg.log")])
        try:
            deadline = time.monotonic() + 60
            while not os.path.ismount(mp):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            assert (mp / "tiny.txt").read_bytes() == b"hello\n"
            if how == "fusermount":
                subprocess.run(["fusermount3", "-u", str(mp)], check=True)
            else:
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert not os.path.ismount(mp)
        finally:
            if proc.poll() is None:
                subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True)
                proc.kill()
                proc.wait()


class HungFolder:
    """A folder on a filesystem that never answers (tests/hungfs.py), as on a hung NFS server. `stop`
    kills its process (by pid) and unmounts it lazily, which fails every request still waiting: only
    then can a process with a thread stuck there exit (the kernel waits for a request it handed over)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hungfs.py"), str(path)],
                                     stdout=subprocess.PIPE, text=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)


@pytest.fixture
def hung_folder(tmp_path: Path) -> Iterator[HungFolder]:
    h = HungFolder(tmp_path / "hung")
    try:
        assert h.proc.stdout is not None and h.proc.stdout.readline().strip() == "ready"
        yield h
    finally:
        h.stop()


def _output_within(args: list[str], out: Path, want: bytes, seconds: float) -> subprocess.Popen:
    """Start a command writing to `out`; return once `out` holds `want` (its exit may wait for a
    thread stuck on the hung store), or fail after `seconds`."""
    proc = subprocess.Popen(args, stdout=out.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + seconds
    while want not in out.read_bytes():
        assert time.monotonic() < deadline, f"{args[4:]}: no answer in {seconds} s: {out.read_bytes()[-500:]!r}"
        time.sleep(0.1)
    return proc


def test_a_store_on_a_hung_filesystem_holds_up_no_command_or_mount(tmp_path: Path, hung_folder: HungFolder,
                                                                   mount) -> None:
    """Store s2's folder is on a filesystem that stopped answering (an NFS server gone). `cpfs ls`,
    `cpfs cat` and a mount start, mark s2 down after its timeout and serve from the other replicas:
    the bytes are the file's. Before, each stat'ed the folder while reading the config (to compare
    stores by real path) and waited in the kernel for good, before any store timeout (an audit's
    find); mount.py never returned."""
    cfg = write_config(tmp_path / "cfg", extra='[store_defaults]\ntimeout = "3s"')
    data = os.urandom(5 * 2**20 + 17)
    (tmp_path / "f.bin").write_bytes(data)
    cpfs("put", str(tmp_path / "f.bin"), "/f.bin", config=cfg)
    text = cfg.read_text().replace('url = "stores/s2"', f'url = "{hung_folder.path / "s2"}"')
    cfg.write_text(text)
    cli = [sys.executable, "-m", "cpfs.cli", "--config", str(cfg)]
    started = [_output_within([*cli, "ls", "/"], tmp_path / "ls.out", b"f.bin", 60),
               _output_within([*cli, "cat", "/f.bin"], tmp_path / "cat.out", data, 60)]
    assert b"does not answer" in (tmp_path / "ls.out").read_bytes()
    try:
        m = mount(cfg)
        assert (m.path / "f.bin").read_bytes() == data
        assert "store 's2' marked down" in m.log.read_text()
    finally:
        hung_folder.stop()             # before the mount's teardown: its daemon exits once s2 answers
        for p in started:
            p.wait(timeout=60)


def test_mount_errors_are_one_clear_line_and_leave_nothing_mounted(imported, tmp_path, mount):
    def attempt(config: Path, mp: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "mount.py"), "--config", str(config), str(mp),
                               "--log-file", str(tmp_path / "err.log")], capture_output=True, text=True,
                              timeout=60)

    r = attempt(imported, tmp_path / "missing")
    assert r.returncode != 0 and "no such folder" in r.stderr and "mkdir" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(imported.read_text() + "\nbogus = 1\n")
    (tmp_path / "mp").mkdir()
    r = attempt(bad, tmp_path / "mp")
    assert r.returncode == 2 and "bogus" in r.stderr and str(bad) in r.stderr
    assert not os.path.ismount(tmp_path / "mp")
    # A store that cannot be used: its folder is a file.
    unreachable = write_config(tmp_path / "u")
    (tmp_path / "u" / "stores").mkdir(parents=True)
    (tmp_path / "u" / "stores" / "s1").write_text("not a folder")
    r = attempt(unreachable, tmp_path / "mp")
    assert r.returncode == 2 and "'s1'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.ismount(tmp_path / "mp")
    # On the stores: the daemon's own store requests went through its mount, waited on themselves
    # for the store timeout, and every operation then failed EIO (an audit's find).
    for mp in (imported.parent / "stores" / "s0", imported.parent):
        r = attempt(imported, mp)
        mounted = os.path.ismount(mp)
        if mounted:                       # unmounted here, so that a failure leaves no mount behind
            subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True)
        assert not mounted and r.returncode == 1 and "the folder of store 's0'" in r.stderr \
            and "mount elsewhere" in r.stderr, r.stderr
    # Busy: something is mounted there already.
    m = mount(imported)
    r = attempt(imported, m.path)
    assert r.returncode == 1 and "mounted there already" in r.stderr
    # Stale: the daemon was killed (we started it: kill it by its pid).
    os.kill(m.pid, signal.SIGKILL)
    while m.alive():
        time.sleep(0.05)
    r = attempt(imported, m.path)
    assert r.returncode == 1 and "stale mount" in r.stderr and "fusermount3 -u" in r.stderr


def test_daemon_memory_stays_within_cache_budget_on_a_large_read(make_config, tmp_path, mount):
    """Reading a file 8x the cache budget: the daemon's RSS grows by at most the budget + a constant."""
    import numpy as np
    import psutil

    budget = 64 * 1024**2
    src = tmp_path / "big.bin"
    np.random.default_rng(0).integers(0, 255, 512 * 1024**2, dtype=np.uint8).tofile(src)
    cfg = make_config(chunk_size="4MiB", cache="64MiB")
    cpfs("put", str(src), "big.bin", config=cfg)
    m = mount(cfg)
    daemon = psutil.Process(m.pid)
    base = daemon.memory_info().rss
    peak = base
    h = hashlib.sha256()
    with open(m.path / "big.bin", "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            peak = max(peak, daemon.memory_info().rss)
    assert h.hexdigest() == sha(src)
    growth = peak - base
    print(f"daemon RSS {base / 2**20:.0f} MiB before, peak growth {growth / 2**20:.0f} MiB "
          f"reading 512 MiB with a 64 MiB cache")
    assert growth < budget + 128 * 1024**2
