"""The lab's service functions: up, status, fault, down (the CLI calls only these)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdctl.core.errors import InputError, NotFound, PdctlError
from pdctl.core.fleet_model import FleetSettings
from pdctl.doors.workspace import Workspace
from pdctl.lab import (
    faults,
    hub_service,
    image,
    inotify,
    network,
    registry,
    rootfs,
    state,
    wheelhouse,
)
from pdctl.lab import host as lab_host
from pdctl.lab.host import SHARE_MOUNT, HostPaths, Shared
from pdctl.lab.runtime import crun_clamp
from pdctl.lab.state import DEFAULT_GPU, LAB_GPUS, Fault, HostKind, LabHost, LabState, LinkLayer
from pdctl.lab.system import remove_tree, require_programs, require_root, run

Progress = Callable[[str], None]
# Hosts take .11 up; .200-.254 stay free for failover addresses (a service's router address).
FIRST_HOST = 11
FAILOVER_FIRST, FAILOVER_LAST = 200, 254
MAX_HOSTS = FAILOVER_FIRST - FIRST_HOST
BOOT_TIMEOUT = 180.0
FAKES_SOURCE = Path(__file__).parent / "fakes"
RUNTIME_SOURCE = Path(crun_clamp.__file__).parent
# Lab hosts have no internet: SMG and the scaler install from here (wheelhouse.py).
WHEELHOUSE = f"{SHARE_MOUNT}/wheelhouse"


class Lab:
    """The lab of one workspace: its files under ``.pdctl/lab``."""

    def __init__(self, workspace: Workspace) -> None:
        self.dir = workspace.lab
        self.state_file = self.dir / "lab.json"
        self.key = self.dir / "id_ed25519"

    def load(self) -> LabState | None:
        return state.load(self.state_file)

    def save(self, lab: LabState) -> None:
        state.save(self.state_file, lab)

    def paths(self, host: LabHost) -> HostPaths:
        return HostPaths(self.dir / "hosts" / host.name)

    def ensure_key(self) -> str:
        if not self.key.exists():
            self.dir.mkdir(parents=True, exist_ok=True)
            run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    "pdctl-lab",
                    "-f",
                    str(self.key),
                ]
            )
        return self.key.with_suffix(".pub").read_text()


def _desired(
    hosts: int, cpu_hosts: int, subnet: str, gpus: Sequence[str], link_layer: LinkLayer
) -> list[LabHost]:
    """GPU hosts take the models in turn (--gpu MI300X --gpu H200: node2 MI300X, node3 H200,
    ...); only ConnectX hosts can be InfiniBand, Broadcom ones stay RoCE."""
    kinds: list[HostKind] = ["cpu" if i < cpu_hosts else "gpu" for i in range(hosts)]
    found = []
    for i, kind in enumerate(kinds):
        gpu = gpus[max(0, i - cpu_hosts) % len(gpus)] if kind == "gpu" else DEFAULT_GPU
        layer: LinkLayer = link_layer if LAB_GPUS[gpu].nic_driver == "mlx5" else "eth"
        found.append(
            LabHost(
                name=f"node{i + 1}",
                index=i + 1,
                kind=kind,
                address=f"{subnet}.{FIRST_HOST + i}",
                gpu=gpu,
                link_layer=layer,
            )
        )
    return found


def up(
    workspace: Workspace,
    hosts: int,
    cpu_hosts: int,
    progress: Progress,
    gpus: Sequence[str] = (DEFAULT_GPU,),
    link_layer: LinkLayer = "eth",
    hub_rate: str | None = None,
    link_rate: str | None = None,
    hub_model_size: str | None = None,
) -> dict[str, Any]:
    """Boot (or converge to) the hosts and the hub. ``hub_rate``/``link_rate``: bytes/s
    (``10M``; ``none``: no cap); ``hub_model_size``: the size of the models the hub makes
    on request (``64M``; ``none``: none); None keeps the lab's current setting."""
    gpus = list(gpus) or [DEFAULT_GPU]
    rates = {"hub_rate": hub_service.parse_rate(hub_rate) if hub_rate is not None else None}
    rates["link_rate"] = hub_service.parse_rate(link_rate) if link_rate is not None else None
    model_size = (
        hub_service.parse_model_size(hub_model_size) if hub_model_size is not None else None
    )
    for gpu in gpus:
        if gpu not in LAB_GPUS:
            raise InputError(
                f"--gpu {gpu!r} is not a GPU the lab emulates", hint=", ".join(LAB_GPUS)
            )
    if link_layer == "ib" and all(LAB_GPUS[g].nic_driver != "mlx5" for g in gpus):
        raise InputError(
            f"--link-layer ib: the lab's {', '.join(gpus)} hosts have Broadcom RoCE NICs "
            "(Ethernet only)",
            hint="InfiniBand comes with the NVIDIA hosts' ConnectX NICs: --gpu H200 or H100",
        )
    if not 1 <= hosts <= MAX_HOSTS:
        raise InputError(f"--hosts must be between 1 and {MAX_HOSTS} (got {hosts})")
    if not 0 <= cpu_hosts <= hosts:
        raise InputError(f"--cpu-hosts must be between 0 and --hosts ({hosts}); got {cpu_hosts}")
    require_root("pdctl lab up")
    require_programs()
    lab = Lab(workspace)
    shared = _shared(lab, progress)
    with registry.locked():
        current = _claim(lab, str(shared.rootfs))
        desired = _desired(hosts, cpu_hosts, current.subnet, gpus, link_layer)
        network.ensure_bridge(current)
        inotify.ensure(_hosts_running(except_lab=lab.dir) + hosts)
        booting = _converge_hosts(lab, current, desired, shared, progress)
        if hub_rate is not None:
            current.hub_rate = rates["hub_rate"]
        if link_rate is not None:
            current.link_rate = rates["link_rate"]
        if hub_model_size is not None:
            current.hub_model_size = model_size
        progress(f"starting the model hub at {hub_service.endpoint(current)}")
        hub_service.ensure(current, lab.dir)
        for host in current.hosts:
            faults.cap_link(current, host)
        lab.save(current)
    deadline = time.monotonic() + BOOT_TIMEOUT
    for host in booting:
        progress(f"waiting for {host.name} to boot")
        lab_host.wait_ssh(host, lab.paths(host), deadline)
    _load_worker_images(current, progress)
    return status(workspace)


def _shared(lab: Lab, progress: Progress) -> Shared:
    """What every host mounts read-only (built once per machine, then found in the cache)."""
    public_key = lab.ensure_key()
    base = rootfs.ensure_rootfs(progress)
    wheels = wheelhouse.ensure_wheelhouse(progress)
    return Shared(
        rootfs=base,
        fakes=FAKES_SOURCE,
        runtime=RUNTIME_SOURCE,
        images=image.ensure_images(base, wheels),
        wheelhouse=wheels,
        public_key=public_key,
    )


def _labs() -> Iterator[tuple[int, Path | None, LabState | None]]:
    """Every lab id claimed on this machine: its owner's lab directory and recorded state."""
    for lab_id in registry.claimed_ids():
        owner = registry.owner(lab_id)
        yield lab_id, owner, state.load(owner / "lab.json") if owner else None


def _hosts_running(except_lab: Path) -> int:
    """Lab hosts whose nspawn runs, in every workspace's lab but ``except_lab``."""
    return sum(
        lab_host.has_process(host)
        for _, owner, other in _labs()
        if other is not None and owner != except_lab
        for host in other.hosts
    )


def _claim(lab: Lab, base: str) -> LabState:
    """This workspace's lab state, with a lab id held; stale labs swept first."""
    for lab_id, owner, other in _labs():
        if other is None or not _in_use(other):
            _sweep(owner or Path("/nonexistent"), other, lab_id)
            registry.release(lab_id)
    mine = lab.load()
    if mine is not None and registry.owner(mine.lab_id) not in {None, lab.dir}:
        mine = None  # our old id went to another workspace: start afresh
    if mine is None:
        mine = LabState(lab_id=registry.free_id(set(), lab.dir))
    registry.claim(mine.lab_id, lab.dir)
    mine.rootfs = base
    lab.save(mine)
    return mine


def _in_use(lab: LabState) -> bool:
    """A host of it runs, or one is powered off while the lab's bridge is still there (a
    lab whose every host is off still belongs to its workspace; after a reboot of this
    machine the bridge is gone and the lab is stale)."""
    if any(lab_host.has_process(h) for h in lab.hosts):
        return True
    return any(h.power == "off" for h in lab.hosts) and network.link_exists(lab.bridge)


def _sweep(lab_dir: Path, lab: LabState | None, lab_id: int) -> None:
    """Remove what a lab made, from its records and by its naming pattern."""
    known = lab or LabState(lab_id=lab_id)
    for host in known.hosts:
        lab_host.stop(known, host, HostPaths(lab_dir / "hosts" / host.name))
    hosts_dir = lab_dir / "hosts"
    if hosts_dir.is_dir():
        for leftover in hosts_dir.iterdir():
            root = leftover / "root"
            if root.is_mount():
                run(["umount", "-l", str(root)], check=False)
            shutil.rmtree(leftover, ignore_errors=True)
    hub_service.stop(known)
    for veth in network.stray_links(lab_id):
        run(["ip", "link", "del", veth], check=False)
    for ns in network.stray_netns(lab_id):
        run(["ip", "netns", "del", ns], check=False)
    network.delete_bridge(known)
    lab_host.remove_cgroup(known.cgroup())
    if lab is not None:
        lab.hosts = []
        with contextlib.suppress(OSError):
            state.save(lab_dir / "lab.json", lab)


def _converge_hosts(
    lab: Lab, current: LabState, desired: list[LabHost], shared: Shared, progress: Progress
) -> list[LabHost]:
    wanted = {(h.name, h.kind, h.gpu, h.link_layer) for h in desired}
    for host in list(current.hosts):
        kept = host.power == "off" or lab_host.is_running(host)  # an "off" host stays off
        if (host.name, host.kind, host.gpu, host.link_layer) not in wanted or not kept:
            progress(f"removing {host.name}")
            lab_host.stop(current, host, lab.paths(host))
            current.hosts.remove(host)
            lab.save(current)
    have = {h.name for h in current.hosts}
    booting = [h for h in desired if h.name not in have]
    current.hosts = sorted([*current.hosts, *booting], key=lambda h: h.index)
    lab.save(current)  # recorded before anything is made, so a crash leaves a trail to clean
    for host in booting:
        progress(f"starting {host.name} ({host.kind}, {host.address})")
        lab_host.prepare(current, host, lab.paths(host), shared)
        lab_host.boot(current, host, lab.paths(host), shared)
        lab.save(current)
    return booting


def _load_worker_images(lab: LabState, progress: Progress) -> None:
    def load(host: LabHost) -> None:
        for spec in image.IMAGES:
            exists = lab_host.exec_in(host, ["podman", "image", "exists", spec.name], check=False)
            if exists.returncode != 0:
                archive = f"{SHARE_MOUNT}/images/{spec.archive_name}"
                lab_host.exec_in(
                    host, ["podman", "load", "--quiet", "--input", archive], timeout=300
                )

    gpu_hosts = [h for h in lab.hosts if h.kind == "gpu" and h.power == "on"]
    if gpu_hosts:
        progress(f"loading the worker images into {len(gpu_hosts)} host(s)")
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(load, gpu_hosts))


def status(workspace: Workspace) -> dict[str, Any]:
    lab = Lab(workspace)
    current = lab.load()
    hosts = current.hosts if current else []
    emulated = {h.name: crun_clamp.emulated(lab.paths(h).rlimit_log) for h in hosts}
    doc_hosts = [
        {
            "name": h.name,
            "address": h.address,
            "port": 22,
            "user": rootfs.SUDO_USER,
            "identity_file": str(lab.key),
            "gpus": h.gpus,
            "gpu_vendor": h.model.vendor if h.model else None,
            "gpu_model": h.gpu if h.model else None,
            "nic_driver": h.model.nic_driver if h.model else None,
            "link_layer": h.link_layer if h.model else None,
            "kind": h.kind,
            "state": _state(h),
            "power": h.power,
            "faults": [f.label() for f in h.faults],
            "emulated": emulated[h.name],
        }
        for h in hosts
    ]
    return {
        "hosts": doc_hosts,
        "worker_image": image.WORKER_IMAGE,
        "worker_images": {spec.engine: spec.name for spec in image.IMAGES},
        "wheelhouse": WHEELHOUSE,
        "fleet_add": fleet_add_line(lab, hosts, current) if current and hosts else None,
        "hub": hub_service.status(current, lab.dir),
        # Each host's link, both ways, in bytes/s (None: the veth's own speed).
        "link_rate": current.link_rate if current else None,
        # Addresses no lab host takes: a service's router failover address goes here.
        "free_addresses": (
            f"{current.subnet}.{FAILOVER_FIRST}-{current.subnet}.{FAILOVER_LAST}"
            if current
            else None
        ),
        # What the hosts' runtimes granted in place of what units asked (crun_clamp.py).
        "emulated": sorted({line for lines in emulated.values() for line in lines}),
    }


def _state(host: LabHost) -> str:
    """running; off (powered off by `lab fault HOST power-off`); stopped (it died)."""
    if host.power == "off":
        return "off"
    return "running" if lab_host.is_running(host) else "stopped"


def fleet_add_line(lab: Lab, hosts: list[LabHost], current: LabState) -> str:
    """Registers the hosts, with the lab's settings as fleet settings (the wheelhouse, the
    model hub)."""
    host_args = " ".join(f"--host {rootfs.SUDO_USER}@{h.address}" for h in hosts)
    kinds = {(h.gpu, h.link_layer) for h in hosts if h.model is not None}
    hardware = ""
    if len(kinds) > 1:  # a mixed lab: each host is checked by what it has
        hardware = " --gpu-vendor any --nic-driver auto --link-layer auto"
    elif kinds and next(iter(kinds))[0] != DEFAULT_GPU:
        gpu, layer = next(iter(kinds))
        hardware = f" --gpu {gpu} --nic-driver {LAB_GPUS[gpu].nic_driver} --link-layer {layer}"
    # Until pdctl's fleet has a model endpoint setting (issue 16's cache), the line leaves it.
    model = ""
    if "model_endpoint" in FleetSettings.model_fields:
        model = f" --model-endpoint {hub_service.endpoint(current)}"
    return (
        f"pdctl fleet add lab --identity-file {lab.key} --wheelhouse {WHEELHOUSE}{hardware}"
        f"{model} {host_args}"
    )


def known_host(workspace: Workspace, name: str) -> tuple[Lab, LabState, LabHost]:
    lab = Lab(workspace)
    current = lab.load()
    host = current.host(name) if current else None
    if current is None or host is None:
        known = ", ".join(h.name for h in current.hosts) if current else "none (no lab here)"
        raise NotFound(f"no lab host named {name!r}", hint=f"lab hosts: {known}")
    return lab, current, host


def running_host(workspace: Workspace, name: str) -> tuple[Lab, LabState, LabHost]:
    lab, current, host = known_host(workspace, name)
    if host.power == "off":
        raise PdctlError(f"lab host {name} is powered off", hint=f"pdctl lab fault {name} power-on")
    if not lab_host.is_running(host):
        raise PdctlError(f"lab host {name} is not running", hint="run `pdctl lab up` again")
    return lab, current, host


def power(workspace: Workspace, name: str, on: bool, progress: Progress) -> dict[str, Any]:
    """Power a host off at once (no packet in or out, every process gone, its disk kept) or
    boot it again; idempotent. For any host: a GPU host's replicas or a router host."""
    require_root("pdctl lab fault")
    lab, current, host = known_host(workspace, name)
    if on and host.power == "on" and not lab_host.is_running(host):
        raise PdctlError(f"lab host {name} is not running", hint="run `pdctl lab up` again")
    if on and host.power == "off":
        shared = _shared(lab, progress)
        with registry.locked():
            progress(f"booting {name}")
            lab_host.power_on(current, host, lab.paths(host), shared)
            host.power = "on"
            lab.save(current)
            hub_service.limit_link(current, host, current.link_rate)
        lab_host.wait_ssh(host, lab.paths(host), time.monotonic() + BOOT_TIMEOUT)
    elif not on and host.power == "on":
        with registry.locked():
            lab_host.power_off(current, host, lab.paths(host))
            host.power = "off"
            lab.save(current)
    return {"host": name, "power": host.power, "faults": [f.label() for f in host.faults]}


def fault(
    workspace: Workspace,
    name: str,
    kind: str,
    arg: str | None,
    progress: Progress = lambda _line: None,
) -> dict[str, Any]:
    require_root("pdctl lab fault")
    if kind in faults.POWER:
        faults.validate(known_host(workspace, name)[2], kind, arg)
        return power(workspace, name, kind == "power-on", progress)
    lab, current, host = running_host(workspace, name)
    chosen = faults.validate(host, kind, arg)
    faults.apply(host, lab.paths(host), chosen)
    if chosen.kind == "clear":
        host.faults = []
    elif chosen.kind == "link-slow":  # the latest rate replaces an earlier one
        host.faults = [f for f in host.faults if f.kind != "link-slow"] + [chosen]
    elif chosen not in host.faults:
        host.faults.append(Fault(kind=chosen.kind, arg=chosen.arg))
    if chosen.kind in ("link-slow", "clear"):
        faults.cap_link(current, host)
    lab.save(current)
    return {"host": host.name, "power": host.power, "faults": [f.label() for f in host.faults]}


def down(workspace: Workspace, progress: Progress) -> dict[str, Any]:
    require_root("pdctl lab down")
    lab = Lab(workspace)
    with registry.locked():
        current = lab.load()
        if current is None:
            return {"removed_hosts": [], "lab": None}
        if registry.owner(current.lab_id) not in {None, lab.dir}:
            # This lab was swept as stale and its id went to another workspace: the hosts,
            # namespaces and bridge named after that id are the other lab's now.
            remove_tree(lab.dir)
            return {"removed_hosts": [], "lab": None}
        names = [h.name for h in current.hosts]
        progress(f"removing {len(names)} host(s)")
        _sweep(lab.dir, current, current.lab_id)
        if registry.owner(current.lab_id) == lab.dir:
            registry.release(current.lab_id)
        remove_tree(lab.dir)
        inotify.restore_when_idle(_hosts_running(except_lab=lab.dir))
    return {"removed_hosts": names, "lab": current.lab_id}


def ssh_argv(workspace: Workspace, name: str, user: str, command: tuple[str, ...]) -> list[str]:
    lab, _, host = running_host(workspace, name)
    # Lab hosts get fresh host keys on every `lab up`: pinning them here would
    # only break. Real fleets pin keys (pdctl fleet add); this is lab-only.
    return [
        "ssh",
        "-i",
        str(lab.key),
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        f"{user}@{host.address}",
        *command,
    ]


def hub_add(workspace: Workspace, repo: str, size: str) -> dict[str, Any]:
    """Add a generated model to the lab's hub (served at once, even before `lab up`)."""
    model = hub_service.add_model(Lab(workspace).dir, repo, size)
    return {
        "repo": model.repo_id,
        "revision": model.sha,
        "bytes": model.size,
        "files": {f.path: {"size": f.size, "sha256": f.sha256} for f in model.files},
    }


def _running_lab(workspace: Workspace, what: str) -> tuple[Lab, LabState]:
    require_root(what)
    lab = Lab(workspace)
    current = lab.load()
    if current is None or not current.hosts:
        raise NotFound("no lab in this workspace", hint="run `pdctl lab up` first")
    return lab, current


def hub_limit(workspace: Workspace, rate: str) -> dict[str, Any]:
    """Cap the hub's serving rate (all downloads together); the running hub follows."""
    lab, current = _running_lab(workspace, "pdctl lab hub limit")
    hub_service.set_rate(current, lab.dir, hub_service.parse_rate(rate))
    lab.save(current)
    return {"hub_rate": current.hub_rate}


def hub_token(workspace: Workspace, token: str | None) -> dict[str, Any]:
    """Make the hub require ``Authorization: Bearer TOKEN`` (None: no token)."""
    lab, current = _running_lab(workspace, "pdctl lab hub token")
    hub_service.set_token(current, lab.dir, token)
    return {"token": token is not None}


def link_limit(workspace: Workspace, rate: str) -> dict[str, Any]:
    """Cap every host's link, both ways."""
    lab, current = _running_lab(workspace, "pdctl lab link-rate")
    current.link_rate = hub_service.parse_rate(rate)
    for host in current.hosts:
        faults.cap_link(current, host)
    lab.save(current)
    return {"link_rate": current.link_rate}
