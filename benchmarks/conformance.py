"""POSIX conformance: pjdfstest (github.com/pjd/pjdfstest) run inside a real cpfs mount.

    sudo .venv/bin/python -m benchmarks.conformance [--source DIR|URL] [--jobs 4] [--only chmod,rename]

Fetches pjdfstest (a git clone of --source, default the GitHub repository; a local clone or mirror
works too) into a temporary folder, builds it there (autoreconf, configure, make: apt packages
autoconf, automake and a C compiler), never inside the project. Mounts cpfs over three folder stores
(replicas 2) with `[mount] allow_other = true`, since the suite acts as several users, and runs every
`tests/<syscall>/*.t` from inside the mount, as `prove -r tests` does (each .t is a shell script that
prints TAP). Prints, per syscall folder, the tests that pass out of those planned, the total, and every
failing test line; `--json FILE` keeps them. Must run as root (the suite chowns and switches users).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import mounted, print_table

DEFAULT_SOURCE = "https://github.com/pjd/pjdfstest"
FILE_TIMEOUT = 600.0


@dataclass
class FileResult:
    name: str                    # "chmod/00.t"
    planned: int
    passed: int
    failures: list[str] = field(default_factory=list)    # "not ok" lines, and a note for missing ones
    seconds: float = 0.0


def build(source: str, into: Path) -> Path:
    """Clone and build pjdfstest under `into`; returns the source folder (binary at its top)."""
    src = into / "pjdfstest"
    subprocess.run(["git", "clone", "-q", "--depth", "1", source, str(src)], check=True)
    for cmd in (["autoreconf", "-ifs"], ["./configure"], ["make", "pjdfstest"]):
        r = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"building pjdfstest: {' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return src


def write_config(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["replicas = 2", 'chunk_size = "1MiB"', "[mount]", "allow_other = true", "[cache]", 'memory = "256MiB"']
    for i in range(3):
        lines += ["[[store]]", f'name = "s{i}"', f'url = "stores/s{i}"']
    path = folder / "cpfs.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def parse_tap(name: str, out: str, seconds: float) -> FileResult:
    plan = re.search(r"^1\.\.(\d+)", out, re.MULTILINE)
    planned = int(plan.group(1)) if plan else 0
    seen: set[int] = set()
    passed = 0
    failures = []
    for line in out.splitlines():
        m = re.match(r"(not )?ok (\d+)", line)
        if not m:
            continue
        seen.add(int(m.group(2)))
        if m.group(1) and "# TODO" not in line:
            failures.append(f"{name}: {line.strip()}")
        else:
            passed += 1     # as prove counts: a TODO test passes whatever it printed
    missing = planned - len(seen)
    if missing > 0:
        failures.append(f"{name}: {missing} planned tests never reported (the script stopped)")
    if not plan:
        failures.append(f"{name}: no TAP plan in the output: {out[-300:]!r}")
    return FileResult(name, planned, passed, failures, seconds)


def run_file(test: Path, tests: Path, workdir: Path) -> FileResult:
    name = str(test.relative_to(tests))
    here = workdir / name.replace("/", "_")
    here.mkdir()
    t0 = time.monotonic()
    try:
        r = subprocess.run(["/bin/sh", str(test)], cwd=here, capture_output=True, text=True, timeout=FILE_TIMEOUT)
        out = r.stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n# timed out after {FILE_TIMEOUT:.0f} s\n"
    return parse_tap(name, out, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=os.environ.get("PJDFSTEST_SOURCE", DEFAULT_SOURCE),
                    help="git URL or local clone of pjdfstest (env PJDFSTEST_SOURCE)")
    ap.add_argument("--built", type=Path, help="an already built pjdfstest folder (skips clone and build)")
    ap.add_argument("--jobs", type=int, default=4, help="test files run at once")
    ap.add_argument("--only", default="", help="comma-separated syscall folders (default: all)")
    ap.add_argument("--json", type=Path, help="write the per-file results here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("pjdfstest must run as root (it chowns and acts as other users)")
    for tool in ("git", "autoreconf", "make", "cc"):
        if not args.built and shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing (apt-get install git autoconf automake build-essential)")
    with tempfile.TemporaryDirectory(prefix="cpfs-conformance-") as tmp_name:
        tmp = Path(tmp_name)
        os.chmod(tmp, 0o755)         # other users must reach the mountpoint inside
        src = args.built or build(args.source, tmp)
        tests = src / "tests"
        only = {s for s in args.only.split(",") if s}
        files = sorted(t for t in tests.glob("*/*.t") if not only or t.parent.name in only)
        config = write_config(tmp / "cfg")
        t0 = time.monotonic()
        with mounted(config, tmp / "mnt", tmp / "daemon.log") as m:
            work = m.path / "conformance"
            work.mkdir()
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                results = list(pool.map(lambda t: run_file(t, tests, work), files))
        took = time.monotonic() - t0
        for line in m.warnings()[:20]:
            print(f"daemon: {line}")
    folders: dict[str, list[FileResult]] = {}
    for r in results:
        folders.setdefault(r.name.split("/")[0], []).append(r)
    rows = []
    for name, rs in sorted(folders.items()):
        planned, passed = sum(r.planned for r in rs), sum(r.passed for r in rs)
        rows.append([name, str(len(rs)), str(passed), str(planned), f"{100 * passed / max(planned, 1):.1f}%"])
    planned, passed = sum(r.planned for r in results), sum(r.passed for r in results)
    rows.append(["TOTAL", str(len(results)), str(passed), str(planned), f"{100 * passed / max(planned, 1):.1f}%"])
    print(f"\npjdfstest through a cpfs mount ({took:.0f} s, {args.jobs} files at once)")
    print_table(["syscall", "files", "passed", "tests", "pass"], rows)
    failures = [f for r in results for f in r.failures]
    if failures:
        print(f"\n{len(failures)} failing tests:")
        for f in failures:
            print(f"  {f}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
