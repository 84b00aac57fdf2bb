"""pdctl/hardware.py: parsers on real tool output, facts and checks per fault, collect() for real.

Literal samples come from docs/facts.md and from public outputs (the issue each
one was posted in is named next to it). Issue trackers often turn tabs into
spaces; such samples are kept as posted, since operators paste them too.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdctl import hardware as hw
from pdctl.hardware import (
    CHECK_NAMES,
    CPU_SKIP_MESSAGE,
    Check,
    Expectations,
    Gid,
    ParseError,
    collect,
    evaluate,
    facts,
    parse_amd_smi_list,
    parse_amd_smi_static,
    parse_ibv_devices,
    parse_ibv_devinfo,
    parse_rocm_smi_products,
    provider_warnings,
)

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "pdctl" / "hardware.py"
PDFAKE = ROOT / "pdctl" / "lab" / "fakes" / "pdfake.py"
PROVIDER = "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"
HOST = "node2"

# --------------------------------------------------------------------------- literal samples

# docs/facts.md, "ibverbs output"
REF_IBV_DEVICES = (
    "    device          \t   node GUID\n"
    "    ------          \t----------------\n"
    "    bnxt_re0        \tb22628fffed3b0f0\n"
)
REF_IBV_DEVINFO = (
    "hca_id:\tbnxt_re0\n"
    "\ttransport:\t\t\tInfiniBand (0)\n"
    "\tfw_ver:\t\t\t\t230.2.49.0\n"
    "\tnode_guid:\t\t\tb226:28ff:fed3:b0f0\n"
    "\tvendor_id:\t\t\t0x14e4\n"
    "\tvendor_part_id:\t\t\t5984\n"
    "\tphys_port_cnt:\t\t\t1\n"
    "\t\tport:\t1\n"
    "\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n"
    "\t\t\tmax_mtu:\t\t4096 (5)\n"
    "\t\t\tactive_mtu:\t\t4096 (5)\n"
    "\t\t\tlink_layer:\t\tEthernet\n"
    "\n"
)
REF_GID3 = "\t\t\tGID[  3]:\t\t::ffff:192.170.1.101, RoCE v2\n"
# docs/facts.md (ROCm containers) / pdfake.py: libibverbs without the provider library
REF_PROVIDER_WARNING = (
    "libibverbs: Warning: couldn't load driver 'libbnxt_re-rdmav34.so': "
    "libbnxt_re-rdmav34.so: cannot open shared object file: No such file or directory"
)

# uccl-project/rdmatop#9 (RHEL 7, tabs kept)
RDMATOP_IBV_DEVICES = (
    "    device          \t   node GUID\n"
    "    ------          \t----------------\n"
    "    mlx5_bond_0     \te8ebd30300381588\n"
)
# kvcache-ai/Mooncake#105 (tabs turned into spaces)
MOONCAKE_IBV_DEVICES = (
    "    device                 node GUID\n"
    "    ------              ----------------\n"
    "    mlx5_bond_0         08c0eb0300da0fce\n"
    "    mlx5_bond_1         08c0eb0300da0fc2\n"
)
# SoftRoCE/rxe-dev#48: provider missing -> warnings on stderr, header only on stdout
RXE_HEADER_ONLY_STDOUT = (
    "    device                 node GUID\n    ------              ----------------\n"
)
RXE_HEADER_ONLY_STDERR = (
    "libibverbs: Warning: couldn't load driver 'rxe': librxe-rdmav2.so: cannot open shared "
    "object file: No such file or directory\n"
    "libibverbs: Warning: no userspace device-specific driver found for "
    "/sys/class/infiniband_verbs/uverbs0\n"
)
# nminoru/pib#2: ibv_devinfo with no usable device (stderr)
PIB_NO_DEVICES_STDERR = (
    "libibverbs: Warning: no userspace device-specific driver found for "
    "/sys/class/infiniband_verbs/uverbs1\n"
    "libibverbs: Warning: no userspace device-specific driver found for "
    "/sys/class/infiniband_verbs/uverbs0\n"
    "No IB devices found\n"
)
# WukLab/LITE#5: no RDMA sysfs (perror's format)
FAILED_LIST = "Failed to get IB devices list: Function not implemented\n"
# linux-rdma/perftest#262: a healthy host warns about providers it has no device for
PERFTEST_WARNINGS = (
    "libibverbs: Warning: couldn't load driver 'libmana-rdmav34.so': libmana-rdmav34.so: "
    "cannot open shared object file: No such file or directory\n"
    "libibverbs: Warning: couldn't load driver 'liberdma-rdmav34.so': liberdma-rdmav34.so: "
    "cannot open shared object file: No such file or directory\n"
)
# sgl-project/sglang#16242: a container's old bnxt_re provider against a newer kernel
SGLANG_ABI_WARNINGS = (
    "libibverbs: Warning: Driver bnxt_re does not support the kernel ABI of 6 (supports 1 to 1) "
    "for device /sys/class/infiniband/bnxt_re2\n"
    "libibverbs: Warning: Driver bnxt_re does not support the kernel ABI of 6 (supports 1 to 1) "
    "for device /sys/class/infiniband/bnxt_re2\n"
    "libibverbs: Warning: Driver bnxt_re does not support the kernel ABI of 6 (supports 1 to 1) "
    "for device /sys/class/infiniband/bnxt_re1\n"
)
# bytedance/byteps#313: a provider built for another libibverbs
BYTEPS_WARNING = (
    "libibverbs: Warning: couldn't load driver 'mlx4': /usr/local/nvidia/cpu_lib/libibverbs.so.1: "
    "version `IBVERBS_PRIVATE_22' not found (required by /usr/lib64/libibverbs/libmlx4-rdmav2.so)"
)
# SoftRoCE/rxe-dev#46 (tabs turned into spaces; that kernel printed no link_layer)
RXE_DEVINFO = """\
hca_id: rxe0
    transport:          InfiniBand (0)
    fw_ver:             0.0.0
    node_guid:          428d:5cff:fe35:bb12
    sys_image_guid:         0000:0000:0000:0000
    vendor_id:          0x0000
    vendor_part_id:         0
    hw_ver:             0x0
    phys_port_cnt:          1
        port:   1
            state:          PORT_ACTIVE (4)
            max_mtu:        4096 (5)
            active_mtu:     1024 (3)
            sm_lid:         0
            port_lid:       0
            port_lmc:       0x00
"""
# hustcat/k8s-rdma-device-plugin#8 (MLNX_OFED: board_id, "Device ports:"), stdout part
OFED_DEVINFO = """\
hca_id: mlx4_2
        transport:                      InfiniBand (0)
        fw_ver:                         2.40.7000
        node_guid:                      0014:0500:8cc6:cd0a
        sys_image_guid:                 248a:0703:00e5:3d43
        vendor_id:                      0x02c9
        vendor_part_id:                 4100
        hw_ver:                         0x1
        board_id:                       MT_1100120019
        phys_port_cnt:                  1
        Device ports:
                port:   1
                        state:                  PORT_ACTIVE (4)
                        max_mtu:                4096 (5)
                        active_mtu:             4096 (5)
                        sm_lid:                 2
                        port_lid:               1
                        port_lmc:               0x00
                        link_layer:             InfiniBand

"""
# rdma-core before linux-rdma/rdma-core#682 printed GIDs without their type
OLD_GIDS_DEVINFO = (
    "hca_id:\tmlx4_0\n"
    "\t\tport:\t1\n"
    "\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n"
    "\t\t\tlink_layer:\t\tInfiniBand\n"
    "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:0002:c903:00f3:3a01\n"
)

# amd-smi list --json (ROCm 6.x list form); record fields as in ROCm/rocm-systems#3654
AMD_LIST_RECORD = {
    "gpu": 0,
    "bdf": "0000:23:00.0",
    "uuid": "67ff740f-0000-1000-80e6-b5bb3c3ce0db",
    "kfd_id": 63484,
    "node_id": 2,
    "partition_id": 0,
}
# ROCm/rocm-systems#3654: the same without --json (someone forgot the flag)
AMD_LIST_TEXT = """\
GPU: 0
    BDF: 0000:23:00.0
    UUID: 67ff740f-0000-1000-80e6-b5bb3c3ce0db
    KFD_ID: 63484
    NODE_ID: 2
    PARTITION_ID: 0
"""
# nathaninline/ajean#39: amd-smi static --json on a newer amd-smi wraps in gpu_data
AJEAN_STATIC_GPU_DATA = """\
{
    "gpu_data": [
        {
            "gpu": 0,
            "asic": {
                "market_name": "AMD Radeon RX 7800 XT",
                "vendor_id": "0x1002",
                "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
                "subvendor_id": "0x1eae",
                "device_id": "0x747e",
                "subsystem_id": "0x7801",
                "rev_id": "0xc8",
                "asic_serial": "0x4162405E51BB99B0",
                "oam_id": "N/A",
                "num_compute_units": 60,
                "target_graphics_version": "gfx1101"
            }
        }
    ]
}
"""
# ...and what that terminal showed above it, from Python 3.14's SyntaxWarnings
AJEAN_WARNINGS = (
    "/usr/lib/python3.14/site-packages/amdsmi/amdsmi_interface.py:3569: SyntaxWarning: "
    "'return' in a 'finally' block\n  return return_dictionary\n"
)
# ROCm/rocm_smi_lib#159: rocm-smi --showproductname --json, "Card Series"
ROCM_SMI_SERIES = """\
{
  "card0": {
    "Card Series": "AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2",
    "Card Model": "0x7408",
    "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
    "Card SKU": "D65201",
    "Subsystem ID": "0x0b0c",
    "Device Rev": "0x00",
    "Node ID": "7",
    "GUID": "58294",
    "GFX Version": "gfx9010"
  }
}
"""
# wandb/wandb#5449: an older rocm-smi's JSON says "Card series" (trimmed to its product keys)
ROCM_SMI_SERIES_LOWER = (
    '{"card0": {"Card series": "AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2", '
    '"Card model": "FirePro W4300", "PCI Bus": "0000:C9:00.0"}}'
)
# easybuilders/easybuild-framework#3978: the text form (no --json)
ROCM_SMI_TEXT = """\
======================= ROCm System Management Interface =======================
================================= Product Info =================================
GPU[0]          : Card series:          Fiji [Radeon R9 FURY / NANO Series]
GPU[0]          : Card model:           Radeon R9 FURY X
"""
# ROCm/legacy-rocm-build#4374: rocm-smi with nothing to report (exit 0)
ROCM_SMI_NO_JSON = "WARNING: No JSON data to report\n"
# pdfake.py's amd-smi/rocm-smi without the amdgpu module
AMD_SMI_NO_DRIVER = (
    "ERROR:root:Unable to get devices, driver not initialized (amdgpu not found in modules)\n"
    "ERROR:root:Unable to detect any GPU devices, check amdgpu version and module status\n"
)
ROCM_SMI_NO_DRIVER = "ERROR:root:Driver not initialized (amdgpu not found in modules)\n"
# docker/cli#3594 + docker/cli#5900: daemon down, yet `docker info` may exit 0
DOCKER_INFO_DAEMON_DOWN = json.dumps(
    {
        "ID": "",
        "Containers": 0,
        "ServerErrors": [
            "Cannot connect to the Docker daemon at tcp://127.0.0.1:2375. "
            "Is the docker daemon running?"
        ],
    }
)

# --------------------------------------------------------------------------- raw documents

BDFS = [
    "0000:05:00.0",
    "0000:26:00.0",
    "0000:46:00.0",
    "0000:65:00.0",
    "0000:85:00.0",
    "0000:a6:00.0",
    "0000:c6:00.0",
    "0000:e5:00.0",
]


def cmd(argv: list[str], rc: int = 0, stdout: str = "", stderr: str = "") -> dict[str, Any]:
    return {"argv": argv, "rc": rc, "stdout": stdout, "stderr": stderr}


def missing(argv: list[str]) -> dict[str, Any]:
    return cmd(argv, 127, "", f"{argv[0]}: command not found (No such file or directory)")


def guid(k: int) -> str:
    return f"b22628fffed3b{k}f0"


def devinfo_block(k: int, *, active: bool = True, gid3: str = "RoCE v2") -> str:
    """One bnxt_re device in rdma-core's `ibv_devinfo -v` layout (trimmed of capability lines)."""
    g = guid(k)
    groups = ":".join(g[i : i + 4] for i in range(0, 16, 4))
    state = "PORT_ACTIVE (4)" if active else "PORT_DOWN (1)"
    lines = [
        f"hca_id:\tbnxt_re{k}",
        "\ttransport:\t\t\tInfiniBand (0)",
        "\tfw_ver:\t\t\t\t230.2.49.0",
        f"\tnode_guid:\t\t\t{groups}",
        f"\tsys_image_guid:\t\t\t{groups}",
        "\tvendor_id:\t\t\t0x14e4",
        "\tvendor_part_id:\t\t\t5984",
        "\thw_ver:\t\t\t\t0x1D42",
        "\tphys_port_cnt:\t\t\t1",
        "\tmax_mr_size:\t\t\t0x8000000000",
        "\tdevice_cap_flags:\t\t0x01227d80",
        "\t\t\t\t\tCURR_QP_STATE_MOD",
        "\tcompletion_timestamp_mask not supported",
        "\t\tport:\t1",
        f"\t\t\tstate:\t\t\t{state}",
        "\t\t\tmax_mtu:\t\t4096 (5)",
        "\t\t\tactive_mtu:\t\t4096 (5)",
        "\t\t\tlink_layer:\t\tEthernet",
        "\t\t\tgid_tbl_len:\t\t256",
        f"\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:{groups}, RoCE v1",
        f"\t\t\tGID[  1]:\t\tfe80::{groups}, RoCE v2",
    ]
    if active:
        lines += [
            f"\t\t\tGID[  2]:\t\t0000:0000:0000:0000:0000:ffff:c0aa:{k + 1:02x}65, RoCE v1",
            f"\t\t\tGID[  3]:\t\t::ffff:192.170.{k + 1}.101, {gid3}",
        ]
    return "\n".join(lines) + "\n\n"


def rdma_commands(
    nics: int = 8,
    absent: tuple[str, ...] = (),
    down: tuple[str, ...] = (),
    provider: bool = True,
    gid3: dict[str, str] | None = None,
    stderr: str = "",
) -> dict[str, dict[str, Any]]:
    header = "    device          \t   node GUID\n    ------          \t----------------\n"
    if not provider:
        warning = REF_PROVIDER_WARNING + "\n"
        return {
            "ibv_devices": cmd(["ibv_devices"], 0, header, warning),
            "ibv_devinfo": cmd(["ibv_devinfo", "-v"], 255, "", warning + "No IB devices found\n"),
        }
    names = [k for k in range(nics) if f"bnxt_re{k}" not in absent]
    rows = "".join(f"    {f'bnxt_re{k}':<16}\t{guid(k)}\n" for k in names)
    blocks = "".join(
        devinfo_block(
            k,
            active=f"bnxt_re{k}" not in down,
            gid3=(gid3 or {}).get(f"bnxt_re{k}", "RoCE v2"),
        )
        for k in names
    )
    if not names:
        return {
            "ibv_devices": cmd(["ibv_devices"], 0, header, stderr),
            "ibv_devinfo": cmd(["ibv_devinfo", "-v"], 255, "", stderr + "No IB devices found\n"),
        }
    return {
        "ibv_devices": cmd(["ibv_devices"], 0, header + rows, stderr),
        "ibv_devinfo": cmd(["ibv_devinfo", "-v"], 0, blocks, stderr),
    }


def gpu_commands(
    gpus: int = 8, model: str = "AMD Instinct MI300X", wrap: bool = False
) -> dict[str, dict[str, Any]]:
    listed = [{**AMD_LIST_RECORD, "gpu": i, "bdf": BDFS[i], "node_id": 2 + i} for i in range(gpus)]
    static = [
        {"gpu": i, "asic": {"market_name": model, "device_id": "0x74a1"}} for i in range(gpus)
    ]
    as_json = (lambda v: json.dumps({"gpu_data": v})) if wrap else json.dumps
    return {
        "amd_smi_list": cmd(["amd-smi", "list", "--json"], 0, as_json(listed)),
        "amd_smi_static": cmd(["amd-smi", "static", "--asic", "--json"], 0, as_json(static)),
    }


def runtime_commands(kind: str = "podman") -> dict[str, dict[str, Any]]:
    commands = {
        "podman_version": missing(["podman", "--version"]),
        "docker_version": missing(["docker", "--version"]),
    }
    if kind == "podman":
        commands["podman_version"] = cmd(["podman", "--version"], 0, "podman version 4.3.1\n")
        commands["podman_info"] = cmd(
            ["podman", "info", "--format", "json"], 0, '{"host": {"arch": "amd64"}}\n'
        )
    elif kind == "docker-down":
        commands["docker_version"] = cmd(
            ["docker", "--version"], 0, "Docker version 28.2.2, build e6534b4\n"
        )
        commands["docker_info"] = cmd(
            ["docker", "info", "--format", "{{json .}}"], 0, DOCKER_INFO_DAEMON_DOWN + "\n"
        )
    return commands


# A bare-metal host: root may raise its rlimits.
MEMLOCK_OK = {
    "euid": 0,
    "hard": 8388608,
    "cap_sys_resource": True,
    "unlimited": True,
    "error": None,
}
# A host that is itself a container without CAP_SYS_RESOURCE (like this project's machines).
MEMLOCK_CAPPED = {
    "euid": 0,
    "hard": 8388608,
    "cap_sys_resource": False,
    "unlimited": False,
    "error": "ValueError: not allowed to raise maximum limit",
}


def make_raw(
    *,
    kind: str = "gpu",
    rdma: dict[str, dict[str, Any]] | None = None,
    gpu: dict[str, dict[str, Any]] | None = None,
    runtime: str = "podman",
    provider: bool = True,
    kfd: bool | None = None,
    reach: list[dict[str, Any]] | None = None,
    free_gb: float = 400.0,
    memlock: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A raw document as collect() writes it, for a healthy host unless told otherwise."""
    is_gpu = kind == "gpu"
    commands: dict[str, dict[str, Any]] = {}
    if is_gpu:
        commands.update(rdma if rdma is not None else rdma_commands(provider=provider))
        commands.update(gpu if gpu is not None else gpu_commands())
    else:
        commands.update(
            ibv_devices=missing(["ibv_devices"]),
            ibv_devinfo=missing(["ibv_devinfo", "-v"]),
            amd_smi_list=missing(["amd-smi", "list", "--json"]),
            amd_smi_static=missing(["amd-smi", "static", "--asic", "--json"]),
            rocm_smi=missing(["rocm-smi", "--showproductname", "--json"]),
        )
    commands.update(runtime_commands(runtime))
    commands["systemctl"] = cmd(["systemctl", "is-system-running"], 0, "running\n")
    return {
        "schema": 1,
        "hostname": HOST,
        "os": {
            "pretty_name": "Debian GNU/Linux 12 (bookworm)",
            "id": "debian",
            "version_id": "12",
        },
        "kernel": "6.1.0-28-amd64",
        "cpus": 192 if is_gpu else 32,
        "memory_bytes": 2 * 1024**4 if is_gpu else 128 * 1024**3,
        "storage": {
            "path": "/var/lib/containers",
            "free_bytes": int(free_gb * 1024**3),
            "error": None,
            "candidates": ["/var/lib/containers", "/"],
        },
        "kfd": is_gpu if kfd is None else kfd,
        "render_nodes": [f"/dev/dri/renderD{128 + i}" for i in range(8)] if is_gpu else [],
        "provider_lib": {"path": PROVIDER, "exists": is_gpu and provider, "elsewhere": []},
        "systemd": True,
        "python": "3.11.2",
        "commands": commands,
        "memlock": memlock if memlock is not None else MEMLOCK_OK,
        "reach": reach if reach is not None else [],
        "elapsed_s": 0.8,
    }


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def failing(checks: list[Check]) -> dict[str, str]:
    return {check.name: check.message for check in checks if not check.ok}


GPU = Expectations(kind="gpu")
CPU = Expectations(kind="cpu")

# --------------------------------------------------------------------------- ibv_devices


def test_ibv_devices_reference_sample() -> None:
    assert parse_ibv_devices(REF_IBV_DEVICES) == [("bnxt_re0", "b22628fffed3b0f0")]


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        (RDMATOP_IBV_DEVICES, [("mlx5_bond_0", "e8ebd30300381588")]),
        (
            MOONCAKE_IBV_DEVICES,
            [("mlx5_bond_0", "08c0eb0300da0fce"), ("mlx5_bond_1", "08c0eb0300da0fc2")],
        ),
    ],
    ids=["tabs", "spaces"],
)
def test_ibv_devices_real_outputs(sample: str, expected: list[tuple[str, str]]) -> None:
    assert parse_ibv_devices(sample) == expected


def test_ibv_devices_header_only_is_no_device() -> None:
    assert parse_ibv_devices(RXE_HEADER_ONLY_STDOUT) == []
    assert parse_ibv_devices(rdma_commands(provider=False)["ibv_devices"]["stdout"]) == []


def test_ibv_devices_failure_outputs_raise_with_what_was_expected() -> None:
    with pytest.raises(ParseError, match="could not list devices: Failed to get IB devices list"):
        parse_ibv_devices(FAILED_LIST)
    with pytest.raises(ParseError, match=r"expected ibv_devices' header .* got 'empty output'"):
        parse_ibv_devices("")
    with pytest.raises(ParseError, match="expected an ibv_devices row"):
        parse_ibv_devices(REF_IBV_DEVICES + "    bnxt_re1        \tnot-a-guid\n")
    assert issubclass(ParseError, ValueError)


# --------------------------------------------------------------------------- ibv_devinfo


def test_ibv_devinfo_reference_block() -> None:
    [device] = parse_ibv_devinfo(REF_IBV_DEVINFO)
    assert (device.name, device.fw_ver, device.node_guid, device.vendor_id) == (
        "bnxt_re0",
        "230.2.49.0",
        "b226:28ff:fed3:b0f0",
        "0x14e4",
    )
    [port] = device.ports
    assert (port.number, port.state, port.state_code) == (1, "PORT_ACTIVE", 4)
    assert (port.link_layer, port.active_mtu, port.gids) == ("Ethernet", 4096, [])


def test_ibv_devinfo_verbose_gid_table() -> None:
    text = (
        REF_IBV_DEVINFO.rstrip("\n")
        + "\n"
        + (
            "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:b226:28ff:fed3:b0f0, RoCE v1\n"
            "\t\t\tGID[  1]:\t\tfe80::b226:28ff:fed3:b0f0, RoCE v2\n" + REF_GID3 + "\n"
        )
    )
    port = parse_ibv_devinfo(text)[0].ports[0]
    assert port.gids == [
        Gid(0, "fe80:0000:0000:0000:b226:28ff:fed3:b0f0", "RoCE v1"),
        Gid(1, "fe80::b226:28ff:fed3:b0f0", "RoCE v2"),
        Gid(3, "::ffff:192.170.1.101", "RoCE v2"),
    ]
    assert port.gid(3) == Gid(3, "::ffff:192.170.1.101", "RoCE v2")
    assert port.gid(2) is None


def test_ibv_devinfo_real_output_with_spaces_and_no_link_layer() -> None:
    [device] = parse_ibv_devinfo(RXE_DEVINFO)
    assert (device.name, device.node_guid, device.fw_ver) == (
        "rxe0",
        "428d:5cff:fe35:bb12",
        "0.0.0",
    )
    [port] = device.ports
    assert (port.state, port.state_code, port.active_mtu, port.link_layer) == (
        "PORT_ACTIVE",
        4,
        1024,
        "",
    )


def test_ibv_devinfo_ofed_output() -> None:
    [device] = parse_ibv_devinfo(OFED_DEVINFO)
    assert device.name == "mlx4_2"
    assert device.vendor_id == "0x02c9"
    assert [(p.number, p.state, p.link_layer) for p in device.ports] == [
        (1, "PORT_ACTIVE", "InfiniBand")
    ]


def test_ibv_devinfo_untyped_gids_of_old_rdma_core() -> None:
    port = parse_ibv_devinfo(OLD_GIDS_DEVINFO)[0].ports[0]
    assert port.gids == [Gid(0, "fe80:0000:0000:0000:0002:c903:00f3:3a01", "")]


def test_ibv_devinfo_multiple_devices_and_states() -> None:
    devices = parse_ibv_devinfo(devinfo_block(0) + devinfo_block(3, active=False))
    assert [d.name for d in devices] == ["bnxt_re0", "bnxt_re3"]
    down = devices[1].ports[0]
    assert (down.state, down.state_code) == ("PORT_DOWN", 1)
    assert [g.index for g in down.gids] == [0, 1]
    assert [g.kind for g in devices[0].ports[0].gids] == ["RoCE v1", "RoCE v2"] * 2


def test_ibv_devinfo_failure_outputs() -> None:
    assert parse_ibv_devinfo("") == []
    with pytest.raises(ParseError, match="found no device: No IB devices found"):
        parse_ibv_devinfo("No IB devices found\n")
    with pytest.raises(ParseError, match="found no device: Failed to get IB devices list"):
        parse_ibv_devinfo(FAILED_LIST)
    with pytest.raises(ParseError, match=r"line 1: expected ibv_devinfo to start with 'hca_id:"):
        parse_ibv_devinfo(REF_PROVIDER_WARNING + "\n" + REF_IBV_DEVINFO)
    with pytest.raises(ParseError, match="expected a 'state:' line in port 1 of bnxt_re0"):
        parse_ibv_devinfo("hca_id:\tbnxt_re0\n\t\tport:\t1\n\t\t\tlink_layer:\t\tEthernet\n")
    with pytest.raises(ParseError, match="expected a port number after 'port:'"):
        parse_ibv_devinfo("hca_id:\tbnxt_re0\n\t\tport:\tone\n")


def test_ibv_devinfo_of_the_lab_fake(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"host_index": 2, "nics": 3, "down_ports": ["bnxt_re1"]}))
    lib = tmp_path / "libbnxt_re-rdmav34.so"
    lib.write_bytes(b"\x7fELF")
    env = {**os.environ, "PDFAKE_STATE": str(state), "PDFAKE_PROVIDER_LIB": str(lib)}
    proc = subprocess.run(
        [sys.executable, str(PDFAKE), "ibv_devinfo", "-v"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=True,
    )
    devices = parse_ibv_devinfo(proc.stdout)
    assert [(d.name, d.ports[0].state, d.ports[0].state_code) for d in devices] == [
        ("bnxt_re0", "PORT_ACTIVE", 4),
        ("bnxt_re1", "PORT_DOWN", 1),
        ("bnxt_re2", "PORT_ACTIVE", 4),
    ]
    assert devices[2].ports[0].gid(3) == Gid(3, "::ffff:192.170.3.102", "RoCE v2")
    assert devices[1].ports[0].gid(3) is None


# --------------------------------------------------------------------------- provider warnings


def test_provider_warnings() -> None:
    assert provider_warnings(REF_PROVIDER_WARNING + "\nNo IB devices found\n") == [
        REF_PROVIDER_WARNING
    ]
    assert len(provider_warnings(PERFTEST_WARNINGS)) == 2
    abi = SGLANG_ABI_WARNINGS.splitlines()
    assert provider_warnings(SGLANG_ABI_WARNINGS) == [abi[0], abi[2]]  # deduplicated, in order
    assert provider_warnings(PIB_NO_DEVICES_STDERR) == PIB_NO_DEVICES_STDERR.splitlines()[:2]
    assert provider_warnings(BYTEPS_WARNING) == [BYTEPS_WARNING]
    assert provider_warnings("") == []
    assert provider_warnings(FAILED_LIST) == []


# --------------------------------------------------------------------------- amd-smi / rocm-smi


def test_amd_smi_list_list_and_gpu_data_forms() -> None:
    assert parse_amd_smi_list(json.dumps([AMD_LIST_RECORD])) == [AMD_LIST_RECORD]
    assert parse_amd_smi_list(json.dumps({"gpu_data": [AMD_LIST_RECORD]})) == [AMD_LIST_RECORD]
    assert parse_amd_smi_list("[]\n") == []
    assert parse_amd_smi_list('{"gpu_data": []}') == []


def test_amd_smi_list_failures() -> None:
    with pytest.raises(ParseError, match="expected JSON from amd-smi list --json, got 'GPU: 0'"):
        parse_amd_smi_list(AMD_LIST_TEXT)
    with pytest.raises(ParseError, match="got empty output"):
        parse_amd_smi_list("")
    with pytest.raises(ParseError, match=r'\{"gpu_data": \[\.\.\.\]\}.*keys'):
        parse_amd_smi_list('{"nic_data": []}')
    with pytest.raises(ParseError, match=r"GPU record 1 .* to be an object"):
        parse_amd_smi_list("[{}, 3]")
    with pytest.raises(ParseError, match="expected JSON"):
        parse_amd_smi_list(AMD_SMI_NO_DRIVER)


def test_amd_smi_static_forms() -> None:
    listed = json.dumps([{"gpu": 0, "asic": {"market_name": "AMD Instinct MI300X"}}] * 2)
    assert parse_amd_smi_static(listed) == ["AMD Instinct MI300X"] * 2
    assert parse_amd_smi_static(AJEAN_STATIC_GPU_DATA) == ["AMD Radeon RX 7800 XT"]
    # warnings ahead of the document (as pasted from a terminal) are skipped
    assert parse_amd_smi_static(AJEAN_WARNINGS + AJEAN_STATIC_GPU_DATA) == ["AMD Radeon RX 7800 XT"]
    # a generic or missing market_name falls back to board.product_name
    generic = [{"gpu": 0, "asic": {"market_name": "N/A"}, "board": {"product_name": "MI308X OAM"}}]
    assert parse_amd_smi_static(json.dumps(generic)) == ["MI308X OAM"]


def test_amd_smi_static_failures() -> None:
    with pytest.raises(ParseError, match="expected an 'asic' object in GPU record 0"):
        parse_amd_smi_static(json.dumps([AMD_LIST_RECORD]))
    with pytest.raises(ParseError, match=r"expected asic\.market_name in GPU record 0"):
        parse_amd_smi_static('[{"gpu": 0, "asic": {"market_name": ""}}]')


def test_rocm_smi_products_key_case_and_empty_output() -> None:
    expected = ["AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2"]
    assert parse_rocm_smi_products(ROCM_SMI_SERIES) == expected
    assert parse_rocm_smi_products(ROCM_SMI_SERIES_LOWER) == expected
    with_system = json.loads(ROCM_SMI_SERIES)
    with_system["system"] = {"Driver version": "6.7.0"}
    with_system["card1"] = {"card SERIES": "AMD Instinct MI300X"}
    assert parse_rocm_smi_products(json.dumps(with_system)) == [*expected, "AMD Instinct MI300X"]
    assert parse_rocm_smi_products("") == []  # stdout when it prints ROCM_SMI_NO_JSON


def test_rocm_smi_products_failures() -> None:
    with pytest.raises(ParseError, match="expected JSON from rocm-smi"):
        parse_rocm_smi_products(ROCM_SMI_TEXT)
    with pytest.raises(ParseError, match="expected a 'Card Series' key for card0"):
        parse_rocm_smi_products('{"card0": {"Card Model": "0x74a1"}}')
    with pytest.raises(ParseError, match=r'expected a JSON object \{"card0"'):
        parse_rocm_smi_products("[]")


# --------------------------------------------------------------------------- facts()


def test_facts_healthy_gpu_host() -> None:
    summary = facts(make_raw())
    assert list(summary) == [
        "hostname",
        "os",
        "kernel",
        "cpus",
        "memory_gb",
        "disk_free_gb",
        "disk_path",
        "systemd",
        "python",
        "gpus",
        "kfd",
        "render_nodes",
        "rdma",
        "runtime",
        "errors",
    ]
    assert summary["hostname"] == HOST
    assert summary["os"]["pretty_name"] == "Debian GNU/Linux 12 (bookworm)"
    assert (summary["cpus"], summary["memory_gb"], summary["disk_free_gb"]) == (192, 2048.0, 400.0)
    assert summary["disk_path"] == "/var/lib/containers"
    assert summary["gpus"] == {
        "count": 8,
        "model": "AMD Instinct MI300X",
        "source": "amd-smi",
        "bdfs": BDFS,
    }
    assert (summary["kfd"], summary["render_nodes"], summary["systemd"]) == (True, 8, True)
    rdma = summary["rdma"]
    assert [d["name"] for d in rdma["devices"]] == [f"bnxt_re{k}" for k in range(8)]
    port = rdma["devices"][0]["ports"][0]
    assert (port["port"], port["state"], port["link_layer"]) == (1, "PORT_ACTIVE", "Ethernet")
    assert port["gids"][3] == {"index": 3, "address": "::ffff:192.170.1.101", "kind": "RoCE v2"}
    assert (rdma["provider_lib"], rdma["warnings"]) == (True, [])
    assert summary["runtime"] == {"name": "podman", "version": "4.3.1", "usable": True}
    assert summary["errors"] == []
    assert json.loads(json.dumps(summary)) == summary


def test_facts_cpu_host() -> None:
    summary = facts(make_raw(kind="cpu"))
    assert summary["gpus"] == {"count": 0, "model": None, "source": None, "bdfs": []}
    assert summary["rdma"] == {"devices": [], "provider_lib": False, "warnings": []}
    assert (summary["kfd"], summary["render_nodes"], summary["cpus"]) == (False, 0, 32)
    assert summary["runtime"]["usable"] is True
    assert summary["errors"] == []


def test_facts_nic_missing_and_port_down() -> None:
    rdma = rdma_commands(absent=("bnxt_re7",), down=("bnxt_re3",))
    devices = facts(make_raw(rdma=rdma))["rdma"]["devices"]
    assert [d["name"] for d in devices] == [f"bnxt_re{k}" for k in range(7)]
    states = {d["name"]: d["ports"][0]["state"] for d in devices}
    assert states["bnxt_re3"] == "PORT_DOWN"
    assert {s for n, s in states.items() if n != "bnxt_re3"} == {"PORT_ACTIVE"}


def test_facts_provider_lib_missing_with_warning() -> None:
    summary = facts(make_raw(provider=False))
    assert summary["rdma"] == {
        "devices": [],
        "provider_lib": False,
        "warnings": [REF_PROVIDER_WARNING],
    }
    assert summary["errors"] == []  # "No IB devices found" is an answer, not a failure


def test_facts_gpu_missing_renumbered() -> None:
    records = [
        {**AMD_LIST_RECORD, "gpu": i, "bdf": bdf} for i, bdf in enumerate(BDFS) if bdf != BDFS[2]
    ]
    gpu = gpu_commands(gpus=7, wrap=True)
    gpu["amd_smi_list"]["stdout"] = json.dumps({"gpu_data": records})
    summary = facts(make_raw(gpu=gpu))
    assert summary["gpus"]["count"] == 7
    assert summary["gpus"]["bdfs"] == [b for b in BDFS if b != "0000:46:00.0"]
    assert summary["gpus"]["model"] == "AMD Instinct MI300X"


def test_facts_no_runtime() -> None:
    assert facts(make_raw(runtime="none"))["runtime"] == {
        "name": None,
        "version": None,
        "usable": False,
    }


def test_facts_docker_daemon_down_despite_exit_0() -> None:
    summary = facts(make_raw(runtime="docker-down"))
    assert summary["runtime"] == {"name": "docker", "version": "28.2.2", "usable": False}
    assert summary["errors"] == [
        "docker info: Cannot connect to the Docker daemon at tcp://127.0.0.1:2375. "
        "Is the docker daemon running?"
    ]


def test_facts_podman_docker_shim_is_podman() -> None:
    raw = make_raw()
    raw["commands"]["docker_version"] = cmd(["docker", "--version"], 0, "podman version 4.3.1\n")
    assert facts(raw)["runtime"] == {"name": "podman", "version": "4.3.1", "usable": True}


def test_facts_nothing_installed() -> None:
    raw = make_raw(
        rdma={
            "ibv_devices": missing(["ibv_devices"]),
            "ibv_devinfo": missing(["ibv_devinfo", "-v"]),
        },
        gpu={
            "amd_smi_list": missing(["amd-smi", "list", "--json"]),
            "amd_smi_static": missing(["amd-smi", "static", "--asic", "--json"]),
            "rocm_smi": missing(["rocm-smi", "--showproductname", "--json"]),
        },
        runtime="none",
        provider=False,
        kfd=False,
    )
    summary = facts(raw)
    assert summary["gpus"] == {"count": 0, "model": None, "source": None, "bdfs": []}
    assert summary["rdma"] == {"devices": [], "provider_lib": False, "warnings": []}
    assert summary["runtime"]["name"] is None
    assert summary["errors"] == []


def test_facts_rocm_smi_fallback_when_amd_smi_fails() -> None:
    gpu = {
        "amd_smi_list": cmd(["amd-smi", "list", "--json"], 1, "", "Traceback ...\nImportError\n"),
        "amd_smi_static": cmd(["amd-smi", "static", "--asic", "--json"], 1, "", "ImportError\n"),
        "rocm_smi": cmd(["rocm-smi", "--showproductname", "--json"], 0, ROCM_SMI_SERIES_LOWER),
    }
    summary = facts(make_raw(gpu=gpu))
    assert summary["gpus"] == {
        "count": 1,
        "model": "AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2",
        "source": "rocm-smi",
        "bdfs": [],
    }
    assert summary["errors"] == ["amd-smi list --json exited 1: Traceback ..."]


def test_facts_amdgpu_not_loaded() -> None:
    gpu = {
        "amd_smi_list": cmd(["amd-smi", "list", "--json"], 255, "", AMD_SMI_NO_DRIVER),
        "amd_smi_static": cmd(
            ["amd-smi", "static", "--asic", "--json"], 255, "", AMD_SMI_NO_DRIVER
        ),
        "rocm_smi": cmd(
            ["rocm-smi", "--showproductname", "--json"],
            0,
            "",
            ROCM_SMI_NO_DRIVER + ROCM_SMI_NO_JSON,
        ),
    }
    summary = facts(make_raw(gpu=gpu, kfd=False))
    assert summary["gpus"] == {"count": 0, "model": None, "source": "rocm-smi", "bdfs": []}
    assert summary["errors"] == [
        "amd-smi list --json exited 255: ERROR:root:Unable to get devices, driver not initialized "
        "(amdgpu not found in modules)",
        "rocm-smi --showproductname --json: ERROR:root:Driver not initialized (amdgpu not found "
        "in modules)",
    ]


def test_facts_parse_errors_become_errors_entries() -> None:
    gpu = gpu_commands()
    gpu["amd_smi_list"]["stdout"] = AMD_LIST_TEXT
    rdma = rdma_commands()
    rdma["ibv_devinfo"]["stdout"] = "garbage before hca_id\n" + rdma["ibv_devinfo"]["stdout"]
    summary = facts(make_raw(gpu=gpu, rdma=rdma))
    assert summary["gpus"]["count"] == 0
    assert summary["errors"][0] == (
        "amd-smi list --json: expected JSON from amd-smi list --json, got 'GPU: 0'"
    )
    assert summary["errors"][1].startswith(
        "ibv_devinfo -v: line 1: expected ibv_devinfo to start with 'hca_id:"
    )
    # ibv_devices still parsed: the devices are listed without port details
    assert [d["ports"] for d in summary["rdma"]["devices"]] == [[]] * 8


def test_facts_ibv_devices_failed_list() -> None:
    rdma = {
        "ibv_devices": cmd(["ibv_devices"], 255, "", FAILED_LIST),
        "ibv_devinfo": cmd(["ibv_devinfo", "-v"], 255, "", FAILED_LIST),
    }
    summary = facts(make_raw(rdma=rdma))
    assert summary["rdma"]["devices"] == []
    assert summary["errors"] == [
        "ibv_devices exited 255: Failed to get IB devices list: Function not implemented",
        "ibv_devinfo -v exited 255: Failed to get IB devices list: Function not implemented",
    ]


@pytest.mark.parametrize(
    "raw",
    [{}, {"commands": 5}, {"commands": {"ibv_devices": {"rc": "x"}}}, {"storage": [], "os": 3}],
)
def test_facts_never_raises_on_odd_documents(raw: dict[str, Any]) -> None:
    summary = facts(raw)
    assert summary["gpus"]["count"] == 0
    assert summary["rdma"]["devices"] == []
    assert summary["disk_free_gb"] is None
    checks = evaluate(HOST, raw, GPU)
    assert [c.name for c in checks] == list(CHECK_NAMES)
    assert not by_name(checks)["gpus"].ok


# --------------------------------------------------------------------------- evaluate()


def test_evaluate_healthy_gpu_host() -> None:
    checks = evaluate(HOST, make_raw(), GPU)
    assert [c.name for c in checks] == list(CHECK_NAMES)
    assert failing(checks) == {}
    assert not any(c.skipped for c in checks)
    messages = by_name(checks)
    assert (
        messages["gpus"].message == f"{HOST}: 8 x AMD Instinct MI300X (amd-smi), /dev/kfd present"
    )
    assert messages["rdma_devices"].message == f"{HOST}: ibv_devices lists bnxt_re0..bnxt_re7"
    assert "MC_GID_INDEX=3" in messages["roce_gid"].message
    assert all(c.message.startswith(f"{HOST}: ") for c in checks)


def test_evaluate_cpu_host_skips_gpu_and_rdma() -> None:
    checks = evaluate(HOST, make_raw(kind="cpu"), CPU)
    assert [c.name for c in checks] == list(CHECK_NAMES)
    skipped = [c for c in checks if c.skipped]
    assert [c.name for c in skipped] == [
        "gpus",
        "rdma_devices",
        "rdma_ports",
        "provider_lib",
        "roce_gid",
        "memlock",
    ]
    assert all(c.ok and c.message == CPU_SKIP_MESSAGE for c in skipped)
    assert failing(checks) == {}


def test_evaluate_nic_missing_names_exactly_the_missing_device() -> None:
    raw = make_raw(rdma=rdma_commands(absent=("bnxt_re7",)))
    assert failing(evaluate(HOST, raw, GPU)) == {
        "rdma_devices": (
            "node2: ibv_devices does not list bnxt_re7 (expected bnxt_re0..bnxt_re7); check that "
            "the bnxt_re driver is loaded and the NIC is cabled (ibv_devices, dmesg | grep bnxt)"
        )
    }


def test_evaluate_two_nics_missing() -> None:
    raw = make_raw(rdma=rdma_commands(absent=("bnxt_re2", "bnxt_re5")))
    message = failing(evaluate(HOST, raw, GPU))["rdma_devices"]
    assert "does not list bnxt_re2 and bnxt_re5 (" in message
    for healthy in ("bnxt_re0", "bnxt_re1", "bnxt_re3", "bnxt_re4", "bnxt_re6"):
        assert f"{healthy}," not in message and f"{healthy} " not in message


def test_evaluate_port_down() -> None:
    raw = make_raw(rdma=rdma_commands(down=("bnxt_re3",)))
    bad = failing(evaluate(HOST, raw, GPU))
    assert list(bad) == ["rdma_ports"]
    assert bad["rdma_ports"].startswith("node2: bnxt_re3 port 1 is PORT_DOWN (1); bring the links")
    assert all(f"bnxt_re{k}" not in bad["rdma_ports"] for k in (0, 1, 2, 4, 5, 6, 7))


def test_evaluate_provider_lib_missing_with_warning() -> None:
    bad = failing(evaluate(HOST, make_raw(provider=False), GPU))
    assert list(bad) == ["rdma_devices", "rdma_ports", "provider_lib", "roce_gid"]
    assert bad["provider_lib"] == (
        "node2: libibverbs could not load libbnxt_re-rdmav34.so: cannot open shared object file: "
        "No such file or directory; /usr/lib64/libibverbs/libbnxt_re-rdmav34.so is missing: "
        "install Broadcom's RoCE provider library (libbnxt_re-rdmav34.so) there"
    )
    assert "bnxt_re0, bnxt_re1" in bad["rdma_devices"]
    assert "fix provider_lib first" in bad["rdma_devices"]
    assert "MC_GID_INDEX" in bad["roce_gid"]


def test_evaluate_provider_lib_elsewhere() -> None:
    raw = make_raw()
    raw["provider_lib"] = {
        "path": PROVIDER,
        "exists": False,
        "elsewhere": ["/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so"],
    }
    message = failing(evaluate(HOST, raw, GPU))["provider_lib"]
    assert message == (
        "node2: libbnxt_re-rdmav34.so not found at /usr/lib64/libibverbs/libbnxt_re-rdmav34.so "
        "(the worker containers bind-mount it from there); it is at "
        "/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so: set provider_lib to that path"
    )


def test_evaluate_provider_abi_mismatch_fails_other_providers_do_not() -> None:
    raw = make_raw(rdma=rdma_commands(stderr=SGLANG_ABI_WARNINGS))
    message = failing(evaluate(HOST, raw, GPU))["provider_lib"]
    assert message.startswith(
        "node2: libibverbs could not load libbnxt_re-rdmav34.so: Driver bnxt_re does not support "
        "the kernel ABI of 6"
    )
    assert "exists but does not suit this libibverbs/kernel" in message
    raw = make_raw(rdma=rdma_commands(stderr=PERFTEST_WARNINGS))
    assert failing(evaluate(HOST, raw, GPU)) == {}
    assert len(facts(raw)["rdma"]["warnings"]) == 2


def test_evaluate_roce_gid_not_v2() -> None:
    raw = make_raw(rdma=rdma_commands(gid3={"bnxt_re4": "RoCE v1"}))
    message = failing(evaluate(HOST, raw, GPU))["roce_gid"]
    assert message.startswith("node2: bnxt_re4 GID[3] is RoCE v1 (::ffff:192.170.5.101);")
    assert "MC_GID_INDEX" in message
    assert all(f"bnxt_re{k}" not in message for k in (0, 1, 2, 3, 5, 6, 7))


def test_evaluate_roce_gid_index_missing() -> None:
    message = failing(evaluate(HOST, make_raw(), Expectations(kind="gpu", gid_index=5)))["roce_gid"]
    assert message.startswith(
        "node2: bnxt_re0, bnxt_re1, bnxt_re2, bnxt_re3, bnxt_re4, bnxt_re5, bnxt_re6 and bnxt_re7 "
        "have no GID[5] (indexes shown: 0, 1, 2, 3);"
    )
    assert "set MC_GID_INDEX to a RoCE v2 index" in message


def test_evaluate_gpu_missing() -> None:
    bad = failing(evaluate(HOST, make_raw(gpu=gpu_commands(gpus=7)), GPU))
    assert bad == {
        "gpus": (
            "node2: amd-smi lists 7 GPUs, expected 8 MI300X GPUs; find the missing one with "
            "amd-smi list and dmesg | grep -i amdgpu (a GPU that fails to initialise drops out "
            "of the list)"
        )
    }


def test_evaluate_more_gpus_than_expected() -> None:
    message = failing(evaluate(HOST, make_raw(), Expectations(kind="gpu", gpus=4)))["gpus"]
    assert message.startswith("node2: amd-smi lists 8 GPUs, expected 4 MI300X GPUs;")
    assert "partition" in message


def test_evaluate_groups_devices_that_share_a_fault() -> None:
    rdma = rdma_commands(down=("bnxt_re1", "bnxt_re4"), gid3={"bnxt_re2": "RoCE v1"})
    bad = failing(evaluate(HOST, make_raw(rdma=rdma), GPU))
    assert bad["rdma_ports"].startswith("node2: bnxt_re1 and bnxt_re4 port 1 is PORT_DOWN (1);")
    # the down ports have no GID[3] to judge; the one wrong GID is named with its address
    assert bad["roce_gid"].startswith("node2: bnxt_re2 GID[3] is RoCE v1 (::ffff:192.170.3.101);")
    rdma = rdma_commands(gid3={"bnxt_re2": "RoCE v1", "bnxt_re6": "RoCE v1"})
    message = failing(evaluate(HOST, make_raw(rdma=rdma), GPU))["roce_gid"]
    assert message.startswith("node2: bnxt_re2 and bnxt_re6 GID[3] is RoCE v1;")


def test_evaluate_unreadable_ibv_devinfo() -> None:
    rdma = rdma_commands()
    rdma["ibv_devinfo"]["stdout"] = "garbage\n" + rdma["ibv_devinfo"]["stdout"]
    message = failing(evaluate(HOST, make_raw(rdma=rdma), GPU))["rdma_ports"]
    assert message.startswith(
        "node2: cannot read port states: ibv_devinfo -v: line 1: expected ibv_devinfo to start "
        "with 'hca_id:"
    )


def test_evaluate_gpu_model_and_kfd() -> None:
    raw = make_raw(gpu=gpu_commands(model="AMD Instinct MI250X"))
    message = failing(evaluate(HOST, raw, GPU))["gpus"]
    assert message.startswith("node2: the GPUs are AMD Instinct MI250X, expected MI300X;")
    assert failing(evaluate(HOST, raw, Expectations(kind="gpu", gpu_model=None))) == {}
    message = failing(evaluate(HOST, make_raw(kfd=False), GPU))["gpus"]
    assert message.startswith("node2: /dev/kfd is missing, so the amdgpu driver is not loaded")


def test_evaluate_no_runtime_and_daemon_down() -> None:
    assert failing(evaluate(HOST, make_raw(runtime="none"), GPU)) == {
        "runtime": (
            "node2: no container runtime: neither podman nor docker is installed; install one "
            "(apt install podman)"
        )
    }
    message = failing(evaluate(HOST, make_raw(runtime="docker-down"), GPU))["runtime"]
    assert message == (
        "node2: docker 28.2.2 is installed but `docker info` failed (Cannot connect to the Docker "
        "daemon at tcp://127.0.0.1:2375. Is the docker daemon running?); fix it "
        "(systemctl start docker)"
    )


def test_evaluate_disk_low() -> None:
    assert failing(evaluate(HOST, make_raw(free_gb=12.34), GPU)) == {
        "disk": (
            "node2: only 12.3 GB free on /var/lib/containers, need 50 GB for worker images; free "
            "space or move container storage to a larger disk"
        )
    }


def test_evaluate_mesh_names_each_unreachable_peer() -> None:
    reach = [
        {"address": "10.0.0.12", "port": 22, "ok": True, "error": None},
        {"address": "10.0.0.13", "port": 30000, "ok": False, "error": "Connection refused"},
        {"address": "10.0.0.14", "port": 22, "ok": False, "error": "timed out after 2 s"},
    ]
    message = failing(evaluate(HOST, make_raw(reach=reach), GPU))["mesh"]
    assert message == (
        "node2: cannot reach 10.0.0.13:30000 (Connection refused) and 10.0.0.14:22 (timed out "
        "after 2 s); open these ports between the hosts (firewall, routes) and check the peers "
        "are up"
    )
    assert "10.0.0.12" not in message


def test_evaluate_systemd_states() -> None:
    raw = make_raw()
    raw["commands"]["systemctl"] = cmd(["systemctl", "is-system-running"], 1, "degraded\n")
    check = by_name(evaluate(HOST, raw, GPU))["systemd"]
    assert check.ok and "degraded" in check.message and "systemctl --failed" in check.message
    raw["commands"]["systemctl"] = cmd(["systemctl", "is-system-running"], 1, "starting\n")
    assert "still booting" in failing(evaluate(HOST, raw, GPU))["systemd"]
    raw["systemd"] = False
    raw["commands"]["systemctl"] = cmd(["systemctl", "is-system-running"], 1, "offline\n")
    assert failing(evaluate(HOST, raw, GPU))["systemd"].startswith(
        "node2: systemd is not PID 1 (/run/systemd/system is missing)"
    )


def test_evaluate_nothing_installed() -> None:
    raw = make_raw(
        rdma={
            "ibv_devices": missing(["ibv_devices"]),
            "ibv_devinfo": missing(["ibv_devinfo", "-v"]),
        },
        gpu={
            "amd_smi_list": missing(["amd-smi", "list", "--json"]),
            "amd_smi_static": missing(["amd-smi", "static", "--asic", "--json"]),
            "rocm_smi": missing(["rocm-smi", "--showproductname", "--json"]),
        },
        runtime="none",
        provider=False,
        kfd=True,
    )
    bad = failing(evaluate(HOST, raw, GPU))
    assert list(bad) == [
        "gpus",
        "rdma_devices",
        "rdma_ports",
        "provider_lib",
        "roce_gid",
        "runtime",
    ]
    assert "neither amd-smi nor rocm-smi is installed" in bad["gpus"]
    assert "ibv_devices is not installed" in bad["rdma_devices"]
    assert "ibv_devinfo is not installed" in bad["rdma_ports"]
    assert "libbnxt_re-rdmav34.so not found at /usr/lib64/libibverbs/" in bad["provider_lib"]


def test_evaluate_ibv_devices_failed() -> None:
    rdma = {
        "ibv_devices": cmd(["ibv_devices"], 255, "", FAILED_LIST),
        "ibv_devinfo": cmd(["ibv_devinfo", "-v"], 255, "", FAILED_LIST),
    }
    message = failing(evaluate(HOST, make_raw(rdma=rdma), GPU))["rdma_devices"]
    assert message == (
        "node2: ibv_devices exited 255: Failed to get IB devices list: Function not implemented; "
        "load the RDMA stack (modprobe bnxt_re ib_uverbs) and check dmesg | grep bnxt"
    )


def test_failure_messages_are_short_and_name_the_host() -> None:
    scenarios = [
        make_raw(provider=False),
        make_raw(rdma=rdma_commands(absent=tuple(f"bnxt_re{k}" for k in range(8)))),
        make_raw(rdma=rdma_commands(down=tuple(f"bnxt_re{k}" for k in range(8)))),
        make_raw(rdma=rdma_commands(stderr=SGLANG_ABI_WARNINGS)),
        make_raw(gpu=gpu_commands(gpus=3), runtime="docker-down", free_gb=1),
        make_raw(
            reach=[
                {"address": f"10.0.0.{i}", "port": 22, "ok": False, "error": "x"} for i in range(40)
            ]
        ),
    ]
    messages = [c.message for raw in scenarios for c in evaluate(HOST, raw, GPU) if not c.ok]
    assert len(messages) >= 10
    assert all(m.startswith("node2: ") and len(m) <= 300 for m in messages), max(messages, key=len)


def test_check_to_dict_and_expectations() -> None:
    check = Check("disk", False, "node2: full", skipped=False)
    assert check.to_dict() == {
        "name": "disk",
        "ok": False,
        "message": "node2: full",
        "skipped": False,
        "emulated": False,
    }
    assert Expectations(kind="gpu").provider_lib == PROVIDER
    with pytest.raises(ValueError, match="kind must be 'gpu' or 'cpu'"):
        Expectations(kind="router")


# --------------------------------------------------------------------------- collect(): for real


def test_run_command_missing_unexecutable_and_timeout(tmp_path: Path) -> None:
    assert hw.run_command(["pd-no-such-tool", "--x"])["rc"] == 127
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\necho hi\n")
    result = hw.run_command([str(plain)])
    assert (result["rc"], result["stdout"]) == (126, "")
    assert "Permission denied" in result["stderr"]
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\necho started\nsleep 30\n")
    slow.chmod(0o755)
    started = time.monotonic()
    result = hw.run_command([str(slow)], timeout=0.5)
    assert time.monotonic() - started < 5
    assert (result["rc"], result["stdout"]) == (124, "started\n")
    assert result["stderr"].startswith(f"{slow}: timed out after 0.5 s")


def test_collect_on_this_machine_without_any_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    started = time.monotonic()
    raw = collect(PROVIDER, ["/nonexistent-storage", str(tmp_path)], [])
    assert time.monotonic() - started < 3
    commands = raw["commands"]
    assert list(commands) == [
        "ibv_devices",
        "ibv_devinfo",
        "amd_smi_list",
        "amd_smi_static",
        "rocm_smi",
        "podman_version",
        "docker_version",
        "systemctl",
    ]
    assert {k: c["rc"] for k, c in commands.items()} == dict.fromkeys(commands, 127)
    assert commands["ibv_devinfo"] == {
        "argv": ["ibv_devinfo", "-v"],
        "rc": 127,
        "stdout": "",
        "stderr": "ibv_devinfo: command not found (No such file or directory)",
    }
    assert raw["storage"]["path"] == str(tmp_path)
    assert raw["storage"]["free_bytes"] > 0
    assert raw["provider_lib"]["path"] == PROVIDER
    assert raw["python"] == ".".join(map(str, sys.version_info[:3]))
    assert raw["cpus"] == os.cpu_count()
    assert json.loads(json.dumps(raw)) == raw
    summary = facts(raw)
    assert summary["gpus"]["source"] is None and summary["runtime"]["name"] is None
    assert summary["errors"] == []


@pytest.mark.skipif(
    any(shutil.which(t) for t in ("ibv_devices", "ibv_devinfo", "amd-smi", "rocm-smi")),
    reason="this machine has real RDMA/ROCm tools",
)
def test_collect_on_this_machine_with_its_path() -> None:
    raw = collect(PROVIDER, ["/"], [])
    for key in ("ibv_devices", "ibv_devinfo", "amd_smi_list", "amd_smi_static", "rocm_smi"):
        assert raw["commands"][key]["rc"] == 127, key
    assert raw["os"]["id"]
    assert raw["kernel"] == os.uname().release
    assert raw["memory_bytes"] > 0
    assert raw["hostname"] == socket.gethostname()


def test_collect_tries_memlock_unlimited_as_the_runtime_would() -> None:
    """The probe's answer follows the rules setrlimit(2) applies to this very machine."""
    memlock = collect(PROVIDER, ["/"], [])["memlock"]
    may_raise = memlock["euid"] == 0 and memlock["cap_sys_resource"] is not False
    assert memlock["unlimited"] == (memlock["hard"] is None or may_raise)
    if not memlock["unlimited"]:
        assert memlock["error"] == "ValueError: not allowed to raise maximum limit"
        assert memlock["hard"] is not None


# --------------------------------------------------------------------------- memlock


def test_memlock_passes_where_root_may_raise_it() -> None:
    check = by_name(evaluate(HOST, make_raw(), GPU))["memlock"]
    assert check.ok and not check.emulated
    assert "memlock unlimited" in check.message


def test_memlock_on_a_host_without_cap_sys_resource_names_the_fix() -> None:
    message = failing(evaluate(HOST, make_raw(memlock=MEMLOCK_CAPPED), GPU))["memlock"]
    assert message.startswith(f"{HOST}: podman cannot give the workers memlock unlimited")
    assert "no CAP_SYS_RESOURCE here" in message and "8388608 bytes" in message
    assert "--rlimit=RLIMIT_MEMLOCK=infinity" in message  # raise it where the host is made
    assert "`pdctl: {memlock: inherit}`" in message  # or do without RDMA's setting


def test_memlock_fix_follows_the_runtime() -> None:
    refused = {**MEMLOCK_CAPPED, "cap_sys_resource": True}
    podman = failing(evaluate(HOST, make_raw(memlock=refused), GPU))["memlock"]
    assert "DefaultLimitMEMLOCK=infinity in /etc/systemd/system.conf" in podman
    assert "setrlimit failed (ValueError: not allowed to raise maximum limit)" in podman
    raw = make_raw(runtime="none", memlock=refused)
    raw["commands"]["docker_version"] = cmd(["docker", "--version"], 0, "Docker version 28.2.2\n")
    raw["commands"]["docker_info"] = cmd(["docker", "info", "--format", "{{json .}}"], 0, "{}\n")
    docker = failing(evaluate(HOST, raw, GPU))["memlock"]
    assert "drop-in for docker.service and containerd.service" in docker


def test_memlock_clamped_by_the_runtime_passes_as_emulated() -> None:
    raw = make_raw(memlock=MEMLOCK_CAPPED)
    version = f"crun version 1.8.1\nspec: 1.0.0\n{hw.RLIMIT_CLAMP_MARK} to this host's limits"
    info = {"host": {"ociRuntime": {"name": "crun", "path": "/opt/x/crun", "version": version}}}
    raw["commands"]["podman_info"]["stdout"] = json.dumps(info)
    check = by_name(evaluate(HOST, raw, GPU))["memlock"]
    assert check.ok and check.emulated and check.to_dict()["emulated"] is True
    assert "memlock unlimited emulated" in check.message and "/opt/x/crun" in check.message
    assert "workers run with memlock 8388608 bytes" in check.message


def test_memlock_probed_without_root_or_not_at_all() -> None:
    as_user = {**MEMLOCK_CAPPED, "euid": 1000}
    message = failing(evaluate(HOST, make_raw(memlock=as_user), GPU))["memlock"]
    assert "not checked: the probe ran as uid 1000, not root (fix sudo first)" in message
    raw = make_raw()
    del raw["memlock"]  # from a pdctl before the check
    assert "was not probed" in failing(evaluate(HOST, raw, GPU))["memlock"]


# --------------------------------------------------------------------------- collect(): fakes

FAKE_PODMAN = """\
#!/bin/sh
case "$1" in
  --version) echo "podman version 4.3.1" ;;
  info) echo '{"host": {"arch": "amd64"}, "store": {"graphRoot": "/var/lib/containers"}}' ;;
  *) echo "Error: unknown command $1" >&2; exit 125 ;;
esac
"""
FAKE_SYSTEMCTL = '#!/bin/sh\n[ "$1" = is-system-running ] && echo running\n'


class FakeHost:
    """A bin dir of fake tools on PATH, the fake hardware state, and host files under tmp."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        for tool in ("ibv_devices", "ibv_devinfo", "amd-smi", "rocm-smi"):
            (self.bin / tool).symlink_to(PDFAKE)
        for name, text in (("podman", FAKE_PODMAN), ("systemctl", FAKE_SYSTEMCTL)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.state_file = tmp / "state.json"
        self.provider = tmp / "libbnxt_re-rdmav34.so"
        self.provider.write_bytes(b"\x7fELF fake\n")
        (tmp / "kfd").touch()
        (tmp / "dri").mkdir()
        for i in range(8):
            (tmp / "dri" / f"renderD{128 + i}").touch()
        (tmp / "systemd").mkdir()
        self.storage = tmp / "storage"
        self.storage.mkdir()
        monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("PDFAKE_STATE", str(self.state_file))
        monkeypatch.setenv("PDFAKE_PROVIDER_LIB", str(self.provider))
        monkeypatch.setattr(hw, "KFD_PATH", str(tmp / "kfd"))
        monkeypatch.setattr(hw, "DRI_DIR", str(tmp / "dri"))
        monkeypatch.setattr(hw, "SYSTEMD_RUN_DIR", str(tmp / "systemd"))
        # A bare-metal host's root may raise rlimits, whatever this machine allows.
        monkeypatch.setattr(hw, "MEMLOCK_PROBE", "")
        self.state(host_index=1)

    def state(self, **state: Any) -> None:
        self.state_file.write_text(json.dumps(state))

    def collect(self, peers: list[tuple[str, int]] | None = None) -> dict[str, Any]:
        return collect(str(self.provider), [str(self.storage)], peers or [])

    def expect(self) -> Expectations:
        return Expectations(kind="gpu", provider_lib=str(self.provider))


@pytest.fixture
def fake_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHost:
    return FakeHost(tmp_path, monkeypatch)


def test_fakes_healthy_host_end_to_end(fake_host: FakeHost) -> None:
    started = time.monotonic()
    raw = fake_host.collect()
    assert time.monotonic() - started < 3
    assert "rocm_smi" not in raw["commands"]  # amd-smi answered
    assert raw["commands"]["ibv_devinfo"]["argv"] == ["ibv_devinfo", "-v"]
    assert (raw["kfd"], raw["systemd"], len(raw["render_nodes"])) == (True, True, 8)
    summary = facts(raw)
    assert summary["gpus"]["count"] == 8
    assert summary["gpus"]["model"] == "AMD Instinct MI300X"
    assert summary["gpus"]["bdfs"][0] == "0000:05:00.0"
    assert [d["name"] for d in summary["rdma"]["devices"]] == [f"bnxt_re{k}" for k in range(8)]
    assert summary["runtime"] == {"name": "podman", "version": "4.3.1", "usable": True}
    assert summary["errors"] == []
    checks = evaluate(HOST, raw, fake_host.expect())
    assert failing(checks) == {}, failing(checks)


def test_fakes_nic_missing_and_port_down_end_to_end(fake_host: FakeHost) -> None:
    fake_host.state(host_index=1, missing_nics=["bnxt_re7"], down_ports=["bnxt_re3"])
    bad = failing(evaluate(HOST, fake_host.collect(), fake_host.expect()))
    assert list(bad) == ["rdma_devices", "rdma_ports"]
    assert "does not list bnxt_re7 (expected bnxt_re0..bnxt_re7)" in bad["rdma_devices"]
    assert bad["rdma_ports"].startswith("node2: bnxt_re3 port 1 is PORT_DOWN (1);")
    named = bad["rdma_devices"].split("(expected")[0] + bad["rdma_ports"]
    for healthy in ("bnxt_re0", "bnxt_re1", "bnxt_re2", "bnxt_re4", "bnxt_re5", "bnxt_re6"):
        assert healthy not in named


def test_fakes_provider_lib_missing_end_to_end(fake_host: FakeHost) -> None:
    fake_host.provider.unlink()
    raw = fake_host.collect()
    assert raw["commands"]["ibv_devinfo"]["rc"] == 255
    summary = facts(raw)
    assert summary["rdma"]["warnings"] == [REF_PROVIDER_WARNING]
    bad = failing(evaluate(HOST, raw, fake_host.expect()))
    assert list(bad) == ["rdma_devices", "rdma_ports", "provider_lib", "roce_gid"]
    assert bad["provider_lib"].startswith(
        "node2: libibverbs could not load libbnxt_re-rdmav34.so: cannot open shared object file"
    )
    assert str(fake_host.provider) in bad["provider_lib"]


def test_fakes_gpu_missing_gpu_data_format(fake_host: FakeHost) -> None:
    fake_host.state(host_index=1, missing_gpus=[2], amd_smi_format="gpu_data")
    raw = fake_host.collect()
    summary = facts(raw)
    assert summary["gpus"]["count"] == 7
    assert "0000:46:00.0" not in summary["gpus"]["bdfs"]
    assert failing(evaluate(HOST, raw, fake_host.expect())) == {
        "gpus": (
            "node2: amd-smi lists 7 GPUs, expected 8 MI300X GPUs; find the missing one with "
            "amd-smi list and dmesg | grep -i amdgpu (a GPU that fails to initialise drops out "
            "of the list)"
        )
    }


def test_fakes_amdgpu_not_loaded_falls_back_to_rocm_smi(fake_host: FakeHost) -> None:
    fake_host.state(host_index=1, amdgpu_driver=False)
    raw = fake_host.collect()
    assert raw["commands"]["amd_smi_list"]["rc"] == 255
    assert raw["commands"]["rocm_smi"]["rc"] == 0  # rocm-smi exits 0 with no GPU
    summary = facts(raw)
    assert summary["gpus"]["count"] == 0
    assert any("Driver not initialized" in e for e in summary["errors"])
    message = failing(evaluate(HOST, raw, fake_host.expect()))["gpus"]
    assert message.startswith("node2: rocm-smi lists 0 GPUs, expected 8 MI300X GPUs")


def test_fakes_cpu_host(fake_host: FakeHost) -> None:
    fake_host.state(host_index=1, gpus=0, nics=0)
    raw = fake_host.collect()
    summary = facts(raw)
    assert summary["gpus"]["count"] == 0
    assert summary["rdma"]["devices"] == []
    checks = evaluate(HOST, raw, Expectations(kind="cpu"))
    assert failing(checks) == {}
    assert [c.name for c in checks if c.skipped] == [
        "gpus",
        "rdma_devices",
        "rdma_ports",
        "provider_lib",
        "roce_gid",
        "memlock",
    ]


def test_fakes_no_runtime(fake_host: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_host.bin / "podman").unlink()
    monkeypatch.setenv("PATH", f"{fake_host.bin}{os.pathsep}/usr/bin{os.pathsep}/bin")
    if shutil.which("docker") or shutil.which("podman"):
        pytest.skip("a runtime is installed in /usr/bin here")
    raw = fake_host.collect()
    assert "podman_info" not in raw["commands"] and "docker_info" not in raw["commands"]
    assert failing(evaluate(HOST, raw, fake_host.expect()))["runtime"].startswith(
        "node2: no container runtime"
    )


# --------------------------------------------------------------------------- reach


@pytest.fixture
def listener() -> Iterator[int]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def closed_port() -> int:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port: int = probe.getsockname()[1]
    probe.close()
    return port


def test_reach_counts_open_and_refusing_ports_as_reachable(listener: int, tmp_path: Path) -> None:
    closed = closed_port()
    raw = collect(PROVIDER, [str(tmp_path)], [("127.0.0.1", listener), ("127.0.0.1", closed)])
    assert raw["reach"] == [
        {"address": "127.0.0.1", "port": listener, "ok": True, "error": None},
        # refused: the host answered, so the path between the hosts works
        {"address": "127.0.0.1", "port": closed, "ok": True, "error": None, "refused": True},
    ]
    checks = {c.name: c for c in evaluate(HOST, raw, CPU)}
    assert checks["mesh"].ok and "reached all 2 peers" in checks["mesh"].message


def test_reach_rejects_malformed_peers(tmp_path: Path) -> None:
    raw = collect(PROVIDER, [str(tmp_path)], [("127.0.0.1", "22"), ["only-address"]])  # type: ignore[list-item]
    assert [r["error"] for r in raw["reach"]] == ["invalid peer", "invalid peer"]


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A loopback port whose accept queue is full: further connects hang until they time out."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    held = []
    for _ in range(16):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.settimeout(0.3)
        try:
            client.connect(("127.0.0.1", port))
        except OSError:
            client.close()
            break
        held.append(client)
    else:
        server.close()
        pytest.skip("this kernel never fills a loopback accept queue")
    yield port
    for client in held:
        client.close()
    server.close()


def test_reach_forty_hanging_peers_run_concurrently(full_backlog: int, tmp_path: Path) -> None:
    peers = [("127.0.0.1", full_backlog)] * 40
    started = time.monotonic()
    raw = collect(PROVIDER, [str(tmp_path)], peers)
    elapsed = time.monotonic() - started
    assert elapsed < 8, elapsed  # serially: 40 x 2 s
    assert len(raw["reach"]) == 40
    assert {r["error"] for r in raw["reach"]} == {"timed out after 2 s"}


# --------------------------------------------------------------------------- python3 - on a host

PY39 = sorted((Path.home() / ".pyenv" / "versions").glob("3.9*/bin/python3"))
PYTHONS = [sys.executable, *[str(p) for p in PY39[:1]]]


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: Path(p).parent.parent.name or p)
def test_source_piped_to_python_stdin(python: str, listener: int, tmp_path: Path) -> None:
    request = {
        "provider_lib": str(tmp_path / "libbnxt_re-rdmav34.so"),
        "storage_paths": ["/nonexistent", str(tmp_path)],
        "peers": [["127.0.0.1", listener]],
    }
    env = {**os.environ, hw.INPUT_ENV: json.dumps(request)}
    proc = subprocess.run(
        [python, "-"],
        input=MODULE.read_text(),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout)
    assert raw["schema"] == 1
    assert raw["storage"]["path"] == str(tmp_path)
    assert raw["provider_lib"] == {
        "path": request["provider_lib"],
        "exists": False,
        "elsewhere": [],
    }
    assert raw["reach"] == [{"address": "127.0.0.1", "port": listener, "ok": True, "error": None}]
    assert raw["commands"]["ibv_devices"]["argv"] == ["ibv_devices"]
    if "3.9" in python:
        assert raw["python"].startswith("3.9.")
    assert facts(raw)["hostname"] == socket.gethostname()


PORTABLE_SCRIPT = """\
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("pd_hardware", sys.argv[1])
hw = importlib.util.module_from_spec(spec)
sys.modules["pd_hardware"] = hw  # as Ansible's module_utils loader does
spec.loader.exec_module(hw)
raw = json.load(sys.stdin)
checks = hw.evaluate("node2", raw, hw.Expectations(kind="gpu"))
print(json.dumps({"facts": hw.facts(raw), "checks": [c.to_dict() for c in checks]}))
"""


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: Path(p).parent.parent.name or p)
def test_facts_and_evaluate_under_each_python(python: str) -> None:
    raw = make_raw(rdma=rdma_commands(down=("bnxt_re5",)))
    proc = subprocess.run(
        [python, "-W", "error", "-c", PORTABLE_SCRIPT, str(MODULE)],
        input=json.dumps(raw),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(proc.stdout)
    assert result["facts"] == facts(raw)
    assert result["checks"] == [c.to_dict() for c in evaluate(HOST, raw, GPU)]
    assert [c["name"] for c in result["checks"] if not c["ok"]] == ["rdma_ports"]


def test_source_with_bad_input_exits_2() -> None:
    env = {**os.environ, hw.INPUT_ENV: json.dumps({"peers": "10.0.0.1", "typo": 1})}
    proc = subprocess.run(
        [sys.executable, "-"],
        input=MODULE.read_text(),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == {"error": "PD_HARDWARE_INPUT: unknown input keys: typo"}


def test_script_reads_its_request_from_stdin_when_run_as_a_file(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != hw.INPUT_ENV}
    request = {"storage_paths": [str(tmp_path)], "peers": [], "provider_lib": "/nonexistent.so"}
    proc = subprocess.run(
        [sys.executable, str(MODULE)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout)
    assert raw["storage"]["path"] == str(tmp_path)
    assert raw["provider_lib"]["path"] == "/nonexistent.so"


def test_python_c_does_not_wait_on_an_open_stdin(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != hw.INPUT_ENV}
    env["PATH"] = str(tmp_path)  # no tools: the output stays far below a pipe's buffer
    with subprocess.Popen(
        [sys.executable, "-c", MODULE.read_text()],
        stdin=subprocess.PIPE,  # like an SSH channel nobody closes
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("main() waited on stdin under python3 -c")
        out = proc.stdout.read() if proc.stdout else ""
    assert rc == 0
    raw = json.loads(out)
    assert raw["storage"]["candidates"] == list(hw.DEFAULT_STORAGE_PATHS)
    assert raw["provider_lib"]["path"] == hw.DEFAULT_PROVIDER_LIB


def test_importing_the_module_does_nothing() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import runpy; runpy.run_path({str(MODULE)!r}, run_name='pd_hardware')",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
