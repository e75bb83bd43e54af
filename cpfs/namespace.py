"""The folder tree a mount shows, derived from the set of manifests, with stable inode numbers.

Files come from the catalog's summaries (name, size, times: all that a listing needs); a file's whole
manifest (chunks, tensor index) is fetched when it is opened. Folders come from paths (and, within one
mount, from mkdir). A file being written has a node before its first commit, visible in this mount only.

Invariant: an inode number always means one version of one file as another mount committed it. When
another mount commits a newer version, the path gets a new node (a new inode) and the old node is
*retired*: no longer reachable by name, still answering getattr and reads for the handles that opened
it, until the kernel forgets it. So a process that opened version 1 reads version 1 to the end, never a
mix, and the kernel's page cache of the old inode stays true. Names removed while open retire the same way.

Hard links: a file may have several names (`path`, then `aliases`), one node and one inode for all of
them. Every name's manifest carries the same `link` id, and a node is found by it (`links`), so a
listing that meets the second name of a file adds a name to the node, not a node. A node is retired
when its last name goes. `entries` walks names (a linked file appears under each of its names).
"""
from __future__ import annotations

import bisect
import itertools
import logging
import math
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyfuse3

from .catalog import Unreadable
from .errors import Exists, ManifestError, NotADirectory, NotFound
from .manifest import Manifest, Summary, parent_dirs
from .tensor_index import TensorIndex

log = logging.getLogger(__name__)
ROOT = pyfuse3.ROOT_INODE


@dataclass
class Node:
    ino: int
    path: str
    is_dir: bool
    summary: Summary | None = None            # the committed version; None for folders and new files
    manifest: Manifest | None = None          # its whole manifest, once fetched (see the module doc)
    children: dict[str, int] = field(default_factory=dict)    # change with `attach` and `detach`
    # A folder's readdir cookie of each name: given when the name arrives, never moved, so a listing
    # resumed at a cookie skips or repeats no name while others come and go (a position in the sorted
    # names shifted: a loop that removed what it listed left a name in 40).
    cookies: dict[str, int] = field(default_factory=dict)
    _next_cookie: int = 1
    # (cookie, name) in cookie order, also of names detached since (skipped, dropped in bulk): a listing
    # resumed at a cookie starts there, not at the first name (a folder of N names took N^2/batch steps).
    _order: list[tuple[int, str]] = field(default_factory=list)
    broken: str = ""                          # why the current version cannot be read (open: EIO)
    checked: float = -math.inf                # when this mount last looked up its newest version (trio clock)
    given: bool = False                       # its attributes went to the kernel: it may hold the inode
    entries_changed_ns: int = 0               # a folder: when this mount last added or removed a name in it
                                              # (its mtime and ctime show it; not committed, see cpfs/fs.py)
    aliases: list[str] = field(default_factory=list)   # a file's other names (hard links)
    # A file never committed that was renamed over a committed one: that version (its manifest when held:
    # one committed here has no store key to fetch it by), which the stores keep until this file commits
    # (a crash meanwhile loses nothing). If this file leaves the name first (unlink, rename), it goes too;
    # if its commit fails, the name shows that version again (cpfs/fs.py: _leave).
    hides: Summary | Manifest | None = None
    _index: TensorIndex | None = None

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def names(self) -> list[str]:
        """Every path that leads to this node (more than one: hard links)."""
        return [self.path, *self.aliases]

    @property
    def index(self) -> TensorIndex | None:
        """The parsed tensor index, parsed once per version (not per open or read)."""
        if self._index is None and self.manifest is not None and self.manifest.tensor_index:
            try:
                self._index = TensorIndex.from_json(self.manifest.tensor_index)
            except ValueError as e:
                raise ManifestError(f"{self.path}: bad tensor index in manifest: {e}") from None
        return self._index

    def set_version(self, version: Summary | Manifest | None) -> None:
        """Show another committed version (a summary, or a whole manifest we already hold)."""
        if isinstance(version, Manifest):
            self.summary, self.manifest = version.summary, version
        else:
            self.summary, self.manifest = version, None
        self._index = None
        self.broken = ""

    def attach(self, name: str, ino: int) -> None:
        """A folder's name leads to `ino` now (a new name gets the next readdir cookie)."""
        if name not in self.children:
            self.cookies[name] = self._next_cookie
            self._order.append((self._next_cookie, name))
            self._next_cookie += 1
        self.children[name] = ino

    def detach(self, name: str) -> None:
        self.children.pop(name, None)
        if self.cookies.pop(name, None) is not None and len(self._order) > 2 * len(self.cookies) + 64:
            self._order = [(c, n) for c, n in self._order if self.cookies.get(n) == c]

    def listing(self, after: int) -> Iterator[tuple[str, int, int]]:
        """(name, inode, cookie) of the folder's names whose cookie is past `after`, in cookie order."""
        order = self._order
        for i in range(bisect.bisect_right(order, after, key=lambda entry: entry[0]), len(order)):
            cookie, name = order[i]
            if self.cookies.get(name) == cookie and name in self.children:
                yield name, self.children[name], cookie

    def take_manifest(self, manifest: Manifest) -> None:
        """The whole manifest of the version the node shows, fetched on first need."""
        if self.summary is not None and self.summary.order == manifest.order and self.manifest is None:
            self.manifest, self._index = manifest, None


class Namespace:
    def __init__(self, manifests: dict[str, Summary | Unreadable]) -> None:
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, "/", True)}
        self.retired: dict[int, Node] = {}      # unreachable by name, kept for open handles until forget
        self.by_path: dict[str, int] = {"/": ROOT}
        self.links: dict[str, int] = {}         # link id -> the live node all its names lead to
        self._inos = itertools.count(ROOT + 1)
        for path in sorted(manifests):
            try:
                self.add(manifests[path])
            except ManifestError as e:
                log.warning("skipping a file: %s", e)

    def _new(self, path: str, is_dir: bool) -> Node:
        node = Node(next(self._inos), path, is_dir)
        self.nodes[node.ino] = node
        self.by_path[path] = node.ino
        self.parent(node).attach(node.name, node.ino)
        return node

    def parent(self, node: Node) -> Node:
        return self.parent_of(node.path)

    def parent_of(self, path: str) -> Node:
        return self.nodes[self.by_path[posixpath.dirname(path)]]

    def add(self, manifest: Summary | Manifest | Unreadable) -> Node:
        """Add or update a file or a committed folder (and the folders its path implies)."""
        for d in parent_dirs(manifest.path):
            ino = self.by_path.get(d)
            if ino is None:
                self._new(d, True)
            elif not self.nodes[ino].is_dir:
                raise ManifestError(f"{manifest.path}: {d} is a file, not a folder")
        is_dir = not isinstance(manifest, Unreadable) and manifest.directory
        link = "" if isinstance(manifest, Unreadable) else manifest.link
        if link and (linked := self.nodes.get(self.links.get(link, 0))) is not None:
            if manifest.path not in linked.names:     # another name of a file we show: a name, not a node
                if (other := self.by_path.get(manifest.path)) is not None:
                    if self.nodes[other].is_dir:
                        raise ManifestError(f"{manifest.path}: is a folder here")
                    self.remove_name(self.nodes[other], manifest.path)
                self.add_name(linked, manifest.path)
            return linked
        ino = self.by_path.get(manifest.path)
        if ino is None:
            node = self._new(manifest.path, is_dir)
        else:
            node = self.nodes[ino]
            if node.is_dir != is_dir:
                raise ManifestError(f"{manifest.path}: is a {'folder' if node.is_dir else 'file'} here")
        if isinstance(manifest, Unreadable):
            node.set_version(None)
            node.broken = f"manifest {manifest.key}: {manifest.reason}"
        else:
            node.set_version(manifest)
            if link:
                self.links[link] = node.ino
        return node

    def add_name(self, node: Node, path: str) -> None:
        """A hard link: `path` (free, in an existing folder) leads to `node` too."""
        node.aliases.append(path)
        self.by_path[path] = node.ino
        self.parent_of(path).attach(posixpath.basename(path), node.ino)

    def remove_name(self, node: Node, path: str) -> None:
        """One name of a file goes; the node with its last name."""
        if path == node.path and not node.aliases:
            self.remove(node)
            return
        self._unname(path)
        if path == node.path:
            node.path = node.aliases.pop(0)
        else:
            node.aliases.remove(path)

    def _unname(self, path: str) -> None:
        del self.by_path[path]
        parent = self.by_path.get(posixpath.dirname(path))
        if parent is not None:
            self.nodes[parent].detach(posixpath.basename(path))

    def _retire(self, node: Node) -> None:
        """Kept until the kernel forgets the inode; one it never had (a version a refresh found and the
        next replaced, never looked up) gets no forget, and piled up in a mount that watches another's
        busy files (the soak audit: 6,200 an hour)."""
        self.nodes.pop(node.ino)
        if node.given:
            self.retired[node.ino] = node
        link = node.summary.link if node.summary is not None else ""
        if link and self.links.get(link) == node.ino:
            del self.links[link]

    def replace(self, node: Node, manifest: Summary | Unreadable) -> Node:
        """A new node (inode) for a version committed elsewhere; the old one is retired (module doc)."""
        self.remove(node)
        return self.add(manifest)

    def create(self, parent: Node, name: str, is_dir: bool) -> Node:
        if not self.is_current(parent):     # renamed or removed (elsewhere) since it was looked up: ENOENT
            raise NotFound(f"{parent.path}: no such folder any more")
        if not parent.is_dir:
            raise NotADirectory(f"{parent.path}: not a folder")
        if name in parent.children:
            raise Exists(f"{posixpath.join(parent.path, name)}: exists")
        return self._new(posixpath.join(parent.path, name), is_dir)

    def remove(self, node: Node) -> None:
        """Unlink a node: a file with all its names, or a folder with everything below it (a file
        linked from elsewhere keeps its other names); open handles keep it until forget."""
        if not node.is_dir:
            for path in node.names:
                self._unname(path)
            node.aliases.clear()
            self._retire(node)
            return
        for path, n in reversed(self.entries(node)):      # deepest first
            if n.is_dir:
                self._unname(path)
                self._retire(n)
            else:
                self.remove_name(n, path)

    def is_current(self, node: Node) -> bool:
        """Whether the node is still reachable by its name (not retired)."""
        return node.ino in self.nodes

    def forget(self, ino: int) -> None:
        """The kernel dropped the inode: a retired node is gone for good; a live one keeps its number and
        lets go of its whole manifest (fetched again on its next open), which else stayed for the life of
        the mount for every file ever opened. Only a version a listing found (its key known): one
        committed here names no key and could not be fetched again (EIO at the next open)."""
        self.retired.pop(ino, None)
        node = self.nodes.get(ino)
        if node is not None and not node.is_dir and node.summary is not None and node.summary.key:
            node.manifest, node._index = None, None

    def entries(self, node: Node, path: str | None = None) -> list[tuple[str, Node]]:
        """(path, node) of the node under `path` (default: its own) and of every name below it."""
        out: list[tuple[str, Node]] = []
        todo = [(path or node.path, node)]     # depth first, without recursion: trees may be deep
        while todo:
            p, n = todo.pop()
            out.append((p, n))
            todo.extend((posixpath.join(p, name), self.nodes[c]) for name, c in reversed(n.children.items()))
        return out

    def walk(self, node: Node) -> list[Node]:
        """The node and everything below it."""
        return [n for _, n in self.entries(node)]

    def files_below(self, node: Node) -> list[Node]:
        return [n for n in self.walk(node) if not n.is_dir]

    def move(self, node: Node, parent: Node, name: str, old: str | None = None) -> None:
        """Re-home the name `old` (default: the node's path) of a node, and rename everything below it;
        the target name must be free."""
        old = old or node.path
        self.parent_of(old).detach(posixpath.basename(old))
        new = posixpath.join(parent.path, name)
        parent.attach(name, node.ino)
        for path, n in self.entries(node, old):
            moved = new + path[len(old):]
            del self.by_path[path]
            self.by_path[moved] = n.ino
            if n.path == path:
                n.path = moved
            else:
                n.aliases[n.aliases.index(path)] = moved

    def node(self, ino: int) -> Node:
        """A live or retired node: handles and the kernel may still use a retired inode."""
        node = self.nodes.get(ino) or self.retired.get(ino)
        if node is None:
            raise NotFound(f"no inode {ino}")
        return node

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
