"""A host's GPUs, NICs and container devices, read from its stored facts. PURE.

The facts are what a host reported (pdctl/onhost/hardware/facts.py, kept in the inventory's
host_vars): data from a machine pdctl does not trust. Whatever of them can reach a unit,
an env file or an argv word (NIC names, the provider library's path, CDI device names) is
checked here against a whitelist; a host whose facts break one is not placed on, and the
plan says why. The rest (models, PCI paths) is only compared and shown, and is bounded.

Facts written before NVIDIA support (no `vendor`, no `devices`, no NIC `pci_path`) still
read: their GPUs are AMD's (the preflight required /dev/kfd then) and they carry no
topology, so their slots get no per-slot NICs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdctl.core import validate
from pdctl.core.fleet_model import GpuVendor
from pdctl.core.nic_affinity import GpuDevice, Nic
from pdctl.core.spec import Gpu, Range, describe_gb

# An RDMA device name as the kernel and udev spell them (mlx5_0, bnxt_re3, rocep1s0f1, irdma0):
# no ':' (UCX_NET_DEVICES joins name:port), no space, no quote, no line break.
NIC_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
NIC_NAME_RULE = "letters, digits, '_', '.' and '-' (at most 64), starting with a letter or digit"
DRIVER = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}\Z")
# A CDI device name of kind nvidia.com/gpu: an index, a UUID (GPU-...) or "all".
CDI_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
_PCI_ELEMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,31}\Z")
_MAX_DEVICES = 1024
# Reported memory sits a little under the size GPUs are sold and dstack lists them by
# (an H100 80GB reports 81559 MiB = 79.6 GiB, an H200 "141GB" 143771 MiB = 140.4 GiB).
MEMORY_SLACK = 0.03


class FactsError(ValueError):
    """A host's facts hold something pdctl will not use: ``where`` says which fact."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"facts {where}: {problem}")


def _int(value: Any, where: str, low: int = 0, high: int = 1 << 40) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise FactsError(where, f"{value!r} is not a whole number in {low}..{high}")
    return value


def _numa(value: Any, where: str) -> int | None:
    if value is None:
        return None
    number = _int(value, where, -1, 4096)
    return None if number < 0 else number  # sysfs says -1 when it does not know


def _text(value: Any, where: str, limit: int = 128) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise FactsError(where, f"{value!r} is not text of at most {limit} characters")
    bad = validate.control_char(value)
    if bad is not None:
        raise FactsError(where, f"holds {validate.describe_char(bad)}")
    return value


def _pci_path(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > 32:
        raise FactsError(where, "not a list of PCI addresses")
    for element in value:
        if not isinstance(element, str) or not _PCI_ELEMENT.match(element):
            raise FactsError(where, f"{element!r} is not a PCI address")
    return tuple(value)


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > _MAX_DEVICES:
        raise FactsError(where, "not a list")
    return value


def _dict(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FactsError(where, "not a mapping")
    return value


def nic_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not NIC_NAME.match(value):
        raise FactsError(where, f"{value!r} is not an RDMA device name ({NIC_NAME_RULE})")
    return value


def _gpu_devices(raw: Any) -> tuple[GpuDevice, ...]:
    devices = []
    for position, item in enumerate(_list(raw, "gpus.devices")):
        where = f"gpus.devices[{position}]"
        entry = _dict(item, where)
        devices.append(
            GpuDevice(
                index=_int(entry.get("index"), f"{where}.index", 0, _MAX_DEVICES - 1),
                pci_path=_pci_path(entry.get("pci_path"), f"{where}.pci_path"),
                numa=_numa(entry.get("numa"), f"{where}.numa"),
            )
        )
    return tuple(devices)


def _port(ports: Any, where: str) -> int:
    """The port UCX uses: the first ACTIVE one (else the first listed, else 1)."""
    numbers = []
    for position, item in enumerate(_list(ports, where)):
        entry = _dict(item, f"{where}[{position}]")
        number = _int(entry.get("port", 1), f"{where}[{position}].port", 1, 255)
        numbers.append((entry.get("state") != "PORT_ACTIVE", number))
    return min(numbers)[1] if numbers else 1


def _nics(raw: Any) -> tuple[Nic, ...]:
    nics = []
    for position, item in enumerate(_list(raw, "rdma.devices")):
        where = f"rdma.devices[{position}]"
        entry = _dict(item, where)
        driver = entry.get("driver")
        if driver is not None and (not isinstance(driver, str) or not DRIVER.match(driver)):
            raise FactsError(f"{where}.driver", f"{driver!r} is not a driver name")
        nics.append(
            Nic(
                name=nic_name(entry.get("name"), f"{where}.name"),
                pci_path=_pci_path(entry.get("pci_path"), f"{where}.pci_path"),
                numa=_numa(entry.get("numa"), f"{where}.numa"),
                driver=driver,
                port=_port(entry.get("ports"), f"{where}.ports"),
            )
        )
    return tuple(nics)


def _provider_libs(raw: Any) -> dict[str, str] | None:
    if raw is None:
        return None
    libs = {}
    for driver, path in _dict(raw, "rdma.provider_libs").items():
        where = f"rdma.provider_libs.{driver}"
        if not DRIVER.match(str(driver)):
            raise FactsError(where, "not a driver name")
        try:
            validate.host_path(_text(path, where, 4096))
        except ValueError as exc:
            raise FactsError(where, str(exc)) from None
        if not re.fullmatch(rf"lib{re.escape(driver)}-rdmav\d+\.so", path.rsplit("/", 1)[-1]):
            raise FactsError(where, f"{path!r} is not a lib{driver}-rdmav<N>.so")
        libs[driver] = path
    return libs


def _cdi(raw: Any) -> frozenset[str] | None:
    nvidia = _dict(raw, "nvidia")
    if not nvidia:
        return None
    names = set()
    for position, name in enumerate(_list(nvidia.get("cdi_devices"), "nvidia.cdi_devices")):
        if not isinstance(name, str) or not CDI_NAME.match(name):
            raise FactsError(f"nvidia.cdi_devices[{position}]", f"{name!r} is not a CDI name")
        names.add(name)
    return frozenset(names)


@dataclass(frozen=True)
class HostGpus:
    """What placement needs of one host's facts, checked."""

    count: int = 0
    vendor: GpuVendor | None = None
    model: str | None = None
    memory_mib: int | None = None
    devices: tuple[GpuDevice, ...] = ()
    nics: tuple[Nic, ...] = ()
    provider_libs: Mapping[str, str] | None = None  # None: facts from before they were read
    cdi_devices: frozenset[str] | None = None  # None: not an NVIDIA host, or not read
    notes: tuple[str, ...] = field(default=())

    @classmethod
    def from_facts(cls, facts: Mapping[str, Any] | None) -> HostGpus:
        facts = facts or {}
        gpus = _dict(facts.get("gpus"), "gpus")
        count = _int(gpus.get("count") or 0, "gpus.count", 0, _MAX_DEVICES)
        vendor: GpuVendor | None
        if "vendor" not in gpus:
            # Facts from before NVIDIA support: the preflight required /dev/kfd then.
            vendor = "amd" if count else None
        elif gpus["vendor"] in ("amd", "nvidia"):
            vendor = gpus["vendor"]
        elif gpus["vendor"] is None:
            vendor = None
        else:
            raise FactsError("gpus.vendor", f"{gpus['vendor']!r} is not amd or nvidia")
        model = gpus.get("model")
        memory = gpus.get("memory_mib")
        rdma = _dict(facts.get("rdma"), "rdma")
        return cls(
            count=count,
            vendor=vendor,
            model=None if model is None else _text(model, "gpus.model"),
            memory_mib=None if memory is None else _int(memory, "gpus.memory_mib"),
            devices=_gpu_devices(gpus.get("devices")),
            nics=_nics(rdma.get("devices")),
            provider_libs=_provider_libs(rdma.get("provider_libs")),
            cdi_devices=_cdi(facts.get("nvidia")),
        )

    @property
    def memory_gb(self) -> float | None:
        return None if self.memory_mib is None else self.memory_mib / 1024

    def describe(self) -> str:
        """``8x MI300X 192GB``, ``8x H200 140GB``, ``no GPUs``."""
        if not self.count:
            return "no GPUs"
        text = f"{self.count}x {self.model or self.vendor or 'GPU'}"
        return text if self.memory_gb is None else f"{text} {self.memory_gb:.0f}GB"

    def model_is(self, name: str) -> bool:
        """The model is ``name`` as dstack spells it (H200 matches "H200" and older facts'
        "NVIDIA H200" or "AMD Instinct MI300X" word for word, never MI300 for MI300X)."""
        if not self.model:
            return False
        words = re.split(r"[\s_/()-]+", self.model.lower())
        return name.lower() == self.model.lower() or name.lower() in words

    def mismatch(self, gpu: Gpu) -> str | None:
        """Why a replica asking for ``gpu`` cannot run here (None: it can)."""
        if not self.count:
            return "no GPUs"
        if gpu.vendor and gpu.vendor != self.vendor:
            return f"GPU vendor {self.vendor or 'unknown'} is not {gpu.vendor}"
        if gpu.names and not any(self.model_is(name) for name in gpu.names):
            return f"GPU model {self.model or 'unknown'} is not {' or '.join(gpu.names)}"
        return self._memory_mismatch(gpu) or self._cdi_mismatch()

    def _memory_mismatch(self, gpu: Gpu) -> str | None:
        memory = self.memory_gb
        for wanted, have, what in (
            (gpu.memory, memory, "GPU memory"),
            (gpu.total_memory, None if memory is None else memory * gpu.count, "total GPU memory"),
        ):
            if wanted is None:
                continue
            if have is None:
                return f"{what} unknown (facts from an older pdctl: run `pdctl fleet check`)"
            if not _within(have, wanted):
                return f"{what} {have:.0f}GB is not {describe_gb(wanted)}"
        return None

    def _cdi_mismatch(self) -> str | None:
        if self.vendor == "nvidia":
            missing = [str(i) for i in range(self.count) if str(i) not in (self.cdi_devices or ())]
            if missing:
                return (
                    f"no CDI device nvidia.com/gpu={missing[0]} (run `nvidia-ctk cdi generate "
                    "--output=/etc/cdi/nvidia.yaml` there, then `pdctl fleet check`)"
                )
        return None

    def nics_for(self, driver: str | None) -> tuple[Nic, ...]:
        """The host's NICs of ``driver`` (all of them when it is None or they say none)."""
        if driver is None:
            return self.nics
        return tuple(n for n in self.nics if n.driver in (None, driver))

    def rdma_driver(self) -> str | None:
        """The driver most of the host's NICs have (None: the facts do not say)."""
        drivers = sorted(n.driver for n in self.nics if n.driver)
        if not drivers:
            return None
        return max(sorted(set(drivers)), key=drivers.count)


def _within(value: float, wanted: Range) -> bool:
    low = wanted.min is None or value >= wanted.min * (1 - MEMORY_SLACK)
    high = wanted.max is None or value <= wanted.max * (1 + MEMORY_SLACK)
    return low and high
