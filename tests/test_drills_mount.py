"""Fault drills through a real mount: a store that never answers must not hang a mount, a listing, a
lookup or a load (`hang = true` on one of three stores, with the default 30 s request timeout)."""
from __future__ import annotations

import os
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
