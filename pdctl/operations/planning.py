"""A spec placed on its fleet: what `pdctl plan` shows and `pdctl deploy` applies.

The plan is built around what the fleet's other services hold (this workspace's stored plans,
then what the hosts show of services deployed from elsewhere), shown as a table, diffed
against the plan that runs, and written as the extra-vars of playbooks/deploy.yml for a
pipeline's ansible-playbook.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdctl.core import layout
from pdctl.core.ansible_data import unsafe_yaml
from pdctl.core.errors import HostError, InputError
from pdctl.core.plan import WORKER_ROLES, Plan, Slot, build, held_by
from pdctl.core.scaling.budget import check_budgets
from pdctl.core.spec import Env, Spec, load
from pdctl.core.versions import scaler_requirements
from pdctl.doors import inventory
from pdctl.doors.session import Session
from pdctl.doors.workspace import Workspace
from pdctl.operations import drift, sharing

Progress = Callable[[str], None]


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
    session: Session,
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

    The fleet comes from ``session`` (read once for the whole command); the plan is built a
    second time only when the hosts show services no stored plan explains, to go around them.
    """
    workspace = session.workspace
    environ = os.environ if environ is None else environ
    spec, env = load(spec_path, environ)
    fleet_model = session.fleet(resolve_fleet(workspace, spec, fleet))
    key = drift.stored_key(workspace, spec.name)
    fresh = drift.new_key() if key is None and create_key else None
    digest = drift.secrets_digest(key or fresh, env.secrets, environ)
    others = sharing.stored_plans(workspace, fleet_model.name, spec.name)
    held = [h for other in others for h in held_by(other)]
    plan = build(
        spec, env, fleet_model, secrets_digest=digest, allow_partial=allow_partial, held=held
    )
    explained = {spec.name, *(other.service for other in others)}
    found = sharing.read_hosts(session, fleet_model, explained)
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
    check_budgets(plan, others)
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


def pipeline_vars(plan: Plan) -> dict[str, Any]:
    """deploy.yml's extra-vars for this plan: the plan's, and the scaler's packages at the
    versions this control node runs. `pdctl plan -o` writes them for a pipeline; `pdctl
    deploy` passes them too, so the two leave the hosts the same."""
    return {**plan.extravars(), "pd_scaler_packages": scaler_requirements()}


def write_plan_file(plan: Plan, path: Path) -> None:
    header = (
        "# pdctl plan: the extra-vars of playbooks/deploy.yml. Secrets are not in here: export\n"
        f"# {', '.join(plan.secret_names) or '(none)'} before running ansible-playbook.\n"
        "# The document is tagged !unsafe: Ansible passes every value on as written, never as a\n"
        "# template.\n"
    )
    path.write_text("---\n" + header + unsafe_yaml(pipeline_vars(plan)))


def plan_table(plan: Plan) -> list[tuple[str, ...]]:
    """One row per listener owner: the router (its port, metrics and the scaler's), each
    slot (its port, and its bootstrap, side channel and KV connector ports)."""
    router = plan.router
    mesh = f", mesh {router.mesh_port}" if router.meshed else ""
    rows: list[tuple[str, ...]] = [
        (
            "router" if not router.several else f"router/{number}",
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
