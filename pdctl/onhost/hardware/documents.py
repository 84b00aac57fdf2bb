"""The two documents of a host's hardware: what collection saw (Raw) and its summary (Facts).

``collect()`` (collect.py) writes a Raw on the host: every tool's output as it came, a few
files, the PCI topology, the peers' reachability. ``facts()`` (facts.py) reads it into the
Facts pdctl stores in the inventory's host_vars, which the core reads back
(pdctl/core/host_devices.py). A stored Facts is data from a machine pdctl does not trust:
whoever reads one checks every value it uses; these types say which keys a well-formed one has.

Python 3.9 on the hosts: no ``NotRequired``, so a key that only some documents carry is in a
``total=False`` class (the annotations stay strings there, so ``X | None`` is fine).
"""

from __future__ import annotations

from typing import TypedDict

SCHEMA = 1
# A command result's rc when the command did not run to its end (as a shell reports them).
RC_NOT_FOUND = 127
RC_NOT_EXECUTABLE = 126
RC_TIMEOUT = 124

RUNTIMES = ("podman", "docker")
# Stable order of raw["commands"].
COMMAND_ORDER = (
    "ibv_devices",
    "ibv_devinfo",
    "amd_smi_list",
    "amd_smi_static",
    "rocm_smi",
    "nvidia_smi",
    "nvidia_ctk_version",
    "nvidia_ctk_cdi_list",
    "podman_version",
    "docker_version",
    "podman_info",
    "docker_info",
    "systemctl",
)
# perftest's tools, which `pdctl fleet check --fabric` runs between GPU hosts (package
# `perftest` on Debian/Ubuntu and RHEL).
PERFTEST_TOOLS = ("ib_write_bw", "ib_write_lat")


# ------------------------------------------------------------------------------------- Raw


class CommandResult(TypedDict):
    """One tool run: rc 127 when missing, 126 when it cannot run, 124 when it hung."""

    argv: list[str]
    rc: int
    stdout: str
    stderr: str


class OsRelease(TypedDict):
    pretty_name: str
    id: str
    version_id: str


class Storage(TypedDict):
    """The first of the candidate container storage paths that exists, and its free space."""

    path: str | None
    free_bytes: int | None
    error: str | None
    candidates: list[str]


class ProviderLib(TypedDict):
    path: str
    exists: bool
    elsewhere: list[str]  # the same file name in the other provider directories


class Memlock(TypedDict):
    """Whether root here can have RLIMIT_MEMLOCK unlimited (the workers' RDMA), and why not."""

    euid: int
    hard: int | None  # None: unlimited
    cap_sys_resource: bool | None
    unlimited: bool
    error: str | None


class _ReachBase(TypedDict):
    address: str
    port: int | None
    ok: bool
    error: str | None


class Reach(_ReachBase, total=False):
    """A TCP connect to a peer: accepted, or refused (the path works), or why it failed."""

    refused: bool


class _SysfsNodeBase(TypedDict):
    realpath: str | None
    numa_node: int | None


class SysfsNode(_SysfsNodeBase, total=False):
    driver: str | None  # an RDMA device's PCI function's kernel driver


class Sysfs(TypedDict):
    pci: dict[str, SysfsNode]  # GPU PCI address -> its node
    infiniband: dict[str, SysfsNode]  # RDMA device name -> its node


class NvidiaFiles(TypedDict):
    cdi_specs: list[str]
    device_nodes: list[str]


class Raw(TypedDict):
    """What collect() saw on a host (JSON on stdout)."""

    schema: int
    hostname: str
    os: OsRelease
    kernel: str
    cpus: int | None
    memory_bytes: int | None
    storage: Storage
    kfd: bool
    render_nodes: list[str]
    provider_lib: ProviderLib
    systemd: bool
    python: str
    commands: dict[str, CommandResult]  # keys in COMMAND_ORDER, the ones that ran
    memlock: Memlock
    reach: list[Reach]
    sysfs: Sysfs
    provider_libs: dict[str, list[str]]  # provider name -> its libraries
    nvidia_files: NvidiaFiles
    tools: dict[str, str | None]  # PERFTEST_TOOLS -> where on PATH
    elapsed_s: float


# ----------------------------------------------------------------------------------- Facts


class GpuDeviceFacts(TypedDict):
    index: int | None
    pci: str | None
    numa: int | None
    memory_mib: int | None
    uuid: str | None
    pci_path: list[str]  # PCI addresses from the root port down to the GPU


class GpuFacts(TypedDict):
    count: int
    model: str | None  # dstack's name (MI300X, H100, ...)
    vendor: str | None  # amd | nvidia
    memory_mib: int | None
    driver: str | None
    source: str | None  # the tool that listed them
    bdfs: list[str]
    devices: list[GpuDeviceFacts]


class GidFacts(TypedDict):
    index: int
    address: str
    kind: str | None  # "RoCE v2", ...


class PortFacts(TypedDict):
    port: int
    state: str | None  # PORT_ACTIVE, ...
    link_layer: str | None
    active_width: str | None
    active_speed: str | None
    gids: list[GidFacts]


class RdmaDeviceFacts(TypedDict):
    name: str
    ports: list[PortFacts]
    driver: str | None  # the libibverbs provider's name (bnxt_re, mlx5, ...)
    pci: str | None
    numa: int | None
    pci_path: list[str]


class RdmaFacts(TypedDict):
    devices: list[RdmaDeviceFacts]
    provider_libs: dict[str, str]  # provider name -> its first library
    provider_lib: bool  # the configured one exists, or each device's driver has one
    warnings: list[str]  # libibverbs' "couldn't load driver" lines


class NvidiaFacts(TypedDict):
    driver_loaded: bool
    ctk_version: str | None
    cdi_devices: list[str]
    cdi_spec: str | None


class RuntimeFacts(TypedDict):
    name: str | None
    version: str | None
    usable: bool


class Facts(TypedDict):
    """A host's summary, as pdctl stores it (facts())."""

    hostname: str
    os: OsRelease
    kernel: str
    cpus: int | None
    memory_gb: float | None
    disk_free_gb: float | None
    disk_path: str | None
    systemd: bool
    python: str
    gpus: GpuFacts
    kfd: bool
    render_nodes: int
    rdma: RdmaFacts
    nvidia: NvidiaFacts | None  # None: no nvidia-smi on the host
    runtime: RuntimeFacts
    errors: list[str]
