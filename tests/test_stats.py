"""`cpfs stats`: a mount's live figures through its hidden control file."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from cpfs.stats import CONTROL_NAME
from tests.conftest import cpfs

pytestmark = pytest.mark.mount
MiB = 1024 * 1024


def test_stats_of_a_mount_count_what_a_read_did(make_config, tmp_path: Path, mount) -> None:
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    data = os.urandom(6 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    cpfs("put", str(tmp_path / "f.bin"), "/f.bin", config=cfg)
    m = mount(cfg)
    before = json.loads(cpfs("stats", str(m.path), "--json", config=cfg).stdout)
    assert (m.path / "f.bin").read_bytes() == data
    after = json.loads(cpfs("stats", str(m.path), "--json", config=cfg).stdout)
    fetched = sum(s["bytes_read"] for s in after["stores"]) - sum(s["bytes_read"] for s in before["stores"])
    assert fetched >= len(data)                       # every chunk came from some store, once at least
    assert after["cache"]["misses"] >= 6 and after["mount"]["files"] == 1
    assert [s["name"] for s in after["stores"]] == ["s0", "s1", "s2"] and all(h["up"] for h in after["health"])
    assert CONTROL_NAME not in os.listdir(m.path)     # never listed: rsync and cp -r do not see it
    with pytest.raises(OSError) as e:
        open(m.path / CONTROL_NAME, "w")
    assert e.value.errno == errno.EACCES
    human = cpfs("stats", str(m.path), config=cfg, text=True).stdout
    assert "s0" in human and "cache:" in human and "hits" in human


def test_stats_of_a_folder_that_is_not_a_mount_is_one_line(tmp_path: Path) -> None:
    r = cpfs("stats", str(tmp_path), check=False, text=True)
    assert r.returncode == 1 and r.stderr.startswith("cpfs: error:") and r.stderr.count("\n") == 1
