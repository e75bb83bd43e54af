"""Shared pieces of the demo and the benchmarks: cold caches, mounts that always come down, timed loads.

Every timed load runs in a fresh subprocess (`python -m benchmarks.common load ...`), so the Python
heap is fresh and the timer wraps `torch.load` only. Before the timer starts the subprocess drops the
kernel caches (for a cold load) and writes and frees twice the file's size of memory: this VM hands
freed memory back to the host and touching it again costs ~1.5 s/GiB, which would otherwise land in
whichever load allocates first and make the comparison lie.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
GiB = 1024**3
PAGE = 4096
UNMOUNT_TIMEOUT = 30.0


class BenchError(Exception):
    """A step of a benchmark failed; the message says which and why."""


# ---------------------------------------------------------------------------------------------------
# sizes and formatting

def parse_size(text: str) -> int:
    """'1GiB' -> 1073741824 (the same units as the cpfs config)."""
    from cpfs.config import parse_size as _parse

    try:
        return _parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, file: Any = None) -> None:
    """A plain aligned table: the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = file or sys.stdout
    print(line(cells[0]), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in cells[1:]:
        print(line(r), file=out)
    out.flush()


# ---------------------------------------------------------------------------------------------------
# cold caches and memory

def drop_caches() -> str | None:
    """sync, then drop the page cache, dentries and inodes. None on success, else why not (one line)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"could not drop the kernel caches ({e.strerror}): 'cold' loads may be partly warm"
    return None


def touch_memory(nbytes: int) -> None:
    """Write every page of `nbytes` of fresh memory, then free it, so the next allocations of this
    size find guest pages the host has backed again (see the module docstring)."""
    if nbytes <= 0:
        return
    import mmap

    import numpy as np

    # A plain anonymous mapping (4 KiB pages, no hugepage advice), like the large blocks malloc gives
    # torch.load; numpy writes one byte per page, munmap hands the pages back to the kernel.
    m = mmap.mmap(-1, nbytes)
    a = np.frombuffer(m, dtype=np.uint8)
    a[::PAGE] = 1
    del a
    m.close()


# ---------------------------------------------------------------------------------------------------
# the cpfs CLI and mounts

def cpfs(*args: str, config: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `cpfs ARGS` (python -m cpfs.cli) and capture its output."""
    cmd = [sys.executable, "-m", "cpfs.cli"] + (["--config", str(config)] if config else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if check and r.returncode != 0:
        raise BenchError(f"`cpfs {' '.join(args)}` failed (exit {r.returncode}): "
                         f"{(r.stderr or r.stdout).strip()}")
    return r


def ensure_imported(src: Path, dest: str, config: Path | None = None, *, verbose: bool = True) -> bool:
    """`cpfs put SRC DEST` unless `cpfs inspect DEST` shows a file of the same size. True if it put."""
    size = src.stat().st_size
    r = cpfs("inspect", "--json", dest, config=config, check=False)
    if r.returncode == 0:
        have = json.loads(r.stdout).get("size")
        if have == size:
            if verbose:
                print(f"$ cpfs inspect {dest}: already imported ({size} bytes); skipping cpfs put")
            return False
        if verbose:
            print(f"$ cpfs inspect {dest}: {have} bytes there, {size} here; importing again")
    t0 = time.perf_counter()
    r = cpfs("put", str(src), dest, config=config)
    if verbose:
        print(f"$ cpfs put {src.relative_to(ROOT) if src.is_relative_to(ROOT) else src} {dest}"
              f"   ({time.perf_counter() - t0:.1f} s)")
        for line in r.stdout.strip().splitlines():
            print(f"  {line}")
    return True


def _mounted_paths() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4].replace("\\040", " ") for line in f}


def is_mounted(path: Path) -> bool:
    """True also for a stale FUSE mount whose daemon is gone (os.path.ismount says False there)."""
    return str(Path(path).absolute()) in _mounted_paths()


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@dataclass
class Mount:
    path: Path
    pid: int
    log: Path
    log_offset: int                      # the daemon's lines start here in `log` (it may be shared)
    launcher_stderr: str
    log_lines: list[str] = field(default_factory=list)   # filled at unmount
    problems: list[str] = field(default_factory=list)    # unmount trouble, filled at unmount
    unmount_seconds: float | None = None                 # fusermount3 -u until the daemon is gone

    def stats_lines(self) -> list[str]:
        """The daemon's lines with the cache and scheduler statistics (logged at unmount)."""
        return [ln for ln in self.log_lines if "statistics" in ln or "CacheStats" in ln
                or "SchedulerStats" in ln or re.search(r"\b(cache|scheduler)\b", ln)]

    def warnings(self) -> list[str]:
        return [ln for ln in self.log_lines if re.search(r" (WARNING|ERROR|CRITICAL) |Traceback", ln)]


def mount(mountpoint: Path, config: Path | None = None, log_file: Path | None = None) -> Mount:
    """`python mount.py [--config F] MOUNTPOINT`: returns once the mount is live."""
    mountpoint = Path(mountpoint).absolute()
    if mountpoint.parent.is_dir():
        mountpoint.mkdir(exist_ok=True)    # else cpfs says what is missing
    cmd = [sys.executable, str(ROOT / "mount.py")] + (["--config", str(config)] if config else [])
    cmd += [str(mountpoint)] + (["--log-file", str(log_file)] if log_file else [])
    # A benchmark's stores keep their mount's cache (learned plans; staging, if the config names no
    # folder) in `cache/` beside their config: most are temporary, made afresh each run, and each left
    # a learned-plan file in the user's ~/.cache/cpfs, never removed.
    env = None if config is None else {**os.environ,
                                       "XDG_CACHE_HOME": str(Path(config).absolute().parent / "cache")}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    m = re.search(r"daemon pid (\d+), log (.+?)\)\s*$", r.stderr, re.MULTILINE)
    if r.returncode != 0 or not m:
        raise BenchError(f"mount failed: `{' '.join(cmd)}` exit {r.returncode}: {r.stderr.strip()}")
    log = Path(m.group(2))
    # The default log file is shared by every mount (appended): remember where this daemon's lines
    # start, at its "mounted ... (pid N)" line.
    offset = 0
    try:
        data = log.read_bytes()
        i = data.rfind(f"(pid {m.group(1)})".encode())
        offset = data.rfind(b"\n", 0, i) + 1 if i >= 0 else len(data)
    except OSError:
        pass
    return Mount(mountpoint, int(m.group(1)), log, offset, r.stderr.strip())


def unmount(m: Mount, timeout: float = UNMOUNT_TIMEOUT) -> None:
    """`fusermount3 -u`, then wait for the daemon to exit; kill that pid only if it hangs."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while is_mounted(m.path):
        r = subprocess.run(["fusermount3", "-u", str(m.path)], capture_output=True, text=True)
        if r.returncode == 0 or not is_mounted(m.path):
            break
        if time.monotonic() > deadline:
            m.problems.append(f"fusermount3 -u {m.path} kept failing: {r.stderr.strip()}")
            break
        time.sleep(0.2)    # "Device or resource busy": a reader still holds a file open
    while pid_alive(m.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(m.pid):
        m.problems.append(f"daemon pid {m.pid} still running {timeout:.0f} s after unmount; killed it (SIGKILL)")
        try:
            os.kill(m.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)
        end = time.monotonic() + 5
        while pid_alive(m.pid) and time.monotonic() < end:
            time.sleep(0.05)
    else:
        m.unmount_seconds = time.monotonic() - t0
    try:
        with open(m.log, "rb") as f:
            f.seek(m.log_offset)
            m.log_lines = f.read().decode(errors="replace").splitlines()
    except OSError as e:
        m.problems.append(f"cannot read the daemon log {m.log}: {e.strerror}")


@contextmanager
def mounted(config: Path | None, mountpoint: Path, log_file: Path | None = None) -> Iterator[Mount]:
    """Mount (config None = the embedded default), yield the Mount, always unmount and wait for the
    daemon; its log lines are in `Mount.log_lines` afterwards."""
    m = mount(mountpoint, config, log_file)
    try:
        yield m
    finally:
        unmount(m)


def mount_stats(mountpoint: Path) -> dict[str, Any]:
    """The live statistics of a cpfs mount: its `.cpfs-stats` control file (cpfs/stats.py), parsed."""
    from cpfs.stats import CONTROL_NAME

    try:
        return json.loads((Path(mountpoint) / CONTROL_NAME).read_bytes())
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read the statistics of the mount at {mountpoint}: {e}") from None


def fetched_bytes(doc: dict[str, Any]) -> int:
    """Bytes read from every store so far, from a `mount_stats` document."""
    return sum(s["bytes_read"] for s in doc["stores"])


def write_store_config(folder: Path, *, stores: int, replicas: int, name: str = "cpfs.toml",
                       latency: str | None = None, bandwidth: str | None = None, extra: str = "") -> Path:
    """`folder`/`name`: `stores` folder stores under `folder`/stores (relative urls, so several configs in one
    folder share the same stores, e.g. one plain for importing and one throttled for reading)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"replicas = {replicas}", extra]
    for i in range(stores):
        lines += ["", "[[store]]", f'name = "s{i}"', f'url = "stores/s{i}"']
        lines += [f'latency = "{latency}"'] if latency else []
        lines += [f'bandwidth = "{bandwidth}"'] if bandwidth else []
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


def print_daemon_report(m: Mount, title: str, tail: int = 0) -> None:
    """The daemon's statistics lines and warnings; with `tail`, also its last lines."""
    took = f"; unmount took {m.unmount_seconds:.1f} s" if m.unmount_seconds is not None else ""
    print(f"\n{title}: daemon pid {m.pid}, log {m.log}{took}")
    shown = m.stats_lines() + [ln for ln in m.warnings() if ln not in m.stats_lines()]
    if tail:
        shown += [ln for ln in m.log_lines[-tail:] if ln not in shown]
    for line in shown or ["(no statistics line found in the daemon log)"]:
        print(f"  {line}")
    for p in m.problems:
        print(f"  PROBLEM: {p}")


def leave_work(work: Path, keep: bool) -> None:
    """A benchmark's work folder at its end: kept (`--keep`, for its daemon logs; said where) or removed."""
    if keep:
        print(f"kept {work}")
    else:
        remove_tree(work)


def remove_tree(path: Path) -> None:
    """rm -r, but never into a folder that is still a mount point."""
    path = Path(path)
    mounts = [p for p in _mounted_paths() if p == str(path.absolute()) or p.startswith(str(path.absolute()) + "/")]
    if mounts:
        print(f"not removing {path}: still mounted at {', '.join(mounts)}", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# timed loads in a fresh subprocess

@dataclass(frozen=True)
class LoadResult:
    path: str
    size: int
    seconds: float                 # around torch.load only
    read_seconds: float | None     # mmap=True: first read of every tensor (a clone), after the load
    cold: bool
    mmap: bool
    note: str | None               # why the caches could not be dropped, if so
    fingerprints: dict[str, str]

    @property
    def total_seconds(self) -> float:
        return self.seconds + (self.read_seconds or 0.0)


def timed_load(path: Path, *, cold: bool, mmap: bool = False, touch: int = 0, fingerprint: bool = True,
               timeout: float = 1800) -> LoadResult:
    """torch.load(path, weights_only=True) in a fresh subprocess; cold drops the kernel caches first,
    `touch` bytes of memory are written and freed before the timer starts."""
    cmd = [sys.executable, "-m", "benchmarks.common", "load", str(path), "--touch", str(touch)]
    cmd += (["--cold"] if cold else []) + (["--mmap"] if mmap else []) + ([] if fingerprint else ["--no-fingerprint"])
    return LoadResult(**run_child(cmd, timeout))


@dataclass(frozen=True)
class ReadResult:
    path: str
    size: int
    seconds: float
    note: str | None


def timed_read(path: Path, *, cold: bool, touch: int = 0, block: int = MiB, timeout: float = 1800) -> ReadResult:
    """Read the whole file with `block`-sized reads (cat file > /dev/null) in a fresh subprocess."""
    cmd = [sys.executable, "-m", "benchmarks.common", "read", str(path), "--touch", str(touch),
           "--block", str(block)] + (["--cold"] if cold else [])
    return ReadResult(**run_child(cmd, timeout))


def timed_st_load(path: Path, *, cold: bool, touch: int = 0, timeout: float = 1800) -> LoadResult:
    """safetensors.torch.load_file in a fresh python, then a first read of every tensor (a clone):
    load_file maps the file and its tensors fault their pages in only when touched, so the load alone
    would time nothing. `seconds` is the load, `read_seconds` the first read; compare `total_seconds`."""
    cmd = [sys.executable, "-m", "benchmarks.common", "st", str(path), "--touch", str(touch)]
    return LoadResult(**run_child(cmd + (["--cold"] if cold else []), timeout))


def run_child(cmd: list[str], timeout: float) -> dict[str, Any]:
    """A benchmark step in a fresh python: its last stdout line is a JSON result."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"`{' '.join(cmd[1:])}` did not finish in {timeout:.0f} s") from None
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = "\n    ".join(r.stderr.strip().splitlines()[-8:])
        raise BenchError(f"`{' '.join(cmd[1:])}` failed (exit {r.returncode}):\n    {tail}")
    return json.loads(lines[-1])


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) for every leaf of nested dicts/lists/tuples, e.g. 'optimizer/state/3/exp_avg'."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}{k}/")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}{i}/")
    else:
        yield prefix.rstrip("/"), obj


def fingerprint(value: Any) -> str:
    """dtype, shape and BLAKE3 of a tensor's bytes; repr for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        import blake3

        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return f"{value.dtype}{list(value.shape)}:{blake3.blake3(raw, max_threads=blake3.blake3.AUTO).hexdigest()}"
    return f"{type(value).__name__}:{value!r}"


def fingerprints(obj: Any) -> dict[str, str]:
    return {k: fingerprint(v) for k, v in leaves(obj)}


def _child_load(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    note = drop_caches() if args.cold else None
    touch_memory(args.touch)
    t0 = time.perf_counter()
    sd = torch.load(args.path, weights_only=True, mmap=args.mmap)
    seconds = time.perf_counter() - t0
    read_seconds = None
    if args.mmap:
        t0 = time.perf_counter()
        for _, v in leaves(sd):
            if isinstance(v, torch.Tensor):
                v.clone()
        read_seconds = time.perf_counter() - t0
    return {"path": args.path, "size": os.path.getsize(args.path), "seconds": seconds,
            "read_seconds": read_seconds, "cold": args.cold, "mmap": args.mmap, "note": note,
            "fingerprints": fingerprints(sd) if args.fingerprint else {}}


def _child_st(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    note = drop_caches() if args.cold else None
    touch_memory(args.touch)
    t0 = time.perf_counter()
    sd = load_file(args.path)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            v.clone()
    read_seconds = time.perf_counter() - t0
    return {"path": args.path, "size": os.path.getsize(args.path), "seconds": seconds, "read_seconds": read_seconds,
            "cold": args.cold, "mmap": True, "note": note, "fingerprints": {}}


def _child_read(args: argparse.Namespace) -> dict[str, Any]:
    note = drop_caches() if args.cold else None
    touch_memory(args.touch)
    buf = bytearray(args.block)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    with open(args.path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    seconds = time.perf_counter() - t0
    return {"path": args.path, "size": total, "seconds": seconds, "note": note}


def _child_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.common",
                                description="One timed load or read (run by the benchmarks in a fresh process).")
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("load", "read", "st"):
        s = sub.add_parser(name)
        s.add_argument("path")
        s.add_argument("--cold", action="store_true", help="drop the kernel caches first")
        s.add_argument("--touch", type=int, default=0, help="write and free this many bytes first")
        if name == "load":
            s.add_argument("--mmap", action="store_true")
            s.add_argument("--no-fingerprint", dest="fingerprint", action="store_false")
        else:
            s.add_argument("--block", type=int, default=MiB)
    args = p.parse_args(argv)
    result = {"load": _child_load, "read": _child_read, "st": _child_st}[args.what](args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())


class RssSampler:
    """Peak RSS of a process, sampled every `interval` seconds in a thread;
    also its CPU time. Used by bench_save, bench_memory (a peak per load: `reset`) and by the tests'
    memory checks."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self._error = psutil.Error
        self.before = self.peak = self.now()
        self.samples = 0
        self.cpu_seconds = 0.0
        self._cpu0 = self._cpu()
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        return self._proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                rss = self.now()
            except self._error:
                return
            with self._lock:
                self.peak = max(self.peak, rss)
                self.samples += 1

    def reset(self) -> int:
        """The peak so far; the next peak starts from the RSS now."""
        with self._lock:
            peak, self.peak = self.peak, self.now()
        return max(peak, self.peak)

    def _cpu(self) -> float:
        t = self._proc.cpu_times()
        return t.user + t.system

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.cpu_seconds = self._cpu() - self._cpu0
        except self._error:
            pass
