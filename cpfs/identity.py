"""Which deployment each store belongs to: a store URL that points at another deployment's folder or
bucket is refused before anything is listed from it or written to it.

Why. Store names are a config's, and configs are copied: two teams' deployments both call their
stores nvme0-2 (the default). A config whose nvme1 URL pointed at the other team's nvme1 (a typo, a
config copied from the other cluster) took it for its own: listings merged both trees (the other
team's saves of a path became versions of ours, and ours retired theirs), and gc deleted the copies
there that no manifest of ours names. Neither the names nor the roster tell the two apart: both
deployments enroll the same config. Two URLs swapped within one deployment are the same mistake in
small: reads miss where placement says to look, and gc deletes what it finds there.

So each store holds KEY: the deployment's id (random, minted once) and the store's name in it.
Writers (`roster.enroll`: mounts and the CLI's writing commands), the CLI's other commands and gc
read it from every store before anything else:
- a store whose identity names another store, or another deployment than the other stores', is
  refused: a ConfigError naming each store's deployment, and nothing is written;
- a store without one (new, or written before identities existed) is given the deployment's, by
  writers only, and only after the roster's checks passed (a blank store is refused first);
- when no store holds one, a writer mints it, and only while every store answers: on the first store
  by name, created only if absent (`Store.put_new`: a hard link on a folder, a conditional PUT on
  S3), then read back, so that mounts starting together on new stores all take the one that landed.
  A store that was down could hold an older one that the new one would contradict.
Caveats: a store down when a command starts is checked at the next start that reaches it (as for
`roster.blank`). A store whose identity does not parse or match its check is logged and left as it
is, not refused.
Stores of two deployments are merged on purpose by deleting KEY from the stores of one.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

from .errors import MALFORMED, ConfigError, ManifestError, NoSuchObject, StoreError
from .manifest import metadata_check
from .pool import StorePool
from .sync import fan_out

log = logging.getLogger(__name__)

KEY = "identity/store.json"
FORMAT = 1


@dataclass(frozen=True)
class Identity:
    """A store's identity: its deployment's id and its name there."""

    deployment: str
    store: str

    def _fields(self) -> dict[str, object]:
        return {"format": FORMAT, "deployment": self.deployment, "store": self.store}

    def to_bytes(self) -> bytes:
        return json.dumps(self._fields() | {"check": _check(self._fields())}, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> Identity:
        """ManifestError (bad stored metadata) if `data` is not an identity of this format, or does not
        match its check: a flipped bit must not pass for another deployment (a fault drill's corrupt
        read of one refused a mount) but leave the store unchecked (`claim` logs it)."""
        try:
            doc = json.loads(data)
            ok = doc.get("format") == FORMAT and all(isinstance(doc.get(k), str) and doc[k]
                                                     for k in ("deployment", "store"))
            ident = cls(doc["deployment"], doc["store"]) if ok else None
        except MALFORMED:           # json's errors, and bytes that are no UTF-8, are ValueErrors
            ident = None
        if ident is None:
            raise ManifestError(f"{KEY}: not a store identity of format {FORMAT}")
        if doc.get("check") != _check(ident._fields()):
            raise ManifestError(f"{KEY}: does not match its check: a damaged copy")
        return ident


def _check(fields: dict[str, object]) -> str:
    return metadata_check(json.dumps(fields, sort_keys=True).encode())


@dataclass(frozen=True)
class Found:
    """What the stores hold: each store's identity, the stores that answered with none (sorted), and
    the stores whose identity could not be read (why)."""

    held: dict[str, Identity]
    absent: tuple[str, ...]
    unread: dict[str, str]

    @property
    def deployments(self) -> dict[str, list[str]]:
        """Each deployment id the stores hold -> the stores holding it (sorted)."""
        out: dict[str, list[str]] = {}
        for name, ident in sorted(self.held.items()):
            out.setdefault(ident.deployment, []).append(name)
        return out


async def read(pool: StorePool) -> Found:
    """Every store's identity, read at once."""
    held: dict[str, Identity] = {}
    absent: list[str] = []
    unread: dict[str, str] = {}

    async def one(name: str) -> None:
        try:
            held[name] = Identity.parse(await pool.get(name, KEY))
        except NoSuchObject:
            absent.append(name)
        except ManifestError as e:
            unread[name] = str(e)

    out = await fan_out(one, pool.names, catch=StoreError)
    unread |= {name: e.detail for name, e in out.errors}
    return Found(held, tuple(sorted(absent)), unread)


def problem(pool: StorePool, found: Found) -> str:
    """Why these stores must not be used together ("" if they may): see the module doc."""
    c = pool.config
    wrong = [f"store {name!r} ({c.store(name).url}) is store {ident.store!r} of its deployment"
             for name, ident in sorted(found.held.items()) if ident.store != name]
    if len(groups := found.deployments) > 1:
        wrong.append(f"the stores belong to {len(groups)} deployments: " + "; ".join(
            f"{', '.join(map(repr, names))} to {dep}" for dep, names in groups.items()))
    if not wrong:
        return ""
    return (f"{c.source}: {'; '.join(wrong)}. A store URL points at another deployment's folder or bucket, or "
            f"two URLs were swapped: fix the URLs ({KEY} in each store names the store it is); nothing "
            f"was written or deleted")


async def check(pool: StorePool) -> Found:
    """`read`, then ConfigError if the stores must not be used together (`problem`)."""
    found = await read(pool)
    if why := problem(pool, found):
        raise ConfigError(why)
    return found


async def claim(pool: StorePool, found: Found) -> str | None:
    """Give the stores that hold no identity the deployment's, minting it if no store holds one and
    every store answered (see the module doc); `found` passed `check`. Returns the deployment's id
    (None if it has none yet). ConfigError if a store took another deployment's meanwhile. A store
    that fails is logged: it gets its identity at the next start."""
    for name, why in sorted(found.unread.items()):
        log.warning("store %r: its identity (%s) cannot be read, so it is not checked against the other "
                    "stores': %s", name, KEY, why)
    todo = list(found.absent)
    settled = dict(found.held)                  # store -> its identity, known to be the deployment's
    if found.held:
        deployment = next(iter(found.held.values())).deployment
    elif found.unread or not todo:
        return None
    else:
        first = todo.pop(0)
        try:
            await pool.put_new(first, KEY, Identity(uuid.uuid4().hex, first).to_bytes())
            landed = Identity.parse(await pool.get(first, KEY))   # ours, or a writer's that raced us
        except (StoreError, ManifestError) as e:
            log.warning("store %r: could not record the stores' identity (%s): tried again at the next "
                        "start", first, e)
            return None
        settled[first] = landed
        if landed.store != first:
            raise ConfigError(problem(pool, Found(settled, (), {})))
        deployment = landed.deployment
        log.info("stores %s: deployment %s", ", ".join(map(repr, pool.names)), deployment)

    async def one(name: str) -> None:
        mine = Identity(deployment, name)
        settled[name] = (mine if await pool.put_new(name, KEY, mine.to_bytes())
                         else Identity.parse(await pool.get(name, KEY)))

    out = await fan_out(one, todo, catch=(StoreError, ManifestError))
    for name, e in out.errors:
        log.warning("store %r: could not record its identity (%s): tried again at the next start", name, e)
    if why := problem(pool, Found(settled, (), {})):     # a writer of another deployment got there first
        raise ConfigError(why)
    return deployment
