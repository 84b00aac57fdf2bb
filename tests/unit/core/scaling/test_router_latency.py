"""A gRPC group's latency from its router's histograms, windowed (router_latency.py).

The router text is a real SMG 1.13.0 scrape (tests/data/smg/SOURCES) and texts in its exact
shape.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdctl.core.scaling.observe import histograms
from pdctl.core.scaling.router_latency import (
    CLIENT_TPOT,
    CLIENT_TTFT,
    PREFILL_LEG,
    ROUTER_HISTOGRAMS,
    RouterLatency,
)

SCRAPE = Path(__file__).resolve().parents[3] / "data" / "smg" / "grpc-pd-vllm-metrics.txt"
SMG_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LABELS = 'router_type="grpc",backend_type="pd",model="m",endpoint="chat"'
PD_LABELS = 'backend_type="pd",model="m",runtime="vllm"'


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


def scrape(
    ttft: list[float],
    tpot: list[float],
    prefill: list[float],
    requests: list[float] | None = None,
    output_tokens: float = 0.0,
) -> str:
    """An SMG text with these observations since it started (a histogram with none is absent,
    as SMG exports one only once observed): ``requests`` the whole requests' durations,
    ``output_tokens`` the tokens they produced."""
    lines: list[str] = []
    for name, labels, values in (
        (CLIENT_TTFT, LABELS, ttft),
        (CLIENT_TPOT, LABELS, tpot),
        (PREFILL_LEG, PD_LABELS, prefill),
        ("smg_router_request_duration_seconds", LABELS, requests or []),
    ):
        if values:
            lines += histogram_text(name, labels, values)
    if output_tokens:
        lines += [
            "# HELP smg_router_tokens_total x",
            "# TYPE smg_router_tokens_total counter",
            f'smg_router_tokens_total{{{LABELS},token_type="output"}} {output_tokens}',
            f'smg_router_tokens_total{{{LABELS},token_type="input"}} {output_tokens * 50}',
        ]
    return "\n".join(lines) + "\n"


def test_ttft_is_the_prefill_leg_and_streamed_itl_the_clients_tpot() -> None:
    """The client's TTFT (0.8 s) holds the decode's first token and the KV transfer: the
    prefill group is judged on its own leg (0.3 s), as an HTTP prefill on its worker's own."""
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([], [], []))
    latency.add("r", 10.0, scrape([0.8] * 10, [0.02] * 10, [0.3] * 10))
    reading = latency.ttft({"r"}, 0.9, 10.0, 30)
    assert reading.value is not None and 0.25 < reading.value <= 0.5
    assert reading.source == f"{PREFILL_LEG} (10 requests)"
    tpot = latency.tpot({"r"}, 0.9, 10.0, 30)
    assert tpot.value is not None and 0.01 < tpot.value <= 0.025
    assert CLIENT_TPOT in tpot.source


def test_a_router_without_the_prefill_leg_gives_the_clients_ttft() -> None:
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([], [], []))
    latency.add("r", 10.0, scrape([0.8] * 10, [], []))
    reading = latency.ttft({"r"}, 0.9, 10.0, 30)
    assert reading.value is not None and 0.5 < reading.value <= 1.0
    assert CLIENT_TTFT in reading.source


def test_unstreamed_traffic_takes_the_prefill_leg_and_the_routers_mean_per_token() -> None:
    """Few streamed requests: ttft is the prefill leg's p90; itl is what the requests spent
    after their prefill leg over the tokens they produced, in the window."""
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([0.1], [0.01], [0.1], [1.0], output_tokens=100))
    latency.add(
        "r",
        10.0,
        # 20 more requests: prefill legs of 0.3 s, 2.3 s in all, 100 tokens each
        scrape([0.1, 0.1], [0.01, 0.01], [0.1] + [0.3] * 20, [1.0] + [2.3] * 20, 2100),
    )
    reading = latency.ttft({"r"}, 0.9, 10.0, 30)
    assert reading.value is not None and 0.25 < reading.value <= 0.5
    assert PREFILL_LEG in reading.source
    tpot = latency.tpot({"r"}, 0.9, 10.0, 30)
    assert tpot.value == pytest.approx(20 * 2.0 / 2000)  # 40 s of decoding over 2000 tokens
    assert "mean seconds per output token" in tpot.source
    assert "1 of 20 requests streamed" in tpot.source


def test_a_backlog_of_streams_is_judged_on_the_streams_that_ended() -> None:
    """Streams pile up on decode: few end in the window, so fewer than half the prefill legs
    have a TPOT, and what the requests spent after their prefill leg says about nothing
    (0.1 s each over 20 legs). The streams that did end say 0.2 s per token: that stands."""
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([], [], []))
    latency.add("r", 10.0, scrape([0.1] * 3, [0.2] * 3, [0.1] * 20, [0.2] * 20, 600))
    tpot = latency.tpot({"r"}, 0.9, 10.0, 30)
    assert tpot.value is not None and 0.1 < tpot.value <= 0.25
    assert tpot.source == f"{CLIENT_TPOT} (3 of 20 streamed)"


def test_no_token_counted_is_missing_data_for_the_mean() -> None:
    latency = RouterLatency(window=60, min_span=5)
    latency.add("r", 0.0, scrape([], [], []))
    latency.add("r", 10.0, scrape([], [], [0.3] * 5, [1.0] * 5))
    tpot = latency.tpot({"r"}, 0.9, 10.0, 30)
    assert tpot.value is None and "no output token" in tpot.source


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
