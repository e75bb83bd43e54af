"""`cpfs put` and the tools that read back: exact bytes of a 1 GiB checkpoint, dedup, replica repair on
read, cuts on tensor boundaries, and the ls / inspect / rm / folder-put commands."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import ROOT, cpfs, write_config
from cpfs import chunk as chunkfmt
from cpfs.catalog import Catalog
from cpfs.chunking import record_cuts, tensor_boundaries
from cpfs.config import load_config
from cpfs.cli import rm_targets
from cpfs.errors import CorruptChunk, StoreError, StoreUnavailable
from cpfs.importer import Importer
from cpfs.manifest import Manifest
from cpfs.pool import StorePool
from cpfs.store import FaultyStore, open_store
from cpfs.tensor_index import TensorIndex

GiB = 1024**3


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _cat_sha256(config: Path, path: str, tmp: Path) -> tuple[int, str, int, str]:
    """Run `cpfs cat`, hashing stdout as it streams: (exit status, sha256, bytes, stderr)."""
    err = tmp / "cat.stderr"
    h, n = hashlib.sha256(), 0
    with open(err, "wb") as ferr:
        proc = subprocess.Popen([sys.executable, "-m", "cpfs.cli", "--config", str(config), "cat", path],
                                stdout=subprocess.PIPE, stderr=ferr, cwd=ROOT)
        assert proc.stdout is not None
        while block := proc.stdout.read(8 << 20):
            h.update(block)
            n += len(block)
        rc = proc.wait()
    return rc, h.hexdigest(), n, err.read_text()


def _store_bytes(root: Path) -> int:
    """Bytes of chunk data (manifests are versions: a second put adds one, by design)."""
    return sum(p.stat().st_size for p in root.glob("*/chunks/**/*") if p.is_file())


def _chunk_files(root: Path) -> dict[str, list[Path]]:
    """digest -> the replica files holding it, over every store under `root`."""
    out: dict[str, list[Path]] = {}
    for p in sorted(root.glob("*/chunks/*/*")):
        out.setdefault(p.name, []).append(p)
    return out


def _new_chunk_data(stdout: str) -> str:
    m = re.search(r"new chunk data ([0-9.]+ [KMGT]?i?B)", stdout)
    assert m, stdout
    return m.group(1)


# ---- the 1 GiB checkpoint -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def checkpoint_1g(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A ~1 GiB torch.save checkpoint of a transformer-like state dict (bf16 matrices, fp32 norms),
    fixed seed; made once per session, deleted at its end. Yields (path, sha256)."""
    torch.manual_seed(0)
    d = 2048
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(16384, d, dtype=torch.bfloat16)}
    for i in range(15):
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = torch.randn(3 * d, d, dtype=torch.bfloat16)
        sd[p + "attn.o.weight"] = torch.randn(d, d, dtype=torch.bfloat16)
        sd[p + "mlp.up.weight"] = torch.randn(2 * d, d, dtype=torch.bfloat16)
        sd[p + "mlp.down.weight"] = torch.randn(d, 2 * d, dtype=torch.bfloat16)
        sd[p + "norm1.weight"] = torch.ones(d)
        sd[p + "norm2.weight"] = torch.randn(d)
    sd["final_norm.weight"] = torch.ones(d)
    path = tmp_path_factory.mktemp("ckpt1g") / "step_1000.pt"
    torch.save({"model": sd, "step": 1000, "lr": 3e-4}, path)
    del sd
    assert path.stat().st_size >= GiB
    yield path, _sha256(path)
    path.unlink()


@pytest.fixture(scope="module")
def imported_1g(tmp_path_factory: pytest.TempPathFactory, checkpoint_1g) -> Iterator[tuple[Path, Path, str]]:
    """The checkpoint put once into 3 stores with the default chunk size and replicas (2 GiB of stores,
    deleted after this module). Yields (config, stores folder, stdout of the put)."""
    folder = tmp_path_factory.mktemp("stores1g")
    config = write_config(folder, stores=3, replicas=2, chunk_size="4MiB", cache="1GiB")
    src, _ = checkpoint_1g
    r = cpfs("put", str(src), "/run1/step_1000.pt", config=config, text=True)
    yield config, folder / "stores", r.stdout
    shutil.rmtree(folder / "stores")


@pytest.mark.long
def test_put_cat_1gib_exact(imported_1g, checkpoint_1g, tmp_path: Path) -> None:
    """put then cat of a 1 GiB checkpoint gives back the exact bytes; every chunk has 2 replicas on
    distinct stores and the chunks spread over all 3."""
    config, stores, out = imported_1g
    src, digest = checkpoint_1g
    size = src.stat().st_size
    assert _new_chunk_data(out) == "1.0 GiB" and "over 2 replicas" in out
    assert f"/run1/step_1000.pt  {size} bytes" in out
    files = _chunk_files(stores)
    assert all(len(reps) == 2 and len({p.parts[-4] for p in reps}) == 2 for reps in files.values())
    per_store = {s.name: len(list(s.glob("chunks/*/*"))) for s in stores.iterdir()}
    assert len(per_store) == 3 and min(per_store.values()) > len(files) / 2, per_store
    rc, got, n, err = _cat_sha256(config, "/run1/step_1000.pt", tmp_path)
    assert rc == 0, err
    assert (n, got) == (size, digest)
    assert err == ""


@pytest.mark.long
def test_second_put_adds_nothing(imported_1g, checkpoint_1g) -> None:
    """Putting the same 1 GiB file again writes no chunk data: the CLI says so and the stores' folders
    do not grow."""
    config, stores, _ = imported_1g
    src, _ = checkpoint_1g
    before_total, before_chunks = _store_bytes(stores), _chunk_files(stores)
    r = cpfs("put", str(src), "/run1/step_1000.pt", config=config, text=True)
    assert _new_chunk_data(r.stdout) == "0 B" and "stored 0 B" in r.stdout
    assert _chunk_files(stores) == before_chunks
    assert _store_bytes(stores) == before_total      # only a new manifest version was written


@pytest.mark.long
def test_corrupt_replica_served_from_other(imported_1g, checkpoint_1g, tmp_path: Path) -> None:
    """With one byte flipped in store s1's replica of every chunk it holds (so each chunk has exactly one
    bad replica), cat still gives the exact bytes and stderr names s1 as holding corrupt replicas."""
    config, stores, _ = imported_1g
    src, digest = checkpoint_1g
    victims = sorted((stores / "s1").glob("chunks/*/*"))
    assert victims

    def flip() -> None:
        for p in victims:
            offset = (chunkfmt.HEADER_SIZE + p.stat().st_size) // 2      # a payload byte
            with open(p, "r+b") as f:
                f.seek(offset)
                b = f.read(1)
                f.seek(offset)
                f.write(bytes([b[0] ^ 0xFF]))

    def unflip() -> None:
        """Undo the damage read repair has not undone already (it rewrites copies it found bad)."""
        for p in victims:
            try:
                chunkfmt.decode(p.read_bytes(), p.name)
            except CorruptChunk:
                offset = (chunkfmt.HEADER_SIZE + p.stat().st_size) // 2
                with open(p, "r+b") as f:
                    f.seek(offset)
                    b = f.read(1)
                    f.seek(offset)
                    f.write(bytes([b[0] ^ 0xFF]))

    flip()
    try:
        rc, got, n, err = _cat_sha256(config, "/run1/step_1000.pt", tmp_path)
    finally:
        unflip()
    assert rc == 0, err
    assert (n, got) == (src.stat().st_size, digest)
    lines = err.splitlines()
    assert lines and all("WARNING" in ln and ("corrupt replica" in ln or "read repair: rewrote" in ln)
                         and "on store 's1'" in ln for ln in lines), err
    assert "file /run1/step_1000.pt offset" in lines[0]
    assert all(chunkfmt.decode(p.read_bytes(), p.name) is not None for p in victims)


# ---- dedup and cuts on real checkpoints -----------------------------------------------------------------

def _layers(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    sd = {}
    for i in range(10):
        sd[f"layers.{i}.weight"] = torch.randn(512, 512)     # 1 MiB fp32
        sd[f"layers.{i}.bias"] = torch.randn(512)
        sd[f"layers.{i}.norm"] = torch.randn(256, 256, dtype=torch.bfloat16)   # 128 KiB
    return sd


def _importer(config_path: Path) -> Importer:
    pool = StorePool(load_config(config_path))
    return Importer(pool, Catalog(pool))


def _check_cuts(m: Manifest, chunk_size: int) -> None:
    """Chunks cover the file exactly, none exceeds chunk_size, and every large tensor/record is cut where
    `record_cuts` says: at its start and end, or (torch records) LEAD bytes in and TAIL bytes short."""
    assert m.chunks and all(0 < c.raw_len <= chunk_size for c in m.chunks)
    assert m.offsets[-1] == m.size
    index = TensorIndex.from_json(m.tensor_index)
    starts = set(m.offsets)
    bounds = tensor_boundaries(index, chunk_size)
    assert bounds and set(bounds) <= starts
    large = [t for t in index.tensors if t.length >= chunk_size // 8]
    assert large
    for t in large:
        assert set(record_cuts(t.offset, t.length, chunk_size, index.format == "torch-zip")) <= starts, t


async def test_dedup_across_torch_saves(tmp_path: Path) -> None:
    """Two torch.save checkpoints where 1 of 10 layers changed (same shapes) share >= 80% of chunk bytes:
    the second put writes little new chunk data, and the cuts fall on tensor boundaries."""
    chunk_size = 256 * 1024
    config = write_config(tmp_path / "cfg", stores=3, chunk_size="256KiB")
    sd = _layers()
    torch.save(sd, tmp_path / "a.pt")
    sd["layers.3.weight"] = torch.randn(512, 512)
    sd["layers.3.norm"] = torch.randn(256, 256, dtype=torch.bfloat16)
    torch.save(sd, tmp_path / "b.pt")
    size_b = (tmp_path / "b.pt").stat().st_size

    first = _importer(config)
    (ma,) = await first.put(tmp_path / "a.pt", "/run/a.pt")
    assert first.stats.new_raw_bytes == ma.size      # random tensors: all new
    second = _importer(config)
    (mb,) = await second.put(tmp_path / "b.pt", "/run/b.pt")
    assert second.stats.new_raw_bytes <= 0.2 * size_b, (second.stats.new_raw_bytes, size_b)
    assert second.stats.new_raw_bytes >= 1024**2          # the changed layer is new data
    known = {c.digest for c in ma.chunks}
    shared = sum(c.raw_len for c in mb.chunks if c.digest in known)
    assert shared >= 0.8 * size_b
    assert shared + second.stats.new_raw_bytes == size_b   # no chunk repeats within b.pt
    for m in (ma, mb):
        _check_cuts(m, chunk_size)


async def test_cuts_on_safetensors_and_repeated_chunks(tmp_path: Path) -> None:
    """A safetensors file is cut on its tensor boundaries, and a chunk repeated inside one file (identical
    tensors) is stored once."""
    config = write_config(tmp_path / "cfg", stores=2, chunk_size="128KiB")
    torch.manual_seed(1)
    tensors = {f"zero{i}": torch.zeros(64, 1024) for i in range(4)}         # 256 KiB each, identical
    tensors["w"] = torch.randn(300, 700).to(torch.bfloat16)
    tensors["tiny"] = torch.arange(10, dtype=torch.int64)
    save_file(tensors, tmp_path / "m.safetensors")
    imp = _importer(config)
    (m,) = await imp.put(tmp_path / "m.safetensors", "/m.safetensors")
    _check_cuts(m, 128 * 1024)
    assert m.tensor_index["format"] == "safetensors"
    zero = chunkfmt.chunk_hash(bytes(128 * 1024))
    assert [c.digest for c in m.chunks].count(zero) == 8      # 4 x 256 KiB of zeros, cut in 8
    assert imp.stats.new_raw_bytes == m.size - 7 * 128 * 1024  # ... stored once
    stored = _chunk_files(tmp_path / "cfg" / "stores")
    assert set(stored) == {c.digest for c in m.chunks}


# ---- the other commands ---------------------------------------------------------------------------------

@pytest.fixture
def small_tree(tmp_path: Path) -> Path:
    """A folder of checkpoints: nested folders, an empty file, a name with a space."""
    src = tmp_path / "ckpts"
    (src / "run1").mkdir(parents=True)
    (src / "run1" / "deep").mkdir()
    torch.manual_seed(2)
    torch.save({"w": torch.randn(300, 300), "b": torch.randn(300)}, src / "run1" / "step_1.pt")
    save_file({"w": torch.randn(200, 200)}, src / "run1" / "deep" / "model.safetensors")
    (src / "notes 1.txt").write_text("learning rate 3e-4\n" * 100)
    (src / "empty.bin").write_bytes(b"")
    return src


def _tree_files(src: Path) -> dict[str, bytes]:
    return {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}


def test_put_folder_recursively(tmp_path: Path, small_tree: Path) -> None:
    """put of a folder imports every file under DEST with the same layout (default DEST: the folder's
    name), and cat gives each back exactly."""
    config = write_config(tmp_path / "cfg")
    r = cpfs("put", str(small_tree), "/exp/a", config=config, text=True)
    files = _tree_files(small_tree)
    assert f"put {len(files)} file(s)" in r.stdout
    for rel, data in files.items():
        assert f"  /exp/a/{rel}  {len(data)} bytes" in r.stdout
        assert cpfs("cat", f"/exp/a/{rel}", config=config).stdout == data
    cpfs("put", str(small_tree), config=config)
    assert cpfs("cat", "/ckpts/run1/deep/model.safetensors", config=config).stdout == \
        files["run1/deep/model.safetensors"]
    assert cpfs("ls", "/", config=config, text=True).stdout.split() == ["-", "ckpts/", "-", "exp/"]


def test_ls(tmp_path: Path, small_tree: Path) -> None:
    """ls lists folders first, then files with sizes; ls of a file shows that file; a missing path fails."""
    config = write_config(tmp_path / "cfg")
    cpfs("put", str(small_tree), "/c", config=config)
    lines = cpfs("ls", "/c", config=config, text=True).stdout.splitlines()
    assert lines[0].split() == ["-", "run1/"]
    assert [ln.split()[0] for ln in lines[1:]] == ["0", "1900"]
    assert [ln.split(maxsplit=3)[3] for ln in lines[1:]] == ["empty.bin", "notes 1.txt"]
    one = cpfs("ls", "/c/run1/step_1.pt", config=config, text=True).stdout.split()
    assert one[0] == str((small_tree / "run1" / "step_1.pt").stat().st_size) and one[-1] == "step_1.pt"
    assert cpfs("ls", "c/run1/", config=config, text=True).stdout.split()[:2] == ["-", "deep/"]
    r = cpfs("ls", "/nope", config=config, check=False, text=True)
    assert r.returncode == 1 and r.stderr == "cpfs: error: /nope: no such file or folder\n"


def test_inspect(tmp_path: Path, small_tree: Path) -> None:
    """inspect shows chunks, replicas and the tensor table; --json parses and carries chunks_per_store
    and the tensor index."""
    config = write_config(tmp_path / "cfg", stores=3, chunk_size="64KiB")
    src = small_tree / "run1" / "step_1.pt"
    cpfs("put", str(src), "/r/step_1.pt", config=config)
    doc = json.loads(cpfs("inspect", "--json", "/r/step_1.pt", config=config).stdout)
    assert doc["path"] == "/r/step_1.pt" and doc["size"] == src.stat().st_size
    assert sum(c[1] for c in doc["chunks"]) == doc["size"]
    per_store = doc["chunks_per_store"]
    assert set(per_store) <= {"s0", "s1", "s2"} and sum(per_store.values()) == 2 * len(doc["chunks"])
    tensors = {t["name"]: t for t in doc["tensor_index"]["tensors"]}
    assert set(tensors) == {"w", "b"}
    assert tensors["w"]["shape"] == [300, 300] and tensors["w"]["dtype"] == "float32"
    assert tensors["w"]["length"] == 300 * 300 * 4
    with open(src, "rb") as f:       # the index points at the tensor's bytes in the file
        f.seek(tensors["b"]["offset"])
        assert f.read(tensors["b"]["length"]) == torch.load(src)["b"].numpy().tobytes()
    text = cpfs("inspect", "/r/step_1.pt", config=config, text=True).stdout
    assert f"chunks      {len(doc['chunks'])} " in text
    assert "replicas    " + ", ".join(f"{s}: {n} chunks" for s, n in sorted(per_store.items())) in text
    assert re.search(r"^\s+w\s+float32\s+\[300, 300\]\s+\d+\s+360000$", text, re.M), text
    assert re.search(r"^\s+b\s+float32\s+\[300\]\s+\d+\s+1200$", text, re.M), text
    r = cpfs("inspect", "/r/nope.pt", config=config, check=False, text=True)
    assert r.returncode == 1 and r.stderr == "cpfs: error: no file '/r/nope.pt'\n"


def test_rm(tmp_path: Path, small_tree: Path) -> None:
    """rm removes a file (then cat fails with one clear line, exit 1) and, with -r only, a folder;
    other files, also ones sharing chunks, still read."""
    config = write_config(tmp_path / "cfg")
    cpfs("put", str(small_tree), "/c", config=config)
    cpfs("put", str(small_tree / "run1" / "step_1.pt"), "/copy.pt", config=config)
    assert cpfs("rm", "/c/run1/step_1.pt", config=config, text=True).stdout == "removed /c/run1/step_1.pt\n"
    r = cpfs("cat", "/c/run1/step_1.pt", config=config, check=False, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == "cpfs: error: no file '/c/run1/step_1.pt'\n"
    assert cpfs("cat", "/copy.pt", config=config).stdout == (small_tree / "run1" / "step_1.pt").read_bytes()
    r = cpfs("rm", "/c/run1", config=config, check=False, text=True)
    assert r.returncode == 1 and r.stderr == "cpfs: error: /c/run1: is a folder (use -r)\n"
    assert cpfs("rm", "-r", "/c", config=config, text=True).stdout.splitlines() == [
        "removed /c/empty.bin", "removed /c/notes 1.txt", "removed /c/run1/deep/model.safetensors"]
    assert cpfs("ls", "/", config=config, text=True).stdout.split()[-1] == "copy.pt"
    r = cpfs("rm", "/c", config=config, check=False, text=True)
    assert r.returncode == 1 and "no such file or folder" in r.stderr


def test_put_of_a_folder_keeps_links_as_links_and_empty_folders(tmp_path: Path, mount) -> None:
    """put of a folder imports what `cp -a` copies: symbolic links as links (a `latest -> step_2`
    link, a Hugging Face snapshot's relative links to its blobs), empty folders; fifos and the like
    are named and left out. Links were followed, and a link to a folder, a dangling link and an empty
    folder were left out without a word. `-L` imports what the links point to, as `cp -rL` does."""
    src = tmp_path / "run"
    (src / "blobs").mkdir(parents=True)
    (src / "step_2").mkdir()
    (src / "empty").mkdir()
    data = {"blobs/abc": os.urandom(300_000), "step_2/model.pt": os.urandom(200_000)}
    for rel, d in data.items():
        (src / rel).write_bytes(d)
    (src / "step_2" / "weights.bin").symlink_to("../blobs/abc")
    (src / "latest").symlink_to("step_2")
    (src / "gone").symlink_to("no-such-file")
    os.mkfifo(src / "pipe")
    (src / "sockets").mkdir()
    os.mkfifo(src / "sockets" / "fifo")                  # a folder of nothing to import: made empty
    config = write_config(tmp_path / "cfg")
    r = cpfs("put", str(src), "/run", config=config, text=True)
    assert "put 2 file(s)" in r.stdout and "and 3 symbolic link(s)" in r.stdout and "2 empty folder(s)" in r.stdout
    assert "  /run/latest -> step_2" in r.stdout and "  /run/empty/" in r.stdout
    assert "pipe is no regular file, link or folder" in r.stderr, r.stderr
    cpfs("put", str(src), "/run", config=config)             # again: the empty folder is there, no error
    m = mount(config)
    assert os.readlink(m.path / "run" / "latest") == "step_2"
    assert os.readlink(m.path / "run" / "gone") == "no-such-file"
    assert os.readlink(m.path / "run" / "step_2" / "weights.bin") == "../blobs/abc"
    assert (m.path / "run" / "latest" / "weights.bin").read_bytes() == data["blobs/abc"]
    assert (m.path / "run" / "latest" / "model.pt").read_bytes() == data["step_2/model.pt"]
    assert (m.path / "run" / "empty").is_dir() and not list((m.path / "run" / "empty").iterdir())
    assert not (m.path / "run" / "pipe").exists()
    assert (m.path / "run" / "sockets").is_dir() and not list((m.path / "run" / "sockets").iterdir())

    r = cpfs("put", "-L", str(src), "/followed", config=config, check=False, text=True)
    assert r.returncode == 1 and "no-such-file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (src / "gone").unlink()
    r = cpfs("put", "-L", str(src), "/followed", config=config, text=True)
    assert "symbolic link" not in r.stdout
    for rel, d in {"latest/model.pt": data["step_2/model.pt"], "latest/weights.bin": data["blobs/abc"],
                   "step_2/weights.bin": data["blobs/abc"]}.items():
        assert cpfs("cat", f"/followed/{rel}", config=config).stdout == d
    (src / "step_2" / "loop").symlink_to("..")
    r = cpfs("put", "-L", str(src), "/loop", config=config, check=False, text=True)
    assert r.returncode == 1 and "a loop" in r.stderr and "/loop" not in cpfs("ls", "/", config=config, text=True).stdout


def test_put_over_a_folder_or_inside_a_file_is_refused_and_stores_nothing(tmp_path: Path, small_tree: Path) -> None:
    """`put notes.txt /c/run1` where /c/run1 is a folder, or a folder under a file's name: refused with
    one line (exit 1), the tree as it was. Both once succeeded, and a mount then showed one of the two
    and hid the other: the folder's checkpoints gave ENOTDIR (an audit's find)."""
    config = write_config(tmp_path / "cfg")
    cpfs("put", str(small_tree), "/c", config=config)

    def listing() -> list[str]:
        return [cpfs("ls", p, config=config, text=True).stdout for p in ("/c", "/c/run1")]
    before = listing()
    r = cpfs("put", str(small_tree / "notes 1.txt"), "/c/run1", config=config, check=False, text=True)
    assert r.returncode == 1 and r.stderr == ("cpfs: error: /c/run1: a folder; remove it first (cpfs rm -r) or put "
                                              "elsewhere; nothing was stored\n"), r.stderr
    r = cpfs("put", str(small_tree / "run1"), "/c/notes 1.txt", config=config, check=False, text=True)
    assert r.returncode == 1 and "/c/notes 1.txt: a file, so /c/notes 1.txt/deep/model.safetensors cannot go " \
        "inside it" in r.stderr, r.stderr
    assert listing() == before
    cpfs("put", str(small_tree / "notes 1.txt"), "/c/run1/notes.txt", config=config)     # beside them: fine
    assert "notes.txt" in cpfs("ls", "/c/run1", config=config, text=True).stdout


def test_put_of_a_name_no_mount_can_show_is_refused_and_stores_nothing(tmp_path: Path) -> None:
    """A name over 255 bytes, or the control file's, is refused with one line, before anything is
    stored. Both were stored: the first made its folder's listing fail with EIO in every mount, the
    second hid the mount's figures (`cpfs stats` failed with a traceback) (an audit's find)."""
    config = write_config(tmp_path / "cfg")
    (tmp_path / "f.bin").write_bytes(b"data")
    for dest, why in [(f"/long/{'a' * 256}", "a name of 256 bytes: at most 255 (NAME_MAX)"),
                      (f"/long/{'é' * 128}", "a name of 256 bytes: at most 255 (NAME_MAX)"),
                      ("/.cpfs-stats", "the name of a mount's control file")]:
        r = cpfs("put", str(tmp_path / "f.bin"), dest, config=config, check=False, text=True)
        assert r.returncode == 1 and r.stderr.startswith(f"cpfs: error: {dest}: {why}"), r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
    assert not list((tmp_path / "cfg" / "stores").glob("*/chunks/*/*"))
    assert not list((tmp_path / "cfg" / "stores").glob("*/manifests/*"))
    cpfs("put", str(tmp_path / "f.bin"), f"/long/{'a' * 255}", config=config)      # 255: fine
    cpfs("put", str(tmp_path / "f.bin"), "/sub/.cpfs-stats", config=config)        # not at the root: fine


def test_commands_name_the_same_paths_under_any_locale(tmp_path: Path) -> None:
    """Under LANG=C, not coerced to UTF-8, a command names the path a UTF-8 one does: a put there
    reads back under UTF-8 and the other way round, and ls prints the name's bytes. Every command
    failed with a traceback on the first non-ASCII path (its key hashed by the locale's codec)."""
    config = write_config(tmp_path / "cfg")
    c_locale = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    (tmp_path / "a.bin").write_bytes(b"put under C")
    (tmp_path / "b.bin").write_bytes(b"put under UTF-8")
    cpfs("put", str(tmp_path / "a.bin"), "/loc/café-a.pt", config=config, env=c_locale)
    cpfs("put", str(tmp_path / "b.bin"), "/loc/café-b.pt", config=config)
    assert cpfs("cat", "/loc/café-a.pt", config=config).stdout == b"put under C"
    assert cpfs("cat", "/loc/café-b.pt", config=config, env=c_locale).stdout == b"put under UTF-8"
    for env in (c_locale, None):
        out = cpfs("ls", "/loc", config=config, env=env).stdout
        assert out.count("café-a.pt".encode()) == 1 and out.count("café-b.pt".encode()) == 1, out


def test_cat_unavailable_chunk(tmp_path: Path) -> None:
    """When every replica of a chunk is gone, cat exits 1 with a line naming the file, the offset, the
    chunk and the stores (no traceback)."""
    config = write_config(tmp_path / "cfg", chunk_size="64KiB")
    (tmp_path / "f.bin").write_bytes(os.urandom(300_000))
    cpfs("put", str(tmp_path / "f.bin"), "/f.bin", config=config)
    m = json.loads(cpfs("inspect", "--json", "/f.bin", config=config).stdout)
    digest, _, _, _, holders = m["chunks"][2]
    for p in _chunk_files(tmp_path / "cfg" / "stores")[digest]:
        p.unlink()
    r = cpfs("cat", "/f.bin", config=config, check=False)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith(f"cpfs: error: file /f.bin offset {2 * 65536} chunk 2"), err
    assert digest[:16] in last and all(f"{s}: store {s!r}: no object" in last for s in holders)


async def test_rm_of_a_file_lists_its_own_versions_only(tmp_path: Path, small_tree: Path) -> None:
    """`cpfs rm FILE` looks the file up alone: it listed every path's versions first (5-15 s at 20,000
    paths; the gc audit). Here a listing of all of manifests/ is refused and the file's rm works."""
    config = write_config(tmp_path / "cfg")
    cpfs("put", str(small_tree), "/c", config=config)
    cfg = load_config(config)
    stores = [FaultyStore(open_store(s)) for s in cfg.stores]
    for s in stores:
        s.refuse("list", "manifests/", error=StoreError)
    catalog = Catalog(StorePool(cfg, stores=stores))
    assert await rm_targets(catalog, "/c/run1/step_1.pt", recursive=False) == ["/c/run1/step_1.pt"]
    with pytest.raises(StoreError):
        await rm_targets(catalog, "/c/run1", recursive=True)        # a folder's files: the whole listing


async def test_rm_of_a_folder_whose_stores_cannot_all_be_listed_removes_nothing(tmp_path: Path,
                                                                             small_tree: Path) -> None:
    """With write_quorum 1 of 2 replicas, a store that cannot be listed may hold the only versions of
    some files: `rm -r` of a folder then removes nothing and says why (it removed what it saw and
    reported success, leaving files it never saw), and `rm` of a path it does not see does not say
    "no such file". A file it sees goes as usual; with the store back, the folder does."""
    config = write_config(tmp_path / "cfg", extra="write_quorum = 1")
    cpfs("put", str(small_tree), "/c", config=config)
    cfg = load_config(config)
    stores = [FaultyStore(open_store(s)) for s in cfg.stores]
    catalog = Catalog(StorePool(cfg, stores=stores))
    rule = stores[0].refuse("list", error=StoreError)
    with pytest.raises(StoreUnavailable, match=r"cannot list store\(s\) s0: /c may hold files .* nothing removed"):
        await rm_targets(catalog, "/c", recursive=True)
    with pytest.raises(StoreUnavailable, match=r"cannot list store\(s\) s0: /c/nope.pt may hold files"):
        await rm_targets(catalog, "/c/nope.pt", recursive=False)
    seen = await catalog.load_all()
    assert not catalog.whole(seen) and seen.missed == {"s0"}
    stores[0].allow(rule)
    assert await rm_targets(catalog, "/c", recursive=True) == [
        "/c/empty.bin", "/c/notes 1.txt", "/c/run1/deep/model.safetensors", "/c/run1/step_1.pt"]
