"""The scaler's loop (pdctl/scaler/loop.py): which replicas it takes away (never the last routable
one while another starts), its worker scrape (a latency group's p90 and queue from the workers'
/metrics, real HTTP servers on loopback), and its tick when a host or a replica stops answering
(real SSH servers and worker processes)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pdctl.core import layout
from pdctl.core.plan import Plan, Slot, build
from pdctl.core.spec import parse
from pdctl.doors.router import Worker
from pdctl.doors.slots import Actuator, SlotState
from pdctl.scaler.groups import policies, scale_in_order
from pdctl.scaler.loop import Scaler
from pdctl.scaler.store import Store
from tests.support import LAB_SCALING
from tests.unit.core.plan.test_placement import ENV, REPO, fleet, host
from tests.unit.core.scaling.test_observe import sglang_text
from tests.unit.scaler.world import (
    Keys,
    Ticks,
    World,
    make_keys,
    make_world,
    settled,
    unused_router,
)

# ------------------------------------------------------------------ which replicas a scale-in takes


def _slot(index: int) -> Slot:
    return Slot(
        group="prefill",
        index=index,
        host="10.0.0.12",
        address="10.0.0.12",
        gpus=[index],
        port=30000 + 1000 * (index - 1),
        bootstrap_port=8998 + index,
        start=index == 1,
    )


def _serving(*slots: Slot) -> dict[str, Worker]:
    return {s.url: Worker(str(s.index), s.url, "prefill", "ready", True) for s in slots}


def test_nothing_leaves_while_a_running_replica_is_not_yet_routed_to() -> None:
    # A deploy started slot 1; slot 2 serves. Taking slot 2 now would leave no prefill.
    one, two = _slot(1), _slot(2)
    since: dict[str, float] = {}
    victims, starting = scale_in_order(
        [one, two], _serving(two), {}, since, now=100.0, start_timeout=600
    )
    assert victims == [] and starting == ["prefill/1"]
    # Registered but not healthy yet counts as starting too.
    pending = {**_serving(two), one.url: Worker("1", one.url, "prefill", "pending", False)}
    victims, starting = scale_in_order([one, two], pending, {}, since, now=200.0, start_timeout=600)
    assert victims == [] and starting == ["prefill/1"] and since == {"prefill/1": 100.0}


def test_once_in_service_the_newest_leaves_first() -> None:
    one, two, three = _slot(1), _slot(2), _slot(3)
    since = {"prefill/1": 100.0}
    victims, starting = scale_in_order(
        [one, two, three],
        _serving(one, two, three),
        {"prefill/2": 50.0},  # this scaler started slot 2 last; 1 and 3 were there before
        since,
        now=300.0,
        start_timeout=600,
    )
    assert starting == [] and victims == [two, three, one] and since == {}


def test_a_replica_never_routed_to_past_its_start_timeout_leaves_first() -> None:
    one, two = _slot(1), _slot(2)
    since: dict[str, float] = {}
    assert scale_in_order([one, two], _serving(one), {}, since, now=0.0, start_timeout=60)[0] == []
    victims, starting = scale_in_order(
        [one, two], _serving(one), {}, since, now=61.0, start_timeout=60
    )
    assert starting == [] and victims == [two, one]


# ------------------------------------------------------------------------------ the workers' scrape

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
    scaler = Scaler(plan, actuator, unused_router(), store, log=logged.append)
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


# -------------------------------------------------- a tick when a host or a replica stops answering


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def world(tmp_path: Path, keys: Keys) -> Iterator[World]:
    yield from make_world(tmp_path, keys)


def test_a_host_that_stops_answering_is_replaced_elsewhere_and_fenced_on_return(
    world: World,
) -> None:
    ticks = Ticks(world)
    ticks.until("the deployed replicas to be known healthy", lambda: settled(world), 20)
    for _ in range(3):
        ticks.one()
    gpu2 = world.hosts["gpu2"]  # decode/1's host
    assert world.slot("decode/1").host == "gpu2"
    gpu2.freeze()
    # SMG counts a failed prefill+decode request against both: decode/1's failures open
    # prefill/1's circuit breaker too
    world.router.cb_open.add(world.slot("prefill/1").url)
    world.pin("prefill", 2)  # a pin for the other group, while a host hangs
    ticks.until(
        "decode/1 replaced on another host and prefill pinned to 2",
        lambda: (
            world.registered("decode") == {"decode/2"}
            and world.registered("prefill") == {"prefill/1", "prefill/2"}
        ),
        30,
    )
    assert world.slot("decode/2").host != "gpu2"
    assert any(line.startswith("gpu2 lost:") for line in world.logged), world.logged
    ticks.until(
        "prefill/1 registered afresh (a closed breaker)",
        lambda: world.slot("prefill/1").url not in world.router.cb_open,
        20,
    )
    ticks.until(
        "the renewal logged",
        lambda: any("registered prefill/1 afresh" in line for line in world.logged),
        10,
    )
    assert world.unit("decode/1").state == "active"  # untouched: its host cannot be reached
    assert "decode/1" in world.files[layout.SCALER_STATE]  # fenced

    def never_twice() -> None:
        assert "decode/1" not in world.registered("decode"), world.logged[-10:]
        assert len(world.registered("decode")) <= 1

    gpu2.thaw()  # back, with decode/1 running and enabled as before it went
    assert world.unit("decode/1").enabled
    ticks.until(
        "decode/1 stopped and disabled on its returned host",
        lambda: world.unit("decode/1").state == "inactive" and not world.unit("decode/1").enabled,
        30,
        never_twice,
    )
    for _ in range(5):
        ticks.one()
        never_twice()
    assert world.registered("decode") == {"decode/2"}
    assert any("gpu2 answers again" in line for line in world.logged)
    assert "decode/1" not in world.scaler.watch.fenced


def test_a_stop_that_never_returns_holds_up_no_tick_and_no_other_group(world: World) -> None:
    ticks = Ticks(world)
    ticks.until("the deployed replicas to be known healthy", lambda: settled(world), 20)
    world.pin("decode", 2)
    ticks.until("decode at 2", lambda: world.registered("decode") == {"decode/1", "decode/2"}, 20)
    world.hosts[world.slot("decode/2").host].hang_stop.add("decode/2")
    world.pin("decode", 1)  # scale-in: decode/2 (the newest) drains, then its stop hangs
    ticks.until("decode/2 deregistered", lambda: world.registered("decode") == {"decode/1"}, 20)
    world.pin("prefill", 2)
    ticks.until(
        "prefill pinned to 2 while decode/2's stop hangs",
        lambda: world.registered("prefill") == {"prefill/1", "prefill/2"},
        20,
    )
    for _ in range(5):
        ticks.one()
    host = world.hosts[world.slot("decode/2").host]
    assert any(c.split()[2:4] == ["stop", "decode"] for c in host.commands)
    assert world.scaler.pending["decode/2"].action == "stop"  # still in flight, in the background
    assert world.scaler.last["decode"].desired == 1
    assert world.scaler.metrics.running.labels("decode")._value.get() == 1  # leaving: not counted


def test_a_hung_worker_is_replaced_first_then_killed(world: World) -> None:
    ticks = Ticks(world)
    ticks.until("the deployed replicas to be known healthy", lambda: settled(world), 20)
    for _ in range(3):
        ticks.one()
    hung = world.unit("decode/1")
    assert hung.process is not None
    hung.process.send_signal(19)  # SIGSTOP: alive, listening, answering nothing
    started = time.monotonic()
    ticks.until(
        "the spare serving in decode/1's place",
        lambda: world.registered("decode") == {"decode/2"},
        20,
    )
    replaced = time.monotonic() - started
    ticks.until("decode/1 killed", lambda: hung.state == "inactive", 20)
    assert hung.process is None
    unhealthy = [line for line in world.logged if "decode/1 on gpu2 unhealthy" in line]
    assert unhealthy, world.logged
    # detection took about unhealthy_after (1 s), not the old 60 s; the whole replacement a
    # few ticks more
    assert replaced < 15, replaced
    assert world.registered("prefill") == {"prefill/1"}  # the other group untouched


def test_a_worker_systemd_restarted_in_place_is_given_its_start_timeout_not_replaced(
    world: World,
) -> None:
    """An engine that died and came back in its own unit loads again: replacing it after
    unhealthy_after would take the group's only replica out of the router just as it serves."""
    ticks = Ticks(world)
    ticks.until("the deployed replicas to be known healthy", lambda: settled(world), 20)
    for _ in range(3):
        ticks.one()
    decode = world.unit("decode/1")
    host = world.hosts[decode.slot.host]
    host.restart_in_place(decode, after=4 * world.plan.failover.unhealthy_after)
    ticks.until("decode/1 answering again", lambda: decode.port is not None, 20)
    ticks.until("decode/1 known healthy again", lambda: settled(world), 20)
    for _ in range(10):
        ticks.one()
    assert world.registered("decode") == {"decode/1"}, world.logged
    assert world.unit("decode/2").state == "inactive"  # no spare started
    assert not [line for line in world.logged if "unhealthy" in line], world.logged
    restarted = [line for line in world.logged if "systemd restarted its engine" in line]
    assert restarted == [
        f"decode/1 on {decode.slot.host}: systemd restarted its engine in place; it has "
        f"{world.plan.start_timeout} s to answer again before it is replaced"
    ]
