"""Fault drills through a real mount: a store that never answers must not hang a mount, a listing, a
lookup or a load (`hang = true` on one of three stores, with the default 30 s request timeout)."""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import cpfs

pytestmark = pytest.mark.mount
MiB = 1024 * 1024


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(12)}


def timed_load(path: Path) -> tuple[float, dict[str, torch.Tensor]]:
    t0 = time.perf_counter()
    sd = torch.load(path, weights_only=True)
    return time.perf_counter() - t0, sd


def test_a_hung_store_never_hangs_the_mount(make_config: Callable[..., Path], tmp_path: Path, mount) -> None:
    healthy = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    src = tmp_path / "step_1.pt"
    want = state_dict(1)
    torch.save(want, src)
    cpfs("put", str(src), "/run/step_1.pt", config=healthy)
    text = healthy.read_text()
    hung = healthy.with_name("hung.toml")
    hung.write_text(text.replace('name = "s0"\n', 'name = "s0"\nhang = true\n', 1))
    assert "hang = true" in hung.read_text()

    base_t, got = timed_load(mount(healthy, "healthy").path / "run" / "step_1.pt")
    assert all(torch.equal(got[k], v) for k, v in want.items())

    t0 = time.perf_counter()
    m = mount(hung, "hung")                      # the startup check gives up on s0 after 5 s
    mount_t = time.perf_counter() - t0
    assert os.listdir(m.path / "run") == ["step_1.pt"]
    took, got = timed_load(m.path / "run" / "step_1.pt")
    assert all(torch.equal(got[k], v) for k, v in want.items())
    print(f"\nhang = true on 1 of 3 stores: mount {mount_t:.1f} s, load on a fresh mount {took:.2f} s "
          f"vs {base_t:.2f} s healthy ({took / base_t:.2f}x)")
    assert took < 15 and mount_t < 15, "a hung store held a request for its whole 30 s timeout"
    assert "marked down" in m.log.read_text()


def drill_config(healthy: Path, name: str, **drills: str) -> Path:
    """A copy of `healthy` (same stores) with drill knobs on some stores: {"s0": "down = true", ...}."""
    text = healthy.read_text()
    for store, knobs in drills.items():
        text = text.replace(f'name = "{store}"\n', f'name = "{store}"\n{knobs}\n', 1)
    path = healthy.with_name(name)
    path.write_text(text)
    return path


def saved(tmp_path: Path, cfg: Path, n: int, per: int = 2 * MiB) -> dict[str, dict[str, torch.Tensor]]:
    """n checkpoints of 8 tensors, put under /ck/; returns what each should load as."""
    out = {}
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        sd = {f"t{j}": torch.randn(per // 4, generator=g) for j in range(8)}
        src = tmp_path / f"ck{i}.pt"
        torch.save(sd, src)
        out[f"ck{i}.pt"] = sd
    for name in out:
        cpfs("put", str(tmp_path / name), f"/ck/{name}", config=cfg)
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("drill", ["down at mount", "error_rate 0.2 on two stores", "corrupt_rate 0.1"])
def test_loads_are_right_under_drills(make_config, tmp_path: Path, mount, drill: str) -> None:
    """Every tensor right with a store down from the start, with 20% of the requests to two stores
    failing (retried), or with 10% of one store's reads altered (checksums catch it, another replica
    answers, read repair rewrites)."""
    healthy = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    want = saved(tmp_path, healthy, 3)
    knobs = {"down at mount": {"s0": "down = true"},
             "error_rate 0.2 on two stores": {"s0": "error_rate = 0.2\nfault_seed = 1",
                                              "s1": "error_rate = 0.2\nfault_seed = 2"},
             "corrupt_rate 0.1": {"s1": "corrupt_rate = 0.1\nfault_seed = 3"}}[drill]
    m = mount(drill_config(healthy, "drill.toml", **knobs))
    for name, sd in want.items():
        assert same(torch.load(m.path / "ck" / name, weights_only=True), sd), (drill, name)
    doc = json.loads((m.path / ".cpfs-stats").read_bytes())
    print(f"\n{drill}: " + ", ".join(f"{s['name']} {s['requests']} requests {s['errors']} errors"
                                      for s in doc["stores"]) + f"; {doc['replicas']}")


def test_saves_go_on_with_one_store_down(make_config, tmp_path: Path, mount) -> None:
    """One of three stores down, the default write_quorum (every copy must land): before spares, 2 in 3
    saves failed (their placement held the store). Now each lands on the spare; a mount of the stores
    all up loads every one, and `cpfs scrub --repair` puts the copies on their placement."""
    healthy = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    down = drill_config(healthy, "down.toml", s1="down = true")
    down.write_text(down.read_text().replace(str(tmp_path / "staging"), str(tmp_path / "staging-down")))
    earlier = saved(tmp_path, healthy, 1)              # the stores in use before s1 went down
    s1 = healthy.parent / "stores" / "s1"
    before = set(s1.glob("manifests/*/*"))
    m = mount(down, "down")
    want: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(6):
        g = torch.Generator().manual_seed(200 + i)
        want[f"ck{i}.pt"] = sd = {f"t{j}": torch.randn(MiB // 4, generator=g) for j in range(4)}
        torch.save(sd, m.path / f"ck{i}.pt")
    assert "marked down" in m.log.read_text()
    assert set(s1.glob("manifests/*/*")) == before                        # nothing reached s1
    up = mount(healthy, "up")
    for name, sd in want.items():
        assert same(torch.load(up.path / name, weights_only=True), sd), name
    assert same(torch.load(up.path / "ck" / "ck0.pt", weights_only=True), earlier["ck0.pt"])
    assert cpfs("scrub", config=healthy, check=False).returncode == 1        # copies off their placement
    assert cpfs("scrub", "--repair", config=healthy, check=False).returncode == 0
    assert cpfs("scrub", config=healthy, check=False).returncode == 0
    assert set(s1.glob("manifests/*/*")) > before


def test_a_store_that_vanishes_mid_load(make_config, tmp_path: Path, mount) -> None:
    """A store's folder goes away while a load runs (an NFS export unmounted): the load completes from
    the other replicas, byte for byte."""
    cfg = make_config(cache="16MiB", extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    want = saved(tmp_path, cfg, 2, per=8 * MiB)
    m = mount(cfg)
    folder = cfg.parent / "stores" / "s0"
    with open(m.path / "ck" / "ck0.pt", "rb") as f:
        head = f.read(4 * MiB)
        folder.rename(folder.with_name("s0.away"))
        rest = f.read()
        try:
            assert head + rest == (tmp_path / "ck0.pt").read_bytes()
            # A checkpoint not read before: its chunks on s0 come from the other replicas.
            assert same(torch.load(m.path / "ck" / "ck1.pt", weights_only=True), want["ck1.pt"])
            doc = json.loads((m.path / ".cpfs-stats").read_bytes())
            assert doc["stores"][0]["errors"] >= 1       # s0 was asked, failed, and others answered
        finally:
            folder.with_name("s0.away").rename(folder)
    assert same(torch.load(m.path / "ck" / "ck0.pt", weights_only=True), want["ck0.pt"])


@pytest.mark.long
def test_eight_loads_and_thirty_two_readers_with_a_flaky_store(make_config, tmp_path: Path, mount) -> None:
    """8 processes load 8 checkpoints at once while 32 threads read one file at random offsets, with
    one store failing 20% of its requests: every byte right, and the daemon's memory stays within the
    cache budget + 150 MiB."""
    healthy = make_config(cache="64MiB", extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    want = saved(tmp_path, healthy, 8)
    m = mount(drill_config(healthy, "flaky.toml", s2="error_rate = 0.2\nfault_seed = 7"))
    from benchmarks.common import RssSampler

    big = tmp_path / "ck0.pt"
    data = big.read_bytes()
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        with open(m.path / "ck" / "ck0.pt", "rb", buffering=0) as f:
            for _ in range(40):
                off = rng.randrange(len(data))
                n = rng.randrange(1, 256 * 1024)
                if os.pread(f.fileno(), n, off) != data[off:off + n]:
                    errors.append(f"reader {seed}: bytes {off}+{n} differ")
                    return

    loaders = [subprocess.Popen([sys.executable, "-c", (
        "import sys, torch, hashlib\n"
        "sd = torch.load(sys.argv[1], weights_only=True)\n"
        "print(hashlib.sha256(b''.join(sd[k].numpy().tobytes() for k in sorted(sd))).hexdigest())\n"),
        str(m.path / "ck" / name)], stdout=subprocess.PIPE, text=True) for name in want]
    with RssSampler(m.pid) as rss:
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        outs = [p.communicate(timeout=300)[0].strip() for p in loaders]
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    for (name, sd), out in zip(want.items(), outs):
        assert out == hashlib.sha256(b"".join(sd[k].numpy().tobytes() for k in sorted(sd))).hexdigest(), name
    grew = (rss.peak - rss.before) / MiB
    print(f"\ndaemon RSS grew {grew:.0f} MiB (cache 64 MiB) for 8 loads + 32 readers with a flaky store")
    assert rss.peak <= rss.before + (64 + 150) * MiB
