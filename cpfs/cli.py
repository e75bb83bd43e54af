"""The `cpfs` command: put, ls, inspect, cat, rm, log, restore, gc, scrub, mount.

User errors print one line without a traceback: exit 2 for bad configuration, 1 for anything else.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from . import buffers, daemon, identity, roster, stats
from .cache import ChunkCache
from .catalog import Catalog, Unreadable, VersionRef
from .config import GC_GRACE_FLOOR, Config, load_config, parse_duration
from .errors import ConfigError, CpfsError, ManifestError, NotFound, StoreError, StoreUnavailable
from .holds import Holds
from .importer import Importer, Tree
from .manifest import Summary, normalize_path
from .pool import StorePool
from .readahead import Scheduler
from .tensor_index import TensorIndex
from .voidjournal import VoidJournal


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


_background: contextvars.ContextVar[trio.Nursery] = contextvars.ContextVar("cpfs_background")


async def _run(command: Callable[[Config, argparse.Namespace], Awaitable[int]], config: Config,
               args: argparse.Namespace) -> int:
    """A command, with a nursery for the pool's background work (store health), cancelled at its end."""
    async with trio.open_nursery() as n:
        _background.set(n)
        try:
            return await command(config, args)
        finally:
            n.cancel_scope.cancel()


async def _open(config: Config, *, writes: bool = False, refill: bool = False) -> tuple[StorePool, Catalog]:
    """The stores, checked before anything is read or written; a command that `writes` enrolls its
    config in the stores' roster first, refusing a blank store unless it will `refill` it
    (cpfs/roster.py)."""
    pool = StorePool(config)
    await pool.check()
    if not writes:
        await identity.check(pool)          # a store of another deployment: refused (enroll checks too)
    # The roster's layouts, for every command: a listing must reach where any writer put versions.
    listed = await roster.enroll(pool, refill=refill) if writes else (await roster.read(pool))[0]
    await _background.get().start(pool.run)
    catalog = Catalog(pool, journal=VoidJournal.for_config(config))
    roster.take(catalog, listed)
    return pool, catalog


async def cmd_put(config: Config, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    src = Path(args.src)
    if not src.exists():
        raise NotFound(f"{src}: no such file or folder")
    tree = Tree.of(src, args.dereference) if src.is_dir() else Tree(files=(src,))
    pool, catalog = await _open(config, writes=True)
    t0 = time.monotonic()
    with tqdm(total=tree.size, unit="B", unit_scale=True, unit_divisor=1024, disable=not sys.stderr.isatty(),
              desc="put", file=sys.stderr) as bar:
        importer = Importer(pool, catalog, progress=bar.update)
        manifests = await importer.put(src, args.dest, tree)
    s = importer.stats
    dt = time.monotonic() - t0
    ratio = "inf (no new chunk data)" if s.new_raw_bytes == 0 else f"{s.dedup_ratio:.2f}"
    print(f"put {s.files} file(s), {_human(s.logical_bytes)} in {dt:.1f}s ({_human(s.logical_bytes / dt)}/s): "
          f"new chunk data {_human(s.new_raw_bytes)}, stored {_human(s.new_stored_bytes)} "
          f"over {config.replicas} replicas, dedup ratio {ratio}")
    links = sum(1 for m in manifests if m.symlink)
    folders = len(manifests) - s.files - links
    also = ([f"{links} symbolic link(s), kept as links (-L imports what they point to)"] if links else []) + \
        ([f"{folders} empty folder(s)"] if folders else [])
    if also:
        print("and " + ", ".join(also))
    for m in manifests:
        if m.symlink:
            print(f"  {m.path} -> {m.symlink}")
        elif m.directory:
            print(f"  {m.path}/")
        else:
            print(f"  {m.path}  {m.size} bytes  {len(m.chunks)} chunks"
                  f"{'  tensor index: ' + str(len(m.tensor_index['tensors'])) + ' tensors' if m.tensor_index else ''}")
    return 0


def _children(manifests: dict[str, Summary | Unreadable],
              path: str) -> tuple[list[str], list[Summary | Unreadable]]:
    prefix = "/" if path == "/" else path + "/"
    dirs, files = set(), []
    for p, m in manifests.items():
        if p.startswith(prefix):
            rest = p[len(prefix):]
            if "/" in rest:
                dirs.add(rest.split("/", 1)[0])
            elif isinstance(m, Summary) and m.directory:
                dirs.add(rest)
            else:
                files.append(m)
    return sorted(dirs), sorted(files, key=lambda m: m.path)


async def cmd_ls(config: Config, args: argparse.Namespace) -> int:
    _, catalog = await _open(config)
    manifests = await catalog.load_all()
    path = "/" if args.path in (None, "", "/") else normalize_path(args.path)
    if not catalog.whole(manifests):
        logging.getLogger(__name__).warning("cannot list store(s) %s: files whose versions are all there are "
                                            "not shown", ", ".join(sorted(manifests.missed)))
    m = manifests.get(path)
    if m is not None and not (isinstance(m, Summary) and m.directory):
        files, dirs = [m], []
    else:
        dirs, files = _children(manifests, path)
        if not dirs and not files and path != "/" and m is None:
            raise NotFound(f"{path}: no such file or folder")
    for d in dirs:
        print(f"{'-':>12}  {'':19}  {d}/")
    for m in files:
        name = m.path.rsplit('/', 1)[1]
        if isinstance(m, Unreadable):
            print(f"{'?':>12}  {'(unreadable manifest)':19}  {name}")
            continue
        link = f" -> {m.symlink}" if m.symlink else ""
        print(f"{m.size:>12}  {_when(m.mtime_ns)}  {name}{link}")
    return 0


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


async def cmd_inspect(config: Config, args: argparse.Namespace) -> int:
    _, catalog = await _open(config)
    m = await catalog.get(normalize_path(args.path))
    per_store: dict[str, int] = {}
    for c in m.chunks:
        for s in c.stores:
            per_store[s] = per_store.get(s, 0) + 1
    index = TensorIndex.from_json(m.tensor_index) if m.tensor_index else None
    if args.json:
        head, body = m.to_bytes().split(b"\n")
        doc = {**json.loads(head), **json.loads(body)}
        doc["chunks_per_store"] = per_store
        doc["compression_ratio"] = m.size / m.stored_bytes if m.stored_bytes else 1.0
        print(json.dumps(doc, indent=1))
        return 0
    print(f"path        {m.path}")
    print(f"size        {m.size} ({_human(m.size)})")
    print(f"chunks      {len(m.chunks)} (chunk size {_human(m.chunk_size)}; "
          f"{sum(c.codec == 'lz4' for c in m.chunks)} lz4, {sum(c.codec == 'raw' for c in m.chunks)} raw)")
    print(f"stored      {_human(m.stored_bytes)} per replica, compression ratio "
          f"{m.size / m.stored_bytes if m.stored_bytes else 1:.2f}")
    print("replicas    " + ", ".join(f"{s}: {n} chunks" for s, n in sorted(per_store.items())))
    print(f"mtime       {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.mtime_ns / 1e9))}  "
          f"mode {oct(m.mode)}  version {m.version}")
    if index is None:
        print("tensors     (no tensor index)")
        return 0
    print(f"tensors     {len(index.tensors)} ({index.format}, {len(index.records)} records)")
    width = max((len(t.name) for t in index.tensors), default=4)
    print(f"  {'name':<{width}}  {'dtype':<9}  {'shape':<18}  {'offset':>12}  {'length':>12}")
    for t in index.tensors:
        print(f"  {t.name:<{width}}  {t.dtype:<9}  {str(list(t.shape)):<18}  {t.offset:>12}  {t.length:>12}")
    return 0


async def cmd_cat(config: Config, args: argparse.Namespace) -> int:
    pool, catalog = await _open(config)
    path = normalize_path(args.path)
    m = await (catalog.get(path) if args.version is None else catalog.get_version(path, args.version))
    sched = Scheduler(ChunkCache(max(config.readahead_max * 2, 8 * config.chunk_size)), pool.fetch_chunk, config)
    # Held as a mount holds what it has open (cpfs/holds.py): a cat into a slow pipe may outlast the
    # version's retirement by newer commits, and a gc meanwhile would delete the chunks it has yet to read.
    holds = Holds(pool)
    await _background.get().start(holds.run)
    hold = holds.take(m)
    out = sys.stdout.buffer
    try:
        async with trio.open_nursery() as n:
            reader = await sched.open(n, m, None)
            step = config.chunk_size
            for off in range(0, m.size, step):
                data = await reader.read(off, step)
                await trio.to_thread.run_sync(out.write, data)
            await reader.aclose()
        await trio.to_thread.run_sync(out.flush)
    finally:
        holds.drop(hold)
        with trio.move_on_after(daemon.SHARE_AT_UNMOUNT):
            await holds.aclose()        # not deleted (a store hangs, ^C): it lapses after gc_grace
    return 0


async def cmd_rm(config: Config, args: argparse.Namespace) -> int:
    _, catalog = await _open(config, writes=True)
    for p in await rm_targets(catalog, normalize_path(args.path), args.recursive):
        await catalog.remove(p)
        print(f"removed {p}")
    return 0


async def rm_targets(catalog: Catalog, path: str, recursive: bool) -> list[str]:
    """What `cpfs rm [-r] PATH` removes, in order: the file, or the folder's files, deepest first,
    then the folder. A folder (or a path not seen) whose stores could not all be listed is refused:
    the listing may have missed files, and rm removed what it saw and said it was done. A file is
    looked up alone: loading every path took 5-15 s at 20,000 paths (the gc audit)."""
    try:
        current = await catalog.current(path)
    except (NotFound, ManifestError, StoreError):
        current = None                      # a folder's, unreadable, or unlisted: the whole listing tells
    if current is not None and not current.directory:
        return [path]
    manifests = await catalog.load_all()

    def is_dir(p: str) -> bool:
        return isinstance(manifests[p], Summary) and manifests[p].directory    # type: ignore[union-attr]

    inside = [p for p in manifests if p.startswith(path + "/")]
    below = sorted(p for p in inside if not is_dir(p)) + sorted((p for p in inside if is_dir(p)),
                                                                 key=lambda p: -p.count("/"))
    m = manifests.get(path)
    if m is not None and not (isinstance(m, Summary) and m.directory):
        targets = [path]
    else:
        if not catalog.whole(manifests):     # a folder's files, or the path itself, may be unlisted
            missed = sorted(manifests.missed)
            raise StoreUnavailable(missed[0], f"cannot list store(s) {', '.join(missed)}: {path} may hold "
                                   f"files this listing did not see; nothing removed")
        if m is None and not below:
            raise NotFound(f"{path}: no such file or folder")
        if below and not recursive:
            raise CpfsError(f"{path}: is a folder (use -r)")
        targets = below + ([path] if m is not None else [])      # deepest first, the folder last
    return targets


async def cmd_log(config: Config, args: argparse.Namespace) -> int:
    """The kept versions of a path, newest first: what happened to it (commits, failed saves, removal)."""
    _, catalog = await _open(config)
    path = normalize_path(args.path)
    infos = await catalog.history(path)
    if not infos:
        raise NotFound(f"{path}: no versions (never committed, retired, or a removed path whose history gc purged)")
    rows = []
    for i in infos:
        m = i.summary
        rows.append({"version": i.ref.version, "time": m.committed_ns if m else None,
                     "size": m.size if m else None, "host": m.host if m else None, "writer": i.ref.writer,
                     "state": i.ref.state if m else "unreadable",
                     "reason": (m.reason or await _moved(catalog, path, i.ref)) if m else i.error,
                     "current": i.current})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'':1} {'version':>20}  {'committed':19}  {'size':>14}  {'state':8}  host / writer")
    for r in rows:
        when = _when(r["time"]) if r["time"] else "-"
        size = "-" if r["size"] is None else str(r["size"])
        print(f"{'*' if r['current'] else ' '} {r['version']:>20}  {when:19}  {size:>14}  {r['state']:8}  "
              f"{r['host'] or '-'} / {r['writer'] or '-'}{'  ' + r['reason'] if r['reason'] else ''}")
    return 0


async def _moved(catalog: Catalog, path: str, ref: VersionRef) -> str:
    """Where a version committed by a rename went ("renamed to"), or came from ("renamed from"): a
    removal that said only "deleted" looked like a rotation that took the checkpoint."""
    if not ref.txn or ref.state not in ("ok", "deleted"):
        return ""
    written, removed = await catalog.moved(ref.txn)
    mine, theirs = (removed, written) if ref.state == "deleted" else (written, removed)
    if path not in mine or not theirs:
        return ""
    other = theirs[mine.index(path)] if len(mine) == len(theirs) else ", ".join(theirs[:3]) + \
        (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
    return f"renamed {'to' if ref.state == 'deleted' else 'from'} {other}"


async def cmd_restore(config: Config, args: argparse.Namespace) -> int:
    _, catalog = await _open(config, writes=True)
    path = normalize_path(args.path)
    m = await catalog.restore(path, args.version)
    print(f"restored {path} to the content of version {args.version} as version {m.version} "
          f"({m.size} bytes); undo with: cpfs restore {path} <previous version>")
    return 0


async def cmd_scrub(config: Config, args: argparse.Namespace) -> int:
    """Check (and with --repair restore) every copy of every chunk and manifest; cpfs/scrub.py."""
    from tqdm import tqdm

    from .scrub import Scrubber, render

    pool, catalog = await _open(config, writes=args.repair, refill=args.repair)
    scrubber = Scrubber(pool, catalog)

    def draw(bar: tqdm) -> None:
        s = scrubber.statistics()
        chunks = s.phase in ("chunks", "done")
        bar.unit = " chunks" if chunks else " manifest copies"
        bar.total = s.chunks_total if chunks else None
        bar.n = s.chunks if chunks else s.manifest_copies
        bar.set_description(s.phase)
        bar.set_postfix_str(f"{s.bytes_read / 2**20:.0f} MiB read, {s.found} problems")

    async def show(bar: tqdm) -> None:
        while True:
            draw(bar)
            await trio.sleep(0.2)

    with tqdm(disable=args.json or not sys.stderr.isatty(), file=sys.stderr) as bar:
        async with trio.open_nursery() as n:
            if not bar.disable:
                n.start_soon(show, bar)
            report = await scrubber.run([args.path] if args.path else [], repair=args.repair)
            n.cancel_scope.cancel()
        if not bar.disable:
            draw(bar)
    print(json.dumps(report.to_json(), indent=1) if args.json else render(report))
    return 0 if report.ok else 1


async def cmd_stats(config: Config, args: argparse.Namespace) -> int:
    """A mount's live figures, from its control file (cpfs/stats.py); --watch adds rates."""
    control = Path(args.mountpoint) / stats.CONTROL_NAME

    def read() -> dict:
        try:
            doc = json.loads(control.read_bytes())
        except OSError as e:
            raise CpfsError(f"{args.mountpoint}: no cpfs mount there ({e.strerror})") from None
        except ValueError:      # a file of that name in a folder that is no cpfs mount
            raise CpfsError(f"{control}: not a cpfs mount's figures (no cpfs mount there?)") from None
        if not isinstance(doc, dict):
            raise CpfsError(f"{control}: not a cpfs mount's figures (no cpfs mount there?)")
        return doc

    before = None
    while True:
        now = await trio.to_thread.run_sync(read)
        out = json.dumps(now, indent=1) if args.json else stats.render(now, before)
        print(out + ("\n" if args.watch else ""), flush=True)
        if not args.watch:
            return 0
        before = now
        await trio.sleep(args.watch)


async def cmd_gc(config: Config, args: argparse.Namespace) -> int:
    """Delete unreferenced chunks and leftovers older than the grace (cpfs/gc.py); exit 1 if it refused
    or a request failed."""
    from .gc import GarbageCollector

    grace = config.gc_grace if args.grace is None else args.grace
    if grace < config.gc_grace:
        raise ConfigError(f"--grace {grace:g}s is below gc_grace ({config.gc_grace:g}s) of {config.source}: "
                          f"mounts refresh a chunk they reuse only once it is older than gc_grace/2, so a "
                          f"shorter grace could delete one a commit in flight counts on (lower gc_grace for "
                          f"the mounts first)")
    pool, _ = await _open(config)
    report = await GarbageCollector(pool, grace=grace, dry_run=args.dry_run, forget=args.forget_store).run()
    print(json.dumps(report.to_json(), indent=1) if args.json else "\n".join(report.lines(_human)))
    return 0 if report.ok else 1


def _grace(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds < GC_GRACE_FLOOR:
        raise argparse.ArgumentTypeError(f"must be at least {GC_GRACE_FLOOR:g}s, got {text!r}")
    return seconds


def cmd_mount(config: Config, args: argparse.Namespace) -> int:
    mountpoint = Path(args.mountpoint).absolute()
    daemon.check_mountpoint(mountpoint)
    daemon.check_mount_place(config, mountpoint)
    level = (args.log_level or config.log_level).upper()
    if args.foreground:
        daemon.setup_logging(level, args.log_file)
        return daemon.run_foreground(config, mountpoint, args.ready_fd)
    argv = ["mount", str(mountpoint), "--log-level", level]
    if args.config:
        argv += ["--config", str(Path(args.config).absolute())]
    log_file = Path(args.log_file) if args.log_file else daemon.default_log_file()
    return daemon.launch(argv, log_file)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpfs", description="A filesystem for ML checkpoints.")
    p.add_argument("--config", help="TOML config (default: $CPFS_CONFIG, else the embedded default)")
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    s = sub.add_parser("put", parents=[common], help="import a file or folder")
    s.add_argument("src")
    s.add_argument("dest", nargs="?")
    s.add_argument("-L", "--dereference", action="store_true",
                   help="follow symbolic links in a folder and import what they point to (default: keep them as links)")
    s = sub.add_parser("ls", parents=[common], help="list a folder")
    s.add_argument("path", nargs="?")
    s = sub.add_parser("inspect", parents=[common], help="chunks, replicas, tensor index of a file")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("cat", parents=[common], help="write a file's verified bytes to stdout")
    s.add_argument("path")
    s.add_argument("--version", type=int, help="an older kept version (see cpfs log)")
    s = sub.add_parser("log", parents=[common], help="the kept versions of a file, newest first")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("restore", parents=[common], help="make an older version current (a new commit)")
    s.add_argument("path")
    s.add_argument("version", type=int)
    s = sub.add_parser("rm", parents=[common], help="remove a file (or, with -r, a folder)")
    s.add_argument("path")
    s.add_argument("-r", "--recursive", action="store_true")
    s = sub.add_parser("scrub", parents=[common], help="check every copy of every chunk and manifest")
    s.add_argument("path", nargs="?", help="only the files at or under PATH")
    s.add_argument("--repair", action="store_true", help="restore `replicas` good copies of everything")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("stats", parents=[common], help="a mount's live figures (stores, cache, readahead)")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
                   help="print again every SECONDS (1), with rates over the interval")
    s = sub.add_parser("gc", parents=[common], help="delete chunks no kept version names (older than the grace)")
    s.add_argument("--dry-run", action="store_true", help="report what would be deleted, delete nothing")
    s.add_argument("--json", action="store_true")
    s.add_argument("--grace", type=_grace, metavar="DURATION",
                   help="only objects older than this (default: gc_grace; not below it, nor below the "
                        "longest gc_grace of the stores' roster)")
    s.add_argument("--forget-store", action="append", default=[], metavar="NAME",
                   help="a store retired for good (its copies moved by scrub --repair): it leaves the "
                        "stores' roster, which otherwise makes gc refuse a config without it")
    s = sub.add_parser("mount", parents=[common], help="mount; returns once the mount is live")
    s.add_argument("mountpoint")
    s.add_argument("--foreground", action="store_true", help="stay attached; SIGINT/SIGTERM unmount")
    s.add_argument("--log-file")
    s.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    s.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    return p


COMMANDS = {"put": cmd_put, "ls": cmd_ls, "inspect": cmd_inspect, "cat": cmd_cat, "rm": cmd_rm,
            "log": cmd_log, "restore": cmd_restore, "gc": cmd_gc, "stats": cmd_stats, "scrub": cmd_scrub}


def _leaves(e: BaseException) -> list[BaseException]:
    """The errors inside (nested) exception groups, as trio nurseries raise them."""
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [e]


def _report(args: argparse.Namespace, e: CpfsError) -> int:
    """One line on stderr (and to the mount launcher); exit 2 for bad configuration, else 1."""
    bad_config = isinstance(e, ConfigError)
    line = f"{'config error' if bad_config else 'error'}: {e}"
    ready_fd = getattr(args, "ready_fd", None) if args.command == "mount" else None
    if args.command == "mount" and (ready_fd is not None or args.log_file):
        logging.getLogger("cpfs.daemon").error("%s", e)    # the daemon's log says why it stopped
    if ready_fd is not None:
        with contextlib.suppress(OSError):                 # the launcher prints it; it may be gone
            os.write(ready_fd, f"ERROR {'config error: ' if bad_config else ''}{e}\n".encode())
    else:
        print(f"cpfs: {line}", file=sys.stderr)
    return 2 if bad_config else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = load_config(args.config)
        if args.command == "mount":
            return cmd_mount(config, args)
        daemon.log_to(logging.StreamHandler(sys.stderr), "cpfs: %(levelname)s: %(message)s", logging.WARNING)
        # Names print as the bytes they are (as ls does), whatever the locale's codec: one that is no
        # UTF-8 (LANG=C, not coerced) failed on the first non-ASCII name with a traceback.
        sys.stdout.reconfigure(encoding="utf-8", errors="surrogateescape")  # type: ignore[union-attr]
        if args.command in ("put", "scrub"):
            buffers.keep_freed_memory()        # they encode or copy chunk after chunk
        return trio.run(_run, COMMANDS[args.command], config, args)
    except (CpfsError, BrokenPipeError, BaseExceptionGroup) as e:
        leaves = _leaves(e)
        if all(isinstance(leaf, BrokenPipeError) for leaf in leaves):
            return 1
        errors = [leaf for leaf in leaves if isinstance(leaf, CpfsError)]
        if len(errors) != len(leaves):
            raise
        return _report(args, errors[0])


if __name__ == "__main__":
    sys.exit(main())
