"""What the pdctl/onhost/hardware tests share: the tools' sample outputs (tests/data/hardware/,
read verbatim by ``sample``) and raw documents shaped as collect() writes them.

The samples come from docs/facts.md and from public outputs (the issue each one was posted
in is named next to it). Issue trackers often turn tabs into spaces; such samples are kept
as posted, since operators paste them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdctl.onhost.hardware.checks import Check, Expectations
from pdctl.onhost.hardware.documents import PERFTEST_TOOLS

ROOT = Path(__file__).resolve().parents[4]
DATA = ROOT / "tests" / "data" / "hardware"
LOADER = ROOT / "pdctl" / "onhost" / "loader.py"
PDFAKE = ROOT / "pdctl" / "lab" / "fakes" / "pdfake.py"
PROVIDER = "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"
HOST = "node2"


def sample(name: str) -> str:
    """A sample output, byte for byte (tabs, trailing spaces and a missing final newline are
    part of what the parsers meet)."""
    return (DATA / name).read_bytes().decode()


def line(name: str) -> str:
    """A one-line sample without its final newline (a line as the parsers get it, split)."""
    return sample(name).removesuffix("\n")


# --------------------------------------------------------------------------- literal samples

# docs/facts.md, "ibverbs output"
REF_IBV_DEVICES = sample("ibv_devices.reference.txt")
REF_IBV_DEVINFO = sample("ibv_devinfo.reference.txt")
REF_GID3 = sample("ibv_devinfo.reference-gid3.txt")
# docs/facts.md (ROCm containers) / pdfake.py: libibverbs without the provider library
REF_PROVIDER_WARNING = line("libibverbs.provider-warning.txt")

# uccl-project/rdmatop#9 (RHEL 7, tabs kept)
RDMATOP_IBV_DEVICES = sample("ibv_devices.rdmatop-9.txt")
# kvcache-ai/Mooncake#105 (tabs turned into spaces)
MOONCAKE_IBV_DEVICES = sample("ibv_devices.mooncake-105.txt")
# SoftRoCE/rxe-dev#48: provider missing -> warnings on stderr, header only on stdout
RXE_HEADER_ONLY_STDOUT = sample("ibv_devices.rxe-dev-48.stdout.txt")
RXE_HEADER_ONLY_STDERR = sample("ibv_devices.rxe-dev-48.stderr.txt")
# nminoru/pib#2: ibv_devinfo with no usable device (stderr)
PIB_NO_DEVICES_STDERR = sample("ibv_devinfo.pib-2.stderr.txt")
# WukLab/LITE#5: no RDMA sysfs (perror's format)
FAILED_LIST = sample("ibv.lite-5.failed-list.txt")
# linux-rdma/perftest#262: a healthy host warns about providers it has no device for
PERFTEST_WARNINGS = sample("libibverbs.perftest-262.stderr.txt")
# sgl-project/sglang#16242: a container's old bnxt_re provider against a newer kernel
SGLANG_ABI_WARNINGS = sample("libibverbs.sglang-16242.stderr.txt")
# bytedance/byteps#313: a provider built for another libibverbs
BYTEPS_WARNING = line("libibverbs.byteps-313.stderr.txt")
# SoftRoCE/rxe-dev#46 (tabs turned into spaces; that kernel printed no link_layer)
RXE_DEVINFO = sample("ibv_devinfo.rxe-dev-46.txt")
# hustcat/k8s-rdma-device-plugin#8 (MLNX_OFED: board_id, "Device ports:"), stdout part
OFED_DEVINFO = sample("ibv_devinfo.k8s-rdma-device-plugin-8.txt")
# rdma-core before linux-rdma/rdma-core#682 printed GIDs without their type
OLD_GIDS_DEVINFO = sample("ibv_devinfo.old-gids.txt")

# amd-smi list --json (ROCm 6.x list form); record fields as in ROCm/rocm-systems#3654
AMD_LIST_RECORD: dict[str, Any] = json.loads(sample("amd-smi-list.record.json"))
# ROCm/rocm-systems#3654: the same without --json (someone forgot the flag)
AMD_LIST_TEXT = sample("amd-smi-list.rocm-systems-3654.txt")
# nathaninline/ajean#39: amd-smi static --json on a newer amd-smi wraps in gpu_data
AJEAN_STATIC_GPU_DATA = sample("amd-smi-static.ajean-39.json")
# ...and what that terminal showed above it, from Python 3.14's SyntaxWarnings
AJEAN_WARNINGS = sample("amd-smi-static.ajean-39.stderr.txt")
# ROCm/rocm_smi_lib#159: rocm-smi --showproductname --json, "Card Series"
ROCM_SMI_SERIES = sample("rocm-smi.rocm_smi_lib-159.json")
# wandb/wandb#5449: an older rocm-smi's JSON says "Card series" (trimmed to its product keys)
ROCM_SMI_SERIES_LOWER = line("rocm-smi.wandb-5449.json")
# easybuilders/easybuild-framework#3978: the text form (no --json)
ROCM_SMI_TEXT = sample("rocm-smi.easybuild-3978.txt")
# ROCm/legacy-rocm-build#4374: rocm-smi with nothing to report (exit 0)
ROCM_SMI_NO_JSON = sample("rocm-smi.no-json.txt")
# pdfake.py's amd-smi/rocm-smi without the amdgpu module
AMD_SMI_NO_DRIVER = sample("amd-smi.no-driver.stderr.txt")
ROCM_SMI_NO_DRIVER = sample("rocm-smi.no-driver.stderr.txt")
# docker/cli#3594 + docker/cli#5900: daemon down, yet `docker info` may exit 0
DOCKER_INFO_DAEMON_DOWN = json.dumps(json.loads(sample("docker-info.daemon-down.json")))

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
        "tools": {tool: f"/usr/bin/{tool}" if is_gpu else None for tool in PERFTEST_TOOLS},
        "elapsed_s": 0.8,
    }


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def failing(checks: list[Check]) -> dict[str, str]:
    return {check.name: check.message for check in checks if not check.ok}


GPU = Expectations(kind="gpu")
CPU = Expectations(kind="cpu")
