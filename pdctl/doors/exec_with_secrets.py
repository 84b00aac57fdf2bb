"""Start a program with secrets added to its environment, read from stdin.

pdctl's runner (pdctl/doors/runner.py) starts ansible-playbook as
``python -I exec_with_secrets.py PROMPT ansible-playbook ARG...`` under ansible-runner's pty.
This prints PROMPT, reads one line of JSON (``{"NAME": "value", ...}``, ``{}`` for a run
without secrets) with the terminal's echo off, and replaces itself with the program, those
variables added to its environment. ansible-runner answers PROMPT from memory (its
``passwords``): the values never pass through a file, an argv or ansible-runner's artifacts,
and the roles read them as a plain ``ansible-playbook`` run does
(``lookup('ansible.builtin.env', NAME)``).

The program is also asked to stop (SIGTERM: Ansible stops its workers) when pdctl dies: a
killed pdctl would otherwise leave it running the playbook with nobody reading its output.
That request is in place before the prompt, and pdctl answers only while alive, so no
program starts without it.

Standard library only: ``-I`` keeps the script's directory and every PYTHON* variable out of
its imports, so it works whichever pdctl is importable from the working directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import termios
from collections.abc import Iterator

_USAGE = 2
_NOT_FOUND = 127  # a shell's code for a program it cannot find, as ansible-runner reports it
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>; kept across execve


def _stop_with_parent() -> None:
    """SIGTERM when the parent (pdctl) dies, where the system offers it (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


@contextlib.contextmanager
def _quiet_raw_input(fd: int) -> Iterator[None]:
    """No echo and no line editing on the terminal at ``fd`` (if it is one), restored after.

    Echo off keeps the value out of the pty output ansible-runner reads; line editing off lifts
    the kernel's cap on a terminal's input line (4095 bytes), which a few long secrets exceed.
    """
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        yield
        return
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)
    quiet[6][termios.VMIN] = 1
    quiet[6][termios.VTIME] = 0
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _read_line(fd: int) -> bytes:
    """Bytes up to the first newline (without it); what follows it, if anything, is dropped."""
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError("stdin closed before a line of secrets arrived")
        line, newline, _rest = chunk.partition(b"\n")
        chunks.append(line)
        if newline:
            return b"".join(chunks)


def parse_secrets(line: bytes) -> dict[str, str]:
    """The JSON object of names to values that pdctl sent; ValueError for anything else."""
    doc = json.loads(line)
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in doc.items()
    ):
        raise ValueError("expected a JSON object of strings")
    return doc


def receive(prompt: str, fd: int = 0) -> dict[str, str]:
    """Ask for the secrets on stdout and read them from ``fd``, echo off before the prompt."""
    with _quiet_raw_input(fd):
        os.write(1, f"{prompt}\n".encode())
        return parse_secrets(_read_line(fd))


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.stderr.write(f"usage: {argv[0]} PROMPT PROGRAM [ARG...]\n")
        return _USAGE
    prompt, program = argv[1], argv[2:]
    _stop_with_parent()
    try:
        secrets = receive(prompt)
    except (OSError, EOFError, ValueError) as exc:
        sys.stderr.write(f"pdctl: no secrets received: {exc}\n")
        return _USAGE
    try:
        # pdctl's own command line (ansible-playbook's): no shell involved.
        os.execvpe(program[0], program, {**os.environ, **secrets})  # noqa: S606
    except OSError as exc:
        sys.stderr.write(f"pdctl: cannot run {program[0]}: {exc}\n")
    return _NOT_FOUND


if __name__ == "__main__":
    sys.exit(main(sys.argv))
