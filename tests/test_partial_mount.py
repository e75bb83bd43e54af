"""Partial loads through a real mount fetch what the reader touches, not the whole file (issue 10)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cpfs

pytestmark = pytest.mark.mount
MiB = 1024 * 1024
CHUNK = 4 * MiB                 # the default chunk size


def fetched_bytes(m, cfg: Path) -> tuple[int, dict]:
    doc = json.loads(cpfs("stats", str(m.path), "--json", config=cfg).stdout)
    return sum(s["bytes_read"] for s in doc["stores"]), doc


def test_loading_two_tensors_of_eight_fetches_about_what_was_read(make_config, tmp_path: Path, mount) -> None:
    torch = pytest.importorskip("torch")
    safetensors = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{k}.weight": torch.randn(4096, 1024, generator=g) for k in range(8)}  # 16 MiB each
    src = tmp_path / "model.safetensors"
    safetensors.save_file(tensors, str(src))
    cfg = make_config(chunk_size="4MiB", cache="256MiB", extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    cpfs("put", str(src), "/model.safetensors", config=cfg)
    m = mount(cfg)
    before, _ = fetched_bytes(m, cfg)
    wanted = ["layers.2.weight", "layers.5.weight"]
    with safe_open(str(m.path / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k).clone() for k in wanted}
    header = 8 + int.from_bytes(src.read_bytes()[:8], "little")
    for k in wanted:
        assert torch.equal(got[k], tensors[k])
    after, doc = fetched_bytes(m, cfg)
    read = header + sum(tensors[k].numel() * 4 for k in wanted)
    ranges = 3                                  # the header, and the two tensors (not adjacent)
    bound = 1.3 * read + CHUNK * 2 * ranges
    fetched = after - before
    print(f"read {read / MiB:.1f} MiB, fetched {fetched / MiB:.1f} MiB of {src.stat().st_size / MiB:.0f} MiB "
          f"(bound {bound / MiB:.1f} MiB); files {doc['scheduler']['files']}")
    assert fetched <= bound
    files = [f for f in doc["scheduler"]["files"] if f["path"] == "/model.safetensors"]
    assert files and sum(f["read_bytes"] for f in files) > 0
    assert sum(f["fetched_bytes"] for f in files) <= fetched


def test_a_full_read_through_the_mount_is_fetched_once_and_counted_per_file(make_config, tmp_path: Path,
                                                                           mount) -> None:
    import os

    data = os.urandom(24 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    cpfs("put", str(tmp_path / "f.bin"), "/f.bin", config=cfg)
    m = mount(cfg)
    before, _ = fetched_bytes(m, cfg)
    assert (m.path / "f.bin").read_bytes() == data
    after, doc = fetched_bytes(m, cfg)
    assert len(data) <= after - before <= 1.3 * len(data)
    [f] = [f for f in doc["scheduler"]["files"] if f["path"] == "/f.bin"]
    assert f["fetched_bytes"] == len(data) and not f["open"]
    assert f["prefetched_bytes"] > 0 and f["prefetch_used_bytes"] + f["prefetch_wasted_bytes"] == f["prefetched_bytes"]
