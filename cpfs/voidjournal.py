"""Twins and void markers that no store took yet, kept on local disk until one does.

A failed commit whose copy may remain on a store is voided by a key its writer puts on the stores
(cpfs/catalog.py: a failed version's twin, a transaction's void marker). When no store takes that key
either, the copy counts on every mount until one does, and the writer tries again before its next
commit. Kept only in memory, that duty died with the writer: after a crash or an unmount, the save
that its writer had been told failed stayed current for good. So each such key is also a file here,
written before the commit reports its failure and removed once a store took the key. A catalog over
the same stores, in any later process, starts with them pending (`pending`); the daemon tries them
before its first listing, and then every so often, with those other processes on the host left
(`Catalog.keep_voiding`).

One folder per store set (`for_config`: the stores' names and where they are), under the staging
folder, which is local and outside every store (cpfs/daemon.py checks it). Several processes may
share it: a put of a key that a store already holds changes nothing, and whoever succeeds first
removes the file.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import trio

from .config import Config, staging_dir, store_set_id
from .store.directory import reap_temporaries, write_durably

log = logging.getLogger(__name__)
SUFFIX = ".void"


class VoidJournal:
    """The pending keys of one store set; `folder` None keeps them in memory only (tools, tests)."""

    def __init__(self, folder: Path | None, file_mode: int = 0o600, dir_mode: int = 0o700) -> None:
        self.folder = folder
        self._file_mode, self._dir_mode = file_mode, dir_mode
        self._limiter = trio.CapacityLimiter(1)     # a few small files, seldom: one at a time
        self._reported: set[Path] = set()           # unreadable files already logged (a mount reads every 10 s)

    @classmethod
    def for_config(cls, config: Config) -> "VoidJournal":
        return cls(staging_dir(config) / "unvoided" / store_set_id(config), config.file_mode, config.dir_mode)

    def _file(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / (hashlib.sha256(key.encode()).hexdigest()[:32] + SUFFIX)

    def pending(self) -> dict[str, bytes]:
        """Every key written and not yet removed, with its bytes. Blocking (at startup). A file that
        cannot be read is logged and skipped, never removed: it is the only record of its duty. Old
        temporary files (a process killed while writing a key) go."""
        out: dict[str, bytes] = {}
        if self.folder is None or not self.folder.is_dir():
            return out
        reap_temporaries(self.folder)
        for f in sorted(self.folder.glob("*" + SUFFIX)):
            try:
                key, sep, data = f.read_bytes().partition(b"\n")
                if not sep or self._file(key.decode()) != f:
                    raise ValueError("not a key and its bytes")
                out[key.decode()] = data
            except (OSError, ValueError) as e:
                if f not in self._reported:
                    self._reported.add(f)
                    log.error("%s: cannot read a pending void (%s); a failed commit it names may count", f, e)
        return out

    async def read(self) -> dict[str, bytes]:
        """`pending`, from a worker thread (while a mount runs: other processes on this host add keys)."""
        if self.folder is None:
            return {}
        return await trio.to_thread.run_sync(self.pending, limiter=self._limiter)

    async def add(self, key: str, data: bytes) -> None:
        """Keep `key` and its bytes durably (as the folder store writes a file). A failure is logged: the key
        then stays pending in this process only."""
        if self.folder is not None:
            try:
                await trio.to_thread.run_sync(self._write, key, data, limiter=self._limiter)
            except OSError as e:
                log.error("could not keep %s pending in %s (%s): a restart before a store takes it "
                          "forgets it", key, self.folder, e)

    async def remove(self, key: str) -> None:
        """A store took `key`: forget it (another process may have already)."""
        if self.folder is not None:
            try:
                await trio.to_thread.run_sync(self._file(key).unlink, True, limiter=self._limiter)
            except OSError as e:
                log.warning("could not remove the pending void of %s: %s (harmless: it is put again)", key, e)

    def _write(self, key: str, data: bytes) -> None:
        assert self.folder is not None
        self.folder.mkdir(mode=self._dir_mode, parents=True, exist_ok=True)
        write_durably(self._file(key), key.encode() + b"\n" + data, self._file_mode)
