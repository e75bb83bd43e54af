"""mount.cpfs: mount(8)'s helper interface, an fstab line (`mount -t fuse.cpfs`) and `mount -a`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpfs.mount_helper import UsageError, parse
from tests.conftest import cpfs

HELPER = Path(sys.executable).with_name("mount.cpfs")
SBIN_LINK = Path("/sbin/mount.fuse.cpfs")


def test_options_map_to_the_mount_command() -> None:
    assert parse(["/etc/cpfs.toml", "/mnt/ckpt", "-o", "rw,_netdev,nofail,x-systemd.automount,"
                  "log_file=/var/log/cpfs.log,log_level=debug"]) == [
        "mount", "/mnt/ckpt", "--config", "/etc/cpfs.toml", "--log-file", "/var/log/cpfs.log",
        "--log-level", "debug"]
    assert parse(["cpfs", "/mnt/ckpt", "-n", "-oconfig=/c.toml"]) == ["mount", "/mnt/ckpt", "--config", "/c.toml"]


@pytest.mark.parametrize("argv", [["/c.toml"], ["/c.toml", "/m", "-o", "ro"], ["/c.toml", "/m", "-o", "colour=red"],
                                  ["/c.toml", "/m", "-o", "config=/d.toml"], ["/c.toml", "/m", "-x"]])
def test_bad_invocations_are_refused(argv: list[str]) -> None:
    with pytest.raises(UsageError):
        parse(argv)


def _put_sample(cfg: Path, tmp_path: Path) -> bytes:
    data = os.urandom(3 * 1024 * 1024)
    (tmp_path / "sample.bin").write_bytes(data)
    cpfs("put", str(tmp_path / "sample.bin"), "/sample.bin", config=cfg)
    return data


def test_mount_cpfs_mounts_and_returns_once_live(make_config, tmp_path: Path) -> None:
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    data = _put_sample(cfg, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([str(HELPER), str(cfg), str(mnt), "-o", f"rw,nofail,log_file={tmp_path / 'm.log'}"],
                       capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        assert (mnt / "sample.bin").read_bytes() == data
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mount(8) with a helper in /sbin needs root")
def test_fstab_line_and_mount_a(make_config, tmp_path: Path) -> None:
    """An fstab line of type fuse.cpfs mounts with `mount MOUNTPOINT` and with `mount -a` (an fstab of
    the test's own, `mount -T`, so the machine's /etc/fstab is never touched)."""
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    data = _put_sample(cfg, tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# cpfs test\n{cfg} {mnt} fuse.cpfs _netdev,nofail,log_file={tmp_path / 'm.log'} 0 0\n")
    made = not SBIN_LINK.exists()
    if made:
        SBIN_LINK.symlink_to(HELPER)
    elif SBIN_LINK.resolve() != HELPER.resolve():
        pytest.skip(f"{SBIN_LINK} belongs to another installation")
    try:
        for cmd in (["mount", "-T", str(fstab), str(mnt)], ["mount", "-a", "-T", str(fstab)]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            try:
                assert r.returncode == 0, r.stderr
                assert os.path.ismount(mnt)
                assert (mnt / "sample.bin").read_bytes() == data
            finally:
                subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
                _wait_unmounted(mnt)
    finally:
        if made:
            SBIN_LINK.unlink()


def _wait_unmounted(mnt: Path) -> None:
    deadline = time.monotonic() + 30
    while os.path.ismount(mnt) and time.monotonic() < deadline:
        time.sleep(0.05)
