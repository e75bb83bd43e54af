"""Prometheus metrics: `[metrics] listen` serves the `.cpfs-stats` figures in the text exposition format."""
from __future__ import annotations

import json
import os
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import trio

from cpfs import metrics
from cpfs.config import parse_config
from cpfs.errors import ConfigError
from cpfs.stats import CONTROL_NAME
from tests.conftest import Mount, cpfs

MiB = 1024 * 1024
STORES = '[[store]]\nname = "a"\nurl = "a"\n'
SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)')


def parse_exposition(text: str) -> dict[str, dict[str, float]]:
    """{metric name: {labels text: value}}; fails on any line that is not valid exposition syntax, on a
    sample before its family's TYPE line, and on a family declared twice."""
    assert text.endswith("\n")
    out: dict[str, dict[str, float]] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "untyped") and name not in typed, line
            typed.add(name)
            continue
        m = SAMPLE.fullmatch(line)
        assert m, f"not an exposition line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        assert name in typed, f"{name}: sample before its TYPE line"
        out.setdefault(name, {})[labels] = float(value)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def listening_ports(pid: int) -> list[int]:
    return [c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


# ---- rendering ------------------------------------------------------------------------------------------

DOC = {
    "time": 1.0,
    "stores": [{"name": "s0", "requests": 3, "bytes_read": 100, "latency_ewma": 0.005, "outstanding": 1},
               {"name": 'odd "name"\\', "requests": 1, "bytes_read": 7, "latency_ewma": 0.0, "outstanding": 0}],
    "health": [{"name": "s0", "up": True, "reason": "", "retries": 2},
               {"name": 'odd "name"\\', "up": False, "reason": "timeout", "retries": 0}],
    "cache": {"hits": 5, "misses": 2, "used": 4096},
    "scheduler": {"inflight": 1, "a_field_added_later": 9},
    "learned": {"recordings": 3, "learned": 4, "replayed": 2, "strayed": 1, "shared_gets": 5, "shared_got": 2,
                "shared_puts": 4, "shared_errors": 1},
    "holds": {"versions": 2, "chunks": 40, "objects": 2, "writes": 3, "skipped": 7, "failed": 0, "late": 1,
              "renewed": 6, "deleted": 3, "lapsed": 1},
    "buffers": {"buffers": 25, "bytes": 131072000, "keep": 134217728, "reused": 259, "larger": 223, "allocated": 27},
    "replicas": {"hedges": 4, "hedges_over_budget": 3, "hedge_tokens": 0.25},
    "mount": {"files": 1},
}


def test_render_names_types_and_labels_every_figure() -> None:
    m = parse_exposition(metrics.render(DOC))
    assert m["cpfs_store_fetched_bytes_total"] == {'{store="s0"}': 100, '{store="odd \\"name\\"\\\\"}': 7}
    assert m["cpfs_store_up"] == {'{store="s0"}': 1, '{store="odd \\"name\\"\\\\"}': 0}
    assert m["cpfs_store_latency_ewma_seconds"]['{store="s0"}'] == 0.005
    assert m["cpfs_cache_hits_total"] == {"": 5} and m["cpfs_cache_misses_total"] == {"": 2}
    assert m["cpfs_fetches_in_flight"] == {"": 1} and m["cpfs_files"] == {"": 1}
    assert m["cpfs_scheduler_a_field_added_later"] == {"": 9}     # a new field is never silently missing
    assert m["cpfs_learned_plans_total"] == {"": 2} and m["cpfs_learned_plans_left_total"] == {"": 1}
    assert m["cpfs_learned_shared_recordings_total"] == {"": 2} and m["cpfs_learned_shared_errors_total"] == {"": 1}
    assert m["cpfs_holds_versions"] == {"": 2} and m["cpfs_holds_late_total"] == {"": 1}
    assert m["cpfs_holds_lapsed_total"] == {"": 1}
    assert m["cpfs_read_buffers_ready_bytes"] == {"": 134217728} and m["cpfs_read_buffers_mapped_total"] == {"": 27}
    assert m["cpfs_hedges_over_budget_total"] == {"": 3} and m["cpfs_hedge_budget_tokens"] == {"": 0.25}
    assert not any("time" in name or "reason" in name for name in m)
    text = metrics.render(DOC)
    assert "# TYPE cpfs_cache_hits_total counter" in text and "# TYPE cpfs_store_up gauge" in text
    assert "# TYPE cpfs_scheduler_a_field_added_later untyped" in text
    assert "# TYPE cpfs_holds_failed_total counter" in text and "# TYPE cpfs_holds_versions gauge" in text
    assert "# TYPE cpfs_hedge_budget_tokens gauge" in text


def test_answer_routes() -> None:
    ok = metrics.answer("GET /metrics HTTP/1.1", lambda: DOC)
    assert ok.startswith(b"HTTP/1.0 200 OK\r\n") and b"text/plain; version=0.0.4" in ok
    assert b"cpfs_cache_hits_total 5\n" in ok
    head = metrics.answer("HEAD /metrics HTTP/1.1", lambda: DOC)
    assert head.startswith(b"HTTP/1.0 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert metrics.answer("POST /metrics HTTP/1.1", lambda: DOC).startswith(b"HTTP/1.0 405 ")
    assert metrics.answer("GET /nothing HTTP/1.1", lambda: DOC).startswith(b"HTTP/1.0 404 ")
    assert metrics.answer("garbage", lambda: DOC).startswith(b"HTTP/1.0 400 ")


# ---- the config key -------------------------------------------------------------------------------------

def test_listen_parses(tmp_path: Path) -> None:
    def listen(value: str):
        return parse_config(f'replicas = 1\n[metrics]\nlisten = "{value}"\n' + STORES, "x.toml", tmp_path).metrics_listen

    assert parse_config("replicas = 1\n" + STORES, "x.toml", tmp_path).metrics_listen is None          # off by default
    assert listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert listen("[::1]:9464") == ("::1", 9464)
    assert listen("localhost:80") == ("localhost", 80)


@pytest.mark.parametrize("bad", ['"9464"', '"127.0.0.1"', '"127.0.0.1:0"', '"127.0.0.1:70000"', '":9464"',
                                 '"::1:9464"', '"300.1.2.3:9464"', '"http://127.0.0.1:9464"', '"a b:1"', "9464",
                                 "true", '""'])
def test_bad_listen_is_a_config_error_naming_the_key(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^x\.toml: metrics\.listen: .*(HOST:PORT|port must be)"):
        parse_config(f"replicas = 1\n[metrics]\nlisten = {bad}\n" + STORES, "x.toml", tmp_path)


def test_unknown_metrics_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.port: unknown key"):
        parse_config("replicas = 1\n[metrics]\nport = 9464\n" + STORES, "x.toml", tmp_path)


# ---- the responder, in this trio loop -------------------------------------------------------------------

async def test_a_silent_client_does_not_hold_up_a_scrape() -> None:
    figures = {"cache": {"hits": 0}}

    def source() -> dict:
        figures["cache"]["hits"] += 1           # each scrape renders a fresh document
        return figures

    async with trio.open_nursery() as n:
        [(host, port)] = await n.start(metrics.serve, ("127.0.0.1", 0), source)
        silent = await trio.open_tcp_stream(host, port)          # connects, never sends a request
        for expected in (1, 2):
            s = await trio.open_tcp_stream(host, port)
            await s.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            with trio.fail_after(5):
                while chunk := await s.receive_some():
                    got += chunk
            assert got.startswith(b"HTTP/1.0 200 OK") and f"cpfs_cache_hits_total {expected}\n".encode() in got
            await s.aclose()
        await silent.aclose()
        n.cancel_scope.cancel()


async def test_a_taken_port_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cfg: metrics\.listen: cannot listen on 127\.0\.0\.1:{port}"):
            await metrics.serve(("127.0.0.1", port), dict, where="cfg: metrics.listen")


# ---- through a real mount -------------------------------------------------------------------------------

@pytest.mark.mount
def test_a_mount_serves_what_a_read_did(make_config, tmp_path: Path, mount) -> None:
    port = free_port()
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    data = os.urandom(6 * MiB)
    (tmp_path / "f.bin").write_bytes(data)
    cpfs("put", str(tmp_path / "f.bin"), "/f.bin", config=cfg)
    m = mount(cfg)
    assert listening_ports(m.pid) == [port]
    before = parse_exposition(scrape(port)[2])
    assert (m.path / "f.bin").read_bytes() == data
    status, ctype, text = scrape(port)
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    after = parse_exposition(text)
    fetched = after["cpfs_store_fetched_bytes_total"]
    assert sorted(fetched) == ['{store="s0"}', '{store="s1"}', '{store="s2"}']
    assert sum(fetched.values()) - sum(before["cpfs_store_fetched_bytes_total"].values()) >= len(data)
    assert after["cpfs_cache_misses_total"][""] >= 6 > before["cpfs_cache_misses_total"][""]
    assert after["cpfs_read_bytes_total"][""] > 0     # not all: pages pushed to the kernel never reach the daemon
    assert after["cpfs_store_up"] == {f'{{store="s{i}"}}': 1 for i in range(3)}
    assert after["cpfs_files"] == {"": 1} and "cpfs_fetches_in_flight" in after and "cpfs_hedges_total" in after
    # The same figures as the control file (nothing ran between the two reads).
    doc = json.loads((m.path / CONTROL_NAME).read_bytes())
    assert {f'{{store="{s["name"]}"}}': s["bytes_read"] for s in doc["stores"]} == fetched
    assert scrape(port, "/other")[0] == 404


@pytest.mark.mount
def test_off_by_default_nothing_listens(make_config, tmp_path: Path, mount) -> None:
    cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n')
    m = mount(cfg)
    assert listening_ports(m.pid) == []


@pytest.mark.mount
def test_a_mount_whose_port_is_taken_fails_with_a_config_error(make_config, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = make_config(extra=f'[mount]\nstaging = "{tmp_path / "staging"}"\n'
                                f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        m = Mount(cfg, tmp_path / "mnt", tmp_path / "mnt.log")
        try:
            r = m.start()
            assert r.returncode == 2, r.stderr
            assert "config error" in r.stderr and f"metrics.listen: cannot listen on 127.0.0.1:{port}" in r.stderr
            assert not os.path.ismount(m.path)
        finally:
            m.stop()
