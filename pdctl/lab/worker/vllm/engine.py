"""The vLLM stand-in's engine: roles, the NIXL side channel, answers and their pace.

A prefill (``kv_producer``) that gets ``do_remote_decode`` runs the prompt on its prefill slot,
keeps the request's "KV" and answers with ``kv_transfer_params`` naming its side channel
(``VLLM_NIXL_SIDE_CHANNEL_HOST``:``PORT``). A decode (``kv_consumer``) refuses a request without
``do_remote_prefill``; with it, it connects to the named side channel and fetches the request's
KV (one JSON line each way) before it decodes: a request whose side channel does not answer
fails (docs/facts.md, vLLM gRPC workers). ``kv_both`` does either, as the parameters say, or
answers alone. Answers name the worker and echo the last user message, in word tokens
(common/words.py), paced by the capacity model (common/capacity.py).
"""

from __future__ import annotations

import json
import socket
import socketserver
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

from ..common import settings, tokenizer
from ..common.capacity import ROOMS_KEPT, Capacity, Pace
from ..common.grpc_serving import Refused, health_of
from ..common.runtime import Runtime
from ..common.words import fit
from .cli import Config

Json = dict[str, Any]
SIDE_CHANNEL_TIMEOUT_SECS = 5.0
_log_lock = threading.Lock()


def log(message: str, level: str = "INFO") -> None:
    """One line on stderr, in vLLM's ``LEVEL mm-dd HH:MM:SS [where] message`` shape."""
    stamp = datetime.now().strftime("%m-%d %H:%M:%S")
    with _log_lock:
        sys.stderr.write(f"{level} {stamp} [pdctl-lab vllm] {message}\n")
        sys.stderr.flush()


@dataclass
class Plan:
    """What one Generate call does: its answer's words (ids per word), its pace and what it
    hands back to the router."""

    words: list[list[int]]
    finish: str
    prompt_tokens: int
    pace: Pace
    kv_params: Json | None = None
    on_done: Callable[[], None] = field(default=lambda: None)


class KvStore:
    """The prefill's finished requests, whose KV a decode may fetch (bounded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: OrderedDict[str, int] = OrderedDict()

    def put(self, request_id: str, prompt_tokens: int) -> None:
        with self._lock:
            self._done[request_id] = prompt_tokens
            while len(self._done) > ROOMS_KEPT:
                self._done.popitem(last=False)

    def get(self, request_id: str) -> int | None:
        with self._lock:
            return self._done.get(request_id)


class SideChannelHandler(socketserver.StreamRequestHandler):
    timeout = SIDE_CHANNEL_TIMEOUT_SECS
    store: KvStore

    def handle(self) -> None:
        try:
            asked = json.loads(self.rfile.readline(4096) or b"{}")
        except ValueError:
            asked = {}
        request_id = asked.get("remote_request_id") if isinstance(asked, dict) else None
        tokens = self.store.get(request_id) if isinstance(request_id, str) else None
        answer = (
            {"ok": True, "prompt_tokens": tokens}
            if tokens is not None
            else {"ok": False, "error": f"no KV for request {request_id!r} on this prefill"}
        )
        log(f"NIXL side channel: {self.client_address[0]} fetched {request_id}: {answer['ok']}")
        self.wfile.write(json.dumps(answer).encode() + b"\n")


class SideChannel(socketserver.ThreadingTCPServer):
    """The NIXL side channel a decode reaches to fetch its prefill's KV. Binding fails (OSError)
    when the port is taken: no address reuse, as a second NIXL agent on the port fails."""

    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, cfg: Config, store: KvStore) -> None:
        self.address_family = socket.AF_INET6 if ":" in cfg.side_host else socket.AF_INET
        handler = type("BoundSideChannelHandler", (SideChannelHandler,), {"store": store})
        super().__init__((cfg.side_host, cfg.side_port), handler)


def fetch_kv(host: str, port: int, request_id: str) -> str | None:
    """Fetch a request's KV from the prefill's side channel: None, or why it failed."""
    try:
        with socket.create_connection((host, port), timeout=SIDE_CHANNEL_TIMEOUT_SECS) as sock:
            sock.sendall(json.dumps({"remote_request_id": request_id}).encode() + b"\n")
            line = sock.makefile("rb").readline(4096)
    except OSError as exc:
        return f"cannot reach the prefill's NIXL side channel at {host}:{port}: {exc}"
    try:
        answer = json.loads(line or b"{}")
    except ValueError:
        answer = {}
    if isinstance(answer, dict) and answer.get("ok") is True:
        return None
    error = answer.get("error") if isinstance(answer, dict) else None
    return f"the prefill's side channel at {host}:{port} refused: {error or 'no answer'}"


class Engine(Runtime):
    """A worker's runtime (common/runtime.py), its KV and the generation plans."""

    def __init__(self, cfg: Config, state: settings.StateFile, warmup_secs: float) -> None:
        super().__init__(state, warmup_secs, Capacity())
        self.cfg = cfg
        self.kv = KvStore()
        self.aborted: set[str] = set()

    def health(self) -> tuple[bool, str]:
        """(healthy, why) for HealthCheck and grpc.health.v1."""
        return health_of(self)

    def plan(
        self, request_id: str, input_ids: list[int], max_tokens: int | None, kv_json: str | None
    ) -> Plan:
        """What to answer, or Refused (the router gets a gRPC error)."""
        params = _kv_params(kv_json)
        remote_decode = params.get("do_remote_decode") is True
        remote_prefill = params.get("do_remote_prefill") is True
        role = self.cfg.role
        if role == "decode" and not remote_prefill:
            raise Refused(
                "FAILED_PRECONDITION",
                f"request {request_id}: this worker is a KV consumer (kv_role=kv_consumer) and "
                "the request carries no kv_transfer_params from a prefill (do_remote_prefill, "
                "remote_host, remote_port): send it through a P/D router",
            )
        if remote_prefill and role in ("decode", "both"):
            self._fetch(request_id, params)
            return self._answer("decode", "decode", input_ids, max_tokens)
        if remote_decode and role in ("prefill", "both"):
            plan = self._answer(
                "prefill", "prefill", input_ids, 1 if max_tokens is None else max_tokens
            )
            plan.kv_params = self._handoff(request_id)
            plan.on_done = partial(self.kv.put, request_id, plan.prompt_tokens)
            return plan
        return self._answer("regular", "null", input_ids, max_tokens)

    def _fetch(self, request_id: str, params: Json) -> None:
        host, port = params.get("remote_host"), params.get("remote_port")
        remote_id = params.get("remote_request_id") or request_id
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            raise Refused(
                "INVALID_ARGUMENT",
                f"request {request_id}: kv_transfer_params need remote_host and remote_port "
                f"(got {host!r}, {port!r})",
            )
        error = fetch_kv(host, port, str(remote_id))
        if error:
            log(f"KV transfer for {request_id} failed: {error}", "ERROR")
            raise Refused("INTERNAL", f"KV transfer for request {request_id} failed: {error}")

    def _handoff(self, request_id: str) -> Json:
        """vLLM's NixlConnector hand-off, which SMG forwards to the decode unchanged."""
        assert self.cfg.kv is not None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [0],
            "remote_engine_id": self.cfg.kv.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.cfg.side_host,
            "remote_port": self.cfg.side_port,
            "tp_size": self.cfg.tensor_parallel_size,
        }

    def _answer(self, label: str, mode: str, input_ids: list[int], limit: int | None) -> Plan:
        cfg = self.cfg
        who = f"{label} {cfg.hostname}:{cfg.port} model={cfg.served_model_name}"
        text = f"[{who}] echo: {tokenizer.last_user_message(input_ids)}"
        finish = "stop" if limit is None else "length"
        words = tokenizer.encode_words(text if limit is None else fit(text, limit))
        state = self.state.read()
        pace = Pace(
            capacity=self.capacity,
            mode=mode,
            rates=settings.rates(state),
            latency=settings.latency_secs(state),
            prompt_tokens=len(input_ids),
            kv_from=None,  # the decode fetched the KV before it plans its answer
            started=time.monotonic(),
            warn=partial(log, level="WARNING"),
        )
        return Plan(words, finish, len(input_ids), pace)


def _kv_params(text: str | None) -> Json:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise Refused("INVALID_ARGUMENT", "kv_transfer_params_json must be a JSON object")
    return value
