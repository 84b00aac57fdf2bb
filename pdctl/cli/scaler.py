"""`pdctl scaler run` (the daemon) and `pdctl scale` (a manual override)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from pdctl.cli.app import App, pass_app
from pdctl.layout import GROUPS, Layout
from pdctl.scaler import control
from pdctl.scaler.loop import serve_metrics, service_lock, stop_on_signals
from pdctl.scaler.setup import default_config, from_workspace, on_host


@click.group()
def scaler() -> None:
    """The autoscaler daemon."""


def _log(line: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    sys.stderr.write(f"{stamp} {line}\n")
    sys.stderr.flush()


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
        lock = Path(Layout(service).scaler_lock)
        with service_lock(lock), on_host(config, _log) as (daemon, settings):
            port = metrics_port or settings.get("metrics", {}).get("port")
            if port:
                serve_metrics(
                    daemon.metrics, settings.get("metrics", {}).get("host", "127.0.0.1"), int(port)
                )
            with stop_on_signals(daemon):
                daemon.run()
        return
    control.refuse_if_daemon_runs(app.workspace, service)
    lock = app.workspace.service_dir(service) / "scaler.lock"
    with (
        service_lock(lock),
        from_workspace(app.workspace, service, _log, interval=interval) as daemon,
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
