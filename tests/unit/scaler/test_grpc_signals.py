"""A gRPC group's signals in the scaler: latency from the router's histograms, queue and
in-flight from each routed engine's GetLoads.

The engines are real grpcio servers on loopback serving vLLM's ``VllmEngine.GetLoads`` (the
load each test sets), asked through pdctl's own h2c call (Actuator.loads); the router's text
is SMG's shape (tests/unit/core/scaling/test_router_latency.py); the spec is the lab's vLLM
example switched to ttft/itl, planned as `pdctl deploy` plans it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from pdctl.core.plan import Plan, Slot, build
from pdctl.core.scaling.engine_loads import EngineLoad
from pdctl.core.spec import parse
from pdctl.doors.router import Worker
from pdctl.doors.slots import Actuator, SlotState
from pdctl.scaler.calls import Answer
from pdctl.scaler.groups import policies
from pdctl.scaler.loop import Scaler
from pdctl.scaler.store import Store
from tests.support import LAB_SCALING
from tests.unit.core.plan.test_placement import ENV, REPO, fleet, host
from tests.unit.core.scaling.test_router_latency import scrape
from tests.unit.scaler.world import unused_router

TTFT = "  - count: 1..2\n    scaling:\n      metric: ttft\n      target: 400ms\n"
ITL = "  - count: 1..2\n    scaling:\n      metric: itl\n      target: 60ms\n"


def vllm_plan() -> Plan:
    text = (REPO / "examples/lab/pd-vllm.yml").read_text()
    assert text.count(LAB_SCALING) == 2
    text = text.replace(LAB_SCALING, TTFT, 1).replace(LAB_SCALING, ITL, 1)
    spec, env = parse(text, Path("pd.yml"), ENV)
    hosts = fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    return build(spec, env, hosts, secrets_digest="")


class Engines(pb_grpc.VllmEngineServicer):  # type: ignore[misc]
    """One grpcio server per slot; GetLoads answers what the test set for that slot."""

    def __init__(self) -> None:
        self.loads: dict[int, dict[str, Any]] = {}
        self.servers: dict[tuple[str, int], tuple[grpc.Server, int]] = {}

    def serve(self, slot: Slot) -> None:
        owner, key = self, slot.port

        class One(pb_grpc.VllmEngineServicer):  # type: ignore[misc]
            def GetLoads(self, request: Any, context: Any) -> Any:
                load = pb.SchedulerLoad(dp_rank=0, **owner.loads.get(key, {}))
                return pb.GetLoadsResponse(version="t", dp_rank_count=1, loads=[load])

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_VllmEngineServicer_to_server(One(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.servers[(slot.address, slot.port)] = (server, port)

    def connect(self, address: str, port: int) -> socket.socket:
        found = self.servers.get((address, port))
        if found is None:
            raise ConnectionRefusedError(f"{address}:{port}")
        return socket.create_connection(("127.0.0.1", found[1]), timeout=5)

    def close(self) -> None:
        for server, _ in self.servers.values():
            server.stop(0)


@pytest.fixture
def setup() -> Iterator[tuple[Scaler, Engines, list[str]]]:
    plan = vllm_plan()
    engines = Engines()
    for slot in plan.slots():
        engines.serve(slot)
    actuator = Actuator(plan, None, {}, None, connector=lambda _t: engines.connect)  # type: ignore[arg-type]
    actuator.targets = {s.host: None for s in plan.slots()}  # type: ignore[misc]
    files: dict[str, str] = {}
    logged: list[str] = []
    store = Store(files.get, files.__setitem__)
    scaler = Scaler(plan, actuator, unused_router(), store, log=logged.append)
    yield scaler, engines, logged
    engines.close()


def routed(plan: Plan, role: str) -> tuple[dict[str, SlotState], dict[str, Worker]]:
    states = {s.name: SlotState(s, "active", None) for s in plan.slots()}
    slots = plan.groups[role].slots
    return states, {s.url: Worker(s.name, s.url, role, "ready", True) for s in slots}


def loads(scaler: Scaler, role: str) -> dict[str, Answer[EngineLoad]]:
    """What the tick asks of each routed engine (Actuator.loads), as it gathers the answers."""
    found: dict[str, Answer[EngineLoad]] = {}
    for slot in scaler.plan.groups[role].slots:
        try:
            found[slot.name] = Answer(scaler.actuator.loads(slot, 2.0), None, True)
        except Exception as exc:  # the tick keeps the error as the answer
            found[slot.name] = Answer(None, exc, True)
    return found


def router(scaler: Scaler, now: float, text: str) -> None:
    scaler._scrape(now, Answer(text, None, True))


def test_prefill_scales_on_the_routers_ttft_and_the_engines_queue(
    setup: tuple[Scaler, Engines, list[str]],
) -> None:
    scaler, engines, logged = setup
    plan = scaler.plan
    one, two = plan.groups["prefill"].slots
    policy = policies(plan, {})["prefill"]
    states, routes = routed(plan, "prefill")
    router(scaler, 0.0, scrape([], [], []))
    engines.loads = {one.port: {"num_waiting_reqs": 6, "num_running_reqs": 1}, two.port: {}}
    first = scaler._scrape_workers(
        "prefill", policy, states, routes, 0.0, loads=loads(scaler, "prefill")
    )
    assert first.latency is None and first.serving == 2  # one scrape: no window yet
    assert first.queue_per_replica == pytest.approx(3.0)
    assert first.inflight_per_replica == pytest.approx(0.5)
    router(scaler, 10.0, scrape([], [], [0.9] * 20))  # 20 prefill legs, none streamed
    signals = scaler._scrape_workers(
        "prefill", policy, states, routes, 10.0, loads=loads(scaler, "prefill")
    )
    assert signals.latency is not None and 0.5 < signals.latency <= 1.0
    assert signals.source is not None and "smg_pd_prefill_duration_seconds" in signals.source
    assert logged == []


def test_decode_takes_the_routers_mean_per_token_when_few_requests_stream(
    setup: tuple[Scaler, Engines, list[str]],
) -> None:
    scaler, engines, _ = setup
    plan = scaler.plan
    one, two = plan.groups["decode"].slots
    policy = policies(plan, {})["decode"]
    states, routes = routed(plan, "decode")
    engines.loads = {
        one.port: {"num_running_reqs": 30, "gen_throughput": 300.0},
        two.port: {"num_running_reqs": 10, "num_waiting_reqs": 2, "gen_throughput": 200.0},
    }
    router(scaler, 0.0, scrape([], [], []))
    # 20 requests, none streamed: 0.1 s of prefill, 4.1 s in all, 50 tokens each
    router(scaler, 10.0, scrape([], [], [0.1] * 20, [4.1] * 20, 1000))
    signals = scaler._scrape_workers(
        "decode", policy, states, routes, 10.0, loads=loads(scaler, "decode")
    )
    assert signals.latency == pytest.approx(20 * 4.0 / 1000)
    assert signals.source is not None and "mean seconds per output token" in signals.source
    assert signals.inflight_per_replica == pytest.approx(20.0)
    assert signals.queue_per_replica == pytest.approx(1.0)
    # With streamed traffic the router's own TPOT speaks for it.
    router(scaler, 20.0, scrape([0.1] * 20, [0.03] * 20, [0.1] * 40, [4.1] * 40, 2000))
    streamed = scaler._scrape_workers(
        "decode", policy, states, routes, 20.0, loads=loads(scaler, "decode")
    )
    assert streamed.latency is not None and 0.025 < streamed.latency <= 0.05
    assert streamed.source is not None and "smg_router_tpot_seconds" in streamed.source


def test_an_engine_that_does_not_answer_getloads_is_missing_data_logged_once(
    setup: tuple[Scaler, Engines, list[str]],
) -> None:
    scaler, engines, logged = setup
    plan = scaler.plan
    _, two = plan.groups["decode"].slots
    policy = policies(plan, {})["decode"]
    states, routes = routed(plan, "decode")
    server, _ = engines.servers.pop((two.address, two.port))
    server.stop(0)
    router(scaler, 0.0, scrape([], [], []))
    for now in (10.0, 12.0):
        router(scaler, now, scrape([], [], [0.1] * 20, [2.1] * 20, 400))
        signals = scaler._scrape_workers(
            "decode", policy, states, routes, now, loads=loads(scaler, "decode")
        )
    # The queue and in-flight are unknown (a latency scale-in then does not count on an empty
    # queue); the latency is the router's, which decode/2's silence does not touch.
    assert signals.queue_per_replica is None and signals.inflight_per_replica is None
    assert signals.latency == pytest.approx(0.1)
    assert len([line for line in logged if "GetLoads of decode/2 unavailable" in line]) == 1
