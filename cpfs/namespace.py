"""The folder tree a mount shows, derived from the set of manifests, with stable inode numbers."""
from __future__ import annotations

import itertools
import logging
import posixpath
from dataclasses import dataclass, field

import pyfuse3

from .errors import ManifestError, NotFound
from .manifest import Manifest, parent_dirs
from .tensor_index import TensorIndex

log = logging.getLogger(__name__)
ROOT = pyfuse3.ROOT_INODE


@dataclass
class Node:
    ino: int
    path: str
    manifest: Manifest | None = None          # None for folders
    children: dict[str, int] = field(default_factory=dict)
    _index: TensorIndex | None = None

    @property
    def is_dir(self) -> bool:
        return self.manifest is None

    @property
    def index(self) -> TensorIndex | None:
        """The parsed tensor index, parsed once per file (not per open or read)."""
        if self._index is None and self.manifest is not None and self.manifest.tensor_index:
            try:
                self._index = TensorIndex.from_json(self.manifest.tensor_index)
            except ValueError as e:
                raise ManifestError(f"{self.path}: bad tensor index in manifest: {e}") from None
        return self._index


class Namespace:
    def __init__(self, manifests: dict[str, Manifest]) -> None:
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, "/")}
        self.by_path: dict[str, int] = {"/": ROOT}
        self._inos = itertools.count(ROOT + 1)
        for path in sorted(manifests):
            try:
                self.add(manifests[path])
            except ManifestError as e:
                log.warning("skipping a file: %s", e)

    def _new(self, path: str, manifest: Manifest | None) -> Node:
        ino = next(self._inos)
        node = self.nodes[ino] = Node(ino, path, manifest)
        self.by_path[path] = ino
        parent = self.nodes[self.by_path[posixpath.dirname(path)]]
        parent.children[posixpath.basename(path)] = ino
        return node

    def add(self, manifest: Manifest) -> Node:
        """Add a file (and the folders its path implies). A path that is a folder here is skipped."""
        for d in parent_dirs(manifest.path):
            ino = self.by_path.get(d)
            if ino is None:
                self._new(d, None)
            elif not self.nodes[ino].is_dir:
                raise ManifestError(f"{manifest.path}: {d} is a file, not a folder")
        ino = self.by_path.get(manifest.path)
        if ino is None:
            return self._new(manifest.path, manifest)
        node = self.nodes[ino]
        if node.is_dir:
            raise ManifestError(f"{manifest.path}: is a folder here")
        node.manifest, node._index = manifest, None
        return node

    def node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise NotFound(f"no inode {ino}") from None

    def lookup(self, parent: int, name: str) -> Node:
        node = self.node(parent)
        if name == ".":
            return node
        if name == "..":
            return self.node(self.by_path[posixpath.dirname(node.path)])
        try:
            return self.nodes[node.children[name]]
        except KeyError:
            raise NotFound(f"no {name!r} in {node.path}") from None

    def resolve(self, path: str) -> Node:
        try:
            return self.nodes[self.by_path[path]]
        except KeyError:
            raise NotFound(f"no {path!r}") from None
