"""Folder semantics through real mounts: statfs, owner/mode/times (stored, enforced, seen by another
mount and after a remount), allow_other, user extended attributes, fifos and sockets, hard links.

Tests that act as another user run a child process as uid/gid 65534 with the system Python (the
project's venv may sit under a private home). The child reaches the mount through an inherited file
descriptor of its folder (/proc/self/fd/N), since pytest's temporary folders are private to root.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from conftest import cpfs
from cpfs.config import parse_config
from cpfs.manifest import Manifest
from cpfs.pool import StorePool
from cpfs.store import DirectoryStore, Store, StoreWrapper
from cpfs.store.base import Capacity

NOBODY = 65534
CHILD_PYTHON = "/usr/bin/python3"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, acting as another user)")
needs_child = pytest.mark.skipif(not os.access(CHILD_PYTHON, os.X_OK), reason=f"no {CHILD_PYTHON}")


def config(make_config: Callable[..., Path], tmp_path: Path, allow_other: bool = True) -> Path:
    return make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\nrefresh = "0s"\n'
                             f'allow_other = {"true" if allow_other else "false"}\n')


def as_nobody(folder: Path, code: str) -> subprocess.CompletedProcess:
    """Run `code` as uid/gid 65534 with `d` = the path of `folder` (via an inherited descriptor)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        prelude = f"import os, errno\nd = '/proc/self/fd/{fd}'\n"
        return subprocess.run([CHILD_PYTHON, "-c", prelude + code], user=NOBODY, group=NOBODY, extra_groups=[],
                              pass_fds=[fd], capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)


def refreshed(path: Path) -> os.stat_result:
    """lstat in a mount after listing the folder (a listing picks up other mounts' commits)."""
    os.listdir(path.parent)
    return os.lstat(path)


# -- statfs -----------------------------------------------------------------------------------------
@pytest.mark.mount
def test_statfs_reports_the_stores_space_as_a_user_can_spend_it(make_config, tmp_path, mount):
    """Three folder stores on one filesystem, replicas 2: every byte is stored twice on that
    filesystem, so the mount shows half its size and half its free space."""
    m = mount(config(make_config, tmp_path))
    disk = os.statvfs(tmp_path)
    s = os.statvfs(m.path)
    assert s.f_namemax == 255
    total = s.f_blocks * s.f_frsize
    assert abs(total - disk.f_blocks * disk.f_frsize // 2) <= s.f_frsize
    free = s.f_bavail * s.f_frsize
    assert abs(free - disk.f_bavail * disk.f_frsize // 2) < 256 * 1024**2    # others write meanwhile
    assert abs(shutil.disk_usage(m.path).free - free) < 256 * 1024**2      # what a pre-save space check reads
    # df -i: used = files - free, the names the mount knows (it read negative: free was above files).
    used = s.f_files - s.f_ffree
    assert 1 <= used and s.f_favail == s.f_ffree
    (m.path / "one").write_bytes(b"1")
    (m.path / "two").mkdir()
    s = os.statvfs(m.path)
    assert s.f_files - s.f_ffree == used + 2


# -- owner, mode, times -----------------------------------------------------------------------------
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def utimensat(path: Path, atime: tuple[int, int], mtime: tuple[int, int]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    times = (Timespec * 2)(Timespec(*atime), Timespec(*mtime))
    if libc.utimensat(-100, os.fsencode(path), times, 0) != 0:      # AT_FDCWD
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(path))


@pytest.mark.mount
@needs_root
def test_a_folder_implied_by_put_files_is_as_new_as_its_newest_file(make_config, tmp_path, mount):
    """`cpfs put` stores files, not the folders above them: such a folder showed mtime 1970 (`ls -l`,
    `find -newer`, an rsync out of the mount). It is as new as its newest file, through the implied
    folders below it, in every mount."""
    cfg = config(make_config, tmp_path)
    src = tmp_path / "src"
    (src / "step_100" / "shards").mkdir(parents=True)
    for name, when in (("step_100/shards/a.bin", 1_700_000_000), ("step_100/shards/b.bin", 1_700_000_500),
                       ("step_100/meta.json", 1_690_000_000)):
        (src / name).write_bytes(name.encode())
        os.utime(src / name, (when, when))
    cpfs("put", str(src), "/run", config=cfg)
    for m in (mount(cfg, "a"), mount(cfg, "b")):
        for folder in ("run", "run/step_100", "run/step_100/shards"):
            assert (m.path / folder).stat().st_mtime == 1_700_000_500, folder
        assert (m.path / "run/step_100/meta.json").stat().st_mtime == 1_690_000_000


def test_owner_mode_and_times_persist_and_show_in_another_mount(make_config, tmp_path, mount):
    cfg = config(make_config, tmp_path)
    a = mount(cfg, "a")
    f, d = a.path / "run" / "ckpt.pt", a.path / "run"
    d.mkdir()
    f.write_bytes(b"weights" * 1000)
    os.chmod(f, 0o640)
    os.chown(f, 1234, 2345)
    os.chmod(d, 0o2750)
    os.chown(d, 1234, 2345)
    os.utime(f, ns=(1_000_000_000_123_456_789, 1_100_000_000_987_654_321))
    before = os.stat(f)
    assert (stat.S_IMODE(before.st_mode), before.st_uid, before.st_gid) == (0o640, 1234, 2345)
    assert (before.st_atime_ns, before.st_mtime_ns) == (1_000_000_000_123_456_789, 1_100_000_000_987_654_321)
    assert before.st_ctime_ns > 1_100_000_000_987_654_321          # the change itself, now

    def same(st: os.stat_result, want: os.stat_result) -> None:
        assert (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_atime_ns, st.st_mtime_ns) == \
               (want.st_mode, want.st_uid, want.st_gid, want.st_size, want.st_atime_ns, want.st_mtime_ns)

    b = mount(cfg, "b")
    same(refreshed(b.path / "run" / "ckpt.pt"), before)
    dst = refreshed(b.path / "run")
    assert (stat.S_IMODE(dst.st_mode), dst.st_uid, dst.st_gid) == (0o2750, 1234, 2345)

    # UTIME_OMIT keeps the atime, UTIME_NOW takes the time now; and a chmod in b reaches a
    t0 = time.time_ns()
    utimensat(b.path / "run" / "ckpt.pt", (0, UTIME_OMIT), (0, UTIME_NOW))
    os.chmod(b.path / "run" / "ckpt.pt", 0o600)
    st = os.stat(b.path / "run" / "ckpt.pt")
    assert st.st_atime_ns == before.st_atime_ns and st.st_mtime_ns >= t0 - 10**9
    assert stat.S_IMODE(refreshed(f).st_mode) == 0o600

    # a folder's new mode reaches a mount that has it cached (dropped from the kernel at the refresh;
    # the drop runs beside the listing, so look a few times)
    os.chmod(d, 0o2700)
    for _ in range(50):
        if stat.S_IMODE(refreshed(b.path / "run").st_mode) == 0o2700:
            break
        time.sleep(0.1)
    assert stat.S_IMODE(os.stat(b.path / "run").st_mode) == 0o2700

    a.stop()
    a.start()
    again = os.stat(f)
    same(again, st)
    assert f.read_bytes() == b"weights" * 1000


@pytest.mark.mount
@needs_root
def test_chmod_of_a_file_open_for_writing_commits_at_close(make_config, tmp_path, mount):
    m = mount(config(make_config, tmp_path))
    f = m.path / "f"
    with open(f, "wb") as out:
        out.write(b"abc")
        os.fchmod(out.fileno(), 0o604)
        os.fchown(out.fileno(), 7, 8)
    m.stop()
    m.start()
    st = os.stat(f)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, f.read_bytes()) == (0o604, 7, 8, b"abc")


def test_manifests_without_owner_or_times_load_with_defaults():
    """A version committed before owners were stored: no uid/gid (the mount shows its own user), atime
    and ctime as mtime."""
    old = (b'{"format":2,"path":"/a","size":0,"mtime_ns":5,"mode":420,"version":1,"writer":"","host":"",'
           b'"committed_ns":0,"state":"ok","reason":"","symlink":"","directory":false}\n'
           b'{"chunk_size":4,"chunks":[],"tensor_index":null}')
    m = Manifest.from_bytes(old)
    assert (m.uid, m.gid, m.atime_ns, m.ctime_ns, m.xattrs) == (None, None, None, None, ())
    assert Manifest.from_bytes(m.to_bytes()) == m


@pytest.mark.mount
@needs_root
@needs_child
def test_the_kernel_enforces_stored_permissions_for_other_users(make_config, tmp_path, mount):
    m = mount(config(make_config, tmp_path))
    os.chmod(m.path, 0o755)
    secret, shared, box = m.path / "secret", m.path / "shared", m.path / "box"
    secret.write_bytes(b"s")
    os.chmod(secret, 0o600)
    shared.write_bytes(b"public")
    os.chmod(shared, 0o644)
    box.mkdir()
    os.chmod(box, 0o777)
    r = as_nobody(m.path, """
for name, flags in (("secret", os.O_RDONLY), ("shared", os.O_WRONLY)):
    try:
        os.close(os.open(f"{d}/{name}", flags))
        print(name, "opened")
    except PermissionError:
        print(name, "EACCES")
print(open(f"{d}/shared").read())
try:
    os.chown(f"{d}/shared", 65534, 65534)
except PermissionError:
    print("chown EPERM")
with open(f"{d}/box/mine", "w") as f:
    f.write("x")
st = os.stat(f"{d}/box/mine")
print("owner", st.st_uid, st.st_gid)
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:5] == ["secret EACCES", "shared EACCES", "public", "chown EPERM",
                                        f"owner {NOBODY} {NOBODY}"]
    st = os.stat(box / "mine")
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)       # create records the caller
    m.stop()
    m.start()
    st = os.stat(box / "mine")
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)


@pytest.mark.mount
@needs_root
@needs_child
def test_without_allow_other_other_users_cannot_reach_the_mount(make_config, tmp_path, mount):
    m = mount(config(make_config, tmp_path, allow_other=False))
    (m.path / "f").write_bytes(b"x")
    os.chmod(m.path / "f", 0o644)
    r = as_nobody(m.path, """
try:
    os.stat(f"{d}/f")
    print("reached")
except PermissionError:
    print("EACCES")
""")
    assert r.stdout.strip() == "EACCES", r.stderr
    assert "allow_other" not in _options(m.path) and "default_permissions" in _options(m.path)


def _options(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(path):
                return fields[5].split(",") + line.split(" - ")[1].split()[2].split(",")
    raise AssertionError(f"{path} is not mounted")


@pytest.mark.mount
@needs_root
def test_allow_other_is_a_mount_option(make_config, tmp_path, mount):
    m = mount(config(make_config, tmp_path, allow_other=True))
    assert {"allow_other", "default_permissions"} <= set(_options(m.path))


@pytest.mark.mount
@needs_root
def test_new_names_in_a_set_group_id_folder_take_its_group(make_config, tmp_path, mount):
    m = mount(config(make_config, tmp_path))
    d = m.path / "team"
    d.mkdir()
    os.chown(d, 0, 4321)
    os.chmod(d, 0o2775)
    (d / "f").write_bytes(b"")
    (d / "sub").mkdir()
    assert os.stat(d / "f").st_gid == 4321
    sub = os.stat(d / "sub")
    assert sub.st_gid == 4321 and sub.st_mode & stat.S_ISGID


# -- extended attributes ----------------------------------------------------------------------------
@pytest.mark.mount
def test_user_xattrs_round_trip_persist_and_show_in_another_mount(make_config, tmp_path, mount):
    cfg = config(make_config, tmp_path)
    a = mount(cfg, "a")
    f, d = a.path / "ckpt.pt", a.path / "dir"
    f.write_bytes(b"data")
    d.mkdir()
    os.setxattr(f, "user.loader.hint", b"tensors=a,b\x00\xff")
    os.setxattr(f, "user.empty", b"")
    os.setxattr(d, "user.owner", b"team-a")
    assert os.getxattr(f, "user.loader.hint") == b"tensors=a,b\x00\xff"
    assert sorted(os.listxattr(f)) == ["user.empty", "user.loader.hint"]
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.empty", b"x", os.XATTR_CREATE)
    assert e.value.errno == errno.EEXIST
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.none", b"x", os.XATTR_REPLACE)
    assert e.value.errno == errno.ENODATA
    for name in ("trusted.x", "security.x", "system.x"):
        with pytest.raises(OSError) as e:
            os.setxattr(f, name, b"x")
        assert e.value.errno == errno.EOPNOTSUPP, name
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.big", b"x" * 5000)          # more than a file's 4 KiB
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.huge", b"x" * 65537)        # more than Linux allows one value
    assert e.value.errno == errno.E2BIG
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user." + "n" * 251, b"x")        # a name of 256 bytes
    assert e.value.errno == errno.ERANGE
    os.removexattr(f, "user.empty")
    with pytest.raises(OSError) as e:
        os.getxattr(f, "user.empty")
    assert e.value.errno == errno.ENODATA

    b = mount(cfg, "b")
    refreshed(b.path / "ckpt.pt")
    assert os.listxattr(b.path / "ckpt.pt") == ["user.loader.hint"]
    assert os.getxattr(b.path / "dir", "user.owner") == b"team-a"
    # a file rewritten keeps its attributes
    with open(b.path / "ckpt.pt", "wb") as out:
        out.write(b"new data")
    a.stop()
    a.start()
    assert f.read_bytes() == b"new data"
    assert os.getxattr(f, "user.loader.hint") == b"tensors=a,b\x00\xff"


# -- fifos, sockets, device nodes, hard links -----------------------------------------------------------
@pytest.mark.mount
def test_fifos_and_sockets_are_names_other_mounts_see(make_config, tmp_path, mount):
    cfg = config(make_config, tmp_path)
    a = mount(cfg, "a")
    os.mkfifo(a.path / "fifo")
    os.chmod(a.path / "fifo", 0o620)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(a.path / "sock"))
    b = mount(cfg, "b")
    st = refreshed(b.path / "fifo")
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o620
    assert stat.S_ISSOCK(refreshed(b.path / "sock").st_mode)
    os.link(a.path / "fifo", a.path / "hard")       # any kind of file may have several names
    assert os.stat(a.path / "hard").st_ino == os.stat(a.path / "fifo").st_ino
    # b sees the link at its next refresh: spaced by 3x the last one's time (fs.REFRESH_SPACING), which
    # a busy machine stretches past the listing right after the link.
    deadline = time.monotonic() + 10
    while not (stat.S_ISFIFO(refreshed(b.path / "hard").st_mode) and os.stat(b.path / "fifo").st_nlink == 2):
        assert time.monotonic() < deadline, (os.lstat(b.path / "hard"), os.stat(b.path / "fifo"))
        time.sleep(0.2)
    assert os.stat(b.path / "hard").st_ino == os.stat(b.path / "fifo").st_ino


@pytest.mark.mount
@needs_root
def test_device_nodes_are_stored_but_never_open(make_config, tmp_path, mount):
    m = mount(config(make_config, tmp_path))
    os.mknod(m.path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    st = os.stat(m.path / "null")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    with pytest.raises(PermissionError):
        open(m.path / "null", "rb")                 # FUSE mounts are nodev


# -- the pool's capacity arithmetic (stores injected as wrappers) -------------------------------------
class Sized(StoreWrapper):
    """A folder store that reports a given capacity (None: none, as S3)."""

    def __init__(self, inner: Store, cap: Capacity | None) -> None:
        super().__init__(inner)
        self.cap = cap

    async def capacity(self) -> Capacity | None:
        return self.cap


def _pool(tmp_path: Path, caps: list[Capacity | None], replicas: int = 2) -> StorePool:
    stores = [Sized(DirectoryStore(f"s{i}", tmp_path / f"s{i}"), c) for i, c in enumerate(caps)]
    text = f"replicas = {replicas}\n" + "".join(f'[[store]]\nname = "s{i}"\nurl = "s{i}"\n' for i in range(len(caps)))
    return StorePool(parse_config(text, "test.toml", tmp_path), stores)


async def test_pool_capacity_is_the_smallest_share_a_user_can_fill(tmp_path):
    GiB = 1024**3
    # Three stores of their own, replicas 2: each takes 2/3 of every byte; the emptiest bounds the rest.
    pool = _pool(tmp_path, [Capacity(30 * GiB, 9 * GiB), Capacity(60 * GiB, 30 * GiB), Capacity(90 * GiB, 60 * GiB)])
    assert await pool.capacity() == Capacity(total=45 * GiB, free=27 * GiB // 2)
    # Two of them on one filesystem: that space takes 2 x 2/3 of every byte.
    pool = _pool(tmp_path, [Capacity(90 * GiB, 60 * GiB, "dev:1"), Capacity(90 * GiB, 60 * GiB, "dev:1"),
                            Capacity(300 * GiB, 200 * GiB)])
    assert await pool.capacity() == Capacity(total=135 * GiB // 2, free=45 * GiB)
    # A store without a quota (S3) is left out; with none reporting, statfs shows its fixed figure.
    pool = _pool(tmp_path, [None, Capacity(40 * GiB, 20 * GiB), None, Capacity(80 * GiB, 40 * GiB)])
    assert await pool.capacity() == Capacity(total=80 * GiB, free=40 * GiB)
    assert await _pool(tmp_path, [None, None]).capacity() is None
    # A folder store reports its filesystem, as statvfs does.
    cap = await DirectoryStore("d", tmp_path / "not-yet").capacity()
    disk = os.statvfs(tmp_path)
    assert cap.total == disk.f_blocks * disk.f_frsize and cap.shared == f"dev:{os.stat(tmp_path).st_dev}"


@pytest.mark.mount
@needs_root
def test_cp_a_and_rsync_round_trips_keep_owners_modes_times_xattrs_kinds_and_links(make_config, tmp_path, mount):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a").write_bytes(b"hi")
    os.chown(src / "a", 1000, 1001)
    os.chmod(src / "a", 0o640)
    os.utime(src / "a", ns=(1_580_608_922_500_000_000, 1_580_608_922_500_000_001))
    os.setxattr(src / "a", "user.k", b"v")
    os.symlink("a", src / "lnk")
    os.mkfifo(src / "ff")
    os.link(src / "a", src / "sub" / "hard")
    os.chmod(src / "sub", 0o700)
    m = mount(config(make_config, tmp_path))
    back = tmp_path / "back"
    subprocess.run(["cp", "-a", str(src), str(m.path / "copy")], check=True)
    subprocess.run(["cp", "-a", str(m.path / "copy"), str(back)], check=True)
    for name in ("a", "lnk", "ff", "sub"):
        want, got = os.lstat(src / name), os.lstat(back / name)
        assert (got.st_mode, got.st_uid, got.st_gid, got.st_mtime_ns) == \
               (want.st_mode, want.st_uid, want.st_gid, want.st_mtime_ns), name
    assert os.getxattr(back / "a", "user.k") == b"v" and (back / "a").read_bytes() == b"hi"
    assert os.readlink(back / "lnk") == "a"
    for top in (m.path / "copy", back):          # the hard link is kept a hard link, both ways
        assert os.stat(top / "a").st_ino == os.stat(top / "sub" / "hard").st_ino
        assert os.stat(top / "a").st_nlink == 2
    rsynced = tmp_path / "rsynced"
    subprocess.run(["rsync", "-aHX", f"{src}/", str(m.path / "rsynced")], check=True)   # make deps installs it
    subprocess.run(["rsync", "-aHX", f"{m.path / 'rsynced'}/", str(rsynced)], check=True)
    assert os.stat(rsynced / "a").st_ino == os.stat(rsynced / "sub" / "hard").st_ino
    assert (rsynced / "sub" / "hard").read_bytes() == b"hi" and os.getxattr(rsynced / "a", "user.k") == b"v"
    assert os.readlink(rsynced / "lnk") == "a" and stat.S_ISFIFO(os.lstat(rsynced / "ff").st_mode)
    # Folder times are not compared after rsync: its generator sets them while its receiver may still
    # rename a finished temporary file into the folder, which moves the mtime (on any filesystem).


# -- hard links -------------------------------------------------------------------------------------
@pytest.mark.mount
def test_hard_links_are_one_file_under_several_names_in_every_mount(make_config, tmp_path, mount):
    """`ln step_200/model.pt last.pt`: one inode, nlink 2; bytes written and attributes changed through
    either name show through the other; unlink of one name leaves the other whole and shows the new
    ctime; another mount and a fresh mount see one file with two names."""
    cfg = config(make_config, tmp_path, allow_other=False)
    a = mount(cfg, "a")
    (a.path / "run" / "step_200").mkdir(parents=True)
    model = a.path / "run" / "step_200" / "model.pt"
    data = os.urandom(3 * 1024 * 1024)
    model.write_bytes(data)
    os.link(model, a.path / "last.pt")
    s1, s2 = os.stat(model), os.stat(a.path / "last.pt")
    assert s1.st_ino == s2.st_ino and s1.st_nlink == s2.st_nlink == 2
    with open(a.path / "last.pt", "ab") as f:
        f.write(b"tail")
    assert model.read_bytes() == data + b"tail"
    os.chmod(a.path / "last.pt", 0o600)
    assert stat.S_IMODE(os.stat(model).st_mode) == 0o600
    os.link(model, a.path / "run" / "third.pt")
    assert os.stat(a.path / "last.pt").st_nlink == 3
    b = mount(cfg, "b")
    names = [b.path / "run" / "step_200" / "model.pt", b.path / "last.pt", b.path / "run" / "third.pt"]
    inos = {os.stat(n).st_ino for n in names}
    assert len(inos) == 1 and os.stat(names[0]).st_nlink == 3
    assert all(n.read_bytes() == data + b"tail" for n in names)
    before = os.stat(a.path / "last.pt").st_ctime_ns
    time.sleep(0.01)
    os.unlink(model)
    assert not model.exists()
    after = os.stat(a.path / "last.pt")
    assert after.st_nlink == 2 and after.st_ctime_ns > before
    assert (a.path / "last.pt").read_bytes() == data + b"tail"
    c = mount(cfg, "c")
    assert sorted(os.listdir(c.path / "run" / "step_200")) == []
    assert os.stat(c.path / "last.pt").st_nlink == 2
    assert os.stat(c.path / "last.pt").st_ino == os.stat(c.path / "run" / "third.pt").st_ino
    assert stat.S_IMODE(os.stat(c.path / "run" / "third.pt").st_mode) == 0o600
    os.rename(a.path / "run" / "third.pt", a.path / "run" / "renamed.pt")     # a name moves, the file stays
    assert os.stat(a.path / "run" / "renamed.pt").st_ino == os.stat(a.path / "last.pt").st_ino
    os.unlink(a.path / "last.pt")
    assert os.stat(a.path / "run" / "renamed.pt").st_nlink == 1
    assert (a.path / "run" / "renamed.pt").read_bytes() == data + b"tail"
    d = mount(cfg, "d")
    assert sorted(os.listdir(d.path / "run")) == ["renamed.pt", "step_200"] and not (d.path / "last.pt").exists()
    assert (d.path / "run" / "renamed.pt").read_bytes() == data + b"tail"


@pytest.mark.mount
def test_a_hard_link_that_cannot_commit_adds_no_name(make_config, tmp_path, mount):
    """The link's transaction cannot be recorded (every store's `txns` is a file): EIO, no new name, the
    file as it was, here and in another mount."""
    cfg = config(make_config, tmp_path, allow_other=False)
    a = mount(cfg, "a")
    (a.path / "model.pt").write_bytes(b"weights")
    for store in (tmp_path / "cfg" / "stores").iterdir():
        (store / "txns").write_text("not a folder")
    with pytest.raises(OSError) as e:
        os.link(a.path / "model.pt", a.path / "last.pt")
    assert e.value.errno == errno.EIO
    assert os.listdir(a.path) == ["model.pt"] and os.stat(a.path / "model.pt").st_nlink == 1
    b = mount(cfg, "b")
    assert os.listdir(b.path) == ["model.pt"] and (b.path / "model.pt").read_bytes() == b"weights"


def test_a_folder_listed_while_its_names_come_and_go_gives_each_other_name_once(make_config, tmp_path, mount):
    """`for e in os.scandir(d): os.unlink(e.path)` (shutil.rmtree does so) empties the folder, as on a
    local one; names created while a listing runs do not make another name come twice. readdir's
    offsets were positions in the sorted names, which shift when one goes: 5 of 200 files were left
    (an audit's find). Now each name keeps the cookie it got when it arrived."""
    m = mount(config(make_config, tmp_path))
    d = m.path / "d"
    d.mkdir()
    for i in range(200):
        (d / f"file-{i:04d}.txt").write_bytes(b"x")
    for e in os.scandir(d):
        os.unlink(e.path)
    assert os.listdir(d) == []
    for i in range(100):
        (d / f"old-{i:03d}").write_bytes(b"x")
    seen = []
    for k, e in enumerate(os.scandir(d)):
        seen.append(e.name)
        if k < 100:
            (d / f"new-{k:03d}").write_bytes(b"y")   # may or may not be listed (POSIX), never twice
    old = [n for n in seen if n.startswith("old-")]
    assert sorted(old) == [f"old-{i:03d}" for i in range(100)] and len(set(seen)) == len(seen)
    assert set(seen) <= {f"old-{i:03d}" for i in range(100)} | {f"new-{k:03d}" for k in range(100)}
    shutil.rmtree(d)
    assert not d.exists()


def test_a_file_name_that_is_not_utf8_is_saved_listed_read_and_removed(make_config, tmp_path, mount):
    """Linux names are bytes: one that is not UTF-8 (a Latin-1 name from an old tool) saves, lists,
    reads back and goes like any other, here and in another mount; its commit failed with EIO (an
    audit's find: the manifest's path hash encoded the name strictly)."""
    cfg = config(make_config, tmp_path)
    a = mount(cfg)
    root = os.fsencode(a.path)
    name = b"step_\xe9t\xe9-\xff.pt"
    with open(root + b"/" + name, "wb") as f:
        f.write(b"weights")
    os.mkdir(root + b"/run-\xfe")
    os.rename(root + b"/" + name, root + b"/run-\xfe/" + name)
    assert os.listdir(root) == [b"run-\xfe"] and os.listdir(root + b"/run-\xfe") == [name]
    b = os.fsencode(mount(cfg, "b").path)
    with open(b + b"/run-\xfe/" + name, "rb") as f:
        assert f.read() == b"weights"
    os.unlink(root + b"/run-\xfe/" + name)
    os.rmdir(root + b"/run-\xfe")
    assert os.listdir(root) == [] and os.listdir(b) == []


async def _put_as_an_older_cpfs_did(cfg: Path, src: Path, dest: str) -> None:
    """Store `dest` as `cpfs put` did before it refused names no mount can show (`Importer.put_file`
    checks none)."""
    from cpfs.catalog import Catalog
    from cpfs.config import load_config
    from cpfs.importer import Importer

    pool = StorePool(load_config(cfg))
    try:
        await Importer(pool, Catalog(pool)).put_file(src, dest)
    finally:
        await pool.aclose()


def test_stored_names_no_listing_may_carry_are_left_out_of_it(make_config, tmp_path, mount):
    """A name over 255 bytes, and one at the control file's, stored by an older `cpfs put`: the folder
    lists its other names (the kernel failed the whole listing with EIO), the root does not list the
    control file's name twice, and `.cpfs-stats` still serves the mount's figures (it served the file,
    and `cpfs stats` failed with a traceback). Each is logged once (an audit's find)."""
    cfg = config(make_config, tmp_path)
    src = tmp_path / "f.bin"
    src.write_bytes(b"data")
    for dest in (f"/long/{'a' * 300}", "/long/ok.bin", "/.cpfs-stats", "/top.bin"):
        trio.run(_put_as_an_older_cpfs_did, cfg, src, dest)
    m = mount(cfg)
    for _ in range(2):
        assert os.listdir(m.path / "long") == ["ok.bin"]
        assert sorted(os.listdir(m.path)) == ["long", "top.bin"]
    assert "stores" in json.loads((m.path / ".cpfs-stats").read_bytes())
    assert cpfs("stats", str(m.path), config=cfg).returncode == 0
    log_text = m.log.read_text()
    assert log_text.count(f"'/long/{'a' * 300}': not listed: a name over 255 bytes") == 1
    assert log_text.count("'/.cpfs-stats': not listed: the control file's name") == 1


def test_paths_too_long_for_a_manifest_are_enametoolong_at_once(make_config, tmp_path, mount):
    """Paths are JSON text in a manifest's summary line (16 KiB): a character that is no ASCII takes
    6-12 bytes there. A symlink or folder within PATH_MAX whose path and target did not fit failed
    with EIO, and a file there failed at its close, after every write (an audit's find). Now the
    create, mkdir and symlink answer ENAMETOOLONG; shorter ones of the same kind work."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    emoji = "\U0001F600" * 60                               # 240 bytes, 720 bytes of JSON
    deep = m.path.joinpath(*[emoji] * 12)                   # 2.9 KB of path, 8.6 KB of JSON
    shallow = m.path.joinpath(*[emoji] * 4)
    os.makedirs(shallow)
    os.symlink("\U0001F600" * 100, shallow / "link")
    (shallow / "f").write_bytes(b"x")
    assert os.readlink(shallow / "link") == "\U0001F600" * 100 and (shallow / "f").read_bytes() == b"x"
    with pytest.raises(OSError) as e:
        os.makedirs(deep)
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as e:
        os.symlink("\U0001F600" * 1000, shallow / "long-link")
    assert e.value.errno == errno.ENAMETOOLONG
    assert deep.parent.is_dir()                             # 11 levels fit: makedirs made them
    with pytest.raises(OSError) as e:
        open(deep.parent / emoji, "wb")
    assert e.value.errno == errno.ENAMETOOLONG


def test_a_name_with_control_characters_is_logged_on_one_line(make_config, tmp_path, mount):
    """`mv` allows any byte but '/' and NUL in a name: a newline or an escape sequence in one split the
    mount's log lines and could forge one (an audit's find). Each record is one line, escaped."""
    cfg = config(make_config, tmp_path)
    m = mount(cfg)
    name = "a\nINFO cpfs.fs: forged\x1b[31m"
    (m.path / name).write_bytes(b"x")
    os.unlink(m.path / name)
    text = m.log.read_text()
    assert not any(line.startswith("INFO cpfs.fs: forged") for line in text.splitlines())
    assert "\x1b" not in text
    assert "a\\nINFO cpfs.fs: forged\\x1b[31m" in text, text[-2000:]


def test_an_answer_the_kernel_no_longer_waited_for_is_logged_as_info() -> None:
    """pyfuse3 logs a failed fuse_reply_* at ERROR; with ENOENT the kernel had stopped waiting (a
    RELEASE right before an unmount, an interrupted read), which is no failure (the failover-reload
    audit read it as one). Other reply failures stay errors."""
    import io
    import logging
    from cpfs.daemon import log_to
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        log_to(logging.StreamHandler(out), "%(levelname)s %(name)s: %(message)s", "INFO")
        log = logging.getLogger("pyfuse3")
        log.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
        log.error("fuse_read(): fuse_reply_* failed with %s", os.strerror(errno.EINVAL))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert out.getvalue().splitlines() == [
        "INFO pyfuse3: fuse_release(): fuse_reply_* failed with No such file or directory (the kernel no "
        "longer waited for this answer)",
        "ERROR pyfuse3: fuse_read(): fuse_reply_* failed with Invalid argument"]
