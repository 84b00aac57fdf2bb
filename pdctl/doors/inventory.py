"""Fleets as standard Ansible YAML inventories: ``inventories/<fleet>/``.

    hosts.yml                  groups pd_gpu_hosts, pd_cpu_hosts, pd_new_hosts (never reached yet)
    group_vars/all.yml         connection settings and the fleet's preflight expectations
    group_vars/pd_*_hosts.yml  pd_host_kind
    host_vars/<host>.yml       pd_facts (gathered), pd_preflight (last check) and pd_fabric
                               (its part in the last fabric check)
    known_hosts.txt            the fleet's pinned host keys (OpenSSH format; .txt so that
                               Ansible does not take it for an inventory source)

``ansible-inventory -i inventories/<fleet> --list`` and a plain ``ansible-playbook``
read it as is. Files are written with a stable key order, so re-writing the
same fleet changes no byte.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from pdctl.core import validate
from pdctl.core.ansible_data import unsafe_yaml
from pdctl.core.errors import InputError, NotFound
from pdctl.core.fleet_model import (
    PREFLIGHT_VARS,
    FabricRecord,
    Fleet,
    FleetHost,
    FleetSettings,
    HostKind,
    Preflight,
    natural_key,
)
from pdctl.core.yamlsrc import YamlError, dump_text, load_mapping_file
from pdctl.doors.ssh import Target, parse_target
from pdctl.doors.workspace import Workspace, write_atomic

GROUPS: dict[HostKind, str] = {"gpu": "pd_gpu_hosts", "cpu": "pd_cpu_hosts", "new": "pd_new_hosts"}
KNOWN_HOSTS = "known_hosts.txt"


def validate_name(name: str) -> None:
    if not validate.FLEET_NAME.match(name):
        raise InputError(f"bad fleet name {name!r}", hint=f"use {validate.FLEET_NAME_RULE}")


def fleet_dir(workspace: Workspace, name: str) -> Path:
    return workspace.fleet_dir(name)


def known_hosts_file(workspace: Workspace, name: str) -> Path:
    return fleet_dir(workspace, name) / KNOWN_HOSTS


def exists(workspace: Workspace, name: str) -> bool:
    return (fleet_dir(workspace, name) / "hosts.yml").is_file()


def list_fleets(workspace: Workspace) -> list[str]:
    root = workspace.inventories
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if (p / "hosts.yml").is_file() and p.name != "example"
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return load_mapping_file(path)
    except YamlError as exc:
        raise InputError(exc.describe(path), hint="fix or remove the file") from exc


def _settings_from_vars(variables: dict[str, Any]) -> FleetSettings:
    prefix = "pd_fleet_"
    return FleetSettings(
        **{
            k[len(prefix) :]: v
            for k, v in variables.items()
            if k.startswith(prefix) and k[len(prefix) :] in FleetSettings.model_fields
        }
    )


def load(workspace: Workspace, name: str) -> Fleet:
    validate_name(name)  # the name picks a directory: never a path
    directory = fleet_dir(workspace, name)
    if not (directory / "hosts.yml").is_file():
        known = ", ".join(list_fleets(workspace)) or "none yet"
        raise NotFound(
            f"no fleet named {name!r} in {workspace.inventories}",
            hint=f"fleets: {known}; add one with `pdctl fleet add {name} --host ...`",
        )
    inventory = _read_yaml(directory / "hosts.yml")
    children = (inventory.get("all") or {}).get("children") or {}
    fleet = Fleet(
        name=name, settings=_settings_from_vars(_read_yaml(directory / "group_vars/all.yml"))
    )
    for kind, group in GROUPS.items():
        for host, declared in ((children.get(group) or {}).get("hosts") or {}).items():
            variables = declared or {}
            extra = _read_yaml(directory / "host_vars" / f"{host}.yml")
            preflight = extra.get("pd_preflight")
            fabric = extra.get("pd_fabric")
            fleet.hosts.append(
                FleetHost(
                    name=str(host),
                    address=str(variables.get("ansible_host", host)),
                    port=int(variables.get("ansible_port", 22)),
                    user=str(variables.get("ansible_user", "root")),
                    kind=kind,
                    facts=extra.get("pd_facts"),
                    preflight=Preflight.model_validate(preflight) if preflight else None,
                    fabric=FabricRecord.model_validate(fabric) if fabric else None,
                )
            )
    fleet.hosts.sort(key=lambda h: natural_key(h.name))
    return fleet


def _dump(path: Path, doc: dict[str, Any], header: str, *, untrusted: bool = False) -> None:
    """``untrusted``: the values came from a host; Ansible must never render them."""
    text = f"---\n# {header}\n" + (unsafe_yaml(doc) if untrusted else dump_text(doc))
    if not path.exists() or path.read_text() != text:
        write_atomic(path, text)


def _pinned_only(known_hosts: str) -> str:
    """ssh options that accept exactly the keys in the fleet's known_hosts file."""
    return (
        f"-o UserKnownHostsFile={known_hosts} -o GlobalKnownHostsFile=/dev/null"
        " -o StrictHostKeyChecking=yes"
    )


def _jump_command(jump: Target, identity_file: str | None) -> str:
    """The ProxyCommand that reaches a host through the jump host under the fleet's pins.

    Not ProxyJump: OpenSSH applies command-line options to the destination only, so the
    jump hop would be checked against ~/.ssh/known_hosts under the user's own policy (by
    Ansible's ssh and Mitogen's alike). A shell runs this (quoted for it); ssh expands %h
    and %p.
    """
    words = [
        "ssh",
        _pinned_only("{{ inventory_dir | quote }}/" + KNOWN_HOSTS),
        "-o BatchMode=yes",  # its stdin and stdout are the tunnel: nothing to answer a prompt
        *([f"-i {shlex.quote(identity_file)}"] if identity_file else []),
        f"-p {jump.port} -l {jump.user} -W '[%h]:%p' {jump.address}",
    ]
    return " ".join(words)


def ssh_common_args(settings: FleetSettings) -> str:
    # {{ inventory_dir }} keeps the inventory valid wherever the workspace moves.
    args = _pinned_only(f"{{{{ inventory_dir }}}}/{KNOWN_HOSTS}")
    jump = jump_target(settings)
    if jump is not None:
        # Double quotes: Ansible and Mitogen split these args as a shell would.
        args += f' -o "ProxyCommand={_jump_command(jump, settings.identity_file)}"'
    return args


def save(workspace: Workspace, fleet: Fleet) -> Path:
    directory = fleet_dir(workspace, fleet.name)
    children: dict[str, Any] = {}
    for kind, group in GROUPS.items():
        members = {
            h.name: {"ansible_host": h.address, "ansible_port": h.port, "ansible_user": h.user}
            for h in fleet.hosts
            if h.kind == kind
        }
        children[group] = {"hosts": members} if members else {}
    _dump(
        directory / "hosts.yml",
        {"all": {"children": children}},
        f"pdctl fleet {fleet.name}: written by `pdctl fleet add`; plain Ansible reads it as is",
    )
    settings = fleet.settings
    all_vars: dict[str, Any] = {"pd_fleet": fleet.name}
    all_vars.update({f"pd_fleet_{k}": v for k, v in settings.model_dump().items()})
    all_vars["ansible_become"] = settings.become
    all_vars["ansible_ssh_common_args"] = ssh_common_args(settings)
    if settings.identity_file:
        all_vars["ansible_ssh_private_key_file"] = settings.identity_file
    # What pd_preflight checks, from the fleet's settings (the role's own names).
    all_vars.update({var: getattr(settings, field) for var, field in PREFLIGHT_VARS.items()})
    _dump(directory / "group_vars/all.yml", all_vars, "fleet-wide settings (pdctl fleet add)")
    for kind, group in GROUPS.items():
        _dump(
            directory / "group_vars" / f"{group}.yml",
            {"pd_host_kind": kind},
            "what kind of host this group holds",
        )
    host_vars = directory / "host_vars"
    keep = set()
    for host in fleet.hosts:
        doc: dict[str, Any] = {}
        if host.facts is not None:
            doc["pd_facts"] = host.facts
        if host.preflight is not None:
            doc["pd_preflight"] = host.preflight.model_dump()
        if host.fabric is not None:
            doc["pd_fabric"] = host.fabric.model_dump()
        header = f"{host.name}: facts and last preflight (pdctl)"
        _dump(host_vars / f"{host.name}.yml", doc, header, untrusted=True)
        keep.add(f"{host.name}.yml")
    if host_vars.is_dir():
        for stale in host_vars.glob("*.yml"):
            if stale.name not in keep:
                stale.unlink()
    return directory


def jump_target(settings: FleetSettings) -> Target | None:
    """The fleet's jump host, as every path reaches it (pdctl's SSH, Ansible, Mitogen)."""
    if not settings.proxy_jump:
        return None
    # `fleet add` stores USER@HOST[:PORT]; root for a value written without a user.
    return parse_target(
        settings.proxy_jump, default_user="root", identity_file=settings.identity_file
    )


def target(fleet: Fleet, host: FleetHost) -> Target:
    """How to SSH to a fleet host (through the fleet's jump host, if it has one)."""
    return Target(
        address=host.address,
        port=host.port,
        user=host.user,
        identity_file=fleet.settings.identity_file,
        proxy_jump=jump_target(fleet.settings),
    )
