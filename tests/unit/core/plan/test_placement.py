"""The placement plan: pure, deterministic, no slot sharing a GPU or a port."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pdctl.core.entrypoint import worker_script
from pdctl.core.errors import CheckFailed, InputError
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import (
    CONTAINER_PROVIDER_LIB,
    SCALER_METRICS_PORT,
    Held,
    Plan,
    build,
    held_by,
    plan_from_extravars,
    router_args,
)
from pdctl.core.spec import load, parse
from pdctl.operations import drift
from tests.support import assert_apart, lab_service

REPO = Path(__file__).resolve().parents[4]
ENV = {"HF_TOKEN": "hf_value"}


def host(
    name: str,
    kind: str = "gpu",
    gpus: int = 8,
    ok: bool = True,
    model: str = "AMD Instinct MI300X",
    cpus: int = 96,
) -> FleetHost:
    facts = {
        "cpus": cpus,
        "memory_gb": 1024.0,
        "gpus": {"count": gpus if kind == "gpu" else 0, "model": model},
    }
    checks = [
        {"name": "ssh", "ok": True, "message": "ok"},
        {"name": "rdma_ports", "ok": ok, "message": "x"},
    ]
    return FleetHost(
        name=name,
        address=f"10.0.0.{len(name) + int(name[-1])}",
        user="root",
        kind=kind,
        facts=facts,
        preflight=Preflight(ok=ok, checked_at="2026-01-01T00:00:00+00:00", checks=checks),
    )


def fleet(*hosts: FleetHost) -> Fleet:
    return Fleet(name="f", hosts=list(hosts))


def lab_spec() -> tuple:
    return load(REPO / "examples/lab/pd.yml", ENV)


def test_lab_example_on_one_cpu_and_two_gpu_hosts() -> None:
    spec, env = lab_spec()
    plan = build(
        spec, env, fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2")), secrets_digest=""
    )
    assert plan.router.host == "cpu1"
    placed = {(s.name, s.host, tuple(s.gpus), s.start) for s in plan.slots()}
    # The minimum replicas first, spread over the hosts; the spares fill the rest.
    assert placed == {
        ("prefill/1", "gpu1", (0, 1, 2, 3), True),
        ("decode/1", "gpu2", (0, 1, 2, 3), True),
        ("prefill/2", "gpu1", (4, 5, 6, 7), False),
        ("decode/2", "gpu2", (4, 5, 6, 7), False),
    }


def test_no_gpu_or_port_is_shared_and_ports_are_apart() -> None:
    spec, env = load(REPO / "examples/pd-amd-mi300x.yml", ENV)
    plan = build(
        spec,
        env,
        fleet(host("cpu1", "cpu"), *(host(f"gpu{i}") for i in range(1, 5))),
        secrets_digest="",
    )
    by_host: dict[str, list] = {}
    for slot in plan.slots():
        by_host.setdefault(slot.host, []).append(slot)
    for slots in by_host.values():
        gpus = [g for s in slots for g in s.gpus]
        assert len(gpus) == len(set(gpus)) <= 8
        ports = sorted(s.port for s in slots)
        assert all(b - a >= 300 for a, b in itertools.pairwise(ports))  # SGLang uses port+233
        boots = [s.bootstrap_port for s in slots if s.bootstrap_port]
        assert len(boots) == len(set(boots))
        assert not set(boots) & {p + d for p in ports for d in range(0, 300)}
    assert [len(plan.groups[r].slots) for r in ("prefill", "decode")] == [4, 4]
    assert all(s.bootstrap_port is None for s in plan.groups["decode"].slots)


def test_router_takes_a_gpu_host_when_there_is_no_cpu_host() -> None:
    spec, env = lab_spec()
    plan = build(spec, env, fleet(host("gpu1"), host("gpu2")), secrets_digest="")
    assert plan.router.host == "gpu1"


def test_failed_hosts_are_never_used_and_say_why() -> None:
    spec, env = lab_spec()
    plan = build(
        spec,
        env,
        fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2"), host("gpu3", ok=False)),
        allow_partial=False,
        secrets_digest="",
    )
    assert "gpu3" not in {s.host for s in plan.slots()}
    assert plan.excluded_hosts["gpu3"] == "failed preflight (rdma_ports)"


def test_not_enough_capacity_is_refused_unless_partial() -> None:
    spec, env = lab_spec()
    small = fleet(host("cpu1", "cpu"), host("gpu1"))  # 8 GPUs; the max needs 16
    with pytest.raises(CheckFailed) as caught:
        build(spec, env, small, secrets_digest="")
    assert (
        "prefill: 1 of 2 slots fit" in caught.value.message
        or "decode: 1 of 2 slots fit" in caught.value.message
    )
    assert "--allow-partial" in (caught.value.hint or "")
    plan = build(spec, env, small, allow_partial=True, secrets_digest="")
    assert [plan.groups[r].max for r in ("prefill", "decode")] == [1, 1]


def test_even_the_minimum_not_fitting_is_refused_always() -> None:
    spec, env = lab_spec()
    with pytest.raises(CheckFailed, match="even the minimum"):
        build(
            spec,
            env,
            fleet(host("cpu1", "cpu"), host("gpu1", gpus=4)),
            allow_partial=True,
            secrets_digest="",
        )


def test_gpu_model_is_checked_against_facts() -> None:
    spec, env = lab_spec()
    plan_fleet = fleet(
        host("cpu1", "cpu"), host("gpu1"), host("gpu2"), host("gpu3", model="AMD Instinct MI250X")
    )
    plan = build(spec, env, plan_fleet, secrets_digest="")
    assert plan.excluded_hosts["gpu3"] == "GPU model AMD Instinct MI250X is not MI300X"


def test_plan_is_deterministic() -> None:
    spec, env = load(REPO / "examples/pd-amd-mi300x.yml", ENV)
    hosts = [host("cpu1", "cpu"), *(host(f"gpu{i}") for i in range(1, 5))]
    first = json.dumps(
        build(spec, env, fleet(*hosts), secrets_digest="").extravars(), sort_keys=True
    )
    second = json.dumps(
        build(spec, env, fleet(*reversed(hosts)), secrets_digest="").extravars(), sort_keys=True
    )
    assert first == second


def test_worker_script_uses_the_slot_ports() -> None:
    spec, _ = lab_spec()
    prefill = worker_script(spec.group("prefill").commands, "prefill")
    assert "--port $PDCTL_PORT" in prefill and "--port 8000" not in prefill
    assert "--disaggregation-bootstrap-port $PDCTL_BOOTSTRAP_PORT" in prefill
    decode = worker_script(spec.group("decode").commands, "decode")
    assert "bootstrap-port" not in decode and decode.startswith("set -e\nexec python3 -m sglang")


def test_missing_flags_are_added() -> None:
    text = (REPO / "tests/data/dstack-pd.yml").read_text().replace("--host 0.0.0.0 \\\n", "")
    spec, _ = parse(text, Path("x.yml"), ENV)
    script = worker_script(spec.group("decode").commands, "decode")
    assert "--host $PDCTL_HOST" in script and "--port $PDCTL_PORT" in script


def test_router_flags_keep_policies_and_drop_what_pdctl_sets() -> None:
    spec, _ = load(REPO / "examples/pd-amd-mi300x.yml", ENV)
    assert router_args(spec) == [
        "--prefill-policy",
        "cache_aware",
        "--decode-policy",
        "least_load",
    ]
    dstack, _ = load(REPO / "tests/data/dstack-pd.yml", ENV)  # no router group: pdctl's defaults
    assert router_args(dstack) == [
        "--prefill-policy",
        "round_robin",
        "--decode-policy",
        "round_robin",
    ]


def test_provider_library_is_mounted_once() -> None:
    spec, env = load(REPO / "examples/pd-amd-mi300x.yml", ENV)
    plan = build(
        spec,
        env,
        fleet(host("cpu1", "cpu"), *(host(f"gpu{i}") for i in range(1, 5))),
        secrets_digest="",
    )
    mounts = [v for v in plan.volumes if v.split(":")[1] == CONTAINER_PROVIDER_LIB]
    assert len(mounts) == 1 and mounts[0].endswith(":ro")
    dstack, env2 = load(REPO / "tests/data/dstack-pd.yml", ENV)
    hosts = [host("cpu1", "cpu"), *(host(f"gpu{i}") for i in range(1, 4))]
    plan2 = build(dstack, env2, fleet(*hosts), allow_partial=True, secrets_digest="")
    assert plan2.volumes == [
        f"/usr/lib64/libibverbs/libbnxt_re-rdmav34.so:{CONTAINER_PROVIDER_LIB}:ro",
        "/var/lib/pdctl/models:/root/.cache/huggingface:ro",  # the model cache (issue 16)
    ]


def test_slot_environment_and_extravars() -> None:
    spec, env = lab_spec()
    plan = build(
        spec, env, fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2")), secrets_digest=""
    )
    decode = plan.groups["decode"].slots[1]
    slot_env = decode.env()
    assert decode.gpus == [4, 5, 6, 7]
    assert slot_env["DSTACK_GPUS_NUM"] == "4" and slot_env["ROCR_VISIBLE_DEVICES"] == "4,5,6,7"
    assert slot_env["PDCTL_DEVICE_ARGS"] == " ".join(
        f"--device /dev/dri/renderD{128 + g}" for g in range(4, 8)
    )
    assert "PDCTL_BOOTSTRAP_PORT" not in slot_env
    assert plan.groups["prefill"].slots[1].env()["PDCTL_BOOTSTRAP_PORT"] == "8999"
    extra = plan.extravars()
    assert extra["pd_router_hosts"] == ["cpu1"] and extra["pd_worker_hosts"] == ["gpu1", "gpu2"]
    assert extra["pd_secret_names"] == ["HF_TOKEN"]
    assert "hf_value" not in json.dumps(extra)  # secret values never enter the plan
    assert "slots" not in extra["pd_groups"]["prefill"]


def test_extravars_round_trip() -> None:
    spec, env = lab_spec()
    plan = build(
        spec, env, fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2")), secrets_digest=""
    )
    assert plan_from_extravars(json.loads(json.dumps(plan.extravars()))) == plan


def test_the_probe_reaches_the_roles_and_stored_plans_as_a_plain_mapping() -> None:
    spec, env = lab_spec()
    plan = build(
        spec, env, fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2")), secrets_digest=""
    )
    # pd_probe as the roles and the scaler read it: these keys, in this order, whole seconds.
    probe = plan.extravars()["pd_probe"]
    assert json.dumps(probe) == '{"url": "/health", "interval": 2, "timeout": 10}'
    assert plan.model_dump(mode="json")["probe"] == probe  # plan.json holds the same
    stored = Plan.model_validate({**plan.model_dump(mode="json"), "probe": probe})
    assert stored == plan and (stored.probe.url, stored.probe.interval) == ("/health", 2)


# ---------------------------------------------------------------- services sharing a fleet


def service(name: str, port: int = 8000, metrics: int = 29000, count: int = 1) -> tuple:
    """The lab example as service ``name`` with ``count`` fixed prefill and decode replicas."""
    text = lab_service((REPO / "examples/lab/pd.yml").read_text(), name, port, metrics, count)
    return parse(text, Path(f"{name}.yml"), ENV)


def lab_fleet() -> Fleet:
    return fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2"))


def place(name: str, held: list[Held] | None = None, **kwargs: int) -> Plan:
    """The service's plan as make_plan gives it before this workspace made its key."""
    spec, env = service(name, **kwargs)
    digest = drift.secrets_digest(None, env.secrets, ENV)
    return build(spec, env, lab_fleet(), held=held or [], secrets_digest=digest)


def test_a_second_service_takes_the_free_gpus_and_ports() -> None:
    a = place("a")
    b = place("b", held_by(a), port=8001, metrics=29001)
    assert {(s.name, s.host, tuple(s.gpus)) for s in a.slots()} == {
        ("prefill/1", "gpu1", (0, 1, 2, 3)),
        ("decode/1", "gpu2", (0, 1, 2, 3)),
    }
    assert {(s.name, s.host, tuple(s.gpus), s.port) for s in b.slots()} == {
        ("prefill/1", "gpu1", (4, 5, 6, 7), 31000),
        ("decode/1", "gpu2", (4, 5, 6, 7), 31000),
    }
    assert b.groups["prefill"].slots[0].bootstrap_port == 8999  # a's prefill/1 has 8998
    assert b.router.host == a.router.host == "cpu1"
    assert (a.scaler_metrics_port, b.scaler_metrics_port) == (SCALER_METRICS_PORT, 29101)
    assert b.extravars()["pd_scaler_metrics_port"] == 29101  # what the pd_scaler role reads
    assert_apart(a, b)


def test_spares_are_held_too() -> None:
    """A service's spare slots are its scaler's room: another service never takes them."""
    spec, env = lab_spec()  # pdlab: 1..2 prefill and decode, 16 GPUs with the spares
    pdlab = build(spec, env, lab_fleet(), secrets_digest="")
    with pytest.raises(CheckFailed) as caught:
        place("b", held_by(pdlab), port=8001, metrics=29001)
    assert "service pdlab's prefill/2" in caught.value.message  # a spare (start: false)


def test_a_service_that_no_longer_fits_is_refused_naming_the_holders() -> None:
    a = place("a")
    b = place("b", held_by(a), port=8001, metrics=29001)
    with pytest.raises(CheckFailed) as caught:
        place("c", held_by(a) + held_by(b), port=8002, metrics=29002)
    message = caught.value.message
    assert "even the minimum" in message
    assert "gpu1: GPUs 0,1,2,3 (service a's prefill/1), 4,5,6,7 (service b's prefill/1)" in message
    assert "gpu2: GPUs 0,1,2,3 (service a's decode/1), 4,5,6,7 (service b's decode/1)" in message
    assert "other services hold" in (caught.value.hint or "")


def test_re_planning_a_service_ignores_its_own_holdings() -> None:
    a = place("a")
    b = place("b", held_by(a), port=8001, metrics=29001)
    again = place("a", held_by(a) + held_by(b))
    assert again == a
    assert place("b", held_by(a) + held_by(b), port=8001, metrics=29001) == b


def test_a_router_port_another_service_has_is_refused_naming_it_and_the_field() -> None:
    a = place("a")
    with pytest.raises(InputError) as caught:
        place("b", held_by(a), metrics=29001)  # port 8000, as a's router
    assert "cpu1: the router of service b cannot listen on port 8000" in caught.value.message
    assert "service a's router does" in caught.value.message
    assert "`port`" in (caught.value.hint or "")
    with pytest.raises(InputError) as caught:
        place("b", held_by(a), port=8001)  # metrics 29000, as a's router's
    assert "port 29000 for service b's router's metrics is taken by service a's router's" in (
        caught.value.message
    )
    assert "pdctl.router.metrics_port" in (caught.value.hint or "")


def test_worker_and_bootstrap_ports_skip_what_others_hold() -> None:
    """Held ports from a host's units (another workspace's service): the slots go around."""
    held = [
        Held("x", "gpu1", "prefill/1", ports=(30000, 30299)),
        Held("x", "gpu1", "decode/1", ports=(31100, 31399)),  # inside position 1's range
        Held("x", "gpu1", "prefill/1's bootstrap port", ports=(9000, 9000)),  # position 2's
    ]
    plan = place("b", held, count=2)
    on_gpu1 = [(s.name, s.port, s.bootstrap_port) for s in plan.slots() if s.host == "gpu1"]
    assert on_gpu1 == [("prefill/1", 33000, 9001), ("prefill/2", 34000, 9002)]
    assert {s.port for s in plan.slots() if s.host == "gpu2"} == {30000, 31000}  # nothing held
    assert_apart(plan)


def test_held_gpus_steer_slots_to_the_host_with_more_free() -> None:
    plan = place("b", [Held("x", "gpu1", "prefill/1", gpus=(0, 1))])
    assert {(s.name, s.host, tuple(s.gpus)) for s in plan.slots()} == {
        ("prefill/1", "gpu2", (0, 1, 2, 3)),
        ("decode/1", "gpu1", (2, 3, 4, 5)),
    }


def test_held_gpus_outside_the_host_or_on_other_hosts_change_nothing() -> None:
    a = place("a")
    noise = [Held("x", "gpu1", "prefill/1", gpus=(8, 9)), Held("x", "elsewhere", "d", gpus=(0,))]
    assert place("a", noise) == a


def test_wheelhouse_from_the_fleet_unless_the_spec_names_one() -> None:
    hosts = fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    hosts.settings.wheelhouse = "/srv/wheels"
    spec, env = load(REPO / "examples/pd-amd-mi300x.yml", ENV)  # no pdctl.wheelhouse
    assert spec.pdctl.wheelhouse is None
    assert (
        build(spec, env, hosts, allow_partial=True, secrets_digest="").router.wheelhouse
        == "/srv/wheels"
    )
    spec.pdctl.wheelhouse = "/opt/spec-wheels"
    assert (
        build(spec, env, hosts, allow_partial=True, secrets_digest="").router.wheelhouse
        == "/opt/spec-wheels"
    )
