"""Two services on one fleet under one GPU budget: their scalers with pdctl's ledger versus
scalers that do not know of each other, on a simulated fleet.

    python bench/scaler_budget.py [--warmup SECONDS] [--seconds N] [--seed S]

Services ``chat`` and ``batch`` each have a prefill (3 rps per replica) and a decode group
(2 rps per replica), 1..8 replicas of 4 GPUs, scaled by ``decide()`` with scaler_sim's pdctl
timers; the fleet's budget is ``BUDGET`` GPUs (10 replicas). Their load peaks overlap: chat
rises to 9 rps over the middle of the trace, batch to 6 rps over its second half; together
they need 13 replicas (52 GPUs). Each second batch's scaler ticks, then chat's half a second
later: batch asks first, chat is further from its SLO. Policies:

- pdctl: each tick draws from the shared ledger (pdctl/onhost/gpu_ledger.py, as the scaler
  does through its file): priority to the group furthest from its SLO, whole replicas;
- first-come: a shared GPU counter without priority: a scale-out that fits when its scaler
  asks is taken (what a plain lock and count would do);
- independent: no ledger: each scaler takes what its policy wants (what two scalers that do
  not know of each other do; the fleet may have the slots, the budget is overrun).

Per policy: GPU-seconds over the budget, seconds with demand above serving capacity (summed
over the four groups), and the worst lag: per second, the largest over the groups of
``rps / (serving x target) - 1`` when above 0, summed (how far behind the most starved group
runs). CSV (and PNG with matplotlib) under bench/out/.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Mapping, Sequence
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
    Group,
    Panel,
    average,
    parse,
    parser,
    save,
)
from pdctl.core.scaling.budget import hold, need
from pdctl.core.scaling.decide import History, Observation, Policy, decide
from pdctl.onhost.gpu_ledger import Ask, Ledger, draw

SERVICES = ("batch", "chat")  # in the order their scalers tick each second
TARGETS = {"prefill": 3.0, "decode": 2.0}
GPUS_PER_REPLICA = 4
BUDGET = 40
POLICIES = ("pdctl", "first-come", "independent")
TICK_OFFSET = {"batch": 0.0, "chat": 0.5}


def _noisy(values: list[float], seed: int, noise: float = 0.05) -> list[float]:
    rng = random.Random(seed)
    return [max(0.0, v * (1.0 + rng.gauss(0.0, noise))) for v in values]


def traces(seconds: int, seed: int = 0) -> dict[str, list[float]]:
    """chat: 1.5 rps, 9 rps over the middle half; batch: 1 rps, 6 rps over the same span:
    both grow into the same free GPUs."""
    peak, end = seconds // 4, 3 * seconds // 4
    chat = [9.0 if peak <= t < end else 1.5 for t in range(seconds)]
    batch = [6.0 if peak <= t < end else 1.0 for t in range(seconds)]
    return {"chat": _noisy(chat, seed + 11), "batch": _noisy(batch, seed + 12)}


@dataclass
class Service:
    name: str
    groups: dict[str, Group]
    policies: dict[str, Policy]
    histories: dict[str, History] = field(default_factory=dict)

    def using(self) -> int:
        return sum(g.replicas for g in self.groups.values()) * GPUS_PER_REPLICA


def _service(name: str, first: float) -> Service:
    groups, policies = {}, {}
    for group, target in TARGETS.items():
        need_now = max(MIN_REPLICAS, min(MAX_REPLICAS, math.ceil(first / target)))
        groups[group] = Group(group, target, ready_at=[-math.inf] * need_now)
        policies[group] = Policy(
            group=group,
            min=MIN_REPLICAS,
            max=MAX_REPLICAS,
            target=target,
            scale_up_delay=PDCTL_UP,
            scale_down_delay=PDCTL_DOWN,
            stabilization=PDCTL_STABILIZATION,
        )
    return Service(name, groups, policies, {g: History() for g in TARGETS})


@dataclass
class Result:
    over_budget: float = 0.0  # GPU-seconds above the budget
    under_capacity: int = 0  # seconds, summed over the four groups
    worst_lag: float = 0.0
    refusals: int = 0  # scale-outs the ledger cut or refused
    series: list[list[int]] = field(default_factory=list)  # per second: replicas per group


def _first_come(ask: Ask, used_by_others: int) -> dict[str, tuple[int, str]]:
    """A shared GPU counter and nothing more: a scale-out that fits when its scaler asks is
    taken, whoever needs the GPUs more."""
    free = ask.budget - used_by_others - ask.using
    grants = {}
    for group, (gpus, unit, _) in ask.wants.items():
        take = min(gpus, max(0, free) // unit * unit)
        free -= take
        grants[group] = (take, "no GPUs left")
    return grants


def _tick(
    service: Service,
    rps: float,
    now: float,
    policy: str,
    ledger: Ledger,
    result: Result,
    warmup: float,
    used_by_others: int,
) -> Ledger:
    decisions = {}
    befores = {}
    for group_name, group in service.groups.items():
        observation = Observation(at=now, rps=rps, running=group.replicas)
        befores[group_name] = service.histories[group_name]
        decisions[group_name], service.histories[group_name] = decide(
            service.policies[group_name], observation, befores[group_name], now
        )
    if policy != "independent":
        wants = {}
        for group_name, decision in decisions.items():
            group = service.groups[group_name]
            free = MAX_REPLICAS - group.replicas
            item = need(decision, group.replicas, MIN_REPLICAS, free, GPUS_PER_REPLICA)
            if item is not None:
                wants[group_name] = (item.gpus, item.unit, item.pressure)
        ask = Ask(service.name, BUDGET, service.using(), 1.0, wants)
        if policy == "pdctl":
            ledger, answer = draw(ledger, ask, now)
            grants = {g: (x.gpus, x.reason) for g, x in answer.grants.items()}
        else:
            grants = _first_come(ask, used_by_others)
        for group_name, (gpus, unit, _) in wants.items():
            granted, why = grants[group_name]
            if granted < gpus:
                result.refusals += 1
            decisions[group_name], service.histories[group_name] = hold(
                decisions[group_name],
                befores[group_name],
                service.histories[group_name],
                service.groups[group_name].replicas,
                gpus // unit,
                granted // unit,
                why,
            )
    for group_name, decision in decisions.items():
        service.groups[group_name].scale_to(decision.desired, now, warmup)
    return ledger


def simulate(trace: Mapping[str, Sequence[float]], policy: str, warmup: float = WARMUP) -> Result:
    services = {name: _service(name, trace[name][0]) for name in SERVICES}
    ledger = Ledger()
    result = Result()
    seconds = len(trace[SERVICES[0]])
    for t in range(seconds):
        for name in SERVICES:
            rps = average(trace[name], t, PDCTL_WINDOW)
            others = sum(s.using() for n, s in services.items() if n != name)
            ledger = _tick(
                services[name], rps, t + TICK_OFFSET[name], policy, ledger, result, warmup, others
            )
        used = sum(s.using() for s in services.values())
        result.over_budget += max(0, used - BUDGET)
        lags = []
        for name, service in services.items():
            load = trace[name][t]
            for group in service.groups.values():
                serving = group.serving(float(t))
                if load > serving * group.target:
                    result.under_capacity += 1
                lags.append(load / (max(serving, 1) * group.target) - 1)
        result.worst_lag += max(0.0, *lags)
        result.series.append(
            [g.replicas for s in services.values() for g in s.groups.values()] + [used]
        )
    return result


def summary_line(results: dict[str, Result]) -> str:
    """The ratio is the GPU-seconds the scalers that know nothing of each other spend above the
    budget per GPU-second pdctl's spend (0: inf); the lag of the most starved group beside it."""
    pdctl, alone = results["pdctl"], results["independent"]
    r = math.inf if pdctl.over_budget == 0 else alone.over_budget / pdctl.over_budget
    return (
        f"bench scaler-budget: ratio {r:.2f} (over budget: pdctl {pdctl.over_budget:.0f} GPU-s, "
        f"baseline {alone.over_budget:.0f} GPU-s; worst-lag pdctl {pdctl.worst_lag:.0f}, "
        f"first-come {results['first-come'].worst_lag:.0f})"
    )


def write(out: Path, trace: Mapping[str, Sequence[float]], results: dict[str, Result]) -> None:
    columns = [f"{s}_{g}" for s in SERVICES for g in TARGETS] + ["gpus"]
    header = ["time", *(f"{s}_rps" for s in SERVICES)]
    header += [f"{p}_{c}" for p in POLICIES for c in columns]
    seconds = len(trace[SERVICES[0]])
    rows = [
        [t, *(f"{trace[s][t]:.3f}" for s in SERVICES)]
        + [n for p in POLICIES for n in results[p].series[t]]
        for t in range(seconds)
    ]
    panels = [Panel("rps", {s: trace[s] for s in SERVICES}, steps=False)]
    panels.append(
        Panel(
            "GPUs in use",
            {p: [row[-1] for row in results[p].series] for p in POLICIES}
            | {"budget": [BUDGET] * seconds},
        )
    )
    save(out, "scaler_budget", header, rows, "two services, one GPU budget", panels)


def run(
    seconds: int,
    warmup: float = WARMUP,
    seed: int = 0,
    out: Path | None = OUT,
    emit: Callable[[str], None] = print,
) -> dict[str, Result]:
    emit(
        f"scaler-budget: services {', '.join(SERVICES)} (prefill {TARGETS['prefill']:g} / decode "
        f"{TARGETS['decode']:g} rps per replica, {GPUS_PER_REPLICA} GPUs each, "
        f"{MIN_REPLICAS}..{MAX_REPLICAS}), budget {BUDGET} GPUs, {seconds} s, warm-up "
        f"{warmup:g} s, seed {seed}"
    )
    trace = traces(seconds, seed)
    results = {policy: simulate(trace, policy, warmup) for policy in POLICIES}
    emit(
        f"{'policy':<12} {'over-budget GPU-s':>18} {'under-cap s':>12} {'worst-lag':>10} {'cut':>5}"
    )
    for policy, r in results.items():
        emit(
            f"{policy:<12} {r.over_budget:>18.0f} {r.under_capacity:>12d} {r.worst_lag:>10.0f} "
            f"{r.refusals:>5d}"
        )
    if out is not None:
        write(out, trace, results)
        emit(f"CSV in {out}")
    emit(summary_line(results))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(parser(__doc__), argv)
    run(args.seconds, args.warmup, args.seed, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
