"""Where a chunk's replicas go: rendezvous (highest-random-weight) hashing.

Placement is a pure function of the chunk's name and the store list, so the same chunk always lands
on the same stores (dedup needs no global lookup) and the chunks of one file spread evenly over all
stores, which is what lets one reader pull from every store at once. Adding a store moves only the
chunks that now rank it first.
"""
from __future__ import annotations

from collections.abc import Sequence

import blake3


def _score(store: str, digest: str) -> int:
    return int.from_bytes(blake3.blake3(f"{store}\0{digest}".encode()).digest(8), "big")


def place(digest: str, stores: Sequence[str], replicas: int) -> list[str]:
    """The `replicas` stores for `digest`, best first."""
    if replicas > len(stores):
        raise ValueError(f"{replicas} replicas need {replicas} stores, have {len(stores)}")
    return sorted(stores, key=lambda s: _score(s, digest), reverse=True)[:replicas]
