"""Where files are cut: the boundary scanner, and cut_points, which `cpfs put` and the mount share."""
from __future__ import annotations

import io
import os
import random
import struct
import zipfile

import pytest
import safetensors.torch
import torch

from cpfs.chunking import BoundaryScanner, chunk_end, cut, cut_points, tensor_boundaries
from cpfs.tensor_index import build_index


def _checkpoints() -> dict[str, bytes]:
    rng = random.Random(7)
    sd = {f"t{i}": torch.randn(rng.choice([1, 100, 3000, 9000, 40000])) for i in range(40)}
    sd["empty"] = torch.zeros(0)
    sd["view"] = sd["t3"][1:]
    buf = io.BytesIO()
    torch.save(sd, buf)
    plain_zip = io.BytesIO()
    with zipfile.ZipFile(plain_zip, "w") as z:
        z.writestr("a.bin", os.urandom(50_000))
        z.writestr("b.bin", os.urandom(30_000))
    return {
        "torch": buf.getvalue(),
        "safetensors": safetensors.torch.save({k: v.contiguous() for k, v in sd.items() if k != "view"}),
        "zipfile": plain_zip.getvalue(),
        "random": os.urandom(300_000),
    }


@pytest.mark.parametrize("kind", ["torch", "safetensors", "zipfile", "random"])
def test_scanner_predicts_the_index_cut_points_while_bytes_arrive(kind: str) -> None:
    data = _checkpoints()[kind]
    chunk_size = 64 * 1024
    read_at = lambda off, n: data[off:off + n]

    one_pass = BoundaryScanner(chunk_size)
    one_pass.advance(read_at, len(data), eof=True, budget=1 << 40)

    stepped, rng, limit = BoundaryScanner(chunk_size), random.Random(1), 0
    while limit < len(data):
        limit = min(len(data), limit + rng.choice([1, 7, 30, 100, 4096, 50_000]))
        stepped.advance(read_at, limit)
        # Never claims knowledge it cannot have: what it reports below known_upto is final.
        known = [b for b in one_pass.boundaries if b < min(stepped.known_upto, limit)]
        assert [b for b in stepped.boundaries if b < min(stepped.known_upto, limit)] == known
    stepped.advance(read_at, len(data), eof=True, budget=1 << 40)
    assert stepped.boundaries == one_pass.boundaries

    index = build_index(read_at, len(data))
    if kind in ("torch", "safetensors"):
        assert index is not None and one_pass.boundaries == tensor_boundaries(index, chunk_size)
        assert len(one_pass.boundaries) > 10
    elif kind == "zipfile":  # no tensor index, but the zip members still give the cuts
        expected = []
        for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
            nlen, elen = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + nlen + elen
            expected += [start, start + info.compress_size]
        assert one_pass.boundaries == expected
    else:
        assert one_pass.boundaries == []


def test_scanner_follows_zip64_data_descriptors() -> None:
    """miniz writes 24-byte descriptors once a member's header lies beyond 4 GiB."""
    out, expected = bytearray(), []
    for i, size in enumerate([100_000, 3, 50_000]):
        name = f"archive/data/{i}".encode()
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 8, 0, 0, 0, 0, 0, 0, len(name), 0) + name
        expected += [len(out), len(out) + size] if size >= 8192 else []
        out += os.urandom(size) + struct.pack("<IIQQ", 0x08074B50, 0, size, size)
    out += b"PK\x01\x02" + bytes(60)
    scanner = BoundaryScanner(64 * 1024)
    scanner.advance(lambda off, n: bytes(out[off:off + n]), len(out), eof=True)
    assert scanner.boundaries == expected and scanner.done


# ---------------------------------------------------------------- cut_points

@pytest.mark.parametrize("kind", ["torch", "safetensors", "zipfile", "random"])
def test_cut_points_take_the_index_else_the_scanner(kind: str) -> None:
    data = _checkpoints()[kind]
    chunk_size = 64 * 1024
    read_at = lambda off, n: data[off:off + n]
    index = build_index(read_at, len(data))
    points = cut_points(read_at, len(data), index, chunk_size)
    without_index = cut_points(read_at, len(data), None, chunk_size)  # as for a pickle the indexer rejects
    if kind in ("torch", "safetensors"):  # the same cuts with or without the index
        assert index is not None and points == tensor_boundaries(index, chunk_size) == without_index
    else:
        assert index is None and points == without_index
        assert bool(points) == (kind == "zipfile")  # zip members still give cuts; random bytes none


def test_cut_points_resume_a_scanner_without_changing_it() -> None:
    data = _checkpoints()["torch"]
    chunk_size = 64 * 1024
    read_at = lambda off, n: data[off:off + n]
    partial = BoundaryScanner(chunk_size)
    partial.advance(read_at, len(data) // 2)
    before = (list(partial.boundaries), partial.read_upto, partial.known_upto)

    reads: list[int] = []
    points = cut_points(lambda off, n: reads.append(off) or read_at(off, n), len(data), None, chunk_size, partial)
    assert points == cut_points(read_at, len(data), None, chunk_size)
    assert min(reads) > partial.read_upto - 28  # resumed where it stopped (a descriptor may straddle it)
    assert (partial.boundaries, partial.read_upto, partial.known_upto) == before


def test_chunk_end_is_the_next_cut_of_cut() -> None:
    boundaries = [10, 500, 520, 3000]
    spans = cut(4000, 1000, boundaries)
    assert spans == [(0, 10), (10, 490), (500, 20), (520, 1000), (1520, 1000), (2520, 480), (3000, 1000)]
    assert all(chunk_end(off, 1000, boundaries) == off + n for off, n in spans)
    assert chunk_end(3500, 1000, boundaries) == 4500  # past the end of the file: the caller clips
