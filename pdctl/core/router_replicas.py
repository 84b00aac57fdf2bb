"""Several routers for one service, and the failover address in front of them. PURE.

A router group's ``count: N`` places N SMG routers on distinct hosts (CPU hosts first), each
given every worker by pdctl (or, with ``pdctl.router.mesh``, by the others through SMG's
mesh); ``pdctl: {router: {address: IP}}`` is an address that
keepalived holds on one healthy router (roles/pd_router). Here: what the plan says of them (the
models the plan carries), the checks of the address, the routers' placement, and the URLs
clients use. Standard library and pydantic only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from pdctl.core.errors import CheckFailed
from pdctl.core.fleet_model import FleetHost

MAX_ROUTERS = 8
# SMG's own default mesh port (`smg launch --help`).
MESH_PORT = 39527


class RouterReplica(BaseModel):
    """One router: the inventory host it runs on, and the address it listens and is reached on."""

    host: str
    address: str


class FailoverAddress(BaseModel):
    """The address keepalived holds on one healthy router (VRRP: one virtual router id)."""

    address: str
    virtual_router_id: int


def check_address(value: str) -> str:
    """An IPv4 address a host can hold: not loopback, multicast, link-local or unspecified."""
    try:
        parsed = ipaddress.IPv4Address(str(value).strip())
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 address (e.g. 10.0.0.200)") from None
    if (
        parsed.is_loopback
        or parsed.is_multicast
        or parsed.is_link_local
        or parsed.is_unspecified
        or parsed.is_reserved
        or str(parsed).endswith(".255")
        or str(parsed).endswith(".0")
    ):
        raise ValueError(
            f"{parsed}: an address one host of the routers' subnet can hold (not loopback, "
            "multicast, link-local, a network's or a broadcast address)"
        )
    return str(parsed)


def virtual_router_id(address: str, chosen: int | None = None) -> int:
    """VRRP's id of the address's virtual router: ``chosen`` (the spec's), else the address's
    last octet. Two services' addresses in one /24 get two ids; in a larger subnet, set
    pdctl.router.virtual_router_id where two addresses share their last octet."""
    if chosen is not None:
        return chosen
    last = int(address.rsplit(".", 1)[1])
    return last if 1 <= last <= 254 else int(ipaddress.IPv4Address(address)) % 255 + 1


def failover(
    address: str | None, chosen_id: int | None, hosts: Sequence[tuple[str, str]]
) -> FailoverAddress | None:
    """The plan's failover address, refused when a fleet host has it as its own (``hosts``:
    each host's name and address)."""
    if address is None:
        return None
    for name, own in hosts:
        if own == address:
            raise CheckFailed(
                f"pdctl.router.address {address} is host {name}'s own address",
                hint="choose an unused address of the router hosts' subnet",
            )
    return FailoverAddress(address=address, virtual_router_id=virtual_router_id(address, chosen_id))


def place(
    count: int,
    hosts: Sequence[FleetHost],
    *,
    pinned: str | None,
    short_of: Callable[[FleetHost], str | None],
) -> list[FleetHost]:
    """``count`` distinct hosts for the routers: the pinned one first (pdctl.router.host, by
    name or address), then CPU hosts, then GPU hosts, each with the router group's cpu and
    memory minimums (``short_of`` says what a host lacks), in the hosts' order. Never two
    routers on one host."""
    chosen: list[FleetHost] = []
    if pinned:
        first = next((h for h in hosts if pinned in {h.name, h.address}), None)
        if first is None:
            raise CheckFailed(f"pdctl.router.host {pinned!r} is not a healthy host of the fleet")
        short = short_of(first)
        if short:
            raise CheckFailed(
                f"pdctl.router.host {pinned}: {short}, the router group's resources",
                hint="lower the router group's cpu/memory, or name another host",
            )
        chosen.append(first)
    for wanted in ("cpu", "gpu"):
        chosen += [
            host
            for host in hosts
            if host.kind == wanted and host not in chosen and not short_of(host)
        ][: count - len(chosen)]
    if len(chosen) == count:
        return chosen
    if not hosts:
        raise CheckFailed(
            "no healthy host in the fleet for the router", hint="pdctl fleet check FLEET"
        )
    fit = [h for h in hosts if not short_of(h)]
    if not fit:
        have = ", ".join(f"{h.name}: {short_of(h)}" for h in hosts)
        raise CheckFailed(
            f"no healthy host has the router group's resources ({have})",
            hint="lower the router group's cpu/memory, or add a host that has them",
        )
    raise CheckFailed(
        f"the router group asks for {count} routers on distinct hosts, and {len(fit)} healthy "
        "host(s) of the fleet can run one",
        hint="lower the router group's count, or add hosts (pdctl fleet add)",
    )


def url(address: str, port: int) -> str:
    return f"http://{address}:{port}"
