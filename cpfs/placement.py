"""Where a chunk's replicas go: rendezvous (highest-random-weight) hashing.

Placement is a pure function of the chunk's name and the store list, so the same chunk always lands
on the same stores (dedup needs no global lookup) and the chunks of one file spread evenly over all
stores, which is what lets one reader pull from every store at once. Adding a store moves only the
chunks that now rank it first.
"""
from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

import blake3


def _score(store: str, digest: str) -> int:
    return int.from_bytes(blake3.blake3(f"{store}\0{digest}".encode()).digest(8), "big")


def place(digest: str, stores: Sequence[str], replicas: int) -> list[str]:
    """The `replicas` stores for `digest`, best first."""
    if replicas > len(stores):
        raise ValueError(f"{replicas} replicas need {replicas} stores, have {len(stores)}")
    return sorted(stores, key=lambda s: _score(s, digest), reverse=True)[:replicas]


@dataclass(frozen=True)
class Layout:
    """Where one config puts a path's versions: its stores, replicas and write_quorum. A path's versions
    sit where the layout of the config that committed them placed them, until `cpfs scrub --repair`
    copies them to the current placement; the stores' roster (cpfs/roster.py) names every layout its
    writers used, so a listing can tell whether it reached the stores of each."""
    stores: tuple[str, ...]
    replicas: int
    write_quorum: int

    def holders(self, digest: str) -> list[str]:
        return place(digest, self.stores, self.replicas)

    def reached(self, digest: str, missed: Container[str]) -> bool:
        """Whether a listing that the stores `missed` did not answer met every version this layout
        placed: each is on write_quorum of its `replicas` holders, so the listing must reach
        replicas - write_quorum + 1 of them."""
        answered = sum(n not in missed for n in self.holders(digest))
        return answered >= self.replicas - self.write_quorum + 1
