"""The KV paths `deploy --certify` and `status --certify` test (pdctl/fabric_run.kv_links):
each prefill slot's own NICs to each decode slot's on another host, from a real plan."""

from __future__ import annotations

from pathlib import Path

from pdctl.core import fabric_schedule
from pdctl.core.fleet_model import Fleet, FleetHost, FleetSettings, Preflight
from pdctl.core.plan import Plan, build
from pdctl.core.spec import parse
from pdctl.operations.fabric_run import kv_links
from tests.hostfacts import nvidia_facts

REPO = Path(__file__).resolve().parents[3]
CHECKED = Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00", checks=[])


def h200_plan(spec_text: str, hosts: int = 3) -> tuple[Plan, Fleet]:
    fleet = Fleet(
        name="f",
        settings=FleetSettings(gpu_model="H200", gpu_vendor="nvidia", nic_driver="mlx5"),
        hosts=[
            FleetHost(
                name="cpu1",
                address="10.0.0.10",
                user="root",
                kind="cpu",
                facts={"cpus": 8, "memory_gb": 16.0},
                preflight=CHECKED,
            ),
            *(
                FleetHost(
                    name=f"h{i}",
                    address=f"10.0.0.{20 + i}",
                    user="root",
                    kind="gpu",
                    facts=nvidia_facts(),
                    preflight=CHECKED,
                )
                for i in range(hosts)
            ),
        ],
    )
    spec, env = parse(spec_text, Path("pd.yml"), {"HF_TOKEN": "hf_x"})
    return build(spec, env, fleet, secrets_digest="", allow_partial=True), fleet


def test_every_cross_host_prefill_decode_pair_on_the_slots_own_nics() -> None:
    text = (REPO / "examples/pd-nvidia-h200.yml").read_text()
    plan, fleet = h200_plan(text.replace("gpu: H200", "gpu: H200:2"))
    links = kv_links(plan, fleet)
    prefill, decode = plan.groups["prefill"].slots, plan.groups["decode"].slots
    assert prefill and decode and all(s.rdma_devices for s in (*prefill, *decode))
    expected = set()
    for p in prefill:
        for d in decode:
            if p.host == d.host:
                continue
            for a, b in zip(p.rdma_devices, d.rdma_devices, strict=True):
                expected.add((p.host, a, d.host, b))
    found = {
        (link.client, link.client_nic.name, link.server, link.server_nic.name)
        for link in links
        if link.client_nic and link.server_nic
    }
    assert found == expected and len(links) == len(expected)
    assert all(link.client != link.server for link in links)
    assert all(link.problem is None for link in links)
    assert all(link.client_nic and not link.client_nic.roce for link in links)  # InfiniBand
    schedule = fabric_schedule.of_links(links, parallel=True)
    for round_waves in schedule.rounds:
        pairs = {link.pair for wave in round_waves for link in wave}
        busy = [h for pair in pairs for h in pair]
        assert len(busy) == len(set(busy))
        for wave in round_waves:
            used = [use for link in wave for use in link.uses()]
            assert len(used) == len(set(used))
    assert sorted(link.rail for link in schedule.links()) == sorted(link.rail for link in links)


def test_a_slot_nic_the_facts_lack_fails_without_a_run() -> None:
    text = (REPO / "examples/pd-nvidia-h200.yml").read_text()
    plan, fleet = h200_plan(text, hosts=2)
    host = next(h for h in fleet.hosts if h.name == plan.groups["decode"].slots[0].host)
    assert host.facts is not None
    host.facts["rdma"]["devices"] = host.facts["rdma"]["devices"][1:]  # mlx5_0 gone since
    broken = [link for link in kv_links(plan, fleet) if link.problem]
    assert broken
    assert all(
        "the facts show no NIC mlx5_0 (run `pdctl fleet check`)" in link.problem
        for link in broken
        if link.problem
    )
