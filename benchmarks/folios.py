"""The page-cache folios behind a file's pages (not a test: it prints): how many of its cached pages sit in
large folios (compound pages) and how many in single pages.

Why: a warm `torch.load(mmap=True)` through the mount takes about twice the page faults of the local
file. The kernel maps a large folio's pages in one fault, a single page's in fault-around steps of
64 KiB. ext4 caches files in large folios; this shows whether the FUSE mount's pages (from pushes or
from answers to reads) are, on the running kernel.

    python -m benchmarks.folios FILE [FILE ...]      # root: /proc/kpageflags

Each file is mapped and every page touched (read into the page cache if it was not), then the page
frame of each page is looked up in /proc/self/pagemap and its flags in /proc/kpageflags.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

PAGE = mmap.PAGESIZE
KPF_COMPOUND_HEAD = 15
KPF_COMPOUND_TAIL = 16
PFN_MASK = (1 << 55) - 1
PRESENT = 1 << 63


@dataclass(frozen=True)
class Folios:
    pages: int        # pages of the file
    resident: int     # mapped and present after the touch
    large: int        # in a large folio (head or tail of a compound page)
    heads: int        # large folios

    def describe(self) -> str:
        share = self.large / self.resident if self.resident else 0.0
        avg = self.large / self.heads * PAGE // 1024 if self.heads else 0
        return (f"{self.pages} pages, {self.resident} resident: {self.large} in {self.heads} large folios "
                f"({share:.0%}, {avg} KiB on average), {self.resident - self.large} single pages")


def folios(path: Path) -> Folios:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return Folios(0, 0, 0, 0)
        # Private and writable only so that ctypes can tell its address; never written, so every page
        # stays the page cache's own.
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            with memoryview(m) as view:
                for off in range(0, size, PAGE):    # fault every page in (and read it, if it was not cached)
                    view[off]
            base = _address(m)
            n = -(-size // PAGE)
            resident = large = heads = 0
            with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
                pm.seek(base // PAGE * 8)
                entries = struct.unpack(f"{n}Q", pm.read(8 * n))
                for e in entries:
                    if not e & PRESENT:
                        continue
                    resident += 1
                    kf.seek((e & PFN_MASK) * 8)
                    flags = struct.unpack("Q", kf.read(8))[0]
                    if flags >> KPF_COMPOUND_HEAD & 1:
                        heads += 1
                        large += 1
                    elif flags >> KPF_COMPOUND_TAIL & 1:
                        large += 1
            return Folios(n, resident, large, heads)
        finally:
            m.close()


def _address(m: mmap.mmap) -> int:
    """Where the mapping starts in this process."""
    buf = (ctypes.c_char * 1).from_buffer(m)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("folios: /proc/kpageflags needs root", file=sys.stderr)
        return 2
    for path in args.files:
        print(f"{path}: {folios(path).describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
