"""The lab's SGLang stand-in behind the REAL router (SMG 1.13): SMG must take it for SGLang.

One prefill and one decode stand-in run on 127.0.0.1; ``smg launch`` routes to them in PD
mode, and the client must get the decode's answer, streamed or not. Skipped only when no
``smg`` executable can be found (the project's dev extras install it).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_for, worker_tree_dir

ROOT = Path(__file__).resolve().parents[2]
WORKER_DIR = worker_tree_dir("sglang") / "site"  # the image's layout (worker_tree.py)
PROVIDER_NAME = "libbnxt_re-rdmav34.so"
MODEL = "Qwen/Qwen3-8B"
HOSTNAME = socket.gethostname()
FAST_HEALTH = [
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "1",
    "--worker-startup-check-interval", "1",
]  # fmt: skip


def find_smg() -> Path | None:
    """SMG from $PDCTL_SMG, the project venv, this interpreter's venv, or PATH."""
    candidates = [
        os.environ.get("PDCTL_SMG"),
        str(ROOT / ".venv" / "bin" / "smg"),
        str(Path(sys.executable).parent / "smg"),
        shutil.which("smg"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


SMG = find_smg()
pytestmark = pytest.mark.skipif(SMG is None, reason="smg not found (pip install smg==1.13.0)")


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(port: int, method: str, path: str, body: object = None, timeout: float = 30.0) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def status_of(port: int, path: str) -> int | None:
    try:
        return request(port, "GET", path, timeout=3).status
    except OSError:
        return None


def sse_events(body: bytes) -> list[str]:
    return [
        block.removeprefix("data: ")
        for block in body.decode().split("\n\n")
        if block.strip() and block.startswith("data: ")
    ]


def stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=10)


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    port: int
    bootstrap_port: int
    mode: str
    log_path: Path
    state_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def who(self) -> str:
        return f"[{self.mode} {HOSTNAME}:{self.port} model={MODEL}]"


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log_path: Path


@dataclass
class Lab:
    """Every process a test starts, killed at teardown."""

    tmp: Path
    workers: list[Worker] = field(default_factory=list)
    routers: list[Router] = field(default_factory=list)

    def worker(self, mode: str) -> Worker:
        provider = self.tmp / PROVIDER_NAME
        provider.write_bytes(b"\x7fELF fake provider")
        port, bootstrap = free_port(), free_port()
        state = self.tmp / f"{mode}-{port}.json"
        state.write_text("{}")
        log_path = self.tmp / f"{mode}-{port}.log"
        env = {
            **{k: v for k, v in os.environ.items() if k != "MC_FORCE_TCP"},
            "PYTHONPATH": str(WORKER_DIR),
            "PDFAKE_PROVIDER_LIB": str(provider),
            "PDFAKE_STATE": str(state),
            "PDFAKE_WARMUP_SECS": "0.5",
            "PDFAKE_LATENCY_MS": "10",
        }
        argv = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", MODEL,
            "--disaggregation-mode", mode,
            "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-bootstrap-port", str(bootstrap),
            "--host", "127.0.0.1", "--port", str(port),
            "--tp", "4", "--trust-remote-code", "--mem-fraction-static", "0.85",
        ]  # fmt: skip
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=log_file)
        worker = Worker(proc, port, bootstrap, mode, log_path, state)
        self.workers.append(worker)
        wait_for(lambda: status_of(port, "/health") == 200, timeout=20, step=0.05)
        return worker

    def router(self, *args: str, env: Mapping[str, str] | None = None) -> Router:
        assert SMG is not None
        port, metrics_port = free_port(), free_port()
        log_path = self.tmp / f"smg-{port}.log"
        argv = [
            str(SMG), "launch",
            "--host", "127.0.0.1", "--port", str(port),
            "--pd-disaggregation",
            *args,
            "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        ]  # fmt: skip
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                argv, env={**os.environ, **(env or {})}, stdout=log_file, stderr=log_file
            )
        router = Router(proc, port, metrics_port, log_path)
        self.routers.append(router)
        wait_for(lambda: status_of(port, "/liveness") == 200 or proc.poll() is not None, 30)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return router

    def close(self) -> None:
        for router in self.routers:
            stop(router.proc, grace=3)
        for worker in self.workers:
            stop(worker.proc, grace=10)


def wait_ready(router: Router, timeout: float = 60.0) -> None:
    try:
        wait_for(lambda: status_of(router.port, "/readiness") == 200, timeout)
    except AssertionError:
        pytest.fail(f"SMG never got ready:\n{router.log_path.read_text()[-4000:]}")


def paths_called(worker: Worker) -> list[str]:
    """The request paths in a worker's log, in order."""
    paths = []
    for line in worker.log().splitlines():
        if ' - "' in line:
            paths.append(line.split(' - "', 1)[1].split()[1])
    return paths


def polled_loads(worker: Worker) -> bool:
    return any(path.startswith("/v1/loads") for path in paths_called(worker))


def is_subsequence(wanted: list[str], seen: list[str]) -> bool:
    remaining = iter(seen)
    return all(any(item == path for path in remaining) for item in wanted)


def chat(prompt: str, stream: bool = False) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": stream}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lab = Lab(tmp_path_factory.mktemp("smg"))
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def deployment(lab: Lab) -> tuple[Router, Worker, Worker]:
    """The lab's usual shape: workers up first, then SMG launched with them on its command line."""
    prefill, decode = lab.worker("prefill"), lab.worker("decode")
    router = lab.router(
        "--prefill", prefill.url, str(prefill.bootstrap_port),
        "--decode", decode.url,
        "--worker-startup-check-interval", "1",
    )  # fmt: skip
    wait_ready(router)
    return router, prefill, decode


# --------------------------------------------------------------------------- SMG's view


def test_smg_registers_the_stand_ins_as_sglang(deployment: tuple[Router, Worker, Worker]) -> None:
    router, prefill, decode = deployment
    listing = request(router.port, "GET", "/workers").json()
    workers = {w["worker_type"]: w for w in listing["workers"]}
    assert set(workers) == {"prefill", "decode"}
    assert workers["prefill"]["url"] == prefill.url
    assert workers["prefill"]["bootstrap_port"] == prefill.bootstrap_port
    assert workers["decode"]["url"] == decode.url
    for worker in workers.values():
        assert worker["status"] == "ready"
        assert worker["is_healthy"] is True
        assert worker["runtime_type"] == "sglang"
        assert worker["connection_mode"] == "http"
        assert worker["model_id"] == MODEL
        assert worker["labels"]["model_path"] == MODEL
        assert worker["labels"]["tp_size"] == "4"
        assert worker["labels"]["version"] == "0.5.x-pdctl-lab"
    assert workers["decode"]["labels"]["disaggregation_mode"] == "decode"
    assert workers["prefill"]["labels"]["disaggregation_mode"] == "prefill"
    # What SMG asked each worker while registering it (see the report in the stand-in).
    for worker in (prefill, decode):
        wait_for(partial(polled_loads, worker), timeout=15)
        seen = [p.split("?")[0] for p in paths_called(worker)]
        assert is_subsequence(["/health", "/server_info", "/model_info", "/v1/models"], seen)
        assert "/v1/loads" in seen


def test_chat_completion_through_smg_is_the_decodes_answer(
    deployment: tuple[Router, Worker, Worker],
) -> None:
    router, prefill, decode = deployment
    reply = request(router.port, "POST", "/v1/chat/completions", chat("hello through smg"))
    assert reply.status == 200, reply.body
    completion = reply.json()
    assert completion["object"] == "chat.completion"
    content = completion["choices"][0]["message"]["content"]
    assert content == f"{decode.who()} echo: hello through smg"
    assert completion["usage"]["completion_tokens"] == len(content.split())
    # SMG sent the same request to both, with the prefill's bootstrap address added.
    tag = f"bootstrap=127.0.0.1:{prefill.bootstrap_port} room="

    def chat_lines(worker: Worker) -> list[str]:
        return [ln for ln in worker.log().splitlines() if "/v1/chat/completions" in ln]

    # The access log line may land just after the reply (a loaded machine): wait for it.
    wait_for(lambda: bool(chat_lines(decode)) and bool(chat_lines(prefill)), timeout=10)
    decode_lines, prefill_lines = chat_lines(decode), chat_lines(prefill)
    assert tag in decode_lines[-1]
    room = decode_lines[-1].split("room=")[1].split()[0]
    assert any(f"room={room} " in ln and " prefill " in ln for ln in prefill_lines)
    assert "KV bootstrap connection from 127.0.0.1" in prefill.log()


def test_streamed_chat_through_smg(deployment: tuple[Router, Worker, Worker]) -> None:
    router, _, decode = deployment
    reply = request(router.port, "POST", "/v1/chat/completions", chat("stream it", stream=True))
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == f"{decode.who()} echo: stream it"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_generate_through_smg(deployment: tuple[Router, Worker, Worker]) -> None:
    router, _, decode = deployment
    body = {"text": "native path", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    reply = request(router.port, "POST", "/generate", body)
    assert reply.status == 200, reply.body
    # max_new_tokens reaches the decode: its 6-word echo is cycled to 16 tokens.
    echo = f"{decode.who()} echo: native path".split()
    expected = " ".join((echo * 3)[:16])
    assert reply.json()["text"] == expected
    streamed = request(router.port, "POST", "/generate", {**body, "stream": True})
    assert streamed.status == 200, streamed.body
    events = sse_events(streamed.body)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == expected


def test_completions_through_smg(deployment: tuple[Router, Worker, Worker]) -> None:
    router, _, decode = deployment
    reply = request(router.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "p q"})
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["text"] == f"{decode.who()} echo: p q"


def histogram_total(worker: Worker, name: str, part: str) -> float:
    """``sglang:<name>_seconds_<part>`` (count or sum) from the worker's /metrics."""
    text = request(worker.port, "GET", "/metrics").body.decode()
    prefix = f'sglang:{name}_seconds_{part}{{model_name="{MODEL}"}} '
    return sum(float(ln.removeprefix(prefix)) for ln in text.splitlines() if ln.startswith(prefix))


def test_prefill_time_reaches_the_client_through_smg(
    deployment: tuple[Router, Worker, Worker],
) -> None:
    """SMG sends both legs at once; the decode waits for its prefill's KV hand-off, so the
    client's first token comes after the prefill, which records TTFT, the decode ITL."""
    router, prefill, decode = deployment
    ttft_before = histogram_total(prefill, "time_to_first_token", "count")
    itl_before = histogram_total(decode, "inter_token_latency", "count")
    prefill.state_path.write_text(json.dumps({"prefill_tokens_per_s": 2000}))
    try:
        words = " ".join(f"w{i}" for i in range(600))  # 0.3 s of prefill at 2,000 tokens/s
        body = {**chat(words, stream=True), "max_tokens": 3}
        started = time.monotonic()
        reply = request(router.port, "POST", "/v1/chat/completions", body)
        elapsed = time.monotonic() - started
    finally:
        prefill.state_path.write_text("{}")
    assert reply.status == 200, reply.body
    chunks = [json.loads(e) for e in sse_events(reply.body) if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(text.split()) == 3
    assert elapsed >= 0.3
    wait_for(lambda: histogram_total(prefill, "time_to_first_token", "count") == ttft_before + 1)
    assert histogram_total(prefill, "time_to_first_token", "sum") >= 0.3
    assert histogram_total(decode, "inter_token_latency", "count") == itl_before + 2
    assert "KV hand-off" not in decode.log()  # SMG's bootstrap_room reached the prefill


def test_router_metrics_count_requests(deployment: tuple[Router, Worker, Worker]) -> None:
    router, _, decode = deployment
    assert request(router.port, "POST", "/v1/chat/completions", chat("count me")).status == 200

    def chat_requests() -> float:
        text = request(router.metrics_port, "GET", "/metrics").body.decode()
        lines = [ln for ln in text.splitlines() if ln.startswith("smg_router_requests_total{")]
        chat_lines = [ln for ln in lines if 'endpoint="chat"' in ln and 'backend_type="pd"' in ln]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in chat_lines)

    # SMG books a request beside answering it: on a loaded machine the count may come later.
    wait_for(lambda: chat_requests() >= 1, 30, what="smg_router_requests_total for the chat")
    text = request(router.metrics_port, "GET", "/metrics").body.decode()
    assert f'smg_worker_requests_total{{worker="{decode.url}"' in text


# --------------------------------------------------------------------------- dynamic registration


def test_workers_api_registration_and_health_fault(lab: Lab) -> None:
    router = lab.router(*FAST_HEALTH)
    assert status_of(router.port, "/readiness") == 503
    prefill, decode = lab.worker("prefill"), lab.worker("decode")
    add_prefill = {
        "url": prefill.url,
        "worker_type": "prefill",
        "bootstrap_port": prefill.bootstrap_port,
        "runtime": "sglang",
    }
    add_decode = {"url": decode.url, "worker_type": "decode", "runtime": "sglang"}
    for body in (add_prefill, add_decode):
        reply = request(router.port, "POST", "/workers", body)
        assert reply.status == 202, reply.body
        assert reply.json()["status"] == "accepted"
    wait_ready(router)
    reply = request(router.port, "POST", "/v1/chat/completions", chat("registered later"))
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["message"]["content"].startswith(decode.who())
    # A worker that turns unhealthy takes the PD pool out of service, then back.
    decode.state_path.write_text(json.dumps({"worker_unhealthy": True}))
    wait_for(lambda: status_of(router.port, "/readiness") == 503, timeout=30)
    decode.state_path.write_text("{}")
    wait_ready(router, timeout=30)


def test_unreachable_bootstrap_surfaces_as_a_500_naming_it(lab: Lab) -> None:
    prefill, decode = lab.worker("prefill"), lab.worker("decode")
    wrong = free_port()
    router = lab.router(
        "--prefill", prefill.url, str(wrong),
        "--decode", decode.url,
        "--disable-retries",
        *FAST_HEALTH,
    )  # fmt: skip
    wait_ready(router)
    reply = request(router.port, "POST", "/v1/chat/completions", chat("doomed"))
    assert reply.status == 500, reply.body
    assert f"127.0.0.1:{wrong}" in reply.body.decode()
    assert "KV transfer could not start" in reply.body.decode()
