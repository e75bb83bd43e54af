"""A store that is an S3 bucket (or a prefix in one): AWS S3, Ceph RGW, MinIO, any S3-compatible server.

    [[store]]
    name = "rgw1"
    url = "s3://bucket/optional/prefix"
    endpoint = "https://rgw.example:8443"    # omit for AWS S3
    region = "us-east-1"                     # optional
    profile = "ckpt"                         # optional: a profile of the shared AWS config files

Credentials come from the standard AWS chain only (environment, shared credentials and config files,
the profile, container or instance metadata unless AWS_EC2_METADATA_DISABLED): nothing secret is in a
config, and nothing secret is logged (an endpoint with user:password@ is refused).

Client: boto3, its blocking calls in trio worker threads under one CapacityLimiter per store, with a
connection pool of the same size (`concurrency`); a chunk's check runs in the thread of its GET
(`get_with`), not in a second one. Measured against obstore on a loopback server
(benchmarks/bench_s3_client.py): boto3 read faster and with less CPU per GiB once obstore's buffers are
copied into the `bytes` this interface returns, and it brings the whole credential chain itself.

Atomicity: one PUT is atomic on S3 (a reader sees the old object or the new one), so every put is a
single PUT; chunks are at most 256 MiB, far below the 5 GiB a PUT may carry.

Errors: this kind classifies, it never retries (botocore's retries are off: one attempt per call); the
pool decides whether to try again from `transient`. Throttling, 5xx, resets, timeouts and an endpoint
that does not answer are transient; a missing bucket, denied access and bad credentials are not.
Checksums: botocore computes and checks the optional S3 checksums only where the API requires them,
since older Ceph and MinIO reject the newer default ones; cpfs verifies every chunk by its BLAKE3 anyway.

Ages: an object's mtime is its LastModified (to the second); `touch` copies the object onto itself,
server-side. `delete_if_older` is the interface's default, a HEAD then a DELETE: S3 offers no delete
conditional on age, so a touch landing between the two is lost with the copy (cpfs/gc.py).

Caveat: like the folder store, a call cancelled by the pool's timeout abandons its thread, which keeps
its limiter token until botocore gives up (its own connect and read timeouts, set from `timeout`).
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import trio

from ..errors import NoSuchObject, StoreDenied, StoreError, StoreFull, StoreUnavailable
from .base import Capacity, ObjectInfo, Store, foreign, foreign_prefix

if TYPE_CHECKING:
    from ..config import StoreConfig
    from .registry import OptionContext

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PUT = 5 * 1024**3          # the most one S3 PUT may carry
CONNECT_TIMEOUT_MAX = 10.0     # seconds; a connect slower than this will not get better

_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}")      # S3, plus Ceph's legacy names
_REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# Error codes (the XML <Code>, or the status for bodiless HEAD answers) by what they mean for us.
_MISSING = {"NoSuchKey", "404", "NotFound"}
_FULL = {"EntityTooLarge", "QuotaExceeded", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded",
         "InsufficientStorage", "StorageFull"}
_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId",
           "SignatureDoesNotMatch", "InvalidToken", "RequestTimeTooSkewed", "UserSuspended"}
_TRANSIENT = {"SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
              "TooManyRequests", "RequestLimitExceeded", "ServiceUnavailable", "InternalError",
              "RequestTimeout", "RequestTimeoutException", "ExpiredToken", "TokenRefreshRequired",
              "OperationAborted", "XMinioServerNotInitialized", "503", "500", "502", "504"}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


class S3Store(Store):
    """The `s3` kind: a bucket, or a prefix in one; keys are relative to the prefix."""

    kind = "s3"
    option_keys: frozenset[str] = frozenset({"endpoint", "region", "profile"})

    # ------------------------------------------------------------------ configuration

    @classmethod
    def parse_options(cls, url: str, raw: Mapping[str, Any], ctx: OptionContext) -> dict[str, Any]:
        """{"bucket", "prefix", "endpoint", "region", "profile", "location"} from
        `s3://BUCKET[/PREFIX]` and the kind's own keys; the errors name the [[store]] and the key."""
        try:
            expanded = ctx.expand(url)
        except KeyError as e:
            raise ctx.fail("url", f"${e.args[0]} is not set (in {url!r})") from None
        rest = expanded.split("://", 1)[1]
        if "@" in rest:         # not echoed: it may hold a secret
            raise ctx.fail("url", "must not hold credentials: they come from the environment, the shared "
                                  "AWS files or the profile")
        if any(c in rest for c in "?#\\") or any(c.isspace() for c in rest):
            raise ctx.fail("url", f"expected s3://BUCKET[/PREFIX] (no query or spaces), got {url!r}")
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise ctx.fail("url", f"{bucket!r} is not a bucket name (3 to 255 letters, digits, '.', '-', '_'), "
                                  f"in {url!r}")
        prefix = prefix.strip("/")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ctx.fail("url", f"the prefix {prefix!r} has an empty, '.' or '..' part, in {url!r}")

        def text(key: str) -> str | None:
            if key not in raw:
                return None
            value = ctx.convert(key, str, raw[key]).strip()
            if not value:
                raise ctx.fail(key, "must not be empty (leave the key out for the default)")
            try:
                return ctx.expand(value)
            except KeyError as e:
                raise ctx.fail(key, f"${e.args[0]} is not set (in {value!r})") from None

        endpoint = text("endpoint")
        server = "AWS S3"
        if endpoint is not None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ctx.fail("endpoint", f"expected http(s)://HOST[:PORT], got {endpoint!r}")
            if parts.username or parts.password:
                raise ctx.fail("endpoint", "must not hold credentials: they come from the environment, the "
                                           "shared AWS files or the profile")
            if parts.path not in ("", "/") or parts.query or parts.fragment:
                raise ctx.fail("endpoint", f"expected http(s)://HOST[:PORT] without a path, got {endpoint!r}")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise ctx.fail("endpoint", f"bad port in {endpoint!r}") from None
            endpoint = endpoint.rstrip("/")
            server = f"{parts.scheme}://{parts.hostname}:{port}"     # one spelling of one server
        region = text("region")
        if region is not None and not _REGION.fullmatch(region):
            raise ctx.fail("region", f"expected a region name such as 'us-east-1', got {region!r}")
        # Where the objects are, for cpfs.config's check that no two stores are one or nest.
        location = f"s3://{bucket}/{prefix}".rstrip("/") + f" at {server}"
        return {"bucket": bucket, "prefix": prefix, "endpoint": endpoint, "region": region,
                "profile": text("profile"), "location": location}

    @classmethod
    def from_config(cls, cfg: StoreConfig) -> S3Store:
        o = cfg.options
        return cls(cfg.name, o["bucket"], o["prefix"], endpoint=o["endpoint"], region=o["region"],
                   profile=o["profile"], concurrency=cfg.concurrency, timeout=cfg.timeout)

    def __init__(self, name: str, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 region: str | None = None, profile: str | None = None, concurrency: int = 8,
                 timeout: float = 30.0) -> None:
        self.name = name
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = endpoint
        self.region = region
        self.profile = profile
        self.concurrency = concurrency
        self.timeout = timeout
        self.limiter = trio.CapacityLimiter(concurrency)
        self._base = self.prefix + "/" if self.prefix else ""
        # Built in a worker thread on first use: making a client reads files and is slow (~0.1 s).
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._unconditional_deletes = False     # the server answered If-Match on a DELETE with 501

    def __repr__(self) -> str:
        return f"S3Store({self.name!r}, {self._where!r})"

    @property
    def _where(self) -> str:
        """s3://bucket/prefix [at endpoint], for messages (never credentials)."""
        where = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return where + (f" at {self.endpoint}" if self.endpoint else "")

    # ------------------------------------------------------------------ the client, in threads

    def _client_sync(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                session = boto3.session.Session(profile_name=self.profile)
                config = Config(
                    max_pool_connections=self.concurrency,
                    retries={"total_max_attempts": 1, "mode": "standard"},     # the pool retries
                    connect_timeout=min(self.timeout, CONNECT_TIMEOUT_MAX),
                    read_timeout=self.timeout,
                    # Custom endpoints (Ceph, MinIO) rarely have per-bucket DNS names.
                    s3={"addressing_style": "path" if self.endpoint else "auto"},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                self._client = session.client("s3", endpoint_url=self.endpoint, region_name=self.region,
                                              config=config)
                log.debug("store %r: boto3 client for %s, region %s, profile %s, %d connections",
                          self.name, self._where, self._client.meta.region_name, self.profile or "(default)",
                          self.concurrency)
            return self._client

    async def _run(self, what: str, fn: Callable[[Any], Any], then: Callable[[Any], T] | None = None) -> T:
        """fn(client) in a worker thread, its errors classified; `what` names the request in messages.
        `then`, if given, runs on fn's result in the same thread, and what it raises comes out as it
        is: a chunk's decode and check right after its GET, one hand-off per object instead of two.
        Abandoned (not waited for) if the caller is cancelled."""
        def call() -> T:
            try:
                got = fn(self._client_sync())
            except StoreError:
                raise
            except Exception as e:      # botocore's, and socket errors it lets through
                raise self._error(e, what) from None
            return got if then is None else then(got)
        return await trio.to_thread.run_sync(call, limiter=self.limiter, abandon_on_cancel=True)

    def _error(self, e: Exception, what: str) -> StoreError:
        from botocore import exceptions as bx

        if isinstance(e, bx.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            detail = f"{what}: {code or status} {err.get('Message', '')}".rstrip()
            if code == "NoSuchBucket":
                return StoreUnavailable(self.name, f"bucket {self.bucket!r} does not exist ({self._where})",
                                        transient=False)
            if code in _MISSING:
                return NoSuchObject(self.name, f"no object {what}")
            if code in _FULL or status == 507:
                return StoreFull(self.name, f"{detail} ({self._where})")
            if code in _TRANSIENT or status in _TRANSIENT_STATUS:
                return StoreError(self.name, detail, transient=True)
            if code in _DENIED or status == 403:
                return StoreDenied(self.name, f"{detail} ({self._where})")
            return StoreError(self.name, detail)
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
            return StoreDenied(self.name, f"no usable AWS credentials ({e}): set them in the environment, the "
                                          f"shared AWS files or the store's profile")
        if isinstance(e, bx.ProfileNotFound):
            return StoreUnavailable(self.name, f"{e} (the store's profile key)", transient=False)
        if isinstance(e, bx.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(e):
            return StoreUnavailable(self.name, f"{self.endpoint}: TLS certificate not trusted: {e}",
                                    transient=False)
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ProxyConnectionError)):
            return StoreUnavailable(self.name, f"{what}: cannot reach {self.endpoint or 'S3'}: {e}")
        if isinstance(e, (bx.HTTPClientError, bx.ConnectionError, bx.IncompleteReadError, OSError)):
            # Read timeouts, resets and broken streams mid-request.
            return StoreError(self.name, f"{what}: {type(e).__name__}: {e}", transient=True)
        return StoreError(self.name, f"{what}: {type(e).__name__}: {e}")

    def _key(self, key: str) -> str:
        if foreign(key) or "\0" in key:
            raise StoreError(self.name, f"invalid key {key!r}")
        return self._base + key

    # ------------------------------------------------------------------ the Store interface

    async def get(self, key: str) -> bytes:
        return await self._run(repr(key), self._whole(key))

    async def get_with(self, key: str, fn: Callable[[bytes | memoryview], T], limiter: trio.CapacityLimiter) -> T:
        """The GET and fn in one worker thread, under this store's limiter (`limiter` is not taken: fn is
        a short check after a read that held the connection far longer)."""
        return await self._run(repr(key), self._whole(key), fn)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        request = self._ranged(key, start, length)
        if length == 0:
            await self.head(key)            # still NoSuchObject if absent
            return b""
        return await self._run(f"{key!r} [{start}+{length}]", request)

    async def get_range_with(self, key: str, start: int, length: int, fn: Callable[[bytes | memoryview], T],
                             limiter: trio.CapacityLimiter) -> T:
        """As `get_with`, for a range (a zero-length one the interface's way)."""
        request = self._ranged(key, start, length)
        if length == 0:
            return await super().get_range_with(key, start, length, fn, limiter)
        return await self._run(f"{key!r} [{start}+{length}]", request, fn)

    def _whole(self, key: str) -> Callable[[Any], bytes]:
        full = self._key(key)
        return lambda c: c.get_object(Bucket=self.bucket, Key=full)["Body"].read()

    def _ranged(self, key: str, start: int, length: int) -> Callable[[Any], bytes]:
        """The ranged GET of bytes [start, start+length), once the range is checked."""
        full = self._key(key)
        if start < 0 or length < 0:
            raise StoreError(self.name, f"invalid range {start}+{length} of {key!r}")

        def ranged(c: Any) -> bytes:
            from botocore.exceptions import ClientError
            try:
                resp = c.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}")
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") == "InvalidRange":
                    return b""                  # starts at or past the end (416)
                raise
            data = resp["Body"].read()
            # A server that ignores Range answers 200 with the whole object.
            return data[start:start + length] if "ContentRange" not in resp else data
        return ranged

    async def head(self, key: str) -> int:
        full = self._key(key)
        return await self._run(repr(key), lambda c: c.head_object(Bucket=self.bucket, Key=full)["ContentLength"])

    async def stat(self, key: str) -> ObjectInfo:
        full = self._key(key)
        resp = await self._run(repr(key), lambda c: c.head_object(Bucket=self.bucket, Key=full))
        return ObjectInfo(key=key, size=resp["ContentLength"], mtime=resp["LastModified"].timestamp(),
                          tag=resp.get("ETag", ""))

    async def touch(self, key: str) -> None:
        """A copy of the object onto itself (server-side, no bytes through us): S3 has no other way to
        renew LastModified. It also changes the object's ETag, which `delete_if_older` deletes by: a
        copy in one piece gives the MD5 of the bytes, a copy as a one-part upload "md5-of-md5-1", so
        the touch takes the form the object is not in. REPLACE is what makes a self-copy legal; we keep
        no metadata to lose. Caveat: a one-part copy cancelled midway leaves an incomplete upload (a
        bucket lifecycle rule aborts those)."""
        full = self._key(key)
        source = {"Bucket": self.bucket, "Key": full}

        def touch(c: Any) -> None:
            head = c.head_object(Bucket=self.bucket, Key=full)
            if "-" in head.get("ETag", "") or not head["ContentLength"]:
                c.copy_object(Bucket=self.bucket, Key=full, CopySource=source, MetadataDirective="REPLACE")
                return
            upload = c.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]
            try:
                part = c.upload_part_copy(Bucket=self.bucket, Key=full, UploadId=upload, PartNumber=1,
                                          CopySource=source)["CopyPartResult"]["ETag"]
                c.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload, MultipartUpload={
                    "Parts": [{"ETag": part, "PartNumber": 1}]})
            except BaseException:
                try:
                    c.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
                except Exception:       # the error that brought us here is the one to report
                    log.debug("store %r: could not abort the upload of a touch of %r", self.name, key)
                raise
        await self._run(f"touch {key!r}", touch)

    async def delete_if_older(self, key: str, before: float) -> bool:
        """A HEAD, then a DELETE only while the ETag is the one the HEAD judged old (If-Match): a touch
        (which changes the ETag) or a rewrite that lands before the server carries the DELETE out keeps
        the object, however late that is. An unconditional DELETE that the server was slow to carry out
        (an overloaded gateway; the pool gave up on it after its timeout) deleted a copy that a save had
        touched and committed meanwhile: the save, said done, lost a chunk (an audit's find). A server
        that refuses conditional deletes (501) gets an unconditional one, logged once."""
        if (info := await self.older(key, before)) is None:
            return False
        full = self._key(key)

        def delete(c: Any) -> bool | None:
            from botocore.exceptions import ClientError
            try:
                c.delete_object(Bucket=self.bucket, Key=full, IfMatch=info.tag or "*")
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status in (404, 412):    # gone, or changed since the HEAD: a touch, a rewrite
                    return False
                if status == 501:
                    return None
                raise
            return True

        deleted = await self._run(f"delete {key!r}", delete)
        if deleted is None:
            if not self._unconditional_deletes:
                self._unconditional_deletes = True
                log.warning("store %r: %s refuses conditional deletes (If-Match): gc deletes unconditionally, "
                            "and a touch in the moment before a delete lands is lost with the object",
                            self.name, self._where)
            await self.delete(key)
            return True
        return deleted

    async def put(self, key: str, data: bytes | memoryview) -> None:
        full = self._key(key)
        if len(data) > MAX_PUT:
            raise StoreError(self.name, f"{key!r}: {len(data)} bytes exceed the {MAX_PUT}-byte limit of one PUT")
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)   # botocore takes no memoryview
        await self._run(f"put {key!r}", lambda c: c.put_object(Bucket=self.bucket, Key=full, Body=body))

    async def put_new(self, key: str, data: bytes | memoryview) -> bool:
        """A conditional PUT (If-None-Match: *): AWS S3, MinIO, Ceph RGW since 19 (Squid). Caveat:
        a server that ignores the header (older ones) replaces the object like `put` and says True."""
        full = self._key(key)
        body = bytes(data)

        def put(c: Any) -> bool:
            from botocore.exceptions import ClientError
            try:
                c.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status == 412:       # PreconditionFailed: an object has the key
                    return False
                if status == 409:       # ConditionalRequestConflict: another one's PUT of it is under
                    raise StoreError(self.name, f"put_new {key!r}: {status} conditional request conflict",
                                     transient=True) from None   # way; once it ends, a retry gets 412
                raise
            return True

        return await self._run(f"put_new {key!r}", put)

    async def delete(self, key: str) -> None:
        full = self._key(key)
        try:
            await self._run(f"delete {key!r}", lambda c: c.delete_object(Bucket=self.bucket, Key=full))
        except NoSuchObject:
            pass                                # S3 answers 204 anyway; some servers 404

    async def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[str]:
        return [info.key for info in await self.list_info(prefix, start_after, limit)]

    async def list_info(self, prefix: str, start_after: str = "", limit: int = 1000) -> list[ObjectInfo]:
        if foreign_prefix(prefix) or "\0" in prefix:
            raise StoreError(self.name, f"invalid prefix {prefix!r}")
        if limit < 1:
            raise StoreError(self.name, f"invalid list limit {limit}")
        full_prefix = self._base + prefix

        def page(c: Any) -> list[ObjectInfo]:
            # A server may answer fewer keys than asked and say so (IsTruncated): go on until `limit`.
            out: list[ObjectInfo] = []
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
            if start_after:
                args["StartAfter"] = self._base + start_after
            while len(out) < limit:
                resp = c.list_objects_v2(**args, MaxKeys=min(limit - len(out), 1000))
                # "folder/" objects made by an S3 console, other tools' dotfiles: not ours (`foreign`).
                out += [ObjectInfo(key=o["Key"][len(self._base):], size=o["Size"],
                                   mtime=o["LastModified"].timestamp())
                        for o in resp.get("Contents", ()) if not foreign(o["Key"][len(self._base):])]
                if not resp.get("IsTruncated") or not resp.get("NextContinuationToken"):
                    break
                args["ContinuationToken"] = resp["NextContinuationToken"]
            return out[:limit]
        return await self._run(f"list {prefix!r}", page)

    async def check(self) -> None:
        """The bucket exists and we may list it; creates nothing (a startup that fails on another store
        leaves no trace). Whether we may write shows on the first put."""
        def probe(c: Any) -> None:
            c.head_bucket(Bucket=self.bucket)
            c.list_objects_v2(Bucket=self.bucket, Prefix=self._base, MaxKeys=1)
        try:
            await self._run("check", probe)
        except NoSuchObject:
            # head_bucket has no body: a bare 404 there is the bucket.
            raise StoreUnavailable(self.name, f"bucket {self.bucket!r} does not exist ({self._where})",
                                   transient=False) from None

    async def capacity(self) -> Capacity | None:
        """None: a bucket has no quota to report (statfs shows a large fixed figure for it)."""
        return None

    async def aclose(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
