"""Staging and store files are cpfs's own: a shared staging folder keeps what cpfs did not make, a staging
folder that overlaps a store is refused, and what cpfs writes on disk is private to its owner (modes from
`[store_defaults] file_mode, dir_mode`, whatever the umask) with new folders fsynced into their parents.

Through real mounts (the conftest fixtures: every mount is unmounted in teardown, daemons ended by pid).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cpfs.config import parse_config
from cpfs.errors import ConfigError
from tests.conftest import ROOT, Mount, cpfs

pytestmark = pytest.mark.mount

MiB = 1024 * 1024


def staging_config(make_config, staging: Path, extra: str = "", **kw) -> Path:
    return make_config(extra=f'{extra}\n[mount]\nstaging = "{staging}"\n', **kw)


def tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under root (and root itself): its mode and, for a file, its bytes."""
    out: dict[str, tuple[int, bytes | None]] = {".": (root.lstat().st_mode, None)}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, p.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return out


def own_folders(staging: Path, pid: int | None = None) -> list[Path]:
    """The staging folders cpfs made (of daemon `pid`, or of any)."""
    return sorted(staging.glob(f"cpfs-{pid if pid is not None else '*'}-*"))


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """This process's umask (inherited by the cpfs commands and mount daemons it starts)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---- a shared staging folder ----------------------------------------------------------------------------

def user_files(staging: Path) -> None:
    """What a user keeps in /scratch: folders with files, empty ones, names that look like cpfs's."""
    (staging / "datasets" / "imagenet").mkdir(parents=True)
    (staging / "datasets" / "imagenet" / "shard-0.tar").write_bytes(os.urandom(100_000))
    (staging / "12345").mkdir()                                 # a pid-like name
    (staging / "12345" / "notes.txt").write_text("mine\n")
    (staging / "empty").mkdir()
    (staging / "cpfs-1-0123abcd").mkdir()                       # named like ours, but never marked
    (staging / "cpfs-1-0123abcd" / "keep.bin").write_bytes(b"\0" * 4096)
    (staging / "readme.txt").write_text("scratch space\n")
    os.chmod(staging / "datasets", 0o755)


def test_a_shared_staging_folder_keeps_everything_cpfs_did_not_make(make_config, tmp_path, mount):
    staging = tmp_path / "scratch"
    staging.mkdir(mode=0o755)
    user_files(staging)
    before = tree(staging)
    m = mount(staging_config(make_config, staging))
    mine = own_folders(staging, m.pid)
    assert len(mine) == 1, sorted(os.listdir(staging))
    data = os.urandom(3 * MiB + 17)
    with open(m.path / "w.bin", "wb") as f:
        f.write(data)
        f.flush()
        assert list(mine[0].glob("*.stage")), "the open file stages in the daemon's own folder"
    assert (m.path / "w.bin").read_bytes() == data
    m.stop()
    assert tree(staging) == before, "the mount changed what it did not make"


def test_a_live_daemons_folder_survives_another_mount(make_config, tmp_path, mount):
    staging = tmp_path / "scratch"
    cfg = staging_config(make_config, staging)
    first = mount(cfg, "mnt1")
    with open(first.path / "slow.bin", "wb") as f:
        f.write(os.urandom(2 * MiB))
        f.flush()
        second = mount(cfg, "mnt2")
        assert len(own_folders(staging, first.pid)) == 1 and len(own_folders(staging, second.pid)) == 1
        tail = os.urandom(MiB)
        f.write(tail)
    assert (first.path / "slow.bin").read_bytes()[-MiB:] == tail


def test_a_dead_daemons_folder_is_removed_by_the_next_mount(make_config, tmp_path, mount):
    staging = tmp_path / "scratch"
    staging.mkdir()
    user_files(staging)
    before = tree(staging)
    cfg = staging_config(make_config, staging)
    m = mount(cfg)
    f = open(m.path / "half.bin", "wb")
    try:
        f.write(os.urandom(2 * MiB))
        f.flush()
        os.kill(m.pid, signal.SIGKILL)                          # our own daemon, by its pid
        assert wait_for(lambda: not m.alive())
    finally:
        with contextlib.suppress(OSError):
            f.close()
    m.stop()                                                    # fusermount3 -u of the stale mount
    dead = own_folders(staging, m.pid)
    assert len(dead) == 1 and list(dead[0].glob("*.stage")), "the killed daemon left its staging"
    again = mount(cfg, "mnt2")
    assert not dead[0].exists(), "the next daemon removed the dead one's folder"
    assert len(own_folders(staging, again.pid)) == 1
    again.stop()
    assert tree(staging) == before


@pytest.mark.parametrize("where, store", [("inside-a-store", "s1"), ("holding-the-stores", "s0"),
                                          ("is-a-store", "s1")])
def test_staging_that_overlaps_a_store_is_refused(make_config, tmp_path, where, store):
    """One line naming mount.staging and the store, exit 2, nothing mounted, nothing created or deleted."""
    stores = tmp_path / "cfg" / "stores"
    staging = {"inside-a-store": stores / "s1" / "staging", "holding-the-stores": stores,
               "is-a-store": stores / "s1"}[where]
    cfg = staging_config(make_config, staging, replicas=3)     # every store holds the file
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(MiB + 5))
    cpfs("put", str(src), "/src.bin", config=cfg)
    (stores / "s1" / "staging").mkdir(exist_ok=True)
    before = tree(tmp_path / "cfg")
    attempt = Mount(cfg, tmp_path / "mp", tmp_path / "mount.log")
    try:
        r = attempt.start()
    finally:
        attempt.stop()                                          # only if it did mount (it must not)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{cfg}: mount.staging: " in r.stderr and f"store {store!r}" in r.stderr, r.stderr
    assert not os.path.ismount(tmp_path / "mp")
    assert tree(tmp_path / "cfg") == before
    assert cpfs("cat", "/src.bin", config=cfg).stdout == src.read_bytes()


# ---- modes of what cpfs writes on disk --------------------------------------------------------------------

def modes(root: Path) -> tuple[set[int], set[int]]:
    """The permission bits of the files and of the folders under root (root included)."""
    files, dirs = set(), set()
    for p in [root, *root.rglob("*")]:
        st = p.lstat()
        (dirs if stat.S_ISDIR(st.st_mode) else files).add(stat.S_IMODE(st.st_mode))
    return files, dirs


@pytest.mark.parametrize("configured, mask, file_mode, dir_mode", [
    ("", 0o000, 0o600, 0o700),                                   # the defaults, even with no umask at all
    ('[store_defaults]\nfile_mode = "0640"\ndir_mode = "0750"', 0o077, 0o640, 0o750),
    ('[store_defaults]\nfile_mode = "600"\ndir_mode = "0711"', 0o022, 0o600, 0o711),
])
def test_store_and_staging_files_have_the_configured_modes(make_config, tmp_path, mount, configured, mask,
                                                           file_mode, dir_mode):
    staging = tmp_path / "staging"
    cfg = staging_config(make_config, staging, configured)
    stores = tmp_path / "cfg" / "stores"
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(3 * MiB))
    (src / "sub" / "b.bin").write_bytes(os.urandom(100))
    with umask(mask):
        cpfs("put", str(src), "run1", config=cfg)
        assert modes(stores) == ({file_mode}, {dir_mode}), "after cpfs put"
        m = mount(cfg)
    with open(m.path / "run1" / "new.bin", "wb") as f:
        f.write(os.urandom(2 * MiB + 1))
        f.flush()
        assert len(own_folders(staging)) == 1
        assert modes(staging) == ({file_mode}, {dir_mode}), "the staging folder it made, and its files"
    (m.path / "run2").mkdir()
    (m.path / "run2" / "c.bin").write_bytes(os.urandom(MiB))
    m.stop()
    files, dirs = modes(stores)
    assert (files, dirs) == ({file_mode}, {dir_mode}), "after writes through the mount"
    assert len(list(stores.rglob("*"))) > 10


BAD_MODES = [
    ("file_mode", '"0644x"', "octal"), ("file_mode", '"999"', "octal"), ("file_mode", "600", "octal"),
    ("file_mode", '""', "octal"), ("file_mode", '"4755"', "octal"), ("dir_mode", '"rwx"', "octal"),
    ("file_mode", '"0400"', "owner"), ("dir_mode", '"0600"', "owner"), ("dir_mode", "0o700", "octal"),
]


@pytest.mark.parametrize("key, value, what", BAD_MODES)
def test_bad_modes_are_config_errors_naming_the_key(key, value, what):
    text = (f"[store_defaults]\n{key} = {value}\n"
            '[[store]]\nname = "a"\nurl = "a"\n[[store]]\nname = "b"\nurl = "b"\n')
    with pytest.raises(ConfigError) as e:
        parse_config(text, "/cfg/cpfs.toml", Path("/cfg"))
    msg = str(e.value)
    assert msg.startswith(f"/cfg/cpfs.toml: store_defaults.{key}: ") and what in msg and "\n" not in msg, msg


def test_a_bad_mode_fails_cpfs_put_with_one_line_and_nothing_written(make_config, tmp_path):
    cfg = make_config(extra='[store_defaults]\nfile_mode = "0o600"')
    (tmp_path / "x.bin").write_bytes(b"x")
    r = cpfs("put", str(tmp_path / "x.bin"), config=cfg, check=False, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{cfg}: store_defaults.file_mode: " in r.stderr and "octal" in r.stderr, r.stderr
    assert not (tmp_path / "cfg" / "stores").exists()


# ---- new folders are durable ------------------------------------------------------------------------------

def test_every_new_store_folder_is_fsynced_into_its_parent(make_config, tmp_path):
    """Every folder `cpfs put` makes in a store is followed by an fsync of the folder holding it, so a
    crash cannot lose a folder whose files were fsynced (seen with strace: no crash needed)."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace")
    cfg = make_config()
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 * MiB))
    trace = tmp_path / "trace.txt"
    cmd = ["strace", "-f", "-qq", "-y", "-e", "trace=mkdir,mkdirat,fsync", "-o", str(trace),
           sys.executable, "-m", "cpfs.cli", "--config", str(cfg), "put", str(src), "/deep/er/src.bin"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    stores = str(tmp_path / "cfg" / "stores")
    made: dict[str, int] = {}
    synced: dict[str, list[int]] = {}
    for i, line in enumerate(trace.read_text().splitlines()):
        if m := re.search(r'mkdir(?:at)?\((?:[^,]*, )?"([^"]+)"', line):
            made.setdefault(os.path.normpath(m.group(1)), i)
        elif m := re.search(r"fsync\(\d+<([^>]+)>", line):
            synced.setdefault(m.group(1), []).append(i)
    in_stores = {d: i for d, i in made.items() if d.startswith(stores + "/")}
    assert len(in_stores) >= 3 * 2, made                      # the roots, manifests/..., chunk folders
    unsynced = [d for d, i in in_stores.items() if not any(j > i for j in synced.get(os.path.dirname(d), []))]
    assert not unsynced, unsynced
