"""keepalived's view of the local router, run by the service's own keepalived as root.

    router_check.py health HOST PORT [TIMEOUT]  exit 0 when SMG answers GET /health with 200
                                                within TIMEOUT seconds (2)
    router_check.py notify FILE TYPE NAME STATE [PRIORITY]
                                                record keepalived's state (MASTER, BACKUP,
                                                FAULT, STOP) in FILE, for `pdctl status`

keepalived runs the check every few seconds on a host that may be busy: it imports nothing
but socket, os and sys (no urllib), and speaks just enough HTTP/1.0 to read a status line.
"""

import os
import socket
import sys

STATES = {"MASTER", "BACKUP", "FAULT", "STOP"}


def health(host: str, port: int, timeout: float) -> int:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"GET /health HTTP/1.0\r\nHost: " + host.encode() + b"\r\n\r\n")
            status = sock.recv(64).split(b"\r\n", 1)[0].split()
    except OSError:
        return 1
    return 0 if len(status) >= 2 and status[1] == b"200" else 1


def notify(path: str, state: str) -> int:
    if state not in STATES:
        return 1
    tmp = path + ".new"
    with open(tmp, "w") as out:
        out.write(state + "\n")
    os.replace(tmp, path)
    return 0


def main(argv: list) -> int:
    if len(argv) >= 3 and argv[0] == "health":
        return health(argv[1], int(argv[2]), float(argv[3]) if len(argv) > 3 else 2.0)
    if len(argv) >= 5 and argv[0] == "notify":
        return notify(argv[1], argv[4])
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
