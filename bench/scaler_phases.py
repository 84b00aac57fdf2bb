"""Per-phase scaling versus RPS scaling, on traces whose prompt/answer mix alternates.

    python bench/scaler_phases.py [--warmup SECONDS] [--seconds N] [--seed S]

Every request passes through both groups, so the router's rps moves prefill and decode
together; what each group must do per request does not: a long prompt is prefill work, a
long answer decode work. The traces alternate prompt-heavy phases (2,000-token prompts,
20-token answers) with answer-heavy ones (100-token prompts, 300-token answers), at a steady
rate ("alternating") and under a rate that rises and falls ("alternating-ramp").

The simulated capacity is the lab worker's (issue 17): a prefill replica processes 8,000
prompt tokens/s, a decode replica 400 generated tokens/s shared by its streams with a floor
of 10 ms per token. Per group and second, with s the service time of one request (prompt /
8,000 s for prefill, the 10 ms floor for decode) and u the utilisation of the serving
replicas, the p90 latency is ``s x (1 + 2.3 x u' / (2 (1 - u')))`` with u' = min(u, 0.95)
(a queue's wait, mean ``s u / 2(1-u)``, with an exponential tail: p90 = 2.3 x mean),
plus the time to drain the work left over from earlier seconds (a fluid backlog that grows
while demand exceeds capacity). TTFT is prefill's latency, ITL decode's.

Policies (both groups 1..8, a started replica serves after ``--warmup`` s):

- per-phase: pdctl's ``decide()`` with ``metric: ttft`` (target 500 ms) on prefill and
  ``metric: itl`` (target 50 ms) on decode, fed the p90 averaged over the last 30 s and the
  queued requests per replica; delays as scaler_sim's pdctl.
- rps: pdctl's ``decide()`` on the router's rps, each group's target sized for the
  average mix at 70% utilisation (what an operator who knows the mean would write).
- dstack: dstack's RPS autoscaler (scaler_sim.Baseline) with the same targets.

Reported per trace and policy: SLO-violation seconds (seconds a group's p90 exceeds its
target, summed over groups) and replica-seconds (loading replicas included). CSV and PNG
per trace under bench/out/.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.simkit import (
    MAX_REPLICAS,
    MIN_REPLICAS,
    OUT,
    PDCTL_DOWN,
    PDCTL_STABILIZATION,
    PDCTL_UP,
    PDCTL_WINDOW,
    WARMUP,
    Baseline,
    Group,
    Panel,
    parse,
    parser,
    save,
)
from pdctl.core.scaling.decide import History, Metric, Observation, Policy, decide

PREFILL_TOKENS_PER_S = 8000.0
DECODE_TOKENS_PER_S = 400.0
ITL_FLOOR = 0.010
TTFT_TARGET, ITL_TARGET = 0.5, 0.05
PROMPT_HEAVY = (2000.0, 20.0)  # (prompt tokens, answer tokens) per request
ANSWER_HEAVY = (100.0, 300.0)
PHASE = 900  # seconds per phase
UTILISATION = 0.7  # what the mean-sized rps targets allow
MEAN_PROMPT = (PROMPT_HEAVY[0] + ANSWER_HEAVY[0]) / 2
MEAN_ANSWER = (PROMPT_HEAVY[1] + ANSWER_HEAVY[1]) / 2
LATENCY: dict[str, tuple[Metric, float]] = {
    "prefill": ("ttft", TTFT_TARGET),
    "decode": ("itl", ITL_TARGET),
}
GROUPS = ("prefill", "decode")
POLICIES = ("per-phase", "rps-mean", "dstack-mean", "rps-peak", "dstack-peak", "slo-floor")


def _peak_utilisation(service: float, target: float) -> float:
    """The utilisation at which p90() reaches ``target`` (p90(service, u, 0) == target)."""
    k = target / service - 1
    return min(0.95, k / (1.15 + k))


# An rps target per replica is one number for every mix. "mean": sized for the average mix at
# 70% utilisation; "peak": for the heavier mix at the utilisation that just meets the latency
# target (no violation in steady state, at the price of idle replicas in the other phase).
RPS_TARGETS = {
    "mean": {
        "prefill": UTILISATION * PREFILL_TOKENS_PER_S / MEAN_PROMPT,
        "decode": UTILISATION * DECODE_TOKENS_PER_S / MEAN_ANSWER,
    },
    "peak": {
        "prefill": _peak_utilisation(PROMPT_HEAVY[0] / PREFILL_TOKENS_PER_S, TTFT_TARGET)
        * PREFILL_TOKENS_PER_S
        / PROMPT_HEAVY[0],
        "decode": _peak_utilisation(ITL_FLOOR, ITL_TARGET) * DECODE_TOKENS_PER_S / ANSWER_HEAVY[1],
    },
}


# -- traces ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Second:
    rps: float
    prompt: float  # tokens per request
    answer: float


def alternating(seconds: int, seed: int = 0, rps: float = 6.0) -> list[Second]:
    """Steady rps; the mix flips between prompt-heavy and answer-heavy every PHASE s."""
    rng = random.Random(seed + 10)
    out = []
    for t in range(seconds):
        prompt, answer = PROMPT_HEAVY if (t // PHASE) % 2 == 0 else ANSWER_HEAVY
        out.append(Second(max(0.0, rps * (1 + rng.gauss(0.0, 0.05))), prompt, answer))
    return out


def alternating_ramp(seconds: int, seed: int = 0) -> list[Second]:
    """The same flips under a rate that rises from 2 to 8 rps and back over the trace."""
    rng = random.Random(seed + 11)
    out = []
    for t in range(seconds):
        prompt, answer = PROMPT_HEAVY if (t // PHASE) % 2 == 0 else ANSWER_HEAVY
        base = 5.0 - 3.0 * math.cos(2 * math.pi * t / seconds)
        out.append(Second(max(0.0, base * (1 + rng.gauss(0.0, 0.05))), prompt, answer))
    return out


def traces(seconds: int, seed: int = 0) -> dict[str, list[Second]]:
    return {
        "alternating": alternating(seconds, seed),
        "alternating-ramp": alternating_ramp(seconds, seed),
    }


# -- the simulated workers ------------------------------------------------------------------------


def p90(service: float, utilisation: float, backlog: float) -> float:
    """The p90 latency (s) of one request's phase: service time, a queue's wait, the drain
    of the work left over (``backlog`` seconds)."""
    u = min(max(utilisation, 0.0), 0.95)
    return service * (1 + 2.3 * u / (2 * (1 - u))) + backlog


@dataclass
class Phase:
    """One group's load model: demand in tokens per second against its serving capacity."""

    name: str
    backlog: float = 0.0  # tokens of work left over from earlier seconds

    def step(self, second: Second, serving: int) -> tuple[float, float]:
        """(p90 latency in s, queued requests per serving replica) for this second."""
        per_replica = PREFILL_TOKENS_PER_S if self.name == "prefill" else DECODE_TOKENS_PER_S
        tokens = second.prompt if self.name == "prefill" else second.answer
        demand = second.rps * tokens
        capacity = serving * per_replica
        self.backlog = max(0.0, self.backlog + demand - capacity)
        if serving == 0:
            return math.inf, math.inf
        utilisation = demand / capacity
        drain = self.backlog / capacity
        if self.name == "prefill":
            latency = p90(tokens / PREFILL_TOKENS_PER_S, utilisation, drain)
        else:  # the wait to drain spreads over the answer's tokens
            latency = p90(ITL_FLOOR, utilisation, drain / max(tokens, 1.0))
        queued = self.backlog / max(tokens, 1.0) / serving
        return latency, queued


# -- policies -------------------------------------------------------------------------------------


def _policy(group: str, sizing: str | None) -> Policy:
    latency = sizing is None
    return Policy(
        group=group,
        min=MIN_REPLICAS,
        max=MAX_REPLICAS,
        target=LATENCY[group][1] if sizing is None else RPS_TARGETS[sizing][group],
        metric=LATENCY[group][0] if latency else "rps",
        scale_up_delay=PDCTL_UP,
        scale_down_delay=PDCTL_DOWN,
        stabilization=PDCTL_STABILIZATION,
    )


class Decide:
    """pdctl's decide() per group, on latency (sizing None) or on rps sized one way."""

    def __init__(self, sizing: str | None, warmup: float) -> None:
        self.warmup = warmup
        self.policies = {g: _policy(g, sizing) for g in GROUPS}
        self.histories = {g: History() for g in GROUPS}

    def step(
        self,
        now: float,
        rps: float,
        seen: dict[str, tuple[float, float]],
        groups: dict[str, Group],
    ) -> None:
        for name, group in groups.items():
            latency, queued = seen[name]
            observation = Observation(
                at=now,
                rps=rps,
                running=group.replicas,
                serving=group.serving(now),
                latency=latency if math.isfinite(latency) else None,
                queue_per_replica=queued if math.isfinite(queued) else None,
            )
            decision, self.histories[name] = decide(
                self.policies[name], observation, self.histories[name], now
            )
            group.scale_to(decision.desired, now, self.warmup)


@dataclass
class Result:
    violations: int = 0  # seconds, summed over groups
    replica_seconds: float = 0.0
    # per second: prefill and decode replicas, their p90 latencies
    series: list[tuple[int, int, float, float]] = field(default_factory=list)


def _fleet(first: Second, sizing: str) -> dict[str, Group]:
    """Each group starts at what the first second's mix needs at 70% utilisation."""
    groups = {}
    for name in GROUPS:
        tokens = first.prompt if name == "prefill" else first.answer
        per = PREFILL_TOKENS_PER_S if name == "prefill" else DECODE_TOKENS_PER_S
        need = math.ceil(first.rps * tokens / (UTILISATION * per))
        count = max(MIN_REPLICAS, min(MAX_REPLICAS, need))
        groups[name] = Group(name, RPS_TARGETS[sizing][name], ready_at=[-math.inf] * count)
    return groups


def fewest(second: Second, group: str) -> int:
    """The fewest replicas whose p90 meets the group's target at this second's rate and mix
    with nothing left over (the max when none does)."""
    for count in range(MIN_REPLICAS, MAX_REPLICAS + 1):
        latency, _ = Phase(group).step(second, count)
        if latency <= LATENCY[group][1]:
            return count
    return MAX_REPLICAS


def simulate(trace: Sequence[Second], policy: str, warmup: float = WARMUP) -> Result:
    """One policy on one trace. ``slo-floor`` is no policy but a bound: each second, the
    fewest replicas that meet both targets, serving at once (no load, no reaction time)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    sizing = None if policy in {"per-phase", "slo-floor"} else policy.split("-")[1]
    groups = _fleet(trace[0], sizing or "mean")
    phases = {name: Phase(name) for name in GROUPS}
    recent: dict[str, list[float]] = {name: [] for name in GROUPS}
    deciding = Decide(sizing, warmup)
    dstack = Baseline(warmup)
    rps_trace = [s.rps for s in trace]
    result = Result()
    for t, second in enumerate(trace):
        now = float(t)
        seen: dict[str, tuple[float, float]] = {}
        if policy == "slo-floor":
            for name, group in groups.items():
                group.ready_at = [-math.inf] * fewest(second, name)
        for name in GROUPS:
            latency, queued = phases[name].step(second, groups[name].serving(now))
            window = recent[name]
            window.append(latency)
            del window[:-PDCTL_WINDOW]
            seen[name] = (sum(window) / len(window), queued)
            if latency > LATENCY[name][1]:
                result.violations += 1
        if policy.startswith("dstack"):
            dstack.step(now, rps_trace, t, groups)
        elif policy != "slo-floor":
            rate = sum(rps_trace[max(0, t - PDCTL_WINDOW + 1) : t + 1]) / min(t + 1, PDCTL_WINDOW)
            deciding.step(now, rate, seen, groups)
        result.replica_seconds += sum(g.replicas for g in groups.values())
        result.series.append(
            (
                groups["prefill"].replicas,
                groups["decode"].replicas,
                recent["prefill"][-1],
                recent["decode"][-1],
            )
        )
    return result


# -- report ---------------------------------------------------------------------------------------


def write(out: Path, name: str, trace: Sequence[Second], results: dict[str, Result]) -> None:
    header = ["time", "rps", "prompt", "answer"]
    for policy in POLICIES:
        header += [f"{policy}_{c}" for c in ("prefill", "decode", "ttft_p90", "itl_p90")]
    rows: list[list[object]] = []
    for t, s in enumerate(trace):
        row: list[object] = [t, f"{s.rps:.3f}", s.prompt, s.answer]
        for policy in POLICIES:
            p, d, ttft, itl = results[policy].series[t]
            row += [p, d, f"{ttft:.4f}", f"{itl:.4f}"]
        rows.append(row)
    heavy = [1.0 if s.prompt > s.answer else 0.0 for s in trace]
    rate = {"rps": [s.rps for s in trace]}
    panels = [Panel("rps (shaded: prompt-heavy)", rate, steps=False, shade=heavy)]
    titles: list[tuple[str, float | None]] = [
        ("prefill replicas", None),
        ("decode replicas", None),
        ("ttft p90 s", TTFT_TARGET),
        ("itl p90 s", ITL_TARGET),
    ]
    for index, (label, target) in enumerate(titles):
        lines = {p: [min(s[index], 10.0) for s in results[p].series] for p in POLICIES}
        panels.append(Panel(label, lines, target))
    save(out, f"phases_{name}", header, rows, name, panels)


def _legend(seconds: int, warmup: float) -> list[str]:
    mean, peak = RPS_TARGETS["mean"], RPS_TARGETS["peak"]
    delays = (
        f"scale_up_delay {PDCTL_UP:g} s, scale_down_delay {PDCTL_DOWN:g} s, "
        f"stabilization {PDCTL_STABILIZATION:g} s"
    )
    return [
        f"scaler-phases: {seconds} s per trace, phases of {PHASE} s, model load {warmup:g} s "
        f"for every policy, groups {MIN_REPLICAS}..{MAX_REPLICAS}; targets ttft p90 "
        f"{TTFT_TARGET * 1000:.0f} ms, itl p90 {ITL_TARGET * 1000:.0f} ms",
        f"  per-phase:  pdctl decide() on ttft (prefill) and itl (decode), p90 over "
        f"{PDCTL_WINDOW} s and the queue per replica; {delays}",
        f"  rps-*:      pdctl decide() on the router's rps over {PDCTL_WINDOW} s, the same delays",
        "  dstack-*:   dstack's rps policy (rps over 60 s, up 300 s / down 600 s after the last "
        "scaling of any group)",
        f"  *-mean:     rps per replica for the average mix ({MEAN_PROMPT:.0f}-token prompts, "
        f"{MEAN_ANSWER:.0f}-token answers) at {UTILISATION:.0%} utilisation: prefill "
        f"{mean['prefill']:.2f}, decode {mean['decode']:.2f}",
        f"  *-peak:     for the heavier mix at the utilisation that just meets the target: "
        f"prefill {peak['prefill']:.2f}, decode {peak['decode']:.2f}",
        "  slo-floor:  no policy: each second the fewest replicas meeting both targets, serving "
        "at once (no load): what meeting the SLO costs at least",
    ]


def _verdict(name: str, results: dict[str, Result]) -> str:
    ours, dstack, floor = results["per-phase"], results["dstack-mean"], results["slo-floor"]
    rps = results["rps-mean"]
    fewer = ours.violations < min(dstack.violations, rps.violations)
    cost = ours.replica_seconds / dstack.replica_seconds - 1
    bound = floor.replica_seconds / dstack.replica_seconds - 1
    return (
        f"{name:<17} per-phase vs the mean-sized rps policies: SLO-violation s "
        f"{'fewer' if fewer else 'NOT fewer'} ({ours.violations} vs {rps.violations} pdctl, "
        f"{dstack.violations} dstack); replica-s {cost:+.1%} vs dstack's (slo-floor {bound:+.1%})"
    )


def run(
    seconds: int,
    warmup: float = WARMUP,
    seed: int = 0,
    out: Path | None = OUT,
    emit: Callable[[str], None] = print,
) -> dict[str, dict[str, Result]]:
    for line in _legend(seconds, warmup):
        emit(line)
    emit(f"{'trace':<17} {'policy':<12} {'SLO-violation s':>16} {'replica-s':>10}")
    results: dict[str, dict[str, Result]] = {}
    for name, trace in traces(seconds, seed).items():
        results[name] = {policy: simulate(trace, policy, warmup) for policy in POLICIES}
        for policy in POLICIES:
            r = results[name][policy]
            emit(f"{name:<17} {policy:<12} {r.violations:>16d} {r.replica_seconds:>10.0f}")
        emit(_verdict(name, results[name]))
        if out is not None:
            write(out, name, trace, results[name])
    if out is not None:
        emit(f"CSV per trace in {out}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(parser(__doc__), argv)
    run(args.seconds, args.warmup, args.seed, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
