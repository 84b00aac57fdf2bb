"""A gRPC worker's load from its engine's GetLoads answer, decoded without the protobuf
runtime (engine_loads.py). The answers are built with the real generated messages
(smg-grpc-proto), so the hand decoder is checked against the wire format the workers speak."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as sglang_pb
from smg_grpc_proto import vllm_engine_pb2 as vllm_pb

from pdctl.core.scaling.engine_loads import GET_LOADS, EngineLoad, LoadsError, decode_loads

# --------------------------------------------------------------------------- GetLoads


def vllm_answer(*ranks: dict[str, float]) -> bytes:
    loads = [vllm_pb.SchedulerLoad(dp_rank=i, **r) for i, r in enumerate(ranks)]
    return bytes(
        vllm_pb.GetLoadsResponse(
            timestamp="2026-11-02T10:00:00Z", version="0.11", dp_rank_count=len(loads), loads=loads
        ).SerializeToString()
    )


def test_a_vllm_answer_is_summed_over_its_ranks() -> None:
    message = vllm_answer(
        {"num_running_reqs": 3, "num_waiting_reqs": 2, "gen_throughput": 120.5,
         "num_waiting_uncached_tokens": 900, "token_usage": 0.4, "utilization": 0.1},
        {"num_running_reqs": 1, "num_waiting_reqs": 0, "gen_throughput": 40.0,
         "max_running_requests": 256},
    )  # fmt: skip
    assert decode_loads(message, "vllm") == EngineLoad(4, 2, 900, 160.5)


def test_an_sglang_answer_reads_its_own_waiting_tokens_field() -> None:
    """SGLang numbers num_waiting_uncached_tokens 17 (12 is its memory section)."""
    load = sglang_pb.SchedulerLoad(
        dp_rank=0, num_running_reqs=5, num_waiting_reqs=7, gen_throughput=250.0,
        num_waiting_uncached_tokens=3000,
        memory=sglang_pb.MemoryMetrics(weight_gb=1.0, token_capacity=9),
    )  # fmt: skip
    answer = sglang_pb.GetLoadsResponse(
        version="0.5", dp_rank_count=1, loads=[load],
        aggregate=sglang_pb.AggregateMetrics(total_running_reqs=5),
    )  # fmt: skip
    assert decode_loads(answer.SerializeToString(), "sglang") == EngineLoad(5, 7, 3000, 250.0)


def test_the_methods_are_the_engines_services() -> None:
    assert GET_LOADS["vllm"] == "/vllm.grpc.engine.VllmEngine/GetLoads"
    assert vllm_pb.DESCRIPTOR.services_by_name["VllmEngine"].methods_by_name["GetLoads"]
    assert GET_LOADS["sglang"] == "/sglang.grpc.scheduler.SglangScheduler/GetLoads"
    assert sglang_pb.DESCRIPTOR.services_by_name["SglangScheduler"].methods_by_name["GetLoads"]


@pytest.mark.parametrize(
    ("message", "why"),
    [
        (b"", "no rank"),
        (vllm_answer(), "no rank"),
        (b"\x22\x05\x10", "runs past"),  # a rank of 5 bytes with 1 given
        (b"\x22\x02\x10\xff", "truncated"),  # a varint that never ends
        (b"\x22\x03\x0b\x00\x00", "wire type 3"),
        (b"\x22\x01\x00", "field number 0"),
        (b"\x22\x03\x41\x00\x00", "truncated fixed"),
    ],
)
def test_a_malformed_answer_is_an_error(message: bytes, why: str) -> None:
    with pytest.raises(LoadsError, match=why):
        decode_loads(message, "vllm")


def test_a_negative_count_or_a_bad_throughput_is_refused() -> None:
    with pytest.raises(LoadsError, match="negative num_waiting_reqs"):
        decode_loads(vllm_answer({"num_waiting_reqs": -3}), "vllm")
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(LoadsError, match="gen_throughput"):
            decode_loads(vllm_answer({"gen_throughput": bad}), "vllm")


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_fail_cleanly(data: bytes) -> None:
    try:
        load = decode_loads(data, "vllm")
    except LoadsError:
        return
    assert min(load.running, load.waiting, load.waiting_tokens) >= 0
    assert math.isfinite(load.gen_throughput) and load.gen_throughput >= 0
