"""keepalived's view of the local router, run by the service's own keepalived as root.

    router_check.py health HOST PORT TIMEOUT STATE_FILE
        exit 0 when the local SMG answers 200 within TIMEOUT seconds: GET /health while this
        router holds the address (STATE_FILE says MASTER: it is alive), else GET /readiness (a
        backup, or a router that comes back, takes the address only once it has the workers
        again: it can serve)
    router_check.py notify STATE_FILE TYPE NAME STATE [PRIORITY]
        record keepalived's state (MASTER, BACKUP, FAULT, STOP), for the check and `pdctl status`

keepalived runs the check every few seconds on a host that may be busy: it imports nothing
but socket, os, sys and pathlib (no urllib), and speaks just enough HTTP/1.0 to read a status line.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

STATES = {"MASTER", "BACKUP", "FAULT", "STOP"}


def state(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def health(host: str, port: int, timeout: float, state_file: str) -> int:
    path = b"/health" if state(state_file) == "MASTER" else b"/readiness"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"GET " + path + b" HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
            status = sock.recv(64).split(b"\r\n", 1)[0].split()
    except OSError:
        return 1
    return 0 if len(status) >= 2 and status[1] == b"200" else 1


def notify(path: str, state: str) -> int:
    if state not in STATES:
        return 1
    # Readable by pdctl's SSH user (`pdctl status` reads it without sudo), whatever the
    # umask keepalived runs its scripts with.
    tmp = path + ".new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, (state + "\n").encode())
    finally:
        os.close(fd)
    Path(tmp).replace(path)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "health":
        return health(argv[1], int(argv[2]), float(argv[3]), argv[4])
    if len(argv) >= 5 and argv[0] == "notify":
        return notify(argv[1], argv[4])
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
