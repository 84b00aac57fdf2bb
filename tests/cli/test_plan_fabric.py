"""`pdctl plan` and the hosts' fabric records, through the real CLI: a warning for each host
with a slot whose last fabric check failed or that has none, and --strict refusing the plan.
No host is contacted: the fleet's hosts are a listening socket that must see no connection."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from pdctl import inventory
from pdctl.fleet_model import FabricRecord, Fleet, FleetHost, FleetSettings, Preflight
from pdctl.workspace import Workspace
from tests.hostfacts import nvidia_facts
from tests.support import contacted, pdctl

REPO = Path(__file__).resolve().parents[2]
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
