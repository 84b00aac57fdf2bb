"""A worker group's `commands` as the container's entrypoint script. PURE: stdlib only.

The commands come from a service file, which is untrusted input, and become lines of
a script that `/bin/sh` (dash in Debian images) runs. So they are parsed as POSIX shell
(shell.py) rather than matched with regexes: every rewrite is a splice at a word's span in the
original text (all other quoting and `$VARS` stay as written), and a command that pdctl
cannot rewrite with certainty is refused with a CommandError saying how to write it
instead. A script is never produced silently broken.

The script is ``set -e`` and then the commands, one per line, as written except that
- the launch command (SGLang's ``python -m sglang.launch_server ...``, vLLM's
  ``vllm serve ... --grpc`` or ``python -m vllm.entrypoints.grpc_server``: pdctl/core/launch.py)
  gets the slot's ports: ``--port $PDCTL_PORT``, ``--host $PDCTL_HOST`` unless a host is
  given and, for an SGLang prefill, ``--disaggregation-bootstrap-port $PDCTL_BOOTSTRAP_PORT``;
  and the flags the plan adds (``--enable-metrics`` for latency scaling: spec.added_flags);
- the last command runs with ``exec``: it replaces the shell, so it is the container's
  PID 1 and gets the SIGTERM of a stop, on which SGLang drains (a shell as PID 1 would
  not pass the signal on).

Every command must be complete on its own (quotes, here-documents, `if ... fi`), so
that joining them as lines cannot change how any of them parses.
"""

from __future__ import annotations

from typing import Literal

from pdctl.core import launch as launches
from pdctl.core import layout
from pdctl.core.launch import Launch, LaunchError
from pdctl.core.shell import (
    CommandError,
    ParsedCommand,
    SimpleCommand,
    Word,
    parse_command,
    shell_words,
)

__all__ = [
    "BOOTSTRAP_PORT",
    "HOST",
    "PORT",
    "CommandError",
    "Word",
    "find_launch",
    "shell_words",
    "worker_script",
]

PORT = f"${layout.ENV_PORT}"
HOST = f"${layout.ENV_HOST}"
BOOTSTRAP_PORT = f"${layout.ENV_BOOTSTRAP_PORT}"


def worker_script(
    commands: list[str], role: Literal["prefill", "decode"], add: tuple[str, ...] = ()
) -> str:
    """The group's commands as the container's shell script, wired to the slot's ports;
    ``add``: flags (without values) the launch gets unless it has them (spec.added_flags)."""
    if not commands:
        raise CommandError(
            "the group has no commands",
            "add the command that starts the server: python -m sglang.launch_server ...",
        )
    parsed = _parse_all(commands)
    last = len(parsed) - 1
    found = _find_launch(parsed)
    if found is not None and found[0] != last:
        raise CommandError(
            f"the {found[1].name} launch command must be the group's last command",
            "move the commands after it before it: pdctl runs the last command with exec, so "
            "that the server is the container's PID 1 and gets the SIGTERM that makes it drain",
            found[0],
        )
    for index, command in enumerate(parsed[:-1]):
        _check_not_exec(command, index)
    try:
        final = _last_line(parsed[-1], role, found[1] if found is not None else None, add)
    except CommandError as exc:
        raise exc.at(last) from None
    lines = ["set -e", *(command.text[: command.end] for command in parsed[:-1]), final]
    return "\n".join(lines) + "\n"


def _parse_all(commands: list[str]) -> list[ParsedCommand]:
    """Each command parsed; a CommandError names the command's index."""
    parsed: list[ParsedCommand] = []
    for index, text in enumerate(commands):
        try:
            parsed.append(parse_command(text))
        except CommandError as exc:
            raise exc.at(index) from None
    return parsed


def find_launch(commands: list[str]) -> Launch | None:
    """The server launch among a group's commands (None: none of them starts one), with its
    engine and, for vLLM, its KV connector and role. CommandError as worker_script's."""
    found = _find_launch(_parse_all(commands))
    return found[1] if found is not None else None


# Builtins with no program of the same name: `exec` cannot run them.
_SHELL_ONLY = frozenset(
    {
        ".", ":", "alias", "bg", "break", "cd", "command", "continue", "eval", "exit",
        "export", "fg", "getopts", "hash", "jobs", "local", "read", "readonly", "return",
        "set", "shift", "source", "times", "trap", "type", "ulimit", "umask", "unalias",
        "unset", "wait",
    }
)  # fmt: skip

_SPLIT_HINT = (
    "put setup such as `cd DIR` or `export X=1` in its own command before it: each command "
    "is a line of the script, run under set -e"
)

_LINE_BREAK_HINT = (
    "continue a long command with a `\\` at the end of each line; a `#` comment runs to the "
    "end of its line and takes that `\\` with it, so put comments after the last line"
)


def _find_launch(parsed: list[ParsedCommand]) -> tuple[int, Launch] | None:
    """The index of the group's launch command and what it launches, checked to be a plain
    command."""
    launch: tuple[int, Launch] | None = None
    for index, command in enumerate(parsed):
        try:
            found = _launch_in(command.words)
        except CommandError as exc:
            raise exc.at(index) from None
        if found is None:
            code = command.code()
            mention = next((m for m in launches.MENTIONS if m in code), None)
            if mention is not None:
                raise CommandError(
                    f"the command mentions {mention}, but not as a command that pdctl can "
                    "give the slot's ports: it is inside quotes, a variable or a substitution",
                    "write the launch as a command of its own: python -m sglang.launch_server "
                    "..., vllm serve MODEL --grpc ...",
                    index,
                )
            continue
        try:
            simple = _plain(command, launch=found.name)
            found = _launch_in(simple.words) or found
        except CommandError as exc:
            raise exc.at(index) from None
        if launch is not None:
            raise CommandError(
                f"the group has a second launch command; the first is commands[{launch[0]}]",
                "keep one: each replica of the group runs one server",
                index,
            )
        launch = (index, found)
    return launch


def _launch_in(words: list[Word]) -> Launch | None:
    try:
        return launches.find([word.value for word in words])
    except LaunchError as exc:
        raise CommandError(exc.problem, exc.hint) from None


def _check_not_exec(command: ParsedCommand, index: int) -> None:
    for item in command.items:
        simple = item.simple
        if simple is not None and len(simple.words) > 1 and simple.words[0].value == "exec":
            raise CommandError(
                "only the last command may exec a program: the commands after this one would "
                "never run",
                "drop the `exec`: pdctl adds it to the last command",
                index,
            )


def _plain(command: ParsedCommand, *, launch: str | None) -> SimpleCommand:
    """The command as one simple command, or a CommandError naming what is in the way."""
    items = command.items
    if not items:
        raise CommandError(
            "the last command is empty, but it must start the server",
            "end the commands with the one that starts the server",
        )
    found = ""
    hint = _SPLIT_HINT
    if len(items) > 1 or items[0].separator:
        separator = items[0].separator
        found = "a line break" if separator == "\n" else f"`{separator}`"
        if separator == "\n":
            hint = _LINE_BREAK_HINT
    elif items[0].simple is None:
        found = f"`{command.constructs[0]}`" if command.constructs else "a compound command"
    elif launch and items[0].simple.redirections:
        found = f"`{items[0].simple.redirections[0]}`"
        hint = "drop the redirection: the server's output goes to the unit's journal"
    simple = items[0].simple
    if found or simple is None:
        if launch:
            raise CommandError(
                f"the {launch} launch command must be a plain command of its own, "
                f"but it has {found}",
                hint,
            )
        raise CommandError(
            "the last command must be a plain command, which pdctl runs with exec so that it "
            f"is the container's PID 1 and gets SIGTERM, but it has {found}",
            "make the server launch the last command, on its own, and move the rest into "
            "commands before it",
        )
    return simple


_Edit = tuple[int, int, str]


def _last_line(
    command: ParsedCommand,
    role: Literal["prefill", "decode"],
    launch: Launch | None,
    add: tuple[str, ...],
) -> str:
    simple = _plain(command, launch=launch.name if launch is not None else None)
    edits = _exec_edits(simple)
    if launch is not None:
        edits += _port_edits(simple, role, launch, add)
    text = command.text[: command.end]
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def _exec_edits(simple: SimpleCommand) -> list[_Edit]:
    if not simple.words:
        raise CommandError(
            "the last command only sets variables, so the container has no program to run",
            "end the commands with the one that starts the server",
        )
    first = simple.words[0]
    if first.value == "exec":
        if len(simple.words) == 1:
            raise CommandError(
                "the last command is an `exec` without a program",
                "end the commands with the one that starts the server",
            )
        return []
    if first.value in _SHELL_ONLY:
        raise CommandError(
            f"the last command runs the shell builtin `{first.value}`, which exec cannot run",
            "end the commands with the one that starts the server",
        )
    # `A=1 exec prog` exports A to prog in POSIX sh (dash too); `exec A=1 prog` would not.
    return [(first.start, first.start, "exec ")]


def _port_edits(
    simple: SimpleCommand, role: Literal["prefill", "decode"], launch: Launch, add: tuple[str, ...]
) -> list[_Edit]:
    words = simple.words
    args = words[launch.at + 1 :]
    appended = "".join(f" {flag}" for flag in add if not launch.has_flag(flag))
    wanted = [("--port", PORT, True), ("--host", HOST, False)]
    # vLLM's NIXL side channel takes its port from the environment (the slot's env file).
    if role == "prefill" and launch.engine == "sglang":
        wanted.append(("--disaggregation-bootstrap-port", BOOTSTRAP_PORT, True))
    edits: list[_Edit] = []
    for flag, value, replace in wanted:
        found = False
        for index, word in enumerate(args):
            name, inline, _ = word.value.partition("=")
            if not _abbreviates(name, flag):
                continue
            found = True
            if inline:
                if replace:
                    edits.append((word.start, word.end, f"{flag}={value}"))
                continue
            if index + 1 == len(args) or args[index + 1].value.startswith("-"):
                raise CommandError(
                    f"`{word.text}` has no value",
                    f"write `{flag} VALUE`, or leave the flag out: pdctl sets it for each slot",
                )
            if replace:
                following = args[index + 1]
                edits.append((following.start, following.end, value))
        if not found:
            appended += f" {flag} {value}"
    if appended:
        # After the last word: before a trailing comment, continuation or line break.
        edits.append((words[-1].end, words[-1].end, appended))
    return edits


def _abbreviates(name: str, flag: str) -> bool:
    """Whether argparse reads option `name` as `flag` (it takes unambiguous prefixes)."""
    return len(name) > 2 and name.startswith("--") and flag.startswith(name)
