"""The lab's SGLang stand-in in gRPC mode (``--grpc-mode``) behind the REAL router (SMG 1.13)
in P/D mode, on 127.0.0.1.

A prefill and a decode (``python3 -m sglang.launch_server ... --grpc-mode
--disaggregation-mode prefill|decode``, NIXL) run from the image's Python layout; SMG runs with
``--enable-igw`` and no ``--model-path`` (pdctl drops it: SMG takes the tokenizer from the
workers' GetTokenizer), and the workers are registered through ``POST /workers`` as pdctl
registers them (pdctl/core/plan/model.py Slot.registration: ``grpc://``,
``runtime_type: sglang``, the prefill's bootstrap port). A chat must come back in the decode's
words, streamed or not, after the decode reached the prefill's bootstrap server for its room;
SMG counts it for the scaler's RPS. Skipped only when no ``smg`` executable can be found.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from pdctl.core.plan import Slot, WorkerRole
from pdctl.doors.router import requests_total
from pdctl.lab.worker.common import tokenizer
from pdctl.onhost.grpc_health import GRPC_STANDARD_HEALTH, grpc_healthy
from tests.integration.test_worker_with_smg import (
    FAST_HEALTH,
    SMG,
    free_port,
    request,
    sse_events,
    stop,
)
from tests.support import wait_for, worker_tree_dir

pytestmark = pytest.mark.skipif(SMG is None, reason="smg not found (pip install smg==1.13.0)")

TREE = worker_tree_dir("sglang")
MODEL = "lab/tiny-llama"
HOSTNAME = socket.gethostname()


@dataclass
class StandIn:
    proc: subprocess.Popen[bytes]
    port: int
    bootstrap_port: int | None
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def stub(self) -> Any:
        return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))

    def health(self, service: str = "") -> int | None:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))
        try:
            ask = health_pb2.HealthCheckRequest(service=service)
            return int(stub.Check(ask, timeout=2).status)
        except grpc.RpcError:
            return None


@dataclass
class Bench:
    tmp: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, mode: str, *args: str) -> StandIn:
        port = free_port()
        bootstrap = free_port() if mode == "prefill" else None
        provider = self.tmp / "libmlx5-rdmav34.so"
        provider.write_bytes(b"\x7fELF fake provider")
        settings = {
            "PYTHONPATH": str(TREE / "site"),
            "PDFAKE_PROVIDER_LIB": str(provider),
            "PDFAKE_STATE": str(self.tmp / "state.json"),
            "PDFAKE_WARMUP_SECS": "0",
            "PDFAKE_LATENCY_MS": "5",
        }
        argv = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--grpc-mode",
            "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl",
        ]  # fmt: skip
        if bootstrap is not None:
            argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
        log_path = self.tmp / f"{mode}-{port}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [*argv, *args], env={**os.environ, **settings}, stdout=log_file, stderr=log_file
            )
        self.procs.append(proc)
        worker = StandIn(proc, port, bootstrap, log_path)
        wait_for(lambda: worker.health() == health_pb2.HealthCheckResponse.SERVING, 20, 0.1)
        return worker

    def smg(self) -> tuple[int, int]:
        """SMG's port and its metrics port."""
        assert SMG is not None
        port, metrics = free_port(), free_port()
        argv = [
            str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--pd-disaggregation", "--enable-igw",
            "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            *FAST_HEALTH,
        ]  # fmt: skip
        log_path = self.tmp / "smg.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=log_file)
        self.procs.append(proc)
        wait_for(lambda: _status(port, "/liveness") == 200 or proc.poll() is not None, 30)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return port, metrics

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc, grace=5)


def _status(port: int, path: str) -> int | None:
    try:
        return request(port, "GET", path, timeout=3).status
    except OSError:
        return None


@dataclass
class PD:
    router: int
    metrics: int
    prefill: StandIn
    decode: StandIn


def slot(group: WorkerRole, worker: StandIn) -> Slot:
    """The plan's slot for a worker: pdctl's own registration body and probe."""
    return Slot(
        group=group,
        index=1,
        host="loopback",
        address="127.0.0.1",
        gpus=[0],
        port=worker.port,
        bootstrap_port=worker.bootstrap_port,
        start=True,
        vendor="nvidia",
        engine="sglang",
        connection="grpc",
    )


def chat(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    bench = Bench(tmp_path_factory.mktemp("sglang-grpc-smg"))
    try:
        yield bench
    finally:
        bench.close()


@pytest.fixture(scope="module")
def pd(bench: Bench) -> PD:
    """A prefill and a decode, registered with SMG as pdctl registers SGLang gRPC workers."""
    prefill, decode = bench.start("prefill"), bench.start("decode")
    router, metrics = bench.smg()
    for worker, kind in ((prefill, "prefill"), (decode, "decode")):
        reply = request(router, "POST", "/workers", slot(kind, worker).registration())
        assert reply.status == 202, reply.body

    def ready() -> bool:
        workers = request(router, "GET", "/workers").json()["workers"]
        return sum(w["status"] == "ready" for w in workers) == 2

    wait_for(ready, 60)
    # SMG loads the workers' tokenizer (GetTokenizer) after they are ready: until then a chat
    # is answered 503 tokenizer_not_ready.
    wait_for(lambda: request(router, "POST", "/v1/chat/completions", chat("hi")).status != 503, 30)
    return PD(router, metrics, prefill, decode)


def test_pdctls_registration_is_what_smg_routes(pd: PD) -> None:
    workers = {w["url"]: w for w in request(pd.router, "GET", "/workers").json()["workers"]}
    prefill = workers[f"grpc://127.0.0.1:{pd.prefill.port}"]
    decode = workers[f"grpc://127.0.0.1:{pd.decode.port}"]
    assert (prefill["worker_type"], decode["worker_type"]) == ("prefill", "decode")
    assert prefill["runtime_type"] == decode["runtime_type"] == "sglang"
    assert prefill["connection_mode"] == decode["connection_mode"] == "grpc"
    assert prefill["bootstrap_port"] == pd.prefill.bootstrap_port


def test_chat_is_answered_by_the_decode_after_the_bootstrap_handoff(pd: PD) -> None:
    reply = request(pd.router, "POST", "/v1/chat/completions", chat("hello there, world 42!"))
    assert reply.status == 200, reply.body
    body = reply.json()
    answer = f"[decode {HOSTNAME}:{pd.decode.port} model={MODEL}] echo: hello there, world 42!"
    assert body["choices"][0]["message"]["content"] == answer
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(answer.split())  # a word is a token
    # Both legs carried the prefill's bootstrap server and one room (SMG logs no room: find
    # the decode's line by the request id SMG gave both legs, then the prefill's by its room).
    where = f"bootstrap=127.0.0.1:{pd.prefill.bootstrap_port} room="
    line = next(x for x in pd.decode.log().splitlines() if body["id"] in x and "decode" in x)
    room = line.split(where, 1)[1].split()[0]
    wait_for(lambda: f"prefill stop 0 token(s) stream=False {where}{room}" in pd.prefill.log(), 10)


def test_max_tokens_cuts_the_answer_to_that_many_words(pd: PD) -> None:
    reply = request(pd.router, "POST", "/v1/chat/completions", chat("one two", max_tokens=3))
    body = reply.json()
    who = ["[decode", f"{HOSTNAME}:{pd.decode.port}", f"model={MODEL}]"]
    assert body["choices"][0]["message"]["content"].split() == who
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_chat_streams_one_word_a_chunk(pd: PD) -> None:
    reply = request(pd.router, "POST", "/v1/chat/completions", chat("stream me", stream=True))
    assert reply.status == 200, reply.body
    events = sse_events(reply.body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    who = f"[decode {HOSTNAME}:{pd.decode.port} model={MODEL}]"
    assert "".join(deltas) == f"{who} echo: stream me"
    assert len([d for d in deltas if d]) == 6
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_smg_counts_the_requests_the_scaler_reads_as_rps(pd: PD) -> None:
    """The scaler's RPS is the rate of smg_router_requests_total (pdctl/core/scaling/observe.py)."""

    def total() -> float:
        return requests_total(request(pd.metrics, "GET", "/metrics").body.decode())

    before = total()
    assert request(pd.router, "POST", "/v1/chat/completions", chat("count me")).status == 200
    wait_for(lambda: total() >= before + 1, 10, what="smg_router_requests_total")


def _prompt(text: str) -> list[int]:
    return [tokenizer.USER, *(i for word in tokenizer.encode_words(text) for i in word)]


def test_decode_refuses_a_request_without_disaggregated_params(pd: PD) -> None:
    ask = pb.GenerateRequest(request_id="no-handoff", tokenized=pb.TokenizedInput(input_ids=[4]))
    with pytest.raises(grpc.RpcError) as refused:
        list(pd.decode.stub().Generate(ask, timeout=10))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no disaggregated_params" in (refused.value.details() or "")


def test_decode_fails_when_the_prefill_bootstrap_server_does_not_answer(pd: PD) -> None:
    params = pb.DisaggregatedParams(
        bootstrap_host="127.0.0.1", bootstrap_port=free_port(), bootstrap_room=7
    )
    ask = pb.GenerateRequest(
        request_id="dead-bootstrap",
        tokenized=pb.TokenizedInput(input_ids=_prompt("hi")),
        disaggregated_params=params,
    )
    with pytest.raises(grpc.RpcError) as failed:
        list(pd.decode.stub().Generate(ask, timeout=10))
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "cannot reach the prefill bootstrap server" in (failed.value.details() or "")


def test_health_info_loads_and_tokenizer(pd: PD) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    scheduler = "sglang.grpc.scheduler.SglangScheduler"
    assert pd.decode.health() == pd.decode.health(scheduler) == serving
    stub = pd.prefill.stub()
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert info.server_type == "grpc"
    assert info.server_args["disaggregation_mode"] == "prefill"
    assert info.server_args["disaggregation_bootstrap_port"] == pd.prefill.bootstrap_port
    model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (model.served_model_name, list(model.eos_token_ids)) == (MODEL, [tokenizer.EOS])
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=5)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_running_requests == 256
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=5))
    assert b"".join(c.data for c in chunks) == tokenizer.bundle(32768)[0]


def test_pdctls_own_health_call_reads_grpc_health(pd: PD) -> None:
    """pdctl's h2c call (pdctl/onhost/grpc_health.py, the roles' probe and the scaler) asks
    grpc.health.v1 of an SGLang gRPC worker, the method its plan names."""
    worker = slot("decode", pd.decode)
    assert worker.probe_url("/health") == f"grpc://127.0.0.1:{pd.decode.port}{GRPC_STANDARD_HEALTH}"
    with socket.create_connection(("127.0.0.1", pd.decode.port), timeout=5) as stream:
        assert grpc_healthy(stream, f"127.0.0.1:{pd.decode.port}", GRPC_STANDARD_HEALTH)


def test_an_abort_ends_a_stream_early(pd: PD) -> None:
    """Abort (SMG's, when a client goes away) stops the answer: finish reason abort."""
    room = 99
    prefill = pd.prefill.stub().Generate(
        pb.GenerateRequest(
            request_id="to-abort-p",
            tokenized=pb.TokenizedInput(input_ids=_prompt("abort me please now")),
            disaggregated_params=pb.DisaggregatedParams(
                bootstrap_host="127.0.0.1",
                bootstrap_port=pd.prefill.bootstrap_port or 0,
                bootstrap_room=room,
            ),
        ),
        timeout=10,
    )
    assert list(prefill)[-1].complete.finish_reason == "stop"
    stub = pd.decode.stub()
    stream = stub.Generate(
        pb.GenerateRequest(
            request_id="to-abort",
            tokenized=pb.TokenizedInput(input_ids=_prompt("abort me please now")),
            sampling_params=pb.SamplingParams(max_new_tokens=2000),
            stream=True,
            disaggregated_params=pb.DisaggregatedParams(
                bootstrap_host="127.0.0.1",
                bootstrap_port=pd.prefill.bootstrap_port or 0,
                bootstrap_room=room,
            ),
        ),
        timeout=30,
    )
    first = next(stream)
    assert first.chunk.token_ids
    assert stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5).success
    last = list(stream)[-1]
    assert last.complete.finish_reason == "abort"
    assert last.complete.completion_tokens < 2000
