#!/usr/bin/env python3
"""Stand-ins for the hardware tools of a GPU server: AMD MI300X with Broadcom RoCE NICs, or
NVIDIA H200/H100 with ConnectX (mlx5) NICs on InfiniBand or RoCE.

Lab hosts have no GPUs or RDMA NICs, yet pdctl's preflight and the worker
containers probe them with ``ibv_devices``, ``ibv_devinfo``, ``amd-smi`` and
``rocm-smi``. This one script answers as each of those tools (chosen by the
name it is invoked as, through symlinks) with the real tools' exact output
formats, so pdctl's parsers meet what they will meet on real servers. On NVIDIA hosts it
is also ``nvidia-smi`` and ``nvidia-ctk``; and, run at boot as ``pdlab-hardware``, it
lays out what the kernel and an admin would: the /dev/nvidia* nodes, the CDI spec, and
a sysfs PCI topology grafted over /sys (see sysfs_graft()).

What the host "has" comes from a JSON state file (``$PDFAKE_STATE``, default
/etc/pd-fake/state.json), re-read on every call so a fault injected while the
host runs shows at once. All keys are optional; unknown keys are ignored
(the SGLang stand-in reads other keys from the same file):

    host_index      1        derives NIC GUIDs, GPU serials and RoCE IPs
    gpus            8        GPU slots; 0 = CPU-only host
    gpu_model       "AMD Instinct MI300X"
    missing_gpus    []       GPU slots that have disappeared
    nics            8        bnxt_re0 .. bnxt_re{nics-1}
    missing_nics    []       device names absent from every ibverbs output
    down_ports      []       device names whose port 1 is PORT_DOWN
    amd_smi_format  "list"   or "gpu_data" (newer amd-smi wraps its JSON list)
    roce_ip_base    "192.170"  NIC k of host i has GID IPv4 {base}.{k+1}.{100+i}
    amdgpu_driver   true     false: the amdgpu module is not loaded
    vendor          "amd"    or "nvidia"
    nic_driver      "bnxt_re"  or "mlx5" (ConnectX: mlx5_0.., Mellanox ids)
    link_layer      "eth"    or "ib" (mlx5 only: InfiniBand ports with LIDs)
    nvidia_driver   true     false: the nvidia module is not loaded
    gpu_memory_mib  143771   per GPU (nvidia-smi's memory.total)
    link_width      4        the NICs' active_width, in lanes (1, 2, 4, 8, 12)
    link_speed      100.0    the NICs' active_speed per lane, Gb/s as rdma-core prints it

libibverbs loads the Broadcom provider library from its provider directory:
the file named by ``$PDFAKE_PROVIDER_LIB``, else the first existing of the
RHEL-style and Debian-style provider paths. Without it every ibverbs tool
prints libibverbs' real warning and sees no device.

Invoked as ``pdfake.py TOOL ARGS...`` it behaves as TOOL. Standard library
only: it runs on emulated hosts and in containers that have just python3.
"""

from __future__ import annotations

import getopt
import hashlib
import ipaddress
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

STATE_ENV = "PDFAKE_STATE"
DEFAULT_STATE = "/etc/pd-fake/state.json"
PROVIDER_ENV = "PDFAKE_PROVIDER_LIB"
# RHEL-style first (the host path pdctl mounts), then Debian/Ubuntu's
# multiarch directory, where ROCm containers get the library mounted.
DEFAULT_PROVIDER_DIRS = ("/usr/lib64/libibverbs", "/usr/lib/x86_64-linux-gnu/libibverbs")

TOOLS = ("ibv_devices", "ibv_devinfo", "amd-smi", "rocm-smi", "nvidia-smi", "nvidia-ctk")
SELF_NAMES = ("pdfake.py", "pdfake")
BAD_STATE_RC = 1
USAGE_RC = 2


class Result(NamedTuple):
    out: str = ""
    err: str = ""
    rc: int = 0


class StateError(Exception):
    """The state file exists but says something no real host could."""


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class State:
    host_index: int = 1
    gpus: int = 8
    gpu_model: str = "AMD Instinct MI300X"
    missing_gpus: frozenset[int] = frozenset()
    nics: int = 8
    missing_nics: frozenset[str] = frozenset()
    down_ports: frozenset[str] = frozenset()
    amd_smi_format: str = "list"
    roce_ip_base: str = "192.170"
    amdgpu_driver: bool = True
    vendor: str = "amd"
    nic_driver: str = "bnxt_re"
    link_layer: str = "eth"
    nvidia_driver: bool = True
    gpu_memory_mib: int = 143771
    link_width: int = 4
    link_speed: float = 100.0


def _get_int(raw: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise StateError(f"{key} must be an integer in {low}..{high}, got {value!r}")
    return value


def _get_str(raw: dict[str, Any], key: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not value:
        raise StateError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _get_list(raw: dict[str, Any], key: str, kind: type) -> frozenset[Any]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(
        isinstance(item, kind) and not isinstance(item, bool) for item in value
    ):
        raise StateError(f"{key} must be a list of {kind.__name__}, got {value!r}")
    return frozenset(value)


def _get_ip_base(raw: dict[str, Any]) -> str:
    base = _get_str(raw, "roce_ip_base", State.roce_ip_base)
    octets = base.split(".")
    if len(octets) != 2 or not all(o.isdigit() and int(o) <= 255 for o in octets):
        raise StateError(f"roce_ip_base must be two IPv4 octets like '192.170', got {base!r}")
    return base


def parse_state(raw: object) -> State:
    if not isinstance(raw, dict):
        raise StateError("the state file must hold a JSON object")
    fmt = _get_str(raw, "amd_smi_format", State.amd_smi_format)
    if fmt not in ("list", "gpu_data"):
        raise StateError(f"amd_smi_format must be 'list' or 'gpu_data', got {fmt!r}")
    driver = raw.get("amdgpu_driver", True)
    if not isinstance(driver, bool):
        raise StateError(f"amdgpu_driver must be true or false, got {driver!r}")
    choices = {"vendor": ("amd", "nvidia"), "nic_driver": ("bnxt_re", "mlx5")}
    choices["link_layer"] = ("eth", "ib")
    picked = {}
    for key, allowed in choices.items():
        picked[key] = _get_str(raw, key, getattr(State, key))
        if picked[key] not in allowed:
            raise StateError(f"{key} must be one of {', '.join(allowed)}, got {picked[key]!r}")
    nvidia_driver = raw.get("nvidia_driver", True)
    if not isinstance(nvidia_driver, bool):
        raise StateError(f"nvidia_driver must be true or false, got {nvidia_driver!r}")
    width = raw.get("link_width", State.link_width)
    if width not in WIDTH_CODES or isinstance(width, bool):
        raise StateError(f"link_width must be one of {sorted(WIDTH_CODES)}, got {width!r}")
    speed = raw.get("link_speed", State.link_speed)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed not in SPEED_CODES:
        raise StateError(f"link_speed must be one of {sorted(SPEED_CODES)}, got {speed!r}")
    return State(
        link_width=width,
        link_speed=float(speed),
        vendor=picked["vendor"],
        nic_driver=picked["nic_driver"],
        link_layer=picked["link_layer"],
        nvidia_driver=nvidia_driver,
        gpu_memory_mib=_get_int(raw, "gpu_memory_mib", State.gpu_memory_mib, 1, 1 << 24),
        # 155: the host's GID address ends in 100 + host_index
        host_index=_get_int(raw, "host_index", State.host_index, 0, 155),
        gpus=_get_int(raw, "gpus", State.gpus, 0, 64),
        gpu_model=_get_str(raw, "gpu_model", State.gpu_model),
        missing_gpus=_get_list(raw, "missing_gpus", int),
        nics=_get_int(raw, "nics", State.nics, 0, 254),
        missing_nics=_get_list(raw, "missing_nics", str),
        down_ports=_get_list(raw, "down_ports", str),
        amd_smi_format=fmt,
        roce_ip_base=_get_ip_base(raw),
        amdgpu_driver=driver,
    )


def load_state() -> State:
    path = Path(os.environ.get(STATE_ENV) or DEFAULT_STATE)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return State()
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return parse_state(json.loads(text))
    except json.JSONDecodeError as exc:
        raise StateError(f"{path} is not valid JSON: {exc}") from exc


def _digest(*parts: object) -> int:
    text = ":".join(str(part) for part in ("pdfake", *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


# --------------------------------------------------------------------------- ibverbs

FW_VER = "230.2.49.0"
# Broadcom's OUI is b0:26:28; a port GUID is the EUI-64 of the port's MAC.
GUID_PREFIX = 0xB22628FFFE000000
GID_TABLE_LEN = 256

DEVINFO_LONG_OPTIONS = ["ib-dev=", "ib-port=", "list", "verbose"]
DEVINFO_USAGE = """\
Usage: ibv_devinfo             print the ca attributes

Options:
  -d, --ib-dev=<dev>     use IB device <dev> (default first device found)
  -i, --ib-port=<port>   use port <port> of IB device (default all ports)
  -l, --list             print only the IB devices names
  -v, --verbose          print all the attributes of the IB device(s)
"""

_CAP_FLAGS = (
    ("CURR_QP_STATE_MOD", 1 << 7),
    ("SHUTDOWN_PORT", 1 << 8),
    ("PORT_ACTIVE_EVENT", 1 << 10),
    ("SYS_IMAGE_GUID", 1 << 11),
    ("RC_RNR_NAK_GEN", 1 << 12),
    ("SRQ_RESIZE", 1 << 13),
    ("N_NOTIFY_CQ", 1 << 14),
    ("MEM_WINDOW", 1 << 17),
    ("MEM_MGT_EXTENSIONS", 1 << 21),
    ("MEM_WINDOW_TYPE_2B", 1 << 24),
)

# What `ibv_devinfo -v` adds after phys_port_cnt, in rdma-core's layout.
_DEVICE_VERBOSE = (
    "\tmax_mr_size:\t\t\t0x8000000000",
    "\tpage_size_cap:\t\t\t0x201000",
    "\tmax_qp:\t\t\t\t65537",
    "\tmax_qp_wr:\t\t\t65407",
    f"\tdevice_cap_flags:\t\t0x{sum(bit for _, bit in _CAP_FLAGS):08x}",
    *(f"\t\t\t\t\t{name}" for name, _ in _CAP_FLAGS),
    "\tmax_sge:\t\t\t6",
    "\tmax_sge_rd:\t\t\t6",
    "\tmax_cq:\t\t\t\t131072",
    "\tmax_cqe:\t\t\t16777215",
    "\tmax_mr:\t\t\t\t262144",
    "\tmax_pd:\t\t\t\t65536",
    "\tmax_qp_rd_atom:\t\t\t126",
    "\tmax_ee_rd_atom:\t\t\t0",
    "\tmax_res_rd_atom:\t\t0",
    "\tmax_qp_init_rd_atom:\t\t126",
    "\tmax_ee_init_rd_atom:\t\t0",
    "\tatomic_cap:\t\t\tATOMIC_HCA (1)",
    "\tmax_ee:\t\t\t\t0",
    "\tmax_rdd:\t\t\t0",
    "\tmax_mw:\t\t\t\t262144",
    "\tmax_raw_ipv6_qp:\t\t0",
    "\tmax_raw_ethy_qp:\t\t0",
    "\tmax_mcast_grp:\t\t\t0",
    "\tmax_mcast_qp_attach:\t\t0",
    "\tmax_total_mcast_qp_attach:\t0",
    "\tmax_ah:\t\t\t\t131072",
    "\tmax_fmr:\t\t\t0",
    "\tmax_srq:\t\t\t8192",
    "\tmax_srq_wr:\t\t\t1048574",
    "\tmax_srq_sge:\t\t\t6",
    "\tmax_pkeys:\t\t\t1",
    "\tlocal_ca_ack_delay:\t\t16",
    "\tgeneral_odp_caps:",
    "\trc_odp_caps:",
    "\t\t\t\t\tNO SUPPORT",
    "\tuc_odp_caps:",
    "\t\t\t\t\tNO SUPPORT",
    "\tud_odp_caps:",
    "\t\t\t\t\tNO SUPPORT",
    "\txrc_odp_caps:",
    "\t\t\t\t\tNO SUPPORT",
    "\tcompletion_timestamp_mask not supported",
    "\tcore clock not supported",
    "\tdevice_cap_flags_ex:\t\t0x0",
    "\ttso_caps:",
    "\tmax_tso:\t\t\t0",
    "\trss_caps:",
    "\t\tmax_rwq_indirection_tables:\t\t\t0",
    "\t\tmax_rwq_indirection_table_size:\t\t\t0",
    "\t\trx_hash_function:\t\t\t\t0x0",
    "\t\trx_hash_fields_mask:\t\t\t\t0x0",
    "\tmax_wq_type_rq:\t\t\t0",
    "\tpacket_pacing_caps:",
    "\t\tqp_rate_limit_min:\t0kbps",
    "\t\tqp_rate_limit_max:\t0kbps",
    "\ttag matching not supported",
    "\tnum_comp_vectors:\t\t32",
)


@dataclass(frozen=True)
class Nic:
    index: int
    name: str
    guid: int
    active: bool
    ipv4: str
    driver: str = "bnxt_re"
    link_layer: str = "eth"
    lid: int = 0  # InfiniBand: given by the subnet manager
    width: int = 4  # lanes
    speed: float = 100.0  # Gb/s per lane, as printed


# rdma-core's devinfo.c: active_width's lanes and active_speed's Gb/s per lane, by the code
# printed next to them; and the per-lane data rate after line encoding (8b/10b up to QDR,
# 64b/66b from FDR10 on), what the perftest stand-in paces itself to (pdperf.py).
WIDTH_CODES = {1: 1, 4: 2, 8: 4, 12: 8, 2: 16}
SPEED_CODES = {2.5: 1, 5.0: 2, 10.0: 8, 14.0: 16, 25.0: 32, 50.0: 64, 100.0: 128, 200.0: 256}
LANE_DATA_GBPS = {1: 2.0, 2: 4.0, 4: 8.0, 8: 10.0, 16: 14.0625 * 64 / 66, 32: 25.0, 64: 50.0}
LANE_DATA_GBPS.update({128: 100.0, 256: 200.0})


def data_rate_gbps(nic: Nic) -> float:
    """What the NIC moves at most, in Gb/s of data."""
    return nic.width * LANE_DATA_GBPS[SPEED_CODES[nic.speed]]


@dataclass(frozen=True)
class NicModel:
    """What a NIC family prints: ConnectX-7 (mlx5) or Broadcom P2100G/Thor (bnxt_re)."""

    prefix: str
    guid_prefix: int
    fw_ver: str
    vendor_id: str
    vendor_part_id: int
    hw_ver: str
    pci_vendor: str
    pci_device: str
    kernel_driver: str  # the PCI function's driver, as sysfs shows it


NIC_MODELS = {
    "bnxt_re": NicModel(
        "bnxt_re", GUID_PREFIX, FW_VER, "0x14e4", 5984, "0x1D42", "0x14e4", "0x1760", "bnxt_en"
    ),
    # Mellanox's OUI 94:6d:ae; ConnectX-7 is PCI device 0x1021 (vendor_part_id 4129).
    "mlx5": NicModel(
        "mlx5_",
        0x946DAE0300000000,
        "28.39.1002",
        "0x02c9",
        4129,
        "0x0",
        "0x15b3",
        "0x1021",
        "mlx5_core",
    ),
}
IB_SM_LID = 1


def nic_guid(host_index: int, nic: int, prefix: int = GUID_PREFIX) -> int:
    return prefix | (host_index & 0xFF) << 16 | (nic & 0xFF) << 8 | 0xF0


def nic_name(state: State, k: int) -> str:
    return f"{NIC_MODELS[state.nic_driver].prefix}{k}"


def present_nics(state: State) -> list[Nic]:
    model = NIC_MODELS[state.nic_driver]
    nics = []
    for k in range(state.nics):
        name = nic_name(state, k)
        if name in state.missing_nics:
            continue
        ipv4 = f"{state.roce_ip_base}.{k + 1}.{100 + state.host_index}"
        guid = nic_guid(state.host_index, k, model.guid_prefix)
        layer = state.link_layer if state.nic_driver == "mlx5" else "eth"
        # LIDs unique across the fabric: one block of 64 per host.
        lid = 64 * state.host_index + k + 2 if layer == "ib" else 0
        active = name not in state.down_ports
        nics.append(
            Nic(
                k,
                name,
                guid,
                active,
                ipv4,
                state.nic_driver,
                layer,
                lid,
                state.link_width,
                state.link_speed,
            )
        )
    return nics


def provider_soname(state: State) -> str:
    return f"lib{state.nic_driver}-rdmav34.so"


def provider_present(state: State) -> bool:
    override = os.environ.get(PROVIDER_ENV)
    if override:
        return Path(override).is_file()
    soname = provider_soname(state)
    return any((Path(d) / soname).is_file() for d in DEFAULT_PROVIDER_DIRS)


def get_device_list(state: State) -> tuple[list[Nic], str]:
    """What ibv_get_device_list() returns, and what libibverbs warns on stderr."""
    nics = present_nics(state)
    # libibverbs only goes looking for a provider when sysfs shows a device.
    if nics and not provider_present(state):
        soname = provider_soname(state)
        warning = (
            f"libibverbs: Warning: couldn't load driver '{soname}': "
            f"{soname}: cannot open shared object file: No such file or directory\n"
        )
        return [], warning
    return nics, ""


def ibv_devices(_args: Sequence[str], state: State) -> Result:
    # The real ibv_devices parses no options at all.
    nics, warning = get_device_list(state)
    lines = [f"    {'device':<16}\t   node GUID", f"    {'------':<16}\t----------------"]
    lines += [f"    {nic.name:<16}\t{nic.guid:016x}" for nic in nics]
    return Result("\n".join(lines) + "\n", warning)


def guid_groups(guid: int) -> str:
    return ":".join(f"{guid >> shift & 0xFFFF:04x}" for shift in (48, 32, 16, 0))


def ntop6(raw: bytes) -> str:
    """inet_ntop(AF_INET6): IPv4-mapped addresses end in dotted quad."""
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in raw[12:])
    return ipaddress.IPv6Address(raw).compressed


def gid_lines(nic: Nic) -> list[str]:
    """RoCE v1 GIDs print in full hex, v2 GIDs through inet_ntop (rdma-core devinfo.c);
    an InfiniBand port's GIDs in full hex without a type."""
    link_local = b"\xfe\x80" + b"\0" * 6 + nic.guid.to_bytes(8, "big")
    if nic.link_layer == "ib":
        full = ":".join(link_local[i : i + 2].hex() for i in range(0, 16, 2))
        return [f"\t\t\tGID[{0:3d}]:\t\t{full}"]
    gids = [link_local]
    if nic.active:  # the interface's IPv4 address leaves the GID table with the link
        gids.append(b"\0" * 10 + b"\xff\xff" + ipaddress.IPv4Address(nic.ipv4).packed)
    lines = []
    for pair, raw in enumerate(gids):
        full = ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))
        lines.append(f"\t\t\tGID[{2 * pair:3d}]:\t\t{full}, RoCE v1")
        lines.append(f"\t\t\tGID[{2 * pair + 1:3d}]:\t\t{ntop6(raw)}, RoCE v2")
    return lines


def port_lines(nic: Nic, verbose: bool) -> list[str]:
    state, mtu, phys = ("PORT_ACTIVE (4)", "4096 (5)", "LINK_UP (5)")
    if not nic.active:
        state, mtu, phys = ("PORT_DOWN (1)", "1024 (3)", "DISABLED (3)")
    ib = nic.link_layer == "ib"
    # A port whose link is down has no speed (devinfo.c's speed_str of 0).
    code = SPEED_CODES[nic.speed]
    speed = f"{nic.speed:.1f} Gbps ({code})" if nic.active else "invalid speed (0)"
    # A down InfiniBand port has no LID: the subnet manager assigns one once the link is up.
    sm_lid, port_lid = (IB_SM_LID, nic.lid) if ib and nic.active else (0, 0)
    lines = [
        "\t\tport:\t1",
        f"\t\t\tstate:\t\t\t{state}",
        "\t\t\tmax_mtu:\t\t4096 (5)",
        f"\t\t\tactive_mtu:\t\t{mtu}",
        f"\t\t\tsm_lid:\t\t\t{sm_lid}",
        f"\t\t\tport_lid:\t\t{port_lid}",
        "\t\t\tport_lmc:\t\t0x00",
        f"\t\t\tlink_layer:\t\t{'InfiniBand' if ib else 'Ethernet'}",
    ]
    if verbose:
        lines += [
            "\t\t\tmax_msg_sz:\t\t0x7fffffff",
            "\t\t\tport_cap_flags:\t\t0x041d0000",
            "\t\t\tport_cap_flags2:\t0x0000",
            "\t\t\tmax_vl_num:\t\t8 (4)",
            "\t\t\tbad_pkey_cntr:\t\t0x0",
            "\t\t\tqkey_viol_cntr:\t\t0x0",
            "\t\t\tsm_sl:\t\t\t0",
            "\t\t\tpkey_tbl_len:\t\t1",
            f"\t\t\tgid_tbl_len:\t\t{GID_TABLE_LEN}",
            "\t\t\tsubnet_timeout:\t\t0",
            "\t\t\tinit_type_reply:\t0",
            f"\t\t\tactive_width:\t\t{nic.width}X ({WIDTH_CODES[nic.width]})",
            f"\t\t\tactive_speed:\t\t{speed}",
            f"\t\t\tphys_state:\t\t{phys}",
            *gid_lines(nic),
        ]
    return lines


def devinfo_block(nic: Nic, verbose: bool) -> str:
    guid = guid_groups(nic.guid)
    model = NIC_MODELS[nic.driver]
    lines = [
        f"hca_id:\t{nic.name}",
        "\ttransport:\t\t\tInfiniBand (0)",
        f"\tfw_ver:\t\t\t\t{model.fw_ver}",
        f"\tnode_guid:\t\t\t{guid}",
        f"\tsys_image_guid:\t\t\t{guid}",
        f"\tvendor_id:\t\t\t{model.vendor_id}",
        f"\tvendor_part_id:\t\t\t{model.vendor_part_id}",
        f"\thw_ver:\t\t\t\t{model.hw_ver}",
        "\tphys_port_cnt:\t\t\t1",
    ]
    if verbose:
        lines += _DEVICE_VERBOSE
    lines += port_lines(nic, verbose)
    return "\n".join(lines) + "\n\n"  # every port block ends with an empty line


def devinfo_list(state: State) -> Result:
    nics, warning = get_device_list(state)
    plural = "" if len(nics) == 1 else "s"
    out = f"{len(nics)} HCA{plural} found:\n" + "".join(f"\t{n.name}\n" for n in nics) + "\n"
    return Result(out, warning)


def _getopt_error(tool: str, exc: getopt.GetoptError) -> str:
    """glibc getopt_long's wording, which Python's getopt does not reproduce."""
    opt = exc.opt
    if "requires argument" in exc.msg:
        return f"{tool}: option requires an argument -- '{opt}'\n"
    if len(opt) > 1:
        return f"{tool}: unrecognized option '--{opt}'\n"
    return f"{tool}: invalid option -- '{opt}'\n"


def _port_arg(value: str) -> int:
    try:
        return int(value, 0)
    except ValueError:
        return 0  # strtol() stops at the first bad character


def ibv_devinfo(args: Sequence[str], state: State) -> Result:
    tool = "ibv_devinfo"
    try:
        opts, _ = getopt.gnu_getopt(list(args), "d:i:lv", DEVINFO_LONG_OPTIONS)
    except getopt.GetoptError as exc:
        return Result(DEVINFO_USAGE, _getopt_error(tool, exc), 255)
    device, port, verbose = None, 0, False
    for opt, value in opts:
        if opt in ("-l", "--list"):
            return devinfo_list(state)  # getopt_long order: -l answers at once
        if opt in ("-d", "--ib-dev"):
            device = value
        elif opt in ("-i", "--ib-port"):
            port = _port_arg(value)
            if port <= 0:
                return Result(DEVINFO_USAGE, "", 1)
        else:
            verbose = True
    return _devinfo_devices(state, device, port, verbose)


def _devinfo_devices(state: State, device: str | None, port: int, verbose: bool) -> Result:
    nics, err = get_device_list(state)
    if device is not None:
        nics = [nic for nic in nics if nic.name == device]
        if not nics:
            return Result("", err + f"IB device '{device}' wasn't found\n", 255)
    elif not nics:
        return Result("", err + "No IB devices found\n", 255)
    if port > 1:  # bnxt_re devices have a single port
        return Result("", err + "Invalid port requested for device\n" * len(nics), 4)
    return Result("".join(devinfo_block(nic, verbose) for nic in nics), err)


# --------------------------------------------------------------------------- GPUs

DEVICE_ID = "0x74a1"
VENDOR_ID = "0x1002"
GFX_VERSION = "gfx942"
CARD_SKU = "M3000100"
CARD_VENDOR = "Advanced Micro Devices, Inc. [AMD/ATI]"
# PCI buses of the eight OAM slots on common MI300X platforms.
SLOT_BUSES = (0x05, 0x26, 0x46, 0x65, 0x85, 0xA6, 0xC6, 0xE5)
FIRST_GPU_NODE = 2  # KFD topology nodes 0 and 1 are the two CPU sockets


@dataclass(frozen=True)
class Gpu:
    slot: int  # physical slot (OAM id): keeps its number when another GPU vanishes
    index: int  # enumeration index: amd-smi and rocm-smi number present GPUs 0..n-1
    bdf: str
    serial: int
    kfd_id: int

    @property
    def node_id(self) -> int:
        return FIRST_GPU_NODE + self.index

    @property
    def uuid(self) -> str:
        s = self.serial
        low48 = s & (1 << 48) - 1
        return f"{s >> 56:02x}ff{DEVICE_ID[2:]}-0000-1000-80{s >> 48 & 0xFF:02x}-{low48:012x}"


# PCI buses of the eight SXM GPUs on common HGX H100/H200 boards.
NVIDIA_SLOT_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def _buses(vendor: str) -> tuple[int, ...]:
    return NVIDIA_SLOT_BUSES if vendor == "nvidia" else SLOT_BUSES


def slot_bdf(slot: int, vendor: str = "amd") -> str:
    buses = _buses(vendor)
    return f"{slot // len(buses):04x}:{buses[slot % len(buses)]:02x}:00.0"


@dataclass(frozen=True)
class SlotTopology:
    """Slot k's PCIe: a root port, a switch, GPU k and NIC k on two of its downstream ports.

    GPU k's bus is b: root port (b-3):01.0 under host bridge pci<domain>:(b-3), switch
    upstream port (b-2):00.0, downstream ports (b-1):00.0 (GPU) and (b-1):01.0 (NIC), the GPU
    at b:00.0 and the NIC at (b+1):00.0. Slots 0-3 sit on NUMA node 0, 4-7 on node 1.
    """

    host_bridge: str  # pci0000:15
    gpu_path: tuple[str, ...]  # root port .. GPU
    nic_path: tuple[str, ...]  # root port .. NIC
    numa: int

    @property
    def gpu(self) -> str:
        return self.gpu_path[-1]

    @property
    def nic(self) -> str:
        return self.nic_path[-1]


def slot_topology(slot: int, vendor: str) -> SlotTopology:
    buses = _buses(vendor)
    domain, bus = slot // len(buses), buses[slot % len(buses)]

    def bdf(b: int, device: int = 0) -> str:
        return f"{domain:04x}:{b:02x}:{device:02x}.0"

    common = (bdf(bus - 3, 1), bdf(bus - 2))
    return SlotTopology(
        host_bridge=f"pci{domain:04x}:{bus - 3:02x}",
        gpu_path=(*common, bdf(bus - 1), bdf(bus)),
        nic_path=(*common, bdf(bus - 1, 1), bdf(bus + 1)),
        numa=0 if slot % len(buses) < len(buses) // 2 else 1,
    )


def _kfd_ids(state: State) -> list[int]:
    """KFD gpu_ids: 16-bit hashes, distinct on one host, independent of missing GPUs."""
    ids: list[int] = []
    for slot in range(state.gpus):
        kfd_id = 1 + _digest("kfd", state.host_index, slot) % 65534
        while kfd_id in ids:
            kfd_id = kfd_id % 65534 + 1
        ids.append(kfd_id)
    return ids


def present_gpus(state: State) -> list[Gpu]:
    kfd_ids = _kfd_ids(state)
    slots = [s for s in range(state.gpus) if s not in state.missing_gpus]
    return [
        Gpu(
            slot,
            index,
            slot_bdf(slot, state.vendor),
            _digest("serial", state.host_index, slot_bdf(slot, state.vendor)),
            kfd_ids[slot],
        )
        for index, slot in enumerate(slots)
    ]


def amd_list_record(gpu: Gpu) -> dict[str, Any]:
    return {
        "gpu": gpu.index,
        "bdf": gpu.bdf,
        "uuid": gpu.uuid,
        "kfd_id": gpu.kfd_id,
        "node_id": gpu.node_id,
        "partition_id": 0,
    }


def amd_asic_record(gpu: Gpu, state: State) -> dict[str, Any]:
    asic = {
        "market_name": state.gpu_model,
        "vendor_id": VENDOR_ID,
        "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
        "subvendor_id": VENDOR_ID,
        "device_id": DEVICE_ID,
        "subsystem_id": DEVICE_ID,
        "rev_id": "0x00",
        "asic_serial": f"0x{gpu.serial:016X}",
        "oam_id": gpu.slot,
        "num_compute_units": 304,
        "target_graphics_version": GFX_VERSION,
    }
    return {"gpu": gpu.index, "asic": asic}


def amd_text(records: list[dict[str, Any]]) -> str:
    """amd-smi's human-readable form: upper-cased keys, four spaces a level."""

    def lines(data: dict[str, Any], depth: int) -> list[str]:
        out = []
        for key, value in data.items():
            pad = "    " * depth
            if isinstance(value, dict):
                out += [f"{pad}{key.upper()}:", *lines(value, depth + 1)]
            else:
                out.append(f"{pad}{key.upper()}: {value}")
        return out

    blocks = []
    for record in records:
        rest = {k: v for k, v in record.items() if k != "gpu"}
        blocks.append("\n".join([f"GPU: {record['gpu']}", *lines(rest, 1)]) + "\n\n")
    return "".join(blocks)


AMD_USAGE = "usage: amd-smi [-h] {list,static} ...\n"
AMD_NO_DRIVER = (
    "ERROR:root:Unable to get devices, driver not initialized (amdgpu not found in modules)\n"
    "ERROR:root:Unable to detect any GPU devices, check amdgpu version and module status\n"
)


def amd_smi(args: Sequence[str], state: State) -> Result:
    if not args or args[0] not in ("list", "static"):
        got = args[0] if args else ""
        return Result("", AMD_USAGE + f"amd-smi: error: invalid choice: '{got}'\n", USAGE_RC)
    command, flags = args[0], set(args[1:])
    allowed = {"--json"} | ({"--asic", "-a"} if command == "static" else set())
    if flags - allowed:
        bad = " ".join(sorted(flags - allowed))
        return Result("", AMD_USAGE + f"amd-smi: error: unrecognized arguments: {bad}\n", USAGE_RC)
    if not state.amdgpu_driver:
        return Result("", AMD_NO_DRIVER, 255)
    gpus = present_gpus(state)
    if command == "list":
        records = [amd_list_record(gpu) for gpu in gpus]
    else:
        records = [amd_asic_record(gpu, state) for gpu in gpus]
    if "--json" not in flags:
        return Result(amd_text(records))
    payload: object = {"gpu_data": records} if state.amd_smi_format == "gpu_data" else records
    return Result(json.dumps(payload, indent=4) + "\n")


ROCM_WIDTH = 90
ROCM_USAGE = "usage: rocm-smi [-h] [-d DEVICE [DEVICE ...]] [-i] [--showproductname] [--json]\n"
ROCM_NO_DRIVER = "ERROR:root:Driver not initialized (amdgpu not found in modules)\n"
ROCM_FLAGS = {"-i": "id", "--showid": "id", "--showproductname": "product", "--json": "json"}


def rocm_spacer(title: str = "") -> str:
    if title and len(title) % 2:
        title += "="
    side = "=" * ((ROCM_WIDTH - len(title)) // 2)
    return f"{side}{title}{side}\n" if title else "=" * ROCM_WIDTH + "\n"


def rocm_id_fields(gpu: Gpu, state: State) -> list[tuple[str, str, str]]:
    """(key, text-form padding, value) as rocm-smi's showId prints them."""
    return [
        ("Device Name", "\t\t", state.gpu_model),
        ("Device ID", "\t\t", DEVICE_ID),
        ("Device Rev", "\t\t", "0x00"),
        ("Subsystem ID", "\t", DEVICE_ID),
        ("GUID", "\t\t", str(gpu.kfd_id)),
    ]


def rocm_product_fields(gpu: Gpu, state: State) -> list[tuple[str, str, str]]:
    return [
        ("Card Series", "\t\t", state.gpu_model),
        ("Card Model", "\t\t", DEVICE_ID),
        ("Card Vendor", "\t\t", CARD_VENDOR),
        ("Card SKU", "\t\t", CARD_SKU),
        ("Subsystem ID", "\t", DEVICE_ID),
        ("Device Rev", "\t\t", "0x00"),
        ("Node ID", "\t\t", str(gpu.node_id)),
        ("GUID", "\t\t", str(gpu.kfd_id)),
        ("GFX Version", "\t\t", GFX_VERSION),
    ]


RocmSection = tuple[str, Callable[[Gpu, State], list[tuple[str, str, str]]]]
ROCM_SECTIONS: dict[str, RocmSection] = {
    "id": (" ID ", rocm_id_fields),
    "product": (" Product Info ", rocm_product_fields),
}


def rocm_smi(args: Sequence[str], state: State) -> Result:
    unknown = [a for a in args if a not in ROCM_FLAGS]
    wanted = {ROCM_FLAGS[a] for a in args if a in ROCM_FLAGS}
    if unknown or not wanted - {"json"}:  # the bare concise view is not emulated
        bad = " ".join(unknown) or "(no --show option)"
        return Result(
            "", ROCM_USAGE + f"rocm-smi: error: unrecognized arguments: {bad}\n", USAGE_RC
        )
    if not state.amdgpu_driver:
        return Result("", ROCM_NO_DRIVER, 0)  # yes, rocm-smi exits 0 here
    gpus = present_gpus(state)
    warning = "" if gpus else "WARNING: No AMD GPUs specified\n"
    sections = [ROCM_SECTIONS[name] for name in ("id", "product") if name in wanted]
    if "json" in wanted:
        return _rocm_json(gpus, state, sections, warning)
    return Result(_rocm_text(gpus, state, sections), warning)


def _rocm_json(gpus: list[Gpu], state: State, sections: list[RocmSection], warning: str) -> Result:
    data: dict[str, dict[str, str]] = {}
    for gpu in gpus:
        card = data.setdefault(f"card{gpu.index}", {})
        for _, fields in sections:
            card.update({key: value for key, _, value in fields(gpu, state)})
    if not data:
        return Result("", warning + "WARNING: No JSON data to report\n", 0)
    return Result(json.dumps(data) + "\n", warning)


def _rocm_text(gpus: list[Gpu], state: State, sections: list[RocmSection]) -> str:
    parts = ["\n\n", rocm_spacer(" ROCm System Management Interface ")]
    for title, fields in sections:
        parts.append(rocm_spacer(title))
        for gpu in gpus:
            parts += [
                f"GPU[{gpu.index}]\t\t: {key}: {pad}{value}\n"
                for key, pad, value in fields(gpu, state)
            ]
        parts.append(rocm_spacer())
    parts.append(rocm_spacer(" End of ROCm SMI Log "))
    return "".join(parts)


# --------------------------------------------------------------------------- NVIDIA

NVIDIA_DRIVER_VERSION = "570.211.01"
CUDA_VERSION = "12.8"
NVIDIA_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
    "that the latest NVIDIA driver is installed and running.\n\n"
)
NVIDIA_RC_NO_DRIVER = 9
NVIDIA_USAGE = (
    "NVIDIA System Management Interface -- v" + NVIDIA_DRIVER_VERSION + "\n\n"
    "nvidia-smi [OPTION1 [ARG1]] [OPTION2 [ARG2]] ...\n"
)
# memory.* print in MiB; the header carries the unit (nounits drops it from the values only).
NVIDIA_FIELDS = (
    "index",
    "name",
    "uuid",
    "serial",
    "memory.total",
    "memory.used",
    "memory.free",
    "driver_version",
    "pci.bus_id",
    "count",
)
CPU_AFFINITY = ("0-47,96-143", "48-95,144-191")
NV_LINKS = "NV18"  # H100/H200 SXM: 18 NVLinks to the NVSwitches
DEV_DIR = "/dev"
CDI_DIRS_ENV = "PDFAKE_CDI_DIRS"
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
CDI_SPEC = "/etc/cdi/nvidia.yaml"
CTK_VERSION = "1.17.8"
CTK_COMMIT = "f202b80a9b9d0db00d9b1d73c0128c8962c55f4d"


def gpu_uuid(state: State, slot: int) -> str:
    h = hashlib.sha256(f"pdfake:nvidia:{state.host_index}:{slot}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def nvidia_bus_id(bdf: str) -> str:
    """0000:18:00.0 -> 00000000:18:00.0, as nvidia-smi prints it."""
    domain, rest = bdf.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def nvidia_value(gpu: Gpu, state: State, name: str, units: bool) -> str:
    mib = " MiB" if units else ""
    values = {
        "index": str(gpu.index),
        "name": state.gpu_model,
        "uuid": gpu_uuid(state, gpu.slot),
        "serial": str(1650000000000 + gpu.serial % 10**9),
        "memory.total": f"{state.gpu_memory_mib}{mib}",
        "memory.used": f"0{mib}",
        "memory.free": f"{state.gpu_memory_mib - 490}{mib}",
        "driver_version": NVIDIA_DRIVER_VERSION,
        "pci.bus_id": nvidia_bus_id(gpu.bdf),
        "count": str(len(present_gpus(state))),
    }
    return values[name]


def _query(args: Sequence[str]) -> tuple[list[str], list[str], str | None] | str:
    """(fields, format options, -i id) from nvidia-smi's arguments, or an error text."""
    fields: list[str] = []
    formats: list[str] = []
    gpu_id = None
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--query-gpu", "--format", "-i", "--id") and not eq:
            value = next(it, "")
        if key == "--query-gpu":
            fields = [f.strip() for f in value.split(",") if f.strip()]
        elif key == "--format":
            formats = [f.strip() for f in value.split(",") if f.strip()]
        elif key in ("-i", "--id"):
            gpu_id = value
        else:
            return "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
    if not fields:
        return "Missing --query-gpu fields\n"
    for name in fields:
        if name not in NVIDIA_FIELDS:
            return f'Field "{name}" is not a valid field to query.\n\n'
    if "csv" not in formats or set(formats) - {"csv", "noheader", "nounits"}:
        return '"--format=" switch is missing or invalid: use csv[,noheader][,nounits]\n'
    return fields, formats, gpu_id


def nvidia_query(args: Sequence[str], state: State) -> Result:
    parsed = _query(args)
    if isinstance(parsed, str):
        return Result(parsed, "", 2)
    fields, formats, gpu_id = parsed
    gpus = present_gpus(state)
    if gpu_id is not None:
        gpus = [g for g in gpus if str(g.index) == gpu_id or gpu_uuid(state, g.slot) == gpu_id]
        if not gpus:
            return Result("No devices were found\n", "", 6)
    units = "nounits" not in formats
    lines = []
    if "noheader" not in formats:
        lines.append(", ".join(f"{n} [MiB]" if n.startswith("memory.") else n for n in fields))
    lines += [", ".join(nvidia_value(g, state, n, units) for n in fields) for g in gpus]
    return Result("".join(line + "\n" for line in lines))


def nvidia_list(state: State) -> Result:
    gpus = present_gpus(state)
    return Result(
        "".join(
            f"GPU {g.index}: {state.gpu_model} (UUID: {gpu_uuid(state, g.slot)})\n" for g in gpus
        )
    )


def _topo_cell(a: SlotTopology, b: SlotTopology, a_gpu: bool, b_gpu: bool) -> str:
    if a_gpu and b_gpu:
        return NV_LINKS
    if a.host_bridge == b.host_bridge:
        return "PXB"  # through the slot's switch, not the host bridge
    return "NODE" if a.numa == b.numa else "SYS"


TOPO_LEGEND = "".join(
    [
        "\nLegend:\n\n",
        "  X    = Self\n",
        "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes "
        "(e.g., QPI/UPI)\n",
        "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host "
        "Bridges within a NUMA node\n",
        "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n",
        "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host "
        "Bridge)\n",
        "  PIX  = Connection traversing at most a single PCIe bridge\n",
        "  NV#  = Connection traversing a bonded set of # NVLinks\n",
    ]
)


def nvidia_topo(state: State) -> Result:
    """``nvidia-smi topo -m``: the GPU/NIC matrix, consistent with the sysfs topology."""
    gpus = present_gpus(state)
    nics = present_nics(state)
    items = [(f"GPU{g.index}", slot_topology(g.slot, "nvidia"), True) for g in gpus]
    items += [(f"NIC{i}", slot_topology(n.index, "nvidia"), False) for i, n in enumerate(nics)]
    head = [name for name, _, _ in items] + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    lines = ["\t" + "\t".join(head)]
    for name, topo, is_gpu in items:
        cells = [
            " X " if other == name else _topo_cell(topo, t, is_gpu, g) for other, t, g in items
        ]
        if is_gpu:
            cells += [CPU_AFFINITY[topo.numa], str(topo.numa), "\tN/A"]
        lines.append(name + "\t" + "\t".join(cells))
    legend = "".join(f"  NIC{i}: {n.name}\n" for i, n in enumerate(nics))
    return Result("\n".join(lines) + "\n" + TOPO_LEGEND + "\nNIC Legend:\n\n" + legend + "\n")


def nvidia_smi(args: Sequence[str], state: State) -> Result:  # noqa: PLR0911 - one per mode
    if not state.nvidia_driver:
        return Result(NVIDIA_NO_DRIVER, "", NVIDIA_RC_NO_DRIVER)
    if not present_gpus(state):
        return Result("No devices were found\n", "", 6)
    if list(args) in (["-L"], ["--list-gpus"]):
        return nvidia_list(state)
    if args and args[0] == "topo":
        if list(args[1:]) in (["-m"], ["--matrix"]):
            return nvidia_topo(state)
        return Result(NVIDIA_USAGE, "", 2)
    if args and any(a.startswith("--query-gpu") for a in args):
        return nvidia_query(args, state)
    return Result(NVIDIA_USAGE, "", 2)  # the default table is not emulated


def cdi_spec_text(state: State) -> str:
    """The YAML `nvidia-ctk cdi generate` writes, device nodes only (no hooks, no mounts)."""
    gpus = present_gpus(state)
    lines = [
        "---",
        "cdiVersion: 0.5.0",
        "containerEdits:",
        "  deviceNodes:",
        "  - path: /dev/nvidia-uvm",
        "  - path: /dev/nvidia-uvm-tools",
        "  - path: /dev/nvidiactl",
        "devices:",
    ]
    for gpu in gpus:
        for name in (str(gpu.index), gpu_uuid(state, gpu.slot)):
            shown = f'"{name}"' if name.isdigit() else name
            lines += [
                "- containerEdits:",
                "    deviceNodes:",
                f"    - path: /dev/nvidia{gpu.slot}",
                f"  name: {shown}",
            ]
    lines += ["- containerEdits:", "    deviceNodes:"]
    lines += [f"    - path: /dev/nvidia{gpu.slot}" for gpu in gpus]
    lines += ["  name: all", "kind: nvidia.com/gpu"]
    return "\n".join(lines) + "\n"


_CDI_KIND = re.compile(r"^kind:\s*(\S+)\s*$", re.MULTILINE)
_CDI_DEVICE = re.compile(r"^  name:\s*\"?([^\"\s]+)\"?\s*$", re.MULTILINE)


def cdi_devices() -> list[str]:
    """kind=name of every device in the CDI specs (the layout cdi_spec_text() writes)."""
    dirs = os.environ.get(CDI_DIRS_ENV, ":".join(CDI_DIRS)).split(":")
    found = []
    for directory in dirs:
        for path in sorted(Path(directory).glob("*")) if Path(directory).is_dir() else []:
            if path.suffix not in (".yaml", ".json") or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            kind = _CDI_KIND.search(text)
            if kind:
                found += [f"{kind.group(1)}={m.group(1)}" for m in _CDI_DEVICE.finditer(text)]
    return found


CTK_USAGE = (
    "NAME:\n   NVIDIA Container Toolkit CLI - Tools to configure the NVIDIA Container Toolkit\n"
)


def nvidia_ctk(args: Sequence[str], state: State) -> Result:  # noqa: PLR0911 - one per mode
    if list(args) in (["--version"], ["-v"]):
        return Result(f"NVIDIA Container Toolkit CLI version {CTK_VERSION}\ncommit: {CTK_COMMIT}\n")
    if list(args[:2]) == ["cdi", "list"]:
        devices = cdi_devices()
        return Result(
            "".join(d + "\n" for d in devices), f"INFO[0000] Found {len(devices)} CDI devices\n"
        )
    if list(args[:2]) == ["cdi", "generate"]:
        output = None
        rest = list(args[2:])
        while rest:
            arg = rest.pop(0)
            if arg.startswith("--output="):
                output = arg.split("=", 1)[1]
            elif arg == "--output" and rest:
                output = rest.pop(0)
            else:
                return Result("", f"Incorrect Usage: flag provided but not defined: {arg}\n", 1)
        if not state.nvidia_driver:
            return Result(
                "",
                "ERRO[0000] failed to generate CDI spec: failed to create device CDI specs: "
                "failed to initialize NVML: ERROR_DRIVER_NOT_LOADED\n",
                1,
            )
        text = cdi_spec_text(state)
        if output is None:
            return Result(text)
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text)
        return Result(
            "",
            "INFO[0000] Auto-detected mode as 'nvml'\n"
            "INFO[0000] Generated CDI spec with version 0.5.0\n",
        )
    return Result(CTK_USAGE, "", 1)


# --------------------------------------------------------------------------- boot: devices, sysfs

SYSFS_STAGE = "/run/pdlab-sysfs"
SYSFS = "/sys"
PCI_CLASSES = {"bridge": "0x060400", "nvidia": "0x030200", "amd": "0x120000"}
PCI_GPU_IDS = {"nvidia": ("0x10de", "0x2335"), "amd": ("0x1002", "0x74a1")}
GPU_DRIVERS = {"nvidia": "nvidia", "amd": "amdgpu"}


def _mknod_null(path: Path) -> None:
    """A character device like /dev/null (1,3): opens fine, reads empty."""
    if not path.exists():
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        path.chmod(0o666)


def sync_nvidia_nodes(state: State, dev: Path) -> None:
    """/dev/nvidia<minor> for the present GPUs and the control nodes, as the loaded driver
    makes them; none without the driver."""
    want = set()
    if state.vendor == "nvidia" and state.nvidia_driver:
        want = {f"nvidia{g.slot}" for g in present_gpus(state)}
        want |= {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}
    for node in dev.glob("nvidia*"):
        if node.name not in want:
            node.unlink()
    for name in sorted(want):
        _mknod_null(dev / name)


def _pci_dir(
    directory: Path,
    sysfs_path: str,
    numa: int,
    klass: str,
    ids: tuple[str, str],
    driver: str | None,
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    files = {"numa_node": str(numa), "class": klass, "vendor": ids[0], "device": ids[1]}
    for name, value in files.items():
        (directory / name).write_text(value + "\n")
    if driver:
        target = os.path.relpath(f"{SYSFS}/bus/pci/drivers/{driver}", sysfs_path)
        (directory / "driver").symlink_to(target)


def build_sysfs(state: State, gen: Path) -> tuple[dict[str, Path], dict[str, str], Path]:
    """The GPUs' and NICs' sysfs, as the kernel lays it out, under gen: the host bridges to
    put in /sys/devices, the links to put in /sys/bus/pci/devices, the class/infiniband dir."""
    roots: dict[str, Path] = {}
    pci_links: dict[str, str] = {}
    infiniband = gen / "class-infiniband"
    infiniband.mkdir(parents=True, exist_ok=True)
    nic_model = NIC_MODELS[state.nic_driver]
    gpu_ids, bridge = PCI_GPU_IDS[state.vendor], ("0x8086", "0x352a")
    for slot in range(max(state.gpus, state.nics)):
        topo = slot_topology(slot, state.vendor)
        roots[topo.host_bridge] = gen / "devices" / topo.host_bridge
        chains = []
        if slot < state.gpus:
            chains.append(
                (topo.gpu_path, PCI_CLASSES[state.vendor], gpu_ids, GPU_DRIVERS[state.vendor])
            )
        if slot < state.nics:
            klass = "0x020700" if state.link_layer == "ib" else "0x020000"
            chains.append(
                (
                    topo.nic_path,
                    klass,
                    (nic_model.pci_vendor, nic_model.pci_device),
                    nic_model.kernel_driver,
                )
            )
        for chain, klass, ids, driver in chains:
            for depth, bdf in enumerate(chain):
                rel = "/".join((topo.host_bridge, *chain[: depth + 1]))
                leaf = depth == len(chain) - 1
                directory = gen / "devices" / rel
                if not directory.exists():
                    _pci_dir(
                        directory,
                        f"{SYSFS}/devices/{rel}",
                        topo.numa,
                        klass if leaf else PCI_CLASSES["bridge"],
                        ids if leaf else bridge,
                        driver if leaf else "pcieport",
                    )
                pci_links[bdf] = f"../../../devices/{rel}"
        if slot < state.nics:
            name = nic_name(state, slot)
            rel = "/".join((topo.host_bridge, *topo.nic_path, "infiniband", name))
            ib_dir = gen / "devices" / rel
            ib_dir.mkdir(parents=True, exist_ok=True)
            (ib_dir / "device").symlink_to(f"../../../{topo.nic}")
            (infiniband / name).symlink_to(f"../../devices/{rel}")
    return roots, pci_links, infiniband


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _graft(target: Path, source: Path, dirs: dict[str, Path], links: dict[str, str]) -> None:
    """Cover sysfs directory TARGET with a tmpfs holding what it held (bind mounts of SOURCE's
    children, its links recreated) plus DIRS (bind-mounted) and LINKS."""
    _mount("-t", "tmpfs", "-o", "mode=755", "pdlab-sysfs", str(target))
    for child in sorted(source.iterdir()):
        if child.name in dirs or child.name in links:
            continue  # the lab's device wins over one of this machine's
        dest = target / child.name
        if child.is_symlink():
            dest.symlink_to(child.readlink())
            continue
        if child.is_dir():
            dest.mkdir()
        else:
            dest.touch()
        _mount("--bind", str(child), str(dest))
    for name, directory in dirs.items():
        (target / name).mkdir()
        _mount("--bind", str(directory), str(target / name))
    for name, link in links.items():
        (target / name).symlink_to(link)
    _mount("-o", "remount,ro,bind", str(target))


def sysfs_graft(state: State) -> None:
    """Show the fake GPUs and NICs in /sys where the kernel would, so that pdctl reads the
    topology through its real code path: /sys/devices/pci<domain>:<bus>/..., the
    /sys/bus/pci/devices links and /sys/class/infiniband. sysfs itself cannot be written,
    so each of those directories is covered by a tmpfs holding what was there (bound back
    from the real sysfs) and the lab's devices. Once per boot."""
    stage = Path(SYSFS_STAGE)
    if (stage / "grafted").exists():
        return
    gen, real = stage / "gen", stage / "real"
    shutil.rmtree(gen, ignore_errors=True)
    roots, pci_links, infiniband = build_sysfs(state, gen)
    real.mkdir(parents=True, exist_ok=True)
    _mount("--bind", SYSFS, str(real))
    _mount("--make-private", str(real))
    _graft(Path(SYSFS, "devices"), real / "devices", roots, {})
    _graft(Path(SYSFS, "bus/pci/devices"), real / "bus/pci/devices", {}, pci_links)
    _graft(Path(SYSFS, "class"), real / "class", {"infiniband": infiniband}, {})
    (stage / "grafted").write_text("")


def pdlab_hardware(args: Sequence[str], state: State) -> Result:
    """At boot (and after a fault changes the state): device nodes, the CDI spec (--cdi: an
    admin's `nvidia-ctk cdi generate`, when none exists) and the sysfs topology."""
    if set(args) - {"--cdi"}:
        return Result("", "usage: pdfake.py pdlab-hardware [--cdi]\n", USAGE_RC)
    sync_nvidia_nodes(state, Path(DEV_DIR))
    if "--cdi" in args and state.vendor == "nvidia" and state.nvidia_driver:
        spec = Path(CDI_SPEC)
        if not spec.exists():
            spec.parent.mkdir(parents=True, exist_ok=True)
            spec.write_text(cdi_spec_text(state))
    try:
        sysfs_graft(state)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return Result(
            "", f"pdlab-hardware: sysfs graft failed: {exc} {detail.decode(errors='replace')}\n", 1
        )
    return Result()


# --------------------------------------------------------------------------- dispatch

HANDLERS: dict[str, Callable[[Sequence[str], State], Result]] = {
    "ibv_devices": ibv_devices,
    "ibv_devinfo": ibv_devinfo,
    "amd-smi": amd_smi,
    "rocm-smi": rocm_smi,
    "nvidia-smi": nvidia_smi,
    "nvidia-ctk": nvidia_ctk,
    "pdlab-hardware": pdlab_hardware,
}
PDFAKE_USAGE = f"usage: pdfake.py TOOL [ARGS...]  (TOOL: {', '.join(TOOLS)})\n"


def run(argv: Sequence[str]) -> Result:
    name = Path(argv[0]).name if argv else ""
    args = list(argv[1:])
    if name in SELF_NAMES:
        name = args.pop(0) if args else ""
    handler = HANDLERS.get(name)
    if handler is None:
        return Result("", PDFAKE_USAGE + f"pdfake: unknown tool {name!r}\n", USAGE_RC)
    try:
        state = load_state()
    except StateError as exc:
        return Result("", f"pdfake: bad state: {exc}\n", BAD_STATE_RC)
    return handler(args, state)


def main() -> int:
    result = run(sys.argv)
    sys.stdout.write(result.out)
    sys.stdout.flush()
    sys.stderr.write(result.err)
    return result.rc


if __name__ == "__main__":
    sys.exit(main())
