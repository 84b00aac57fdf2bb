"""`pdctl plan` of the vLLM examples on emulated fleets (hosts' facts as `pdctl fleet check`
stores them), through the real CLI: gRPC workers, NIXL side channels, UCX on the nearest NICs,
SMG as IGW. No host is contacted."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from tests.cli.test_plan_gpus import _workspace
from tests.hostfacts import amd_facts, nvidia_facts
from tests.support import contacted, pdctl

REPO = Path(__file__).resolve().parents[2]
ENV = {"HF_TOKEN": "hf_x", "COLUMNS": "250"}


@pytest.fixture
def port(listener: socket.socket) -> int:
    return int(listener.getsockname()[1])


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
