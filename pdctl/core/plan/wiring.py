"""What each placed slot is wired to on its host: its nearest RDMA NICs (from the PCI topology,
pdctl/core/nic_affinity.py) for the transfer backend, the libibverbs provider library mounted
into the container, the service's volumes; and the KV transfer's addresses checked.
"""

from __future__ import annotations

import ipaddress
import re

from pdctl.core import nic_affinity, validate
from pdctl.core.errors import CheckFailed, InputError
from pdctl.core.fleet_model import Fleet, natural_key
from pdctl.core.host_devices import HostGpus
from pdctl.core.plan.model import (
    CONTAINER_PROVIDER_DIR,
    CONTAINER_PROVIDER_LIB,
    UCX_BACKENDS,
    WORKER_ROLES,
    GroupPlan,
    Slot,
)
from pdctl.core.spec import (
    Env,
    ReplicaGroup,
    Spec,
)


def check_kv_ip(spec: Spec, placed: list[Slot]) -> None:
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


def _transfer_backend(group: ReplicaGroup) -> str | None:
    """SGLang's --disaggregation-transfer-backend, or vLLM's KV connector."""
    launch = group.launch
    if launch is not None and launch.engine == "vllm":
        return launch.kv_connector
    match = re.search(r"--disaggregation-transfer-backend[=\s]+([\w-]+)", " ".join(group.commands))
    return match[1] if match else None


def wire_slots(
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
            names = nic_affinity.nearest_nics(host.devices, nics, slot.gpus)
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


def plan_volumes(
    spec: Spec, fleet: Fleet, slots: list[Slot], gpus: dict[str, HostGpus]
) -> list[str]:
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
