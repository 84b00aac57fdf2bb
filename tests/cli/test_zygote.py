"""The tests' zygote (tests/zygote.py) runs a command as a fresh `python -m pdctl` would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import zygote
from tests.support import private_tmp, wait_for

CASES = {
    "version": (["--version"], {}),
    "usage error": (["lab", "up", "--hosts", "many"], {}),
    "json error": (["--json", "no-such-command"], {}),
    "json from the environment": (["lab", "status"], {"PDCTL_JSON": "1"}),
    "traceback under PDCTL_DEBUG": (["lab", "up", "--hosts", "0"], {"PDCTL_DEBUG": "1"}),
    "not found": (["--json", "fleet", "show", "nope"], {}),
}


def _env(home: Path, extra: dict[str, str]) -> dict[str, str]:
    tmp = private_tmp(home)
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PDCTL_HOME": str(home), "TMPDIR": str(tmp), **extra}


@pytest.mark.parametrize("case", CASES)
def test_a_command_answers_as_from_a_fresh_interpreter(tmp_path: Path, case: str) -> None:
    args, extra = CASES[case]
    argv = [sys.executable, "-m", "pdctl", *args]
    env = _env(tmp_path / "home", extra)
    fresh = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    forked = zygote.run(argv, env, 60)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )


def test_each_command_has_its_callers_environment_and_directory(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "pdctl", "lab", "status"]
    plain = zygote.run(argv, _env(tmp_path / "a", {}), 60)
    as_json = zygote.run(argv, _env(tmp_path / "b", {"PDCTL_JSON": "1"}), 60)
    again = zygote.run(argv, _env(tmp_path / "a", {}), 60)
    assert plain.stdout == again.stdout and not plain.stdout.startswith("{")
    assert as_json.stdout.startswith("{")
    elsewhere = zygote.run(
        [sys.executable, "-m", "pdctl", "--home", "relative", "fleet", "show", "x"],
        _env(tmp_path / "a", {}),
        60,
        cwd=str(tmp_path),
    )
    assert f"no fleet named 'x' in {tmp_path}/relative/inventories" in elsewhere.stderr


def _descendants(pid: int) -> dict[int, int]:
    """Every process under ``pid``, with its parent."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child in children.get(parent, []):
            found[child] = parent
            todo.append(child)
    return found


@pytest.mark.parametrize("hang", ["unanswered", "stopped"])
def test_a_command_past_its_deadline_is_killed(tmp_path: Path, hang: str) -> None:
    """A `fleet add` to a port that accepts and never speaks SSH outlives a 2 s deadline; so
    does any command once it is stopped (SIGSTOP). Either way the caller gets TimeoutExpired
    at the deadline and the command is gone."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    argv = [sys.executable, "-m", "pdctl", "fleet", "add", "f", "--host", f"127.0.0.1:{port}"]
    env = _env(tmp_path / "home", {})
    zygote.run([sys.executable, "-m", "pdctl", "--version"], env, 60)  # the zygote is up
    root = zygote.zygote_pid()
    before = set(_descendants(root))
    if hang == "stopped":
        stopper = _stop_new_descendants(root, before)
    started = time.monotonic()
    with server:  # open until the end: the command is not let go by a closed connection
        with pytest.raises(subprocess.TimeoutExpired):
            zygote.run(argv, env, 2)
        assert time.monotonic() - started < 6
        if hang == "stopped":
            assert stopper()
        wait_for(lambda: set(_descendants(root)) <= before, timeout=5, what="the command gone")


def _stop_new_descendants(root: int, before: set[int]) -> Callable[[], bool]:
    """Stop (SIGSTOP) the command once it runs under its supervisor (the zygote's child), from
    a thread; returns a call that says whether it was stopped."""
    stopped: list[int] = []

    def stop() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not stopped:
            tree = _descendants(root)
            for pid in sorted(set(tree) - before):
                if tree[pid] == root:
                    continue  # the supervisor, which must live to reap the command
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    continue
                stopped.append(pid)
            time.sleep(0.01)

    thread = threading.Thread(target=stop, daemon=True)
    thread.start()

    def done() -> bool:
        thread.join(6)
        return bool(stopped)

    return done
