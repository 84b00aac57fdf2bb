"""SGLang's gRPC mode (``python3 -m sglang.launch_server ... --grpc-mode``) in pdctl's lab,
routed by the real SMG.

Serves, on ``--host``:``--port``, the ``sglang.grpc.scheduler.SglangScheduler`` service of PyPI
``smg-grpc-proto`` (HealthCheck, GetModelInfo, GetServerInfo, GetLoads, GetTokenizer, Generate
streamed or not, Abort) and ``grpc.health.v1.Health`` (SERVING once loaded, for the server and
for the scheduler's service name, as SGLang's health servicer answers); no HTTP port. A prefill
keeps its KV bootstrap server on ``--disaggregation-bootstrap-port`` (launch_server.py).

The P/D hand-off is SGLang's, as SMG sends it over gRPC: both legs of a request carry
``disaggregated_params`` (the prefill's ``bootstrap_host`` and ``bootstrap_port``, one
``bootstrap_room``) and go out at once. The prefill runs the prompt and keeps the room; the
decode reaches the prefill's bootstrap server, refuses the request when it cannot (INTERNAL),
waits there for the room's prefill (the KV transfer), then answers in its own words. A decode
refuses a request without those parameters (FAILED_PRECONDITION): only a P/D router sends it
work. Words are tokens (common/tokenizer.py, which SMG fetches with GetTokenizer); the pace is
the capacity model's (common/capacity.py). Settings, faults and start-up refusals are the HTTP
stand-in's (launch_server.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from typing import Any

from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from ..common import grpc_serving, tokenizer
from ..common.capacity import Pace
from ..common.grpc_serving import HealthServicer, Refused, abort, health_of
from .launch_server import (
    MAX_TOTAL_NUM_TOKENS,
    VERSION,
    Runtime,
    ServerConfig,
    log,
    make_answer,
    probe_bootstrap,
    rank_load,
    start_servers,
)

_LOAD_FIELDS = frozenset(f.name for f in pb.SchedulerLoad.DESCRIPTOR.fields)


class Handoff:
    """A request's ``disaggregated_params``: where its prefill's bootstrap server is and the
    room that names its KV (None when the request carries none)."""

    def __init__(self, request: Any) -> None:
        params = request.disaggregated_params if request.HasField("disaggregated_params") else None
        self.host = params.bootstrap_host if params is not None else ""
        self.port = params.bootstrap_port if params is not None else 0
        self.room = str(params.bootstrap_room) if params is not None else None

    @property
    def given(self) -> bool:
        return bool(self.host) and self.room is not None

    def describe(self) -> str:
        return f" bootstrap={self.host}:{self.port} room={self.room}" if self.given else ""


class SglangSchedulerServicer(pb_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.cfg = runtime.cfg
        self.aborted: set[str] = set()

    def HealthCheck(self, request: Any, context: Any) -> Any:
        healthy, message = health_of(self.runtime)
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    def GetModelInfo(self, request: Any, context: Any) -> Any:
        cfg = self.cfg
        return pb.GetModelInfoResponse(
            model_path=cfg.model_path,
            tokenizer_path=cfg.tokenizer_path,
            is_generation=True,
            weight_version="default",
            served_model_name=cfg.served_model_name,
            max_context_length=cfg.context_length,
            vocab_size=len(tokenizer.VOCAB),
            model_type="llama",
            eos_token_ids=[tokenizer.EOS],
            bos_token_id=tokenizer.BOS,
            max_req_input_len=cfg.context_length - 1,
            architectures=["LlamaForCausalLM"],
        )

    def GetServerInfo(self, request: Any, context: Any) -> Any:
        rt = self.runtime
        server_args, scheduler_info = Struct(), Struct()
        server_args.update(self.cfg.server_args() | {"grpc_mode": True})
        scheduler_info.update(
            {
                "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
                "max_req_input_len": self.cfg.context_length - 1,
                "is_generation": True,
            }
        )
        started = Timestamp()
        started.FromSeconds(int(time.time() - (time.monotonic() - rt.started)))
        return pb.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=rt.inflight,
            is_paused=False,
            last_receive_timestamp=time.time(),
            uptime_seconds=time.monotonic() - rt.started,
            sglang_version=VERSION,
            server_type="grpc",
            start_time=started,
            max_total_num_tokens=MAX_TOTAL_NUM_TOKENS,
        )

    def GetLoads(self, request: Any, context: Any) -> Any:
        include = set(request.include) or {"all"}
        loads = []
        for rank in range(self.cfg.dp_size):
            if request.HasField("dp_rank") and request.dp_rank != rank:
                continue
            load = rank_load(self.runtime, rank, include)
            loads.append(pb.SchedulerLoad(**{k: v for k, v in load.items() if k in _LOAD_FIELDS}))
        count = max(1, len(loads))
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=VERSION,
            dp_rank_count=len(loads),
            loads=loads,
            aggregate=pb.AggregateMetrics(
                total_running_reqs=sum(x.num_running_reqs for x in loads),
                total_waiting_reqs=sum(x.num_waiting_reqs for x in loads),
                total_reqs=sum(x.num_total_reqs for x in loads),
                avg_token_usage=sum(x.token_usage for x in loads) / count,
                avg_throughput=sum(x.gen_throughput for x in loads) / count,
                avg_utilization=sum(x.utilization for x in loads) / count,
            ),
        )

    def GetTokenizer(self, request: Any, context: Any) -> Iterator[Any]:
        return grpc_serving.tokenizer_chunks(self.cfg.context_length)

    def Abort(self, request: Any, context: Any) -> Any:
        self.aborted.add(request.request_id)
        log(f"Abort request {request.request_id}: {request.reason or 'no reason given'}")
        return pb.AbortResponse(success=True, message=f"Request {request.request_id} aborted")

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        rid = request.request_id
        if not request.HasField("tokenized"):
            abort(context, "INVALID_ARGUMENT", "Tokenized input must be provided")
        if not self.runtime.begin():
            abort(context, "UNAVAILABLE", "The server is shutting down")
        handoff = Handoff(request)
        room = handoff.room if self.cfg.mode == "prefill" and handoff.given else None
        if room is not None:
            self.runtime.capacity.rooms.arrived(room)
        pace: Pace | None = None
        sent, finish = 0, "abort"
        try:
            try:
                self._check_handoff(rid, handoff)
            except Refused as exc:
                log(f"Generate {rid} refused: {exc}", "ERROR")
                abort(context, exc.code, str(exc))
            ids = list(request.tokenized.input_ids)
            sampling = request.sampling_params
            limit = sampling.max_new_tokens if sampling.HasField("max_new_tokens") else None
            answer = make_answer(self.cfg, tokenizer.last_user_message(ids), "", limit)
            words = tokenizer.encode_words(answer.text)
            pace = self._pace(len(ids), handoff)
            finish, out = answer.finish, []
            for index, word in enumerate(words):
                if rid in self.aborted:
                    finish = "abort"
                    break
                pace.token(index)
                out += word
                sent = index + 1
                if request.stream:
                    chunk = pb.GenerateStreamChunk(
                        token_ids=word, prompt_tokens=len(ids), completion_tokens=sent
                    )
                    yield pb.GenerateResponse(request_id=rid, chunk=chunk)
            pace.token(0)  # an empty answer (a prefill's) still waits for its prompt's turn
            if room is not None:
                self.runtime.capacity.rooms.finished(room)  # the KV is there for the decode
            # Counted before the final frame goes out (see Runtime.record).
            pace.finish()
            self.runtime.record(len(ids), sent)
            complete = pb.GenerateComplete(
                output_ids=[] if request.stream else out,  # a stream's ids went in its chunks
                finish_reason=finish,
                prompt_tokens=len(ids),
                completion_tokens=sent,
            )
            yield pb.GenerateResponse(request_id=rid, complete=complete)
        finally:
            if pace is not None:
                pace.close()
            if room is not None:
                self.runtime.capacity.rooms.finished(room)
            self.aborted.discard(rid)
            self.runtime.end()
            log(
                f"Generate {rid}: {self.cfg.label} {finish} {sent} token(s) "
                f"stream={request.stream}{handoff.describe()}"
            )

    def _check_handoff(self, rid: str, handoff: Handoff) -> None:
        """A decode starts only from a prefill it can reach (its KV comes from there)."""
        if self.cfg.mode != "decode":
            return
        if not handoff.given:
            raise Refused(
                "FAILED_PRECONDITION",
                f"request {rid}: this worker is a decode (--disaggregation-mode decode) and the "
                "request carries no disaggregated_params (bootstrap_host, bootstrap_port, "
                "bootstrap_room): send it through a P/D router",
            )
        error = probe_bootstrap(handoff.host, handoff.port)
        if error is not None:
            raise Refused(
                "INTERNAL",
                f"KV transfer could not start: cannot reach the prefill bootstrap server at "
                f"{handoff.host}:{handoff.port} (bootstrap_room={handoff.room}): {error}",
            )

    def _pace(self, prompt_tokens: int, handoff: Handoff) -> Pace:
        rt = self.runtime
        kv_from = None
        if self.cfg.mode == "decode" and handoff.room is not None:
            kv_from = (handoff.host, handoff.port, handoff.room)
        return Pace(
            capacity=rt.capacity,
            mode=self.cfg.mode,
            rates=rt.rates(),
            latency=rt.latency_secs(),
            prompt_tokens=prompt_tokens,
            kv_from=kv_from,
            started=time.monotonic(),
            warn=partial(log, level="WARNING"),
        )


def serve(cfg: ServerConfig, runtime: Runtime) -> int:
    """Serve SGLang's gRPC API (and a prefill's bootstrap server) until SIGTERM/SIGINT."""
    try:
        bootstrap = start_servers(cfg, runtime, http=False)
    except OSError as exc:
        log(f"Cannot listen on {cfg.host}:{cfg.bootstrap_port}: {exc}", "ERROR")
        return 1
    server = grpc_serving.new_server(cfg.max_running_requests)
    pb_grpc.add_SglangSchedulerServicer_to_server(SglangSchedulerServicer(runtime), server)
    health = partial(health_of, runtime)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(health), server)
    address = grpc_serving.listen(server, cfg.host, cfg.port, log)
    if address is None:
        for item in bootstrap:
            item.server_close()
        return 1
    log(f"gRPC server listening on {address}; warming up for {runtime.warmup_secs:g}s")

    def stop_bootstrap() -> None:
        for item in bootstrap:
            item.shutdown()
            item.server_close()

    return grpc_serving.serve_until_stopped(
        server, runtime, log, "The server is fired up and ready to roll!", stop_bootstrap
    )
