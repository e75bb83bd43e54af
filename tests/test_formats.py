"""The on-store formats: chunks, manifests, paths, placement and where files are cut."""
from __future__ import annotations

import json
import os
import random
import struct
from collections import Counter

import pytest

from cpfs import chunk as chunkfmt
from cpfs.chunking import cut, tensor_boundaries
from cpfs.errors import CorruptChunk, ManifestError
from cpfs.manifest import ChunkEntry, Manifest, Summary, normalize_path, parent_dirs, path_hash
from cpfs.placement import place
from cpfs.tensor_index import TensorEntry, TensorIndex


def _compressible(n: int) -> bytes:
    """Text-like bytes lz4 shrinks a lot."""
    words = [b"weight", b"bias", b"layer", b"attn", b"mlp", b"norm", b" ", b"\n"]
    rng = random.Random(1)
    out = bytearray()
    while len(out) < n:
        out += rng.choice(words)
    return bytes(out[:n])


# ---- chunks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [_compressible(1 << 20), os.urandom(1 << 20), b"x", bytes(300_000),
                                  bytes(4 << 20)], ids=["text", "random", "one-byte", "zeros", "zeros-4MiB"])
def test_chunk_round_trip(data: bytes) -> None:
    """encode then decode gives back the exact bytes, named by their BLAKE3 hash."""
    enc = chunkfmt.encode(data)
    assert enc.digest == chunkfmt.chunk_hash(data) and len(enc.digest) == 64
    assert enc.raw_len == len(data) and enc.stored_len == len(enc.blob)
    assert chunkfmt.decode(enc.blob, enc.digest) == data
    assert chunkfmt.chunk_key(enc.digest) == f"chunks/{enc.digest[:2]}/{enc.digest}"


@pytest.mark.parametrize("data", [os.urandom(300_000), bytes(300_000), b"", os.urandom(5)],
                         ids=["random", "zeros", "empty", "five-random"])   # stable ids: xdist workers collect alike
def test_encode_framed_is_encode_and_keeps_raw_chunks_in_place(data: bytes) -> None:
    framed = bytearray(chunkfmt.HEADER_SIZE) + data
    enc = chunkfmt.encode_framed(framed)
    assert enc == chunkfmt.encode(data) and chunkfmt.decode(bytes(enc.blob), enc.digest) == data
    assert (enc.blob is framed) == (enc.codec == "raw") and (enc.codec == "lz4") == (data == bytes(300_000))


def test_encode_span_reuses_a_buffer_only_once_nothing_holds_its_chunk(tmp_path) -> None:
    """Spans are read into pooled buffers (upload.ENCODE_POOL), not fresh zero-filled ones: a raw chunk
    is stored from the buffer it was read into, so that buffer must not serve another span while the
    chunk is held (an upload in flight), and serves the next one once it is let go."""
    from cpfs.upload import ENCODE_POOL, encode_span

    a, b = os.urandom(300_000), os.urandom(300_000)
    (tmp_path / "f").write_bytes(a + b)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        first = encode_span(fd, 0, len(a), "lz4", "f")
        second = encode_span(fd, len(a), len(b), "lz4", "f")     # first still held: another buffer
        assert first.codec == second.codec == "raw"
        assert chunkfmt.decode(first.blob, first.digest) == a and chunkfmt.decode(second.blob, second.digest) == b
        reused = ENCODE_POOL.statistics().reused
        del first
        third = encode_span(fd, 0, len(a), "lz4", "f")            # a's bytes again, in first's buffer
        assert ENCODE_POOL.statistics().reused == reused + 1
        assert chunkfmt.decode(third.blob, third.digest) == a
        assert chunkfmt.decode(second.blob, second.digest) == b  # untouched by the reuse
    finally:
        os.close(fd)


def test_codec_choice() -> None:
    """lz4 is kept only where it shrinks the data; random data and compression='none' are stored raw."""
    text = _compressible(1 << 20)
    packed = chunkfmt.encode(text)
    assert packed.codec == "lz4" and packed.stored_len < len(text) // 2
    noise = os.urandom(1 << 20)
    raw = chunkfmt.encode(noise)
    assert raw.codec == "raw" and raw.stored_len == len(noise) + chunkfmt.HEADER_SIZE
    assert raw.blob[chunkfmt.HEADER_SIZE:] == noise
    plain = chunkfmt.encode(text, compression="none")
    assert plain.codec == "raw" and plain.stored_len == len(text) + chunkfmt.HEADER_SIZE
    assert chunkfmt.decode(plain.blob, plain.digest) == text


def test_codec_raw_when_saving_is_too_small() -> None:
    """Data lz4 shrinks by less than MIN_SAVING is stored raw (no decompression for a tiny gain)."""
    data = os.urandom(60_000) + bytes(2_000)   # ~3% compressible
    assert chunkfmt.encode(data).codec == "raw"


def test_incompressible_chunks_skip_lz4_but_partly_compressible_ones_keep_it() -> None:
    """Samples decide (chunk.PROBE): trained-weight-like bytes are stored raw; a chunk with a zero
    region (an optimizer state at init next to weights) or text is still compressed."""
    import torch

    weights = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).numpy().tobytes()   # 4 MiB
    assert chunkfmt.encode(weights).codec == "raw"
    assert chunkfmt.encode(weights[:3 << 20] + bytes(1 << 20)).codec == "lz4"   # a quarter zeros
    assert chunkfmt.encode(_compressible(4 << 20)).codec == "lz4"
    mixed = chunkfmt.encode(bytes(1 << 20) + weights[1 << 20:])
    assert chunkfmt.decode(mixed.blob, mixed.digest) == bytes(1 << 20) + weights[1 << 20:]


def _flip(blob: bytes, i: int) -> bytes:
    b = bytearray(blob)
    b[i] ^= 0x40
    return bytes(b)


@pytest.mark.parametrize("codec_data", [_compressible(200_000), os.urandom(200_000)], ids=["lz4", "raw"])
def test_every_header_byte_flip_is_detected(codec_data: bytes) -> None:
    """A flipped bit anywhere in the header (magic, version, codec, lengths, reserved) raises CorruptChunk."""
    enc = chunkfmt.encode(codec_data)
    undetected = []
    for i in range(chunkfmt.HEADER_SIZE):
        try:
            chunkfmt.decode(_flip(enc.blob, i), enc.digest)
            undetected.append(i)
        except CorruptChunk:
            pass
    assert undetected == []


@pytest.mark.parametrize("codec_data", [_compressible(200_000), os.urandom(200_000)], ids=["lz4", "raw"])
def test_payload_flip_is_detected(codec_data: bytes) -> None:
    """A flipped payload byte (first, middle, last and a random sample) raises CorruptChunk."""
    enc = chunkfmt.encode(codec_data)
    n = len(enc.blob)
    rng = random.Random(2)
    positions = [chunkfmt.HEADER_SIZE, n // 2, n - 1] + rng.sample(range(chunkfmt.HEADER_SIZE, n), 40)
    for i in positions:
        with pytest.raises(CorruptChunk):
            chunkfmt.decode(_flip(enc.blob, i), enc.digest)


def test_truncated_wrong_magic_wrong_hash() -> None:
    """Truncated blobs, a foreign magic and a blob stored under the wrong name all raise CorruptChunk."""
    enc = chunkfmt.encode(_compressible(100_000))
    for n in (0, 5, chunkfmt.HEADER_SIZE - 1, chunkfmt.HEADER_SIZE, len(enc.blob) - 1):
        with pytest.raises(CorruptChunk):
            chunkfmt.decode(enc.blob[:n], enc.digest)
    with pytest.raises(CorruptChunk):
        chunkfmt.decode(enc.blob + b"\0", enc.digest)
    with pytest.raises(CorruptChunk, match="magic"):
        chunkfmt.decode(b"XXXX" + enc.blob[4:], enc.digest)
    other = chunkfmt.chunk_hash(b"something else")   # a whole, valid chunk served under another name
    with pytest.raises(CorruptChunk, match="check word"):
        chunkfmt.decode(enc.blob, other)
    with pytest.raises(CorruptChunk):
        chunkfmt.decode(enc.blob, other, full=True)


def _v1(data: bytes) -> tuple[bytes, str]:
    """A chunk as version 1 wrote it: raw, no check word; its name."""
    digest = chunkfmt.chunk_hash(data)
    return struct.pack("<4sBBHQQQ", b"CPFC", 1, 0, 0, len(data), len(data), 0) + data, digest


def test_version_1_chunks_are_read_and_verified_by_blake3() -> None:
    data = os.urandom(100_000)
    blob, digest = _v1(data)
    assert chunkfmt.decode(blob, digest) == data
    with pytest.raises(CorruptChunk, match="hash"):
        chunkfmt.decode(_flip(blob, 5000), digest)
    with pytest.raises(CorruptChunk, match="hash"):
        chunkfmt.decode(blob, chunkfmt.chunk_hash(b"other"))
    with pytest.raises(CorruptChunk, match="reserved"):    # version 1 has no check word
        chunkfmt.decode(blob[:24] + b"\1" + blob[25:], digest)


def test_the_check_word_stops_accidents_and_full_decode_stops_forgeries() -> None:
    """What the read-side check proves and what it leaves to scrub (decode full=True): a copy whose
    check word was computed, on purpose, for other bytes under this name passes a read, not scrub."""
    data = os.urandom(100_000)
    enc = chunkfmt.encode(data)
    assert enc.blob[:5] == b"CPFC\2" and chunkfmt.decode(enc.blob, enc.digest, full=True) == data
    forged = os.urandom(100_000)
    header = struct.pack("<4sBBHQQQ", b"CPFC", 2, 0, 0, len(forged), len(forged),
                         chunkfmt.chunk_check(forged, enc.digest))
    assert chunkfmt.decode(header + forged, enc.digest) == forged
    with pytest.raises(CorruptChunk, match="hash"):
        chunkfmt.decode(header + forged, enc.digest, full=True)


def test_block_checks_prove_a_range_of_a_chunk_and_nothing_else() -> None:
    """A ranged read of a raw chunk is checked block by block: the right blocks pass; a flipped byte,
    blocks from another place of the chunk, or the same bytes under another name do not."""
    data = os.urandom(3 * chunkfmt.BLOCK + 1000)            # a short last block
    enc = chunkfmt.encode(data)
    assert enc.codec == "raw" and len(enc.blocks) == 8 * 4
    assert enc.blocks == chunkfmt.block_checks(data, enc.digest)
    B = chunkfmt.BLOCK
    chunkfmt.check_blocks(data[B:3 * B], enc.digest, enc.blocks, 1)
    chunkfmt.check_blocks(data[3 * B:], enc.digest, enc.blocks, 3)
    flipped = bytearray(data[B:2 * B])
    flipped[12345] ^= 1
    other = chunkfmt.encode(data + b"!")                      # another name
    for bad, first, checks, digest in [(bytes(flipped), 1, enc.blocks, enc.digest),
                                       (data[B:2 * B], 2, enc.blocks, enc.digest),
                                       (data[:B], 0, enc.blocks, other.digest),
                                       (data[3 * B:-1], 3, enc.blocks, enc.digest),
                                       (data[3 * B:] + b"x" * B, 3, enc.blocks, enc.digest)]:
        with pytest.raises(CorruptChunk, match="block"):
            chunkfmt.check_blocks(bad, digest, checks, first)
    # The same bytes saved again, or found in another file, get the same checks (dedup shares them).
    assert chunkfmt.encode(data, "none").blocks == enc.blocks


# ---- manifests ------------------------------------------------------------------------------------------

def _digest(i: int) -> str:
    return chunkfmt.chunk_hash(str(i).encode())


def _manifest(lengths=(100, 50, 200, 1), **kw) -> Manifest:
    chunks = tuple(ChunkEntry(_digest(i), n, n + 32, "raw" if i % 2 else "lz4", ("s0", "s1"))
                   for i, n in enumerate(lengths))
    fields = dict(path="/run1/step_100.pt", size=sum(lengths), mtime_ns=1_700_000_000_123_456_789,
                  mode=0o644, chunk_size=256, chunks=chunks, version=1_700_000_001_000_000_000,
                  tensor_index={"version": 1, "format": "safetensors", "tensors": []})
    fields.update(kw)
    return Manifest(**fields)


def test_summary_is_the_first_line_and_enough_for_a_listing() -> None:
    m = _manifest(state="failed", reason="no central directory", writer="ab12", host="node7")
    data = m.to_bytes()
    s = Summary.from_bytes(data[:data.index(b"\n") + 1])
    assert s == m.summary and (s.size, s.version, s.state, s.reason) == (m.size, m.version, "failed",
                                                                         "no central directory")
    with pytest.raises(ManifestError):
        Summary.from_bytes(data[:10])


def test_manifest_round_trip() -> None:
    """to_bytes/from_bytes is lossless, including stores, codecs and the tensor index."""
    m = _manifest()
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m
    assert back.stored_bytes == sum(n + 32 for n in (100, 50, 200, 1))
    empty = _manifest(lengths=(), tensor_index=None)
    assert Manifest.from_bytes(empty.to_bytes()) == empty


def test_block_checks_round_trip_beside_the_chunk_list_and_are_optional() -> None:
    """Block checks ride in the body under "blocks", one base64 string per chunk ("" for a chunk that has
    none); the chunk entries keep their five fields, so a reader that predates them reads the manifest.
    A manifest without them (written before) loads with none; checks of another block size are left
    out; a malformed "blocks" is refused like any other field."""
    lengths = (chunkfmt.BLOCK * 2 + 5, 300)
    data = [os.urandom(n) for n in lengths]
    chunks = tuple(ChunkEntry(chunkfmt.chunk_hash(d), len(d), len(d) + 32, "raw", ("s0",),
                              chunkfmt.block_checks(d, chunkfmt.chunk_hash(d)) if k == 0 else b"")
                   for k, d in enumerate(data))
    m = _manifest(lengths=lengths, chunks=chunks)
    raw = m.to_bytes()
    body = json.loads(raw.split(b"\n")[1])
    assert all(len(c) == 5 for c in body["chunks"]) and body["blocks"]["size"] == chunkfmt.BLOCK
    assert body["blocks"]["checks"][1] == ""
    back = Manifest.from_bytes(raw)
    assert back == m and len(back.chunks[0].blocks) == 8 * 3 and back.chunks[1].blocks == b""
    plain = _manifest(lengths=lengths, chunks=tuple(ChunkEntry(c.digest, c.raw_len, c.stored_len, c.codec, c.stores)
                                                    for c in chunks))
    assert b'"blocks"' not in plain.to_bytes() and Manifest.from_bytes(plain.to_bytes()) == plain
    body["blocks"]["size"] = chunkfmt.BLOCK * 2
    head = json.dumps(_unchecked(raw.split(b"\n")[0])).encode()
    assert all(c.blocks == b"" for c in Manifest.from_bytes(head + b"\n" + json.dumps(body).encode()).chunks)
    for bad in [{"size": chunkfmt.BLOCK, "checks": ["", ""][:1]},                    # one per chunk
                {"size": chunkfmt.BLOCK, "checks": ["AAAA", ""]},                     # 3 bytes for 3 blocks
                {"size": chunkfmt.BLOCK, "checks": ["not base64!", ""]},
                {"size": chunkfmt.BLOCK, "checks": [7, ""]}, ["x"], "x"]:
        body["blocks"] = bad
        with pytest.raises(ManifestError, match="blocks|block checks|base64"):
            Manifest.from_bytes(head + b"\n" + json.dumps(body).encode(), where="m")


def test_a_manifest_copy_whose_bits_rotted_is_refused_even_when_it_parses() -> None:
    """Every line carries a check: one flipped bit anywhere (a chunk's name still a name, a size still
    a number) makes the copy unreadable, so readers, gc and scrub take another. A flip in the body
    leaves the summary readable (a listing reads only that line). A manifest written before the checks
    (neither key) loads; a line that lost one of its two keys, or whose trailer moved, is refused."""
    m = _manifest(tensor_index={"version": 1, "format": "safetensors", "tensors": [{"name": "w"}]})
    data = m.to_bytes()
    assert Manifest.from_bytes(data) == m
    head_len = data.index(b"\n")
    rng = random.Random(7)
    flips = 0
    for at in sorted(rng.sample(range(len(data)), 300)) + [head_len - 3, head_len + 5, len(data) - 2]:
        for bit in (0, 1, 5):
            bad = bytearray(data)
            bad[at] ^= 1 << bit
            if bad[at] == ord("\n"):
                continue
            flips += 1
            with pytest.raises(ManifestError, match="where"):
                Manifest.from_bytes(bytes(bad), where="where")
            if at > head_len:
                assert Summary.from_bytes(bytes(bad)) == m.summary
            else:
                with pytest.raises(ManifestError):
                    Summary.from_bytes(bytes(bad))
    assert flips > 800
    head, body = data.split(b"\n")
    older = json.dumps(_unchecked(head), separators=(",", ":")).encode() + b"\n" + body
    assert Manifest.from_bytes(older) == m
    doc = json.loads(head)
    for lost in ("check", "body_check"):
        one = {k: v for k, v in doc.items() if k != lost}
        with pytest.raises(ManifestError, match="check"):
            Manifest.from_bytes(json.dumps(one, separators=(",", ":")).encode() + b"\n" + body)
    moved = {"check": doc["check"], **{k: v for k, v in doc.items() if k != "check"}}
    with pytest.raises(ManifestError, match="check"):
        Manifest.from_bytes(json.dumps(moved, separators=(",", ":")).encode() + b"\n" + body)


def _unchecked(head: bytes) -> dict:
    """A summary line without its checks, as manifests were written before them (so that a test can
    change the body, or the fields, and reach the checks of the fields)."""
    doc = json.loads(head)
    del doc["check"], doc["body_check"]
    return doc


def _doc() -> dict:
    """A manifest as one JSON document (the summary line and the body merged; format 1 reads so too)."""
    head, body = _manifest().to_bytes().split(b"\n")
    return {**json.loads(body), **_unchecked(head)}


def _mutations():
    def drop(key):
        return lambda d: d.pop(key)

    def chunk(i, value):
        def f(d):
            d["chunks"][0][i] = value
        return f

    return {
        "size-mismatch": lambda d: d.update(size=d["size"] + 1),
        "chunk-shorter": chunk(1, 99),
        "bad-hash-short": chunk(0, "abc"),
        "bad-hash-upper": chunk(0, _digest(0).upper()),
        "bad-hash-type": chunk(0, 12),
        "zero-length-chunk": chunk(1, 0),
        "bad-codec": chunk(3, "zstd"),
        "no-stores": chunk(4, []),
        "entry-too-short": lambda d: d["chunks"][0].pop(),
        "entry-not-list": lambda d: d["chunks"].__setitem__(0, 7),
        "missing-format": drop("format"),
        "missing-path": drop("path"),
        "missing-size": drop("size"),
        "missing-chunks": drop("chunks"),
        "missing-version": drop("version"),
        "format-3": lambda d: d.update(format=3),
        "format-str": lambda d: d.update(format="1"),
        "size-str": lambda d: d.update(size="lots"),
        "path-dotdot": lambda d: d.update(path="/a/../b"),
        "path-root": lambda d: d.update(path="/"),
        "index-not-object": lambda d: d.update(tensor_index=[1, 2]),
        "mode-directory": lambda d: d.update(mode=0o40755),
        # Out-of-range or mistyped numbers once crashed a whole folder's listing: each is refused.
        "size-huge": lambda d: d.update(size=2**64, chunks=[]),
        "size-negative": lambda d: d.update(size=-1, chunks=[]),
        "size-float": lambda d: d.update(size=float(d["size"])),
        "size-bool": lambda d: d.update(size=True, chunks=[]),
        "mtime-huge": lambda d: d.update(mtime_ns=2**70),
        "version-negative": lambda d: d.update(version=-5),
        "chunk-size-zero": lambda d: d.update(chunk_size=0),
        "chunk-huge": chunk(1, 2**40),
        "stored-much-longer-than-raw": chunk(2, 10**6),
        "duplicate-stores": chunk(4, ["s0", "s0"]),
        "state-unknown": lambda d: d.update(state="maybe"),
        "writer-not-hex": lambda d: d.update(writer="../x"),
        "reason-not-text": lambda d: d.update(reason=7),
    }


@pytest.mark.parametrize("name", list(_mutations()))
def test_malformed_manifest(name: str) -> None:
    """Every inconsistency raises ManifestError naming where the manifest came from."""
    doc = _doc()
    _mutations()[name](doc)
    with pytest.raises(ManifestError, match="store 's1' manifests/x"):
        Manifest.from_bytes(json.dumps(doc).encode(), where="store 's1' manifests/x")


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[]", b"null", b"42", b'"text"'])
def test_manifest_not_a_json_object(data: bytes) -> None:
    """Bytes that are not a JSON object raise ManifestError, never a raw exception."""
    with pytest.raises(ManifestError):
        Manifest.from_bytes(data)


def test_chunk_at_and_range_with_variable_chunks() -> None:
    """chunk_at/chunk_range follow the real chunk lengths, not chunk_size."""
    m = _manifest(lengths=(100, 50, 200, 1))    # offsets 0, 100, 150, 350, end 351
    assert m.offsets == [0, 100, 150, 350, 351]
    assert [m.chunk_at(o) for o in (0, 99, 100, 149, 150, 349, 350)] == [0, 0, 1, 1, 2, 2, 3]
    assert m.chunk_range(0, 1) == range(0, 1)
    assert m.chunk_range(99, 2) == range(0, 2)
    assert m.chunk_range(100, 50) == range(1, 2)
    assert m.chunk_range(100, 51) == range(1, 3)
    assert m.chunk_range(0, 351) == range(0, 4)
    assert m.chunk_range(300, 10_000) == range(2, 4)    # clipped at the end of the file
    assert m.chunk_range(351, 10) == range(0)           # at EOF
    assert m.chunk_range(10, 0) == range(0)
    assert _manifest(lengths=()).chunk_range(0, 10) == range(0)


@pytest.mark.parametrize("raw, norm", [
    ("a", "/a"), ("/a", "/a"), ("a/b", "/a/b"), ("/a//b/", "/a/b"), ("./a/./b/.", "/a/b"),
    ("/run 1/step_100.pt", "/run 1/step_100.pt"), ("//x", "/x"),
])
def test_normalize_path(raw: str, norm: str) -> None:
    """Paths become absolute, without '.', empty components or trailing '/'."""
    assert normalize_path(raw) == norm


@pytest.mark.parametrize("bad", ["", "/", ".", "//./", "..", "/a/../b", "a/..", "a\0b", None, 5])
def test_normalize_path_refuses(bad) -> None:
    """The root, '..' components, NUL bytes and non-strings are refused."""
    with pytest.raises(ManifestError):
        normalize_path(bad)


def test_manifest_key_and_parents() -> None:
    """Manifest keys are stable per path and distinct between paths; parent_dirs lists the folders."""
    assert path_hash("/a/b") == path_hash("/a/b") != path_hash("/a/c")
    assert len(path_hash("/a/b")) == 40
    assert parent_dirs("/a/b/c.pt") == ["/a", "/a/b"]
    assert parent_dirs("/c.pt") == []


# ---- placement ------------------------------------------------------------------------------------------

def test_placement_spread() -> None:
    """3000 chunks over 4 stores, 2 replicas: 2 distinct stores each, every store holds 50% +- 5%."""
    stores = ["nvme0", "nvme1", "nvme2", "nvme3"]
    digests = [_digest(i) for i in range(3000)]
    per_store: Counter[str] = Counter()
    for d in digests:
        chosen = place(d, stores, 2)
        assert len(chosen) == 2 and len(set(chosen)) == 2 and set(chosen) <= set(stores)
        per_store.update(chosen)
    for s in stores:
        assert 0.45 <= per_store[s] / len(digests) <= 0.55, per_store


def test_placement_deterministic_and_stable() -> None:
    """The same chunk always lands on the same stores, whatever the order of the store list;
    adding a store moves a chunk only onto the new store."""
    stores = ["a", "b", "c", "d"]
    for i in range(500):
        d = _digest(i)
        first = place(d, stores, 2)
        assert place(d, stores, 2) == first
        assert place(d, list(reversed(stores)), 2) == first
        assert place(d, stores, 1) == first[:1]
        grown = place(d, stores + ["e"], 2)
        assert set(grown) - set(first) <= {"e"}
    with pytest.raises(ValueError):
        place(_digest(0), ["a"], 2)


# ---- chunking -------------------------------------------------------------------------------------------

def _check_cover(spans: list[tuple[int, int]], size: int, chunk_size: int) -> None:
    pos = 0
    for off, ln in spans:
        assert off == pos and 0 < ln <= chunk_size
        pos += ln
    assert pos == size


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 12_345])
def test_cut_without_boundaries(size: int) -> None:
    """Without boundaries, cuts are fixed-size and cover the file exactly."""
    spans = cut(size, 1000)
    _check_cover(spans, size, 1000)
    assert all(ln == 1000 for _, ln in spans[:-1])


def test_cut_falls_on_tensor_boundaries() -> None:
    """Every large tensor starts and ends on a cut; no chunk exceeds chunk_size; the file is covered."""
    chunk_size = 1 << 20
    rng = random.Random(3)
    for _ in range(50):
        tensors, pos = [], rng.randrange(0, 5000)
        for i in range(rng.randrange(1, 30)):
            length = rng.choice([rng.randrange(1, 1000), rng.randrange(chunk_size // 8, 5 * chunk_size)])
            tensors.append(TensorEntry(f"t{i}", "BF16", (length // 2,), (1,), str(i), pos, length))
            pos += length + rng.randrange(0, 200)
        size = pos + rng.randrange(0, 3000)
        index = TensorIndex("safetensors", (), tuple(tensors), size)
        bounds = tensor_boundaries(index, chunk_size)
        spans = cut(size, chunk_size, bounds)
        _check_cover(spans, size, chunk_size)
        starts = {off for off, _ in spans} | {size}
        for t in tensors:
            if t.length >= chunk_size // 8:
                assert t.offset in starts and t.offset + t.length in starts, t
        assert tensor_boundaries(None, chunk_size) == []


def test_keep_freed_memory_makes_chunk_sized_objects_reuse_the_heap() -> None:
    """After keep_freed_memory (glibc), encoding chunk after chunk reuses freed memory: a child python
    encodes 64 chunks of 4 MiB and sees a fraction of the page faults it sees without (each fault is
    a zeroed page; on this VM, memory handed back to the host costs ~1.5 s/GiB to touch again)."""
    import subprocess
    import sys

    code = ("import os, resource, sys\nfrom cpfs import buffers, chunk\n"
            "if sys.argv[1] == 'keep': assert buffers.keep_freed_memory()\n"
            "data = [os.urandom(4 << 20) for _ in range(4)]\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for i in range(64):\n    enc = chunk.encode(data[i % 4]); del enc\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    faults = {mode: int(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("keep", "default")}
    assert faults["keep"] * 4 < faults["default"], faults
