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

import argparse
import csv
import importlib
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.scaler_sim import (
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
)
from pdctl.scaler.decide import History, Metric, Observation, Policy, decide

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
POLICIES = ("per-phase", "rps-mean", "dstack-mean", "rps-peak", "dstack-peak")


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


def simulate(trace: Sequence[Second], policy: str, warmup: float = WARMUP) -> Result:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    sizing = None if policy == "per-phase" else policy.split("-")[1]
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
        else:
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


def write_csv(path: Path, trace: Sequence[Second], results: dict[str, Result]) -> None:
    columns = ["time", "rps", "prompt", "answer"]
    for policy in POLICIES:
        columns += [f"{policy}_{c}" for c in ("prefill", "decode", "ttft_p90", "itl_p90")]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for t, s in enumerate(trace):
            row: list[object] = [t, f"{s.rps:.3f}", s.prompt, s.answer]
            for policy in POLICIES:
                p, d, ttft, itl = results[policy].series[t]
                row += [p, d, f"{ttft:.4f}", f"{itl:.4f}"]
            writer.writerow(row)


def write_png(path: Path, name: str, trace: Sequence[Second], results: dict[str, Result]) -> None:
    try:  # optional: skip silently without matplotlib
        importlib.import_module("matplotlib").use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return
    figure, axes = plt.subplots(5, 1, sharex=True, figsize=(10, 11))
    x = range(len(trace))
    axes[0].plot([s.rps for s in trace], linewidth=0.6, color="gray", label="rps")
    heavy = [1 if s.prompt > s.answer else 0 for s in trace]
    axes[0].fill_between(x, 0, [h * 10 for h in heavy], alpha=0.15, label="prompt-heavy")
    axes[0].set_ylabel("rps")
    axes[0].set_title(name)
    axes[0].legend(loc="upper right")
    panels: list[tuple[str, float | None]] = [
        ("prefill replicas", None),
        ("decode replicas", None),
        ("ttft p90 s", TTFT_TARGET),
        ("itl p90 s", ITL_TARGET),
    ]
    for index, (label, target) in enumerate(panels):
        axis = axes[index + 1]
        for policy in POLICIES:
            values = [min(s[index], 10.0) for s in results[policy].series]
            axis.step(x, values, label=policy, linewidth=0.8)
        if target is not None:
            axis.axhline(target, color="red", linewidth=0.6, label="target")
            axis.set_yscale("log")
        axis.set_ylabel(label)
        axis.legend(loc="upper right")
    axes[-1].set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def run(
    seconds: int,
    warmup: float = WARMUP,
    seed: int = 0,
    out: Path | None = OUT,
    emit: Callable[[str], None] = print,
) -> dict[str, dict[str, Result]]:
    emit(
        f"scaler-phases: {seconds} s per trace, phases of {PHASE} s, warm-up {warmup:g} s; "
        f"targets ttft p90 {TTFT_TARGET * 1000:.0f} ms, itl p90 {ITL_TARGET * 1000:.0f} ms; "
        "rps targets per replica (prefill / decode): "
        + ", ".join(f"{k} {v['prefill']:.2f} / {v['decode']:.2f}" for k, v in RPS_TARGETS.items())
    )
    emit(f"{'trace':<17} {'policy':<12} {'SLO-violation s':>16} {'replica-s':>10}")
    results: dict[str, dict[str, Result]] = {}
    for name, trace in traces(seconds, seed).items():
        results[name] = {policy: simulate(trace, policy, warmup) for policy in POLICIES}
        for policy in POLICIES:
            r = results[name][policy]
            emit(f"{name:<17} {policy:<12} {r.violations:>16d} {r.replica_seconds:>10.0f}")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            write_csv(out / f"phases_{name}.csv", trace, results[name])
            write_png(out / f"phases_{name}.png", name, trace, results[name])
    if out is not None:
        emit(f"CSV per trace in {out}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--warmup", type=float, default=WARMUP, help="model load, seconds")
    parser.add_argument("--seconds", type=int, default=7200, help="length of each trace")
    parser.add_argument("--seed", type=int, default=0, help="noise seed")
    parser.add_argument("--out", type=Path, default=OUT, help="where CSVs and PNGs go")
    args = parser.parse_args(argv)
    if args.seconds < 60 or args.warmup < 0:
        parser.error("--seconds must be >= 60 and --warmup >= 0")
    run(args.seconds, args.warmup, args.seed, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
