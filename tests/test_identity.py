"""Store identities (cpfs/identity.py): a store URL that points at another deployment's folder, or two
swapped URLs, is refused by every command and by the mount before anything is written; stores without
an identity get their deployment's; writers starting together on new stores mint one deployment."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import trio

from cpfs import identity
from cpfs.config import load_config
from cpfs.manifest import path_hash
from cpfs.placement import place
from cpfs.pool import StorePool
from cpfs.store import open_store
from tests.conftest import Mount, cpfs

KEY = identity.KEY


def _config(folder: Path, name: str, urls: Iterable[str], *, down: Iterable[str] = ()) -> Path:
    """A config over folder stores s0, s1, ... at `urls` (relative to `folder`); the stores in `down`
    fail every request (a write returns once one copy is stored)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text('replicas = 2\nchunk_size = "64KiB"\nkeep_versions = 3\n' + ("write_quorum = 1\n" if down else "")
                    + '[cache]\nmemory = "64MiB"\n' + "".join(
        f'[[store]]\nname = "s{i}"\nurl = "{url}"\n' + ("down = true\n" if f"s{i}" in down else "")
        for i, url in enumerate(urls)))
    return path


def _identities(folder: Path, stores: Iterable[str]) -> dict[str, dict]:
    return {s: json.loads((folder / s / KEY).read_bytes()) for s in stores}


def _tree(root: Path) -> dict[str, str]:
    """Every file under root -> its sha256: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _put(cfg: Path, path: str, data: bytes, tmp_path: Path, check: bool = True):
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    return cpfs("put", str(src), path, config=cfg, check=check)


def test_new_stores_get_one_deployment_each_under_its_own_name(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "c.toml", ["stores/s0", "stores/s1", "stores/s2"])
    _put(cfg, "/ck.pt", os.urandom(100_000), tmp_path)
    ids = _identities(tmp_path / "stores", ["s0", "s1", "s2"])
    assert {i["store"]: i["deployment"] for i in ids.values()}.keys() == {"s0", "s1", "s2"}
    assert len({i["deployment"] for i in ids.values()}) == 1
    before = _tree(tmp_path / "stores")
    _put(cfg, "/other.pt", os.urandom(1000), tmp_path)                  # minted once, not again
    assert _identities(tmp_path / "stores", ["s0", "s1", "s2"]) == ids
    assert all(before[f"{s}/{KEY}"] == _tree(tmp_path / "stores")[f"{s}/{KEY}"] for s in ("s0", "s1", "s2"))


def test_a_store_url_into_another_deployments_folder_is_refused_and_changes_nothing(tmp_path: Path, mount) -> None:
    """Teams A and B both call their stores s0-s2. B's config gets s1's URL wrong: A's s1. Every
    command and the mount refuse, naming the store, and A's stores stay byte for byte as they were. It
    was taken for B's own: B's put wrote a version of A's path there, and B's gc deleted A's copies
    there that only manifests on A's other stores name (the config audit's find)."""
    a = _config(tmp_path / "a", "a.toml", ["stores/s0", "stores/s1", "stores/s2"])
    b = _config(tmp_path / "b", "b.toml", ["stores/s0", "stores/s1", "stores/s2"])
    saved = [os.urandom(300_000) for _ in range(2)]
    for data in saved:
        _put(a, "/run/ck.pt", data, tmp_path)
    _put(b, "/run/ck.pt", os.urandom(300_000), tmp_path)
    typo = _config(tmp_path / "b", "typo.toml", ["stores/s0", str(tmp_path / "a" / "stores" / "s1"), "stores/s2"])
    before = _tree(tmp_path / "a" / "stores")

    attempts = [_put(typo, "/run/ck.pt", os.urandom(300_000), tmp_path, check=False),
                cpfs("gc", config=typo, check=False),
                cpfs("ls", "/run", config=typo, check=False),
                cpfs("scrub", "--repair", config=typo, check=False)]
    m = Mount(typo, tmp_path / "mnt", tmp_path / "mnt.log")
    try:
        attempts.append(m.start())
        assert not os.path.ismount(m.path)
    finally:
        m.stop()
    for r in attempts:
        err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode()
        assert r.returncode != 0, err
        assert "the stores belong to 2 deployments" in err and "another deployment's folder" in err, err
        assert str(typo) in err
    assert _tree(tmp_path / "a" / "stores") == before
    assert cpfs("cat", "/run/ck.pt", config=a).stdout == saved[-1]
    assert [v["version"] for v in json.loads(cpfs("log", "/run/ck.pt", "--json", config=a).stdout)] == [2, 1]
    assert cpfs("scrub", config=a).returncode == 0


def test_swapped_urls_are_refused(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "c.toml", ["stores/s0", "stores/s1", "stores/s2"])
    _put(cfg, "/ck.pt", os.urandom(100_000), tmp_path)
    swapped = _config(tmp_path, "swapped.toml", ["stores/s0", "stores/s2", "stores/s1"])
    before = _tree(tmp_path / "stores")
    r = _put(swapped, "/ck2.pt", os.urandom(100_000), tmp_path, check=False)
    assert r.returncode != 0
    assert b"store 's1' (stores/s2) is store 's2' of its deployment" in r.stderr, r.stderr
    assert b"store 's2' (stores/s1) is store 's1' of its deployment" in r.stderr
    assert _tree(tmp_path / "stores") == before


def test_stores_without_an_identity_get_their_deployments(tmp_path: Path) -> None:
    """Stores written before identities existed get one at the next writer's start; a store that
    joins later gets the deployment's, not a new one."""
    cfg = _config(tmp_path, "c.toml", ["stores/s0", "stores/s1", "stores/s2"])
    _put(cfg, "/ck.pt", os.urandom(100_000), tmp_path)
    for s in ("s0", "s1", "s2"):
        (tmp_path / "stores" / s / KEY).unlink()
    assert cpfs("ls", "/", config=cfg).returncode == 0                 # a reader writes none
    assert not any((tmp_path / "stores" / s / KEY).exists() for s in ("s0", "s1", "s2"))
    _put(cfg, "/ck2.pt", os.urandom(1000), tmp_path)
    (deployment,) = {i["deployment"] for i in _identities(tmp_path / "stores", ["s0", "s1", "s2"]).values()}
    more = _config(tmp_path, "more.toml", ["stores/s0", "stores/s1", "stores/s2", "stores/s3"])
    _put(more, "/ck3.pt", os.urandom(1000), tmp_path)
    s3 = _identities(tmp_path / "stores", ["s3"])["s3"]
    assert (s3["deployment"], s3["store"]) == (deployment, "s3")


def test_no_deployment_is_minted_while_a_store_is_down(tmp_path: Path) -> None:
    """A store that was down may hold an identity: a new one minted meanwhile would contradict it."""
    up = _config(tmp_path, "up.toml", ["stores/s0", "stores/s1", "stores/s2"])
    _put(up, "/ck.pt", os.urandom(100_000), tmp_path)
    for s in ("s0", "s1", "s2"):                       # stores written before identities existed
        (tmp_path / "stores" / s / KEY).unlink()
    down = _config(tmp_path, "down.toml", ["stores/s0", "stores/s1", "stores/s2"], down=["s2"])
    path = next(p for i in range(100) if "s2" not in place(path_hash(p := f"/ck{i}.pt"), ["s0", "s1", "s2"], 2))
    _put(down, path, os.urandom(100_000), tmp_path)             # its versions are listed where s2 is not
    assert not list((tmp_path / "stores").glob(f"*/{KEY}"))
    _put(up, "/ck3.pt", os.urandom(1000), tmp_path)
    assert len({i["deployment"] for i in _identities(tmp_path / "stores", ["s0", "s1", "s2"]).values()}) == 1


def test_an_identity_that_does_not_parse_or_match_its_check_is_logged_and_left(tmp_path: Path) -> None:
    """A damaged identity leaves its store unchecked, not refused: a bit flipped in the id passed for
    another deployment's and refused the mount (a fault drill's corrupt read)."""
    cfg = _config(tmp_path, "c.toml", ["stores/s0", "stores/s1", "stores/s2"])
    _put(cfg, "/ck.pt", os.urandom(100_000), tmp_path)
    good = (tmp_path / "stores" / "s1" / KEY).read_bytes()
    deployment = json.loads(good)["deployment"]
    flipped = good.replace(deployment.encode(), deployment[:-1].encode() + (b"0" if deployment[-1] != "0" else b"1"))
    for damaged, why in [(b"\xff not json", b"not a store identity"), (flipped, b"does not match its check")]:
        (tmp_path / "stores" / "s1" / KEY).write_bytes(damaged)
        r = _put(cfg, "/ck2.pt", os.urandom(1000), tmp_path)
        assert b"store 's1': its identity" in r.stderr and why in r.stderr, r.stderr
        assert (tmp_path / "stores" / "s1" / KEY).read_bytes() == damaged
        assert cpfs("cat", "/ck2.pt", config=cfg).returncode == 0


async def test_writers_starting_together_on_new_stores_mint_one_deployment(tmp_path: Path) -> None:
    """Four writers read the new stores (no identity anywhere), then all claim them at once: each
    mints one, one lands on the first store (`put_new`), and all take that one for every store."""
    cfg = _config(tmp_path, "c.toml", ["stores/s0", "stores/s1", "stores/s2"])
    config = load_config(cfg)
    pools = [StorePool(config, stores=[open_store(s) for s in config.stores]) for _ in range(4)]
    found = [await identity.read(p) for p in pools]
    assert all(f.absent == ("s0", "s1", "s2") and not f.held for f in found)
    got: list[str | None] = []

    async def claim(pool: StorePool, f: identity.Found) -> None:
        got.append(await identity.claim(pool, f))

    async with trio.open_nursery() as n:
        for p, f in zip(pools, found):
            n.start_soon(claim, p, f)
    assert len(set(got)) == 1 and got[0]
    assert {i["deployment"] for i in _identities(tmp_path / "stores", ["s0", "s1", "s2"]).values()} == {got[0]}
    assert not identity.problem(pools[0], await identity.read(pools[0]))
    for p in pools:
        await p.aclose()
