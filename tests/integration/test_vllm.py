"""vLLM P/D behind SMG, end to end on a 3-host lab (1 CPU host, 2 GPU hosts, `:4` replicas).

The lab's vLLM stand-in image runs both of vLLM's gRPC entry points (`vllm serve --grpc` for
prefill, `python -m vllm.entrypoints.grpc_server` for decode) with NixlConnector producer and
consumer; its decode refuses a request without the prefill's kv_transfer_params and fetches
the KV from the prefill's NIXL side channel, so a served chat proves the P->D handoff. SMG
takes the tokenizer from the workers (the lab has no route out). One lab, one deployment, the
checks in file order: everything is the real program (sshd, Ansible, systemd, podman, SMG,
the scaler) but the GPUs and vLLM itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import Lab, chat, lab_fleet, pdctl, service_status

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "lab" / "pd-vllm.yml"
SERVICE = "vlab"
IMAGE = ("vllm-rocm:0.11.0-lab", "vllm-rocm:0.11.1-lab")


@dataclass
class Service:
    lab: Lab
    env: dict[str, str]

    def pdctl(self, *args: str, check: bool = True) -> Any:
        return pdctl(self.lab.home, *args, env=self.env, check=check)

    def json(self, *args: str) -> Any:
        return json.loads(self.pdctl("--json", *args).stdout)

    def status(self) -> dict[str, Any]:
        return service_status(self.lab.home, SERVICE, self.env)

    def key(self) -> str:
        return str(self.json("endpoint", SERVICE, "--show-key")["api_key"])

    def serving(self, role: str) -> int:
        replicas = self.status()["groups"][role]["replicas"]
        return sum(1 for r in replicas if r["state"] == "active" and r["registered"])

    def router_log(self) -> str:
        node = self.lab.node_at(self.status()["groups"]["router"]["host"])
        command = f"journalctl -u pd-{SERVICE}-router.service --since -4min --no-pager | tail -60"
        return str(self.lab.ssh(node, command, user="root", check=False).stdout)


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    lab = lab_fleet(tmp_path_factory, "vllm")
    service = Service(lab=lab, env={"HF_TOKEN": f"hf_{uuid.uuid4().hex}"})
    yield service
    pdctl(lab.home, "lab", "down")  # the hosts go with the service: no destroy needed


def stream_chat(endpoint: str, text: str, key: str) -> list[str]:
    """A streamed chat completion: the content of each of its chunks, in order."""
    request = urllib.request.Request(
        f"{endpoint}/v1/chat/completions",
        method="POST",
        data=json.dumps(
            {
                "model": "lab/tiny-llama",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 6,
                "stream": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    pieces: list[str] = []
    with urllib.request.urlopen(request, timeout=20) as response:
        assert response.status == 200
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data:") :])["choices"]:
                pieces.append(choice.get("delta", {}).get("content") or "")
    return pieces


def test_deploy_serves_chats_streamed_and_not(svc: Service) -> None:
    started = time.monotonic()
    proc = svc.pdctl("--json", "deploy", str(SPEC), "--fleet", "lab", "-y", check=False)
    took = time.monotonic() - started
    if proc.returncode != 0:
        router = svc.lab.ssh(
            "node1",
            f"journalctl -u pd-{SERVICE}-router.service --no-pager | tail -60",
            user="root",
            check=False,
        ).stdout
        raise AssertionError(f"deploy failed:\n{proc.stdout}\n{proc.stderr}\nrouter:\n{router}")
    doc = json.loads(proc.stdout)
    endpoint, key = doc["endpoint"], svc.key()
    status, body = chat(endpoint, "hello there vllm", key, timeout=20)
    assert status == 200, (body, svc.router_log())
    words = body["choices"][0]["message"]["content"].split()
    assert words and 0 < body["usage"]["completion_tokens"] <= 8  # the client's max_tokens
    pieces = stream_chat(endpoint, "and now streamed", key)
    assert "".join(pieces).split(), pieces
    assert took < 240


def test_workers_are_registered_over_grpc_with_their_side_channels(svc: Service) -> None:
    groups = svc.status()["groups"]
    plan = svc.json("plan", str(SPEC), "--fleet", "lab")["plan"]
    slots = {f"{s['group']}/{s['index']}": s for g in plan["groups"].values() for s in g["slots"]}
    for role in ("prefill", "decode"):
        (replica,) = [r for r in groups[role]["replicas"] if r["state"] == "active"]
        assert replica["registered"] and replica["healthy"], replica
        slot = slots[f"{role}/{replica['slot']}"]
        node = svc.lab.node_at(replica["host"])
        env = svc.lab.ssh(
            node, f"podman exec pd-{SERVICE}-{role}-{replica['slot']} env", user="root"
        ).stdout
        assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={slot['side_channel_port']}" in env
        assert f"VLLM_NIXL_SIDE_CHANNEL_HOST={slot['address']}" in env
    router = svc.lab.node_at(groups["router"]["host"])
    unit = svc.lab.ssh(router, f"systemctl cat pd-{SERVICE}-router.service", user="root").stdout
    assert "--enable-igw" in unit


def test_logs_show_a_vllm_replicas_journal(svc: Service) -> None:
    lines = svc.pdctl("logs", SERVICE, "decode/1", "-n", "5").stdout.splitlines()
    assert 1 <= len(lines) <= 5 and all(f"pd-{SERVICE}-decode-1" in line for line in lines)


def test_scale_decode_to_two_still_serves(svc: Service) -> None:
    svc.pdctl("scale", SERVICE, "decode", "2")
    deadline = time.monotonic() + 120
    while svc.serving("decode") != 2:
        assert time.monotonic() < deadline, svc.status()
        time.sleep(1)
    key, endpoint = svc.key(), svc.status()["endpoint"]
    for text in ("one", "two", "three", "four"):  # round robin: both decodes answer
        status, body = chat(endpoint, text, key, timeout=20)
        assert status == 200, body


def test_the_scale_playbook_probes_vllm_workers_over_grpc(svc: Service, tmp_path: Path) -> None:
    """playbooks/scale.yml (the path for ops pipelines) at the count pdctl pinned: it waits on
    each running decode's gRPC health through the roles' shared wait (pd_health) and registers
    them (409: they are), then both still serve."""
    plan = tmp_path / "plan.yml"
    svc.pdctl("plan", str(SPEC), "--fleet", "lab", "-o", str(plan))
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run(
        [
            str(bin_dir / "ansible-playbook"),
            *("-i", str(svc.lab.home / "inventories" / "lab")),
            str(ROOT / "playbooks" / "scale.yml"),
            *("-e", f"@{plan}", "-e", "pd_scale_group=decode", "-e", "pd_scale_replicas=2"),
        ],
        capture_output=True,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")},
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            **svc.env,
        },
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "pd_health : Wait for the units to be healthy" in proc.stdout
    assert svc.serving("decode") == 2


class Client(threading.Thread):
    """A steady client at ~10 requests per second, each in its own thread."""

    def __init__(self, endpoint: str, key: str) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.key = endpoint, key
        self.done = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.lock = threading.Lock()
        self.inflight: list[threading.Thread] = []

    def one(self) -> None:
        try:
            status, body = chat(self.endpoint, "rolling", self.key, timeout=20)
        except OSError as exc:
            status, body = 0, {"error": str(exc)}
        with self.lock:
            if status == 200:
                self.ok += 1
            else:
                self.failed.append(f"{time.strftime('%H:%M:%S')} {status} {body}")

    def run(self) -> None:
        while not self.done.is_set():
            worker = threading.Thread(target=self.one, daemon=True)
            worker.start()
            self.inflight.append(worker)
            time.sleep(0.1)

    def stop(self) -> None:
        self.done.set()
        self.join(30)
        for worker in self.inflight:
            worker.join(30)


def test_a_rolling_update_under_10_rps_fails_no_request(svc: Service, tmp_path: Path) -> None:
    # Prefill pinned at 1 rolls onto its spare slot; decode pinned at its maximum (2) restarts
    # in place, one replica after the other.
    svc.pdctl("scale", SERVICE, "prefill", "1")
    changed = tmp_path / "pd.yml"
    changed.write_text(SPEC.read_text().replace(*IMAGE))
    client = Client(svc.status()["endpoint"], svc.key())
    client.start()
    try:
        time.sleep(2)
        doc = svc.json("deploy", str(changed), "--fleet", "lab", "-y")
        time.sleep(2)
    finally:
        client.stop()
    assert set(doc["rolled"]) == {"prefill/1", "decode/1", "decode/2"}
    assert client.failed == [] and client.ok > 50, (client.failed[:5], svc.router_log())
    groups = svc.status()["groups"]
    assert not any(r["stale"] for role in ("prefill", "decode") for r in groups[role]["replicas"])
    images = "".join(
        svc.lab.ssh(node, "podman ps --format '{{.Image}}'", user="root").stdout
        for node in svc.lab.gpu_hosts()
    )
    assert IMAGE[1] in images and IMAGE[0] not in images


def test_destroy_leaves_no_pd_unit(svc: Service) -> None:
    svc.pdctl("destroy", SERVICE, "-y")
    for node in ("node1", "node2", "node3"):
        left = svc.lab.ssh(
            node,
            "systemctl list-units --all --no-legend 'pd-*' | wc -l;"
            " ls /etc/systemd/system | grep -c '^pd-';"
            " podman ps -a --format '{{.Names}}' 2>/dev/null | grep -c '^pd-'",
            user="root",
            check=False,
        ).stdout.split()
        assert left == ["0", "0", "0"], f"{node}: {left}"
