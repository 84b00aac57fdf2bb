"""The object every command receives in ``ctx.obj``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from pdctl.cli.output import Output
from pdctl.core.errors import PdctlError
from pdctl.doors.session import Session
from pdctl.doors.workspace import Workspace


@dataclass
class App:
    out: Output
    workspace: Workspace
    session: Session  # what the command's operations share of the fleets (doors/session.py)


pass_app = click.make_pass_decorator(App)


def emit(app: App, doc: Any, render: Callable[[], None], failure: PdctlError | None = None) -> None:
    """Print a command's result; when it also failed, say so and exit non-zero.

    The result document stays the one JSON document on stdout (it carries the
    failure's details), so scripts get both the findings and the exit code.
    """
    app.out.result(doc, render)
    if failure is not None:
        if not app.out.json_mode:
            app.out.err.print(f"error: {failure.one_line()}", markup=False, style="bold red")
        raise click.exceptions.Exit(failure.exit_code)
