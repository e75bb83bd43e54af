"""One checkpoint, one loopback S3 server, five ways to read it (not a test: it prints, it does not assert).

A moto S3 server on 127.0.0.1 (tests/s3server.py, fake credentials in the environment) holds the same
checkpoint twice: imported by `cpfs put` into two buckets that are the two stores of a cpfs config
(replicas = 1, so each chunk lives in one bucket and a load pulls from both), and uploaded as one plain
object to a third bucket for the other readers. Every case is cold and timed in a fresh process (sync,
drop the page cache, write and free twice the file's size of memory, then start the timer), with a
fresh mount per measurement, and compared with the same file loaded straight from local disk:

1. direct: torch.load of the local file (the baseline of the ratios);
2. plain GETs: one thread, boto3 get_object of the whole object, its body read 8 MiB at a time;
3. cpfs: `python mount.py --config S3_CONFIG MNT`, torch.load through the mount;
4. s3fs (Debian package): `s3fs BUCKET MNT -f -o url=...,use_path_request_style,passwd_file=...`;
5. rclone mount (Debian package): an s3 remote (provider Other), `--vfs-cache-mode full`, and `off`.

Every torch.load is checked against the direct load (dtype, shape and BLAKE3 of every tensor), the plain
GETs against the file's BLAKE3. The server is a Python process sharing the machine's cores with every
reader: it caps all S3 rows, so compare them with each other, within one run. Every object is kept in
its memory; it still answers a ranged GET by copying the whole object, so readers that fetch one big
object in ranges (s3fs: 10 MiB ranges) pay that per request: the run prints what one range costs.

    python -m benchmarks.bench_s3 [--size 512MiB] [--repeat 3] [--rclone-modes full,off] [--s3fs-option OPT]
                                  [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .bench_load import checkpoint_for
from .common import (MiB, BenchError, Mount, cpfs, drop_caches, human, is_mounted, leave_work, mounted,
                     parse_size, run_child, pid_alive, print_daemon_report, timed_load, touch_memory)
from .make_checkpoint import make_checkpoint

DEST = "bench/ckpt.pt"           # the checkpoint's path in cpfs
KEY = "ckpt.pt"                  # the plain object's key, for the GETs, s3fs and rclone
GET_BLOCK = 8 * MiB
APT_LINE = "apt-get install -y s3fs rclone"
MOUNT_TIMEOUT = 60.0
UNMOUNT_TIMEOUT = 30.0


@dataclass(frozen=True)
class Sample:
    seconds: float
    daemon_cpu: float | None = None    # CPU-s of the FUSE daemon while the load ran (mounted cases)


@dataclass
class Case:
    """One row: a way of reading the checkpoint, measured `--repeat` times."""
    label: str
    note: str
    measure: Callable[[int], Sample] | None     # round -> Sample; None: skipped (`note` says why)
    samples: list[Sample] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)   # moto's CPU-s over the whole measurement
    error: str | None = None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["get"]:
        return _child_get(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_s3", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=512 * MiB,
                   help="checkpoint size (default 512MiB; moto is a Python server and slow)")
    p.add_argument("--repeat", type=int, default=3, help="cold measurements per case; the median is shown")
    p.add_argument("--rclone-modes", default="full,off",
                   help="rclone --vfs-cache-mode values, one row each (default full,off)")
    p.add_argument("--s3fs-option", action="append", default=[], metavar="OPT",
                   help="an extra `-o OPT` for s3fs, e.g. multipart_size=128 (its ranged GETs are 10 MiB)")
    p.add_argument("--workdir", type=Path, help="where the temporary files and mounts go (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (configs, logs)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    t0 = time.monotonic()
    try:
        return run(args)
    except BenchError as e:
        print(f"\nbench_s3: error: {e}", file=sys.stderr)
        return 1
    finally:
        print(f"\nbench_s3: {time.monotonic() - t0:.0f} s in all")


def run(args: argparse.Namespace) -> int:
    # Imported here: the timed `get` child needs none of it.
    import blake3
    import psutil

    from tests.s3server import running_server, s3_environ

    # The fake credentials go into our environment so every process we start (cpfs put, the mount
    # daemons, the timed children) finds them first in the AWS chain.
    env = s3_environ()
    os.environ.clear()
    os.environ.update(env)
    # moto keeps an object larger than this in a temporary file and reads all of it for every GET,
    # ranged or not: keep every object in the server's memory, so no row waits on its disk.
    os.environ["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(1 << 40)

    ckpt = make_checkpoint(checkpoint_for(args.size), args.size)
    nbytes = ckpt.stat().st_size
    touch = 2 * nbytes
    with open(ckpt, "rb") as f:
        digest = blake3.blake3(f.read(), max_threads=blake3.blake3.AUTO).hexdigest()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cpfs-bench-s3-", dir=args.workdir or "/tmp"))
    mp = work / "mnt"
    print(f"work folder {work}")

    mounts: list[tuple[str, Mount]] = []
    mismatches: list[str] = []
    try:
        with running_server() as server:
            print(f"moto S3 server {server.endpoint} (pid {server.proc.pid}), every object in its memory")
            moto = psutil.Process(server.proc.pid)

            def moto_cpu() -> float:
                t = moto.cpu_times()
                return t.user + t.system
            client = server.client()
            stores = [server.make_bucket(f"cpfs-s{i}") for i in range(2)]
            plain = server.make_bucket("plain")
            cfg = write_config(work, stores, server.endpoint)
            print(f"buckets: cpfs stores {', '.join(stores)} (replicas = 1: each chunk in one bucket, a load "
                  f"pulls from both); plain object s3://{plain}/{KEY}")

            t = time.perf_counter()
            r = cpfs("put", str(ckpt), DEST, config=cfg)
            print(f"\n$ cpfs --config {cfg.name} put {ckpt.name} {DEST}   ({time.perf_counter() - t:.1f} s)")
            for line in r.stdout.strip().splitlines():
                print(f"  {line}")
            for b in stores:
                n, size = bucket_usage(client, b)
                print(f"  s3://{b}: {n} objects, {human(size)}")
            t = time.perf_counter()
            client.upload_file(str(ckpt), plain, KEY)
            if client.head_object(Bucket=plain, Key=KEY)["ContentLength"] != nbytes:
                raise BenchError(f"s3://{plain}/{KEY} does not have the file's {nbytes} bytes")
            print(f"$ boto3 upload_file {ckpt.name} s3://{plain}/{KEY}   ({time.perf_counter() - t:.1f} s)")
            range_probe(client, plain, ckpt)

            direct_fp: dict[str, str] = {}

            def load(path: Path, label: str, daemon: int | None = None) -> Sample:
                cpu0 = proc_cpu(daemon)
                res = timed_load(path, cold=True, touch=touch)
                cpu = proc_cpu(daemon) - cpu0 if daemon else None
                if res.note:
                    print(f"  note: {res.note}")
                if not direct_fp:
                    direct_fp.update(res.fingerprints)
                else:
                    bad = sorted(k for k in direct_fp if direct_fp[k] != res.fingerprints.get(k))
                    bad += sorted(set(res.fingerprints) - set(direct_fp))
                    mismatches.extend(f"{label}: {k}" for k in bad)
                return Sample(res.seconds, cpu)

            def direct(i: int) -> Sample:
                return load(ckpt, "direct")

            def gets(i: int) -> Sample:
                res = timed_get(server.endpoint, plain, KEY, touch)
                if res.get("note"):
                    print(f"  note: {res['note']}")
                if res["size"] != nbytes or res["blake3"] != digest:
                    mismatches.append(f"plain GETs: {res['size']} bytes, BLAKE3 {res['blake3'][:16]}... "
                                      f"(expected {nbytes} bytes, {digest[:16]}...)")
                return Sample(res["seconds"])

            def through_cpfs(i: int) -> Sample:
                with mounted(cfg, mp, work / f"cpfs-{i}.log") as m:
                    mounts.append((f"cpfs, round {i + 1}", m))
                    return load(mp / DEST, "cpfs", m.pid)

            cases = [
                Case("direct torch.load, local disk", "baseline", direct),
                Case("plain GETs, 1 thread", f"boto3 get_object, {GET_BLOCK // MiB} MiB reads; bytes only, no torch.load",
                     gets),
                Case("cpfs, 2 S3 stores", "replicas = 1, chunks split over 2 buckets", through_cpfs),
            ]
            cases += peer_cases(work, mp, server.endpoint, plain, args.rclone_modes.split(","), args.s3fs_option,
                                load)

            print(f"\n== cold reads of {human(nbytes)}, {args.repeat} rounds, cases interleaved (each in a fresh "
                  f"python, after sync + drop_caches and writing and freeing {human(touch)} of memory; a fresh "
                  f"mount for every mounted case)")
            for i in range(args.repeat):
                for c in cases:
                    if c.measure is None or c.error:
                        continue
                    cpu0 = moto_cpu()
                    try:
                        s = c.measure(i)
                    except BenchError as e:
                        c.error = str(e)
                        print(f"  round {i + 1}: {c.label}: FAILED: {e}")
                        continue
                    c.samples.append(s)
                    c.server_cpu.append(moto_cpu() - cpu0)
                    daemon = "" if s.daemon_cpu is None else f", FUSE daemon CPU {s.daemon_cpu:.1f} s"
                    print(f"  round {i + 1}: {c.label}: {s.seconds:.2f} s (moto CPU {c.server_cpu[-1]:.1f} s{daemon})")
    finally:
        leave_work(work, args.keep)

    report(cases, nbytes, args)
    print("\n== cpfs daemon statistics (logged at unmount)")
    for title, m in mounts:
        print_daemon_report(m, title)
        for line in m.log_lines:
            if "StoreStats" in line and line not in m.stats_lines():
                print(f"  {line}")
    if mismatches:
        print(f"\nFAILED: {len(mismatches)} value(s) differ from the original:")
        for x in mismatches[:30]:
            print(f"  {x}")
    else:
        print(f"\nevery torch.load equals the direct load ({len(direct_fp)} values: dtype, shape, BLAKE3 of the "
              f"bytes); the plain GETs returned the file's {nbytes} bytes (BLAKE3)")
    failed = bool(mismatches) or any(c.error for c in cases) or any(m.problems for _, m in mounts)
    return 1 if failed else 0


def write_config(work: Path, buckets: list[str], endpoint: str) -> Path:
    """Two S3 stores, one copy of every chunk: a load must fetch from both buckets."""
    lines = ["replicas = 1", "", "[mount]", f'staging = "{work / "staging"}"']
    for i, b in enumerate(buckets):
        lines += ["", "[[store]]", f'name = "s{i}"', f'url = "s3://{b}"', f'endpoint = "{endpoint}"']
    path = work / "cpfs-s3.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def proc_cpu(pid: int | None) -> float:
    """User + system CPU-s of a process (all its threads); 0 for None."""
    if pid is None:
        return 0.0
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error as e:
        raise BenchError(f"cannot read the CPU time of pid {pid}: {e}") from None
    return t.user + t.system


def bucket_usage(client: Any, bucket: str) -> tuple[int, int]:
    """(objects, bytes) in a bucket."""
    n = size = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", ()):
            n += 1
            size += o["Size"]
    return n, size


def range_probe(client: Any, bucket: str, ckpt: Path, rounds: int = 3) -> None:
    """What one 8 MiB GET costs on this server: a whole 8 MiB object, and a range of the big object
    (moto reads the whole object to answer a range, so readers that use ranges pay for that)."""
    with open(ckpt, "rb") as f:
        head = f.read(GET_BLOCK)
    client.put_object(Bucket=bucket, Key="probe-8MiB", Body=head)

    def median_get(**kw: Any) -> float:
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            client.get_object(Bucket=bucket, **kw)["Body"].read()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    whole = median_get(Key="probe-8MiB")
    ranged = median_get(Key=KEY, Range=f"bytes=0-{len(head) - 1}")
    client.delete_object(Bucket=bucket, Key="probe-8MiB")
    print(f"moto, one 8 MiB GET (warm, median of {rounds}): a whole 8 MiB object {whole * 1000:.0f} ms; "
          f"an 8 MiB range of the {human(ckpt.stat().st_size)} object {ranged * 1000:.0f} ms")


# ---------------------------------------------------------------------------------------------------
# s3fs and rclone

def peer_cases(work: Path, mp: Path, endpoint: str, bucket: str, rclone_modes: list[str],
               s3fs_options: list[str], load: Callable[[Path, str, int], Sample]) -> list[Case]:
    """The s3fs and rclone rows; skipped (with the apt line to install them) where the tool is missing."""
    missing = f"not installed: {APT_LINE}"
    for tool in ("s3fs", "rclone"):
        if not shutil.which(tool):
            print(f"{tool} is not installed: skipping its row(s); to measure it: {APT_LINE}")
    cases: list[Case] = []
    if shutil.which("s3fs"):
        passwd = work / "s3fs.passwd"
        passwd.write_text(f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}\n")
        passwd.chmod(0o600)
        cmd = ["s3fs", bucket, str(mp), "-f", "-o", f"url={endpoint}", "-o", "use_path_request_style",
               "-o", f"passwd_file={passwd}", "-o", f"endpoint={os.environ['AWS_DEFAULT_REGION']}",
               "-o", "dbglevel=warn"]
        for opt in s3fs_options:
            cmd += ["-o", opt]

        def s3fs(i: int) -> Sample:
            with fuse_daemon(cmd, mp, work / f"s3fs-{i}.log", "s3fs") as pid:
                return load(mp / KEY, "s3fs", pid)
        opts = ", ".join(f"-o {o}" for o in s3fs_options) or "default options (no use_cache)"
        cases.append(Case("s3fs", f"{tool_version('s3fs')}, {opts}", s3fs))
    else:
        cases.append(Case("s3fs", missing, None))

    modes = [m.strip() for m in rclone_modes if m.strip()]
    if not shutil.which("rclone"):
        cases += [Case(f"rclone mount, cache {m}", missing, None) for m in modes]
        return cases
    conf = work / "rclone.conf"
    conf.write_text("\n".join([
        "[moto]", "type = s3", "provider = Other", "env_auth = false",
        f"access_key_id = {os.environ['AWS_ACCESS_KEY_ID']}",
        f"secret_access_key = {os.environ['AWS_SECRET_ACCESS_KEY']}",
        f"region = {os.environ['AWS_DEFAULT_REGION']}", f"endpoint = {endpoint}", ""]))
    conf.chmod(0o600)
    version = tool_version("rclone")
    for mode in modes:
        def rclone(i: int, mode: str = mode) -> Sample:
            cache = work / f"rclone-cache-{mode}-{i}"     # empty: a cold vfs cache too
            cmd = ["rclone", "mount", f"moto:{bucket}", str(mp), "--config", str(conf), "--vfs-cache-mode", mode,
                   "--cache-dir", str(cache), "--log-level", "NOTICE"]
            # rclone's AWS SDK fails on a custom CA bundle from the environment even for plain http
            # ("LoadCustomCABundleError"): the endpoint is loopback http, it needs none.
            env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
            try:
                with fuse_daemon(cmd, mp, work / f"rclone-{mode}-{i}.log", "rclone mount", env=env) as pid:
                    return load(mp / KEY, f"rclone {mode}", pid)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
        cases.append(Case(f"rclone mount, cache {mode}", f"{version}, --vfs-cache-mode {mode}", rclone))
    return cases


def tool_version(tool: str) -> str:
    """'s3fs 1.90', 'rclone v1.60.1-DEV': the first line of its version output, shortened."""
    try:
        r = subprocess.run([tool, "--version"] if tool == "s3fs" else [tool, "version"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return tool
    first = (r.stdout or r.stderr).strip().splitlines()[:1]
    words = first[0].split() if first else []
    ver = next((w for w in words if w[:1].isdigit() or (w[:1] == "v" and w[1:2].isdigit())), "")
    if not ver:
        ver = next((w for w in words if w.startswith("V") and w[1:2].isdigit()), "")[1:]
    return f"{tool} {ver}".strip()


@contextmanager
def fuse_daemon(cmd: list[str], mountpoint: Path, log: Path, what: str,
                env: dict[str, str] | None = None) -> Iterator[int]:
    """Run a FUSE daemon in the foreground as our child, yield its pid once `mountpoint` is mounted;
    always unmount and wait for that pid (killed only if it hangs)."""
    mountpoint.mkdir(exist_ok=True)
    if is_mounted(mountpoint):
        raise BenchError(f"{mountpoint} is already mounted")
    with open(log, "ab") as f:
        # Its own session: a Ctrl-C reaches us, and our `finally` unmounts it.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not is_mounted(mountpoint):
            if proc.poll() is not None:
                raise BenchError(f"{what} exited {proc.returncode} before mounting: {log_tail(log)}")
            if time.monotonic() > deadline:
                raise BenchError(f"{what} did not mount {mountpoint} in {MOUNT_TIMEOUT:.0f} s: {log_tail(log)}")
            time.sleep(0.1)
        yield proc.pid
    finally:
        stop_fuse_daemon(proc, mountpoint, what)


def stop_fuse_daemon(proc: subprocess.Popen, mountpoint: Path, what: str) -> None:
    deadline = time.monotonic() + UNMOUNT_TIMEOUT
    while is_mounted(mountpoint) and time.monotonic() < deadline:
        r = subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True, text=True)
        if r.returncode != 0 and is_mounted(mountpoint):
            time.sleep(0.2)       # busy: a reader still has a file open
    if is_mounted(mountpoint):
        print(f"  {what}: fusermount3 -u kept failing; lazy unmount", file=sys.stderr)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"  {what} (pid {proc.pid}) still running after unmount; SIGTERM, then SIGKILL", file=sys.stderr)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if pid_alive(proc.pid):
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass


def log_tail(log: Path, lines: int = 5) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:]) or "(empty log)"
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------------
# plain GETs in a fresh process

def timed_get(endpoint: str, bucket: str, key: str, touch: int, timeout: float = 1800) -> dict[str, Any]:
    """One cold GET of the whole object in a fresh python: {"seconds", "size", "blake3", "note"}."""
    cmd = [sys.executable, "-m", "benchmarks.bench_s3", "get", endpoint, bucket, key, "--touch", str(touch)]
    return run_child(cmd, timeout)


def _child_get(argv: list[str]) -> int:
    """The timed child: the client is made and the memory touched before the timer; the body is
    copied into one buffer (as a reader of the bytes would), hashed after the timer."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_s3 get")
    p.add_argument("endpoint")
    p.add_argument("bucket")
    p.add_argument("key")
    p.add_argument("--touch", type=int, default=0)
    args = p.parse_args(argv)
    import blake3
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=args.endpoint,
                          config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1},
                                        request_checksum_calculation="when_required",
                                        response_checksum_validation="when_required"))
    size = client.head_object(Bucket=args.bucket, Key=args.key)["ContentLength"]
    note = drop_caches()           # the server's copy lives in files: cold for it too
    touch_memory(args.touch)
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    t0 = time.perf_counter()
    body = client.get_object(Bucket=args.bucket, Key=args.key)["Body"]
    while chunk := body.read(GET_BLOCK):
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "size": got, "note": note,
                      "blake3": blake3.blake3(view[:got], max_threads=blake3.blake3.AUTO).hexdigest()}))
    return 0


# ---------------------------------------------------------------------------------------------------

def report(cases: list[Case], nbytes: int, args: argparse.Namespace) -> None:
    base = statistics.median(s.seconds for s in cases[0].samples) if cases[0].samples else None
    print(f"\n== results: {human(nbytes)} checkpoint, cold, median of {args.repeat}; one moto server on "
          f"loopback serves every S3 row. moto CPU s: the server's CPU time over the measurement (mount and "
          f"unmount included); FUSE CPU s: the mount daemon's while the load ran")
    rows = []
    for c in cases:
        if not c.samples:
            why = c.note if c.measure is None else f"FAILED: {c.error}"
            rows.append([c.label, "-", "-", "-", "-", "-", why if len(why) < 100 else why[:97] + "..."])
            continue
        s = statistics.median(x.seconds for x in c.samples)
        daemon = [x.daemon_cpu for x in c.samples if x.daemon_cpu is not None]
        note = c.note + (f"; FAILED after {len(c.samples)} round(s)" if c.error else "")
        rows.append([c.label, f"{s:.2f}", f"{nbytes / s / MiB:.0f}", f"{s / base:.2f}x" if base else "-",
                     f"{statistics.median(c.server_cpu):.1f}",
                     f"{statistics.median(daemon):.1f}" if daemon else "-", note])
    table(["case", "seconds", "MiB/s", "vs direct", "moto CPU s", "FUSE CPU s", "note"], rows)


def table(headers: list[str], rows: list[list[str]]) -> None:
    """Like common.print_table, with the last column (the notes) left-aligned too."""
    cells = [headers] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        last = len(r) - 1
        return "  ".join(c.ljust(w) if i in (0, last) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
