"""Backing stores: the interface, its implementations, and a factory from configuration."""
from __future__ import annotations

import trio

from ..config import StoreConfig
from .base import Store
from .directory import DirectoryStore
from .throttled import ThrottledStore

__all__ = ["Store", "DirectoryStore", "ThrottledStore", "open_store"]


def open_store(cfg: StoreConfig) -> Store:
    """Build the store a [[store]] table describes (wrapped in ThrottledStore if it simulates a link)."""
    assert cfg.kind == "dir" and cfg.path is not None
    store: Store = DirectoryStore(cfg.name, cfg.path, trio.CapacityLimiter(cfg.concurrency))
    if cfg.latency or cfg.bandwidth:
        store = ThrottledStore(store, cfg.latency, cfg.bandwidth)
    return store
