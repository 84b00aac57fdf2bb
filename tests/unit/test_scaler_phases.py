"""The per-phase simulation (bench/scaler_phases.py): each group follows its own phase."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from bench.scaler_phases import (
    ANSWER_HEAVY,
    ITL_FLOOR,
    ITL_TARGET,
    PHASE,
    PREFILL_TOKENS_PER_S,
    PROMPT_HEAVY,
    RPS_TARGETS,
    TTFT_TARGET,
    Phase,
    Second,
    _peak_utilisation,
    alternating,
    p90,
    run,
    simulate,
)

SECONDS = 4 * PHASE  # prompt-heavy, answer-heavy, prompt-heavy, answer-heavy


def test_latency_model() -> None:
    assert p90(0.25, 0.0, 0.0) == pytest.approx(0.25)  # idle: the service time
    assert p90(0.25, 0.5, 0.0) == pytest.approx(0.25 * (1 + 2.3 * 0.5 / 1.0))
    assert p90(0.25, 5.0, 2.0) == pytest.approx(0.25 * (1 + 2.3 * 0.95 / 0.1) + 2.0)
    prompt = PROMPT_HEAVY[0] / PREFILL_TOKENS_PER_S
    u = _peak_utilisation(prompt, TTFT_TARGET)
    assert p90(prompt, u, 0.0) == pytest.approx(TTFT_TARGET)
    assert p90(ITL_FLOOR, _peak_utilisation(ITL_FLOOR, ITL_TARGET), 0.0) == pytest.approx(
        ITL_TARGET
    )


def test_overload_builds_a_backlog_that_drains() -> None:
    phase = Phase("prefill")
    heavy = Second(rps=8.0, prompt=2000.0, answer=20.0)  # 16,000 tokens/s on one replica
    for _ in range(10):
        latency, queued = phase.step(heavy, 1)
    assert phase.backlog == pytest.approx(80_000)
    assert latency > 10 and queued == pytest.approx(40.0)
    latency, _ = phase.step(heavy, 4)  # 32,000 tokens/s: 16,000 of the backlog drained
    assert phase.backlog == pytest.approx(64_000)


def test_the_trace_alternates_the_mix_at_a_steady_rate() -> None:
    trace = alternating(SECONDS)
    assert (trace[0].prompt, trace[0].answer) == PROMPT_HEAVY
    assert (trace[PHASE].prompt, trace[PHASE].answer) == ANSWER_HEAVY
    assert 5.0 < sum(s.rps for s in trace) / len(trace) < 7.0


def test_per_phase_moves_the_groups_apart_while_rps_moves_neither() -> None:
    trace = alternating(SECONDS)
    phases = simulate(trace, "per-phase")
    end_prompt_heavy, end_answer_heavy = phases.series[PHASE - 1], phases.series[2 * PHASE - 1]
    assert end_prompt_heavy[0] >= 3 and end_prompt_heavy[1] == 1  # prefill up, decode at min
    assert end_answer_heavy[1] >= 5 and end_answer_heavy[0] == 1  # and the other way round
    assert end_prompt_heavy[2] < TTFT_TARGET and end_answer_heavy[3] < ITL_TARGET
    rps = simulate(trace, "rps-mean")
    settled = {s[:2] for s in rps.series[300:]}  # the rate does not change: neither do they
    assert len(settled) == 1


def test_per_phase_beats_each_rps_sizing_on_its_weak_side() -> None:
    trace = alternating(SECONDS)
    results = {p: simulate(trace, p) for p in ("per-phase", "rps-mean", "dstack-mean")}
    results |= {p: simulate(trace, p) for p in ("rps-peak", "dstack-peak")}
    ours = results["per-phase"]
    # sized for the mean mix, rps policies violate the SLO through every heavy phase
    assert ours.violations < 0.7 * results["rps-mean"].violations
    assert ours.violations < 0.7 * results["dstack-mean"].violations
    # sized for the peak, they meet it by keeping idle replicas through the other phase
    assert ours.replica_seconds < 0.9 * results["rps-peak"].replica_seconds
    assert ours.replica_seconds < 0.9 * results["dstack-peak"].replica_seconds
    assert RPS_TARGETS["peak"]["decode"] < RPS_TARGETS["mean"]["decode"]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(alternating(120), "hpa")


def test_run_prints_the_table_and_writes_csv(tmp_path: Path) -> None:
    lines: list[str] = []
    results = run(1800, out=tmp_path, emit=lines.append)
    assert set(results) == {"alternating", "alternating-ramp"}
    assert sum(1 for line in lines if line.startswith("alternating ")) == 5
    rows = list(csv.reader((tmp_path / "phases_alternating.csv").open()))
    assert rows[0][:6] == [
        "time",
        "rps",
        "prompt",
        "answer",
        "per-phase_prefill",
        "per-phase_decode",
    ]
    assert len(rows) == 1801
