"""Faults injected into a running lab host, each visible through the real tools.

Hardware faults edit the host's fake-hardware state file (read live by the
fake tools and the SGLang stand-in); the others change the host itself
(the provider library file, the podman binary, sshd). Power faults (power-off,
power-on) stop and boot the whole host: manager.power.
"""

from __future__ import annotations

from collections.abc import Callable

from pdctl.core.errors import InputError
from pdctl.lab import host as lab_host
from pdctl.lab import hub_service
from pdctl.lab.host import HostPaths
from pdctl.lab.rootfs import SUDO_USER
from pdctl.lab.state import (
    CAPACITY_SETTINGS,
    FakeHardware,
    Fault,
    LabHost,
    LabState,
    write_hardware,
)

# kind -> what its argument is (None: takes no argument)
KINDS: dict[str, str | None] = {
    "nic-missing": "DEV",
    "port-down": "DEV",
    "provider-lib-missing": None,
    "no-runtime": None,
    "sshd-down": None,
    "sudo-password": None,
    "gpu-missing": "N",
    "driver-missing": None,
    "cdi-missing": None,
    "worker-unhealthy": None,
    "link-slow": "RATE",
    "power-off": None,
    "power-on": None,
    "clear": None,
}
# The host's power (manager.power): not a change inside the host, so not kept as a fault.
POWER = {"power-off", "power-on"}
GPU_ONLY = {"nic-missing", "port-down", "provider-lib-missing", "gpu-missing"}
NVIDIA_ONLY = {"driver-missing", "cdi-missing"}
NIC_NAMES = {"bnxt_re": "bnxt_re{}", "mlx5": "mlx5_{}"}
CDI_SPECS = ("/etc/cdi/nvidia.yaml", "/var/run/cdi/nvidia.yaml")
# Re-lays out the device nodes after a state change (pdfake.py pdlab-hardware).
HARDWARE_SYNC = [f"{lab_host.SHARE_MOUNT}/fakes/pdfake.py", "pdlab-hardware"]
PODMAN = "/usr/bin/podman"
PODMAN_HIDDEN = "/usr/lib/pdctl-lab-podman.hidden"
SUDOERS = f"/etc/sudoers.d/{SUDO_USER}"
SUDOERS_HIDDEN = "/etc/pdctl-lab-sudoers.hidden"


def validate(host: LabHost, kind: str, arg: str | None) -> Fault:
    if kind not in KINDS:
        raise InputError(f"unknown fault kind {kind!r}", hint=f"one of: {', '.join(KINDS)}")
    wants = KINDS[kind]
    if wants is None and arg is not None:
        raise InputError(f"fault {kind} takes no argument (got {arg!r})")
    if wants is not None and arg is None:
        raise InputError(
            f"fault {kind} needs {wants}", hint=f"pdctl lab fault {host.name} {kind} {wants}"
        )
    if kind in GPU_ONLY | NVIDIA_ONLY and host.kind != "gpu":
        raise InputError(
            f"lab host {host.name} is a CPU host: it has no GPUs or RDMA NICs to break"
        )
    if kind in NVIDIA_ONLY and lab_host.vendor(host) != "nvidia":
        raise InputError(f"{kind}: lab host {host.name} has AMD GPUs, not NVIDIA ones")
    names = NIC_NAMES[host.model.nic_driver if host.model else "bnxt_re"]
    if wants == "DEV" and arg not in {names.format(k) for k in range(8)}:
        raise InputError(
            f"{kind}: no RDMA device {arg!r} on {host.name}",
            hint=f"{names.format(0)} .. {names.format(7)}",
        )
    if wants == "N" and not (arg and arg.isdigit() and int(arg) < host.gpus):
        raise InputError(f"{kind}: no GPU {arg!r} on {host.name}", hint=f"0 .. {host.gpus - 1}")
    if wants == "RATE" and hub_service.parse_rate(arg) is None:
        raise InputError(f"{kind} needs a rate, not {arg!r}", hint="bytes per second: 20M, 1G")
    return Fault(kind=kind, arg=arg)


def apply(host: LabHost, paths: HostPaths, fault: Fault) -> None:
    hardware = FakeHardware.model_validate_json(paths.hardware.read_text())
    if fault.kind == "clear":
        _clear(host, paths, hardware)
        return
    edit: dict[str, Callable[[], None]] = {
        "nic-missing": lambda: _add(hardware.missing_nics, fault.arg),
        "port-down": lambda: _add(hardware.down_ports, fault.arg),
        "gpu-missing": lambda: _gpu_missing(paths, hardware, int(fault.arg or 0)),
        "driver-missing": lambda: setattr(hardware, "nvidia_driver", False),
        "cdi-missing": lambda: _remove_cdi_specs(host),
        "worker-unhealthy": lambda: setattr(hardware, "worker_unhealthy", True),
        "provider-lib-missing": lambda: (paths.libibverbs / lab_host.provider_lib(host)).unlink(
            missing_ok=True
        ),
        "no-runtime": lambda: _hide_podman(host),
        "sshd-down": lambda: _stop_sshd(host),
        "sudo-password": lambda: _move(host, SUDOERS, SUDOERS_HIDDEN),
        "link-slow": lambda: None,  # the link itself: cap_link, which needs the lab's state
    }
    edit[fault.kind]()
    write_hardware(paths.hardware, hardware)
    if lab_host.vendor(host) == "nvidia" and host.kind == "gpu":
        lab_host.exec_in(host, HARDWARE_SYNC)  # e.g. the driver's or a GPU's /dev nodes go


def _add(items: list[str], item: str | None) -> None:
    if item and item not in items:
        items.append(item)


def _gpu_missing(paths: HostPaths, hardware: FakeHardware, gpu: int) -> None:
    if gpu not in hardware.missing_gpus:
        hardware.missing_gpus.append(gpu)
    lab_host.render_node(paths, gpu).unlink(missing_ok=True)
    (paths.dev / "dri" / f"card{gpu}").unlink(missing_ok=True)


def _remove_cdi_specs(host: LabHost) -> None:
    lab_host.exec_in(host, ["rm", "-f", *CDI_SPECS])


def _move(host: LabHost, path: str, to: str) -> None:
    lab_host.exec_in(host, ["sh", "-c", f"[ ! -e {path} ] || mv {path} {to}"])


def _hide_podman(host: LabHost) -> None:
    _move(host, PODMAN, PODMAN_HIDDEN)


def _stop_sshd(host: LabHost) -> None:
    lab_host.exec_in(host, ["systemctl", "stop", "ssh.socket", "ssh.service"])


def _clear(host: LabHost, paths: HostPaths, hardware: FakeHardware) -> None:
    kept = ("worker_warmup_secs", *CAPACITY_SETTINGS)
    fresh = host.hardware().model_copy(update={k: getattr(hardware, k) for k in kept})
    write_hardware(paths.hardware, fresh)
    if host.kind == "gpu":
        lab_host.prepare_hardware(host, paths)
    if host.kind == "gpu" and lab_host.vendor(host) == "nvidia":
        lab_host.exec_in(host, [*HARDWARE_SYNC, "--cdi"])
    _move(host, PODMAN_HIDDEN, PODMAN)
    _move(host, SUDOERS_HIDDEN, SUDOERS)  # the sudo user's passwordless rule, if hidden
    lab_host.exec_in(host, ["systemctl", "start", "ssh.service"])


def link_rate(host: LabHost, lab_rate: int | None) -> int | None:
    """What the host's link carries, bytes/s each way: its link-slow fault's rate, else the
    lab's (`lab up --link-rate`, `lab link-rate`); None: no cap."""
    slow = [hub_service.parse_rate(f.arg) for f in host.faults if f.kind == "link-slow"]
    rates = [rate for rate in (*slow, lab_rate) if rate is not None]
    return min(rates) if rates else None


def cap_link(lab: LabState, host: LabHost) -> None:
    """Cap the host's link (tc on both ends of its veth) to what link_rate says."""
    hub_service.limit_link(lab, host, link_rate(host, lab.link_rate))
