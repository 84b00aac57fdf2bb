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

from pdctl.scaler.decide import Action, Decision, History
from pdctl.scaler.gpu_ledger import pressure


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
