"""Configuration: key names and defaults, sizes, store URLs, where the tools find their config, and
every bad configuration failing with one line, exit status 2, and nothing touched."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpfs, write_config
from cpfs.config import DEFAULT_CONFIG, load_config, parse_config, parse_size
from cpfs.errors import ConfigError

STORES = '[[store]]\nname = "a"\nurl = "a"\n[[store]]\nname = "b"\nurl = "b"\n'


def _parse(text: str, base: Path = Path("/cfg")):
    return parse_config(text, "/cfg/cpfs.toml", base)


# ---- keys, defaults, sizes ------------------------------------------------------------------------------

def test_defaults() -> None:
    """Only [[store]] tables are required; the documented defaults apply to everything else."""
    cfg = _parse(STORES)
    assert (cfg.replicas, cfg.chunk_size, cfg.compression, cfg.cache_memory) == (2, 4 * 1024**2, "lz4", 1024**3)
    assert cfg.write_quorum == 2
    assert cfg.ready_buffers == 128 * 1024**2                    # [cache] buffers: memory / 8
    assert _parse('[cache]\nmemory = "2GiB"\nbuffers = "0"\n' + STORES).ready_buffers == 0
    assert [(s.name, s.path, s.kind) for s in cfg.stores] == [("a", Path("/cfg/a"), "dir"),
                                                              ("b", Path("/cfg/b"), "dir")]


def test_documented_keys() -> None:
    """The contract key names: replicas, chunk_size, compression, [cache] memory, [[store]] name/url."""
    cfg = _parse('replicas = 1\nchunk_size = "512KiB"\ncompression = "none"\n[cache]\nmemory = "3GiB"\n'
                 + STORES)
    assert (cfg.replicas, cfg.chunk_size, cfg.compression, cfg.cache_memory) == (1, 512 * 1024, "none",
                                                                                 3 * 1024**3)
    assert _parse("chunk_size = 1048576\n" + STORES).chunk_size == 1024**2


@pytest.mark.parametrize("text, value", [
    ("512KiB", 512 * 1024), ("4MiB", 4 * 1024**2), ("1GiB", 1024**3), ("2 MiB", 2 * 1024**2),
    ("4mib", 4 * 1024**2), ("64k", 64 * 1024), ("1MB", 10**6), ("100", 100), ("1.5KiB", 1536),
])
def test_parse_size(text: str, value: int) -> None:
    """Sizes take binary and decimal units, any case, or plain byte counts."""
    assert parse_size(text) == value
    assert parse_size(value) == value


@pytest.mark.parametrize("bad", ["4XB", "-1", "", "MiB", "4 MiBs", "1e6", True, -5, 4.5, None, [4]])
def test_parse_size_refuses(bad) -> None:
    """Anything that is not a size raises ValueError saying what a size looks like."""
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_embedded_default_config() -> None:
    """The embedded default.toml is valid: three stores under $XDG_DATA_HOME/cpfs, the documented values."""
    cfg = parse_config(DEFAULT_CONFIG.read_text(), "default", DEFAULT_CONFIG.parent)
    assert (cfg.replicas, cfg.chunk_size, cfg.compression, cfg.cache_memory) == (2, 4 * 1024**2, "lz4", 1024**3)
    assert [s.name for s in cfg.stores] == ["nvme0", "nvme1", "nvme2"]


# ---- store URLs -----------------------------------------------------------------------------------------

def test_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """file:///abs, absolute and relative paths (against the config's folder), ~ and $VARS all resolve."""
    monkeypatch.setenv("CPFS_TEST_ROOT", str(tmp_path / "env"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = parse_config(
        f'replicas = 1\n'
        f'[[store]]\nname = "f"\nurl = "file://{tmp_path}/f"\n'
        f'[[store]]\nname = "abs"\nurl = "{tmp_path}/abs"\n'
        f'[[store]]\nname = "rel"\nurl = "sub/rel"\n'
        f'[[store]]\nname = "up"\nurl = "../up"\n'
        f'[[store]]\nname = "home"\nurl = "~/h"\n'
        f'[[store]]\nname = "var"\nurl = "${{CPFS_TEST_ROOT}}/v"\n'
        f'[[store]]\nname = "var2"\nurl = "$CPFS_TEST_ROOT/v2"\n',
        "x.toml", tmp_path / "cfgdir")
    assert {s.name: s.path for s in cfg.stores} == {
        "f": tmp_path / "f", "abs": tmp_path / "abs", "rel": tmp_path / "cfgdir" / "sub" / "rel",
        "up": tmp_path / "cfgdir" / ".." / "up", "home": tmp_path / "home" / "h",
        "var": tmp_path / "env" / "v", "var2": tmp_path / "env" / "v2"}


def test_xdg_data_home_unset_or_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without $XDG_DATA_HOME, or with it empty, the default stores go under ~/.local/share/cpfs."""
    monkeypatch.delenv("CPFS_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("XDG_DATA_HOME", raising=False)
        else:
            monkeypatch.setenv("XDG_DATA_HOME", value)
        cfg = load_config()
        assert [s.path for s in cfg.stores] == [tmp_path / ".local/share/cpfs" / f"nvme{i}" for i in range(3)]
        assert "embedded default" in cfg.source


# ---- bad configurations, parsed -------------------------------------------------------------------------

BAD = {
    # name: (config text, key named in the message, what is wrong)
    "unknown-key": ('replica = 2\n' + STORES, "replica", "unknown key"),
    "unknown-section-key": ('[cache]\nmemroy = "1GiB"\n' + STORES, "cache.memroy", "unknown key"),
    "unknown-section": ('[caches]\nmemory = "1GiB"\n' + STORES, "caches", "unknown key"),
    "unknown-store-key": (STORES + 'path = "/x"\n', "store[1].path", "unknown key"),
    "bad-size": ('chunk_size = "4XB"\n' + STORES, "chunk_size", "expected a size"),
    "bad-size-type": ('chunk_size = 4.5\n' + STORES, "chunk_size", "expected a size"),
    "bad-cache-size": ('[cache]\nmemory = "lots"\n' + STORES, "cache.memory", "expected a size"),
    "tiny-chunks": ('chunk_size = "1KiB"\n' + STORES, "chunk_size", "between 64KiB and 256MiB"),
    "small-cache": ('[cache]\nmemory = "8MiB"\n' + STORES, "cache.memory", "at least 4 chunks"),
    "big-buffers": ('[cache]\nbuffers = "600MiB"\n' + STORES, "cache.buffers", "at most half of cache.memory"),
    "duplicate-store": (STORES + '[[store]]\nname = "a"\nurl = "c"\n', "store 'a'.name", "duplicate store name"),
    "same-folder": (STORES + '[[store]]\nname = "c"\nurl = "a/"\n', "store 'a'.url", "share the folder"),
    "same-folder-dotdot": (STORES + '[[store]]\nname = "c"\nurl = "x/../a"\n', "store 'a'.url", "share the folder"),
    "nested-folders": (STORES + '[[store]]\nname = "c"\nurl = "a/inner"\n', "store 'a'.url",
                       "holds /cfg/a/inner (store 'c'): stores must not nest"),
    "infinite-timeout": ('[store_defaults]\ntimeout = inf\n' + STORES, "store_defaults.timeout",
                         "expected a duration"),
    "too-many-replicas": ('replicas = 3\n' + STORES, "replicas", "3 replicas need at least 3 stores, 2 configured"),
    "zero-replicas": ('replicas = 0\n' + STORES, "replicas", "at least 1"),
    "replicas-string": ('replicas = "2"\n' + STORES, "replicas", "expected an integer"),
    "compression": ('compression = "zstd"\n' + STORES, "compression", "expected 'lz4' or 'none'"),
    "s3": ('replicas = 1\n[[store]]\nname = "s"\nurl = "s3://bucket/prefix"\nendpoint = "rgw:7480"\n',
           "store 's'.endpoint", "expected http(s)://HOST"),
    "scheme": ('replicas = 1\n[[store]]\nname = "h"\nurl = "http://x/y"\n', "store 'h'.url", "unsupported scheme"),
    "file-relative": ('replicas = 1\n[[store]]\nname = "f"\nurl = "file://rel/x"\n', "store 'f'.url", "absolute"),
    "unset-var": ('replicas = 1\n[[store]]\nname = "v"\nurl = "$CPFS_NO_SUCH_VAR/x"\n', "store 'v'.url",
                  "$CPFS_NO_SUCH_VAR is not set"),
    "no-stores": ('replicas = 1\n', "store", "at least one [[store]]"),
    "store-no-url": ('replicas = 1\n[[store]]\nname = "a"\n', "store[0].url", "required"),
    "store-no-name": ('replicas = 1\n[[store]]\nurl = "a"\n', "store[0].name", "required"),
    "not-toml": ('replicas = = 2\n' + STORES, "not valid TOML", ""),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_parse(name: str) -> None:
    """Every bad configuration raises ConfigError 'FILE: KEY: what is wrong' on one line."""
    text, key, what = BAD[name]
    with pytest.raises(ConfigError) as e:
        _parse(text)
    msg = str(e.value)
    assert msg.startswith(f"/cfg/cpfs.toml: {key}") and what in msg and "\n" not in msg, msg


def test_two_spellings_of_one_folder_are_one_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose folder is a symlink to another's is the same store: refused, else "2 replicas"
    were one copy (an audit saw scrub count 2 good copies of a chunk stored once, and lost it with
    that one file). A url made of an empty variable is refused like an unset one."""
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(ConfigError, match="store 'a'.url: two stores share the folder"):
        parse_config(STORES.replace('url = "b"', 'url = "link"'), "t.toml", tmp_path)
    monkeypatch.setenv("CPFS_TEST_EMPTY", "")
    with pytest.raises(ConfigError, match=r"store 'b'.url: \$CPFS_TEST_EMPTY is not set"):
        parse_config(STORES.replace('url = "b"', 'url = "$CPFS_TEST_EMPTY/b"'), "t.toml", tmp_path)


# ---- the tools: where the config comes from, and how a bad one fails ------------------------------------

def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


CLI_BAD = ["unknown-key", "bad-size", "duplicate-store", "too-many-replicas", "s3", "unset-var"]


@pytest.mark.parametrize("name", CLI_BAD)
def test_bad_config_cli(tmp_path: Path, name: str) -> None:
    """`cpfs put` with a bad config prints one line naming the file, the key and the problem, exits 2,
    and creates or changes nothing."""
    text, key, what = BAD[name]
    cfg = tmp_path / "cfg" / "cpfs.toml"
    cfg.parent.mkdir()
    cfg.write_text(text)
    (tmp_path / "data.bin").write_bytes(os.urandom(100_000))
    before = _tree(tmp_path)
    r = cpfs("put", str(tmp_path / "data.bin"), "/d.bin", config=cfg, check=False, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"cpfs: config error: {cfg}: {key}: ") and what in r.stderr, r.stderr
    assert _tree(tmp_path) == before


def test_unreachable_store_cli(tmp_path: Path) -> None:
    """A store whose folder cannot exist (a file is in the way) fails every tool with exit 2 and one line
    naming the file, the store and why, before any other store is touched."""
    cfg = write_config(tmp_path / "cfg", stores=3)
    (tmp_path / "cfg" / "blocker").write_bytes(b"not a folder")
    cfg.write_text(cfg.read_text().replace('url = "stores/s1"', 'url = "blocker/s1"'))
    (tmp_path / "data.bin").write_bytes(os.urandom(100_000))
    before = _tree(tmp_path)
    for args in (["put", str(tmp_path / "data.bin"), "/d.bin"], ["ls"], ["cat", "/d.bin"]):
        r = cpfs(*args, config=cfg, check=False, text=True)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"cpfs: config error: {cfg}: store 's1'.url: "), r.stderr
        assert "blocker" in r.stderr and "not a directory" in r.stderr
        assert _tree(tmp_path) == before     # no stores/ folder, no chunks on s0 or s2


def test_missing_config_file(tmp_path: Path) -> None:
    """--config naming a missing file is a config error (exit 2) naming the file."""
    r = cpfs("ls", config=tmp_path / "nope.toml", check=False, text=True)
    assert r.returncode == 2 and f"{tmp_path / 'nope.toml'}: cannot read config" in r.stderr


def _env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def test_default_config_under_xdg_data_home(tmp_path: Path) -> None:
    """Without --config or $CPFS_CONFIG, put/ls/cat use the embedded default: stores under
    $XDG_DATA_HOME/cpfs, replicas 2."""
    env = _env(CPFS_CONFIG=None, XDG_DATA_HOME=str(tmp_path / "xdg"))
    data = os.urandom(300_000)
    (tmp_path / "f.bin").write_bytes(data)
    r = cpfs("put", str(tmp_path / "f.bin"), "/d/f.bin", env=env, text=True)
    assert "over 2 replicas" in r.stdout
    stores = {p.name for p in (tmp_path / "xdg" / "cpfs").iterdir()}
    assert len(stores) >= 2 and stores <= {"nvme0", "nvme1", "nvme2"}   # folders appear on first write
    chunk_files = list((tmp_path / "xdg" / "cpfs").glob("nvme*/chunks/*/*"))
    assert len(chunk_files) == 2          # one 300 kB chunk, two replicas
    assert cpfs("cat", "/d/f.bin", env=env).stdout == data
    assert "f.bin" in cpfs("ls", "/d", env=env, text=True).stdout


def test_cpfs_config_env_and_precedence(tmp_path: Path) -> None:
    """$CPFS_CONFIG is used without --config; --config wins over it. Relative store URLs resolve against
    the config file's folder, not the working directory."""
    good = write_config(tmp_path / "good", stores=2)
    bad = tmp_path / "bad.toml"
    bad.write_text("nonsense = 1\n")
    (tmp_path / "f.bin").write_bytes(b"hello" * 1000)
    env = _env(CPFS_CONFIG=str(good), XDG_DATA_HOME=str(tmp_path / "xdg"))
    cpfs("put", str(tmp_path / "f.bin"), "/f.bin", env=env)
    assert sorted(p.name for p in (tmp_path / "good" / "stores").iterdir()) == ["s0", "s1"]
    assert not (tmp_path / "xdg").exists()
    env_bad = _env(CPFS_CONFIG=str(bad))
    r = cpfs("cat", "/f.bin", env=env_bad, check=False, text=True)
    assert r.returncode == 2 and f"{bad}: nonsense: unknown key" in r.stderr
    assert cpfs("cat", "/f.bin", config=good, env=env_bad).stdout == b"hello" * 1000
    # The same config, named relative to another working directory, finds the same stores.
    r = subprocess.run([sys.executable, "-m", "cpfs.cli", "--config", "good/cpfs.toml", "cat", "/f.bin"],
                       capture_output=True, check=True, cwd=tmp_path, env=env_bad)
    assert r.stdout == b"hello" * 1000
