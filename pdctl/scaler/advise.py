"""`pdctl scaler advise SVC --for 10m`: the decisions the service's scaler would take, without
acting, so an operator can trust the policy before letting it act.

An advising Scaler (loop.py, ``advise=True``) observes the service as the acting one does (unit
states, the router, the workers' signals) and decides with the same policy and the same budget
(it looks at the fleet's GPU ledger, drawing nothing); it starts, stops, registers and
replaces nothing, and writes no state of its own: the acting scaler's record and pins stand.
Its History starts from the acting scaler's record (its cool-downs and stabilization window),
so its advice is what the acting scaler, on the same observations, decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from pdctl.core.scaling.decide import Decision
from pdctl.scaler.loop import Scaler

Show = Callable[[float, Decision], None]


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """The scaler's own metrics, one entry per sample: ``name{label="v",...}`` -> value."""
    found: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def advise(
    scaler: Scaler,
    seconds: float,
    show: Show,
    *,
    sleep: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """Tick ``scaler`` (advising) for ``seconds``; ``show`` each decision that differs from
    the group's last shown (an action, or a new reason); the whole record at the end."""
    if not scaler.advise:
        raise ValueError("advise() takes an advising scaler")
    wait = sleep or scaler.stop.wait
    ended = time.monotonic() + seconds
    decisions: list[dict[str, Any]] = []
    shown: dict[str, Decision] = {}
    ticks = 0
    try:
        while not scaler.stop.is_set():
            started = time.monotonic()
            at = scaler.clock()
            found = scaler.tick()
            ticks += 1
            for group, decision in found.items():
                decisions.append({"at": at, **decision.to_dict()})
                last = shown.get(group)
                if decision.action != "hold" or last is None or last.reason != decision.reason:
                    show(at, decision)
                    shown[group] = decision
            left = ended - time.monotonic()
            if left <= 0:
                break
            wait(max(0.0, min(left, scaler.interval - (time.monotonic() - started))))
    finally:
        scaler.close()
    return {
        "service": scaler.plan.service,
        "mode": "advise",
        "for": seconds,
        "interval": scaler.interval,
        "ticks": ticks,
        "decisions": decisions,
        "summary": _summary(decisions),
        "budget": scaler.budget,
        "metrics": _samples(scaler.metrics.registry),
    }


def _summary(decisions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for item in decisions:
        group = summary.setdefault(
            item["group"], {"up": 0, "down": 0, "hold": 0, "refused": 0, "last": None}
        )
        group[item["action"]] += 1
        group["refused"] += 1 if item.get("refusal") else 0
        group["last"] = item
    return summary
