"""The two-service budget simulation (bench/scaler_budget.py) on a short trace."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from bench.scaler_budget import BUDGET, GPUS_PER_REPLICA, run, simulate, traces

SECONDS = 1200
SUMMARY = re.compile(
    r"^bench scaler-budget: ratio (\d+\.\d\d|inf) \(over budget: pdctl (\d+) GPU-s, "
    r"baseline (\d+) GPU-s; worst-lag pdctl (\d+), first-come (\d+)\)$"
)


def test_the_ledger_keeps_both_services_within_the_budget() -> None:
    trace = traces(SECONDS)
    pdctl = simulate(trace, "pdctl")
    assert pdctl.over_budget == 0
    assert max(row[-1] for row in pdctl.series) == BUDGET  # it used all of it at the peaks
    assert pdctl.refusals > 0
    # both services grew at their peaks: the budget was shared, not taken by one
    start = pdctl.series[0]
    peak = pdctl.series[SECONDS // 2]
    assert sum(peak[:2]) > sum(start[:2]) and sum(peak[2:4]) > sum(start[2:4])


def test_scalers_that_do_not_know_of_each_other_overrun_it() -> None:
    alone = simulate(traces(SECONDS), "independent")
    assert alone.over_budget > 0 and alone.refusals == 0
    assert max(row[-1] for row in alone.series) > BUDGET
    assert all(row[-1] % GPUS_PER_REPLICA == 0 for row in alone.series)


def test_run_prints_the_table_and_summary_and_writes_csv(tmp_path: Path) -> None:
    lines: list[str] = []
    results = run(SECONDS, out=tmp_path, emit=lines.append)
    match = SUMMARY.match(lines[-1])
    assert match is not None, lines[-1]
    assert int(match[2]) == 0 and int(match[3]) == round(results["independent"].over_budget)
    rows = list(csv.reader((tmp_path / "scaler_budget.csv").open()))
    assert rows[0][:3] == ["time", "batch_rps", "chat_rps"]
    assert "pdctl_gpus" in rows[0] and "independent_gpus" in rows[0]
    assert len(rows) == SECONDS + 1
