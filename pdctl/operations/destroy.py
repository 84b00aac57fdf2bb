"""`pdctl destroy`: undo a service on every host of its plans, and forget it.

The scaler is stopped first (else it would register the workers again), each registered
replica deregistered and drained, then destroy.yml removes the units and files; hosts where
nothing was applied are left as they are. A dry run stops, deregisters and forgets nothing: it
lists the registered replicas and runs destroy.yml in check mode, whose removal steps report
per host what they would take away.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pdctl.core.errors import HostError, PdctlError
from pdctl.core.results import DestroyResult
from pdctl.doors import inventory, runner, ssh
from pdctl.doors import service as services
from pdctl.doors.runner import RunSummary
from pdctl.doors.session import Session

Progress = Callable[[str], None]


def destroy(
    session: Session, name: str, progress: Progress, *, dry_run: bool = False
) -> DestroyResult:
    """Undo the service on every host of its plans: the last applied one and that of a
    deploy that did not complete (hosts where nothing was applied are left as they are)."""
    workspace = session.workspace
    plans = services.plans(workspace, name)
    if not plans:
        services.load_plan(workspace, name)  # the NotFound error, with the services known
    deregistered: list[str] = []
    try:
        with services.open_handle(session, plans[0], log=progress) as handle:
            if not dry_run:
                if services.scaler_unit(handle, "stop"):  # else it would register them again
                    progress("stopped the scaler")
                _release_gpus(handle, progress)
            listed = {worker.url for worker in handle.router.workers()}
            registered = [s for s in plans[0].slots() if s.url in listed]
            names = [slot.name for slot in registered]
            if names and not dry_run:
                progress(f"deregistering and draining {', '.join(names)}")
                handle.actuator.deregister_all(registered)
            deregistered = names  # with dry_run, those it would take out
    except PdctlError as exc:
        anyway = "would destroy anyway" if dry_run else "destroying anyway"
        progress(f"router not reachable ({exc.message}); {anyway}")
    hosts: set[str] = set()
    would_remove: dict[str, list[str]] = {}
    for plan in plans:
        summary = runner.run_playbook(
            "destroy.yml",
            inventory.fleet_dir(workspace, plan.fleet),
            extravars=plan.extravars(),
            progress=progress,
            forks=min(100, max(5, len(plan.hosts()))),
            check=dry_run,
        )
        if summary.rc != 0:
            unreachable = [f"{h}: unreachable" for h in summary.unreachable()]
            failed = [f"{h}: {r.task}: {r.message[:200]}" for h, r in summary.failures().items()]
            raise HostError(
                f"destroy failed: {'; '.join(unreachable + failed) or summary.status}",
                hint="fix and re-run `pdctl destroy` (the service stays recorded until then)",
            )
        hosts.update(plan.hosts())
        for host, items in _removals(summary).items():
            named = would_remove.setdefault(host, [])
            named += [item for item in dict.fromkeys(items) if item not in named]
    if dry_run:
        return DestroyResult(
            service=name,
            deregistered=deregistered,
            hosts=sorted(hosts),
            dry_run=True,
            would_remove=would_remove,
        )
    services.forget(workspace, name)
    return DestroyResult(service=name, deregistered=deregistered, hosts=sorted(hosts))


def _removals(summary: RunSummary) -> dict[str, list[str]]:
    """What each host's removal steps (the pd_apply module running host_remove) reported."""
    found: dict[str, list[str]] = {}
    for result in summary.results:
        if not result.action.endswith("pd_apply") or not result.changed:
            continue
        res = result.res
        items = [f"unit {unit}" for unit in res.get("stopped") or []]
        items += [f"container {container}" for container in res.get("containers") or []]
        items += [f"user {user}" for user in res.get("users") or []]
        items += [str(path) for path in res.get("files") or []]
        found.setdefault(result.host, []).extend(items)
    return found


LEDGER_ENTRY = "pdctl.onhost.gpu_ledger_file"  # run on the router host to release the GPUs


def _release_gpus(handle: services.Handle, progress: Progress) -> None:
    """The service's GPUs leave its fleet's ledger (its scaler, stopped, reports no more): the
    other services' scalers may grow into them."""
    plan = handle.plan
    if plan.gpu_budget is None:
        return
    params = {"path": plan.layout.gpu_ledger(plan.fleet), "release": plan.service}
    target = handle.targets[plan.router.host]
    become = handle.fleet.settings.become
    try:
        out = ssh.run_onhost(handle.pool, target, LEDGER_ENTRY, json.dumps(params), become=become)
        held = json.loads(out).get("held")
    except (PdctlError, OSError, ValueError) as exc:
        progress(f"could not release its GPUs from the fleet's ledger: {exc}")
        return
    if held is not None:
        progress(f"released its {held} GPU(s) from fleet {plan.fleet}'s budget")
