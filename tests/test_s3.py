"""The S3 store on a real S3-protocol server (moto, on loopback): the store contract, how it classifies
failures, its [[store]] keys, and end to end: `cpfs put`/`cat` and a real mount over S3 buckets alone
and mixed with a folder."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import trio

from cpfs.config import load_config, parse_config
from cpfs.errors import ConfigError, NoSuchObject, StoreDenied, StoreError, StoreFull, StoreUnavailable
from cpfs.store import open_store
from cpfs.store.s3 import S3Store
from tests.conftest import cpfs
from tests.s3server import S3_LAYOUTS, DelayingProxy, ErrorEndpoint, S3Server, closed_port, s3_server, write_s3_config  # noqa: F401  (fixture)


def store_on(server: S3Server, bucket: str, prefix: str = "", name: str = "s3a", **kw) -> S3Store:
    return S3Store(name, bucket, prefix, endpoint=server.endpoint, **kw)


# ---- the store contract ---------------------------------------------------------------------------------

async def test_s3_store_contract(s3_server: S3Server) -> None:
    """get/get_range/head/put/exists/delete/list as the Store interface says, keys relative to the prefix."""
    bucket = s3_server.make_bucket()
    store = store_on(s3_server, bucket, "team/run1")
    try:
        await store.check()
        assert await store.list("") == []
        with pytest.raises(NoSuchObject) as e:
            await store.get("chunks/ab/missing")
        assert e.value.store == "s3a" and not e.value.transient
        with pytest.raises(NoSuchObject):
            await store.head("chunks/ab/missing")
        with pytest.raises(NoSuchObject):
            await store.get_range("chunks/ab/missing", 0, 10)
        with pytest.raises(NoSuchObject):
            await store.get_range("chunks/ab/missing", 0, 0)
        assert not await store.exists("chunks/ab/missing")

        data = bytes(range(256)) * 40
        await store.put("chunks/ab/ab01", data)
        await store.put("chunks/ab/ab02", memoryview(b"xxtwoxx")[2:5])
        await store.put("chunks/cd/cd01", b"")
        await store.put("manifests/m1.json", b"{}")
        assert await store.get("chunks/ab/ab01") == data
        assert await store.get("chunks/ab/ab02") == b"two"
        assert await store.get("chunks/cd/cd01") == b""
        assert await store.head("chunks/ab/ab01") == len(data)
        assert await store.head("chunks/cd/cd01") == 0
        assert await store.exists("chunks/ab/ab01") and await store.exists("chunks/cd/cd01")
        assert not await store.exists("chunks/ab")           # a common prefix is no object

        # Ranges: inside, short at the end, empty past it.
        assert await store.get_range("chunks/ab/ab01", 100, 1000) == data[100:1100]
        assert await store.get_range("chunks/ab/ab01", len(data) - 10, 100) == data[-10:]
        assert await store.get_range("chunks/ab/ab01", len(data), 10) == b""
        assert await store.get_range("chunks/ab/ab01", len(data) + 5, 10) == b""
        assert await store.get_range("chunks/ab/ab01", 7, 0) == b""
        assert await store.get_range("chunks/cd/cd01", 0, 10) == b""
        with pytest.raises(StoreError):
            await store.get_range("chunks/ab/ab01", -1, 10)

        # The objects live under the prefix in the bucket; listings drop it.
        raw = s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]
        assert sorted(o["Key"] for o in raw) == ["team/run1/chunks/ab/ab01", "team/run1/chunks/ab/ab02",
                                                 "team/run1/chunks/cd/cd01", "team/run1/manifests/m1.json"]
        assert await store.list("") == ["chunks/ab/ab01", "chunks/ab/ab02", "chunks/cd/cd01", "manifests/m1.json"]
        assert await store.list("chunks/") == ["chunks/ab/ab01", "chunks/ab/ab02", "chunks/cd/cd01"]
        assert await store.list("chunks/ab/ab0") == ["chunks/ab/ab01", "chunks/ab/ab02"]
        assert await store.list("chunk") == ["chunks/ab/ab01", "chunks/ab/ab02", "chunks/cd/cd01"]
        assert await store.list("chunks/", start_after="chunks/ab/ab01") == ["chunks/ab/ab02", "chunks/cd/cd01"]
        assert await store.list("nothing/here/") == []

        # Overwrite replaces; delete is idempotent.
        await store.put("chunks/ab/ab01", b"replaced")
        assert await store.get("chunks/ab/ab01") == b"replaced"
        assert await store.head("chunks/ab/ab01") == len(b"replaced")
        await store.delete("chunks/ab/ab01")
        await store.delete("chunks/ab/ab01")
        assert not await store.exists("chunks/ab/ab01")
        with pytest.raises(NoSuchObject):
            await store.get("chunks/ab/ab01")
        assert await store.list("chunks/ab/") == ["chunks/ab/ab02"]

        for bad in ("", "/abs", "a/../b"):
            with pytest.raises(StoreError):
                await store.put(bad, b"x")
        with pytest.raises(StoreError):
            await store.list("", limit=0)
    finally:
        await store.aclose()


async def _late_delete_round(server: S3Server, bucket: str, key: str, data: bytes) -> bool:
    """gc's delete_if_older judges the copy old and sends its DELETE, which the gateway holds; a mount
    touches the copy (dedup reusing it) and is answered; then the gateway carries the DELETE out.
    Returns what delete_if_older said."""
    mount_side = S3Store("s0", bucket, "cpfs", endpoint=server.endpoint)
    with DelayingProxy(server.endpoint, hold=key) as proxy:
        gc_side = S3Store("s0", bucket, "cpfs", endpoint=proxy.endpoint)
        said: list[bool] = []

        async def gc() -> None:
            said.append(await gc_side.delete_if_older(key, time.time() + 3600))

        async with trio.open_nursery() as n:
            n.start_soon(gc)
            await trio.to_thread.run_sync(proxy.held.wait)
            await mount_side.touch(key)
            proxy.release()
        assert proxy.forwarded_late == 1
        await gc_side.aclose()
    assert await mount_side.get(key) == data
    await mount_side.aclose()
    return said[0]


async def test_a_delete_carried_out_late_spares_a_copy_touched_meanwhile(s3_server: S3Server) -> None:
    """An overloaded gateway carries gc's DELETE out after a mount touched the copy and committed a
    version naming it: the copy stays (the DELETE is conditional on the ETag gc judged old, and a touch
    changes the ETag), in both of a touch's forms. It was deleted: the save, said done, lost a chunk
    (an audit's find)."""
    bucket = s3_server.make_bucket()
    key, data = "chunks/ab/ab" + "0" * 62, os.urandom(200_000)
    store = S3Store("s0", bucket, "cpfs", endpoint=s3_server.endpoint)
    await store.put(key, data)
    tags = [(await store.stat(key)).tag]
    for _ in range(2):              # the first touch copies as one part, the second in one piece
        assert not await _late_delete_round(s3_server, bucket, key, data)
        tags.append((await store.stat(key)).tag)
    assert len(set(tags)) == 2 and tags[0] == tags[2] and tags[1].endswith('-1"'), tags
    assert await store.delete_if_older(key, time.time() + 3600)      # untouched since: deleted
    assert not await store.exists(key)
    await store.aclose()


async def test_a_server_without_conditional_deletes_gets_unconditional_ones(
        s3_server: S3Server, caplog: pytest.LogCaptureFixture) -> None:
    bucket = s3_server.make_bucket()
    with DelayingProxy(s3_server.endpoint, hold="never", refuse_conditional=True) as proxy:
        store = S3Store("s0", bucket, "cpfs", endpoint=proxy.endpoint)
        for i in range(2):
            await store.put(f"chunks/ab/{i}", b"x")
            assert not await store.delete_if_older(f"chunks/ab/{i}", time.time() - 3600)     # young: kept
            assert await store.delete_if_older(f"chunks/ab/{i}", time.time() + 3600)
            assert not await store.exists(f"chunks/ab/{i}")
        await store.aclose()
    assert sum("refuses conditional deletes" in r.message for r in caplog.records) == 1


async def test_s3_list_pages(s3_server: S3Server) -> None:
    """Pages of `limit` keys, each after the last key of the one before, a short page last."""
    bucket = s3_server.make_bucket()
    store = store_on(s3_server, bucket, "p")
    other = store_on(s3_server, bucket, "p2", name="other")      # a sibling prefix must not leak in
    try:
        keys = sorted(f"chunks/{i % 7:02x}/{i:05d}" for i in range(53))
        for k in keys:
            await store.put(k, k.encode())
        await other.put("chunks/00/zzz", b"not mine")
        await store.put("manifests/m", b"")

        pages, after = [], ""
        while True:
            page = await store.list("chunks/", start_after=after, limit=10)
            pages.append(page)
            if len(page) < 10:
                break
            after = page[-1]
        assert [len(p) for p in pages] == [10, 10, 10, 10, 10, 3]
        assert [k for p in pages for k in p] == keys
        assert await store.list("chunks/", start_after=keys[24], limit=5) == keys[25:30]
        assert await store.list("chunks/", limit=2000) == keys           # more than one S3 page worth
        assert await other.list("") == ["chunks/00/zzz"]
    finally:
        await store.aclose()
        await other.aclose()


async def test_two_buckets_are_two_stores(s3_server: S3Server) -> None:
    """The same key in two buckets: two independent objects."""
    a = store_on(s3_server, s3_server.make_bucket(), name="a")
    b = store_on(s3_server, s3_server.make_bucket(), name="b")
    try:
        await a.put("k", b"in a")
        assert not await b.exists("k")
        await b.put("k", b"in b")
        assert (await a.get("k"), await b.get("k")) == (b"in a", b"in b")
        await a.delete("k")
        assert await b.get("k") == b"in b"
    finally:
        await a.aclose()
        await b.aclose()


# ---- failures: what is permanent, what may pass -----------------------------------------------------------

async def test_missing_bucket_is_a_clear_permanent_error(s3_server: S3Server) -> None:
    store = store_on(s3_server, "no-such-bucket-here", name="gone")
    try:
        with pytest.raises(StoreUnavailable) as e:
            await store.check()
        assert not e.value.transient
        assert "bucket 'no-such-bucket-here' does not exist" in str(e.value) and "gone" in str(e.value)
        for op in (store.get("k"), store.put("k", b"x"), store.list("")):
            with pytest.raises(StoreUnavailable) as e:
                await op
            assert not e.value.transient and "does not exist" in str(e.value)
    finally:
        await store.aclose()


async def test_credentials_from_a_profile_of_the_shared_files(s3_server: S3Server, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No keys in the environment: the store's profile finds them in the shared credentials file; a
    profile that is not there, or no credentials anywhere, is a clear permanent error."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    creds = tmp_path / "credentials"
    creds.write_text("[lab]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    bucket = s3_server.make_bucket()
    lab = store_on(s3_server, bucket, profile="lab", name="lab")
    nope = store_on(s3_server, bucket, profile="nope", name="nope")
    anon = store_on(s3_server, bucket, name="anon")
    try:
        await lab.check()
        await lab.put("k", b"via profile")
        assert await lab.get("k") == b"via profile"
        with pytest.raises(StoreUnavailable) as e:
            await nope.check()
        assert not e.value.transient and "nope" in str(e.value)
        with pytest.raises(StoreDenied) as e:
            await anon.get("k")
        assert "no usable AWS credentials" in str(e.value)
    finally:
        for store in (lab, nope, anon):
            await store.aclose()


def test_cli_names_a_missing_bucket(s3_server: S3Server, tmp_path: Path) -> None:
    """A config naming a bucket that does not exist: one line naming the store and the bucket."""
    config = tmp_path / "cpfs.toml"
    config.write_text('replicas = 1\n[[store]]\nname = "b0"\nurl = "s3://no-such-bucket/ckpt"\n'
                      f'endpoint = "{s3_server.endpoint}"\n')
    r = cpfs("ls", config=config, check=False, text=True)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'b0'" in r.stderr and "bucket 'no-such-bucket' does not exist" in r.stderr, r.stderr


async def test_unreachable_endpoint_is_transient(s3_server: S3Server) -> None:
    """Nothing listens on the port: StoreUnavailable, transient (the server may come back)."""
    store = S3Store("down", "bucket", endpoint=f"http://127.0.0.1:{closed_port()}")
    try:
        for op in (store.check(), store.get("k"), store.put("k", b"x"), store.head("k")):
            with pytest.raises(StoreUnavailable) as e:
                await op
            assert e.value.transient and "cannot reach" in str(e.value)
    finally:
        await store.aclose()


@pytest.mark.parametrize("status, code, error, transient", [
    (503, "SlowDown", StoreError, True),
    (503, "ServiceUnavailable", StoreError, True),
    (500, "InternalError", StoreError, True),
    (502, "BadGateway", StoreError, True),
    (504, "GatewayTimeout", StoreError, True),
    (429, "TooManyRequests", StoreError, True),
    (400, "RequestTimeout", StoreError, True),
    (403, "AccessDenied", StoreDenied, False),
    (403, "InvalidAccessKeyId", StoreDenied, False),
    (403, "QuotaExceeded", StoreFull, False),                 # Ceph RGW's quota answer
    (400, "EntityTooLarge", StoreFull, False),
    (507, "XMinioStorageFull", StoreFull, False),
    (400, "InvalidArgument", StoreError, False),
])
async def test_server_errors_are_classified_and_not_retried(s3_server: S3Server, status: int, code: str,
                                                            error: type[StoreError], transient: bool) -> None:
    """What a misbehaving server answers, classified; s3_server only lends its credentials (environment)."""
    with ErrorEndpoint(status, code) as ep:
        store = S3Store("flaky", "bucket", endpoint=ep.endpoint)
        try:
            for op in (store.get("k"), store.put("k", b"data"), store.list("")):
                with pytest.raises(StoreError) as e:
                    await op
                assert type(e.value) is error and e.value.transient is transient, e.value
                assert code in str(e.value)
        finally:
            await store.aclose()
        assert ep.requests == 3          # one attempt each: only the pool retries


async def test_reset_and_silence_are_transient(s3_server: S3Server) -> None:
    with ErrorEndpoint(reset=True) as ep:
        store = S3Store("resets", "bucket", endpoint=ep.endpoint)
        try:
            with pytest.raises(StoreError) as e:
                await store.get("k")
            assert e.value.transient
        finally:
            await store.aclose()
    with ErrorEndpoint(hang=True) as ep:
        store = S3Store("silent", "bucket", endpoint=ep.endpoint, timeout=0.5)   # botocore's read timeout
        try:
            with pytest.raises(StoreError) as e:
                await store.get("k")
            assert e.value.transient
        finally:
            await store.aclose()


# ---- configuration --------------------------------------------------------------------------------------

def _config(tmp_path: Path, store: str, extra_stores: str = "") -> str:
    return f"replicas = 1\n[[store]]\nname = \"b\"\n{store}\n{extra_stores}"


def test_s3_store_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPFS_TEST_PREFIX", "users/ana")
    cfg = parse_config(_config(tmp_path, 'url = "s3://ckpts/$CPFS_TEST_PREFIX/"\nendpoint = "http://rgw:7480/"\n'
                                         'region = "default"\nprofile = "lab"\nconcurrency = 32'),
                       "t.toml", tmp_path)
    s = cfg.stores[0]
    assert s.kind == "s3" and s.path is None and s.concurrency == 32
    assert dict(s.options) == {"bucket": "ckpts", "prefix": "users/ana", "endpoint": "http://rgw:7480",
                               "region": "default", "profile": "lab",
                               "location": "s3://ckpts/users/ana at http://rgw:7480"}
    store = open_store(s)
    assert isinstance(store, S3Store) and store.limiter.total_tokens == 32
    assert "lab" not in repr(store)

    bare = parse_config(_config(tmp_path, 'url = "s3://ckpts"'), "t.toml", tmp_path).stores[0]
    assert dict(bare.options) == {"bucket": "ckpts", "prefix": "", "endpoint": None, "region": None,
                                  "profile": None, "location": "s3://ckpts at AWS S3"}

    # Same bucket and prefix twice would be one replica fewer than it says; other prefixes are fine.
    same = 'url = "s3://ckpts/a/"\nendpoint = "http://rgw:7480"\n[[store]]\nname = "c"\nurl = "s3://ckpts/a"\n' \
           'endpoint = "http://rgw:7480"'
    with pytest.raises(ConfigError, match="store 'b'.url: two stores share s3://ckpts/a at http://rgw:7480"):
        parse_config(_config(tmp_path, same), "t.toml", tmp_path)
    other = 'url = "s3://ckpts/a"\n[[store]]\nname = "c"\nurl = "s3://ckpts/b"\n'
    assert len(parse_config(_config(tmp_path, other), "t.toml", tmp_path).stores) == 2
    # Other spellings of one server are one server; a prefix inside another's lists its objects.
    for a, b in (("http://RGW:7480", "http://rgw:7480"), ("http://rgw", "http://rgw:80"),
                 ("https://rgw/", "https://rgw:443")):
        two = f'url = "s3://ckpts/a"\nendpoint = "{a}"\n[[store]]\nname = "c"\nurl = "s3://ckpts/a"\nendpoint = "{b}"'
        with pytest.raises(ConfigError, match="store 'b'.url: two stores share s3://ckpts/a"):
            parse_config(_config(tmp_path, two), "t.toml", tmp_path)
    for a, b in (("s3://ckpts/a", "s3://ckpts/a/b"), ("s3://ckpts", "s3://ckpts/a")):
        nested = f'url = "{a}"\n[[store]]\nname = "c"\nurl = "{b}"'
        with pytest.raises(ConfigError, match="store 'b'.url: .* holds .* \\(store 'c'\\): stores must not nest"):
            parse_config(_config(tmp_path, nested), "t.toml", tmp_path)


@pytest.mark.parametrize("store, key, what", [
    ('url = "s3://"', "url", "not a bucket name"),
    ('url = "s3://x"', "url", "not a bucket name"),
    ('url = "s3://bad bucket/p"', "url", "expected s3://BUCKET"),
    ('url = "s3://key:secret@bucket/p"', "url", "must not hold credentials"),
    ('url = "s3://bucket/a//b"', "url", "empty"),
    ('url = "s3://bucket/a/../b"', "url", "'..'"),
    ('url = "s3://bucket"\nendpoint = "rgw:7480"', "endpoint", "expected http(s)://HOST"),
    ('url = "s3://bucket"\nendpoint = "http://ak:sk@rgw:7480"', "endpoint", "must not hold credentials"),
    ('url = "s3://bucket"\nendpoint = "http://rgw:7480/sub"', "endpoint", "without a path"),
    ('url = "s3://bucket"\nendpoint = "http://rgw:port"', "endpoint", "bad port"),
    ('url = "s3://bucket"\nregion = ""', "region", "must not be empty"),
    ('url = "s3://bucket"\nregion = "us east"', "region", "expected a region"),
    ('url = "s3://bucket"\nprofile = 3', "profile", "expected a string"),
    ('url = "s3://bucket"\naccess_key = "AKIA"', None, "unknown key"),
])
def test_s3_store_key_errors_name_the_store_and_key(tmp_path: Path, store: str, key: str | None, what: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(_config(tmp_path, store), "t.toml", tmp_path)
    msg = str(e.value)
    assert msg.startswith("t.toml: ") and what in msg, msg
    if key:
        assert f"store 'b'.{key}:" in msg, msg
    assert "secret" not in msg and "sk@" not in msg


def test_other_tools_objects_in_a_bucket_are_no_keys_and_gc_runs(s3_server: S3Server, tmp_path: Path) -> None:
    """Objects other tools leave in a bucket: an S3 console's "folder/" markers (for every folder of
    keys) and dotfiles an `aws s3 sync` of a Mac folder uploads. Listings pass them by, so `cpfs gc` runs
    (it refused, naming the marker as an unreadable version) and `cpfs scrub` finds everything whole;
    the file reads as it was written and the markers stay."""
    config, urls = write_s3_config(s3_server, tmp_path / "cfg", "two-buckets")
    src = tmp_path / "f.bin"
    src.write_bytes(bytes(range(256)) * 5000)
    cpfs("put", str(src), "run1/f.bin", config=config)
    client = s3_server.client()
    planted = []
    for url in urls:
        bucket, _, prefix = url[len("s3://"):].partition("/")
        base = prefix + "/" if prefix else ""
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
        folders = {k[:i + 1] for k in keys for i in range(len(k)) if k[i] == "/"}
        for key in sorted(folders) + [base + "manifests/.DS_Store", base + "roster/._roster"]:
            client.put_object(Bucket=bucket, Key=key, Body=b"" if key.endswith("/") else b"not ours")
            planted.append((bucket, key))
        store = open_store(load_config(config).stores[urls.index(url)])
        assert all(not k.endswith("/") and "/." not in "/" + k for k in _listed(store))
    gc = cpfs("gc", "--json", config=config, check=False)
    assert gc.returncode == 0 and json.loads(gc.stdout)["refused"] is None, gc.stdout + gc.stderr
    scrub = cpfs("scrub", config=config, check=False)
    assert scrub.returncode == 0, scrub.stdout + scrub.stderr
    assert cpfs("cat", "run1/f.bin", config=config).stdout == src.read_bytes()
    for bucket, key in planted:
        assert client.head_object(Bucket=bucket, Key=key)["ContentLength"] == (0 if key.endswith("/") else 8)


def _listed(store: S3Store) -> list[str]:
    import trio

    async def listing() -> list[str]:
        try:
            return await store.list("") + await store.list("manifests/") + await store.list("roster/")
        finally:
            await store.aclose()
    return trio.run(listing)


# ---- end to end: the CLI and a real mount over S3 --------------------------------------------------------

def _state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.weight": torch.randn(512, 512, generator=g) for i in range(4)}
    sd["embed"] = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    sd["step"] = torch.tensor(7)
    return sd


@pytest.fixture(params=S3_LAYOUTS)
def s3_config(request: pytest.FixtureRequest, s3_server: S3Server, tmp_path: Path) -> tuple[Path, list[str]]:
    """Two replicas: on two buckets (one with a prefix), or on a folder and a bucket."""
    return write_s3_config(s3_server, tmp_path / "cfg", request.param)


@pytest.mark.long
@pytest.mark.mount
def test_put_cat_and_mount_over_s3(s3_config: tuple[Path, list[str]], s3_server: S3Server, tmp_path: Path,
                                   mount) -> None:
    """`cpfs put` a torch checkpoint, `cpfs cat` gives its bytes, torch.load through a mount gives its
    tensors, torch.save through the mount stores a new one; the daemon and the CLI find the credentials
    in their environment (set by the s3_server fixture)."""
    config, urls = s3_config
    src = tmp_path / "step_7.pt"
    sd = _state_dict(7)
    torch.save(sd, src)
    cpfs("put", str(src), "run1/step_7.pt", config=config)
    for url in urls:               # every bucket holds a replica of every chunk, and the manifest
        bucket, _, prefix = url[len("s3://"):].partition("/")
        keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
        base = prefix + "/" if prefix else ""
        assert all(k.startswith(base) for k in keys), keys
        assert sum(k.startswith(base + "chunks/") for k in keys) >= src.stat().st_size // 2**20, keys
        assert any(k.startswith(base + "manifests/") for k in keys), keys
    assert cpfs("cat", "run1/step_7.pt", config=config).stdout == src.read_bytes()

    m = mount(config)
    mounted = m.path / "run1" / "step_7.pt"
    assert mounted.read_bytes() == src.read_bytes()
    loaded = torch.load(mounted, weights_only=True)
    assert loaded.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k

    # A save through the mount lands in the buckets: another process reads it back with the CLI.
    sd8 = _state_dict(8)
    torch.save(sd8, m.path / "run1" / "step_8.pt")
    out = tmp_path / "step_8.pt"
    out.write_bytes(cpfs("cat", "run1/step_8.pt", config=config).stdout)
    loaded8 = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded8[k], v) for k, v in sd8.items())

    # The other commands on the same mix of stores.
    assert {"step_7.pt", "step_8.pt"} <= set(cpfs("ls", "run1", config=config, text=True).stdout.split())
    doc = json.loads(cpfs("inspect", "run1/step_7.pt", "--json", config=config).stdout)
    assert doc["size"] == src.stat().st_size and len(doc["tensor_index"]["tensors"]) == len(sd)
    cpfs("rm", "run1/step_7.pt", config=config)
    rows = json.loads(cpfs("log", "run1/step_7.pt", "--json", config=config).stdout)
    assert [r["state"] for r in rows] == ["deleted", "ok"]
    cpfs("restore", "run1/step_7.pt", str(rows[1]["version"]), config=config)
    assert cpfs("cat", "run1/step_7.pt", config=config).stdout == src.read_bytes()
