"""What a fleet is, as data: its settings, its hosts and their last preflight. PURE.

The plan and the other pure modules work on these; pdctl/doors/inventory.py reads and writes
them as an Ansible inventory, and the connections to the hosts live elsewhere (ssh.py).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

from pdctl.core import layout, validate

HostKind = Literal["gpu", "cpu", "new"]
# "any"/"auto": a fleet mixing vendors, each host checked by what it has.
GpuVendor = Literal["amd", "nvidia", "any"]
LinkLayer = Literal["eth", "ib", "auto"]
# The libibverbs provider's name (lib<driver>-rdmav*.so): bnxt_re, mlx5, irdma, ...
NIC_DRIVER = r"^[a-z][a-z0-9_]{0,31}$"
DEFAULT_ENDPOINT = "https://huggingface.co"


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key putting node2 before node10 (host and slot names)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def host_name(address: str, port: int) -> str:
    """The inventory name of a host: its address (and port, when not 22)."""
    return address if port == 22 else f"{address}_{port}"


class FleetSettings(BaseModel):
    """Fleet-wide settings: how to connect, and what every GPU host must have.

    The defaults of what a GPU host must have are the one home of the preflight's
    expectations: the pd_preflight role's defaults and the on-host checks' Expectations
    (pdctl/onhost/hardware/checks.py) are held equal to them
    (tests/unit/content/test_role_facts.py)."""

    identity_file: str | None = None
    proxy_jump: str | None = None
    become: bool = True
    expect_gpus: int = 8
    expect_nics: int = 8
    gpu_model: str | None = "MI300X"
    gpu_vendor: GpuVendor = "amd"
    nic_driver: Annotated[str, Field(pattern=NIC_DRIVER)] = "bnxt_re"
    link_layer: LinkLayer = "eth"  # RoCE (Ethernet) or InfiniBand
    # The provider library the worker containers bind-mount (a bnxt_re fleet's); the
    # preflight finds other drivers' by glob.
    provider_lib: str = "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"
    gid_index: int = 3
    min_disk_gb: float = 50.0
    # Wheels on the hosts for SMG and the scaler when they have no internet; a spec's
    # pdctl.wheelhouse wins.
    wheelhouse: Annotated[str, AfterValidator(validate.host_path)] | None = None
    # The hosts' model cache (pdctl/core/model_cache.py), and where its models come from: a hub or
    # a mirror of one (HF_ENDPOINT-style).
    model_cache: Annotated[str, AfterValidator(validate.host_path)] = layout.MODEL_CACHE
    model_endpoint: Annotated[str, AfterValidator(validate.endpoint_url)] = DEFAULT_ENDPOINT


# What pd_preflight checks, by the role's variable: the fleet setting it comes from. `pdctl fleet
# add` writes the fleet's values under these names (pdctl/doors/inventory.py).
PREFLIGHT_VARS = {
    "pd_preflight_expected_gpus": "expect_gpus",
    "pd_preflight_expected_nics": "expect_nics",
    "pd_preflight_gpu_model": "gpu_model",
    "pd_preflight_gpu_vendor": "gpu_vendor",
    "pd_preflight_nic_driver": "nic_driver",
    "pd_preflight_link_layer": "link_layer",
    "pd_preflight_provider_lib": "provider_lib",
    "pd_preflight_gid_index": "gid_index",
    "pd_preflight_min_disk_gb": "min_disk_gb",
}


class Preflight(BaseModel):
    ok: bool
    checked_at: str
    checks: list[dict[str, Any]] = Field(default_factory=list)


class FabricRecord(BaseModel):
    """A host's part in its last fabric check (pdctl/core/fabric_judge.py): whether every pair it
    was in passed, and the failures (bounded)."""

    ok: bool
    checked_at: str
    scope: Literal["mesh", "kv"] = "mesh"  # `fleet check --fabric`, or `--certify`'s KV paths
    pairs: int = 0
    named: bool = False  # every pair it was in failed: its own link is the cause
    summary: str = ""
    failed: list[dict[str, Any]] = Field(default_factory=list)


class FleetHost(BaseModel):
    name: str
    address: str
    port: int = 22
    user: str
    kind: HostKind = "new"
    facts: dict[str, Any] | None = None
    preflight: Preflight | None = None
    fabric: FabricRecord | None = None


class Fleet(BaseModel):
    name: str
    settings: FleetSettings = Field(default_factory=FleetSettings)
    hosts: list[FleetHost] = Field(default_factory=list)

    def host(self, name: str) -> FleetHost | None:
        return next((h for h in self.hosts if h.name == name), None)

    def by_endpoint(self, address: str, port: int) -> FleetHost | None:
        return next((h for h in self.hosts if (h.address, h.port) == (address, port)), None)
