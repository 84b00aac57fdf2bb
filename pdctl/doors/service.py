"""A deployed service: its stored plan, and live handles to its hosts and router.

``.pdctl/services/<name>/plan.json`` is the plan last applied (written only
after a successful deploy); ``applying.json`` the plan of a deploy that started
changing hosts and has not completed (it failed, was interrupted, or still runs).
Everything else (unit states, registrations, metrics) is read live.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdctl.core import layout, validate
from pdctl.core.errors import HostError, InputError, NotFound
from pdctl.core.fleet_model import Fleet
from pdctl.core.plan import Plan
from pdctl.core.results import RecordState
from pdctl.core.router_replicas import url
from pdctl.doors import router_views, ssh
from pdctl.doors.router import Router
from pdctl.doors.router_views import RouterView
from pdctl.doors.session import Session
from pdctl.doors.slots import Actuator
from pdctl.doors.workspace import Workspace, write_atomic

PLAN = "plan.json"  # the last deploy that completed
APPLYING = "applying.json"  # a deploy that started and has not completed
LOCK = "deploy.lock"


def state_dir(workspace: Workspace, name: str) -> Path:
    return workspace.service_dir(name)


def names(workspace: Workspace) -> list[str]:
    """The services deployed from this workspace: with a plan applied, or being applied (a
    deploy that did not complete may have changed hosts too)."""
    if not workspace.services.is_dir():
        return []
    found = {
        p.parent.name for file in (PLAN, APPLYING) for p in workspace.services.glob(f"*/{file}")
    }
    return sorted(name for name in found if validate.SERVICE_NAME.fullmatch(name))


def every_plan(workspace: Workspace) -> list[tuple[str, Plan | str]]:
    """Each service deployed from the workspace with each of its plans (that of a deploy that
    did not complete, and the last applied), or why a plan is unreadable."""
    found: list[tuple[str, Plan | str]] = []
    for name in names(workspace):
        for file in (APPLYING, PLAN):
            path = state_dir(workspace, name) / file
            if not path.is_file():
                continue
            try:
                found.append((name, Plan.model_validate_json(path.read_text())))
            except (OSError, ValueError) as exc:
                found.append((name, f"{path} is unreadable: {' '.join(str(exc).split())[:200]}"))
    return found


def _read(path: Path) -> Plan | None:
    return Plan.model_validate_json(path.read_text()) if path.is_file() else None


def stored_plan(workspace: Workspace, name: str) -> Plan | None:
    """The plan of the last deploy that completed."""
    return _read(state_dir(workspace, name) / PLAN)


def applying_plan(workspace: Workspace, name: str) -> Plan | None:
    """The plan of a deploy that started and has not completed (running, failed or killed)."""
    return _read(state_dir(workspace, name) / APPLYING)


def plans(workspace: Workspace, name: str) -> list[Plan]:
    """Every plan that may have changed hosts for the service: the applying one first."""
    found = [p for p in (applying_plan(workspace, name), stored_plan(workspace, name)) if p]
    return [p for i, p in enumerate(found) if p not in found[:i]]


def load_plan(workspace: Workspace, name: str) -> Plan:
    """The service's newest plan: a deploy's that did not complete, else the last applied."""
    found = plans(workspace, name)
    if not found:
        raise NotFound(
            f"no service named {name!r} is deployed from this workspace",
            hint=f"services: {', '.join(names(workspace)) or 'none'}; "
            "`pdctl deploy pd.yml --fleet F`",
        )
    return found[0]


def save_plan(workspace: Workspace, plan: Plan) -> None:
    text = json.dumps(plan.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    write_atomic(state_dir(workspace, plan.service) / PLAN, text)


@contextmanager
def applying(workspace: Workspace, plan: Plan) -> Iterator[None]:
    """Around a deploy that changes hosts: the plan is recorded as applying before any host
    changes, and stays so if the deploy fails, is interrupted or pdctl is killed, so that
    `status` shows it and `destroy` can undo it. A lock tells a deploy still running from
    one that died (the kernel drops it with the process)."""
    directory = state_dir(workspace, plan.service)
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / LOCK).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                f"another pdctl is deploying {plan.service} from this workspace",
                hint="wait for it to finish",
            ) from None
        text = json.dumps(plan.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        write_atomic(directory / APPLYING, text)
        yield
        (directory / APPLYING).unlink()


def record_state(workspace: Workspace, name: str) -> RecordState:
    directory = state_dir(workspace, name)
    if not (directory / APPLYING).is_file():
        return "applied"
    with (directory / LOCK).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "applying"
        fcntl.flock(lock, fcntl.LOCK_UN)
    return "failed"


def forget(workspace: Workspace, name: str) -> None:
    directory = state_dir(workspace, name)
    for item in sorted(directory.glob("*"), reverse=True):
        item.unlink()
    if directory.is_dir():
        directory.rmdir()


def secret_values(plan: Plan) -> dict[str, str]:
    """The plan's secrets, from pdctl's own environment (where pd.yml's bare KEYs came from)."""
    return {name: os.environ.get(name, "") for name in plan.secret_names}


@dataclass
class Handle:
    plan: Plan
    fleet: Fleet
    pool: ssh.Pool
    targets: dict[str, ssh.Target]
    router: Router
    actuator: Actuator
    router_problem: str | None = None  # why the router's API key could not be read
    # Several routers, or a failover address: each router as read live (router_views.py);
    # ``router`` is the one clients reach. None for a plan of one router and no address.
    routers: list[RouterView] | None = None
    router_host: str = ""  # the host of ``router``


def _router_env(plan: Plan) -> str:
    return plan.layout.config_file(layout.ROUTER_ENV)


def _api_key(pool: ssh.Pool, target: ssh.Target, path: str) -> str:
    result = pool.run(target, f"sudo -n cat {path}")
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == layout.ENV_ROUTER_API_KEY and value.strip():
            return value.strip()
    raise HostError(
        f"{target.label}: cannot read the router's API key from {path}",
        hint="re-run `pdctl deploy` to repair the router",
    )


def endpoint(plan: Plan) -> str:
    """The URL clients use: the failover address (keepalived holds it on a healthy router),
    else the first router's address, with the routers' port, from the plan."""
    router = plan.router
    return url(router.failover.address if router.failover else router.address, router.port)


def endpoints(plan: Plan) -> list[str]:
    """Every router's own URL, in the plan's order (clients that fail over themselves)."""
    return [url(replica.address, plan.router.port) for replica in plan.router.replicas]


def api_key_file(plan: Plan) -> str:
    """Where the router's API key lives, as ``host:path`` (the same key on every router
    host: the first is named)."""
    return f"{plan.router.host}:{_router_env(plan)}"


def _target(session: Session, plan: Plan, name: str) -> ssh.Target:
    if session.fleet(plan.fleet).host(name) is None:
        raise NotFound(f"host {name} of service {plan.service} is no longer in fleet {plan.fleet}")
    return session.target(plan.fleet, name)


def router_api_key(session: Session, plan: Plan) -> str:
    """The router's API key, read over SSH from a router host (the copies there are the only
    ones: pdctl keeps none): the first in the plan's order that answers."""
    targets = [_target(session, plan, host) for host in plan.router.hosts]
    return _any_key(session.pool(plan.fleet), targets, plan)


def _any_key(pool: ssh.Pool, targets: list[ssh.Target], plan: Plan) -> str:
    problem: HostError | None = None
    for target in targets:
        try:
            return _api_key(pool, target, _router_env(plan))
        except HostError as exc:
            problem = problem or exc
    assert problem is not None  # a plan has at least one router
    raise problem


@contextmanager
def open_handle(
    session: Session, plan: Plan, *, log: ssh.Log | None = None, need_key: bool = True
) -> Iterator[Handle]:
    """SSH to the plan's hosts over the session's pool, and a router client through the router
    host. ``need_key=False``: a router whose API key cannot be read (a deploy that failed before
    installing it) gives a client without one, and the reason in ``router_problem``."""
    fleet = session.fleet(plan.fleet)
    targets = {name: _target(session, plan, name) for name in plan.hosts()}
    pool = session.pool(plan.fleet)
    views = None
    chosen = plan.router.replicas[0]
    if plan.router.several or plan.router.failover:
        views = router_views.read(plan, pool, targets)
        found = router_views.acting(views)
        if found is not None:
            chosen = plan.router.replica(found.host) or chosen
    router_target = targets[chosen.host]
    key, problem = None, None
    try:
        key = _any_key(pool, [router_target, *(targets[h] for h in plan.router.hosts)], plan)
    except HostError as exc:
        if need_key:
            raise
        problem = exc.message
    router = Router(
        chosen.address,
        plan.router.port,
        plan.router.metrics_port,
        key,
        pool.connector(router_target),
    )
    # The others get every registration and removal too (a router found down is skipped: the
    # acting scaler brings it up to date when it answers again, pdctl/scaler/mirror.py).
    down = {view.host for view in views or [] if view.state == "down"}
    router.peers = [
        Router(
            replica.address,
            plan.router.port,
            plan.router.metrics_port,
            key,
            pool.connector(targets[replica.host]),
        )
        for replica in plan.router.replicas
        if replica.host not in down and replica.host != chosen.host
    ]
    yield Handle(
        plan=plan,
        fleet=fleet,
        pool=pool,
        targets=targets,
        router=router,
        router_problem=problem,
        routers=views,
        router_host=chosen.host,
        actuator=Actuator(
            plan,
            pool,
            targets,
            router,
            log=log,
            secrets=secret_values(plan).values(),
        ),
    )


def scaler_unit(handle: Handle, verb: str) -> bool:
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
