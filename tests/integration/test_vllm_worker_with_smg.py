"""The lab's vLLM stand-in behind the REAL router (SMG 1.13) in gRPC P/D mode, on 127.0.0.1.

A prefill (``vllm serve ... --grpc``, kv_producer) and a decode (``python3 -m
vllm.entrypoints.grpc_server``, kv_consumer) run from the image's Python layout; SMG runs with
``--enable-igw`` and the workers are registered through ``POST /workers`` with
``runtime_type: vllm``. SMG takes its tokenizer from the workers (GetTokenizer). A chat must
come back in the decode's words, streamed or not, after the decode fetched the prefill's KV over
its side channel. Skipped only when no ``smg`` executable can be found.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from pdctl.core.scaling.engine_loads import GET_LOADS, EngineLoad, decode_loads
from pdctl.onhost.grpc_health import grpc_call
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

TREE = worker_tree_dir("vllm")
MODEL = "lab/tiny-llama"
HOSTNAME = socket.gethostname()
PAIRING = ["--block-size", "128", "--attention-backend", "ROCM_ATTN"]  # SMG pairs P/D by these


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role})


@dataclass
class StandIn:
    proc: subprocess.Popen[bytes]
    port: int
    side_port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def stub(self) -> Any:
        return pb_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))

    def health(self) -> int | None:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
        except grpc.RpcError:
            return None


@dataclass
class Bench:
    tmp: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(
        self,
        entry: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        side_port: int | None = None,
        wait: bool = True,
    ) -> StandIn:
        """``entry`` is ``serve`` (``vllm serve MODEL --grpc``) or ``grpc_server``."""
        port, side = free_port(), side_port or free_port()
        provider = self.tmp / "libbnxt_re-rdmav34.so"
        provider.write_bytes(b"\x7fELF fake provider")
        settings = {
            "PYTHONPATH": str(TREE / "site"),
            "PDFAKE_PROVIDER_LIB": str(provider),
            "PDFAKE_STATE": str(self.tmp / "state.json"),
            "PDFAKE_WARMUP_SECS": "0",
            "PDFAKE_LATENCY_MS": "5",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
            **(env or {}),
        }
        if entry == "serve":
            argv = [sys.executable, str(TREE / "bin" / "vllm"), "serve", MODEL, "--grpc"]
        else:
            argv = [sys.executable, "-m", "vllm.entrypoints.grpc_server", "--model", MODEL]
        log_path = self.tmp / f"{entry}-{port}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [*argv, "--host", "127.0.0.1", "--port", str(port), *args],
                env={**os.environ, **settings},
                stdout=log_file,
                stderr=log_file,
            )
        self.procs.append(proc)
        worker = StandIn(proc, port, side, log_path)
        if wait:
            wait_for(lambda: worker.health() == health_pb2.HealthCheckResponse.SERVING, 20, 0.1)
        return worker

    def smg(self) -> int:
        assert SMG is not None
        port = free_port()
        argv = [
            str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--pd-disaggregation", "--enable-igw",
            "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            *FAST_HEALTH,
        ]  # fmt: skip
        log_path = self.tmp / "smg.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=log_file)
        self.procs.append(proc)
        wait_for(lambda: _status(port, "/liveness") == 200 or proc.poll() is not None, 30)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return port

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
    prefill: StandIn
    decode: StandIn


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    bench = Bench(tmp_path_factory.mktemp("vllm-smg"))
    try:
        yield bench
    finally:
        bench.close()


@pytest.fixture(scope="module")
def pd(bench: Bench) -> PD:
    """Both entry points, registered with SMG as pdctl registers vLLM workers."""
    prefill = bench.start("serve", "--kv-transfer-config", kv_config("kv_producer"), *PAIRING)
    decode = bench.start("grpc_server", "--kv-transfer-config", kv_config("kv_consumer"), *PAIRING)
    router = bench.smg()
    for worker, kind in ((prefill, "prefill"), (decode, "decode")):
        body = {
            "url": f"grpc://127.0.0.1:{worker.port}",
            "worker_type": kind,
            "runtime_type": "vllm",
        }
        reply = request(router, "POST", "/workers", body)
        assert reply.status == 202, reply.body

    def ready() -> bool:
        workers = request(router, "GET", "/workers").json()["workers"]
        return sum(w["status"] == "ready" for w in workers) == 2

    wait_for(ready, 60)
    return PD(router, prefill, decode)


def chat(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


def test_smg_registers_both_with_their_kv_roles(pd: PD) -> None:
    workers = {w["url"]: w for w in request(pd.router, "GET", "/workers").json()["workers"]}
    prefill = workers[f"grpc://127.0.0.1:{pd.prefill.port}"]
    decode = workers[f"grpc://127.0.0.1:{pd.decode.port}"]
    assert (prefill["kv_role"], decode["kv_role"]) == ("kv_producer", "kv_consumer")
    assert prefill["kv_connector"] == decode["kv_connector"] == "NixlConnector"
    assert prefill["runtime_type"] == "vllm" and prefill["connection_mode"] == "grpc"


def test_chat_is_answered_by_the_decode_after_the_kv_handoff(pd: PD) -> None:
    reply = request(pd.router, "POST", "/v1/chat/completions", chat("hello there, world 42!"))
    assert reply.status == 200, reply.body
    body = reply.json()
    answer = f"[decode {HOSTNAME}:{pd.decode.port} model={MODEL}] echo: hello there, world 42!"
    assert body["choices"][0]["message"]["content"] == answer
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(answer.split())  # a word is a token
    # The decode fetched this request's KV from the prefill's side channel (same request id).
    # The prefill logs the fetch beside serving it: on a loaded machine the line comes later.
    wait_for(lambda: f"fetched {body['id']}: True" in pd.prefill.log(), 20, what="the KV fetch")


def test_max_tokens_cuts_the_answer_to_that_many_words(pd: PD) -> None:
    reply = request(pd.router, "POST", "/v1/chat/completions", chat("one two", max_tokens=3))
    body = reply.json()
    assert body["choices"][0]["message"]["content"].split() == [
        "[decode",
        f"{HOSTNAME}:{pd.decode.port}",
        f"model={MODEL}]",
    ]
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


def test_decode_refuses_a_request_without_kv_transfer_params(pd: PD) -> None:
    ask = pb.GenerateRequest(
        request_id="no-kv", tokenized=pb.TokenizedInput(input_ids=[4, 10]), stream=False
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(pd.decode.stub().Generate(ask, timeout=10))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no kv_transfer_params" in (refused.value.details() or "")


def test_decode_fails_when_the_prefill_side_channel_does_not_answer(pd: PD) -> None:
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port()}
    ask = pb.GenerateRequest(
        request_id="dead-side-channel",
        tokenized=pb.TokenizedInput(input_ids=[4, 10]),
        kv_transfer_params_json=json.dumps(params),
    )
    with pytest.raises(grpc.RpcError) as failed:
        list(pd.decode.stub().Generate(ask, timeout=10))
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "cannot reach the prefill's NIXL side channel" in (failed.value.details() or "")


def test_prefill_hands_back_its_side_channel(pd: PD) -> None:
    ask = pb.GenerateRequest(
        request_id="handoff",
        tokenized=pb.TokenizedInput(input_ids=[4, 10]),
        sampling_params=pb.SamplingParams(max_tokens=1),
        kv_transfer_params_json=json.dumps({"do_remote_decode": True}),
    )
    (reply,) = list(pd.prefill.stub().Generate(ask, timeout=10))
    params = json.loads(reply.complete.kv_transfer_params_json)
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "handoff"
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", pd.prefill.side_port)
    assert len(reply.complete.output_ids) >= 1 and reply.complete.finish_reason == "length"


def test_health_services_and_server_info(pd: PD) -> None:
    assert pd.decode.health() == health_pb2.HealthCheckResponse.SERVING
    assert pd.decode.stub().HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
    info = pd.prefill.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert (info.kv_connector, info.kv_role, info.block_size) == (
        "NixlConnector",
        "kv_producer",
        128,
    )


def test_a_second_worker_on_a_taken_side_channel_port_fails_to_start(pd: PD, bench: Bench) -> None:
    clash = bench.start(
        "serve", "--kv-transfer-config", kv_config("kv_producer"), side_port=pd.prefill.side_port,
        wait=False,
    )  # fmt: skip
    assert clash.proc.wait(timeout=20) == 1
    assert f"cannot listen on 127.0.0.1:{pd.prefill.side_port}" in clash.log()
    assert "its own VLLM_NIXL_SIDE_CHANNEL_PORT" in clash.log()


def test_the_scalers_getloads_call_reads_the_engines_load(pd: PD) -> None:
    """pdctl's own h2c call (no grpcio: the scaler's) asks GetLoads as SMG does; under load
    the decode reports the streams it runs, as the generated stub reads them."""
    answers = [
        threading.Thread(
            target=request,
            args=(pd.router, "POST", "/v1/chat/completions", chat("x " * 5, max_tokens=150)),
            daemon=True,
        )
        for _ in range(3)
    ]
    for thread in answers:
        thread.start()

    def load() -> EngineLoad:
        with socket.create_connection(("127.0.0.1", pd.decode.port), timeout=5) as stream:
            message = grpc_call(stream, f"127.0.0.1:{pd.decode.port}", GET_LOADS["vllm"], b"", 5)
        return decode_loads(message, "vllm")

    wait_for(lambda: load().running == 3, 20, 0.1, what="three running streams")
    stubbed = pd.decode.stub().GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0]
    assert stubbed.num_running_reqs == 3
    for thread in answers:
        thread.join(60)
    wait_for(lambda: load().gen_throughput > 0, 10, 0.2, what="tokens per second")
    assert load().running == 0
