"""Tensor index: where each tensor's bytes live inside a checkpoint file.

The readahead scheduler uses it to fetch bytes in the order ``torch.load`` reads
them, and the chunker uses it to cut chunks at tensor boundaries. It is only a
hint, so anything unexpected yields ``None`` instead of an exception. Torch
checkpoints are parsed without importing torch and without running pickle code:
the zip is read with ``struct`` and ``data.pkl`` goes through an allow-listed
unpickler that builds inert stubs.
"""
from __future__ import annotations

import bisect
import collections
import functools
import io
import json
import logging
import os
import pickle
import struct
from dataclasses import dataclass
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
_FORMATS = ("torch-zip", "safetensors")
# Caps keep a hostile file from making the indexer allocate or loop without bound.
_MAX_PICKLE = 64 << 20
_MAX_CENTRAL_DIR = 64 << 20
_MAX_SAFETENSORS_HEADER = 100 << 20
_MAX_WALK_NODES = 1_000_000
_MAX_DEPTH = 200
_U32 = 0xFFFFFFFF


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
        ranges = []
        if self.file_size > self.directory_offset:
            ranges.append((self.directory_offset, self.file_size - self.directory_offset))
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
        raise ValueError(f"expected a non-negative int64, got {value!r:.40}")
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

def _zip_directory(read_at: ReadAt, size: int) -> tuple[int, int, int]:
    """Return (central directory offset, size, entry count), zip64-aware."""
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
    if eocd >= 20:
        loc = _read_exact(read_at, eocd - 20, 20)
        if loc[:4] == b"PK\x06\x07":
            rec_off = struct.unpack_from("<Q", loc, 8)[0]
            rec = _read_exact(read_at, rec_off, 56)
            if rec[:4] != b"PK\x06\x06":
                raise _Malformed("bad zip64 end record")
            (_, _, _, _, disk, cd_disk, _, count, cd_size,
             cd_offset) = struct.unpack("<IQHHIIQQQQ", rec)
            eocd = rec_off
    if disk or cd_disk:
        raise _Malformed("multi-disk zip")
    if cd_offset + cd_size > eocd or cd_size > _MAX_CENTRAL_DIR:
        raise _Malformed("central directory out of range")
    return cd_offset, cd_size, count


def _zip_records(read_at: ReadAt, size: int) -> tuple[list[Record], int]:
    """Every member with its absolute data offset (from the LOCAL header, which
    torch pads with extra bytes for alignment), plus the directory offset."""
    cd_offset, cd_size, count = _zip_directory(read_at, size)
    cd = _read_exact(read_at, cd_offset, cd_size)
    records, pos = [], 0
    for _ in range(count):
        if cd[pos:pos + 4] != b"PK\x01\x02" or pos + 46 > len(cd):
            raise _Malformed("bad central directory entry")
        (_, _, _, flags, method, _, _, _, comp, uncomp, nlen, elen, clen, _, _, _,
         local) = struct.unpack_from("<IHHHHHHIIIHHHHHII", cd, pos)
        raw_name = cd[pos + 46:pos + 46 + nlen]
        extra = cd[pos + 46 + nlen:pos + 46 + nlen + elen]
        pos += 46 + nlen + elen + clen
        if method != 0 or flags & 1:
            raise _Malformed("compressed or encrypted member")
        _, comp, local = zip64_extra(extra, uncomp, comp, local)
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
        header = _read_exact(read_at, local, 30)
        if header[:4] != b"PK\x03\x04":
            raise _Malformed(f"bad local header for {name}")
        lnlen, lelen = struct.unpack_from("<HH", header, 26)
        data = local + 30 + lnlen + lelen
        if data + comp > cd_offset:
            raise _Malformed(f"member {name} overruns the central directory")
        records.append(Record(name, data, comp))
    return records, cd_offset


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


# --- pickle stubs ------------------------------------------------------------

# Stubs are NamedTuples: immutable, so a pickle BUILD opcode cannot rewrite them.
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


def _latin1_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles store bytes as _codecs.encode(str, "latin1").
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("unexpected _codecs.encode call")
    return text.encode("latin-1")


class _StubUnpickler(pickle.Unpickler):
    """Resolves only allow-listed globals, each to an inert stub."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.created: list[_Tensor] = []

    def _rebuild_v2(self, storage, storage_offset, size, stride, *_rest) -> _Tensor:
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError("tensor without a storage")
        return self._new_tensor(storage, storage_offset, size, stride, storage.dtype)

    def _rebuild_v3(self, storage, storage_offset, size, stride, _grad, _hooks, dtype,
                    *_rest) -> _Tensor:
        if not isinstance(dtype, _DType):
            raise pickle.UnpicklingError("tensor v3 without a dtype")
        return self._new_tensor(storage, storage_offset, size, stride, dtype.name)

    def _new_tensor(self, storage: Any, offset: Any, size: Any, stride: Any,
                    dtype: str) -> _Tensor:
        if (not isinstance(storage, _Storage) or dtype not in _ITEMSIZE
                or len(size) != len(stride)):
            raise pickle.UnpicklingError("bad tensor rebuild arguments")
        tensor = _Tensor(storage, _nonneg(offset), tuple(_nonneg(x) for x in size),
                         tuple(_nonneg(x) for x in stride), dtype, len(self.created))
        self.created.append(tensor)
        return tensor

    @staticmethod
    def _rebuild_parameter(data, _requires_grad, _hooks, _state=None) -> Any:
        return data

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils":
            table = {"_rebuild_tensor_v2": self._rebuild_v2, "_rebuild_tensor_v3": self._rebuild_v3,
                     "_rebuild_parameter": self._rebuild_parameter,
                     "_rebuild_parameter_with_state": self._rebuild_parameter}
            if name in table:
                return table[name]
        elif module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        elif module == "torch":
            if name in _ITEMSIZE:  # dtypes pickle by canonical name, e.g. torch.bfloat16
                return _DType(name)
            if name == "Size":
                return tuple
            if name == "device":
                return lambda *args: "device" + repr(args)
        elif module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        elif module in ("builtins", "__builtin__") and name in ("set", "frozenset", "slice"):
            return {"set": set, "frozenset": frozenset, "slice": slice}[name]
        elif module == "_codecs" and name == "encode":
            return _latin1_encode
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> _Storage:
        if (not isinstance(pid, tuple) or len(pid) < 3 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r:.80}")
        return _Storage(pid[2], pid[1].dtype)


def _collect(root: Any) -> list[tuple[str, _Tensor]]:
    """Name every tensor stub reachable from root by its dotted container path.

    Shared objects are visited once per path (tied weights get both names);
    cycles are cut and a node budget stops DAG-shaped blow-ups."""
    found: list[tuple[str, _Tensor]] = []
    active: set[int] = set()
    budget = [_MAX_WALK_NODES]

    def visit(obj: Any, path: str, depth: int) -> None:
        budget[0] -= 1
        if budget[0] < 0 or depth > _MAX_DEPTH:
            raise _Malformed("object graph too large or too deep")
        if isinstance(obj, _Tensor):
            found.append((path, obj))
            return
        if isinstance(obj, dict):
            items = [(str(k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            items = [(str(i), v) for i, v in enumerate(obj)]
        else:
            return  # scalars, strings, None, sets (unordered: no stable names)
        if id(obj) in active:
            return
        active.add(id(obj))
        for key, value in items:
            visit(value, f"{path}.{key}" if path else key, depth + 1)
        active.discard(id(obj))

    visit(root, "", 0)
    return found


def _build_torch(read_at: ReadAt, size: int) -> TensorIndex:
    records, cd_offset = _zip_records(read_at, size)
    root = _torch_root(tuple(records))
    by_name = {r.name: r for r in records}
    pkl = by_name.get(f"{root}/data.pkl")
    if pkl is None:
        raise _Malformed(f"no {root}/data.pkl")
    if pkl.length > _MAX_PICKLE:
        raise _Malformed("data.pkl too large")
    unpickler = _StubUnpickler(_read_exact(read_at, pkl.offset, pkl.length))
    obj = unpickler.load()
    named = _collect(obj)
    named.sort(key=lambda item: item[1].seq)  # stable: pickle order, then walk order
    tensors = []
    for name, t in named:
        rec = by_name.get(f"{root}/data/{t.storage.key}")
        if rec is None:
            raise _Malformed(f"storage {t.storage.key} missing")
        itemsize = _ITEMSIZE[t.dtype]
        start = rec.offset + t.storage_offset * itemsize
        length = 0
        if all(t.shape):
            length = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride))) * itemsize
            if start + length > rec.offset + rec.length:
                raise _Malformed(f"tensor {name} overruns storage {t.storage.key}")
        tensors.append(TensorEntry(name, t.dtype, t.shape, t.stride, t.storage.key,
                                   start, length))
    return TensorIndex("torch-zip", tuple(records), tuple(tensors), size, cd_offset)


def _build_safetensors(read_at: ReadAt, size: int) -> TensorIndex:
    (n,) = struct.unpack("<Q", _read_exact(read_at, 0, 8))
    if n > _MAX_SAFETENSORS_HEADER or 8 + n > size:
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


def build_index(read_at: ReadAt, size: int) -> TensorIndex | None:
    """Detect torch-zip or safetensors from the bytes and index it; else None."""
    try:
        head = _read_exact(read_at, 0, min(size, 9))
        if head[:4] == b"PK\x03\x04":
            return _build_torch(read_at, size)
        if head[8:9] == b"{":
            return _build_safetensors(read_at, size)
        log.debug("no tensor index: unrecognised format (size %d)", size)
    except Exception as e:  # a hint must never break an import or a write
        log.debug("no tensor index: %s: %s", type(e).__name__, e)
    return None


def index_file(path: str | os.PathLike) -> TensorIndex | None:
    """Index a file on disk with os.pread; unreadable files also give None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        log.debug("no tensor index for %s: %s", path, e)
        return None
    try:
        return build_index(lambda off, n: os.pread(fd, n, off), os.fstat(fd).st_size)
    finally:
        os.close(fd)
