"""Partial loads: bytes fetched from the stores against the bytes a process read (not a test: it prints).

A training checkpoint (bf16 model weights and fp32 Adam moments for every parameter, so the weights are
~20% of the bytes; 16 layers) is written locally as `.pt` (torch.save), `.safetensors` and a
torch.distributed.checkpoint folder (`dcp`: dcp.save of one process, a `.distcp` data file and its
`.metadata`), imported into three folder stores, and read by a fresh python through a fresh mount
(kernel caches dropped) in these ways:

- weights:  only the model weights (`sd["model"]`; safetensors: the `model.*` keys);
- stage:    one pipeline stage, 1/8 of the layers (weights and optimizer state of layers 6 and 7);
- slice:    rank 3 of 8 (`--rank`): its 1/8 row slice of every 2-D tensor (safetensors `get_slice`),
            the 1-D tensors whole (tensor-parallel resume);
- full:     everything (`.pt`: a plain torch.load; safetensors: every `get_tensor`).

`dcp` runs the weights, stage and full cases only (dcp.load of those keys), never declared: its data
file's tensor index names each item by its number in the file (the state dict's names live in
`.metadata`). What it read is `.metadata` and the items of those keys, from DCP's own metadata.

With --declare, the weights, stage and full cases run a second time with the reader declaring its
tensors first (`user.cpfs.prefetch`, cpfs/plan.py: globs such as `model.*`, set inside the timing, then
the same load): the mount fetches them all at once instead of as the reads arrive. (Not the slice case:
a declaration names whole tensors.)

With --learn, the weights, stage and slice cases run twice more, on a mount that learns prefetch plans
(cpfs/learned.py): once to learn (a fresh mount, untimed), then again through another fresh mount with
the kernel's caches dropped, as a rank restarted on the same host: the row shows that second load (the
mount fetches what the first one read at once, from the reader's first landing). The plain and declared
rows run with learning off, so each is a first load. With --another-host as well, the second load's
mount has none of the first one's local recordings (its staging folder's `learned/` is removed, as on
a replacement node): its plan comes from the recordings shared through the stores.

`.pt` partial cases use `torch.load(mmap=True)` and read only their part. What the process read is
computed from the file's tensor index (the loader's metadata: zip directory, data.pkl, safetensors
header, plus the tensor bytes it asked for); what was fetched is the stores' `bytes_read` from the
mount's statistics (`.cpfs-stats`), before and after the child. The target: fetched <= 1.3 x read + one
chunk per range boundary (a run of adjacent read bytes has two boundaries).

    python -m benchmarks.bench_partial [--size 512MiB] [--latency 5ms --bandwidth 400MiB/s] [--cases ...]
                                       [--layers 16] [--read-ahead-kb N] [--slice-parts] [--rank N] [--declare] [--learn [--another-host]]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import (MiB, ROOT, BenchError, drop_caches, ensure_imported, human, mounted, parse_size,
                     print_daemon_report, print_table, remove_tree, run_child)

LAYERS = 16
VOCAB = 16000
STAGES = 8
STAGE = 3                    # layers 6 and 7 of 16
RANKS = 8
RANK = 3                     # a middle rank: its slices start inside tensors, not on chunk cuts (--rank)
CASES = ("weights", "stage", "slice", "full")
FORMATS = ("safetensors", "pt", "dcp")
DCP_DATA = "__0_0.distcp"    # the data file of a one-process dcp.save
CHUNK = 4 * MiB              # the default chunk size (the configs here keep it)
DATA = ROOT / "demo-data" / "partial"
LOCAL_HEADER = 64            # a torch zip record's local header ends where its data starts (64-aligned)
PAGE = 4096


# ---------------------------------------------------------------------------------------------------
# the checkpoint

def shapes(dim: int, layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    ffn = 64 * max(1, round(dim * 8 / 3 / 64))
    out = [("tok_embeddings.weight", (VOCAB, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        out.append((p + "attention_norm.weight", (dim,)))
        out += [(p + f"attention.{w}.weight", (dim, dim)) for w in ("wq", "wk", "wv", "wo")]
        out.append((p + "ffn_norm.weight", (dim,)))
        out += [(p + "feed_forward.w1.weight", (ffn, dim)), (p + "feed_forward.w3.weight", (ffn, dim)),
                (p + "feed_forward.w2.weight", (dim, ffn))]
    out += [("norm.weight", (dim,)), ("output.weight", (VOCAB, dim))]
    return out


def nbytes_for(dim: int, layers: int = LAYERS) -> int:
    total = 0
    for _, shape in shapes(dim, layers):
        n = 1
        for d in shape:
            n *= d
        total += n * (2 if len(shape) == 2 else 4) + 8 * n       # bf16 matrices / fp32 norms, two fp32 moments
    return total


def build(size: int, layers: int = LAYERS) -> dict[str, Any]:
    import torch

    dim = min(range(64, 8193, 64), key=lambda d: abs(nbytes_for(d, layers) - size))
    g = torch.Generator().manual_seed(0)
    model, state = {}, {}
    for i, (name, shape) in enumerate(shapes(dim, layers)):
        dtype = torch.bfloat16 if len(shape) == 2 else torch.float32
        model[name] = torch.randn(shape, generator=g).to(dtype)
        state[i] = {"step": torch.tensor(100.0), "exp_avg": torch.randn(shape, generator=g) * 1e-3,
                    "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6}
    return {"model": model, "optimizer": {"state": state, "param_groups": [
        {"lr": 3e-4, "betas": (0.9, 0.95), "params": list(range(len(model)))}]}, "step": 100}


def flatten(sd: dict[str, Any]) -> dict[str, Any]:
    """The state dict's tensors under the names the tensor index gives them (dot-joined paths)."""
    out = {f"model.{k}": v for k, v in sd["model"].items()}
    for i, s in sd["optimizer"]["state"].items():
        out.update({f"optimizer.state.{i}.{k}": v for k, v in s.items()})
    return out


def make_files(size: int, layers: int = LAYERS) -> dict[str, Path]:
    """`.pt` and `.safetensors` of the same training checkpoint, generated once per size and layer count."""
    import torch
    from safetensors.torch import save_file

    tag = human(size).replace(" ", "").replace(".00", "") + (f"_{layers}L" if layers != LAYERS else "")
    paths = {"pt": DATA / f"train_{tag}.pt", "safetensors": DATA / f"train_{tag}.safetensors",
             "dcp": DATA / f"train_{tag}.dcp"}
    if all(p.exists() for p in paths.values()) and (paths["dcp"] / ".metadata").exists():
        return paths
    DATA.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sd = build(size, layers)
    torch.save(sd, paths["pt"])
    save_file({k: v.contiguous() for k, v in flatten(sd).items()}, str(paths["safetensors"]))
    remove_tree(paths["dcp"])
    dcp_save(flatten(sd), paths["dcp"])
    print(f"generated {paths['pt'].name} ({human(paths['pt'].stat().st_size)}), {paths['safetensors'].name} "
          f"({human(paths['safetensors'].stat().st_size)}) and {paths['dcp'].name}/ in {time.perf_counter() - t0:.1f} s")
    return paths


def dcp_save(flat: dict[str, Any], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "torch.distributed is ... uninitialized": one process
        dcp.save(flat, checkpoint_id=str(folder))


def dcp_items(folder: Path) -> dict[str, tuple[int, int]]:
    """Every key's (offset, length) in the data file, from DCP's `.metadata`."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = dcp.FileSystemReader(str(folder)).read_metadata()
    return {k.fqn: (v.offset, v.length) for k, v in md.storage_data.items() if v.relative_path == DCP_DATA}


# ---------------------------------------------------------------------------------------------------
# the reader (a fresh python per case)

def wanted(case: str, names: list[str]) -> list[str]:
    """Which tensors a case reads, by index name (model.X, optimizer.state.N.K)."""
    if case == "weights":
        return [n for n in names if n.startswith("model.")]
    if case == "stage":
        count = len({n.split(".")[2] for n in names if n.startswith("model.layers.")})   # --layers
        per = max(1, count // STAGES)
        first = min(STAGE * per, count - per)
        layers = {f"layers.{i}." for i in range(first, first + per)}
        model = [n for n in names if n.startswith("model.") and any(n[6:].startswith(x) for x in layers)]
        # Optimizer state i belongs to the model's parameter i (build()), whatever order `names` lists
        # them in: a safetensors file lists its keys by name, its index by offset, neither in model order.
        order = [n for n, _ in shapes(64, count)]
        ids = {str(order.index(n[6:])) for n in model}
        return model + [n for n in names if n.startswith("optimizer.state.") and n.split(".")[2] in ids]
    return list(names)


def declared(case: str, names: list[str]) -> list[str]:
    """What a loader of the case declares before it reads (cpfs/plan.py): globs, as a loader that knows
    its model would write them."""
    if case == "weights":
        return ["model.*"]
    if case == "stage":
        return sorted({".".join(n.split(".")[:3]) + ".*" for n in wanted(case, names)})   # model.layers.6.*
    return ["*"]


def rows(shape: list[int], rank: int) -> tuple[int, int]:
    per = shape[0] // RANKS
    return rank * per, (rank + 1) * per


def _child(fmt: str, case: str, path: str, rank: int = RANK, declare: str = "") -> dict[str, Any]:
    """Read the case's part; report what was asked: [name, first row, end row] (rows None = whole).
    `rank`: the slice case's rank; `declare`: tensor-name globs (lines) declared to the mount first,
    inside the timing."""
    import torch
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp     # ~2 s of imports, outside the timing as torch's are

    note = drop_caches()
    got: list[list[Any]] = []
    checksum = 0.0
    t0 = time.perf_counter()
    if declare:
        os.setxattr(path, "user.cpfs.prefetch", declare.encode())
    if fmt == "dcp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            md = dcp.FileSystemReader(path).read_metadata()
            names = list(md.state_dict_metadata)
            sd = {n: torch.empty(md.state_dict_metadata[n].size, dtype=md.state_dict_metadata[n].properties.dtype)
                  for n in (wanted(case, names) if case != "full" else names)}
            dcp.load(sd, checkpoint_id=path)
        for name, t in sd.items():
            got.append([name, None, None])
            checksum += float(t.float().sum())
    elif fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            names = list(f.keys())
            for name in wanted(case, names) if case != "full" else names:
                if case == "slice":
                    sl = f.get_slice(name)
                    shape = sl.get_shape()
                    if len(shape) == 2:
                        r0, r1 = rows(shape, rank)
                        t = sl[r0:r1]
                        got.append([name, r0, r1])
                    else:
                        t = f.get_tensor(name)
                        got.append([name, None, None])
                else:
                    t = f.get_tensor(name)
                    got.append([name, None, None])
                checksum += float(t.float().sum())
    else:
        sd = torch.load(path, weights_only=True, mmap=case != "full")
        flat = flatten(sd)
        for name in wanted(case, list(flat)):
            t = flat[name]
            if case == "slice" and t.dim() == 2:
                r0, r1 = rows(list(t.shape), rank)
                t = t[r0:r1]
                got.append([name, r0, r1])
            else:
                got.append([name, None, None])
            checksum += float(t.clone().float().sum())
    return {"seconds": time.perf_counter() - t0, "read": got, "note": note, "checksum": checksum}


# ---------------------------------------------------------------------------------------------------
# accounting

def read_ranges(index: Any, got: list[list[Any]]) -> list[tuple[int, int]]:
    """File ranges (start, end) the process read: the loader's metadata plus the asked tensor bytes."""
    by_name = {t.name: t for t in index.tensors}
    ranges: list[tuple[int, int]] = []
    if index.format == "safetensors":
        ranges += [(r.offset, r.offset + r.length) for r in index.records]
    else:
        data = {r.offset for r in index.records if "/data/" in r.name}
        ranges += [(r.offset, r.offset + r.length) for r in index.records if r.offset not in data]
        ranges.append((index.directory_offset, index.file_size))
        # torch.load reads the zip local header (30 bytes + name + padding) of every storage record it
        # meets in data.pkl, even with mmap=True and even for tensors the caller never touches.
        ranges += [(max(0, o - LOCAL_HEADER), o) for o in data]
    for name, r0, r1 in got:
        t = by_name[name]
        if r0 is None:
            ranges.append((t.offset, t.offset + t.length))
        else:
            row = t.length // t.shape[0]
            ranges.append((t.offset + r0 * row, t.offset + r1 * row))
    return merge(ranges, gap=4096)


def merge(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted ranges with those closer than `gap` (zip headers, alignment) joined."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and s <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def touched(chunks: list[int], ranges: list[tuple[int, int]]) -> int:
    """Bytes of the chunks that overlap `ranges`: the least a reader fetching whole chunks can fetch."""
    import bisect

    offsets = [0]
    for n in chunks:
        offsets.append(offsets[-1] + n)
    hit: set[int] = set()
    for s, e in ranges:                       # the kernel reads whole pages
        s, e = s - s % PAGE, -(-e // PAGE) * PAGE
        first = bisect.bisect_right(offsets, s) - 1
        last = bisect.bisect_left(offsets, e) - 1
        hit.update(range(first, last + 1))
    return sum(chunks[i] for i in hit if 0 <= i < len(chunks))


@dataclass
class Result:
    fmt: str
    case: str
    size: int
    read: int
    ranges: int
    fetched: int
    touched: int               # bytes of the chunks the pages of the read ranges overlap
    hedges: int
    sched_fetched: int         # chunk bytes the scheduler fetched for this file's opens (no hedge copies)
    asked: int                 # bytes the kernel asked the daemon for in reads of this file (its read-around too)
    parts: int                 # bytes fetched as parts of chunks (a reader of slices), in sched_fetched too
    seconds: float
    files: list[dict[str, Any]]
    declared: bool = False     # the reader declared its tensors first (user.cpfs.prefetch)
    learned: bool = False      # the second load through a mount that learned from the first

    @property
    def name(self) -> str:
        return f"{self.case}, declared" if self.declared else f"{self.case}, learned" if self.learned else self.case

    @property
    def bound(self) -> int:
        return int(1.3 * self.read) + CHUNK * 2 * self.ranges


def stats(mp: Path, cfg: Path) -> dict[str, Any]:
    from .common import cpfs

    return json.loads(cpfs("stats", str(mp), "--json", config=cfg).stdout)


def write_config(folder: Path, latency: str | None, bandwidth: str | None, learn: bool = False,
                 read_ahead_kb: int | None = None, slice_parts: bool = False) -> Path:
    """The stores' config; `learn`: a second config over the same stores whose mounts learn prefetch
    plans, kept in a staging folder of its own (the first has learning off)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["replicas = 2", "", "[readahead]", f"learn = {'true' if learn else 'false'}",
             f"slice_parts = {'true' if slice_parts else 'false'}", "",
             "[mount]", f'staging = "{folder / ("staging-learn" if learn else "staging")}"']
    if read_ahead_kb is not None:
        lines.append(f"read_ahead_kb = {read_ahead_kb}")
    for i in range(3):
        lines += ["", "[[store]]", f'name = "s{i}"', f'url = "stores/s{i}"']
        if latency:
            lines.append(f'latency = "{latency}"')
        if bandwidth:
            lines.append(f'bandwidth = "{bandwidth}"')
    path = folder / ("cpfs-learn.toml" if learn else "cpfs.toml")
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:           # python -m benchmarks.bench_partial child FORMAT CASE PATH RANK [DECLARE]
        fmt, case, path, rank, *declare = argv[1:6]
        print(json.dumps(_child(fmt, case, path, int(rank), *declare)))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_partial", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=512 * MiB, help="checkpoint size (default 512MiB)")
    p.add_argument("--latency", help="simulated latency of every store (default none)")
    p.add_argument("--bandwidth", help="simulated bandwidth of every store (default none)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--workdir", type=Path, help="where the temporary stores and mounts go (default /tmp)")
    p.add_argument("--declare", action="store_true",
                   help="also run the weights, stage and full cases with the reader declaring its tensors first")
    p.add_argument("--another-host", action="store_true",
                   help="with --learn: the second load's mount has no local recordings (another host's): its "
                        "plan comes through the stores")
    p.add_argument("--learn", action="store_true",
                   help="also run the weights, stage and slice cases a second time through a mount that learned "
                        "from the first")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help=f"transformer layers of the checkpoint (default {LAYERS}); fewer makes larger tensors of the "
                        "same size (at 1GiB, 16 layers: matrices of 0.8-4.2 MiB, a rank's 1/8 slices of 0.1-0.5 MiB; "
                        "2 layers: 4.5-24 MiB, slices of 0.6-3 MiB)")
    p.add_argument("--read-ahead-kb", type=int,
                   help="the mounts' kernel readahead ([mount] read_ahead_kb; default the config's, 1024)")
    p.add_argument("--slice-parts", action="store_true",
                   help="[readahead] slice_parts = true: readers of slices get parts of chunks (off by default)")
    p.add_argument("--rank", type=int, default=RANK, choices=range(RANKS),
                   help=f"the slice case's rank of {RANKS} (default {RANK}; rank 0's slices start at tensor starts)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    try:
        return run(args)
    except BenchError as e:
        print(f"\nbench_partial: error: {e}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    from cpfs.tensor_index import index_file

    paths = make_files(args.size, args.layers)
    work = Path(tempfile.mkdtemp(prefix="cpfs-partial-", dir=args.workdir or "/tmp"))
    ra, sp = args.read_ahead_kb, args.slice_parts
    cfg = write_config(work / "cfg", args.latency, args.bandwidth, read_ahead_kb=ra, slice_parts=sp)
    learn_cfg = write_config(work / "cfg", args.latency, args.bandwidth, learn=True, read_ahead_kb=ra, slice_parts=sp)
    mp = work / "mnt"
    results: list[Result] = []
    try:
        for fmt in args.formats:
            ensure_imported(paths[fmt], f"/{paths[fmt].name}", cfg)
        for fmt in args.formats:
            from .common import cpfs
            data = f"/{paths[fmt].name}" + (f"/{DCP_DATA}" if fmt == "dcp" else "")
            chunks = [c[1] for c in json.loads(cpfs("inspect", "--json", data, config=cfg).stdout)["chunks"]]
            if fmt == "dcp":
                index, items = None, dcp_items(paths[fmt])
                cases = [case for case in args.cases if case != "slice"]
                runs = [(case, "", False) for case in cases]
            else:
                index, items = index_file(paths[fmt]), {}
                if index is None:
                    raise BenchError(f"{paths[fmt]} has no tensor index")
                names = [t.name for t in index.tensors]
                cases = list(args.cases)
                runs = [(case, "", False) for case in cases]
                if args.declare:
                    runs += [(case, "\n".join(declared(case, names)), False) for case in cases if case != "slice"]
            if args.learn:
                runs += [(case, "", True) for case in cases if case != "full"]
            for case, declare, learn in runs:
                child = [sys.executable, "-m", "benchmarks.bench_partial", "child", fmt, case,
                         str(mp / paths[fmt].name), str(args.rank), declare]
                tag = "-declared" if declare else "-learned" if learn else ""
                if learn:                     # the first load, which the mount learns from
                    with mounted(learn_cfg, mp, work / f"{fmt}-{case}-learning.log"):
                        run_child(child, timeout=1800)
                        time.sleep(1.5)       # the recording is written within a second of the close
                    if args.another_host:     # what the stores shared, nothing of this host's
                        remove_tree(work / "cfg" / "staging-learn" / "learned")
                with mounted(learn_cfg if learn else cfg, mp, work / f"{fmt}-{case}{tag}.log") as m:
                    before = stats(mp, cfg)
                    r = run_child(child, timeout=1800)
                    time.sleep(0.5)           # fetches the closing reader cancelled settle
                    after = stats(mp, cfg)
                if m.problems:
                    print_daemon_report(m, f"{fmt} {case}", tail=20)
                fetched = (sum(s["bytes_read"] for s in after["stores"])
                           - sum(s["bytes_read"] for s in before["stores"]))
                if fmt == "dcp":            # the items asked for, and all of .metadata (a file of its own)
                    ranges = merge([(items[n][0], sum(items[n])) for n, _, _ in r["read"]], gap=4096)
                    meta = (paths[fmt] / ".metadata").stat().st_size
                    size = meta + (paths[fmt] / DCP_DATA).stat().st_size
                    read, spans, least = sum(e - s for s, e in ranges) + meta, len(ranges) + 1, touched(chunks, ranges) + meta
                else:
                    ranges = read_ranges(index, r["read"])
                    size, read, spans, least = (paths[fmt].stat().st_size, sum(e - s for s, e in ranges), len(ranges),
                                                touched(chunks, ranges))
                res = Result(fmt, case, size, read, spans, fetched, least,
                             after["replicas"]["hedges"] - before["replicas"]["hedges"],
                             sum(f["fetched_bytes"] for f in after["scheduler"].get("files", [])
                                 if f["path"] == data),
                             sum(f["read_bytes"] for f in after["scheduler"].get("files", []) if f["path"] == data),
                             after["scheduler"]["part_bytes"] - before["scheduler"]["part_bytes"],
                             r["seconds"], after["scheduler"].get("files", []), bool(declare), learn)
                results.append(res)
                print(f"  {fmt:<11} {res.name:<16} read {human(res.read):>11} in {res.ranges:>3} ranges, fetched "
                      f"{human(fetched):>11} = {fetched / res.read:5.2f}x, bound {human(res.bound)}  "
                      f"({r['seconds']:.1f} s)", flush=True)
    finally:
        remove_tree(work)
    report(results)
    if args.json:
        args.json.write_text(json.dumps([{**r.__dict__, "bound": r.bound, "name": r.name} for r in results],
                                        indent=1))
    return 0


def report(results: list[Result]) -> None:
    print(f"\n== fetched from the stores vs read by the process; bound = 1.3 x read + one {human(CHUNK)} chunk "
          "per range boundary")
    print("fetched = the stores' bytes_read (hedged reads included); sched/read = chunk bytes the scheduler "
          "fetched for the file (per-file statistics) / read;\nasked/read = bytes the kernel asked the daemon for "
          "(the reader's pages and the kernel's readahead around them, less what pushes gave it) / read")
    print("touched = bytes of the chunks the pages of the read ranges overlap (the least whole-chunk fetches can move)")
    print_table(["format", "case", "read", "ranges", "touched", "fetched", "fetched/read", "fetched/touched",
                 "fetched/file", "fetched/bound", "target", "hedges", "sched/read", "asked/read", "seconds"],
                [[r.fmt, r.name, human(r.read), r.ranges, human(r.touched), human(r.fetched), f"{r.fetched / r.read:.2f}",
                  f"{r.fetched / r.touched:.2f}", f"{r.fetched / r.size:.2f}", f"{r.fetched / r.bound:.2f}",
                  "met" if r.fetched <= r.bound else "MISSED", r.hedges,
                  f"{r.sched_fetched / r.read:.2f}", f"{r.asked / r.read:.2f}", f"{r.seconds:.1f}"] for r in results])
    plain = {(r.fmt, r.case): r for r in results if not r.declared and not r.learned}
    for what, flag in (("declared prefetch (user.cpfs.prefetch)", "declared"),
                       ("learned prefetch (a second load, the mount having learned from the first)", "learned")):
        pairs = [(plain[(r.fmt, r.case)], r) for r in results if getattr(r, flag) and (r.fmt, r.case) in plain]
        if pairs:
            print(f"\n== {what} against the same load without, same run")
            print_table(["format", "case", "seconds", flag, "speedup", "fetched/read", flag],
                        [[a.fmt, a.case, f"{a.seconds:.2f}", f"{b.seconds:.2f}", f"{a.seconds / b.seconds:.2f}x",
                          f"{a.fetched / a.read:.2f}", f"{b.fetched / b.read:.2f}"] for a, b in pairs])


if __name__ == "__main__":
    sys.exit(main())
