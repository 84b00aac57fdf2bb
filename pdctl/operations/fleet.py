"""Fleets: register SSH hosts, pin their keys, gather facts, run the preflight.

Service functions for ``pdctl fleet ...``. SSH itself lives in ssh.py, the
inventory files in inventory.py, Ansible in runner.py, and what a good GPU
host looks like in pdctl/onhost/hardware/.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdctl.core import layout, validate
from pdctl.core.errors import CheckFailed, HostError, InputError, NotFound
from pdctl.core.fleet_model import (
    Fleet,
    FleetHost,
    FleetSettings,
    HostKind,
    Preflight,
    host_name,
    natural_key,
)
from pdctl.core.plan import Plan
from pdctl.doors import inventory, runner, ssh
from pdctl.doors import service as services
from pdctl.doors.workspace import Workspace
from pdctl.onhost import bundle
from pdctl.onhost.hardware import facts as host_facts
from pdctl.operations import fabric_run

Progress = Callable[[str], None]
PROBE_TIMEOUT = 60.0
# The pd_preflight role's task that runs pdctl/onhost/hardware/preflight.py (its name there).
PREFLIGHT_PROBE_TASK = "Probe GPUs, RDMA fabric, container runtime, disk and peers"
COLLECT = "pdctl.onhost.hardware.collect"  # what a host runs to say what it has


@dataclass
class Contact:
    """What one SSH contact found: the key, the facts, or why it failed."""

    host: FleetHost
    error: str | None = None
    fingerprint: str | None = None
    facts: dict[str, Any] | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)


def _known_hosts(workspace: Workspace, name: str) -> ssh.KnownHosts:
    return ssh.KnownHosts(inventory.known_hosts_file(workspace, name))


def _facts_command(fleet: Fleet) -> str:
    """Collection on a host: as root when the fleet uses sudo (container runtime info needs it),
    else as the user; the test comes first so that stdin reaches exactly one python3."""
    command = bundle.command(COLLECT)
    if not fleet.settings.become:
        return command
    return f"if sudo -n true 2>/dev/null; then sudo -n {command}; else {command}; fi"


def _facts_input(fleet: Fleet, peers: list[tuple[str, int]]) -> bytes:
    """What collection reads on stdin: the loader and its bundle, then the request."""
    request = {
        "provider_lib": fleet.settings.provider_lib,
        "storage_paths": list(layout.STORAGE_PATHS),
        "peers": peers,
    }
    return bundle.stdin(COLLECT) + json.dumps(request).encode()


def _contact(
    fleet: Fleet, host: FleetHost, known: ssh.KnownHosts, *, gather: bool, pin_new: bool
) -> Contact:
    contact = Contact(host=host)
    target = inventory.target(fleet, host)
    try:
        client = ssh.connect(target, known, pin_new=pin_new, fleet=fleet.name)
    except HostError as exc:
        contact.error = exc.one_line()
        return contact
    try:
        contact.fingerprint = known.fingerprint(target)
        if gather:
            result = ssh.run(
                client, _facts_command(fleet), stdin=_facts_input(fleet, []), timeout=PROBE_TIMEOUT
            )
            try:
                contact.facts = dict(host_facts.facts(json.loads(result.stdout)))
            except (ValueError, TypeError):
                contact.error = (
                    f"{target.label}: could not gather facts (python3 on the host? "
                    f"{(result.stderr.strip().splitlines() or ['no output'])[-1]})"
                )
    finally:
        client.close()
    return contact


def _contact_all(
    fleet: Fleet,
    hosts: list[FleetHost],
    known: ssh.KnownHosts,
    *,
    gather: Callable[[FleetHost], bool],
    pin_new: bool,
    progress: Progress,
) -> dict[str, Contact]:
    progress(f"contacting {len(hosts)} host(s) over SSH")
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        contacts = list(
            pool.map(lambda h: _contact(fleet, h, known, gather=gather(h), pin_new=pin_new), hosts)
        )
    if pin_new:
        known.save()
    return {c.host.name: c for c in contacts}


def _kind_from_facts(facts: dict[str, Any]) -> HostKind:
    gpus = (facts.get("gpus") or {}).get("count") or 0
    devices = (facts.get("rdma") or {}).get("devices") or []
    # An NVIDIA host whose driver is not loaded yet still has nvidia-smi: a GPU host to fix.
    return "gpu" if gpus or facts.get("kfd") or facts.get("nvidia") or devices else "cpu"


def _ssh_check(contact: Contact) -> dict[str, Any]:
    if contact.error:
        return {"name": "ssh", "ok": False, "message": contact.error}
    return {"name": "ssh", "ok": True, "message": f"reachable; host key {contact.fingerprint}"}


def _sudo_check(host: FleetHost, result: runner.TaskResult | None) -> dict[str, Any]:
    if result is None:
        return {"name": "sudo", "ok": False, "message": f"{host.name}: preflight did not run"}
    if result.status == "ok":
        return {"name": "sudo", "ok": True, "message": "passwordless sudo works"}
    return {
        "name": "sudo",
        "ok": False,
        "message": f"{host.name}: sudo as {host.user} needs a password or is not allowed "
        f"({result.message}); allow passwordless sudo, or use --no-become",
    }


def _preflight(
    workspace: Workspace, fleet: Fleet, hosts: list[FleetHost], progress: Progress
) -> dict[str, list[dict[str, Any]]]:
    """Run playbooks/preflight.yml on the hosts; the checks per host."""
    if not hosts:
        return {}
    progress(f"preflight on {len(hosts)} host(s)")
    summary = runner.run_playbook(
        "preflight.yml",
        inventory.fleet_dir(workspace, fleet.name),
        limit=",".join(h.name for h in hosts),
        forks=min(100, max(5, len(hosts))),
        progress=progress,
    )
    sudo_results = {
        r.host: r for r in summary.results if r.task == "Check that sudo works without a password"
    }
    probes = {r.host: r for r in summary.results if r.task == PREFLIGHT_PROBE_TASK}
    unreachable = summary.unreachable()
    found: dict[str, list[dict[str, Any]]] = {}
    for host in hosts:
        if host.name in unreachable:
            message = unreachable_reason(fleet, host.name, unreachable[host.name])
            found[host.name] = [{"name": "ssh", "ok": False, "message": message}]
            continue
        checks = [_sudo_check(host, sudo_results.get(host.name))]
        probe = probes.get(host.name)
        report = _probe_report(probe)
        if report is not None:
            checks += list(report.get("checks") or [])
            host.facts = report.get("facts") or host.facts
        else:
            message = probe.message if probe else "the probe did not run"
            checks.append({"name": "probe", "ok": False, "message": f"{host.name}: {message}"})
        found[host.name] = checks
    return found


def _probe_report(probe: runner.TaskResult | None) -> dict[str, Any] | None:
    """What the preflight's probe printed (pdctl/onhost/hardware/preflight.py), if it ran."""
    if probe is None or probe.status != "ok":
        return None
    try:
        report = json.loads(str(probe.res.get("stdout") or ""))
    except ValueError:
        return None
    return report if isinstance(report, dict) and "checks" in report else None


_ANSIBLE_REFUSED = "Ansible's ssh refused its host key (changed, or not pinned)"


def _refusal(fleet: str, target: ssh.Target, output: str) -> HostError | None:
    """The host key refusal in Ansible's output for TARGET (or its failed jump hop)."""
    names = ssh.refused_key_names(output)
    jump = target.proxy_jump
    if names and jump is not None and jump.known_hosts_name in names:
        return ssh.key_refused(jump, fleet, _ANSIBLE_REFUSED, jump=True)
    if (names and target.known_hosts_name in names) or (names == [] and jump is None):
        return ssh.key_refused(target, fleet, _ANSIBLE_REFUSED)
    # Mitogen names no host; Ansible's ssh under ControlPersist hides the jump hop's stderr.
    if jump is not None and (names == [] or ssh.closed_by_proxy(output)):
        return ssh.key_refused(
            jump,
            fleet,
            f"Ansible's ssh could not get through it to {target.label}: a refused host key "
            "(the jump host's or that host's) or an unreachable host, OpenSSH does not say",
            jump=True,
        )
    return None


def unreachable_reason(fleet: Fleet, name: str, output: str) -> str:
    """Why Ansible could not reach host NAME; a refused host key says whose and the fix."""
    host = fleet.host(name)
    refusal = _refusal(fleet.name, inventory.target(fleet, host), output) if host else None
    return refusal.one_line() if refusal else f"{name}: Ansible could not reach it: {output}"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _check(
    workspace: Workspace,
    fleet: Fleet,
    hosts: list[FleetHost],
    known: ssh.KnownHosts,
    progress: Progress,
    *,
    gather: bool,
    pin_new: bool,
) -> None:
    """SSH contact (facts; keys pinned if ``pin_new``), then preflight on the reachable
    hosts; results stored. A host without a pinned key is not contacted unless pinning."""
    # Facts are gathered on add, and for hosts never reached before (their kind is unknown).
    contacts = _contact_all(
        fleet,
        hosts,
        known,
        progress=progress,
        gather=lambda h: gather or h.kind == "new" or h.facts is None,
        pin_new=pin_new,
    )
    for host in hosts:
        contact = contacts[host.name]
        if contact.facts is not None:
            host.facts = contact.facts
        if host.kind == "new" and host.facts is not None:
            host.kind = _kind_from_facts(host.facts)
    inventory.save(workspace, fleet)  # the preflight reads kinds from the inventory
    reachable = [h for h in hosts if not contacts[h.name].error]
    results = _preflight(workspace, fleet, reachable, progress)
    stamp = _now()
    for host in hosts:
        checks = [_ssh_check(contacts[host.name]), *results.get(host.name, [])]
        host.preflight = Preflight(ok=all(c["ok"] for c in checks), checked_at=stamp, checks=checks)
    inventory.save(workspace, fleet)


def _jump_report(fleet: Fleet, known: ssh.KnownHosts) -> dict[str, Any] | None:
    jump = inventory.jump_target(fleet.settings)
    if jump is None:
        return None
    return {"host": jump.label, "fingerprint": known.fingerprint(jump)}


def report(fleet: Fleet, hosts: Iterable[FleetHost], known: ssh.KnownHosts) -> dict[str, Any]:
    return {
        "fleet": fleet.name,
        "proxy_jump": _jump_report(fleet, known),
        "hosts": [
            {
                "name": h.name,
                "address": h.address,
                "port": h.port,
                "kind": h.kind,
                "ok": bool(h.preflight and h.preflight.ok),
                "checks": h.preflight.checks if h.preflight else [],
            }
            for h in hosts
        ],
    }


def _owner(workspace: Workspace, address: str, port: int, except_fleet: str) -> str | None:
    for name in inventory.list_fleets(workspace):
        if name != except_fleet and inventory.load(workspace, name).by_endpoint(address, port):
            return name
    return None


def _read_hosts_file(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InputError(f"cannot read hosts file {path}: {exc.strerror}") from exc
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


@dataclass
class AddOptions:
    hosts: list[str]
    hosts_file: Path | None = None
    user: str | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None
    become: bool | None = None
    expect_nics: int | None = None
    expect_gpus: int | None = None
    gpu_model: str | None = None
    gpu_vendor: str | None = None
    nic_driver: str | None = None
    link_layer: str | None = None
    wheelhouse: str | None = None
    model_cache: str | None = None
    model_endpoint: str | None = None
    repin: bool = False
    fabric: fabric_run.Options | None = None  # `--fabric`: test the new hosts' links too
    gpu_budget: int | None = None  # `--gpu-budget N` (0: the fleet has none)


def gpu_vendor_of(model: str) -> str:
    """The vendor of a GPU model as dstack spells it: MI300X/MI325X are AMD, the rest NVIDIA."""
    return "amd" if model.upper().startswith("MI") else "nvidia"


def _hardware_updates(options: AddOptions) -> dict[str, Any]:
    """--gpu, --gpu-vendor, --nic-driver, --link-layer as settings (None: unchanged)."""
    updates: dict[str, Any] = {
        "gpu_vendor": options.gpu_vendor,
        "nic_driver": options.nic_driver,
        "link_layer": options.link_layer,
    }
    if options.gpu_model is not None:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,31}", options.gpu_model):
            raise InputError(
                f"--gpu {options.gpu_model!r} is not a GPU model",
                hint="a model as dstack spells it: H200, H100, A100, MI300X",
            )
        updates["gpu_model"] = options.gpu_model
        updates["gpu_vendor"] = options.gpu_vendor or gpu_vendor_of(options.gpu_model)
    if options.nic_driver is not None and not re.fullmatch(
        r"[a-z][a-z0-9_]{0,31}", options.nic_driver
    ):
        raise InputError(
            f"--nic-driver {options.nic_driver!r} is not a driver name",
            hint="the libibverbs provider's name: bnxt_re, mlx5, irdma, ...",
        )
    return updates


def _jump_spec(options: AddOptions) -> str | None:
    """--proxy-jump as stored: USER@HOST[:PORT], its user from --user (else root) like the
    hosts', so that pdctl's SSH, Ansible and Mitogen all reach it as the same user."""
    if options.proxy_jump is None:
        return None
    return ssh.parse_target(options.proxy_jump, default_user=options.user or "root").label


def _settings(current: FleetSettings | None, options: AddOptions) -> FleetSettings:
    settings = current.model_copy() if current else FleetSettings()
    if options.identity_file is not None:
        key = Path(options.identity_file).expanduser()
        if not key.is_file():
            raise InputError(
                f"identity file {key} does not exist", hint="pass the private key's path"
            )
        settings.identity_file = str(key.resolve())
    if options.wheelhouse is not None:
        try:
            validate.host_path(options.wheelhouse)
        except ValueError as exc:
            raise InputError(
                f"--wheelhouse {exc}", hint="the directory's path on the hosts"
            ) from exc
    updates = {
        "proxy_jump": _jump_spec(options),
        "become": options.become,
        "expect_nics": options.expect_nics,
        "expect_gpus": options.expect_gpus,
        "wheelhouse": options.wheelhouse,
        "model_cache": options.model_cache,
        "model_endpoint": options.model_endpoint,
        **_hardware_updates(options),
    }
    for key_name, value in updates.items():
        if value is not None:
            setattr(settings, key_name, value)
    if options.gpu_budget is not None:
        if options.gpu_budget < 0:
            raise InputError(
                f"--gpu-budget {options.gpu_budget}: a number of GPUs",
                hint="the GPUs the fleet's services may hold together (0: no budget)",
            )
        settings.gpu_budget = options.gpu_budget or None
    if options.gpu_vendor == "any" and options.gpu_model is None:
        settings.gpu_model = None  # a mixed fleet: any model, unless --gpu names one
    try:
        settings = FleetSettings.model_validate(settings.model_dump())
    except ValueError as exc:
        raise InputError(f"fleet settings: {exc}") from exc
    if settings.proxy_jump and settings.identity_file:
        try:
            validate.host_path(settings.identity_file)
        except ValueError as exc:
            raise InputError(
                f"identity file {exc}",
                hint="with a jump host the key's path is a word of the inventory's ssh "
                "command for the jump; move or link the key to such a path",
            ) from exc
    return settings


def _targets(workspace: Workspace, name: str, specs: list[str], user: str) -> list[ssh.Target]:
    """The hosts to add, once each; a host another fleet holds is refused."""
    targets: dict[tuple[str, int], ssh.Target] = {}
    for spec in specs:
        target = ssh.parse_target(spec, default_user=user)
        targets.setdefault((target.address, target.port), target)
    for (address, port), target in targets.items():
        owner = _owner(workspace, address, port, name)
        if owner:
            raise InputError(
                f"{target.label} already belongs to fleet {owner!r}",
                hint=f"remove it there first: pdctl fleet remove {owner} --host {address}",
            )
    return list(targets.values())


def _pin_jump(
    fleet: Fleet,
    known: ssh.KnownHosts,
    previous: ssh.Target | None,
    options: AddOptions,
    progress: Progress,
) -> bool:
    """Pin the jump host's key when this add sets the jump host or re-pins it (--repin with
    --proxy-jump); True when it did. A jump host's key is pinned here only, never on the way
    to a host: afterwards every path through it checks the pinned key."""
    jump = inventory.jump_target(fleet.settings)
    if jump is None or options.proxy_jump is None:
        return False
    if not options.repin and previous is not None and previous.label == jump.label:
        return False
    if options.repin:
        known.forget(jump)
    progress(f"pinning the host key of jump host {jump.label}")
    ssh.connect(jump, known, pin_new=True, jump=True, fleet=fleet.name).close()
    return True


def _touch(
    fleet: Fleet, targets: list[ssh.Target], known: ssh.KnownHosts, repin: bool
) -> list[FleetHost]:
    """The hosts this add contacts: new ones, and with --repin the given ones (keys forgotten)."""
    touched: list[FleetHost] = []
    for target in targets:
        host = fleet.by_endpoint(target.address, target.port)
        if host is None:
            host = FleetHost(
                name=host_name(target.address, target.port),
                address=target.address,
                port=target.port,
                user=target.user,
            )
            fleet.hosts.append(host)
            touched.append(host)
        elif repin:
            known.forget(target)
            touched.append(host)
    fleet.hosts.sort(key=lambda h: natural_key(h.name))
    return touched


def add(workspace: Workspace, name: str, options: AddOptions, progress: Progress) -> dict[str, Any]:
    inventory.validate_name(name)
    specs = list(options.hosts) + (
        _read_hosts_file(options.hosts_file) if options.hosts_file else []
    )
    fleet = (
        inventory.load(workspace, name) if inventory.exists(workspace, name) else Fleet(name=name)
    )
    if not specs and not (fleet.hosts and (options.proxy_jump or options.gpu_budget is not None)):
        raise InputError(
            "no hosts given",
            hint="pass --host [USER@]ADDR[:PORT] (repeatable) or --hosts-file; "
            "--proxy-jump J --repin alone re-pins a fleet's jump host, --gpu-budget N alone "
            "sets its GPU budget",
        )
    previous_jump = inventory.jump_target(fleet.settings) if fleet.hosts else None
    previous_settings = fleet.settings.model_copy()
    fleet.settings = _settings(fleet.settings if fleet.hosts else None, options)
    settings_changed = bool(fleet.hosts) and fleet.settings != previous_settings
    targets = _targets(workspace, name, specs, options.user or "root")
    known = _known_hosts(workspace, name)
    jump_pinned = _pin_jump(fleet, known, previous_jump, options, progress)
    touched = _touch(fleet, targets, known, options.repin)
    if not touched:
        if jump_pinned or settings_changed:
            known.save()
            inventory.save(workspace, fleet)
        else:
            progress("every host is already in the fleet: nothing to do")
        changed = jump_pinned or settings_changed
        return {**report(fleet, _in_order(fleet, targets), known), "changed": changed}
    _check(workspace, fleet, touched, known, progress, gather=True, pin_new=True)
    doc = {**report(fleet, _in_order(fleet, targets), known), "changed": True}
    if options.fabric is not None:
        doc["fabric"] = fabric_run.check_fleet(workspace, fleet, touched, options.fabric, progress)
    return doc


def _in_order(fleet: Fleet, targets: list[ssh.Target]) -> list[FleetHost]:
    return [h for t in targets if (h := fleet.by_endpoint(t.address, t.port)) is not None]


def check(
    workspace: Workspace,
    name: str,
    limit: list[str] | None,
    progress: Progress,
    fabric: fabric_run.Options | None = None,
    *,
    preflight: bool = True,
) -> dict[str, Any]:
    """The preflight on the hosts; with ``fabric``, then the fabric check between the GPU
    hosts (with ``limit``: the pairs with one of those hosts in them). ``preflight=False``
    (`--fabric-only`): the fabric check alone, on the facts on record."""
    if fabric is not None:
        fabric.check()  # a bad option is refused before any host is contacted
    fleet = inventory.load(workspace, name)
    hosts = _select(fleet, limit)
    known = _known_hosts(workspace, name)
    if preflight or fabric is None:
        _check(workspace, fleet, hosts, known, progress, gather=False, pin_new=False)
        doc = report(fleet, hosts, known)
    else:
        doc = {**report(fleet, [], known), "preflight": "skipped"}
    if fabric is not None:
        doc["fabric"] = fabric_run.check_fleet(
            workspace, fleet, hosts if limit else None, fabric, progress
        )
    return doc


def _select(fleet: Fleet, limit: list[str] | None) -> list[FleetHost]:
    if not limit:
        return list(fleet.hosts)
    chosen = []
    for wanted in limit:
        host = fleet.host(wanted) or next((h for h in fleet.hosts if h.address == wanted), None)
        if host is None:
            raise NotFound(
                f"no host {wanted!r} in fleet {fleet.name}",
                hint=f"hosts: {', '.join(h.name for h in fleet.hosts)}",
            )
        chosen.append(host)
    return chosen


def failure(doc: dict[str, Any]) -> CheckFailed | None:
    """The error to exit with (after the report is printed) when any host failed."""
    failed = [h["name"] for h in doc["hosts"] if not h["ok"]]
    fabric = doc.get("fabric")
    problems = []
    if failed:
        problems.append(
            f"{len(failed)} of {len(doc['hosts'])} host(s) failed preflight: {', '.join(failed)}"
        )
    if fabric is not None and not fabric["ok"]:
        problems.append(f"fabric: {fabric['summary']}")
    if not problems:
        return None
    return CheckFailed(
        "; ".join(problems),
        hint=f"see the findings above; fix, then `pdctl fleet check {doc['fleet']}"
        + (" --fabric`" if fabric is not None else "`"),
    )


def _uses(plan: Plan) -> dict[str, list[str]]:
    """Host -> what the plan has there: its router, its slots (spares too: the scaler starts
    them on that host whenever it scales out)."""
    found: dict[str, list[str]] = {host: ["router"] for host in plan.router.hosts}
    for slot in plan.slots():
        found.setdefault(slot.host, []).append(slot.name if slot.start else f"{slot.name} (spare)")
    return found


def placements(workspace: Workspace, fleet: str) -> dict[str, list[str]]:
    """Service -> the fleet hosts it uses (router or slots; from each service's stored plan)."""
    found: dict[str, set[str]] = {}
    for service, plan in services.every_plan(workspace):
        if isinstance(plan, Plan) and plan.fleet == fleet:
            found.setdefault(service, set()).update(_uses(plan))
    return {service: sorted(hosts) for service, hosts in found.items()}


def _refuse_in_use(workspace: Workspace, fleet: str, hosts: set[str]) -> None:
    """CheckFailed naming each service with its router or a slot on one of these hosts (and
    each service whose plan cannot be read: it may have)."""
    found = []
    for service, plan in services.every_plan(workspace):
        if not isinstance(plan, Plan):
            found.append(f"cannot tell what service {service} uses: {plan}")
        elif plan.fleet == fleet:
            found += [
                f"service {service} has {', '.join(what)} on {host}"
                for host, what in _uses(plan).items()
                if host in hosts
            ]
    if found:
        raise CheckFailed(
            f"fleet {fleet}: hosts still in use ({'; '.join(found)})",
            hint="`pdctl destroy SERVICE` first, or pass --force to forget the hosts and their "
            "keys anyway",
        )


def list_all(workspace: Workspace) -> dict[str, Any]:
    fleets = []
    for name in inventory.list_fleets(workspace):
        fleet = inventory.load(workspace, name)
        fleets.append(
            {
                "name": name,
                "hosts": len(fleet.hosts),
                "gpu_hosts": sum(h.kind == "gpu" for h in fleet.hosts),
                "cpu_hosts": sum(h.kind == "cpu" for h in fleet.hosts),
                "failed": sum(not (h.preflight and h.preflight.ok) for h in fleet.hosts),
                "services": sorted(placements(workspace, name)),
            }
        )
    return {"fleets": fleets}


def show(workspace: Workspace, name: str) -> dict[str, Any]:
    fleet = inventory.load(workspace, name)
    services = placements(workspace, name)
    return {
        "fleet": name,
        "inventory": str(inventory.fleet_dir(workspace, name)),
        "settings": fleet.settings.model_dump(),
        "hosts": [
            {
                "name": h.name,
                "address": h.address,
                "port": h.port,
                "user": h.user,
                "kind": h.kind,
                "facts": h.facts,
                "preflight": h.preflight.model_dump() if h.preflight else None,
                "fabric": h.fabric.model_dump() if h.fabric else None,
                "services": sorted(s for s, hosts in services.items() if h.name in hosts),
            }
            for h in fleet.hosts
        ],
        "services": services,
    }


def remove(workspace: Workspace, name: str, hosts: list[str], force: bool) -> dict[str, Any]:
    fleet = inventory.load(workspace, name)
    chosen = _select(fleet, hosts) if hosts else list(fleet.hosts)
    if not force:
        _refuse_in_use(workspace, name, {h.name for h in chosen})
    removed = [h.name for h in chosen]
    if not hosts or len(chosen) == len(fleet.hosts):
        shutil.rmtree(inventory.fleet_dir(workspace, name))
        return {"fleet": name, "removed_hosts": removed, "fleet_removed": True}
    known = _known_hosts(workspace, name)
    jump = inventory.jump_target(fleet.settings)
    for host in chosen:
        target = inventory.target(fleet, host)
        # A host that is also the fleet's jump host keeps its pin: the others go through it.
        if jump is None or target.known_hosts_name != jump.known_hosts_name:
            known.forget(target)
    fleet.hosts = [h for h in fleet.hosts if h.name not in removed]
    known.save()
    inventory.save(workspace, fleet)
    return {"fleet": name, "removed_hosts": removed, "fleet_removed": False}
