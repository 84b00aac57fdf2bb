"""The lab's SGLang stand-in (pdctl/lab/worker/sglang), run as the lab runs it.

Each test starts ``python -m sglang.launch_server`` as a subprocess on 127.0.0.1 and speaks
HTTP to it, as SMG and the lab's tools do.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_for, worker_tree_dir

WORKER_DIR = worker_tree_dir("sglang") / "site"  # the image's layout (worker_tree.py)
PROVIDER_NAME = "libbnxt_re-rdmav34.so"
PROVIDER_WARNING = (
    "libibverbs: Warning: couldn't load driver 'libbnxt_re-rdmav34.so': "
    "libbnxt_re-rdmav34.so: cannot open shared object file: No such file or directory"
)
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HOSTNAME = socket.gethostname()


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


def request(
    port: int,
    method: str,
    path: str,
    body: object = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=payload, headers=all_headers)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def health(port: int) -> int | None:
    try:
        return request(port, "GET", "/health", timeout=2).status
    except OSError:
        return None


def wait_http(port: int, path: str = "/health", status: int = 200, timeout: float = 15.0) -> None:
    def answered() -> bool:
        try:
            return request(port, "GET", path, timeout=2).status == status
        except OSError:
            return False

    wait_for(answered, timeout)


def sse_events(body: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    events = []
    for block in body.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(block.removeprefix("data: "))
    return events


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    port: int
    bootstrap_port: int
    log_path: Path
    state_path: Path
    mode: str

    def log(self) -> str:
        return self.log_path.read_text()

    def who(self) -> str:
        return f"[{self.mode} {HOSTNAME}:{self.port} model={MODEL}]"


@dataclass
class Launcher:
    tmp: Path
    provider: Path
    started: list[Worker] = field(default_factory=list)

    def start(
        self,
        mode: str = "null",
        *extra: str,
        env: Mapping[str, str | None] | None = None,
        wait: bool = True,
    ) -> Worker:
        """Start a worker; ``env`` overrides the defaults (None removes a variable)."""
        port, bootstrap = free_port(), free_port()
        name = f"{mode}-{port}"
        state = self.tmp / f"{name}.state.json"
        state.write_text("{}")
        log_path = self.tmp / f"{name}.log"
        settings: dict[str, str | None] = {
            "PYTHONPATH": str(WORKER_DIR),
            "PDFAKE_PROVIDER_LIB": str(self.provider),
            "PDFAKE_STATE": str(state),
            "PDFAKE_WARMUP_SECS": "0",
            "PDFAKE_LATENCY_MS": "5",
            "MC_FORCE_TCP": None,
            **(env or {}),
        }
        full_env = {k: v for k, v in os.environ.items() if k not in settings}
        full_env.update({k: v for k, v in settings.items() if v is not None})
        argv = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", MODEL,
            "--disaggregation-mode", mode,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--disaggregation-bootstrap-port", str(bootstrap),
            "--disaggregation-transfer-backend", "mooncake",
            "--tp", "4",
            *extra,
        ]  # fmt: skip
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(argv, env=full_env, stderr=log_file, stdout=log_file)
        label = mode if mode in ("prefill", "decode") else "regular"
        worker = Worker(proc, port, bootstrap, log_path, state, label)
        self.started.append(worker)
        if wait:
            wait_http(port, "/v1/models")
        return worker

    def stop_all(self) -> None:
        for worker in self.started:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, Worker]]:
    """A healthy prefill and decode, shared by the read-only tests."""
    tmp = tmp_path_factory.mktemp("pair")
    provider = tmp / PROVIDER_NAME
    provider.write_bytes(b"\x7fELF fake provider")
    launch = Launcher(tmp, provider)
    try:
        prefill = launch.start("prefill")
        decode = launch.start("decode")
        yield prefill, decode
    finally:
        launch.stop_all()


def bootstrap_fields(prefill: Worker, room: int = 42) -> dict[str, object]:
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }


# --------------------------------------------------------------------------- start-up


def test_health_is_503_while_warming_then_200(launcher: Launcher) -> None:
    worker = launcher.start("decode", env={"PDFAKE_WARMUP_SECS": "2"}, wait=False)
    wait_for(lambda: health(worker.port) is not None)
    started = time.monotonic()
    assert health(worker.port) == 503
    assert request(worker.port, "GET", "/health_generate").status == 503
    wait_for(lambda: health(worker.port) == 200, timeout=10)
    assert time.monotonic() - started > 1.0
    assert request(worker.port, "GET", "/health_generate").status == 200
    reply = request(worker.port, "GET", "/ready")
    assert reply.status == 200
    assert reply.headers["content-length"] == "0"
    wait_for(lambda: "The server is fired up and ready to roll!" in worker.log())


def test_warmup_comes_from_the_state_file_without_env(launcher: Launcher, tmp_path: Path) -> None:
    state = tmp_path / "warm.json"
    state.write_text(json.dumps({"worker_warmup_secs": 30}))
    worker = launcher.start("null", env={"PDFAKE_STATE": str(state), "PDFAKE_WARMUP_SECS": None})
    assert request(worker.port, "GET", "/v1/models").status == 200
    time.sleep(0.3)
    assert health(worker.port) == 503


def test_missing_provider_library_fails_like_libibverbs(launcher: Launcher, tmp_path: Path) -> None:
    missing = str(tmp_path / "absent" / PROVIDER_NAME)
    worker = launcher.start("prefill", env={"PDFAKE_PROVIDER_LIB": missing}, wait=False)
    assert worker.proc.wait(timeout=20) == 1
    lines = worker.log().splitlines()
    assert PROVIDER_WARNING in lines
    error = lines[lines.index(PROVIDER_WARNING) + 1]
    assert "ERROR" in error
    assert "no RDMA device found" in error
    assert health(worker.port) is None
    assert health(worker.bootstrap_port) is None


@pytest.mark.parametrize(
    ("extra", "env"),
    [
        (("--disaggregation-transfer-backend", "mooncake_tcp"), {}),
        ((), {"MC_FORCE_TCP": "1"}),
    ],
)
def test_tcp_transfer_needs_no_provider_library(
    launcher: Launcher, tmp_path: Path, extra: tuple[str, ...], env: dict[str, str]
) -> None:
    env = {**env, "PDFAKE_PROVIDER_LIB": str(tmp_path / "absent" / PROVIDER_NAME)}
    worker = launcher.start("decode", *extra, env=env)
    assert health(worker.port) == 200
    assert "couldn't load driver" not in worker.log()


def test_not_disaggregated_needs_no_provider_library(launcher: Launcher, tmp_path: Path) -> None:
    missing = str(tmp_path / "absent" / PROVIDER_NAME)
    worker = launcher.start("null", env={"PDFAKE_PROVIDER_LIB": missing})
    assert health(worker.port) == 200


def test_unknown_flags_are_accepted_with_one_warning(launcher: Launcher) -> None:
    worker = launcher.start(
        "null", "--enable-metrics", "--chunked-prefill-size", "4096", "--attention-backend=aiter"
    )
    assert health(worker.port) == 200
    warnings = [line for line in worker.log().splitlines() if "WARNING" in line]
    assert len(warnings) == 1
    assert "--enable-metrics" in warnings[0]
    assert "--chunked-prefill-size" in warnings[0]
    assert "--attention-backend=aiter" in warnings[0]


# --------------------------------------------------------------------------- metadata


def test_v1_models_is_what_smg_reads(pair: tuple[Worker, Worker]) -> None:
    _, decode = pair
    reply = request(decode.port, "GET", "/v1/models")
    assert reply.status == 200
    assert reply.headers["content-type"] == "application/json"
    models = reply.json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == MODEL
    assert card["root"] == MODEL
    assert card["owned_by"] == "sglang"
    assert card["max_model_len"] == 32768
    assert card["object"] == "model"


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_reports_server_args(pair: tuple[Worker, Worker], path: str) -> None:
    prefill, _ = pair
    info = request(prefill.port, "GET", path).json()
    assert info["model_path"] == MODEL
    assert info["served_model_name"] == MODEL
    assert info["tp_size"] == 4
    assert info["dp_size"] == 1
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == prefill.bootstrap_port
    assert info["disaggregation_transfer_backend"] == "mooncake"
    assert info["port"] == prefill.port
    assert info["host"] == "127.0.0.1"
    assert info["version"] == "0.5.x-pdctl-lab"
    assert isinstance(info["max_running_requests"], int)
    assert isinstance(info["num_running_reqs"], int)
    assert "api_key" not in info


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info(pair: tuple[Worker, Worker], path: str) -> None:
    info = request(pair[1].port, "GET", path).json()
    assert info["model_path"] == MODEL
    assert info["tokenizer_path"] == MODEL
    assert info["is_generation"] is True


def test_v1_loads_has_sglang_shape(pair: tuple[Worker, Worker]) -> None:
    loads = request(pair[1].port, "GET", "/v1/loads?include=core,disagg,queues,memory").json()
    assert loads["dp_rank_count"] == 1
    rank = loads["loads"][0]
    for key in ("num_running_reqs", "num_waiting_reqs", "token_usage", "max_total_num_tokens"):
        assert key in rank
    assert rank["disaggregation"]["mode"] == "decode"
    assert rank["queues"]["waiting"] == 0
    assert loads["aggregate"]["total_running_reqs"] == rank["num_running_reqs"]
    core = request(pair[1].port, "GET", "/v1/loads?include=core").json()
    assert "disaggregation" not in core["loads"][0]


def test_metrics_are_prometheus_text_labelled_like_sglang(pair: tuple[Worker, Worker]) -> None:
    reply = request(pair[1].port, "GET", "/metrics")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain")
    text = reply.body.decode()
    labels = f'{{engine_type="decode",model_name="{MODEL}",pp_rank="0",tp_rank="0"}}'
    for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage", "gen_throughput"):
        assert f"# TYPE sglang:{gauge} gauge" in text
        assert f"sglang:{gauge}{labels} " in text


def test_unknown_path_is_404_and_keep_alive_holds(pair: tuple[Worker, Worker]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", pair[1].port, timeout=5)
    try:
        for path, status in [("/nope", 404), ("/health", 200), ("/v1/models", 200)]:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == status
            assert resp.getheader("Content-Length") is not None
            assert not resp.will_close
    finally:
        conn.close()


# --------------------------------------------------------------------------- generation


def test_chat_completion_answers_as_the_decode(pair: tuple[Worker, Worker]) -> None:
    prefill, decode = pair
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": [{"type": "text", "text": "hello world"}]},
        ],
        **bootstrap_fields(prefill, 7),
    }
    reply = request(decode.port, "POST", "/v1/chat/completions", body)
    assert reply.status == 200
    completion = reply.json()
    assert completion["object"] == "chat.completion"
    assert completion["model"] == MODEL
    choice = completion["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == f"{decode.who()} echo: hello world"
    assert choice["finish_reason"] == "stop"
    usage = completion["usage"]
    assert usage["prompt_tokens"] == 8
    assert usage["completion_tokens"] == len(choice["message"]["content"].split())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    wait_for(lambda: "KV bootstrap connection from 127.0.0.1" in prefill.log())
    # The decode logs the transfer as it finishes: on a busy machine, after the reply arrived.
    wait_for(lambda: f"bootstrap=127.0.0.1:{prefill.bootstrap_port} room=7" in decode.log())


def test_chat_completion_streams_sse(pair: tuple[Worker, Worker]) -> None:
    prefill, decode = pair
    body = {
        "messages": [{"role": "user", "content": "stream please"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **bootstrap_fields(prefill),
    }
    reply = request(decode.port, "POST", "/v1/chat/completions", body)
    assert reply.status == 200
    assert reply.headers["content-type"] == "text/event-stream"
    assert reply.headers["transfer-encoding"] == "chunked"
    events = sse_events(reply.body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == f"{decode.who()} echo: stream please"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(text.split())


def test_generate_native_api(pair: tuple[Worker, Worker]) -> None:
    prefill, decode = pair
    body = {"text": "native call", "sampling_params": {"max_new_tokens": 8}}
    out = request(decode.port, "POST", "/generate", {**body, **bootstrap_fields(prefill)}).json()
    echo = f"{decode.who()} echo: native call".split()  # 6 words, cycled up to the limit
    assert out["text"] == " ".join(echo + echo[:2])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert out["meta_info"]["completion_tokens"] == 8
    assert out["meta_info"]["prompt_tokens"] == 2
    stream = request(
        decode.port, "POST", "/generate", {**body, "stream": True, **bootstrap_fields(prefill)}
    )
    events = sse_events(stream.body)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == out["text"]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert json.loads(events[0])["text"] == "[decode "


def test_completions_batch_and_stream(pair: tuple[Worker, Worker]) -> None:
    prefill, decode = pair
    body = {"model": MODEL, "prompt": ["one", "two words"], **bootstrap_fields(prefill)}
    out = request(decode.port, "POST", "/v1/completions", body).json()
    assert out["object"] == "text_completion"
    assert [c["text"] for c in out["choices"]] == [
        f"{decode.who()} echo: one",
        f"{decode.who()} echo: two words",
    ]
    assert out["usage"]["prompt_tokens"] == 3
    streamed = request(
        decode.port,
        "POST",
        "/v1/completions",
        {"prompt": "one", "stream": True, **bootstrap_fields(prefill)},
    )
    events = sse_events(streamed.body)
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == f"{decode.who()} echo: one"


def test_prefill_answers_minimally(pair: tuple[Worker, Worker]) -> None:
    prefill, _ = pair
    body = {"messages": [{"role": "user", "content": "hi"}], **bootstrap_fields(prefill)}
    out = request(prefill.port, "POST", "/v1/chat/completions", body).json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["content"] == ""
    assert out["usage"]["prompt_tokens"] == 1


def test_decode_fails_when_the_bootstrap_is_unreachable(pair: tuple[Worker, Worker]) -> None:
    _, decode = pair
    dead = free_port()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": dead,
        "bootstrap_room": 99,
    }
    reply = request(decode.port, "POST", "/v1/chat/completions", body)
    assert reply.status == 500
    message = reply.json()["error"]["message"]
    assert f"127.0.0.1:{dead}" in message
    assert "KV transfer could not start" in message
    assert "bootstrap_room=99" in message


def test_bad_json_is_400(pair: tuple[Worker, Worker]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", pair[1].port, timeout=5)
    try:
        conn.request("POST", "/generate", body=b"{not json", headers={"Content-Length": "9"})
        resp = conn.getresponse()
        assert resp.status == 400
        assert "Invalid JSON" in json.loads(resp.read())["error"]["message"]
    finally:
        conn.close()


def test_api_key_guards_all_but_health_and_metrics(launcher: Launcher) -> None:
    worker = launcher.start("null", "--api-key", "s3cret", wait=False)
    wait_http(worker.port, "/health")
    assert request(worker.port, "GET", "/metrics").status == 200
    assert request(worker.port, "GET", "/v1/models").status == 401
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert request(worker.port, "POST", "/v1/chat/completions", body).status == 401
    auth = {"Authorization": "Bearer s3cret"}
    reply = request(worker.port, "POST", "/v1/chat/completions", body, headers=auth)
    assert reply.status == 200
    assert reply.json()["choices"][0]["message"]["content"] == f"{worker.who()} echo: x"


# --------------------------------------------------------------------------- faults and stop


def test_worker_unhealthy_fault_flips_health(launcher: Launcher) -> None:
    worker = launcher.start("decode")
    assert health(worker.port) == 200
    worker.state_path.write_text(json.dumps({"worker_unhealthy": True}))
    wait_for(lambda: health(worker.port) == 503, timeout=5)
    worker.state_path.write_text("not json at all")
    wait_for(lambda: health(worker.port) == 200, timeout=5)
    worker.state_path.write_text(json.dumps({"worker_unhealthy": True, "x": 1}))
    wait_for(lambda: health(worker.port) == 503, timeout=5)
    worker.state_path.unlink()
    wait_for(lambda: health(worker.port) == 200, timeout=5)


def test_latency_comes_from_the_state_file(launcher: Launcher) -> None:
    worker = launcher.start("null", env={"PDFAKE_LATENCY_MS": None})
    worker.state_path.write_text(json.dumps({"worker_latency_ms": 600}))
    started = time.monotonic()
    reply = request(worker.port, "POST", "/generate", {"text": "slow"})
    assert reply.status == 200
    assert time.monotonic() - started >= 0.55


def test_sigterm_drains_in_flight_requests_then_exits_0(launcher: Launcher) -> None:
    worker = launcher.start("null", env={"PDFAKE_LATENCY_MS": "1500"})
    result: dict[str, Reply] = {}

    def slow() -> None:
        body = {"messages": [{"role": "user", "content": "take your time"}]}
        result["reply"] = request(worker.port, "POST", "/v1/chat/completions", body)

    client = threading.Thread(target=slow)
    client.start()

    def running() -> bool:
        info = request(worker.port, "GET", "/server_info").json()
        return bool(info["num_running_reqs"] == 1)

    wait_for(running, timeout=5)
    worker.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: health(worker.port) == 503, timeout=2)
    refused = request(worker.port, "POST", "/generate", {"text": "late"})
    assert refused.status == 503
    assert worker.proc.poll() is None
    client.join(timeout=10)
    reply = result["reply"]
    assert reply.status == 200
    content = reply.json()["choices"][0]["message"]["content"]
    assert content == f"{worker.who()} echo: take your time"
    assert worker.proc.wait(timeout=10) == 0
    log = worker.log()
    assert "Received SIGTERM" in log
    assert "draining 1 in-flight request(s)" in log


def test_sigint_stops_an_idle_worker(launcher: Launcher) -> None:
    worker = launcher.start("prefill")
    assert health(worker.bootstrap_port) == 200
    worker.proc.send_signal(signal.SIGINT)
    assert worker.proc.wait(timeout=10) == 0
    assert health(worker.port) is None
    assert health(worker.bootstrap_port) is None


def test_client_hanging_up_aborts_quietly(launcher: Launcher) -> None:
    worker = launcher.start("null", env={"PDFAKE_LATENCY_MS": "400"})
    for stream in (False, True):
        payload = json.dumps({"text": "bye", "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", worker.port), timeout=5) as sock:
            sock.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            time.sleep(0.1)
            # A reset, not a polite FIN: the way the router drops the other leg.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    wait_for(lambda: worker.log().count("request aborted") == 2, timeout=5)
    assert "Traceback" not in worker.log()
    assert health(worker.port) == 200
    info = request(worker.port, "GET", "/server_info").json()
    assert info["num_running_reqs"] == 0
