#!/usr/bin/env python3
"""Stand-ins for the hardware tools of an AMD MI300X server with Broadcom RoCE NICs.

Lab hosts have no GPUs or RDMA NICs, yet pdctl's preflight and the worker
containers probe them with ``ibv_devices``, ``ibv_devinfo``, ``amd-smi`` and
``rocm-smi``. This one script answers as each of those tools (chosen by the
name it is invoked as, through symlinks) with the real tools' exact output
formats, so pdctl's parsers meet what they will meet on real servers.

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
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

STATE_ENV = "PDFAKE_STATE"
DEFAULT_STATE = "/etc/pd-fake/state.json"
PROVIDER_ENV = "PDFAKE_PROVIDER_LIB"
PROVIDER_SONAME = "libbnxt_re-rdmav34.so"
# RHEL-style first (the host path pdctl mounts), then Debian/Ubuntu's
# multiarch directory, where ROCm containers get the library mounted.
DEFAULT_PROVIDER_DIRS = ("/usr/lib64/libibverbs", "/usr/lib/x86_64-linux-gnu/libibverbs")

TOOLS = ("ibv_devices", "ibv_devinfo", "amd-smi", "rocm-smi")
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
    return State(
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


def nic_guid(host_index: int, nic: int) -> int:
    return GUID_PREFIX | (host_index & 0xFF) << 16 | (nic & 0xFF) << 8 | 0xF0


def present_nics(state: State) -> list[Nic]:
    nics = []
    for k in range(state.nics):
        name = f"bnxt_re{k}"
        if name in state.missing_nics:
            continue
        ipv4 = f"{state.roce_ip_base}.{k + 1}.{100 + state.host_index}"
        nics.append(Nic(k, name, nic_guid(state.host_index, k), name not in state.down_ports, ipv4))
    return nics


def provider_present() -> bool:
    override = os.environ.get(PROVIDER_ENV)
    if override:
        return Path(override).is_file()
    return any((Path(d) / PROVIDER_SONAME).is_file() for d in DEFAULT_PROVIDER_DIRS)


def get_device_list(state: State) -> tuple[list[Nic], str]:
    """What ibv_get_device_list() returns, and what libibverbs warns on stderr."""
    nics = present_nics(state)
    # libibverbs only goes looking for a provider when sysfs shows a device.
    if nics and not provider_present():
        soname = PROVIDER_SONAME
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
    """RoCE v1 GIDs print in full hex, v2 GIDs through inet_ntop (rdma-core devinfo.c)."""
    link_local = b"\xfe\x80" + b"\0" * 6 + nic.guid.to_bytes(8, "big")
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
    lines = [
        "\t\tport:\t1",
        f"\t\t\tstate:\t\t\t{state}",
        "\t\t\tmax_mtu:\t\t4096 (5)",
        f"\t\t\tactive_mtu:\t\t{mtu}",
        "\t\t\tsm_lid:\t\t\t0",
        "\t\t\tport_lid:\t\t0",
        "\t\t\tport_lmc:\t\t0x00",
        "\t\t\tlink_layer:\t\tEthernet",
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
            "\t\t\tactive_width:\t\t4X (2)",
            "\t\t\tactive_speed:\t\t100.0 Gbps (128)",
            f"\t\t\tphys_state:\t\t{phys}",
            *gid_lines(nic),
        ]
    return lines


def devinfo_block(nic: Nic, verbose: bool) -> str:
    guid = guid_groups(nic.guid)
    lines = [
        f"hca_id:\t{nic.name}",
        "\ttransport:\t\t\tInfiniBand (0)",
        f"\tfw_ver:\t\t\t\t{FW_VER}",
        f"\tnode_guid:\t\t\t{guid}",
        f"\tsys_image_guid:\t\t\t{guid}",
        "\tvendor_id:\t\t\t0x14e4",
        "\tvendor_part_id:\t\t\t5984",
        "\thw_ver:\t\t\t\t0x1D42",
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


def slot_bdf(slot: int) -> str:
    return f"{slot // len(SLOT_BUSES):04x}:{SLOT_BUSES[slot % len(SLOT_BUSES)]:02x}:00.0"


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
            slot_bdf(slot),
            _digest("serial", state.host_index, slot_bdf(slot)),
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


# --------------------------------------------------------------------------- dispatch

HANDLERS: dict[str, Callable[[Sequence[str], State], Result]] = {
    "ibv_devices": ibv_devices,
    "ibv_devinfo": ibv_devinfo,
    "amd-smi": amd_smi,
    "rocm-smi": rocm_smi,
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
