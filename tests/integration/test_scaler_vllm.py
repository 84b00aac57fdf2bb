"""Issue 27 on a lab of 1 CPU + 3 GPU hosts: a vLLM service scales each phase on its latency,
read without HTTP on the workers; `pdctl scaler advise` shows what the acting scaler decides;
a vLLM scale-in under light load fails no request.

The service is llm-d's shape (`vllm serve --grpc`, NixlConnector `kv_both` in both groups,
their roles by name), prefill 1..3 on `ttft` (400 ms), decode 1..3 on `itl` (60 ms), each over
a 20 s window (a span users may set; the 60 s default only makes each phase change wait
longer). The workers are the lab's vLLM stand-ins with the capacity model (8,000 prompt
tokens/s per prefill, 400 tokens/s per decode, a 10 ms floor); the scaler is the deployed
unit, reading SMG's own histograms (smg_pd_prefill_duration_seconds, smg_router_tpot_seconds)
and the engines' GetLoads over gRPC.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
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
SERVICE = "vscale"
SPEC = """\
type: service
name: vscale
image: localhost/pdctl-lab/vllm-rocm:0.11.0-lab
env:
  - HF_TOKEN
  - MODEL_ID=lab/tiny-llama
replicas:
  - count: 1
    commands:
      - >-
        smg launch --host 0.0.0.0 --port 8000 --pd-disaggregation
        --prefill-policy round_robin --decode-policy round_robin
    router:
      type: sglang
  - name: prefill
    count: 1..3
    scaling:
      metric: ttft
      target: 400ms
      window: 20s
      scale_down_delay: 30s
    commands:
      - |
        vllm serve $MODEL_ID --grpc \\
          --tensor-parallel-size 4 --block-size 128 --attention-backend ROCM_ATTN \\
          --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    resources:
      gpu: MI300X:4
  - name: decode
    count: 1..3
    scaling:
      metric: itl
      target: 60ms
      window: 20s
      scale_down_delay: 30s
    commands:
      - |
        vllm serve $MODEL_ID --grpc \\
          --tensor-parallel-size 4 --block-size 128 --attention-backend ROCM_ATTN \\
          --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    resources:
      gpu: MI300X:4
port: 8000
model: lab/tiny-llama
probes:
  - interval: 2s
pdctl:
  start_timeout: 2m
  stop_timeout: 60s
  router:
    health_check_interval: 2s
"""


class Deployed:
    def __init__(self, lab: Lab, env: dict[str, str]) -> None:
        self.lab, self.env = lab, env
        self.endpoint = self.status()["endpoint"]
        key = pdctl(lab.home, "--json", "endpoint", SERVICE, "--show-key", env=env)
        self.key = json.loads(key.stdout)["api_key"]

    def status(self) -> dict[str, Any]:
        return service_status(self.lab.home, SERVICE, self.env)

    def journal(self) -> str:
        command = f"journalctl -u pd-{SERVICE}-scaler --no-pager -o cat"
        return self.lab.ssh("node1", command, user="root").stdout


class Load(threading.Thread):
    """Chat requests at a steady rate, each in its own thread; failures are kept.

    `cut()` closes the connections of the requests still in flight: an answer-heavy load leaves
    a backlog of streams that takes a minute to finish, and the router cancels a stream whose
    client went away (its engine stops generating it), so a test that has seen what it waited
    for need not wait them out. What ends after the cut counts as neither answered nor failed.
    """

    def __init__(
        self, deployed: Deployed, rps: float, words: int, max_tokens: int, stream: bool = False
    ) -> None:
        super().__init__(daemon=True)
        self.deployed, self.rps, self.stream = deployed, rps, stream
        self.body = json.dumps(
            {
                "model": "lab/tiny-llama",
                "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
                "max_tokens": max_tokens,
                "stream": stream,
            }
        ).encode()
        self.stopping = threading.Event()
        self.cutting = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.in_flight: set[http.client.HTTPConnection] = set()
        self.endpoint = urllib.parse.urlsplit(deployed.endpoint)

    def one(self) -> None:
        assert self.endpoint.hostname is not None
        connection = http.client.HTTPConnection(
            self.endpoint.hostname, self.endpoint.port, timeout=180
        )
        with self.lock:
            self.in_flight.add(connection)
        headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {self.deployed.key}",
        }
        try:
            connection.request("POST", "/v1/chat/completions", body=self.body, headers=headers)
            response = connection.getresponse()
            body = response.read()
            ok = response.status == 200 and (not self.stream or b"[DONE]" in body)
            detail = f"{response.status} {body[-200:]!r}"
        except (OSError, http.client.HTTPException) as exc:
            ok, detail = False, str(exc)
        finally:
            connection.close()
        with self.lock:
            self.in_flight.discard(connection)
            if ok:
                self.ok += 1
            elif not self.cutting.is_set():
                self.failures.append(f"{time.strftime('%H:%M:%S')} {detail}")

    def run(self) -> None:
        period = 1.0 / self.rps
        next_at = time.monotonic()
        while not self.stopping.is_set():
            thread = threading.Thread(target=self.one, daemon=True)
            thread.start()
            self.threads.append(thread)
            next_at += period
            self.stopping.wait(max(0.0, next_at - time.monotonic()))

    def cut(self) -> None:
        """Stop sending and close every connection still waiting for its answer."""
        self.stopping.set()
        self.join(5)
        with self.lock:
            self.cutting.set()
            for connection in self.in_flight:
                if connection.sock is not None:
                    with contextlib.suppress(OSError):
                        connection.sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stopping.set()
        self.join(5)
        for thread in self.threads:
            thread.join(200)


def prompt_heavy(deployed: Deployed) -> Load:
    """Long prompts, short answers, not streamed. 3,000 words is about 11,000 prompt tokens
    here: one prefill carries about 0.7 requests/s (44 requests in a 20 s window at 3
    prefills). 1.5 requests/s queues on one prefill (the TTFT the scaler must see) and drains
    once prefill has grown; a rate past what 3 prefills carry left a backlog that each test
    then waited out (40-95 s) as its load's requests finished."""
    return Load(deployed, rps=1.5, words=3000, max_tokens=4)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    require_lab()
    lab = start_lab(tmp_path_factory.mktemp("vscale"), hosts=4, cpu_hosts=1)
    spec = lab.home / "pd.yml"
    spec.write_text(SPEC)
    env = {"HF_TOKEN": f"hf_{uuid.uuid4().hex}"}
    try:
        pdctl(lab.home, *lab.status()["fleet_add"].split()[1:])
        pdctl(lab.home, "deploy", str(spec), "--fleet", "lab", "-y", env=env)
        yield Deployed(lab, env)
    finally:
        pdctl(lab.home, "lab", "down", check=False)  # the hosts go with the service


def watch(deployed: Deployed, seconds: float, done: Any) -> tuple[dict[str, Any], list[Any]]:
    """Poll status until done(doc); every doc seen, for what must hold throughout."""
    return watch_status(deployed.status, seconds, done, deployed.journal)


def test_prompt_heavy_load_grows_prefill_only(deployed: Deployed) -> None:
    """Long prompts, short answers (not streamed): the prefill legs queue (SMG's
    smg_pd_prefill_duration_seconds); decode stays at 1."""
    with prompt_heavy(deployed) as prompts:
        doc, seen = watch(deployed, 240, lambda d: running(d, "prefill") >= 2)
    assert all(running(d, "decode") == 1 for d in seen), [running(d, "decode") for d in seen]
    decision = doc["groups"]["prefill"]["last_decision"]
    assert decision["signal"] == "ttft" and decision["target"] == pytest.approx(0.4)
    assert "smg_pd_prefill_duration_seconds" in decision["source"]
    assert prompts.ok > 0


def test_answer_heavy_load_grows_decode_only(deployed: Deployed) -> None:
    """Short prompts, long streamed answers: the decode streams crowd (SMG's
    smg_router_tpot_seconds); prefill returns to 1."""
    with Load(deployed, rps=4, words=10, max_tokens=200, stream=True) as answers:
        doc, _ = watch(
            deployed,
            420,
            lambda d: running(d, "decode") >= 2 and running(d, "prefill") == 1,
        )
        answers.cut()  # the backlog's streams would take a minute more
    decision = doc["groups"]["decode"]["last_decision"]
    assert decision["signal"] == "itl" and decision["target"] == pytest.approx(0.06)
    assert answers.ok > 0
    wanted = ("decision prefill: signal=ttft value=", "decision decode: signal=itl value=")
    wait_for(lambda: all(w in deployed.journal() for w in wanted), 30, 1, what="the decisions")
    assert "source=smg_router_tpot_seconds" in deployed.journal()


def test_advise_beside_the_acting_scaler_agrees_with_it(deployed: Deployed) -> None:
    """`pdctl scaler advise` beside the acting scaler, under the same prompt-heavy load: it
    decides on the same signals and comes to the count the acting scaler keeps, and acts on
    nothing (the tick-by-tick comparison, in lockstep: tests/unit/scaler/test_advise.py)."""
    with prompt_heavy(deployed):
        advised = pdctl(
            deployed.lab.home, "--json", "scaler", "advise", SERVICE, "--for", "45s",
            env=deployed.env,
        )  # fmt: skip
        doc = json.loads(advised.stdout)
        last = {g: s["last"] for g, s in doc["summary"].items()}
        # The acting scaler, on the same load, keeps (or comes to) the advised counts.
        watch(
            deployed,
            90,
            lambda d: all(
                (d["groups"][g]["last_decision"] or {}).get("desired") == last[g]["desired"]
                for g in ("prefill", "decode")
            ),
        )
    assert doc["mode"] == "advise" and doc["ticks"] >= 10
    assert {d["signal"] for d in doc["decisions"] if d["group"] == "prefill"} == {"ttft"}
    assert all(d["reason"] for d in doc["decisions"])
    assert "smg_pd_prefill_duration_seconds" in (last["prefill"]["source"] or "")
    assert last["prefill"]["desired"] >= 2  # the prompts need more than one prefill
    assert doc["metrics"]["pdctl_scaler_advise_only"] == 1
    assert deployed.status()["scaler"]["mode"] == "act"  # the acting scaler's record stands
    assert "advice " not in deployed.journal()  # nothing of the advice went to the unit


def test_a_vllm_scale_in_under_light_load_fails_no_request(deployed: Deployed) -> None:
    """Every group back to 1 on a trickle of streamed answers: the leaving replicas drain
    (deregistered, their in-flight answers finished) before they stop."""
    with Load(deployed, rps=1, words=20, max_tokens=40, stream=True) as trickle:
        watch(deployed, 300, lambda d: running(d, "prefill") == 1 and running(d, "decode") == 1)
        time.sleep(5)
    assert trickle.failures == [], trickle.failures
    assert trickle.ok > 20
    assert "drained and stopped" in deployed.journal()


def test_a_scaler_deployed_to_advise_acts_on_nothing(deployed: Deployed) -> None:
    """`pdctl: {scaling: {mode: advise}}`: the deployed scaler decides under load and says so
    (its journal, status, metrics) while the replicas stay as they are."""
    spec = deployed.lab.home / "advise.yml"
    spec.write_text(SPEC + "  scaling:\n    mode: advise\n")
    pdctl(deployed.lab.home, "deploy", str(spec), "--fleet", "lab", "-y", env=deployed.env)
    before = {g: running(deployed.status(), g) for g in ("prefill", "decode")}
    with prompt_heavy(deployed):
        wait_for(
            lambda: (
                "advice prefill: signal=ttft" in deployed.journal()
                and "action=up" in deployed.journal().split("advice prefill:")[-1]
            ),
            240,
            3,
            what="the advice to grow prefill",
        )
        doc = deployed.status()
    assert doc["scaler"]["mode"] == "advise"
    assert {g: running(doc, g) for g in ("prefill", "decode")} == before
    assert doc["groups"]["prefill"]["last_decision"]["desired"] > before["prefill"]
