"""Several daemons over the same stores, as several nodes would mount them."""
from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.conftest import cpfs

pytestmark = pytest.mark.mount
MiB = 1024 * 1024


def config(make_config: Callable[..., Path], tmp_path: Path, refresh: str) -> Path:
    return make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\nrefresh = "{refresh}"\n')


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if what():
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def test_a_new_file_is_seen_at_once_by_a_lookup_in_another_mount(make_config, tmp_path, mount):
    """With a refresh interval of a minute, another mount still finds a new file on its first lookup."""
    cfg = config(make_config, tmp_path, "60s")
    a, b = mount(cfg, "a"), mount(cfg, "b")
    (a.path / "run").mkdir()
    (a.path / "run" / "first.bin").write_bytes(b"1")
    assert os.listdir(b.path / "run") == ["first.bin"]          # b's one refresh for a minute
    data = os.urandom(3 * MiB)
    (a.path / "run" / "step_1.pt").write_bytes(data)
    assert (b.path / "run" / "step_1.pt").read_bytes() == data   # no refresh due: the lookup finds it


def test_different_files_never_lose_one_another(make_config, tmp_path, mount):
    """Three mounts write five files each at the same time: every mount ends up with all fifteen."""
    cfg = config(make_config, tmp_path, "0.2s")
    mounts = [mount(cfg, f"m{i}") for i in range(3)]
    want = {f"/node{i}/f{j}.bin": np.random.default_rng(10 * i + j).bytes(MiB + j) for i in range(3) for j in range(5)}
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            (mounts[i].path / f"node{i}").mkdir()
            for j in range(5):
                (mounts[i].path / f"node{i}" / f"f{j}.bin").write_bytes(want[f"/node{i}/f{j}.bin"])
        except BaseException as e:      # reported below, not lost in a thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for m in mounts:
        assert wait_for(lambda: sorted(p.relative_to(m.path).as_posix() for p in m.path.rglob("*.bin"))
                        == sorted(k.lstrip("/") for k in want))
        for path, data in want.items():
            assert (m.path / path.lstrip("/")).read_bytes() == data


def test_two_commits_of_one_path_one_wins_whole(make_config, tmp_path, mount):
    """Two mounts save the same path, one after the other and then at the same time: every mount reads
    one whole version (the later one when they were sequential), and `cpfs log` lists both."""
    cfg = config(make_config, tmp_path, "0.2s")
    a, b = mount(cfg, "a"), mount(cfg, "b")
    first, second = b"A" * (4 * MiB), b"B" * (4 * MiB)
    (a.path / "ckpt.pt").write_bytes(first)
    (b.path / "ckpt.pt").write_bytes(second)
    for m in (a, b):
        assert wait_for(lambda: (m.path / "ckpt.pt").read_bytes() == second)
    rows = json.loads(cpfs("log", "/ckpt.pt", "--json", config=cfg).stdout)
    assert [r["size"] for r in rows[:2]] == [len(second), len(first)] and rows[0]["current"]

    contenders = {b"C" * (5 * MiB), b"D" * (5 * MiB)}
    threads = [threading.Thread(target=(m.path / "race.pt").write_bytes, args=(data,))
               for m, data in zip((a, b), contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.5)
    seen = {(m.path / "race.pt").read_bytes() for m in (a, b)}
    assert len(seen) == 1 and seen <= contenders, "the mounts disagree, or a version is mixed"
    assert cpfs("cat", "/race.pt", config=cfg).stdout in contenders


def test_readers_on_another_mount_only_ever_read_whole_versions(make_config, tmp_path, mount):
    """While one mount rewrites a file twelve times (write_bytes, a temp file renamed over it, truncate
    and write on an open handle; 1 byte to 12 MiB, random), three readers on another mount open and read
    it whole again and again, in reads of 4 KiB to 1 MiB: each read gives one version written, whole."""
    rng = np.random.default_rng(7)
    cfg = config(make_config, tmp_path, "0.1s")
    a, b = mount(cfg, "a"), mount(cfg, "b")
    written = {b"first version" * 1000}
    (b.path / "f.bin").write_bytes(next(iter(written)))
    stop, errors, seen = threading.Event(), [], set()

    def reader(size: int) -> None:
        try:
            while not stop.is_set():
                with open(a.path / "f.bin", "rb") as f:
                    got = b"".join(iter(lambda: f.read(size), b""))
                assert got in written, f"{len(got)} bytes, no version written"
                seen.add(got)
        except BaseException as e:          # reported by the test
            errors.append(e)
    threads = [threading.Thread(target=reader, args=(size,)) for size in (4096, 131072, MiB)]
    for t in threads:
        t.start()
    try:
        for i in range(12):
            data = os.urandom(int(rng.integers(1, 12 * MiB)))
            written.add(data)                 # before the write: a reader may see it from then on
            target, how = b.path / "f.bin", i % 3
            if how == 0:
                target.write_bytes(data)
            elif how == 1:
                (b.path / f".part{i}").write_bytes(data)
                os.rename(b.path / f".part{i}", target)
            else:
                with open(target, "r+b") as f:
                    f.truncate(0)
                    f.write(data)
            time.sleep(float(rng.choice([0.05, 0.2, 0.5])))
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert len(seen) >= 4                     # they did follow the rewrites


def test_empty_folders_are_committed_and_seen_by_every_mount(make_config, tmp_path, mount):
    """mkdir commits the folder: another mount (and `cpfs ls`) sees it empty, with its mode; rmdir
    removes it everywhere; a renamed folder keeps its empty subfolders."""
    cfg = config(make_config, tmp_path, "0.2s")
    a, b = mount(cfg, "a"), mount(cfg, "b")
    os.mkdir(a.path / "runs", 0o750)
    os.makedirs(a.path / "runs" / "exp1" / "ckpts")
    assert wait_for(lambda: os.listdir(b.path / "runs" / "exp1") == ["ckpts"])
    assert os.stat(b.path / "runs").st_mode & 0o777 == 0o750
    assert "ckpts/" in cpfs("ls", "/runs/exp1", config=cfg, text=True).stdout
    os.rename(a.path / "runs" / "exp1", a.path / "runs" / "exp2")
    assert wait_for(lambda: os.listdir(b.path / "runs") == ["exp2"] and os.listdir(b.path / "runs" / "exp2") == ["ckpts"])
    os.rmdir(a.path / "runs" / "exp2" / "ckpts")
    assert wait_for(lambda: os.listdir(b.path / "runs" / "exp2") == [])
    c = mount(cfg, "c")                              # a fresh mount builds the same tree
    assert os.listdir(c.path / "runs") == ["exp2"] and os.listdir(c.path / "runs" / "exp2") == []
    cpfs("rm", "-r", "/runs", config=cfg)
    assert wait_for(lambda: "runs" not in os.listdir(a.path) and "runs" not in os.listdir(b.path))
    assert not (a.path / "runs").exists()


def test_a_folder_rename_is_one_commit_that_other_mounts_see_whole(make_config, tmp_path, mount):
    """`mv run/tmp_step run/step_100` of a 24-file checkpoint folder: every listing another node takes
    meanwhile (a catalog over the same stores, listing as fast as it can) shows all of the files under
    the old name or all under the new one, never some of each; then a mount sees the new tree."""
    from cpfs.catalog import Catalog
    from cpfs.config import load_config
    from cpfs.pool import StorePool

    cfg = config(make_config, tmp_path, "0.2s")
    a, b = mount(cfg, "a"), mount(cfg, "b")
    (a.path / "run" / "tmp_step" / "shards").mkdir(parents=True)
    names = [f"shards/part_{i:02d}.bin" for i in range(20)] + ["meta.json", "model.pt", "optim.pt", "rng.pt"]
    for n in names:
        (a.path / "run" / "tmp_step" / n).write_bytes(n.encode() * 100)
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def watch() -> None:
        async def listings() -> None:
            catalog = Catalog(StorePool(load_config(cfg)))
            while not stop.is_set():
                paths = await catalog.load_all()
                seen.append((sum(p.startswith("/run/tmp_step/") for p in paths),
                             sum(p.startswith("/run/step_100/") for p in paths)))
        trio.run(listings)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert wait_for(lambda: len(seen) >= 3)
        os.rename(a.path / "run" / "tmp_step", a.path / "run" / "step_100")
        count = len(seen)
        assert wait_for(lambda: len(seen) >= count + 3)
    finally:
        stop.set()
        watcher.join()
    whole = {(len(names) + 1, 0), (0, len(names) + 1)}     # and the folder `shards` (mkdir commits it)
    assert set(seen) <= whole, f"a listing saw a mix: {sorted(set(seen) - whole)}"
    assert seen[0] == (len(names) + 1, 0) and seen[-1] == (0, len(names) + 1)
    assert wait_for(lambda: sorted(os.listdir(b.path / "run")) == ["step_100"])
    for n in names:
        assert (b.path / "run" / "step_100" / n).read_bytes() == n.encode() * 100


def test_a_folder_rename_that_cannot_commit_changes_nothing(make_config, tmp_path, mount):
    """When the transaction's record cannot be written (here: every store's `txns` is a file), mv fails
    with EIO and the folder keeps its name and files, in this mount, another, and after a remount."""
    cfg = config(make_config, tmp_path, "0.2s")
    a = mount(cfg, "a")
    (a.path / "run" / "tmp_step").mkdir(parents=True)
    for i in range(3):
        (a.path / "run" / "tmp_step" / f"f{i}.pt").write_bytes(b"%d" % i * 1000)
    for store in (tmp_path / "cfg" / "stores").iterdir():
        (store / "txns").write_text("not a folder")
    with pytest.raises(OSError) as e:
        os.rename(a.path / "run" / "tmp_step", a.path / "run" / "step_100")
    assert e.value.errno == errno.EIO
    assert sorted(os.listdir(a.path / "run")) == ["tmp_step"]
    assert sorted(os.listdir(a.path / "run" / "tmp_step")) == ["f0.pt", "f1.pt", "f2.pt"]
    b = mount(cfg, "b")
    assert sorted(os.listdir(b.path / "run")) == ["tmp_step"]
    assert (b.path / "run" / "tmp_step" / "f2.pt").read_bytes() == b"2" * 1000
    assert "step_100" not in cpfs("ls", "/run", config=cfg, text=True).stdout
