"""Versions through real mounts: an open handle keeps its version, rename over a committed file, bad
manifests, and `cpfs log`/`restore`/`cat --version` on what mounts committed."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import trio

from cpfs.catalog import Catalog
from cpfs.config import load_config
from cpfs.errors import StoreError
from cpfs.manifest import path_hash
from cpfs.placement import place
from cpfs.pool import StorePool
from cpfs.store import FaultyStore, open_store
from cpfs.voidjournal import VoidJournal
from test_catalog import MANIFESTS, TWINS, commit_bytes
from tests.conftest import cpfs

pytestmark = pytest.mark.mount
MiB = 1024 * 1024


def config(make_config: Callable[..., Path], tmp_path: Path, push: bool = True) -> Path:
    return make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\nrefresh = "0.2s"\n'
                             f'notify_store = {"true" if push else "false"}\n')


def put(cfg: Path, tmp_path: Path, path: str, data: bytes) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    cpfs("put", str(src), path, config=cfg)


def cat(cfg: Path, path: str, *extra: str) -> bytes:
    return cpfs("cat", path, *extra, config=cfg).stdout


def log(cfg: Path, path: str) -> list[dict]:
    return json.loads(cpfs("log", path, "--json", config=cfg).stdout)


@pytest.mark.parametrize("push", [True, False], ids=["push", "no-push"])
def test_an_open_handle_reads_the_version_it_opened(make_config, tmp_path, mount, push):
    """Another process commits version 2 while a reader holds version 1 open: the reader reads version 1
    to the end (never a mix); a new open reads version 2."""
    cfg = config(make_config, tmp_path, push)
    rng = np.random.default_rng(6)
    v1, v2 = rng.bytes(24 * MiB), rng.bytes(24 * MiB)
    put(cfg, tmp_path, "/run/ckpt.pt", v1)
    m = mount(cfg)
    f = m.path / "run" / "ckpt.pt"
    with open(f, "rb", buffering=0) as old:
        head = old.read(MiB)
        ino1 = os.fstat(old.fileno()).st_ino
        put(cfg, tmp_path, "/run/ckpt.pt", v2)          # committed by another process (the CLI)
        time.sleep(0.5)                                  # past the mount's refresh interval
        with open(f, "rb") as new:
            assert new.read() == v2
            ino2 = os.fstat(new.fileno()).st_ino
        rest = old.read()
        assert head + rest == v1, "the old handle read bytes of another version"
        assert ino2 != ino1               # each version its own inode, so page caches never mix
        assert os.fstat(old.fileno()).st_size == len(v1)
    assert f.read_bytes() == v2


def test_rename_of_an_uncommitted_file_over_a_committed_one_keeps_the_target_until_commit(
        make_config, tmp_path, mount):
    """os.rename(tmp, target) while tmp is still open and never committed: the target's committed
    version stays on the stores; a daemon killed before the commit leaves the target as it was."""
    cfg = config(make_config, tmp_path)
    put(cfg, tmp_path, "/target.pt", b"the last good checkpoint" * 1000)
    m = mount(cfg)
    # The writer is another process, which the test leaves running while it kills the daemon.
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        f"fd = os.open({str(m.path / 'tmp.pt')!r}, os.O_WRONLY | os.O_CREAT, 0o644)\n"
        "os.write(fd, b'half a new checkpoint')\n"
        f"os.rename({str(m.path / 'tmp.pt')!r}, {str(m.path / 'target.pt')!r})\n"
        "print('renamed', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "renamed"
        assert cat(cfg, "/target.pt") == b"the last good checkpoint" * 1000
        os.kill(m.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    deadline = time.monotonic() + 10
    while m.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)
    m2 = mount(cfg, "mnt2")
    assert (m2.path / "target.pt").read_bytes() == b"the last good checkpoint" * 1000
    assert not (m2.path / "tmp.pt").exists()
    # Without the crash, the renamed file's close makes it the target's next version.
    with open(m2.path / "tmp2.pt", "wb") as w:
        w.write(b"complete new bytes")
        os.rename(m2.path / "tmp2.pt", m2.path / "target.pt")
    assert cat(cfg, "/target.pt") == b"complete new bytes"
    assert [r["state"] for r in log(cfg, "/target.pt")][:2] == ["ok", "ok"]


@pytest.mark.parametrize("then", ["unlink", "rename-away"])
def test_an_uncommitted_file_renamed_over_a_committed_one_takes_it_along_when_it_leaves(
        make_config, tmp_path, mount, then):
    """rename(tmp, target) with tmp still open and never committed, then target unlinked or renamed
    away before tmp's close: the target's old version is gone for good, here and in every mount (an
    audit found it back at the next listing: the stores kept it for the commit that never came)."""
    cfg = config(make_config, tmp_path)
    put(cfg, tmp_path, "/target.pt", b"replaced")
    m = mount(cfg)
    with open(m.path / "tmp.pt", "wb") as w:
        w.write(b"new bytes")
        os.rename(m.path / "tmp.pt", m.path / "target.pt")
        if then == "unlink":
            os.unlink(m.path / "target.pt")
        else:
            os.rename(m.path / "target.pt", m.path / "moved.pt")
    time.sleep(0.5)                                        # past the mount's refresh interval
    expected = [] if then == "unlink" else ["moved.pt"]
    assert sorted(os.listdir(m.path)) == expected
    assert sorted(os.listdir(mount(cfg, "mnt2").path)) == expected
    assert cpfs("cat", "/target.pt", config=cfg, check=False).returncode != 0
    if then == "rename-away":
        assert cat(cfg, "/moved.pt") == b"new bytes"


def test_a_bad_manifest_makes_only_its_file_unreadable(make_config, tmp_path, mount):
    """Every replica of one file's newest manifest damaged: that file gives EIO, its folder lists, its
    neighbours read; `cpfs log` names the problem and `cpfs restore` brings the last good version back."""
    cfg = config(make_config, tmp_path)
    for name in ("a", "b", "c"):
        put(cfg, tmp_path, f"/dir/{name}.bin", name.encode() * 100)
    put(cfg, tmp_path, "/dir/b.bin", b"B" * 100)
    for folder in (tmp_path / "cfg" / "stores").glob(f"*/manifests/{path_hash('/dir/b.bin')}"):
        newest = sorted(folder.iterdir())[-1]
        head, body = newest.read_bytes().split(b"\n")
        doc = json.loads(head)
        del doc["check"], doc["body_check"]       # as written before checks: the size check is the test
        doc["size"] = 2**64
        newest.write_bytes(json.dumps(doc).encode() + b"\n" + body)
    m = mount(cfg)
    assert sorted(os.listdir(m.path / "dir")) == ["a.bin", "b.bin", "c.bin"]
    assert (m.path / "dir" / "a.bin").read_bytes() == b"a" * 100
    assert (m.path / "dir" / "c.bin").read_bytes() == b"c" * 100
    with pytest.raises(OSError) as e:
        (m.path / "dir" / "b.bin").read_bytes()
    assert e.value.errno == errno.EIO
    assert "b.bin" in m.log.read_text() and "size" in m.log.read_text()
    rows = log(cfg, "/dir/b.bin")
    assert rows[0]["state"] == "unreadable" and rows[1]["state"] == "ok"
    cpfs("restore", "/dir/b.bin", str(rows[1]["version"]), config=cfg)
    time.sleep(0.5)
    os.listdir(m.path / "dir")              # a listing refreshes the mount's view
    assert (m.path / "dir" / "b.bin").read_bytes() == b"b" * 100


async def _fail_a_commit_beyond_voiding(cfg: Path) -> None:
    """Commit version 2 of /run/ckpt.pt as a writer whose commit fails below quorum, on stores that then
    refuse to delete its copy and to take its twin; the writer is gone when this returns."""
    config = load_config(str(cfg))
    first, second = place(path_hash("/run/ckpt.pt"), [s.name for s in config.stores], config.replicas)
    wrappers = {s.name: FaultyStore(open_store(s)) for s in config.stores}
    wrappers[second].refuse("put", MANIFESTS)
    wrappers[first].refuse("delete", MANIFESTS)
    for w in wrappers.values():
        w.refuse("put", TWINS)
    catalog = Catalog(StorePool(config, stores=list(wrappers.values())), writer="ab", journal=VoidJournal.for_config(config))
    with pytest.raises(StoreError):
        await commit_bytes(catalog, "/run/ckpt.pt", b"version 2, failed")
    assert catalog.statistics().unvoided == 1


def test_a_failed_commit_its_writer_could_not_void_is_voided_by_the_next_mount(make_config, tmp_path, mount):
    """The writer was told that its save failed, but its copy stayed on a store and no store took the
    twin that voids it (cpfs/catalog.py); then the writer went away. The next mount of those stores on
    this host finds the twin in the journal that writer left (cpfs/voidjournal.py), puts it before its
    first listing, and shows the version before. Without the journal the failed save stayed current."""
    cfg = config(make_config, tmp_path)
    put(cfg, tmp_path, "/run/ckpt.pt", b"version 1")
    trio.run(_fail_a_commit_beyond_voiding, cfg)
    assert cat(cfg, "/run/ckpt.pt") == b"version 2, failed"           # the hole, until a mount starts
    m = mount(cfg)
    assert (m.path / "run" / "ckpt.pt").read_bytes() == b"version 1"
    assert "voided a failed commit with" in m.log.read_text() and "on a later try" in m.log.read_text()
    assert [(e["version"], e["state"]) for e in log(cfg, "/run/ckpt.pt")][:2] == [(2, "failed"), (1, "ok")]
    assert not list((tmp_path / "staging" / "unvoided").rglob("*.void"))


def test_log_and_cat_version_show_what_a_mount_committed(make_config, tmp_path, mount):
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    for i in range(4):
        (m.path / "notes.txt").write_bytes(f"version {i}\n".encode())
    rows = log(cfg, "/notes.txt")
    assert [r["current"] for r in rows] == [True, False, False]          # keep_versions = 3
    assert all(r["state"] == "ok" and r["host"] for r in rows)
    assert cat(cfg, "/notes.txt", "--version", str(rows[2]["version"])) == b"version 1\n"


def test_log_says_where_a_renamed_file_went_and_came_from(make_config, tmp_path, mount):
    """`cpfs log` of a renamed file's old name said only "deleted", which looked like a rotation that
    took the checkpoint (the frameworks audit); it says where it went, and the new name where it came
    from, for a file and for every file of a renamed folder."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    (m.path / "tmp-checkpoint-1").mkdir()
    for name in ("model.pt", "optimizer.pt"):
        (m.path / "tmp-checkpoint-1" / name).write_bytes(name.encode())
    os.rename(m.path / "tmp-checkpoint-1", m.path / "checkpoint-1")
    (m.path / "latest.txt").write_text("1")
    os.rename(m.path / "latest.txt", m.path / "LATEST")
    for old, new in [("/tmp-checkpoint-1/optimizer.pt", "/checkpoint-1/optimizer.pt"), ("/latest.txt", "/LATEST")]:
        assert [(r["state"], r["reason"]) for r in log(cfg, old)][0] == ("deleted", f"renamed to {new}")
        assert [(r["state"], r["reason"]) for r in log(cfg, new)][0] == ("ok", f"renamed from {old}")
    assert f"renamed to /LATEST" in cpfs("log", "/latest.txt", config=cfg, text=True).stdout


def test_a_file_unlinked_while_open_stays_usable_through_its_handle(make_config, tmp_path, mount):
    """tempfile.TemporaryFile (create, unlink, then use) works, and a committed file removed while a
    reader holds it open still reads whole through that handle; neither name comes back."""
    import tempfile

    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    with tempfile.TemporaryFile(dir=m.path) as f:
        f.write(b"scratch " * 100_000)
        f.flush()
        assert os.fstat(f.fileno()).st_size == 800_000
        f.seek(0)
        assert f.read() == b"scratch " * 100_000
    data = np.random.default_rng(9).bytes(6 * MiB)
    (m.path / "old.pt").write_bytes(data)
    with open(m.path / "old.pt", "rb") as r:
        head = r.read(MiB)
        os.unlink(m.path / "old.pt")
        assert os.fstat(r.fileno()).st_size == len(data)
        assert head + r.read() == data
    assert os.listdir(m.path) == []


def test_symlinks_are_stored_followed_and_seen_by_other_mounts(make_config, tmp_path, mount):
    """`ln -s step_200 latest` (a folder) and `ln -s ../run/step_200/model.pt last.pt` (a file): readlink,
    lstat, reading through them, another mount sees them, rename and rm; cp -a keeps a link a link
    (hard links: tests/test_semantics.py)."""
    cfg = config(make_config, tmp_path)
    a = mount(cfg, "a")
    (a.path / "run" / "step_200").mkdir(parents=True)
    data = np.random.default_rng(3).bytes(3 * MiB)
    (a.path / "run" / "step_200" / "model.pt").write_bytes(data)
    os.symlink("step_200", a.path / "run" / "latest")
    os.mkdir(a.path / "top")
    os.symlink("../run/step_200/model.pt", a.path / "top" / "last.pt")
    assert os.readlink(a.path / "run" / "latest") == "step_200"
    assert os.lstat(a.path / "top" / "last.pt").st_size == len("../run/step_200/model.pt")
    assert (a.path / "run" / "latest" / "model.pt").read_bytes() == data
    assert (a.path / "top" / "last.pt").read_bytes() == data
    b = mount(cfg, "b")
    assert os.readlink(b.path / "run" / "latest") == "step_200"
    assert (b.path / "top" / "last.pt").read_bytes() == data
    subprocess.run(["cp", "-a", str(a.path / "top"), str(a.path / "top2")], check=True)
    assert os.readlink(a.path / "top2" / "last.pt") == "../run/step_200/model.pt"
    os.rename(a.path / "top2" / "last.pt", a.path / "top2" / "prev.pt")
    assert os.readlink(a.path / "top2" / "prev.pt") == "../run/step_200/model.pt"
    os.unlink(a.path / "run" / "latest")
    assert not os.path.lexists(a.path / "run" / "latest")
    assert cpfs("ls", "/top", config=cfg, text=True).stdout.rstrip().endswith("last.pt -> ../run/step_200/model.pt")
    assert "latest" not in cpfs("ls", "/run", config=cfg, text=True).stdout
