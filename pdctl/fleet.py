"""Fleets: register SSH hosts, pin their keys, gather facts, run the preflight.

Service functions for ``pdctl fleet ...``. SSH itself lives in ssh.py, the
inventory files in inventory.py, Ansible in runner.py, and what a good GPU
host looks like in hardware.py.
"""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdctl import hardware, inventory, runner, ssh, validate
from pdctl.errors import CheckFailed, HostError, InputError, NotFound
from pdctl.inventory import Fleet, FleetHost, FleetSettings, Preflight
from pdctl.workspace import Workspace

Progress = Callable[[str], None]
PROBE_TIMEOUT = 60.0
_HARDWARE_SOURCE = Path(hardware.__file__).read_text()


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


def _facts_command(fleet: Fleet, peers: list[tuple[str, int]]) -> str:
    payload = json.dumps(
        {
            "provider_lib": fleet.settings.provider_lib,
            "storage_paths": ["/var/lib/containers", "/var/lib/docker", "/var/lib"],
            "peers": peers,
        }
    )
    command = f"PD_HARDWARE_INPUT={shlex.quote(payload)} python3 -"
    # Run as root when the fleet uses sudo (container runtime info needs it), else as the user;
    # the test comes first so that the source on stdin reaches exactly one python3.
    if not fleet.settings.become:
        return f"env {command}"
    return f"if sudo -n true 2>/dev/null; then sudo -n env {command}; else env {command}; fi"


def _contact(fleet: Fleet, host: FleetHost, known: ssh.KnownHosts, *, gather: bool) -> Contact:
    contact = Contact(host=host)
    target = inventory.target(fleet, host)
    try:
        client = ssh.connect(target, known, pin_new=True, fleet=fleet.name)
    except HostError as exc:
        contact.error = exc.one_line()
        return contact
    try:
        keys = known.lookup(target)
        contact.fingerprint = ssh.fingerprint(next(iter(keys.values()))) if keys else None
        if gather:
            result = ssh.run(
                client, _facts_command(fleet, []), stdin=_HARDWARE_SOURCE, timeout=PROBE_TIMEOUT
            )
            try:
                contact.facts = hardware.facts(json.loads(result.stdout))
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
    progress: Progress,
) -> dict[str, Contact]:
    progress(f"contacting {len(hosts)} host(s) over SSH")
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        contacts = list(pool.map(lambda h: _contact(fleet, h, known, gather=gather(h)), hosts))
    known.save()
    return {c.host.name: c for c in contacts}


def _kind_from_facts(facts: dict[str, Any]) -> inventory.HostKind:
    gpus = (facts.get("gpus") or {}).get("count") or 0
    devices = (facts.get("rdma") or {}).get("devices") or []
    return "gpu" if gpus or facts.get("kfd") or devices else "cpu"


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
    probes = {r.host: r for r in summary.results if r.action.endswith("pd_preflight_probe")}
    unreachable = summary.unreachable()
    found: dict[str, list[dict[str, Any]]] = {}
    for host in hosts:
        if host.name in unreachable:
            found[host.name] = [
                {
                    "name": "ssh",
                    "ok": False,
                    "message": f"{host.name}: Ansible could not reach it: {unreachable[host.name]}",
                }
            ]
            continue
        checks = [_sudo_check(host, sudo_results.get(host.name))]
        probe = probes.get(host.name)
        if probe is not None and probe.status == "ok":
            checks += list(probe.res.get("checks") or [])
            host.facts = probe.res.get("facts") or host.facts
        else:
            message = probe.message if probe else "the probe did not run"
            checks.append({"name": "probe", "ok": False, "message": f"{host.name}: {message}"})
        found[host.name] = checks
    return found


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
) -> None:
    """SSH contact (pin keys, facts), then preflight on the reachable hosts; results stored."""
    # Facts are gathered on add, and for hosts never reached before (their kind is unknown).
    contacts = _contact_all(
        fleet,
        hosts,
        known,
        progress=progress,
        gather=lambda h: gather or h.kind == "new" or h.facts is None,
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


def report(fleet: Fleet, hosts: Iterable[FleetHost]) -> dict[str, Any]:
    return {
        "fleet": fleet.name,
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
    wheelhouse: str | None = None
    repin: bool = False


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
        "proxy_jump": options.proxy_jump,
        "become": options.become,
        "expect_nics": options.expect_nics,
        "expect_gpus": options.expect_gpus,
        "wheelhouse": options.wheelhouse,
    }
    for key_name, value in updates.items():
        if value is not None:
            setattr(settings, key_name, value)
    return settings


def add(workspace: Workspace, name: str, options: AddOptions, progress: Progress) -> dict[str, Any]:
    inventory.validate_name(name)
    specs = list(options.hosts) + (
        _read_hosts_file(options.hosts_file) if options.hosts_file else []
    )
    if not specs:
        raise InputError(
            "no hosts given", hint="pass --host [USER@]ADDR[:PORT] (repeatable) or --hosts-file"
        )
    fleet = (
        inventory.load(workspace, name) if inventory.exists(workspace, name) else Fleet(name=name)
    )
    fleet.settings = _settings(fleet.settings if fleet.hosts else None, options)
    default_user = options.user or "root"
    targets: dict[tuple[str, int], ssh.Target] = {}
    for spec in specs:
        target = ssh.parse_target(spec, default_user=default_user)
        targets.setdefault((target.address, target.port), target)
    for (address, port), target in targets.items():
        owner = _owner(workspace, address, port, name)
        if owner:
            raise InputError(
                f"{target.label} already belongs to fleet {owner!r}",
                hint=f"remove it there first: pdctl fleet remove {owner} --host {address}",
            )
    known = _known_hosts(workspace, name)
    touched: list[FleetHost] = []
    for (address, port), target in targets.items():
        host = fleet.by_endpoint(address, port)
        if host is None:
            host = FleetHost(
                name=inventory.host_name(address, port),
                address=address,
                port=port,
                user=target.user,
            )
            fleet.hosts.append(host)
            touched.append(host)
        elif options.repin:
            known.forget(target)
            touched.append(host)
    if not touched:
        progress("every host is already in the fleet: nothing to do")
        return {**report(fleet, _in_order(fleet, targets)), "changed": False}
    fleet.hosts.sort(key=lambda h: inventory._sort_key(h.name))
    _check(workspace, fleet, touched, known, progress, gather=True)
    return {**report(fleet, _in_order(fleet, targets)), "changed": True}


def _in_order(fleet: Fleet, targets: dict[tuple[str, int], ssh.Target]) -> list[FleetHost]:
    return [h for key in targets if (h := fleet.by_endpoint(*key)) is not None]


def check(
    workspace: Workspace, name: str, limit: list[str] | None, progress: Progress
) -> dict[str, Any]:
    fleet = inventory.load(workspace, name)
    hosts = _select(fleet, limit)
    _check(workspace, fleet, hosts, _known_hosts(workspace, name), progress, gather=False)
    return report(fleet, hosts)


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
    if not failed:
        return None
    return CheckFailed(
        f"{len(failed)} of {len(doc['hosts'])} host(s) failed preflight: {', '.join(failed)}",
        hint=f"see the checks above; fix, then `pdctl fleet check {doc['fleet']}`",
    )


def placements(workspace: Workspace, fleet: str) -> dict[str, list[str]]:
    """Service -> the fleet hosts it has replicas on (from each service's stored plan)."""
    found: dict[str, list[str]] = {}
    root = workspace.services
    if not root.is_dir():
        return found
    for plan_file in sorted(root.glob("*/plan.json")):
        try:
            plan = json.loads(plan_file.read_text())
        except ValueError:
            continue
        if plan.get("fleet") == fleet:
            found[plan_file.parent.name] = sorted(
                {s["host"] for s in plan.get("slots", []) if "host" in s}
            )
    return found


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
                "services": sorted(s for s, hosts in services.items() if h.name in hosts),
            }
            for h in fleet.hosts
        ],
        "services": services,
    }


def remove(workspace: Workspace, name: str, hosts: list[str], force: bool) -> dict[str, Any]:
    fleet = inventory.load(workspace, name)
    chosen = _select(fleet, hosts) if hosts else list(fleet.hosts)
    services = placements(workspace, name)
    busy = {s: sorted(set(on) & {h.name for h in chosen}) for s, on in services.items()}
    busy = {s: on for s, on in busy.items() if on}
    if busy and not force:
        names = "; ".join(f"{s} on {', '.join(on)}" for s, on in busy.items())
        raise CheckFailed(
            f"fleet {name}: services still have replicas there ({names})",
            hint="`pdctl destroy SERVICE` first, or pass --force",
        )
    known = _known_hosts(workspace, name)
    for host in chosen:
        known.forget(inventory.target(fleet, host))
    removed = [h.name for h in chosen]
    if not hosts or len(chosen) == len(fleet.hosts):
        shutil.rmtree(inventory.fleet_dir(workspace, name))
        return {"fleet": name, "removed_hosts": removed, "fleet_removed": True}
    fleet.hosts = [h for h in fleet.hosts if h.name not in removed]
    known.save()
    inventory.save(workspace, fleet)
    return {"fleet": name, "removed_hosts": removed, "fleet_removed": False}
