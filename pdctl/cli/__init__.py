"""The pdctl command line: parse, call one service function, print.

Global options go before the subcommand (``pdctl --json lab status``) and each
has an environment variable. ``main()`` is the one place that turns errors
into a line on stderr (or a JSON error document) and an exit code.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path

import click

from pdctl import __version__
from pdctl.cli.app import App
from pdctl.cli.output import Output
from pdctl.core.errors import Interrupted, PdctlError
from pdctl.doors.session import Session
from pdctl.doors.workspace import Workspace

# Each command's module, imported when the command runs (or --help lists it): a command pays
# for its own imports only (`pdctl status` need not load the lab, the fabric checks, the fleet
# commands), and the tests and scripts run pdctl many times.
COMMANDS = {
    "lab": "pdctl.cli.lab:lab",
    "fleet": "pdctl.cli.fleet:fleet",
    "plan": "pdctl.cli.service:plan",
    "deploy": "pdctl.cli.service:deploy",
    "prefetch": "pdctl.cli.service:prefetch",
    "status": "pdctl.cli.service:status",
    "endpoint": "pdctl.cli.service:endpoint",
    "logs": "pdctl.cli.service:logs",
    "destroy": "pdctl.cli.service:destroy",
    "scale": "pdctl.cli.scaler:scale",
    "scaler": "pdctl.cli.scaler:scaler",
}


class _LazyGroup(click.Group):
    """A group whose commands are imported by name (click's documented lazy-loading pattern)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        module, _, attribute = COMMANDS[cmd_name].partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{COMMANDS[cmd_name]} is not a click command")
        return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--json",
    "json_mode",
    is_flag=True,
    envvar="PDCTL_JSON",
    help="Machine output: one JSON document on stdout, errors included. [PDCTL_JSON]",
)
@click.option(
    "-v",
    "--verbose",
    count=True,
    envvar="PDCTL_VERBOSE",
    help="More detail on stderr. [PDCTL_VERBOSE]",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    envvar="PDCTL_QUIET",
    help="Only results and errors. [PDCTL_QUIET]",
)
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="PDCTL_HOME",
    default=Path(),
    show_default="current directory",
    help="Workspace for inventories, service state and lab files. [PDCTL_HOME]",
)
@click.version_option(__version__, prog_name="pdctl")
@click.pass_context
def cli(ctx: click.Context, json_mode: bool, verbose: int, quiet: bool, home: Path) -> None:
    """pdctl: run Prefill/Decode-disaggregated inference on GPU servers you own."""
    workspace = Workspace(home.resolve())
    session = Session(workspace)  # one per command: its fleets read once, one SSH pool each
    ctx.call_on_close(session.close)
    ctx.obj = App(
        out=Output(json_mode=json_mode, verbosity=verbose, quiet=quiet),
        workspace=workspace,
        session=session,
    )


def _json_requested(argv: list[str]) -> bool:
    """Whether --json was asked for, even when parsing failed before the root ran."""
    if os.environ.get("PDCTL_JSON", "").lower() in {"1", "true", "yes", "on"}:
        return True
    valued = {
        opt
        for param in cli.params
        if isinstance(param, click.Option) and not (param.is_flag or param.count)
        for opt in param.opts
    }
    args = iter(argv)
    for arg in args:
        if arg == "--json":
            return True
        if arg in valued:
            next(args, None)  # its value (`--home DIR`), not a subcommand
        elif not arg.startswith("-"):
            return False  # global options stop at the first subcommand
    return False


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    out = Output(json_mode=_json_requested(args))
    debug = os.environ.get("PDCTL_DEBUG") == "1"
    try:
        try:
            code = cli.main(args=args, prog_name="pdctl", standalone_mode=False)
        except KeyboardInterrupt as exc:
            raise Interrupted(
                "interrupted", hint="re-run the command; pdctl operations are idempotent"
            ) from exc
        except click.exceptions.Abort as exc:
            raise Interrupted("aborted") from exc
    except click.ClickException as exc:
        if debug:
            traceback.print_exc()
        out.error(
            {"kind": "usage", "message": exc.format_message(), "exit_code": exc.exit_code},
            exc.format_message(),
        )
        sys.exit(exc.exit_code)
    except PdctlError as exc:
        if debug:
            traceback.print_exc()
        out.error(exc.as_dict(), exc.one_line())
        sys.exit(exc.exit_code)
    except Exception as exc:  # a bug: say so in one line, trace only when asked
        if debug:
            traceback.print_exc()
        message = f"internal error: {type(exc).__name__}: {exc}"
        out.error(
            {"kind": "internal", "message": message, "exit_code": 70},
            f"{message} (re-run with PDCTL_DEBUG=1 for a traceback, and report it)",
        )
        sys.exit(70)
    sys.exit(code if isinstance(code, int) else 0)
