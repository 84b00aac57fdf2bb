"""The one place pdctl talks HTTP to SMG: worker registration, readiness, metrics.

Connections come from a connector (host, port) -> socket-like object, so the
same client works over a plain TCP socket (tests on loopback) or through an
SSH channel to the router host (its metrics listen on 127.0.0.1 only). SMG's worker API
and metrics as this client reads them: docs/facts.md.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdctl.core.errors import HostError

Connector = Callable[[str, int], Any]
REQUESTS_TOTAL = "smg_router_requests_total"
CB_STATE = "smg_worker_cb_state"  # per worker: 0 closed, 1 open, 2 half-open
CB_OPEN = 1.0


def tcp_connector(timeout: float = 5.0) -> Connector:
    return lambda host, port: socket.create_connection((host, port), timeout=timeout)


class _Connection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, connector: Connector, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._connector = connector

    def connect(self) -> None:
        self.sock = self._connector(self.host, self.port)
        # Every read by the request's own timeout, whatever the connector set (a peer that
        # stopped answering must not hold a caller longer than it asked).
        settimeout = getattr(self.sock, "settimeout", None)
        if settimeout is not None and self.timeout is not None:
            settimeout(self.timeout)


@dataclass
class Response:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"null")


def request(
    connector: Connector,
    host: str,
    port: int,
    method: str,
    path: str,
    *,
    body: Any = None,
    token: str | None = None,
    timeout: float = 10.0,
) -> Response:
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    connection = _Connection(host, port, connector, timeout)
    try:
        connection.request(method, path, body=data, headers=headers)
        response = connection.getresponse()
        return Response(status=response.status, body=response.read())
    except (OSError, http.client.HTTPException) as exc:
        raise HostError(
            f"{method} http://{host}:{port}{path} failed: {exc}",
            hint="is the router (or worker) running? `pdctl status`",
        ) from exc
    finally:
        connection.close()


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    worker_type: str
    status: str
    healthy: bool
    bootstrap_port: int | None = None


class Router:
    """SMG's worker-management API and its metrics."""

    def __init__(
        self,
        address: str,
        port: int,
        metrics_port: int,
        api_key: str | None,
        connector: Connector,
        timeout: float = 10.0,
    ) -> None:
        self.address, self.port, self.metrics_port = address, port, metrics_port
        self.api_key, self.connector = api_key, connector
        self.timeout = timeout  # each call's answer, unless the call says otherwise
        # The service's other routers. Without SMG's mesh, each knows only the workers it is
        # told of: a registration and a removal are made on each. With the mesh, a removal is
        # (it gives a worker back to a router that dropped it while another still lists it),
        # a registration is not (the same URL posted to two meshed routers becomes two
        # registrations the mesh never merges: docs/facts.md).
        self.peers: list[Router] = []

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    def _call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> Response:
        return request(
            self.connector,
            self.address,
            self.port,
            method,
            path,
            body=body,
            token=self.api_key,
            timeout=self.timeout if timeout is None else timeout,
        )

    def workers(self) -> list[Worker]:
        response = self._call("GET", "/workers")
        if response.status != 200:
            raise HostError(
                f"router GET /workers answered {response.status}: {response.body[:200]!r}"
            )
        return [
            Worker(
                id=str(w.get("id")),
                # SMG may list a worker's URL with a slash at the end; a plan's never has one
                url=str(w.get("url")).rstrip("/"),
                worker_type=str(w.get("worker_type")),
                status=str(w.get("status") or ""),
                healthy=bool(w.get("is_healthy")),
                bootstrap_port=w.get("bootstrap_port"),
            )
            for w in response.json().get("workers") or []
        ]

    def add_worker(self, registration: dict[str, Any], drain_settle_secs: int = 2) -> bool:
        """Register a worker (``registration``: its POST /workers body, pdctl/core/plan/model.py's
        Slot.registration()); False when SMG already had it (409)."""
        body = {**registration, "health": {"drain_settle_secs": drain_settle_secs}}
        url = body.get("url")
        response = self._call("POST", "/workers", body)
        if response.status in {200, 201, 202}:
            return True
        if response.status == 409:
            return False
        raise HostError(f"router refused worker {url}: {response.status} {response.body[:200]!r}")

    def remove_worker(self, worker_id: str) -> None:
        response = self._call("DELETE", f"/workers/{worker_id}")
        if response.status not in {200, 202, 204, 404}:
            raise HostError(f"router could not remove worker {worker_id}: {response.status}")

    def add_to_peers(self, registration: dict[str, Any]) -> list[str]:
        """Register the worker on every peer (one that has it already is fine); the peers
        that could not be asked (a router that is down holds no one up: each call has its
        deadline)."""
        missed = []
        for peer in self.peers:
            try:
                peer.add_worker(registration)
            except (HostError, OSError) as exc:
                missed.append(f"{peer.address}: {exc}")
        return missed

    def remove_from_peers(self, url: str) -> list[str]:
        """Remove the worker at ``url`` from every peer that lists it; the peers that could not
        be asked (a router that is down holds no one up: each call has its deadline)."""
        missed = []
        for peer in self.peers:
            try:
                worker = peer.find(url)
                if worker is not None:
                    peer.remove_worker(worker.id)
            except (HostError, OSError) as exc:
                missed.append(f"{peer.address}: {exc}")
        return missed

    def find(self, url: str) -> Worker | None:
        return next((w for w in self.workers() if w.url == url.rstrip("/")), None)

    def ready(self) -> bool:
        try:
            return self._call("GET", "/readiness", timeout=5).status == 200
        except HostError:
            return False

    def metrics_text(self) -> str:
        response = request(self.connector, "127.0.0.1", self.metrics_port, "GET", "/metrics")
        if response.status != 200:
            raise HostError(f"router metrics answered {response.status}")
        return response.body.decode(errors="replace")


def samples(text: str, name: str) -> Iterable[tuple[dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                yield sample.labels, float(sample.value)


def requests_total(text: str) -> float:
    """Client requests served so far: smg_router_requests_total summed over its labels."""
    return sum(value for _, value in samples(text, REQUESTS_TOTAL))


def open_circuits(text: str) -> set[str]:
    """The worker URLs whose circuit breaker is open (SMG rejects them without trying)."""
    try:
        return {
            labels["worker"].rstrip("/")
            for labels, value in samples(text, CB_STATE)
            if value == CB_OPEN and "worker" in labels
        }
    except ValueError:
        return set()
