"""The folder tree a mount shows, derived from the set of manifests, with stable inode numbers.

Files come from manifests; folders from their paths (and, within one mount, from mkdir). A file being
written has a node before its first commit, visible in this mount only.
"""
from __future__ import annotations

import itertools
import logging
import posixpath
from dataclasses import dataclass, field

import pyfuse3

from .errors import Exists, ManifestError, NotADirectory, NotFound
from .manifest import Manifest, parent_dirs
from .tensor_index import TensorIndex

log = logging.getLogger(__name__)
ROOT = pyfuse3.ROOT_INODE


@dataclass
class Node:
    ino: int
    path: str
    is_dir: bool
    manifest: Manifest | None = None          # the committed version; None for folders and new files
    children: dict[str, int] = field(default_factory=dict)
    _index: TensorIndex | None = None

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def index(self) -> TensorIndex | None:
        """The parsed tensor index, parsed once per version (not per open or read)."""
        if self._index is None and self.manifest is not None and self.manifest.tensor_index:
            try:
                self._index = TensorIndex.from_json(self.manifest.tensor_index)
            except ValueError as e:
                raise ManifestError(f"{self.path}: bad tensor index in manifest: {e}") from None
        return self._index

    def set_manifest(self, manifest: Manifest | None) -> None:
        self.manifest, self._index = manifest, None


class Namespace:
    def __init__(self, manifests: dict[str, Manifest]) -> None:
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, "/", True)}
        self.by_path: dict[str, int] = {"/": ROOT}
        self._inos = itertools.count(ROOT + 1)
        for path in sorted(manifests):
            try:
                self.add(manifests[path])
            except ManifestError as e:
                log.warning("skipping a file: %s", e)

    def _new(self, path: str, is_dir: bool, manifest: Manifest | None = None) -> Node:
        node = Node(next(self._inos), path, is_dir, manifest)
        self.nodes[node.ino] = node
        self.by_path[path] = node.ino
        self.parent(node).children[node.name] = node.ino
        return node

    def parent(self, node: Node) -> Node:
        return self.nodes[self.by_path[posixpath.dirname(node.path)]]

    def add(self, manifest: Manifest) -> Node:
        """Add or update a file (and the folders its path implies)."""
        for d in parent_dirs(manifest.path):
            ino = self.by_path.get(d)
            if ino is None:
                self._new(d, True)
            elif not self.nodes[ino].is_dir:
                raise ManifestError(f"{manifest.path}: {d} is a file, not a folder")
        ino = self.by_path.get(manifest.path)
        if ino is None:
            return self._new(manifest.path, False, manifest)
        node = self.nodes[ino]
        if node.is_dir:
            raise ManifestError(f"{manifest.path}: is a folder here")
        node.set_manifest(manifest)
        return node

    def create(self, parent: Node, name: str, is_dir: bool) -> Node:
        if not parent.is_dir:
            raise NotADirectory(f"{parent.path}: not a folder")
        if name in parent.children:
            raise Exists(f"{posixpath.join(parent.path, name)}: exists")
        return self._new(posixpath.join(parent.path, name), is_dir)

    def remove(self, node: Node) -> None:
        """Drop a node (a folder with everything below it)."""
        self.parent(node).children.pop(node.name, None)
        for n in self.walk(node):
            del self.by_path[n.path]
            del self.nodes[n.ino]

    def walk(self, node: Node) -> list[Node]:
        """The node and everything below it."""
        out = [node]
        for c in node.children.values():
            out.extend(self.walk(self.nodes[c]))
        return out

    def files_below(self, node: Node) -> list[Node]:
        return [n for n in self.walk(node) if not n.is_dir]

    def move(self, node: Node, parent: Node, name: str) -> None:
        """Re-home a node (and rename everything below it); the target name must be free."""
        self.parent(node).children.pop(node.name, None)
        old = node.path
        parent.children[name] = node.ino
        for n in self.walk(node):
            del self.by_path[n.path]
            n.path = posixpath.join(parent.path, name) + n.path[len(old):]
            self.by_path[n.path] = n.ino

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
            return self.parent(node) if node.ino != ROOT else node
        try:
            return self.nodes[node.children[name]]
        except KeyError:
            raise NotFound(f"no {name!r} in {node.path}") from None

    def resolve(self, path: str) -> Node:
        try:
            return self.nodes[self.by_path[path]]
        except KeyError:
            raise NotFound(f"no {path!r}") from None
