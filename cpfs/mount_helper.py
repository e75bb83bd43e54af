"""`mount.cpfs`: the helper mount(8) runs for fstab lines and systemd mount units.

mount(8) calls `/sbin/mount.<type> SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS]`; for `-t fuse.cpfs` that is
`/sbin/mount.fuse.cpfs` (a link to this script, see README "Mounting on nodes"). SOURCE is the config
file (`cpfs` or `default` for $CPFS_CONFIG / the embedded default). OPTIONS are mount(8)'s comma list:
our own `config=`, `log_file=`, `log_level=`; mount(8) and systemd bookkeeping (`rw`, `defaults`,
`_netdev`, `nofail`, `x-systemd.*`, ...) is accepted and ignored; anything else is an error, so a typo
never silently mounts something other than what the fstab line says. It returns once the mount is live,
as `python mount.py` does.
"""
from __future__ import annotations

import sys

from .cli import main as cli_main

# Options mount(8), systemd or fstab conventions pass along that mean nothing to a FUSE daemon here.
_IGNORED = {"rw", "defaults", "auto", "noauto", "user", "nouser", "users", "_netdev", "nofail", "dev",
            "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime", "relatime", "nodiratime",
            "async", "sync", "owner", "group"}
_IGNORED_PREFIXES = ("x-", "comment=", "fsname=", "subtype=")
_OURS = {"config": "--config", "log_file": "--log-file", "log_level": "--log-level"}


class UsageError(Exception):
    pass


def parse(argv: list[str]) -> list[str]:
    """mount(8)'s arguments -> the `cpfs mount` command line."""
    positional: list[str] = []
    options: list[str] = []
    args = iter(argv)
    for a in args:
        if a == "-o":
            options += next(args, "").split(",")
        elif a.startswith("-o"):
            options += a[2:].split(",")
        elif a in ("-s", "-f", "-n", "-v"):     # sloppy, fake, no mtab, verbose: nothing to do here
            if a == "-f":
                raise UsageError("-f (fake mount) is not supported")
        elif a.startswith("-"):
            raise UsageError(f"unknown flag {a!r}")
        else:
            positional.append(a)
    if len(positional) != 2:
        raise UsageError("usage: mount.cpfs CONFIG|cpfs MOUNTPOINT [-o OPTIONS]")
    source, mountpoint = positional
    out = ["mount", mountpoint]
    if source not in ("cpfs", "default"):
        out += ["--config", source]
    for opt in filter(None, options):
        key, eq, value = opt.partition("=")
        if opt in _IGNORED or opt.startswith(_IGNORED_PREFIXES):
            continue
        if key == "ro":
            raise UsageError("read-only mounts are not supported yet (remove 'ro')")
        if key not in _OURS or not eq or not value:
            raise UsageError(f"unknown mount option {opt!r} (cpfs takes config=, log_file=, log_level=)")
        if key == "config" and "--config" in out:
            raise UsageError("config given twice (as SOURCE and as config=)")
        out += [_OURS[key], value]
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"mount.cpfs: {e}", file=sys.stderr)
        return 1
    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
