"""Configuration: a TOML file whose key names are a contract (tests outside this repo write them).

Every key has a default, every unknown key is an error, and every error names the file and the key,
because a typo in a store list must never silently mean "one replica fewer".
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)

REALPATH_PATIENCE = 2.0     # seconds a folder's real path may take (a hung NFS or FUSE store never answers)
_real: dict[str, Path] = {}

DEFAULT_CONFIG = Path(__file__).with_name("default.toml")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
GC_GRACE_FLOOR = 60.0       # seconds: a shorter gc_grace leaves a commit too little time (cpfs/gc.py)
_NUM = r"\s*([0-9]+(?:\.[0-9]+)?)\s*"


def parse_size(value: Any) -> int:
    """'4MiB' -> 4194304; plain integers are bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '4MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(_NUM + r"([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ValueError(f"expected a size such as '512KiB', '4MiB', '1GiB' or an integer, got {value!r}")


def parse_duration(value: Any) -> float:
    """'5ms' -> 0.005 seconds; plain numbers are seconds (finite: a timeout of inf hung a request for good)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf:
        return float(value)
    if isinstance(value, str):
        m = re.fullmatch(_NUM + r"(us|ms|s|m|h|d)?\s*", value)
        if m:
            return float(m.group(1)) * _TIME_UNITS[m.group(2) or ""]
    raise ValueError(f"expected a duration such as '5ms', '2s', '10m', '1h' or '7d', got {value!r}")


def parse_retention(value: Any) -> float:
    """A duration, or "forever" (math.inf)."""
    if isinstance(value, str) and value.strip() == "forever":
        return math.inf
    try:
        return parse_duration(value)
    except ValueError:
        raise ValueError(f"expected a duration such as '7d' or '12h', or \"forever\", got {value!r}") from None


def parse_rate(value: Any) -> float:
    """'300MiB/s' -> bytes per second."""
    if isinstance(value, str) and value.strip().endswith("/s"):
        return float(parse_size(value.strip()[:-2]))
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ValueError(f"expected a rate such as '300MiB/s', got {value!r}")


def parse_mode(value: Any) -> int:
    """'0600' -> 0o600: permission bits as a string of octal digits. Integers are refused: in TOML
    600 is decimal and 0o600 looks like a mode but is not the documented form."""
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value):
        return int(value, 8)
    raise ValueError(f"expected permission bits as a string of octal digits such as \"0600\", got {value!r}")


def parse_listen(value: Any) -> tuple[str, int]:
    """'127.0.0.1:9464' -> ('127.0.0.1', 9464); '[::1]:9464' for IPv6; a host name is allowed."""
    import ipaddress

    if isinstance(value, str):
        m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:([0-9]{1,5})|([A-Za-z0-9.-]+):([0-9]{1,5})", value.strip())
        if m:
            host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            try:
                ipaddress.ip_address(host)
                ok = True
            except ValueError:       # a host name: RFC 1123 labels, not all digits
                ok = not m.group(1) and all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label)
                                            for label in host.split(".")) and not host.replace(".", "").isdigit()
            if ok and 1 <= int(port) <= 65535:
                return host, int(port)
            if ok:
                raise ValueError(f"port must be between 1 and 65535, got {value!r}")
    raise ValueError(f"expected \"HOST:PORT\" such as \"127.0.0.1:9464\" (\"[::1]:9464\" for IPv6), got {value!r}")


@dataclass(frozen=True)
class FaultConfig:
    """Fault drills of one store (cpfs.store.faulty); all off by default."""

    error_rate: float = 0.0      # fraction of requests failing with a transient error
    corrupt_rate: float = 0.0    # fraction of reads returning altered bytes
    down: bool = False           # every request fails
    hang: bool = False           # every request waits forever
    seed: int | None = None      # repeatable random choices (tests)

    @property
    def active(self) -> bool:
        return bool(self.error_rate or self.corrupt_rate or self.down or self.hang)


@dataclass(frozen=True)
class StoreConfig:
    name: str
    url: str
    kind: str                    # a kind of cpfs.store.registry: "dir", "s3"
    path: Path | None            # the folder, for "dir"
    latency: float = 0.0         # simulated per-request latency, seconds
    bandwidth: float | None = None  # simulated per-store bandwidth, bytes/s
    concurrency: int = 8         # requests in flight to this store
    timeout: float = 30.0        # a request slower than this fails ([store_defaults] timeout)
    file_mode: int = 0o600       # of the files a folder store writes ([store_defaults] file_mode)
    dir_mode: int = 0o700        # of the folders it makes ([store_defaults] dir_mode)
    faults: FaultConfig = FaultConfig()
    options: Mapping[str, Any] = field(default_factory=dict)   # the kind's own keys, parsed by the kind


@dataclass(frozen=True)
class Config:
    source: str
    stores: tuple[StoreConfig, ...]
    replicas: int = 2
    write_quorum: int = 2
    spares: int = 0                 # stores further down the placement that stand in for one marked
                                    # down (cpfs/placement.py: Layout); default 1 if there are more
                                    # stores than replicas and write_quorum = replicas >= 2
    keep_versions: int = 3          # committed versions kept per path (older manifests are retired)
    gc_grace: float = 3600.0        # gc deletes only objects older than this; dedup and renewal touch
                                    # copies a commit counts on once half of it old (cpfs/gc.py)
    keep_removed: float = 7 * 86400.0   # a removed path's history stays this long, then gc purges it
    chunk_size: int = 4 * 1024**2
    compression: str = "lz4"
    cache_memory: int = 1024**3
    cache_buffers: int | None = None  # read buffers kept ready (cpfs/buffers.py); None: cache_memory // 8
    readahead_initial: int = 8 * 1024**2
    readahead_max: int = 256 * 1024**2
    fetch_concurrency: int = 16
    cpu_threads: int = 2
    learn_prefetch: bool = True      # replay what earlier loads read (cpfs/learned.py)
    learn_shared: bool = True        # ... also what other hosts' loads read: recordings kept in the stores
    slice_parts: bool = False        # readers of slices get parts of chunks (cpfs/readahead.py); README
    request_timeout: float = 30.0
    hedge_min: float = 0.01         # a read slower than its store's recent p95, bounded by these two,
    hedge_max: float = 0.5          # also asks the next replica ([store_defaults] hedge_min/max)
    hedges: int = 8                 # hedge requests in flight at most per mount (0: no hedging)
    file_mode: int = 0o600          # files cpfs writes on disk: store objects, staging files
    dir_mode: int = 0o700           # folders cpfs makes: in stores, for staging
    entry_timeout: float = 300.0
    notify_store: bool = True
    read_ahead_kb: int = 1024
    max_tasks: int = 64
    refresh: float = 1.0
    allow_other: bool = False       # [mount] allow_other: other users reach the mount (see default.toml)
    staging: Path | None = None     # None: $XDG_CACHE_HOME/cpfs/staging
    log_level: str = "INFO"
    metrics_listen: tuple[str, int] | None = None   # [metrics] listen: Prometheus figures (cpfs/metrics.py)

    @property
    def ready_buffers(self) -> int:
        """Bytes of read buffers the daemon keeps backed and ready ([cache] buffers, see cpfs/buffers.py)."""
        return self.cache_memory // 8 if self.cache_buffers is None else self.cache_buffers

    def store(self, name: str) -> StoreConfig:
        for s in self.stores:
            if s.name == name:
                return s
        raise KeyError(name)


# key -> (Config field, parser); sections flatten into Config fields.
_TOP = {
    "replicas": ("replicas", int),
    "write_quorum": ("write_quorum", int),
    "spares": ("spares", int),
    "keep_versions": ("keep_versions", int),
    "gc_grace": ("gc_grace", parse_duration),
    "keep_removed": ("keep_removed", parse_retention),
    "chunk_size": ("chunk_size", parse_size),
    "compression": ("compression", str),
    "log_level": ("log_level", str),
}
_SECTIONS = {
    "cache": {"memory": ("cache_memory", parse_size), "buffers": ("cache_buffers", parse_size)},
    "readahead": {
        "initial": ("readahead_initial", parse_size),
        "max": ("readahead_max", parse_size),
        "concurrency": ("fetch_concurrency", int),
        "cpu_threads": ("cpu_threads", int),
        "learn": ("learn_prefetch", bool),
        "learn_shared": ("learn_shared", bool),
        "slice_parts": ("slice_parts", bool),
    },
    "mount": {
        "entry_timeout": ("entry_timeout", parse_duration),
        "notify_store": ("notify_store", bool),
        "read_ahead_kb": ("read_ahead_kb", int),
        "max_tasks": ("max_tasks", int),
        "refresh": ("refresh", parse_duration),
        "allow_other": ("allow_other", bool),
        "staging": ("staging", str),
    },
    "metrics": {"listen": ("metrics_listen", parse_listen)},
    "store_defaults": {
        "timeout": ("request_timeout", parse_duration),
        "hedge_min": ("hedge_min", parse_duration),
        "hedge_max": ("hedge_max", parse_duration),
        "hedges": ("hedges", int),
        "file_mode": ("file_mode", parse_mode),
        "dir_mode": ("dir_mode", parse_mode),
    },
}
# [[store]] keys every kind has; a kind adds its own (cpfs.store.registry).
_STORE_KEYS = {"name", "url", "latency", "bandwidth", "concurrency", "timeout",
               "error_rate", "corrupt_rate", "down", "hang", "fault_seed"}


def _fail(source: str, key: str, what: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {what}")


def _convert(source: str, key: str, parser: Any, value: Any) -> Any:
    if parser is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise _fail(source, key, f"expected an integer, got {value!r}")
    if parser is bool and not isinstance(value, bool):
        raise _fail(source, key, f"expected true or false, got {value!r}")
    if parser is str and not isinstance(value, str):
        raise _fail(source, key, f"expected a string, got {value!r}")
    try:
        return parser(value)
    except ValueError as e:
        raise _fail(source, key, str(e)) from None


def _expand(path: str) -> str:
    """$VAR and ${VAR} from the environment; KeyError names a variable that is not set or empty
    (an empty one turned "$SCRATCH/cpfs" into "/cpfs", and "$STORE" into the config's own folder).
    $XDG_DATA_HOME defaults to ~/.local/share when unset or empty (as the XDG spec says)."""
    env = {k: v for k, v in os.environ.items() if v}
    env.setdefault("XDG_DATA_HOME", str(Path.home() / ".local" / "share"))
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env[m.group(1) or m.group(2)], path)


def real_path(path: Path) -> Path:
    """os.path.realpath, or, if the filesystem does not answer within REALPATH_PATIENCE, the path made
    absolute (logged). realpath stats each component: on a hung store's folder (an NFS server gone,
    a stuck FUSE mount) it waited in the kernel for good, so every mount and `cpfs` command of the
    config hung unkillably before any store timeout applied (an audit's find). Asked of a child
    process, which is left to the kernel if it hangs: a thread of ours stuck there would keep this
    process from exiting (mount.py's launcher never returned). The answer is kept for the process."""
    key = str(path)
    if key not in _real:
        try:
            child = subprocess.Popen([sys.executable, "-I", "-S", "-c", "import os, sys; "
                                      "sys.stdout.write(os.path.realpath(sys.argv[1]))", key],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError:
            return Path(os.path.realpath(key))
        try:
            out, _ = child.communicate(timeout=REALPATH_PATIENCE)
            _real[key] = Path(os.fsdecode(out)) if child.returncode == 0 and out else Path(os.path.abspath(key))
        except subprocess.TimeoutExpired:
            child.kill()            # not waited for: it may be stuck in the kernel until the store answers
            log.warning("%s does not answer (a hung filesystem?): compared by the path as written", key)
            _real[key] = Path(os.path.abspath(key))
    return _real[key]


def overlap(here: Path, there: Path, real: bool = True) -> str | None:
    """How `here` overlaps `there`: 'is', 'is inside' or 'holds'; None if neither holds the other.
    `real`: folders on this machine, compared by their real paths (symlinks, '..' resolved)."""
    a, b = (real_path(here), real_path(there)) if real else (here, there)
    return "is" if a == b else "is inside" if a.is_relative_to(b) else "holds" if b.is_relative_to(a) else None


def _where(s: StoreConfig) -> tuple[str, Path] | None:
    """Where a store's objects live, as (namespace, path): a folder store's folder ("" namespace);
    an object store's bucket and prefix at its endpoint, from its 'location' ("s3://BUCKET/PREFIX at
    ENDPOINT", the endpoint normalised by its kind)."""
    if s.path is not None:
        return "", s.path
    loc = s.options.get("location")
    if loc is None:
        return None
    path, _, space = str(loc).partition(" at ")
    return space, Path("/" + path.partition("://")[2])


def _fraction(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
        return float(value)
    raise ValueError(f"expected a fraction between 0 and 1, got {value!r}")


def _store(source: str, base: Path, i: int, raw: Any, defaults: dict[str, Any]) -> StoreConfig:
    """One [[store]] table: the common keys here, the kind's own keys by the kind (store.registry)."""
    from .store import registry
    where = f"store[{i}]"
    if not isinstance(raw, dict):
        raise _fail(source, where, "each [[store]] must be a table")
    for req in ("name", "url"):
        if not isinstance(raw.get(req), str) or not raw[req]:
            raise _fail(source, f"{where}.{req}", "required, a non-empty string")
    name, url = raw["name"], raw["url"]
    kind = registry.kind_of(url)
    if kind is None:
        known = ", ".join(f"{s}://" for s in registry.SCHEMES)
        raise _fail(source, f"store {name!r}.url", f"unsupported scheme in {url!r} (use {known} or a path)")
    try:
        cls = registry.load(kind)
    except registry.KindUnavailable as e:
        raise _fail(source, f"store {name!r}.url", f"{kind} stores are not supported yet in this "
                                                  f"installation: {e}") from None
    unknown = set(raw) - _STORE_KEYS - cls.option_keys
    if unknown:
        raise _fail(source, f"{where}.{sorted(unknown)[0]}", f"unknown key (for a {kind} store)")
    where = f"store {name!r}"

    def get(key: str, parser: Any, default: Any) -> Any:
        return _convert(source, f"{where}.{key}", parser, raw[key]) if key in raw else default

    latency = get("latency", parse_duration, 0.0)
    bandwidth = get("bandwidth", parse_rate, None)
    concurrency = get("concurrency", int, 8)
    if concurrency < 1:
        raise _fail(source, f"{where}.concurrency", "must be at least 1")
    timeout = get("timeout", parse_duration, defaults.get("request_timeout", Config.request_timeout))
    if timeout <= 0:
        raise _fail(source, f"{where}.timeout" if "timeout" in raw else "store_defaults.timeout",
                    "must be more than 0")
    faults = FaultConfig(error_rate=get("error_rate", _fraction, 0.0), corrupt_rate=get("corrupt_rate", _fraction, 0.0),
                         down=get("down", bool, False), hang=get("hang", bool, False),
                         seed=get("fault_seed", int, None))
    ctx = registry.OptionContext(source=source, store=name, base=base)
    options = cls.parse_options(url, {k: v for k, v in raw.items() if k in cls.option_keys}, ctx)
    return StoreConfig(name=name, url=url, kind=kind, path=options.get("path"), latency=latency,
                       bandwidth=bandwidth, concurrency=concurrency, timeout=timeout,
                       file_mode=defaults.get("file_mode", Config.file_mode),
                       dir_mode=defaults.get("dir_mode", Config.dir_mode), faults=faults, options=options)


def parse_config(text: str, source: str, base: Path) -> Config:
    """Parse TOML text; relative store paths resolve against `base`."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "store":
            continue
        if key in _TOP:
            fld, parser = _TOP[key]
            values[fld] = _convert(source, key, parser, value)
        elif key in _SECTIONS:
            if not isinstance(value, dict):
                raise _fail(source, key, "must be a table")
            for sub, subvalue in value.items():
                if sub not in _SECTIONS[key]:
                    raise _fail(source, f"{key}.{sub}", "unknown key")
                fld, parser = _SECTIONS[key][sub]
                values[fld] = _convert(source, f"{key}.{sub}", parser, subvalue)
        else:
            raise _fail(source, key, "unknown key")
    # cpfs must read and write what it stores, and search the folders it makes.
    for key, need, what in (("file_mode", 0o600, "rw"), ("dir_mode", 0o700, "rwx")):
        if key in values and values[key] & need != need:
            raise _fail(source, f"store_defaults.{key}", f"must give the owner {what} ({need:04o} at least), "
                                                         f"got {values[key]:04o}")
    stores_raw = raw.get("store", [])
    if not isinstance(stores_raw, list) or not stores_raw:
        raise _fail(source, "store", "at least one [[store]] table is required")
    stores = tuple(_store(source, base, i, s, values) for i, s in enumerate(stores_raw))
    names = [s.name for s in stores]
    for name in names:
        if names.count(name) > 1:
            raise _fail(source, f"store {name!r}.name", "duplicate store name")
    # Two stores in one place are one replica fewer than the config says (a symlink to another
    # store's folder: scrub counted 2 good copies of a chunk stored once); one inside another lists
    # and cleans up the other's objects as its own.
    for i, s in enumerate(stores):
        for t in stores[i + 1:]:
            a, b = _where(s), _where(t)
            how = overlap(a[1], b[1], real=not a[0]) if a and b and a[0] == b[0] else None
            if how == "is":
                raise _fail(source, f"store {s.name!r}.url", f"two stores share {'' if a[0] else 'the folder '}"
                                                             f"{s.path or s.options['location']} ({t.name!r} too)")
            if how:
                raise _fail(source, f"store {s.name!r}.url", f"{s.path or s.options['location']} {how} "
                                                             f"{t.path or t.options['location']} (store {t.name!r}): "
                                                             f"stores must not nest")
    replicas = values.get("replicas", 2)
    if replicas < 1:
        raise _fail(source, "replicas", "must be at least 1")
    if replicas > len(stores):
        raise _fail(source, "replicas", f"{replicas} replicas need at least {replicas} stores, "
                                        f"{len(stores)} configured")
    values.setdefault("write_quorum", replicas)
    # A spare keeps saves going with one store down where every copy must land (write_quorum =
    # replicas); below that the quorum does, and a spare would only make listings need more stores
    # (with replicas 1, both the placement store and the spare: one store down would stop commits).
    values.setdefault("spares", min(1, len(stores) - replicas) if values["write_quorum"] == replicas >= 2 else 0)
    if not 0 <= values["spares"] <= len(stores) - replicas:
        raise _fail(source, "spares", f"must be between 0 and the stores beyond replicas ({len(stores) - replicas})")
    if values["spares"] and values["write_quorum"] == 1:
        raise _fail(source, "spares", "must be 0 with write_quorum 1: every listing would need every store a "
                                      "path may sit on, so one store down would stop saves and reads")
    if values.get("hedges", 0) < 0:
        raise _fail(source, "store_defaults.hedges", "must be 0 (no hedged reads) or more")
    if values.get("hedge_min", Config.hedge_min) > values.get("hedge_max", Config.hedge_max):
        raise _fail(source, "store_defaults.hedge_min", "must not exceed store_defaults.hedge_max")
    if values.get("gc_grace", GC_GRACE_FLOOR) < GC_GRACE_FLOOR:
        raise _fail(source, "gc_grace", f"must be at least {GC_GRACE_FLOOR:g}s: mounts renew what a commit "
                                        f"counts on once half of it old (see cpfs gc), got {values['gc_grace']:g}s")
    if values.get("keep_versions", 1) < 1:
        raise _fail(source, "keep_versions", "must be at least 1 (the current version)")
    if not 1 <= values["write_quorum"] <= replicas:
        raise _fail(source, "write_quorum", f"must be between 1 and replicas ({replicas})")
    if values.get("compression", "lz4") not in ("lz4", "none"):
        raise _fail(source, "compression", f"expected 'lz4' or 'none', got {values['compression']!r}")
    chunk_size = values.get("chunk_size", Config.chunk_size)
    if not 64 * 1024 <= chunk_size <= 256 * 1024**2:
        raise _fail(source, "chunk_size", "must be between 64KiB and 256MiB")
    if values.get("cache_memory", Config.cache_memory) < 4 * chunk_size:
        raise _fail(source, "cache.memory", f"must hold at least 4 chunks ({4 * chunk_size} bytes)")
    if values.get("cache_buffers", 0) > values.get("cache_memory", Config.cache_memory) // 2:
        raise _fail(source, "cache.buffers", "must be at most half of cache.memory")
    for key, fld in (("readahead.concurrency", "fetch_concurrency"), ("readahead.cpu_threads", "cpu_threads"),
                     ("mount.max_tasks", "max_tasks")):
        if values.get(fld, 1) < 1:
            raise _fail(source, key, "must be at least 1")
    level = values.get("log_level", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise _fail(source, "log_level", f"expected DEBUG, INFO, WARNING or ERROR, got {level!r}")
    values["log_level"] = level
    if "staging" in values:
        try:
            staging = Path(_expand(values["staging"])).expanduser()
        except KeyError as e:
            raise _fail(source, "mount.staging", f"${e.args[0]} is not set") from None
        values["staging"] = staging if staging.is_absolute() else base / staging
    return Config(source=source, stores=stores, **values)


def staging_dir(config: Config) -> Path:
    """Where files being written are staged: local disk, never memory."""
    if config.staging is not None:
        return config.staging
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "cpfs" / "staging"


def store_set_id(config: Config) -> str:
    """A name for the config's set of stores (their names and where they are), for what a host keeps
    per store set under the staging folder (cpfs/voidjournal.py, cpfs/learned.py)."""
    where = sorted(f"{s.name}\0{real_path(s.path) if s.path is not None else s.url}" for s in config.stores)
    return hashlib.sha256("\n".join(where).encode()).hexdigest()[:24]


def load_config(path: str | os.PathLike | None = None) -> Config:
    """--config, else $CPFS_CONFIG, else the embedded default (stores under $XDG_DATA_HOME/cpfs)."""
    if path is None:
        path = os.environ.get("CPFS_CONFIG") or None
    if path is None:
        return parse_config(DEFAULT_CONFIG.read_text(), f"{DEFAULT_CONFIG} (embedded default)",
                            DEFAULT_CONFIG.parent)
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e.strerror}") from None
    return parse_config(text, str(p), p.resolve().parent)
