"""The manifest format: one JSON document per file, replicated like chunks.

It records everything a reader needs without asking anyone else: the file's attributes, its ordered
chunks (hash, lengths, codec, the stores holding each), and the tensor index. The namespace is derived
from the set of manifests; a new version of a path replaces the old one by an atomic put of the same key,
and `version` (commit time in ns) decides between replicas that disagree.
"""
from __future__ import annotations

import bisect
import json
import posixpath
import re
import stat
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import blake3

from .errors import ManifestError

FORMAT = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")


def normalize_path(path: str) -> str:
    """'/run1/step_100.pt' form: absolute, no '.', '..' or empty components."""
    if not isinstance(path, str) or "\0" in path:
        raise ManifestError(f"invalid path {path!r}")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ManifestError(f"path {path!r} may not contain '..'")
    if not parts:
        raise ManifestError(f"path {path!r} names the root, not a file")
    return "/" + "/".join(parts)


def manifest_key(path: str) -> str:
    """Store key of a path's manifest: a hash, since paths may be long or hold any character."""
    return f"manifests/{blake3.blake3(path.encode()).hexdigest()[:40]}.json"


@dataclass(frozen=True)
class ChunkEntry:
    digest: str
    raw_len: int
    stored_len: int
    codec: str
    stores: tuple[str, ...]


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
        doc = {
            "format": self.format, "path": self.path, "size": self.size, "mtime_ns": self.mtime_ns,
            "mode": self.mode, "chunk_size": self.chunk_size, "version": self.version,
            "chunks": [[c.digest, c.raw_len, c.stored_len, c.codec, list(c.stores)] for c in self.chunks],
            "tensor_index": self.tensor_index,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> "Manifest":
        """Parse and validate; anything inconsistent raises ManifestError naming `where`."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where}: not valid JSON: {e}") from None
        try:
            if not isinstance(doc, dict):
                raise TypeError("not an object")
            if doc["format"] != FORMAT:
                raise ManifestError(f"unsupported manifest format {doc['format']!r}")
            chunks = []
            for c in doc["chunks"]:
                digest, raw_len, stored_len, codec, stores = c
                if not (isinstance(digest, str) and _HEX64.fullmatch(digest)):
                    raise ValueError(f"bad chunk hash {digest!r}")
                if not (isinstance(raw_len, int) and raw_len > 0 and isinstance(stored_len, int)
                        and stored_len > 0 and codec in ("raw", "lz4") and isinstance(stores, list)
                        and stores and all(isinstance(s, str) for s in stores)):
                    raise ValueError(f"bad chunk entry {c!r}")
                chunks.append(ChunkEntry(digest, raw_len, stored_len, codec, tuple(stores)))
            m = cls(path=normalize_path(doc["path"]), size=int(doc["size"]), mtime_ns=int(doc["mtime_ns"]),
                    mode=int(doc["mode"]), chunk_size=int(doc["chunk_size"]), chunks=tuple(chunks),
                    version=int(doc["version"]), tensor_index=doc.get("tensor_index"))
        except ManifestError as e:    # the format check, or a bad path
            raise ManifestError(f"{where}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where}: malformed manifest: {e!r}") from None
        if m.offsets[-1] != m.size:
            raise ManifestError(f"{where}: chunks add up to {m.offsets[-1]} bytes, size says {m.size}")
        if not stat.S_ISREG(m.mode | stat.S_IFREG) or m.size < 0:
            raise ManifestError(f"{where}: bad mode or size")
        if m.tensor_index is not None and not isinstance(m.tensor_index, dict):
            raise ManifestError(f"{where}: tensor_index must be an object")
        return m


def parent_dirs(path: str) -> list[str]:
    """'/a/b/c' -> ['/a', '/a/b']: the folders a file implies."""
    out = []
    d = posixpath.dirname(path)
    while d != "/":
        out.append(d)
        d = posixpath.dirname(d)
    return out[::-1]
