"""S3-protocol servers on loopback for the tests and the S3 benchmark.

- `S3Server`: moto in server mode, a real S3 implementation, in its own subprocess (an in-process
  server would compete with the code under test for the GIL and die with a crashed test). It binds
  port 0 on 127.0.0.1 and prints the port it got, so two runs never race for a port; it exits when
  its stdin closes, so a test process killed outright takes it along, and `stop()` ends it by pid.
- `s3_server`: the session fixture over `shared_server()`, the one server of a test process;
  `open_s3_store` opens an S3Store on a fresh bucket of it (a factory for the store contract suite).
- `ErrorEndpoint`: a tiny in-process HTTP server answering every request with one chosen S3 error,
  a reset or silence, to see how the store classifies what a misbehaving server does.

Credentials are fake and come from the environment, the first link of the standard AWS chain:
`S3_ENV` is what the tests set for themselves and for the mount daemons and CLI runs they start.
"""
from __future__ import annotations

import atexit
import http.client
import http.server
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from cpfs.store.s3 import S3Store

# Fake credentials; AWS_EC2_METADATA_DISABLED keeps the chain from probing a metadata service.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Variables that would make the chain pick something other than S3_ENV.
_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ROLE_ARN",
          "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")

_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()          # until the parent closes our stdin (or dies)
server.stop()
"""


def s3_environ(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: os.environ) with the test credentials in force."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _UNSET}
    env.update(S3_ENV)
    return env


class S3Server:
    """One moto server subprocess on 127.0.0.1; `endpoint` is its URL."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.endpoint = ""

    def start(self, timeout: float = 60.0) -> S3Server:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=s3_environ())
        port = self.proc.stdout.readline().strip()       # blocks until bound (or the child died)
        if not port.isdigit():
            self.stop()
            raise RuntimeError(f"moto server did not start (exit {self.proc.returncode})")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until the server answers an S3 request (ListBuckets)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client().list_buckets()
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"moto server at {self.endpoint} does not answer") from None
                time.sleep(0.1)

    def client(self) -> Any:
        """A boto3 client for setting up and inspecting buckets from the test itself."""
        import boto3
        from botocore.config import Config

        env = s3_environ()
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=env["AWS_DEFAULT_REGION"],
                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}))

    def make_bucket(self, prefix: str = "cpfs") -> str:
        """A new, empty bucket with a unique name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """Close its stdin (it exits), and kill it by pid if it has not within a few seconds."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@contextmanager
def running_server() -> Iterator[S3Server]:
    """A server of one's own (the benchmark); the caller sets the credentials (S3_ENV)."""
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


_shared: S3Server | None = None
_saved_env: dict[str, str | None] = {}


def shared_server() -> S3Server:
    """The test process's one server, started on first use, with the test credentials put in
    os.environ (so every subprocess a test starts, mount daemons and CLI runs, has them too).
    `stop_shared()` ends it and puts the environment back; so does the exit of the process."""
    global _shared
    if _shared is None:
        if not _saved_env:
            _saved_env.update({k: os.environ.get(k) for k in (*S3_ENV, *_UNSET)})
            atexit.register(stop_shared)
        for k in _UNSET:
            os.environ.pop(k, None)
        os.environ.update(S3_ENV)
        _shared = S3Server().start()
    return _shared


def stop_shared() -> None:
    global _shared
    server, _shared = _shared, None
    if server is not None:
        server.stop()
    for k, v in _saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The moto server (and the test credentials in the environment) for the session."""
    try:
        yield shared_server()
    finally:
        stop_shared()


S3_LAYOUTS = ("two-buckets", "folder-and-bucket")


def write_s3_config(server: S3Server, folder: Path, layout: str, head: str = "") -> tuple[Path, list[str]]:
    """A config with two replicas on fresh buckets of `server`: "two-buckets" (one under a prefix) or
    "folder-and-bucket" (a folder store beside one bucket). Returns the config and its s3:// urls."""
    def store(name: str, url: str) -> str:
        return f'[[store]]\nname = "{name}"\nurl = "{url}"\nendpoint = "{server.endpoint}"\n'

    if layout == "two-buckets":
        urls = [f"s3://{server.make_bucket()}/cpfs/test", f"s3://{server.make_bucket()}"]
        stores = store("b0", urls[0]) + store("b1", urls[1])
    elif layout == "folder-and-bucket":
        urls = [f"s3://{server.make_bucket()}"]
        stores = '[[store]]\nname = "local"\nurl = "stores/local"\n' + store("b1", urls[0])
    else:
        raise ValueError(layout)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cpfs.toml"
    path.write_text((head or 'replicas = 2\nchunk_size = "1MiB"\n[cache]\nmemory = "64MiB"\n') + stores)
    return path, urls


@asynccontextmanager
async def open_s3_store(tmp_path: Path, name: str) -> AsyncIterator[S3Store]:
    """A store factory for the contract suite (tests/storekinds.py's StoreFactory): an S3Store on a
    fresh bucket of the shared server, under a prefix so that keys are relative to it."""
    server = await trio.to_thread.run_sync(shared_server)        # the first call starts it (~1 s)
    bucket = await trio.to_thread.run_sync(server.make_bucket)
    store = S3Store(name, bucket, "cpfs/test", endpoint=server.endpoint)
    try:
        yield store
    finally:
        await store.aclose()


class _Loopback:
    """A threaded HTTP server on 127.0.0.1 for one handler class (`_serve`); `endpoint` is its URL.
    Used as a context manager; at its end `_unblock()` frees the handlers that wait, then it stops."""

    def _serve(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _unblock(self) -> None:
        pass

    def __enter__(self) -> Any:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._unblock()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass


class ErrorEndpoint(_Loopback):
    """An HTTP server on 127.0.0.1 that answers every request the same wrong way, as a misbehaving S3
    server would: an S3 error (`status`, `code`), a connection reset (`reset=True`), or no answer at all
    (`hang=True`, until stopped). `requests` counts what reached it (the store must not retry)."""

    def __init__(self, status: int = 503, code: str = "SlowDown", *, reset: bool = False,
                 hang: bool = False) -> None:
        self.requests = 0
        self._stop = threading.Event()
        endpoint = self

        class Handler(_Handler):
            def _answer(self) -> None:
                endpoint.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if hang:
                    endpoint._stop.wait()
                    return
                if reset:      # RST instead of an answer: SO_LINGER with a zero timeout, then close
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                        f"<Message>injected {code}</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _answer

        self._serve(Handler)

    def _unblock(self) -> None:
        self._stop.set()


class DelayingProxy(_Loopback):
    """A forwarding HTTP proxy on 127.0.0.1 in front of an S3 server that holds back the DELETEs of
    keys containing `hold` until `release()`, and then forwards them, however long their client has
    given up: a gateway slow to carry out a request (an overloaded Ceph RGW). `held` is set once one
    waits. With `refuse_conditional`, a DELETE carrying If-Match is answered 501, as by a server
    without conditional deletes."""

    def __init__(self, upstream: str, hold: str, *, refuse_conditional: bool = False) -> None:
        self.held = threading.Event()
        self.forwarded_late = 0
        self._release = threading.Event()
        target = upstream.removeprefix("http://")
        proxy = self

        class Handler(_Handler):
            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "DELETE" and refuse_conditional and "If-Match" in self.headers:
                    return self._reply(501, {"Content-Type": "application/xml"},
                                       b"<Error><Code>NotImplemented</Code></Error>")
                if self.command == "DELETE" and hold in self.path:
                    proxy.held.set()
                    proxy._release.wait()
                    proxy.forwarded_late += 1
                conn = http.client.HTTPConnection(target, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body,
                                 headers={k: v for k, v in self.headers.items() if k.lower() != "connection"})
                    resp = conn.getresponse()
                    self._reply(resp.status, dict(resp.getheaders()), resp.read())
                finally:
                    conn.close()

            def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        if k.lower() not in ("content-length", "connection", "transfer-encoding"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                except OSError:
                    self.close_connection = True    # the client gave up on it: the request was carried out

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        self._serve(Handler)

    def release(self) -> None:
        self._release.set()

    _unblock = release


def closed_port() -> int:
    """A loopback port nothing listens on (just released by us)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
