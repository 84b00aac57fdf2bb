"""The quick no-op check: does every host still hold exactly what the last deploy applied?

A redeploy of an unchanged spec used to run every task of deploy.yml on every host only to
find nothing to do (95 s on 16 lab hosts). After each successful converge pdctl records:

- the inputs: the playbook's extra-vars (the plan, with its keyed hash of the secrets'
  values, the scaler's code and packages), the Ansible content it ran (playbooks, roles,
  templates, ansible.cfg) and the fleet's inventory;
- per host, what drift_probe.py reads: owner, mode and keyed content hash of every file the
  roles manage for the service (configs, units, pdctl-unitctl, the scaler's access, the
  router's and scaler's code and venvs).

The next deploy reads the same from every host in one SSH command each, all at once, plus
the live facts no file shows: units planned to run are active and enabled, their images
present, no running slot on a stale config, every running slot registered with the router.
Only when all of that matches does it skip Ansible; anything else (or --converge) runs
deploy.yml as before, and the reasons are shown. ``compare`` is pure; ``observe`` does the
reading.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl.core import layout
from pdctl.core.errors import InputError, PdctlError
from pdctl.core.layout import UNITCTL
from pdctl.core.plan import Plan, Slot
from pdctl.core.yamlsrc import YamlError, load_mapping_file
from pdctl.doors import service as services
from pdctl.doors import ssh
from pdctl.doors.content import content_root
from pdctl.doors.slots import SlotState, parse_states
from pdctl.doors.workspace import Workspace, write_atomic
from pdctl.onhost import bundle

RECORD = "converged.json"
KEY = "converged.key"
_CHECK_RECORDS = ("pd_facts", "pd_preflight")
_CONTENT = ("ansible.cfg", "playbooks", "roles", "templates")
# pdctl's code the roles install on hosts (the pd_onhost lookup): a new pdctl with other code
# there converges them.
INSTALLED_CODE = ("pdctl.scaler", "pdctl.onhost.router_launch")
PROBE = "pdctl.onhost.drift_probe"  # what each host runs (drift_probe.py says what it reads)


@dataclass(frozen=True)
class HostExpectation:
    """What to read on one host: the files the roles manage, units planned to run, images."""

    roots: tuple[str, ...]
    units: tuple[str, ...]
    images: tuple[str, ...]
    slots: tuple[Slot, ...]


def _unit_files(unit: str) -> list[str]:
    """A unit's file and its drop-in directory."""
    return [layout.unit_file(unit), f"{layout.unit_file(unit)}.d"]


def expectations(plan: Plan) -> dict[str, HostExpectation]:
    """Per host of the plan, the paths and units its roles manage for the service."""
    svc, where = plan.service, plan.layout
    found: dict[str, HostExpectation] = {}
    for host in plan.hosts():
        slots = [s for s in plan.slots() if s.host == host]
        roots: list[str] = [where.config_dir]
        units: list[str] = [s.unit(svc) for s in slots if s.start]
        images: set[str] = set()
        if slots:
            roots += [UNITCTL, where.scaler_sudoers, f"{layout.SCALER_USER_HOME}/.ssh"]
            for group in sorted({s.group for s in slots}):
                roots += _unit_files(layout.worker_unit(svc, group))
                images.add(plan.groups[group].image)
        if host in plan.router.hosts:
            roots += [
                where.router_home,
                where.scaler_home,
                layout.smg_venv(plan.router.smg_version, plan.roots),
            ]
            router_units = [layout.router_unit(svc), layout.scaler_unit(svc)]
            if plan.router.failover:
                router_units.append(layout.keepalived_unit(svc))
            for unit in router_units:
                roots += _unit_files(unit)
                units.append(unit)
        found[host] = HostExpectation(
            roots=tuple(roots),
            units=tuple(units),
            images=tuple(sorted(images)),
            slots=tuple(slots),
        )
    return found


def stored_key(workspace: Workspace, service: str) -> bytes | None:
    """The service's HMAC key (0600 in its state dir), None before its first deploy."""
    path = services.state_dir(workspace, service) / KEY
    return bytes.fromhex(path.read_text().strip()) if path.is_file() else None


def save_key(workspace: Workspace, service: str, key: bytes) -> None:
    write_atomic(services.state_dir(workspace, service) / KEY, key.hex(), private=True)


def new_key() -> bytes:
    return secrets.token_bytes(32)


def key(workspace: Workspace, service: str, *, create: bool = True) -> bytes:
    """The service's HMAC key, made on first use. ``create=False`` (a dry run) leaves the
    workspace as it is: without a key there is no record to match."""
    found = stored_key(workspace, service)
    if found is None:
        found = new_key()
        if create:
            save_key(workspace, service, found)
    return found


def secrets_digest(key: bytes | None, names: Sequence[str], environ: Mapping[str, str]) -> str:
    """A keyed hash (HMAC-SHA256 under the service's key) of the secrets' values, for the plan.

    The groups' config covers it, so a rotated secret rolls the replicas; the plan, its
    plan.yml and the record hold no value, nor a plain hash one could test guesses against.
    """
    if not names:
        return ""  # nothing to cover: the configs stay the same in every workspace
    if key is None:
        # A dry run or `pdctl plan` before the first deploy from this workspace, which must
        # not make the key. Nothing this workspace deployed runs yet (the first deploy makes
        # the key before it converges; destroy removes it), so no running config is compared
        # with this one: a fixed marker, not a throwaway key, keeps such plans the same.
        return "unkeyed"
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for name in sorted(names):
        # Unambiguous: a name holds no "=" and a value no NUL (the spec refuses both).
        mac.update(f"{name}={environ.get(name, '')}\0".encode())
    return mac.hexdigest()


def _content_digest() -> str:
    digest = hashlib.sha256()
    root = content_root()
    for name in _CONTENT:
        top = root / name
        files = sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top]
        for file in files:
            if "__pycache__" in file.parts or not file.is_file():
                continue
            digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    for entry in INSTALLED_CODE:
        digest.update(entry.encode() + b"\0" + bundle.stdin(entry))
    return digest.hexdigest()


def _inventory_bytes(file: Path) -> bytes:
    """A host_vars file without what `fleet add`/`fleet check` record there (facts and
    preflight results, which no role reads): a re-check must not force a converge."""
    if file.parent.name != "host_vars" or file.suffix not in {".yml", ".yaml"}:
        return file.read_bytes()
    try:
        doc = load_mapping_file(file)
    except YamlError as exc:
        raise InputError(exc.describe(file), hint="fix or remove the file") from exc
    for record in _CHECK_RECORDS:
        doc.pop(record, None)
    return json.dumps(doc, sort_keys=True, default=str).encode()


def inputs_digest(key: bytes, playbook_vars: Mapping[str, Any], inventory_dir: Path) -> str:
    """One digest of everything a deploy's outcome depends on besides the hosts themselves.
    The secrets are in it through the plan (``pd_secrets_digest``, see secrets_digest)."""
    digest = hmac.new(key, digestmod=hashlib.sha256)
    digest.update(json.dumps(playbook_vars, sort_keys=True, default=str).encode())
    digest.update(_content_digest().encode())
    for file in sorted(p for p in inventory_dir.rglob("*") if p.is_file()):
        digest.update(
            str(file.relative_to(inventory_dir)).encode() + b"\0" + _inventory_bytes(file)
        )
    return digest.hexdigest()


@dataclass
class Observed:
    """What one host showed (``error`` when it could not be read)."""

    files: dict[str, str]
    units: dict[str, list[str]]
    images: dict[str, bool]
    states: dict[str, SlotState]
    error: str | None = None


def observe(handle: services.Handle, key: bytes) -> dict[str, Observed]:
    """Read every host of the plan at once: one SSH command per host, over the pool."""
    plan = handle.plan
    wanted = expectations(plan)

    def read(host: str) -> Observed:
        expect = wanted[host]
        params = {
            "roots": list(expect.roots),
            "units": list(expect.units),
            "images": list(expect.images),
            "states": [UNITCTL, plan.service, "states"] if expect.slots else None,
            "key": key.hex(),
        }
        # The parameters travel on stdin after the bundle: nothing of them in any argv.
        become = handle.fleet.settings.become
        target = handle.targets[host]
        try:
            stdout = ssh.run_onhost(handle.pool, target, PROBE, json.dumps(params), become=become)
        except (PdctlError, OSError) as exc:
            return Observed({}, {}, {}, {}, error=f"cannot read it: {exc}")
        doc = json.loads(stdout)
        states = {}
        if doc.get("states") is not None:
            states = parse_states(doc["states"], list(expect.slots))
        return Observed(doc["files"], doc["units"], doc["images"], states)

    return ssh.at_once(plan.hosts(), read)


def compare(
    plan: Plan,
    record: Mapping[str, Any] | None,
    inputs: str,
    observed: Mapping[str, Observed],
    registered: set[str] | None,
) -> list[str]:
    """Why the hosts differ from the last converge, one reason a line; [] when they do not.

    ``registered`` is the set of worker URLs the router has (None: it could not be asked).
    """
    if record is None:
        return ["no record of a completed deploy"]
    if record.get("inputs") != inputs:
        return ["the plan, pdctl's Ansible content, the inventory or a secret changed"]
    reasons: list[str] = []
    wanted = expectations(plan)
    recorded_hosts: Mapping[str, Mapping[str, str]] = record.get("hosts") or {}
    for host in plan.hosts():
        seen = observed.get(host)
        if seen is None or seen.error:
            reasons.append(f"{host}: {seen.error if seen else 'not read'}")
        elif host not in recorded_hosts:
            reasons.append(f"{host}: not in the last deploy's record")
        else:
            reasons += _file_drift(host, recorded_hosts[host], seen.files)
            reasons += _live_drift(plan, host, wanted[host], seen, registered)
    if registered is None:
        reasons.append("the router could not be asked for its workers")
    return reasons


def _file_drift(host: str, before: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    changed = sorted(p for p in before.keys() | now.keys() if before.get(p) != now.get(p))
    reasons = []
    for path in changed[:3]:
        what = "missing" if path not in now else "new" if path not in before else "changed"
        reasons.append(f"{host}: {path} {what} since the last deploy")
    if len(changed) > 3:
        reasons.append(f"{host}: {len(changed) - 3} more file(s) changed")
    return reasons


def _live_drift(
    plan: Plan, host: str, expect: HostExpectation, seen: Observed, registered: set[str] | None
) -> list[str]:
    reasons = []
    for unit in expect.units:
        active, enabled = (seen.units.get(unit) or ["unknown", "-"])[:2]
        if active != "active":
            reasons.append(f"{host}: {unit} is {active}, planned to run")
        if enabled != "enabled":
            reasons.append(f"{host}: {unit} is {enabled}, not enabled")
    reasons += [
        f"{host}: image {image} is missing" for image in expect.images if not seen.images.get(image)
    ]
    for state in seen.states.values():
        if not state.running:
            continue
        if state.config not in {None, plan.groups[state.slot.group].config}:
            reasons.append(f"{host}: {state.slot.name} runs a stale config")
        if registered is not None and state.slot.url not in registered:
            reasons.append(f"{host}: {state.slot.name} runs but the router does not have it")
    return reasons


def load_record(workspace: Workspace, service: str) -> dict[str, Any] | None:
    path = services.state_dir(workspace, service) / RECORD
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc


def forget(workspace: Workspace, service: str) -> None:
    """Before a converge: a run that fails half-way must not leave a record behind."""
    (services.state_dir(workspace, service) / RECORD).unlink(missing_ok=True)


def save_record(
    workspace: Workspace, service: str, inputs: str, observed: Mapping[str, Observed]
) -> None:
    """Record what the hosts hold after a converge; hosts that could not be read are left
    out, so the next deploy converges again."""
    doc = {"inputs": inputs, "hosts": {h: o.files for h, o in observed.items() if not o.error}}
    record = services.state_dir(workspace, service) / RECORD
    write_atomic(record, json.dumps(doc, sort_keys=True), private=True)


def registered_urls(handle: services.Handle) -> set[str] | None:
    try:
        return {w.url for w in handle.router.workers()}
    except PdctlError:
        return None
