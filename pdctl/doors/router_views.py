"""The service's routers as they run: which one holds the failover address, which are backups,
which are down. One SSH command per router host, all at once, each within its deadline; what
a host prints is data, parsed strictly.
"""

from __future__ import annotations

import shlex
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Literal

from pdctl.core import layout
from pdctl.core.errors import HostError
from pdctl.core.plan import Plan
from pdctl.doors import ssh

RouterState = Literal["active", "backup", "down"]
VRRP_STATES = frozenset({"MASTER", "BACKUP", "FAULT", "STOP"})
READ_TIMEOUT = 10.0


@dataclass(frozen=True)
class RouterView:
    host: str
    address: str
    state: RouterState  # active: clients reach it (it holds the address, or there is none)
    unit: str  # the router unit's systemd state ("unreachable": its host did not answer)
    vrrp: str | None  # keepalived's state (MASTER, BACKUP, FAULT), None without an address
    holds_address: bool
    error: str | None = None


def _command(plan: Plan) -> str:
    unit = shlex.quote(layout.router_unit(plan.service))
    state = shlex.quote(plan.layout.keepalived_state)
    return "; ".join(
        [
            f"printf 'unit=%s\\n' \"$(systemctl is-active {unit})\"",
            f"printf 'vrrp=%s\\n' \"$(cat {state} 2>/dev/null)\"",
            "ip -o -4 addr show 2>/dev/null"
            " | while read -r _ _ _ cidr _; do printf 'addr=%s\\n' \"$cidr\"; done",
        ]
    )


def parse(plan: Plan, host: str, text: str) -> RouterView:
    """One router host's answer (``unit=``, ``vrrp=``, ``addr=`` lines) as a view."""
    replica = plan.router.replica(host)
    address = replica.address if replica else host
    unit, vrrp, addresses = "unknown", None, set()
    for line in text.splitlines()[:256]:
        key, _, value = line.partition("=")
        value = value.strip()
        if key == "unit" and value.replace("-", "").isalpha() and len(value) <= 32:
            unit = value
        elif key == "vrrp" and value in VRRP_STATES:
            vrrp = value
        elif key == "addr":
            addresses.add(value.split("/", 1)[0])
    failover = plan.router.failover
    holds = failover is not None and failover.address in addresses
    state: RouterState
    if unit != "active":
        state = "down"
    elif failover is None or holds:
        state = "active"
    else:
        state = "backup"
    return RouterView(host, address, state, unit, vrrp if failover else None, holds)


def read(
    plan: Plan, pool: ssh.Pool, targets: dict[str, ssh.Target], timeout: float = READ_TIMEOUT
) -> list[RouterView]:
    """Every router of the plan, in the plan's order; a host that does not answer in time is
    ``down`` with why."""
    command = _command(plan)
    calls = ThreadPoolExecutor(max_workers=len(plan.router.hosts))
    futures = {
        host: calls.submit(pool.run, targets[host], command, timeout=timeout)
        for host in plan.router.hosts
        if host in targets
    }
    wait_futures(list(futures.values()), timeout=timeout + 1)
    calls.shutdown(wait=False)
    views = []
    for replica in plan.router.replicas:
        future = futures.get(replica.host)
        why: str | None = None
        if future is None:
            why = "not in the fleet"
        elif not future.done():
            why = f"no answer within {timeout:g} s"
        elif isinstance(future.exception(), HostError):
            why = str(getattr(future.exception(), "message", future.exception()))
        elif future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
        if why is None and future is not None:
            views.append(parse(plan, replica.host, future.result().stdout))
        else:
            views.append(
                RouterView(replica.host, replica.address, "down", "unreachable", None, False, why)
            )
    return views


def acting(views: list[RouterView]) -> RouterView | None:
    """The router clients reach: the one holding the failover address, else the first that
    runs."""
    return next((v for v in views if v.holds_address), None) or next(
        (v for v in views if v.unit == "active"), None
    )
