"""What the lab remembers: ``<PDCTL_HOME>/.pdctl/lab/lab.json`` and each host's fake hardware."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from pdctl.workspace import write_atomic

HostKind = Literal["cpu", "gpu"]
GPUS_PER_HOST = 8
NICS_PER_HOST = 8


class Fault(BaseModel):
    kind: str
    arg: str | None = None

    def label(self) -> str:
        return f"{self.kind} {self.arg}" if self.arg else self.kind


class FakeHardware(BaseModel):
    """The per-host state file the fake tools and the SGLang stand-in read live.

    Mounted read-only at /etc/pd-fake/state.json in the host and in its containers.
    """

    host_index: int
    gpus: int = GPUS_PER_HOST
    gpu_model: str = "AMD Instinct MI300X"
    missing_gpus: list[int] = Field(default_factory=list)
    nics: int = NICS_PER_HOST
    missing_nics: list[str] = Field(default_factory=list)
    down_ports: list[str] = Field(default_factory=list)
    worker_unhealthy: bool = False
    worker_warmup_secs: float = 1.0


class LabHost(BaseModel):
    name: str
    index: int
    kind: HostKind
    address: str
    nspawn_pid: int | None = None
    faults: list[Fault] = Field(default_factory=list)

    @property
    def gpus(self) -> int:
        return GPUS_PER_HOST if self.kind == "gpu" else 0


class LabState(BaseModel):
    lab_id: int
    hosts: list[LabHost] = Field(default_factory=list)
    rootfs: str = ""

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
