"""`pdctl status`: the service as it runs, read live from its hosts, its router and its scaler.

Degrades, never fails, on hosts that do not answer: their replicas show "unreachable" and
the rest is read; only a service that does not serve is an error (status_failure).
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from pdctl.core import layout
from pdctl.core.errors import HostError, PdctlError, ServiceDown
from pdctl.core.failover import plan_host_loss
from pdctl.core.plan import WORKER_ROLES, Plan, WorkerRole
from pdctl.core.results import (
    GroupStatus,
    HostLossStatus,
    ModelStatus,
    ReplicaStatus,
    RouterReplicaStatus,
    RouterStatus,
    ScalerStatus,
    ServiceHealth,
    StatusGroups,
    StatusResult,
)
from pdctl.core.router_replicas import url
from pdctl.core.scaling.decide import Decision
from pdctl.core.unhealthy import Unhealthy
from pdctl.doors import service as services
from pdctl.doors.session import Session
from pdctl.doors.slots import Actuator, SlotState
from pdctl.operations import prefetch
from pdctl.scaler import control
from pdctl.scaler.setup import handle_store

_DECISION = TypeAdapter(Decision)

# `pdctl status` waits this long for a host (its unit states), then shows it unreachable.
STATUS_TIMEOUT = 10.0


def status(session: Session, name: str) -> StatusResult:
    """The service as it runs, read live. Degrades, never fails, on hosts that do not
    answer: their replicas show "unreachable" (``unreachable`` says why); the router's and
    the scaler's parts show what could be read. ``health`` says whether the service serves."""
    plan = services.load_plan(session.workspace, name)
    record = services.record_state(session.workspace, name)
    # A deploy that did not complete may have left any part: read what is there.
    with services.open_handle(session, plan, need_key=False) as handle:
        states, unreachable = handle.actuator.read_states(timeout=STATUS_TIMEOUT)
        reasons = _why_failed(handle.actuator, states)
        try:
            if handle.router_problem:
                raise HostError(handle.router_problem)
            workers = {w.url: w for w in handle.router.workers()}
            router_state = "ready" if handle.router.ready() else "not ready"
        except PdctlError as exc:
            workers, router_state = {}, f"unreachable: {exc.message}"
        scaler = None
        if handle.router_host not in unreachable:
            try:
                scaler = control.recorded(handle_store(handle))
            except PdctlError:
                scaler = None
        routers = _routers(plan, handle, router_state)
        model = prefetch.status(
            plan, handle.fleet.settings.model_endpoint, handle.pool, handle.targets
        )
    scaler_alive = control.alive(scaler)
    decisions = (scaler or {}).get("groups") or {}
    pins = (scaler or {}).get("pins") or {}
    groups: dict[WorkerRole, GroupStatus] = {}
    for role in WORKER_ROLES:
        group = plan.groups[role]
        replicas = []
        for slot in group.slots:
            state = states[slot.name]
            worker = workers.get(slot.url)
            replicas.append(
                ReplicaStatus(
                    host=slot.host,
                    slot=slot.index,
                    port=slot.port,
                    gpus=slot.gpus,
                    state=state.active,
                    registered=worker is not None,
                    router_status=worker.status if worker else None,
                    healthy=worker.healthy if worker else None,
                    stale=bool(state.running and state.config not in {None, group.config}),
                    restarts=reasons[slot.name].restarts if slot.name in reasons else None,
                    last_log=_last_line(reasons.get(slot.name)),
                )
            )
        decision = _decision(decisions.get(role))
        desired = decision.desired if decision and scaler_alive else None
        groups[role] = GroupStatus(
            min=group.min,
            max=group.max,
            desired=desired,
            pinned=pins.get(role),
            running=sum(r.state == "active" for r in replicas),
            last_decision=decision,
            replicas=replicas,
            spares=sum(
                1 for s in group.slots if s.host not in unreachable and not states[s.name].running
            ),
        )
    need: dict[str, int] = {
        role: g.desired if g.desired is not None else g.min for role, g in groups.items()
    }
    losses = plan_host_loss(plan, need, lost=unreachable)
    for role in WORKER_ROLES:
        groups[role].host_loss = HostLossStatus.model_validate(losses[role].to_dict())
    short = any(
        g.running < (g.desired if g.desired is not None else g.min) for g in groups.values()
    )
    health: ServiceHealth = (
        "down" if router_state != "ready" else "degraded" if unreachable or short else "serving"
    )
    return StatusResult(
        service=name,
        fleet=plan.fleet,
        state=record,
        endpoint=services.endpoint(plan),
        api_key_file=services.api_key_file(plan),
        scaler=ScalerStatus(
            running=scaler_alive,
            rps=(scaler or {}).get("rps"),
            recorded_at=(scaler or {}).get("at"),
            hosts=_scaler_hosts(scaler),
            fenced=[str(n) for n in (scaler or {}).get("fenced") or [] if isinstance(n, str)],
            mode="advise" if (scaler or {}).get("mode") == "advise" else "act",
            budget=_scaler_budget(scaler),
        ),
        groups=StatusGroups(
            router=RouterStatus(
                host=handle.router_host,
                address=handle.router.address,
                port=plan.router.port,
                state=router_state,
                unit=layout.router_unit(plan.service),
            ),
            prefill=groups["prefill"],
            decode=groups["decode"],
        ),
        routers=routers,
        failover_address=plan.router.failover.address if plan.router.failover else None,
        model=ModelStatus.model_validate(model) if model else None,
        health=health,
        unreachable=unreachable,
    )


def _routers(plan: Plan, handle: services.Handle, router_state: str) -> list[RouterReplicaStatus]:
    """Every router as read live (several, or an address: doors/router_views.py); a lone
    router without an address is active unless it does not answer."""
    if handle.routers is None:
        one = plan.router.replicas[0]
        return [
            RouterReplicaStatus(
                host=one.host,
                address=one.address,
                url=url(one.address, plan.router.port),
                state="down" if router_state.startswith("unreachable") else "active",
                unit="unknown",
            )
        ]
    return [
        RouterReplicaStatus(
            host=view.host,
            address=view.address,
            url=url(view.address, plan.router.port),
            state=view.state,
            unit=view.unit,
            vrrp=view.vrrp,
            error=view.error,
        )
        for view in handle.routers
    ]


def status_failure(doc: StatusResult) -> ServiceDown | None:
    """The error `pdctl status` exits with after printing ``doc``: only a service that does
    not serve (a host that does not answer is shown, not failed on)."""
    if doc.health != "down":
        return None
    router = doc.groups.router
    return ServiceDown(
        f"service {doc.service} is down: its router on {router.host} is {router.state}",
        hint=f"pdctl logs of the replicas; `pdctl deploy` to repair the router on {router.host}"
        if router.state.startswith("unreachable")
        else "no healthy prefill and decode worker: see the replicas above",
    )


def _scaler_budget(scaler: dict[str, Any] | None) -> dict[str, Any] | None:
    """The GPU budget as the scaler recorded it (its own file: checked, not trusted)."""
    budget = (scaler or {}).get("budget")
    if not isinstance(budget, dict):
        return None
    kept: dict[str, Any] = {}
    for key in ("budget", "used", "using", "max_gpus"):
        value = budget.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            kept[key] = value
    holders = budget.get("holders")
    if isinstance(holders, dict):
        kept["holders"] = {
            str(k): v for k, v in holders.items() if isinstance(v, int) and not isinstance(v, bool)
        }
    if isinstance(budget.get("error"), str):
        kept["error"] = budget["error"][:500]
    return kept


def _scaler_hosts(scaler: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The scaler's record of silent and lost hosts (its own file: checked, not trusted)."""
    hosts = (scaler or {}).get("hosts")
    if not isinstance(hosts, dict):
        return {}
    return {str(h): v for h, v in hosts.items() if isinstance(v, dict)}


def _decision(recorded: object) -> Decision | None:
    """A group's last decision as the scaler recorded it (its state in the store, written by
    pdctl/scaler/loop.py); None when there is none, or what is there is not a decision (as
    control.recorded takes a state it cannot read for none)."""
    try:
        return _DECISION.validate_python(recorded) if recorded else None
    except ValidationError:
        return None


def _why_failed(actuator: Actuator, states: dict[str, SlotState]) -> dict[str, Unhealthy]:
    """Each failed replica's unit record (state, restarts, last journal lines)."""
    found: dict[str, Unhealthy] = {}
    for name, state in states.items():
        if state.active == "failed":
            try:
                found[name] = actuator.why(state.slot)
            except PdctlError:
                continue  # the state is shown; its journal could not be read
    return found


def _last_line(record: Unhealthy | None) -> str | None:
    lines = [line for line in (record.journal if record else []) if line.strip()]
    return lines[-1] if lines else None
