"""Several routers and their failover address in the plan: distinct hosts, CPU hosts first,
one port of each on every router host, the address checked, what the roles are given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdctl.core.errors import CheckFailed
from pdctl.core.plan import Held, Plan, build, listeners, plan_from_extravars
from pdctl.core.router_replicas import MESH_PORT, virtual_router_id
from pdctl.core.spec import parse
from tests.unit.core.plan.test_placement import ENV, REPO, fleet, host


def spec_text(routers: int = 2, **router: Any) -> str:
    doc = yaml.safe_load((REPO / "examples/lab/pd.yml").read_text())
    doc["replicas"][0]["count"] = routers
    doc["pdctl"]["router"].update(router)
    return str(yaml.safe_dump(doc, sort_keys=False))


def plan_of(text: str, *hosts: Any, held: tuple[Held, ...] = ()) -> Plan:
    spec, env = parse(text, Path("pd.yml"), ENV)
    return build(spec, env, fleet(*hosts), secrets_digest="", held=held)


def test_two_routers_go_to_two_cpu_hosts() -> None:
    plan = plan_of(
        spec_text(address="10.0.0.200"),
        host("cpu1", "cpu"),
        host("cpu2", "cpu"),
        host("gpu1"),
        host("gpu2"),
    )
    assert plan.router.hosts == ["cpu1", "cpu2"]
    assert [r.address for r in plan.router.replicas] == ["10.0.0.5", "10.0.0.6"]
    assert plan.router.failover is not None
    assert plan.router.failover.address == "10.0.0.200"
    assert plan.router.failover.virtual_router_id == 200
    # pdctl registers every worker on each router: no mesh unless the spec asks for it.
    assert plan.router.several and not plan.router.meshed
    assert set(plan.hosts()) == {"cpu1", "cpu2", "gpu1", "gpu2"}


def test_the_mesh_joins_several_routers_when_the_spec_asks() -> None:
    hosts = (host("cpu1", "cpu"), host("cpu2", "cpu"), host("gpu1"), host("gpu2"))
    plan = plan_of(spec_text(mesh=True), *hosts)
    assert plan.router.meshed and plan.router.mesh_port == MESH_PORT
    assert plan.extravars()["pd_router"]["mesh"] is True
    meshes = {item.host for item in listeners(plan) if item.what == "router's mesh"}
    assert meshes == {"cpu1", "cpu2"}
    one = plan_of(spec_text(routers=1, mesh=True), host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    assert not one.router.meshed  # a lone router has no one to mesh with


def test_cpu_hosts_first_then_gpu_hosts_never_two_on_one_host() -> None:
    plan = plan_of(spec_text(routers=3), host("gpu1"), host("cpu1", "cpu"), host("gpu2"))
    assert plan.router.hosts == ["cpu1", "gpu1", "gpu2"]
    assert len(set(plan.router.hosts)) == 3
    assert not plan.router.failover  # no address: clients take every router's URL


def test_the_pinned_host_comes_first() -> None:
    plan = plan_of(
        spec_text(host="cpu2"), host("cpu1", "cpu"), host("cpu2", "cpu"), host("gpu1"), host("gpu2")
    )
    assert plan.router.hosts == ["cpu2", "cpu1"]


def test_more_routers_than_hosts_that_can_run_one_is_refused() -> None:
    with pytest.raises(CheckFailed) as caught:
        plan_of(spec_text(routers=4), host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    assert "asks for 4 routers on distinct hosts, and 3 healthy host(s)" in caught.value.message
    assert "lower the router group's count" in (caught.value.hint or "")


def test_a_host_that_failed_preflight_runs_no_router() -> None:
    plan = plan_of(
        spec_text(), host("cpu1", "cpu", ok=False), host("cpu2", "cpu"), host("gpu1"), host("gpu2")
    )
    assert plan.router.hosts == ["cpu2", "gpu1"]


def test_an_address_a_fleet_host_has_is_refused() -> None:
    with pytest.raises(CheckFailed) as caught:
        plan_of(spec_text(address="10.0.0.6"), host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    assert caught.value.message == "pdctl.router.address 10.0.0.6 is host gpu2's own address"


def test_the_virtual_router_id() -> None:
    assert virtual_router_id("10.1.2.200") == 200
    assert virtual_router_id("10.1.2.200", 9) == 9
    assert 1 <= virtual_router_id("10.1.3.0") <= 255 and virtual_router_id("10.1.3.255") >= 1
    plan = plan_of(
        spec_text(address="10.0.0.200", virtual_router_id=42),
        host("cpu1", "cpu"),
        host("gpu1"),
        host("gpu2"),
    )
    assert plan.router.failover is not None and plan.router.failover.virtual_router_id == 42


def test_every_router_host_gets_the_same_free_ports() -> None:
    # Another service holds the router metrics' default port on cpu2 only: both move.
    held = (Held("other", "cpu2", "router's metrics", ports=(29000, 29000)),)
    plan = plan_of(
        spec_text(mesh=True),
        host("cpu1", "cpu"),
        host("cpu2", "cpu"),
        host("gpu1"),
        host("gpu2"),
        held=held,
    )
    assert plan.router.metrics_port == 29001
    by_host = {(item.host, item.what) for item in listeners(plan)}
    for router_host in ("cpu1", "cpu2"):
        for what in ("router", "router's metrics", "router's mesh", "scaler's metrics"):
            assert (router_host, what) in by_host, (router_host, what)


def test_routers_without_the_mesh_claim_no_mesh_port() -> None:
    plan = plan_of(
        spec_text(), host("cpu1", "cpu"), host("cpu2", "cpu"), host("gpu1"), host("gpu2")
    )
    assert all(item.what != "router's mesh" for item in listeners(plan))


def test_one_router_has_no_mesh_and_no_address() -> None:
    plan = plan_of(spec_text(routers=1), host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    assert plan.router.hosts == ["cpu1"] and not plan.router.meshed
    assert all(item.what != "router's mesh" for item in listeners(plan))


def test_the_roles_get_every_router_and_the_address() -> None:
    plan = plan_of(
        spec_text(address="10.0.0.200"),
        host("cpu1", "cpu"),
        host("cpu2", "cpu"),
        host("gpu1"),
        host("gpu2"),
    )
    extra = plan.extravars()
    assert extra["pd_router_hosts"] == ["cpu1", "cpu2"]
    assert "pd_router_host" not in extra
    assert extra["pd_router"]["replicas"] == [
        {"host": "cpu1", "address": "10.0.0.5"},
        {"host": "cpu2", "address": "10.0.0.6"},
    ]
    assert extra["pd_router"]["failover"] == {"address": "10.0.0.200", "virtual_router_id": 200}
    assert plan_from_extravars(extra) == plan


def test_a_plan_stored_with_one_router_host_still_loads() -> None:
    plan = plan_of(spec_text(routers=1), host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    stored = plan.model_dump(mode="json")
    stored["router"] = {
        **{k: v for k, v in stored["router"].items() if k not in {"replicas", "failover"}},
        "host": "cpu1",
        "address": "10.0.0.5",
    }
    again = Plan.model_validate(stored)
    assert again.router.hosts == ["cpu1"] and again.router.address == "10.0.0.5"
    assert again.router.failover is None
