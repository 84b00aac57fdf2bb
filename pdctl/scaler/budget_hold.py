"""A scaler's scale-outs held to the GPU budget (pdctl/core/scaling/budget.py): the service's own
``max_gpus``, then the fleet's ledger, which each tick also tells what the service uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdctl.core.errors import HostError, PdctlError
from pdctl.core.plan import Plan
from pdctl.core.scaling.budget import hold, need, within_cap
from pdctl.core.scaling.decide import Decision, History
from pdctl.onhost.gpu_ledger import Ask
from pdctl.onhost.gpu_ledger_file import LedgerBusy
from pdctl.scaler.ledger_door import LedgerDoor
from pdctl.scaler.metrics import Metrics


class BudgetHold:
    """One scaler's side of the budget. An advising scaler asks what a draw would get and
    writes nothing. A ledger that cannot be reached in time refuses the growth of that tick,
    nothing else."""

    def __init__(
        self,
        plan: Plan,
        ledger: LedgerDoor | None,
        metrics: Metrics,
        *,
        advise: bool,
        interval: float,
        say: Callable[[str, str], None],
        clear: Callable[[str], None],
    ) -> None:
        self.plan, self.ledger, self.metrics = plan, ledger, metrics
        self.advise, self.interval = advise, interval
        self.say, self.clear = say, clear
        self.record: dict[str, Any] | None = None  # the ledger's last answer, for the record

    def apply(
        self,
        decisions: dict[str, Decision],
        befores: dict[str, History],
        histories: dict[str, History],
        available: dict[str, int],
        free: dict[str, int],
        now: float,
    ) -> dict[str, Decision]:
        """Each scale-out as far as the budget allows. ``available``: each group's replicas
        that count (running or starting); ``free``: its slots free to start; ``histories``
        take the holds."""
        plan = self.plan
        if plan.gpu_budget is None and plan.max_gpus is None:
            return decisions
        units = {role: plan.groups[role].gpus_per_replica for role in decisions}
        using = sum(available[role] * units[role] for role in decisions)
        needs = [
            item
            for role, decision in decisions.items()
            if (
                item := need(
                    decision,
                    available[role],
                    plan.groups[role].min,
                    free[role],
                    units[role],
                )
            )
            is not None
        ]
        asked = {item.group: item.replicas for item in needs}
        kept, why = within_cap(needs, using, plan.max_gpus)
        granted = {item.group: item.replicas for item in kept}
        if plan.gpu_budget is not None:
            wants = {item.group: (item.gpus, item.unit, item.pressure) for item in kept}
            ask = Ask(plan.service, plan.gpu_budget, using, self.interval, wants)
            try:
                if self.ledger is None:
                    raise HostError("no GPU ledger configured for this scaler")
                reach = self.ledger.look if self.advise else self.ledger.draw
                answer, note = reach(ask, now)
            except (PdctlError, LedgerBusy, OSError) as exc:
                message = exc.message if isinstance(exc, PdctlError) else str(exc)
                self.say("ledger", f"GPU ledger unavailable: {message}; no scale-out until it is")
                granted = {}
                why.update({item.group: f"GPU ledger unavailable: {message}" for item in kept})
                self.record = {"error": message, "budget": plan.gpu_budget, "using": using}
            else:
                self.clear("ledger")
                if note:
                    self.say(f"ledger note {note}", f"GPU ledger: {note}")
                for item in kept:
                    grant = answer.grants.get(item.group)
                    granted[item.group] = (grant.gpus if grant else 0) // item.unit
                    if grant is not None and grant.reason:
                        why[item.group] = grant.reason
                self.record = {**answer.to_dict(), "using": using}
                self.metrics.gpus.labels("budget").set(answer.budget)
                self.metrics.gpus.labels("fleet_used").set(answer.used)
        self.metrics.gpus.labels("service").set(using)
        if plan.max_gpus is not None:
            self.metrics.gpus.labels("max_gpus").set(plan.max_gpus)
            self.record = {**(self.record or {}), "max_gpus": plan.max_gpus, "using": using}
        for role, count in asked.items():
            got = granted.get(role, 0)
            if got >= count:
                continue
            decisions[role], histories[role] = hold(
                decisions[role],
                befores[role],
                histories[role],
                available[role],
                count,
                got,
                why.get(role, "the GPU budget has no room"),
            )
            self.metrics.refusals.labels(role).inc()
        return decisions
