"""The namespace's hard links without a mount: one node for every name that carries one link id."""
from __future__ import annotations

import itertools

from cpfs.manifest import Summary
from cpfs.namespace import Namespace


def summary(path: str, link: str = "", committed_ns: int = 1) -> Summary:
    return Summary(path=path, size=3, mtime_ns=1, mode=0o644, version=1, link=link, committed_ns=committed_ns)


L = "0123456789abcdef"


def test_names_with_one_link_id_are_one_node_whatever_the_listing_order() -> None:
    ns = Namespace({p: summary(p, L) for p in ("/z/last.pt", "/a/model.pt", "/m/third.pt")}
                   | {"/a/other.pt": summary("/a/other.pt")})
    node = ns.resolve("/a/model.pt")
    assert ns.resolve("/z/last.pt") is node and ns.resolve("/m/third.pt") is node
    assert sorted(node.names) == ["/a/model.pt", "/m/third.pt", "/z/last.pt"]
    assert ns.resolve("/a/other.pt") is not node
    assert ns.lookup(ns.resolve("/z").ino, "last.pt") is node


def test_removing_names_keeps_the_node_until_the_last() -> None:
    ns = Namespace({p: summary(p, L) for p in ("/a/x", "/b/y")})
    node = ns.resolve("/a/x")
    ns.remove_name(node, "/a/x")                  # the primary name goes: another takes its place
    assert node.path == "/b/y" and node.aliases == [] and ns.is_current(node)
    assert "x" not in ns.resolve("/a").children and "/a/x" not in ns.by_path
    ns.remove_name(node, "/b/y")
    assert not ns.is_current(node) and L not in ns.links


def test_moving_a_folder_renames_only_the_names_below_it() -> None:
    ns = Namespace({p: summary(p, L) for p in ("/run/tmp/model.pt", "/latest.pt")})
    node = ns.resolve("/latest.pt")
    ns.move(ns.resolve("/run/tmp"), ns.resolve("/run"), "step_1")
    assert sorted(node.names) == ["/latest.pt", "/run/step_1/model.pt"]
    assert ns.resolve("/run/step_1/model.pt") is node and "/run/tmp/model.pt" not in ns.by_path
    ns.move(node, ns.resolve("/run"), "renamed.pt", old="/latest.pt")       # one name of a file
    assert sorted(node.names) == ["/run/renamed.pt", "/run/step_1/model.pt"]
    ns.remove(ns.resolve("/run/step_1"))          # a folder goes: the file keeps its other name
    assert node.names == ["/run/renamed.pt"] and ns.is_current(node)
    assert sorted(ns.by_path) == ["/", "/run", "/run/renamed.pt"]


def test_a_name_that_joins_a_link_group_leaves_its_old_node() -> None:
    ns = Namespace({"/a": summary("/a", L), "/b": summary("/b")})
    old = ns.resolve("/b")
    node = ns.add(summary("/b", L))
    assert node is ns.resolve("/a") and sorted(node.names) == ["/a", "/b"] and not ns.is_current(old)


def test_a_folder_tree_deeper_than_pythons_recursion_limit_moves_and_goes() -> None:
    """An audit's find: a rename of a folder 1500 levels deep failed with RecursionError (EIO), as
    any walk below it did."""
    deep = "/top" + "/d" * 1500 + "/model.pt"
    ns = Namespace({deep: summary(deep), "/other.pt": summary("/other.pt")})
    node = ns.resolve(deep)
    ns.move(ns.resolve("/top"), ns.resolve("/"), "moved")
    assert node.path == "/moved" + "/d" * 1500 + "/model.pt" and ns.resolve(node.path) is node
    assert [p for p, _ in ns.entries(ns.resolve("/moved"))][:3] == ["/moved", "/moved/d", "/moved/d/d"]
    assert ns.files_below(ns.resolve("/moved")) == [node]
    ns.remove(ns.resolve("/moved"))
    assert sorted(ns.by_path) == ["/", "/other.pt"] and not ns.is_current(node)


def test_a_listing_resumed_at_a_cookie_gives_every_name_once_while_names_come_and_go() -> None:
    """readdir in batches (resumed at the last cookie it gave) over a folder whose names churn meanwhile:
    every name there from start to end comes exactly once, in the order of their cookies, and a name
    that left and came back comes with its new cookie. Resuming starts at the cookie (it walked from the
    first name, so a folder of N names took N^2 / batch steps: an audit's find)."""
    ns = Namespace({f"/d/f{i:05d}": summary(f"/d/f{i:05d}") for i in range(3000)})
    folder = ns.resolve("/d")
    seen: list[tuple[str, int]] = []
    after = 0
    step = 0
    while True:
        batch = list(itertools.islice(folder.listing(after), 100))
        if not batch:
            break
        seen += [(name, cookie) for name, _, cookie in batch]
        after = batch[-1][2]
        step += 1
        for i in range(20 if step <= 25 else 0):    # others remove names and add new ones meanwhile
            gone = f"f{(step * 97 + i * 31) % 3000:05d}"
            if gone in folder.children and gone not in dict(seen):
                ns.remove(ns.resolve(f"/d/{gone}"))
            ns.add(summary(f"/d/new{step}-{i}"))
    cookies = [c for _, c in seen]
    assert cookies == sorted(cookies) and len(set(cookies)) == len(cookies)
    names = [n for n, _ in seen]
    assert len(set(names)) == len(names)
    stayed = {n for n in folder.children if n.startswith("f")}
    assert stayed <= set(names)                  # every original name still there was listed
    assert [n for n, _ in seen if n not in folder.children] == []   # none listed after it had left
