"""The placement plan: spec + fleet facts -> which replica slot runs where. PURE.

Every slot up to each group's max is planned now (the scaler only starts and
stops planned slots); the min are started. A slot owns its GPUs, serving port
and bootstrap port on its host. Services share a fleet: what the others hold
(their GPUs and ports, spares included; the caller gathers it) is left alone.
Ports are judged per host once the slots are placed (_wire_ports): the ports
the spec sets stay, pdctl's own step past whatever else listens on the host.
Deterministic: the same inputs give the same plan, byte for byte, so plans diff
cleanly. The plan is also the extra-vars document of playbooks/deploy.yml.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field, model_validator

from pdctl import layout, model_cache, topology, validate
from pdctl.commands import worker_script
from pdctl.errors import CheckFailed, InputError
from pdctl.failover import FailoverPlan, refuse_unsurvivable
from pdctl.fleet_model import Fleet, FleetHost, GpuVendor, natural_key
from pdctl.grpc_health import GRPC_HEALTH_CHECK, GRPC_STANDARD_HEALTH
from pdctl.hostgpus import NIC_NAME, NIC_NAME_RULE, FactsError, HostGpus
from pdctl.launch import Connection, Engine
from pdctl.layout import Layout, Roots
from pdctl.port_ledger import MAX_PORT, Ledger, Span
from pdctl.router_flags import IGW_FLAG, dropped_flags, kept_flags, launch_line
from pdctl.router_replicas import MESH_PORT, FailoverAddress, RouterReplica, place
from pdctl.router_replicas import failover as failover_address
from pdctl.spec import (
    DEFAULT_PORT_STRIDE,
    Env,
    Gpu,
    Probe,
    ReplicaGroup,
    Resources,
    Spec,
    added_flags,
    image_pin,
)
from pdctl.versions import SMG_VERSION

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
# What the listeners of a service are called in plans and refusals.
ROUTER = "router"
ROUTER_METRICS = "router's metrics"
ROUTER_MESH = "router's mesh"
SCALER_METRICS = "scaler's metrics"


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
    # The RDMA devices nearest the slot's GPUs (pdctl/topology.py); empty: the host's facts
    # carry no topology, and the slot's commands name NICs themselves.
    rdma_devices: Annotated[list[str], AfterValidator(_nic_names)] = Field(default_factory=list)
    # UCX_NET_DEVICES entries (device:port) for a NIXL slot, the same NICs; empty: not set.
    ucx_net_devices: list[Annotated[str, AfterValidator(_ucx_device)]] = Field(default_factory=list)
    engine: Engine = "sglang"
    # How SMG reaches the worker: vLLM over gRPC, SGLang over HTTP or in its gRPC mode.
    connection: Connection = "http"
    # vLLM: the first port of the slot's NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT; its
    # ranks take the next ones, one per GPU at most), and its KV connector and role as SMG
    # is told them (pdctl/launch.py checked both).
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
        """The gRPC method that says whether a gRPC worker is healthy (pdctl/grpc_health.py):
        vLLM's own HealthCheck, which SMG calls too; for SGLang grpc.health.v1, which its gRPC
        server answers without running a generation (its own HealthCheck runs one)."""
        return GRPC_HEALTH_CHECK if self.engine == "vllm" else GRPC_STANDARD_HEALTH

    def probe_url(self, path: str) -> str:
        """What the roles' probe asks (templates/unit-probe.py): the spec's HTTP probe path,
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
    """The service's routers: one, or several on distinct hosts (SMG's mesh between them, on
    ``mesh_port``), each listening on ``port`` and its metrics on ``metrics_port``; with a
    failover address in front of them (keepalived, roles/pd_router) or none."""

    replicas: list[RouterReplica] = Field(min_length=1)
    port: int
    metrics_port: int
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
    def meshed(self) -> bool:
        """Several routers share their workers through SMG's mesh."""
        return len(self.replicas) > 1


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
    # Keyed hash of the secrets' values (pdctl/drift.py secrets_digest), never a value.
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


@dataclass(frozen=True)
class Listener:
    """The ports first..last that one listener of a plan takes on its host."""

    host: str
    first: int
    last: int
    what: str  # ROUTER, "prefill/2", "prefill/2's bootstrap port", ...
    field: str | None  # the spec field that moves it (None: pdctl picks the port)

    def describe(self) -> str:
        return f"{self.what} ({self.field})" if self.field else self.what


@dataclass(frozen=True)
class Held:
    """GPUs, or the ports first..last, that a service holds on a host."""

    service: str
    host: str
    what: str  # as Listener.what, or a slot's name for its GPUs
    gpus: tuple[int, ...] = ()
    ports: tuple[int, int] | None = None

    @property
    def owner(self) -> str:
        return f"service {self.service}'s {self.what}"


def bootstrap_of(slot_name: str) -> str:
    """What a slot's bootstrap port is called (a Listener's or Held's ``what``)."""
    return f"{slot_name}'s bootstrap port"


def side_channel_of(slot_name: str) -> str:
    """What a vLLM slot's NIXL side channel ports are called."""
    return f"{slot_name}'s NIXL side channel"


def kv_of(slot_name: str) -> str:
    """What a vLLM slot's KV connector listener (kv_port) is called."""
    return f"{slot_name}'s KV connector"


KV_PORT_FIELD = "kv_port in --kv-transfer-config"


def listeners(plan: Plan) -> list[Listener]:
    """Every port the plan listens on. A worker takes `port_stride` ports from its own on."""
    router = plan.router
    found = []
    for host in router.hosts:  # every router host runs the router, its metrics and a scaler
        found += [
            Listener(host, router.port, router.port, ROUTER, "port"),
            Listener(
                host,
                router.metrics_port,
                router.metrics_port,
                ROUTER_METRICS,
                "pdctl.router.metrics_port",
            ),
            Listener(
                host, plan.scaler_metrics_port, plan.scaler_metrics_port, SCALER_METRICS, None
            ),
        ]
        if router.meshed:
            found.append(Listener(host, router.mesh_port, router.mesh_port, ROUTER_MESH, None))
    for slot in plan.slots():
        last = slot.port + plan.port_stride - 1
        found.append(Listener(slot.host, slot.port, last, slot.name, "pdctl.ports.base, stride"))
        if slot.bootstrap_port is not None:
            boot = slot.bootstrap_port
            found.append(
                Listener(
                    slot.host, boot, boot, bootstrap_of(slot.name), "pdctl.ports.bootstrap_base"
                )
            )
        if slot.side_channel_port is not None:
            first = slot.side_channel_port
            found.append(
                Listener(
                    slot.host,
                    first,
                    first + len(slot.gpus) - 1,
                    side_channel_of(slot.name),
                    "pdctl.ports.side_channel_base",
                )
            )
        if slot.kv_port is not None:
            first = slot.kv_port
            last = first + len(slot.gpus) - 1
            found.append(Listener(slot.host, first, last, kv_of(slot.name), KV_PORT_FIELD))
    return found


def held_by(plan: Plan) -> list[Held]:
    """What a deployed plan holds: every slot's GPUs (spares too: they are its scaler's
    room) and every listener's ports."""
    ports = [
        Held(plan.service, item.host, item.what, ports=(item.first, item.last))
        for item in listeners(plan)
    ]
    gpus = [Held(plan.service, s.host, s.name, gpus=tuple(s.gpus)) for s in plan.slots()]
    return ports + gpus


def router_args(spec: Spec) -> list[str]:
    """The router group's `smg launch` flags that pdctl keeps (policies, timeouts, ...)."""
    router = next((g for g in spec.replicas if g.role == "router"), None)
    launch = launch_line(router.commands) if router else None
    if launch is None:
        settings = spec.pdctl.router
        args = [
            "--prefill-policy",
            settings.prefill_policy,
            "--decode-policy",
            settings.decode_policy,
        ]
        args += ["--policy", settings.policy] if settings.policy else []
    else:
        args = kept_flags(launch)
    # SMG 1.13 routes dynamically registered gRPC workers only as its IGW (docs/facts.md).
    if spec.connection == "grpc" and IGW_FLAG not in args:
        args.append(IGW_FLAG)
    return args


def _config_hash(
    image: str, script: str, env: Env, spec: Spec, gpus: int, secrets_digest: str
) -> str:
    material: dict[str, Any] = {
        "image": image,
        "script": script,
        "env": env.plain,
        "secrets": env.secrets,
        "volumes": spec.volumes,
        "privileged": spec.workers_privileged,
        "gpus": gpus,
        "memlock": spec.pdctl.memlock,
    }
    if secrets_digest:  # a rotated secret rolls the replicas; without secrets, as before
        material["secrets_digest"] = secrets_digest
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:12]


def _fits(host: FleetHost, gpus: HostGpus, group: ReplicaGroup, spec: Spec) -> str | None:
    """Why a host cannot take this group's replicas (None: it can)."""
    reason = gpus.mismatch(spec.gpus(group) or Gpu())
    return reason if reason is not None else _short_of(host, group.resources or spec.resources)


def unusable(host: FleetHost) -> str | None:
    """Why placement never uses a host (None: it may)."""
    if host.preflight is None:
        return "never checked (run `pdctl fleet check`)"
    if not host.preflight.ok:
        failed = [c["name"] for c in host.preflight.checks if not c["ok"]]
        return f"failed preflight ({', '.join(failed)})"
    return None


def _eligible(fleet: Fleet, excluded: dict[str, str]) -> list[FleetHost]:
    hosts = []
    for host in sorted(fleet.hosts, key=lambda h: natural_key(h.name)):
        reason = unusable(host)
        if reason is None:
            hosts.append(host)
        else:
            excluded[host.name] = reason
    return hosts


def _router_hosts(spec: Spec, hosts: list[FleetHost]) -> list[FleetHost]:
    """The router group's count of distinct hosts: pdctl.router.host first, then CPU hosts,
    then GPU hosts, with the router group's cpu and memory minimums."""
    router = next((g for g in spec.replicas if g.role == "router"), None)
    resources = router.resources if router else None
    return place(
        spec.routers,
        hosts,
        pinned=spec.pdctl.router.host,
        short_of=lambda host: _short_of(host, resources),
    )


def _short_of(host: FleetHost, resources: Resources | None) -> str | None:
    """What a host lacks of cpu and memory minimums (None: nothing)."""
    facts = host.facts or {}
    cpu = resources.cpu if resources else None
    memory = resources.memory if resources else None
    if cpu and cpu.min and (facts.get("cpus") or 0) < cpu.min:
        return f"{facts.get('cpus')} CPUs < {cpu.describe()}"
    if memory and memory.min and (facts.get("memory_gb") or 0) < memory.min:
        return f"{facts.get('memory_gb')} GB memory < {memory.describe()}"
    return None


def build(
    spec: Spec,
    env: Env,
    fleet: Fleet,
    *,
    secrets_digest: str,
    allow_partial: bool = False,
    held: Sequence[Held] = (),
) -> Plan:
    """Place the service on the fleet, around what other services hold there (``held``).

    The spec's own service's holdings are ignored: a re-plan is not pushed off its own GPUs
    and ports, so a redeploy keeps its placement. ``secrets_digest``: the caller's keyed hash
    of the secrets' values (the plan stays pure: the key is the workspace's), which every
    group's config covers.
    """
    others = [h for h in held if h.service != spec.name]
    cache = model_cache.plan_cache(spec, env, fleet.settings.model_cache)
    env = model_cache.worker_env(cache, env)
    excluded: dict[str, str] = {}
    hosts = _eligible(fleet, excluded)
    router_hosts = _router_hosts(spec, hosts)
    groups: dict[str, GroupPlan] = {
        role: _group_plan(spec, env, role, secrets_digest) for role in WORKER_ROLES
    }
    gpus = _read_facts(fleet, hosts, excluded)
    candidates: dict[str, list[FleetHost]] = {
        role: _candidates(spec, role, fleet, gpus, excluded) for role in WORKER_ROLES
    }
    shortfalls, placed = _place(spec, groups, candidates, hosts, others)
    _check_capacity(groups, shortfalls, _gpu_holders(others, candidates), allow_partial)
    for role in WORKER_ROLES:
        groups[role].max = len(groups[role].slots)
    notes = _spec_notes(spec) + _wire_slots(spec, env, groups, gpus)
    plan = _plan(spec, env, fleet, router_hosts, groups, excluded, secrets_digest)
    plan.volumes = model_cache.cache_volume(cache, _volumes(spec, fleet, plan.slots(), gpus))
    if cache is not None:
        plan.model_repo, plan.model_revision = cache.repo, cache.revision
        plan.model_cache = cache.cache
    _check_kv_ip(spec, placed)
    plan.notes = notes + _wire_ports(spec, plan, placed, others)
    _check_listeners(plan, others)
    refuse_unsurvivable(plan)
    return plan


def _spec_notes(spec: Spec) -> list[str]:
    """What the plan runs otherwise than the spec's text says: flags pdctl adds to a launch
    or drops from the router's, dstack settings that mean nothing here."""
    notes = []
    for role in WORKER_ROLES:
        group = spec.group(role)
        for flag in added_flags(group):
            metric = group.scaling.metric if group.scaling else "latency"
            notes.append(
                f"{role}: {flag} added to its SGLang command (it scales on {metric}, which the "
                "scaler reads from the workers' /metrics)"
            )
    router = next((g for g in spec.replicas if g.role == "router"), None)
    line = launch_line(router.commands) if router else None
    dropped = dropped_flags(line) if line else []
    if dropped:
        notes.append(
            f"router: {', '.join(dropped)} left out of `smg launch` (SMG takes the tokenizer "
            "from the workers)"
        )
    if spec.connection == "grpc" and IGW_FLAG not in (kept_flags(line) if line else []):
        notes.append(
            f"router: {IGW_FLAG} added to `smg launch` (SMG routes the gRPC workers pdctl "
            "registers only in its IGW mode)"
        )
    if spec.ignored:
        notes.append(f"dstack settings pdctl does not use, ignored: {', '.join(spec.ignored)}")
    return notes


def _check_kv_ip(spec: Spec, placed: list[Slot]) -> None:
    """A kv_ip the command fixes is the same for every slot of the group: it must be an
    address each slot's host has (its own, loopback, or any)."""
    for slot in placed:
        launch = spec.group(slot.group).launch
        address = launch.kv_ip if launch else None
        if address is None or address == slot.address:
            continue
        parsed = ipaddress.ip_address(address)
        if parsed.is_loopback or parsed.is_unspecified:
            continue
        raise InputError(
            f"{slot.host}: {slot.name}'s --kv-transfer-config sets kv_ip {address}, which is "
            f"not an address of that host ({slot.address}): every slot of the {slot.group} "
            "group runs the same command, on hosts pdctl chooses",
            hint="leave kv_ip out (vLLM takes its host's address) or set it to 0.0.0.0",
        )


def _group_plan(spec: Spec, env: Env, role: WorkerRole, secrets_digest: str) -> GroupPlan:
    group = spec.group(role)
    gpu = spec.gpus(group)
    per_replica = gpu.count if gpu else 1
    low, high = group.count
    image = spec.image_of(group)
    script = worker_script(group.commands, role, added_flags(group))
    return GroupPlan(
        role=role,
        engine=group.engine,
        connection=group.connection,
        min=low,
        max=high,
        gpus_per_replica=per_replica,
        scaling=group.scaling.model_dump() if group.scaling else None,
        image=image,
        image_id=image_pin(spec, group),
        script=script,
        config=_config_hash(image, script, env, spec, per_replica, secrets_digest),
    )


def _read_facts(
    fleet: Fleet, hosts: list[FleetHost], excluded: dict[str, str]
) -> dict[str, HostGpus]:
    """The GPU hosts' facts, checked; a host whose facts hold what pdctl will not write
    (a NIC name with a space, a CDI name with a newline) is not used, and says why."""
    found = {}
    for host in hosts:
        if host.kind != "gpu":
            continue
        try:
            found[host.name] = HostGpus.from_facts(host.facts)
        except FactsError as exc:
            excluded[host.name] = (
                f"unusable {exc} (refused; `pdctl fleet check {fleet.name}` reads them again)"
            )
    return found


def _candidates(
    spec: Spec,
    role: WorkerRole,
    fleet: Fleet,
    gpus: dict[str, HostGpus],
    excluded: dict[str, str],
) -> list[FleetHost]:
    """The hosts that can take the group's replicas; the GPU hosts that cannot say why.
    A group's replicas run one image, so they never land on two vendors' GPUs."""
    group = spec.group(role)
    wanted = spec.gpus(group) or Gpu()
    found = []
    for name, host_gpus in gpus.items():
        host = fleet.host(name)
        assert host is not None  # gpus is read from the fleet's hosts
        reason = _fits(host, host_gpus, group, spec)
        if reason is None:
            found.append(host)
        else:
            excluded.setdefault(name, reason)
    found.sort(key=lambda h: natural_key(h.name))
    if not found:
        raise CheckFailed(
            f"{role} needs {wanted.describe()}; hosts: {_what_hosts_have(fleet, gpus, excluded)}",
            hint="change the group's resources.gpu, or add (or fix) hosts with such GPUs",
        )
    vendors: dict[str, list[str]] = {}
    for host in found:
        vendors.setdefault(gpus[host.name].vendor or "unknown", []).append(host.name)
    if len(vendors) > 1:
        which = "; ".join(f"{v}: {', '.join(names)}" for v, names in sorted(vendors.items()))
        raise InputError(
            f"{role}: gpu {wanted.describe()} matches hosts of more than one vendor ({which}), "
            "and a group's image runs on one",
            hint=f"name the vendor or the model in resources.gpu (e.g. nvidia:{wanted.count} "
            f"or H200:{wanted.count})",
        )
    return found


def _what_hosts_have(fleet: Fleet, gpus: dict[str, HostGpus], excluded: dict[str, str]) -> str:
    """Every GPU host of the fleet with its GPUs, and why it is not used if it is not:
    "10.0.0.11 8x MI300X 192GB, 10.0.0.12 8x H200 140GB (failed preflight (gpus))"."""
    parts = []
    for host in sorted(fleet.hosts, key=lambda h: natural_key(h.name)):
        if host.kind != "gpu":
            continue
        have = gpus[host.name].describe() if host.name in gpus else "unreadable facts"
        reason = excluded.get(host.name, "")
        health = f" ({reason})" if reason and host.name not in gpus else ""
        parts.append(f"{host.address} {have}{health}")
    return ", ".join(parts) or "no GPU hosts"


def _transfer_backend(group: ReplicaGroup) -> str | None:
    """SGLang's --disaggregation-transfer-backend, or vLLM's KV connector."""
    launch = group.launch
    if launch is not None and launch.engine == "vllm":
        return launch.kv_connector
    match = re.search(r"--disaggregation-transfer-backend[=\s]+([\w-]+)", " ".join(group.commands))
    return match[1] if match else None


def _wire_slots(
    spec: Spec, env: Env, groups: dict[str, GroupPlan], gpus: dict[str, HostGpus]
) -> list[str]:
    """Each slot's vendor and the NICs nearest its GPUs (UCX's too, for NIXL). Returns a note
    per host whose facts carry no topology: its slots get no NICs of their own."""
    blind: set[str] = set()
    for role in WORKER_ROLES:
        ucx = (
            _transfer_backend(spec.group(role)) in UCX_BACKENDS
            and "UCX_NET_DEVICES" not in env.plain
        )
        for slot in groups[role].slots:
            host = gpus[slot.host]
            slot.vendor = host.vendor or "amd"
            nics = host.nics_for(host.rdma_driver())
            names = topology.nearest_nics(host.devices, nics, slot.gpus)
            if nics and not names:
                blind.add(slot.host)
            slot.rdma_devices = names
            if ucx:
                ports = {n.name: n.port for n in nics}
                slot.ucx_net_devices = [f"{name}:{ports[name]}" for name in names]
    return [
        f"{host}: its facts carry no PCI topology (gathered by an older pdctl): its slots get "
        "no NICs of their own (no PDCTL_RDMA_DEVICES); `pdctl fleet check` reads them again"
        for host in sorted(blind, key=natural_key)
    ]


def _order(groups: dict[str, GroupPlan]) -> list[tuple[WorkerRole, int]]:
    """Every group's minimum first, then the spares; prefill and decode take turns, so one
    group's spares never crowd out the other's minimum."""
    indexes = range(1, max(g.max for g in groups.values()) + 1)
    minimum = [(r, i) for i in indexes for r in WORKER_ROLES if i <= groups[r].min]
    spares = [(r, i) for i in indexes for r in WORKER_ROLES if groups[r].min < i <= groups[r].max]
    return minimum + spares


def _place(
    spec: Spec,
    groups: dict[str, GroupPlan],
    candidates: dict[str, list[FleetHost]],
    hosts: list[FleetHost],
    held: Sequence[Held],
) -> tuple[list[str], list[Slot]]:
    """Put each slot on the host with the most free GPUs (its ports come later: _wire_ports);
    the groups that ran out, each as "role: N of M slots fit", and the slots in the order
    they were placed."""
    free = {h.name: _free_gpus(h, held) for h in hosts if h.kind == "gpu"}
    shortfalls: list[str] = []
    placed: list[Slot] = []
    full: set[str] = set()
    for role, index in _order(groups):
        group_plan = groups[role]
        if role in full:
            continue
        per_replica = group_plan.gpus_per_replica
        # max keeps the first (lowest-named) of equals: replicas spread across hosts.
        host = max(candidates[role], key=lambda h: len(free[h.name]), default=None)
        if host is None or len(free[host.name]) < per_replica:
            shortfalls.append(
                f"{role}: {index - 1} of {group_plan.max} slots fit ({per_replica} GPUs each)"
            )
            full.add(role)
            continue
        gpus, free[host.name] = free[host.name][:per_replica], free[host.name][per_replica:]
        launch = spec.group(role).launch
        slot = Slot(
            group=role,
            index=index,
            host=host.name,
            address=host.address,
            gpus=gpus,
            port=0,  # _wire_ports gives every slot its ports
            bootstrap_port=None,
            start=index <= group_plan.min,
            engine=group_plan.engine,
            connection=group_plan.connection,
            kv_connector=launch.kv_connector if launch else None,
            kv_role=launch.kv_role if launch else None,
            kv_port=launch.kv_port if launch else None,
        )
        group_plan.slots.append(slot)
        placed.append(slot)
    return shortfalls, placed


def _free_gpus(host: FleetHost, held: Sequence[Held]) -> list[int]:
    """The host's GPUs that no other service holds."""
    count = int(((host.facts or {}).get("gpus") or {}).get("count") or 0)
    taken = {g for h in held if h.host == host.name for g in h.gpus}
    return [g for g in range(count) if g not in taken]


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _side_channel_span(spec: Spec) -> int:
    """The ports between two slot positions' NIXL side channels: vLLM's ranks each take the
    next port from the slot's, so a slot takes as many as its GPUs (docs/facts.md)."""
    return max(g.count for g in (spec.gpus(spec.group(r)) for r in WORKER_ROLES) if g)


def _slot_ports(spec: Spec, role: WorkerRole, nth: int) -> tuple[int, int | None, int | None]:
    """The serving port, the bootstrap port (SGLang prefill) and the first NIXL side channel
    port (vLLM) of the nth slot position on a host."""
    ports = spec.pdctl.ports
    vllm = spec.engine == "vllm"
    return (
        ports.base + nth * ports.stride,
        ports.bootstrap_base + nth if role == "prefill" and not vllm else None,
        ports.side_channel_base + nth * _side_channel_span(spec) if vllm else None,
    )


def _position_spans(spec: Spec, role: WorkerRole, gpus: int, nth: int) -> list[tuple[int, int]]:
    """The ports the nth slot position takes on a host: its worker range, bootstrap port and
    side channel (every position's are above the one before's)."""
    return [(first, last) for first, last, _what in _position_parts(spec, role, gpus, nth)]


def _position_parts(
    spec: Spec, role: WorkerRole, gpus: int, nth: int
) -> list[tuple[int, int, str]]:
    port, bootstrap, side_channel = _slot_ports(spec, role, nth)
    parts = [(port, port + spec.pdctl.ports.stride - 1, "worker ports (pdctl.ports.base, stride)")]
    if bootstrap is not None:
        parts.append((bootstrap, bootstrap, "bootstrap port (pdctl.ports.bootstrap_base)"))
    if side_channel is not None:
        last = side_channel + gpus - 1
        parts.append((side_channel, last, "NIXL side channel (pdctl.ports.side_channel_base)"))
    return parts


def _gpu_holders(held: Sequence[Held], candidates: dict[str, list[FleetHost]]) -> str:
    """Who holds GPUs on the hosts the groups could use: "gpu1: GPUs 0,1 (service a's
    prefill/1), ...; gpu2: ..." ("" when nobody does)."""
    hosts = sorted({h.name for found in candidates.values() for h in found}, key=natural_key)
    parts = []
    for host in hosts:
        owned = sorted((h for h in held if h.host == host and h.gpus), key=lambda h: h.gpus)
        if owned:
            gpus = ", ".join(f"{','.join(map(str, h.gpus))} ({h.owner})" for h in owned)
            parts.append(f"{host}: GPUs {gpus}")
    return "; ".join(parts)


def _check_capacity(
    groups: dict[str, GroupPlan], shortfalls: list[str], holders: str, allow_partial: bool
) -> None:
    others = f"; other services hold {holders}" if holders else ""
    free_theirs = ", free GPUs other services hold (pdctl destroy)" if holders else ""
    for role in WORKER_ROLES:
        if len(groups[role].slots) < groups[role].min:
            raise CheckFailed(
                f"not enough GPUs: {'; '.join(shortfalls)}; even the minimum "
                f"{groups[role].min} {role} replica(s) do not fit{others}",
                hint=f"add GPU hosts, fix failing ones (pdctl fleet check){free_theirs}, "
                "or lower the counts",
            )
    if shortfalls and not allow_partial:
        raise CheckFailed(
            f"not enough GPUs for every planned slot: {'; '.join(shortfalls)}{others}",
            hint=f"add GPU hosts{free_theirs}, lower the max counts, or pass --allow-partial",
        )


def _plan(
    spec: Spec,
    env: Env,
    fleet: Fleet,
    router_hosts: list[FleetHost],
    groups: dict[str, GroupPlan],
    excluded: dict[str, str],
    secrets_digest: str,
) -> Plan:
    settings = spec.pdctl
    probe = spec.probes[0] if spec.probes else Probe()
    return Plan(
        service=spec.name,
        fleet=fleet.name,
        runtime=settings.runtime,
        image_archive=settings.image_archive,
        env=env.plain,
        secret_names=env.secrets,
        secrets_digest=secrets_digest,
        volumes=list(spec.volumes),  # build() adds the provider library once slots are placed
        privileged=spec.workers_privileged,
        memlock=settings.memlock,
        start_timeout=int(settings.start_timeout),
        stop_timeout=int(settings.stop_timeout),
        probe=ProbePlan(url=probe.url, interval=int(probe.interval), timeout=int(probe.timeout)),
        model=spec.model_name,
        router=RouterPlan(
            replicas=[RouterReplica(host=h.name, address=h.address) for h in router_hosts],
            failover=failover_address(
                settings.router.address,
                settings.router.virtual_router_id,
                [(h.name, h.address) for h in fleet.hosts],
            ),
            port=spec.port,
            metrics_port=settings.router.metrics_port,
            args=router_args(spec),
            health_check_interval=max(1, int(settings.router.health_check_interval)),
            wheelhouse=settings.wheelhouse or fleet.settings.wheelhouse,
        ),
        groups=groups,
        port_stride=settings.ports.stride,
        excluded_hosts=dict(sorted(excluded.items())),
        failover=FailoverPlan(
            **settings.scaler.model_dump(),
            survive_host_loss=settings.placement.survive_host_loss,
        ),
    )


def _fixed_listeners(spec: Spec, plan: Plan, placed: list[Slot]) -> list[Listener]:
    """The ports the user set, which pdctl never moves: the router's `port` and metrics port
    when the spec gives them, and each vLLM slot's kv_port (its ranks' too)."""
    router = plan.router
    found = []
    for host in router.hosts:
        if "port" in spec.model_fields_set:
            found.append(Listener(host, router.port, router.port, ROUTER, "port"))
        if "metrics_port" in spec.pdctl.router.model_fields_set:
            metrics = router.metrics_port
            found.append(
                Listener(host, metrics, metrics, ROUTER_METRICS, "pdctl.router.metrics_port")
            )
    for slot in placed:
        if slot.kv_port is not None:
            last = slot.kv_port + len(slot.gpus) - 1
            found.append(Listener(slot.host, slot.kv_port, last, kv_of(slot.name), KV_PORT_FIELD))
    return found


def _wire_ports(spec: Spec, plan: Plan, placed: list[Slot], held: Sequence[Held]) -> list[str]:
    """Every listener's port, judged on its host: what other services hold there and the
    ports the user set are entered first (two that meet are refused); every port pdctl picks
    then steps past what is taken on its host: the router's and its metrics' defaults, each
    slot's position (worker range, bootstrap, side channel) in placement order, the scaler's.
    Returns the plan's notes on ports that moved from what the spec says."""
    ledger = Ledger()
    for item in held:
        if item.ports is not None:
            ledger.take(item.host, *item.ports, item.owner, held=True)
    for listener in _fixed_listeners(spec, plan, placed):
        span = ledger.clash(listener.host, listener.first, listener.last)
        if span is not None:
            raise _meets(plan.service, listener, span)
        ledger.take(listener.host, listener.first, listener.last, _named(listener))
    notes: list[str] = []
    router = plan.router
    # One port of each for every router host (clients and the failover address use one).
    if "port" not in spec.model_fields_set:
        router.port = _free_on_all(ledger, router.hosts, router.port, ROUTER, "port")
        if router.port != spec.port:
            notes.append(
                f"router: port {spec.port} is taken on {_one_of(router.hosts)}: the router "
                f"listens on {router.port} (set `port` in the spec to choose)"
            )
    if "metrics_port" not in spec.pdctl.router.model_fields_set:
        field = "pdctl.router.metrics_port"
        router.metrics_port = _free_on_all(
            ledger, router.hosts, router.metrics_port, ROUTER_METRICS, field
        )
    for host in router.hosts:
        if "port" not in spec.model_fields_set:
            ledger.take(host, router.port, router.port, f"the {ROUTER}")
        if "metrics_port" not in spec.pdctl.router.model_fields_set:
            ledger.take(host, router.metrics_port, router.metrics_port, f"the {ROUTER_METRICS}")
    if router.meshed:
        router.mesh_port = _free_on_all(ledger, router.hosts, router.mesh_port, ROUTER_MESH, None)
        for host in router.hosts:
            ledger.take(host, router.mesh_port, router.mesh_port, f"the {ROUTER_MESH}")
    positions: dict[str, int] = {}
    for slot in placed:
        nth = ledger.free_position(
            slot.host,
            positions.get(slot.host, 0),
            partial(_position_spans, spec, slot.group, len(slot.gpus)),
        )
        if nth is None:
            raise _past_the_end(spec, slot, positions.get(slot.host, 0))
        positions[slot.host] = nth + 1
        slot.port, slot.bootstrap_port, slot.side_channel_port = _slot_ports(spec, slot.group, nth)
        for first, last in _position_spans(spec, slot.group, len(slot.gpus), nth):
            ledger.take(slot.host, first, last, slot.name)
    plan.scaler_metrics_port = _free_on_all(
        ledger, router.hosts, SCALER_METRICS_PORT, SCALER_METRICS, None
    )
    return notes


def _past_the_end(spec: Spec, slot: Slot, nth: int) -> InputError:
    """No position from ``nth`` on fits below 65536 on the slot's host: say which of its
    ports runs past the end first."""
    while True:
        parts = _position_parts(spec, slot.group, len(slot.gpus), nth)
        past = [(last, what) for _first, last, what in parts if last > MAX_PORT]
        if past:
            last, what = max(past)
            return InputError(
                f"{slot.host}: no free ports for {slot.name}: its {what} would reach {last}, "
                "past 65535",
                hint="lower pdctl.ports.base, stride or the other bases, or the groups' max counts",
            )
        nth += 1


def _free(ledger: Ledger, host: str, port: int, what: str, field: str | None) -> int:
    found = ledger.free_port(host, port)
    if found is None:
        raise InputError(
            f"{host}: no free port for the {what} from {port} up to 65535",
            hint=f"set {field} in the spec" if field else "free ports on the host",
        )
    return found


def _one_of(hosts: Sequence[str]) -> str:
    return hosts[0] if len(hosts) == 1 else f"one of the router hosts ({', '.join(hosts)})"


def _free_on_all(
    ledger: Ledger, hosts: Sequence[str], port: int, what: str, field: str | None
) -> int:
    """The first port from ``port`` on that is free on every one of ``hosts``."""
    while True:
        found = port
        for host in hosts:
            found = _free(ledger, host, found, what, field)
        if all(_free(ledger, host, found, what, field) == found for host in hosts):
            return found
        port = found


def _named(listener: Listener) -> str:
    """A listener of this plan as a message names it: "the router (port)", "prefill/2's KV
    connector (kv_port in --kv-transfer-config)"."""
    service_wide = listener.what in {ROUTER, ROUTER_METRICS, ROUTER_MESH, SCALER_METRICS}
    return f"the {listener.describe()}" if service_wide else listener.describe()


def _meets(service: str, listener: Listener, span: Span) -> InputError:
    """A port the user set that meets another listener on its host: another service's
    (``span.held``) or another port the user set."""
    port = max(listener.first, span.first)
    if not span.held:
        return InputError(
            f"{listener.host}: port {port} is wanted by {span.owner} and by "
            f"{_named(listener)}, both set in the spec",
            hint="set one of them to another port",
        )
    if listener.what == ROUTER:
        return InputError(
            f"{listener.host}: the router of service {service} cannot listen on port {port}: "
            f"{span.owner} does, and the router's port is the service's public endpoint, "
            "so pdctl does not move it",
            hint="set another `port` in the spec (or pdctl.router.host to another host)",
        )
    return InputError(
        f"{listener.host}: port {port} for service {service}'s {listener.what} is taken by "
        f"{span.owner}",
        hint=f"set another {listener.field or 'port'} in the spec",
    )


def _check_listeners(plan: Plan, held: Sequence[Held]) -> None:
    """What _wire_ports gave, checked once more as a whole: no two listeners of the plan on
    one (host, port), none on a port another service holds there, every port a TCP port.

    A worker's port starts a range of `pdctl.ports.stride` ports: SGLang opens internal
    ports from --port + 233, so every other listener on its host stays out of that range.
    """
    mine: dict[str, list[Listener]] = {}
    for listener in listeners(plan):
        mine.setdefault(listener.host, []).append(listener)
    for host in sorted(mine, key=natural_key):
        spans = sorted(mine[host], key=lambda x: (x.first, x.last, x.what))
        _check_own(host, spans)
        for listener in spans:
            for other in held:
                span = (listener.first, listener.last)
                if other.host == host and other.ports and _overlaps(span, other.ports):
                    start = max(span[0], other.ports[0])
                    raise _meets(plan.service, listener, Span(start, start, other.owner, True))


def _check_own(host: str, spans: list[Listener]) -> None:
    """The plan's own listeners on one host (sorted by first port) apart and below 65536."""
    previous: Listener | None = None
    for listener in spans:
        if listener.last > 65535:
            raise InputError(
                f"{host}: {listener.describe()} would use ports up to {listener.last}, past 65535",
                hint="lower pdctl.ports.base or pdctl.ports.stride, or the groups' max counts",
            )
        if previous is not None and listener.first <= previous.last:
            raise InputError(
                f"{host}: port {listener.first} is wanted by {previous.describe()} "
                f"and by {listener.describe()}",
                hint="move one: pdctl.ports.base/stride/bootstrap_base, port or "
                "pdctl.router.metrics_port in the spec",
            )
        if previous is None or listener.last > previous.last:
            previous = listener


def _provider_mount(spec: Spec, fleet: Fleet, host: str, gpus: HostGpus) -> str | None:
    """The RDMA provider library mount a host's workers get (None: none), from the host's
    facts (rdma.provider_libs[its NICs' driver]); facts from before they carried it: the
    fleet's provider_lib, as pdctl always did."""
    setting = spec.pdctl.provider_lib
    if setting == "image" or (setting == "auto" and gpus.vendor == "nvidia"):
        return None
    if gpus.provider_libs is None:
        path = fleet.settings.provider_lib
        try:
            validate.host_path(path)
        except ValueError as exc:
            raise InputError(f"fleet {fleet.name}: provider_lib {exc}") from None
        return f"{path}:{CONTAINER_PROVIDER_LIB}:ro"
    driver = gpus.rdma_driver()
    found = gpus.provider_libs.get(driver or "")
    if found is None:
        raise CheckFailed(
            f"{host}: its facts name no RDMA provider library for {driver or 'its NICs'}",
            hint="install rdma-core's lib<driver>-rdmav*.so there and run `pdctl fleet check`, "
            "or set pdctl.provider_lib: image when the worker image carries its own",
        )
    return f"{found}:{CONTAINER_PROVIDER_DIR}/{found.rsplit('/', 1)[-1]}:ro"


def _volumes(spec: Spec, fleet: Fleet, slots: list[Slot], gpus: dict[str, HostGpus]) -> list[str]:
    """The spec's volumes, plus the worker hosts' RDMA provider library mounted read-only
    (once; not when a spec volume already mounts something there). The volumes are the
    service's, so its worker hosts must keep the library at one path."""
    mounts: dict[str, list[str]] = {}
    for host in sorted({s.host for s in slots}, key=natural_key):
        mount = _provider_mount(spec, fleet, host, gpus[host])
        mounts.setdefault(mount or "none", []).append(host)
    volumes = list(spec.volumes)
    if len(mounts) > 1:
        which = "; ".join(f"{m.split(':')[0]}: {', '.join(h)}" for m, h in sorted(mounts.items()))
        raise CheckFailed(
            f"the service's worker hosts differ in their RDMA provider library ({which}); "
            "pdctl mounts one path into every worker of a service",
            hint="install it at one path on every host, or set pdctl.provider_lib: image",
        )
    mount = next(iter(mounts), "none")
    if mount != "none" and not any(v.split(":")[1] == mount.split(":")[1] for v in volumes):
        volumes.insert(0, mount)
    return volumes
