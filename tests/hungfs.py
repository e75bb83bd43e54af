"""A filesystem that never answers: every request waits for good, as a hung NFS server or a stuck FUSE
daemon does. `python tests/hungfs.py MOUNTPOINT` mounts it and prints "ready"; the test ends it by
killing this process (its pid) and unmounting lazily, which fails the requests still waiting."""
from __future__ import annotations

import sys

import pyfuse3
import trio


class Hung(pyfuse3.Operations):
    async def getattr(self, inode, ctx=None):
        await trio.sleep_forever()

    async def lookup(self, parent_inode, name, ctx=None):
        await trio.sleep_forever()

    async def opendir(self, inode, ctx):
        await trio.sleep_forever()

    async def statfs(self, ctx):
        await trio.sleep_forever()


def main() -> None:
    options = set(pyfuse3.default_options)
    options.add("fsname=hungfs")
    pyfuse3.init(Hung(), sys.argv[1], options)
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)


if __name__ == "__main__":
    main()
