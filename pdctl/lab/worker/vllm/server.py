"""Stand-in for vLLM's gRPC server (``vllm serve --grpc``, ``python3 -m
vllm.entrypoints.grpc_server``) in pdctl's lab, routed by the real SMG.

Serves, on ``--host``:``--port``, the ``vllm.grpc.engine.VllmEngine`` service of PyPI
``smg-grpc-proto`` (HealthCheck, GetModelInfo, GetServerInfo, GetLoads, GetTokenizer, Generate
streamed or not, Abort) and ``grpc.health.v1.Health`` (SERVING once loaded); no HTTP port.
What SMG reads from each RPC: docs/facts.md, vLLM gRPC workers.
What the engine does is in engine.py. Lab settings and faults as for the SGLang stand-in
(common/settings.py); at start it refuses, like vLLM's NIXL would, a missing RDMA provider
library, GPUs or RDMA devices (common/devices.py), and a side-channel port already taken.
SIGTERM/SIGINT: health goes NOT_SERVING, new requests are refused, in-flight ones finish.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from grpc_health.v1 import health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from .. import model_cache
from ..common import grpc_serving, settings, tokenizer
from ..common.devices import gpu_failure, missing_provider, nic_failure, verbs_warning
from ..common.grpc_serving import HealthServicer, Refused, abort
from ..common.runtime import MAX_TOTAL_NUM_TOKENS, TOKENS_PER_RUNNING_REQUEST, rank_share
from .cli import Config, UsageError, parse
from .engine import Engine, Plan, SideChannel, log

VERSION = "0.11.x-pdctl-lab"
TOKENIZER_PATH = "/opt/pdctl-lab/vllm/tokenizer"  # not on the router host: SMG asks GetTokenizer
# UCX transports that move KV without RDMA (UCX_TLS); any other needs a verbs provider.
TCP_TRANSPORTS = frozenset({"tcp", "self", "sm", "shm", "posix", "sysv", "cma"})
_SIDE_CHANNEL_FIX = {
    errno.EADDRINUSE: "Another worker on this host uses the port: give each worker its own "
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    errno.EADDRNOTAVAIL: "VLLM_NIXL_SIDE_CHANNEL_HOST must be an address of this host (one "
    "the decode workers reach)",
}


class VllmEngineServicer(pb_grpc.VllmEngineServicer):  # type: ignore[misc]
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg

    def HealthCheck(self, request: Any, context: Any) -> Any:
        healthy, message = self.engine.health()
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    def GetModelInfo(self, request: Any, context: Any) -> Any:
        cfg = self.cfg
        return pb.GetModelInfoResponse(
            model_path=cfg.model,
            is_generation=True,
            max_context_length=cfg.max_model_len,
            vocab_size=len(tokenizer.VOCAB),
            served_model_name=cfg.served_model_name,
            tokenizer_path=TOKENIZER_PATH,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            eos_token_ids=[tokenizer.EOS],
            bos_token_id=tokenizer.BOS,
            max_req_input_len=cfg.max_model_len,
        )

    def GetServerInfo(self, request: Any, context: Any) -> Any:
        cfg, kv = self.cfg, self.cfg.kv
        return pb.GetServerInfoResponse(
            active_requests=self.engine.inflight,
            is_paused=False,
            last_receive_timestamp=time.time(),
            uptime_seconds=time.monotonic() - self.engine.started,
            server_type="vllm-grpc",
            kv_connector=kv.connector if kv else "",
            kv_role=kv.role if kv else "",
            kv_engine_id=kv.engine_id if kv else "",
            data_parallel_size=cfg.data_parallel_size,
            kv_cache_dtype=cfg.kv_cache_dtype,
            block_size=cfg.block_size,
            attention_backend=cfg.attention_backend,
            model_dtype=cfg.dtype,
            max_num_seqs=cfg.max_num_seqs,
        )

    def GetLoads(self, request: Any, context: Any) -> Any:
        """The capacity model's load (common/capacity.py), as vLLM's servicer reads its
        scheduler stats: requests running and waiting for the prefill slot, the waiting
        prompt tokens, the KV pool's use and the tokens generated per second, per DP rank."""
        engine, dp = self.engine, self.cfg.data_parallel_size
        running, waiting = engine.load()
        queued_tokens = engine.queued_tokens()
        loads = []
        for rank in range(dp):
            if request.HasField("dp_rank") and request.dp_rank != rank:
                continue
            busy = rank_share(running, dp, rank)
            queued = rank_share(waiting, dp, rank)
            loads.append(
                pb.SchedulerLoad(
                    dp_rank=rank,
                    num_running_reqs=busy,
                    num_waiting_reqs=queued,
                    num_total_reqs=busy + queued,
                    num_used_tokens=busy * TOKENS_PER_RUNNING_REQUEST,
                    max_total_num_tokens=MAX_TOTAL_NUM_TOKENS,
                    token_usage=engine.token_usage(busy),
                    gen_throughput=round(engine.gen_throughput() / dp, 2),
                    utilization=round(busy / self.cfg.max_num_seqs, 4),
                    max_running_requests=self.cfg.max_num_seqs,
                    num_waiting_uncached_tokens=rank_share(queued_tokens, dp, rank),
                )
            )
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=VERSION,
            dp_rank_count=len(loads),
            loads=loads,
        )

    def GetTokenizer(self, request: Any, context: Any) -> Iterator[Any]:
        return grpc_serving.tokenizer_chunks(self.cfg.max_model_len)

    def Abort(self, request: Any, context: Any) -> Any:
        self.engine.aborted.update(request.request_ids)
        log(f"Abort requests: {list(request.request_ids)}")
        return pb.AbortResponse()

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        rid = request.request_id
        if request.WhichOneof("input") != "tokenized":
            abort(context, "INVALID_ARGUMENT", "this engine takes tokenized input only")
        if not self.engine.begin():
            abort(context, "UNAVAILABLE", "the server is shutting down")
        sampling = request.sampling_params
        limit = sampling.max_tokens if sampling.HasField("max_tokens") else None
        kv_json = (
            request.kv_transfer_params_json if request.HasField("kv_transfer_params_json") else None
        )
        plan: Plan | None = None
        sent = 0
        try:
            try:
                plan = self.engine.plan(rid, list(request.tokenized.input_ids), limit, kv_json)
            except Refused as exc:
                log(f"Generate {rid} refused: {exc}", "ERROR")
                abort(context, exc.code, str(exc))
            ids: list[int] = []
            finish = plan.finish
            for index, word in enumerate(plan.words):
                if rid in self.engine.aborted:
                    finish = "abort"
                    break
                plan.pace.token(index)
                ids += word
                sent = index + 1
                if request.stream:
                    chunk = pb.GenerateStreamChunk(
                        token_ids=word, prompt_tokens=plan.prompt_tokens, completion_tokens=sent
                    )
                    yield pb.GenerateResponse(chunk=chunk)
            plan.pace.token(0)  # an empty answer still waits for its prompt's turn
            plan.on_done()
            # Counted before the final frame goes out (see Runtime.record).
            plan.pace.finish()
            self.engine.record(plan.prompt_tokens, sent)
            complete = pb.GenerateComplete(
                output_ids=[] if request.stream else ids,  # a stream's ids went in its chunks
                finish_reason=finish,
                prompt_tokens=plan.prompt_tokens,
                completion_tokens=sent,
            )
            if plan.kv_params is not None:
                complete.kv_transfer_params_json = json.dumps(plan.kv_params)
            yield pb.GenerateResponse(complete=complete)
            log(f"Generate {rid}: {self.cfg.role} {finish} {sent} token(s) stream={request.stream}")
        finally:
            if plan is not None:
                plan.pace.close()
            self.engine.aborted.discard(rid)
            self.engine.end()


def start_failure(cfg: Config, env: Mapping[str, str]) -> str | None:
    """Why the engine cannot start on this host (what vLLM and NIXL would say), or None."""
    if cfg.kv is not None:
        transports = {t.strip() for t in (env.get("UCX_TLS") or "").split(",") if t.strip()}
        name = None if transports and transports <= TCP_TRANSPORTS else missing_provider(env)
        if name is not None:
            sys.stderr.write(verbs_warning(name) + "\n")
            return (
                f"RuntimeError: {cfg.kv.connector}: NIXL UCX backend found no RDMA device "
                "(ibv_get_device_list returned 0 devices): mount the host's RDMA provider "
                "library into the container, or set UCX_TLS=tcp"
            )
    refused = gpu_failure(env)
    if refused is None and cfg.kv is not None:
        refused = nic_failure(env)
    return refused


def serve(cfg: Config, ignored: list[str]) -> int:
    if ignored:
        log(f"Ignoring flags this stand-in does not model: {' '.join(ignored)}", "WARNING")
    kv = cfg.kv
    log(
        f"Starting vLLM stand-in {VERSION} (pdctl lab): model={cfg.model} "
        f"served={cfg.served_model_name} grpc={cfg.host}:{cfg.port} tp={cfg.tensor_parallel_size} "
        + (
            f"kv={kv.connector}/{kv.role} side_channel={cfg.side_host}:{cfg.side_port}"
            if kv
            else "kv=none"
        )
    )
    refused = start_failure(cfg, os.environ)
    if refused:
        log(refused, "ERROR")
        return 1
    state = settings.state_file(os.environ)
    refused = model_cache.load_model(cfg.model, cfg.revision, os.environ, state.read(), log)
    if refused:
        log(refused, "ERROR")
        return 1
    engine = Engine(cfg, state, settings.warmup_secs(state.read()))
    channel: SideChannel | None = None
    if kv is not None:
        try:
            channel = SideChannel(cfg, engine.kv)
        except OSError as exc:
            fix = _SIDE_CHANNEL_FIX.get(exc.errno or 0, "")
            where = f"{cfg.side_host}:{cfg.side_port}"
            log(
                f"NIXL side channel: cannot listen on {where}: {exc.strerror or exc}. {fix}",
                "ERROR",
            )
            return 1
        threading.Thread(target=channel.serve_forever, daemon=True, name="side-channel").start()
    server = grpc_serving.new_server(cfg.max_num_seqs)
    pb_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(engine), server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(engine.health), server)
    address = grpc_serving.listen(server, cfg.host, cfg.port, log)
    if address is None:
        return 1
    log(f"gRPC server listening on {address}; loading the model for {engine.warmup_secs:g}s")

    def close_side_channel() -> None:
        if channel is not None:
            channel.shutdown()
            channel.server_close()

    return grpc_serving.serve_until_stopped(
        server, engine, log, "Model loaded; the gRPC server is serving", close_side_channel
    )


def _run(argv: Sequence[str], entry: str) -> int:
    try:
        cfg, ignored = parse(argv, entry)
    except UsageError as exc:
        log(str(exc), "ERROR")
        return 2
    return serve(cfg, ignored)


def main_cli(argv: Sequence[str] | None = None) -> int:
    """``vllm SUBCOMMAND ...``: only ``serve`` is modelled."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "serve":
        log(
            "usage: vllm serve MODEL --grpc [options] (the lab's stand-in models only serve)",
            "ERROR",
        )
        return 2
    return _run(args[1:], "serve")


def main_grpc_server(argv: Sequence[str] | None = None) -> int:
    """``python3 -m vllm.entrypoints.grpc_server ...``."""
    return _run(list(sys.argv[1:] if argv is None else argv), "grpc_server")
