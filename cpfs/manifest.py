"""The manifest format: one JSON document per file, replicated like chunks.

It records everything a reader needs without asking anyone else: the file's attributes, its ordered
chunks (hash, lengths, codec, the stores holding each), and the tensor index. The namespace is derived
from the set of manifests. Every commit is a new immutable document (see cpfs/catalog.py): `version` is
a per-path counter, `writer` breaks ties between two commits of one version, and `state` says whether
the version is a file ("ok"), a removal ("deleted") or a save that did not complete ("failed").

Fields added later (owner, group, atime, ctime, `user.` extended attributes, mknod's kind and device,
the hard-link id) are optional: a manifest without them loads with defaults (cpfs/fs.py shows the mounting user, and
mtime for the other times), and readers that predate them ignore them.

Every field is checked on load, since a manifest comes from a store we do not control: a bad one must
make its own file unreadable, never crash a listing of its neighbours (a size beyond 2**63 once did).

Each line carries a check, as each chunk does (cpfs/chunk.py): the summary line ends with
`"check"`, a BLAKE3-128 of the line's bytes before it, and holds `"body_check"`, that of the body line.
A copy whose bits rotted may still parse, with another chunk's name in it: trusted, gc would delete
the chunks the good copies name, and a reader would fail on a chunk that does not exist. A copy that
fails its check is unreadable like a malformed one, so readers, gc and scrub take another copy. The
check is where a listing's ranged read of the summary finds it; manifests written before it have none
and load as before. Readers that predate it ignore both keys.
"""
from __future__ import annotations

import base64
import binascii
import bisect
import dataclasses
import hashlib
import json
import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import blake3

from .chunk import BLOCK, BLOCK_CHECK_SIZE
from .errors import ManifestError, NameTooLong

FORMAT = 2
READABLE_FORMATS = (1, 2)          # format 1: one document per path, before version history
STATES = ("ok", "failed", "deleted")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_WRITER = re.compile(r"[0-9a-f]{0,32}")
_LINK = re.compile(r"(?:[0-9a-f]{16})?")
_MAX_INT = 2**63 - 1               # what stat(2) and the kernel can carry
_MAX_CHUNK = 1024**3               # far above the largest chunk_size (256 MiB) we cut
_MAX_VERSION = 10**19              # fits the 20 digits of a manifest key
_MAX_TEXT = 4096
_MAX_ID = 2**32 - 2                # uid and gid (2**32 - 1 is "no change" to chown)
XATTR_NAMESPACE = "user."          # the only extended attributes stored (others: ENOTSUP)
XATTR_NAME_MAX = 255               # bytes of a name, as Linux (longer: ERANGE)
XATTR_SIZE_MAX = 65536             # bytes of one value, as Linux (larger: E2BIG)
XATTR_TOTAL_MAX = 4096             # names and values of one file together, as ext4's one block (ENOSPC)


NAME_MAX = 255          # bytes of one name, as Linux (statfs f_namemax; longer: ENAMETOOLONG)


def name_bytes(text: str) -> bytes:
    """A path or name as the kernel and the stores know it: UTF-8, and bytes that are no UTF-8 kept
    as os.fsdecode keeps them under a UTF-8 locale (surrogateescape), whatever this process's locale:
    a mount or command run under LANG=C (not coerced to UTF-8) hashed paths by its ASCII codec and
    failed on every non-ASCII one (an audit's find)."""
    return text.encode("utf-8", "surrogateescape")


def name_text(raw: bytes) -> str:
    """The inverse of `name_bytes`: a name from the kernel (or the command line) as cpfs keeps it."""
    return raw.decode("utf-8", "surrogateescape")


def normalize_path(path: str) -> str:
    """'/run1/step_100.pt' form: absolute, no '.', '..' or empty components, and text as `name_text`
    makes it (a command line decoded by an ASCII locale names the same path as a UTF-8 one)."""
    if not isinstance(path, str) or "\0" in path:
        raise ManifestError(f"invalid path {path!r}")
    try:
        path = name_text(name_bytes(path))
    except UnicodeError:                # a lone surrogate that stands for no byte
        raise ManifestError(f"invalid path {path!r}") from None
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ManifestError(f"path {path!r} may not contain '..'")
    if not parts:
        raise ManifestError(f"path {path!r} names the root, not a file")
    return "/" + "/".join(parts)


def metadata_check(data: bytes) -> str:
    """The check of a small metadata object's bytes (a store's identity, a hold, a roster enrollment:
    128 bits of SHA-256), so that a copy that rotted into bytes that still parse is told apart."""
    return hashlib.sha256(data).hexdigest()[:32]


def path_hash(path: str) -> str:
    """Names a path's folder of manifest versions on the stores: a hash, since paths may be long or
    hold any character (names that are not UTF-8 too: `name_bytes`)."""
    return blake3.blake3(name_bytes(path)).hexdigest()[:40]


@dataclass(frozen=True)
class ChunkEntry:
    digest: str
    raw_len: int
    stored_len: int
    codec: str
    stores: tuple[str, ...]
    blocks: bytes = b""     # block checks of the raw bytes (cpfs/chunk.py); empty: not recorded


_SUMMARY_KEYS = ("format", "path", "size", "mtime_ns", "mode", "version", "writer", "host", "committed_ns",
                 "state", "reason", "symlink", "directory", "uid", "gid", "atime_ns", "ctime_ns", "xattrs",
                 "special", "rdev", "link")
SPECIALS = ("fifo", "socket", "char", "block")   # mknod's kinds (no content: the kernel serves them)
Xattrs = tuple[tuple[str, bytes], ...]     # (name, value), sorted by name
SUMMARY_MAX = 16 * 1024      # a summary line is at most this long (path and reason are bounded)
# Of a summary line, what a path and a symlink's target may take as JSON text (`check_room`); the
# rest holds xattrs (XATTR_TOTAL_MAX, base64) and the other fields.
PATH_ROOM = SUMMARY_MAX // 2


def check_room(path: str, symlink: str = "") -> None:
    """NameTooLong unless a version of `path` (a symlink to `symlink`) fits its summary line. Paths are
    JSON text there, so a character that is no ASCII takes 6-12 bytes: a symlink or folder within
    PATH_MAX failed with EIO, and a file would have failed at its close (an audit's find)."""
    used = len(json.dumps(path)) + len(json.dumps(symlink))
    if used > PATH_ROOM:
        raise NameTooLong(f"{path}: its path{' and target' if symlink else ''} take {used} bytes of a "
                          f"manifest's summary line, at most {PATH_ROOM}")


@dataclass(frozen=True)
class Summary:
    """What a listing needs of a version (name, size, times, order), without chunks or tensor index.

    A manifest is stored as two JSON lines: this summary, then the body. A mount of 10,000 files of
    1,000 tensors reads 10,000 summaries (a ranged read each), not gigabytes of tensor indexes;
    the body is read when a file is opened. `key` and `stores` say where it was found (not stored)."""
    path: str
    size: int
    mtime_ns: int
    mode: int
    version: int
    writer: str = ""
    host: str = ""
    committed_ns: int = 0
    state: str = "ok"
    reason: str = ""
    symlink: str = ""              # the target, if this version is a symbolic link (then no chunks)
    directory: bool = False        # a folder made with mkdir (committed, so every mount sees it)
    uid: int | None = None         # owner and group; None: not recorded (older manifests): the mount's user
    gid: int | None = None
    atime_ns: int | None = None    # None: not recorded: mtime_ns
    ctime_ns: int | None = None    # None: not recorded: mtime_ns
    xattrs: Xattrs = ()            # extended attributes ("user." names), at most XATTR_TOTAL_MAX bytes
    special: str = ""              # a node made with mknod (one of SPECIALS): no chunks
    rdev: int = 0                  # its device number (char and block)
    link: str = ""                 # hard links: every name of one file carries the same id (see fs.py)
    key: str = ""
    stores: tuple[str, ...] = ()

    @property
    def order(self) -> tuple[int, str]:
        """Total order of a path's versions: the counter, then the writer id."""
        return (self.version, self.writer)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> "Summary":
        """The summary from the first line of a stored manifest (a prefix of it is enough)."""
        line, nl, _ = bytes(data).partition(b"\n")
        if not nl:
            raise ManifestError(f"{where}: no summary line in the first {len(data)} bytes")
        return _parse_summary(_checked_head(line, where), where)


@dataclass(frozen=True)
class Manifest:
    path: str
    size: int
    mtime_ns: int
    mode: int
    chunk_size: int
    chunks: tuple[ChunkEntry, ...]
    version: int
    tensor_index: dict[str, Any] | None = None
    format: int = FORMAT
    writer: str = ""               # hex id of the committing process: breaks ties between versions
    host: str = ""                 # where it was committed (information only)
    committed_ns: int = 0          # wall clock at commit (information only: never orders versions)
    state: str = "ok"              # "ok", "failed" (an incomplete save, kept for history), "deleted"
    reason: str = ""               # why a version failed
    symlink: str = ""              # the target, as given, if this version is a symbolic link
    directory: bool = False        # a folder made with mkdir: no chunks
    uid: int | None = None         # owner, group, times and extended attributes: see Summary
    gid: int | None = None
    atime_ns: int | None = None
    ctime_ns: int | None = None
    xattrs: Xattrs = ()
    special: str = ""
    rdev: int = 0
    link: str = ""

    @property
    def order(self) -> tuple[int, str]:
        """Total order of a path's versions: the counter, then the writer id."""
        return (self.version, self.writer)

    @property
    def summary(self) -> Summary:
        return Summary(**{k: getattr(self, k) for k in _SUMMARY_KEYS if k != "format"})

    def at(self, paths: Iterable[str], **changes: Any) -> list["Manifest"]:
        """This version under each of `paths` (the names of a hard-linked file, a transaction's paths),
        with `changes` to its fields."""
        return [dataclasses.replace(self, path=p, **changes) for p in paths]

    @cached_property
    def offsets(self) -> list[int]:
        """Start offset of every chunk, plus the file size at the end (chunks may vary in length)."""
        out = [0]
        for c in self.chunks:
            out.append(out[-1] + c.raw_len)
        return out

    def chunk_at(self, offset: int) -> int:
        """Index of the chunk holding byte `offset` (0 <= offset < size)."""
        return bisect.bisect_right(self.offsets, offset) - 1

    def chunk_range(self, offset: int, length: int) -> range:
        """Indices of the chunks that bytes [offset, offset+length) touch."""
        end = min(offset + length, self.size)
        if length <= 0 or offset >= end:
            return range(0)
        return range(self.chunk_at(offset), self.chunk_at(end - 1) + 1)

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_len for c in self.chunks)

    def to_bytes(self) -> bytes:
        """Two JSON lines: the summary (see Summary), then chunks and tensor index."""
        head = {k: getattr(self, k) for k in _SUMMARY_KEYS}
        for k in ("uid", "gid", "atime_ns", "ctime_ns"):
            if head[k] is None:
                del head[k]          # not recorded: read back as None
        for k in ("special", "rdev", "link"):
            if not head[k]:
                del head[k]
        head["xattrs"] = {name: base64.b64encode(value).decode() for name, value in self.xattrs}
        if not head["xattrs"]:
            del head["xattrs"]
        body: dict[str, Any] = {
            "chunk_size": self.chunk_size,
            "chunks": [[c.digest, c.raw_len, c.stored_len, c.codec, list(c.stores)] for c in self.chunks],
            "tensor_index": self.tensor_index}
        if any(c.blocks for c in self.chunks):
            # Beside the chunk list, not in its entries: readers that predate it ignore the key.
            body["blocks"] = {"size": BLOCK, "checks": [base64.b64encode(c.blocks).decode() for c in self.chunks]}
        rest = json.dumps(body, separators=(",", ":")).encode()
        head["body_check"] = _check(rest)
        line = json.dumps(head, separators=(",", ":")).encode()[:-1]
        line += b',"check":"' + _check(line).encode() + b'"}'
        if len(line) >= SUMMARY_MAX:
            raise NameTooLong(f"{self.path}: summary of {len(line)} bytes is too long")
        return line + b"\n" + rest

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> "Manifest":
        """Parse and validate; anything inconsistent raises ManifestError naming `where`.
        Format 1 (one JSON document) is read too."""
        head, nl, body = bytes(data).partition(b"\n")
        doc = _checked_head(head, where)
        if isinstance(doc, dict) and "body_check" in doc and (not nl or doc["body_check"] != _check(body)):
            raise ManifestError(f"{where}: the body does not match its check: a damaged copy")
        if nl:
            more = _loads(body, where)
            if isinstance(doc, dict) and isinstance(more, dict):
                doc = {**more, **doc}
        s = _parse_summary(doc, where)
        try:
            chunk_size = _int(doc, "chunk_size", 1, _MAX_CHUNK)
            chunks = []
            for c in doc["chunks"]:
                digest, raw_len, stored_len, codec, stores = c
                if not (isinstance(digest, str) and _HEX64.fullmatch(digest)):
                    raise ValueError(f"bad chunk hash {digest!r:.80}")
                if not (type(raw_len) is int and 0 < raw_len <= _MAX_CHUNK and type(stored_len) is int
                        and 0 < stored_len <= raw_len + 64 and codec in ("raw", "lz4")
                        and isinstance(stores, list) and stores
                        and all(isinstance(s, str) and 0 < len(s) <= 255 for s in stores)
                        and len(set(stores)) == len(stores)):
                    raise ValueError(f"bad chunk entry {c!r:.200}")
                chunks.append(ChunkEntry(digest, raw_len, stored_len, codec, tuple(stores)))
            if "blocks" in doc:
                chunks = _with_blocks(chunks, doc["blocks"])
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where}: malformed manifest: {e!r:.300}") from None
        m = cls(chunk_size=chunk_size, chunks=tuple(chunks), tensor_index=doc.get("tensor_index"), format=FORMAT,
                **{k: getattr(s, k) for k in _SUMMARY_KEYS if k != "format"})
        if (m.symlink or m.directory or m.special) and (m.chunks or m.size):
            raise ManifestError(f"{where}: a symlink, folder or special file has no chunks")
        if m.offsets[-1] != m.size:
            raise ManifestError(f"{where}: chunks add up to {m.offsets[-1]} bytes, size says {m.size}")
        if m.tensor_index is not None and not isinstance(m.tensor_index, dict):
            raise ManifestError(f"{where}: tensor_index must be an object")
        return m


def _with_blocks(chunks: list[ChunkEntry], raw: Any) -> list[ChunkEntry]:
    """The chunks with their block checks: one base64 string per chunk, BLOCK_CHECK_SIZE bytes per
    BLOCK of it (empty: not recorded); blocks of another size than this build's are ignored."""
    if not isinstance(raw, dict) or not isinstance(raw.get("checks"), list) or len(raw["checks"]) != len(chunks):
        raise ValueError("blocks must be {size, checks} with one check string per chunk")
    if raw.get("size") != BLOCK:
        return chunks
    out = []
    for c, text in zip(chunks, raw["checks"]):
        if not isinstance(text, str):
            raise TypeError("a chunk's block checks must be base64 text")
        try:
            checks = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"block checks of chunk {c.digest[:16]} are not base64") from None
        if checks and len(checks) != BLOCK_CHECK_SIZE * -(-c.raw_len // BLOCK):
            raise ValueError(f"chunk {c.digest[:16]}: {len(checks)} bytes of block checks for {c.raw_len} bytes")
        out.append(dataclasses.replace(c, blocks=checks))
    return out


_TRAILER = b',"check":"'
_CHECK_HEX = 32


def _check(data: bytes) -> str:
    """A manifest line's check: BLAKE3-128, hex."""
    return blake3.blake3(data).hexdigest(_CHECK_HEX // 2)


def _checked_head(line: bytes, where: str) -> Any:
    """The summary line, parsed, once its check matches (a line without a check: written before it).
    A "body_check" without the line's own check is a damaged copy too: both are written together."""
    doc = _loads(line, where)
    if isinstance(doc, dict) and ("check" in doc or "body_check" in doc):
        end = len(line) - _CHECK_HEX - 2
        if not (line.endswith(b'"}') and line[end - len(_TRAILER):end] == _TRAILER
                and line[end:-2] == _check(line[:end - len(_TRAILER)]).encode()
                and isinstance(doc.get("body_check"), str)):
            raise ManifestError(f"{where}: the summary does not match its check: a damaged copy")
    return doc


def _loads(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{where}: not valid JSON: {e}") from None


def _parse_summary(doc: Any, where: str) -> Summary:
    """Every summary field, validated: a manifest comes from a store we do not control."""
    try:
        if not isinstance(doc, dict):
            raise TypeError("not an object")
        if type(doc["format"]) is not int or doc["format"] not in READABLE_FORMATS:
            raise ManifestError(f"unsupported manifest format {doc['format']!r:.40}")
        state = doc.get("state", "ok")
        if state not in STATES:
            raise ValueError(f"bad state {state!r:.40}")
        writer, host, reason, symlink = (_text(doc, k) for k in ("writer", "host", "reason", "symlink"))
        if "\0" in symlink:
            raise ValueError("a symlink target may not contain NUL")
        directory = doc.get("directory", False)
        if not isinstance(directory, bool) or (directory and symlink):
            raise ValueError("bad directory flag")
        if not _WRITER.fullmatch(writer):
            raise ValueError(f"bad writer id {writer!r:.40}")
        special = doc.get("special", "")
        if special and (special not in SPECIALS or directory or symlink):
            raise ValueError(f"bad special kind {special!r:.40}")
        link = doc.get("link", "")
        if not (isinstance(link, str) and _LINK.fullmatch(link)) or (link and directory):
            raise ValueError(f"bad link id {link!r:.40}")
        owner = {k: _int(doc, k, 0, _MAX_ID) if doc.get(k) is not None else None for k in ("uid", "gid")}
        times = {k: _int(doc, k, -_MAX_INT, _MAX_INT) if doc.get(k) is not None else None
                 for k in ("atime_ns", "ctime_ns")}
        return Summary(path=normalize_path(doc["path"]), size=_int(doc, "size", 0, _MAX_INT),
                       mtime_ns=_int(doc, "mtime_ns", -_MAX_INT, _MAX_INT), mode=_int(doc, "mode", 0, 0o7777),
                       version=_int(doc, "version", 0, _MAX_VERSION), writer=writer, host=host,
                       committed_ns=_int(doc, "committed_ns", 0, _MAX_INT, default=0), state=state,
                       reason=reason, symlink=symlink, directory=directory, xattrs=_xattrs(doc.get("xattrs", {})),
                       special=special, rdev=_int(doc, "rdev", 0, _MAX_INT, default=0), link=link,
                       **owner, **times)
    except ManifestError as e:    # the format check, or a bad path
        raise ManifestError(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where}: malformed manifest: {e!r:.300}") from None


def _xattrs(raw: Any) -> Xattrs:
    """Extended attributes as stored: {name: base64 value}, within the limits above."""
    if not isinstance(raw, dict):
        raise TypeError("xattrs must be an object")
    out = []
    for name, value in raw.items():
        if not isinstance(value, str):
            raise TypeError(f"xattr {name!r:.60} must be base64 text")
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"xattr {name!r:.60} is not base64") from None
        out.append((name, data))
    check_xattrs(out)
    return tuple(sorted(out))


def check_xattrs(xattrs: Any) -> None:
    """ValueError unless every name is in the user namespace and the sizes are within the limits."""
    total = 0
    for name, value in xattrs:
        if not (isinstance(name, str) and name.startswith(XATTR_NAMESPACE) and len(name) > len(XATTR_NAMESPACE)
                and "\0" not in name and len(name.encode(errors="surrogateescape")) <= XATTR_NAME_MAX):
            raise ValueError(f"bad xattr name {name!r:.60}")
        if len(value) > XATTR_SIZE_MAX:
            raise ValueError(f"xattr {name!r:.60}: value of {len(value)} bytes")
        total += len(name.encode(errors="surrogateescape")) + len(value)
    if total > XATTR_TOTAL_MAX:
        raise ValueError(f"xattrs of {total} bytes, more than {XATTR_TOTAL_MAX}")


def _int(doc: dict, key: str, lo: int, hi: int, default: int | None = None) -> int:
    """An integer field within [lo, hi]: JSON floats, strings and booleans are refused, not coerced."""
    value = doc.get(key, default) if default is not None else doc[key]
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def _text(doc: dict, key: str) -> str:
    value = doc.get(key, "")
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ValueError(f"{key} must be a string of at most {_MAX_TEXT} characters")
    return value


def parent_dirs(path: str) -> list[str]:
    """'/a/b/c' -> ['/a', '/a/b']: the folders a file implies."""
    out = []
    d = posixpath.dirname(path)
    while d != "/":
        out.append(d)
        d = posixpath.dirname(d)
    return out[::-1]
