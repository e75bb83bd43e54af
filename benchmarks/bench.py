"""`make bench`: every read- and write-path case of issue 10 side by side in one run (not a test: it prints
ratios against baselines measured in the same run, and draws them).

Cases (`--cases`, default all), each a function returning rows, run in this order:
- loads:   one checkpoint (~`--size`) from local disk and through cpfs over 3 fast folder stores:
           direct cold/warm, cpfs cold (fresh mount; daemon CPU-s per GiB, peak RSS), cpfs on a fresh mount over
           3 stores in memory (the remote case's, unthrottled; folder stores read with O_DIRECT, so stores
           on disk are never warm), cpfs warm torch.load / mmap=True / safetensors load_file (both + the
           first read of every tensor: they map the file, so the load alone reads nothing).
- peers:   the same cold load through benchmarks/passthrough.py (a naive pyfuse3 pass-through, from
           benchmarks/bench_cpu.py) and `rclone mount` of the local folder with `--vfs-cache-mode full`.
- remote:  3 folder stores throttled at 5 ms / 400 MiB/s: cold torch.load and 1 MiB sequential reads
           against the floor size / aggregate bandwidth (fetched/size from the mount's statistics).
- stores:  the 1-2-4-8 store series (replicas min(2, N)), cold sequential reads, speed vs 1 store.
           The stores of these two cases (and of the loads case's fresh mount) live in `--remote-dir`
           (default /dev/shm when memory allows; without it that row is left out):
           a remote store's bytes do not come from this machine's disk, so only the simulated latency
           and bandwidth limit them, not the local disk (which reads ~400-700 MiB/s cold here).
- saves:   torch.save through the mount (returns once committed) vs local disk + fsync
           (benchmarks/bench_save.py's timed child); the disk's floor: the 2 copies the stores hold,
           written from memory with O_DIRECT and fsynced on the same disk.
- partial: bytes fetched vs read for partial loads (benchmarks/bench_partial.py, its own checkpoint),
  declared and learned too.

Rules for every timed load (benchmarks/common.py): a fresh python per measurement; a cold one after
`sync; echo 3 > /proc/sys/vm/drop_caches` and through a fresh mount; before the timer, twice the file's
size of memory is written and freed (this VM returns freed memory to its host). Rounds interleave the
cases; the table shows medians of `--repeat` (default 3). `ratio` is always baseline time / this time
(higher is better; a save at 1.5x the local time shows 0.67) except for partial loads, where it is
fetched / read (lower is better). The chart (`--chart`, default bench.png) draws the same rows.

    python -m benchmarks.bench [--size 1GiB] [--repeat 3] [--cases loads,peers,remote,stores,saves,partial]
                               [--latency 5ms] [--bandwidth 400MiB/s] [--series 1,2,4,8] [--chart PATH]
                               [--json PATH] [--workdir DIR] [--remote-dir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .common import (GiB, MiB, ROOT, BenchError, Mount, RssSampler, ensure_imported, fetched_bytes, human, leaves, mount_stats,
                     mounted, parse_size, print_daemon_report, remove_tree, timed_load, timed_read,
                     timed_st_load, write_store_config)

CASES = ("loads", "peers", "remote", "stores", "saves", "partial")
DEST_PT = "bench/ckpt.pt"
DEST_ST = "bench/ckpt.safetensors"


@dataclass
class Row:
    """One line of the table and one bar of the chart."""
    case: str                     # the group: loads, peers, remote, stores, saves, partial
    name: str
    seconds: float | None         # median
    ratio: float | None           # baseline seconds / seconds (partial: fetched / read)
    baseline: str                 # what `ratio` compares with
    target: float | None = None   # the target for `ratio`
    lower_is_better: bool = False
    extra: dict[str, str] = field(default_factory=dict)    # MiB/s, CPU-s/GiB, fetched/size, ...
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None or self.ratio is None:
            return None
        return self.ratio <= self.target if self.lower_is_better else self.ratio >= self.target


@dataclass
class Ctx:
    """What every case gets: the arguments, the work folder, the checkpoint and its safetensors twin."""
    args: argparse.Namespace
    work: Path
    remote: Path            # where the remote-like stores live (see --remote-dir)
    pt: Path
    st: Path
    size: int
    mounts: list[tuple[str, Mount]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    reference: dict[str, str] = field(default_factory=dict)    # fingerprints of the direct load

    @property
    def touch(self) -> int:
        return 2 * self.size

    @property
    def repeat(self) -> int:
        return self.args.repeat

    def check(self, label: str, fingerprints: dict[str, str]) -> None:
        """Every value loaded through a mount equals the direct load's (dtype, shape, BLAKE3)."""
        if not self.reference:
            self.reference.update(fingerprints)
            return
        bad = sorted(k for k in set(self.reference) | set(fingerprints) if self.reference.get(k) != fingerprints.get(k))
        self.mismatches += [f"{label}: {k}" for k in bad]

    @contextmanager
    def mount(self, config: Path, title: str) -> Iterator[Mount]:
        """A fresh cpfs mount at work/mnt, remembered for the daemon report."""
        with mounted(config, self.work / "mnt", self.work / "logs" / f"{title.replace(' ', '-')}.log") as m:
            self.mounts.append((title, m))
            yield m


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


@functools.cache
def optional(module: str) -> Any | None:
    """A sibling benchmark module written by another helper, if it is there and imports (said once)."""
    try:
        return importlib.import_module(f"benchmarks.{module}")
    except ImportError as e:
        print(f"  (benchmarks/{module}.py not usable here: {e}; its rows are skipped)")
        return None


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` so far (bench_cpu's when present)."""
    cpu = optional("bench_cpu")
    if cpu is not None and hasattr(cpu, "cpu_seconds"):
        return cpu.cpu_seconds(pid)
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def safetensors_load(path: Path, *, cold: bool, touch: int) -> float:
    """safetensors.torch.load_file plus the first read of every tensor, in a fresh python (load_file maps
    the file: timing it alone measures almost nothing, as the mmap=True load alone does)."""
    return timed_st_load(path, cold=cold, touch=touch).total_seconds


# ---------------------------------------------------------------------------------------------------
# the checkpoint

def checkpoint(size: int) -> tuple[Path, Path]:
    """The demo's LLaMA-like training checkpoint of `size` (benchmarks/make_checkpoint.py) and a
    safetensors file of the same tensors beside it, each made once."""
    from .bench_load import checkpoint_for
    from .make_checkpoint import make_checkpoint

    pt = make_checkpoint(checkpoint_for(size), size)
    st = pt.with_suffix(".safetensors")
    if not st.exists():
        r = subprocess.run([sys.executable, "-m", "benchmarks.bench", "convert", str(pt), str(st)], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise BenchError(f"could not write {st}: {r.stderr.strip()[-500:]}")
    return pt, st


def _convert(pt: str, st: str) -> int:
    """The tensors of a .pt state dict into a .safetensors file (names: the leaves' paths, dot-joined)."""
    import torch
    from safetensors.torch import save_file

    sd = torch.load(pt, weights_only=True, mmap=True)
    tensors = {k.replace("/", "."): v.contiguous() for k, v in leaves(sd) if isinstance(v, torch.Tensor)}
    tmp = f"{st}.{os.getpid()}.tmp"
    save_file(tensors, tmp)
    os.replace(tmp, st)
    return 0


# ---------------------------------------------------------------------------------------------------
# cases

FRESH = "cpfs fresh mount, stores in memory"


def remote_stores(ctx: Ctx) -> Path:
    """The remote case's 3 stores (replicas 2) holding the checkpoint: their unthrottled config."""
    put = write_store_config(ctx.remote / "remote", stores=3, replicas=2, name="put.toml")
    ensure_imported(ctx.pt, DEST_PT, put, verbose=False)
    return put


def case_loads(ctx: Ctx) -> list[Row]:
    """Direct vs cpfs over 3 fast folder stores: cold, fresh mount over stores in memory, warm (3 ways)."""
    cfg = ctx.work / "fast" / "cpfs.toml"
    mem = remote_stores(ctx) if ctx.remote != ctx.work else None    # the remote-like stores live in memory
    t: dict[str, list[float]] = defaultdict(list)
    cpu: list[float] = []
    fetched: list[float] = []
    rss: list[float] = []
    fresh_cpu: list[float] = []
    for rnd in range(ctx.repeat):
        d = timed_load(ctx.pt, cold=True, touch=ctx.touch)
        ctx.check("direct cold", d.fingerprints)
        t["direct cold"].append(d.seconds)
        t["direct warm"].append(timed_load(ctx.pt, cold=False, touch=ctx.touch, fingerprint=False).seconds)
        t["direct warm mmap"].append(timed_load(ctx.pt, cold=False, mmap=True, touch=ctx.touch,
                                                fingerprint=False).total_seconds)
        safetensors_load(ctx.st, cold=False, touch=ctx.touch)            # into the page cache
        t["direct warm safetensors"].append(safetensors_load(ctx.st, cold=False, touch=ctx.touch))
        with ctx.mount(cfg, f"loads cold {rnd + 1}") as m:
            s0, c0 = mount_stats(m.path), cpu_seconds(m.pid)
            with RssSampler(m.pid) as sampler:
                r = timed_load(m.path / DEST_PT, cold=True, touch=ctx.touch)
            rss.append(sampler.peak)
            cpu.append(cpu_seconds(m.pid) - c0)
            fetched.append(fetched_bytes(mount_stats(m.path)) - fetched_bytes(s0))
            ctx.check("cpfs cold", r.fingerprints)
            t["cpfs cold"].append(r.seconds)
            t["cpfs warm"].append(timed_load(m.path / DEST_PT, cold=False, touch=ctx.touch, fingerprint=False).seconds)
            t["cpfs warm mmap"].append(timed_load(m.path / DEST_PT, cold=False, mmap=True, touch=ctx.touch,
                                                  fingerprint=False).total_seconds)
            safetensors_load(m.path / DEST_ST, cold=False, touch=ctx.touch)
            t["cpfs warm safetensors"].append(safetensors_load(m.path / DEST_ST, cold=False, touch=ctx.touch))
        # A fresh mount over fast stores, its own caches empty, against the direct warm load. Folder
        # stores read with O_DIRECT, so "fast" cannot mean stores whose files are in the page cache:
        # it means the remote case's stores (in memory, tmpfs) without their throttle.
        if mem is not None:
            with ctx.mount(mem, f"loads fresh {rnd + 1}") as m:
                c0 = cpu_seconds(m.pid)
                t[FRESH].append(timed_load(m.path / DEST_PT, cold=False, touch=ctx.touch, fingerprint=False).seconds)
                fresh_cpu.append(cpu_seconds(m.pid) - c0)
        progress("loads", rnd, t)
    gib = ctx.size / GiB

    def row(name: str, base: str, target: float | None, **extra: str) -> Row:
        s, b = med(t[name]), med(t[base])
        return Row("loads", name, s, b / s if s and b else None, base, target,
                   extra={"MiB/s": f"{ctx.size / s / MiB:.0f}" if s else "", **extra})

    c = med(cpu)
    return [row("direct cold", "direct cold", None), row("direct warm", "direct warm", None),
            row("cpfs cold", "direct cold", 0.9, **{"CPU-s/GiB": f"{c / gib:.2f}" if c is not None else "",
                                                    "fetched/size": f"{med(fetched) / ctx.size:.2f}",
                                                    "daemon RSS peak": human(med(rss))}),
            *([row(FRESH, "direct warm", 0.8, **{"CPU-s/GiB": f"{med(fresh_cpu) / gib:.2f}"})]
              if mem is not None else []),
            row("cpfs warm", "direct warm", 0.95),
            row("direct warm mmap", "direct warm mmap", None), row("cpfs warm mmap", "direct warm mmap", 0.95),
            row("direct warm safetensors", "direct warm safetensors", None),
            row("cpfs warm safetensors", "direct warm safetensors", 0.95)]


def case_peers(ctx: Ctx) -> list[Row]:
    """The same cold load through other FUSE daemons: the naive pass-through and rclone (full cache)."""
    t: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    cpu_mod = optional("bench_cpu")
    rclone = shutil.which("rclone")
    for rnd in range(ctx.repeat):
        t["direct cold"].append(timed_load(ctx.pt, cold=True, touch=ctx.touch, fingerprint=False).seconds)
        with ctx.mount(ctx.work / "fast" / "cpfs.toml", f"peers cpfs {rnd + 1}") as m:
            c0 = cpu_seconds(m.pid)
            t["cpfs cold"].append(timed_load(m.path / DEST_PT, cold=True, touch=ctx.touch, fingerprint=False).seconds)
            cpu["cpfs cold"].append(cpu_seconds(m.pid) - c0)
        if cpu_mod is not None and hasattr(cpu_mod, "Passthrough"):
            mp = ctx.work / "peer-mnt"
            p = cpu_mod.Passthrough(ctx.pt.parent, mp)
            try:
                c0 = cpu_seconds(p.pid)
                r = timed_load(mp / ctx.pt.name, cold=True, touch=ctx.touch)
                cpu["naive pyfuse3 pass-through cold"].append(cpu_seconds(p.pid) - c0)
            finally:
                p.close()
            ctx.check("pass-through", r.fingerprints)
            t["naive pyfuse3 pass-through cold"].append(r.seconds)
        if rclone:
            from .bench_s3 import fuse_daemon

            mp, cache = ctx.work / "peer-mnt", ctx.work / f"rclone-cache-{rnd}"
            cmd = [rclone, "mount", str(ctx.pt.parent), str(mp), "--vfs-cache-mode", "full", "--cache-dir", str(cache),
                   "--read-only", "--log-level", "NOTICE"]
            try:
                with fuse_daemon(cmd, mp, ctx.work / "logs" / f"rclone-{rnd}.log", "rclone mount") as pid:
                    c0 = cpu_seconds(pid)
                    r = timed_load(mp / ctx.pt.name, cold=True, touch=ctx.touch)
                    cpu["rclone mount (local, vfs cache full) cold"].append(cpu_seconds(pid) - c0)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            ctx.check("rclone", r.fingerprints)
            t["rclone mount (local, vfs cache full) cold"].append(r.seconds)
        progress("peers", rnd, t)
    base = med(t["direct cold"])
    rows = []
    for name in t:
        s, c = med(t[name]), med(cpu.get(name, []))
        rows.append(Row("peers", name, s, base / s if s and base else None, "direct cold",
                        extra={"MiB/s": f"{ctx.size / s / MiB:.0f}",
                               "CPU-s/GiB": "" if c is None else f"{c / (ctx.size / GiB):.2f}"}))
    if not (cpu_mod and hasattr(cpu_mod, "Passthrough")):
        rows.append(Row("peers", "naive pyfuse3 pass-through", None, None, "", note="benchmarks/bench_cpu.py missing"))
    if not rclone:
        rows.append(Row("peers", "rclone mount", None, None, "", note="not installed: apt-get install rclone"))
    return rows


def case_remote(ctx: Ctx) -> list[Row]:
    """3 throttled stores: cold torch.load and sequential reads against size / aggregate bandwidth."""
    from cpfs.config import parse_rate

    remote_stores(ctx)
    cfg = write_store_config(ctx.remote / "remote", stores=3, replicas=2, name="remote.toml",
                             latency=ctx.args.latency, bandwidth=ctx.args.bandwidth)
    floor = ctx.size / (3 * parse_rate(ctx.args.bandwidth))
    t: dict[str, list[float]] = defaultdict(list)
    fetched: dict[str, list[float]] = defaultdict(list)
    hedges: dict[str, list[float]] = defaultdict(list)
    for rnd in range(ctx.repeat):
        for name, measure in (("3 remote stores, torch.load cold",
                               lambda p: timed_load(p, cold=True, touch=ctx.touch, fingerprint=False).seconds),
                              ("3 remote stores, 1 MiB reads cold",
                               lambda p: timed_read(p, cold=True, touch=ctx.touch).seconds)):
            with ctx.mount(cfg, f"remote {rnd + 1}") as m:
                s0 = mount_stats(m.path)
                t[name].append(measure(m.path / DEST_PT))
                s1 = mount_stats(m.path)
                fetched[name].append((fetched_bytes(s1) - fetched_bytes(s0)) / ctx.size)
                hedges[name].append(s1["replicas"]["hedges"] - s0["replicas"]["hedges"])
        progress("remote", rnd, t)
    return [Row("remote", name, med(xs), floor / med(xs), f"floor {floor:.2f} s (size / 3 x {ctx.args.bandwidth})",
                0.8, extra={"MiB/s": f"{ctx.size / med(xs) / MiB:.0f}", "fetched/size": f"{med(fetched[name]):.2f}",
                            "hedges": f"{med(hedges[name]):.0f}"})
            for name, xs in t.items()]


def case_stores(ctx: Ctx) -> list[Row]:
    """The 1-2-4-8 store series: cold sequential reads through N throttled stores."""
    from cpfs.config import parse_rate

    bw = parse_rate(ctx.args.bandwidth)
    configs = {}
    for n in ctx.args.series:
        folder = ctx.remote / f"series-{n}"
        put = write_store_config(folder, stores=n, replicas=min(2, n), name="put.toml")
        configs[n] = write_store_config(folder, stores=n, replicas=min(2, n), name="read.toml",
                                        latency=ctx.args.latency, bandwidth=ctx.args.bandwidth)
        ensure_imported(ctx.pt, DEST_PT, put, verbose=False)
    t: dict[int, list[float]] = defaultdict(list)
    for rnd in range(ctx.repeat):
        for n, cfg in configs.items():
            with ctx.mount(cfg, f"stores {n} {rnd + 1}") as m:
                r = timed_read(m.path / DEST_PT, cold=True, touch=ctx.touch)
            if r.size != ctx.size:
                ctx.mismatches.append(f"{n} stores: read {r.size} bytes of {ctx.size}")
            t[n].append(r.seconds)
        progress("stores", rnd, {f"{n} stores": xs for n, xs in t.items()})
    one = med(t[min(t)])
    return [Row("stores", f"{n} store{'s' if n > 1 else ''}, 1 MiB reads cold", med(xs), one / med(xs),
                f"{min(t)} store", 0.75 * n if n > 1 else None,
                extra={"MiB/s": f"{ctx.size / med(xs) / MiB:.0f}",
                       "of aggregate": f"{ctx.size / (n * bw) / med(xs):.0%}"})
            for n, xs in t.items()]


FLOOR = "2 copies, O_DIRECT + fsync, local disk (the disk's floor)"


def case_saves(ctx: Ctx) -> list[Row]:
    """torch.save through the mount (committed at close) vs the same save to local disk + fsync, and
    the disk's floor: the 2 copies the stores hold, written from memory with O_DIRECT and fsynced."""
    from .bench_save import timed_copies, timed_save

    folder = ctx.work / "saves"
    cfg = write_store_config(folder, stores=3, replicas=2,
                             extra=f'[mount]\nstaging = "{folder / "staging"}"')
    (folder / "local").mkdir(parents=True, exist_ok=True)
    local = folder / "local" / "ckpt.pt"
    t: dict[str, list[float]] = defaultdict(list)
    cpu: list[float] = []
    for rnd in range(ctx.repeat):
        d = timed_save(local, ctx.size, seed=rnd, fsync=True)
        t["torch.save, local disk + fsync"].append(d.seconds + (d.fsync or 0.0))
        t[FLOOR].append(timed_copies(local, folder / "copies", 2))
        local.unlink()
        with ctx.mount(cfg, f"saves {rnd + 1}") as m:
            v = timed_save(m.path / "ckpt.pt", ctx.size, seed=rnd, daemon_pid=m.pid)
            t["torch.save through cpfs (committed)"].append(v.seconds)
            if v.rss is not None:
                cpu.append(v.rss.cpu_seconds)
        progress("saves", rnd, t)
    base = med(t["torch.save, local disk + fsync"])
    rows = []
    for name, xs in t.items():
        s = med(xs)
        extra = {"MiB/s": f"{ctx.size / s / MiB:.0f}"}
        if "cpfs" in name:
            extra["vs floor"] = f"{med(t[FLOOR]) / s:.2f}"
            if cpu:
                extra["CPU-s/GiB"] = f"{med(cpu) / (ctx.size / GiB):.2f}"
        rows.append(Row("saves", name, s, base / s, "local disk + fsync", 1 / 1.5 if "cpfs" in name else None,
                        extra=extra))
    return rows


def case_partial(ctx: Ctx) -> list[Row]:
    """Partial loads: benchmarks/bench_partial.py (its own checkpoint and mounts), fetched vs read.
    Hook: a `bench_rows(size, repeat, workdir) -> list[dict]` there (dicts as its --json writes) is used
    when present; else its main() with --json."""
    mod = optional("bench_partial")
    if mod is None:
        return [Row("partial", "partial loads", None, None, "", note="benchmarks/bench_partial.py missing")]
    out = ctx.work / "partial.json"
    size = ctx.args.partial_size or ctx.args.size          # the size asked for: its files are named after it
    if hasattr(mod, "bench_rows"):
        results = mod.bench_rows(size=size, repeat=ctx.repeat, workdir=ctx.work)
    else:
        code = mod.main(["--size", str(size), "--workdir", str(ctx.work), "--json", str(out), "--declare", "--learn"])
        if code != 0 or not out.exists():
            return [Row("partial", "partial loads", None, None, "", note=f"bench_partial exited {code}")]
        results = json.loads(out.read_text())
    plain = {(r["fmt"], r["case"]): r["seconds"] for r in results if not r.get("declared") and not r.get("learned")}

    def speedup(r: dict) -> dict[str, str]:
        """A declared or learned load's time against the same load without either (same run)."""
        base = plain.get((r["fmt"], r["case"])) if r.get("declared") or r.get("learned") else None
        return {"speed vs plain": f"{base / r['seconds']:.2f}x"} if base and r["seconds"] else {}

    return [Row("partial", f"{r['fmt']} {r.get('name', r['case'])}", r["seconds"],
                r["fetched"] / r["read"] if r["read"] else None,
                "bytes read", r["bound"] / r["read"] if r["read"] else None, lower_is_better=True,
                extra={"read": human(r["read"]), "fetched": human(r["fetched"]),
                       "fetched/touched": f"{r['fetched'] / r['touched']:.2f}" if r.get("touched") else "",
                       **speedup(r)})
            for r in results]


CASE_FUNCTIONS: dict[str, Callable[[Ctx], list[Row]]] = {
    "loads": case_loads, "peers": case_peers, "remote": case_remote, "stores": case_stores,
    "saves": case_saves, "partial": case_partial,
}


def progress(case: str, rnd: int, t: dict[str, list[float]]) -> None:
    print(f"  {case} round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in t.items() if v), flush=True)


# ---------------------------------------------------------------------------------------------------
# output

def report(rows: list[Row], ctx: Ctx) -> None:
    print(f"\n== results: {human(ctx.size)} checkpoint, medians of {ctx.repeat}; ratio = baseline s / s (higher is "
          f"better), partial: fetched / read (lower is better); target from issue 10")
    table = []
    for r in rows:
        met = {None: "", True: "met", False: "MISSED"}[r.met]
        target = "" if r.target is None else f"{'<=' if r.lower_is_better else '>='} {r.target:.2f}"
        figures = "; ".join(f"{k} {v}" for k, v in r.extra.items() if v)
        table.append([f"{r.case}: {r.name}", "-" if r.seconds is None else f"{r.seconds:.2f}",
                      "-" if r.ratio is None else f"{r.ratio:.2f}", target, met, r.baseline,
                      "; ".join(x for x in (figures, r.note) if x)])
    cells = [["case", "seconds", "ratio", "target", "", "baseline", "figures"]] + table
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    for i, c in enumerate(cells):
        print("  ".join(x.rjust(w) if j in (1, 2, 3) else x.ljust(w) for j, (x, w) in enumerate(zip(c, widths))).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def _bars(ax: Any, rows: list[Row], xlabel: str, log: bool = False) -> None:
    """Horizontal bars of `ratio`, coloured by met/missed, the target as a black tick."""
    rows = rows[::-1]
    y = list(range(len(rows)))
    top = max([1.0] + [r.ratio for r in rows] + [r.target for r in rows if r.target is not None]) * 1.2
    colors = ["#999999" if r.met is None else "#2a9d8f" if r.met else "#e76f51" for r in rows]
    ax.barh(y, [r.ratio for r in rows], color=colors)
    for i, r in enumerate(rows):
        ax.text(r.ratio, i, f" {r.ratio:.2f}", va="center", fontsize=8)
        if r.target is not None:
            ax.plot([r.target, r.target], [i - 0.4, i + 0.4], color="black", linewidth=2)
    ax.set_yticks(y, [f"{r.case}: {r.name}" for r in rows], fontsize=8)
    ax.axvline(1.0, color="#555555", linestyle=":", linewidth=1)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(0.5, top)
    else:
        ax.set_xlim(0, top)
    ax.set_xlabel(xlabel, fontsize=9)


def chart(rows: list[Row], path: Path, ctx: Ctx) -> None:
    """Left: every speed ratio against its target. Right: the store series against linear scaling and
    the aggregate bandwidth (top), partial loads' fetched / read (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cpfs.config import parse_rate

    speed = [r for r in rows if r.ratio is not None and not r.lower_is_better]
    partial = [r for r in rows if r.ratio is not None and r.lower_is_better]
    series = [r for r in rows if r.case == "stores" and r.seconds]
    fig = plt.figure(figsize=(16, max(6.0, 0.32 * len(speed) + 2.0)))
    grid = fig.add_gridspec(2, 2, width_ratios=[1.6, 1], hspace=0.35, wspace=0.45)
    fig.suptitle(f"cpfs bench: {human(ctx.size)} checkpoint, medians of {ctx.repeat}; green met, red missed, "
                 f"grey baseline; black tick = target (issue 10)", fontsize=11)
    if speed:
        _bars(fig.add_subplot(grid[:, 0]), speed, "baseline time / time (higher is better)")
    if series:
        ax = fig.add_subplot(grid[0, 1])
        ns = [int(r.name.split()[0]) for r in series]
        mibs = [ctx.size / r.seconds / MiB for r in series]
        bw = parse_rate(ctx.args.bandwidth) / MiB
        ax.plot(ns, mibs, "o-", label="cpfs, cold 1 MiB reads")
        ax.plot(ns, [mibs[0] * n / ns[0] for n in ns], "--", color="#999999", label="linear from 1 store")
        ax.plot(ns, [bw * n for n in ns], ":", color="#555555", label="aggregate bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("stores", fontsize=9)
        ax.set_ylabel("MiB/s", fontsize=9)
        ax.set_title(f"store series, each {ctx.args.latency} / {ctx.args.bandwidth}", fontsize=10)
        ax.legend(fontsize=8)
    if partial:
        _bars(fig.add_subplot(grid[1, 1]), partial, "bytes fetched / bytes read (lower is better)", log=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        return _convert(argv[1], argv[2])
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=GiB, help="checkpoint size (default 1GiB)")
    p.add_argument("--repeat", type=int, default=3, help="rounds per case; medians shown (default 3)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)} (default all)")
    p.add_argument("--latency", default="5ms", help="latency of the remote-like stores (default 5ms)")
    p.add_argument("--bandwidth", default="400MiB/s", help="bandwidth of each remote-like store (default 400MiB/s)")
    p.add_argument("--series", default="1,2,4,8", help="store counts of the series (default 1,2,4,8)")
    p.add_argument("--partial-size", type=parse_size, default=None,
                   help="checkpoint size of the partial-load case (default: --size)")
    p.add_argument("--chart", type=Path, default=ROOT / "bench.png", help="the PNG chart (default bench.png)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--remote-dir", type=Path, help="where the stores of the remote and stores cases go "
                   "(default /dev/shm if it and the memory have room, else the work folder)")
    p.add_argument("--workdir", type=Path, help="where the temporary stores and mounts go (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (stores, configs, daemon logs)")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    if bad := [c for c in args.cases if c not in CASES]:
        p.error(f"unknown case(s) {bad}: choose from {', '.join(CASES)}")
    args.series = sorted({int(n) for n in args.series.split(",") if n})
    args.repeat = max(1, args.repeat)
    t0 = time.monotonic()
    try:
        return run(args)
    except BenchError as e:
        print(f"\nbench: error: {e}", file=sys.stderr)
        return 1
    finally:
        print(f"\nbench: {time.monotonic() - t0:.0f} s in all")


def _memory_allows(folder: Path, nbytes: int) -> bool:
    """`folder` is a tmpfs with `nbytes` free, and the machine has that much memory available."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return folder.is_dir() and shutil.disk_usage(folder).free >= nbytes and available >= nbytes
    except (OSError, StopIteration, ValueError):
        return False


def run(args: argparse.Namespace) -> int:
    pt, st = checkpoint(args.size)
    size = pt.stat().st_size
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cpfs-bench-", dir=args.workdir or "/tmp"))
    # fast/: 3 stores, replicas 2, each chunk twice (.pt and .safetensors); the series: 1 + 3 x 2 copies;
    # saves: the local file, its staging copy and 2 replicas.
    need = size * (4 * ("loads" in args.cases or "peers" in args.cases or "remote" in args.cases)
                   + (1 + 2 * (len(args.series) - 1)) * ("stores" in args.cases) + 4 * ("saves" in args.cases)) + GiB
    free = shutil.disk_usage(work).free
    if free < need:
        remove_tree(work)
        raise BenchError(f"{work}: {human(free)} free, this run needs about {human(need)}; use --workdir or --size")
    (work / "logs").mkdir()
    remote = work
    need_remote = size * (2 * bool({"remote", "loads"} & set(args.cases))
                          + (1 + 2 * (len(args.series) - 1)) * ("stores" in args.cases))
    where = args.remote_dir or (Path("/dev/shm") if _memory_allows(Path("/dev/shm"), need_remote + 4 * size) else None)
    if need_remote and where is not None:
        where.mkdir(parents=True, exist_ok=True)
        remote = Path(tempfile.mkdtemp(prefix="cpfs-bench-remote-", dir=where))
    ctx = Ctx(args, work, remote, pt, st, size)
    print(f"remote-like stores in {remote}")
    print(f"work folder {work}; checkpoint {pt} ({human(size)}) and {st.name}; cases {', '.join(args.cases)}; "
          f"{args.repeat} round(s)")
    rows: list[Row] = []
    failed: list[str] = []
    try:
        if {"loads", "peers"} & set(args.cases):
            fast = write_store_config(work / "fast", stores=3, replicas=2)
            ensure_imported(pt, DEST_PT, fast)
            ensure_imported(st, DEST_ST, fast)
        for case in args.cases:
            print(f"\n== {case}: {CASE_FUNCTIONS[case].__doc__.splitlines()[0]}", flush=True)
            try:
                rows += CASE_FUNCTIONS[case](ctx)
            except Exception as e:          # one broken case (or a sibling module's) leaves the others' rows
                if not isinstance(e, BenchError):
                    traceback.print_exc()
                failed.append(f"{case}: {e}")
                print(f"  {case}: FAILED: {e}", file=sys.stderr)
                rows.append(Row(case, "(failed)", None, None, "", note=str(e).splitlines()[0][:80]))
    finally:
        if args.keep:
            print(f"kept {work}" + (f" and {remote}" if remote != work else ""))
        else:
            remove_tree(work)
            if remote != work:
                remove_tree(remote)
    report(rows, ctx)
    chart(rows, args.chart, ctx)
    print(f"\nchart: {args.chart}")
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "met": r.met} for r in rows], indent=1))
    problems = [f"{title}: {pr}" for title, m in ctx.mounts for pr in m.problems]
    warnings = [f"{title}: {w}" for title, m in ctx.mounts for w in m.warnings()]
    for title, m in ctx.mounts:
        if m.problems:
            print_daemon_report(m, title, tail=20)
    for w in warnings[:20]:
        print(f"daemon warning: {w}")
    if ctx.mismatches:
        print(f"\nFAILED: {len(ctx.mismatches)} value(s) differ from the direct load: {ctx.mismatches[:10]}")
    elif ctx.reference:
        print(f"\nevery torch.load through a mount equals the direct load ({len(ctx.reference)} values: dtype, "
              f"shape, BLAKE3 of the bytes)")
    return 1 if ctx.mismatches or problems or failed else 0


if __name__ == "__main__":
    sys.exit(main())
