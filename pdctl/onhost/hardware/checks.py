"""The preflight's verdicts: is this host fit to run PD workers (or the router)?

``evaluate()`` reads the raw document (through facts.read_view) against the fleet's
Expectations and returns one named Check per concern (CHECK_NAMES), each with a message that
names the host, what was found and the fix. CPU hosts (router candidates) skip the GPU and RDMA
checks; an NVIDIA host is checked for its container toolkit and CDI spec too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdctl.onhost.hardware.documents import PERFTEST_TOOLS
from pdctl.onhost.hardware.facts import View, read_view, to_gb
from pdctl.onhost.hardware.parsing import (
    as_dict,
    clip,
    command_result,
    installed,
    snippet,
    stderr_summary,
)
from pdctl.onhost.hardware.paths import CDI_SPEC_PATHS, DEFAULT_PROVIDER_LIB, PROVIDER_DIRS

CDI_GENERATE = "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"

CPU_SKIP_MESSAGE = "CPU-only host (router candidate): GPU/RDMA checks skipped"

CHECK_NAMES = (
    "systemd",
    "gpus",
    "container_toolkit",
    "cdi",
    "rdma_devices",
    "rdma_ports",
    "provider_lib",
    "roce_gid",
    "perftest",
    "runtime",
    "memlock",
    "disk",
    "mesh",
)

# Workers (and so RDMA and their rlimits) run on GPU hosts only.
GPU_ONLY_CHECKS = frozenset(
    {"gpus", "rdma_devices", "rdma_ports", "provider_lib", "roce_gid", "perftest", "memlock"}
)

# NVIDIA-only checks: AMD GPUs reach containers as plain device nodes, no toolkit or CDI.
NVIDIA_ONLY_CHECKS = frozenset({"container_toolkit", "cdi"})


def _named_list(items: Sequence[str], limit: int = 8) -> str:
    """'a, b and c', with 'and N more' past limit."""
    shown = list(items[:limit])
    if len(items) > limit:
        return ", ".join(shown) + f" and {len(items) - limit} more"
    if len(shown) == 1:
        return shown[0]
    return ", ".join(shown[:-1]) + " and " + shown[-1]


def _grouped(problems: Sequence[tuple[str, str, str]]) -> str:
    """(device, issue, detail) triples as 'a and b <issue>; c <issue> <detail>'.

    Devices sharing an issue are named together, so every faulty device fits in
    one short message; the detail (what is there) is kept when they share it.
    """
    groups: dict[str, list[tuple[str, str]]] = {}
    for name, issue, detail in problems:
        groups.setdefault(issue, []).append((name, detail))
    parts = []
    for issue, members in groups.items():
        names = _named_list([name for name, _ in members], 16)
        details = {detail for _, detail in members}
        detail = f" {members[0][1]}" if len(details) == 1 and members[0][1] else ""
        verb = issue
        if len(members) > 1:  # "bnxt_re1 and bnxt_re4 have no GID[3]"
            verb = re.sub(
                r"^(has|is) ", lambda m: {"has": "have ", "is": "are "}[m.group(1)], issue
            )
        parts.append(f"{names} {verb}{detail}")
    return "; ".join(parts)


# "any", "auto": a fleet that mixes vendors; each host is checked by what it has (_resolve).
GPU_VENDORS = ("amd", "nvidia", "any")

LINK_LAYERS = ("eth", "ib", "auto")

AUTO_NIC_DRIVER = "auto"

# The NICs such servers usually carry: what a mixed fleet's host without a NIC is told to have.
USUAL_NIC_DRIVER = {"amd": "bnxt_re", "nvidia": "mlx5"}

_LINK_LAYER_NAMES = {"eth": "Ethernet", "ib": "InfiniBand"}


@dataclass
class Expectations:
    """What a host of a fleet must have; kind "cpu" hosts skip the GPU/RDMA checks."""

    kind: str  # "gpu" | "cpu"
    gpus: int = 8
    gpu_model: str | None = "MI300X"
    nics: int = 8
    # Device names the NICs usually have (bnxt_re0.., mlx5_0..); None: from nic_driver.
    nic_prefix: str | None = None
    provider_lib: str = DEFAULT_PROVIDER_LIB
    gid_index: int = 3
    min_disk_gb: float = 50.0
    gpu_vendor: str = "amd"  # "amd" | "nvidia" | "any"
    # The libibverbs provider's name: bnxt_re, mlx5, irdma, ...; "auto": the host's own.
    nic_driver: str = "bnxt_re"
    link_layer: str = "eth"  # "eth" (RoCE) | "ib" (InfiniBand) | "auto" (the host's own)

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"Expectations.kind must be 'gpu' or 'cpu', got {self.kind!r}")
        if self.gpu_vendor not in GPU_VENDORS:
            raise ValueError(f"Expectations.gpu_vendor must be one of {GPU_VENDORS}")
        if self.link_layer not in LINK_LAYERS:
            raise ValueError(f"Expectations.link_layer must be one of {LINK_LAYERS}")
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", self.nic_driver):
            raise ValueError(f"Expectations.nic_driver is not a driver name: {self.nic_driver!r}")


@dataclass
class Check:
    name: str
    ok: bool
    message: str
    skipped: bool = False
    emulated: bool = False  # passed only because the host emulates it (the pdctl lab)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _prefix(expect: Expectations) -> str:
    """bnxt_re -> bnxt_re (bnxt_re0..), mlx5 -> mlx5_ (mlx5_0..)."""
    if expect.nic_prefix:
        return expect.nic_prefix
    driver = expect.nic_driver
    return f"{driver}_" if driver[-1:].isdigit() else driver


def _expected_nics(expect: Expectations) -> list[str]:
    return [f"{_prefix(expect)}{i}" for i in range(expect.nics)]


def _nic_range(expect: Expectations) -> str:
    if expect.nics == 1:
        return f"{_prefix(expect)}0"
    return f"{_prefix(expect)}0..{_prefix(expect)}{expect.nics - 1}"


def _driver(expect: Expectations) -> str:
    return expect.nic_driver


def _fleet_nics(view: View, expect: Expectations) -> list[str]:
    """The present RDMA devices of the fleet's NIC driver: by the kernel driver sysfs shows
    (so udev names like rocep1s0f1 count), else by their name; the usual names first."""
    usual = _expected_nics(expect)
    mine = [name for name in _present(view) if view.nic_driver(name) == expect.nic_driver]
    return sorted(mine, key=lambda n: (usual.index(n) if n in usual else len(usual), n))


def _provider_stem(path: str) -> str:
    """libbnxt_re-rdmav34.so -> bnxt_re (the name libibverbs also uses for it)."""
    match = re.match(r"^lib(.+?)-rdmav\d+\.so", Path(path).name)
    return match.group(1) if match else Path(path).name


def _relevant_warnings(view: View, expect: Expectations) -> list[str]:
    return [w for w in view.warnings if expect.nic_driver in w]


def _warning_detail(warning: str) -> str:
    text = warning.split("Warning:", 1)[-1].strip()
    match = re.match(r"couldn't load driver '([^']*)':\s*(.*)$", text)
    if match:
        reason = match.group(2)
        # "libx.so: cannot open shared object file: ..." repeats the name first
        prefix = match.group(1) + ": "
        return reason[len(prefix) :] if reason.startswith(prefix) else reason
    return text


def _check_systemd(host: str, raw: dict[str, Any]) -> Check:
    cmd = command_result(raw, "systemctl")
    state = snippet(cmd["stdout"], 30) if cmd and cmd["stdout"].strip() else "unknown"
    if raw.get("systemd") is not True:
        return Check(
            "systemd",
            False,
            f"{host}: systemd is not PID 1 (/run/systemd/system is missing); pdctl runs workers "
            "as systemd units, so boot the host with systemd as init",
        )
    if state == "running":
        return Check("systemd", True, f"{host}: systemd is PID 1 and running")
    if state == "degraded":
        return Check(
            "systemd",
            True,
            f"{host}: systemd is PID 1 but degraded (some unit failed: systemctl --failed)",
        )
    hint = (
        "it is still booting: re-run the check in a minute"
        if state in ("starting", "initializing")
        else "see systemctl --failed and journalctl -b"
    )
    return Check("systemd", False, f"{host}: systemd reports {state!r}; {hint}")


def _check_amd_gpus(host: str, raw: dict[str, Any], view: View, expect: Expectations) -> Check:
    gpus, count = view.gpus, int(view.gpus.get("count") or 0)
    source, model = gpus.get("source") or "amd-smi", gpus.get("model")
    want = f"{expect.gpus} {expect.gpu_model or 'AMD'} GPU{'s' if expect.gpus != 1 else ''}"
    if gpus.get("vendor") == "nvidia" and count:
        problem = (
            f"the GPUs are {model} ({source}), expected {want}; put this host in a fleet for "
            "NVIDIA GPUs (pdctl fleet add --gpu MODEL)"
        )
    elif raw.get("kfd") is not True:
        problem = (
            "/dev/kfd is missing, so the amdgpu driver is not loaded; load it (modprobe amdgpu) "
            "and check dmesg | grep -i amdgpu"
        )
    elif not view.gpu_tools:
        problem = (
            "neither amd-smi nor rocm-smi is installed; install ROCm's amd-smi (amd-smi-lib) "
            "so GPUs can be counted"
        )
    elif gpus.get("source") is None:
        why = next((e for e in view.errors if "smi" in e), "no output")
        problem = (
            f"no GPU tool could list GPUs ({clip(why, 110)}); check the amdgpu driver "
            "(dmesg | grep -i amdgpu) and the ROCm install"
        )
    elif count > expect.gpus:
        problem = (
            f"{source} lists {count} GPUs, expected {want}; a compute partition mode (CPX) or "
            "an extra card changes the count: see amd-smi list"
        )
    elif count < expect.gpus:
        problem = (
            f"{source} lists {count} GPU{'s' if count != 1 else ''}, expected {want}; find the "
            "missing one with amd-smi list and dmesg | grep -i amdgpu (a GPU that fails to "
            "initialise drops out of the list)"
        )
    elif expect.gpu_model and not model:
        problem = (
            f"could not read the GPU model (expected {expect.gpu_model}); run amd-smi static "
            "--asic to see why"
        )
    elif expect.gpu_model and expect.gpu_model.lower() not in str(model).lower():
        problem = (
            f"the GPUs are {model}, expected {expect.gpu_model}; put this host in a fleet for "
            "its GPU model or change the fleet's gpu_model"
        )
    else:
        return Check(
            "gpus", True, f"{host}: {count} x {model or 'GPU'} ({source}), /dev/kfd present"
        )
    return Check("gpus", False, f"{host}: {problem}")


def _check_nvidia_gpus(host: str, view: View, expect: Expectations) -> Check:
    gpus, count, nvidia = view.gpus, int(view.gpus.get("count") or 0), view.nvidia
    model = gpus.get("model")
    want = f"{expect.gpus} {expect.gpu_model or 'NVIDIA'} GPU{'s' if expect.gpus != 1 else ''}"
    if nvidia is None:
        if gpus.get("vendor") == "amd" and count:
            problem = (
                f"the GPUs are {model} ({gpus.get('source')}), expected {want}; put this host in "
                "a fleet for AMD GPUs (pdctl fleet add --gpu MI300X)"
            )
        else:
            problem = (
                "nvidia-smi is not installed, so the NVIDIA driver is not either; install the "
                "driver (its utilities ship nvidia-smi) and reboot"
            )
    elif not nvidia["driver_loaded"]:
        why = next((e for e in view.errors if e.startswith("nvidia-smi")), "nvidia-smi failed")
        problem = (
            f"the NVIDIA driver is not loaded ({clip(why, 140)}); load it (modprobe nvidia, "
            "dmesg | grep -i nvrm) or reinstall the driver for this kernel"
        )
    elif count > expect.gpus:
        problem = f"nvidia-smi lists {count} GPUs, expected {want}; see nvidia-smi -L"
    elif count < expect.gpus:
        problem = (
            f"nvidia-smi lists {count} GPU{'s' if count != 1 else ''}, expected {want}; find the "
            "missing one with nvidia-smi -L and dmesg | grep -i -e nvrm -e xid (a GPU that "
            "falls off the bus drops out of the list)"
        )
    elif expect.gpu_model and not model:
        problem = f"could not read the GPU model (expected {expect.gpu_model}); run nvidia-smi -L"
    elif expect.gpu_model and expect.gpu_model.lower() not in str(model).lower():
        problem = (
            f"the GPUs are {model}, expected {expect.gpu_model}; put this host in a fleet for "
            "its GPU model or change the fleet's gpu_model"
        )
    else:
        driver = gpus.get("driver") or "unknown"
        return Check("gpus", True, f"{host}: {count} x {model} (nvidia-smi, driver {driver})")
    return Check("gpus", False, f"{host}: {problem}")


def _check_gpus(host: str, raw: dict[str, Any], view: View, expect: Expectations) -> Check:
    if expect.gpu_vendor == "nvidia":
        return _check_nvidia_gpus(host, view, expect)
    return _check_amd_gpus(host, raw, view, expect)


_TOOLKIT_FIX = (
    "install the NVIDIA Container Toolkit (apt install nvidia-container-toolkit, or dnf install "
    f"nvidia-container-toolkit), then {CDI_GENERATE}"
)


def _why_failed(raw: dict[str, Any], key: str) -> str:
    """A failed command's stderr, short enough for a check's message."""
    cmd = command_result(raw, key)
    return clip(stderr_summary(cmd) if cmd else "no output", 100)


def _check_container_toolkit(host: str, raw: dict[str, Any], view: View) -> Check:
    nvidia = view.nvidia or {}
    if not nvidia.get("ctk_installed"):
        return Check(
            "container_toolkit",
            False,
            f"{host}: nvidia-ctk is not installed, so containers cannot get the GPUs through "
            f"CDI; {_TOOLKIT_FIX}",
        )
    version = nvidia.get("ctk_version")
    if version is None:
        why = _why_failed(raw, "nvidia_ctk_version")
        return Check(
            "container_toolkit",
            False,
            f"{host}: nvidia-ctk --version failed ({why}); reinstall the NVIDIA Container Toolkit",
        )
    return Check("container_toolkit", True, f"{host}: NVIDIA Container Toolkit {version}")


def _check_cdi(host: str, raw: dict[str, Any], view: View) -> Check:
    nvidia = view.nvidia or {}
    if not nvidia.get("ctk_installed"):
        return Check(
            "cdi",
            False,
            f"{host}: cannot list CDI devices without nvidia-ctk; fix container_toolkit first",
        )
    spec = nvidia.get("cdi_spec")
    if spec is None:
        return Check(
            "cdi",
            False,
            f"{host}: no CDI spec for the GPUs ({' and '.join(CDI_SPEC_PATHS)} are missing), so "
            f"podman cannot resolve --device nvidia.com/gpu=N; generate it: {CDI_GENERATE}",
        )
    listed = nvidia.get("cdi_devices")
    if listed is None:
        why = _why_failed(raw, "nvidia_ctk_cdi_list")
        return Check(
            "cdi",
            False,
            f"{host}: nvidia-ctk cdi list failed ({why}); regenerate the spec: {CDI_GENERATE}",
        )
    gpus = [d for d in view.gpus.get("devices") or [] if view.gpus.get("vendor") == "nvidia"]
    names = set(listed)
    missing = [
        str(d["index"]) for d in gpus if str(d["index"]) not in names or d.get("uuid") not in names
    ]
    indexes = {str(d["index"]) for d in gpus}
    stale = sorted((n for n in names if n.isdigit() and n not in indexes), key=int)
    if missing or stale:
        parts = []
        if missing:
            parts.append(f"does not list GPU {_named_list(missing)} (by index and UUID)")
        if stale:
            parts.append(f"lists GPU {_named_list(stale)} that nvidia-smi does not show")
        return Check(
            "cdi",
            False,
            f"{host}: the CDI spec {spec} {' and '.join(parts)}; regenerate it after every "
            f"driver or GPU change: {CDI_GENERATE}",
        )
    return Check(
        "cdi",
        True,
        f"{host}: CDI spec {spec} lists all {len(gpus)} GPUs (nvidia.com/gpu=0..{len(gpus) - 1})"
        if gpus
        else f"{host}: CDI spec {spec} present",
    )


def _present(view: View) -> list[str]:
    names = list(view.listed or [])
    names += [dev.name for dev in view.devinfo or [] if dev.name not in names]
    return names


def _check_rdma_devices(host: str, raw: dict[str, Any], view: View, expect: Expectations) -> Check:
    expected = _expected_nics(expect)
    if not expected:
        return Check("rdma_devices", True, f"{host}: no RDMA NIC expected")
    cmd = command_result(raw, "ibv_devices")
    if not installed(cmd):
        return Check(
            "rdma_devices",
            False,
            f"{host}: ibv_devices is not installed; install rdma-core's tools "
            "(apt install ibverbs-utils, or dnf install libibverbs-utils)",
        )
    if view.listed is None and cmd is not None:
        why = next((e for e in view.errors if e.startswith("ibv_devices")), stderr_summary(cmd))
        return Check(
            "rdma_devices",
            False,
            f"{host}: {clip(why, 140)}; load the RDMA stack (modprobe {_driver(expect)} "
            f"ib_uverbs) and check dmesg | grep {_driver(expect).split('_')[0]}",
        )
    mine = _fleet_nics(view, expect)
    if mine[: len(expected)] == expected:
        return Check("rdma_devices", True, f"{host}: ibv_devices lists {_nic_range(expect)}")
    if len(mine) >= expect.nics:
        return Check(
            "rdma_devices",
            True,
            f"{host}: ibv_devices lists {len(mine)} {_driver(expect)} devices "
            f"({_named_list(mine, 16)})",
        )
    listed = set(mine)
    missing = [name for name in expected if name not in listed][: expect.nics - len(mine)]
    others = sorted(
        {d for d in (view.nic_driver(n) for n in _present(view)) if d and d != expect.nic_driver}
    )
    if _relevant_warnings(view, expect):
        fix = (
            f"libibverbs could not load its {_provider_stem(expect.provider_lib)} provider "
            "library, so no device shows: fix provider_lib first"
        )
    else:
        fix = (
            f"check that the {_driver(expect)} driver is loaded and the NIC is cabled "
            f"(ibv_devices, dmesg | grep {_driver(expect).split('_')[0]})"
        )
    if others:
        fix += (
            f"; this host has {_named_list(others)} devices instead: if that is right, set the "
            f"fleet's NIC driver (pdctl fleet add ... --nic-driver {others[0]})"
        )
    return Check(
        "rdma_devices",
        False,
        f"{host}: ibv_devices does not list {_named_list(missing, 16)} "
        f"(expected {_nic_range(expect)}); {fix}",
    )


def _port_problem(view: View, name: str, link_layer: str) -> tuple[str, str, str] | None:
    device = next((dev for dev in view.devinfo or [] if dev.name == name), None)
    if device is None:
        return name, "is missing from ibv_devinfo", ""
    port = device.port(1)
    if port is None:
        return name, "has no port 1 in ibv_devinfo", ""
    if port.state != "PORT_ACTIVE":
        return name, f"port 1 is {port.state} ({port.state_code})", ""
    want = _LINK_LAYER_NAMES[link_layer]
    if port.link_layer != want:
        layer = port.link_layer or "not shown"
        return name, f"port 1 link_layer is {layer}, expected {want}", ""
    if link_layer == "ib" and not port.lid:
        return name, "port 1 has no LID (port_lid 0)", ""
    return None


def _check_rdma_ports(host: str, raw: dict[str, Any], view: View, expect: Expectations) -> Check:
    names = _fleet_nics(view, expect)
    if not _expected_nics(expect):
        return Check("rdma_ports", True, f"{host}: no RDMA NIC expected")
    cmd = command_result(raw, "ibv_devinfo")
    if not installed(cmd):
        return Check(
            "rdma_ports",
            False,
            f"{host}: ibv_devinfo is not installed; install rdma-core's tools "
            "(apt install ibverbs-utils, or dnf install libibverbs-utils)",
        )
    if not names:
        return Check(
            "rdma_ports",
            False,
            f"{host}: no {_driver(expect)} device to check ports on; fix rdma_devices first",
        )
    if view.devinfo is None and cmd is not None:
        why = next((e for e in view.errors if e.startswith("ibv_devinfo")), stderr_summary(cmd))
        return Check(
            "rdma_ports",
            False,
            f"{host}: cannot read port states: {clip(why, 150)}; run ibv_devinfo -v to see why",
        )
    layer = _LINK_LAYER_NAMES[expect.link_layer]
    problems = [p for p in (_port_problem(view, n, expect.link_layer) for n in names) if p]
    if not problems:
        lids = ", LID assigned" if expect.link_layer == "ib" else ""
        return Check(
            "rdma_ports",
            True,
            f"{host}: port 1 is PORT_ACTIVE ({layer}{lids}) on {len(names)} {_driver(expect)} "
            "devices",
        )
    fix = "bring the links up (cables, switch ports, ip link; ibv_devinfo -d DEV)"
    if any("link_layer" in issue for _, issue, _ in problems):
        fix = (
            f"the fleet expects {layer}: set the fleet's link layer (pdctl fleet add ... "
            "--link-layer ib|eth) or switch the port's mode (mlxconfig LINK_TYPE_P1)"
        )
    elif any("LID" in issue for _, issue, _ in problems):
        fix = (
            "an InfiniBand port gets its LID from the subnet manager: run one (opensm) or "
            "check the switch's SM (sminfo, ibstat)"
        )
    return Check("rdma_ports", False, f"{host}: {_grouped(problems)}; {fix}")


_PROVIDER_FIX = (
    "install rdma-core's provider libraries (apt install ibverbs-providers, or dnf install "
    "libibverbs)"
)


def _provider_label(expect: Expectations) -> str:
    if expect.nic_driver == "bnxt_re":
        return "Broadcom's RoCE provider library"
    return f"the {expect.nic_driver} provider library"


def _check_provider_lib(host: str, raw: dict[str, Any], view: View, expect: Expectations) -> Check:
    provider = as_dict(raw.get("provider_lib"))
    path = str(provider.get("path") or expect.provider_lib)
    if _provider_stem(path) != expect.nic_driver:
        return _check_provider_glob(host, view, expect)
    soname = Path(path).name
    exists = provider.get("exists") is True
    relevant = _relevant_warnings(view, expect)
    if relevant:
        detail = clip(_warning_detail(relevant[0]), 90)
        fix = (
            f"{path} is missing: install {_provider_label(expect)} ({soname}) there"
            if not exists
            else f"{path} exists but does not suit this libibverbs/kernel: install the matching one"
        )
        return Check(
            "provider_lib", False, f"{host}: libibverbs could not load {soname}: {detail}; {fix}"
        )
    if not exists:
        elsewhere = [str(p) for p in provider.get("elsewhere") or []]
        elsewhere += [p for p in view.provider_libs.get(expect.nic_driver, []) if p != path]
        fix = (
            f"it is at {elsewhere[0]}: set provider_lib to that path"
            if elsewhere
            else f"install {_provider_label(expect)} ({soname}) there"
        )
        return Check(
            "provider_lib",
            False,
            f"{host}: {soname} not found at {path} (the worker containers bind-mount it from "
            f"there); {fix}",
        )
    return Check("provider_lib", True, f"{host}: {soname} present at {path}")


def _check_provider_glob(host: str, view: View, expect: Expectations) -> Check:
    """The fleet's provider by glob in every provider directory (no path configured for it)."""
    pattern = f"lib{expect.nic_driver}-rdmav*.so"
    relevant = _relevant_warnings(view, expect)
    found = view.provider_libs.get(expect.nic_driver, [])
    if relevant:
        detail = clip(_warning_detail(relevant[0]), 90)
        return Check(
            "provider_lib",
            False,
            f"{host}: libibverbs could not load its {expect.nic_driver} provider: {detail}; "
            f"{_PROVIDER_FIX}",
        )
    if not found:
        return Check(
            "provider_lib",
            False,
            f"{host}: no {pattern} in {' or '.join(PROVIDER_DIRS[:2])} (libibverbs' "
            f"{expect.nic_driver} provider, without which no device shows); {_PROVIDER_FIX}",
        )
    return Check("provider_lib", True, f"{host}: {Path(found[0]).name} present at {found[0]}")


def _gid_problem(view: View, name: str, index: int) -> tuple[str, str, str] | None:
    device = next((dev for dev in view.devinfo or [] if dev.name == name), None)
    port = device.port(1) if device else None
    if port is None:
        return None
    gid = port.gid(index)
    if gid is None:
        shown = ", ".join(str(g.index) for g in port.gids[:6]) or "none"
        return name, f"has no GID[{index}]", f"(indexes shown: {shown})"
    if gid.kind != "RoCE v2":
        return name, f"GID[{index}] is {gid.kind or 'untyped'}", f"({clip(gid.address, 40)})"
    return None


def _check_roce_gid(host: str, view: View, expect: Expectations) -> Check:
    active = []
    for name in _fleet_nics(view, expect):
        device = next((dev for dev in view.devinfo or [] if dev.name == name), None)
        port = device.port(1) if device else None
        if port is not None and port.state == "PORT_ACTIVE":
            active.append(name)
    if not _expected_nics(expect):
        return Check("roce_gid", True, f"{host}: no RDMA NIC expected")
    if expect.link_layer == "ib":
        return Check(
            "roce_gid",
            True,
            f"{host}: InfiniBand fabric: ports are addressed by LID (rdma_ports), no RoCE GID",
            skipped=True,
        )
    if not active:
        return Check(
            "roce_gid",
            False,
            f"{host}: no active {_driver(expect)} port to read GID[{expect.gid_index}] from "
            f"(MC_GID_INDEX); fix rdma_devices/rdma_ports first",
        )
    problems = [p for p in (_gid_problem(view, name, expect.gid_index) for name in active) if p]
    if not problems:
        return Check(
            "roce_gid",
            True,
            f"{host}: GID[{expect.gid_index}] is RoCE v2 on {len(active)} active ports "
            f"(MC_GID_INDEX={expect.gid_index})",
        )
    return Check(
        "roce_gid",
        False,
        f"{host}: {_grouped(problems)}; RoCE v2 GIDs appear once the NIC's netdev has an "
        f"IP address: assign one, or set MC_GID_INDEX to a RoCE v2 index (ibv_devinfo -v)",
    )


def _check_perftest(host: str, raw: dict[str, Any]) -> Check:
    tools = raw.get("tools")
    if not isinstance(tools, dict):
        return Check("perftest", False, f"{host}: perftest was not probed (re-run the check)")
    missing = [name for name in PERFTEST_TOOLS if not tools.get(name)]
    if missing:
        return Check(
            "perftest",
            False,
            f"{host}: {' and '.join(missing)} not found (perftest, which `pdctl fleet check "
            "--fabric` runs between hosts); install the package perftest (apt install perftest; "
            "dnf install perftest)",
        )
    return Check("perftest", True, f"{host}: perftest's ib_write_bw and ib_write_lat present")


def _check_runtime(host: str, view: View) -> Check:
    name, version = view.runtime.get("name"), view.runtime.get("version")
    if not name:
        return Check(
            "runtime",
            False,
            f"{host}: no container runtime: neither podman nor docker is installed; install one "
            "(apt install podman)",
        )
    if not view.runtime.get("usable"):
        start = "systemctl start docker" if name == "docker" else "podman info"
        return Check(
            "runtime",
            False,
            f"{host}: {name} {version} is installed but `{name} info` failed "
            f"({clip(view.runtime_error or '', 110)}); fix it ({start})",
        )
    return Check("runtime", True, f"{host}: {name} {version} works (`{name} info` succeeds)")


def _memlock_fix(runtime: str, cap_sys_resource: object) -> str:
    if cap_sys_resource is False:
        return (
            "raise RLIMIT_MEMLOCK to unlimited where this host is made (e.g. `--ulimit "
            "memlock=-1:-1`, nspawn `--rlimit=RLIMIT_MEMLOCK=infinity`) or grant it "
            "CAP_SYS_RESOURCE"
        )
    if runtime == "docker":
        return "LimitMEMLOCK=infinity in a drop-in for docker.service and containerd.service"
    return "DefaultLimitMEMLOCK=infinity in /etc/systemd/system.conf (podman runs in pdctl's units)"


def _check_memlock(host: str, raw: dict[str, Any], view: View) -> Check:
    memlock = as_dict(raw.get("memlock"))
    if "unlimited" not in memlock:
        return Check("memlock", False, f"{host}: memlock was not probed (re-run the check)")
    if memlock["unlimited"] is True:
        return Check(
            "memlock",
            True,
            f"{host}: root can set memlock unlimited (the workers' --ulimit memlock=-1:-1, RDMA)",
        )
    hard = memlock.get("hard")
    limit = "unlimited" if hard is None else f"{hard} bytes"
    cap = memlock.get("cap_sys_resource")
    why = (
        f"no CAP_SYS_RESOURCE here (a container or sandbox host) and the hard limit is {limit}"
        if cap is False
        else f"setrlimit failed ({memlock.get('error') or 'no error text'}), hard limit {limit}"
    )
    if view.runtime.get("clamps_rlimits"):
        return Check(
            "memlock",
            True,
            f"{host}: memlock unlimited emulated: {why}; the OCI runtime "
            f"{view.runtime.get('oci_runtime') or ''} lowers containers' rlimits to what the host "
            f"grants, so workers run with memlock {limit}",
            emulated=True,
        )
    if memlock.get("euid") != 0:
        return Check(
            "memlock",
            False,
            f"{host}: memlock not checked: the probe ran as uid {memlock.get('euid')}, not root "
            "(fix sudo first)",
        )
    runtime = str(view.runtime.get("name") or "the container runtime")
    return Check(
        "memlock",
        False,
        f"{host}: {runtime} cannot give the workers memlock unlimited (--ulimit memlock=-1:-1, "
        f"for RDMA): {why}; fix: {_memlock_fix(runtime, cap)}; or, without RDMA, set "
        "`pdctl: {memlock: inherit}` in the spec",
    )


def _check_disk(host: str, raw: dict[str, Any], expect: Expectations) -> Check:
    storage = as_dict(raw.get("storage"))
    path, free = storage.get("path"), to_gb(storage.get("free_bytes"))
    if not path:
        tried = ", ".join(str(p) for p in storage.get("candidates") or []) or "no path given"
        return Check(
            "disk",
            False,
            f"{host}: none of the container storage paths exist ({clip(tried, 120)}); create it "
            "or configure the storage path",
        )
    if free is None:
        why = storage.get("error") or "unknown error"
        return Check("disk", False, f"{host}: cannot read free space on {path} ({why})")
    if free < expect.min_disk_gb:
        return Check(
            "disk",
            False,
            f"{host}: only {free:.1f} GB free on {path}, need {expect.min_disk_gb:g} GB for worker "
            "images; free space or move container storage to a larger disk",
        )
    return Check(
        "disk", True, f"{host}: {free:.1f} GB free on {path} (need {expect.min_disk_gb:g})"
    )


def _check_mesh(host: str, raw: dict[str, Any]) -> Check:
    reach = [r for r in raw.get("reach") or [] if isinstance(r, dict)]
    if not reach:
        return Check("mesh", True, f"{host}: no peers to check")
    bad = [
        f"{r.get('address')}:{r.get('port')} ({clip(str(r.get('error') or 'unreachable'), 60)})"
        for r in reach
        if r.get("ok") is not True
    ]
    if not bad:
        return Check("mesh", True, f"{host}: reached all {len(reach)} peers")
    return Check(
        "mesh",
        False,
        f"{host}: cannot reach {_named_list(bad, 4)}; open these ports between the hosts "
        "(firewall, routes) and check the peers are up",
    )


def _resolve(expect: Expectations, view: View) -> Expectations:
    """A mixed fleet's expectations for one host: its vendor (nvidia-smi installed or not),
    its NICs' driver (the most common among its devices) and their ports' link layer."""
    vendor, driver, layer = expect.gpu_vendor, expect.nic_driver, expect.link_layer
    if vendor == "any":
        vendor = "nvidia" if view.nvidia is not None else "amd"
    if driver == AUTO_NIC_DRIVER:
        found = [d for d in (view.nic_driver(n) for n in _present(view)) if d]
        driver = max(sorted(set(found)), key=found.count) if found else USUAL_NIC_DRIVER[vendor]
    resolved = replace(expect, gpu_vendor=vendor, nic_driver=driver)
    if layer == "auto":
        ports = [
            port.link_layer
            for device in view.devinfo or []
            if device.name in _fleet_nics(view, resolved)
            for port in device.ports[:1]
        ]
        layer = "ib" if ports and set(ports) == {"InfiniBand"} else "eth"
    return replace(resolved, link_layer=layer)


def evaluate(host: str, document: Mapping[str, Any], expect: Expectations) -> list[Check]:
    """The preflight checks, in CHECK_NAMES order. Never raises on odd observations."""
    raw = as_dict(document)
    view = read_view(raw)
    try:
        expect = _resolve(expect, view)
    except Exception:  # odd observations: the checks below say what is wrong
        expect = replace(
            expect,
            gpu_vendor="amd" if expect.gpu_vendor == "any" else expect.gpu_vendor,
            nic_driver="bnxt_re" if expect.nic_driver == AUTO_NIC_DRIVER else expect.nic_driver,
            link_layer="eth" if expect.link_layer == "auto" else expect.link_layer,
        )
    builders: dict[str, Callable[[], Check]] = {
        "systemd": lambda: _check_systemd(host, raw),
        "gpus": lambda: _check_gpus(host, raw, view, expect),
        "container_toolkit": lambda: _check_container_toolkit(host, raw, view),
        "cdi": lambda: _check_cdi(host, raw, view),
        "rdma_devices": lambda: _check_rdma_devices(host, raw, view, expect),
        "rdma_ports": lambda: _check_rdma_ports(host, raw, view, expect),
        "provider_lib": lambda: _check_provider_lib(host, raw, view, expect),
        "roce_gid": lambda: _check_roce_gid(host, view, expect),
        "perftest": lambda: _check_perftest(host, raw),
        "runtime": lambda: _check_runtime(host, view),
        "memlock": lambda: _check_memlock(host, raw, view),
        "disk": lambda: _check_disk(host, raw, expect),
        "mesh": lambda: _check_mesh(host, raw),
    }
    checks = []
    for name in CHECK_NAMES:
        if expect.gpu_vendor != "nvidia" and name in NVIDIA_ONLY_CHECKS:
            # Not a skipped check: on an AMD fleet there is nothing of the kind to have.
            message = f"{host}: AMD fleet: ROCm devices reach containers directly, no CDI needed"
            checks.append(Check(name, True, message))
            continue
        if expect.kind == "cpu" and name in GPU_ONLY_CHECKS | NVIDIA_ONLY_CHECKS:
            checks.append(Check(name, True, CPU_SKIP_MESSAGE, skipped=True))
            continue
        try:
            checks.append(builders[name]())
        except Exception as exc:  # a check that cannot judge says so instead of raising
            checks.append(Check(name, False, f"{host}: could not evaluate {name}: {exc}"))
    return checks
