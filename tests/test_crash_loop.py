"""kill -9 of the mount daemon at random points of many saves: every path stays a whole checkpoint.

One saver process (torch imported once) saves checkpoints of a few to tens of MiB to a few paths
through the mount; the daemon is SIGKILLed a random fraction into each save, the dead mount detached
(`fusermount3 -u -z`) and a new daemon mounted. Afterwards every path loads as exactly one of the
checkpoints saved to it (never a partial file, never a mix of two), at least as new as the last save
whose close() succeeded, and `cpfs log` lists only whole versions, newest save first. The random
choices come from one seed, printed (set CPFS_CRASH_SEED to replay a failure).
"""
from __future__ import annotations

import io
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, cpfs

pytestmark = pytest.mark.mount

MiB = 1024 * 1024
ROUNDS = 20
PATHS = ("a.pt", "b.pt", "run/c.pt")
KEEP_VERSIONS = 3           # the default keep_versions


def checkpoint(seed: int, mib: int) -> dict[str, torch.Tensor]:
    """A state dict of `mib` 1 MiB bf16 tensors, and its seed, so a loaded file says which save it is."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.w": torch.randn(MiB // 2, generator=g).to(torch.bfloat16) for i in range(mib)}
    sd["seed"] = torch.tensor(seed)
    return sd


SAVER = """
import sys
import torch
from tests.test_crash_loop import checkpoint
for line in sys.stdin:
    path, seed, mib = line.split()
    sd = checkpoint(int(seed), int(mib))
    print("saving", flush=True)
    try:
        torch.save(sd, path)
    except Exception as e:
        print("error", type(e).__name__, str(e).replace("\\n", " ")[:200], flush=True)
    else:
        print("ok", flush=True)
"""


class Saver:
    """The saving process: `start` hands it a save and returns once it is about to call torch.save;
    `result` waits for "ok" or "error ..." (a line reader thread, so no line waits behind a buffer)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SAVER], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("exited")

    def _next(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the saver said nothing for {timeout} s") from None

    def start(self, path: Path, seed: int, mib: int) -> None:
        self.proc.stdin.write(f"{path} {seed} {mib}\n")
        self.proc.stdin.flush()
        line = self._next(60)
        assert line == "saving", f"{line}: {self.proc.stderr.read() if line == 'exited' else ''}"

    def result(self, timeout: float = 120) -> str:
        return self._next(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def kill_daemon(m) -> None:
    os.kill(m.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while m.alive():
        assert time.monotonic() < deadline, f"daemon {m.pid} survived SIGKILL"
        time.sleep(0.02)
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)


@pytest.mark.long
@pytest.mark.parametrize("write_quorum", [2, 1], ids=["every-replica", "quorum-1-of-2"])
def test_kill_9_of_the_daemon_mid_save_never_leaves_a_partial_checkpoint(make_config, tmp_path, mount,
                                                                         write_quorum: int) -> None:
    """Also with write_quorum 1 of 2 replicas: a close returns once one store holds the version, and the
    daemon may die with the second copies still being written in the background."""
    seed = int(os.environ.get("CPFS_CRASH_SEED", "20240611"))
    print(f"\ncrash loop: seed {seed} (CPFS_CRASH_SEED={seed} replays it)")
    rng = random.Random(seed)
    cfg = make_config(extra=f'write_quorum = {write_quorum}\n[mount]\nstaging = "{tmp_path / "staging"}"\n')
    saves: dict[str, list[tuple[int, int, str]]] = {p: [] for p in PATHS}    # (seed, MiB, outcome)
    saver = Saver()
    try:
        m = mount(cfg)
        (m.path / "run").mkdir()
        took = []
        for i, path in enumerate(PATHS):         # a whole first version of each, and the pace of a save
            began = time.perf_counter()
            saver.start(m.path / path, i + 1, 16)
            assert saver.result() == "ok"
            took.append(time.perf_counter() - began)
            saves[path].append((i + 1, 16, "ok"))
        per_mib = min(took) / 16

        for round_ in range(ROUNDS):
            path, mib, s = rng.choice(PATHS), rng.randint(2, 32), 100 + round_
            delay = rng.uniform(0.0, 1.1) * mib * per_mib
            saver.start(m.path / path, s, mib)
            time.sleep(delay)
            kill_daemon(m)
            outcome = saver.result()
            saves[path].append((s, mib, outcome.split()[0]))
            print(f"round {round_:2d}: {path} seed {s} {mib:2d} MiB, daemon killed after {delay:.2f} s: {outcome}")
            m = mount(cfg)
    finally:
        saver.close()
    killed = sum(outcome != "ok" for h in saves.values() for _, _, outcome in h)
    print(f"{killed} of {ROUNDS} saves cut short by the kill, {ROUNDS - killed} closed before it")

    for path, history in saves.items():
        order = {s: i for i, (s, _, _) in enumerate(history)}
        size_of = {s: mib for s, mib, _ in history}
        last_ok = max(i for i, (_, _, outcome) in enumerate(history) if outcome == "ok")
        got = torch.load(m.path / path, weights_only=True)
        now = int(got["seed"])
        assert now in order and order[now] >= last_ok, f"{path}: seed {now}, saves {history}"
        assert_equal(got, checkpoint(now, size_of[now]), path)

        rows = json.loads(cpfs("log", path, "--json", config=cfg).stdout)
        assert rows[0]["current"] and {r["state"] for r in rows} == {"ok"}, rows
        logged = []
        for r in rows:                           # every kept version is a whole save
            data = cpfs("cat", path, "--version", str(r["version"]), config=cfg).stdout
            assert len(data) == r["size"]
            version = torch.load(io.BytesIO(data), weights_only=True)
            logged.append(int(version["seed"]))
            assert_equal(version, checkpoint(logged[-1], size_of[logged[-1]]), f"{path} v{r['version']}")
        assert logged[0] == now
        assert [order[s] for s in logged] == sorted((order[s] for s in logged), reverse=True)
        for i, (s, _, outcome) in enumerate(history):   # a save whose close succeeded is there, or retired
            if outcome == "ok":
                assert s in logged or sum(order[x] > i for x in logged) >= KEEP_VERSIONS, (path, s, logged)
        print(f"{path}: current seed {now}; kept versions (newest first) {logged}")


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k}"
