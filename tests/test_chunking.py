"""Where files are cut: the boundary scanner, and cut_points, which `cpfs put` and the mount share."""
from __future__ import annotations

import bisect
import io
import os
import random
import struct
import zipfile
import zlib

import pytest
import safetensors.torch
import torch

from cpfs.chunking import (LEAD, PAGE, READ_BLOCK, TAIL, BoundaryScanner, chunk_end, cut, cut_points, record_cuts,
                           tensor_boundaries)
from cpfs.completeness import incomplete_reason
from cpfs.tensor_index import build_index


def _checkpoints() -> dict[str, bytes]:
    rng = random.Random(7)
    sd = {f"t{i}": torch.randn(rng.choice([1, 100, 3000, 9000, 40000, 70000])) for i in range(40)}
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


@pytest.mark.parametrize("chunk_size", [64 * 1024, 1024 * 1024])   # without and with the LEAD/TAIL cuts
@pytest.mark.parametrize("kind", ["torch", "safetensors", "zipfile", "random"])
def test_scanner_predicts_the_index_cut_points_while_bytes_arrive(kind: str, chunk_size: int) -> None:
    data = _checkpoints()[kind]
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
            expected += record_cuts(start, info.compress_size, chunk_size, member=True)
        assert one_pass.boundaries == expected and bool(expected) == (chunk_size == 64 * 1024)
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


def test_scanning_a_torch_save_reads_its_headers_not_its_tensors() -> None:
    """data.pkl gives each storage record's length, so the scanner reads a local header and the
    descriptor where that length puts it, never the tensors' bytes, in one pass or as bytes arrive."""
    g = torch.Generator().manual_seed(3)
    data = _save({f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([700_000, 5, 300_000, 1_200_000, 40])},
                 "ckpt.pt")
    for steps in ([len(data)], list(range(4096, len(data), 65_536)) + [len(data)]):
        scanner, read = BoundaryScanner(1024 * 1024), 0

        def read_at(off: int, n: int) -> bytes:
            nonlocal read
            read += n
            return data[off:off + n]

        for limit in steps:
            scanner.advance(read_at, limit, eof=limit == len(data), budget=1 << 40)
        index = build_index(lambda off, n: data[off:off + n], len(data))
        assert scanner.done and scanner.boundaries == tensor_boundaries(index, 1024 * 1024)
        assert len(scanner.boundaries) == 6 and read < len(data) // 100   # 8.8 MB of tensors, ~20 KB read
        # The tensor records a writer may drop from staging: no header or pickle byte is in them.
        assert scanner.interiors == [(r.offset, r.offset + r.length) for r in index.records
                                     if r.length >= 1024 * 1024 // 8 and r.name.split("/")[-2] == "data"]
        assert scanner.inside_record(index.records[-3].offset, index.records[-3].offset + 10) is False


def test_a_pickle_that_misstates_a_length_gets_the_cuts_of_the_bytes() -> None:
    """A data.pkl whose storage lengths do not match the records that follow it (not torch.save's,
    or a lie): the descriptor is not where it says, and the member's end is found by scanning. While
    the bytes arrive the scanner trusts the pickle (a wrong prediction costs the writer an upload);
    the cuts it ends with are those of the bytes."""
    g = torch.Generator().manual_seed(4)
    real = zipfile.ZipFile(io.BytesIO(_save({"a": torch.randn(90_000, generator=g), "b": torch.randn(1000)}, "x.pt")))
    liar = zipfile.ZipFile(io.BytesIO(_save({"a": torch.randn(60_000), "b": torch.randn(45_000)}, "x.pt")))
    assert len(real.read("archive/data/0")) == 360_000 and len(liar.read("archive/data/0")) == 240_000
    assert len(real.read("archive/data/1")) == 4000 and len(liar.read("archive/data/1")) == 180_000
    out, expected = bytearray(), []
    for name, body in [("archive/data.pkl", liar.read("archive/data.pkl")), ("archive/data/0", real.read("archive/data/0")),
                       ("archive/data/1", real.read("archive/data/1")), ("archive/other", os.urandom(30_000))]:
        encoded = name.encode()
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 8, 0, 0, 0, 0, 0, 0, len(encoded), 0) + encoded
        expected += record_cuts(len(out), len(body), 64 * 1024, member=True)
        out += body + struct.pack("<IIII", 0x08074B50, zlib.crc32(body), len(body), len(body))
    out += b"PK\x01\x02" + bytes(60)
    data = bytes(out)
    for steps in ([len(data)], list(range(1000, len(data), 3_000)) + [len(data)]):
        scanner = BoundaryScanner(64 * 1024)
        for limit in steps:
            scanner.advance(lambda off, n: data[off:off + n], limit, eof=limit == len(data), budget=1 << 40)
        assert scanner.done and scanner.boundaries == expected and len(expected) == 4   # data/1 is small


@pytest.mark.parametrize("head", [struct.pack("<Q", 2**63 + 5) + b"{",        # byte 8 is "{" by chance
                                  struct.pack("<Q", 30) + b"{ not json at all, no",   # a header that is no JSON
                                  struct.pack("<Q", 8) + b'{"a": 1}',                 # JSON, no tensors in it
                                  struct.pack("<Q", 100_005) + b'{"a":' + b"[" * 100_000])  # too deep to parse
def test_a_file_that_only_looks_like_safetensors_may_leave_staging_past_what_commit_reads(head: bytes) -> None:
    """Any file may start like safetensors; once the scanner sees it is not, it is any other file:
    everything past the bytes that the indexer and the completeness check read may be dropped."""
    data = head + os.urandom(3 * 1024 * 1024)
    scanner = BoundaryScanner(1024 * 1024)
    scanner.advance(lambda off, n: data[off:off + n], len(data), budget=1 << 40)
    assert scanner.done and scanner.boundaries == [] and len(scanner.interiors) == 1
    read: list[tuple[int, int]] = []

    def read_at(off: int, n: int) -> bytes:
        read.append((off, n))
        return data[off:off + n]

    assert incomplete_reason(read_at, len(data)) is None
    assert build_index(read_at, len(data)) is None
    assert max(off + n for off, n in read) <= scanner.interiors[0][0] in (9, 8 + struct.unpack_from("<Q", head)[0])
    assert scanner.inside_record(scanner.interiors[0][0], len(data))


def test_record_cuts() -> None:
    """Big zip members: start + LEAD and end - TAIL; other big records: start and end."""
    mib = 1024 * 1024
    assert record_cuts(1000, mib // 2 - 1, 4 * mib, member=True) == ()                 # below chunk_size/8
    assert record_cuts(1000, 10 * mib, 4 * mib, member=True) == (1000 + LEAD, 1000 + 10 * mib - TAIL)
    assert record_cuts(1000, mib // 2, 4 * mib, member=True) == (1000 + LEAD, 1000 + mib // 2 - TAIL)
    assert record_cuts(1000, 10 * mib, 4 * mib, member=False) == (1000, 1000 + 10 * mib)   # safetensors
    # chunk_size/8 <= LEAD + TAIL: no room for both in every big member, plain cuts
    assert record_cuts(1000, 100_000, 8 * (LEAD + TAIL), member=True) == (1000, 101_000)
    assert record_cuts(1000, 100_000, 8 * (LEAD + TAIL + 1), member=True) == (1000 + LEAD, 101_000 - TAIL)


def _local_headers(data: bytes) -> dict[int, int]:
    """Data offset -> local header offset of every member of a zip."""
    out = {}
    for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
        nlen, elen = struct.unpack_from("<HH", data, info.header_offset + 26)
        out[info.header_offset + 30 + nlen + elen] = info.header_offset
    return out


def _save(sd: dict, name: str) -> bytes:
    """torch.save to a file called `name` (the archive inside is named after it), as bytes."""
    buf = io.BytesIO()
    buf.name = name
    torch.save(sd, buf)
    return buf.getvalue()


def test_reading_every_record_header_fetches_little() -> None:
    """What torch.load(mmap=True) reads of the records it does not load: from the page of each local
    header to READ_BLOCK past it. That read falls in one chunk of about LEAD + TAIL bytes (cut at the
    records' ends: the record's first chunk and the previous record's last, several MiB); the cuts
    from the bytes (the mount) and from the index (`cpfs put`) agree."""
    chunk_size = 4 * 1024 * 1024
    g = torch.Generator().manual_seed(0)
    sizes = [3_000_000, 600_000, 100, 5_000_000, 700_000, 2_000_000, 100_000, 9_000_000]   # bytes
    data = _save({f"t{i}": torch.randn(n // 4, generator=g) for i, n in enumerate(sizes)}, "ckpt.pt")
    read_at = lambda off, n: data[off:off + n]
    index = build_index(read_at, len(data))
    points = cut_points(read_at, len(data), index, chunk_size)
    assert points == cut_points(read_at, len(data), None, chunk_size)
    offsets = [off for off, _ in cut(len(data), chunk_size, points)] + [len(data)]
    headers = _local_headers(data)
    big = [r for r in index.records if r.length >= chunk_size // 8]
    assert len(big) == 6
    after_big = {b.offset for a, b in zip(index.records, index.records[1:]) if a.length >= chunk_size // 8}
    for r in big:
        assert {r.offset + LEAD, r.offset + r.length - TAIL} <= set(offsets) and r.offset not in offsets
        lo = headers[r.offset] // PAGE * PAGE
        hi = -(-(headers[r.offset] + READ_BLOCK) // PAGE) * PAGE
        first = bisect.bisect_right(offsets, lo) - 1
        assert offsets[first + 1] == r.offset + LEAD and hi <= r.offset + LEAD      # one chunk
        if r.offset in after_big:     # else that chunk also holds the small records before the header
            assert offsets[first + 1] - offsets[first] <= LEAD + TAIL + PAGE


def test_unchanged_records_keep_their_chunks_in_a_checkpoint_of_another_name() -> None:
    """A record's first LEAD and last TAIL bytes share a chunk with a local header, which names the
    archive: a checkpoint saved under another name with one tensor changed shares all but that tensor
    and about LEAD + TAIL per record with its predecessor; under the same name, all but that tensor."""
    chunk_size = 4 * 1024 * 1024
    g = torch.Generator().manual_seed(1)
    sd = {f"t{i}": torch.randn(n // 4, generator=g) for i, n in enumerate([2_000_000, 6_000_000, 900_000, 3_000_000])}
    first = _save(sd, "step_100.pt")
    sd["t2"] = sd["t2"] + 1
    second = _save(sd, "step_200.pt")

    def chunks(data: bytes) -> list[bytes]:
        read_at = lambda off, n: data[off:off + n]
        spans = cut(len(data), chunk_size, cut_points(read_at, len(data), build_index(read_at, len(data)), chunk_size))
        return [data[off:off + n] for off, n in spans]

    known = set(chunks(first))
    shared = sum(len(c) for c in chunks(second) if c in known)
    assert shared >= len(second) - 900_000 - 4 * (LEAD + TAIL + PAGE) - 64 * 1024
    same_name = _save(sd, "step_100.pt")
    shared = sum(len(c) for c in chunks(same_name) if c in known)
    assert shared >= len(second) - 900_000 - 2 * (LEAD + TAIL + PAGE)


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
