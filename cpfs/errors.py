"""One small hierarchy of errors; the FUSE boundary (cpfs.fs) alone maps them to errno."""
from __future__ import annotations

import errno

# What decoding a stored JSON object that we do not control raises when it is not what we wrote: bad JSON
# and fields (ValueError, TypeError, KeyError, AttributeError), a number beyond a float (OverflowError),
# nesting beyond the interpreter's stack (RecursionError). Callers turn it into their own error.
MALFORMED = (ValueError, TypeError, KeyError, AttributeError, ArithmeticError, RecursionError)


class CpfsError(Exception):
    """Base of every error cpfs raises on purpose."""

    errno = errno.EIO


class ConfigError(CpfsError):
    """Bad configuration: the message names the file, the key and what is wrong."""

    errno = errno.EINVAL


class StoreError(CpfsError):
    """A backing store failed an operation; `store` names it.

    `transient` says whether the same request may succeed if tried again (throttling, 5xx, a reset
    connection, a timeout). The store kind decides, at the raise site; only the pool retries."""

    transient: bool = False

    def __init__(self, store: str, message: str, *, transient: bool | None = None) -> None:
        super().__init__(f"store {store!r}: {message}")
        self.store = store
        self.detail = message
        if transient is not None:
            self.transient = transient


class NoSuchObject(StoreError):
    """The key is not in the store (a missing replica, not necessarily a missing file)."""

    errno = errno.ENOENT


class StoreFull(StoreError):
    errno = errno.ENOSPC


class StoreDenied(StoreError):
    """The store refuses us (permissions, a read-only or immutable folder)."""

    errno = errno.EACCES


class StoreUnavailable(StoreError):
    """The store cannot be reached (missing directory, refused connection, timeout)."""

    transient = True


class CorruptChunk(CpfsError):
    """Stored bytes do not decode, or decode to bytes whose hash is not the chunk's name."""


class ManifestError(CpfsError):
    """A manifest does not parse or contradicts itself."""


class ManifestGone(ManifestError):
    """Every store that listed a version no longer has it: retired (keep_versions) or voided between
    a listing and the read. Not damage: a fresh listing names the version that took its place."""


class NameTooLong(ManifestError):
    """A path (or a symlink's target) too long for a manifest's summary line."""
    errno = errno.ENAMETOOLONG


class ChunkUnavailable(CpfsError):
    """No replica of a chunk could be read; the message names file, offset, chunk and stores."""


class NotFound(CpfsError):
    errno = errno.ENOENT


class ReadOnly(CpfsError):
    errno = errno.EROFS


class Exists(CpfsError):
    errno = errno.EEXIST


class NotEmpty(CpfsError):
    errno = errno.ENOTEMPTY


class NotADirectory(CpfsError):
    errno = errno.ENOTDIR


class IsADirectory(CpfsError):
    errno = errno.EISDIR


class Stale(CpfsError):
    """The file, or a folder above it, was removed or renamed by another mount while open here: its
    commit would bring the old name back. ESTALE, as NFS answers for a file removed elsewhere."""
    errno = errno.ESTALE


class IncompleteFile(CpfsError):
    """A checkpoint (torch zip, safetensors) whose bytes stop before its end: kept only as a failed
    version, never made current (see cpfs/completeness.py)."""


class WriteFailed(CpfsError):
    """An earlier write or truncate of an open file failed (disk full, I/O error): its content is not
    what the writer meant, so it never commits. Carries that failure's errno."""

    def __init__(self, message: str, err: int = errno.EIO) -> None:
        super().__init__(message)
        self.errno = err
