"""Live statistics of a mount: every layer's `statistics()` snapshot in one JSON document.

A mount serves it as a hidden control file, `MOUNTPOINT/.cpfs-stats` (looked up by name, never listed,
read-only, generated at each open), so tools find a mount's figures from its path with no socket to
discover; `cpfs stats MOUNTPOINT [--json] [--watch]` reads it. Each layer owns its counters: this module
only gathers the frozen snapshots (keyword dataclasses) and formats them.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from .catalog import VOID_RETRY

CONTROL_NAME = ".cpfs-stats"
CONTROL_INO = 0x7FFF_FFFF_FFFF_FF00      # far above the inode numbers the namespace hands out
MiB = 1024 * 1024


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def collect(*, pool: Any, catalog: Any, scheduler: Any, mount: dict[str, Any], plans: Sequence[Any] = (),
            learned: Any = None, pushes: Any = None, holds: Any = None, buffers: Any = None) -> bytes:
    """The JSON document: stores (requests, bytes, errors, latency), their health, replica reads
    (hedges, repairs), the chunk cache, the readahead scheduler, the page-cache pushes, the read
    buffers, declared and learned prefetches, the versions held open against gc, the catalog, and the
    mount's own."""
    doc = {
        "time": time.time(),
        "stores": _plain(pool.statistics()),
        "health": _plain(pool.health()),
        "replicas": _plain(pool.replica_statistics()),
        "cache": _plain(scheduler.cache.statistics()),
        "scheduler": _plain(scheduler.statistics()),
        "pushes": _plain(pushes),
        "buffers": _plain(buffers),
        "plans": _plain(list(plans)),
        "learned": _plain(learned),
        "holds": _plain(holds),
        "catalog": _plain(catalog.statistics()),
        "mount": mount,
    }
    return json.dumps(doc, indent=1).encode() + b"\n"


def _figure(key: str, value: float) -> str:
    """A per-file figure for people: byte counts in MiB."""
    return f"{value / MiB:.1f} MiB" if "bytes" in key or key in ("read", "fetched") else f"{value:g}"


def render(now: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """A screenful for people: per store, then the cache and the scheduler. With `before` (an earlier
    document), rates over the interval between the two."""
    dt = (now["time"] - before["time"]) if before else 0.0
    old = {s["name"]: s for s in before["stores"]} if before else {}
    up = {h["name"]: h["up"] for h in now["health"]}
    # Figures a layer may not report (yet): shown when the document has them.
    quantiles = all("latency_p50" in s and "latency_p99" in s for s in now["stores"]) and bool(now["stores"])
    slowest = quantiles and all("latency_max" in s for s in now["stores"])
    missing = all("missing" in s for s in now["stores"]) and bool(now["stores"])
    lines = [f"{'store':<12} {'up':<3} {'requests':>9} {'errors':>7}" + (f" {'missing':>7}" if missing else "")
             + f" {'in flight':>9} {'read MiB':>9} {'written MiB':>11} {'latency ms':>10}"
             + (f" {'p50 ms':>8} {'p99 ms':>8}" if quantiles else "") + (f" {'max ms':>9}" if slowest else "")
             + (f" {'read MiB/s':>10}" if dt else "")]
    for s in now["stores"]:
        line = (f"{s['name']:<12} {'yes' if up.get(s['name'], True) else 'NO':<3} {s['requests']:>9} "
                f"{s['errors']:>7}" + (f" {s['missing']:>7}" if missing else "")
                + f" {s['outstanding']:>9} {s['bytes_read'] / MiB:>9.1f} "
                f"{s['bytes_written'] / MiB:>11.1f} {s['latency_ewma'] * 1000:>10.2f}")
        if quantiles:
            line += f" {s['latency_p50'] * 1000:>8.2f} {s['latency_p99'] * 1000:>8.2f}"
        if slowest:
            line += f" {s['latency_max'] * 1000:>9.2f}"
        if dt:
            prev = old.get(s["name"], s)
            line += f" {(s['bytes_read'] - prev['bytes_read']) / MiB / dt:>10.1f}"
        lines.append(line)
    c, sc, r = now["cache"], now["scheduler"], now["replicas"]
    lines.append(f"cache: {c['used'] / MiB:.0f} of {c['budget'] / MiB:.0f} MiB, {c['hits']} hits, "
                 f"{c['misses']} misses, {c['evictions']} evictions")
    if b := now.get("buffers"):
        lines.append(f"read buffers: {b['bytes'] / MiB:.0f} MiB ({b['keep'] / MiB:.0f} MiB kept ready), {b['reused']} "
                     f"reads into backed ones ({b['larger']} of a larger size), {b['allocated']} into new ones")
    prefetch = f"{sc['prefetches']} prefetched ({sc['prefetch_failures']} failed"
    if "prefetch_used" in sc and "prefetch_wasted" in sc:
        prefetch += f", {sc['prefetch_used']} used, {sc['prefetch_wasted']} wasted"
    pushed = f"{sc['pushed']} chunks"
    if p := now.get("pushes"):
        pushed += (f" ({p['bytes'] / MiB:.1f} MiB; {p['replied_bytes'] / MiB:.1f} MiB left out, read replies gave "
                   f"them first)")
    if sc.get("kernel_drops"):
        pushed += f" (the kernel dropped them {sc['kernel_drops']} times)"
    lines.append(f"reads: {sc['reads']} requests, {sc['read_bytes'] / MiB:.1f} MiB; fetches: {sc['demand_fetches']} "
                 f"on demand, {prefetch}), {sc['inflight']} in flight; {pushed} pushed to the page cache")
    if sc.get("block_fetches"):
        lines.append(f"pages the kernel lost: {sc['block_fetches']} reads served from {sc['block_bytes'] / MiB:.1f} "
                     f"MiB of their blocks; {sc.get('refilled', 0)} of their chunks loaded into the cache since, "
                     f"{sc.get('refill_queued', 0)} waiting for the mount to be idle"
                     + (f", {sc['refill_skipped']} given up" if sc.get("refill_skipped") else ""))
    if sc.get("part_fetches"):
        lines.append(f"readers of slices: {sc['part_fetches']} parts of chunks fetched, "
                     f"{sc['part_bytes'] / MiB:.1f} MiB")
    if dt:
        fetched = sum(s["bytes_read"] for s in now["stores"]) - sum(s["bytes_read"] for s in before["stores"])
        read = sc["read_bytes"] - before["scheduler"]["read_bytes"]
        lines.append(f"last {dt:.1f} s: {read / MiB / dt:.1f} MiB/s read from the mount, "
                     f"{fetched / MiB / dt:.1f} MiB/s fetched from the stores")
    for f in sc.get("files", []) if isinstance(sc.get("files"), list) else []:
        if isinstance(f, dict):
            name = f.get("path", f.get("name", "?"))
            figures = ", ".join(f"{k} {_figure(k, v)}" for k, v in f.items()
                                if k not in ("path", "name") and isinstance(v, (int, float)) and not isinstance(v, bool))
            lines.append(f"file {name}: {figures}")
    for p in now.get("plans", []):
        kind, what = (("learned", f"from {p['learned_from']}") if p.get("learned_from")
                      else ("declared", ", ".join(p["patterns"])))
        lines.append(f"{kind} prefetch {p['path']} ({what}): {p['tensors']} tensors, "
                     f"{p['fetched_bytes'] / MiB:.1f} of {p['bytes'] / MiB:.1f} MiB fetched, "
                     f"{p['failed_chunks']} chunks failed, {'done' if p['done'] else 'running'} ({p['seconds']:.1f} s)")
    if lr := now.get("learned"):
        lines.append(f"learned prefetch: {lr['recordings']} loads kept, {lr['learned']} learned, "
                     f"{lr['replayed']} replayed ({lr['strayed']} left by their reader); shared: "
                     f"{lr['shared_got']} taken in {lr['shared_gets']} gets, "
                     f"{lr['shared_puts']} puts, {lr['shared_errors']} errors")
    batched = f" ({r['batched']} in {r['batch_reads']} batches)" if r.get("batch_reads") else ""
    held = f", {r['hedges_over_budget']} held back by the budget" if r.get("hedges_over_budget") else ""
    lines.append(f"replicas: {r['reads']} reads{batched}, {r['fallbacks']} fallbacks, {r['hedges']} hedges "
                 f"({r['hedges_won']} won{held}), {r['repairs_dropped']} repairs dropped")
    m = now["mount"]
    lines.append(f"mount: {m['files']} files, {m['open_handles']} open handles, {m['writing']} being written"
                 + (f", {m['closes_not_last']} closes that were not the writer's last (forks, dups: no commit)"
                    if m.get("closes_not_last") else ""))
    if h := now.get("holds"):
        lines.append(f"holds (open versions kept from gc): {h['versions']} versions, {h['chunks']} chunks, "
                     f"{h['objects']} on the stores; {h['writes']} written, {h['skipped']} closed too soon to "
                     f"need one, {h['renewed']} renewed, {h['deleted']} deleted")
        if h["failed"] or h["late"] or h["lapsed"]:
            lines.append(f"WARNING: {h['failed']} holds no store took, {h['late']} that a store took late and "
                         f"{h['lapsed']} renewals later than the lease (the host slept): gc may have taken "
                         f"those versions' chunks once newer commits retired them (the log names them)")
    if cat := now.get("catalog"):
        lines.append(f"commits: {cat['commits']} ({cat['failed_commits']} failed, {cat['voided']} of them voided "
                     f"by a twin or marker), {cat['transactions']} transactions")
        if cat.get("unvoided"):
            lines.append(f"WARNING: {cat['unvoided']} failed commits may count as current: no store took the key "
                         f"that voids them yet (tried again every {VOID_RETRY:g} s; the mount's log names them)")
    return "\n".join(lines)
