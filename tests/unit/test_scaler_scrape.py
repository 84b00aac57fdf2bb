"""The scaler's worker scrape: a latency group's p90 and queue from the workers' /metrics.

The workers are real HTTP servers on loopback answering SGLang's text format; the spec is
the lab example switched to ttft/itl, planned as `pdctl deploy` plans it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pdctl.plan import Plan, Slot, build
from pdctl.router import Worker
from pdctl.scaler.loop import Scaler, Store, policies
from pdctl.slots import Actuator, SlotState
from pdctl.spec import parse
from tests.support import LAB_SCALING
from tests.unit.test_observe import sglang_text
from tests.unit.test_plan import ENV, REPO, fleet, host

TTFT = "  - count: 1..2\n    scaling:\n      metric: ttft\n      target: 400ms\n"
ITL = "  - count: 1..2\n    scaling:\n      metric: itl\n      target: 60ms\n"


def latency_plan() -> Plan:
    text = (REPO / "examples/lab/pd.yml").read_text()
    text = text.replace(LAB_SCALING, TTFT, 1).replace(LAB_SCALING, ITL, 1)
    text = text.replace("--disaggregation-mode ", "--enable-metrics --disaggregation-mode ")
    spec, env = parse(text, Path("pd.yml"), ENV)
    hosts = fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    return build(spec, env, hosts, secrets_digest="")


class Workers:
    """One loopback HTTP server per slot, answering /metrics with what the test sets."""

    def __init__(self) -> None:
        self.text: dict[str, str] = {}
        self.servers: dict[tuple[str, int], ThreadingHTTPServer] = {}

    def serve(self, slot: Slot) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.text.get(slot.name, "").encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers[(slot.address, slot.port)] = server

    def stop(self, slot: Slot) -> None:
        server = self.servers.pop((slot.address, slot.port))
        server.shutdown()
        server.server_close()

    def connect(self, address: str, port: int) -> socket.socket:
        """The slot's address and port, reached on the loopback server standing for it."""
        server = self.servers.get((address, port))
        if server is None:
            raise ConnectionRefusedError(f"{address}:{port}")
        return socket.create_connection(server.server_address[:2], timeout=5)  # type: ignore[arg-type]


@pytest.fixture
def setup() -> Iterator[tuple[Scaler, Workers, list[str]]]:
    plan = latency_plan()
    workers = Workers()
    for slot in plan.groups["prefill"].slots:
        workers.serve(slot)
    actuator = Actuator(plan, None, {}, None, connector=lambda _t: workers.connect)  # type: ignore[arg-type]
    actuator.targets = {s.host: None for s in plan.slots()}  # type: ignore[misc]
    files: dict[str, str] = {}
    logged: list[str] = []
    store = Store(files.get, files.__setitem__)
    scaler = Scaler(plan, actuator, None, store, log=logged.append)  # type: ignore[arg-type]
    yield scaler, workers, logged
    for key in list(workers.servers):
        server = workers.servers.pop(key)
        server.shutdown()
        server.server_close()


def routed(plan: Plan) -> tuple[dict[str, SlotState], dict[str, Worker]]:
    slots = plan.groups["prefill"].slots
    states = {s.name: SlotState(s, "active", None) for s in plan.slots()}
    return states, {s.url: Worker(s.name, s.url, "prefill", "ready", True) for s in slots}


def test_the_plan_carries_each_groups_metric_to_the_policy() -> None:
    found = policies(latency_plan(), {})
    assert (found["prefill"].metric, found["prefill"].target) == ("ttft", pytest.approx(0.4))
    assert (found["decode"].metric, found["decode"].target) == ("itl", pytest.approx(0.06))


def test_p90_and_queue_summed_over_the_routed_replicas(
    setup: tuple[Scaler, Workers, list[str]],
) -> None:
    scaler, workers, logged = setup
    plan = scaler.plan
    one, two = plan.groups["prefill"].slots
    policy = policies(plan, {})["prefill"]
    states, routes = routed(plan)
    workers.text = {one.name: sglang_text([], queue=2), two.name: sglang_text([], queue=0)}
    first = scaler._scrape_workers("prefill", policy, states, routes, now=0.0)
    assert first.latency is None and first.serving == 2  # one scrape: no window yet
    workers.text = {
        one.name: sglang_text([0.3] * 9, queue=4, running=3),
        two.name: sglang_text([0.3] * 9 + [0.7] * 2, queue=2, running=1),
    }
    signals = scaler._scrape_workers("prefill", policy, states, routes, now=10.0)
    assert signals.latency == pytest.approx(0.5)  # rank 18 of 20 ends the (0.25, 0.5] bucket
    assert signals.queue_per_replica == pytest.approx(3.0)
    assert signals.inflight_per_replica == pytest.approx(2.0)
    assert logged == []


def test_an_unreachable_replica_is_logged_once_and_its_data_goes_stale(
    setup: tuple[Scaler, Workers, list[str]],
) -> None:
    scaler, workers, logged = setup
    plan = scaler.plan
    one, two = plan.groups["prefill"].slots
    policy = policies(plan, {})["prefill"]
    states, routes = routed(plan)
    workers.text = {one.name: sglang_text([0.1]), two.name: sglang_text([0.1])}
    scaler._scrape_workers("prefill", policy, states, routes, now=0.0)
    workers.stop(two)
    for now in (10.0, 12.0, 14.0):
        signals = scaler._scrape_workers("prefill", policy, states, routes, now=now)
    assert signals.queue_per_replica is None  # one replica did not say
    assert len([line for line in logged if "metrics of prefill/2 unavailable" in line]) == 1
    later = scaler._scrape_workers("prefill", policy, states, routes, now=60.0)
    assert later.latency is None  # prefill/2's last scrape is 60 s old: missing, hold
