"""The RPS signal: a counter's rate over a window, through resets and gaps."""

from __future__ import annotations

import math

import pytest

from pdctl.core.scaling.observe import (
    LATENCY_HISTOGRAMS,
    QUEUE_GAUGES,
    RUNNING_GAUGES,
    CounterRate,
    LatencyWindow,
    gauge,
    histogram,
    quantile,
)


def test_steady_rate() -> None:
    rate = CounterRate(window=60)
    for t in range(0, 121, 5):
        rate.add(float(t), 4.0 * t)
    assert rate.rate(120.0, stale_after=30) == pytest.approx(4.0)


def test_counter_reset_counts_from_zero() -> None:
    rate = CounterRate(window=60)
    for t, total in [(0, 1000), (10, 1020), (20, 1040), (30, 10), (40, 30), (50, 50), (60, 70)]:
        rate.add(float(t), float(total))
    # 20+20 before the reset, 10 across it (restarted from 0), then 20+20+20: 110 in 60 s
    assert rate.rate(60.0, stale_after=30) == pytest.approx(110 / 60)


def test_scrape_gap_uses_the_time_actually_covered() -> None:
    rate = CounterRate(window=60)
    rate.add(0.0, 0.0)
    rate.add(50.0, 100.0)  # 50 s gap
    assert rate.rate(50.0, stale_after=30) == pytest.approx(2.0)


def test_too_little_data_or_stale_is_missing() -> None:
    rate = CounterRate(window=60, min_span=5)
    assert rate.rate(0.0, stale_after=30) is None
    rate.add(0.0, 0.0)
    rate.add(2.0, 10.0)
    assert rate.rate(2.0, stale_after=30) is None  # 2 s of data: noise
    rate.add(10.0, 50.0)
    assert rate.rate(10.0, stale_after=30) == pytest.approx(5.0)
    assert rate.rate(100.0, stale_after=30) is None  # no sample for 90 s: stale


def test_window_slides_and_keeps_an_anchor() -> None:
    rate = CounterRate(window=30)
    for t in range(0, 61, 10):
        rate.add(float(t), 10.0 * t if t <= 30 else 300.0 + (t - 30))  # 10/s then 1/s
    assert rate.rate(60.0, stale_after=30) == pytest.approx(1.0)
    assert len(rate.samples) <= 5


# -- the workers' latency histograms (SGLang's text format) --------------------------------------

BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def sglang_text(ttft: list[float], queue: int = 0, running: int = 0, model: str = "m") -> str:
    """What an SGLang worker answers on /metrics, for these TTFT observations."""
    name = "sglang:time_to_first_token_seconds"
    label = f'model_name="{model}"'
    lines = [
        f"# HELP {name} Histogram of time to first token in seconds.",
        f"# TYPE {name} histogram",
    ]
    for le in BOUNDS:
        count = sum(1 for v in ttft if v <= le)
        lines.append(f'{name}_bucket{{{label},le="{le}"}} {float(count)}')
    lines += [
        f'{name}_bucket{{{label},le="+Inf"}} {float(len(ttft))}',
        f"{name}_sum{{{label}}} {sum(ttft)}",
        f"{name}_count{{{label}}} {float(len(ttft))}",
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
        "# TYPE sglang:num_queue_reqs gauge",
        f"sglang:num_queue_reqs{{{label}}} {float(queue)}",
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs{{{label}}} {float(running)}",
    ]
    return "\n".join(lines) + "\n"


TTFT = LATENCY_HISTOGRAMS["ttft"]


def test_histogram_and_gauges_parse_sglang_text() -> None:
    text = sglang_text([0.2, 0.3, 0.7], queue=4, running=2)
    buckets = histogram(text, TTFT)
    assert buckets is not None
    assert buckets[0.25] == 1 and buckets[0.5] == 2 and buckets[1.0] == 3 and buckets[math.inf] == 3
    assert gauge(text, QUEUE_GAUGES) == 4 and gauge(text, RUNNING_GAUGES) == 2
    assert histogram(text, LATENCY_HISTOGRAMS["itl"]) is None  # a prefill worker has no ITL
    assert histogram("not prometheus {{{", TTFT) is None
    assert gauge("", QUEUE_GAUGES) is None


def test_histogram_sums_label_sets() -> None:
    name = "sglang:time_to_first_token_seconds"
    text = f"# TYPE {name} histogram\n" + "".join(
        f'{name}_bucket{{model_name="{m}",le="{le}"}} {n}\n'
        for m, n in (("a", 1.0), ("b", 2.0))
        for le in ("0.5", "+Inf")
    )
    assert histogram(text, TTFT) == {0.5: 3.0, math.inf: 3.0}


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 0.0, 0.5: 10.0, 1.0: 20.0, math.inf: 20.0}
    assert quantile(0.5, buckets) == pytest.approx(0.5)
    assert quantile(0.9, buckets) == pytest.approx(0.5 + 0.5 * 8 / 10)
    assert quantile(0.25, buckets) == pytest.approx(0.1 + 0.4 * 5 / 10)
    assert quantile(0.9, {1.0: 1.0, math.inf: 10.0}) == 1.0  # in +Inf: the highest bound
    assert quantile(0.9, {1.0: 0.0, math.inf: 0.0}) is None
    assert quantile(0.9, {1.0: 3.0}) is None  # cut short: no +Inf


def scrape(window: LatencyWindow, replica: str, at: float, ttft: list[float]) -> None:
    buckets = histogram(sglang_text(ttft), TTFT)
    assert buckets is not None
    window.add(replica, at, buckets)


def test_window_percentile_from_deltas_summed_over_replicas() -> None:
    window = LatencyWindow(window=60)
    old = [5.0] * 100  # slow requests before the window: must not count
    scrape(window, "a", 0.0, old)
    scrape(window, "b", 0.0, [])
    scrape(window, "a", 70.0, old)
    scrape(window, "b", 70.0, [])
    scrape(window, "a", 100.0, [*old, *[0.3] * 9])
    scrape(window, "b", 100.0, [0.3] * 9 + [0.7] * 2)
    # in the window: 18 at 0.3 s and 2 at 0.7 s; p90 = rank 18 of 20, in (0.25, 0.5]
    p90 = window.percentile({"a", "b"}, 0.9, now=100.0, stale_after=30)
    assert p90 == pytest.approx(0.25 + 0.25 * 18 / 18)
    p99 = window.percentile({"a", "b"}, 0.99, now=100.0, stale_after=30)
    assert p99 is not None and 0.5 < p99 <= 1.0


def test_window_handles_a_worker_restart() -> None:
    window = LatencyWindow(window=60)
    scrape(window, "a", 0.0, [0.2] * 50)
    scrape(window, "a", 10.0, [0.2] * 60)  # +10 at 0.2 s
    scrape(window, "a", 20.0, [2.0] * 5)  # restarted: 5 new observations at 2 s
    buckets = window.observed({"a"}, now=20.0, stale_after=30)
    assert buckets is not None and buckets[math.inf] == 15 and buckets[0.25] == 10


def test_window_idle_missing_and_stale() -> None:
    window = LatencyWindow(window=60, min_span=5)
    scrape(window, "a", 0.0, [0.2])
    assert window.percentile({"a"}, 0.9, now=0.0, stale_after=30) is None  # one scrape
    scrape(window, "a", 10.0, [0.2])
    assert window.percentile({"a"}, 0.9, now=10.0, stale_after=30) == 0.0  # idle
    assert window.percentile({"a", "b"}, 0.9, now=10.0, stale_after=30) is None  # b unscraped
    assert window.percentile({"a"}, 0.9, now=100.0, stale_after=30) is None  # stale
    window.forget({"b"})
    assert window.series == {}
