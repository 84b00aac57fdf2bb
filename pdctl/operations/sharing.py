"""What other services hold on a fleet's hosts, for the placement (plan.build) to go around.

Two sources:
- this workspace's stored plans of the fleet's other services, spares included (they are
  their scaler's room);
- what the hosts show of services no stored plan explains (deployed from another
  workspace): holdings_probe.py, one SSH command per host, all hosts at once.

A host's output is data, never code: every value is checked (service names by the spec's
rule, GPU ids and ports as bounded integers) and what does not pass is dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pdctl.core import layout, validate
from pdctl.core.errors import InputError, PdctlError
from pdctl.core.fleet_model import Fleet
from pdctl.core.plan import (
    ROUTER,
    ROUTER_METRICS,
    SCALER_METRICS,
    Held,
    Plan,
    bootstrap_of,
    kv_of,
    side_channel_of,
    unusable,
)
from pdctl.core.spec import MIN_PORT_STRIDE
from pdctl.doors import service as services
from pdctl.doors import ssh
from pdctl.doors.session import Session
from pdctl.doors.workspace import Workspace

PROBE = "pdctl.onhost.holdings_probe"  # what each host runs
# Where holdings_probe.py looks: the default roots (a host holds one config root).
PROBE_WHERE = {
    "config_root": layout.CONFIG_ROOT,
    "unit_dir": layout.UNIT_DIR,
    "router_units": layout.router_unit("*"),
}
_SLOT = re.compile(f"({'|'.join(layout.GROUPS)})-([1-9][0-9]{{0,3}})")
_PORT = re.compile(r"[1-9][0-9]{0,4}")
_GPU_IDS = re.compile(r"[0-9]{1,3}(?:,[0-9]{1,3}){0,63}")
# holdings_probe.py's names for a service's own listeners.
_LISTENERS = {"--port": ROUTER, "--prometheus-port": ROUTER_METRICS, "scaler": SCALER_METRICS}


def stored_plans(workspace: Workspace, fleet: str, service: str) -> list[Plan]:
    """This workspace's plans of the fleet's services other than ``service``: the last
    applied and that of a deploy that did not complete (it may have changed hosts too)."""
    found = []
    for name, plan in services.every_plan(workspace):
        if isinstance(plan, str):  # its service may hold anything: placing blind could collide
            raise InputError(plan, hint=f"fix or remove it: what service {name} holds is unknown")
        if plan.fleet == fleet and name != service:
            found.append(plan)
    return found


@dataclass
class Found:
    """What the hosts showed of services no stored plan explains, and the hosts not read."""

    held: list[Held] = field(default_factory=list)
    unread: dict[str, str] = field(default_factory=dict)  # host -> why


def read_hosts(session: Session, fleet: Fleet, explained: set[str]) -> Found:
    """Every usable host's pdctl services but the ``explained`` ones (a stored plan says
    what they hold), one SSH command per host, all at once, over the session's pool."""
    pool = session.pool(fleet.name)
    hosts = {h.name: h for h in fleet.hosts if unusable(h) is None}

    def read(name: str) -> list[Held] | str:
        target = session.target(fleet.name, name)
        try:  # a host without a pinned key is refused before contact
            where = json.dumps(PROBE_WHERE)
            text = ssh.run_onhost(
                pool, target, PROBE, where, become=fleet.settings.become, timeout=30
            )
        except (PdctlError, OSError) as exc:
            return str(exc)
        return [h for h in parse_report(name, text) if h.service not in explained]

    results = ssh.at_once(sorted(hosts), read)
    found = Found()
    for name, result in results.items():
        if isinstance(result, str):
            found.unread[name] = result
        else:
            found.held += result
    return found


def parse_report(host: str, text: str) -> list[Held]:
    """The holdings in holdings_probe.py's output from ``host``; what does not parse is
    dropped (each value on its own: a bad port leaves the slot's GPUs held)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    if not isinstance(doc, dict):
        return []
    held: list[Held] = []
    for entry in _triples(doc.get("slots")):
        held += _slot(host, *entry)
    for service, name, value in _triples(doc.get("listeners")):
        port = _port(value)
        if _service(service) and isinstance(name, str) and name in _LISTENERS and port:
            held.append(Held(service, host, _LISTENERS[name], ports=(port, port)))
    return held


def _triples(value: Any) -> list[tuple[Any, Any, Any]]:
    entries = value if isinstance(value, list) else []
    return [(e[0], e[1], e[2]) for e in entries if isinstance(e, list) and len(e) == 3]


def _slot(host: str, service: Any, stem: Any, values: Any) -> list[Held]:
    """A slot env file's holdings. Its stride is not on the host: a worker is taken to hold
    the shortest range a spec may give it."""
    match = _SLOT.fullmatch(stem) if isinstance(stem, str) else None
    if not (_service(service) and match and isinstance(values, dict)):
        return []
    name = f"{match[1]}/{match[2]}"
    held = []
    ids = values.get(layout.ENV_GPU_IDS)
    gpus: tuple[int, ...] = ()
    if isinstance(ids, str) and _GPU_IDS.fullmatch(ids):
        gpus = tuple(sorted({int(g) for g in ids.split(",")}))
        held.append(Held(service, host, name, gpus=gpus))
    port = _port(values.get(layout.ENV_PORT))
    if port:
        held.append(Held(service, host, name, ports=(port, port + MIN_PORT_STRIDE - 1)))
    bootstrap = _port(values.get(layout.ENV_BOOTSTRAP_PORT))
    if bootstrap:
        held.append(Held(service, host, bootstrap_of(name), ports=(bootstrap, bootstrap)))
    side_channel = _port(values.get("VLLM_NIXL_SIDE_CHANNEL_PORT"))
    if side_channel:  # a vLLM slot's ranks take one port each from it (pdctl/core/plan/)
        last = min(side_channel + max(len(gpus), 1) - 1, 65535)
        held.append(Held(service, host, side_channel_of(name), ports=(side_channel, last)))
    kv_port = _port(values.get(layout.ENV_KV_PORT))
    if kv_port:  # its ranks take the next ports, one per GPU (pdctl/core/plan/)
        last = min(kv_port + max(len(gpus), 1) - 1, 65535)
        held.append(Held(service, host, kv_of(name), ports=(kv_port, last)))
    return held


def _service(value: Any) -> bool:
    return isinstance(value, str) and validate.SERVICE_NAME.fullmatch(value) is not None


def _port(value: Any) -> int | None:
    if not (isinstance(value, str) and _PORT.fullmatch(value)):
        return None
    number = int(value)
    return number if number <= 65535 else None
