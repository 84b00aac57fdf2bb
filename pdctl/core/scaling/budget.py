"""A decision held to the GPU budget (PURE): what a scale-out asks of the ledger, and the
decision once the ledger (and the service's own ``max_gpus``) answered.

Only growth draws from the budget: a scale-out the policy wants (``up`` on its signals or a
pin). Restoring a group to its min count, replacing a lost or hung replica and scaling in take
nothing new: the budget counted those replicas already. A refused or cut scale-out becomes a
hold (or a smaller step) whose reason says so, and ``refusal`` keeps why for status and
metrics; the group's History forgets the scaling that did not happen (no cool-down for it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdctl.core.errors import CheckFailed
from pdctl.core.plan import WORKER_ROLES, Plan
from pdctl.core.scaling.decide import Action, Decision, History
from pdctl.onhost.gpu_ledger import pressure


@dataclass(frozen=True)
class Need:
    """One group's request for more GPUs this tick."""

    group: str
    replicas: int  # more replicas the decision wants (and the group has slots for)
    unit: int  # GPUs per replica
    pressure: float  # how far from its SLO (gpu_ledger.pressure)

    @property
    def gpus(self) -> int:
        return self.replicas * self.unit


def need(
    decision: Decision, available: int, minimum: int, free_slots: int, unit: int
) -> Need | None:
    """What ``decision`` asks of the budget: the replicas above ``max(available, minimum)`` it
    wants started (no more than the group has free slots for), or None when it asks nothing."""
    if decision.desired <= available or unit <= 0:
        return None
    floor = max(available, min(minimum, decision.desired))
    more = min(decision.desired, available + free_slots) - floor
    if more <= 0:
        return None
    level = pressure(decision.signal, decision.value, decision.target, decision.current)
    return Need(decision.group, more, unit, level)


def within_cap(
    needs: list[Need], using: int, max_gpus: int | None
) -> tuple[list[Need], dict[str, str]]:
    """The needs cut to the service's own ``max_gpus`` (the furthest from its SLO first, whole
    replicas), and why each cut one was cut."""
    if max_gpus is None:
        return needs, {}
    room = max(0, max_gpus - using)
    kept: list[Need] = []
    why: dict[str, str] = {}
    for item in sorted(needs, key=lambda n: -n.pressure):
        fits = min(item.replicas, room // item.unit)
        room -= fits * item.unit
        if fits < item.replicas:
            why[item.group] = (
                f"max_gpus {max_gpus}: the service uses {using} GPU(s), room for {fits} more "
                f"of its {item.replicas} replica(s) of {item.unit} GPU(s)"
            )
        if fits > 0:
            kept.append(dataclasses.replace(item, replicas=fits))
    return kept, why


def hold(
    decision: Decision,
    before: History,
    after: History,
    available: int,
    asked: int,
    granted: int,
    why: str,
) -> tuple[Decision, History]:
    """``decision`` given ``granted`` of the ``asked`` replicas above ``available`` (its
    ``refusal`` says why not all); the group's History as if only what was granted happened."""
    if granted >= asked:
        return decision, after
    desired = decision.desired - (asked - granted)
    action: Action = (
        "up" if desired > decision.current else "down" if desired < decision.current else "hold"
    )
    reason = (
        f"{decision.reason}; refused: {why}"
        if granted == 0
        else (f"{decision.reason}; {granted} of {asked} granted: {why}")
    )
    held = dataclasses.replace(decision, desired=desired, action=action, reason=reason, refusal=why)
    history = (
        after
        if desired != decision.current
        else dataclasses.replace(after, last_scaled_at=before.last_scaled_at)
    )
    return held, history


def floor_gpus(plan: Plan) -> int:
    """The GPUs the service holds at its groups' min counts."""
    return sum(plan.groups[r].min * plan.groups[r].gpus_per_replica for r in WORKER_ROLES)


def check_budgets(plan: Plan, others: list[Plan]) -> None:
    """Before anything is deployed: the service's ``max_gpus`` and its fleet's budget can hold
    the min counts (of every budgeted service of the fleet), and the budgeted services share
    the router host that keeps the fleet's ledger (their scalers draw from it there)."""
    floor = floor_gpus(plan)
    if plan.max_gpus is not None and floor > plan.max_gpus:
        raise CheckFailed(
            f"pdctl.scaling.max_gpus {plan.max_gpus} is below the {floor} GPUs {plan.service}'s "
            "groups hold at their min counts",
            hint="raise max_gpus, or lower the groups' min counts",
        )
    if plan.gpu_budget is None:
        return
    if plan.router.several:
        raise CheckFailed(
            f"fleet {plan.fleet} has a GPU budget, kept in one ledger on one router host; "
            f"{plan.service} has several routers, and the scaler acting after a failover "
            "would draw from a ledger of its own",
            hint="cap the service with pdctl.scaling.max_gpus instead, or give it one router "
            f"(or clear the fleet's budget: pdctl fleet add {plan.fleet} ... --gpu-budget 0)",
        )
    budgeted = [o for o in others if o.gpu_budget is not None]
    elsewhere = sorted({o.router.host for o in budgeted} - {plan.router.host})
    if elsewhere:
        names = ", ".join(o.service for o in budgeted if o.router.host != plan.router.host)
        raise CheckFailed(
            f"fleet {plan.fleet} has a GPU budget, kept in one ledger on the router host its "
            f"services share: {names} run their router on {', '.join(elsewhere)}, "
            f"{plan.service} would run it on {plan.router.host}",
            hint=f"put the router there too: pdctl.router.host: {elsewhere[0]}",
        )
    total = floor + sum(floor_gpus(o) for o in budgeted)
    if total > plan.gpu_budget:
        held = ", ".join(f"{o.service} {floor_gpus(o)}" for o in budgeted) or "none"
        raise CheckFailed(
            f"fleet {plan.fleet}'s GPU budget ({plan.gpu_budget}) cannot hold every service at "
            f"its min count: {plan.service} needs {floor}, the others {held}",
            hint=f"raise it (pdctl fleet add {plan.fleet} ... --gpu-budget N), or lower min counts",
        )
