"""A gRPC worker's load, from its engine's ``GetLoads`` RPC (PURE: the bytes in, numbers out).

vLLM's ``vllm.grpc.engine.VllmEngine`` and SGLang's ``sglang.grpc.scheduler.SglangScheduler``
(PyPI ``smg-grpc-proto``, docs/facts.md "Engine loads over gRPC") answer ``GetLoads`` with one
``SchedulerLoad`` per data-parallel rank in field 4 of ``GetLoadsResponse``. Both number the
fields the scaler reads alike: ``num_running_reqs`` 2, ``num_waiting_reqs`` 3,
``gen_throughput`` 8 (a double); the prompt tokens still waiting, ``num_waiting_uncached_tokens``,
is 12 in vLLM's message and 17 in SGLang's. SMG itself polls the same RPC to route.

The answer is a worker's word about itself: decoded by field number and wire type with bounds
on every length, anything malformed is an error (the caller treats it as missing data), and a
negative count or a throughput that is not a finite non-negative number is refused the same way.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Literal

from pdctl.onhost.protowire import FIXED64, LENGTH, VARINT, WireError, fields

Engine = Literal["vllm", "sglang"]

# The RPC's full method name per engine (what the h2c call's :path carries).
GET_LOADS: dict[Engine, str] = {
    "vllm": "/vllm.grpc.engine.VllmEngine/GetLoads",
    "sglang": "/sglang.grpc.scheduler.SglangScheduler/GetLoads",
}
_LOADS = 4  # GetLoadsResponse.loads
_RUNNING, _WAITING, _THROUGHPUT = 2, 3, 8
_WAITING_TOKENS: dict[Engine, int] = {"vllm": 12, "sglang": 17}
# A GetLoads answer is a few hundred bytes per rank; anything near this is not one.
MAX_MESSAGE = 1 << 20
MAX_RANKS = 1024


class LoadsError(WireError):
    """The answer is not a GetLoadsResponse the scaler can read."""


@dataclass(frozen=True)
class EngineLoad:
    """One worker's load, summed over its data-parallel ranks."""

    running: int  # requests the engine runs now
    waiting: int  # requests queued for admission (a prefill: waiting for its turn)
    waiting_tokens: int  # prompt tokens of the waiting requests
    gen_throughput: float  # tokens generated per second, as the engine measures it


def _count(value: int | bytes, what: str) -> int:
    assert isinstance(value, int)
    if value >= 1 << 63:  # an int32 below zero travels as a 64-bit two's complement
        raise LoadsError(f"a negative {what}")
    return value


def _rank(data: bytes, engine: Engine) -> EngineLoad:
    running = waiting = tokens = 0
    throughput = 0.0
    for number, wire, value in fields(data):
        if number == _RUNNING and wire == VARINT:
            running = _count(value, "num_running_reqs")
        elif number == _WAITING and wire == VARINT:
            waiting = _count(value, "num_waiting_reqs")
        elif number == _WAITING_TOKENS[engine] and wire == VARINT:
            tokens = _count(value, "num_waiting_uncached_tokens")
        elif number == _THROUGHPUT and wire == FIXED64:
            assert isinstance(value, int)
            (throughput,) = struct.unpack("<d", value.to_bytes(8, "little"))
            if not (math.isfinite(throughput) and throughput >= 0):
                raise LoadsError(f"gen_throughput {throughput!r}")
    return EngineLoad(running, waiting, tokens, throughput)


def decode_loads(message: bytes, engine: Engine) -> EngineLoad:
    """A GetLoadsResponse's ranks, summed. LoadsError when it is not one (or reports none)."""
    try:
        return _decode(message, engine)
    except LoadsError:
        raise
    except WireError as exc:
        raise LoadsError(str(exc)) from exc


def _decode(message: bytes, engine: Engine) -> EngineLoad:
    if len(message) > MAX_MESSAGE:
        raise LoadsError(f"{len(message)} bytes: not a GetLoads answer")
    ranks = [
        _rank(value, engine)
        for number, wire, value in fields(message)
        if number == _LOADS and wire == LENGTH and isinstance(value, bytes)
    ]
    if not ranks:
        raise LoadsError("no rank's load in the answer")
    if len(ranks) > MAX_RANKS:
        raise LoadsError(f"{len(ranks)} ranks")
    return EngineLoad(
        running=sum(r.running for r in ranks),
        waiting=sum(r.waiting for r in ranks),
        waiting_tokens=sum(r.waiting_tokens for r in ranks),
        gen_throughput=sum(r.gen_throughput for r in ranks),
    )
