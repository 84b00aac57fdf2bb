"""The per-phase simulation (bench/scaler_phases.py): each group follows its own phase."""

from __future__ import annotations

import csv
import itertools
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
    fewest,
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


def test_the_slo_floor_is_the_fewest_replicas_that_meet_each_target() -> None:
    heavy = Second(rps=6.0, prompt=2000.0, answer=20.0)  # 1.5 prefill replicas of work
    assert fewest(heavy, "prefill") == 4  # 3 would run at 50%: p90 537 ms > 500 ms
    assert fewest(heavy, "decode") == 1
    answers = Second(rps=6.0, prompt=100.0, answer=300.0)  # 4.5 decode replicas of work
    assert (fewest(answers, "prefill"), fewest(answers, "decode")) == (1, 6)
    trace = alternating(SECONDS)
    floor = simulate(trace, "slo-floor")
    assert floor.violations == 0
    # meeting the SLO costs at least 5 replicas in a prompt-heavy phase, 7 in an answer-heavy
    # one: on average what dstack's mean-sized 2 + 4 cost, without any reaction time
    assert 6 * SECONDS <= floor.replica_seconds < 1.02 * 6 * SECONDS
    assert simulate(trace, "dstack-mean").replica_seconds == 6 * SECONDS


def test_per_phase_leaves_a_phase_in_one_step_and_sizes_the_next_from_its_queue() -> None:
    trace = alternating(SECONDS)
    series = simulate(trace, "per-phase").series
    # answer-heavy from PHASE: decode reaches the 6 it needs, not more, within a minute
    decode = [s[1] for s in series[PHASE : 2 * PHASE]]
    assert max(decode) == 6 and decode.index(6) < 60
    # prompt-heavy again from 2 x PHASE: decode leaves in three moves (estimate, stabilised)
    decode = [s[1] for s in series[2 * PHASE : 3 * PHASE]]
    moves = sum(1 for a, b in itertools.pairwise(decode) if b < a)
    assert decode[-1] == 1 and moves <= 3


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(alternating(120), "hpa")


def test_run_prints_the_table_and_writes_csv(tmp_path: Path) -> None:
    lines: list[str] = []
    results = run(1800, out=tmp_path, emit=lines.append)
    assert set(results) == {"alternating", "alternating-ramp"}
    table = [line for line in lines if line.startswith("alternating ")]
    assert [line.split()[1] for line in table[:6]] == [
        "per-phase",
        "rps-mean",
        "dstack-mean",
        "rps-peak",
        "dstack-peak",
        "slo-floor",
    ]
    assert table[6].startswith("alternating       per-phase vs the mean-sized rps policies:")
    assert any("*-mean:     rps per replica for the average mix" in line for line in lines)
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
