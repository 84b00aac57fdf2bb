"""The lab's private network: one bridge on this machine, a namespace and veth per host.

Hosts get an address on the bridge's /24 and no default route, so lab traffic
never leaves the bridge.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pdctl.core.errors import EnvironmentProblem
from pdctl.lab.state import LabHost, LabState
from pdctl.lab.system import quiet, run


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def ensure_bridge(state: LabState) -> None:
    if link_exists(state.bridge):
        return
    _refuse_overlap(f"{state.subnet}.0/24")
    run(["ip", "link", "add", state.bridge, "type", "bridge"])
    run(["ip", "addr", "add", f"{state.gateway}/24", "dev", state.bridge])
    run(["ip", "link", "set", state.bridge, "up"])


def _refuse_overlap(cidr: str) -> None:
    wanted = ipaddress.ip_network(cidr)
    for line in run(["ip", "-4", "route", "show"]).stdout.splitlines():
        dest = line.split()[0] if line.strip() else ""
        if dest in {"", "default"}:
            continue
        try:
            existing = ipaddress.ip_network(dest, strict=False)
        except ValueError:
            continue
        if existing.overlaps(wanted):
            raise EnvironmentProblem(
                f"the lab subnet {cidr} overlaps this machine's route `{line.strip()}`",
                hint="run `pdctl lab down` in the workspace that owns it, or free that network",
            )


def delete_bridge(state: LabState) -> None:
    if link_exists(state.bridge):
        quiet(["ip", "link", "del", state.bridge])


def plug(state: LabState, host: LabHost) -> None:
    """Create the host's namespace and wire it to the bridge (idempotent)."""
    plug_namespace(state, state.netns(host), state.veth(host), host.address)


def plug_namespace(state: LabState, ns: str, veth: str, address: str) -> None:
    """A namespace with ``eth0`` at ``address`` on the lab bridge (a host's, the hub's)."""
    unplug_namespace(ns, veth)
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", veth, "master", state.bridge, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])


def unplug(state: LabState, host: LabHost) -> None:
    unplug_namespace(state.netns(host), state.veth(host))


def unplug_namespace(ns: str, veth: str) -> None:
    if link_exists(veth):
        quiet(["ip", "link", "del", veth])
    if netns_exists(ns):
        quiet(["ip", "netns", "del", ns])


def stray_links(lab_id: int) -> list[str]:
    """Veths named like this lab's that no recorded host accounts for."""
    prefix = f"pl{lab_id}h"
    return sorted(p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(prefix))


def stray_netns(lab_id: int) -> list[str]:
    root = Path("/run/netns")
    prefix = f"pdl{lab_id}-"
    return (
        sorted(p.name for p in root.iterdir() if p.name.startswith(prefix)) if root.is_dir() else []
    )
