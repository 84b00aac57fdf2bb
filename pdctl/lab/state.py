"""What the lab remembers: ``<PDCTL_HOME>/.pdctl/lab/lab.json`` and each host's fake hardware."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from pdctl.doors.workspace import write_atomic

HostKind = Literal["cpu", "gpu"]
LinkLayer = Literal["eth", "ib"]
GPUS_PER_HOST = 8
NICS_PER_HOST = 8


class LabGpu(BaseModel):
    """A GPU model the lab emulates: what its tools print, and the NICs such servers carry."""

    vendor: Literal["amd", "nvidia"]
    name: str  # as amd-smi's market_name / nvidia-smi's name print it
    memory_mib: int
    nic_driver: Literal["bnxt_re", "mlx5"]


# MI300X servers with Broadcom RoCE NICs; HGX H200/H100 with ConnectX-7 (docs/facts.md).
LAB_GPUS = {
    "MI300X": LabGpu(
        vendor="amd", name="AMD Instinct MI300X", memory_mib=196592, nic_driver="bnxt_re"
    ),
    "H200": LabGpu(vendor="nvidia", name="NVIDIA H200", memory_mib=143771, nic_driver="mlx5"),
    "H100": LabGpu(
        vendor="nvidia", name="NVIDIA H100 80GB HBM3", memory_mib=81559, nic_driver="mlx5"
    ),
}
DEFAULT_GPU = "MI300X"


class Fault(BaseModel):
    kind: str
    arg: str | None = None

    def label(self) -> str:
        return f"{self.kind} {self.arg}" if self.arg else self.kind


# Lab settings the worker stand-ins read (kept by `fault clear`): their serving capacity and
# how fast they load their model.
CAPACITY_SETTINGS = (
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "decode_token_floor_ms",
    "load_bytes_per_s",
)


class FakeHardware(BaseModel):
    """The per-host state file the fake tools and the SGLang stand-in read live.

    Mounted read-only at /etc/pd-fake/state.json in the host and in its containers.
    """

    host_index: int
    gpus: int = GPUS_PER_HOST
    gpu_model: str = "AMD Instinct MI300X"
    gpu_memory_mib: int = 196592
    vendor: Literal["amd", "nvidia"] = "amd"
    nic_driver: Literal["bnxt_re", "mlx5"] = "bnxt_re"
    link_layer: LinkLayer = "eth"
    nvidia_driver: bool = True
    missing_gpus: list[int] = Field(default_factory=list)
    nics: int = NICS_PER_HOST
    missing_nics: list[str] = Field(default_factory=list)
    down_ports: list[str] = Field(default_factory=list)
    # The NICs' line rate as ibv_devinfo -v reports it (lanes x Gb/s per lane): 1X SDR, 2 Gb/s
    # of data, what the lab's links carry for every test of a fabric-check round at once
    # (the perftest stand-in, fakes/pdperf.py, moves its bytes over them at that rate).
    link_width: int = 1
    link_speed: float = 2.5
    worker_unhealthy: bool = False
    worker_warmup_secs: float = 1.0
    # The stand-ins' capacity (pdctl/lab/worker/common/capacity.py): lab settings, not
    # faults, so `fault clear` keeps them.
    prefill_tokens_per_s: float = Field(default=8000.0, ge=0)
    decode_tokens_per_s: float = Field(default=400.0, ge=0)
    decode_token_floor_ms: float = Field(default=10.0, ge=0)
    # How fast a worker stand-in reads its model at start (pdctl/lab/worker/model_cache.py).
    load_bytes_per_s: float = Field(default=1e9, ge=0)


class LabHost(BaseModel):
    name: str
    index: int
    kind: HostKind
    address: str
    nspawn_pid: int | None = None
    faults: list[Fault] = Field(default_factory=list)
    gpu: str = DEFAULT_GPU  # a LAB_GPUS key; GPU hosts only
    link_layer: LinkLayer = "eth"
    # `lab fault HOST power-off` / `power-on`: an "off" host has no process and no link, and
    # keeps its disk; `lab up` leaves it off.
    power: Literal["on", "off"] = "on"

    @property
    def gpus(self) -> int:
        return GPUS_PER_HOST if self.kind == "gpu" else 0

    @property
    def model(self) -> LabGpu | None:
        return LAB_GPUS[self.gpu] if self.kind == "gpu" else None

    def hardware(self) -> FakeHardware:
        """The fake hardware this host starts with (and returns to on `fault clear`)."""
        if self.model is None:
            return FakeHardware(host_index=self.index, gpus=0, nics=0)
        return FakeHardware(
            host_index=self.index,
            gpus=self.gpus,
            nics=NICS_PER_HOST,
            gpu_model=self.model.name,
            gpu_memory_mib=self.model.memory_mib,
            vendor=self.model.vendor,
            nic_driver=self.model.nic_driver,
            link_layer=self.link_layer,
        )


class LabState(BaseModel):
    lab_id: int
    hosts: list[LabHost] = Field(default_factory=list)
    rootfs: str = ""
    # Bytes/s: the hub's serving rate in all (the site's uplink) and each host's link, both
    # ways (hub_service.py); None: no cap.
    hub_rate: int | None = None
    link_rate: int | None = None
    # Bytes: the size of a model the hub makes when a repository it has never seen is asked
    # for (hub.py, "generate"); None: unknown repositories are 404.
    hub_model_size: int | None = 64 << 20

    @property
    def bridge(self) -> str:
        return f"pdlab{self.lab_id}"

    @property
    def subnet(self) -> str:
        return f"10.77.{self.lab_id}"

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def netns(self, host: LabHost) -> str:
        return f"pdl{self.lab_id}-{host.name}"

    def veth(self, host: LabHost) -> str:
        return f"pl{self.lab_id}h{host.index}"  # <= 15 characters, the kernel's limit

    def cgroup(self, host: LabHost | None = None) -> str:
        base = f"pdctl-lab{self.lab_id}"
        return f"{base}/{host.name}" if host else base

    def host(self, name: str) -> LabHost | None:
        return next((h for h in self.hosts if h.name == name), None)


def load(path: Path) -> LabState | None:
    if not path.is_file():
        return None
    return LabState.model_validate_json(path.read_text())


def save(path: Path, state: LabState) -> None:
    write_atomic(path, state.model_dump_json(indent=2))


def write_hardware(path: Path, hardware: FakeHardware) -> None:
    """Atomically: the fake tools may be reading it this very moment."""
    write_atomic(path, json.dumps(hardware.model_dump(), indent=2))
