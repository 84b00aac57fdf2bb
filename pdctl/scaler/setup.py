"""Wiring a Scaler together, on the router host (the unit) or on the control node.

On the router host (``pd-<svc>-scaler.service``) the config written by the
pd_scaler role says everything: the plan, the worker hosts, the scaler's own
restricted SSH key, where the router's API key is. On the control node
(``pdctl scaler run --service S`` in a workspace) the workspace's plan and
fleet are used with the operator's SSH access, and the router is reached
through the router host.
"""

from __future__ import annotations

import json
import operator
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from pdctl.core import layout
from pdctl.core.errors import InputError
from pdctl.core.layout import Layout
from pdctl.core.plan import Plan, plan_from_extravars
from pdctl.doors import service as services
from pdctl.doors import ssh
from pdctl.doors.router import Router, tcp_connector
from pdctl.doors.session import Session
from pdctl.doors.slots import Actuator
from pdctl.doors.workspace import Workspace
from pdctl.scaler import leader, ledger_door
from pdctl.scaler.ledger_door import LedgerDoor, read_only
from pdctl.scaler.loop import Log, Scaler
from pdctl.scaler.store import Store


def default_config(service: str) -> Path:
    """Where the pd_scaler role writes the scaler's config, under the default roots."""
    return Path(Layout(service).config_file(layout.SCALER_CONFIG))


def _read_key(path: Path) -> str:
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == layout.ENV_ROUTER_API_KEY:
            return value.strip()
    raise InputError(f"{path} has no {layout.ENV_ROUTER_API_KEY}")


@contextmanager
def on_host(config_path: Path, log: Log) -> Iterator[tuple[Scaler, dict[str, Any]]]:
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the scaler config {config_path}: {exc}") from exc
    plan = plan_from_extravars(config["plan"])
    # The fleet's pins (pd_scaler copies its known_hosts): a worker without one is refused.
    pool = ssh.Pool(ssh.KnownHosts(Path(config["known_hosts"])), plan.fleet)
    # Straight to each worker, never through the fleet's jump host: the router host is on
    # the workers' network (the router itself sends them requests), and the scaler's key
    # is authorized on the workers only.
    targets = {  # hosts: {inventory name: [address, ssh port]}
        name: ssh.Target(
            address=str(address),
            port=int(port),
            user=config["ssh_user"],
            identity_file=config["identity_file"],
        )
        for name, (address, port) in config["hosts"].items()
    }
    # This host's router (config router_host: the pd_scaler role's host), else the first.
    local = plan.router.replica(str(config.get("router_host") or "")) or plan.router.replicas[0]
    key = _read_key(Path(config["api_key_file"]))
    router = Router(local.address, plan.router.port, plan.router.metrics_port, key, tcp_connector())
    # A router that is down or hung costs a call to it at most this long.
    peer_wait = plan.failover.probe_timeout
    peer_connector = tcp_connector(timeout=peer_wait)
    router.peers = [
        Router(
            r.address, plan.router.port, plan.router.metrics_port, key, peer_connector, peer_wait
        )
        for r in plan.router.replicas
        if r.host != local.host
    ]
    store = Store.directory(Path(config["state_dir"]))
    # The scaler's key is restricted to pdctl-unitctl on the worker hosts (no sudo prefix:
    # the forced command does that itself); health checks go straight to the workers, and a
    # worker whose host is gone fails its check within the probe timeout (no longer).
    probe = tcp_connector(timeout=plan.failover.probe_timeout)
    actuator = Actuator(
        plan, pool, targets, router, sudo=False, log=log, connector=lambda _t: probe
    )
    interval = config.get("interval")
    ledger = (
        ledger_door.local(Path(plan.layout.gpu_ledger(plan.fleet))) if plan.gpu_budget else None
    )
    server = None
    leadership = None
    if plan.router.several:
        leadership = _leadership(plan, local.host, key)
        # The peers pull this scaler's state from here (its host's own address).
        server = leader.serve_state(local.address, plan.scaler_metrics_port, key, store.state)
    try:
        yield (
            Scaler(
                plan,
                actuator,
                router,
                store,
                interval=float(interval) if interval not in (None, "") else None,
                log=log,
                ledger=ledger,
                leader=leadership,
            ),
            config,
        )
    finally:
        if server is not None:
            server.shutdown()
        pool.close()


def _leadership(plan: Plan, host: str, key: str) -> leader.Leadership:
    """Several routers, a scaler on each host: the one whose host holds the failover address
    acts (without an address, the first router's), the others pull its state."""
    peers = [
        f"http://{r.address}:{plan.scaler_metrics_port}"
        for r in plan.router.replicas
        if r.host != host
    ]
    failover = plan.router.failover
    if failover is not None:
        address = failover.address
        holds: Callable[[], bool] = partial(leader.holds, address)
    else:
        address = f"{plan.router.address} (the first router's: no failover address)"
        holds = partial(operator.eq, host, plan.router.host)
    return leader.Leadership(
        address=address,
        holds=holds,
        pull=partial(leader.pull_state, peers, key, plan.service),
    )


def remote_store(pool: ssh.Pool, target: ssh.Target, directory: str) -> Store:
    """Files on another host, through sudo over the pooled connection."""

    def read(name: str) -> str | None:
        result = pool.run(target, f"sudo -n cat {shlex.quote(f'{directory}/{name}')} 2>/dev/null")
        return result.stdout if result.rc == 0 else None

    def write(name: str, text: str) -> None:
        path = shlex.quote(f"{directory}/{name}")
        with pool.session(target) as client:
            ssh.run(
                client,
                f"sudo -n mkdir -p {shlex.quote(directory)} && sudo -n tee {path}.tmp >/dev/null"
                f" && sudo -n mv {path}.tmp {path}",
                stdin=text,
            )

    return Store(read, write)


@contextmanager
def from_workspace(
    workspace: Workspace,
    name: str,
    log: Log,
    interval: float | None = None,
    *,
    advise: bool = False,
) -> Iterator[Scaler]:
    """A scaler for ``name`` run from the control node, over the operator's SSH access. An
    advising one reads the acting scaler's record (its histories: the same cool-downs) and
    the fleet's GPU ledger, and writes neither."""
    plan = services.load_plan(workspace, name)
    if plan.gpu_budget is not None and not advise:
        raise InputError(
            f"{name} draws from the GPU budget of fleet {plan.fleet}, whose ledger is on "
            f"{plan.router.host}: its scaler runs there",
            hint=f"let the deployed {layout.scaler_unit(name)} act; `pdctl scaler advise "
            f"{name}` runs from here",
        )
    with Session(workspace) as session, services.open_handle(session, plan, log=log) as handle:
        store = handle_store(handle)
        ledger: LedgerDoor | None = None
        if advise:
            store = Store(store.read, lambda _name, _text: None)
            ledger = read_only(_remote_ledger(handle)) if plan.gpu_budget else None
        yield Scaler(
            plan,
            handle.actuator,
            handle.router,
            store,
            interval=interval,
            log=log,
            advise=advise or None,
            ledger=ledger,
        )


def _remote_ledger(handle: services.Handle) -> Callable[[], str | None]:
    plan = handle.plan
    directory = plan.layout.gpu_ledger_dir
    store = remote_store(handle.pool, handle.targets[plan.router.host], directory)
    return lambda: store.read(f"{plan.fleet}.json")


def handle_store(handle: services.Handle) -> Store:
    """The acting scaler's state and pins, on the router host clients reach (the failover
    address's holder), seen from the control node."""
    plan = handle.plan
    host = handle.router_host or plan.router.host
    return remote_store(handle.pool, handle.targets[host], plan.layout.state_dir)


def handle_stores(handle: services.Handle) -> dict[str, Store]:
    """Every router host's scaler store (pins go to each), the acting one's first."""
    plan = handle.plan
    hosts = [handle.router_host or plan.router.host]
    hosts += [h for h in plan.router.hosts if h not in hosts]
    return {h: remote_store(handle.pool, handle.targets[h], plan.layout.state_dir) for h in hosts}
