"""`cpfs stats`: a mount's live figures through its hidden control file."""
from __future__ import annotations

import errno
import json
import os
import re
import time
from pathlib import Path

import pytest

from cpfs.chunk import BLOCK
from cpfs.stats import CONTROL_NAME, render
from tests.conftest import cpfs

pytestmark = pytest.mark.mount
MiB = 1024 * 1024


def test_stats_of_a_mount_count_what_a_read_did(make_config, tmp_path: Path, mount) -> None:
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    data = os.urandom(6 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    cpfs("put", str(tmp_path / "f.bin"), "/f.bin", config=cfg)
    m = mount(cfg)
    before = json.loads(cpfs("stats", str(m.path), "--json", config=cfg).stdout)
    assert (m.path / "f.bin").read_bytes() == data
    after = json.loads(cpfs("stats", str(m.path), "--json", config=cfg).stdout)
    fetched = sum(s["bytes_read"] for s in after["stores"]) - sum(s["bytes_read"] for s in before["stores"])
    assert fetched >= len(data)                       # every chunk came from some store, once at least
    assert after["cache"]["misses"] >= 6 and after["mount"]["files"] == 1
    # The ready read buffers ([cache] buffers: memory / 8 = 8 MiB here) were backed before the mount
    # returned, and the read went into them rather than into new ones.
    ready = before["buffers"]
    assert ready["keep"] == 8 * MiB and 0 < ready["bytes"] <= 8 * MiB and ready["reused"] == ready["allocated"] == 0
    assert after["buffers"]["reused"] >= 1
    # The chunks went to the kernel's page cache, each page once at most: pushed, or left out of its push
    # because the reply to the reader's read gave it first (a push counts once its thread is done).
    for _ in range(50):
        pushes = json.loads(cpfs("stats", str(m.path), "--json", config=cfg).stdout)["pushes"]
        if pushes["bytes"] + pushes["replied_bytes"]:
            break
        time.sleep(0.1)
    assert pushes["pieces"] >= 1 and pushes["failed"] == 0
    assert 0 < pushes["bytes"] + pushes["replied_bytes"] <= len(data)
    assert [s["name"] for s in after["stores"]] == ["s0", "s1", "s2"] and all(h["up"] for h in after["health"])
    assert CONTROL_NAME not in os.listdir(m.path)     # never listed: rsync and cp -r do not see it
    with pytest.raises(OSError) as e:
        open(m.path / CONTROL_NAME, "w")
    assert e.value.errno == errno.EACCES
    # No file takes its name: one renamed or linked there hid behind it, and was never seen again.
    (m.path / "notes.txt").write_bytes(b"kept")
    for act, code in ((os.rename, errno.EPERM), (os.link, errno.EEXIST)):
        with pytest.raises(OSError) as e:
            act(m.path / "notes.txt", m.path / CONTROL_NAME)
        assert e.value.errno == code
    assert (m.path / "notes.txt").read_bytes() == b"kept" and "stores" in json.loads(
        (m.path / CONTROL_NAME).read_bytes())
    human = cpfs("stats", str(m.path), config=cfg, text=True).stdout
    assert "s0" in human and "cache:" in human and "hits" in human


def test_stats_of_a_folder_that_is_not_a_mount_is_one_line(tmp_path: Path) -> None:
    r = cpfs("stats", str(tmp_path), check=False, text=True)
    assert r.returncode == 1 and r.stderr.startswith("cpfs: error:") and r.stderr.count("\n") == 1


def _doc(t: float, read: int, fetched: int, **scheduler_extra) -> dict:
    store = {"name": "s0", "requests": 1, "errors": 0, "cancelled": 0, "outstanding": 0, "peak_outstanding": 1,
             "bytes_read": fetched, "bytes_written": 0, "latency_ewma": 0.002}
    return {"time": t, "stores": [store], "health": [{"name": "s0", "up": True}],
            "replicas": {"reads": 1, "fallbacks": 0, "hedges": 0, "hedges_won": 0, "repairs_dropped": 0},
            "cache": {"used": 0, "budget": 64 * MiB, "hits": 0, "misses": 1, "evictions": 0},
            "scheduler": {"reads": 2, "read_bytes": read, "demand_fetches": 1, "prefetches": 0,
                          "prefetch_failures": 0, "inflight": 0, "pushed": 0, **scheduler_extra},
            "mount": {"files": 1, "open_handles": 0, "writing": 0}}


def test_render_shows_rates_and_the_figures_a_layer_adds() -> None:
    """--watch: read and fetched MiB/s over the interval; latency quantiles, prefetch used/wasted, pushed
    bytes and per-file figures appear once the layers report them (and are left out before)."""
    plain = render(_doc(1.0, 0, 0))
    assert "p50" not in plain and "wasted" not in plain and "file " not in plain and "last " not in plain
    before = _doc(1.0, 0, 0)
    now = _doc(3.0, 8 * MiB, 4 * MiB, prefetch_used=3, prefetch_wasted=1,
               files=[{"path": "/f.bin", "read_bytes": 8 * MiB, "fetched_bytes": 4 * MiB}])
    now["pushes"] = {"pieces": 3, "thread_calls": 2, "failed": 0, "bytes": 2 * MiB, "replied_bytes": MiB // 2}
    now["stores"][0].update(latency_p50=0.004, latency_p99=0.02)
    assert "max ms" not in render(now, before)
    now["stores"][0].update(latency_max=0.75)
    text = render(now, before)
    assert "last 2.0 s: 4.0 MiB/s read from the mount, 2.0 MiB/s fetched from the stores" in text
    assert "p50 ms" in text and "4.00" in text and "20.00" in text and "max ms" in text and "750.00" in text
    assert "missing" not in text
    now["stores"][0].update(missing=37)
    header, row = render(now, before).splitlines()[:2]
    assert header.split()[3:5] == ["errors", "missing"] and row.split()[3:5] == ["0", "37"]
    assert "3 used, 1 wasted" in text
    assert "0 chunks (2.0 MiB; 0.5 MiB left out, read replies gave them first) pushed" in text
    assert "file /f.bin: read_bytes 8.0 MiB, fetched_bytes 4.0 MiB" in text
    assert "declared prefetch" not in text
    now["plans"] = [{"path": "/m.pt", "patterns": ["layers.1.*"], "tensors": 3, "chunks": 4, "bytes": 8 * MiB,
                     "fetched_chunks": 2, "fetched_bytes": 4 * MiB, "in_kernel_chunks": 0, "pushed_again_chunks": 0,
                     "failed_chunks": 0, "done": False, "seconds": 0.5}]
    assert ("declared prefetch /m.pt (layers.1.*): 3 tensors, 4.0 of 8.0 MiB fetched, 0 chunks failed, "
            "running (0.5 s)") in render(now, before)
    assert "batches" not in render(now, before) and "pages the kernel lost" not in render(now, before)
    assert "commits:" not in render(now)
    now["catalog"] = {"commits": 5, "failed_commits": 2, "voided": 1, "unvoided": 0, "transactions": 1}
    assert "commits: 5 (2 failed, 1 of them voided by a twin or marker), 1 transactions" in render(now)
    assert "WARNING" not in render(now)
    now["catalog"]["unvoided"] = 1                       # a failed save that may count: said loudly
    assert "WARNING: 1 failed commits may count as current" in render(now)
    now["scheduler"].update(block_fetches=3, block_bytes=MiB, refilled=2, refill_queued=1)
    assert ("pages the kernel lost: 3 reads served from 1.0 MiB of their blocks; 2 of their chunks loaded into "
            "the cache since, 1 waiting for the mount to be idle") in render(now)
    assert "readers of slices" not in render(now)
    now["scheduler"].update(part_fetches=6, part_bytes=3 * MiB)
    assert "readers of slices: 6 parts of chunks fetched, 3.0 MiB" in render(now)
    now["scheduler"].update(refill_skipped=4)
    assert "1 waiting for the mount to be idle, 4 given up" in render(now)
    now["replicas"].update(reads=12, batch_reads=2, batched=9)
    assert "replicas: 12 reads (9 in 2 batches)," in render(now, before)
    assert "held back" not in render(now)
    now["replicas"].update(hedges=5, hedges_over_budget=7)
    assert "5 hedges (0 won, 7 held back by the budget)" in render(now)
    assert "read buffers" not in render(now)
    now["buffers"] = {"buffers": 26, "bytes": 130 * MiB, "keep": 128 * MiB, "reused": 259, "larger": 223,
                      "allocated": 27}
    assert ("read buffers: 130 MiB (128 MiB kept ready), 259 reads into backed ones (223 of a larger size), "
            "27 into new ones") in render(now)


def _read_through_a_mount(make_config, tmp_path: Path, mount) -> tuple:
    """A 48 MiB file put, mounted and read once (its pages pushed to the kernel): the mount, the bytes,
    and a function returning the daemon's scheduler statistics. hedge_min 200 ms: a block read gives up
    (and the whole chunk is read on demand) once slower than the hedge delay, whose floor of 10 ms a
    busy CI host crossed once, failing the count of demand fetches below; that fallback is the pool's,
    tested in test_faults (a hanging replica), not here."""
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n[store_defaults]\nhedge_min = "200ms"\n')
    data = os.urandom(48 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    cpfs("put", str(tmp_path / "f.bin"), "/f.bin", config=cfg)
    m = mount(cfg)

    def scheduler() -> dict:
        return json.loads(cpfs("stats", str(m.path), "--json", config=cfg).stdout)["scheduler"]

    assert (m.path / "f.bin").read_bytes() == data
    return m, data, scheduler


def test_pages_the_kernel_dropped_are_prefetched_again_not_fetched_one_by_one(make_config, tmp_path: Path,
                                                                               mount) -> None:
    """The daemon pushes what it prefetches into the kernel's page cache and drops its own copy. When
    the kernel drops those pages (here fadvise DONTNEED; drop_caches or memory pressure alike), the
    next read of the file must prefetch again: before, the daemon took every chunk for the kernel's
    and fetched each on demand, one at a time."""
    m, data, scheduler = _read_through_a_mount(make_config, tmp_path, mount)
    first = scheduler()
    time.sleep(0.25)     # past pagecache.RACE: the kernel asks for pages it was given only once it dropped them
    fd = os.open(m.path / "f.bin", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)        # the kernel drops the file's pages
        assert os.read(fd, 1) == data[:1]
    finally:
        os.close(fd)
    assert (m.path / "f.bin").read_bytes() == data
    second = scheduler()
    assert second["kernel_drops"] >= 1 and first["pushed"] > 0
    assert second["demand_fetches"] - first["demand_fetches"] <= 6, (first, second)   # of 48 chunks
    assert second["fetched_bytes"] - first["fetched_bytes"] >= len(data) * 3 // 4    # most from the stores again


def test_a_few_pages_the_kernel_dropped_are_read_from_their_blocks_not_the_whole_file(make_config, tmp_path: Path,
                                                                                       mount) -> None:
    """Memory pressure, or a host reclaiming a VM's cold pages, drops a few pages here and there of a
    file the kernel holds: each such read fetches the 256 KiB blocks around its pages, checked against
    the manifest's block checks, not its chunk, and the rest of the file is not fetched and pushed again
    (that cost a warm load more than the pages did). Once the mount is idle their chunks are loaded
    into the daemon's cache: a page dropped later beside them costs no fetch."""
    m, data, scheduler = _read_through_a_mount(make_config, tmp_path, mount)
    first = scheduler()
    time.sleep(0.25)     # past pagecache.RACE (this VM's host takes untouched pages this soon too)
    holes = [3 * MiB + 4096, 17 * MiB + 16384, 30 * MiB + 8192 * 3, 41 * MiB - 16384]   # in 4 chunks, MiBs apart
    fd = os.open(m.path / "f.bin", os.O_RDONLY)
    try:
        for off in holes:
            os.posix_fadvise(fd, off, 4096, os.POSIX_FADV_DONTNEED)
        for off in holes:
            assert os.pread(fd, 4096, off) == data[off:off + 4096]
        second = scheduler()
        assert second["kernel_drops"] == first["kernel_drops"]       # the file's pushes stand
        assert second["demand_fetches"] == first["demand_fetches"], "no chunk read on demand"
        # Their 4 reads, and one for each page the host took meanwhile (this VM's DAMON reclaim took 13
        # pages in 10 more chunks in one CI run), each the block or two around its pages.
        reads = second["block_fetches"] - first["block_fetches"]
        assert reads >= len(holes), (first, second)
        assert second["block_bytes"] - first["block_bytes"] <= reads * 2 * BLOCK, (first, second)
        deadline = time.monotonic() + 20
        while (now := scheduler())["refill_queued"] or now["refilled"] < len(holes):
            assert time.monotonic() < deadline, now       # loaded once no read came for REFILL_IDLE
            time.sleep(0.2)
        third = scheduler()
        for off in holes:           # another page of each of those chunks
            os.posix_fadvise(fd, off + 8192, 4096, os.POSIX_FADV_DONTNEED)
        for off in holes:
            assert os.pread(fd, 4096, off + 8192) == data[off + 8192:off + 12288]
        fourth = scheduler()
        # Served from the loaded chunks: no block read for these 4. (The loop above waits for the queue to
        # empty, not only for `refilled`: chunks of pages the host took can make up that count.) A page the
        # host takes meanwhile costs a read of its own, its block, and its chunk's load once idle, which can
        # land during `cpfs stats`: 2 blocks and 1 MiB for 2 such reads in one run here.
        others = fourth["reads"] - third["reads"] - len(holes)
        assert fourth["block_fetches"] - third["block_fetches"] <= others, (third, fourth)
        assert fourth["fetched_bytes"] - third["fetched_bytes"] <= others * (2 * BLOCK + MiB), (third, fourth)
        assert fourth["demand_fetches"] == third["demand_fetches"], (third, fourth)
    finally:
        os.close(fd)
    assert (m.path / "f.bin").read_bytes() == data


def test_the_unmount_log_line_gives_each_stores_figures_and_its_slowest_fetch(make_config, tmp_path: Path,
                                                                             mount) -> None:
    """The daemon's last line names what each store did (requests, bytes, p50/p99, the slowest fetch) and
    the replica reads (hedges): a load that was slow once can be told from its log after the mount."""
    m, data, _ = _read_through_a_mount(make_config, tmp_path, mount)
    stores = json.loads(cpfs("stats", str(m.path), "--json", config=m.config).stdout)["stores"]
    m.stop()
    line = [ln for ln in m.log.read_text().splitlines() if " unmounted " in ln][-1]
    assert "; replicas ReplicaStats(reads=" in line
    fetched = 0
    for s in stores:
        figures = re.search(rf"StoreStats\(name='{re.escape(s['name'])}'.*?bytes_read=(\d+).*?latency_max=([0-9.e-]+)\)",
                            line)
        assert figures, (s["name"], line)
        fetched += int(figures.group(1))
        assert float(figures.group(2)) >= s["latency_p99"] > 0 or int(figures.group(1)) == 0
    assert fetched >= len(data)
