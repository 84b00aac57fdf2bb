"""A group's scaling policy from the plan and its pins, its signals from the workers, and
which of its replicas leave first on a scale-in."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdctl.core.plan import WORKER_ROLES, Plan, Slot
from pdctl.core.scaling.decide import Policy
from pdctl.doors.router import Worker


def policies(plan: Plan, pins: dict[str, int]) -> dict[str, Policy]:
    found: dict[str, Policy] = {}
    for role in WORKER_ROLES:
        group = plan.groups[role]
        scaling = group.scaling or {}
        up = scaling.get("scale_up_delay")
        down = scaling.get("scale_down_delay")
        found[role] = Policy(
            group=role,
            min=group.min,
            max=group.max,
            target=float(scaling.get("target") or math.inf),
            metric=scaling.get("metric") or "rps",
            scale_up_delay=float(up) if up is not None else 0.0,
            scale_down_delay=float(down) if down is not None else 60.0,
            pinned=pins.get(role),
        )
    return found


@dataclass(frozen=True)
class WorkerSignals:
    """One group's signals from its workers' own metrics (None: missing)."""

    latency: float | None = None  # the windowed percentile, seconds
    queue_per_replica: float | None = None
    inflight_per_replica: float | None = None
    serving: int | None = None  # replicas routed to (a started one serves once registered)
    source: str | None = None  # a gRPC group's latency: which measurement it is


def scale_in_order(
    running: list[Slot],
    workers: dict[str, Worker],
    started_at: dict[str, float],
    out_of_service_since: dict[str, float],
    *,
    now: float,
    start_timeout: float,
) -> tuple[list[Slot], list[str]]:
    """Which running replicas leave first, and the names of those still starting.

    A replica that runs but is not routed to yet (someone else started it: a deploy, a
    restart) is about to serve: taking an in-service replica away meanwhile could leave the
    group with none (503s), so nothing leaves while one is starting, up to the start timeout
    (``out_of_service_since`` remembers since when, across ticks). Past that it serves nothing
    and leaves first; then the newest this scaler started, then the highest index."""
    out = []
    for slot in running:
        worker = workers.get(slot.url)
        if worker is not None and worker.healthy:
            out_of_service_since.pop(slot.name, None)
        else:
            out.append(slot)
    starting = [
        s.name for s in out if now - out_of_service_since.setdefault(s.name, now) < start_timeout
    ]
    if starting:
        return [], starting
    newest = sorted(running, key=lambda s: (started_at.get(s.name, 0.0), s.index), reverse=True)
    return out + [s for s in newest if s not in out], []
