"""The chunk format: content-addressed, checksummed, optionally lz4-compressed.

A chunk's name is the BLAKE3 hash of its raw bytes, so identical data is stored once. On a store a
chunk is a 32-byte header followed by the payload:

    magic  b"CPFC"   4 bytes
    version          1 byte   (2; 1 is still read)
    codec            1 byte   (0 = raw, 1 = lz4 block)
    reserved         2 bytes
    raw length       8 bytes  little-endian
    payload length   8 bytes
    check            8 bytes  version 2: XXH3-64 of the raw bytes, seeded with the name's first 64 bits
                              (version 1: zero)

Every read checks the raw bytes against the name. Recomputing BLAKE3 did that at ~3 GiB/s on this
machine's cores: a third of the daemon's CPU on a cold load. The check word does it at ~30 GiB/s, and
keeps what a read must prove. A flipped or lost byte anywhere in the chunk changes the XXH3 or the
header (a miss is 2**-64). The seed ties the check to the name: another chunk's object, served under
this name by a misdirected write, a stale index or a bug, fails too, although its own check matches its
own bytes. What a 64-bit non-cryptographic check does not stop is a store that forges chunks on
purpose. `decode(..., full=True)` recomputes BLAKE3 as well: scrub does that, so a deliberately wrong
copy is found there.

Block checks: the XXH3-64 of each BLOCK of a chunk's raw bytes, seeded with the name's seed plus the
block's number, recorded in the manifest (not in the chunk: the stored format is unchanged, and a
ranged read needs no second request for a table). With them a reader that needs a few pages of a raw
chunk reads the blocks around them (`Store.get_range`) and checks those alone: a host that reclaims
scattered pages of a loaded checkpoint from the kernel's page cache then costs a block per lost page,
not a whole chunk. The seed ties a block to its name and place, as the check word does.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3
import lz4.block
import xxhash

from .errors import CorruptChunk

MAGIC = b"CPFC"
VERSION = 2
VERSIONS = (1, 2)
CODEC_RAW = 0
CODEC_LZ4 = 1
CODECS = {"raw": CODEC_RAW, "lz4": CODEC_LZ4}
CODEC_NAMES = {v: k for k, v in CODECS.items()}
_HEADER = struct.Struct("<4sBBHQQQ")
HEADER_SIZE = _HEADER.size
# lz4 must save at least this fraction to be worth a decompression on every read.
MIN_SAVING = 1 / 16
# Trained weights do not compress (lz4 saves < 1% on fp32 or bf16 mantissas) and lz4 runs at only
# ~0.7 GiB/s over them, 1.4 CPU-s per GiB saved for nothing. So a chunk larger than PROBES * PROBE
# bytes is compressed only if one of PROBES samples spread over it shrinks by MIN_SAVING: zeros,
# optimizer states at init, integer tensors and pickles do; sampling costs 1/16 of a 2 MiB chunk.
PROBE = 16 * 1024
PROBES = 8
BLOCK = 256 * 1024     # bytes per block check (64 KiB would cost the manifest 128 KiB per GiB)
_WORD = struct.Struct("<Q")
BLOCK_CHECK_SIZE = _WORD.size   # bytes per block check in a manifest
# An lz4 block never expands more than this (255 bytes of match per byte), so a larger raw length is a
# corrupt header, not a reason to allocate gigabytes.
LZ4_MAX_RATIO = 255


def chunk_hash(data: bytes | memoryview) -> str:
    """Hex BLAKE3 of raw bytes: ~9 GB/s on one core here (sha256: ~2 GB/s), and it drops the GIL."""
    return blake3.blake3(data).hexdigest()


def chunk_check(raw: bytes | memoryview, digest: str) -> int:
    """The header's check word: XXH3-64 of the raw bytes, seeded with the name (see the module doc)."""
    return xxhash.xxh3_64_intdigest(raw, seed=int(digest[:16], 16))


def block_checks(raw: bytes | memoryview, digest: str, first: int = 0) -> bytes:
    """The block checks of raw bytes that start at block `first` of their chunk: one little-endian
    XXH3-64 per BLOCK (the last may be short)."""
    view, seed = memoryview(raw), int(digest[:16], 16) + first
    return b"".join(_WORD.pack(xxhash.xxh3_64_intdigest(view[o:o + BLOCK], seed=(seed + o // BLOCK) % 2**64))
                    for o in range(0, len(view), BLOCK))


def differing_blocks(a: bytes, b: bytes) -> list[int]:
    """The places of the checks that differ between two runs of block checks (one missing differs)."""
    w = BLOCK_CHECK_SIZE
    return [k for k in range(-(-max(len(a), len(b)) // w)) if a[k * w:(k + 1) * w] != b[k * w:(k + 1) * w]]


def check_blocks(data: bytes | memoryview, digest: str, checks: bytes, first: int) -> None:
    """Raise CorruptChunk unless `data` is blocks first, first+1, ... of the chunk, as `checks` records."""
    got = block_checks(data, digest, first)
    want = checks[first * BLOCK_CHECK_SIZE:first * BLOCK_CHECK_SIZE + len(got)]
    if got != want:
        b = first + differing_blocks(got, want)[0]
        raise CorruptChunk(f"chunk {digest[:16]}: block {b} does not match its check")


def chunk_key(digest: str) -> str:
    """Store key of a chunk; two-level fan-out keeps folders small on directory stores."""
    return f"chunks/{digest[:2]}/{digest}"


@dataclass(frozen=True)
class EncodedChunk:
    digest: str
    raw_len: int
    codec: str
    blob: bytes | bytearray | memoryview    # header + payload, as stored
    blocks: bytes = b""                     # block checks of the raw bytes (block_checks)

    @property
    def stored_len(self) -> int:
        return len(self.blob)


def encode(data: bytes | memoryview, compression: str = "lz4", digest: str | None = None) -> EncodedChunk:
    """Hash and (if it pays) compress raw bytes. Blocking: call from a worker thread."""
    return _encode(memoryview(data), compression, digest, None)


def encode_framed(framed: bytearray | memoryview, compression: str = "lz4") -> EncodedChunk:
    """`encode` of the raw bytes that follow HEADER_SIZE spare bytes in `framed`. A chunk kept raw (trained
    weights do not compress) is then stored from `framed` itself, its header written in place: no copy of
    its bytes, where `encode` copies them twice (~0.2 CPU-s per GiB saved)."""
    return _encode(memoryview(framed)[HEADER_SIZE:], compression, None, framed)


def _encode(raw: memoryview, compression: str, digest: str | None,
            framed: bytearray | memoryview | None) -> EncodedChunk:
    digest = digest or chunk_hash(raw)
    payload: bytes | memoryview = raw
    codec = CODEC_RAW
    if compression == "lz4" and len(raw) and _compressible(raw):
        packed = lz4.block.compress(raw, store_size=False)
        if len(packed) <= len(raw) * (1 - MIN_SAVING):
            payload, codec = packed, CODEC_LZ4
    header = _HEADER.pack(MAGIC, VERSION, codec, 0, len(raw), len(payload), chunk_check(raw, digest))
    blocks = block_checks(raw, digest)
    if codec == CODEC_RAW and framed is not None:
        framed[:HEADER_SIZE] = header
        return EncodedChunk(digest, len(raw), CODEC_NAMES[codec], framed, blocks)
    return EncodedChunk(digest, len(raw), CODEC_NAMES[codec], header + bytes(payload), blocks)


def _compressible(raw: memoryview) -> bool:
    """Whether some sample of the chunk shrinks by MIN_SAVING under lz4 (see PROBE)."""
    if len(raw) <= PROBES * PROBE:
        return True
    step = (len(raw) - PROBE) // (PROBES - 1)
    limit = PROBE * (1 - MIN_SAVING)
    return any(len(lz4.block.compress(raw[i * step:i * step + PROBE], store_size=False)) <= limit
               for i in range(PROBES))


def decode(blob: bytes | memoryview, digest: str, full: bool = False) -> bytes | memoryview:
    """Raw bytes of a stored chunk, verified against its name: by the check word, and with `full` (or
    for a version 1 chunk, which has none) by recomputing BLAKE3. Blocking: call from a worker thread."""
    if len(blob) < HEADER_SIZE:
        raise CorruptChunk(f"chunk {digest[:16]}: {len(blob)} bytes is shorter than its header")
    magic, version, codec, reserved, raw_len, payload_len, check = _HEADER.unpack_from(blob)
    if magic != MAGIC or version not in VERSIONS:
        raise CorruptChunk(f"chunk {digest[:16]}: bad magic or version ({magic!r}, {version})")
    if reserved or (version == 1 and check):
        raise CorruptChunk(f"chunk {digest[:16]}: reserved header bytes are not zero")
    if payload_len != len(blob) - HEADER_SIZE:
        raise CorruptChunk(f"chunk {digest[:16]}: payload is {len(blob) - HEADER_SIZE} bytes, "
                           f"header says {payload_len}")
    payload = memoryview(blob)[HEADER_SIZE:]
    if codec == CODEC_LZ4:
        if raw_len > LZ4_MAX_RATIO * payload_len:
            raise CorruptChunk(f"chunk {digest[:16]}: raw length {raw_len} is impossible for a "
                               f"{payload_len}-byte lz4 payload")
        try:
            raw = lz4.block.decompress(payload, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as e:
            raise CorruptChunk(f"chunk {digest[:16]}: lz4 payload does not decompress: {e}") from None
    elif codec == CODEC_RAW:
        raw = payload                     # no copy: the cache holds the stored blob
    else:
        raise CorruptChunk(f"chunk {digest[:16]}: unknown codec {codec}")
    if len(raw) != raw_len:
        raise CorruptChunk(f"chunk {digest[:16]}: {len(raw)} raw bytes, header says {raw_len}")
    if version >= 2 and chunk_check(raw, digest) != check:
        raise CorruptChunk(f"chunk {digest[:16]}: check word mismatch (the bytes are not this chunk's)")
    if (full or version == 1) and chunk_hash(raw) != digest:
        raise CorruptChunk(f"chunk {digest[:16]}: content hash mismatch")
    return raw
