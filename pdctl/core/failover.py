"""Losing a host or a replica: the scaler's timings, and the plan's spare capacity. PURE.

A plan keeps every slot up to a group's max count, spread over the hosts; the scaler starts
spare slots in place of replicas that stop answering. Whether that works when a whole host goes
depends on where the spares are: a group "survives the loss of any one host" (N+1) when, for
every host, the group's slots on the *other* hosts number at least the replicas it must keep.
`pdctl plan` and `pdctl status` show it per group, and `pdctl: {placement: {survive_host_loss:
true}}` in the spec refuses a plan without it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from pdctl.core.errors import CheckFailed

if TYPE_CHECKING:  # the plan imports this module for FailoverPlan
    from pdctl.core.plan import Plan

# What the scaler does when a replica or a host stops answering (seconds). The spec's
# `pdctl: {scaler: {...}}` sets them; these are the defaults.
INTERVAL = 2.0
HOST_LOST_AFTER = 6.0
UNHEALTHY_AFTER = 10.0
# SGLang's /health runs a one-token generation and answers after a second at the soonest
# (docs/facts.md); SMG's own health check waits 5 s.
PROBE_TIMEOUT = 5.0
KILL_AFTER = 10.0


class FailoverPlan(BaseModel):
    """The plan's failover settings (``pd_failover`` of the extra-vars; the scaler's config)."""

    # Seconds between the scaler's ticks.
    interval: float = Field(INTERVAL, gt=0)
    # A worker host that answers no SSH command and none of whose workers answers its health
    # check for this long is lost: its replicas are deregistered and replaced elsewhere.
    host_lost_after: float = Field(HOST_LOST_AFTER, gt=0)
    # A serving replica whose engine fails its health check (or the router's) this long is
    # replaced: a spare starts, the replica is deregistered at once and then killed.
    unhealthy_after: float = Field(UNHEALTHY_AFTER, gt=0)
    # One health check of one engine at most.
    probe_timeout: float = Field(PROBE_TIMEOUT, gt=0)
    # A replica being removed for not answering gets this long to stop before SIGKILL (a hung
    # worker never finishes a drain).
    kill_after: float = Field(KILL_AFTER, ge=0)
    # The spec asked for N+1 (plan refused without it).
    survive_host_loss: bool = False


@dataclass(frozen=True)
class HostLoss:
    """One group against the loss of any one host."""

    group: str
    need: int  # the replicas the group must keep
    slots: int  # its planned slots on hosts that count (not already lost)
    worst_host: str | None  # the host whose loss leaves the fewest slots (None: no slot)
    left: int  # the slots left after losing worst_host

    @property
    def survives(self) -> bool:
        return self.left >= self.need

    def describe(self) -> str:
        if self.worst_host is None:
            return f"{self.group}: no slot to lose (keeps {self.need})"
        verdict = "survives" if self.survives else "does NOT survive"
        return (
            f"{self.group}: {verdict} the loss of any one host: losing {self.worst_host} leaves "
            f"{self.left} of {self.slots} slot(s) for {self.need} replica(s)"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "need": self.need,
            "slots": self.slots,
            "worst_host": self.worst_host,
            "left": self.left,
            "survives": self.survives,
        }


def host_loss(
    group: str, slot_hosts: Iterable[str], need: int, hosts: Iterable[str] = ()
) -> HostLoss:
    """N+1 of a group whose slots sit on ``slot_hosts`` (one entry per slot): the worst single
    host to lose, and what remains. ``hosts``: more hosts that could be lost (a host without
    a slot of the group loses it nothing)."""
    per_host = Counter(slot_hosts)
    for host in hosts:
        per_host.setdefault(host, 0)
    total = sum(per_host.values())
    if not per_host:
        return HostLoss(group, need, 0, None, 0)
    worst = max(sorted(per_host), key=lambda h: per_host[h])
    return HostLoss(group, need, total, worst, total - per_host[worst])


def unsurvivable(losses: Mapping[str, HostLoss]) -> list[HostLoss]:
    return [loss for loss in losses.values() if not loss.survives]


def plan_host_loss(
    plan: Plan, need: Mapping[str, int] | None = None, lost: Iterable[str] = ()
) -> dict[str, HostLoss]:
    """Each worker group of ``plan`` against the loss of one more host: ``need`` the replicas
    each must keep (default: its min count, what a deploy starts); ``lost``: hosts already gone
    (their slots count for nothing)."""
    gone = set(lost)
    worker_hosts = [s.host for s in plan.slots() if s.host not in gone]
    found = {}
    for role, group in plan.groups.items():
        hosts = [s.host for s in group.slots if s.host not in gone]
        wanted = group.min if need is None or need.get(role) is None else need[role]
        found[role] = host_loss(role, hosts, wanted, worker_hosts)
    return found


def refuse_unsurvivable(plan: Plan) -> None:
    """CheckFailed when the spec asks for N+1 and some group lacks it."""
    if not plan.failover.survive_host_loss:
        return
    short = unsurvivable(plan_host_loss(plan))
    if short:
        raise CheckFailed(
            "pdctl.placement.survive_host_loss: the plan cannot keep every group's min count "
            "when one host is lost: " + "; ".join(loss.describe() for loss in short),
            hint="raise the group's max count (spare slots on other hosts), add GPU hosts to "
            "the fleet, or lower the group's min count",
        )
