"""Shared fixtures: configs with temporary stores, and real mounts that always come down."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def write_config(folder: Path, *, stores: int = 3, replicas: int = 2, chunk_size: str = "1MiB",
                 cache: str = "64MiB", extra: str = "", store_extra: str = "") -> Path:
    """A config with `stores` directory stores under `folder`/stores; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"replicas = {replicas}", f'chunk_size = "{chunk_size}"', extra, "[cache]", f'memory = "{cache}"']
    for i in range(stores):
        lines += ["[[store]]", f'name = "s{i}"', f'url = "stores/s{i}"', store_extra]
    path = folder / "cpfs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(autouse=True, scope="session")
def private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache home of the tests' own: mounts whose config names no staging folder stage files and keep
    learned prefetch plans under $XDG_CACHE_HOME/cpfs (config.staging_dir). Without it every such test
    left a plans file in the user's ~/.cache/cpfs, one per temporary store set, never removed."""
    home = tmp_path_factory.mktemp("cache-home")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(home)
    yield home
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., Path]:
    return lambda **kw: write_config(tmp_path / "cfg", **kw)


def stale_and_fresh_temporaries(folder: Path) -> tuple[Path, Path]:
    """Two temporary files as write_durably names them in `folder`: one two hours old (its writer was
    killed mid-write), one just made (another process's write under way)."""
    folder.mkdir(parents=True, exist_ok=True)
    old, young = (folder / f"x.{tag * 32}.cpfs-tmp" for tag in "ab")
    for f in (old, young):
        f.write_bytes(b"half a file")
    os.utime(old, (time.time() - 7200,) * 2)
    return old, young


def cpfs(*args: str, config: Path | None = None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run the cpfs CLI in a subprocess, as a user would."""
    cmd = [sys.executable, "-m", "cpfs.cli"] + (["--config", str(config)] if config else []) + list(args)
    return subprocess.run(cmd, capture_output=True, check=check, cwd=ROOT, **kw)


class Mount:
    def __init__(self, config: Path, mountpoint: Path, log: Path) -> None:
        self.config, self.path, self.log = config, mountpoint, log
        self.pid: int | None = None

    def start(self, *extra: str) -> subprocess.CompletedProcess:
        self.path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, str(ROOT / "mount.py"), "--config", str(self.config), str(self.path),
                            "--log-file", str(self.log), *extra], capture_output=True, text=True, timeout=120)
        m = re.search(r"daemon pid (\d+)", r.stderr)
        if r.returncode == 0:
            assert m, r.stderr
            self.pid = int(m.group(1))
        return r

    def alive(self) -> bool:
        if self.pid is None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        # A zombie of ours counts as gone.
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().split(")")[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """Unmount, wait for the daemon to exit; kill it by pid only if it does not."""
        if os.path.ismount(self.path) or self._stale():
            subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
            raise AssertionError(f"daemon {self.pid} did not exit after unmount; killed")

    def _stale(self) -> bool:
        try:
            os.stat(self.path)
            return False
        except OSError:
            return True


LOG_TAIL = 60      # lines of a mount's log shown when its test failed


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `long` first, the rest in their order: `make test` runs the suite in several
    processes (pytest-xdist, `--maxschedchunk 2`: a worker holds at most two tests ahead, so the long
    ones spread over the workers), and a long test started last would leave the others idle until it ends."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Keep each phase's report on the test item, so that fixtures can tell a failed test."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Mount]]:
    """mount(config) -> a live Mount; every mount made is unmounted at teardown, also on failure.
    When the test failed, the tail of each mount's log is printed (shown with the failure): the
    daemon's side of an errno, which the temporary folder takes with it."""
    made: list[Mount] = []

    def _mount(config: Path, name: str = "mnt", *extra: str) -> Mount:
        m = Mount(config, tmp_path / name, tmp_path / f"{name}.log")
        made.append(m)
        r = m.start(*extra)
        assert r.returncode == 0, f"mount failed: {r.stderr}\n{m.log.read_text() if m.log.exists() else ''}"
        return m

    yield _mount
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for m in made:
            if m.log.exists():
                tail = m.log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
                print(f"---- last {len(tail)} lines of {m.log}", *tail, sep="\n")
    errors = []
    for m in made:
        try:
            m.stop()
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, errors
