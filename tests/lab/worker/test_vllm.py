"""The lab's vLLM stand-in's pieces (pdctl/lab/worker/vllm), without a router: its command
lines, kv roles, tokenizer, NIXL side channel and start-up refusals. SMG routing it is
tests/integration/test_vllm_worker_with_smg.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import example, given
from hypothesis import strategies as st
from smg_grpc_proto import vllm_engine_pb2 as pb

from pdctl.lab.worker.common import tokenizer
from pdctl.lab.worker.common.grpc_serving import Refused
from pdctl.lab.worker.common.settings import StateFile
from pdctl.lab.worker.vllm.cli import Config, UsageError, parse
from pdctl.lab.worker.vllm.engine import Engine, SideChannel
from pdctl.lab.worker.vllm.server import VllmEngineServicer, start_failure
from tests.support import worker_tree_dir

NIXL = '{"kv_connector": "NixlConnector", "kv_role": "%s"}'
SIDE = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "0"}


def config(role: str | None, *extra: str, env: dict[str, str] | None = None) -> Config:
    kv = ["--kv-transfer-config", NIXL % role] if role else []
    cfg, _ = parse(
        ["--model", "m", "--port", "50051", *kv, *extra],
        "grpc_server",
        SIDE if env is None else env,
    )
    return cfg


# --------------------------------------------------------------------------- command lines


def test_vllm_serve_takes_the_model_as_its_argument_and_needs_grpc() -> None:
    cfg, ignored = parse(["amd/Llama", "--grpc", "--port", "8100", "-tp", "4"], "serve", {})
    assert (cfg.model, cfg.served_model_name, cfg.port, cfg.host) == (
        "amd/Llama",
        "amd/Llama",
        8100,
        "0.0.0.0",
    )
    assert cfg.tensor_parallel_size == 4 and ignored == []
    with pytest.raises(UsageError, match="add --grpc"):
        parse(["amd/Llama", "--port", "8100"], "serve", {})


def test_unknown_vllm_flags_are_accepted_and_named() -> None:
    argv = ["--model", "m", "--gpu-memory-utilization", "0.9", "--enforce-eager", "--block-size"]
    cfg, ignored = parse([*argv, "128", "--served-model-name", "a", "b"], "grpc_server", {})
    assert ignored == ["--gpu-memory-utilization", "--enforce-eager"]
    assert (cfg.block_size, cfg.served_model_name, cfg.port) == (128, "a", 50051)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not valid JSON"),
        ('["NixlConnector"]', "must be a JSON object"),
        ('{"kv_role": "kv_producer"}', "needs kv_connector"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_sender"}', "Unsupported kv_role"),
        ('{"kv_connector": "NixlConnector"}', "Unsupported kv_role: None"),
    ],
)
def test_a_bad_kv_transfer_config_is_refused(text: str, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        parse(["--model", "m", "--kv-transfer-config", text], "grpc_server", {})


def test_kv_roles_say_what_the_worker_does() -> None:
    assert config("kv_producer").role == "prefill"
    assert config("kv_consumer").role == "decode"
    assert config("kv_both").role == "both"
    assert config(None).role == "regular"


def test_side_channel_comes_from_vllms_variables() -> None:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    cfg = config("kv_producer", env=env)
    assert (cfg.side_host, cfg.side_port) == ("10.1.2.3", 5601)
    assert (config("kv_producer", env={}).side_port, config(None, env={}).side_host) == (
        5600,
        "localhost",
    )
    with pytest.raises(UsageError, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
        config("kv_producer", env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"})


# --------------------------------------------------------------------------- tokenizer

_WORD = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1)


@given(st.lists(_WORD, max_size=12))
@example(["##0"])  # a word that starts like a continuation piece (make flake found it)
@example(["a", "##", "x##y"])
def test_any_printable_words_round_trip(words: list[str]) -> None:
    ids = [i for word in tokenizer.encode_words(" ".join(words)) for i in word]
    assert tokenizer.UNK not in ids
    assert tokenizer.decode(ids) == " ".join(words)


def test_known_words_are_one_id_others_are_spelled() -> None:
    assert tokenizer.encode_words("echo: hello") == [
        [tokenizer.VOCAB["echo:"]],
        [tokenizer.VOCAB["hello"]],
    ]
    assert [tokenizer.decode([i]) for i in tokenizer.encode_words("hey")[0]] == ["h", "e", "y"]


def test_the_last_user_turn_is_what_the_template_marked() -> None:
    def words(text: str) -> list[int]:
        return [i for word in tokenizer.encode_words(text) for i in word]

    system, user = tokenizer.SPECIAL.index("<|system|>"), tokenizer.USER
    assistant = tokenizer.SPECIAL.index("<|assistant|>")
    ids = [system, *words("be brief"), user, *words("first"), assistant, *words("ok")]
    ids += [user, *words("second question?"), assistant]
    assert tokenizer.last_user_message(ids) == "second question?"
    assert tokenizer.last_user_message(words("no template")) == "no template"


def test_the_bundle_is_a_tokenizer_smg_can_load() -> None:
    data, digest = tokenizer.bundle(4096)
    assert (data, digest) == tokenizer.bundle(4096)  # the same bytes every time
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert sorted(archive.namelist()) == ["tokenizer.json", "tokenizer_config.json"]
        spec = json.loads(archive.read("tokenizer.json"))
        config_doc = json.loads(archive.read("tokenizer_config.json"))
    assert spec["model"]["vocab"] == tokenizer.VOCAB
    assert len(set(tokenizer.VOCAB.values())) == len(tokenizer.VOCAB)
    assert [t["content"] for t in spec["added_tokens"]] == list(tokenizer.SPECIAL)
    assert config_doc["eos_token"] == "</s>" and "<|user|>" not in config_doc["chat_template"]
    assert "<|{{ message['role'] }}|>" in config_doc["chat_template"]
    assert config_doc["model_max_length"] == 4096


# --------------------------------------------------------------------------- engine


@pytest.fixture
def state(tmp_path: Path) -> StateFile:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"worker_latency_ms": 0, "prefill_tokens_per_s": 0}))
    return StateFile(path)


@pytest.fixture
def side_channel(state: StateFile) -> Iterator[tuple[Engine, SideChannel]]:
    """A prefill engine with its side channel listening on a free loopback port."""
    engine = Engine(config("kv_producer"), state, 0)
    channel = SideChannel(engine.cfg, engine.kv)
    port = channel.server_address[1]
    engine.cfg = config("kv_producer", env={**SIDE, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)})
    threading.Thread(target=channel.serve_forever, daemon=True).start()
    try:
        yield engine, channel
    finally:
        channel.shutdown()
        channel.server_close()


def test_consumer_refuses_a_request_without_kv_transfer_params(state: StateFile) -> None:
    engine = Engine(config("kv_consumer"), state, 0)
    with pytest.raises(Refused, match="no kv_transfer_params") as refused:
        engine.plan("r1", [4, 10], None, None)
    assert refused.value.code == "FAILED_PRECONDITION"
    with pytest.raises(Refused, match="JSON object") as bad:
        engine.plan("r1", [4, 10], None, "[1]")
    assert bad.value.code == "INVALID_ARGUMENT"


def test_prefill_hands_off_and_the_decode_fetches_over_the_side_channel(
    side_channel: tuple[Engine, SideChannel], state: StateFile
) -> None:
    prefill, channel = side_channel
    plan = prefill.plan("req-7", [4, 10, 11], 1, json.dumps({"do_remote_decode": True}))
    assert plan.kv_params is not None and len(plan.words) == 1 and plan.finish == "length"
    assert plan.kv_params["remote_port"] == channel.server_address[1]
    decode = Engine(config("kv_consumer"), state, 0)
    with pytest.raises(Refused, match="refused: no KV for request 'req-7'") as early:
        decode.plan("req-7", [4, 10], None, json.dumps(plan.kv_params))
    assert early.value.code == "INTERNAL"
    plan.on_done()  # the prefill finished: its KV is there to fetch
    answer = decode.plan("req-7", [4, 10], None, json.dumps(plan.kv_params))
    assert tokenizer.decode(i for w in answer.words for i in w).startswith("[decode ")


def test_kv_both_answers_alone_without_kv_transfer_params(state: StateFile) -> None:
    plan = Engine(config("kv_both"), state, 0).plan("r", [tokenizer.USER, 10], 2, None)
    assert plan.kv_params is None and len(plan.words) == 2 and plan.finish == "length"
    assert tokenizer.decode(i for w in plan.words for i in w).split()[0] == "[regular"


def test_a_taken_side_channel_port_cannot_be_bound_twice(
    side_channel: tuple[Engine, SideChannel],
) -> None:
    prefill, _ = side_channel
    with pytest.raises(OSError):
        SideChannel(prefill.cfg, prefill.kv)


def test_the_rdma_provider_library_is_needed_unless_ucx_goes_over_tcp(tmp_path: Path) -> None:
    missing = {"PDFAKE_PROVIDER_LIB": str(tmp_path / "libbnxt_re-rdmav34.so")}
    refused = start_failure(config("kv_consumer"), missing)
    assert refused is not None and "no RDMA device" in refused
    assert start_failure(config("kv_consumer"), {**missing, "UCX_TLS": "tcp,self"}) is None
    assert start_failure(config(None), missing) is None  # no KV transfer, no RDMA


# --------------------------------------------------------------------------- processes


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    site = worker_tree_dir("vllm") / "site"
    return subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.grpc_server", "--model", "m", *args],
        env={**os.environ, "PYTHONPATH": str(site), **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_bad_kv_role_stops_the_process_with_vllms_words() -> None:
    proc = _run("--kv-transfer-config", NIXL % "kv_sender", env={})
    assert proc.returncode == 2
    assert "Unsupported kv_role: 'kv_sender'" in proc.stderr


def test_without_its_provider_library_the_worker_fails_like_libibverbs(tmp_path: Path) -> None:
    missing = str(tmp_path / "libbnxt_re-rdmav34.so")
    proc = _run("--kv-transfer-config", NIXL % "kv_producer", env={"PDFAKE_PROVIDER_LIB": missing})
    assert proc.returncode == 1
    assert "libibverbs: Warning: couldn't load driver 'libbnxt_re-rdmav34.so'" in proc.stderr


def test_a_side_channel_host_not_on_this_host_is_named(tmp_path: Path) -> None:
    provider = tmp_path / "libbnxt_re-rdmav34.so"
    provider.write_bytes(b"")
    env = {
        "PDFAKE_PROVIDER_LIB": str(provider),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "192.0.2.1",  # TEST-NET-1: no host has it
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }
    proc = _run("--port", "0", "--kv-transfer-config", NIXL % "kv_producer", env=env)
    assert proc.returncode == 1
    assert "cannot listen on 192.0.2.1:5600" in proc.stderr
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST must be an address of this host" in proc.stderr


def test_not_serving_while_loading_then_serving_then_drains_on_sigterm(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    site = worker_tree_dir("vllm") / "site"
    env = {"PYTHONPATH": str(site), "PDFAKE_WARMUP_SECS": "3", "PDFAKE_STATE": str(tmp_path)}
    argv = ["-m", "vllm.entrypoints.grpc_server", "--model", "m", "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [sys.executable, *argv, "--port", str(port)],
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    seen = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and health_pb2.HealthCheckResponse.SERVING not in seen:
            with contextlib.suppress(grpc.RpcError):  # not listening yet
                seen.append(stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen[-1] == health_pb2.HealthCheckResponse.SERVING
    assert proc.returncode == 0 and "Drained; shutting down." in stderr


# --------------------------------------------------------------------------- GetLoads


def _generate(engine: Engine, words: int, max_tokens: int) -> None:
    """One answer through the capacity model, as the servicer's Generate paces it."""
    engine.begin()
    try:
        plan = engine.plan(
            f"r{time.monotonic_ns()}", [tokenizer.USER] + [10] * words, max_tokens, None
        )
        for index in range(len(plan.words)):
            plan.pace.token(index)
        plan.pace.finish()
    finally:
        engine.end()


def _loads(engine: Engine) -> Any:
    return VllmEngineServicer(engine).GetLoads(pb.GetLoadsRequest(), None)


def test_get_loads_reports_the_prefill_queue_of_the_capacity_model(tmp_path: Path) -> None:
    """Prompts queue behind one another on the prefill slot: GetLoads names the one running,
    the ones waiting and their prompt tokens, as vLLM's servicer reports its scheduler's."""
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"worker_latency_ms": 0, "prefill_tokens_per_s": 200}))
    engine = Engine(config("kv_both"), StateFile(path), 0)
    threads = [
        threading.Thread(target=_generate, args=(engine, 99, 1), daemon=True) for _ in range(3)
    ]
    for thread in threads:  # 100 prompt tokens each: 0.5 s apiece on the slot
        thread.start()
        time.sleep(0.05)
    (load,) = _loads(engine).loads
    assert (load.num_running_reqs, load.num_waiting_reqs) == (1, 2)
    assert load.num_total_reqs == 3
    assert load.num_waiting_uncached_tokens == 2 * 100  # two prompts of 100 input ids wait
    assert load.max_running_requests == engine.cfg.max_num_seqs
    for thread in threads:
        thread.join(10)
    (idle,) = _loads(engine).loads
    assert (idle.num_running_reqs, idle.num_waiting_reqs, idle.num_waiting_uncached_tokens) == (
        0,
        0,
        0,
    )


def test_get_loads_throughput_is_tokens_as_produced(tmp_path: Path) -> None:
    """Decode streams share the decode rate: gen_throughput counts tokens as they come (not
    when answers end), so running / gen_throughput is the streams' inter-token latency."""
    path = tmp_path / "state.json"
    path.write_text(
        json.dumps({"worker_latency_ms": 0, "prefill_tokens_per_s": 0, "decode_tokens_per_s": 100})
    )
    engine = Engine(config("kv_both"), StateFile(path), 0)
    streams = [
        threading.Thread(target=_generate, args=(engine, 2, 100), daemon=True) for _ in range(4)
    ]
    for stream in streams:
        stream.start()
    time.sleep(3.0)  # 4 streams x 25 tokens/s each (4 s of answer), 3 s of the 10 s window
    (load,) = _loads(engine).loads
    assert load.num_running_reqs == 4
    assert 20 <= load.gen_throughput <= 40  # ~300 tokens / 10 s
    assert load.token_usage > 0 and load.num_used_tokens == 4 * 512
    for stream in streams:
        stream.join(10)
