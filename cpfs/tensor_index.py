"""Tensor index: where each tensor's bytes live inside a checkpoint file.

The readahead scheduler uses it to fetch bytes in the order ``torch.load`` reads
them, and the chunker uses it to cut chunks at tensor boundaries. It is only a
hint, so anything unexpected yields ``None`` instead of an exception. Torch
checkpoints (and torch.distributed.checkpoint's `.distcp` files: a torch.save per item, back to
back, format ``torch-dcp``) are parsed without importing torch and without running pickle code:
the zip is read with ``struct`` and ``data.pkl`` is interpreted opcode by opcode
over inert stubs, with allow-listed globals only. The work and memory it takes
are bounded per byte of input; a file over budget is left unindexed (a warning),
never waited for. Callers run it in a worker thread.
"""
from __future__ import annotations

import bisect
import functools
import json
import logging
import os
import pickletools
import struct
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple

log = logging.getLogger(__name__)

ReadAt = Callable[[int, int], bytes]

_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16,
    "complex64": 8, "complex32": 4, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}
_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "UntypedStorage": "uint8",
}
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64", "C128": "complex128", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
_FORMATS = ("torch-zip", "safetensors", "torch-dcp")
_MAX_DCP_ITEMS = 1 << 20   # torch.save zips back to back in one file (torch-dcp)
# torch-dcp keeps an item's small records out of its index (hundreds of items, seven records each):
# the smallest chunk_size (64 KiB) cuts no record under an eighth of it, and nothing else reads them.
_DCP_KEEP = 8 * 1024
# Caps keep a hostile file from making the indexer allocate or loop without bound.
MAX_PICKLE = 64 << 20
_MAX_CENTRAL_DIR = 64 << 20
MAX_SAFETENSORS_HEADER = 100 << 20
EOCD_SEARCH = 4096       # torch's zip reader (miniz) first reads this much of the file's end, for the end record
# data.pkl work, in budget units (see _Budget): at most so many per byte of pickle, plus a slack,
# and never more than the cap. torch.save spends ~32 opcodes (~100 bytes) per tensor, so the caps
# index ~500,000 tensors (a large MoE model with its optimizer state); an opcode allocates at most
# ~65 bytes, so they also cap memory (~1 GB, reached only by a file of that many tensors).
_OPS_PER_BYTE = 64
_WALK_PER_BYTE = 64
_BUDGET_SLACK = 1 << 16
_MAX_PICKLE_OPS = 16_000_000
_MAX_WALK = 16_000_000
_ENTRY_COST = 8  # walk units per tensor name found: an index entry outweighs a step
_MAX_DEPTH = 200
_U32 = 0xFFFFFFFF
_I64 = 1 << 63


class _Malformed(Exception):
    """Internal: the file is not something we can index."""


@dataclass(frozen=True)
class Record:
    """One zip member (or the safetensors header); offset is where its data starts."""
    name: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorEntry:
    """One tensor view: state-dict path, layout, and the file bytes it spans."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_key: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorIndex:
    """Byte layout of one checkpoint file.

    ``tensors`` is in the order the loader materialises them (pickle order for
    torch, header order for safetensors). ``file_size``/``directory_offset``
    locate the zip tail (central directory to EOF) for :meth:`read_order`.
    """
    format: str
    records: tuple[Record, ...]
    tensors: tuple[TensorEntry, ...]
    file_size: int = 0
    directory_offset: int = 0

    def __post_init__(self) -> None:
        self._overlap_table  # build eagerly: first use is inside a FUSE read

    @functools.cached_property
    def _overlap_table(self) -> tuple[list[TensorEntry], list[int], list[int]]:
        """Non-empty tensors by offset, their starts, and the running max of their
        ends: lets tensors_overlapping bisect instead of scanning every entry."""
        ordered = sorted((t for t in self.tensors if t.length > 0),
                         key=lambda t: (t.offset, t.length))
        max_end, running = [], -1
        for t in ordered:
            running = max(running, t.offset + t.length)
            max_end.append(running)
        return ordered, [t.offset for t in ordered], max_end

    def to_json(self) -> dict:
        return {
            "version": 1, "format": self.format, "file_size": self.file_size,
            "directory_offset": self.directory_offset,
            "records": [{"name": r.name, "offset": r.offset, "length": r.length}
                        for r in self.records],
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                         "stride": list(t.stride), "storage_key": t.storage_key,
                         "offset": t.offset, "length": t.length} for t in self.tensors],
        }

    @classmethod
    def from_json(cls, d: dict) -> TensorIndex:
        try:
            if not isinstance(d, dict) or d.get("version") != 1:
                raise ValueError("not a version-1 tensor index")
            fmt = _typed(d["format"], str, "format")
            if fmt not in _FORMATS:
                raise ValueError(f"unknown format {fmt!r}")
            records = tuple(
                Record(_typed(r["name"], str, "name"), _nonneg(r["offset"]), _nonneg(r["length"]))
                for r in _typed(d["records"], list, "records"))
            tensors = []
            for t in _typed(d["tensors"], list, "tensors"):
                shape = tuple(_nonneg(x) for x in _typed(t["shape"], list, "shape"))
                stride = tuple(_nonneg(x) for x in _typed(t["stride"], list, "stride"))
                if len(shape) != len(stride):
                    raise ValueError("shape and stride differ in rank")
                tensors.append(TensorEntry(
                    _typed(t["name"], str, "name"), _typed(t["dtype"], str, "dtype"), shape,
                    stride, _typed(t["storage_key"], str, "storage_key"),
                    _nonneg(t["offset"]), _nonneg(t["length"])))
            return cls(fmt, records, tuple(tensors), _nonneg(d["file_size"]),
                       _nonneg(d["directory_offset"]))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed tensor index: {e!r}") from e

    def read_order(self) -> list[tuple[int, int]]:
        """Byte ranges (offset, length) in loader order; empty ranges are omitted."""
        if self.format == "safetensors":
            ranges = [(r.offset, r.length) for r in self.records]
            ranges += [(t.offset, t.length) for t in self._overlap_table[0]]
            return [r for r in ranges if r[1] > 0]
        if self.format == "torch-dcp":
            # Item by item in file order (the saver's state dict order), only the data: each item's zip
            # headers are read just before its data, and only for the items a load wants (no head).
            # dcp.load takes its items by sorted top-level key, which only `.metadata` holds: the
            # readahead follows its jumps between runs of the file.
            return [(r.offset, r.length) for r in self.records if _is_data(r.name) and r.length > 0]
        ranges = []
        if self.file_size > self.directory_offset:
            # The loader looks for the end record in the file's last EOCD_SEARCH bytes before it reads
            # the directory: when the directory is shorter, that read takes the last tensor's end too.
            start = min(self.directory_offset, max(0, self.file_size - EOCD_SEARCH))
            ranges.append((start, self.file_size - start))
        root = _torch_root(self.records)
        pkl = f"{root}/data.pkl"
        storages = {r.name[len(root) + 6:]: r for r in self.records
                    if r.name.startswith(f"{root}/data/")}
        ranges += [(r.offset, r.length) for r in self.records if r.name == pkl]
        ranges += [(r.offset, r.length) for r in self.records
                   if r.name != pkl and not r.name.startswith(f"{root}/data/")]
        for key in dict.fromkeys(t.storage_key for t in self.tensors):
            if key in storages:
                r = storages.pop(key)
                ranges.append((r.offset, r.length))
        ranges += [(r.offset, r.length) for r in storages.values()]
        return [r for r in ranges if r[1] > 0]

    def record_starts(self) -> list[int]:
        """Data offsets of non-empty storages (safetensors: tensors), for chunk cuts."""
        if self.format == "safetensors":
            return sorted({t.offset for t in self.tensors if t.length > 0})
        if self.format == "torch-dcp":
            return sorted({r.offset for r in self.records if _is_data(r.name) and r.length > 0})
        prefix = f"{_torch_root(self.records)}/data/"
        return sorted({r.offset for r in self.records
                       if r.name.startswith(prefix) and r.length > 0})

    def tensors_overlapping(self, offset: int, length: int) -> list[TensorEntry]:
        """Tensors intersecting [offset, offset+length), sorted by file offset."""
        if length <= 0:
            return []
        ordered, starts, max_end = self._overlap_table
        hi = bisect.bisect_left(starts, offset + length)
        lo = bisect.bisect_right(max_end, offset)  # first tensor that may reach offset
        return [t for t in ordered[lo:hi] if t.offset + t.length > offset]


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{what}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _nonneg(value: Any) -> int:
    """An int in [0, 2**63): what torch and zip64 can express; also bounds big-int math."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(f"expected a non-negative int64, got a {type(value).__name__}")
    return value


def _torch_root(records: tuple[Record, ...]) -> str:
    # torch names every member "<root>/..." and takes <root> from the first member.
    return records[0].name.split("/", 1)[0] if records else ""


def _read_exact(read_at: ReadAt, offset: int, length: int) -> bytes:
    """read_at may return short reads; loop, and treat EOF as malformed."""
    parts, got = [], 0
    while got < length:
        chunk = read_at(offset + got, length - got)
        if not chunk:
            raise _Malformed(f"short read at {offset + got}")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


# --- zip -------------------------------------------------------------------

class ZipEnd(NamedTuple):
    """What a zip's end records say: where its central directory is (in the file), how long it is,
    how many entries it has, and `base`, the bytes of other data before the zip. A zip's offsets count
    from its own start, and a zip may follow other data: torch.distributed.checkpoint's `.distcp` files
    are one torch.save per item, back to back, so their end records are the last item's."""
    cd_offset: int
    cd_size: int
    count: int
    base: int


def _zip_directory(read_at: ReadAt, size: int) -> ZipEnd:
    """The end records of the zip that ends the file, zip64-aware. Whether its central directory
    starts where they say is the caller's to check (`base` comes from where the end records are, as
    Python's zipfile finds a zip appended to other data: the directory is right before them)."""
    # An end record without a comment (torch's) is the last 22 bytes: read those first, and search the
    # tail a comment may take only if they are not one (torch-dcp looks for hundreds of end records).
    tail_len = min(size, 22)
    tail = _read_exact(read_at, size - tail_len, tail_len)
    pos = 0 if tail_len == 22 and tail[:4] == b"PK\x05\x06" and tail[20:22] == b"\0\0" else -1
    if pos < 0:
        tail_len = min(size, 22 + 0xFFFF)
        tail = _read_exact(read_at, size - tail_len, tail_len)
        # The end record is the last signature whose comment length reaches EOF exactly.
        pos = tail.rfind(b"PK\x05\x06")
        while pos >= 0 and (pos + 22 > tail_len or
                            pos + 22 + struct.unpack_from("<H", tail, pos + 20)[0] != tail_len):
            pos = tail.rfind(b"PK\x05\x06", 0, pos)
    if pos < 0:
        raise _Malformed("no end-of-central-directory record")
    eocd = size - tail_len + pos
    _, disk, cd_disk, _, count, cd_size, cd_offset, _ = struct.unpack_from("<IHHHHIIH", tail, pos)
    end = eocd                    # where the directory ends: the first end record
    if eocd >= 20:
        loc = _read_exact(read_at, eocd - 20, 20)
        if loc[:4] == b"PK\x06\x07":
            rec_off = struct.unpack_from("<Q", loc, 8)[0]       # from the zip's start
            # Right before the locator (every writer but one with zip64 extensible data), else where
            # the locator says, for a zip at the file's start.
            for rec_at in dict.fromkeys((eocd - 76, rec_off)):
                if 0 <= rec_off <= rec_at and _read_exact(read_at, rec_at, 4) == b"PK\x06\x06":
                    break
            else:
                raise _Malformed("bad zip64 end record")
            (_, _, _, _, disk, cd_disk, _, count, cd_size,
             cd_offset) = struct.unpack("<IQHHIIQQQQ", _read_exact(read_at, rec_at, 56))
            end = rec_at
    if disk or cd_disk:
        raise _Malformed("multi-disk zip")
    if cd_offset + cd_size > end or cd_size > _MAX_CENTRAL_DIR:
        raise _Malformed("central directory out of range")
    base = end - cd_size - cd_offset
    if base and (not count or (_read_exact(read_at, end - cd_size, 4) != b"PK\x01\x02"
                               and _read_exact(read_at, cd_offset, 4) == b"PK\x01\x02")):
        base = 0                  # a zip at the file's start with bytes between its directory and end
    return ZipEnd(base + cd_offset, cd_size, count, base)


def _zip_records(read_at: ReadAt, size: int) -> tuple[list[Record], int]:
    """Every member with its absolute data offset (from the LOCAL header, which
    torch pads with extra bytes for alignment), plus the directory offset."""
    cd_offset, cd_size, count, base = _zip_directory(read_at, size)
    if base:
        raise _Malformed(f"a zip after {base} bytes of other data (back-to-back torch.save items, as "
                         f"torch.distributed.checkpoint writes): one zip's index would miss the rest")
    records = []
    for e in central_entries(_read_exact(read_at, cd_offset, cd_size), count):
        if e.method != 0 or e.flags & 1:
            raise _Malformed("compressed or encrypted member")
        name = e.name.decode("utf-8" if e.flags & 0x800 else "cp437")
        header = _read_exact(read_at, e.local, 30)
        if header[:4] != b"PK\x03\x04":
            raise _Malformed(f"bad local header for {name}")
        lnlen, lelen = struct.unpack_from("<HH", header, 26)
        data = e.local + 30 + lnlen + lelen
        if data + e.comp > cd_offset:
            raise _Malformed(f"member {name} overruns the central directory")
        records.append(Record(name, data, e.comp))
    return records, cd_offset


class CentralEntry(NamedTuple):
    name: bytes          # raw
    flags: int
    method: int
    comp: int            # compressed size
    local: int           # local header offset from the zip's start
    crc: int             # CRC-32 of the member's data


def central_entries(cd: bytes, count: int) -> Iterator[CentralEntry]:
    """Each of the `count` entries of a central directory, zip64 sizes and offsets resolved."""
    pos = 0
    for _ in range(count):
        if cd[pos:pos + 4] != b"PK\x01\x02" or pos + 46 > len(cd):
            raise _Malformed("bad central directory entry")
        (_, _, _, flags, method, _, _, crc, comp, uncomp, nlen, elen, clen, _, _, _,
         local) = struct.unpack_from("<IHHHHHHIIIHHHHHII", cd, pos)
        raw_name = cd[pos + 46:pos + 46 + nlen]
        extra = cd[pos + 46 + nlen:pos + 46 + nlen + elen]
        pos += 46 + nlen + elen + clen
        _, comp, local = zip64_extra(extra, uncomp, comp, local)
        yield CentralEntry(raw_name, flags, method, comp, local, crc)


def zip64_extra(extra: bytes, uncomp: int, comp: int, local: int = 0) -> tuple[int, int, int]:
    """(uncompressed size, compressed size, local header offset) with 0xFFFFFFFF sentinels replaced by
    the zip64 extra field's 64-bit values. The extra holds, in this order, only the fields whose 32-bit
    slot is the sentinel; a value the extra lacks leaves its sentinel in place (callers reject it)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = list(struct.unpack_from(f"<{min(n, len(extra) - pos - 4) // 8}Q", extra, pos + 4))
            uncomp, comp, local = (values.pop(0) if v == _U32 and values else v for v in (uncomp, comp, local))
            break
        pos += 4 + n
    return uncomp, comp, local


# --- data.pkl: a bounded pickle interpreter ------------------------------------
#
# Invariant: nothing here hashes, compares, repr()s or str()s a container built from the file. The C
# unpickler hashes dict keys and set members as it builds them, and a key that is a tuple holding
# the same tuple twice, sixty levels deep, costs 2**60 hash steps (repr, str and == likewise): a
# 0.5 KB file would hold the GIL for ever. So pickletools.genops decodes the opcodes (it builds no
# objects) and the small stack machine below gives every value an inert representation: a dict is
# a flat [key, value, ...] list, a set keeps nothing, a global is a stub. Only str and int keys are
# ever hashed (linear in their size), when the walk names tensors. Every opcode and every walk step
# spends from a budget that grows with the pickle's size, so work and memory are bounded per byte.

class _GaveUp(_Malformed):
    """Internal: the pickle needs more work than its size allows, or an opcode we do not interpret.
    Unlike a plain malformed file this is worth a warning: a real checkpoint goes unindexed."""


class _Budget:
    """Units of work left. A unit is an opcode, an element a stub call copies, or a step of the
    tensor walk; a name the walk finds costs its length plus _ENTRY_COST."""
    __slots__ = ("left",)

    def __init__(self, data_len: int, per_byte: int, cap: int) -> None:
        self.left = min(per_byte * data_len + _BUDGET_SLACK, cap)

    def spend(self, units: int = 1) -> None:
        self.left -= units
        if self.left < 0:
            raise _GaveUp("work budget exceeded")


# Stubs are NamedTuples (immutable: a BUILD cannot rewrite them); containers are list subclasses.
class _DType(NamedTuple):
    name: str


class _StorageType(NamedTuple):
    dtype: str


class _Storage(NamedTuple):
    key: str
    dtype: str


class _Tensor(NamedTuple):
    """What a rebuild call produced; seq is its creation (= pickle) order."""
    storage: _Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    seq: int


class _Func(NamedTuple):
    """An allow-listed callable global; `kind` says what calling it builds."""
    kind: str


class _Dict(list):
    """A dict (or OrderedDict) as [key, value, key, value, ...]: building it hashes no key."""
    __slots__ = ()


class _Set(list):
    """A set or frozenset. Its members are dropped: unordered, so they get no tensor names."""
    __slots__ = ()


_OPAQUE = _Func("opaque")  # a value we keep no content of (torch.device, slice, encoded bytes)

_TORCH_UTILS = {"_rebuild_tensor_v2": "rebuild_v2", "_rebuild_tensor_v3": "rebuild_v3",
                "_rebuild_parameter": "parameter", "_rebuild_parameter_with_state": "parameter"}
_BUILTINS = {"set": "set", "frozenset": "set", "slice": "opaque"}


def _find_global(module: str, name: str) -> Any:
    """The stub for an allow-listed global; anything else makes the file unindexable."""
    if module == "torch._utils" and name in _TORCH_UTILS:
        return _Func(_TORCH_UTILS[name])
    if module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
        return _StorageType(_STORAGE_DTYPES[name])
    if module == "torch" and name in _ITEMSIZE:  # dtypes pickle by name, e.g. torch.bfloat16
        return _DType(name)
    if module == "torch" and name in ("Size", "device"):
        return _Func("size" if name == "Size" else "opaque")
    if module == "collections" and name == "OrderedDict":
        return _Func("dict")
    if module in ("builtins", "__builtin__") and name in _BUILTINS:
        return _Func(_BUILTINS[name])
    if module == "_codecs" and name == "encode":  # protocol 2 stores bytes as encode(str, "latin1")
        return _OPAQUE
    raise _Malformed(f"global {module:.60} {name:.60} is not allowed")


class _PickleMachine:
    """Runs one pickle's opcodes over inert values; `created` lists the tensor stubs in order."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.budget = _Budget(len(data), _OPS_PER_BYTE, _MAX_PICKLE_OPS)
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.created: list[_Tensor] = []
        self.storage_bytes: dict[str, int] = {}  # key -> numel x itemsize, as the persistent ids say

    def run(self) -> Any:
        budget, handlers = self.budget, _OPCODES
        try:
            for op, arg, _ in pickletools.genops(self.data):
                budget.left -= 1  # budget.spend(), inlined: this loop is the indexer's hot spot
                if budget.left < 0:
                    raise _GaveUp("work budget exceeded")
                if op.name == "STOP":
                    return self.stack.pop()
                handler = handlers.get(op.name)
                if handler is None:  # EXT*, PERSID, out-of-band buffers: torch.save writes none
                    raise _GaveUp(f"pickle opcode {op.name} is not interpreted")
                handler(self, arg)
        except (IndexError, KeyError, ValueError, TypeError, AttributeError) as e:
            # genops' messages may quote the pickle; ours never quote values
            raise _Malformed(f"bad pickle: {type(e).__name__}: {str(e):.120}") from None
        raise _Malformed("pickle without STOP")

    # Opcode handlers, named after the opcode (or the group) they serve; see _OPCODES.
    def push(self, value: Any) -> None:
        self.stack.append(value)

    def push_py2_string(self, text: str) -> None:
        self.stack.append(text.encode("latin-1").decode("utf-8"))  # as torch.load: py2 str is utf-8

    def ignore(self, _: Any) -> None:
        pass

    def mark(self, _: Any) -> None:
        self.marks.append(len(self.stack))

    def pop_mark(self, _: Any = None) -> list[Any]:
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def pop(self, _: Any) -> None:
        if self.marks and self.marks[-1] == len(self.stack):
            self.marks.pop()  # as the C unpickler: POP right after MARK drops the mark
        else:
            self.stack.pop()

    def dup(self, _: Any) -> None:
        self.stack.append(self.stack[-1])

    def put(self, index: int) -> None:
        self.memo[index] = self.stack[-1]

    def memoize(self, _: Any) -> None:
        self.memo[len(self.memo)] = self.stack[-1]

    def get(self, index: int) -> None:
        self.stack.append(self.memo[index])

    def tuple_n(self, n: int) -> None:
        if len(self.stack) < n:
            raise _Malformed("stack underflow")
        items = tuple(self.stack[len(self.stack) - n:])
        del self.stack[len(self.stack) - n:]
        self.stack.append(items)

    def tuple_mark(self, _: Any) -> None:
        self.stack.append(tuple(self.pop_mark()))

    def list_mark(self, _: Any) -> None:
        self.stack.append(self.pop_mark())

    def dict_mark(self, _: Any) -> None:
        self.stack.append(_pairs(self.pop_mark()))

    def frozenset_mark(self, _: Any) -> None:
        self.pop_mark()
        self.stack.append(_Set())

    def append(self, _: Any) -> None:
        value = self.stack.pop()
        self._target(list).append(value)

    def appends(self, _: Any) -> None:
        items = self.pop_mark()
        self._target(list).extend(items)

    def setitem(self, _: Any) -> None:
        items = self.stack[-2:]
        del self.stack[-2:]
        self._target(_Dict).extend(_pairs(items))

    def setitems(self, _: Any) -> None:
        items = self.pop_mark()
        self._target(_Dict).extend(_pairs(items))

    def additems(self, _: Any) -> None:
        self.pop_mark()
        self._target(_Set)

    def global_(self, arg: str) -> None:
        module, _, name = arg.partition(" ")
        self.stack.append(_find_global(module, name))

    def stack_global(self, _: Any) -> None:
        name, module = self.stack.pop(), self.stack.pop()
        if type(module) is not str or type(name) is not str:
            raise _Malformed("STACK_GLOBAL of non-strings")
        self.stack.append(_find_global(module, name))

    def inst(self, arg: str) -> None:
        module, _, name = arg.partition(" ")
        func = _find_global(module, name)
        self.stack.append(self._call(func, tuple(self.pop_mark())))

    def obj(self, _: Any) -> None:
        items = self.pop_mark()
        self.stack.append(self._call(items[0], tuple(items[1:])))

    def reduce(self, _: Any) -> None:  # also NEWOBJ: cls.__new__(cls, *args) of a stub is its call
        args = self.stack.pop()
        self.stack.append(self._call(self.stack.pop(), args))

    def newobj_ex(self, _: Any) -> None:
        self.stack.pop()  # keyword arguments: no allow-listed callable takes any
        self.reduce(None)

    def build(self, _: Any) -> None:
        self.stack.pop()  # the state (OrderedDict._metadata): stubs keep no attributes
        if not self.stack:
            raise _Malformed("BUILD without an object")

    def binpersid(self, _: Any) -> None:
        pid = self.stack.pop()
        if (type(pid) is not tuple or len(pid) < 3 or type(pid[0]) is not str or pid[0] != "storage"
                or type(pid[1]) is not _StorageType or type(pid[2]) is not str):
            raise _Malformed("unsupported persistent id")
        if len(pid) >= 5 and type(pid[4]) is int and pid[4] >= 0:
            self.storage_bytes[pid[2]] = pid[4] * _ITEMSIZE[pid[1].dtype]
        self.stack.append(_Storage(pid[2], pid[1].dtype))

    def _target(self, kind: type) -> Any:
        target = self.stack[-1]
        if type(target) is not kind:
            raise _Malformed(f"{kind.__name__} opcode on a {type(target).__name__}")
        return target

    def _call(self, func: Any, args: Any) -> Any:
        """REDUCE and friends: only stubs are callable, and each builds an inert value."""
        if type(func) is not _Func or type(args) is not tuple:
            raise _Malformed(f"call of a {type(func).__name__} on a {type(args).__name__}")
        kind = func.kind
        if kind == "rebuild_v2" and len(args) >= 4:
            storage = args[0]
            dtype = storage.dtype if type(storage) is _Storage else ""
            return self._new_tensor(storage, args[1], args[2], args[3], dtype)
        if kind == "rebuild_v3" and len(args) >= 7 and type(args[6]) is _DType:
            return self._new_tensor(args[0], args[1], args[2], args[3], args[6].name)
        if kind == "parameter" and args:
            return args[0]
        if kind == "size" and not args:
            return ()
        if kind == "size" and len(args) == 1 and type(args[0]) in (tuple, list):
            self.budget.spend(len(args[0]))
            return tuple(args[0])
        if kind == "dict" and not args:
            return _Dict()
        if kind == "dict" and len(args) == 1 and type(args[0]) is list:  # OrderedDict([(k, v)])
            pairs = args[0]
            self.budget.spend(len(pairs))
            if not all(type(p) is tuple and len(p) == 2 for p in pairs):
                raise _Malformed("OrderedDict of non-pairs")
            return _Dict(x for p in pairs for x in p)
        if kind == "set":
            return _Set()
        if kind == "opaque":
            return _OPAQUE
        raise _Malformed(f"bad arguments to {kind}")

    def _new_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, dtype: str) -> _Tensor:
        if (type(storage) is not _Storage or dtype not in _ITEMSIZE or type(size) is not tuple
                or type(stride) is not tuple or len(size) != len(stride)):
            raise _Malformed("bad tensor rebuild arguments")
        self.budget.spend(2 * len(size))  # a shared shape may be reused: charge each copy
        tensor = _Tensor(storage, _nonneg(offset), tuple(_nonneg(x) for x in size),
                         tuple(_nonneg(x) for x in stride), dtype, len(self.created))
        self.created.append(tensor)
        return tensor


def _pairs(items: list[Any]) -> _Dict:
    if len(items) % 2:
        raise _Malformed("odd number of dict items")
    return _Dict(items)


def _constant(value: Any) -> Callable[[_PickleMachine, Any], None]:
    return lambda machine, _: machine.stack.append(value)


_M = _PickleMachine
# Every opcode of protocols 0-5 but EXT1/2/4, PERSID, NEXT_BUFFER and READONLY_BUFFER (and STOP,
# which run() handles): torch.save writes protocol 2, other savers may write any.
_OPCODES: dict[str, Callable[[_PickleMachine, Any], Any]] = {
    **dict.fromkeys(("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT",
                     "BINFLOAT", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
                     "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"), _M.push),
    **dict.fromkeys(("STRING", "BINSTRING", "SHORT_BINSTRING"), _M.push_py2_string),
    "BYTEARRAY8": lambda m, arg: m.stack.append(bytearray(arg)),
    "NONE": _constant(None), "NEWTRUE": _constant(True), "NEWFALSE": _constant(False),
    "EMPTY_TUPLE": _constant(()),
    "EMPTY_LIST": lambda m, _: m.stack.append([]),
    "EMPTY_DICT": lambda m, _: m.stack.append(_Dict()),
    "EMPTY_SET": lambda m, _: m.stack.append(_Set()),
    "PROTO": _M.ignore, "FRAME": _M.ignore,
    "MARK": _M.mark, "POP": _M.pop, "POP_MARK": _M.pop_mark, "DUP": _M.dup,
    "PUT": _M.put, "BINPUT": _M.put, "LONG_BINPUT": _M.put, "MEMOIZE": _M.memoize,
    "GET": _M.get, "BINGET": _M.get, "LONG_BINGET": _M.get,
    "TUPLE": _M.tuple_mark, "TUPLE1": lambda m, _: m.tuple_n(1),
    "TUPLE2": lambda m, _: m.tuple_n(2), "TUPLE3": lambda m, _: m.tuple_n(3),
    "LIST": _M.list_mark, "DICT": _M.dict_mark,
    "FROZENSET": _M.frozenset_mark,
    "APPEND": _M.append, "APPENDS": _M.appends, "SETITEM": _M.setitem, "SETITEMS": _M.setitems,
    "ADDITEMS": _M.additems,
    "GLOBAL": _M.global_, "STACK_GLOBAL": _M.stack_global, "INST": _M.inst, "OBJ": _M.obj,
    "REDUCE": _M.reduce, "NEWOBJ": _M.reduce, "NEWOBJ_EX": _M.newobj_ex, "BUILD": _M.build,
    "BINPERSID": _M.binpersid,
}
del _M


def _name_part(key: Any) -> str | None:
    """A str or int key names itself; any other key (a tuple, bytes...) is named by its position,
    so the walk never formats a value of unbounded cost."""
    if type(key) is str:
        return key
    if type(key) in (int, bool) and -_I64 <= key < _I64:
        return str(key)
    return None


def _dict_items(d: _Dict) -> list[tuple[str, Any]]:
    """(name, value) of a dict in insertion order; a repeated key keeps its first place and its
    last value, as dict does."""
    items: list[tuple[str, Any]] = []
    where: dict[str | int, int] = {}
    for i in range(0, len(d), 2):
        key, value = d[i], d[i + 1]
        part = _name_part(key)
        if part is None:
            items.append((f"#{i // 2}", value))
        elif key in where:
            items[where[key]] = (items[where[key]][0], value)
        else:
            where[key] = len(items)
            items.append((part, value))
    return items


def _collect(root: Any, budget: _Budget) -> list[tuple[str, _Tensor]]:
    """Name every tensor stub reachable from root by its dotted container path.

    Shared objects are visited once per path (tied weights get both names); cycles are cut, and
    the budget (one unit per step and per character of a name) stops DAG-shaped blow-ups."""
    found: list[tuple[str, _Tensor]] = []
    active: set[int] = set()
    path: list[str] = []

    def visit(obj: Any, depth: int, name_len: int) -> None:
        budget.spend()
        if depth > _MAX_DEPTH:
            raise _GaveUp("object graph too deep")
        kind = type(obj)
        if kind is _Tensor:
            budget.spend(_ENTRY_COST + name_len)  # before the join: a long key may recur per level
            found.append((".".join(path), obj))
            return
        if kind is not _Dict and kind is not list and kind is not tuple:
            return  # scalars, strings, None, stubs, sets (unordered: no stable names)
        if id(obj) in active:
            return
        items = _dict_items(obj) if kind is _Dict else [(str(i), v) for i, v in enumerate(obj)]
        active.add(id(obj))
        for part, value in items:
            path.append(part)
            visit(value, depth + 1, name_len + len(part) + 1)
            path.pop()
        active.discard(id(obj))

    visit(root, 0, 0)
    return found


def _build_torch(read_at: ReadAt, size: int) -> TensorIndex:
    records, cd_offset = _zip_records(read_at, size)
    root = _torch_root(tuple(records))
    by_name = {r.name: r for r in records}
    pkl = by_name.get(f"{root}/data.pkl")
    if pkl is None:
        raise _Malformed(f"no {root}/data.pkl")
    if pkl.length > MAX_PICKLE:
        raise _GaveUp(f"data.pkl of {pkl.length} bytes is over the {MAX_PICKLE} byte limit")
    data = _read_exact(read_at, pkl.offset, pkl.length)
    machine = _PickleMachine(data)
    named = _collect(machine.run(), _Budget(len(data), _WALK_PER_BYTE, _MAX_WALK))
    named.sort(key=lambda item: item[1].seq)  # stable: pickle order, then walk order
    spans: dict[int, tuple[int, int]] = {}  # by seq: once per tensor, however many names it has
    tensors = []
    for name, t in named:
        if t.seq not in spans:
            spans[t.seq] = _tensor_span(t, by_name, f"{root}/data/")
        tensors.append(TensorEntry(name, t.dtype, t.shape, t.stride, t.storage.key, *spans[t.seq]))
    return TensorIndex("torch-zip", tuple(records), tuple(tensors), size, cd_offset)


def _is_data(name: str) -> bool:
    """A storage record: `<root>/data/<key>` (torch-dcp: `<item>/<root>/data/<key>`)."""
    return "/data/" in name


def _build_dcp(read_at: ReadAt, size: int, last: ZipEnd) -> TensorIndex:
    """torch.distributed.checkpoint's `.distcp` file: zips back to back, each a torch.save of one item
    (a tensor, or a pickled object). Each zip ends where the next starts, so they are found from the
    file's end, each end record giving its zip's start (`ZipEnd.base`); the first starts at 0. Each is
    indexed as a torch zip of its own, its record and tensor names prefixed with its number in the
    file (`<k>/archive/data/0`, tensor `<k>`: the state dict's names live in the checkpoint's
    `.metadata`, another file); of its records, only the storages and those of `_DCP_KEEP` bytes or
    more are kept. An item that is not a torch.save we read (a pickled object of a class we do not
    allow) gives its zip members and no tensor."""
    spans: list[tuple[int, int]] = [(last.base, size)]
    while spans[-1][0] > 0:
        if len(spans) >= _MAX_DCP_ITEMS:
            raise _GaveUp(f"over {_MAX_DCP_ITEMS} zips back to back")
        end = spans[-1][0]
        spans.append((_zip_directory(read_at, end).base, end))
    records: list[Record] = []
    tensors: list[TensorEntry] = []
    for k, (base, end) in enumerate(reversed(spans)):
        def sub(offset: int, length: int, base: int = base, end: int = end) -> bytes:
            return read_at(base + offset, max(0, min(length, end - base - offset)))
        try:
            item = _build_torch(sub, end - base)
            members, found = item.records, item.tensors
        except _Malformed:
            members, found = tuple(_zip_records(sub, end - base)[0]), ()
        records += [Record(f"{k}/{r.name}", base + r.offset, r.length) for r in members
                    if _is_data(r.name) or r.length >= _DCP_KEEP]
        tensors += [TensorEntry(f"{k}.{t.name}" if t.name else f"{k}", t.dtype, t.shape, t.stride,
                                f"{k}/{t.storage_key}", base + t.offset, t.length) for t in found]
    return TensorIndex("torch-dcp", tuple(records), tuple(tensors), size, size)


def storage_sizes(pickle: bytes) -> dict[str, int]:
    """Byte length of every storage a torch `data.pkl` names (numel x itemsize, from its persistent
    ids): where each `data/<key>` record ends, known as soon as the pickle is written (torch.save writes
    it first), long before the zip directory. Empty if the pickle is not one we read. Blocking (bounded
    by the pickle's size, as build_index): run it in a worker thread."""
    if len(pickle) > MAX_PICKLE:
        return {}
    machine = _PickleMachine(pickle)
    try:
        machine.run()
    except _Malformed:
        return {}
    return machine.storage_bytes


def _tensor_span(t: _Tensor, by_name: dict[str, Record], prefix: str) -> tuple[int, int]:
    """(file offset, length) of the bytes a tensor view covers in its storage record."""
    rec = by_name.get(prefix + t.storage.key)
    if rec is None:
        raise _Malformed(f"storage {t.storage.key:.80} missing")
    itemsize = _ITEMSIZE[t.dtype]
    start = rec.offset + t.storage_offset * itemsize
    length = 0
    if all(t.shape):
        length = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride))) * itemsize
        if start + length > rec.offset + rec.length:
            raise _Malformed(f"tensor {t.seq} overruns storage {t.storage.key:.80}")
    return start, length


def _build_safetensors(read_at: ReadAt, size: int) -> TensorIndex:
    (n,) = struct.unpack("<Q", _read_exact(read_at, 0, 8))
    if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
        raise _Malformed(f"absurd header length {n}")
    header = json.loads(_read_exact(read_at, 8, n))
    if not isinstance(header, dict):
        raise _Malformed("header is not an object")
    base, tensors = 8 + n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        if dtype is None:
            raise _Malformed(f"tensor {name}: bad entry or unknown dtype")
        shape = tuple(_nonneg(x) for x in _typed(info.get("shape"), list, "shape"))
        begin, end = (_nonneg(x) for x in _typed(info.get("data_offsets"), list, "data_offsets"))
        numel = 0 if 0 in shape else 1
        for dim in shape:
            numel *= dim
            if numel > size:
                break
        if begin > end or base + end > size or end - begin != numel * _ITEMSIZE[dtype]:
            raise _Malformed(f"tensor {name}: data_offsets out of range")
        stride, step = [], 1
        for dim in reversed(shape):
            stride.append(step)
            step *= max(dim, 1)
        tensors.append(TensorEntry(name, dtype, shape, tuple(reversed(stride)), "",
                                   base + begin, end - begin))
    return TensorIndex("safetensors", (Record("header", 0, base),), tuple(tensors), size, 0)


def build_index(read_at: ReadAt, size: int, name: str = "") -> TensorIndex | None:
    """Detect torch-zip, torch-dcp or safetensors from the bytes and index it; else None.

    Blocking, and bounded by the file's size (see _Budget): run it in a worker thread. `name`
    only labels the warning logged when a checkpoint is too costly to index."""
    label = name or f"a file of {size} bytes"
    try:
        head = _read_exact(read_at, 0, min(size, 9))
        if head[:4] == b"PK\x03\x04":
            last = _zip_directory(read_at, size)
            return _build_dcp(read_at, size, last) if last.base else _build_torch(read_at, size)
        if head[8:9] == b"{":
            return _build_safetensors(read_at, size)
        log.debug("no tensor index for %s: unrecognised format", label)
    except _GaveUp as e:
        log.warning("no tensor index for %s, stored without one: %s", label, e)
    except Exception as e:  # a hint must never break an import or a write
        log.debug("no tensor index for %s: %s: %.200s", label, type(e).__name__, e)
    return None


def index_file(path: str | os.PathLike, name: str = "") -> TensorIndex | None:
    """Index a file on disk with os.pread; unreadable files also give None. `name` labels the
    logs (default: the path)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        log.debug("no tensor index for %s: %s", name or path, e)
        return None
    try:
        return build_index(lambda off, n: os.pread(fd, n, off), os.fstat(fd).st_size,
                           name or os.fspath(path))
    finally:
        os.close(fd)
