"""A close that is not the writer's last commits nothing (cpfs/openers.py, cpfs/fs.py: flush).

A process that forks, or runs a subprocess, while it writes a file through the mount gives the child a
copy of the descriptor, and the child's close is a FLUSH like the writer's own. Each one committed the
half-written file: a failed version for a checkpoint, a version of partial bytes for any other file
(which retired a good one). First /proc itself (a local file, no mount), then real mounts.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cpfs import openers
from tests.conftest import cpfs

MiB = 1024 * 1024


def test_a_process_holds_a_file_for_writing_while_any_descriptor_of_it_is_open(tmp_path: Path) -> None:
    """/proc answers for a local file: a writable descriptor (or a dup of it) holds it; a read-only one
    does not; once every writable one is closed, nothing does. A thread's id names its process."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x")
    st = os.stat(path)

    def held() -> bool | None:
        return openers.holds_for_writing(os.getpid(), st.st_dev, st.st_ino, ["f.bin"])

    assert held() is False
    fd = os.open(path, os.O_WRONLY)
    assert held() is True
    assert openers.holds_for_writing(os.getpid(), st.st_dev, st.st_ino, ["other.bin"]) is False
    assert openers.holds_for_writing(os.getpid(), st.st_dev + 1, st.st_ino, ["f.bin"]) is None   # no such mount
    dup = os.dup(fd)
    os.close(fd)
    assert held() is True
    os.close(dup)
    ro = os.open(path, os.O_RDONLY)
    try:
        assert held() is False
    finally:
        os.close(ro)
    got: list[int | None] = []
    t = threading.Thread(target=lambda: got.append(openers.process_of(threading.get_native_id())))
    t.start()
    t.join()
    assert got == [os.getpid()]
    assert openers.process_of(0) is None


def _config(make_config: Callable[..., Path], tmp_path: Path, keep: int = 3) -> Path:
    return make_config(extra=f'keep_versions = {keep}\n[mount]\nstaging = "{tmp_path / "staging"}"\n')


def _log(cfg: Path, path: str) -> list[tuple[int, str]]:
    return [(r["version"], r["state"]) for r in json.loads(cpfs("log", path, "--json", config=cfg).stdout)]


def _closes_not_last(mnt: Path) -> int:
    return json.loads((mnt / ".cpfs-stats").read_bytes())["mount"]["closes_not_last"]


def _fork_and_exit(f) -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)                      # the child's exit closes its copy of the descriptor
    os.waitpid(pid, 0)


def _run_a_subprocess(f) -> None:
    subprocess.run(["true"], check=True)   # exec closes the inherited descriptors


def _close_a_dup(f) -> None:
    os.close(os.dup(f.fileno()))


@pytest.mark.mount
@pytest.mark.parametrize("event", [_fork_and_exit, _run_a_subprocess, _close_a_dup], ids=["fork", "subprocess", "dup"])
def test_a_checkpoint_saved_while_the_saver_forks_commits_once_at_its_close(make_config, tmp_path: Path, mount,
                                                                              event) -> None:
    """A torch checkpoint written in four parts, with a fork, a subprocess or the close of a dup between
    them: one version, at the saver's close; no failed versions of the parts written so far; the
    tensors equal the originals."""
    torch = pytest.importorskip("torch")
    cfg = _config(make_config, tmp_path)
    buf = io.BytesIO()
    tensors = {"w": torch.randn(1024, 1024), "b": torch.randn(3 * MiB // 4)}
    torch.save(tensors, buf)
    data = buf.getvalue()
    (tmp_path / "v1.bin").write_bytes(b"the last good checkpoint" * 100)
    cpfs("put", str(tmp_path / "v1.bin"), "/ckpt.pt", config=cfg)
    m = mount(cfg)
    with open(m.path / "ckpt.pt", "wb") as f:
        for k in range(4):
            f.write(data[k * len(data) // 4:(k + 1) * len(data) // 4])
            f.flush()
            if k < 3:
                event(f)
                assert _log(cfg, "/ckpt.pt") == [(1, "ok")]
    assert _log(cfg, "/ckpt.pt") == [(2, "ok"), (1, "ok")]
    assert _closes_not_last(m.path) >= 3      # and the forks of `cpfs log` above (a subprocess each)
    assert b"closes that were not the writer's last" in cpfs("stats", str(m.path)).stdout
    got = torch.load(m.path / "ckpt.pt", weights_only=True)
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)


@pytest.mark.mount
@pytest.mark.parametrize("kind", ["checkpoint", "plain"])
def test_another_process_that_opens_a_file_being_saved_and_changes_nothing_commits_nothing(
        make_config, tmp_path: Path, mount, kind: str) -> None:
    """`touch ckpt.pt` (an open for writing, a utimensat, a close) and an open for writing closed
    unwritten, from other processes while a save is half done: both succeed, commit nothing, and the
    save's close makes one version. Each committed the saver's half-written file (an audit's find):
    touch failed with EIO and left a failed version for a checkpoint; for any other file the partial
    bytes were a version, which retired a good one."""
    torch = pytest.importorskip("torch")
    cfg = _config(make_config, tmp_path, keep=2)
    buf = io.BytesIO()
    torch.save({"w": torch.randn(300_000)}, buf)
    data = buf.getvalue() if kind == "checkpoint" else np.random.default_rng(3).bytes(3 * MiB)
    name = "ckpt.pt" if kind == "checkpoint" else "state.bin"
    (tmp_path / "v1.bin").write_bytes(b"the last good version" * 100)
    cpfs("put", str(tmp_path / "v1.bin"), f"/{name}", config=cfg)
    m = mount(cfg)
    with open(m.path / name, "wb") as f:
        f.write(data[:len(data) // 2])
        f.flush()
        assert subprocess.run(["touch", str(m.path / name)], capture_output=True, text=True).returncode == 0
        subprocess.run([sys.executable, "-c", f"open({str(m.path / name)!r}, 'r+b').close()"], check=True)
        assert _log(cfg, f"/{name}") == [(1, "ok")]
        f.write(data[len(data) // 2:])
    assert _log(cfg, f"/{name}") == [(2, "ok"), (1, "ok")]
    assert (m.path / name).read_bytes() == data
    assert cpfs("cat", f"/{name}", "--version", "1", config=cfg).stdout == b"the last good version" * 100


@pytest.mark.mount
def test_forks_during_a_save_of_a_plain_file_keep_its_last_good_version(make_config, tmp_path: Path, mount) -> None:
    """Bytes of no checkpoint format, keep_versions = 2, three forks during the save: before, each
    fork's close committed the bytes written so far as a version, and the last good version was retired
    by the second. Now the save is one version and the one before stays."""
    cfg = _config(make_config, tmp_path, keep=2)
    rng = np.random.default_rng(11)
    old, new = rng.bytes(3 * MiB), rng.bytes(8 * MiB)
    (tmp_path / "old.bin").write_bytes(old)
    cpfs("put", str(tmp_path / "old.bin"), "/state.bin", config=cfg)
    m = mount(cfg)
    with open(m.path / "state.bin", "wb") as f:
        for k in range(4):
            f.write(new[k * 2 * MiB:(k + 1) * 2 * MiB])
            f.flush()
            if k < 3:
                _fork_and_exit(f)
    assert _log(cfg, "/state.bin") == [(2, "ok"), (1, "ok")]
    assert cpfs("cat", "/state.bin", config=cfg).stdout == new
    assert cpfs("cat", "/state.bin", "--version", "1", config=cfg).stdout == old


@pytest.mark.mount
def test_the_writers_close_commits_while_a_child_still_holds_the_file(make_config, tmp_path: Path, mount) -> None:
    """The writer closes while a child it started still holds the descriptor (passed to it): that close
    is the writer's last, so it commits then, not when the child lets go; the child's close after it
    adds no version (nothing new was written)."""
    cfg = _config(make_config, tmp_path)
    data = os.urandom(3 * MiB)
    m = mount(cfg)
    f = open(m.path / "out.bin", "wb")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             pass_fds=(f.fileno(),))
    try:
        f.write(data)
        f.close()
        assert _log(cfg, "/out.bin") == [(1, "ok")]
        assert cpfs("cat", "/out.bin", config=cfg).stdout == data
    finally:
        child.communicate(b"")
    assert (m.path / "out.bin").read_bytes() == data
    assert _log(cfg, "/out.bin") == [(1, "ok")]


@pytest.mark.mount
def test_a_saver_killed_after_its_children_closed_leaves_the_previous_version(make_config, tmp_path: Path,
                                                                             mount) -> None:
    """Rule one with closes that commit nothing: the saver writes half a checkpoint, a child's close is
    skipped, another child keeps the descriptor, and the saver is killed (kill -9). Its exit's close
    records the half as a failed version; the child's later exit adds nothing; the previous version
    stays current and loads equal."""
    torch = pytest.importorskip("torch")
    cfg = _config(make_config, tmp_path)
    m = mount(cfg)
    v1 = {"w": torch.randn(512, 512)}
    torch.save(v1, m.path / "ckpt.pt")
    buf = io.BytesIO()
    torch.save({"w": torch.randn(1024, 1024)}, buf)
    (tmp_path / "half.bin").write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    saver = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "f = open(sys.argv[1], 'wb')\n"
        "f.write(open(sys.argv[2], 'rb').read())\n"
        "f.flush()\n"
        "if os.fork() == 0:\n"
        "    os._exit(0)\n"                      # its close: not the writer's last
        "os.wait()\n"
        "keeper = os.fork()\n"
        "if keeper == 0:\n"
        "    time.sleep(60)\n"                   # holds the descriptor past the saver's death
        "    os._exit(0)\n"
        "print(keeper, flush=True)\n"
        "time.sleep(60)\n"), str(m.path / "ckpt.pt"), str(tmp_path / "half.bin")],
        stdout=subprocess.PIPE, text=True)
    keeper = 0
    try:
        keeper = int(saver.stdout.readline())
        assert _log(cfg, "/ckpt.pt") == [(1, "ok")] and _closes_not_last(m.path) >= 1
        os.kill(saver.pid, signal.SIGKILL)
        saver.wait()
        deadline = time.monotonic() + 30
        while _log(cfg, "/ckpt.pt")[0] != (2, "failed"):
            assert time.monotonic() < deadline, _log(cfg, "/ckpt.pt")
            time.sleep(0.1)
    finally:
        saver.kill()
        saver.wait()
        if keeper:
            os.kill(keeper, signal.SIGKILL)     # the saver's child, started by this test's process tree
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{keeper}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _log(cfg, "/ckpt.pt") == [(2, "failed"), (1, "ok")]
    got = torch.load(m.path / "ckpt.pt", weights_only=True)
    assert torch.equal(got["w"], v1["w"])
    got = torch.load(mount(cfg, "fresh").path / "ckpt.pt", weights_only=True)
    assert torch.equal(got["w"], v1["w"])
