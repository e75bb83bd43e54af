"""Which S3 client the S3 store uses: boto3 or obstore, measured on the same loopback server.

Starts a moto server on 127.0.0.1 (tests/s3server.py), uploads `--total` of `--object-size` random
objects, then reads them all back with each client at `--concurrency` requests in flight, the way
cpfs.store.s3 calls a client: blocking calls in trio worker threads under one CapacityLimiter, one
connection per request slot. obstore's async API needs asyncio, so it runs its sync API in threads too.
Rows: boto3 as the store configures it (optional S3 checksums only where required), boto3 with its
default CRC32 checks, obstore copied into `bytes` (what a Store returns), obstore's zero-copy buffer
(for reference), and cpfs's own S3Store, to show what the store adds to its client.

Prints, per client, the median over `--rounds` rounds (clients interleaved) of the read throughput and
of the client's CPU time per GiB read (user + system of this process, all its threads; the server is
another process, its CPU is shown for context). The server is Python, so throughput here is bound by
it; the CPU per GiB is the figure that carries over to a real object store.

    python -m benchmarks.bench_s3_client [--total 256MiB] [--object-size 4MiB] [--concurrency 16]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import trio

from tests.s3server import S3_ENV, S3Server, running_server

from .common import GiB, MiB, parse_size


Getter = Callable[[str], bytes]


@dataclass(frozen=True)
class Round:
    seconds: float
    cpu: float          # this process, user + system
    server_cpu: float   # the moto subprocess
    nbytes: int


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _server_cpu(server: S3Server) -> float:
    import psutil

    t = psutil.Process(server.proc.pid).cpu_times()
    return t.user + t.system


def boto3_getter(server: S3Server, bucket: str, concurrency: int, *, checksums: bool = False) -> Getter:
    """The settings cpfs.store.s3 uses; `checksums` turns botocore's default CRC32 validation back on."""
    import boto3
    from botocore.config import Config

    when = "when_supported" if checksums else "when_required"
    client = boto3.session.Session().client(
        "s3", endpoint_url=server.endpoint, region_name=S3_ENV["AWS_DEFAULT_REGION"],
        config=Config(max_pool_connections=concurrency, retries={"total_max_attempts": 1},
                      s3={"addressing_style": "path"}, request_checksum_calculation=when,
                      response_checksum_validation=when))
    return lambda key: client.get_object(Bucket=bucket, Key=key)["Body"].read()


def obstore_getter(server: S3Server, bucket: str, concurrency: int, *, copy: bool = True) -> Getter:
    """`copy`: into `bytes`, as a Store must return; without, obstore's zero-copy buffer (reference)."""
    import obstore
    from obstore.store import S3Store as ObS3Store

    store = ObS3Store(bucket, endpoint=server.endpoint, region=S3_ENV["AWS_DEFAULT_REGION"],
                      client_options={"allow_http": True, "pool_max_idle_per_host": str(concurrency)},
                      retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=30),
                                    "backoff": {"init_backoff": timedelta(milliseconds=100),
                                                "max_backoff": timedelta(seconds=1), "base": 2}})
    if copy:
        return lambda key: bytes(obstore.get(store, key).bytes())
    return lambda key: obstore.get(store, key).bytes()


def cpfs_getter(server: S3Server, bucket: str, concurrency: int) -> Callable[[str], Awaitable[bytes]]:
    """cpfs's own store: its get is already async (threads under its own limiter)."""
    from cpfs.store.s3 import S3Store

    return S3Store("bench", bucket, "", endpoint=server.endpoint, concurrency=concurrency).get


async def read_all(get: Callable[[str], Awaitable[bytes]], keys: list[str]) -> int:
    total = 0

    async def one(key: str) -> None:
        nonlocal total
        n = len(await get(key))
        total += n   # not `total += len(await ...)`: that reads `total` before the await

    async with trio.open_nursery() as nursery:
        for key in keys:
            nursery.start_soon(one, key)
    return total


def in_threads(get: Getter, concurrency: int) -> Callable[[str], Awaitable[bytes]]:
    """A blocking getter called as cpfs.store.s3 calls boto3: trio worker threads, one limiter."""
    limiter = trio.CapacityLimiter(concurrency)
    return lambda key: trio.to_thread.run_sync(get, key, limiter=limiter)


async def timed(server: S3Server, get: Callable[[str], Awaitable[bytes]], keys: list[str]) -> Round:
    cpu0, scpu0, t0 = _cpu(), _server_cpu(server), time.perf_counter()
    nbytes = await read_all(get, keys)
    return Round(time.perf_counter() - t0, _cpu() - cpu0, _server_cpu(server) - scpu0, nbytes)


def upload(server: S3Server, bucket: str, total: int, size: int) -> list[str]:
    client = server.client()
    keys = [f"chunks/{i:02x}/obj{i:05d}" for i in range(max(1, total // size))]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=os.urandom(size)), keys))
    return keys


async def measure(server: S3Server, bucket: str, keys: list[str], args: argparse.Namespace) -> dict[str, list[Round]]:
    c = args.concurrency
    makers: dict[str, Callable[[], Callable[[str], Awaitable[bytes]]]] = {
        "boto3": lambda: in_threads(boto3_getter(server, bucket, c), c),
        "boto3, CRC32 checks on": lambda: in_threads(boto3_getter(server, bucket, c, checksums=True), c),
        "obstore, copied to bytes": lambda: in_threads(obstore_getter(server, bucket, c), c),
        "obstore, zero-copy buffer": lambda: in_threads(obstore_getter(server, bucket, c, copy=False), c),
        "cpfs S3Store": lambda: cpfs_getter(server, bucket, c),
    }
    getters = {}
    for label, make in makers.items():
        try:
            getters[label] = make()
        except ImportError as e:
            print(f"({label}: not measured, {e})")
            continue
        await read_all(getters[label], keys[:c])        # build the client, warm its connection pool
    rounds: dict[str, list[Round]] = {label: [] for label in getters}
    for _ in range(args.rounds):
        for label, get in getters.items():
            r = await timed(server, get, keys)
            assert r.nbytes == len(keys) * args.object_size, (label, r.nbytes)
            rounds[label].append(r)
    for get in getters.values():
        if hasattr(get, "__self__"):                     # the S3Store's bound get
            await get.__self__.aclose()
    return rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=parse_size, default=256 * MiB)
    ap.add_argument("--object-size", type=parse_size, default=4 * MiB)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.update(S3_ENV)

    with running_server() as server:
        bucket = server.make_bucket("bench")
        keys = upload(server, bucket, args.total, args.object_size)
        print(f"moto server {server.endpoint}: {len(keys)} objects of {args.object_size / MiB:g} MiB, "
              f"reading at concurrency {args.concurrency}, {args.rounds} rounds")
        rounds = trio.run(measure, server, bucket, keys, args)

    print(f"{'client':32} {'MiB/s':>8} {'client CPU-s/GiB':>17} {'server CPU-s/GiB':>17}")
    for label, rs in rounds.items():
        mibs = statistics.median(r.nbytes / MiB / r.seconds for r in rs)
        cpu = statistics.median(r.cpu / (r.nbytes / GiB) for r in rs)
        scpu = statistics.median(r.server_cpu / (r.nbytes / GiB) for r in rs)
        print(f"{label:32} {mibs:8.1f} {cpu:17.2f} {scpu:17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
