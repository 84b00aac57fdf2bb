"""Stand-in for ``python3 -m sglang.launch_server`` in pdctl's lab.

Why it exists: the lab has no GPU, yet pdctl's playbooks start real SGLang command lines
in containers on emulated hosts and put the real router (SMG) in front of them. This module
takes those command lines unchanged and answers everything SMG uses on a worker, so that
the router cannot tell it from SGLang:

* ``GET /health`` (503 while warming up, draining or faulted), ``/health_generate``, ``/ready``;
* ``GET /v1/models``, ``/server_info`` and ``/model_info`` (with their ``/get_*`` aliases),
  ``/v1/loads`` and ``/metrics`` with the fields SMG parses;
* ``POST /generate``, ``/v1/completions`` and ``/v1/chat/completions``, streamed (SSE over
  chunked encoding) or not. A decode worker first reaches the prefill's bootstrap server named
  in the request (``bootstrap_host``/``bootstrap_port``), as the KV transfer would, and fails
  with HTTP 500 when it cannot; it then waits there until the prefill of its
  ``bootstrap_room`` has finished (the KV hand-off; it decodes anyway, with a warning, when no
  prefill request for the room arrived within 2 s). Its answer names the decode worker and
  echoes the prompt; ``max_tokens``/``max_completion_tokens`` (``sampling_params.
  max_new_tokens`` on /generate) set the number of tokens, the echo's words cycled or cut to
  it (finish reason ``length``). Tokens are whitespace-separated words, the prompt's too;
* a finite capacity (capacity.py): one prefill slot works through prompt tokens one request
  at a time in arrival order (so TTFT grows with the queued prompt load); one decode slot's
  token rate is shared by its concurrent streams, each waiting ``max(floor, streams / rate)``
  between two tokens. Streams emit tokens at that pace; other replies come after the same
  time. ``/metrics`` exports SGLang's ``time_to_first_token``, ``inter_token_latency`` and
  ``e2e_request_latency`` histograms (a prefill records TTFT, a decode ITL), with SGLang's
  bucket bounds or those of its ``--bucket-*`` flags;
* a prefill's bootstrap server on ``--disaggregation-bootstrap-port``;
* SIGTERM/SIGINT: health turns 503, new generations are refused, in-flight ones finish,
  then the process exits 0.

The lab's state file (``PDFAKE_STATE``, default ``/etc/pd-fake/state.json``), re-read per
request, holds faults and the lab's settings; an environment variable overrides each:

* ``worker_unhealthy`` (true: /health answers 503);
* ``worker_warmup_secs`` (``PDFAKE_WARMUP_SECS``, 1; read once, at start): 503 until then;
* ``worker_latency_ms`` (``PDFAKE_LATENCY_MS``, 20): a fixed cost before each first token;
* ``prefill_tokens_per_s`` (``PDFAKE_PREFILL_TOKENS_PER_S``, 8000; 0: no prefill time);
* ``decode_tokens_per_s`` (``PDFAKE_DECODE_TOKENS_PER_S``, 400; shared by the streams;
  0: only the floor);
* ``decode_token_floor_ms`` (``PDFAKE_DECODE_TOKEN_FLOOR_MS``, 10): the least time
  between two tokens of a stream.

At start, a prefill or decode worker on an RDMA transfer backend fails like libibverbs and
Mooncake do when the host's RDMA provider library (``PDFAKE_PROVIDER_LIB``) is not mounted
into the container.

With ``--grpc-mode`` it serves SMG's gRPC protocol instead of this HTTP API, as SGLang does
(grpc_server.py; a prefill keeps its bootstrap server).

It runs on a bare Debian python3: standard library only (the gRPC mode also needs grpcio and
smg-grpc-proto), no import from pdctl, and from this package only by relative import (the lab
image installs the package as ``sglang``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

from .. import model_cache
from ..common import runtime as common_runtime
from ..common import settings
from ..common.capacity import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    Capacity,
    KvRooms,
    Pace,
)
from ..common.devices import gpu_failure, missing_provider, nic_failure, verbs_warning
from ..common.settings import StateFile
from ..common.words import count_tokens, fit, pieces

VERSION = "0.5.x-pdctl-lab"
DEFAULT_BOOTSTRAP_PORT = 8998
MAX_MODEL_LEN = 32768
MAX_TOTAL_NUM_TOKENS = common_runtime.MAX_TOTAL_NUM_TOKENS
TOKENS_PER_RUNNING_REQUEST = common_runtime.TOKENS_PER_RUNNING_REQUEST
DEFAULT_MAX_RUNNING_REQUESTS = 256
BOOTSTRAP_TIMEOUT_SECS = 2.0
# Transfer backends that move KV caches without RDMA; all others need a verbs provider.
TCP_BACKENDS = frozenset({"mooncake_tcp", "fake"})
CLIENT_CLOSED_REQUEST = 499  # logged when the client hangs up before the answer is written
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})

Json = dict[str, Any]

_log_lock = threading.Lock()


def log(message: str, level: str = "INFO") -> None:
    """One line on stderr, in SGLang's ``[time] LEVEL message`` shape."""
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")  # local time, like SGLang
    with _log_lock:
        sys.stderr.write(f"[{stamp}] {level} {message}\n")
        sys.stderr.flush()


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m sglang.launch_server",
        description="pdctl lab stand-in for SGLang's server (no GPU, echoes prompts).",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--model-path", "--model", dest="model_path", required=True)
    add("--tokenizer-path", default=None)
    add("--served-model-name", default=None)
    add("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    add("--disaggregation-transfer-backend", default="mooncake")
    add("--disaggregation-bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT)
    add("--disaggregation-ib-device", default=None)
    add("--tp", "--tp-size", dest="tp_size", type=int, default=1)
    add("--dp", "--dp-size", dest="dp_size", type=int, default=1)
    add("--pp", "--pp-size", dest="pp_size", type=int, default=1)
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--mem-fraction-static", type=float, default=None)
    add("--max-running-requests", type=int, default=None)
    add("--context-length", type=int, default=None)
    add("--trust-remote-code", action="store_true")
    add("--api-key", default=None)
    add("--revision", default=None)  # of the model in the Hugging Face cache (model_cache.py)
    # Serve SMG's gRPC protocol instead of HTTP (grpc_server.py; it needs grpcio).
    add("--grpc-mode", action="store_true")
    # SGLang's histogram bounds (docs/facts.md, SGLang workers, Metrics); default: SGLang's.
    add("--bucket-time-to-first-token", type=float, nargs="+", default=None)
    add("--bucket-inter-token-latency", type=float, nargs="+", default=None)
    add("--bucket-e2e-request-latency", type=float, nargs="+", default=None)
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Known flags, and the unknown ones (real SGLang has hundreds; they are ignored).
    SGLang's argparse also takes a flag abbreviated; this parser does not (an abbreviation of
    one of its few flags may be another of SGLang's), but reads the gRPC switch abbreviated
    (down to --grpc) as SGLang and pdctl do."""
    args, unknown = build_parser().parse_known_args(list(argv))
    switch = [item for item in unknown if len(item) >= 6 and "--grpc-mode".startswith(item)]
    args.grpc_mode = args.grpc_mode or bool(switch)
    return args, [item for item in unknown if item.startswith("-") and item not in switch]


def buckets(given: list[float] | None, default: tuple[float, ...]) -> tuple[float, ...]:
    """Histogram bounds from a --bucket-* flag (sorted, distinct, finite), else SGLang's."""
    chosen = sorted({b for b in given or () if math.isfinite(b)})
    return tuple(chosen) or default


@dataclass(frozen=True)
class ServerConfig:
    model_path: str
    tokenizer_path: str
    served_model_name: str
    mode: str
    transfer_backend: str
    bootstrap_port: int
    ib_device: str | None
    tp_size: int
    dp_size: int
    pp_size: int
    host: str
    port: int
    mem_fraction_static: float | None
    max_running_requests: int
    context_length: int
    trust_remote_code: bool
    api_key: str | None
    hostname: str
    ttft_buckets: tuple[float, ...] = TTFT_BUCKETS
    itl_buckets: tuple[float, ...] = ITL_BUCKETS
    e2e_buckets: tuple[float, ...] = E2E_BUCKETS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(
            model_path=args.model_path,
            tokenizer_path=args.tokenizer_path or args.model_path,
            served_model_name=args.served_model_name or args.model_path,
            mode=args.disaggregation_mode,
            transfer_backend=args.disaggregation_transfer_backend,
            bootstrap_port=args.disaggregation_bootstrap_port,
            ib_device=args.disaggregation_ib_device,
            tp_size=args.tp_size,
            dp_size=max(1, args.dp_size),
            pp_size=args.pp_size,
            host=args.host,
            port=args.port,
            mem_fraction_static=args.mem_fraction_static,
            max_running_requests=args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
            context_length=args.context_length or MAX_MODEL_LEN,
            trust_remote_code=args.trust_remote_code,
            api_key=args.api_key,
            hostname=socket.gethostname(),
            ttft_buckets=buckets(args.bucket_time_to_first_token, TTFT_BUCKETS),
            itl_buckets=buckets(args.bucket_inter_token_latency, ITL_BUCKETS),
            e2e_buckets=buckets(args.bucket_e2e_request_latency, E2E_BUCKETS),
        )

    @property
    def label(self) -> str:
        """Who answers: ``prefill``, ``decode`` or ``regular`` (not disaggregated)."""
        return self.mode if self.mode in ("prefill", "decode") else "regular"

    @property
    def engine_type(self) -> str:
        return self.mode if self.mode in ("prefill", "decode") else "unified"

    def server_args(self) -> Json:
        """The subset of SGLang's ServerArgs that /server_info reports (never the API key)."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "host": self.host,
            "port": self.port,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "pp_size": self.pp_size,
            "disaggregation_mode": self.mode,
            "disaggregation_transfer_backend": self.transfer_backend,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "disaggregation_ib_device": self.ib_device,
            "mem_fraction_static": self.mem_fraction_static,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_length,
            "trust_remote_code": self.trust_remote_code,
            "load_balance_method": "round_robin",
            "is_embedding": False,
            "skip_tokenizer_init": False,
        }


# --------------------------------------------------------------------------- environment


@dataclass(frozen=True)
class ProviderFailure:
    """What real libibverbs (raw, on stderr) and SGLang (logged) say with no RDMA device."""

    verbs_warning: str
    error: str


def provider_failure(cfg: ServerConfig, env: Mapping[str, str]) -> ProviderFailure | None:
    """None when the worker needs no RDMA (not disaggregated, a TCP backend, MC_FORCE_TCP=1)
    or when the host's provider library is mounted where libibverbs looks for it."""
    if cfg.mode not in ("prefill", "decode"):
        return None
    if cfg.transfer_backend in TCP_BACKENDS or env.get("MC_FORCE_TCP") == "1":
        return None
    name = missing_provider(env)
    if name is None:
        return None
    return ProviderFailure(
        verbs_warning=verbs_warning(name),
        error="Mooncake transfer engine initialization failed: no RDMA device found "
        f"(ibv_get_device_list returned 0 devices; backend={cfg.transfer_backend}, "
        f"ib_device={cfg.ib_device or 'auto'}). RuntimeError: Failed to initialize "
        "the KV transfer engine for disaggregation; mount the host's RDMA provider "
        "library or use a TCP transfer backend.",
    )


# --------------------------------------------------------------------------- runtime state


class Runtime(common_runtime.Runtime):
    """Start time, drain flag and the counters /metrics, /v1/loads and /server_info show."""

    def __init__(self, cfg: ServerConfig, state: StateFile, warmup_secs: float) -> None:
        capacity = Capacity(cfg.ttft_buckets, cfg.itl_buckets, cfg.e2e_buckets)
        super().__init__(state, warmup_secs, capacity)
        self.cfg = cfg


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish: str = "stop"


class BadRequest(ValueError):
    """A request SGLang would answer with HTTP 400."""


def token_limit(path: str, body: Json) -> int | None:
    """The number of tokens to generate the request asks for, if any: ``max_tokens`` or
    ``max_completion_tokens`` (OpenAI), ``sampling_params.max_new_tokens`` (/generate)."""
    candidates: list[tuple[str, object]] = [
        ("max_completion_tokens", body.get("max_completion_tokens")),
        ("max_tokens", body.get("max_tokens")),
    ]
    params = body.get("sampling_params")
    if path == "/generate" and isinstance(params, dict):
        candidates = [("sampling_params.max_new_tokens", params.get("max_new_tokens"))]
    for name, value in candidates:
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"{name} must be a non-negative integer, got {value!r}")
        return value
    return None


def content_text(content: object) -> str:
    """An OpenAI message content: a string, or a list of parts whose text parts count."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        return " ".join(part for part in parts if isinstance(part, str))
    return ""


def chat_prompt(body: Json) -> tuple[str, str]:
    """(last user message, whole conversation text) of a chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return "", ""
    texts = [content_text(m.get("content")) for m in messages if isinstance(m, dict)]
    users = [
        content_text(m.get("content"))
        for m in messages
        if isinstance(m, dict) and m.get("role") == "user"
    ]
    return (users[-1] if users else ""), " ".join(texts)


def text_prompts(value: object) -> list[str]:
    """``prompt``/``text`` of completions and generate: a string or a list of strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return [str(item) for item in value] or [""]
    return [""]


def make_answer(cfg: ServerConfig, prompt: str, context: str, limit: int | None) -> Answer:
    """The deterministic reply: the worker's name and the prompt, its words cycled or cut to
    ``limit`` tokens when the request sets one (then it ends on ``length``, as an engine does
    at max_tokens); a prefill worker's is empty (the router discards it)."""
    if cfg.mode == "prefill":
        return Answer("", count_tokens(context), 0)
    who = f"{cfg.label} {cfg.hostname}:{cfg.port} model={cfg.served_model_name}"
    text = f"[{who}] echo: {prompt}"
    if limit is None:
        return Answer(text, count_tokens(context), count_tokens(text))
    return Answer(fit(text, limit), count_tokens(context), limit, "length")


def usage(answer: Answer) -> Json:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def request_model(cfg: ServerConfig, body: Json) -> str:
    model = body.get("model")
    return model if isinstance(model, str) and model else cfg.served_model_name


def wants_usage_chunk(body: Json) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def bootstrap_room(body: Json) -> str | None:
    """The request's KV room (a batch carries a list; its first names the hand-off)."""
    room: object = body.get("bootstrap_room")
    if isinstance(room, list):
        room = room[0] if room else None
    if isinstance(room, bool) or not isinstance(room, int | str):
        return None
    return str(room)


def bootstrap_target(body: Json) -> tuple[str, int] | None:
    """The prefill bootstrap server the router named in the request, if any."""
    host: object = body.get("bootstrap_host")
    port: object = body.get("bootstrap_port")
    if isinstance(host, list):
        host = host[0] if host else None
    if isinstance(port, list):
        port = port[0] if port else None
    if not isinstance(host, str) or not host:
        return None
    if not isinstance(port, int) or isinstance(port, bool):
        port = DEFAULT_BOOTSTRAP_PORT
    return host, port


def probe_bootstrap(host: str, port: int, timeout: float = BOOTSTRAP_TIMEOUT_SECS) -> str | None:
    """Reach a prefill's bootstrap server like the KV receiver does; the error, or None."""
    request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(request.encode())
            status_line = sock.makefile("rb").readline(256)
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    fields = status_line.split()
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/") or fields[1] != b"200":
        return f"unexpected answer {status_line[:80]!r}"
    return None


# --------------------------------------------------------------------------- response bodies


def chat_body(cfg: ServerConfig, body: Json, answer: Answer, rid: str) -> Json:
    message = {"role": "assistant", "content": answer.text, "tool_calls": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": answer.finish}
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request_model(cfg, body),
        "choices": [choice],
        "usage": usage(answer),
    }


def completion_body(cfg: ServerConfig, body: Json, answers: list[Answer], rid: str) -> Json:
    choices = [
        {"index": i, "text": a.text, "logprobs": None, "finish_reason": a.finish}
        for i, a in enumerate(answers)
    ]
    total = Answer(
        "",
        sum(a.prompt_tokens for a in answers),
        sum(a.completion_tokens for a in answers),
    )
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": request_model(cfg, body),
        "choices": choices,
        "usage": usage(total),
    }


def finish_reason(answer: Answer) -> Json:
    """/generate's finish reason: ``stop`` at the end of the answer, ``length`` at the limit."""
    if answer.finish == "length":
        return {"type": "length", "length": answer.completion_tokens}
    return {"type": "stop", "matched": None}


def generate_item(answer: Answer, rid: str, text: str, finished: bool, started: float) -> Json:
    meta: Json = {
        "id": rid,
        "finish_reason": finish_reason(answer) if finished else None,
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": count_tokens(text),
        "cached_tokens": 0,
        "e2e_latency": round(time.monotonic() - started, 4),
    }
    return {"text": text, "meta_info": meta}


# --------------------------------------------------------------------------- HTTP server


class WorkerHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class WorkerHTTPServer6(WorkerHTTPServer):
    address_family = socket.AF_INET6


def bind_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> WorkerHTTPServer:
    """Listen on exactly the given address (IPv4 or IPv6), nothing else."""
    cls = WorkerHTTPServer6 if ":" in host else WorkerHTTPServer
    return cls((host, port), handler)


class BaseHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        """Silenced: requests are logged by :meth:`log_request` or by the handler."""

    def send_body(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_json(self, status: int, payload: object) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json")

    def send_empty(self, status: int) -> None:
        self.send_body(status, b"", "text/plain; charset=utf-8")

    def read_body(self) -> bytes:
        """The request body, by Content-Length or chunked encoding."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _read_chunked(self) -> bytes:
        data = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(data)
            data += self.rfile.read(size)
            self.rfile.readline()


class BootstrapHandler(BaseHandler):
    """The prefill's KV bootstrap server: enough of it for a decode to reach it."""

    timeout = 10
    rooms: ClassVar[KvRooms]

    def handle(self) -> None:
        log(f"KV bootstrap connection from {self.client_address[0]}:{self.client_address[1]}")
        super().handle()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = url.path
        if path == "/health":
            self.send_body(200, b"OK", "text/plain; charset=utf-8")
        elif path == "/kv":
            room = (parse_qs(url.query).get("room") or [""])[0]
            self.send_json(200, {"room": room, "state": self.rooms.wait(room)})
        elif path == "/route":
            self.send_json(200, {"status": "ok", "bootstrap": "pdctl-lab"})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_PUT(self) -> None:
        self.read_body()
        self.send_body(200, b"OK", "text/plain; charset=utf-8")


class WorkerHandler(BaseHandler):
    """SGLang's HTTP API, as far as SMG and the lab's tools use it."""

    runtime: ClassVar[Runtime]
    GET_ROUTES: ClassVar[dict[str, str]] = {
        "/health": "health",
        "/health_generate": "health",
        "/ready": "health",
        "/v1/models": "models",
        "/server_info": "server_info",
        "/get_server_info": "server_info",
        "/model_info": "model_info",
        "/get_model_info": "model_info",
        "/v1/loads": "loads",
        "/get_loads": "loads",
        "/metrics": "metrics",
    }
    OPEN_PREFIXES: ClassVar[tuple[str, ...]] = ("/health", "/metrics")

    _quiet = False

    @property
    def cfg(self) -> ServerConfig:
        return self.runtime.cfg

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if not self._quiet:
            client = f"{self.client_address[0]}:{self.client_address[1]}"
            log(f'{client} - "{self.command} {self.path} {self.request_version}" {code}')

    # ---- dispatch

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        self._quiet = False
        url = urlsplit(self.path)
        body = self.read_body() if method == "POST" else b""
        if not self._authorized(url.path):
            self.send_json(401, {"error": "Unauthorized"})
            return
        if method == "GET" and url.path in self.GET_ROUTES:
            getattr(self, f"get_{self.GET_ROUTES[url.path]}")(parse_qs(url.query))
        elif method == "POST" and url.path in GENERATION_PATHS:
            self.generation(url.path, body)
        elif url.path in self.GET_ROUTES or url.path in GENERATION_PATHS:
            self.send_json(405, {"detail": "Method Not Allowed"})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def _authorized(self, path: str) -> bool:
        key = self.cfg.api_key
        if not key or path.startswith(self.OPEN_PREFIXES):
            return True
        return self.headers.get("Authorization", "") == f"Bearer {key}"

    # ---- GET endpoints

    def get_health(self, _query: dict[str, list[str]]) -> None:
        self.send_empty(200 if self.runtime.healthy() else 503)

    def get_models(self, _query: dict[str, list[str]]) -> None:
        card = {
            "id": self.cfg.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.cfg.model_path,
            "max_model_len": self.cfg.context_length,
        }
        self.send_json(200, {"object": "list", "data": [card]})

    def get_server_info(self, _query: dict[str, list[str]]) -> None:
        rt = self.runtime
        info: Json = {
            **self.cfg.server_args(),
            "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
            "max_req_input_len": self.cfg.context_length - 1,
            "internal_states": [{"last_gen_throughput": rt.gen_throughput()}],
            "num_running_reqs": rt.inflight,
            "num_requests_total": rt.requests_total,
            "prompt_tokens_total": rt.prompt_tokens_total,
            "generation_tokens_total": rt.generation_tokens_total,
            "uptime_seconds": round(time.monotonic() - rt.started, 3),
            "draining": rt.draining,
            "hostname": self.cfg.hostname,
            "version": VERSION,
        }
        self.send_json(200, info)

    def get_model_info(self, _query: dict[str, list[str]]) -> None:
        self.send_json(
            200,
            {
                "model_path": self.cfg.model_path,
                "tokenizer_path": self.cfg.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": None,
                "architectures": None,
            },
        )

    def get_loads(self, query: dict[str, list[str]]) -> None:
        include = {s.strip() for v in query.get("include", []) for s in v.split(",")} or {"all"}
        loads = [rank_load(self.runtime, rank, include) for rank in range(self.cfg.dp_size)]
        wanted = query.get("dp_rank", [])
        if wanted:
            loads = [load for load in loads if str(load["dp_rank"]) == wanted[0]]
        self.send_json(
            200,
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": VERSION,
                "dp_rank_count": len(loads),
                "loads": loads,
                "aggregate": _aggregate(loads),
            },
        )

    def get_metrics(self, _query: dict[str, list[str]]) -> None:
        self.send_body(
            200, render_metrics(self.runtime).encode(), "text/plain; version=0.0.4; charset=utf-8"
        )

    # ---- generation

    def generation(self, path: str, raw: bytes) -> None:
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            self.send_error_json(400, f"Invalid JSON body: {exc}")
            return
        if not isinstance(body, dict):
            self.send_error_json(400, "The request body must be a JSON object")
            return
        try:
            limit = token_limit(path, body)
        except BadRequest as exc:
            self.send_error_json(400, str(exc))
            return
        if not self.runtime.begin():
            self.send_error_json(503, "The server is shutting down; not accepting new requests")
            return
        self._quiet = True
        started = time.monotonic()
        room = bootstrap_room(body) if self.cfg.mode == "prefill" else None
        if room is not None:
            self.runtime.capacity.rooms.arrived(room)
        status = 500
        try:
            status = self._generate(path, body, limit, started)
        except (BrokenPipeError, ConnectionResetError):
            # The router drops the other leg's connection once one leg fails; SGLang aborts.
            self.close_connection = True
            status = CLIENT_CLOSED_REQUEST
        finally:
            if room is not None:
                self.runtime.capacity.rooms.finished(room)
            self.runtime.end()
            self._log_generation(path, body, status, started)

    def _log_generation(self, path: str, body: Json, status: int, started: float) -> None:
        target = bootstrap_target(body)
        room = body.get("bootstrap_room")
        via = f" bootstrap={target[0]}:{target[1]} room={room}" if target else ""
        if status == CLIENT_CLOSED_REQUEST:
            via += " (client closed the connection; request aborted)"
        log(
            f'{self.client_address[0]}:{self.client_address[1]} - "POST {path} '
            f'{self.request_version}" {status} {self.cfg.label} stream={body.get("stream") is True}'
            f"{via} {int((time.monotonic() - started) * 1000)}ms"
        )

    def _generate(self, path: str, body: Json, limit: int | None, started: float) -> int:
        if self.cfg.mode == "decode":
            error = self._kv_transfer_error(body)
            if error:
                self.send_error_json(500, error)
                return 500
        answers = self._answers(path, body, limit)
        rid = uuid.uuid4().hex
        prompt_tokens = sum(a.prompt_tokens for a in answers)
        pace = self._pace(prompt_tokens, body, started)

        def complete() -> None:
            pace.finish()
            self.runtime.record(prompt_tokens, sum(a.completion_tokens for a in answers))

        try:
            if body.get("stream") is True:
                self._stream(path, body, answers[0], rid, pace, complete)
            else:
                pace.run(max(a.completion_tokens for a in answers))
                complete()
                self.send_json(200, self._full_body(path, body, answers, rid, started))
        finally:
            pace.close()
        return 200

    def _pace(self, prompt_tokens: int, body: Json, started: float) -> Pace:
        target, room = bootstrap_target(body), bootstrap_room(body)
        return Pace(
            capacity=self.runtime.capacity,
            mode=self.cfg.mode,
            rates=self.runtime.rates(),
            latency=self.runtime.latency_secs(),
            prompt_tokens=prompt_tokens,
            kv_from=(*target, room) if target is not None and room is not None else None,
            started=started,
            warn=partial(log, level="WARNING"),
        )

    def _kv_transfer_error(self, body: Json) -> str | None:
        target = bootstrap_target(body)
        if target is None:
            return None
        error = probe_bootstrap(*target)
        if error is None:
            return None
        return (
            f"KV transfer could not start: cannot reach the prefill bootstrap server at "
            f"{target[0]}:{target[1]} (bootstrap_room={body.get('bootstrap_room')}): {error}"
        )

    def _answers(self, path: str, body: Json, limit: int | None) -> list[Answer]:
        if path == "/v1/chat/completions":
            last, context = chat_prompt(body)
            return [make_answer(self.cfg, last, context, limit)]
        key = "prompt" if path == "/v1/completions" else "text"
        return [make_answer(self.cfg, p, p, limit) for p in text_prompts(body.get(key))]

    def _full_body(
        self, path: str, body: Json, answers: list[Answer], rid: str, started: float
    ) -> object:
        if path == "/v1/chat/completions":
            return chat_body(self.cfg, body, answers[0], rid)
        if path == "/v1/completions":
            return completion_body(self.cfg, body, answers, rid)
        items = [generate_item(a, rid, a.text, True, started) for a in answers]
        return items if isinstance(body.get("text"), list) else items[0]

    def send_error_json(self, status: int, message: str) -> None:
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        if status == 503:
            kind = "ServiceUnavailableError"
        self.send_json(
            status,
            {
                "object": "error",
                "error": {"message": message, "type": kind, "code": status},
                "message": message,
                "code": status,
            },
        )

    # ---- streaming (SSE over chunked transfer encoding)

    def _stream(
        self,
        path: str,
        body: Json,
        answer: Answer,
        rid: str,
        pace: Pace,
        complete: Callable[[], None],
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in self._events(path, body, answer, rid, pace, complete):
            self._write_chunk(f"data: {event}\n\n".encode())
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _events(
        self,
        path: str,
        body: Json,
        answer: Answer,
        rid: str,
        pace: Pace,
        complete: Callable[[], None],
    ) -> Iterator[str]:
        ctx = StreamContext(
            rid=rid,
            model=request_model(self.cfg, body),
            chat=path == "/v1/chat/completions",
            started=pace.started,
            pace=pace,
            include_usage=wants_usage_chunk(body),
            complete=complete,
        )
        deltas = pieces(answer.text)
        if path == "/generate":
            return generate_events(ctx, answer, deltas)
        return openai_events(ctx, answer, deltas)


# --------------------------------------------------------------------------- stream events


@dataclass(frozen=True)
class StreamContext:
    rid: str
    model: str
    chat: bool
    started: float
    pace: Pace
    include_usage: bool
    complete: Callable[[], None]  # counts the answer: before its finishing event goes out

    def chunk(self, choice: Json) -> str:
        """One OpenAI stream event carrying ``choice``."""
        return json.dumps(
            {
                "id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.rid}",
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "logprobs": None, **choice}],
            }
        )

    def delta(self, text: str, finish: str | None = None) -> str:
        if self.chat:
            return self.chunk({"delta": {"content": text} if text else {}, "finish_reason": finish})
        return self.chunk({"text": text, "finish_reason": finish})

    def usage_chunk(self, answer: Answer) -> str:
        return json.dumps(
            {
                "id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.rid}",
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [],
                "usage": usage(answer),
            }
        )


def openai_events(ctx: StreamContext, answer: Answer, deltas: list[str]) -> Iterator[str]:
    """OpenAI's stream: a role chunk (chat), one delta per word, a finish chunk, usage."""
    if ctx.chat:
        yield ctx.chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
    for index, delta in enumerate(deltas):
        ctx.pace.token(index)
        yield ctx.delta(delta)
    ctx.pace.token(0)  # an empty answer still waits for its prefill
    ctx.complete()
    yield ctx.delta("", answer.finish)
    if ctx.include_usage:
        yield ctx.usage_chunk(answer)


def generate_events(ctx: StreamContext, answer: Answer, deltas: list[str]) -> Iterator[str]:
    """SGLang's native stream: each event carries the cumulative text so far."""
    text = ""
    for index, delta in enumerate(deltas):
        ctx.pace.token(index)
        text += delta
        yield json.dumps(generate_item(answer, ctx.rid, text, False, ctx.started))
    ctx.pace.token(0)  # an empty answer still waits for its prefill
    ctx.complete()
    yield json.dumps(generate_item(answer, ctx.rid, answer.text, True, ctx.started))


def rank_load(rt: Runtime, rank: int, include: set[str]) -> Json:
    """One DP rank's entry of /v1/loads, with the optional sections SGLang adds."""
    dp = rt.cfg.dp_size
    busy, queued = rt.load()
    running = common_runtime.rank_share(busy, dp, rank)
    waiting = common_runtime.rank_share(queued, dp, rank)
    used = running * TOKENS_PER_RUNNING_REQUEST
    load: Json = {
        "dp_rank": rank,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_waiting_uncached_tokens": common_runtime.rank_share(rt.queued_tokens(), dp, rank),
        "num_used_tokens": used,
        "num_total_tokens": used,
        "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
        "token_usage": rt.token_usage(running),
        "gen_throughput": round(rt.gen_throughput() / dp, 2),
        "cache_hit_rate": 0.0,
        "utilization": round(running / rt.cfg.max_running_requests, 4),
        "max_running_requests": rt.cfg.max_running_requests,
        "num_total_reqs": running + waiting,
    }
    everything = "all" in include
    if everything or "memory" in include:
        load["memory"] = {
            "weight_gb": 0.0,
            "kv_cache_gb": 0.0,
            "graph_gb": 0.0,
            "token_capacity": MAX_TOTAL_NUM_TOKENS,
        }
    if everything or "queues" in include:
        load["queues"] = {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0}
    if everything or "disagg" in include:
        load["disaggregation"] = disaggregation_load(rt.cfg.mode)
    return load


def disaggregation_load(mode: str) -> Json:
    return {
        "mode": mode,
        "prefill_prealloc_queue_reqs": 0,
        "prefill_inflight_queue_reqs": 0,
        "decode_prealloc_queue_reqs": 0,
        "decode_transfer_queue_reqs": 0,
        "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    }


def _aggregate(loads: list[Json]) -> Json:
    count = max(1, len(loads))
    return {
        "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
        "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
        "total_reqs": sum(d["num_total_reqs"] for d in loads),
        "total_used_tokens": sum(d["num_used_tokens"] for d in loads),
        "total_tokens": sum(d["num_total_tokens"] for d in loads),
        "avg_token_usage": round(sum(d["token_usage"] for d in loads) / count, 4),
        "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / count, 2),
        "avg_utilization": round(sum(d["utilization"] for d in loads) / count, 4),
    }


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(rt: Runtime) -> str:
    """SGLang's Prometheus series: the scheduler's gauges labelled like a real TP rank 0, the
    tokenizer's counters and histograms labelled by model only, as SGLang labels them."""
    model = f'model_name="{_label_value(rt.cfg.served_model_name)}"'
    labels = f'engine_type="{rt.cfg.engine_type}",{model},pp_rank="0",tp_rank="0"'
    running, queued = rt.load()
    cap = rt.capacity
    gauges = [
        ("num_running_reqs", "The number of running requests.", running),
        ("num_queue_reqs", "The number of requests in the waiting queue.", queued),
        ("token_usage", "The token usage.", rt.token_usage()),
        ("gen_throughput", "The generation throughput (token/s).", rt.gen_throughput()),
        ("cache_hit_rate", "The prefix cache hit rate.", 0.0),
    ]
    counters = [
        ("prompt_tokens_total", "Number of prefill tokens processed.", rt.prompt_tokens_total),
        (
            "generation_tokens_total",
            "Number of generation tokens processed.",
            rt.generation_tokens_total,
        ),
        ("num_requests_total", "Number of requests processed.", rt.requests_total),
    ]
    lines: list[str] = []
    for name, help_text, value in gauges:
        lines += [
            f"# HELP sglang:{name} {help_text}",
            f"# TYPE sglang:{name} gauge",
            f"sglang:{name}{{{labels}}} {float(value)}",
        ]
    for name, help_text, value in counters:
        lines += [
            f"# HELP sglang:{name} {help_text}",
            f"# TYPE sglang:{name} counter",
            f"sglang:{name}{{{model}}} {float(value)}",
        ]
    histograms = [
        ("time_to_first_token", "Histogram of time to first token in seconds.", cap.ttft),
        ("inter_token_latency", "Histogram of inter-token latency in seconds.", cap.itl),
        ("e2e_request_latency", "Histogram of End-to-end request latency in seconds", cap.e2e),
    ]
    for name, help_text, histogram in histograms:
        lines += histogram.render(f"sglang:{name}_seconds", help_text, model)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- process


def handler_for(runtime: Runtime) -> type[WorkerHandler]:
    """A handler class bound to this process's runtime state."""

    class BoundWorkerHandler(WorkerHandler):
        pass

    BoundWorkerHandler.runtime = runtime
    return BoundWorkerHandler


def bootstrap_for(runtime: Runtime) -> type[BootstrapHandler]:
    """The bootstrap server's handler class, bound to this prefill's KV rooms."""

    class BoundBootstrapHandler(BootstrapHandler):
        pass

    BoundBootstrapHandler.rooms = runtime.capacity.rooms
    return BoundBootstrapHandler


def serve_in_thread(server: WorkerHTTPServer, name: str) -> threading.Thread:
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name=name, daemon=True
    )
    thread.start()
    return thread


def announce_ready(runtime: Runtime) -> None:
    """Log SGLang's ready line once the warm-up is over."""
    time.sleep(runtime.warmup_secs)
    if not runtime.draining:
        log("The server is fired up and ready to roll!")


def start_servers(cfg: ServerConfig, runtime: Runtime, http: bool = True) -> list[WorkerHTTPServer]:
    """A prefill's bootstrap server, and the HTTP API unless the gRPC server serves instead."""
    servers: list[WorkerHTTPServer] = []
    try:
        if cfg.mode == "prefill":
            servers.append(bind_server(cfg.host, cfg.bootstrap_port, bootstrap_for(runtime)))
            log(f"KV bootstrap server listening on {cfg.host}:{cfg.bootstrap_port}")
        if http:
            servers.append(bind_server(cfg.host, cfg.port, handler_for(runtime)))
    except OSError:
        for server in servers:
            server.server_close()
        raise
    for server in servers:
        serve_in_thread(server, f"http-{server.server_address[1]}")
    return servers


def install_signal_handlers(stop: threading.Event) -> dict[int, str]:
    received: dict[int, str] = {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received[signum] = signal.Signals(signum).name
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    return received


def drain_and_stop(runtime: Runtime, servers: list[WorkerHTTPServer], why: str) -> None:
    pending = runtime.start_draining()
    log(f"Received {why}: health is now 503; draining {pending} in-flight request(s)")
    runtime.wait_idle()
    for server in servers:
        server.shutdown()
        server.server_close()
    log("Drained; shutting down.")


def describe(cfg: ServerConfig, grpc_mode: bool = False) -> str:
    return (
        f"Starting SGLang stand-in {VERSION} (pdctl lab): model={cfg.model_path} "
        f"served={cfg.served_model_name} mode={cfg.mode} backend={cfg.transfer_backend} "
        f"tp={cfg.tp_size} dp={cfg.dp_size} {'grpc' if grpc_mode else 'http'}={cfg.host}:{cfg.port}"
        + (f" bootstrap={cfg.host}:{cfg.bootstrap_port}" if cfg.mode == "prefill" else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = ServerConfig.from_args(args)
    if unknown:
        log(f"Ignoring flags this stand-in does not model: {' '.join(unknown)}", "WARNING")
    log(describe(cfg, args.grpc_mode))
    failure = provider_failure(cfg, os.environ)
    if failure:
        sys.stderr.write(failure.verbs_warning + "\n")
        log(failure.error, "ERROR")
        return 1
    refused = gpu_failure(os.environ)
    if refused is None and cfg.mode in ("prefill", "decode"):
        refused = nic_failure(os.environ)
    if refused:
        log(refused, "ERROR")
        return 1
    state = settings.state_file(os.environ)
    warmup = settings.warmup_secs(state.read())
    refused = model_cache.load_model(cfg.model_path, args.revision, os.environ, state.read(), log)
    if refused:
        log(refused, "ERROR")
        return 1
    runtime = Runtime(cfg, state, warmup)
    if args.grpc_mode:
        from .grpc_server import serve  # noqa: PLC0415 - needs grpcio, and imports this module

        return serve(cfg, runtime)
    stop = threading.Event()
    received = install_signal_handlers(stop)
    try:
        servers = start_servers(cfg, runtime)
    except OSError as exc:
        log(f"Cannot listen on {cfg.host}: {exc}", "ERROR")
        return 1
    log(f"Uvicorn running on http://{cfg.host}:{cfg.port}; warming up for {warmup:g}s")
    threading.Thread(target=announce_ready, args=(runtime,), daemon=True).start()
    while not stop.wait(0.5):
        pass
    drain_and_stop(runtime, servers, "/".join(received.values()) or "stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
