"""Whether a checkpoint file's bytes reach its end: the writer's guard against committing half a save.

A saver killed mid-save (or a disk that filled up under it) still closes its file: the kernel does it
for a dead process, and close commits. For most files that is POSIX and right. For a checkpoint it
replaces a good version with one that no loader can open, so the writer asks `incomplete_reason`
first and records such bytes as a failed version instead (see cpfs/writer.py).

The formats say where they end, so the check reads only headers and the tail, never the data:
- a zip (torch.save, numpy.savez: it starts with a local header, b"PK\\x03\\x04") is complete once its
  end-of-central-directory record ends the file, the central directory it points at fits before
  that record (the directory is what a zip writer writes last), and every member the directory names
  is there: its local header, and its data's CRC (in the header, or in the data descriptor after the
  data) as the directory has it. A save into a file opened "r+b" that was cut short leaves the old
  directory at the end, over members it no longer describes (the ML workflows audit's find);
- safetensors (an 8-byte little-endian header length N, then a JSON object of N bytes) is complete
  once the header is whole and the file reaches the largest `data_offsets` end the header names.
- torch.save's legacy format (`_use_new_zipfile_serialization=False`: five pickles, the magic number
  first, then each storage as an 8-byte element count and its bytes) is complete once the five
  pickles are whole and the file reaches the end of the storages the object's persistent ids size. A
  legacy save killed midway committed ok, and a few of them retired the last good version from
  `keep_versions` (the ML workflows audit's find). An object pickle the indexer's machine cannot read
  leaves the file unjudged.
- numpy's .npy (`numpy.save`, `open_memmap`: b"\\x93NUMPY", a version, a header length, then a dict
  literal with the dtype and shape) is complete once the header is whole and the file reaches the end
  of the shape's elements. A killed np.save committed ok before (noticed by the ML workflows audit); an
  object array (pickled after the header) or a dtype this module does not size is not judged, nor a
  file that holds its header alone: `open_memmap(mode="w+")` writes and closes that, then extends
  the file by a mapping (its saves failed: the completeness audit).
- a pickle file (named *.pkl, *.pickle, *.pck, *.pcl, or dcp's `.metadata`; `pickle.dump`,
  `joblib.dump`, at protocol 4, Python's default, or 5: PROTO, then a FRAME and its length) is complete
  once it ends with STOP (b"."), its last byte: a writer killed between two frames or inside a large
  object leaves another byte there but for about 1 cut in 100. A file of several pickles back to back
  ends with the last one's STOP. By name only: a pickle followed by other bytes (a pickled header,
  then `np.save` or raw data into the same file) is a format of its own, and its saves failed
  (the completeness audit). Protocols 2 and 3 (no frames) are not judged, but for torch's legacy
  format above, which is recognised at any protocol by its first pickle, torch's magic number.
Anything else (or bytes that only look like those formats at the first byte) is not judged: None.
"""
from __future__ import annotations

import ast
import io
import json
import math
import re
import pickletools
import struct
from collections.abc import Callable

from .tensor_index import MAX_PICKLE, MAX_SAFETENSORS_HEADER, _Malformed, _zip_directory, central_entries, storage_sizes

ReadAt = Callable[[int, int], bytes]

_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_CENTRAL = b"PK\x01\x02"
_ZIP_DESCRIPTOR = b"PK\x07\x08"
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."   # pickle of torch's 0x1950a86a20f9469cfc6c
_NPY_MAGIC = b"\x93NUMPY"
_NPY_HEADER_MAX = 1 << 20                # numpy's own reader stops at 10 KB unless told otherwise
_NPY_SCALAR = re.compile(r"[<>|=]?([biufcmMSUV])(\d*)(\[\w+\])?")
_PICKLE_FRAMED = (b"\x80\x04\x95", b"\x80\x05\x95")   # PROTO 4 or 5, then FRAME
_PICKLE_NAMES = (".pkl", ".pickle", ".pck", ".pcl")
_LEGACY_FRAMED_MAGIC = _LEGACY_MAGIC[2:]     # LONG1 of torch's magic number and STOP, inside a first FRAME
_PICKLE_FRAME_MAX = 1 << 20             # pickle's frames aim at 64 KiB; larger objects go between them
_STRINGS = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BINSTRING", "SHORT_BINSTRING"}


def incomplete_reason(read_at: ReadAt, size: int, name: str = "") -> str | None:
    """Why these `size` bytes are an incomplete checkpoint (see the module doc for the formats); None
    if they are complete, or not one of those formats. `name`: the file's path (pickles are judged by
    name too). Blocking (reads through `read_at`): run it in a thread."""
    head = read_at(0, min(size, 9))     # no more: write-behind may drop what the checks do not read
    if head[:4] == _ZIP_LOCAL:
        return _zip_reason(read_at, size)
    if head[:6] == _NPY_MAGIC:
        return _npy_reason(read_at, size)
    if head[:4] == _LEGACY_MAGIC[:4] and read_at(0, min(size, len(_LEGACY_MAGIC))) == _LEGACY_MAGIC:
        return _legacy_reason(read_at, size)
    if len(head) == 9 and head[8:9] == b"{":
        return _safetensors_reason(read_at, size, struct.unpack_from("<Q", head)[0])
    if head[:3] in _PICKLE_FRAMED:       # after safetensors: a pickle has no "{" at byte 8 (a length byte)
        if read_at(11, len(_LEGACY_FRAMED_MAGIC)) == _LEGACY_FRAMED_MAGIC:
            return _legacy_reason(read_at, size)        # torch.save(..., pickle_protocol=4 or 5), legacy
        base = name.rsplit("/", 1)[-1]
        if base.endswith(_PICKLE_NAMES) or base == ".metadata":
            return _pickle_reason(read_at, size)
    return None


def _zip_reason(read_at: ReadAt, size: int) -> str | None:
    try:
        cd_offset, cd_size, count, base = _zip_directory(read_at, size)
    except _Malformed as e:
        return f"zip of {size} bytes: {e} (the writer stopped before the end)"
    if count and read_at(cd_offset, 4) != _ZIP_CENTRAL:
        return f"zip of {size} bytes: no central directory at offset {cd_offset}, where its end record says"
    return _members_reason(read_at, size, cd_offset, cd_size, count, base)


def _members_reason(read_at: ReadAt, size: int, cd_offset: int, cd_size: int, count: int,
                    base: int) -> str | None:
    """Whether every entry of the directory finds its member: a local header with its name, and data
    whose CRC is the directory's. Bytes cut off mid-save end a zip only by chance (after other data:
    torch.distributed.checkpoint's back-to-back torch.save items), and then not one whose members are
    all where it says; a save over an old file in place ("r+b") cut short keeps the old directory, and
    the members it rewrote carry other CRCs. Two small reads per member."""
    try:
        for e in central_entries(read_at(cd_offset, cd_size), count):
            at = base + e.local
            head = read_at(at, 30 + len(e.name))
            if head[:4] != _ZIP_LOCAL or head[30:] != e.name:
                return f"zip of {size} bytes: no local header of {e.name!r} at offset {at}, where its directory says"
            if e.flags & 8:             # sizes and CRC in a data descriptor after the data (torch.save)
                nlen, elen = struct.unpack_from("<HH", head, 26)
                tail = read_at(at + 30 + nlen + elen + e.comp, 8)
                crc = tail[4:8] if tail[:4] == _ZIP_DESCRIPTOR else tail[:4]
            else:
                crc = head[14:18]
            if len(crc) < 4 or struct.unpack("<I", crc)[0] != e.crc:
                return (f"zip of {size} bytes: member {e.name!r} at offset {at} is not the one its directory "
                        f"describes (another CRC): a save over the file in place that stopped before the end")
    except (_Malformed, struct.error) as e:
        return f"zip of {size} bytes: {e} at offset {cd_offset}"
    return None


def _legacy_reason(read_at: ReadAt, size: int) -> str | None:
    """See the module doc: the five pickles, then sum(8 + numel x itemsize) bytes of storages. The
    pickles are read from a 64 KiB head that grows 4x until they fit (or MAX_PICKLE is passed)."""
    want = 1 << 16
    while True:
        head = read_at(0, min(size, want))
        f = io.BytesIO(head)
        spans: list[tuple[int, int]] = []
        try:
            for _ in range(5):
                start = f.tell()
                keys = [arg for op, arg, _ in pickletools.genops(f) if op.name in _STRINGS]
                spans.append((start, f.tell()))
            break
        except ValueError:              # a pickle ran out before its STOP
            if len(head) >= size:
                return f"legacy torch file of {size} bytes: cut inside its pickles (at pickle {len(spans) + 1} of 5)"
            if want > MAX_PICKLE:
                return None             # longer than we read: not judged
            want *= 4
    start, end = spans[3]
    nbytes = storage_sizes(head[start:end])
    if set(nbytes) != set(keys):        # keys: the fifth pickle's, the storages written after it
        return None                     # an object pickle the machine cannot read: not judged
    want = spans[4][1] + sum(8 + n for n in nbytes.values())
    if size < want:
        return f"legacy torch file of {size} bytes: its {len(keys)} storages end at byte {want}"
    return None


def _safetensors_reason(read_at: ReadAt, size: int, n: int) -> str | None:
    if not 0 < n <= MAX_SAFETENSORS_HEADER:
        return None            # byte 8 is "{" by chance: not safetensors
    if 8 + n > size:
        return f"safetensors of {size} bytes: its header is {n} bytes long but only {size - 8} follow"
    try:
        header = json.loads(read_at(8, n))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None            # a whole header that is not JSON: not safetensors after all
    if not isinstance(header, dict):
        return None
    end = 0
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) and name != "__metadata__" else None
        if isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets):
            end = max(end, offsets[1])
    if 8 + n + end > size:
        return f"safetensors of {size} bytes: its tensors end at byte {8 + n + end}"
    return None


def _pickle_reason(read_at: ReadAt, size: int) -> str | None:
    """PROTO 4/5, FRAME and the first frame's 8-byte length (one no pickle writes: not judged), then
    the last byte, which a whole pickle's STOP is."""
    head = read_at(0, min(size, 11))
    if len(head) < 11:
        return f"pickle of {size} bytes: cut inside its first frame's header"
    n = int.from_bytes(head[3:11], "little")
    if n > _PICKLE_FRAME_MAX:
        return None
    if size < 11 + n:
        return f"pickle of {size} bytes: its first frame ends at byte {11 + n}"
    if read_at(size - 1, 1) != b".":
        return f"pickle of {size} bytes: its last byte is not STOP (b'.'): the writer stopped before the end"
    return None


def _npy_reason(read_at: ReadAt, size: int) -> str | None:
    """numpy.lib.format: 6 magic bytes, major and minor version, the header's length (2 bytes in
    version 1, 4 after), the header, then the elements: itemsize x prod(shape) bytes."""
    head = read_at(0, min(size, 12))
    if len(head) < 8 or head[6] not in (1, 2, 3):
        return None if len(head) >= 8 else f"npy file of {size} bytes: cut inside its preamble"
    width = 2 if head[6] == 1 else 4
    if len(head) < 8 + width:
        return f"npy file of {size} bytes: cut inside its preamble"
    n = int.from_bytes(head[8:8 + width], "little")
    start = 8 + width + n
    if n > _NPY_HEADER_MAX:
        return None
    if start > size:
        return f"npy file of {size} bytes: its header is {n} bytes long but only {size - 8 - width} follow"
    try:
        header = ast.literal_eval(read_at(8 + width, n).decode("utf8" if head[6] == 3 else "latin1"))
        shape, itemsize = header["shape"], _npy_itemsize(header["descr"])
    except (ValueError, SyntaxError, TypeError, KeyError, MemoryError, RecursionError, UnicodeDecodeError):
        return None             # not a header numpy wrote: not judged
    if itemsize is None or not isinstance(shape, tuple) or not all(type(x) is int and x >= 0 for x in shape):
        return None
    want = start + itemsize * math.prod(shape)
    if size == start:
        return None             # the header alone: open_memmap's first close (see the module doc)
    if size < want:
        return f"npy file of {size} bytes: its {math.prod(shape)} elements end at byte {want}"
    return None


def _npy_itemsize(descr: object) -> int | None:
    """Bytes per element of a numpy dtype description (numpy.lib.format's `descr`): a type string such
    as '<f4', '|S10' or '<M8[ns]', or a structured list of (name, descr[, shape]) fields. None for what
    has no fixed size here (objects: '|O', pickled) and anything unknown."""
    if isinstance(descr, str):
        m = _NPY_SCALAR.fullmatch(descr)
        if m is None:
            return None
        kind, n = m.group(1), int(m.group(2) or 0)
        if kind in "mM" and not m.group(3) or kind not in "mM" and m.group(3):
            return None
        return n * 4 if kind == "U" else n
    if isinstance(descr, list):
        total = 0
        for field in descr:
            if not isinstance(field, tuple) or len(field) not in (2, 3):
                return None
            size = _npy_itemsize(field[1])
            shape = field[2] if len(field) == 3 else ()
            if isinstance(shape, int):
                shape = (shape,)
            if size is None or not isinstance(shape, tuple) or not all(type(x) is int and x >= 0 for x in shape):
                return None
            total += size * math.prod(shape)
        return total
    return None
