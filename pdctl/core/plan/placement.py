"""build(): the spec placed on the fleet. Which hosts may be used (their preflight passed, their
stored facts readable), which of them fit each worker group (GPU model, memory, count, cpu and
memory), the router's host, the slots placed in turn on the GPUs free of what other services
hold, and the refusal when even the minimum does not fit; then the ports and the wiring.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from pdctl.core import model_cache
from pdctl.core.entrypoint import worker_script
from pdctl.core.errors import CheckFailed, InputError
from pdctl.core.failover import FailoverPlan, refuse_unsurvivable
from pdctl.core.fleet_model import Fleet, FleetHost, natural_key
from pdctl.core.host_devices import FactsError, HostGpus
from pdctl.core.plan.model import (
    WORKER_ROLES,
    GroupPlan,
    Plan,
    ProbePlan,
    RouterPlan,
    Slot,
    WorkerRole,
)
from pdctl.core.plan.ports import Held, check_listeners, wire_ports
from pdctl.core.plan.wiring import check_kv_ip, plan_volumes, wire_slots
from pdctl.core.router_flags import IGW_FLAG, dropped_flags, kept_flags, launch_line
from pdctl.core.router_replicas import RouterReplica, place
from pdctl.core.router_replicas import failover as failover_address
from pdctl.core.spec import (
    Env,
    Gpu,
    Probe,
    ReplicaGroup,
    Resources,
    Spec,
    added_flags,
    image_pin,
)


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
    notes = _spec_notes(spec) + wire_slots(spec, env, groups, gpus)
    plan = _plan(spec, env, fleet, router_hosts, groups, excluded, secrets_digest)
    plan.volumes = model_cache.cache_volume(cache, plan_volumes(spec, fleet, plan.slots(), gpus))
    if cache is not None:
        plan.model_repo, plan.model_revision = cache.repo, cache.revision
        plan.model_cache = cache.cache
    check_kv_ip(spec, placed)
    plan.notes = notes + wire_ports(spec, plan, placed, others)
    check_listeners(plan, others)
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
    """Put each slot on the host with the most free GPUs (its ports come later: wire_ports);
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
            port=0,  # wire_ports gives every slot its ports
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
            mesh=settings.router.mesh,
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
        scaling_mode=settings.scaling.mode,
        max_gpus=settings.scaling.max_gpus,
        gpu_budget=fleet.settings.gpu_budget,
    )
