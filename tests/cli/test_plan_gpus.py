"""`pdctl plan` on NVIDIA and mixed fleets, through the real CLI: each slot's NICs in the text
table and in --json, what each host has when nothing matches, and hostile facts never written.
No host is contacted: the fleet's hosts are a listening socket that must see no connection."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from pdctl import inventory
from pdctl.fleet_model import Fleet, FleetHost, FleetSettings, Preflight
from pdctl.workspace import Workspace
from tests.hostfacts import amd_facts, nvidia_facts
from tests.support import contacted, pdctl

REPO = Path(__file__).resolve().parents[2]
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


@pytest.fixture
def port(listener: socket.socket) -> int:
    return int(listener.getsockname()[1])


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
