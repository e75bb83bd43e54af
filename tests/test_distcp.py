"""torch.distributed.checkpoint (DCP), the format FSDP and large training runs save: per rank a
`.distcp` file of one torch.save per item, back to back, and a `.metadata` file written last.

The bytes come from real `dcp.save` calls (one process, no process group). Four layers: the boundary
scanner cuts every item as it cuts a torch.save of its own; the tensor index (`torch-dcp`) finds every
item's tensor at its bytes; the completeness check takes a `.distcp` file for whole only once its last
item is (before this, every `.distcp` was judged a truncated zip and its close failed with EIO); and a
real mount saves, reloads on a fresh mount, and dedups a second checkpoint whose layers are mostly
frozen. Learned prefetch of a DCP part load: tests/test_partial_mount.py.
"""
from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cpfs.chunking import BoundaryScanner, cut_points, tensor_boundaries
from cpfs.completeness import incomplete_reason
from cpfs.tensor_index import build_index
from test_write_mount import config, inspect
from tests.conftest import cpfs

MiB = 1024 * 1024
DATA = "__0_0.distcp"       # the data file of rank 0


def train_state(seed: int, layers: int = 12, changed: frozenset[int] = frozenset()) -> dict:
    """A model and its optimizer state, as a training loop hands them to dcp.save; the layers in
    `changed` differ from seed's (trained on), the rest are equal (frozen)."""
    g = torch.Generator().manual_seed(seed)
    model = {f"layers.{i}.w": torch.randn(256, 1024, generator=g) for i in range(layers)}
    model["embed"] = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    for i in changed:
        model[f"layers.{i}.w"] = model[f"layers.{i}.w"] + 1
    optim = {"step": 7 + len(changed), "lr": 1e-4,
             "exp_avg": {k: v.float() * 0.1 for k, v in model.items() if k.startswith("layers.0")}}
    return {"model": model, "optim": optim}


def empty_like(state: dict) -> dict:
    """What a loader passes to dcp.load: the same structure, tensors to fill in place."""
    return {k: empty_like(v) if isinstance(v, dict) else torch.empty_like(v) if isinstance(v, torch.Tensor)
            else v for k, v in state.items()}


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, dict):
            assert_same_state(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def save(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "torch.distributed is ... uninitialized": one process
        dcp.save(state, checkpoint_id=str(folder))


def load(like: dict, folder: Path) -> dict:
    out = empty_like(like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(folder))
    return out


def items(folder: Path) -> list[tuple[int, int]]:
    """(offset, length) of every item of the data file, in file order, from DCP's own metadata."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = dcp.FileSystemReader(str(folder)).read_metadata()
    return sorted((s.offset, s.length) for s in md.storage_data.values() if s.relative_path == DATA)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, bytes, list[tuple[int, int]]]:
    folder = tmp_path / "step_1"
    save(train_state(1), folder)
    data = (folder / DATA).read_bytes()
    spans = items(folder)
    assert len(spans) > 10 and spans[-1][0] + spans[-1][1] == len(data)
    assert all(data[o:o + 4] == b"PK\x03\x04" for o, _ in spans)    # each item: a torch.save zip
    return folder, data, spans


@pytest.mark.parametrize("chunk_size", [256 * 1024, 4 * MiB])
def test_the_scanner_cuts_each_item_as_a_torch_save_of_its_own(saved, chunk_size: int) -> None:
    _, data, spans = saved
    read_at = lambda off, n: data[off:off + n]
    expected = []
    for offset, length in spans:
        part = data[offset:offset + length]
        index = build_index(lambda o, n: part[o:o + n], length)
        assert index is not None
        expected += [offset + b for b in tensor_boundaries(index, chunk_size)]
    assert len(expected) >= 24                       # the 1 MiB layers are cut at both ends
    assert cut_points(read_at, len(data), None, chunk_size) == expected
    index = build_index(read_at, len(data))
    assert index is not None and index.format == "torch-dcp"
    assert cut_points(read_at, len(data), index, chunk_size) == expected     # `cpfs put` cuts alike

    stepped, rng, limit = BoundaryScanner(chunk_size), random.Random(3), 0
    while limit < len(data):                         # as the bytes arrive through a mount
        limit = min(len(data), limit + rng.choice([1, 30, 4096, 100_000, 700_000]))
        stepped.advance(read_at, limit)
        assert [b for b in stepped.boundaries if b < min(stepped.known_upto, limit)] == \
               [b for b in expected if b < min(stepped.known_upto, limit)]
    stepped.advance(read_at, len(data), eof=True, budget=1 << 40)
    assert stepped.boundaries == expected


def test_the_index_of_a_distcp_file_is_its_items_tensors(saved) -> None:
    """Item k's tensor, named "k", at the bytes DCP's metadata gives it (past its zip headers); its
    dtype and shape as saved; the readahead's units are the items' storages in file order."""
    folder, data, spans = saved
    index = build_index(lambda o, n: data[o:o + n], len(data))
    assert index is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = dcp.FileSystemReader(str(folder)).read_metadata()
    state = {"model." + k: v for k, v in train_state(1)["model"].items()}
    state |= {"optim.exp_avg." + k: v for k, v in train_state(1)["optim"]["exp_avg"].items()}
    fqn_at = {s.offset: k.fqn for k, s in md.storage_data.items()}
    tensors = {t.name: t for t in index.tensors}
    for k, (offset, length) in enumerate(spans):
        fqn = fqn_at[offset]
        if fqn not in state:                 # "optim.step", "optim.lr": pickled values, no tensor
            continue
        t, want = tensors[str(k)], state[fqn]
        assert offset < t.offset and t.offset + t.length <= offset + length
        assert t.shape == tuple(want.shape) and t.dtype == str(want.dtype).removeprefix("torch.")
        assert data[t.offset:t.offset + t.length] == want.contiguous().view(torch.uint8).numpy().tobytes(), fqn
    assert index.read_order() == sorted(index.read_order())
    assert len(index.record_starts()) == len([t for t in index.tensors if t.length])


def test_an_item_that_is_no_torch_save_we_read_gives_no_tensor_and_the_others_are_indexed() -> None:
    """Zips back to back where the middle one is a plain zip (no data.pkl): the tensors of the others,
    at their bytes; a file whose last zip claims to start past its own end: no index, no error."""
    import io
    import zipfile

    def saved(t: torch.Tensor) -> bytes:
        buf = io.BytesIO()
        torch.save(t, buf)
        return buf.getvalue()

    plain = io.BytesIO()
    with zipfile.ZipFile(plain, "w") as z:
        z.writestr("notes.txt", b"x" * 20_000)
    a, b = torch.arange(50_000, dtype=torch.float32), torch.ones(3, 7, dtype=torch.bfloat16)
    parts = [saved(a), plain.getvalue(), saved(b)]
    data = b"".join(parts)
    index = build_index(lambda o, n: data[o:o + n], len(data))
    assert index is not None and index.format == "torch-dcp"
    assert [(t.name, t.shape) for t in index.tensors] == [("0", (50_000,)), ("2", (3, 7))]
    for t, want in zip(index.tensors, (a, b)):
        assert data[t.offset:t.offset + t.length] == want.view(torch.uint8).numpy().tobytes()
    assert any(r.name == "1/notes.txt" for r in index.records)          # 20 KB: kept (cuts may fall there)
    bogus = bytearray(parts[0] + parts[2])
    at = len(bogus) - 22 - 20 - 56 + 40             # torch writes zip64 end records: their directory size
    assert bogus[at - 40:at - 36] == b"PK\x06\x06"
    cd_size = int.from_bytes(bogus[at:at + 8], "little")
    bogus[at:at + 8] = (cd_size + 10 ** 6).to_bytes(8, "little")         # a directory longer than the file
    assert build_index(lambda o, n: bytes(bogus[o:o + n]), len(bogus)) is None


def test_a_distcp_file_is_whole_only_when_its_last_item_is(saved) -> None:
    """Cut inside any item (a saver killed mid-save), the file is incomplete; whole, it is complete.
    Cut exactly between two items it looks whole: `.metadata`, which dcp.save writes last, is what
    names the items, and without it the checkpoint does not load."""
    _, data, spans = saved
    reader = lambda blob: (lambda o, n: blob[o:o + n])
    assert incomplete_reason(reader(data), len(data)) is None
    cuts = {o + d for o, n in spans for d in (4, 30, 200, n // 2, n - 22, n - 1) if 0 < d < n}
    cuts |= set(random.Random(4).sample(range(4, len(data)), 300)) - {o + n for o, n in spans}
    wrongly_whole = [c for c in sorted(cuts) if incomplete_reason(reader(data[:c]), c) is None]
    assert wrongly_whole == []
    assert all(incomplete_reason(reader(data[:o + n]), o + n) is None for o, n in spans)
    # A directory that names a member where there is none: not whole.
    o, n = spans[-1]
    cd = data.rindex(b"PK\x01\x02")
    local = int.from_bytes(data[cd + 42:cd + 46], "little")
    broken = bytearray(data)
    broken[o + local:o + local + 4] = b"XXXX"
    assert "no local header" in incomplete_reason(reader(bytes(broken)), len(broken))


@pytest.mark.mount
def test_dcp_saves_and_loads_through_the_mount_and_frozen_layers_dedup(make_config, tmp_path, mount):
    """dcp.save through a mount commits (it failed with EIO: the `.distcp` file was judged a
    truncated zip); dcp.load on a fresh mount gives every tensor back; a second checkpoint with 2 of
    12 layers trained adds about those layers; the file written through the mount is cut as
    `cpfs put` cuts the same bytes."""
    cfg = config(make_config, tmp_path, chunk_size="4MiB", cache="256MiB")
    m = mount(cfg)
    first, second = train_state(1), train_state(1, changed=frozenset({2, 9}))
    save(first, m.path / "run" / "step_1")
    save(second, m.path / "run" / "step_2")
    m.stop()

    m = mount(cfg, "fresh")
    assert_same_state(load(first, m.path / "run" / "step_1"), first)
    assert_same_state(load(second, m.path / "run" / "step_2"), second)

    one, two = inspect(cfg, f"run/step_1/{DATA}"), inspect(cfg, f"run/step_2/{DATA}")
    known = {c[0] for c in one["chunks"]}
    new = sum(c[1] for c in two["chunks"] if c[0] not in known)
    layer = 256 * 1024 * 4
    print(f"\nDCP dedup: step_2's {DATA} ({two['size'] / MiB:.1f} MiB, {len(two['chunks'])} chunks) "
          f"adds {new / MiB:.2f} MiB of new chunk data; 2 layers trained = {2 * layer / MiB:.0f} MiB")
    assert 2 * layer <= new <= 2 * layer + 0.15 * two["size"]

    # torch.save gives every save an id of its own (archive/.data/serialization_id): the same state
    # saved again has the same layout, not the same bytes.
    local = tmp_path / "local"
    save(second, local)
    assert (local / DATA).stat().st_size == two["size"]
    cpfs("put", str(local / DATA), f"/imported/{DATA}", config=cfg)
    assert [c[1] for c in inspect(cfg, f"imported/{DATA}")["chunks"]] == [c[1] for c in two["chunks"]]


@pytest.mark.mount
def test_dcp_async_save_several_writer_threads_and_the_hugging_face_writer_through_the_mount(
        make_config, tmp_path, mount):
    """The other ways a training loop calls DCP, which the README names: `async_save` (the save runs
    in a background thread while training goes on; its future's result() is the commit), a
    FileSystemWriter of 4 threads (4 `.distcp` files written at once) and the Hugging Face storage
    writer (safetensors shards and their index). Each loads back equal on a fresh mount."""
    cfg = config(make_config, tmp_path, chunk_size="4MiB", cache="256MiB")
    m = mount(cfg)
    first, second = train_state(3, layers=6), train_state(4, layers=6)
    flat = {f"layers.{i}.w": torch.randn(128, 256, generator=torch.Generator().manual_seed(i)) for i in range(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pending = dcp.async_save(first, checkpoint_id=str(m.path / "run" / "async"))
        dcp.save(second, storage_writer=dcp.FileSystemWriter(str(m.path / "run" / "threads"), thread_count=4))
        pending.result()
        dcp.save(flat, storage_writer=dcp.HuggingFaceStorageWriter(path=str(m.path / "run" / "hf")))
    assert len(list((m.path / "run" / "threads").glob("*.distcp"))) == 4
    m.stop()

    m = mount(cfg, "fresh")
    assert_same_state(load(first, m.path / "run" / "async"), first)
    assert_same_state(load(second, m.path / "run" / "threads"), second)
    got = {k: torch.empty_like(v) for k, v in flat.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=dcp.HuggingFaceStorageReader(path=str(m.path / "run" / "hf")))
    assert_same_state(got, flat)
    assert {p.name for p in (m.path / "run" / "hf").iterdir()} == {"model-00001-of-00001.safetensors",
                                                                  "model.safetensors.index.json"}
