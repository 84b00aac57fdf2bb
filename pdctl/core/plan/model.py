"""The plan as a document: Plan, its router, its worker groups and their slots (each slot's
GPUs, ports, NICs, unit, environment, registration), the extra-vars it becomes for
playbooks/deploy.yml, and that document read back (plan_from_extravars: the scaler's config,
a plan.yml written by `pdctl plan -o`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, model_validator

from pdctl.core import layout
from pdctl.core.failover import FailoverPlan
from pdctl.core.fleet_model import GpuVendor, natural_key
from pdctl.core.host_devices import NIC_NAME, NIC_NAME_RULE
from pdctl.core.launch import Connection, Engine
from pdctl.core.layout import Layout, Roots
from pdctl.core.router_replicas import MESH_PORT, FailoverAddress, RouterReplica
from pdctl.core.spec import (
    DEFAULT_PORT_STRIDE,
)
from pdctl.core.versions import SMG_VERSION
from pdctl.onhost.grpc_health import GRPC_HEALTH_CHECK, GRPC_STANDARD_HEALTH

WorkerRole = layout.Group
WORKER_ROLES = layout.GROUPS

# Where Debian/Ubuntu images (SGLang's, ROCm's, CUDA's) look for libibverbs providers: the
# host's library is mounted there under its own file name.
CONTAINER_PROVIDER_DIR = "/usr/lib/x86_64-linux-gnu/libibverbs"

CONTAINER_PROVIDER_LIB = f"{CONTAINER_PROVIDER_DIR}/libbnxt_re-rdmav34.so"

# The transfer backends whose UCX the plan points at each slot's NICs (UCX_NET_DEVICES):
# SGLang's --disaggregation-transfer-backend, vLLM's kv_connector.
UCX_BACKENDS = frozenset({"nixl", "NixlConnector"})

RENDER_MINOR_BASE = 128

CDI_KIND = "nvidia.com/gpu"

# The scaler's metrics listener on the router host: the first choice; a service whose router
# host already has another service's scaler takes the next free port (the plan's
# scaler_metrics_port, pd_scaler_metrics_port of the extra-vars).
SCALER_METRICS_PORT = layout.SCALER_METRICS_PORT


def _nic_names(names: list[str]) -> list[str]:
    for name in names:
        if not NIC_NAME.match(name):
            raise ValueError(f"{name!r} is not an RDMA device name ({NIC_NAME_RULE})")
    return names


def _ucx_device(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}:\d{1,3}", value):
        raise ValueError(f"{value!r} is not UCX_NET_DEVICES' device:port")
    return value


def _stored_vllm_connection(data: Any) -> Any:
    """A stored plan from before slots and groups said their connection: its vLLM workers
    spoke gRPC (and its SGLang workers HTTP, the default)."""
    if isinstance(data, dict) and data.get("engine") == "vllm" and "connection" not in data:
        return {**data, "connection": "grpc"}
    return data


class Slot(BaseModel):
    group: WorkerRole
    index: int
    host: str
    address: str
    gpus: list[int]
    port: int
    bootstrap_port: int | None
    start: bool
    # Defaulted so that a stored plan without them (an older pdctl's: AMD only) still loads.
    vendor: GpuVendor = "amd"
    # The RDMA devices nearest the slot's GPUs (pdctl/core/nic_affinity.py); empty: the host's facts
    # carry no topology, and the slot's commands name NICs themselves.
    rdma_devices: Annotated[list[str], AfterValidator(_nic_names)] = Field(default_factory=list)
    # UCX_NET_DEVICES entries (device:port) for a NIXL slot, the same NICs; empty: not set.
    ucx_net_devices: list[Annotated[str, AfterValidator(_ucx_device)]] = Field(default_factory=list)
    engine: Engine = "sglang"
    # How SMG reaches the worker: vLLM over gRPC, SGLang over HTTP or in its gRPC mode.
    connection: Connection = "http"
    # vLLM: the first port of the slot's NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT; its
    # ranks take the next ones, one per GPU at most), and its KV connector and role as SMG
    # is told them (pdctl/core/launch.py checked both).
    side_channel_port: int | None = None
    kv_connector: str | None = None
    kv_role: str | None = None
    # vLLM: the first port of the KV connector's own listener when the command sets kv_port
    # (its ranks take the next ones); the user's port, accounted for, never moved.
    kv_port: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_speaks_grpc(cls, data: Any) -> Any:
        return _stored_vllm_connection(data)

    @property
    def name(self) -> str:
        return f"{self.group}/{self.index}"

    def unit(self, service: str) -> str:
        return layout.slot_unit(service, self.group, self.index)

    @property
    def url(self) -> str:
        """The worker's URL as the router knows it (grpc:// for a gRPC worker)."""
        return f"{self.connection}://{self.address}:{self.port}"

    @property
    def grpc_health(self) -> str:
        """The gRPC method that says whether a gRPC worker is healthy (pdctl/onhost/grpc_health.py):
        vLLM's own HealthCheck, which SMG calls too; for SGLang grpc.health.v1, which its gRPC
        server answers without running a generation (its own HealthCheck runs one)."""
        return GRPC_HEALTH_CHECK if self.engine == "vllm" else GRPC_STANDARD_HEALTH

    def probe_url(self, path: str) -> str:
        """What the roles' probe asks (pdctl/onhost/unit_probe.py): the spec's HTTP probe path,
        or for a gRPC worker its health method (grpc://H:P/package.Service/Method)."""
        return f"{self.url}{self.grpc_health if self.connection == 'grpc' else path}"

    def registration(self) -> dict[str, Any]:
        """The body of SMG's POST /workers for this slot (docs/facts.md, SMG worker API)."""
        body: dict[str, Any] = {"url": self.url, "worker_type": self.group}
        if self.engine == "vllm":
            body |= {"runtime_type": "vllm", "kv_connector": self.kv_connector}
            body["kv_role"] = self.kv_role
        elif self.connection == "grpc":
            body["runtime_type"] = "sglang"  # SMG's own key ("runtime" is its alias)
        else:
            body["runtime"] = "sglang"
        if self.bootstrap_port is not None:
            body["bootstrap_port"] = self.bootstrap_port
        return body

    def env(self) -> dict[str, str]:
        """The slot's own environment (its instance env file, read by systemd and by the
        container runtime). PDCTL_DEVICE_ARGS is split into words by systemd (`$VAR` in
        ExecStart): its words are flags and device names, never quoted text."""
        ids = ",".join(str(g) for g in self.gpus)
        env = {
            layout.ENV_SLOT: self.name,
            layout.ENV_HOST: self.address,
            layout.ENV_PORT: str(self.port),
            layout.ENV_GPU_IDS: ids,
        }
        if self.vendor == "amd":
            env["ROCR_VISIBLE_DEVICES"] = ids
        env["DSTACK_GPUS_NUM"] = str(len(self.gpus))
        env[layout.ENV_DEVICE_ARGS] = " ".join(self.device_args())
        if self.bootstrap_port is not None:
            env[layout.ENV_BOOTSTRAP_PORT] = str(self.bootstrap_port)
        if self.side_channel_port is not None:
            # The address the other side's workers reach this host at (docs/facts.md).
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.address
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        if self.kv_port is not None:  # for other workspaces' plans (holdings_probe.py)
            env[layout.ENV_KV_PORT] = str(self.kv_port)
        if self.rdma_devices:
            env[layout.ENV_RDMA_DEVICES] = ",".join(self.rdma_devices)
        if self.ucx_net_devices:
            env["UCX_NET_DEVICES"] = ",".join(self.ucx_net_devices)
        return env

    def device_args(self) -> list[str]:
        """The runtime flags that give the container the slot's GPUs and only them: AMD its
        render nodes (/dev/kfd is in the unit), NVIDIA its CDI devices (docs/facts.md,
        "NVIDIA containers"), which CUDA numbers from 0 inside."""
        if self.vendor == "nvidia":
            return [f"--device {CDI_KIND}={g}" for g in self.gpus]
        return [f"--device /dev/dri/renderD{RENDER_MINOR_BASE + g}" for g in self.gpus]


class GroupPlan(BaseModel):
    role: WorkerRole
    engine: Engine = "sglang"
    connection: Connection = "http"
    min: int
    max: int
    gpus_per_replica: int
    scaling: dict[str, Any] | None
    image: str
    # The image's ID as the operator pins it (pdctl.image_id; None: not pinned): what a host
    # that takes the image from another checks it against.
    image_id: str | None = None
    script: str
    config: str  # hash of what a replica runs: a change means a rolling update
    slots: list[Slot] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _vllm_speaks_grpc(cls, data: Any) -> Any:
        return _stored_vllm_connection(data)


class ProbePlan(BaseModel):
    """How a worker's health is asked: the spec's first probe (or the defaults), in whole
    seconds. The roles get it as pd_probe; the scaler and pdctl poll slots with it."""

    url: str
    interval: int
    timeout: int


class RouterPlan(BaseModel):
    """The service's routers: one, or several on distinct hosts, each listening on ``port`` and
    its metrics on ``metrics_port``; with a failover address in front of them (keepalived,
    roles/pd_router) or none. Several routers each get every worker from pdctl, or with
    ``mesh`` from one another through SMG's mesh (on ``mesh_port``)."""

    replicas: list[RouterReplica] = Field(min_length=1)
    port: int
    metrics_port: int
    mesh: bool = False
    mesh_port: int = MESH_PORT
    failover: FailoverAddress | None = None
    smg_version: str = SMG_VERSION
    args: list[str]
    health_check_interval: int
    wheelhouse: str | None

    @model_validator(mode="before")
    @classmethod
    def _one_router_of_old(cls, data: Any) -> Any:
        # A plan stored by an older pdctl names its one router's host and address.
        if isinstance(data, dict) and "replicas" not in data and "host" in data:
            one = {"host": data.get("host"), "address": data.get("address")}
            data = {k: v for k, v in data.items() if k not in one}
            data["replicas"] = [one]
        return data

    @property
    def hosts(self) -> list[str]:
        """The router hosts, in the plan's order (the first wins a first election)."""
        return [replica.host for replica in self.replicas]

    @property
    def host(self) -> str:
        """The first router's host: the one router of a plan with one."""
        return self.replicas[0].host

    @property
    def address(self) -> str:
        """The first router's own address."""
        return self.replicas[0].address

    def replica(self, host: str) -> RouterReplica | None:
        return next((r for r in self.replicas if r.host == host), None)

    @property
    def several(self) -> bool:
        """More than one router: a scaler next to each, one of them acting."""
        return len(self.replicas) > 1

    @property
    def meshed(self) -> bool:
        """Several routers that share their workers through SMG's mesh; else pdctl registers
        and removes each worker on every router."""
        return self.several and self.mesh


class Plan(BaseModel):
    service: str
    fleet: str
    runtime: str
    image_archive: str | None
    env: dict[str, str]
    secret_names: list[str]
    volumes: list[str]
    privileged: bool
    memlock: str
    start_timeout: int
    stop_timeout: int
    probe: ProbePlan
    model: str | None
    # The hub model fetched into the hosts' cache before the units start (None: none).
    model_repo: str | None = None
    model_revision: str | None = None
    model_cache: str | None = None
    # Keyed hash of the secrets' values (pdctl/operations/drift.py secrets_digest), never a value.
    # "" without secrets, and in plans stored before it existed.
    secrets_digest: str = ""
    router: RouterPlan
    groups: dict[str, GroupPlan]
    # Defaulted so that a stored plan.json without them (an older pdctl's) still loads.
    port_stride: int = DEFAULT_PORT_STRIDE
    scaler_metrics_port: int = SCALER_METRICS_PORT
    excluded_hosts: dict[str, str] = Field(default_factory=dict)
    # What the plan could not do as well as it would like (hosts without topology facts).
    notes: list[str] = Field(default_factory=list)
    # Where the service lives on its hosts (pd_layout of the extra-vars).
    roots: Roots = Field(default_factory=Roots)
    # What the scaler does about replicas and hosts that stop answering; N+1 asked or not.
    failover: FailoverPlan = Field(default_factory=FailoverPlan)
    # The scaler acts, or only advises (pdctl.scaling.mode); the GPUs the service may hold
    # (pdctl.scaling.max_gpus) and the fleet's budget it draws from (`fleet add --gpu-budget`),
    # whose ledger is on the router host (None: no cap, no budget).
    scaling_mode: Literal["act", "advise"] = "act"
    max_gpus: int | None = None
    gpu_budget: int | None = None

    @property
    def layout(self) -> Layout:
        return Layout(self.service, self.roots)

    def slots(self) -> list[Slot]:
        return [slot for role in WORKER_ROLES for slot in self.groups[role].slots]

    def hosts(self) -> list[str]:
        names = {*self.router.hosts, *(slot.host for slot in self.slots())}
        return sorted(names, key=natural_key)

    def extravars(self) -> dict[str, Any]:
        """The plan as deploy.yml's extra-vars (``-e @plan.yml``): everything prefixed pd_."""
        # Slots appear once, per host (pd_host_slots); groups carry the rest.
        no_slots: dict[str, Any] = {"groups": {role: {"slots"} for role in WORKER_ROLES}}
        doc = self.model_dump(mode="json", exclude=no_slots)
        host_slots: dict[str, list[dict[str, Any]]] = {}
        for slot in self.slots():
            entry = {
                **slot.model_dump(mode="json"),
                "unit": slot.unit(self.service),
                "url": slot.url,
                "registration": slot.registration(),
                "probe_url": slot.probe_url(self.probe.url),
                "env": slot.env(),
                "env_file": self.layout.slot_env(slot.group, slot.index),
            }
            host_slots.setdefault(slot.host, []).append(entry)
        return {
            "pd_service": self.service,
            "pd_fleet": self.fleet,
            "pd_plan_hosts": self.hosts(),
            "pd_worker_hosts": sorted(host_slots, key=natural_key),
            "pd_router_hosts": self.router.hosts,
            "pd_host_slots": host_slots,
            "pd_layout": self.layout.extravar(WORKER_ROLES),
            **{
                f"pd_{key}": value
                for key, value in doc.items()
                if key not in {"service", "fleet", "excluded_hosts", "roots"}
            },
        }


# What extravars() adds to a slot's entry, derived from its fields.
_DERIVED = frozenset({"unit", "env", "url", "registration", "probe_url", "env_file"})


def plan_from_extravars(doc: dict[str, Any]) -> Plan:
    """The inverse of Plan.extravars(): a plan.yml (or the scaler's config) back into a Plan."""
    fields = {key[3:]: value for key, value in doc.items() if key.startswith("pd_")}
    if "layout" in fields:  # its roots; the rest of it derives from them
        fields["roots"] = {k: v for k, v in fields.pop("layout").items() if k in Roots.model_fields}
    slots: dict[str, list[dict[str, Any]]] = {role: [] for role in WORKER_ROLES}
    for entries in (fields.pop("host_slots", None) or {}).values():
        for entry in entries:
            slots[entry["group"]].append({k: v for k, v in entry.items() if k not in _DERIVED})
    groups = fields.get("groups") or {}
    for role in WORKER_ROLES:
        groups[role] = {**groups[role], "slots": sorted(slots[role], key=lambda s: s["index"])}
    known = set(Plan.model_fields)
    return Plan.model_validate({key: value for key, value in fields.items() if key in known})
