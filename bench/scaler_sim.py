"""Replay RPS traces through pdctl's scaling policy and through dstack's, on a simulated fleet.

    python bench/scaler_sim.py [--warmup SECONDS] [--seconds N] [--seed S]

Second by second, for each trace, both policies drive two groups (prefill: 3 rps per replica,
decode: 2 rps per replica, both 1..8) on 8 hosts (8 GPUs each, 4 GPUs per replica: 16 slots,
so both groups at max fit). A started replica serves only after ``--warmup`` seconds (model
load); a removed replica stops at once. Every request goes through both groups, so both see
the same rps.

- pdctl: ``decide()`` every second with the rate over the last 30 s (the scaler's
  ``rps_window``); scale_up_delay 30 s, scale_down_delay 120 s, stabilization 120 s,
  tolerance 10%, steps +2/-1, each group with its own History.
- baseline: dstack's RPS autoscaler as docs/facts.md (Autoscaling) states it: rps
  averaged over 60 s, desired = ceil(rps / target) clipped to [min, max], scale up 5 min and
  down 10 min after the LAST scaling event, one cooldown shared by all groups, no tolerance,
  no step limit.

Both count a replica that is still loading as a replica (dstack counts provisioning replicas;
pdctl's ``running`` counts active units). Before t=0 the load is taken to be the trace's first
value and each group starts at the replica count that load needs, all serving.

Metrics per trace and policy: replica-seconds (GPU cost, loading replicas included), seconds
with demand above serving capacity (summed over groups: rps > serving replicas x target), and
direction reversals (per group, an up after a down or a down after an up). CSVs (and PNGs when
matplotlib is importable) go to bench/out/.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.simkit import (
    BASELINE_DOWN,
    BASELINE_UP,
    BASELINE_WINDOW,
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
    average,
    parse,
    parser,
    save,
)
from pdctl.core.scaling.decide import History, Observation, Policy, decide

HOSTS = 8
GPUS_PER_HOST = 8
GPUS_PER_REPLICA = 4
TARGETS = {"prefill": 3.0, "decode": 2.0}
POLICIES = ("pdctl", "baseline")


# -- traces -------------------------------------------------------------------------------------


def _noisy(values: list[float], seed: int, noise: float) -> list[float]:
    rng = random.Random(seed)
    return [max(0.0, v * (1.0 + rng.gauss(0.0, noise))) for v in values]


def diurnal(seconds: int, seed: int = 0, noise: float = 0.05) -> list[float]:
    """A day compressed into ``seconds``: 1 rps at night, 15 rps at the afternoon peak."""
    base = [8.0 - 7.0 * math.cos(2 * math.pi * t / seconds) for t in range(seconds)]
    return _noisy(base, seed, noise)


def spike(seconds: int, seed: int = 0, noise: float = 0.05) -> list[float]:
    """Steady 2 rps, then 15 rps for 10 min (a quarter of the trace if shorter), then back."""
    start, length = seconds // 3, min(600, seconds // 4)
    base = [15.0 if start <= t < start + length else 2.0 for t in range(seconds)]
    return _noisy(base, seed + 1, noise)


def sawtooth(seconds: int, seed: int = 0, amplitude: float = 1.0, period: int = 180) -> list[float]:
    """Ramps from 6-a to 6+a rps every ``period`` s: 6 rps is a replica boundary for both
    groups (2 x 3 prefill, 3 x 2 decode), so a scaler without damping keeps crossing it."""
    base = [6.0 - amplitude + 2 * amplitude * (t % period) / period for t in range(seconds)]
    return _noisy(base, seed + 2, 0.02)


def traces(seconds: int, seed: int = 0, amplitude: float = 1.0) -> dict[str, list[float]]:
    return {
        "diurnal": diurnal(seconds, seed),
        "spike": spike(seconds, seed),
        "sawtooth": sawtooth(seconds, seed, amplitude),
    }


# -- the simulated fleet --------------------------------------------------------------------------


def _fleet(trace: Sequence[float]) -> dict[str, Group]:
    groups = {}
    for name, target in TARGETS.items():
        need = max(MIN_REPLICAS, min(MAX_REPLICAS, math.ceil(trace[0] / target)))
        groups[name] = Group(name, target, ready_at=[-math.inf] * need)
    return groups


class Pdctl:
    def __init__(self, warmup: float = WARMUP) -> None:
        self.warmup = warmup
        self.policies = {
            name: Policy(
                group=name,
                min=MIN_REPLICAS,
                max=MAX_REPLICAS,
                target=target,
                scale_up_delay=PDCTL_UP,
                scale_down_delay=PDCTL_DOWN,
                stabilization=PDCTL_STABILIZATION,
            )
            for name, target in TARGETS.items()
        }
        self.histories = {name: History() for name in TARGETS}

    def step(self, now: float, trace: Sequence[float], t: int, groups: dict[str, Group]) -> None:
        rps = average(trace, t, PDCTL_WINDOW)
        for name, group in groups.items():
            observation = Observation(at=now, rps=rps, running=group.replicas)
            decision, self.histories[name] = decide(
                self.policies[name], observation, self.histories[name], now
            )
            group.scale_to(decision.desired, now, self.warmup)


@dataclass
class Result:
    replica_seconds: float = 0.0
    under_capacity: int = 0  # seconds, summed over groups
    reversals: dict[str, int] = field(default_factory=dict)
    series: list[tuple[int, int, int, int]] = field(default_factory=list)  # per second, 2 groups

    @property
    def total_reversals(self) -> int:
        return sum(self.reversals.values())


def simulate(trace: Sequence[float], policy: str, warmup: float = WARMUP) -> Result:
    scaler: Pdctl | Baseline = Pdctl(warmup) if policy == "pdctl" else Baseline(warmup)
    groups = _fleet(trace)
    result = Result()
    for t, rps in enumerate(trace):
        now = float(t)
        scaler.step(now, trace, t, groups)
        prefill, decode = groups["prefill"], groups["decode"]
        assert prefill.replicas + decode.replicas <= HOSTS * GPUS_PER_HOST // GPUS_PER_REPLICA
        result.replica_seconds += prefill.replicas + decode.replicas
        serving = (prefill.serving(now), decode.serving(now))
        result.under_capacity += sum(
            1 for n, g in zip(serving, (prefill, decode), strict=True) if rps > n * g.target
        )
        result.series.append((prefill.replicas, decode.replicas, *serving))
    result.reversals = {name: g.reversals for name, g in groups.items()}
    return result


# -- report ---------------------------------------------------------------------------------------


def ratio(baseline: float, pdctl: float) -> str:
    """baseline / pdctl, guarded: both 0 is 'even', pdctl 0 alone is 'inf'."""
    if pdctl == 0:
        return "even (both 0)" if baseline == 0 else "inf (pdctl 0)"
    return f"{baseline / pdctl:.2f}"


def summary_line(pdctl_under: int, baseline_under: int, hosts: int = HOSTS) -> str:
    r = math.inf if pdctl_under == 0 else baseline_under / pdctl_under
    return (
        f"bench scaler-sim: ratio {r:.2f} (pdctl {pdctl_under} s, baseline {baseline_under} s, "
        f"{hosts} hosts)"
    )


def write(out: Path, name: str, trace: Sequence[float], results: dict[str, Result]) -> None:
    header = ["time", "rps"]
    for policy in POLICIES:
        header += [f"{policy}_{g}" for g in TARGETS] + [f"{policy}_{g}_serving" for g in TARGETS]
    rows = [
        [t, f"{rps:.3f}", *(n for p in POLICIES for n in results[p].series[t])]
        for t, rps in enumerate(trace)
    ]
    panels = [Panel("rps", {"rps": trace}, steps=False)]
    for index, group in enumerate(TARGETS):
        lines: dict[str, Sequence[float]] = {
            p: [s[index] for s in results[p].series] for p in POLICIES
        }
        need = [max(MIN_REPLICAS, min(MAX_REPLICAS, math.ceil(r / TARGETS[group]))) for r in trace]
        panels.append(Panel(f"{group} replicas", {**lines, "needed": need}))
    save(out, f"scaler_{name}", header, rows, name, panels)


def run(
    seconds: int,
    warmup: float = WARMUP,
    seed: int = 0,
    amplitude: float = 1.0,
    out: Path | None = OUT,
    emit: Callable[[str], None] = print,
) -> dict[str, dict[str, Result]]:
    emit(
        f"scaler-sim: {HOSTS} hosts ({HOSTS * GPUS_PER_HOST // GPUS_PER_REPLICA} replica slots), "
        f"{seconds} s per trace, warm-up {warmup:g} s, seed {seed}; "
        f"targets prefill {TARGETS['prefill']:g} / decode {TARGETS['decode']:g} rps per replica, "
        f"{MIN_REPLICAS}..{MAX_REPLICAS} each"
    )
    emit(
        f"  pdctl:    rps over {PDCTL_WINDOW} s, scale_up_delay {PDCTL_UP:g} s, "
        f"scale_down_delay {PDCTL_DOWN:g} s, stabilization {PDCTL_STABILIZATION:g} s, "
        "tolerance 10%, steps +2/-1, timers per group"
    )
    emit(
        f"  baseline: dstack, rps over {BASELINE_WINDOW} s, scale_up_delay {BASELINE_UP:g} s, "
        f"scale_down_delay {BASELINE_DOWN:g} s, one cooldown shared by both groups"
    )
    emit("")
    emit(f"{'trace':<9} {'policy':<9} {'replica-s':>10} {'under-cap s':>12} {'reversals':>10}")
    results: dict[str, dict[str, Result]] = {}
    ratios = []
    for name, trace in traces(seconds, seed, amplitude).items():
        results[name] = {policy: simulate(trace, policy, warmup) for policy in POLICIES}
        for policy in POLICIES:
            r = results[name][policy]
            split = "/".join(str(r.reversals[g]) for g in TARGETS)
            emit(
                f"{name:<9} {policy:<9} {r.replica_seconds:>10.0f} {r.under_capacity:>12d} "
                f"{r.total_reversals:>4d} ({split})"
            )
        p, b = results[name]["pdctl"], results[name]["baseline"]
        ratios.append(
            f"{name:<9} baseline/pdctl: replica-s {ratio(b.replica_seconds, p.replica_seconds)}, "
            f"under-cap {ratio(b.under_capacity, p.under_capacity)}, "
            f"reversals {ratio(b.total_reversals, p.total_reversals)}"
        )
        if out is not None:
            write(out, name, trace, results[name])
    emit("")
    emit("ratios (baseline / pdctl; higher is better for pdctl; 'inf' = pdctl had 0):")
    for line in ratios:
        emit(f"  {line}")
    if out is not None:
        emit(f"CSV per trace in {out}")
    pdctl_under = sum(r["pdctl"].under_capacity for r in results.values())
    baseline_under = sum(r["baseline"].under_capacity for r in results.values())
    emit(summary_line(pdctl_under, baseline_under))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    found = parser(__doc__)
    found.add_argument(
        "--amplitude",
        type=float,
        default=1.0,
        help="sawtooth swing around the 6 rps boundary, rps (default 1: 5..7)",
    )
    args = parse(found, argv)
    run(args.seconds, args.warmup, args.seed, args.amplitude, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
