"""Deploy, inspect and destroy a PD service: the service functions behind the CLI.

deploy = spec -> plan -> diff against what runs -> (confirm) -> deploy.yml
-> rolling update of replicas whose config changed (surge: start the new one on
a spare slot, wait healthy, register, then deregister, drain and stop the old).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pdctl import (
    drift,
    image_prefetch,
    inventory,
    layout,
    prefetch,
    runner,
    sharing,
    unhealthy,
)
from pdctl import fleet as fleets
from pdctl import service as services
from pdctl.ansible_data import unsafe_yaml
from pdctl.errors import HostError, InputError, PdctlError, ServiceDown
from pdctl.failover import plan_host_loss
from pdctl.plan import WORKER_ROLES, Plan, Slot, WorkerRole, build, held_by
from pdctl.results import (
    DeployResult,
    DestroyResult,
    EndpointResult,
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
from pdctl.router_replicas import url
from pdctl.scaler import control
from pdctl.scaler.decide import Decision
from pdctl.scaler.setup import handle_store
from pdctl.scaler_source import archive as scaler_source_archive
from pdctl.slots import UNREACHABLE, Actuator, SlotState
from pdctl.spec import Env, Spec, load
from pdctl.unhealthy import Unhealthy
from pdctl.versions import scaler_requirements
from pdctl.workspace import Workspace, cache_dir

Progress = Callable[[str], None]
_DECISION = TypeAdapter(Decision)


def resolve_fleet(workspace: Workspace, spec: Spec, fleet: str | None) -> str:
    name = fleet or spec.pdctl.fleet
    if name:
        return name
    fleets = inventory.list_fleets(workspace)
    if len(fleets) == 1:
        return fleets[0]
    raise InputError(
        "which fleet? pass --fleet NAME (or set pdctl.fleet in the spec)",
        hint=f"fleets here: {', '.join(fleets) or 'none: pdctl fleet add NAME --host ...'}",
    )


def make_plan(
    workspace: Workspace,
    spec_path: Path,
    fleet: str | None,
    *,
    allow_partial: bool = False,
    environ: Mapping[str, str] | None = None,
    warn: Progress | None = None,
    create_key: bool = False,
    unreachable: dict[str, str] | None = None,
) -> tuple[Spec, Env, Plan]:
    """The spec placed on the fleet around what the fleet's other services hold.

    First around this workspace's other services alone, so that a spec's own conflicts and
    a plain lack of GPUs are refused before any host is contacted; then around what the
    hosts show of services deployed from elsewhere. The hosts of the plan that could not be
    read refuse the plan (HostError, listing every one), unless ``warn`` is given (`pdctl
    plan`, a preview: then each is told there) or ``unreachable`` is (a deploy that skips
    them: they are put there, host -> why). ``create_key``: make the service's key if it has
    none (a deploy does; `pdctl plan` and a dry run leave the workspace as it is, see
    drift.secrets_digest).
    """
    environ = os.environ if environ is None else environ
    spec, env = load(spec_path, environ)
    fleet_model = inventory.load(workspace, resolve_fleet(workspace, spec, fleet))
    key = drift.stored_key(workspace, spec.name)
    fresh = drift.new_key() if key is None and create_key else None
    digest = drift.secrets_digest(key or fresh, env.secrets, environ)
    others = sharing.stored_plans(workspace, fleet_model.name, spec.name)
    held = [h for other in others for h in held_by(other)]
    plan = build(
        spec, env, fleet_model, secrets_digest=digest, allow_partial=allow_partial, held=held
    )
    explained = {spec.name, *(other.service for other in others)}
    found = sharing.read_hosts(workspace, fleet_model, explained)
    if found.held:
        held += found.held
        plan = build(
            spec, env, fleet_model, secrets_digest=digest, allow_partial=allow_partial, held=held
        )
    unread = {host: found.unread[host] for host in plan.hosts() if host in found.unread}
    if unread and warn is None and unreachable is None:
        raise HostError(
            f"{len(unread)} host(s) of the plan cannot be reached: "
            + "; ".join(f"{host}: {why}" for host, why in unread.items()),
            hint=f"bring them back (`pdctl fleet check {plan.fleet}`), or converge the other "
            "hosts with `pdctl deploy ... --skip-unreachable` (what runs on these stays as "
            "it is; the scaler replaces their replicas while they are away)",
            unreachable=sorted(unread),
        )
    for host, why in unread.items():
        if unreachable is not None:
            unreachable[host] = why
        if warn is not None:
            warn(
                f"{host}: cannot read which GPUs and ports other services hold there ({why}); "
                "the plan does not know of services deployed there from elsewhere"
            )
    if fresh is not None:  # kept only for a valid plan: a refused spec leaves no state
        drift.save_key(workspace, spec.name, fresh)
    return spec, env, plan


def write_plan_file(plan: Plan, path: Path) -> None:
    header = (
        "# pdctl plan: the extra-vars of playbooks/deploy.yml. Secrets are not in here: export\n"
        f"# {', '.join(plan.secret_names) or '(none)'} before running ansible-playbook.\n"
        "# The document is tagged !unsafe: Ansible passes every value on as written, never as a\n"
        "# template.\n"
    )
    path.write_text("---\n" + header + unsafe_yaml(plan.extravars()))


def plan_table(plan: Plan) -> list[tuple[str, ...]]:
    """One row per listener owner: the router (its port, metrics and the scaler's), each
    slot (its port, and its bootstrap, side channel and KV connector ports)."""
    router = plan.router
    mesh = f", mesh {router.mesh_port}" if router.meshed else ""
    rows: list[tuple[str, ...]] = [
        (
            "router" if not router.meshed else f"router/{number}",
            host,
            "-",
            "-",
            f"{router.port}",
            f"metrics {router.metrics_port}, scaler {plan.scaler_metrics_port}{mesh}",
            layout.router_unit(plan.service),
            "start",
        )
        for number, host in enumerate(router.hosts, start=1)
    ]
    for slot in plan.slots():
        rows.append(
            (
                slot.name,
                slot.host,
                ",".join(map(str, slot.gpus)),
                ",".join(slot.rdma_devices) or "-",
                f"{slot.port}-{slot.port + plan.port_stride - 1}",
                _other_ports(slot),
                slot.unit(plan.service),
                "start" if slot.start else "spare",
            )
        )
    return rows


def _other_ports(slot: Slot) -> str:
    def span(first: int) -> str:
        return str(first) if len(slot.gpus) == 1 else f"{first}-{first + len(slot.gpus) - 1}"

    parts = [f"bootstrap {slot.bootstrap_port}"] if slot.bootstrap_port is not None else []
    if slot.side_channel_port is not None:
        parts.append(f"side channel {span(slot.side_channel_port)}")
    if slot.kv_port is not None:
        parts.append(f"kv {span(slot.kv_port)}")
    return ", ".join(parts) or "-"


def diff(old: Plan | None, new: Plan) -> list[str]:
    """What changes between the plan that runs and the new one, one line each."""
    if old is None:
        return [
            f"+ new service {new.service}: router on {', '.join(new.router.hosts)}"
            + (f" behind {new.router.failover.address}" if new.router.failover else "")
            + ", "
            + ", ".join(f"{len(new.groups[r].slots)} {r} slot(s)" for r in WORKER_ROLES)
        ]
    lines: list[str] = []
    if old.fleet != new.fleet:
        lines.append(f"~ fleet {old.fleet} -> {new.fleet}")
    if old.router != new.router:
        lines.append(f"~ router: {_fields(old.router.model_dump(), new.router.model_dump())}")
    old_slots = {s.name: s for s in old.slots()}
    new_slots = {s.name: s for s in new.slots()}
    for name in sorted(new_slots.keys() - old_slots.keys()):
        lines.append(f"+ slot {name} on {new_slots[name].host}")
    for name in sorted(old_slots.keys() - new_slots.keys()):
        lines.append(f"- slot {name} on {old_slots[name].host}")
    for name in sorted(new_slots.keys() & old_slots.keys()):
        was, now = old_slots[name].model_dump(), new_slots[name].model_dump()
        if was != now:
            lines.append(f"~ slot {name}: {_fields(was, now)}")
    for role in WORKER_ROLES:
        lines += _group_diff(old, new, role)
    for key in (
        "env",
        "secret_names",
        "volumes",
        "stop_timeout",
        "start_timeout",
        "probe",
        "scaler_metrics_port",
    ):
        if getattr(old, key) != getattr(new, key):
            lines.append(f"~ {key} changed")
    return lines


def _group_diff(old: Plan, new: Plan, role: str) -> list[str]:
    before, after = old.groups[role], new.groups[role]
    lines = []
    if before.config != after.config:
        what = [key for key in ("image", "script") if getattr(before, key) != getattr(after, key)]
        if old.secrets_digest != new.secrets_digest:
            what.append("secret values")
        lines.append(
            f"~ {role}: {', '.join(what) or 'environment/volumes'} changed: rolling update"
        )
    if (before.min, before.max) != (after.min, after.max):
        lines.append(f"~ {role}: count {before.min}..{before.max} -> {after.min}..{after.max}")
    return lines


def _fields(before: dict[str, Any], after: dict[str, Any]) -> str:
    return ", ".join(
        f"{k} {before.get(k)} -> {after.get(k)}" for k in after if before.get(k) != after.get(k)
    )


def scaler_source() -> Path:
    """pdctl's own package for the router host's scaler, as one archive (scaler_source.py)."""
    return scaler_source_archive(cache_dir() / "scaler-src")


def playbook_vars(plan: Plan) -> dict[str, Any]:
    """The plan's extra-vars, plus what pdctl itself supplies (the scaler's code and packages)."""
    return {
        **plan.extravars(),
        "pd_worker_rollout": "none",
        "pd_scaler_pdctl_src": str(scaler_source()),
        "pd_scaler_packages": scaler_requirements(),
    }


def without_hosts(plan: Plan, hosts: set[str]) -> Plan:
    """The plan with no slot on ``hosts``: what prefetching the others needs."""
    groups = {
        role: group.model_copy(update={"slots": [s for s in group.slots if s.host not in hosts]})
        for role, group in plan.groups.items()
    }
    return plan.model_copy(update={"groups": groups})


def apply(
    workspace: Workspace,
    plan: Plan,
    progress: Progress,
    *,
    dry_run: bool = False,
    converge: bool = False,
    verbosity: int = 0,
    skip: set[str] | None = None,
) -> DeployResult:
    """Converge the hosts to the plan, unless the quick check finds them as the last deploy
    left them (pdctl/drift.py); ``converge`` runs the playbooks regardless. ``skip``: hosts
    that cannot be reached, left as they are (`--skip-unreachable`)."""
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
        doc.drift = _quick_check(workspace, plan, key, inputs, progress)
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
            doc.model = prefetch.for_plan(workspace, reachable, progress)
            doc.images = image_prefetch.for_plan(workspace, reachable, progress)
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
        _raise_failures(workspace, plan, summary)
        doc.converged = True
        doc.changed_hosts = summary.changed_hosts()
        if not dry_run:
            with services.open_handle(workspace, plan, log=progress) as handle:
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


def _raise_failures(workspace: Workspace, plan: Plan, summary: runner.RunSummary) -> None:
    """A failed run's error: units that never became healthy with their own last log lines
    (secrets masked), else each host's first failed task."""
    units = unhealthy.from_run(summary, services.secret_values(plan).values())
    hint = f"fix the cause and re-run `pdctl deploy`, or undo with `pdctl destroy {plan.service}`"
    if units:
        raise unhealthy.UnhealthyUnits("deploy failed", units, hint=hint)
    failures = summary.failures()
    unreachable = summary.unreachable()
    if unreachable or failures or summary.rc != 0:
        fleet = inventory.load(workspace, plan.fleet)
        details = [fleets.unreachable_reason(fleet, h, m) for h, m in unreachable.items()]
        details += [f"{h}: {r.task}: {r.message[:300]}" for h, r in failures.items()]
        raise HostError(
            "deploy failed: " + ("; ".join(details) or f"ansible-playbook exited {summary.rc}"),
            hint=hint,
        )


def _quick_check(
    workspace: Workspace, plan: Plan, key: bytes, inputs: str, progress: Progress
) -> list[str]:
    """Why the hosts need a converge ([] when they hold what the last deploy left)."""
    record = drift.load_record(workspace, plan.service)
    if record is None or record.get("inputs") != inputs:
        return drift.compare(plan, record, inputs, {}, None)  # no need to ask the hosts
    progress(f"checking {len(plan.hosts())} host(s) against the last deploy")
    try:
        with services.open_handle(workspace, plan) as handle:
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
            paused = _scaler_unit(handle, "stop")
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
        _scaler_unit(handle, "start")
    return rolled


def _scaler_unit(handle: services.Handle, verb: str) -> bool:
    """Start or stop the service's scaler units (one per router host); False when there is
    none."""
    unit = layout.scaler_unit(handle.plan.service)
    found = False
    for host in handle.plan.router.hosts:
        target = handle.targets[host]
        if handle.pool.run(target, f"systemctl cat {unit} >/dev/null 2>&1").rc != 0:
            continue
        found = True
        result = handle.pool.run(
            target, f"sudo -n systemctl {verb} {unit}", timeout=handle.plan.stop_timeout + 90
        )
        if result.rc != 0:
            raise HostError(f"{host}: systemctl {verb} {unit} failed: {result.stderr.strip()}")
    return found


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


# `pdctl status` waits this long for a host (its unit states), then shows it unreachable.
STATUS_TIMEOUT = 10.0
LOGS_TIMEOUT = 30.0  # `pdctl logs` (without -f): one journal read


def status(workspace: Workspace, name: str) -> StatusResult:
    """The service as it runs, read live. Degrades, never fails, on hosts that do not
    answer: their replicas show "unreachable" (``unreachable`` says why); the router's and
    the scaler's parts show what could be read. ``health`` says whether the service serves."""
    plan = services.load_plan(workspace, name)
    record = services.record_state(workspace, name)
    # A deploy that did not complete may have left any part: read what is there.
    with services.open_handle(workspace, plan, need_key=False) as handle:
        states, unreachable = handle.actuator.read_states(timeout=STATUS_TIMEOUT)
        reasons = _why_failed(handle.actuator, states)
        try:
            if handle.router_problem:
                raise HostError(handle.router_problem)
            workers = {w.url.rstrip("/"): w for w in handle.router.workers()}
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


def _routers(
    plan: Plan, handle: services.Handle, router_state: str
) -> list[RouterReplicaStatus]:
    """Every router as read live (several, or an address: router_views.py); a lone router
    without an address is active unless it does not answer."""
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


def endpoint(workspace: Workspace, name: str, *, show_key: bool) -> EndpointResult:
    """Where clients reach the service and, only when asked, the router's API key.

    The URL comes from the stored plan (no host contacted). The key is read from the router
    host each time and handed to the caller only: pdctl never writes it to the workspace.
    """
    plan = services.load_plan(workspace, name)
    return EndpointResult(
        service=name,
        endpoint=services.endpoint(plan),
        endpoints=services.endpoints(plan),
        api_key=services.router_api_key(workspace, plan) if show_key else None,
    )


def find_slot(plan: Plan, which: str) -> Slot:
    group, _, index = which.partition("/")
    for slot in plan.slots():
        if slot.group == group and str(slot.index) == index:
            return slot
    names = ", ".join(s.name for s in plan.slots())
    raise InputError(f"no replica {which!r} in service {plan.service}", hint=f"replicas: {names}")


def logs(
    workspace: Workspace,
    name: str,
    which: str,
    lines: int,
    follow: bool,
    write: Callable[[str], None],
) -> None:
    plan = services.load_plan(workspace, name)
    slot = find_slot(plan, which)
    unit = slot.unit(plan.service)
    command = f"sudo -n journalctl -u {unit} -n {int(lines)} --no-pager -o short-iso"
    # Only the replica's host is contacted (not the router's): logs of a host that answers
    # never depend on one that does not.
    with services.open_handle(workspace, plan, need_key=False) as handle:
        target = handle.targets[slot.host]
        try:
            if not follow:
                result = handle.pool.run(target, command, timeout=LOGS_TIMEOUT)
                write(result.stdout)
                return
            with handle.pool.session(target) as client:
                _stdin, stdout, _stderr = client.exec_command(command + " -f", get_pty=True)
                for line in iter(stdout.readline, ""):
                    write(line)
        except PdctlError as exc:
            others = [s.name for s in plan.slots() if s.host != slot.host]
            raise HostError(
                f"{which} runs on {slot.host}, which does not answer: {exc.message}",
                hint=f"bring {slot.host} back (`pdctl status {name}` shows what it is); the "
                f"other hosts' replicas' logs still read: {', '.join(others) or 'none'}",
            ) from exc


def destroy(workspace: Workspace, name: str, progress: Progress) -> DestroyResult:
    """Undo the service on every host of its plans: the last applied one and that of a
    deploy that did not complete (hosts where nothing was applied are left as they are)."""
    plans = services.plans(workspace, name)
    if not plans:
        services.load_plan(workspace, name)  # the NotFound error, with the services known
    deregistered: list[str] = []
    try:
        with services.open_handle(workspace, plans[0], log=progress) as handle:
            if _scaler_unit(handle, "stop"):  # else it would register the workers again
                progress("stopped the scaler")
            for slot in plans[0].slots():
                if handle.router.find(slot.url) is not None:
                    progress(f"deregistering and draining {slot.name}")
                    handle.actuator.deregister(slot)
                    deregistered.append(slot.name)
    except PdctlError as exc:
        progress(f"router not reachable ({exc.message}); destroying anyway")
    hosts: set[str] = set()
    for plan in plans:
        summary = runner.run_playbook(
            "destroy.yml",
            inventory.fleet_dir(workspace, plan.fleet),
            extravars=plan.extravars(),
            progress=progress,
            forks=min(100, max(5, len(plan.hosts()))),
        )
        if summary.rc != 0:
            unreachable = [f"{h}: unreachable" for h in summary.unreachable()]
            failed = [f"{h}: {r.task}: {r.message[:200]}" for h, r in summary.failures().items()]
            raise HostError(
                f"destroy failed: {'; '.join(unreachable + failed) or summary.status}",
                hint="fix and re-run `pdctl destroy` (the service stays recorded until then)",
            )
        hosts.update(plan.hosts())
    services.forget(workspace, name)
    return DestroyResult(service=name, deregistered=deregistered, hosts=sorted(hosts))
