"""Deploy (or update) a PD service: the plan applied to its hosts.

deploy = (plan: planning.py) -> quick check against the last deploy (drift.py) -> record
"applying" -> model and image prefetch -> deploy.yml -> rolling update of replicas whose config
changed (surge: start the new one on a spare slot, wait healthy, register, then deregister,
drain and stop the old) -> record "applied".
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from pdctl.core import unhealthy
from pdctl.core.errors import HostError, PdctlError
from pdctl.core.plan import WORKER_ROLES, Plan, Slot
from pdctl.core.results import (
    DeployResult,
)
from pdctl.doors import inventory, runner
from pdctl.doors import service as services
from pdctl.doors.session import Session
from pdctl.doors.slots import UNREACHABLE, Actuator, SlotState
from pdctl.operations import drift, image_prefetch, planning, prefetch
from pdctl.operations import fleet as fleets
from pdctl.operations.planning import diff

Progress = Callable[[str], None]


def playbook_vars(plan: Plan) -> dict[str, Any]:
    """A pipeline's extra-vars, with the roll left to pdctl (pd_worker_rollout none: it
    rolls the replicas itself, surging onto spare slots, after the playbook)."""
    return {**planning.pipeline_vars(plan), "pd_worker_rollout": "none"}


def without_hosts(plan: Plan, hosts: set[str]) -> Plan:
    """The plan with no slot on ``hosts``: what prefetching the others needs."""
    groups = {
        role: group.model_copy(update={"slots": [s for s in group.slots if s.host not in hosts]})
        for role, group in plan.groups.items()
    }
    return plan.model_copy(update={"groups": groups})


def apply(
    session: Session,
    plan: Plan,
    progress: Progress,
    *,
    dry_run: bool = False,
    converge: bool = False,
    verbosity: int = 0,
    skip: set[str] | None = None,
) -> DeployResult:
    """Converge the hosts to the plan, unless the quick check finds them as the last deploy
    left them (pdctl/operations/drift.py); ``converge`` runs the playbooks regardless. ``skip``:
    hosts that cannot be reached, left as they are (`--skip-unreachable`). The fleet and the
    SSH connections are the session's, from the plan's placement to the roll."""
    workspace = session.workspace
    skip = set(skip or ())
    old = services.stored_plan(workspace, plan.service)
    extravars = playbook_vars(plan)
    fleet_dir = inventory.fleet_dir(workspace, plan.fleet)
    key = drift.key(workspace, plan.service, create=not dry_run)
    inputs = drift.inputs_digest(key, extravars, fleet_dir)
    doc = DeployResult(
        service=plan.service,
        fleet=plan.fleet,
        dry_run=dry_run,
        changes=diff(old, plan),
        endpoint=services.endpoint(plan),
        api_key_file=services.api_key_file(plan),
        skipped_hosts=sorted(skip),
    )
    if not converge and not skip:
        doc.drift = _quick_check(session, plan, key, inputs, progress)
        if not doc.drift:
            progress("every host matches the last deploy: nothing to do")
            return doc
        for reason in doc.drift[:10]:
            progress(f"converging: {reason}")
    # Recorded as applying before any host changes: a failure, Ctrl-C or kill leaves the
    # record, which `status` shows and `destroy` undoes.
    with nullcontext() if dry_run else services.applying(workspace, plan):
        if not dry_run:
            drift.forget(workspace, plan.service)  # a run that fails half-way leaves no record
            # Before any unit starts: a worker finds its model in the host's cache, and its
            # image in the host's runtime (taken once, spread from peers).
            reachable = without_hosts(plan, skip)
            doc.model = prefetch.for_plan(session, reachable, progress)
            doc.images = image_prefetch.for_plan(session, reachable, progress)
        if skip:
            progress(f"skipping {', '.join(sorted(skip))}: unreachable")
        summary = runner.run_playbook(
            "deploy.yml",
            fleet_dir,
            extravars={**extravars, "pd_preflight_unreachable": sorted(skip)}
            if skip
            else extravars,
            secrets=services.secret_values(plan),
            limit=":".join(["all", *(f"!{host}" for host in sorted(skip))]) if skip else None,
            forks=min(100, max(5, len(plan.hosts()))),
            check=dry_run,
            diff=dry_run,
            progress=progress,
            verbosity=verbosity,
        )
        _raise_failures(session, plan, summary)
        doc.converged = True
        doc.changed_hosts = summary.changed_hosts()
        if not dry_run:
            with services.open_handle(session, plan, log=progress) as handle:
                # One read of every host serves both the roll (slot states) and the record (files:
                # a roll starts and stops units, it writes none).
                observed = drift.observe(handle, key)
                states = {name: st for o in observed.values() for name, st in o.states.items()}
                every_host_read = all(not o.error for o in observed.values())
                if not every_host_read and skip:
                    # The skipped hosts' slots are neither rolled nor used as spares.
                    states.update(
                        {
                            s.name: SlotState(s, UNREACHABLE, None)
                            for s in plan.slots()
                            if s.host in skip
                        }
                    )
                    every_host_read = all(not o.error for h, o in observed.items() if h not in skip)
                doc.rolled = _roll(handle, progress, states if every_host_read else None)
                services.save_plan(workspace, plan)
                drift.save_record(workspace, plan.service, inputs, observed)
    return doc


def _raise_failures(session: Session, plan: Plan, summary: runner.RunSummary) -> None:
    """A failed run's error: units that never became healthy with their own last log lines
    (secrets masked), else each host's first failed task."""
    units = unhealthy.from_run(summary, services.secret_values(plan).values())
    hint = f"fix the cause and re-run `pdctl deploy`, or undo with `pdctl destroy {plan.service}`"
    if units:
        raise unhealthy.UnhealthyUnits("deploy failed", units, hint=hint)
    failures = summary.failures()
    unreachable = summary.unreachable()
    if unreachable or failures or summary.rc != 0:
        fleet = session.fleet(plan.fleet)
        details = [fleets.unreachable_reason(fleet, h, m) for h, m in unreachable.items()]
        details += [f"{h}: {r.task}: {r.message[:300]}" for h, r in failures.items()]
        raise HostError(
            "deploy failed: " + ("; ".join(details) or f"ansible-playbook exited {summary.rc}"),
            hint=hint,
        )


def _quick_check(
    session: Session, plan: Plan, key: bytes, inputs: str, progress: Progress
) -> list[str]:
    """Why the hosts need a converge ([] when they hold what the last deploy left)."""
    record = drift.load_record(session.workspace, plan.service)
    if record is None or record.get("inputs") != inputs:
        return drift.compare(plan, record, inputs, {}, None)  # no need to ask the hosts
    progress(f"checking {len(plan.hosts())} host(s) against the last deploy")
    try:
        with services.open_handle(session, plan) as handle:
            observed = drift.observe(handle, key)
            registered = drift.registered_urls(handle)
    except PdctlError as exc:
        return [f"cannot check the hosts ({exc.message})"]
    return drift.compare(plan, record, inputs, observed, registered)


def _roll(
    handle: services.Handle, progress: Progress, states: dict[str, SlotState] | None = None
) -> list[str]:
    """Replace running replicas whose config is stale, one at a time, without downtime.
    ``states``: the slots' states when already read (else they are read here)."""
    plan = handle.plan
    rolled: list[str] = []
    paused = False
    actuator = handle.actuator
    states = dict(states) if states is not None else actuator.states()
    for role in WORKER_ROLES:
        config = plan.groups[role].config
        stale = [
            s
            for s in states.values()
            if s.slot.group == role and s.running and s.config not in {None, config}
        ]
        if stale and not rolled:
            # The scaler would see the surge replica as one too many: pause it meanwhile.
            paused = services.scaler_unit(handle, "stop")
        for old in stale:
            spare = _spare(states, role, exclude=old.slot)
            if spare is not None:
                progress(f"rolling {old.slot.name}: new replica on {spare.name}")
                _into_service(actuator, spare)
                actuator.scale_in(old.slot)
                states[spare.name] = SlotState(spare, "active", config)
                states[old.slot.name] = SlotState(old.slot, "inactive", None)
            else:
                progress(f"rolling {old.slot.name} in place (no spare slot)")
                # A replica the converge just started may still be pending in the router: the
                # old one leaves only once another of its group is routable (else 503s).
                fresh = [
                    s.slot
                    for s in states.values()
                    if s.slot.group == role
                    and s.running
                    and s.slot != old.slot
                    and s.config in {None, config}
                ]
                if fresh and not actuator.wait_any_in_service(fresh):
                    progress(f"no other {role} replica is in service: {old.slot.name} leaves a gap")
                _restart_in_place(actuator, old.slot)
                states[old.slot.name] = SlotState(old.slot, "active", config)
            rolled.append(old.slot.name)
    if rolled and paused:
        services.scaler_unit(handle, "start")
    return rolled


def _spare(states: dict[str, SlotState], role: str, exclude: Slot) -> Slot | None:
    spares = [
        s.slot
        for s in states.values()
        if s.slot.group == role and not s.running and s.active != UNREACHABLE and s.slot != exclude
    ]
    return min(spares, key=lambda slot: slot.index, default=None)


def _restart_in_place(actuator: Actuator, slot: Slot) -> None:
    actuator.scale_in(slot)
    _into_service(actuator, slot)


def _into_service(actuator: Actuator, slot: Slot) -> None:
    """Start, register and wait until the router routes to it: in a roll another replica of
    the group leaves next (the old one, or the next stale one in place), and the group must
    never be left without a routable worker (SMG adds a registered worker asynchronously)."""
    actuator.scale_out(slot)
    actuator.wait_in_service(slot)
