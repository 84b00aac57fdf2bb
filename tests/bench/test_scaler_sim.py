"""Smoke test of the scaler simulator (bench/scaler_sim.py) on short traces."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from bench.scaler_sim import ratio, run, sawtooth, simulate, spike, summary_line

SECONDS = 1800
SUMMARY = re.compile(
    r"^bench scaler-sim: ratio (\d+\.\d\d|inf) \(pdctl (\d+) s, baseline (\d+) s, (\d+) hosts\)$"
)


def test_pdctl_reverses_less_on_the_sawtooth() -> None:
    trace = sawtooth(SECONDS)
    pdctl, baseline = simulate(trace, "pdctl"), simulate(trace, "baseline")
    assert pdctl.total_reversals < baseline.total_reversals
    assert pdctl.reversals == {"prefill": 0, "decode": 0}
    assert pdctl.under_capacity < baseline.under_capacity


def test_pdctl_is_not_more_under_capacity_on_the_spike() -> None:
    trace = spike(SECONDS)
    pdctl, baseline = simulate(trace, "pdctl"), simulate(trace, "baseline")
    assert pdctl.under_capacity <= baseline.under_capacity
    assert len(pdctl.series) == SECONDS
    # the spike (15 rps from t=600) needs 5 prefill and 8 decode replicas: pdctl gets close
    peak = max(s[0] for s in pdctl.series), max(s[1] for s in pdctl.series)
    assert peak[0] == 5
    assert peak[1] >= 7


def test_warmup_delays_serving() -> None:
    trace = spike(SECONDS)
    result = simulate(trace, "pdctl", warmup=120.0)
    first_up = next(t for t, s in enumerate(result.series) if s[1] > result.series[0][1])
    assert result.series[first_up][3] == result.series[0][3]  # started, not serving yet
    assert result.series[first_up + 120][3] > result.series[0][3]


def test_ratio_guards_division_by_zero() -> None:
    assert ratio(10, 4) == "2.50"
    assert ratio(0, 0) == "even (both 0)"
    assert ratio(3, 0) == "inf (pdctl 0)"


def test_summary_line_format() -> None:
    assert summary_line(100, 250, 8) == (
        "bench scaler-sim: ratio 2.50 (pdctl 100 s, baseline 250 s, 8 hosts)"
    )
    assert SUMMARY.match(summary_line(0, 5, 8))


def test_run_prints_a_table_ratios_and_the_summary_and_writes_csv(tmp_path: Path) -> None:
    lines: list[str] = []
    results = run(SECONDS, out=tmp_path, emit=lines.append)
    assert set(results) == {"diurnal", "spike", "sawtooth"}
    match = SUMMARY.match(lines[-1])
    assert match is not None
    pdctl_s, baseline_s, hosts = int(match[2]), int(match[3]), int(match[4])
    assert pdctl_s == sum(r["pdctl"].under_capacity for r in results.values())
    assert baseline_s == sum(r["baseline"].under_capacity for r in results.values())
    assert hosts == 8
    assert match[1] == f"{baseline_s / pdctl_s:.2f}"
    assert sum(1 for line in lines if "baseline/pdctl:" in line) == 3
    for name in results:
        rows = list(csv.reader((tmp_path / f"scaler_{name}.csv").open()))
        assert rows[0][:4] == ["time", "rps", "pdctl_prefill", "pdctl_decode"]
        assert "baseline_decode" in rows[0]
        assert len(rows) == SECONDS + 1
