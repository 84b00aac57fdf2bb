"""Placement by GPU vendor, model and memory from the hosts' facts; the slots' devices, NICs
and UCX settings per vendor; facts that must not reach a host are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.errors import CheckFailed, InputError
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import Plan, build, plan_from_extravars
from pdctl.core.spec import load, parse
from tests.hostfacts import H100_MIB, amd_facts, nvidia_facts

REPO = Path(__file__).resolve().parents[4]
ENV = {"HF_TOKEN": "hf_value"}
CHECKED = Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00", checks=[])

CACHE_MOUNT = "/var/lib/pdctl/models:/root/.cache/huggingface:ro"  # the model cache


def host(name: str, address: str, facts: dict[str, Any] | None, kind: str = "gpu") -> FleetHost:
    return FleetHost(
        name=name, address=address, user="root", kind=kind, facts=facts, preflight=CHECKED
    )


def cpu(name: str = "cpu1") -> FleetHost:
    return host(name, "10.0.0.10", {"cpus": 8, "memory_gb": 16.0}, kind="cpu")


def fleet(*hosts: FleetHost) -> Fleet:
    return Fleet(name="f", hosts=list(hosts))


def h200_fleet(count: int = 2) -> Fleet:
    return fleet(cpu(), *(host(f"h{i}", f"10.0.0.{20 + i}", nvidia_facts()) for i in range(count)))


def nvidia_example(**changes: str) -> tuple:
    text = (REPO / "examples/pd-nvidia-h200.yml").read_text()
    for old, new in changes.items():
        text = text.replace(old, new)
    return parse(text, Path("pd.yml"), ENV)


def plan_of(spec_env: tuple, plan_fleet: Fleet, **kw: Any) -> Plan:
    spec, env = spec_env
    return build(spec, env, plan_fleet, secrets_digest="", **kw)


def test_the_smg_example_lands_on_h200_hosts_one_gpu_per_replica() -> None:
    plan = plan_of(nvidia_example(), h200_fleet())
    assert plan.router.host == "cpu1"
    assert len(plan.groups["prefill"].slots) == 4 and len(plan.groups["decode"].slots) == 8
    assert {s.vendor for s in plan.slots()} == {"nvidia"}
    assert all(len(s.gpus) == 1 for s in plan.slots())
    assert plan.router.args == ["--prefill-policy", "cache_aware"]
    # NIXL's router side is Mooncake's: HTTP workers, prefill bootstrap ports.
    assert all(s.bootstrap_port for s in plan.groups["prefill"].slots)
    # CUDA images carry libmlx5: no host library mounted; the model cache only (issue 16).
    assert plan.volumes == [CACHE_MOUNT]


def test_nvidia_slot_env_names_its_cdi_devices_nics_and_ucx_devices() -> None:
    plan = plan_of(nvidia_example(**{"gpu: H200": "gpu: H200:4"}), h200_fleet(), allow_partial=True)
    slot = plan.groups["prefill"].slots[0]
    env = slot.env()
    assert slot.gpus == [0, 1, 2, 3] and slot.rdma_devices == [f"mlx5_{k}" for k in range(4)]
    assert env["PDCTL_DEVICE_ARGS"] == " ".join(f"--device nvidia.com/gpu={k}" for k in range(4))
    assert env["PDCTL_GPU_IDS"] == "0,1,2,3" and env["DSTACK_GPUS_NUM"] == "4"
    assert env["PDCTL_RDMA_DEVICES"] == "mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"
    assert "ROCR_VISIBLE_DEVICES" not in env
    assert not any("/dev/dri" in v or "/dev/kfd" in v for v in env.values())
    other = next(s for s in plan.slots() if s.gpus == [4, 5, 6, 7])
    assert other.env()["UCX_NET_DEVICES"] == "mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_7:1"


def test_a_spec_that_sets_ucx_net_devices_keeps_it() -> None:
    spec_env = nvidia_example(**{"  - HF_TOKEN\n": "  - HF_TOKEN\n  - UCX_NET_DEVICES=all\n"})
    plan = plan_of(spec_env, h200_fleet())
    slot = plan.slots()[0]
    assert "UCX_NET_DEVICES" not in slot.env() and slot.env()["PDCTL_RDMA_DEVICES"] == "mlx5_0"
    assert plan.env["UCX_NET_DEVICES"] == "all"


def test_mooncake_slots_get_their_nics_but_no_ucx_settings() -> None:
    spec, env = load(REPO / "examples/lab/pd.yml", ENV)
    plan = build(
        spec,
        env,
        fleet(cpu(), host("a1", "10.0.0.31", amd_facts())),
        secrets_digest="",
        allow_partial=True,
    )
    slots = {s.name: s for s in plan.slots()}
    assert slots["prefill/1"].rdma_devices == ["bnxt_re0", "bnxt_re1", "bnxt_re2", "bnxt_re3"]
    assert slots["decode/1"].rdma_devices == ["bnxt_re4", "bnxt_re5", "bnxt_re6", "bnxt_re7"]
    env1 = slots["prefill/1"].env()
    assert env1["PDCTL_RDMA_DEVICES"] == "bnxt_re0,bnxt_re1,bnxt_re2,bnxt_re3"
    assert "UCX_NET_DEVICES" not in env1 and env1["ROCR_VISIBLE_DEVICES"] == "0,1,2,3"
    assert env1["PDCTL_DEVICE_ARGS"] == " ".join(
        f"--device /dev/dri/renderD{128 + k}" for k in range(4)
    )
    # The host's bnxt_re library, from its facts, mounted where the ROCm image looks.
    assert plan.volumes == [
        "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so:"
        "/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so:ro",
        CACHE_MOUNT,
    ]


def test_provider_library_on_nvidia_hosts_only_when_asked() -> None:
    text = (REPO / "examples/pd-nvidia-h200.yml").read_text() + "pdctl:\n  provider_lib: host\n"
    plan = plan_of(parse(text, Path("pd.yml"), ENV), h200_fleet())
    assert plan.volumes == [
        "/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav34.so:"
        "/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav34.so:ro",
        CACHE_MOUNT,
    ]
    amd_text = (
        (REPO / "examples/lab/pd.yml")
        .read_text()
        .replace("pdctl:\n", "pdctl:\n  provider_lib: image\n")
    )
    spec, env = parse(amd_text, Path("pd.yml"), ENV)
    amd = build(
        spec,
        env,
        fleet(cpu(), host("a1", "10.0.0.31", amd_facts())),
        secrets_digest="",
        allow_partial=True,
    )
    assert amd.volumes == [CACHE_MOUNT]


def test_provider_lib_setting_is_validated() -> None:
    text = (REPO / "examples/pd-nvidia-h200.yml").read_text() + "pdctl:\n  provider_lib: yes\n"
    with pytest.raises(
        InputError,
        match=r"pd.yml:\d+: pdctl.provider_lib: Input should be 'auto', 'host' or 'image'",
    ):
        parse(text, Path("pd.yml"), ENV)


def test_no_host_matches_names_what_each_host_has() -> None:
    amd = fleet(cpu(), host("a1", "10.0.0.11", amd_facts()), host("a2", "10.0.0.12", amd_facts()))
    with pytest.raises(CheckFailed) as caught:
        plan_of(nvidia_example(), amd)
    assert caught.value.message == (
        "prefill needs H200:1; hosts: 10.0.0.11 8x MI300X 192GB, 10.0.0.12 8x MI300X 192GB"
    )
    assert "resources.gpu" in (caught.value.hint or "")


def test_a_mixed_fleet_places_each_service_on_its_own_vendor() -> None:
    mixed = fleet(
        cpu(),
        host("a1", "10.0.0.11", amd_facts()),
        host("n1", "10.0.0.21", nvidia_facts()),
        host("n2", "10.0.0.22", nvidia_facts()),
    )
    nvidia = plan_of(nvidia_example(), mixed)
    assert {s.host for s in nvidia.slots()} == {"n1", "n2"}
    assert nvidia.excluded_hosts["a1"] == "GPU model MI300X is not H200"
    spec, env = load(REPO / "examples/lab/pd.yml", ENV)
    amd = build(spec, env, mixed, secrets_digest="", allow_partial=True)
    assert {s.host for s in amd.slots()} == {"a1"} and {s.vendor for s in amd.slots()} == {"amd"}
    assert amd.excluded_hosts["n1"] == "GPU model H200 is not MI300X"
    # By vendor alone, too.
    by_vendor = plan_of(nvidia_example(**{"gpu: H200": "gpu: nvidia:1"}), mixed)
    assert {s.host for s in by_vendor.slots()} == {"n1", "n2"}
    # A count alone matches both vendors: a group's image runs on one, so it is refused.
    with pytest.raises(
        InputError, match=r"matches hosts of more than one vendor \(amd: a1; nvidia: n1, n2\)"
    ):
        plan_of(nvidia_example(**{"gpu: H200": "gpu: 1"}), mixed)


@pytest.mark.parametrize(
    ("gpu", "fits"),
    [
        ("H200:141GB", True),  # sold as 141GB, reports 140.4 GiB
        ("H200:100GB..", True),
        ("80GB..:1", True),
        ("H200:150GB..", False),
        ("H100,H200", True),
        ("H100", False),
        ("nvidia:40GB..80GB", False),
        ("amd", False),
    ],
)
def test_gpu_memory_names_and_vendor_against_the_facts(gpu: str, fits: bool) -> None:
    spec_env = nvidia_example(**{"gpu: H200": f"gpu: '{gpu}'"})
    if fits:
        assert plan_of(spec_env, h200_fleet()).slots()
    else:
        with pytest.raises(CheckFailed, match=r"needs .*; hosts: 10.0.0.20 8x H200 140GB"):
            plan_of(spec_env, h200_fleet())


def test_h100_80gb_matches_what_nvidia_smi_reports() -> None:
    h100 = fleet(cpu(), host("n1", "10.0.0.21", nvidia_facts("H100", H100_MIB)))
    spec_env = nvidia_example(**{"gpu: H200": "gpu: 'H100:80GB:4'", "1..8": "1..2", "1..4": "1..2"})
    plan = plan_of(spec_env, h100, allow_partial=True)
    assert sorted(s.gpus for s in plan.slots()) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_host_whose_cdi_spec_lacks_a_gpu_is_not_used() -> None:
    facts = nvidia_facts()
    facts["nvidia"]["cdi_devices"] = ["0", "1", "all"]
    plan = plan_of(
        nvidia_example(),
        fleet(cpu(), host("n1", "10.0.0.21", facts), host("n2", "10.0.0.22", nvidia_facts())),
        allow_partial=True,
    )
    assert {s.host for s in plan.slots()} == {"n2"}
    assert plan.excluded_hosts["n1"].startswith(
        "no CDI device nvidia.com/gpu=2 (run `nvidia-ctk cdi generate"
    )


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        (
            ("rdma", "devices", 0, "name"),
            "mlx5_0\nExecStartPre=+/bin/sh",
            "is not an RDMA device name",
        ),
        (("rdma", "devices", 0, "name"), "mlx5 0", "is not an RDMA device name"),
        (("rdma", "devices", 0, "name"), "mlx5_0:1", "is not an RDMA device name"),
        (("rdma", "devices", 0, "driver"), "mlx5;rm", "is not a driver name"),
        (("rdma", "provider_libs", "mlx5"), "/usr/lib/libmlx5-rdmav34.so\n", "holds a newline"),
        (("rdma", "provider_libs", "mlx5"), "/usr/lib/../x/libmlx5-rdmav34.so", "no '..'"),
        (("rdma", "provider_libs", "mlx5"), "/usr/lib/libevil.so", "is not a libmlx5-rdmav<N>.so"),
        (("nvidia", "cdi_devices", 0), "0\nX=1", "is not a CDI name"),
        (("gpus", "model"), "H200\x1b[2J", "holds the control character U+001B"),
        (("gpus", "vendor"), "intel", "is not amd or nvidia"),
        (("gpus", "devices", 0, "pci_path"), ["0000:00:01.0", "../x y"], "is not a PCI address"),
        (("gpus", "devices", 0, "index"), "0", "is not a whole number"),
    ],
)
def test_facts_that_could_reach_a_host_are_refused_not_written(
    path: tuple, value: Any, problem: str
) -> None:
    facts = nvidia_facts()
    where: Any = facts
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    bad = host("n1", "10.0.0.21", facts)
    plan = plan_of(
        nvidia_example(),
        fleet(cpu(), bad, host("n2", "10.0.0.22", nvidia_facts())),
        allow_partial=True,
    )
    assert {s.host for s in plan.slots()} == {"n2"}
    reason = plan.excluded_hosts["n1"]
    assert reason.startswith("unusable facts ") and problem in reason, reason
    assert "`pdctl fleet check f`" in reason
    document = json.dumps(plan.extravars())
    if isinstance(value, str) and any(c in value for c in "\n ;\x1b."):
        assert json.dumps(value)[1:-1] not in document
    # Alone, the host makes the plan fail with what it has, never with its bad facts written.
    with pytest.raises(CheckFailed, match=r"hosts: 10.0.0.21 unreadable facts \(unusable facts"):
        plan_of(nvidia_example(), fleet(cpu(), bad))


def test_old_facts_keep_todays_plan_and_say_why_there_are_no_per_slot_nics() -> None:
    old = {
        "cpus": 96,
        "memory_gb": 1024.0,
        "gpus": {"count": 8, "model": "AMD Instinct MI300X"},
        "rdma": {
            "devices": [{"name": f"bnxt_re{k}", "ports": []} for k in range(8)],
            "provider_lib": True,
            "warnings": [],
        },
    }
    spec, env = load(REPO / "examples/lab/pd.yml", ENV)
    plan = build(
        spec,
        env,
        fleet(cpu(), host("g1", "10.0.0.11", old), host("g2", "10.0.0.12", old)),
        secrets_digest="",
    )
    assert all(s.rdma_devices == [] and s.vendor == "amd" for s in plan.slots())
    assert all("PDCTL_RDMA_DEVICES" not in s.env() for s in plan.slots())
    assert plan.notes == [
        f"{h}: its facts carry no PCI topology (gathered by an older pdctl): its slots get no NICs "
        "of their own (no PDCTL_RDMA_DEVICES); `pdctl fleet check` reads them again"
        for h in ("g1", "g2")
    ]
    assert plan.volumes[0].startswith("/usr/lib64/libibverbs/libbnxt_re-rdmav34.so:")


def test_nvidia_plan_round_trips_through_extravars_and_refuses_edited_nic_names() -> None:
    plan = plan_of(nvidia_example(), h200_fleet())
    doc = json.loads(json.dumps(plan.extravars()))
    assert plan_from_extravars(doc) == plan
    entry = doc["pd_host_slots"]["h0"][0]
    assert entry["vendor"] == "nvidia" and entry["env"]["UCX_NET_DEVICES"] == "mlx5_0:1"
    entry["rdma_devices"] = ["mlx5_0 --privileged"]
    with pytest.raises(ValueError, match="is not an RDMA device name"):
        plan_from_extravars(doc)


def test_a_stored_plan_without_vendor_or_nics_loads_as_amd() -> None:
    spec, env = load(REPO / "examples/lab/pd.yml", ENV)
    plan = build(
        spec,
        env,
        fleet(cpu(), host("a1", "10.0.0.31", amd_facts())),
        secrets_digest="",
        allow_partial=True,
    )
    doc = json.loads(json.dumps(plan.extravars()))
    for entries in doc["pd_host_slots"].values():
        for entry in entries:
            for key in ("vendor", "rdma_devices", "ucx_net_devices"):
                entry.pop(key)
    again = plan_from_extravars(doc)
    assert {s.vendor for s in again.slots()} == {"amd"} and all(
        not s.rdma_devices for s in again.slots()
    )
