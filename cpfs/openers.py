"""Whether a close of a file being written is its writer's last: a fork's close must not commit it.

Why. Every close() of a writable file commits (cpfs/fs.py: flush): the kernel tells a FUSE daemon of
each close (FLUSH), and of the last one only after close() has returned (RELEASE). A process that forks
while a file is open for writing gives the child a copy of the descriptor, and the child's close is a
FLUSH too: its exit, the close of every descriptor before an exec (subprocess.run, os.system), a
DataLoader worker's end. Each one committed the half-written file in the middle of the save: a failed
version for a checkpoint (cpfs/completeness.py), and for any other file a version of partial bytes,
which counted against `keep_versions` and retired a good one; the child waited meanwhile for the upload
of everything written so far (and its parent with it, in subprocess.run).

How. FLUSH does not say who closes. So the file layer keeps the process that opened a writable handle
(`process_of` the request's thread), and at a flush asks `holds_for_writing`: does that process still
have a descriptor open for writing on the same file (its mount's device, its inode)? The kernel takes
the closing descriptor out of the closer's table before it sends FLUSH, so the writer's own last close
finds none and commits, as before; a process on its way out has no table left at all. If one is
found, the close is not the writer's last (a fork's, or a dup's): it commits nothing, and the writer's
own close commits later (or the last release does: cpfs/fs.py, `_leave`).

Only /proc is read, never the mount (a stat of a file on it would be a request to this very daemon).
Where /proc cannot tell (a process in another pid namespace, where the request names pid 0; one of
another user, without CAP_SYS_PTRACE; a kernel without `ino` in fdinfo; the opener gone), the answer is
None and the flush commits, as it always did: an unsure answer never holds a commit back.
"""
from __future__ import annotations

import os
from collections.abc import Iterable


def process_of(tid: int) -> int | None:
    """The process (thread group) of thread `tid`: a FUSE request names the calling thread."""
    if tid <= 0:
        return None
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _mounts_of(pid: int, dev: int) -> set[int]:
    """The ids of the mounts of device `dev` that process `pid` sees (bind mounts included)."""
    ids: set[int] = set()
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        for line in f:
            mount_id, _parent, devno = line.split(b" ", 3)[:3]
            major, minor = devno.split(b":")
            if os.makedev(int(major), int(minor)) == dev:
                ids.add(int(mount_id))
    return ids


def _fdinfo(pid: int, fd: str) -> dict[bytes, int]:
    """flags (octal), mnt_id and ino of one of `pid`'s descriptors."""
    out: dict[bytes, int] = {}
    with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
        for line in f:
            key, _, value = line.partition(b":")
            if key in (b"flags", b"mnt_id", b"ino"):
                out[key] = int(value.strip(), 8 if key == b"flags" else 10)
    return out


def holds_for_writing(pid: int, dev: int, ino: int, names: Iterable[str]) -> bool | None:
    """Whether process `pid` has a descriptor open for writing on the file `ino` of device `dev`; None
    if /proc cannot tell. `names`: the file's last path components (hard links), one of which the
    descriptor's link ends with: only those descriptors' fdinfo is read, so a process with thousands of
    sockets costs a readlink each. A link that matches none counts as no descriptor (the flush commits,
    as before). Blocking: /proc reads."""
    try:
        mounts = _mounts_of(pid, dev)
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, ValueError):
        return None
    if not mounts:
        return None
    ends = tuple(f"/{name}{tail}" for name in names for tail in ("", " (deleted)"))
    for fd in fds:
        try:
            if not os.readlink(f"/proc/{pid}/fd/{fd}").endswith(ends):
                continue
            info = _fdinfo(pid, fd)
        except (OSError, ValueError):
            continue                  # closed meanwhile
        if b"ino" not in info or b"mnt_id" not in info:
            return None               # a kernel that does not say (ino came with Linux 5.14)
        if info[b"mnt_id"] in mounts and info[b"ino"] == ino and info[b"flags"] & os.O_ACCMODE != os.O_RDONLY:
            return True
    return False
