"""The RPS signal: a counter's rate over a window, through resets and gaps."""

from __future__ import annotations

import pytest

from pdctl.scaler.observe import CounterRate


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
