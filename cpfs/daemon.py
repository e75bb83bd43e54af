"""The mount daemon: checks, mounts, serves until unmounted, and reports readiness to the launcher.

`python mount.py MOUNTPOINT` returns once the mount answers a stat: the launcher starts this daemon as a
child in its own session and waits on a pipe for "READY" or "ERROR <one line>". `fusermount3 -u` ends
the FUSE session, the daemon's nursery cancels every task, and the process exits 0; SIGINT/SIGTERM to
a foreground daemon unmount the same way.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyfuse3
import trio

from .cache import ChunkCache
from .catalog import Catalog
from .config import Config, staging_dir
from .errors import CpfsError
from .fs import CpfsOperations
from .namespace import Namespace
from .pool import StorePool
from .readahead import Scheduler

log = logging.getLogger(__name__)


class MountError(CpfsError):
    """A mount that cannot start; the message says what to do."""


def check_mountpoint(mountpoint: Path) -> None:
    """Refuse, with what to do, a missing, busy or stale mountpoint before anything starts."""
    stale = MountError(f"{mountpoint}: a stale mount left by a killed daemon; "
                       f"run 'fusermount3 -u {mountpoint}' and mount again")
    try:
        os.stat(mountpoint)
        if os.path.ismount(mountpoint):
            os.listdir(mountpoint)      # attributes may be cached by the kernel; a listing is not
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise stale from None
        if e.errno == errno.ENOENT:
            raise MountError(f"{mountpoint}: no such folder; create it first (mkdir -p {mountpoint})") from None
        raise MountError(f"{mountpoint}: {e.strerror}") from None
    if not os.path.isdir(mountpoint):
        raise MountError(f"{mountpoint}: not a folder")
    if os.path.ismount(mountpoint):
        raise MountError(f"{mountpoint}: something is mounted there already; "
                         f"unmount it first (fusermount3 -u {mountpoint})")


def _set_kernel_readahead(mountpoint: Path, kb: int) -> None:
    """Raise the mount's bdi readahead so the kernel asks for large sequential reads (root only)."""
    dev = os.stat(mountpoint).st_dev
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        path.write_text(str(kb))
        log.info("kernel readahead of %s set to %d KiB", mountpoint, kb)
    except OSError as e:
        log.info("could not set %s: %s (kernel default readahead stays)", path, e.strerror)


def make_pusher(limiter: trio.CapacityLimiter):
    """An on_chunk callback that stores chunks in the kernel page cache from a worker thread.
    Never from the event loop: the kernel may wait for a page lock that one of our replies releases."""
    disabled = False

    async def push(inode: int, offset: int, data: bytes) -> None:
        nonlocal disabled
        if disabled:
            return
        try:
            await trio.to_thread.run_sync(pyfuse3.notify_store, inode, offset, data, limiter=limiter)
        except OSError as e:
            if e.errno == errno.ENOSYS:
                disabled = True
                log.warning("kernel does not support notify_store; page cache push disabled")
                return
            raise

    return push


async def serve(config: Config, mountpoint: Path, ready_fd: int | None) -> None:
    pool = StorePool(config)
    await pool.check()
    catalog = Catalog(pool)
    manifests = await catalog.load_all()
    log.info("%d files in %d stores", len(manifests), len(pool.names))
    cache = ChunkCache(config.cache_memory)
    pusher = make_pusher(trio.CapacityLimiter(2)) if config.notify_store else None
    sched = Scheduler(cache, pool.fetch_chunk, config, on_chunk=pusher)
    staging = await trio.to_thread.run_sync(prepare_staging, staging_dir(config))
    ops = CpfsOperations(Namespace(manifests), sched, catalog, config, staging)
    options = set(pyfuse3.default_options) | {"fsname=cpfs", "subtype=cpfs"}
    try:
        pyfuse3.init(ops, str(mountpoint), options)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        async with trio.open_nursery() as n:
            ops.nursery = n

            async def announce() -> None:
                await trio.to_thread.run_sync(os.stat, mountpoint)
                await trio.to_thread.run_sync(_set_kernel_readahead, mountpoint, config.read_ahead_kb)
                log.info("mounted %s (pid %d)", mountpoint, os.getpid())
                if ready_fd is not None:
                    os.write(ready_fd, b"READY\n")
                    os.close(ready_fd)

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for sig in signals:
                        log.info("signal %d: unmounting", sig)
                        pyfuse3.terminate()
                        return

            n.start_soon(announce)
            n.start_soon(on_signal)
            await pyfuse3.main(min_tasks=4, max_tasks=config.max_tasks)
            n.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)
        shutil.rmtree(staging, ignore_errors=True)
        log.info("unmounted %s; cache %s; scheduler %s", mountpoint, cache.statistics(), sched.statistics())


_staging_lock: int | None = None       # held open (and flock'ed) for the daemon's life


def _held(folder: Path) -> bool:
    """Whether a live daemon holds this staging folder's lock (a killed one, even a zombie, does not)."""
    try:
        fd = os.open(folder / ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def prepare_staging(root: Path) -> Path:
    """This daemon's staging folder, `root/<pid>`, locked while it lives. Folders no live daemon holds
    (left by kill -9) are removed: their files never committed, the committed versions are on the stores."""
    global _staging_lock
    root.mkdir(parents=True, exist_ok=True)
    for d in root.iterdir():
        if d.is_dir() and not _held(d):
            log.info("removing staging left by a dead daemon: %s", d)
            shutil.rmtree(d, ignore_errors=True)
    mine = root / str(os.getpid())
    mine.mkdir(exist_ok=True)
    _staging_lock = os.open(mine / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(_staging_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return mine


def setup_logging(level: str, log_file: str | None) -> None:
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def run_foreground(config: Config, mountpoint: Path, ready_fd: int | None) -> int:
    """Serve until unmounted; errors go up to the CLI, which reports them (and to the launcher)."""
    trio.run(serve, config, mountpoint, ready_fd)
    return 0


def default_log_file() -> Path:
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "cpfs" / "mount.log"


def launch(argv: list[str], log_file: Path, timeout: float = 120.0) -> int:
    """Start the daemon (`argv` plus --foreground --ready-fd) in the background; return once it is
    mounted (0) or has failed (1, its error printed)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "cpfs.cli", *argv, "--foreground", "--ready-fd", str(w),
           "--log-file", str(log_file)]
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(cmd, pass_fds=(w,), start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        line = pipe.readline().decode(errors="replace").strip()
    if line == "READY":
        print(f"cpfs: mounted (daemon pid {proc.pid}, log {log_file})", file=sys.stderr)
        return 0
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    msg = line[len("ERROR "):] if line.startswith("ERROR ") else f"daemon exited ({code}); see {log_file}"
    print(f"cpfs: error: {msg}", file=sys.stderr)
    return 2 if code == 2 else 1
