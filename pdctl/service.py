"""A deployed service: its stored plan, and live handles to its hosts and router.

``.pdctl/services/<name>/plan.json`` is the plan last applied (written only
after a successful deploy). Everything else (unit states, registrations,
metrics) is read live.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdctl import inventory, ssh
from pdctl.errors import HostError, NotFound
from pdctl.inventory import Fleet
from pdctl.plan import Plan
from pdctl.router import Router
from pdctl.scaler.act import Actuator
from pdctl.workspace import Workspace, write_atomic

ROUTER_ENV = "/etc/pdctl/{service}/router.env"


def state_dir(workspace: Workspace, name: str) -> Path:
    return workspace.service_dir(name)


def load_plan(workspace: Workspace, name: str) -> Plan:
    path = state_dir(workspace, name) / "plan.json"
    if not path.is_file():
        known = (
            sorted(p.parent.name for p in workspace.services.glob("*/plan.json"))
            if (workspace.services.is_dir())
            else []
        )
        raise NotFound(
            f"no service named {name!r} is deployed from this workspace",
            hint=f"services: {', '.join(known) or 'none'}; `pdctl deploy pd.yml --fleet F`",
        )
    return Plan.model_validate_json(path.read_text())


def stored_plan(workspace: Workspace, name: str) -> Plan | None:
    path = state_dir(workspace, name) / "plan.json"
    return Plan.model_validate_json(path.read_text()) if path.is_file() else None


def save_plan(workspace: Workspace, plan: Plan) -> None:
    text = json.dumps(plan.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    write_atomic(state_dir(workspace, plan.service) / "plan.json", text)


def forget(workspace: Workspace, name: str) -> None:
    directory = state_dir(workspace, name)
    for item in sorted(directory.glob("*"), reverse=True):
        item.unlink()
    if directory.is_dir():
        directory.rmdir()


@dataclass
class Handle:
    plan: Plan
    fleet: Fleet
    pool: ssh.Pool
    targets: dict[str, ssh.Target]
    router: Router
    actuator: Actuator


def _api_key(pool: ssh.Pool, target: ssh.Target, service: str) -> str:
    path = ROUTER_ENV.format(service=service)
    result = pool.run(target, f"sudo -n cat {path}")
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "PDCTL_ROUTER_API_KEY" and value.strip():
            return value.strip()
    raise HostError(
        f"{target.label}: cannot read the router's API key from {path}",
        hint="re-run `pdctl deploy` to repair the router",
    )


def endpoint(plan: Plan) -> str:
    """The URL clients use: the router's address and port from the plan."""
    return f"http://{plan.router.address}:{plan.router.port}"


def api_key_file(plan: Plan) -> str:
    """Where the router's API key lives, as ``host:path``."""
    return f"{plan.router.host}:{ROUTER_ENV.format(service=plan.service)}"


def _pool(workspace: Workspace, plan: Plan) -> ssh.Pool:
    return ssh.Pool(ssh.KnownHosts(inventory.known_hosts_file(workspace, plan.fleet)), plan.fleet)


def _target(fleet: Fleet, plan: Plan, name: str) -> ssh.Target:
    host = fleet.host(name)
    if host is None:
        raise NotFound(f"host {name} of service {plan.service} is no longer in fleet {plan.fleet}")
    return inventory.target(fleet, host)


def router_api_key(workspace: Workspace, plan: Plan) -> str:
    """The router's API key, read over SSH from its host (the one copy: pdctl keeps none)."""
    fleet = inventory.load(workspace, plan.fleet)
    target = _target(fleet, plan, plan.router.host)
    pool = _pool(workspace, plan)
    try:
        return _api_key(pool, target, plan.service)
    finally:
        pool.close()


@contextmanager
def open_handle(
    workspace: Workspace, plan: Plan, *, log: ssh.Log | None = None
) -> Iterator[Handle]:
    """Pooled SSH to the plan's hosts and a router client through the router host."""
    fleet = inventory.load(workspace, plan.fleet)
    targets = {name: _target(fleet, plan, name) for name in plan.hosts()}
    pool = _pool(workspace, plan)
    try:
        router_target = targets[plan.router.host]
        key = _api_key(pool, router_target, plan.service)
        router = Router(
            plan.router.address,
            plan.router.port,
            plan.router.metrics_port,
            key,
            pool.connector(router_target),
        )
        yield Handle(
            plan=plan,
            fleet=fleet,
            pool=pool,
            targets=targets,
            router=router,
            actuator=Actuator(plan, pool, targets, router, log=log),
        )
    finally:
        pool.close()
