"""The object every command receives in ``ctx.obj``."""

from __future__ import annotations

from dataclasses import dataclass

import click

from pdctl.output import Output
from pdctl.workspace import Workspace


@dataclass
class App:
    out: Output
    workspace: Workspace


pass_app = click.make_pass_decorator(App)
