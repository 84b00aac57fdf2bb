"""rdma-core's tools: ``ibv_devices``, ``ibv_devinfo -v`` and libibverbs' provider warnings.

Parsed as rdma-core's ``device_list.c`` and ``devinfo.c`` print them (fields TAB separated;
samples in docs/facts.md and tests/data/hardware/), and the kernel driver of an RDMA device's
PCI function mapped to the libibverbs provider it needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdctl.onhost.hardware.parsing import ParseError, clip, snippet, unique


@dataclass
class Gid:
    index: int
    address: str
    kind: str  # "RoCE v2", "RoCE v1"; "" when not shown (InfiniBand, old rdma-core)


@dataclass
class RdmaPort:
    number: int
    state: str  # "PORT_ACTIVE", "PORT_DOWN", ...
    state_code: int  # 4 for PORT_ACTIVE; -1 when not printed
    link_layer: str = ""
    active_mtu: int | None = None
    gids: list[Gid] = field(default_factory=list)
    lid: int | None = None  # port_lid: non-zero once an InfiniBand subnet manager assigned one
    # `-v` only, as printed ("4X (2)", "100.0 Gbps (128)"): the line rate (pdctl/linerate.py).
    active_width: str = ""
    active_speed: str = ""

    def gid(self, index: int) -> Gid | None:
        return next((gid for gid in self.gids if gid.index == index), None)


@dataclass
class RdmaDevice:
    name: str
    node_guid: str = ""
    fw_ver: str = ""
    vendor_id: str = ""
    ports: list[RdmaPort] = field(default_factory=list)

    def port(self, number: int) -> RdmaPort | None:
        return next((port for port in self.ports if port.number == number), None)


_DEVICES_HEADER = re.compile(r"^\s*device\s+node GUID\s*$")

_DEVICES_RULE = re.compile(r"^\s*-+\s+-+\s*$")

_DEVICES_ROW = re.compile(r"^\s*(\S+)\s+([0-9a-fA-F]{16})\s*$")

_GID_LINE = re.compile(r"^GID\[\s*(\d+)\]:\s*(\S+?)(?:,\s*(.*?))?\s*$")

_CODED = re.compile(r"^(.*?)\s*\((-?\d+)\)$")

_PORT_STATES = {"PORT_DOWN": 1, "PORT_INIT": 2, "PORT_ARMED": 3, "PORT_ACTIVE": 4}

_NO_DEVICE_LINES = ("No IB devices found", "Failed to get IB devices list")


def parse_ibv_devices(stdout: str) -> list[tuple[str, str]]:
    """(device, node GUID) pairs from ``ibv_devices``; [] for the header alone."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if lines and lines[0].strip().startswith("Failed to get IB devices list"):
        raise ParseError(f"ibv_devices could not list devices: {snippet(lines[0])}")
    if not lines or not _DEVICES_HEADER.match(lines[0]):
        got = snippet(lines[0]) if lines else "empty output"
        raise ParseError(f"expected ibv_devices' header 'device  node GUID', got {got!r}")
    devices: list[tuple[str, str]] = []
    for line in lines[1:]:
        if _DEVICES_RULE.match(line):
            continue
        match = _DEVICES_ROW.match(line)
        if not match:
            raise ParseError(
                f"expected an ibv_devices row '<device> <16 hex digit GUID>', got {snippet(line)!r}"
            )
        devices.append((match.group(1), match.group(2).lower()))
    return devices


def _coded(value: str) -> tuple[str, int | None]:
    """'PORT_ACTIVE (4)' -> ('PORT_ACTIVE', 4); 'Ethernet' -> ('Ethernet', None)."""
    match = _CODED.match(value)
    if match:
        return match.group(1).strip(), int(match.group(2))
    return value.strip(), None


def _set_device_field(device: RdmaDevice, key: str, value: str) -> None:
    if key == "node_guid":
        device.node_guid = value
    elif key == "fw_ver":
        device.fw_ver = value
    elif key == "vendor_id":
        device.vendor_id = value


def _set_port_field(port: RdmaPort, key: str, value: str) -> None:
    if key == "state":
        state, code = _coded(value)
        port.state = state
        port.state_code = code if code is not None else _PORT_STATES.get(state, -1)
    elif key == "link_layer":
        port.link_layer = value
    elif key == "active_mtu":
        mtu = _coded(value)[0]
        port.active_mtu = int(mtu) if mtu.isdigit() else None
    elif key in ("active_width", "active_speed"):
        setattr(port, key, clip(value, 40))
    elif key == "port_lid":
        try:
            port.lid = int(value, 0)
        except ValueError:
            port.lid = None


def _devinfo_line(
    devices: list[RdmaDevice], line: str, number: int
) -> tuple[RdmaDevice, RdmaPort | None] | None:
    """Handle a line that opens a device or a port; None for any other line."""
    key, sep, value = (part.strip() for part in line.partition(":"))
    if key == "hca_id" and sep and value:
        devices.append(RdmaDevice(name=value))
        return devices[-1], None
    if not devices:
        if line.startswith(_NO_DEVICE_LINES):
            raise ParseError(f"ibv_devinfo found no device: {snippet(line)}")
        raise ParseError(
            f"line {number}: expected ibv_devinfo to start with 'hca_id:<TAB><device>', "
            f"got {snippet(line)!r}"
        )
    if key == "port" and sep:
        if not value.isdigit():
            raise ParseError(f"line {number}: expected a port number after 'port:', got {value!r}")
        port = RdmaPort(number=int(value), state="", state_code=-1)
        devices[-1].ports.append(port)
        return devices[-1], port
    return None


def parse_ibv_devinfo(stdout: str) -> list[RdmaDevice]:
    """Devices, ports and GID tables from ``ibv_devinfo [-v]``; [] for empty output.

    Tolerates tabs turned into spaces (copies from web pages), unknown keys, and
    rdma-core versions that print GIDs without their type.
    """
    devices: list[RdmaDevice] = []
    port: RdmaPort | None = None
    for number, raw_line in enumerate(stdout.splitlines(), 1):
        line = raw_line.strip()
        if not line:
            continue
        gid = _GID_LINE.match(line)
        if gid and port is not None:
            port.gids.append(Gid(int(gid.group(1)), gid.group(2), gid.group(3) or ""))
            continue
        opened = _devinfo_line(devices, line, number)
        if opened is not None:
            port = opened[1]
            continue
        key, sep, value = (part.strip() for part in line.partition(":"))
        if sep and port is not None:
            _set_port_field(port, key, value)
        elif sep:
            _set_device_field(devices[-1], key, value)
    for dev in devices:
        for p in dev.ports:
            if not p.state:
                raise ParseError(f"expected a 'state:' line in port {p.number} of {dev.name}")
    return devices


def provider_warnings(stderr: str) -> list[str]:
    """libibverbs' provider warnings, deduplicated, in order.

    Chiefly "couldn't load driver '<lib>': <why>", but also "Driver <x> does not
    support the kernel ABI ..." and "no userspace device-specific driver found
    ...": every way libibverbs says a device's provider is unusable.
    """
    return unique(
        line.strip()
        for line in stderr.splitlines()
        if line.strip().startswith("libibverbs: Warning")
    )


# Kernel driver of an RDMA device's PCI function -> the libibverbs provider's name (the
# <name> in lib<name>-rdmav*.so, which pdctl calls the NIC driver).
_PROVIDERS = {
    "mlx5_core": "mlx5",
    "mlx5_ib": "mlx5",
    "mlx4_core": "mlx4",
    "mlx4_ib": "mlx4",
    "bnxt_en": "bnxt_re",
    "bnxt_re": "bnxt_re",
    "ice": "irdma",
    "i40e": "irdma",
    "irdma": "irdma",
    "qede": "qedr",
    "qedr": "qedr",
    "hns3": "hns",
    "hns_roce_hw_v2": "hns",
    "mana": "mana",
    "mana_ib": "mana",
    "ionic": "ionic",
    "ionic_rdma": "ionic",
}

_NAMED_AFTER_DRIVER = re.compile(
    r"^(mlx5|mlx4|bnxt_re|irdma|qedr|efa|erdma|hns|mana|rxe|siw)_?\d+$"
)


def provider_driver(kernel_driver: str | None, device_name: str = "") -> str | None:
    """The NIC driver name pdctl uses (mlx5, bnxt_re, ...): from the kernel driver sysfs shows,
    else guessed from a device named after it (mlx5_0, bnxt_re3); None for names udev chose
    (rocep1s0f1) without sysfs."""
    if kernel_driver:
        return _PROVIDERS.get(kernel_driver, kernel_driver)
    match = _NAMED_AFTER_DRIVER.match(device_name)
    return match.group(1) if match else None
