"""The placement plan: spec + fleet facts -> which replica slot runs where. PURE.

Every slot up to each group's max is planned now (the scaler only starts and
stops planned slots); the min are started. A slot owns its GPUs, serving port
and bootstrap port on its host. Deterministic: the same inputs give the same
plan, byte for byte, so plans diff cleanly. The plan is also the extra-vars
document of playbooks/deploy.yml.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, Field

from pdctl.commands import worker_script
from pdctl.errors import CheckFailed, InputError
from pdctl.inventory import Fleet, FleetHost
from pdctl.router_flags import kept_flags, launch_line
from pdctl.spec import Env, ReplicaGroup, Spec
from pdctl.versions import SMG_VERSION

WorkerRole = Literal["prefill", "decode"]
WORKER_ROLES: tuple[WorkerRole, ...] = ("prefill", "decode")
CONTAINER_PROVIDER_LIB = "/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so"
RENDER_MINOR_BASE = 128
# pd_scaler's metrics listener on the router host (roles/pd_scaler/defaults).
SCALER_METRICS_PORT = 29100


class Slot(BaseModel):
    group: WorkerRole
    index: int
    host: str
    address: str
    gpus: list[int]
    port: int
    bootstrap_port: int | None
    start: bool

    @property
    def name(self) -> str:
        return f"{self.group}/{self.index}"

    def unit(self, service: str) -> str:
        return f"pd-{service}-{self.group}@{self.index}.service"

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def env(self) -> dict[str, str]:
        """The slot's own environment (its instance env file)."""
        ids = ",".join(str(g) for g in self.gpus)
        env = {
            "PDCTL_SLOT": self.name,
            "PDCTL_HOST": self.address,
            "PDCTL_PORT": str(self.port),
            "PDCTL_GPU_IDS": ids,
            "ROCR_VISIBLE_DEVICES": ids,
            "DSTACK_GPUS_NUM": str(len(self.gpus)),
            "PDCTL_DEVICE_ARGS": " ".join(
                f"--device /dev/dri/renderD{RENDER_MINOR_BASE + g}" for g in self.gpus
            ),
        }
        if self.bootstrap_port is not None:
            env["PDCTL_BOOTSTRAP_PORT"] = str(self.bootstrap_port)
        return env


class GroupPlan(BaseModel):
    role: WorkerRole
    min: int
    max: int
    gpus_per_replica: int
    scaling: dict[str, Any] | None
    image: str
    script: str
    config: str  # hash of what a replica runs: a change means a rolling update
    slots: list[Slot] = Field(default_factory=list)


class RouterPlan(BaseModel):
    host: str
    address: str
    port: int
    metrics_port: int
    smg_version: str = SMG_VERSION
    args: list[str]
    health_check_interval: int
    wheelhouse: str | None


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
    probe: dict[str, Any]
    model: str | None
    router: RouterPlan
    groups: dict[str, GroupPlan]
    excluded_hosts: dict[str, str] = Field(default_factory=dict)

    def slots(self) -> list[Slot]:
        return [slot for role in WORKER_ROLES for slot in self.groups[role].slots]

    def hosts(self) -> list[str]:
        names = {self.router.host, *(slot.host for slot in self.slots())}
        return sorted(names, key=_natural)

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
                "env": slot.env(),
            }
            host_slots.setdefault(slot.host, []).append(entry)
        return {
            "pd_service": self.service,
            "pd_fleet": self.fleet,
            "pd_plan_hosts": self.hosts(),
            "pd_worker_hosts": sorted(host_slots, key=_natural),
            "pd_router_host": self.router.host,
            "pd_host_slots": host_slots,
            **{
                f"pd_{key}": value
                for key, value in doc.items()
                if key not in {"service", "fleet", "excluded_hosts"}
            },
        }


def plan_from_extravars(doc: dict[str, Any]) -> Plan:
    """The inverse of Plan.extravars(): a plan.yml (or the scaler's config) back into a Plan."""
    fields = {key[3:]: value for key, value in doc.items() if key.startswith("pd_")}
    slots: dict[str, list[dict[str, Any]]] = {role: [] for role in WORKER_ROLES}
    for entries in (fields.pop("host_slots", None) or {}).values():
        for entry in entries:
            slots[entry["group"]].append(
                {k: v for k, v in entry.items() if k not in {"unit", "env", "url"}}
            )
    groups = fields.get("groups") or {}
    for role in WORKER_ROLES:
        groups[role] = {**groups[role], "slots": sorted(slots[role], key=lambda s: s["index"])}
    known = set(Plan.model_fields)
    return Plan.model_validate({key: value for key, value in fields.items() if key in known})


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


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
        return [*args, *(["--policy", settings.policy] if settings.policy else [])]
    return kept_flags(launch)


def _config_hash(image: str, script: str, env: Env, spec: Spec, gpus: int) -> str:
    material = json.dumps(
        {
            "image": image,
            "script": script,
            "env": env.plain,
            "secrets": env.secrets,
            "volumes": spec.volumes,
            "privileged": spec.privileged,
            "gpus": gpus,
            "memlock": spec.pdctl.memlock,
        },
        sort_keys=True,
    )
    return hashlib.sha256(material.encode()).hexdigest()[:12]


def _fits(host: FleetHost, group: ReplicaGroup, spec: Spec) -> str | None:
    """Why a host cannot take this group's replicas (None: it can)."""
    facts = host.facts or {}
    resources = group.resources or spec.resources
    wanted = spec.gpus(group)
    gpus = facts.get("gpus") or {}
    if wanted and wanted.model and wanted.model.lower() not in str(gpus.get("model") or "").lower():
        return f"GPU model {gpus.get('model') or 'unknown'} is not {wanted.model}"
    if (
        resources
        and resources.cpu
        and resources.cpu.min
        and (facts.get("cpus") or 0) < resources.cpu.min
    ):
        return f"{facts.get('cpus')} CPUs < {resources.cpu.describe()}"
    if (
        resources
        and resources.memory
        and resources.memory.min
        and (facts.get("memory_gb") or 0) < resources.memory.min
    ):
        return f"{facts.get('memory_gb')} GB memory < {resources.memory.describe()}"
    return None


def _eligible(fleet: Fleet, excluded: dict[str, str]) -> list[FleetHost]:
    hosts = []
    for host in sorted(fleet.hosts, key=lambda h: _natural(h.name)):
        if host.preflight is None:
            excluded[host.name] = "never checked (run `pdctl fleet check`)"
        elif not host.preflight.ok:
            failed = [c["name"] for c in host.preflight.checks if not c["ok"]]
            excluded[host.name] = f"failed preflight ({', '.join(failed)})"
        else:
            hosts.append(host)
    return hosts


def _router_host(spec: Spec, hosts: list[FleetHost]) -> FleetHost:
    wanted = spec.pdctl.router.host
    if wanted:
        chosen = next((h for h in hosts if wanted in {h.name, h.address}), None)
        if chosen is None:
            raise CheckFailed(f"pdctl.router.host {wanted!r} is not a healthy host of the fleet")
        return chosen
    for kind in ("cpu", "gpu"):
        chosen = next((h for h in hosts if h.kind == kind), None)
        if chosen:
            return chosen
    raise CheckFailed("no healthy host in the fleet for the router", hint="pdctl fleet check FLEET")


def build(spec: Spec, env: Env, fleet: Fleet, *, allow_partial: bool = False) -> Plan:
    excluded: dict[str, str] = {}
    hosts = _eligible(fleet, excluded)
    router_host = _router_host(spec, hosts)
    free = {
        h.name: list(range(int(((h.facts or {}).get("gpus") or {}).get("count") or 0)))
        for h in hosts
        if h.kind == "gpu"
    }
    used_ports: dict[str, int] = {}
    groups: dict[str, GroupPlan] = {}
    shortfalls: list[str] = []
    candidates: dict[str, list[FleetHost]] = {}
    for role in WORKER_ROLES:
        group = spec.group(role)
        gpu = spec.gpus(group)
        per_replica = gpu.count if gpu else 1
        low, high = group.count
        image = group.image or spec.image
        script = worker_script(group.commands, role)
        groups[role] = GroupPlan(
            role=role,
            min=low,
            max=high,
            gpus_per_replica=per_replica,
            scaling=group.scaling.model_dump() if group.scaling else None,
            image=image,
            script=script,
            config=_config_hash(image, script, env, spec, per_replica),
        )
        candidates[role] = []
        for h in hosts:
            reason = _fits(h, group, spec) if h.kind == "gpu" else "CPU host"
            if reason is None:
                candidates[role].append(h)
            elif h.kind == "gpu":
                excluded.setdefault(h.name, reason)
    # Every group's minimum first, then the spares; prefill and decode take turns, so one
    # group's spares never crowd out the other's minimum.
    order = [
        (role, index)
        for index in range(1, max(g.max for g in groups.values()) + 1)
        for role in WORKER_ROLES
        if index <= groups[role].min
    ]
    order += [
        (role, index)
        for index in range(1, max(g.max for g in groups.values()) + 1)
        for role in WORKER_ROLES
        if groups[role].min < index <= groups[role].max
    ]
    full: set[str] = set()
    for role, index in order:
        group_plan = groups[role]
        if role in full:
            continue
        per_replica = group_plan.gpus_per_replica
        # The host with the most free GPUs (max keeps the first, lowest-named, of equals):
        # replicas spread across hosts.
        host = max(candidates[role], key=lambda h: len(free[h.name]), default=None)
        if host is None or len(free[host.name]) < per_replica:
            shortfalls.append(
                f"{role}: {index - 1} of {group_plan.max} slots fit ({per_replica} GPUs each)"
            )
            full.add(role)
            continue
        taken, free[host.name] = free[host.name][:per_replica], free[host.name][per_replica:]
        nth = used_ports.get(host.name, 0)
        used_ports[host.name] = nth + 1
        ports = spec.pdctl.ports
        group_plan.slots.append(
            Slot(
                group=role,
                index=index,
                host=host.name,
                address=host.address,
                gpus=taken,
                port=ports.base + nth * ports.stride,
                bootstrap_port=ports.bootstrap_base + nth if role == "prefill" else None,
                start=index <= group_plan.min,
            )
        )
    for role in WORKER_ROLES:
        placed = len(groups[role].slots)
        if placed < groups[role].min:
            raise CheckFailed(
                f"not enough GPUs: {'; '.join(shortfalls)}; even the minimum "
                f"{groups[role].min} {role} replica(s) do not fit",
                hint="add GPU hosts, fix failing ones (pdctl fleet check), or lower the counts",
            )
    if shortfalls and not allow_partial:
        raise CheckFailed(
            f"not enough GPUs for every planned slot: {'; '.join(shortfalls)}",
            hint="add GPU hosts, lower the max counts, or pass --allow-partial",
        )
    for role in WORKER_ROLES:
        groups[role].max = len(groups[role].slots)
    _check_listeners(spec, router_host.name, [s for r in WORKER_ROLES for s in groups[r].slots])
    settings = spec.pdctl
    volumes = _volumes(spec, fleet)
    probe = spec.probes[0] if spec.probes else None
    return Plan(
        service=spec.name,
        fleet=fleet.name,
        runtime=settings.runtime,
        image_archive=settings.image_archive,
        env=env.plain,
        secret_names=env.secrets,
        volumes=volumes,
        privileged=spec.privileged,
        memlock=settings.memlock,
        start_timeout=int(settings.start_timeout),
        stop_timeout=int(settings.stop_timeout),
        probe={
            "url": probe.url if probe else "/health",
            "interval": int(probe.interval) if probe else 15,
            "timeout": int(probe.timeout) if probe else 10,
        },
        model=spec.model_name,
        router=RouterPlan(
            host=router_host.name,
            address=router_host.address,
            port=spec.port,
            metrics_port=settings.router.metrics_port,
            args=router_args(spec),
            health_check_interval=max(1, int(settings.router.health_check_interval)),
            wheelhouse=settings.wheelhouse or fleet.settings.wheelhouse,
        ),
        groups=groups,
        excluded_hosts=dict(sorted(excluded.items())),
    )


def _check_listeners(spec: Spec, router_host: str, slots: list[Slot]) -> None:
    """No two listeners of the plan on one (host, port), and every port a TCP port.

    A worker's port starts a range of `pdctl.ports.stride` ports: SGLang opens internal
    ports from --port + 233. The router's, its metrics' and the scaler's ports and every
    prefill's bootstrap port must stay out of every such range on their host.
    """
    stride = spec.pdctl.ports.stride
    spans: dict[str, list[tuple[int, int, str]]] = {
        router_host: [
            (spec.port, spec.port, "the router (port)"),
            (m := spec.pdctl.router.metrics_port, m, "the router's metrics (metrics_port)"),
            (SCALER_METRICS_PORT, SCALER_METRICS_PORT, "the scaler's metrics"),
        ]
    }
    for slot in slots:
        spans.setdefault(slot.host, []).append(
            (slot.port, slot.port + stride - 1, f"{slot.name} (pdctl.ports.base, stride)")
        )
        if slot.bootstrap_port is not None:
            spans[slot.host].append(
                (slot.bootstrap_port, slot.bootstrap_port, f"{slot.name}'s bootstrap port")
            )
    for host in sorted(spans, key=_natural):
        previous: tuple[int, int, str] | None = None
        for start, end, owner in sorted(spans[host]):
            if end > 65535:
                raise InputError(
                    f"{host}: {owner} would use ports up to {end}, past 65535",
                    hint="lower pdctl.ports.base or pdctl.ports.stride, or the groups' max counts",
                )
            if previous is not None and start <= previous[1]:
                raise InputError(
                    f"{host}: port {start} is wanted by {previous[2]} and by {owner}",
                    hint="move one: pdctl.ports.base/stride/bootstrap_base, port or "
                    "pdctl.router.metrics_port in the spec",
                )
            if previous is None or end > previous[1]:
                previous = (start, end, owner)


def _volumes(spec: Spec, fleet: Fleet) -> list[str]:
    """The spec's volumes, plus the host's RDMA provider library mounted read-only (once)."""
    provider = f"{fleet.settings.provider_lib}:{CONTAINER_PROVIDER_LIB}:ro"
    volumes = list(spec.volumes)
    if not any(v.split(":")[1] == CONTAINER_PROVIDER_LIB for v in volumes):
        volumes.insert(0, provider)
    return volumes
