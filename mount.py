#!/usr/bin/env python3
"""python mount.py [--config F] MOUNTPOINT: mount cpfs; returns once the mount is live."""
import sys

from cpfs.cli import main

if __name__ == "__main__":
    sys.exit(main(["mount", *sys.argv[1:]]))
