"""Issue 27's GPU budget on a lab of 1 CPU + 3 GPU hosts (24 GPUs): two services on one fleet
whose budget (20 GPUs) has room for one more replica of 4 beyond their min counts (8 each).

Both get more load than one decode replica carries at the same time; the busier one (further
from its target) gets the replica, the other's scale-out is refused and shows so in `pdctl
status` and in its scaler's metrics. Destroying the busy service releases its GPUs from the
ledger, and the other then grows. Everything is the real program: `fleet add --gpu-budget`,
deploy's checks, the scalers on the router host drawing from one ledger file under its lock.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    LAB_SCALING,
    Lab,
    pdctl,
    require_lab,
    service_status,
    start_lab,
    wait_for,
)

SPEC = Path(__file__).resolve().parents[2] / "examples" / "lab" / "pd.yml"
BUDGET = 20
PORTS = {"calm": (8000, 29000), "busy": (8001, 29001)}
RPS = {"calm": 5.0, "busy": 9.0}  # a decode replica carries 2 rps: 2.5x and 4.5x its target


def service_text(name: str, port: int, metrics: int) -> str:
    """The lab example as ``name``: prefill fixed at 1, decode 1..2 on rps (its spare slot the
    only growth), its router on ``port`` and metrics on ``metrics`` (both routers on node1)."""
    text = SPEC.read_text()
    assert text.count(LAB_SCALING) == 2
    text = text.replace(LAB_SCALING, "  - count: 1\n", 1)
    text = text.replace("name: pdlab\n", f"name: {name}\n")
    text = text.replace("port: 8000\nmodel:", f"port: {port}\nmodel:")
    router = "  router:\n    health_check_interval"
    return text.replace(router, router.replace("\n", f"\n    metrics_port: {metrics}\n"))


@dataclass
class Fleet:
    lab: Lab
    env: dict[str, str]

    def status(self, name: str) -> dict[str, Any]:
        return service_status(self.lab.home, name, self.env)

    def decodes(self, name: str) -> int:
        return int(self.status(name)["groups"]["decode"]["running"])

    def key(self, name: str) -> str:
        env = self.lab.ssh("node1", f"cat /etc/pdctl/{name}/router.env", user="root").stdout
        return env.strip().split("=", 1)[1]

    def scaler_metric(self, name: str, sample: str) -> float:
        """One sample of the service's scaler's own metrics, read on the router host at the
        port its config gives (127.0.0.1 only)."""
        script = (
            "import json, urllib.request as u\n"
            f"port = json.load(open('/etc/pdctl/{name}/scaler.json'))['metrics']['port']\n"
            "print(u.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=5).read().decode())\n"
        )
        text = self.lab.ssh("node1", "python3 -", user="root", stdin=script).stdout
        for line in text.splitlines():
            if line.startswith((sample + " ", sample + "{")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


class Load(threading.Thread):
    def __init__(self, endpoint: str, key: str, rps: float) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.key, self.rps = endpoint, key, rps
        self.stopping = threading.Event()

    def one(self) -> None:
        body = {"model": "lab/tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}  # fmt: skip
        request = urllib.request.Request(
            f"{self.endpoint}/v1/chat/completions",
            method="POST",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
        except (urllib.error.HTTPError, OSError):
            pass  # the scaler counts what the router saw; failures are not this test's

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stopping.is_set():
            threading.Thread(target=self.one, daemon=True).start()
            next_at += 1.0 / self.rps
            self.stopping.wait(max(0.0, next_at - time.monotonic()))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_lab()
    lab = start_lab(tmp_path_factory.mktemp("budget"), hosts=4, cpu_hosts=1)
    env = {"HF_TOKEN": f"hf_{uuid.uuid4().hex}"}
    try:
        pdctl(lab.home, *lab.status()["fleet_add"].split()[1:], "--gpu-budget", str(BUDGET))
        for name, (port, metrics) in PORTS.items():
            spec = lab.home / f"{name}.yml"
            spec.write_text(service_text(name, port, metrics))
            pdctl(lab.home, "deploy", str(spec), "--fleet", "lab", "-y", env=env)
        yield Fleet(lab, env)
    finally:
        pdctl(lab.home, "lab", "down", check=False)


def test_one_replica_of_room_goes_to_the_busier_service(fleet: Fleet) -> None:
    loads = [Load(fleet.status(name)["endpoint"], fleet.key(name), RPS[name]) for name in PORTS]
    for load in loads:
        load.start()
    try:
        wait_for(lambda: fleet.decodes("busy") == 2, 180, 3, what="busy's second decode")

        def refused() -> bool:
            decision = fleet.status("calm")["groups"]["decode"]["last_decision"] or {}
            return "GPU budget" in (decision.get("refusal") or "")

        wait_for(refused, 60, 3, what="calm's refusal in its status")
        for _ in range(5):  # and it stays so: exactly one service got the replica
            assert fleet.decodes("calm") == 1 and fleet.decodes("busy") == 2
            time.sleep(3)
        calm = fleet.status("calm")
        assert calm["scaler"]["budget"]["budget"] == BUDGET
        assert calm["scaler"]["budget"]["holders"] == {"busy": 12, "calm": 8}
        refusals = 'pdctl_scaler_budget_refusals_total{group="decode"}'
        assert fleet.scaler_metric("calm", refusals) > 0
        human = pdctl(fleet.lab.home, "status", "calm", env=fleet.env).stdout
        assert "scale-out refused: GPU budget" in human and "fleet 20 of 20" in human
        # Destroying busy releases its GPUs from the ledger: calm grows into them.
        loads[1].stopping.set()
        pdctl(fleet.lab.home, "destroy", "busy", "-y", env=fleet.env)
        wait_for(lambda: fleet.decodes("calm") == 2, 180, 3, what="calm's second decode")
    finally:
        for load in loads:
            load.stopping.set()
