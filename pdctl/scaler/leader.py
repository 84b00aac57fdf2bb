"""One scaler acts at a time: the one on the router host that holds the failover address.

Every router host runs the service's scaler; keepalived puts the failover address on one
healthy router, and that host's scaler acts while the others stand by (Leadership). A scaler
that stands by pulls the acting one's recorded state (its groups' histories, so cooldowns
hold across a move, its pins, fences and lost hosts) every tick from the peers' state
servers, each on its router host's own address and the scaler's metrics port, behind the
router's API key (the same on every router host). When the address comes to its host, it
restores that state and acts: the move costs the scaler one tick, and nothing it knew.
"""

from __future__ import annotations

import hmac
import json
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

STATE_PATH = "/state"
PULL_TIMEOUT = 1.0  # seconds per peer: a peer that is gone holds up a standby tick no longer
MAX_STATE = 4 << 20  # bytes: a peer's state larger than this is refused
NONLOCAL_BIND = Path("/proc/sys/net/ipv4/ip_nonlocal_bind")


def holds(address: str) -> bool:
    """Whether this host has ``address`` on one of its interfaces (keepalived put it there):
    a socket binds to a local address only, unless the host allows any (then `ip` says)."""
    try:
        nonlocal_bind = NONLOCAL_BIND.read_text().strip() == "1"
    except OSError:
        nonlocal_bind = False
    if nonlocal_bind:
        out = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
        return any(f" {address}/" in line for line in out.splitlines())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Leadership:
    """How a scaler knows whether it acts, and where the acting one's state comes from."""

    address: str  # the failover address
    holds: Callable[[], bool]
    pull: Callable[[], dict[str, Any] | None]  # the freshest state a peer recorded


def pull_state(peers: list[str], key: str, service: str) -> dict[str, Any] | None:
    """The freshest state of ``service`` among the peers' state servers (``peers``: their
    base URLs); None when none answered with one. What a peer sends is data: a JSON object
    for this service, with a numeric ``at``, or it is ignored."""
    best: dict[str, Any] | None = None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for base in peers:
        if not base.startswith("http://"):
            continue
        request = urllib.request.Request(  # noqa: S310 - http:// only, checked above
            base + STATE_PATH, headers={"Authorization": f"Bearer {key}"}
        )
        try:
            with opener.open(request, timeout=PULL_TIMEOUT) as answer:
                doc = json.loads(answer.read(MAX_STATE + 1)[:MAX_STATE])
        except (OSError, ValueError, urllib.error.URLError):
            continue
        if (
            isinstance(doc, dict)
            and doc.get("service") == service
            and isinstance(doc.get("at"), int | float)
            and (best is None or doc["at"] > best["at"])
        ):
            best = doc
    return best


def serve_state(
    address: str, port: int, key: str, read: Callable[[], str | None]
) -> ThreadingHTTPServer:
    """GET /state on ``address``:``port`` for the peers (Bearer ``key``): what ``read``
    returns (the scaler's last recorded state). Nothing else is served."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                self._send(401, b'{"error": "unauthorized"}')
            elif self.path != STATE_PATH:
                self._send(404, b'{"error": "not found"}')
            else:
                text = read()
                self._send(200 if text else 404, (text or '{"error": "no state"}').encode())

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="pdctl-scaler-state", daemon=True).start()
    return server
