"""Daemon CPU per GiB on a cold load: cpfs against a naive pyfuse3 pass-through, side by side in one run.

Two checkpoints of the same size (default 512 MiB), built here with torch: "large" (a few large
tensors) and "many" (many tensors of 0.5-2 MiB). Each is imported into 3 folder stores (replicas 2, no
simulated latency: this measures CPU, not the network), then, per shape:
- direct: torch.load cold (sync + drop_caches) and warm (second load) from local disk;
- cpfs: a cold torch.load through a fresh mount, the daemon's CPU seconds (utime + stime of its pid, from
  /proc, before and after the load) per GiB; then warm loads on the same mount: torch.load, mmap=True
  (load + first read of every tensor) and safetensors (safetensors.torch.load_file of the same tensors
  + first read of every tensor);
- cold mmap: torch.load(mmap=True) + a first read of every tensor, cold, from local disk and through a
  fresh mount (its daemon's CPU seconds too);
- passthrough: the same cold torch.load through benchmarks/passthrough.py serving the checkpoint's
  folder (the baseline peer: no cache, no prefetch, no checksums), its daemon's CPU seconds per GiB.
Every timed load runs in a fresh python after writing and freeing twice the file's size of memory
(benchmarks/common.py). The checkpoints and the stores are kept under demo-data/cpu (a second run
builds and imports nothing). A warm row is flagged (NOTE) when the daemon worked during the warm
loads: something dropped the kernel page cache meanwhile (drop_caches is machine-wide). With --profile DIR, a second cold load through a fresh mount per shape runs
under `py-spy record --nonblocking` (outside the measured loads) and DIR gets one collapsed-stack file
per shape, with a summary of the hottest frames printed.

    python -m benchmarks.bench_cpu [--size 512MiB] [--repeat 1] [--shapes large,many] [--profile DIR]
                                   [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import (GiB, MiB, ROOT, BenchError, drop_caches, ensure_imported, human, is_mounted, leave_work,
                     mounted, parse_size, print_daemon_report, print_table, run_child, timed_load,
                     touch_memory)

DATA = ROOT / "demo-data" / "cpu"
SHAPES = ("large", "many")
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------
# checkpoints

def _tensors(shape: str, size: int, seed: int = 0) -> dict[str, Any]:
    """~`size` bytes of bf16/fp32 tensors (normal values: lz4 finds little to save, as in real weights)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    total = 0
    i = 0
    while total < size:
        if shape == "large":
            nbytes = min(size - total, 64 * MiB)
        else:
            nbytes = min(size - total, int(torch.randint(MiB // 2, 2 * MiB + 1, (1,), generator=g)))
        dtype = torch.float32 if i % 4 == 3 else torch.bfloat16
        n = max(1, nbytes // dtype.itemsize)
        t = torch.randn(n, generator=g).to(dtype)
        out[f"layer{i // 8}.w{i % 8}"] = t.reshape(-1, 256) if n % 256 == 0 else t
        total += n * dtype.itemsize
        i += 1
    return out


def make_checkpoints(shape: str, size: int) -> tuple[Path, Path]:
    """(.pt, .safetensors) of one shape, built once and kept under demo-data/cpu."""
    pt = DATA / f"{shape}_{human(size).replace(' ', '').replace('.00', '')}.pt"
    st = pt.with_suffix(".safetensors")
    if pt.exists() and st.exists():
        return pt, st
    import torch
    from safetensors.torch import save_file

    DATA.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sd = _tensors(shape, size)
    torch.save(sd, pt.with_suffix(".pt.tmp"))
    save_file(sd, str(st.with_suffix(".st.tmp")))
    os.replace(pt.with_suffix(".pt.tmp"), pt)
    os.replace(st.with_suffix(".st.tmp"), st)
    print(f"built {pt.name} and {st.name}: {len(sd)} tensors, {human(pt.stat().st_size)} "
          f"({time.perf_counter() - t0:.1f} s)")
    return pt, st


def write_config(folder: Path, cache: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["replicas = 2", "", "[cache]", f'memory = "{cache}"']
    for i in range(3):
        lines += ["", "[[store]]", f'name = "s{i}"', f'url = "stores/s{i}"']
    path = folder / "cpfs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------
# measurement

def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def st_load(path: Path, *, cold: bool, touch: int) -> dict[str, Any]:
    """safetensors.torch.load_file in a fresh python (see _child_st)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_cpu", "--child-st", str(path), "--touch", str(touch)]
    return run_child(cmd + (["--cold"] if cold else []), 600)


def _child_st(path: str, cold: bool, touch: int) -> None:
    from safetensors.torch import load_file

    note = drop_caches() if cold else None
    touch_memory(touch)
    t0 = time.perf_counter()
    sd = load_file(path)
    for t in sd.values():      # load_file may map the file lazily: read every tensor once
        t.clone()
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "tensors": len(sd), "note": note}))


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)        # daemon CPU seconds (cold loads)

    def med(self) -> float:
        return statistics.median(self.seconds)

    def med_cpu(self) -> float | None:
        return statistics.median(self.cpu) if self.cpu else None


class Passthrough:
    """benchmarks/passthrough.py serving `source` at `mountpoint`, always unmounted."""

    def __init__(self, source: Path, mountpoint: Path) -> None:
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.mountpoint = mountpoint
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.passthrough", str(source), str(mountpoint)],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "READY":
            self.proc.wait(10)
            raise BenchError(f"passthrough did not mount: {self.proc.stderr.read().strip() if self.proc.stderr else ''}")
        self.pid = self.proc.pid

    def close(self) -> None:
        deadline = time.monotonic() + 30
        while is_mounted(self.mountpoint) and time.monotonic() < deadline:
            if subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def py_spy() -> str | None:
    """The py-spy executable: on PATH or beside this python (a venv's bin)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


class Profiler:
    """py-spy record --nonblocking on a pid, collapsed stacks ("raw") into `out`."""

    def __init__(self, pid: int, out: Path) -> None:
        exe = py_spy() or "py-spy"
        self.out = out
        # --gil: only the thread holding the GIL is sampled, i.e. Python code running, not threads
        # waiting in a lock, a syscall or epoll (which py-spy would otherwise count as busy).
        self.proc = subprocess.Popen([exe, "record", "--nonblocking", "--gil", "--threads", "--rate", "250", "-f", "raw",
                                      "-o", str(out), "-p", str(pid)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)

    def stop(self) -> None:
        import signal
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def summarize_profile(path: Path, top: int = 25) -> list[str]:
    """Self and inclusive sample counts of the hottest frames of a collapsed-stack file."""
    self_n: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        return [f"(no profile: {e.strerror})"]
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") if " (" in f else f
                  for f in stack.split(";")[1:]]            # [0] is the thread
        if not frames:
            continue
        total += count
        self_n[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    out = [f"{total} samples (all threads, idle excluded)", "  self%   incl%  frame"]
    for f, n in self_n.most_common(top):
        out.append(f"  {100 * n / total:5.1f}  {100 * incl[f] / total:6.1f}  {f}")
    return out


# ---------------------------------------------------------------------------------------------------
# the run

def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="cpfs-bench-cpu-", dir=args.workdir or "/tmp"))
    # The stores live beside the checkpoints and are kept: a second run imports nothing.
    cfg = write_config(DATA / f"stores-{args.cache}", args.cache)
    mp = work / "mnt"
    results: dict[tuple[str, str], Result] = collections.defaultdict(Result)
    sizes: dict[str, int] = {}
    mismatches: list[str] = []
    notes: list[str] = []
    mounts = []
    profiles: dict[str, Path] = {}
    try:
        files = {s: make_checkpoints(s, args.size) for s in args.shapes}
        for s, (pt, st) in files.items():
            sizes[s] = pt.stat().st_size
            ensure_imported(pt, f"bench/{pt.name}", cfg, verbose=False)
            ensure_imported(st, f"bench/{st.name}", cfg, verbose=False)
        print(f"work folder {work}; 3 folder stores, replicas 2, cache {args.cache}; "
              f"{args.repeat} round(s), medians shown")
        for rnd in range(args.repeat):
            for s, (pt, st) in files.items():
                touch = 2 * sizes[s]
                mine = f"bench/{pt.name}"
                # direct, cold then warm
                d = timed_load(pt, cold=True, touch=touch)
                results[(s, "direct cold")].seconds.append(d.seconds)
                results[(s, "direct warm")].seconds.append(timed_load(pt, cold=False, touch=touch).seconds)
                r = timed_load(pt, cold=False, mmap=True, touch=touch, fingerprint=False)
                results[(s, "direct warm mmap")].seconds.append(r.total_seconds)
                st_load(st, cold=False, touch=touch)          # into the page cache
                results[(s, "direct warm safetensors")].seconds.append(st_load(st, cold=False, touch=touch)["seconds"])
                # cpfs: cold on a fresh mount, then warm on the same mount
                with mounted(cfg, mp, work / f"{s}-{rnd}.log") as m:
                    mounts.append((f"{s}, round {rnd + 1}", m))
                    c0 = cpu_seconds(m.pid)
                    r = timed_load(mp / mine, cold=True, touch=touch)
                    c1 = cpu_seconds(m.pid)
                    results[(s, "cpfs cold")].seconds.append(r.seconds)
                    results[(s, "cpfs cold")].cpu.append(c1 - c0)
                    mismatches += [f"{s}: {k}" for k in d.fingerprints if d.fingerprints[k] != r.fingerprints.get(k)]
                    c0 = cpu_seconds(m.pid)
                    results[(s, "cpfs warm")].seconds.append(timed_load(mp / mine, cold=False, touch=touch).seconds)
                    r = timed_load(mp / mine, cold=False, mmap=True, touch=touch, fingerprint=False)
                    results[(s, "cpfs warm mmap")].seconds.append(r.total_seconds)
                    warm_cpu = cpu_seconds(m.pid) - c0
                    path = mp / f"bench/{st.name}"
                    st_load(path, cold=False, touch=touch)    # first read: fetched
                    c0 = cpu_seconds(m.pid)
                    results[(s, "cpfs warm safetensors")].seconds.append(
                        st_load(path, cold=False, touch=touch)["seconds"])
                    warm_cpu += cpu_seconds(m.pid) - c0
                    if warm_cpu > 0.5 * results[(s, "cpfs cold")].cpu[-1]:
                        # Warm loads never reach the daemon unless the page cache lost the file.
                        notes.append(f"round {rnd + 1} {s}: the daemon spent {warm_cpu:.2f} CPU-s during the "
                                     f"warm loads: the kernel page cache was dropped meanwhile (another "
                                     f"process's drop_caches?), so those warm rows include fetches")
                # mmap=True cold: the direct file, then a fresh mount (torch's zip-header open, then the mapping)
                r = timed_load(pt, cold=True, mmap=True, touch=touch, fingerprint=False)
                results[(s, "direct cold mmap")].seconds.append(r.total_seconds)
                with mounted(cfg, mp, work / f"{s}-{rnd}-mmap.log") as m:
                    mounts.append((f"{s}, round {rnd + 1}, cold mmap", m))
                    c0 = cpu_seconds(m.pid)
                    r = timed_load(mp / mine, cold=True, mmap=True, touch=touch, fingerprint=False)
                    results[(s, "cpfs cold mmap")].seconds.append(r.total_seconds)
                    results[(s, "cpfs cold mmap")].cpu.append(cpu_seconds(m.pid) - c0)
                # the naive pass-through peer
                p = Passthrough(pt.parent, work / "pt-mnt")
                try:
                    c0 = cpu_seconds(p.pid)
                    r = timed_load(work / "pt-mnt" / pt.name, cold=True, touch=touch)
                    c1 = cpu_seconds(p.pid)
                finally:
                    p.close()
                results[(s, "passthrough cold")].seconds.append(r.seconds)
                results[(s, "passthrough cold")].cpu.append(c1 - c0)
                mismatches += [f"{s} passthrough: {k}" for k in d.fingerprints
                               if d.fingerprints[k] != r.fingerprints.get(k)]
                print(f"  round {rnd + 1} {s}: " + ", ".join(
                    f"{k} {v.seconds[-1]:.2f} s" + (f" ({v.cpu[-1]:.2f} CPU-s)" if v.cpu else "")
                    for (sh, k), v in results.items() if sh == s), flush=True)
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            for s, (pt, _) in files.items():
                with mounted(cfg, mp, work / f"{s}-profile.log") as m:
                    prof = Profiler(m.pid, args.profile / f"{s}.txt")
                    try:
                        timed_load(mp / f"bench/{pt.name}", cold=True, touch=2 * sizes[s], fingerprint=False)
                    finally:
                        prof.stop()
                profiles[s] = args.profile / f"{s}.txt"
    except BenchError as e:
        print(f"\nbench_cpu: error: {e}", file=sys.stderr)
        for title, m in mounts:
            print_daemon_report(m, title, tail=20)
        return 1
    finally:
        leave_work(work, args.keep)

    report(results, sizes, args)
    for n in notes:
        print(f"NOTE: {n}")
    for s, path in profiles.items():
        print(f"\n== py-spy profile of the daemon, cold load of '{s}' ({path})")
        for line in summarize_profile(path):
            print(line)
    problems = [pr for _, m in mounts for pr in m.problems] + [w for _, m in mounts for w in m.warnings()]
    for pr in problems:
        print(f"PROBLEM: {pr}")
    if mismatches:
        print(f"\nFAILED: {len(mismatches)} value(s) differ from the direct load: {mismatches[:10]}")
        return 1
    print("\nevery value loaded through cpfs and through the pass-through equals the direct load")
    return 1 if problems else 0


def report(results: dict[tuple[str, str], Result], sizes: dict[str, int], args: argparse.Namespace) -> None:
    print(f"\n== results ({args.repeat} round(s), medians; 'vs direct' = direct time / this time, "
          f"higher is better; CPU-s/GiB = daemon utime+stime per GiB loaded)")
    for s, size in sizes.items():
        gib = size / GiB
        rows = []
        for kind, base in (("direct cold", "direct cold"), ("cpfs cold", "direct cold"),
                           ("passthrough cold", "direct cold"),
                           ("direct cold mmap", "direct cold mmap"), ("cpfs cold mmap", "direct cold mmap"),
                           ("direct warm", "direct warm"), ("cpfs warm", "direct warm"),
                           ("direct warm mmap", "direct warm mmap"), ("cpfs warm mmap", "direct warm mmap"),
                           ("direct warm safetensors", "direct warm safetensors"),
                           ("cpfs warm safetensors", "direct warm safetensors")):
            r = results.get((s, kind))
            if r is None or not r.seconds:
                continue
            cpu = r.med_cpu()
            rows.append([kind, f"{r.med():.2f}", f"{size / r.med() / MiB:.0f}",
                         f"{results[(s, base)].med() / r.med():.2f}",
                         "" if cpu is None else f"{cpu:.2f}", "" if cpu is None else f"{cpu / gib:.2f}"])
        print(f"\n'{s}': {human(size)}")
        print_table(["load", "seconds", "MiB/s", "vs direct", "daemon CPU-s", "CPU-s/GiB"], rows)
        c, p = results[(s, "cpfs cold")].med_cpu(), results[(s, "passthrough cold")].med_cpu()
        if c is not None and p:
            print(f"cpfs daemon CPU / pass-through daemon CPU: {c / p:.2f}x "
                  f"({c / gib:.2f} vs {p / gib:.2f} CPU-s/GiB; target <= 0.60)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child-st":
        p = argparse.ArgumentParser()
        p.add_argument("path")
        p.add_argument("--cold", action="store_true")
        p.add_argument("--touch", type=int, default=0)
        a = p.parse_args(argv[1:])
        _child_st(a.path, a.cold, a.touch)
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=512 * MiB, help="size of each checkpoint (default 512MiB)")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the table shows medians")
    p.add_argument("--shapes", default=",".join(SHAPES), help="large,many (default both)")
    p.add_argument("--cache", default="1GiB", help="[cache] memory of the mount (default 1GiB)")
    p.add_argument("--profile", type=Path, help="also profile one cold load per shape with py-spy into DIR")
    p.add_argument("--workdir", type=Path, help="where the temporary stores and mounts go (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary stores and logs")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    if bad := [s for s in args.shapes if s not in SHAPES]:
        p.error(f"unknown shape(s) {bad}: choose from {SHAPES}")
    args.repeat = max(1, args.repeat)
    if args.profile and py_spy() is None:       # found out before the rounds, not after them
        p.error("--profile needs py-spy: pip install py-spy")
    try:
        return run(args)
    except BenchError as e:
        print(f"\nbench_cpu: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
