"""`pdctl scaler run` (the daemon) and `pdctl scale` (a manual override)."""

from __future__ import annotations

from pathlib import Path

import click

from pdctl.cli.app import App, pass_app
from pdctl.core.layout import GROUPS
from pdctl.scaler import control
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
