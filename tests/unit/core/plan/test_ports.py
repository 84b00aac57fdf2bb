"""Listeners are judged per host, after placement: pdctl's own ports (worker ranges, bootstrap
and side channel ports, its default router and metrics ports, the scaler's) step past what is
taken on their host; only ports the user set that truly meet on one host are refused, naming
the host and both owners; the same ports on different hosts are fine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdctl.core.errors import InputError
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import Held, Plan, build, held_by
from pdctl.core.spec import parse
from pdctl.operations import sharing
from pdctl.operations.planning import plan_table
from tests.support import assert_apart, lab_service

REPO = Path(__file__).resolve().parents[4]
ENV = {"HF_TOKEN": "hf_value"}
OK = Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00", checks=[])
LAB = (REPO / "examples/lab/pd.yml").read_text()
METRICS = "    metrics_port: 29000\n"  # what lab_service writes under pdctl.router


def host(name: str, address: str, kind: str = "gpu") -> FleetHost:
    gpus = {"count": 8 if kind == "gpu" else 0, "model": "MI300X"}
    facts = {"cpus": 96, "memory_gb": 1024.0, "gpus": gpus}
    return FleetHost(name=name, address=address, user="root", kind=kind, facts=facts, preflight=OK)


def fleet(cpu: bool = True) -> Fleet:
    hosts = [host("cpu1", "10.0.0.1", "cpu")] if cpu else []
    return Fleet(name="f", hosts=[*hosts, host("gpu1", "10.0.0.11"), host("gpu2", "10.0.0.12")])


def service(name: str, port: int = 8000, metrics: int | None = None, count: int = 1) -> str:
    """The lab example as service ``name``: its router on ``port``, its metrics port set in
    the spec only when ``metrics`` is given (else pdctl's default)."""
    text = lab_service(LAB, name, port, 29000, count)
    if metrics is None:
        return text.replace(METRICS, "")
    return text.replace(METRICS, f"    metrics_port: {metrics}\n")


def plan(text: str, held: list[Held] | None = None, cpu: bool = True) -> Plan:
    spec, env = parse(text, Path("pd.yml"), ENV)
    return build(spec, env, fleet(cpu), secrets_digest="", held=held or [])


def refusal(text: str, held: list[Held] | None = None, cpu: bool = True) -> str:
    with pytest.raises(InputError) as caught:
        plan(text, held, cpu)
    return caught.value.one_line()


def on_gpu1(text: str) -> str:
    """The router on gpu1, beside workers (pdctl.router.host)."""
    assert text.count("\n  router:\n") == 1  # pdctl.router
    return text.replace("\n  router:\n", "\n  router:\n    host: gpu1\n")


# ---------------------------------------------------------------- the router beside workers


def test_a_router_beside_workers_keeps_its_port_and_the_workers_step_past_it() -> None:
    """dstack's habit: the router and every worker on one port (30000, pdctl's worker base)."""
    text = on_gpu1(service("a", port=30000))
    planned = plan(text)
    assert (planned.router.host, planned.router.port) == ("gpu1", 30000)
    beside = [(s.name, s.port, s.bootstrap_port) for s in planned.slots() if s.host == "gpu1"]
    assert beside == [("prefill/1", 31000, 8999)]  # position 0 would hold 30000
    elsewhere = [s.port for s in planned.slots() if s.host == "gpu2"]
    assert elsewhere == [30000]  # another host: the same port is fine
    assert planned.router.metrics_port == 29000 and planned.scaler_metrics_port == 29100
    assert_apart(planned)


def test_pdctls_worker_ports_step_past_the_routers_metrics_beside_them() -> None:
    """Worker ports from 29000 on the router's host, where the router's metrics are: the
    first position steps, the metrics and the scaler keep pdctl's defaults."""
    text = on_gpu1(service("a")).replace("pdctl:\n", "pdctl:\n  ports: {base: 29000}\n", 1)
    planned = plan(text)
    slot = next(s for s in planned.slots() if s.host == "gpu1")
    assert slot.port == 30000
    assert next(s for s in planned.slots() if s.host == "gpu2").port == 29000
    assert planned.router.metrics_port == 29000 and planned.scaler_metrics_port == 29100
    assert_apart(planned)


def test_the_plan_table_shows_each_slots_ports() -> None:
    rows = plan_table(plan(on_gpu1(service("a", port=30000))))
    assert rows[0][:6] == ("router", "gpu1", "-", "-", "30000", "metrics 29000, scaler 29100")
    prefill = next(r for r in rows if r[0] == "prefill/1")
    assert prefill[4:6] == ("31000-31999", "bootstrap 8999")


# ---------------------------------------------------------------- two services on one fleet


def test_a_second_services_default_ports_step_past_the_firsts() -> None:
    """b sets neither its port nor its metrics port: both step past a's on the router host,
    and the plan says where its endpoint went."""
    a = plan(service("a"))
    text = service("b").replace("port: 8000\nmodel:", "model:")
    b = plan(text, held_by(a))
    assert (b.router.port, b.router.metrics_port, b.scaler_metrics_port) == (8001, 29001, 29101)
    assert any("port 8000 is taken on cpu1: the router listens on 8001" in n for n in b.notes)
    assert_apart(a, b)


def test_a_port_the_user_set_that_another_service_holds_is_refused_naming_both() -> None:
    a = plan(service("a"))
    line = refusal(service("b", metrics=29001), held_by(a))  # port: 8000, as a's router
    assert line.startswith("cpu1: the router of service b cannot listen on port 8000: ")
    assert "service a's router does" in line
    line = refusal(service("b", port=8001, metrics=29000), held_by(a))
    assert "cpu1: port 29000 for service b's router's metrics is taken by service a's" in line
    assert "pdctl.router.metrics_port" in line


def test_the_same_ports_on_different_hosts_are_fine() -> None:
    a = plan(service("a", port=8000, metrics=29000))
    text = on_gpu1(service("b", port=8000, metrics=29000))  # a's router is on cpu1
    b = plan(text, held_by(a))
    assert (b.router.host, b.router.port, b.router.metrics_port) == ("gpu1", 8000, 29000)
    assert_apart(a, b)


def test_a_users_router_port_in_another_services_worker_range_is_refused() -> None:
    a = plan(service("a"))  # its prefill/1 holds 30000-30999 on gpu1
    line = refusal(on_gpu1(service("b", port=30500)), held_by(a))
    assert line.startswith("gpu1: the router of service b cannot listen on port 30500: ")
    assert "service a's prefill/1 does" in line


# ---------------------------------------------------------------- ports the user set, meeting


def test_two_ports_the_user_set_on_one_host_are_refused_naming_the_host_and_both() -> None:
    line = refusal(service("a", port=8000, metrics=8000))
    assert line.startswith("cpu1: port 8000 is wanted by the router (port) and by the ")
    assert "router's metrics (pdctl.router.metrics_port), both set in the spec" in line


# ---------------------------------------------------------------- vLLM's kv_port and kv_ip

PRODUCER = '{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer"%s}'
CONSUMER = '{"kv_connector":"P2pNcclConnector","kv_role":"kv_consumer"%s}'


def vllm(kv: str = ', "kv_port": 14579', count: int = 1, gpus: int = 4, name: str = "v") -> str:
    def group(role: str, config: str) -> str:
        command = f"vllm serve m --grpc --kv-transfer-config '{config % kv}'"
        return (
            f"  - name: {role}\n    count: {count}\n    commands:\n      - {json.dumps(command)}\n"
            f"    resources:\n      gpu: MI300X:{gpus}\n"
        )

    return (
        f"type: service\nname: {name}\nimage: img:1\nport: 8000\nreplicas:\n"
        "  - count: 1\n    router: {type: sglang}\n"
        + group("prefill", PRODUCER)
        + group("decode", CONSUMER)
    )


def test_kv_port_is_reserved_on_each_slots_host_for_its_ranks() -> None:
    planned = plan(vllm(gpus=4))
    slots = {s.name: s for s in planned.slots()}
    assert {n: (s.host, s.kv_port) for n, s in slots.items()} == {
        "prefill/1": ("gpu1", 14579),
        "decode/1": ("gpu2", 14579),  # the same port on another host: fine
    }
    assert slots["prefill/1"].env()["PDCTL_KV_PORT"] == "14579"
    assert "kv 14579-14582" in next(r for r in plan_table(planned) if r[0] == "prefill/1")[5]


def test_two_slots_with_one_kv_port_on_a_host_are_refused_naming_both() -> None:
    line = refusal(vllm(count=2, gpus=4))  # two 4-GPU prefills share gpu1
    assert line.startswith("gpu1: port 14579 is wanted by prefill/1's KV connector (kv_port in ")
    assert "and by prefill/2's KV connector" in line


def test_pdctls_worker_ports_step_past_a_kv_port_in_their_range() -> None:
    planned = plan(vllm(kv=', "kv_port": 30000'))
    assert {(s.port, s.kv_port) for s in planned.slots()} == {(31000, 30000)}
    assert_apart(planned)


def test_another_services_kv_ports_are_held_whether_planned_here_or_read_from_a_host() -> None:
    a = plan(vllm(name="a"))
    line = refusal(vllm(name="b").replace("port: 8000", "port: 8001"), held_by(a))
    assert "gpu1: port 14579 for service b's prefill/1's KV connector is taken by service a's" in (
        line
    )
    report = json.dumps(
        {"slots": [["x", "prefill-1", {"PDCTL_GPU_IDS": "0,1", "PDCTL_KV_PORT": "14579"}]]}
    )
    held = sharing.parse_report("gpu1", report)
    assert Held("x", "gpu1", "prefill/1's KV connector", ports=(14579, 14580)) in held
    assert "taken by service x's prefill/1's KV connector" in refusal(vllm(), held)


def test_a_kv_ip_must_be_an_address_of_each_slots_host() -> None:
    for fine in ('"0.0.0.0"', '"127.0.0.1"', '"::"'):
        plan(vllm(kv=f', "kv_port": 14579, "kv_ip": {fine}'))
    line = refusal(vllm(kv=', "kv_ip": "10.0.0.11"'))  # gpu1's: decode/1 lands on gpu2
    assert line.startswith("gpu2: decode/1's --kv-transfer-config sets kv_ip 10.0.0.11")


def test_a_kv_port_or_ip_that_is_no_port_or_address_is_refused_at_parse() -> None:
    for kv, said in ((', "kv_port": 70000', "kv_port 70000"), (', "kv_ip": "h"', "kv_ip 'h'")):
        with pytest.raises(InputError) as caught:
            parse(vllm(kv=kv), Path("pd.yml"), ENV)
        assert said in caught.value.one_line()
