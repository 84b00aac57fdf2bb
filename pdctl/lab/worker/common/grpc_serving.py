"""What the gRPC stand-ins share (vLLM's, and SGLang's in ``--grpc-mode``): grpc.health.v1,
an RPC's refusal, the tokenizer bundle SMG fetches with GetTokenizer, and the server's life
(listen, serve, drain on SIGTERM/SIGINT). Needs grpcio, grpcio-health-checking and
smg-grpc-proto, which only the gRPC stand-ins import (the lab image unpacks them from the
wheelhouse); the rest of ``common`` stays standard library only.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from types import FrameType
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from . import tokenizer
from .runtime import Runtime

CHUNK_SIZE = 64 * 1024
Health = Callable[[], tuple[bool, str]]  # (healthy, why)
Log = Callable[..., None]  # log(message, level="INFO")


def health_of(runtime: Runtime) -> tuple[bool, str]:
    """(healthy, why) of a stand-in, for its engine's HealthCheck and for grpc.health.v1."""
    if runtime.draining:
        return False, "draining"
    if not runtime.warm():
        return False, "loading the model"
    if not runtime.healthy():
        return False, "unhealthy (lab fault)"
    return True, "Health"


class Refused(Exception):
    """A request the engine turns down: gRPC ``code`` (a grpc.StatusCode name) and why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def abort(context: Any, code: str, message: str) -> NoReturn:
    """End the call with a gRPC status (grpc's ``abort`` raises)."""
    context.abort(getattr(grpc.StatusCode, code), message)
    raise AssertionError("grpc's ServicerContext.abort returned")


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1: SERVING once loaded and healthy, for the whole server (service "") and
    for any service name (SGLang answers its scheduler's name; a stand-in serves one)."""

    def __init__(self, health: Health) -> None:
        self.health = health

    def Check(self, request: Any, context: Any) -> Any:
        healthy, _ = self.health()
        status = health_pb2.HealthCheckResponse
        return status(status=status.SERVING if healthy else status.NOT_SERVING)


def tokenizer_chunks(max_model_len: int) -> Iterator[Any]:
    """GetTokenizer's stream: the ZIP in chunks, its SHA-256 on the last one only."""
    data, digest = tokenizer.bundle(max_model_len)
    for start in range(0, len(data), CHUNK_SIZE):
        last = start + CHUNK_SIZE >= len(data)
        yield common_pb2.GetTokenizerChunk(
            data=data[start : start + CHUNK_SIZE], sha256=digest if last else ""
        )


def new_server(workers: int) -> Any:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max(16, workers)))


def listen(server: Any, host: str, port: int, log: Log) -> str | None:
    """Bind the server to exactly host:port (IPv4 or IPv6); the address, or None (logged)."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        log(f"Cannot listen on {address}: {exc}", "ERROR")
        return None
    return address


def serve_until_stopped(
    server: Any, runtime: Runtime, log: Log, ready_line: str, on_stopped: Callable[[], None]
) -> int:
    """Start the server, log ``ready_line`` once warm, and on SIGTERM/SIGINT refuse new
    generations, let in-flight ones finish, stop, then ``on_stopped``. Returns 0."""
    server.start()
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    def announce() -> None:
        time.sleep(runtime.warmup_secs)
        if not runtime.draining:
            log(ready_line)

    threading.Thread(target=announce, daemon=True).start()
    while not stop.wait(0.5):
        pass
    log(f"Received {'/'.join(received)}: draining {runtime.start_draining()} in-flight request(s)")
    runtime.wait_idle()
    server.stop(grace=5).wait()
    on_stopped()
    log("Drained; shutting down.")
    return 0
