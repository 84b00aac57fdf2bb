"""`pdctl scaler run` (the daemon), `pdctl scaler advise` (its decisions, not acted on) and
`pdctl scale` (a manual override)."""

from __future__ import annotations

import time
from pathlib import Path

import click
from pydantic import TypeAdapter, ValidationError

from pdctl.cli.app import App, pass_app
from pdctl.core.layout import GROUPS
from pdctl.core.scaling.decide import Decision
from pdctl.core.spec.values import Duration
from pdctl.scaler import control
from pdctl.scaler.advise import advise as advise_for
from pdctl.scaler.daemon import log, run_on_host, service_lock, stop_on_signals
from pdctl.scaler.metrics import serve_metrics
from pdctl.scaler.setup import default_config, from_workspace


@click.group()
def scaler() -> None:
    """The autoscaler daemon."""


@scaler.command()
@click.option("--service", required=True, help="The service to scale.")
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"Config written by deploy on the router host [default: {default_config('SVC')} "
    "if present, else this workspace's plan].",
)
@click.option(
    "--interval",
    type=float,
    help="Seconds between ticks [default: the plan's, pdctl.scaler.interval of the spec].",
)
@click.option(
    "--metrics-port", type=int, help="Serve the scaler's Prometheus metrics on 127.0.0.1:PORT."
)
@pass_app
def run(
    app: App,
    service: str,
    config: Path | None,
    interval: float | None,
    metrics_port: int | None,
) -> None:
    """Run the scaler in the foreground (SIGTERM: finish the action in hand, then exit)."""
    config = config or default_config(service)
    if config.is_file():
        run_on_host(service, config, metrics_port)
        return
    control.refuse_if_daemon_runs(app.workspace, service)
    lock = app.workspace.service_dir(service) / "scaler.lock"
    with (
        service_lock(lock),
        from_workspace(app.workspace, service, log, interval=interval) as daemon,
    ):
        if metrics_port:
            serve_metrics(daemon.metrics, "127.0.0.1", metrics_port)
        with stop_on_signals(daemon):
            daemon.run()


class DurationType(click.ParamType):  # type: ignore[type-arg]
    """A duration as the spec writes one: 90, 90s, 10m, 1h."""

    name = "duration"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            return float(TypeAdapter(Duration).validate_python(value))
        except ValidationError as exc:
            self.fail(exc.errors()[0]["msg"].removeprefix("Value error, "), param, ctx)


ADVICE = "{:<8}  {:<7}  {:<8}  {:<6}  {:<38}  {}"


def _advice_row(at: float, decision: Decision) -> str:
    return ADVICE.format(
        time.strftime("%H:%M:%S", time.localtime(at)),
        decision.group,
        f"{decision.current} -> {decision.desired}",
        decision.action,
        decision.signal_text() or "",
        decision.reason,
    )


@scaler.command()
@click.argument("service")
@click.option(
    "--for",
    "seconds",
    type=DurationType(),
    default="10m",
    show_default=True,
    help="How long to advise (90s, 10m, 1h).",
)
@click.option(
    "--interval",
    type=float,
    help="Seconds between decisions [default: the plan's, pdctl.scaler.interval of the spec].",
)
@click.option(
    "--metrics-port", type=int, help="Serve the advising scaler's metrics on 127.0.0.1:PORT."
)
@pass_app
def advise(
    app: App, service: str, seconds: float, interval: float | None, metrics_port: int | None
) -> None:
    """Show the decisions SERVICE's scaler would take (signal, target, reason), acting on
    nothing: beside its acting scaler, or before letting one act. Ctrl-C ends it early."""

    def show(at: float, decision: Decision) -> None:
        app.out.line(_advice_row(at, decision))

    with from_workspace(app.workspace, service, log, interval=interval, advise=True) as daemon:
        if metrics_port:
            serve_metrics(daemon.metrics, "127.0.0.1", metrics_port)
        app.out.info(
            f"advising {service} for {seconds:g} s, a decision every {daemon.interval:g} s: "
            "nothing is acted on"
        )
        app.out.line(ADVICE.format("time", "group", "replicas", "action", "signal", "reason"))
        with stop_on_signals(daemon):
            doc = advise_for(daemon, seconds, show)

    def render() -> None:
        rows = [
            [group, counts["up"], counts["down"], counts["hold"], counts["refused"],
             (counts["last"] or {}).get("desired")]
            for group, counts in doc["summary"].items()
        ]  # fmt: skip
        title = f"{doc['ticks']} decisions per group over {doc['for']:g} s"
        app.out.table(["group", "up", "down", "hold", "refused", "last desired"], rows, title)

    app.out.result(doc, render)


@click.command()
@click.argument("service")
@click.argument("group", type=click.Choice(GROUPS))
@click.argument("count", metavar="N|auto")
@pass_app
def scale(app: App, service: str, group: str, count: str) -> None:
    """Pin GROUP to N replicas (within its bounds) until `pdctl scale SVC GROUP auto`."""
    with app.out.progress(f"scale {service} {group} {count}") as progress:
        doc = control.pin(app.workspace, service, group, count, progress)
    app.out.result(doc, lambda: app.out.line(doc["message"]))
