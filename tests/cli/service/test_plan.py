"""`pdctl plan` through the real CLI: the hosts' fabric records (a warning for each host with a
slot whose last fabric check failed or that has none, and --strict), NVIDIA and mixed fleets
(each slot's NICs in the table and in --json), and the vLLM examples on emulated fleets (gRPC
workers, NIXL side channels)."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from pdctl.core.fleet_model import FabricRecord, Fleet, FleetHost, FleetSettings, Preflight
from pdctl.core.versions import scaler_requirements
from pdctl.doors import inventory
from pdctl.doors.workspace import Workspace
from tests.hostfacts import amd_facts, nvidia_facts
from tests.support import contacted, pdctl

# ------------------------------------------------------------------------ the hosts' fabric records

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples/pd-nvidia-h200.yml"
ENV = {"HF_TOKEN": "hf_x", "COLUMNS": "250"}
CHECKED = Preflight(ok=True, checked_at="2026-11-25T00:00:00Z", checks=[])
PASSED = FabricRecord(ok=True, checked_at="2026-11-26T10:00:00+00:00", pairs=3)
FAILED = FabricRecord(
    ok=False,
    checked_at="2026-11-26T10:00:00+00:00",
    pairs=3,
    named=True,
    summary="all its tests on rail 0 failed: its own link (0.16 Gb/s is below 80% of ...)",
)


@pytest.fixture
def port(listener: socket.socket) -> int:
    return int(listener.getsockname()[1])


def workspace(root: Path, port: int, records: dict[str, FabricRecord | None]) -> Path:
    hosts = [
        FleetHost(
            name="cpu1",
            address="127.0.0.1",
            port=port,
            user="root",
            kind="cpu",
            facts={"cpus": 8, "memory_gb": 16.0},
            preflight=CHECKED,
        )
    ]
    hosts += [
        FleetHost(
            name=name,
            address="127.0.0.1",
            port=port,
            user="root",
            kind="gpu",
            facts=nvidia_facts(),
            preflight=CHECKED,
            fabric=record,
        )
        for name, record in records.items()
    ]
    fleet = Fleet(
        name="f", settings=FleetSettings(gpu_model="H200", gpu_vendor="nvidia"), hosts=hosts
    )
    inventory.save(Workspace(root), fleet)
    return root


def plan(
    home: Path, spec: Path, *args: str, json_mode: bool = False, check: bool = True
) -> subprocess.CompletedProcess[str]:
    before = ["--json"] if json_mode else []
    return pdctl(home, *before, "plan", str(spec), "--fleet", "f", *args, env=ENV, check=check)


def test_plan_warns_about_uncertified_hosts_and_strict_refuses(
    tmp_path: Path, port: int, listener: socket.socket
) -> None:
    home = workspace(tmp_path, port, {"gpu1": PASSED, "gpu2": FAILED, "gpu3": None})
    spec = tmp_path / "pd.yml"
    spec.write_text(EXAMPLE.read_text())
    shown = plan(home, spec)
    gpu2 = "warning: fabric: gpu2: its last fabric check (2026-11-26T10:00:00+00:00, mesh) failed"
    assert f"{gpu2}: all its tests on rail 0" in shown.stderr
    assert (
        "warning: fabric: gpu3: no fabric check on record (`pdctl fleet check f --fabric`)"
        in shown.stderr
    )
    assert "fabric: gpu1" not in shown.stderr
    doc = json.loads(plan(home, spec, json_mode=True).stdout)
    assert [w for w in doc["warnings"] if w.startswith("fabric: ")] == [
        "fabric: gpu2: its last fabric check (2026-11-26T10:00:00+00:00, mesh) failed: "
        + FAILED.summary,
        "fabric: gpu3: no fabric check on record (`pdctl fleet check f --fabric`)",
    ]
    refused = plan(home, spec, "--strict", check=False)
    assert refused.returncode == 5
    assert "2 host(s) of the plan are not fabric-certified: gpu2: its last fabric check" in (
        refused.stderr
    )
    assert "Traceback" not in refused.stderr
    error = json.loads(plan(home, spec, "--strict", json_mode=True, check=False).stdout)["error"]
    assert error["kind"] == "check_failed"
    assert not contacted(listener)


def test_strict_passes_when_every_host_with_a_slot_is_certified(
    tmp_path: Path, port: int, listener: socket.socket
) -> None:
    home = workspace(tmp_path, port, {"gpu1": PASSED, "gpu2": PASSED})
    spec = tmp_path / "pd.yml"
    spec.write_text(EXAMPLE.read_text())
    done = plan(home, spec, "--strict")
    assert "fabric" not in done.stderr
    shown = json.loads(pdctl(home, "--json", "fleet", "show", "f", env=ENV).stdout)
    fabric = {h["name"]: h["fabric"] for h in shown["hosts"]}
    assert fabric["cpu1"] is None and fabric["gpu1"]["ok"] is True
    assert not contacted(listener)


# -------------------------------------------------------------------------- NVIDIA and mixed fleets

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples/pd-nvidia-h200.yml"
ENV = {"HF_TOKEN": "hf_x", "COLUMNS": "250"}  # wide enough for every cell


def _workspace(root: Path, port: int, gpu_facts: list[dict]) -> Path:
    checked = Preflight(ok=True, checked_at="2026-11-25T00:00:00Z", checks=[])
    hosts = [
        FleetHost(
            name="cpu1",
            address="127.0.0.1",
            port=port,
            user="root",
            kind="cpu",
            facts={"cpus": 8, "memory_gb": 16.0},
            preflight=checked,
        )
    ]
    hosts += [
        FleetHost(
            name=f"gpu{i}",
            address="127.0.0.1",
            port=port,
            user="root",
            kind="gpu",
            facts=facts,
            preflight=checked,
        )
        for i, facts in enumerate(gpu_facts, start=1)
    ]
    inventory.save(Workspace(root), Fleet(name="f", settings=FleetSettings(), hosts=hosts))
    return root


def _cells(line: str) -> list[str]:
    """A table row's cells (the table's borders are box-drawing characters)."""
    for border in "│┃║|":
        line = line.replace(border, " ")
    return line.split()


def test_plan_shows_each_slots_nics(tmp_path: Path, port: int, listener: socket.socket) -> None:
    home = _workspace(tmp_path, port, [nvidia_facts(), amd_facts()])
    spec = tmp_path / "pd.yml"
    spec.write_text(EXAMPLE.read_text().replace("gpu: H200", "gpu: H200:4"))
    text = pdctl(home, "plan", str(spec), "--fleet", "f", "--allow-partial", env=ENV).stdout
    cells = [_cells(line) for line in text.splitlines()]
    header = next(row for row in cells if "nics" in row)
    assert header[:7] == ["slot", "host", "gpus", "nics", "ports", "other", "ports"]
    rows = {row[0]: row for row in cells if row and row[0].endswith("/1")}
    assert rows["prefill/1"][1:4] == ["gpu1", "0,1,2,3", "mlx5_0,mlx5_1,mlx5_2,mlx5_3"]
    assert rows["prefill/1"][4:7] == ["30000-30999", "bootstrap", "8998"]  # each slot's ports
    assert rows["decode/1"][1:4] == ["gpu1", "4,5,6,7", "mlx5_4,mlx5_5,mlx5_6,mlx5_7"]
    assert "not used: gpu2: GPU model MI300X is not H200" in text
    doc = json.loads(
        pdctl(home, "--json", "plan", str(spec), "--fleet", "f", "--allow-partial", env=ENV).stdout
    )
    slots = {
        f"{s['group']}/{s['index']}": s for g in doc["plan"]["groups"].values() for s in g["slots"]
    }
    assert slots["decode/1"]["rdma_devices"] == ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    assert slots["decode/1"]["vendor"] == "nvidia"
    assert slots["decode/1"]["ucx_net_devices"] == ["mlx5_4:1", "mlx5_5:1", "mlx5_6:1", "mlx5_7:1"]
    out = tmp_path / "plan.yml"
    pdctl(home, "plan", str(spec), "--fleet", "f", "--allow-partial", "-o", str(out), env=ENV)
    extravars = yaml.load(out.read_text(), Loader=yaml.BaseLoader)  # !unsafe tags as text
    (entry,) = [e for e in extravars["pd_host_slots"]["gpu1"] if e["group"] == "decode"]
    assert entry["env"]["PDCTL_DEVICE_ARGS"].split(" --device ")[1:] == [
        "nvidia.com/gpu=5",
        "nvidia.com/gpu=6",
        "nvidia.com/gpu=7",
    ]
    assert not contacted(listener)


def test_no_matching_host_says_what_each_has(
    tmp_path: Path, port: int, listener: socket.socket
) -> None:
    home = _workspace(tmp_path, port, [amd_facts(), amd_facts()])
    proc = pdctl(home, "plan", str(EXAMPLE), "--fleet", "f", env=ENV, check=False)
    assert proc.returncode == 5, proc.stderr
    assert "prefill needs H200:1; hosts: 127.0.0.1 8x MI300X 192GB, 127.0.0.1 8x MI300X 192GB" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and not contacted(listener)


def test_hostile_nic_names_are_refused_not_written(
    tmp_path: Path, port: int, listener: socket.socket
) -> None:
    bad = nvidia_facts()
    bad["rdma"]["devices"][3]["name"] = "mlx5_3\nExecStartPre=+/bin/sh -c id"
    home = _workspace(tmp_path, port, [bad, nvidia_facts()])
    out = tmp_path / "plan.yml"
    proc = pdctl(
        home, "plan", str(EXAMPLE), "--fleet", "f", "--allow-partial", "-o", str(out), env=ENV
    )
    assert "not used: gpu1: unusable facts rdma.devices[3].name:" in proc.stdout
    assert "ExecStartPre" not in out.read_text()
    alone = _workspace(tmp_path / "alone", port, [bad])
    proc = pdctl(alone, "plan", str(EXAMPLE), "--fleet", "f", env=ENV, check=False)
    assert proc.returncode == 5 and "unreadable facts" in proc.stderr
    assert "Traceback" not in proc.stderr and not contacted(listener)


# -------------------------------------------------------------------------------- the vLLM examples

REPO = Path(__file__).resolve().parents[3]
ENV = {"HF_TOKEN": "hf_x", "COLUMNS": "250"}


def _plan(home: Path, example: str, *extra: str) -> dict:
    proc = pdctl(home, "--json", "plan", str(REPO / example), "--fleet", "f", *extra, env=ENV)
    return dict(json.loads(proc.stdout)["plan"])


def test_the_amd_example_plans_one_tp8_prefill_and_decode(
    tmp_path: Path, port: int, listener: socket.socket
) -> None:
    home = _workspace(tmp_path, port, [amd_facts(), amd_facts()])
    plan = _plan(home, "examples/pd-vllm-amd.yml")
    assert "--enable-igw" in plan["router"]["args"]
    (prefill,) = plan["groups"]["prefill"]["slots"]
    (decode,) = plan["groups"]["decode"]["slots"]
    assert {prefill["host"], decode["host"]} == {"gpu1", "gpu2"}  # 8 GPUs each: a host each
    for slot in (prefill, decode):
        assert slot["engine"] == "vllm" and slot["bootstrap_port"] is None
        assert slot["gpus"] == list(range(8)) and slot["side_channel_port"] == 5600
        assert len(slot["ucx_net_devices"]) == 8  # NixlConnector: UCX on the slot's NICs
    assert (prefill["kv_role"], decode["kv_role"]) == ("kv_producer", "kv_consumer")
    out = tmp_path / "plan.yml"
    pdctl(home, "plan", str(REPO / "examples/pd-vllm-amd.yml"), "--fleet", "f", "-o", str(out),
          env=ENV)  # fmt: skip
    extravars = yaml.load(out.read_text(), Loader=yaml.BaseLoader)
    (entry,) = extravars["pd_host_slots"][prefill["host"]]
    assert entry["url"] == f"grpc://127.0.0.1:{prefill['port']}"
    assert entry["probe_url"] == f"{entry['url']}/vllm.grpc.engine.VllmEngine/HealthCheck"
    assert entry["registration"]["runtime_type"] == "vllm"
    assert entry["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert entry["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    # A pipeline installs the scaler's packages at the versions `pdctl deploy` gives: else
    # each alternates the other's, and a pipeline run after a deploy reinstalls them.
    assert extravars["pd_scaler_packages"] == scaler_requirements()
    assert all("==" in package for package in extravars["pd_scaler_packages"])
    assert "pd_worker_rollout" not in extravars  # the playbook rolls its own replicas
    assert not contacted(listener)


def test_the_nvidia_example_packs_side_channels_per_host(
    tmp_path: Path, port: int, listener: socket.socket
) -> None:
    home = _workspace(tmp_path, port, [nvidia_facts(), nvidia_facts()])
    plan = _plan(home, "examples/pd-vllm-nvidia.yml", "--allow-partial")
    slots = [s for g in plan["groups"].values() for s in g["slots"]]
    assert len(slots) == 8  # 16 H200, 2 a replica
    for host in ("gpu1", "gpu2"):
        mine = [s for s in slots if s["host"] == host]
        channels = sorted(s["side_channel_port"] for s in mine)
        assert channels == [5600 + 2 * k for k in range(len(mine))]  # 2 GPUs: 2 ports a slot
        assert len({s["port"] for s in mine}) == len(mine)
    assert {s["vendor"] for s in slots} == {"nvidia"}
    text = pdctl(
        home, "plan", str(REPO / "examples/pd-vllm-nvidia.yml"), "--fleet", "f",
        "--allow-partial", env=ENV,
    ).stdout  # fmt: skip
    assert "prefill/1" in text and "Traceback" not in text
    assert not contacted(listener)
