"""`make flake`: find flaky tests before CI does.

Runs the unit, CLI, lab stand-in and bench tests (and any lab modules named) several times in
a row while a CPU hog keeps one core busy, the way a loaded CI machine or a developer's busy
laptop runs them. Every run is a fresh pytest process with the suite's own options; the summary
names each test that failed and in which runs. Exit 0 only when every run passed.

    python scripts/flake.py [--runs N] [--workers N] [--no-hog] [TEST_PATH ...]
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PATHS = ("tests/unit", "tests/cli", "tests/lab", "tests/bench")
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)
# pytest's closing line, with or without its === border (-q drops it)
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|errors?)\b.* in [\d.]+s.*?)\s*=*$", re.M)
RUN_LIMIT_SECS = 1800  # one run of the unit and CLI tests takes about 2 minutes when loaded


def _burn() -> None:
    while True:
        pass


def _run(index: int, runs: int, paths: list[str], workers: int) -> tuple[bool, list[str], str]:
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        str(workers),
        "--dist",
        "loadfile",
        *paths,
    ]
    started = time.monotonic()
    try:
        proc = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=RUN_LIMIT_SECS, check=False
        )
    except subprocess.TimeoutExpired:
        print(f"flake: run {index}/{runs}: no end within {RUN_LIMIT_SECS} s", flush=True)
        return False, [f"(run {index} timed out)"], ""
    out = proc.stdout + proc.stderr
    summary = SUMMARY.findall(out)
    line = summary[-1] if summary else f"exit {proc.returncode}, no pytest summary"
    took = time.monotonic() - started
    print(f"flake: run {index}/{runs}: {line} ({took:.0f} s)", flush=True)
    # pytest's exit 5 (no tests collected) is a failure too: a run that tested nothing
    # proves nothing.
    return proc.returncode == 0, sorted(set(FAILED.findall(out))), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="how many runs (default 10)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (2)")
    parser.add_argument("--no-hog", action="store_true", help="no CPU hog (a quiet machine)")
    parser.add_argument("paths", nargs="*", help="lab modules to add to the unit and CLI tests")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    paths = [*DEFAULT_PATHS, *args.paths]
    hog = None
    if not args.no_hog:
        hog = multiprocessing.Process(target=_burn, daemon=True)
        hog.start()
        print(f"flake: a CPU hog (pid {hog.pid}) keeps one core busy", flush=True)
    failures: dict[str, list[int]] = defaultdict(list)
    passed = 0
    try:
        for index in range(1, args.runs + 1):
            ok, failed, out = _run(index, args.runs, paths, args.workers)
            passed += ok
            for test in failed or ([] if ok else [f"(run {index}: see its output)"]):
                failures[test].append(index)
            if not ok:
                log = REPO / ".pytest-flake" / f"run-{index}.log"
                log.parent.mkdir(exist_ok=True)
                log.write_text(out)
                print(f"flake: run {index}'s output: {log}", flush=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.join()
    print(f"flake: {passed} of {args.runs} runs passed ({' '.join(paths)})")
    for test, runs in sorted(failures.items()):
        print(f"flake: FAILED {test} in run(s) {', '.join(map(str, runs))}")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
