"""`pdctl destroy`: undo a service on every host of its plans, and forget it.

The scaler is stopped first (else it would register the workers again), each registered
replica deregistered and drained, then destroy.yml removes the units and files; hosts where
nothing was applied are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable

from pdctl.core.errors import HostError, PdctlError
from pdctl.core.results import DestroyResult
from pdctl.doors import inventory, runner
from pdctl.doors import service as services
from pdctl.doors.session import Session

Progress = Callable[[str], None]


def destroy(session: Session, name: str, progress: Progress) -> DestroyResult:
    """Undo the service on every host of its plans: the last applied one and that of a
    deploy that did not complete (hosts where nothing was applied are left as they are)."""
    workspace = session.workspace
    plans = services.plans(workspace, name)
    if not plans:
        services.load_plan(workspace, name)  # the NotFound error, with the services known
    deregistered: list[str] = []
    try:
        with services.open_handle(session, plans[0], log=progress) as handle:
            if services.scaler_unit(handle, "stop"):  # else it would register the workers again
                progress("stopped the scaler")
            for slot in plans[0].slots():
                if handle.router.find(slot.url) is not None:
                    progress(f"deregistering and draining {slot.name}")
                    handle.actuator.deregister(slot)
                    deregistered.append(slot.name)
    except PdctlError as exc:
        progress(f"router not reachable ({exc.message}); destroying anyway")
    hosts: set[str] = set()
    for plan in plans:
        summary = runner.run_playbook(
            "destroy.yml",
            inventory.fleet_dir(workspace, plan.fleet),
            extravars=plan.extravars(),
            progress=progress,
            forks=min(100, max(5, len(plan.hosts()))),
        )
        if summary.rc != 0:
            unreachable = [f"{h}: unreachable" for h in summary.unreachable()]
            failed = [f"{h}: {r.task}: {r.message[:200]}" for h, r in summary.failures().items()]
            raise HostError(
                f"destroy failed: {'; '.join(unreachable + failed) or summary.status}",
                hint="fix and re-run `pdctl destroy` (the service stays recorded until then)",
            )
        hosts.update(plan.hosts())
    services.forget(workspace, name)
    return DestroyResult(service=name, deregistered=deregistered, hosts=sorted(hosts))
