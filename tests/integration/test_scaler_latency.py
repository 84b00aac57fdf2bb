"""Issue 17's acceptance on a lab of 1 CPU + 3 GPU hosts: each phase scales on its own signal.

Prefill 1..3 on `ttft` (400 ms), decode 1..3 on `itl` (60 ms), each over a 20 s window (the
60 s default only makes each phase change wait longer). Long prompts with short
answers move prefill up while decode stays at 1; short prompts with long answers move
decode up while prefill returns to 1. The workers are the lab's stand-ins with a finite
capacity (8,000 prompt tokens/s per prefill slot, 400 tokens/s per decode slot, a 10 ms
floor); the scaler is the deployed unit reading their /metrics.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    LAB_SCALING,
    Lab,
    pdctl,
    require_lab,
    running,
    service_status,
    start_lab,
    wait_for,
    watch_status,
)

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "pdlat"
TTFT = (
    "  - count: 1..3\n    scaling:\n      metric: ttft\n      target: 400ms\n"
    "      window: 20s\n      scale_down_delay: 30s\n"
)
ITL = (
    "  - count: 1..3\n    scaling:\n      metric: itl\n      target: 60ms\n"
    "      window: 20s\n      scale_down_delay: 30s\n"
)


def spec_text() -> str:
    text = (ROOT / "examples" / "lab" / "pd.yml").read_text()
    assert text.count(LAB_SCALING) == 2
    text = text.replace(LAB_SCALING, TTFT, 1).replace(LAB_SCALING, ITL, 1)
    text = text.replace("--disaggregation-mode ", "--enable-metrics --disaggregation-mode ")
    return text.replace("name: pdlab\n", f"name: {SERVICE}\n")


class Deployed:
    def __init__(self, lab: Lab, env: dict[str, str]) -> None:
        self.lab, self.env = lab, env
        self.endpoint = self.status()["endpoint"]
        router_env = lab.ssh("node1", f"cat /etc/pdctl/{SERVICE}/router.env", user="root")
        self.key = router_env.stdout.strip().split("=", 1)[1]

    def status(self) -> dict[str, Any]:
        return service_status(self.lab.home, SERVICE, self.env)


class Load(threading.Thread):
    """Chat requests at a steady rate, each in its own thread."""

    def __init__(self, deployed: Deployed, rps: float, words: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.deployed, self.rps = deployed, rps
        self.body = json.dumps(
            {
                "model": "lab/tiny-llama",
                "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
                "max_tokens": max_tokens,
            }
        ).encode()
        self.stop = threading.Event()
        self.ok = 0
        self.lock = threading.Lock()

    def one(self) -> None:
        request = urllib.request.Request(
            f"{self.deployed.endpoint}/v1/chat/completions",
            method="POST",
            data=self.body,
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {self.deployed.key}",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                response.read()
                ok = response.status == 200
        except (urllib.error.HTTPError, OSError):
            ok = False
        with self.lock:
            self.ok += ok

    def run(self) -> None:
        period = 1.0 / self.rps
        next_at = time.monotonic()
        while not self.stop.is_set():
            threading.Thread(target=self.one, daemon=True).start()
            next_at += period
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.join(5)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    require_lab()
    lab = start_lab(tmp_path_factory.mktemp("latency"), hosts=4, cpu_hosts=1)
    pdctl(lab.home, *lab.status()["fleet_add"].split()[1:])
    spec = lab.home / "pd.yml"
    spec.write_text(spec_text())
    env = {"HF_TOKEN": f"hf_{uuid.uuid4().hex}"}
    try:
        pdctl(lab.home, "deploy", str(spec), "--fleet", "lab", "-y", env=env)
        yield Deployed(lab, env)
    finally:
        pdctl(lab.home, "lab", "down", check=False)  # the hosts go with the service


def watch(deployed: Deployed, seconds: float, done: Any) -> tuple[dict[str, Any], list[Any]]:
    """Poll status until done(doc); every doc seen, for what must hold throughout."""
    return watch_status(deployed.status, seconds, done)


def test_each_phase_scales_on_its_own_latency(deployed: Deployed) -> None:
    with Load(deployed, rps=4, words=3000, max_tokens=4) as prompts:
        doc, seen = watch(deployed, 180, lambda d: running(d, "prefill") >= 2)
    assert all(running(d, "decode") == 1 for d in seen), [running(d, "decode") for d in seen]
    decision = doc["groups"]["prefill"]["last_decision"]
    assert decision["signal"] == "ttft" and decision["target"] == pytest.approx(0.4)
    assert prompts.ok > 0
    with Load(deployed, rps=3, words=10, max_tokens=200) as answers:
        doc, _ = watch(
            deployed,
            300,
            lambda d: running(d, "decode") >= 2 and running(d, "prefill") == 1,
        )
    decision = doc["groups"]["decode"]["last_decision"]
    assert decision["signal"] == "itl" and decision["target"] == pytest.approx(0.06)
    assert answers.ok > 0

    def journal() -> str:
        command = f"journalctl -u pd-{SERVICE}-scaler --no-pager"
        return deployed.lab.ssh("node1", command, user="root").stdout

    wanted = ("decision prefill: signal=ttft value=", "decision decode: signal=itl value=")
    wait_for(lambda: all(w in journal() for w in wanted), 30, 1, what="the decisions' log lines")
    assert "target=400ms" in journal() and "target=60ms" in journal()
