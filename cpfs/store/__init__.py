"""Backing stores: the interface, the kinds, the behaviour wrappers, and the stack a [[store]] builds.

    MeteredStore          (added by the pool: counts, and feeds replica ranking)
      FaultyStore         (error_rate, corrupt_rate, down, hang: drills, off by default)
        ThrottledStore    (latency, bandwidth: a simulated remote link, a `Link` several may share)
          DirectoryStore | S3Store     (the kind, chosen by the URL scheme: registry.py)
"""
from __future__ import annotations

from ..config import StoreConfig
from .base import ObjectInfo, Store, StoreWrapper
from .directory import DirectoryStore
from .faulty import FaultStats, FaultyStore
from .metered import MeteredStore, StoreStats
from .registry import load as load_kind
from .throttled import Link, ThrottledStore

__all__ = ["ObjectInfo", "Store", "StoreWrapper", "DirectoryStore", "Link", "ThrottledStore", "FaultyStore",
           "FaultStats", "MeteredStore", "StoreStats", "open_store"]


def open_store(cfg: StoreConfig) -> Store:
    """The stack a [[store]] table describes: its kind, wrapped in the behaviours it asks for."""
    store = load_kind(cfg.kind).from_config(cfg)
    if cfg.latency or cfg.bandwidth:
        store = ThrottledStore(store, cfg.latency, cfg.bandwidth)
    f = cfg.faults
    if f.active:
        store = FaultyStore(store, error_rate=f.error_rate, corrupt_rate=f.corrupt_rate, down=f.down,
                            hang=f.hang, seed=f.seed)
    return store
