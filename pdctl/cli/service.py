"""`pdctl plan | deploy | status | endpoint | logs | destroy`: a PD service on a fleet."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pdctl.cli import fabric as fabric_cli
from pdctl.cli.app import App, emit, pass_app
from pdctl.core.errors import CheckFailed, InputError, PdctlError
from pdctl.core.failover import plan_host_loss
from pdctl.core.plan import WORKER_ROLES, Plan
from pdctl.core.results import DeployResult, EndpointResult, ScalerStatus, StatusResult
from pdctl.doors import service as services
from pdctl.operations import deploy as deploys
from pdctl.operations import destroy as destroys
from pdctl.operations import endpoint as endpoints
from pdctl.operations import fabric_run, image_prefetch, planning
from pdctl.operations import logs as replica_logs
from pdctl.operations import prefetch as prefetches
from pdctl.operations import status as statuses

SPEC = click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
FLEET = click.option(
    "--fleet", help="Fleet to deploy on (default: pdctl.fleet in the spec, or the only one)."
)
PARTIAL = click.option(
    "--allow-partial",
    is_flag=True,
    help="Plan fewer slots than a group's max when the fleet lacks GPUs.",
)


def _endpoint_line(app: App, doc: DeployResult | StatusResult | EndpointResult) -> None:
    """Where clients go, and the command that prints the key (never the key itself)."""
    app.out.line(f"endpoint: {doc.endpoint}  (API key: `pdctl endpoint {doc.service} --show-key`)")


def _show_plan(app: App, plan: Plan, changes: list[str]) -> None:
    app.out.table(
        ["slot", "host", "gpus", "nics", "ports", "other ports", "unit", "at deploy"],
        planning.plan_table(plan),
        title=f"plan: service {plan.service} on fleet {plan.fleet}",
    )
    for host, reason in plan.excluded_hosts.items():
        app.out.line(f"not used: {host}: {reason}")
    for loss in plan_host_loss(plan).values():
        app.out.line(f"N+1: {loss.describe()}")
    for note in plan.notes:
        app.out.line(f"note: {note}")
    app.out.line("changes:" if changes else "no changes")
    for change in changes:
        app.out.line(f"  {change}")


@click.command()
@SPEC
@FLEET
@PARTIAL
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the plan as deploy.yml's extra-vars (ansible-playbook ... -e @FILE).",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Refuse a plan with a slot on a host whose last fabric check failed or that has none "
    "(`pdctl fleet check F --fabric`).",
)
@pass_app
def plan(
    app: App,
    spec: Path,
    fleet: str | None,
    allow_partial: bool,
    output: Path | None,
    strict: bool,
) -> None:
    """Show where every replica slot would run (changes nothing)."""
    warnings: list[str] = []

    def warn(text: str) -> None:
        warnings.append(text)
        app.out.warn(text)

    _, _, planned = planning.make_plan(
        app.session, spec, fleet, allow_partial=allow_partial, warn=warn
    )
    uncertified = fabric_run.plan_problems(app.session, planned)
    if strict and uncertified:
        raise CheckFailed(
            f"{len(uncertified)} host(s) of the plan are not fabric-certified: "
            + "; ".join(uncertified),
            hint=f"`pdctl fleet check {planned.fleet} --fabric`, fix what it names, or plan "
            "without --strict",
        )
    for problem in uncertified:
        warn(f"fabric: {problem}")
    changes = planning.diff(services.stored_plan(app.workspace, planned.service), planned)
    if output:
        planning.write_plan_file(planned, output)
    doc = {
        "plan": planned.model_dump(mode="json"),
        # per group: does losing any one host leave its min count of slots (N+1)?
        "host_loss": {role: loss.to_dict() for role, loss in plan_host_loss(planned).items()},
        "changes": changes,
        "output": str(output) if output else None,
        "warnings": warnings,
    }
    app.out.result(doc, lambda: _show_plan(app, planned, changes))


@click.command()
@SPEC
@FLEET
@PARTIAL
@pass_app
def prefetch(app: App, spec: Path, fleet: str | None, allow_partial: bool) -> None:
    """Fill the model cache and the image store of every host with a slot of SPEC's plan (what
    `deploy` does first): for a pipeline that runs `pdctl plan -o` and ansible-playbook itself."""
    _, _, planned = planning.make_plan(app.session, spec, fleet, allow_partial=allow_partial)
    with app.out.progress(f"prefetch {planned.model_repo or '(no model)'}") as progress:
        doc = prefetches.for_plan(app.session, planned, progress)
        images = image_prefetch.for_plan(app.session, planned, progress)

    def render() -> None:
        if doc is None:
            app.out.line("the plan names no hub model: nothing to fetch")
        else:
            for host, run in doc["hosts"].items():
                app.out.line(
                    f"{host}: {run['state']}, {run['fetched'] / 1e6:.0f} MB from "
                    f"{run['source']} in {run['seconds']:.1f} s"
                )
        _image_lines(app, images)

    app.out.result({"model": doc, "images": images}, render)


def _image_lines(app: App, images: dict[str, Any] | None) -> None:
    for ref, image in (images or {}).items():
        if "hosts" not in image:
            app.out.line(f"image {ref}: {image.get('skipped')}")
            continue
        taken = [h for h in image["hosts"].values() if h["state"] == "ready"]
        sources = sorted({h["source"] for h in taken})
        app.out.line(
            f"image {ref}: on {len(image['hosts'])} host(s), {len(taken)} took it "
            f"({', '.join(sources) or 'none needed'}) in {image['seconds']:.1f} s"
        )


@click.command()
@SPEC
@FLEET
@PARTIAL
@click.option(
    "--dry-run",
    is_flag=True,
    help="Plan, then run the playbook in check+diff mode; change nothing.",
)
@click.option(
    "--converge",
    is_flag=True,
    help="Run the playbooks even when every host matches the last deploy "
    "(by default a quick check over SSH skips them then).",
)
@click.option(
    "--skip-unreachable",
    is_flag=True,
    help="Converge the hosts that answer and leave those that do not as they are (by default "
    "an unreachable host of the plan refuses the deploy, naming every such host).",
)
@click.option("-y", "--yes", is_flag=True, help="Apply without asking.")
@click.option(
    "--certify",
    is_flag=True,
    help="Before applying, test the plan's KV paths (every prefill slot's NICs to every "
    "decode slot's on another host, perftest) and refuse to deploy if one fails.",
)
@fabric_cli.run_options
@pass_app
def deploy(
    app: App,
    spec: Path,
    fleet: str | None,
    allow_partial: bool,
    dry_run: bool,
    converge: bool,
    skip_unreachable: bool,
    yes: bool,
    certify: bool,
    duration: int,
    iterations: int | None,
    parallel_rails: bool,
    min_fraction: float,
) -> None:
    """Deploy (or update) the service in SPEC: plan, diff, confirm, apply."""
    options = None
    if certify:  # bad options are refused before anything is planned
        options = fabric_cli.options(
            duration=duration,
            iterations=iterations,
            parallel_rails=parallel_rails,
            min_fraction=min_fraction,
        )
    unreachable: dict[str, str] | None = {} if skip_unreachable else None
    _, _, planned = planning.make_plan(
        app.session,
        spec,
        fleet,
        allow_partial=allow_partial,
        create_key=not dry_run,
        unreachable=unreachable,
    )
    changes = planning.diff(services.stored_plan(app.workspace, planned.service), planned)
    for host, why in (unreachable or {}).items():
        app.out.warn(f"skipping {host}: unreachable ({why}); what runs there stays as it is")
    if not app.out.json_mode:
        _show_plan(app, planned, changes)
    if not dry_run and not yes:
        if not sys.stdin.isatty():
            raise InputError(
                "refusing to deploy without confirmation", hint="pass -y (or --dry-run)"
            )
        click.confirm(f"Deploy {planned.service} to fleet {planned.fleet}?", abort=True, err=True)
    certified = None if options is None else _certify(app, planned, options)
    with app.out.progress(
        f"deploy {planned.service}" + (" (dry run)" if dry_run else "")
    ) as progress:
        doc = deploys.apply(
            app.session,
            planned,
            progress,
            dry_run=dry_run,
            converge=converge,
            verbosity=app.out.verbosity,
            skip=set(unreachable or {}),
        )

    def render() -> None:
        hosts = doc.changed_hosts
        if not doc.converged:
            app.out.line(
                "no changes: every host holds what the last deploy applied "
                "(checked over SSH; --converge runs the playbooks anyway)"
            )
            _endpoint_line(app, doc)
            return
        for reason in doc.drift:
            app.out.line(f"converged because {reason}")
        if doc.skipped_hosts:
            app.out.line(f"skipped (unreachable): {', '.join(doc.skipped_hosts)}")
        if dry_run:
            app.out.line(
                f"dry run: would change {len(hosts)} host(s): {', '.join(hosts) or 'none'}"
            )
            return
        app.out.line(
            "no changes"
            if not hosts and not doc.rolled
            else f"changed {len(hosts)} host(s): {', '.join(hosts)}"
        )
        if doc.rolled:
            app.out.line(f"rolled: {', '.join(doc.rolled)}")
        if doc.model is not None:
            fetched = sum(h["fetched"] for h in doc.model["hosts"].values())
            app.out.line(
                f"model {doc.model['repo']}: ready on {len(doc.model['hosts'])} host(s), "
                f"{fetched / 1e6:.0f} MB fetched in {doc.model['seconds']:.1f} s"
            )
        _image_lines(app, doc.images)
        _endpoint_line(app, doc)

    if certified is None:
        app.out.result(doc, render)
    else:
        app.out.result({**doc.model_dump(mode="json"), "certify": certified}, render)


def _certify(app: App, planned: Plan, options: fabric_run.Options) -> dict[str, Any]:
    """The plan's KV paths tested (and shown); CheckFailed, with the report, if one failed."""
    with app.out.progress(f"certify {planned.service}'s KV paths") as progress:
        report = fabric_run.certify_plan(app.session, planned, options, progress)
    if not app.out.json_mode:
        fabric_cli.render(app, report, f"service {planned.service}: KV paths")
    if not report["ok"]:
        raise CheckFailed(
            f"KV path certification: {report['summary']}",
            hint="nothing was deployed; fix the links named above (`pdctl fleet check "
            f"{planned.fleet} --fabric` tests them all), or deploy without --certify",
            certify=report,
        )
    return report


def _render_status(app: App, doc: StatusResult) -> None:
    router = doc.groups.router
    app.out.line(f"service {doc.service} on fleet {doc.fleet}")
    _endpoint_line(app, doc)
    if doc.state != "applied":
        app.out.line(
            f"state: {doc.state}: a deploy started and did not complete"
            + (
                f"; re-run `pdctl deploy` or undo it with `pdctl destroy {doc.service}`"
                if doc.state == "failed"
                else " (it is still running)"
            )
        )
    app.out.line(f"health: {doc.health}")
    app.out.line(f"router on {router.host}: {router.state}")
    if len(doc.routers) > 1 or doc.failover_address:
        where = f" behind {doc.failover_address}" if doc.failover_address else ""
        states = ", ".join(
            f"{r.host} {r.state}" + (f" ({r.error})" if r.error else "") for r in doc.routers
        )
        app.out.line(f"routers{where}: {states}")
    for host, why in doc.unreachable.items():
        app.out.line(f"{host}: unreachable: {why}")
    _render_scaler(app, doc.scaler)
    if doc.model is not None:
        hosts = ", ".join(f"{host} {state}" for host, state in doc.model.hosts.items())
        size = f", {doc.model.bytes / 1e6:.0f} MB" if doc.model.bytes else ""
        app.out.line(f"model {doc.model.repo}@{doc.model.revision}{size}: {hosts}")
    rows = []
    for role in WORKER_ROLES:
        group = doc.groups.worker(role)
        for r in group.replicas:
            rows.append(
                (
                    f"{role}/{r.slot}",
                    r.host,
                    r.port,
                    r.state,
                    r.router_status or ("-" if not r.registered else "?"),
                    "stale" if r.stale else "",
                )
            )
        desired = group.desired if group.desired is not None else "-"
        bounds = f"{group.min}..{group.max}"
        pinned = f", pinned {group.pinned}" if group.pinned is not None else ""
        last = group.last_decision
        signal = last.signal_text() if last else None
        why = (f", {signal}" if signal else "") + (f" ({last.reason})" if last else "")
        app.out.line(
            f"{role}: {group.running} running, desired {desired}{pinned}, bounds {bounds}{why}"
        )
        if last is not None and last.refusal:
            app.out.line(f"  scale-out refused: {last.refusal}")
        if group.host_loss is not None:
            loss = group.host_loss
            verdict = "survives" if loss.survives else "does NOT survive"
            worst = f" (losing {loss.worst_host} leaves {loss.left})" if loss.worst_host else ""
            app.out.line(
                f"  {group.spares} spare slot(s); {verdict} the loss of one more host for "
                f"{loss.need} replica(s){worst}"
            )
    app.out.table(["replica", "host", "port", "unit", "router", "config"], rows)
    for role in WORKER_ROLES:
        for r in doc.groups.worker(role).replicas:
            if r.last_log is not None:
                app.out.line(
                    f"{role}/{r.slot} {r.state} after {r.restarts} restart(s): {r.last_log}"
                )


def _render_scaler(app: App, scaler: ScalerStatus) -> None:
    rps = "n/a" if scaler.rps is None else f"{scaler.rps:.2f}"
    mode = ", advising only (acts on nothing)" if scaler.mode == "advise" else ""
    app.out.line(f"scaler: {'running' if scaler.running else 'not running'}, rps {rps}{mode}")
    if scaler.budget:
        app.out.line(f"scaler: {_budget_line(scaler.budget)}")
    for host, seen in scaler.hosts.items():
        app.out.line(f"scaler: {host} {seen.get('state')}: {seen.get('error') or 'no answer'}")
    if scaler.fenced:
        app.out.line(f"scaler: fenced until stopped on their host: {', '.join(scaler.fenced)}")


def _budget_line(budget: dict[str, Any]) -> str:
    """e.g. "GPUs: this service 8 of max_gpus 16; fleet 20 of 20 (a 8, b 12)"."""
    parts = []
    if "using" in budget:
        cap = f" of max_gpus {budget['max_gpus']}" if "max_gpus" in budget else ""
        parts.append(f"this service {budget['using']}{cap}")
    if "budget" in budget and "used" in budget:
        holders = ", ".join(f"{k} {v}" for k, v in (budget.get("holders") or {}).items())
        parts.append(
            f"fleet {budget['used']} of {budget['budget']}" + (f" ({holders})" if holders else "")
        )
    if "error" in budget:
        parts.append(f"ledger unavailable: {budget['error']}")
    return "GPUs: " + "; ".join(parts)


@click.command()
@click.argument("service")
@click.option(
    "--certify",
    is_flag=True,
    help="Also test the service's KV paths (every prefill slot's NICs to every decode "
    "slot's on another host, perftest); exit non-zero if one fails.",
)
@fabric_cli.run_options
@pass_app
def status(
    app: App,
    service: str,
    certify: bool,
    duration: int,
    iterations: int | None,
    parallel_rails: bool,
    min_fraction: float,
) -> None:
    """Replicas per host, unit states and the router's view, read live.

    A host that does not answer is shown as unreachable (exit 0); exit 8 when the service
    itself is down (its router does not answer or is not ready)."""
    doc = statuses.status(app.session, service)
    down = statuses.status_failure(doc)
    if not certify:
        emit(app, doc, lambda: _render_status(app, doc), down)
        return
    options = fabric_cli.options(
        duration=duration,
        iterations=iterations,
        parallel_rails=parallel_rails,
        min_fraction=min_fraction,
    )
    with app.out.progress(f"certify {service}'s KV paths") as progress:
        report = fabric_run.certify_plan(
            app.session, services.load_plan(app.workspace, service), options, progress
        )

    def render() -> None:
        _render_status(app, doc)
        fabric_cli.render(app, report, f"service {service}: KV paths")

    failure: PdctlError | None = down
    if failure is None and not report["ok"]:
        failure = CheckFailed(
            f"KV path certification: {report['summary']}",
            hint=f"`pdctl fleet check {doc.fleet} --fabric` tests every link of the fleet",
        )
    emit(app, {**doc.model_dump(mode="json"), "certify": report}, render, failure)


@click.command()
@click.argument("service")
@click.option(
    "--show-key",
    is_flag=True,
    help="Also print the router's API key (read over SSH from the router host).",
)
@pass_app
def endpoint(app: App, service: str, show_key: bool) -> None:
    """The service's URL for clients and, with --show-key, the router's API key."""
    doc = endpoints.endpoint(app.session, service, show_key=show_key)

    def render() -> None:
        if show_key:
            app.out.line(f"endpoint: {doc.endpoint}")
            app.out.line(f"api key:  {doc.api_key}")
        else:
            _endpoint_line(app, doc)
        if len(doc.endpoints) > 1 and doc.endpoint in doc.endpoints:
            # No failover address: clients that fail over themselves take every router.
            app.out.line(f"every router: {' '.join(doc.endpoints)}")

    app.out.result(doc, render)


@click.command()
@click.argument("service")
@click.argument("replica", metavar="GROUP/SLOT")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "--lines", default=100, show_default=True, help="How many lines of history.")
@pass_app
def logs(app: App, service: str, replica: str, follow: bool, lines: int) -> None:
    """The journal of one replica (e.g. decode/2), over SSH."""

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    replica_logs.logs(app.session, service, replica, lines, follow, write)


@click.command()
@click.argument("service")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Show what would be deregistered and removed on each host; change nothing.",
)
@pass_app
def destroy(app: App, service: str, yes: bool, dry_run: bool) -> None:
    """Deregister, drain, stop and remove the service; hosts are left as before."""
    if not yes and not dry_run:
        if not sys.stdin.isatty():
            raise InputError(
                "refusing to destroy without confirmation",
                hint="pass -y, or --dry-run to see what would go",
            )
        click.confirm(f"Destroy service {service}?", abort=True, err=True)
    title = f"destroy {service}" + (" (dry run)" if dry_run else "")
    with app.out.progress(title) as progress:
        doc = destroys.destroy(app.session, service, progress, dry_run=dry_run)

    def render() -> None:
        if not doc.dry_run:
            app.out.line(f"destroyed {service} on {', '.join(doc.hosts)}")
            return
        if doc.deregistered:
            app.out.line(f"would deregister and drain {', '.join(doc.deregistered)}")
        for host in doc.hosts:
            items = doc.would_remove.get(host, [])
            app.out.line(f"{host}: would remove {len(items)}: {', '.join(items) or 'nothing'}")
        app.out.line(f"dry run: nothing changed; `pdctl destroy {service} -y` removes it")

    app.out.result(doc, render)
