"""Store kinds by URL scheme: `file://` (or a plain path) is a folder, `s3://` a bucket.

A kind is a Store class that also knows its own [[store]] keys: `kind` (its name in StoreConfig),
`option_keys` (keys beyond the common ones), `parse_options(url, raw, ctx)` (validate them; errors via
`ctx.fail(key, what)` name the file, the store and the key) and `from_config(cfg)` (build one).
The common keys (name, url, concurrency, latency, bandwidth, timeout, the fault knobs) are parsed once
for every kind by cpfs.config.

Kinds with heavy dependencies are named as "module:Class" and imported on first use, so a folder-only
setup never imports an S3 client, and a missing one is a ConfigError on the store that needs it.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..errors import ConfigError
from .directory import DirectoryStore

if TYPE_CHECKING:
    from ..config import StoreConfig
    from .base import Store


class StoreKind(Protocol):
    kind: ClassVar[str]
    option_keys: ClassVar[frozenset[str]]

    @classmethod
    def parse_options(cls, url: str, raw: Mapping[str, Any], ctx: OptionContext) -> dict[str, Any]: ...

    @classmethod
    def from_config(cls, cfg: StoreConfig) -> Store: ...


@dataclass(frozen=True)
class OptionContext:
    """What a kind needs to validate its [[store]] table: where errors point, where paths resolve."""

    source: str          # the config file
    store: str           # the store's name
    base: Path           # the config file's folder

    def fail(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"{self.source}: store {self.store!r}.{key}: {what}")

    def convert(self, key: str, parser: Any, value: Any) -> Any:
        """A value through one of cpfs.config's parsers (int, str, bool, parse_size, ...)."""
        from ..config import _convert
        return _convert(self.source, f"store {self.store!r}.{key}", parser, value)

    def expand(self, text: str) -> str:
        """$VAR and ${VAR}; KeyError names an unset variable."""
        from ..config import _expand
        return _expand(text)


SCHEMES: dict[str, str] = {"file": "dir", "s3": "s3"}          # URL scheme -> kind
KINDS: dict[str, type | str] = {"dir": DirectoryStore, "s3": "cpfs.store.s3:S3Store"}


class KindUnavailable(Exception):
    """The kind's module is missing or not ready (an optional dependency absent)."""


def register(kind: str, cls: type | str, schemes: tuple[str, ...] = ()) -> None:
    """Add a kind (a class, or "module:Class" imported on first use) and the schemes that select it."""
    KINDS[kind] = cls
    for scheme in schemes:
        SCHEMES[scheme] = kind


def kind_of(url: str) -> str | None:
    """The kind a URL selects ("dir" for a plain path); None for an unknown scheme."""
    if "://" not in url:
        return "dir"
    return SCHEMES.get(url.split("://", 1)[0].lower())


def load(kind: str) -> StoreKind:
    """The kind's class, imported now if named lazily."""
    entry = KINDS[kind]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise KindUnavailable(f"{module} cannot be imported ({e})") from None
        except AttributeError:
            raise KindUnavailable(f"{module} has no {attr}") from None
        missing = [a for a in ("kind", "option_keys", "parse_options", "from_config") if not hasattr(cls, a)]
        if missing:
            raise KindUnavailable(f"{entry} is not a store kind yet (no {', '.join(missing)})")
        KINDS[kind] = entry = cls
    return entry  # type: ignore[return-value]  # a class following the StoreKind protocol
