"""Run `python -m pdctl` for the tests from a process that has already imported pdctl.

The suite runs the CLI about 1,300 times, mostly `status` polls. A fresh interpreter spends about
a quarter of a CPU-second importing pdctl, click, pydantic and paramiko before the command does
anything, and on the 2 cores CI has that was an eighth of the suite's CPU. So each test process
starts one zygote: an interpreter that imports pdctl's command modules once and then forks a
child per command. The child is a real process of its own (its pid, exit status, signals,
environment, working directory and stdin/stdout/stderr are the caller's) running pdctl's real
`__main__`; only the imports are inherited instead of repeated.

What a fresh interpreter would do differently is undone in the child: the environment is
replaced, tempfile's cached directory is forgotten, SIGCHLD is the default again. Calls that
need a truly fresh interpreter (an environment that changes how Python itself starts, or a test
that inspects what a command imports) run `python -m pdctl` as before, and so does everything
when PDCTL_TEST_EXEC=1.

Protocol, one connection per command: the client sends its stdin, stdout and stderr descriptors
with one byte, then a JSON line {argv, env, cwd}; the zygote forks a supervisor that forks the
command, writes the command's pid as a line, waits for it and writes its wait status as a line.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import locale
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pdctl.cli import COMMANDS


# What a command imports, loaded once: the CLI and every command's module.
def _preload() -> list[str]:
    return ["pdctl.cli", *sorted({target.partition(":")[0] for target in COMMANDS.values()})]


# -- the zygote (runs as `python -m tests.zygote SOCKET`) ------------------------------------


def _run_command(request: dict[str, object]) -> int:
    """In the forked child: become `python -m pdctl ARGS` in the caller's environment."""
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # gettempdir() caches; the child's TMPDIR is the caller's
    os.chdir(str(request["cwd"]))
    args = request["args"]
    assert isinstance(args, list)
    sys.argv = ["-m", *(str(a) for a in args)]  # runpy puts __main__.py's path first
    try:
        runpy.run_module("pdctl", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def _supervise(conn: socket.socket, fds: list[int]) -> None:
    """In the supervisor: fork the command, report its pid, wait, report its status. Returns
    only in the command's process, which then unwinds the zygote's stack and runs the command
    at the top level, so that it exits as `python -m` does (atexit, stdio flush, threads)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        return
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{status}\n".encode())
    conn.close()
    os._exit(0)


def _read_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("the client left before its request")
        data += chunk
    return json.loads(data), list(fds)


def serve(path: str) -> dict[str, object]:
    """Serve until the test process that started the zygote is gone; in a command's process,
    return its request."""
    for module in _preload():
        importlib.import_module(module)
    # Forks share the heap copy-on-write; a collection in a child would touch every page.
    gc.collect()
    gc.freeze()
    if threading.active_count() != 1:
        raise SystemExit("zygote: a preloaded module started a thread; forks would lose it")
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(64)
        server.settimeout(2.0)
        print("ready", flush=True)
        while os.getppid() == parent:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            if os.fork() == 0:
                server.close()
                try:
                    request, fds = _read_request(conn)
                    _supervise(conn, fds)
                except BaseException:
                    os._exit(1)
                return request
            conn.close()
    raise SystemExit(0)


# -- the client (in the test process) --------------------------------------------------------


class _Zygote:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.path = ""

    def socket_path(self) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            return self.path

    def _start(self) -> None:
        directory = tempfile.mkdtemp(prefix="pdctl-zygote.")
        self.path = os.path.join(directory, "sock")
        root = Path(__file__).resolve().parent.parent
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.path],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the pdctl zygote did not start (said {line!r})")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)


_ZYGOTE = _Zygote()


def zygote_pid() -> int:
    """The running zygote's pid (started if it is not)."""
    _ZYGOTE.socket_path()
    assert _ZYGOTE.proc is not None
    return _ZYGOTE.proc.pid


def can_run(overrides: dict[str, str]) -> bool:
    """Whether a command with these environment overrides can run from the zygote: not when
    they change how the interpreter itself starts (PYTHON*), nor under PDCTL_TEST_EXEC=1."""
    if os.environ.get("PDCTL_TEST_EXEC") == "1":
        return False
    return not any(name.startswith("PYTHON") for name in overrides)


def run(
    argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Like subprocess.run(argv, capture_output=True, text=True, stdin=DEVNULL, env=env,
    timeout=timeout) for argv = [python, -m, pdctl, ...], through the zygote."""
    deadline = time.monotonic() + timeout
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_ZYGOTE.socket_path())
        socket.send_fds(conn, [b"F"], [null, out_w, err_w])
        request = {"args": argv[3:], "env": env, "cwd": cwd or os.getcwd()}
        conn.sendall(json.dumps(request).encode() + b"\n")
    finally:
        for fd in (null, out_w, err_w):
            os.close(fd)
    replies = b""
    out: dict[int, bytearray] = {out_r: bytearray(), err_r: bytearray()}
    pid = status = None
    with selectors.DefaultSelector() as sel:
        sel.register(out_r, selectors.EVENT_READ)
        sel.register(err_r, selectors.EVENT_READ)
        sel.register(conn, selectors.EVENT_READ)
        open_ends = 3
        while open_ends:
            left = deadline - time.monotonic()
            if left <= 0:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                for fd in out:
                    os.close(fd)
                conn.close()
                raise subprocess.TimeoutExpired(argv, timeout)
            for key, _ in sel.select(min(left, 1.0)):
                if key.fileobj is conn:
                    chunk = conn.recv(4096)
                    replies += chunk
                    lines = replies.split(b"\n")
                    if pid is None and len(lines) > 1:
                        pid = int(lines[0])
                    if len(lines) > 2:
                        status = int(lines[1])
                else:
                    assert isinstance(key.fileobj, int)
                    chunk = os.read(key.fileobj, 65536)
                    out[key.fileobj] += chunk
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_ends -= 1
    for fd in out:
        os.close(fd)
    conn.close()
    if status is None:
        raise RuntimeError(f"the pdctl zygote lost the command {argv[3:]} (pid {pid})")
    return subprocess.CompletedProcess(
        argv, os.waitstatus_to_exitcode(status), _text(out[out_r]), _text(out[err_r])
    )


def _text(data: bytes | bytearray) -> str:
    """Decoded as subprocess.run(text=True) does: the locale's encoding, universal newlines."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    sys.exit(_run_command(serve(sys.argv[1])))
