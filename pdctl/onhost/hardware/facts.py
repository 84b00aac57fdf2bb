"""A host's raw document summarised: the Facts pdctl stores (documents.py says their shape).

``read_view()`` parses the raw document once, tool by tool (the parsers of each family), for
``facts()`` here and for the checks (checks.py). Neither raises: what could not be read lands in
the facts' "errors".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdctl.onhost.hardware.amd import (
    parse_amd_smi_list,
    parse_amd_smi_static,
    parse_rocm_smi_products,
)
from pdctl.onhost.hardware.documents import (
    RC_NOT_FOUND,
    Facts,
    GpuDeviceFacts,
    PortFacts,
    RdmaDeviceFacts,
)
from pdctl.onhost.hardware.ibverbs import (
    RdmaDevice,
    RdmaPort,
    parse_ibv_devices,
    parse_ibv_devinfo,
    provider_driver,
    provider_warnings,
)
from pdctl.onhost.hardware.nvidia import (
    parse_nvidia_ctk_cdi_list,
    parse_nvidia_ctk_version,
    parse_nvidia_smi_query,
)
from pdctl.onhost.hardware.parsing import (
    as_dict,
    clip,
    command_label,
    command_result,
    installed,
    parse_output,
    snippet,
    stderr_summary,
    unique,
)
from pdctl.onhost.hardware.pci import normalize_bdf, pci_chain
from pdctl.onhost.hardware.runtime import runtime_view

GIB = 1024**3


def to_gb(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return round(float(value) / GIB, 1)


def dstack_gpu_name(name: str) -> str:
    """A GPU's model as dstack spells it: 'NVIDIA H100 80GB HBM3' -> 'H100',
    'NVIDIA A100-SXM4-80GB' -> 'A100', 'AMD Instinct MI300X' -> 'MI300X'."""
    amd = re.search(r"\b(MI\d{3}[A-Z]?)\b", name, re.IGNORECASE)
    if amd:
        return amd.group(1).upper()
    words = re.sub(r"^(NVIDIA|Tesla|AMD|Radeon|Instinct)\s+", "", name.strip(), flags=re.I)
    words = re.sub(r"^(NVIDIA|Tesla|GeForce|Quadro)\s+", "", words, flags=re.I)
    parts = re.split(r"[\s-]+", words)
    if len(parts) > 1 and parts[0].upper() in ("RTX", "GTX") and parts[1]:
        return parts[0].upper() + parts[1].upper()  # "RTX 4090" -> "RTX4090"
    model = parts[0] if parts and parts[0] else name.strip()
    if len(parts) > 1 and parts[1].upper() == "NVL":
        return model + "NVL"
    return model


def _model(names: Sequence[str]) -> str | None:
    distinct = unique(names)
    return ", ".join(distinct) if distinct else None


@dataclass
class View:
    """What the raw document says, parsed once for facts() and evaluate()."""

    errors: list[str]
    gpus: dict[str, Any]
    gpu_tools: bool  # amd-smi or rocm-smi is installed
    listed: list[str] | None  # ibv_devices' names; None when it did not run or parse
    devinfo: list[RdmaDevice] | None
    warnings: list[str]
    runtime: dict[str, Any]
    runtime_error: str | None
    nvidia: dict[str, Any] | None = None  # None: no nvidia-smi on this host
    sysfs: dict[str, Any] = field(default_factory=dict)
    provider_libs: dict[str, list[str]] = field(default_factory=dict)

    def nic(self, name: str) -> dict[str, Any]:
        """What sysfs says of RDMA device NAME ({} when it does not show it)."""
        return as_dict(as_dict(self.sysfs.get("infiniband")).get(name))

    def nic_driver(self, name: str) -> str | None:
        return provider_driver(self.nic(name).get("driver"), name)


def _nvidia_gpus(raw: dict[str, Any], errors: list[str]) -> dict[str, Any] | None:
    """GPUs as nvidia-smi lists them; None when nvidia-smi is not installed."""
    smi = command_result(raw, "nvidia_smi")
    if smi is None or smi["rc"] == RC_NOT_FOUND:
        return None
    gpus: dict[str, Any] = {"count": 0, "model": None, "source": "nvidia-smi", "bdfs": []}
    gpus.update(vendor="nvidia", devices=[], memory_mib=None, driver=None)
    if smi["rc"] != 0:  # no driver: nvidia-smi says so on stdout and exits 9
        why = snippet(smi["stdout"] or smi["stderr"], 110)
        errors.append(f"{command_label(smi)} exited {smi['rc']}: {why}")
        return gpus
    rows = parse_output(smi, parse_nvidia_smi_query, errors) or []
    rows = sorted(rows, key=lambda r: r.get("index") if isinstance(r.get("index"), int) else -1)
    memories = [r["memory.total"] for r in rows if isinstance(r.get("memory.total"), int)]
    gpus.update(
        count=len(rows),
        model=_model([str(r.get("name") or "") for r in rows if r.get("name")]),
        bdfs=[r["pci"] for r in rows if r.get("pci")],
        devices=[
            {
                "index": r.get("index"),
                "pci": r.get("pci"),
                "memory_mib": r.get("memory.total"),
                "uuid": r.get("uuid"),
            }
            for r in rows
        ],
        memory_mib=min(memories) if memories else None,
        driver=next((str(r["driver_version"]) for r in rows if r.get("driver_version")), None),
    )
    return gpus


def _nvidia_view(raw: dict[str, Any], errors: list[str]) -> dict[str, Any] | None:
    """The NVIDIA driver, container toolkit and CDI spec; None without nvidia-smi."""
    smi = command_result(raw, "nvidia_smi")
    if smi is None or smi["rc"] == RC_NOT_FOUND:
        return None
    version_cmd, cdi_cmd = (
        command_result(raw, "nvidia_ctk_version"),
        command_result(raw, "nvidia_ctk_cdi_list"),
    )
    files = as_dict(raw.get("nvidia_files"))
    specs = [str(p) for p in files.get("cdi_specs") or [] if isinstance(p, str)]
    return {
        "driver_loaded": smi["rc"] == 0,
        "ctk_installed": installed(version_cmd),
        "ctk_version": parse_output(version_cmd, parse_nvidia_ctk_version, errors),
        "cdi_devices": parse_output(cdi_cmd, parse_nvidia_ctk_cdi_list, errors),
        "cdi_spec": specs[0] if specs else None,
        "device_nodes": [str(p) for p in files.get("device_nodes") or []],
    }


def _amd_devices(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    devices = []
    for position, record in enumerate(records):
        index = record.get("gpu")
        devices.append(
            {
                "index": index
                if isinstance(index, int) and not isinstance(index, bool)
                else position,
                "pci": normalize_bdf(str(record.get("bdf") or "")),
                "memory_mib": None,
                "uuid": str(record["uuid"]) if isinstance(record.get("uuid"), str) else None,
            }
        )
    return sorted(devices, key=lambda d: d["index"])


def _gpu_view(raw: dict[str, Any], errors: list[str]) -> tuple[dict[str, Any], bool]:
    amd_list, amd_static = (
        command_result(raw, "amd_smi_list"),
        command_result(raw, "amd_smi_static"),
    )
    rocm = command_result(raw, "rocm_smi")
    records = parse_output(amd_list, parse_amd_smi_list, errors)
    nvidia = _nvidia_gpus(raw, errors)
    if nvidia is not None and (nvidia["count"] or not records):
        return nvidia, True
    gpus: dict[str, Any] = {"count": 0, "model": None, "source": None, "bdfs": []}
    gpus.update(vendor=None, devices=[], memory_mib=None, driver=None)
    if records:
        names = parse_output(amd_static, parse_amd_smi_static, errors)
        bdfs = [str(r["bdf"]) for r in records if isinstance(r.get("bdf"), str)]
        gpus.update(count=len(records), model=_model(names or []), source="amd-smi", bdfs=bdfs)
        gpus.update(vendor="amd", devices=_amd_devices(records))
        return gpus, True
    series = parse_output(rocm, parse_rocm_smi_products, errors)
    if rocm is not None and rocm["rc"] == 0:
        # rocm-smi exits 0 even when the driver is not loaded; its ERROR lines say so.
        errors += [
            f"{command_label(rocm)}: {clip(line.strip(), 100)}"
            for line in rocm["stderr"].splitlines()
            if line.strip().startswith("ERROR")
        ]
    if series:
        gpus.update(count=len(series), model=_model(series), source="rocm-smi", vendor="amd")
        gpus["devices"] = [
            {"index": i, "pci": None, "memory_mib": None, "uuid": None} for i in range(len(series))
        ]
    elif records is not None:
        gpus["source"] = "amd-smi"
    elif series is not None:
        gpus["source"] = "rocm-smi"
    return gpus, installed(amd_list) or installed(rocm)


def read_view(raw: dict[str, Any]) -> View:
    errors: list[str] = []
    gpus, gpu_tools = _gpu_view(raw, errors)
    devices_cmd, devinfo_cmd = (
        command_result(raw, "ibv_devices"),
        command_result(raw, "ibv_devinfo"),
    )
    pairs = parse_output(devices_cmd, parse_ibv_devices, errors)
    devinfo = None
    if devinfo_cmd is not None and devinfo_cmd["rc"] != RC_NOT_FOUND:
        if "hca_id" in devinfo_cmd["stdout"] or devinfo_cmd["rc"] == 0:
            devinfo = parse_output(devinfo_cmd, parse_ibv_devinfo, errors)
        else:  # "No IB devices found" (exit 255) is an answer: no device
            devinfo = []
            if "No IB devices found" not in devinfo_cmd["stderr"]:
                errors.append(
                    f"{command_label(devinfo_cmd)} exited {devinfo_cmd['rc']}: "
                    f"{stderr_summary(devinfo_cmd)}"
                )
    warnings = unique(
        w
        for cmd in (devices_cmd, devinfo_cmd)
        if cmd is not None
        for w in provider_warnings(cmd["stderr"])
    )
    runtime, runtime_error = runtime_view(raw)
    if runtime["name"] and runtime_error:
        errors.append(f"{runtime['name']} info: {runtime_error}")
    libs = as_dict(raw.get("provider_libs"))
    return View(
        nvidia=_nvidia_view(raw, errors),
        sysfs=as_dict(raw.get("sysfs")),
        provider_libs={str(k): [str(p) for p in v] for k, v in libs.items() if isinstance(v, list)},
        errors=errors,
        gpus=gpus,
        gpu_tools=gpu_tools,
        listed=[name for name, _ in pairs] if pairs is not None else None,
        devinfo=devinfo,
        warnings=warnings,
        runtime=runtime,
        runtime_error=runtime_error,
    )


def _topology(node: dict[str, Any]) -> dict[str, Any]:
    realpath = node.get("realpath") if isinstance(node.get("realpath"), str) else None
    chain = pci_chain(realpath)
    numa = node.get("numa_node")
    return {
        "pci": chain[-1] if chain else None,
        "numa": numa if isinstance(numa, int) and not isinstance(numa, bool) else None,
        "pci_path": chain,
    }


def _gpu_device_facts(view: View) -> list[GpuDeviceFacts]:
    pci = as_dict(view.sysfs.get("pci"))
    devices: list[GpuDeviceFacts] = []
    for device in view.gpus.get("devices") or []:
        node = as_dict(pci.get(device.get("pci") or ""))
        topology = _topology(node)
        devices.append(
            {
                "index": device.get("index"),
                "pci": device.get("pci"),
                "numa": topology["numa"],
                "memory_mib": device.get("memory_mib"),
                "uuid": device.get("uuid"),
                "pci_path": topology["pci_path"],
            }
        )
    return devices


def _provider_lib_fact(raw: dict[str, Any], view: View, devices: list[RdmaDeviceFacts]) -> bool:
    """The configured provider library exists, or every present device's driver has one."""
    if as_dict(raw.get("provider_lib")).get("exists") is True:
        return True
    drivers = {d.get("driver") for d in devices}
    return bool(devices) and all(d and view.provider_libs.get(d) for d in drivers)


def _port_facts(port: RdmaPort) -> PortFacts:
    return {
        "port": port.number,
        "state": port.state,
        "link_layer": port.link_layer,
        "active_width": port.active_width,
        "active_speed": port.active_speed,
        "gids": [{"index": g.index, "address": g.address, "kind": g.kind} for g in port.gids],
    }


def _device_facts(view: View) -> list[RdmaDeviceFacts]:
    """Each RDMA device ibv_devinfo described, then those only ibv_devices listed."""
    described = [(dev.name, [_port_facts(p) for p in dev.ports]) for dev in view.devinfo or []]
    known = {name for name, _ in described}
    listed: list[tuple[str, list[PortFacts]]] = [
        (name, []) for name in view.listed or [] if name not in known
    ]
    devices: list[RdmaDeviceFacts] = []
    for name, ports in described + listed:
        topology = _topology(view.nic(name))
        devices.append(
            {
                "name": name,
                "ports": ports,
                "driver": view.nic_driver(name),
                "pci": topology["pci"],
                "numa": topology["numa"],
                "pci_path": topology["pci_path"],
            }
        )
    return devices


def facts(document: Mapping[str, Any]) -> Facts:
    """The per-host summary pdctl stores. Never raises: problems land in "errors"."""
    raw = as_dict(document)
    try:
        view = read_view(raw)
    except Exception as exc:  # a raw document no collect() wrote
        view = View([f"unreadable observations: {exc}"], {}, False, None, None, [], {}, None)
    gpus = view.gpus
    devices = _device_facts(view)
    nvidia = view.nvidia
    os_release, storage = as_dict(raw.get("os")), as_dict(raw.get("storage"))
    render_nodes = raw.get("render_nodes")
    cpus = raw.get("cpus")
    return {
        "hostname": str(raw.get("hostname") or ""),
        "os": {
            "pretty_name": str(os_release.get("pretty_name") or ""),
            "id": str(os_release.get("id") or ""),
            "version_id": str(os_release.get("version_id") or ""),
        },
        "kernel": str(raw.get("kernel") or ""),
        "cpus": cpus if isinstance(cpus, int) else None,
        "memory_gb": to_gb(raw.get("memory_bytes")),
        "disk_free_gb": to_gb(storage.get("free_bytes")),
        "disk_path": storage.get("path") if isinstance(storage.get("path"), str) else None,
        "systemd": raw.get("systemd") is True,
        "python": str(raw.get("python") or ""),
        "gpus": {
            "count": gpus.get("count", 0),
            "model": dstack_gpu_name(str(gpus["model"])) if gpus.get("model") else None,
            "vendor": gpus.get("vendor"),
            "memory_mib": gpus.get("memory_mib"),
            "driver": gpus.get("driver"),
            "source": gpus.get("source"),
            "bdfs": gpus.get("bdfs", []),
            "devices": _gpu_device_facts(view),
        },
        "kfd": raw.get("kfd") is True,
        "render_nodes": len(render_nodes) if isinstance(render_nodes, list) else 0,
        "rdma": {
            "devices": devices,
            "provider_libs": {
                name: paths[0] for name, paths in view.provider_libs.items() if paths
            },
            "provider_lib": _provider_lib_fact(raw, view, devices),
            "warnings": view.warnings,
        },
        "nvidia": None
        if nvidia is None
        else {
            "driver_loaded": nvidia["driver_loaded"],
            "ctk_version": nvidia["ctk_version"],
            "cdi_devices": nvidia["cdi_devices"] or [],
            "cdi_spec": nvidia["cdi_spec"],
        },
        "runtime": {
            "name": view.runtime.get("name"),
            "version": view.runtime.get("version"),
            "usable": view.runtime.get("usable", False),
        },
        "errors": view.errors,
    }
