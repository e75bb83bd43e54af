"""Where a file is cut into chunks.

Fixed-size cuts would let one changed tensor shift or straddle the chunks of its unchanged neighbours.
So large tensors (records of a torch zip, tensors of a safetensors file) start and end on a cut, and
only the small records between them share chunks: a checkpoint in which most tensors are unchanged
then shares most chunks with its predecessor. No chunk exceeds `chunk_size`.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable

from .tensor_index import TensorIndex


def tensor_boundaries(index: TensorIndex | None, chunk_size: int) -> list[int]:
    """Sorted cut points: start and end of every tensor (or torch record) of at least chunk_size/8."""
    if index is None:
        return []
    if index.format == "torch-zip":
        spans: Iterable[tuple[int, int]] = ((r.offset, r.length) for r in index.records)
    else:
        spans = ((t.offset, t.length) for t in index.tensors)
    min_len = max(1, chunk_size // 8)
    points = set()
    for offset, length in spans:
        if length >= min_len:
            points.update((offset, offset + length))
    return sorted(points)


def cut(size: int, chunk_size: int, boundaries: list[int] = ()) -> list[tuple[int, int]]:
    """(offset, length) of every chunk of a `size`-byte file."""
    spans = []
    pos = 0
    while pos < size:
        end = min(pos + chunk_size, size)
        i = bisect.bisect_right(boundaries, pos)
        if i < len(boundaries) and boundaries[i] < end:
            end = boundaries[i]
        spans.append((pos, end - pos))
        pos = end
    return spans
