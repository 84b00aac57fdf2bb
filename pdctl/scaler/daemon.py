"""The scaler as a process: one per service (a lock), SIGTERM finishes the action in hand, its
metrics on a port; and its entry on the router host.

``python -m pdctl.scaler run --service S --config F`` is what pd-<svc>-scaler.service runs
there: the pd_scaler role keeps the bundle of pdctl.scaler (what it imports of pdctl, and
nothing else: pdctl/onhost/bundle.py) in a file the unit feeds to the loader on its stdin. The
operator's ``pdctl scaler run`` (pdctl/cli/scaler.py) runs the same daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from pdctl.core.errors import EnvironmentProblem, PdctlError
from pdctl.core.layout import Layout
from pdctl.scaler.loop import Scaler
from pdctl.scaler.metrics import serve_metrics
from pdctl.scaler.setup import default_config, on_host


@contextlib.contextmanager
def service_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise EnvironmentProblem(
                f"another scaler holds {path}",
                hint="one scaler per service: stop the other one first",
            ) from exc
        yield


@contextlib.contextmanager
def stop_on_signals(scaler: Scaler) -> Iterator[None]:
    """SIGTERM/SIGINT: finish the action in hand, then leave the loop."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        scaler.log(f"signal {signum}: finishing the current action, then exiting")
        scaler.stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def log(line: str) -> None:
    """One line on stderr (the unit's journal), stamped."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    sys.stderr.write(f"{stamp} {line}\n")
    sys.stderr.flush()


def run_on_host(service: str, config: Path, metrics_port: int | None = None) -> None:
    """The scaler of ``service`` as the pd_scaler role configured it on this host."""
    with (
        service_lock(Path(Layout(service).scaler_lock)),
        on_host(config, log) as (
            daemon,
            settings,
        ),
    ):
        port = metrics_port or settings.get("metrics", {}).get("port")
        if port:
            host = settings.get("metrics", {}).get("host", "127.0.0.1")
            serve_metrics(daemon.metrics, host, int(port))
        with stop_on_signals(daemon):
            daemon.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdctl.scaler", description="The scaler of a service, on its router host."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the scaler in the foreground")
    run.add_argument("--service", required=True)
    run.add_argument("--config", type=Path, help="the pd_scaler role's config file")
    run.add_argument("--metrics-port", type=int)
    args = parser.parse_args(argv)
    try:
        run_on_host(args.service, args.config or default_config(args.service), args.metrics_port)
    except PdctlError as exc:
        sys.stderr.write(f"error: {exc.one_line()}\n")
        return exc.exit_code
    return 0
