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
    """Where one config puts a path's versions (and chunks): its stores, replicas, write_quorum and
    spares. A path's versions sit where the layout of the config that committed them placed them,
    until `cpfs scrub --repair` copies them to the current placement; the stores' roster
    (cpfs/roster.py) names every layout its writers used, so a listing can tell whether it reached
    the stores of each.
    Spares: a write whose placement holds a store marked down goes to the next store in rendezvous
    order instead (at most `spares` further down), so one store down does not stop saves under the
    default write_quorum (= replicas); listings then must reach more stores (`reached`)."""
    stores: tuple[str, ...]
    replicas: int
    write_quorum: int
    spares: int = 0

    def holders(self, digest: str) -> list[str]:
        """The stores a write of `digest` may go to, best first: its placement, then its spares."""
        return place(digest, self.stores, min(len(self.stores), self.replicas + self.spares))

    def targets(self, digest: str, down: Container[str], refusing: Container[str] = ()) -> list[str]:
        """Where a write of `digest` goes, in rank order: the first `replicas` holders neither marked
        down nor `refusing` writes of late (its placement while they are fine), then, if too few are,
        the refusing ones (a store full for chunks may take a manifest), then the down ones."""
        holders = self.holders(digest)
        chosen = sorted(holders, key=lambda n: 2 * (n in down) + (n in refusing))[:self.replicas]
        return [n for n in holders if n in chosen]

    def needed(self, digest: str) -> int:
        """How many of `holders(digest)` a listing must reach to meet every version this layout
        placed: each landed on write_quorum of them."""
        return len(self.holders(digest)) - self.write_quorum + 1

    def reached(self, digest: str, missed: Container[str]) -> bool:
        """Whether a listing that the stores `missed` did not answer met every version this layout
        placed (`needed`)."""
        return sum(n not in missed for n in self.holders(digest)) >= self.needed(digest)
