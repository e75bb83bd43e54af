"""A realistic training checkpoint for the demo and the benchmarks, generated in a few seconds.

A LLaMA-like model in bf16 (token embedding; per layer the attention q/k/v/o and the SwiGLU MLP
gate/up/down; an output head), fp32 RMSNorm weights, and fp32 Adam moments (exp_avg, exp_avg_sq) for the
parameters trained in this phase: the embedding, the norms and the last layer. The model width is chosen
so the file comes out close to the requested size. Fixed seed, so the same arguments give the same bytes
(the values differ per tensor, so cpfs finds nothing to deduplicate).

    python -m benchmarks.make_checkpoint [--size 1GiB] [--seed 0] [--force] [PATH]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import GiB, ROOT, human, parse_size

DEFAULT_PATH = ROOT / "demo-data" / "ckpt" / "step_100.pt"
VOCAB = 32000
LAYERS = 8
STEP = 100


@dataclass(frozen=True)
class Shape:
    dim: int
    ffn_dim: int
    n_layers: int = LAYERS
    vocab: int = VOCAB


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    kind: str          # "weight" (bf16 matrix), "norm" (fp32 vector)
    trained: bool      # has Adam moments in the optimizer state


def params(s: Shape) -> list[Param]:
    out = [Param("tok_embeddings.weight", (s.vocab, s.dim), "weight", True)]
    for i in range(s.n_layers):
        last = i == s.n_layers - 1
        p = f"layers.{i}."
        out.append(Param(p + "attention_norm.weight", (s.dim,), "norm", True))
        out += [Param(p + f"attention.{w}.weight", (s.dim, s.dim), "weight", last) for w in ("wq", "wk", "wv", "wo")]
        out.append(Param(p + "ffn_norm.weight", (s.dim,), "norm", True))
        out.append(Param(p + "feed_forward.w1.weight", (s.ffn_dim, s.dim), "weight", last))   # gate
        out.append(Param(p + "feed_forward.w3.weight", (s.ffn_dim, s.dim), "weight", last))   # up
        out.append(Param(p + "feed_forward.w2.weight", (s.dim, s.ffn_dim), "weight", last))   # down
    out.append(Param("norm.weight", (s.dim,), "norm", True))
    out.append(Param("output.weight", (s.vocab, s.dim), "weight", False))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_bytes(s: Shape) -> int:
    """Bytes of tensor data in the checkpoint (the file adds a few KiB of zip and pickle)."""
    total = 0
    for p in params(s):
        n = _numel(p.shape)
        total += n * (2 if p.kind == "weight" else 4) + (8 * n if p.trained else 0)
    return total


def shape_for(size: int) -> Shape:
    """The model width (a multiple of 64; MLP 8/3 of it) whose checkpoint comes closest to `size`."""
    def make(dim: int) -> Shape:
        return Shape(dim, 64 * max(1, round(dim * 8 / 3 / 64)))

    return min((make(d) for d in range(64, 16384 + 1, 64)), key=lambda s: abs(tensor_bytes(s) - size))


def build(shape: Shape, seed: int = 0) -> dict[str, Any]:
    """The state dict: {"model", "optimizer", "step", "config"}, like a trainer's checkpoint."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, p in enumerate(params(shape)):
        if p.kind == "weight":
            t = torch.randn(p.shape, dtype=torch.bfloat16, generator=g).mul_(p.shape[-1] ** -0.5)
        else:
            t = torch.randn(p.shape, dtype=torch.float32, generator=g).mul_(0.02).add_(1.0)
        model[p.name] = t
        if p.trained:
            exp_avg = torch.randn(p.shape, dtype=torch.float32, generator=g).mul_(1e-3)
            exp_avg_sq = torch.randn(p.shape, dtype=torch.float32, generator=g).square_().mul_(1e-6)
            state[i] = {"step": torch.tensor(float(STEP)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    names = [p.name for p in params(shape)]
    return {
        "model": model,
        "optimizer": {
            "state": state,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                              "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                              "differentiable": False, "fused": None, "params": list(range(len(names)))}],
        },
        "step": STEP,
        "config": {"dim": shape.dim, "ffn_dim": shape.ffn_dim, "n_layers": shape.n_layers,
                   "vocab_size": shape.vocab, "norm_eps": 1e-5, "dtype": "bfloat16"},
    }


def make_checkpoint(path: Path = DEFAULT_PATH, size: int = GiB, seed: int = 0, *, force: bool = False,
                    verbose: bool = True) -> Path:
    """Write the checkpoint to `path` unless it exists (or `force`); returns `path`."""
    import torch

    path = Path(path)
    if path.exists() and not force:
        if verbose:
            print(f"checkpoint {path} exists ({human(path.stat().st_size)}); reusing it")
        return path
    shape = shape_for(size)
    t0 = time.perf_counter()
    sd = build(shape, seed)
    t_build = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(sd, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if verbose:
        n = len(sd["model"]) + sum(len(s) for s in sd["optimizer"]["state"].values())
        print(f"generated {path}: {human(path.stat().st_size)}, {n} tensors (dim {shape.dim}, ffn {shape.ffn_dim}, "
              f"{shape.n_layers} layers, vocab {shape.vocab}, seed {seed}) in {t_build:.1f} s "
              f"+ torch.save {time.perf_counter() - t0 - t_build:.1f} s")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.make_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH, help=f"default {DEFAULT_PATH}")
    p.add_argument("--size", type=parse_size, default=GiB, help="approximate file size (default 1GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = p.parse_args(argv)
    make_checkpoint(args.path, args.size, args.seed, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
