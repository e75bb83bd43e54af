"""Prometheus metrics of a mount: the figures of its `.cpfs-stats` control file, on a local port.

`[metrics] listen = "127.0.0.1:9464"` (off by default) makes the daemon answer `GET /metrics` there
in the Prometheus text exposition format (version 0.0.4), as cluster daemons are watched. The figures
are, by construction, those of the control file: every scrape renders one fresh `stats.collect`
document (the same bytes `cat MOUNTPOINT/.cpfs-stats` would show at that moment).

Parts: `render(doc)` turns a statistics document into exposition text (a table names, types and
describes the known fields; a numeric field a layer adds later still appears, as
`cpfs_<section>_<field>`, untyped, so a new counter is never silently missing); `serve()` is a
minimal HTTP/1.0 responder run as a task of the daemon's nursery.

Invariant: a scrape runs in the trio thread, between other tasks, like a read of the control file.
The layers' counters are plain attributes mutated by trio tasks without locks (a scheduler's feeders
are a dict that grows while files open); reading them from another thread could see a dict change
size mid-iteration or a half-updated set of counters. That is why this is not prometheus_client's
`start_http_server`, whose collector runs in a thread of its own. Rendering costs well under a
millisecond per store, so a scrape does not hold up FUSE requests.

Caveats: a mount refuses to start when its port is taken (ConfigError naming `metrics.listen`):
two mounts on one host need a port each. A request is answered only when its head arrives within
REQUEST_TIMEOUT and fits in MAX_HEAD; at most MAX_CLIENTS are served at once (others get 503). A
failure while answering a scrape is logged and never reaches the daemon's nursery: the data path
does not depend on the metrics.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from .config import Config
from .errors import ConfigError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_TIMEOUT = 5.0       # seconds a client has to send its request head
MAX_HEAD = 8192             # bytes of request head read at most
MAX_CLIENTS = 8             # scrapes answered at once

Source = Callable[[], bytes | dict[str, Any]]    # a statistics document (stats.collect), JSON or parsed

# (section, field) -> (metric name, type, help). Sections that are lists (stores, health) carry one
# sample per store, labelled store="NAME".
METRICS: dict[tuple[str, str], tuple[str, str, str]] = {
    # cpfs.store.metered: per store
    ("stores", "requests"): ("cpfs_store_requests_total", "counter", "Requests sent to the store."),
    ("stores", "errors"): ("cpfs_store_errors_total", "counter",
                           "Requests that failed (an error other than 'no such object')."),
    ("stores", "missing"): ("cpfs_store_missing_total", "counter",
                            "Requests answered 'no such object' (dedup probes, replicas not yet written)."),
    ("stores", "cancelled"): ("cpfs_store_cancelled_total", "counter",
                              "Requests abandoned by their caller (timeouts, a hedge won, a reader gone)."),
    ("stores", "outstanding"): ("cpfs_store_requests_in_flight", "gauge", "Requests in flight to the store now."),
    ("stores", "peak_outstanding"): ("cpfs_store_requests_in_flight_peak", "gauge",
                                     "Most requests in flight to the store at once."),
    ("stores", "bytes_read"): ("cpfs_store_fetched_bytes_total", "counter", "Bytes fetched from the store."),
    ("stores", "bytes_written"): ("cpfs_store_written_bytes_total", "counter", "Bytes written to the store."),
    ("stores", "latency_ewma"): ("cpfs_store_latency_ewma_seconds", "gauge",
                                 "Moving average of the store's request latency."),
    ("stores", "latency_p50"): ("cpfs_store_fetch_latency_p50_seconds", "gauge",
                                "Median latency of the store's recent reads."),
    ("stores", "latency_p99"): ("cpfs_store_fetch_latency_p99_seconds", "gauge",
                                "99th percentile latency of the store's recent reads."),
    ("stores", "latency_max"): ("cpfs_store_fetch_latency_max_seconds", "gauge",
                                "Slowest read the store answered since the mount started."),
    # cpfs.pool: per store health
    ("health", "up"): ("cpfs_store_up", "gauge", "1 if the store answers, 0 while it is marked down."),
    ("health", "failures_in_a_row"): ("cpfs_store_failures_in_a_row", "gauge",
                                      "Transient failures since the store last answered."),
    ("health", "retries"): ("cpfs_store_retries_total", "counter", "Requests tried again after a transient failure."),
    ("health", "timeouts"): ("cpfs_store_timeouts_total", "counter", "Requests that got no answer in time."),
    ("health", "marked_down"): ("cpfs_store_marked_down_total", "counter", "Times the store was marked down."),
    ("health", "probes"): ("cpfs_store_probes_total", "counter", "Background checks of the store while down."),
    ("health", "repairs"): ("cpfs_store_repairs_total", "counter", "Corrupt chunk copies rewritten on the store."),
    # cpfs.pool: replica reads
    ("replicas", "reads"): ("cpfs_replica_reads_total", "counter",
                            "Replica reads started (first tries, fallbacks and hedges)."),
    ("replicas", "fallbacks"): ("cpfs_replica_fallbacks_total", "counter",
                                "Reads moved to the next replica because one failed."),
    ("replicas", "hedges"): ("cpfs_hedges_total", "counter",
                             "Slow reads that also asked the next replica."),
    ("replicas", "batch_reads"): ("cpfs_replica_batch_reads_total", "counter",
                                  "Batch requests that read several chunks from one store."),
    ("replicas", "batched"): ("cpfs_replica_batched_chunks_total", "counter",
                              "Chunks asked for in batch requests (in cpfs_replica_reads_total too)."),
    ("replicas", "block_reads"): ("cpfs_replica_block_reads_total", "counter",
                                  "Ranged reads of a chunk's blocks: pages the kernel lost, parts for readers of slices."),
    ("replicas", "block_bytes"): ("cpfs_replica_block_bytes_total", "counter",
                                  "Bytes of those ranged reads that matched their block checks."),
    ("replicas", "block_misses"): ("cpfs_replica_block_misses_total", "counter",
                                   "Ranged reads that did not match (the whole chunk was read instead)."),
    ("replicas", "hedges_won"): ("cpfs_hedges_won_total", "counter", "Hedged reads the hedge answered first."),
    ("replicas", "hedges_in_flight"): ("cpfs_hedges_in_flight", "gauge", "Hedge requests in flight now."),
    ("replicas", "hedges_skipped"): ("cpfs_hedges_skipped_total", "counter",
                                     "Slow reads not hedged because the hedge limit was reached."),
    ("replicas", "hedges_over_budget"): ("cpfs_hedges_over_budget_total", "counter",
                                         "Slow reads whose hedge waited because hedges had lost lately."),
    ("replicas", "hedge_tokens"): ("cpfs_hedge_budget_tokens", "gauge",
                                   "Hedges the budget allows now (answered reads fill it, won hedges refill it)."),
    ("replicas", "repairs_dropped"): ("cpfs_repairs_dropped_total", "counter",
                                      "Read repairs not queued because the queue was full."),
    ("replicas", "touched"): ("cpfs_dedup_touched_total", "counter", "Old copies dedup reused and touched."),
    ("replicas", "renewed"): ("cpfs_chunk_copies_renewed_total", "counter",
                              "Copies an open file's next commit counts on, touched again so that a gc spares them."),
    ("replicas", "background_puts"): ("cpfs_background_puts", "gauge",
                                      "Puts still running after their write returned at quorum."),
    ("replicas", "background_bytes"): ("cpfs_background_bytes", "gauge", "Blob bytes held by background puts."),
    ("replicas", "background_done"): ("cpfs_background_puts_done_total", "counter",
                                      "Background puts that stored their copy."),
    ("replicas", "background_failed"): ("cpfs_background_puts_failed_total", "counter",
                                        "Background puts that failed."),
    ("replicas", "background_abandoned"): ("cpfs_background_puts_abandoned_total", "counter",
                                           "Background puts cancelled at unmount when the grace ran out."),
    ("replicas", "background_waits"): ("cpfs_background_waits_total", "counter",
                                       "Writes that waited for room for background puts."),
    # cpfs.cache
    ("cache", "budget"): ("cpfs_cache_budget_bytes", "gauge", "The chunk cache's memory budget."),
    ("cache", "used"): ("cpfs_cache_used_bytes", "gauge", "Bytes held by cached chunks."),
    ("cache", "inflight"): ("cpfs_cache_inflight_bytes", "gauge", "Bytes reserved for chunks being fetched."),
    ("cache", "pinned"): ("cpfs_cache_pinned_bytes", "gauge", "Bytes held by pinned chunks."),
    ("cache", "peak_used"): ("cpfs_cache_peak_bytes", "gauge", "Highest used + in-flight bytes seen."),
    ("cache", "hits"): ("cpfs_cache_hits_total", "counter", "Chunk lookups answered from the cache."),
    ("cache", "misses"): ("cpfs_cache_misses_total", "counter", "Chunk lookups that had to fetch."),
    ("cache", "joined"): ("cpfs_cache_joined_total", "counter",
                          "Lookups that waited for another lookup's fetch of the same chunk."),
    ("cache", "evictions"): ("cpfs_cache_evictions_total", "counter", "Chunks evicted from the cache."),
    ("cache", "bytes_loaded"): ("cpfs_cache_loaded_bytes_total", "counter", "Bytes of chunks loaded into the cache."),
    # cpfs.readahead
    ("scheduler", "open_files"): ("cpfs_open_files", "gauge", "Files open for reading now."),
    ("scheduler", "reads"): ("cpfs_reads_total", "counter", "Read requests served."),
    ("scheduler", "read_bytes"): ("cpfs_read_bytes_total", "counter", "Bytes returned to readers."),
    ("scheduler", "demand_fetches"): ("cpfs_demand_fetches_total", "counter", "Chunk fetches a read waited for."),
    ("scheduler", "prefetches"): ("cpfs_prefetches_total", "counter", "Chunk fetches started ahead of the reader."),
    ("scheduler", "prefetch_failures"): ("cpfs_prefetch_failures_total", "counter", "Prefetches that failed."),
    ("scheduler", "prefetch_used"): ("cpfs_prefetch_used_total", "counter", "Prefetched chunks a reader used."),
    ("scheduler", "prefetch_wasted"): ("cpfs_prefetch_wasted_total", "counter",
                                       "Prefetched chunks dropped before any reader used them."),
    ("scheduler", "pushed"): ("cpfs_pagecache_pushes_total", "counter", "Chunks handed to the kernel page cache."),
    # cpfs.pagecache
    ("pushes", "pieces"): ("cpfs_pagecache_push_pieces_total", "counter", "Page-cache pushes asked for."),
    ("pushes", "thread_calls"): ("cpfs_pagecache_push_thread_calls_total", "counter",
                                 "Worker-thread calls that made the pushes."),
    ("pushes", "failed"): ("cpfs_pagecache_push_failures_total", "counter", "Pushes the kernel refused."),
    ("pushes", "bytes"): ("cpfs_pagecache_pushed_bytes_total", "counter", "Bytes handed to the kernel page cache."),
    ("pushes", "replied_bytes"): ("cpfs_pagecache_replied_bytes_total", "counter",
                                  "Bytes left out of pushes because a read's reply gave them to the kernel first."),
    ("scheduler", "kernel_drops"): ("cpfs_pagecache_drops_total", "counter",
                                    "Times the kernel was found to have dropped pages pushed to it."),
    ("scheduler", "block_fetches"): ("cpfs_pagecache_lost_reads_total", "counter",
                                     "Reads of pages the kernel lost, served by fetching only their blocks."),
    ("scheduler", "block_bytes"): ("cpfs_pagecache_lost_fetched_bytes_total", "counter",
                                   "Bytes fetched for those reads."),
    ("scheduler", "part_fetches"): ("cpfs_slice_part_fetches_total", "counter",
                                    "Fetches of part of a chunk (its blocks) for a reader of tensor slices."),
    ("scheduler", "part_bytes"): ("cpfs_slice_part_fetched_bytes_total", "counter",
                                  "Bytes fetched as parts of chunks for readers of tensor slices."),
    ("scheduler", "refilled"): ("cpfs_pagecache_lost_refilled_total", "counter",
                                "Chunks with lost pages loaded into the cache once the mount was idle."),
    ("scheduler", "refill_queued"): ("cpfs_pagecache_lost_refill_queued", "gauge",
                                     "Chunks with lost pages waiting for the mount to be idle to be loaded."),
    ("scheduler", "refill_skipped"): ("cpfs_pagecache_lost_refill_skipped_total", "counter",
                                      "Chunks with lost pages not loaded: queue full, no cache room, fetch failed."),
    ("scheduler", "inflight"): ("cpfs_fetches_in_flight", "gauge", "Chunk fetches in flight now."),
    ("scheduler", "peak_inflight"): ("cpfs_fetches_in_flight_peak", "gauge", "Most chunk fetches in flight at once."),
    # cpfs.learned
    ("learned", "recordings"): ("cpfs_learned_recordings", "gauge", "Loads whose reads are kept to replay as plans."),
    ("learned", "learned"): ("cpfs_learned_loads_total", "counter", "Cold loads recorded."),
    ("learned", "replayed"): ("cpfs_learned_plans_total", "counter", "Plans started from a recorded load."),
    ("learned", "strayed"): ("cpfs_learned_plans_left_total", "counter",
                             "Learned plans dropped because their reader read elsewhere."),
    ("learned", "shared_gets"): ("cpfs_learned_shared_gets_total", "counter",
                                 "Shared learned objects asked for (landings no recording here matched)."),
    ("learned", "shared_got"): ("cpfs_learned_shared_recordings_total", "counter",
                                "Recordings other hosts' loads shared that this mount took."),
    ("learned", "shared_puts"): ("cpfs_learned_shared_puts_total", "counter", "Shared learned objects written."),
    ("learned", "shared_errors"): ("cpfs_learned_shared_errors_total", "counter",
                                   "Shared learned objects that could not be read or written."),
    # cpfs.catalog
    ("catalog", "listings"): ("cpfs_catalog_listings_total", "counter", "Folder listings sent to stores."),
    ("catalog", "fetched"): ("cpfs_catalog_manifests_fetched_total", "counter", "Whole manifests read from stores."),
    ("catalog", "summaries"): ("cpfs_catalog_summaries_total", "counter", "Manifest summaries read from stores."),
    ("catalog", "cached"): ("cpfs_catalog_summaries_cached", "gauge", "Manifest summaries kept in memory."),
    ("catalog", "commits"): ("cpfs_catalog_commits_total", "counter", "Versions committed."),
    ("catalog", "failed_commits"): ("cpfs_catalog_failed_commits_total", "counter",
                                    "Commits that did not reach the write quorum."),
    ("catalog", "retired"): ("cpfs_catalog_retired_total", "counter", "Old versions deleted."),
    # cpfs.buffers: the folder stores' read buffers
    ("buffers", "buffers"): ("cpfs_read_buffers", "gauge", "Read buffers the pool tracks, in use or idle."),
    ("buffers", "bytes"): ("cpfs_read_buffers_bytes", "gauge", "Their size."),
    ("buffers", "keep"): ("cpfs_read_buffers_ready_bytes", "gauge",
                          "Bytes of buffers kept backed while idle ([cache] buffers)."),
    ("buffers", "reused"): ("cpfs_read_buffers_reused_total", "counter", "Reads into a buffer already backed."),
    ("buffers", "larger"): ("cpfs_read_buffers_reused_larger_total", "counter",
                            "... of those, into a buffer of a larger size class."),
    ("buffers", "allocated"): ("cpfs_read_buffers_mapped_total", "counter",
                               "Reads that mapped a new buffer (its pages touched for the first time)."),
    # cpfs.holds
    ("holds", "versions"): ("cpfs_holds_versions", "gauge", "Versions open here and kept from gc."),
    ("holds", "chunks"): ("cpfs_holds_chunks", "gauge", "Distinct chunks the held versions name."),
    ("holds", "objects"): ("cpfs_holds_objects", "gauge", "Holds on the stores (or being written or deleted)."),
    ("holds", "writes"): ("cpfs_holds_written_total", "counter", "Holds written to the stores."),
    ("holds", "skipped"): ("cpfs_holds_skipped_total", "counter", "Versions closed too soon to need a hold."),
    ("holds", "failed"): ("cpfs_holds_failed_total", "counter",
                          "Holds no store took: alert on it (gc may take those versions' chunks)."),
    ("holds", "late"): ("cpfs_holds_late_total", "counter",
                        "Holds a store took only after gc's settle: alert on it."),
    ("holds", "renewed"): ("cpfs_holds_renewed_total", "counter", "Holds touched again (per store)."),
    ("holds", "deleted"): ("cpfs_holds_deleted_total", "counter", "Holds deleted once let go of (per store)."),
    ("holds", "lapsed"): ("cpfs_holds_lapsed_total", "counter",
                          "Renewals later than the lease (the host slept): alert on it."),
    # the mount (cpfs.fs)
    ("mount", "files"): ("cpfs_files", "gauge", "Files in the mount's namespace."),
    ("mount", "retired"): ("cpfs_files_unlinked_open", "gauge", "Files removed while still open."),
    ("mount", "open_handles"): ("cpfs_open_handles", "gauge", "Open file handles."),
    ("mount", "writing"): ("cpfs_files_being_written", "gauge", "Files being written."),
    ("mount", "closes_not_last"): ("cpfs_closes_not_committed_total", "counter",
                                   "Closes of a file while its writer still held it open for writing (a fork's, "
                                   "a dup's): no commit."),
}
SKIP = {"time"}                 # document fields that are not figures


def _value(v: Any) -> str | None:
    """A sample value in the exposition format; None for anything that is not a number."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    return None


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def render(doc: dict[str, Any]) -> str:
    """The exposition text of one statistics document: one family per figure, HELP and TYPE first,
    one sample per store for the per-store sections."""
    families: dict[str, tuple[str, str, list[str]]] = {}

    def add(section: str, field: str, labels: str, value: Any) -> None:
        text = _value(value)
        if text is None:
            return
        name, kind, help_ = METRICS.get((section, field)) or (
            f"cpfs_{section}_{field}", "untyped", f"{section}.{field} of the .cpfs-stats document.")
        families.setdefault(name, (kind, help_, []))[2].append(f"{name}{labels} {text}")

    for section, body in doc.items():
        if section in SKIP:
            continue
        if isinstance(body, dict):
            for field, value in body.items():
                add(section, field, "", value)
        elif isinstance(body, list):
            for item in body:
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    labels = f'{{store="{_label(item["name"])}"}}'
                    for field, value in item.items():
                        if field != "name":
                            add(section, field, labels, value)
    out: list[str] = []
    for name, (kind, help_, samples) in families.items():
        out.append(f"# HELP {name} {_help(help_)}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples)
    return "\n".join(out) + "\n"


def _document(source: Source) -> dict[str, Any]:
    doc = source()
    return json.loads(doc) if isinstance(doc, (bytes, str)) else doc


def _response(status: str, body: bytes, content_type: str, head_only: bool = False) -> bytes:
    head = (f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    return head if head_only else head + body


def answer(request_line: str, source: Source) -> bytes:
    """The response to one request line ("GET /metrics HTTP/1.1"); sync, so it runs without a switch."""
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response("400 Bad Request", b"bad request\n", "text/plain; charset=utf-8")
    method, target = parts[0], parts[1].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response("405 Method Not Allowed", b"only GET\n", "text/plain; charset=utf-8")
    if target == "/metrics":
        body = render(_document(source)).encode()
        return _response("200 OK", body, CONTENT_TYPE, method == "HEAD")
    if target == "/":
        body = b"cpfs mount daemon: Prometheus metrics at /metrics\n"
        return _response("200 OK", body, "text/plain; charset=utf-8", method == "HEAD")
    return _response("404 Not Found", b"not found: try /metrics\n", "text/plain; charset=utf-8", method == "HEAD")


async def _read_head(stream: trio.abc.ReceiveStream) -> bytes | None:
    """The request head up to its blank line; None if the client closed or sent too much."""
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > MAX_HEAD:
            return None
        more = await stream.receive_some(MAX_HEAD)
        if not more:
            return data or None      # a head without its blank line: answer the request line anyway
        data += more
    return data


async def _handle(stream: trio.SocketStream, source: Source, clients: trio.CapacityLimiter) -> None:
    """One connection: one request, one response, closed. Never raises into the server's nursery."""
    try:
        async with stream:
            try:
                clients.acquire_nowait()
            except trio.WouldBlock:
                await stream.send_all(_response("503 Service Unavailable", b"busy\n", "text/plain; charset=utf-8"))
                return
            try:
                with trio.move_on_after(REQUEST_TIMEOUT):
                    head = await _read_head(stream)
                    if head is None:
                        return
                    line = head.split(b"\n", 1)[0].decode("latin-1").strip()
                    try:
                        response = answer(line, source)
                    except Exception:
                        log.exception("metrics: could not render the statistics")
                        response = _response("500 Internal Server Error", b"error\n", "text/plain; charset=utf-8")
                    await stream.send_all(response)
            finally:
                clients.release()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        log.debug("metrics: client went away: %s", e)
    except Exception:
        log.exception("metrics: unexpected error answering a scrape")


async def serve(listen: tuple[str, int], source: Source, *, where: str = "metrics.listen",
                task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer scrapes on `listen` (host, port) until cancelled. Reports the bound addresses through
    `task_status` (start it with `nursery.start`); a port that cannot be bound is a ConfigError."""
    host, port = listen
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as e:
        raise ConfigError(f"{where}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    addresses = [tuple(ln.socket.getsockname()[:2]) for ln in listeners]
    log.info("Prometheus metrics on %s", ", ".join(f"http://{h}:{p}/metrics" for h, p in addresses))
    clients = trio.CapacityLimiter(MAX_CLIENTS)
    async with trio.open_nursery() as n:
        await n.start(trio.serve_listeners, lambda s: _handle(s, source, clients), listeners)
        task_status.started(addresses)


async def start(nursery: trio.Nursery, config: Config, source: Source) -> list[tuple[str, int]]:
    """The daemon's hook: serve `source` in `nursery` if `[metrics] listen` is set; the bound
    addresses (none when off). Returns once listening, so a taken port fails the mount at start."""
    if config.metrics_listen is None:
        return []
    return await nursery.start(partial(serve, config.metrics_listen, source,
                                       where=f"{config.source}: metrics.listen"))
