"""The latency and load signals of a gRPC group (vLLM, SGLang --grpc-mode): the engines'
GetLoads answers decoded without the protobuf runtime, and the router's histograms windowed.

The GetLoads answers are built with the real generated messages (smg-grpc-proto), so the
hand decoder is checked against the wire format the workers speak; the router text is a real
SMG 1.13.0 scrape (tests/data/smg/SOURCES) and texts in its exact shape.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as sglang_pb
from smg_grpc_proto import vllm_engine_pb2 as vllm_pb

from pdctl.scaler.engine_loads import GET_LOADS, EngineLoad, LoadsError, decode_loads
from pdctl.scaler.observe import histograms
from pdctl.scaler.router_latency import (
    CLIENT_TPOT,
    CLIENT_TTFT,
    PREFILL_LEG,
    ROUTER_HISTOGRAMS,
    RouterLatency,
)

SCRAPE = Path(__file__).resolve().parents[1] / "data" / "smg" / "grpc-pd-vllm-metrics.txt"
SMG_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LABELS = 'router_type="grpc",backend_type="pd",model="m",endpoint="chat"'
PD_LABELS = 'backend_type="pd",model="m",runtime="vllm"'


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


def test_seconds_per_token_is_the_streams_share_of_the_throughput() -> None:
    assert EngineLoad(4, 0, 0, 100.0).seconds_per_token() == pytest.approx(0.04)
    assert EngineLoad(0, 0, 0, 0.0).seconds_per_token() == 0.0  # idle
    assert EngineLoad(3, 0, 0, 0.0).seconds_per_token() is None  # runs, says no rate


# --------------------------------------------------------------------------- router histograms


def test_the_real_scrape_has_the_histograms_the_scaler_reads() -> None:
    found = histograms(SCRAPE.read_text(), ROUTER_HISTOGRAMS)
    assert found is not None
    # Three streamed requests, six prefill legs (three streamed and three not).
    assert found[CLIENT_TTFT][math.inf] == 3
    assert found[CLIENT_TPOT][math.inf] == 3
    assert found[PREFILL_LEG][math.inf] == 6


def histogram_text(name: str, labels: str, values: list[float]) -> list[str]:
    lines = [f"# HELP {name} x", f"# TYPE {name} histogram"]
    for bound in (*SMG_BOUNDS, math.inf):
        le = "+Inf" if math.isinf(bound) else f"{bound:g}"
        count = sum(1 for v in values if v <= bound)
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {count}')
    lines.append(f"{name}_sum{{{labels}}} {sum(values)}")
    lines.append(f"{name}_count{{{labels}}} {len(values)}")
    return lines


def scrape(ttft: list[float], tpot: list[float], prefill: list[float]) -> str:
    """An SMG text with these observations since it started (a histogram with none is absent,
    as SMG exports one only once observed)."""
    lines: list[str] = []
    for name, labels, values in (
        (CLIENT_TTFT, LABELS, ttft),
        (CLIENT_TPOT, LABELS, tpot),
        (PREFILL_LEG, PD_LABELS, prefill),
    ):
        if values:
            lines += histogram_text(name, labels, values)
    return "\n".join(lines) + "\n"


def test_streamed_traffic_is_measured_by_the_clients_ttft() -> None:
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([], [], []))
    latency.add("r", 10.0, scrape([0.8] * 10, [0.02] * 10, [0.3] * 10))
    reading = latency.ttft({"r"}, 0.9, 10.0, 30)
    assert reading.value is not None and 0.5 < reading.value <= 1.0
    assert CLIENT_TTFT in reading.source
    tpot = latency.tpot({"r"}, 0.9, 10.0, 30)
    assert tpot.value is not None and 0.01 < tpot.value <= 0.025


def test_unstreamed_traffic_takes_the_prefill_leg_and_leaves_itl_to_the_engines() -> None:
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([0.1], [0.01], [0.1]))
    latency.add("r", 10.0, scrape([0.1, 0.1], [0.01, 0.01], [0.1] + [0.3] * 20))
    reading = latency.ttft({"r"}, 0.9, 10.0, 30)
    assert reading.value is not None and 0.25 < reading.value <= 0.5
    assert PREFILL_LEG in reading.source and "few streamed" in reading.source
    tpot = latency.tpot({"r"}, 0.9, 10.0, 30)
    assert tpot.value is None and "1 of 20 requests streamed" in tpot.source


def test_only_what_the_window_holds_counts() -> None:
    """A slow past is forgotten: the percentile is of the increase over the window."""
    latency = RouterLatency(window=20, min_span=5)
    latency.add("r", 0.0, scrape([5.0] * 50, [], [5.0] * 50))
    latency.add("r", 30.0, scrape([5.0] * 50, [], [5.0] * 50))
    latency.add("r", 50.0, scrape([5.0] * 50 + [0.04] * 10, [], [5.0] * 50 + [0.04] * 10))
    reading = latency.ttft({"r"}, 0.9, 50.0, 30)
    assert reading.value is not None and reading.value <= 0.05


def test_an_idle_window_is_zero_and_a_stale_router_is_missing() -> None:
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([0.2], [0.01], [0.2]))
    latency.add("r", 10.0, scrape([0.2], [0.01], [0.2]))
    assert latency.ttft({"r"}, 0.9, 10.0, 30).value == 0.0
    assert latency.tpot({"r"}, 0.9, 10.0, 30).value == 0.0
    assert latency.ttft({"r"}, 0.9, 100.0, 30).value is None  # last scrape 90 s old
    assert latency.ttft({"r"}, 0.9, 10.0, 30).source == "no request in the window"


def test_a_router_restart_counts_from_zero() -> None:
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([0.1] * 100, [], [0.1] * 100))
    latency.add("r", 10.0, scrape([2.0] * 5, [], [2.0] * 5))  # restarted: 5 slow ones since
    reading = latency.ttft({"r"}, 0.5, 10.0, 30)
    assert reading.value is not None and reading.value > 1.0


def test_routers_behind_a_mesh_are_summed() -> None:
    latency = RouterLatency(window=60, min_span=5)
    for router in ("a", "b"):
        latency.add(router, 0.0, scrape([], [], []))
    latency.add("a", 10.0, scrape([0.04] * 10, [], [0.04] * 10))
    latency.add("b", 10.0, scrape([3.0] * 10, [], [3.0] * 10))
    reading = latency.ttft({"a", "b"}, 0.9, 10.0, 30)
    assert reading.value is not None and reading.value > 2.5  # b's slow half is in the p90
    assert latency.ttft({"a", "b", "c"}, 0.9, 10.0, 30).value is None  # c never scraped


def test_text_that_is_not_prometheus_is_refused() -> None:
    assert not RouterLatency().add("r", 0.0, "<html>502 Bad Gateway</html>\n{")
