"""A host's RDMA NICs as the fabric check uses them, read from its stored facts. PURE.

The rails: the host's NICs of the fleet's driver, in name order (NIC i of one host is wired
to NIC i of every other, as rail-optimised fabrics are). For each: the IB port perftest
uses, whether it is RoCE (a GID index) or InfiniBand (a LID), and its line rate.

Facts are what a host said about itself: names go through hostgpus' whitelist, numbers are
bounded, and a GID index is only one the host's own GID table shows.

The line rate is ``ibv_devinfo -v``'s ``active_width`` times ``active_speed`` (rdma-core's
devinfo.c prints them as ``4X (2)`` and ``100.0 Gbps (128)``, the code in brackets), as a
data rate: the per-lane rate after line encoding (8b/10b up to QDR, 64b/66b from FDR10 on),
which is what perftest can reach. On RoCE the kernel derives both from the Ethernet speed
(ib_get_eth_speed), so a 100GbE port shows ``4X`` and ``25.0 Gbps (32)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdctl.core.fleet_model import natural_key
from pdctl.core.host_devices import FactsError, HostGpus

# active_speed's code -> Gb/s of data per lane (IB spec: SDR, DDR, QDR are 8b/10b; FDR10,
# FDR, EDR 64b/66b; HDR, NDR, XDR as their nominal rate).
LANE_GBPS = {
    1: 2.0,
    2: 4.0,
    4: 8.0,
    8: 10.0,
    16: 14.0625 * 64 / 66,
    32: 25.0,
    64: 50.0,
    128: 100.0,
    256: 200.0,
}
_WIDTH = re.compile(r"^(1|2|4|8|12)X\b")
_SPEED = re.compile(r"^(\d{1,4}(?:\.\d{1,3})?) Gbps(?: \((\d{1,4})\))?")
MAX_GID_INDEX = 255


def line_rate_gbps(width: object, speed: object) -> float | None:
    """``active_width`` x ``active_speed`` as Gb/s of data; None when either is missing or
    not a rate ("invalid speed (0)" on a port that is down)."""
    if not isinstance(width, str) or not isinstance(speed, str):
        return None
    lanes, rate = _WIDTH.match(width.strip()), _SPEED.match(speed.strip())
    if lanes is None or rate is None:
        return None
    code = int(rate.group(2)) if rate.group(2) else None
    per_lane = LANE_GBPS.get(code) if code is not None else None
    if per_lane is None:
        per_lane = float(rate.group(1))
    return round(int(lanes.group(1)) * per_lane, 3)


@dataclass(frozen=True)
class FabricNic:
    name: str
    ib_port: int = 1
    roce: bool = True  # Ethernet link layer: addressed by a GID index
    gid_index: int | None = None  # RoCE only
    rate_gbps: float | None = None  # None: the facts do not say (older facts, or port down)
    active: bool = True


def _device(facts: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    rdma = facts.get("rdma") or {}
    devices = rdma.get("devices") if isinstance(rdma, Mapping) else None
    for entry in devices if isinstance(devices, list) else []:
        if isinstance(entry, Mapping) and entry.get("name") == name:
            return entry
    return {}


def _port(device: Mapping[str, Any], number: int) -> Mapping[str, Any]:
    ports = device.get("ports")
    for entry in ports if isinstance(ports, list) else []:
        if isinstance(entry, Mapping) and entry.get("port") == number:
            return entry
    return {}


def _roce_v2_indexes(port: Mapping[str, Any]) -> list[int]:
    """The port's RoCE v2 GID indexes, IPv4-mapped first (what perftest's -x wants)."""
    found: list[tuple[int, int]] = []
    gids = port.get("gids")
    for gid in gids if isinstance(gids, list) else []:
        if not isinstance(gid, Mapping) or gid.get("kind") != "RoCE v2":
            continue
        index = gid.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            continue
        if 0 <= index <= MAX_GID_INDEX:
            address = str(gid.get("address") or "")
            found.append((0 if address.startswith("::ffff:") else 1, index))
    return [index for _, index in sorted(found)]


def _gid_index(port: Mapping[str, Any], preferred: int) -> int:
    """The fleet's GID index (MC_GID_INDEX) when the host shows it as RoCE v2, else the
    host's first RoCE v2 one, else the fleet's (perftest then says what is wrong)."""
    indexes = _roce_v2_indexes(port)
    if preferred in indexes or not indexes:
        return preferred
    return indexes[0]


def rails(facts: Mapping[str, Any] | None, driver: str | None, gid_index: int) -> list[FabricNic]:
    """The host's rails, NIC 0 first. FactsError when the facts hold what pdctl will not use."""
    facts = facts or {}
    host = HostGpus.from_facts(facts)
    nics = sorted(host.nics_for(driver), key=lambda nic: natural_key(nic.name))
    found = []
    for nic in nics:
        port = _port(_device(facts, nic.name), nic.port)
        layer = port.get("link_layer")
        if layer is not None and not isinstance(layer, str):
            raise FactsError(f"rdma.devices[{nic.name}].link_layer", f"{layer!r} is not text")
        roce = layer != "InfiniBand"
        found.append(
            FabricNic(
                name=nic.name,
                ib_port=nic.port,
                roce=roce,
                gid_index=_gid_index(port, gid_index) if roce else None,
                rate_gbps=line_rate_gbps(port.get("active_width"), port.get("active_speed")),
                active=port.get("state", "PORT_ACTIVE") == "PORT_ACTIVE",
            )
        )
    return found
