"""The operator's handles on the scaler: pins (`pdctl scale`) and its recorded state."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from pdctl.core import layout
from pdctl.core.errors import EnvironmentProblem, InputError, PdctlError
from pdctl.doors import service as services
from pdctl.doors.session import Session
from pdctl.doors.workspace import Workspace
from pdctl.scaler.setup import handle_store, handle_stores
from pdctl.scaler.store import Store

# A scaler that has not recorded its state for this long is taken to be gone.
HEARTBEAT_GRACE = 15.0


def recorded(store: Store) -> dict[str, Any] | None:
    try:
        doc = json.loads(store.state() or "null")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def alive(state: dict[str, Any] | None, now: float | None = None) -> bool:
    if not state or "at" not in state:
        return False
    grace = max(HEARTBEAT_GRACE, 3 * float(state.get("interval") or 2.0))
    return (now or time.time()) - float(state["at"]) < grace


def refuse_if_daemon_runs(workspace: Workspace, name: str) -> None:
    plan = services.load_plan(workspace, name)
    with Session(workspace) as session, services.open_handle(session, plan) as handle:
        if alive(recorded(handle_store(handle))):
            raise EnvironmentProblem(
                f"a scaler for {name} already runs ({layout.scaler_unit(name)} on "
                f"{handle.router_host or plan.router.host})",
                hint="one scaler per service: steer it with `pdctl scale`, or stop that unit",
            )


def _write_pins(handle: services.Handle, text: str, progress: Callable[[str], None]) -> None:
    """The pins on every router host (whichever scaler acts, now or after the failover
    address moves, reads the same); a router host that does not answer is said, and gets
    them from the acting scaler when it is back. The acting one's must be written."""
    for number, (host, store) in enumerate(handle_stores(handle).items()):
        try:
            store.write(layout.SCALER_PINS, text)
        except PdctlError as exc:
            if number == 0:
                raise
            progress(
                f"{host}: pins not written ({exc.message}); it takes them from the acting scaler"
            )


def pin(
    workspace: Workspace, name: str, group: str, count: str, progress: Callable[[str], None]
) -> dict[str, Any]:
    plan = services.load_plan(workspace, name)
    bounds = plan.groups[group]
    wanted: int | None = None
    if count != "auto":
        if not count.isdigit() or not bounds.min <= int(count) <= bounds.max:
            raise InputError(
                f"{group} of {name} takes {bounds.min}..{bounds.max} replicas (got {count})",
                hint=f"pdctl scale {name} {group} N (or auto)",
            )
        wanted = int(count)
    with (
        Session(workspace) as session,
        services.open_handle(session, plan, log=progress) as handle,
    ):
        store = handle_store(handle)
        try:
            pins = json.loads(store.pins() or "{}")
        except ValueError:
            pins = {}
        if wanted is None:
            pins.pop(group, None)
        else:
            pins[group] = wanted
        _write_pins(handle, json.dumps(pins, indent=2, sort_keys=True), progress)
        if wanted is None:
            return {
                "service": name,
                "group": group,
                "pinned": None,
                "applied_now": False,
                "message": f"{group} of {name} is back under the scaler's control",
            }
        if alive(recorded(store)):
            return {
                "service": name,
                "group": group,
                "pinned": wanted,
                "applied_now": False,
                "message": f"pinned {group} of {name} to {wanted}; the scaler applies it shortly",
            }
        # No scaler runs: do it now, the same way it would.
        actuator = handle.actuator
        states = [s for s in actuator.states().values() if s.slot.group == group]
        running = sorted((s.slot for s in states if s.running), key=lambda s: s.index)
        free = sorted((s.slot for s in states if not s.running), key=lambda s: s.index)
        for slot in free[: max(0, wanted - len(running))]:
            actuator.scale_out(slot)
        for slot in list(reversed(running))[: max(0, len(running) - wanted)]:
            actuator.scale_in(slot)
    return {
        "service": name,
        "group": group,
        "pinned": wanted,
        "applied_now": True,
        "message": f"no scaler is running: {group} of {name} now runs {wanted} replica(s) (pinned)",
    }
