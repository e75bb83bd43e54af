"""Tests for cpfs.tensor_index against real torch.save / safetensors files."""
from __future__ import annotations

import collections
import io
import json
import logging
import os
import pickle
import random
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cpfs.tensor_index import (
    EOCD_SEARCH,
    Record,
    TensorEntry,
    TensorIndex,
    build_index,
    index_file,
)


def _state_dict() -> dict[str, torch.Tensor | object]:
    """A transformer-ish checkpoint exercising every layout case we index."""
    torch.manual_seed(0)
    embed = torch.randn(64, 32).to(torch.bfloat16)
    mlp = torch.randn(16, 32)
    proj = torch.randn(32, 48)
    return {
        "model": {
            "embed.weight": embed,
            "layers.0.attn.q.weight": torch.randn(32, 32),
            "layers.0.attn.o.weight": proj.t(),  # non-contiguous view, saved directly
            "layers.0.mlp.w": mlp,
            "layers.0.mlp.w_slice": mlp[4:9],  # shares mlp's storage, storage_offset > 0
            "layers.0.mlp.col": mlp[:, 3],  # strided view into the same storage
            "layers.0.norm.weight": torch.nn.Parameter(torch.ones(32)),
            "head.weight": embed,  # tied weights: same object under two names
            "pos_ids": torch.arange(128),
            "scale": torch.tensor(2.5),
            "empty": torch.empty(0, 8),
            "mask": torch.ones(7, dtype=torch.bool),
            "fp8": torch.randn(10).to(torch.float8_e4m3fn),  # saved via _rebuild_tensor_v3
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(32, 32),
                          "exp_avg_sq": torch.rand(32, 32, dtype=torch.float16)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "meta": {"epoch": 3, "name": "run", "none": None, "blob": b"\x00\xff"},
        "history": [torch.zeros(3, dtype=torch.int32), 5],
        "linear": torch.nn.Linear(4, 3).state_dict(),  # OrderedDict with _metadata (BUILD)
    }


def _flatten(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_tensor(data: bytes, entry: TensorEntry, t: torch.Tensor) -> None:
    assert entry.dtype == str(t.dtype).removeprefix("torch.")
    assert entry.shape == tuple(t.shape)
    assert entry.stride == tuple(t.stride())
    span = data[entry.offset:entry.offset + entry.length]
    assert len(span) == entry.length
    if t.numel() == 0:
        assert entry.length == 0
        return
    itemsize = t.element_size()
    storage = bytes(t.untyped_storage())
    start = t.storage_offset() * itemsize
    assert span == storage[start:start + entry.length]
    if t.is_contiguous():
        assert span == _raw(t)
    rebuilt = torch.frombuffer(bytearray(span), dtype=t.dtype).as_strided(t.shape, t.stride())
    assert _raw(rebuilt) == _raw(t)


def _save(obj: object, path: Path) -> TensorIndex:
    torch.save(obj, path)
    index = index_file(path)
    assert index is not None
    return index


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, TensorIndex]:
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    sd = _state_dict()
    return path, sd, _save(sd, path)


def test_torch_tensors_match_file_bytes(torch_ckpt) -> None:
    path, sd, index = torch_ckpt
    data = path.read_bytes()
    expected = _flatten(sd)
    assert index.format == "torch-zip"
    assert sorted(t.name for t in index.tensors) == sorted(expected)
    for entry in index.tensors:
        _check_tensor(data, entry, expected[entry.name])
    by_name = {t.name: t for t in index.tensors}
    # Tied weights and views share a storage; offsets follow storage_offset.
    assert by_name["model.head.weight"].offset == by_name["model.embed.weight"].offset
    w, s = by_name["model.layers.0.mlp.w"], by_name["model.layers.0.mlp.w_slice"]
    assert s.storage_key == w.storage_key and s.offset == w.offset + 4 * 32 * 4
    assert by_name["model.layers.0.attn.o.weight"].stride == (1, 48)
    assert by_name["model.scale"].length == 4 and by_name["model.scale"].shape == ()


def test_root_folder_follows_file_stem(tmp_path: Path) -> None:
    sd = {"w": torch.randn(5, 5), "b": torch.arange(4, dtype=torch.int16)}
    index = _save(sd, tmp_path / "step_100.pt")
    assert all(r.name.startswith("step_100/") for r in index.records)
    data = (tmp_path / "step_100.pt").read_bytes()
    for entry in index.tensors:
        _check_tensor(data, entry, sd[entry.name])
    # torch.save to a buffer uses "archive/" as the root.
    buf = io.BytesIO()
    torch.save(sd, buf)
    raw = buf.getvalue()
    index = build_index(lambda off, n: raw[off:off + n], len(raw))
    assert index is not None and index.records[0].name == "archive/data.pkl"
    for entry in index.tensors:
        _check_tensor(raw, entry, sd[entry.name])


def test_safetensors(tmp_path: Path) -> None:
    torch.manual_seed(1)
    tensors = {
        "embed": torch.randn(33, 17).to(torch.bfloat16), "w": torch.randn(8, 4),
        "ids": torch.arange(9), "half": torch.randn(3, 2, 5).half(),
        "flag": torch.ones(3, dtype=torch.bool), "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 3), "u8": torch.arange(7, dtype=torch.uint8),
        "fp8": torch.randn(5).to(torch.float8_e5m2),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    index = index_file(path)
    assert index is not None and index.format == "safetensors"
    data = path.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    assert index.records == (Record("header", 0, 8 + header_len),)
    assert sorted(t.name for t in index.tensors) == sorted(tensors)
    for entry in index.tensors:
        assert entry.storage_key == ""
        _check_tensor(data, entry, tensors[entry.name])
    assert index.read_order()[0] == (0, 8 + header_len)
    rest = index.read_order()[1:]
    assert rest == sorted(rest) and len(rest) == len(tensors) - 1  # empty tensor omitted
    assert index.record_starts() == sorted(off for off, _ in rest)


def test_read_order_and_record_starts(torch_ckpt) -> None:
    path, _, index = torch_ckpt
    size = path.stat().st_size
    order = index.read_order()
    with zipfile.ZipFile(path) as zf:
        cd_start = zf.start_dir
    start = min(cd_start, size - EOCD_SEARCH)     # the end record's search, then the directory
    assert order[0] == (start, size - start)
    pkl = next(r for r in index.records if r.name.endswith("/data.pkl"))
    assert order[1] == (pkl.offset, pkl.length)
    non_empty = sorted((r.offset, r.length) for r in index.records if r.length > 0)
    assert sorted(order[1:]) == non_empty  # every record exactly once
    storages = [r for r in index.records if "/data/" in r.name]
    metadata_ranges = {(r.offset, r.length) for r in index.records
                       if r.length > 0 and r is not pkl and r not in storages}
    n_meta = len(metadata_ranges)
    assert set(order[2:2 + n_meta]) == metadata_ranges
    # Storages follow in first-reference order of the pickle (= key order for torch.save).
    key_of = {(r.offset, r.length): r.name.rsplit("/", 1)[1] for r in storages}
    keys = [key_of[rng] for rng in order[2 + n_meta:]]
    assert keys == sorted(keys, key=int)
    assert index.record_starts() == sorted(r.offset for r in storages if r.length > 0)


def test_json_round_trip(torch_ckpt, tmp_path: Path) -> None:
    _, _, index = torch_ckpt
    blob = json.dumps(index.to_json())
    again = TensorIndex.from_json(json.loads(blob))
    assert again == index
    assert again.read_order() == index.read_order()
    assert again.tensors_overlapping(0, 1 << 40) == index.tensors_overlapping(0, 1 << 40)


def _good_json() -> dict:
    return TensorIndex(
        "torch-zip", (Record("archive/data.pkl", 64, 10),),
        (TensorEntry("w", "float32", (2, 3), (3, 1), "0", 128, 24),), 500, 400).to_json()


def _mutate(path: tuple, value: object) -> dict:
    d = _good_json()
    target = d
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


@pytest.mark.parametrize("bad", [
    None, [], "x", {}, _mutate(("version",), 2), _mutate(("format",), "zip"),
    _mutate(("records",), KeyError), _mutate(("records",), "nope"),
    _mutate(("records", 0, "offset"), -1), _mutate(("records", 0, "length"), "10"),
    _mutate(("records", 0), [1, 2]), _mutate(("tensors", 0, "offset"), -5),
    _mutate(("tensors", 0, "shape"), [2, -3]), _mutate(("tensors", 0, "stride"), [1]),
    _mutate(("tensors", 0, "dtype"), 4), _mutate(("tensors", 0, "name"), KeyError),
    _mutate(("tensors", 0, "length"), True), _mutate(("file_size",), 1.5),
])
def test_from_json_rejects_malformed(bad: object) -> None:
    assert TensorIndex.from_json(_good_json()).tensors[0].length == 24
    with pytest.raises(ValueError):
        TensorIndex.from_json(bad)  # type: ignore[arg-type]


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps({"w": _Evil(marker)}, protocol=2))
        zf.writestr("evil/byteorder", "little")
        zf.writestr("evil/data/0", b"\0" * 16)
        zf.writestr("evil/version", "3\n")
    assert index_file(path) is None
    assert not marker.exists()


def _valid_safetensors(tmp_path: Path) -> bytes:
    save_file({"a": torch.ones(4, 4)}, tmp_path / "ok.safetensors")
    return (tmp_path / "ok.safetensors").read_bytes()


def _forged_safetensors(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def _garbage_cases(tmp_path: Path, ckpt: Path) -> dict[str, bytes]:
    torch_bytes = ckpt.read_bytes()
    st = _valid_safetensors(tmp_path)
    with zipfile.ZipFile(ckpt) as src:
        members = {i.filename: src.read(i) for i in src.infolist()}
    deflated, no_pkl = io.BytesIO(), io.BytesIO()
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, blob in members.items():
            zf.writestr(name, blob)
    with zipfile.ZipFile(no_pkl, "w") as zf:
        for name, blob in members.items():
            if not name.endswith("data.pkl"):
                zf.writestr(name, blob)
    bad_global = io.BytesIO()
    with zipfile.ZipFile(bad_global, "w") as zf:
        zf.writestr("x/data.pkl", pickle.dumps({"f": eval}, protocol=2))
    rng = random.Random(7)
    return {
        "empty": b"",
        "text": b"hello, this is not a checkpoint\n" * 20,
        "random": bytes(rng.randrange(256) for _ in range(4096)),
        "zip_magic_only": b"PK\x03\x04" + b"\0" * 100,
        "torch_truncated_half": torch_bytes[: len(torch_bytes) // 2],
        "torch_truncated_tail": torch_bytes[:-7],
        "torch_deflated": deflated.getvalue(),
        "torch_without_pkl": no_pkl.getvalue(),
        "pickle_with_eval": bad_global.getvalue(),
        "safetensors_truncated_header": st[:20],
        "safetensors_absurd_length": struct.pack("<Q", 1 << 40) + b"{}" + b"\0" * 30,
        "safetensors_bad_json": struct.pack("<Q", 10) + b"{not json}" + b"\0" * 8,
        "safetensors_out_of_range": _forged_safetensors(
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
        "safetensors_size_mismatch": _forged_safetensors(
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16),
        "safetensors_unknown_dtype": _forged_safetensors(
            {"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4),
    }


def test_garbage_and_truncated_files_give_none(tmp_path: Path, torch_ckpt) -> None:
    for label, blob in _garbage_cases(tmp_path, torch_ckpt[0]).items():
        assert build_index(lambda off, n, b=blob: b[off:off + n], len(blob)) is None, label
        path = tmp_path / f"{label}.bin"
        path.write_bytes(blob)
        assert index_file(path) is None, label
    assert index_file(tmp_path / "does-not-exist") is None


def test_bare_tensor_and_parameter(tmp_path: Path) -> None:
    t = torch.randn(3, 4)
    index = _save(t, tmp_path / "bare.pt")
    assert [e.name for e in index.tensors] == [""]
    _check_tensor((tmp_path / "bare.pt").read_bytes(), index.tensors[0], t)
    p = torch.nn.Parameter(torch.randn(5))
    index = _save([p, {"again": p}], tmp_path / "param.pt")
    assert [e.name for e in index.tensors] == ["0", "1.again"]
    assert index.tensors[0].offset == index.tensors[1].offset


def test_short_reads_are_tolerated(torch_ckpt) -> None:
    path, _, index = torch_ckpt
    data = path.read_bytes()
    again = build_index(lambda off, n: data[off:off + min(n, 7)], len(data))
    assert again == index


def _brute_force(index: TensorIndex, offset: int, length: int) -> list[TensorEntry]:
    return [t for t in index.tensors if t.length and length > 0
            and t.offset < offset + length and offset < t.offset + t.length]


def test_tensors_overlapping_matches_brute_force(torch_ckpt) -> None:
    _, _, ckpt_index = torch_ckpt
    rng = random.Random(3)
    synthetic = TensorIndex("safetensors", (Record("header", 0, 8),), tuple(
        TensorEntry(f"t{i}", "uint8", (n,), (1,), "", off, n)
        for i, (off, n) in enumerate((rng.randrange(100_000), rng.choice([0, 1, 50, 3000, 40_000]))
                                     for _ in range(3000))))
    for index in (ckpt_index, synthetic):
        hi = max(t.offset + t.length for t in index.tensors) + 10
        for _ in range(400):
            offset, length = rng.randrange(hi), rng.choice([0, 1, 2, 64, 1000, 20_000])
            got = index.tensors_overlapping(offset, length)
            assert sorted(got, key=repr) == sorted(_brute_force(index, offset, length), key=repr)
            assert [t.offset for t in got] == sorted(t.offset for t in got)
        assert len(index.tensors_overlapping(0, hi)) == sum(1 for t in index.tensors if t.length)


def test_zip64_archive(tmp_path: Path, torch_ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, sd, _ = torch_ckpt
    with zipfile.ZipFile(ckpt) as src:
        members = [(i.filename.replace("model/", "big/", 1), src.read(i)) for i in src.infolist()]
    path = tmp_path / "big.pt"
    # Tiny limits make zipfile emit zip64 extras in the central directory (sizes and
    # local offsets as 0xFFFFFFFF sentinels) and the zip64 end records.
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", -1)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 1)
    with zipfile.ZipFile(path, "w", allowZip64=True) as zf:
        for name, blob in members:
            with zf.open(name, "w", force_zip64=True) as f:
                f.write(blob)
    monkeypatch.undo()
    data = bytearray(path.read_bytes())
    # Put sentinels in the classic end record too, as a >4 GiB archive would have.
    eocd = data.rfind(b"PK\x05\x06")
    struct.pack_into("<HHII", data, eocd + 8, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    assert data.rfind(b"PK\x06\x06") > 0 and data.rfind(b"PK\x06\x07") > 0
    path.write_bytes(bytes(data))
    index = index_file(path)
    assert index is not None
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        assert [r.name for r in index.records] == [i.filename for i in infos]
        for rec, info in zip(index.records, infos):
            assert data[rec.offset:rec.offset + rec.length] == zf.read(info)
        start = min(zf.start_dir, len(data) - EOCD_SEARCH)     # the end record's search comes first
        assert index.read_order()[0] == (start, len(data) - start)
    expected = _flatten(sd)
    assert sorted(t.name for t in index.tensors) == sorted(expected)
    for entry in index.tensors:
        _check_tensor(bytes(data), entry, expected[entry.name])


def test_indexing_does_not_import_torch(torch_ckpt) -> None:
    code = ("import sys; from cpfs.tensor_index import index_file; "
            f"i = index_file({str(torch_ckpt[0])!r}); "
            "assert i is not None and len(i.tensors) > 10; "
            "assert 'torch' not in sys.modules and 'safetensors' not in sys.modules")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def test_every_pickle_protocol_indexes_the_same(tmp_path: Path) -> None:
    """Protocols 1-5 use different opcodes (LONG vs LONG1, GLOBAL vs STACK_GLOBAL, sets as REDUCE
    vs EMPTY_SET/ADDITEMS, MEMOIZE, FRAME...): all must give the same tensors."""
    t = torch.randn(4, 3)
    obj = {"w": t, "v": t[1:], 7: [t, (1.5, 2**70, -5, None, True)], "s": {1, 2},
           "f": frozenset({3}), "b": b"xx", "od": collections.OrderedDict(a=torch.arange(5))}
    seen = []
    for protocol in range(1, 6):
        path = tmp_path / f"p{protocol}.pt"
        torch.save(obj, path, pickle_protocol=protocol)
        index = index_file(path)
        assert index is not None, protocol
        data, expected = path.read_bytes(), _flatten(obj)
        for entry in index.tensors:
            _check_tensor(data, entry, expected[entry.name])
        seen.append([(e.name, e.storage_key, e.shape, e.stride, e.length) for e in index.tensors])
    assert sorted(n for n, *_ in seen[0]) == ["7.0", "od.a", "v", "w"]
    assert all(s == seen[0] for s in seen)


# --- crafted files: shared references in the pickle memo -----------------------------------------
# Pickle memoizes by identity, so t = (t, t) sixty times over is a few hundred bytes; hashing,
# repr() or str() of it visits 2**60 nodes. The C unpickler hashes dict keys and set members, so
# the old indexer froze the daemon (with the GIL held) on such a file. These checks run the indexer
# in a subprocess with a timeout and a memory limit, so a regression fails instead of hanging.

class _StorageRef:
    """Stands for a storage in a hand-made data.pkl (see _CraftPickler)."""


class _TensorRef:
    """A float32 tensor of 4 elements over _StorageRef, pickled as torch.save pickles a tensor."""

    def __init__(self, storage: _StorageRef) -> None:
        self.storage = storage

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, (4,), (1,), False, collections.OrderedDict()))


class _Reduced:
    """Pickles as func(*args), plus dict items; the test process never builds (or hashes) it."""

    def __init__(self, func: object, args: tuple, items: list | None = None) -> None:
        self.func, self.args, self.items = func, args, items

    def __reduce__(self):
        return (self.func, self.args, None, None, iter(self.items) if self.items else None)


class _CraftPickler(pickle.Pickler):
    def persistent_id(self, obj: object):
        if isinstance(obj, _StorageRef):
            return ("storage", torch.FloatStorage, "0", "cpu", 4)
        return None


def _shared_tuple(depth: int = 60) -> tuple:
    t: tuple = ()
    for _ in range(depth):
        t = (t, t)
    return t


def _shared_lists(leaf: object, depth: int = 60) -> list:
    node = [leaf]
    for _ in range(depth):
        node = [node, node]
    return node


_PAYLOAD = torch.tensor([1.0, 2.0, 3.0, 4.0])


def _crafted_pt(path: Path, extra: object = None, raw_pickle: bytes | None = None) -> Path:
    """A minimal torch zip: {"w": a tensor, "extra": extra}, or a given data.pkl."""
    if raw_pickle is None:
        buf = io.BytesIO()
        _CraftPickler(buf, protocol=2).dump({"w": _TensorRef(_StorageRef()),
                                             "extra": extra})
        raw_pickle = buf.getvalue()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("c/data.pkl", raw_pickle)
        zf.writestr("c/byteorder", "little")
        zf.writestr("c/data/0", _raw(_PAYLOAD))
        zf.writestr("c/version", "3\n")
    return path


def test_crafted_checkpoint_is_a_real_one(tmp_path: Path) -> None:
    """The crafting helper makes what torch.load reads; the bombs below only add to it."""
    path = _crafted_pt(tmp_path / "clean.pt", extra={"k": 1})
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], _PAYLOAD) and loaded["extra"] == {"k": 1}
    index = index_file(path)
    assert index is not None and [t.name for t in index.tensors] == ["w"]
    _check_tensor(path.read_bytes(), index.tensors[0], _PAYLOAD)


_PROBE = """
import json, logging, resource, sys, time, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from cpfs.tensor_index import index_file
tracemalloc.start()
start = time.process_time()
index = index_file(sys.argv[1])
print(json.dumps({"cpu": time.process_time() - start, "peak": tracemalloc.get_traced_memory()[1],
                  "names": None if index is None else [t.name for t in index.tensors]}))
"""


def _probe(path: Path) -> tuple[dict, str]:
    """Index `path` in a subprocess; (its CPU time, peak traced memory, tensor names), stderr."""
    root = Path(__file__).resolve().parents[1]
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(path)], cwd=root, capture_output=True,
                           text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"indexing {path.name} ({path.stat().st_size} bytes) did not finish in 60 s")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


@pytest.mark.parametrize("bomb", ["dict_key", "set_member", "device_arg"])
def test_shared_memo_bombs_index_in_bounded_time(tmp_path: Path, bomb: str) -> None:
    shared = _shared_tuple()
    extra = {
        "dict_key": _Reduced(collections.OrderedDict, (), [(shared, _TensorRef(_StorageRef()))]),
        "set_member": _Reduced(set, ([shared],)),
        "device_arg": _Reduced(torch.device, (shared,)),
    }[bomb]
    path = _crafted_pt(tmp_path / f"{bomb}.pt", extra)
    assert path.stat().st_size < 2048
    result, _ = _probe(path)
    assert result["cpu"] < 5 and result["peak"] < 16 << 20, result
    # The real tensor is indexed; a key that is neither str nor int is named by its position.
    assert result["names"] == (["w", "extra.#0"] if bomb == "dict_key" else ["w"])


def test_exponential_walk_gives_up_with_one_warning(tmp_path: Path) -> None:
    """A tensor reachable by 2**60 container paths: the file is left unindexed, and says so."""
    path = _crafted_pt(tmp_path / "paths.pt", _shared_lists(_TensorRef(_StorageRef())))
    result, stderr = _probe(path)
    assert result["names"] is None and result["cpu"] < 5 and result["peak"] < 64 << 20, result
    warnings = [line for line in stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and str(path) in warnings[0] and "budget" in warnings[0], stderr


def test_memo_index_bomb_allocates_little(tmp_path: Path) -> None:
    """LONG_BINPUT 2**24 in a 9-byte pickle: the C unpickler sized its memo by it (256 MiB)."""
    path = _crafted_pt(tmp_path / "memo.pt", raw_pickle=b"\x80\x02}r\x00\x00\x00\x01.")
    result, _ = _probe(path)
    assert result["names"] == [] and result["peak"] < 16 << 20, result


def test_unsupported_opcode_gives_none_with_a_warning(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = _crafted_pt(tmp_path / "ext.pt", raw_pickle=b"\x80\x02\x82\x01.")  # EXT1 1
    with caplog.at_level(logging.WARNING, logger="cpfs.tensor_index"):
        assert index_file(path, name="/ckpt/ext.pt") is None
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "no tensor index for /ckpt/ext.pt, stored without one: "
        "pickle opcode EXT1 is not interpreted"]
