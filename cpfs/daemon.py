"""The mount daemon: checks, mounts, serves until unmounted, and reports readiness to the launcher.

`python mount.py MOUNTPOINT` returns once the mount answers a stat: the launcher starts this daemon as a
child in its own session and waits on a pipe for "READY" or "ERROR <one line>". `fusermount3 -u` ends
the FUSE session, the daemon's nursery cancels every task, and the process exits 0; SIGINT/SIGTERM to
a foreground daemon unmount the same way.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pyfuse3
import trio

from . import buffers
from . import chunk as chunkfmt
from .cache import ChunkCache
from .catalog import Catalog
from .config import Config, overlap, staging_dir
from .errors import ConfigError, CpfsError
from . import metrics, roster
from .fs import CpfsOperations, mount_options
from .holds import Holds
from .learned import Learner
from .namespace import Namespace
from .pagecache import Pusher
from .pool import StorePool
from .readahead import Scheduler
from .staging import StagingError
from .upload import ENCODE_POOL
from .voidjournal import VoidJournal

log = logging.getLogger(__name__)
SHARE_AT_UNMOUNT = 5.0     # seconds an unmount waits to share what the last loads learned (cpfs/learned.py)


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


async def trim_buffers(pools: tuple[buffers.BufferPool, ...], interval: float = 5.0) -> None:
    """Free the buffers nobody holds (cpfs/buffers.py: chunk reads, spans encoded for upload) once a pool
    handed none out for `interval` s: a load or a save reuses them, an idle daemon gives the memory back."""
    seen = [-1] * len(pools)
    while True:
        await trio.sleep(interval)
        for i, p in enumerate(pools):
            st = p.statistics()
            if st.reused + st.allocated == seen[i] and st.bytes > st.keep:
                p.trim()
            seen[i] = st.reused + st.allocated


async def serve(config: Config, mountpoint: Path, ready_fd: int | None) -> None:
    check_staging_place(config, staging_dir(config))     # before any store work (prepare_staging checks again)
    pool = StorePool(config)
    await pool.check()
    listed = await roster.enroll(pool)     # before any write: what a gc with another config must see
    catalog = Catalog(pool, journal=VoidJournal.for_config(config))
    roster.take(catalog, listed)
    await catalog.retry_voids()            # failed commits an earlier process could not void yet
    if catalog.statistics().unvoided:
        log.error("%d failed commits still wait to be voided (no store takes their key): until one does, "
                  "they may count as current", catalog.statistics().unvoided)
    manifests = await catalog.load_all()
    log.info("%d files in %d stores", len(manifests), len(pool.names))
    cache = ChunkCache(config.cache_memory)
    # Read buffers for what readahead may hold at once (its window, the fetches in flight), in their
    # size classes; within half the cache budget, which counts the same bytes while they are cached.
    buffers.POOL.max_bytes = min(config.cache_memory // 2, config.readahead_max * 5 // 4 + config.fetch_concurrency
                                 * buffers.size_class(config.chunk_size + chunkfmt.HEADER_SIZE))
    # Folder stores read into them; kept backed, so a cold load after an idle spell pays no first touches.
    if any(s.kind == "dir" for s in config.stores):
        buffers.POOL.keep = min(config.ready_buffers, buffers.POOL.max_bytes)
    pusher = Pusher() if config.notify_store else None
    sched = Scheduler(cache, pool.fetch_chunk, config, on_chunk=pusher, fetch_many=pool.fetch_chunks,
                      fetch_blocks=pool.fetch_blocks, on_reply=pusher.replied if pusher else None)
    staging = await trio.to_thread.run_sync(prepare_staging, config)
    learner = Learner.for_config(sched, config, pool) if config.learn_prefetch else None
    sched.watcher = learner
    holds = Holds(pool)                    # the versions open here, kept from gc (cpfs/holds.py)
    ops = CpfsOperations(Namespace(manifests), sched, catalog, config, staging, pusher, learner, holds,
                         make_staging=functools.partial(own_staging, config))
    options = set(pyfuse3.default_options) | {"fsname=cpfs", "subtype=cpfs"} | mount_options(config)
    try:
        pyfuse3.init(ops, str(mountpoint), options)
    except BaseException:
        remove_staging(staging)
        raise
    try:
        async with trio.open_nursery() as n:
            ops.nursery = n

            async def announce() -> None:
                ops.device = (await trio.to_thread.run_sync(os.stat, mountpoint)).st_dev   # cpfs/openers.py
                await trio.to_thread.run_sync(_set_kernel_readahead, mountpoint, config.read_ahead_kb)
                # The ready read buffers (cpfs/buffers.py), before the launcher returns: their first
                # touches belong to starting the mount, not to the first load.
                await trio.to_thread.run_sync(buffers.POOL.prefill, config.chunk_size + chunkfmt.HEADER_SIZE)
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

            await metrics.start(n, config, ops.statistics_document)   # [metrics] listen (off by default): Prometheus
            await n.start(pool.run)          # store health: probes stores marked down until they answer
            await n.start(catalog.keep_voiding)   # failed commits no store let us void yet (cpfs/catalog.py)
            await n.start(holds.run)         # writes, renews and deletes the holds of what is open here
            if pusher is not None:
                await n.start(pusher.run)
            n.start_soon(announce)
            n.start_soon(on_signal)
            n.start_soon(trim_buffers, (buffers.POOL, ENCODE_POOL))
            await n.start(sched.run)
            if learner is not None:
                await n.start(learner.run)
            await pyfuse3.main(min_tasks=4, max_tasks=config.max_tasks)
            with trio.move_on_after(SHARE_AT_UNMOUNT):
                await holds.aclose()        # nothing is open any more (else the holds lapse after gc_grace)
            if learner is not None:
                with trio.move_on_after(SHARE_AT_UNMOUNT):
                    await learner.share()   # what the opens closed at unmount read, for other hosts
            n.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)
        remove_staging(ops.staging)             # made by a write, if the disk was full at mount
        if learner is not None:
            learner.flush()                 # what the opens closed at unmount read
        # The stores' figures too: a load that was slow with nothing odd in the scheduler's (a stall in
        # one run of a benchmark) shows here which store answered late, and whether reads were hedged.
        log.info("unmounted %s; cache %s; scheduler %s; read buffers %s; encode buffers %s; page cache pushes %s; "
                 "stores %s; replicas %s; holds %s; learned %s", mountpoint, cache.statistics(), sched.statistics(),
                 buffers.POOL.statistics(), ENCODE_POOL.statistics(), pusher.statistics() if pusher else None,
                 pool.statistics(), pool.replica_statistics(), holds.statistics(),
                 learner.statistics() if learner else None)


# Staging. The staging folder may be shared (/scratch, a folder beside other tools' data): cpfs works in
# a folder of its own per daemon, `cpfs-<pid>-<random>`, marked by STAGING_MARKER (written and flock'ed
# before it gets its name, so no folder is ever marked and unlocked while its daemon lives) and removes
# only such folders whose lock no live daemon holds. Anything else there is not cpfs's to delete.
STAGING_MARKER = ".cpfs-staging"
_MARKER_TEXT = b"cpfs staging folder: removed by the next mount once its daemon is gone\n"
_OWN_FOLDER = re.compile(r"cpfs-[0-9]+-[0-9a-f]{8}")
_staging_lock: int | None = None       # the marker of this daemon's folder, held open and flock'ed for its life


def check_staging_place(config: Config, staging: Path) -> None:
    """Refuse a staging folder inside a store's folder or holding one (or being one): leftovers are
    removed from it, and a store's keys are its files. ConfigError naming mount.staging and the store."""
    what = f"{staging}" + ("" if config.staging is not None else " (the default)")
    for s in config.stores:
        if s.path is not None and (how := overlap(staging, s.path)):
            raise ConfigError(f"{config.source}: mount.staging: {what} {how} the folder of store {s.name!r} "
                              f"({s.path}); set mount.staging to a folder outside every store")


def check_mount_place(config: Config, mountpoint: Path) -> None:
    """Refuse a mountpoint that is, holds or sits inside a folder store or the staging folder: the
    daemon's own store requests went through its mount and waited on themselves until the store
    timeout, then every operation failed EIO (an audit's find)."""
    staging = staging_dir(config)
    for name, folder in [*((f"store {s.name!r}", s.path) for s in config.stores if s.path is not None),
                         ("the staging folder (mount.staging)", staging)]:
        if how := overlap(mountpoint, folder):
            raise MountError(f"{mountpoint}: {how} the folder of {name} ({folder}); mount elsewhere")


def _remove_if_dead(folder: Path) -> None:
    """Remove `folder` if it is a staging folder cpfs made whose daemon is gone (killed, even a zombie:
    its flock went with it). Its files never committed; the committed versions are on the stores."""
    if not _OWN_FOLDER.fullmatch(folder.name) or folder.is_symlink() or not folder.is_dir():
        return
    try:
        fd = os.open(folder / STAGING_MARKER, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return                      # no marker (or not ours to open): not a folder cpfs can vouch for
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.pread(fd, len(_MARKER_TEXT), 0) != _MARKER_TEXT:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return                  # a live daemon's
        log.info("removing staging left by a dead daemon: %s", folder)
        shutil.rmtree(folder, ignore_errors=True)      # holding its lock: no other daemon removes it too
    finally:
        os.close(fd)


def _make_folders(folder: Path, mode: int) -> None:
    """Make the missing folders down to `folder` with exactly `mode`; existing ones keep theirs."""
    missing = []
    while not folder.is_dir() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)


def prepare_staging(config: Config) -> Path | None:
    """This daemon's staging folder (`own_staging`), after removing the folders of dead daemons (which
    may be what filled the disk). Refuses a staging folder that overlaps a store first. None if the
    disk has no room for it (ENOSPC, EDQUOT: the node's local disk filled up): the mount serves reads,
    which need no staging, and its first write makes the folder once there is room; a full staging disk
    kept the mount from starting, and committed checkpoints from being read. Other failures: StagingError."""
    root = staging_dir(config)
    check_staging_place(config, root)
    try:
        _make_folders(root, config.dir_mode)
        for d in root.iterdir():
            _remove_if_dead(d)
        return own_staging(config)
    except (OSError, StagingError) as e:
        error = e if isinstance(e, StagingError) else _staging_error(root, e)
    if not error.full:
        raise error
    log.warning("%s: this mount serves reads; writes fail (ENOSPC) until the disk has room", error)
    return None


def own_staging(config: Config) -> Path:
    """Make this daemon's folder in the staging folder, marked and locked for the daemon's life;
    StagingError (with the errno) if the disk refuses. Blocking."""
    global _staging_lock
    root = staging_dir(config)
    mine = root / f"cpfs-{os.getpid()}-{secrets.token_hex(4)}"
    fd: int | None = None
    try:
        os.mkdir(mine, config.dir_mode)
        os.chmod(mine, config.dir_mode)
        tmp = mine / f"{STAGING_MARKER}.new"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, config.file_mode)
        os.fchmod(fd, config.file_mode)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, _MARKER_TEXT)
        os.rename(tmp, mine / STAGING_MARKER)          # marked only once locked
    except BaseException as e:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(mine, ignore_errors=True)
        if isinstance(e, OSError):
            raise _staging_error(root, e) from None
        raise
    _staging_lock = fd
    return mine


def _staging_error(root: Path, e: OSError) -> StagingError:
    return StagingError(f"staging folder {root} ([mount] staging): {e.strerror or e}", e.errno or errno.EIO)


def remove_staging(folder: Path | None) -> None:
    """Remove this daemon's staging folder (at unmount, or when the mount fails) and release its lock."""
    global _staging_lock
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    if _staging_lock is not None:
        os.close(_staging_lock)
        _staging_lock = None


class OneLine(logging.Formatter):
    """One record, one line: control characters in a message (a file name with a newline, a tab or
    an escape sequence: `mv` allows any) are escaped, so that a name can neither split a line nor
    forge one (an audit's find). A traceback after the message stays as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _CONTROL.sub(lambda m: repr(m.group())[1:-1], record.message)
        return super().formatMessage(record)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class UnwantedReply(logging.Filter):
    """pyfuse3 logs an answer the kernel no longer waited for (ENOENT from fuse_reply_*: the caller
    was interrupted, or the mount went, as a RELEASE right before an unmount) at ERROR, which reads
    like a failure of the operation (the failover-reload audit). It is INFO, saying so."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and "fuse_reply_* failed" in str(record.msg) \
                and record.args == (os.strerror(errno.ENOENT),):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = f"{record.msg} (the kernel no longer waited for this answer)"
        return True


def log_to(handler: logging.Handler, fmt: str, level: str | int) -> None:
    """Every record goes to `handler`, one line each (`OneLine`)."""
    handler.setFormatter(OneLine(fmt))
    pyfuse3_log = logging.getLogger("pyfuse3")
    if not any(isinstance(f, UnwantedReply) for f in pyfuse3_log.filters):
        pyfuse3_log.addFilter(UnwantedReply())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def setup_logging(level: str, log_file: str | None) -> None:
    # A file name that is not UTF-8 is logged escaped, not lost to a "Logging error".
    handler = logging.FileHandler(log_file, encoding="utf-8", errors="backslashreplace") if log_file \
        else logging.StreamHandler(sys.stderr)
    log_to(handler, "%(asctime)s %(levelname)s %(name)s: %(message)s", level)


def run_foreground(config: Config, mountpoint: Path, ready_fd: int | None) -> int:
    """Serve until unmounted; errors go up to the CLI, which reports them (and to the launcher)."""
    buffers.keep_freed_memory()
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
