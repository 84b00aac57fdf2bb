"""What every reader of a host's raw document shares: the parse error, a command's result
read out of the document, and the short forms messages quote.

The parsers (ibverbs.py, amd.py, nvidia.py, runtime.py) raise ParseError with what they expected
when a tool printed something else; ``parse_output`` turns that, or a failed run, into one line
for the facts' errors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from pdctl.onhost.hardware.documents import RC_NOT_FOUND


class ParseError(ValueError):
    """Tool output that is not in the expected format; the message says what was expected."""


def snippet(text: str, limit: int = 90) -> str:
    """The first non-blank line of text, shortened, for messages."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    if not line:
        return "(empty)"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def load_json(text: str, what: str) -> Any:
    stripped = text.strip()
    if not stripped:
        raise ParseError(f"expected JSON from {what}, got empty output")
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    # Some builds print warnings (Python SyntaxWarnings, "WARNING: ...") ahead of the document.
    decoder = json.JSONDecoder()
    for match in re.finditer(r"^[\[{]", stripped, re.MULTILINE):
        try:
            return decoder.raw_decode(stripped, match.start())[0]
        except ValueError:
            continue
    raise ParseError(f"expected JSON from {what}, got {snippet(stripped)!r}")


def command_result(raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    commands = raw.get("commands")
    cmd = commands.get(key) if isinstance(commands, dict) else None
    if not isinstance(cmd, dict) or not isinstance(cmd.get("rc"), int):
        return None
    return {
        "argv": cmd.get("argv") or [key],
        "rc": cmd["rc"],
        "stdout": str(cmd.get("stdout") or ""),
        "stderr": str(cmd.get("stderr") or ""),
    }


def stderr_summary(cmd: dict[str, Any]) -> str:
    """The line that says why a command failed: the first that is not a provider warning."""
    lines = [line.strip() for line in cmd["stderr"].splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith("libibverbs: Warning")]
    if useful:
        return clip(useful[0], 100)
    if lines:
        return clip(lines[0], 100)
    return f"exit status {cmd['rc']}, no error text"


def command_label(cmd: dict[str, Any]) -> str:
    return " ".join(str(part) for part in cmd["argv"])


def installed(cmd: dict[str, Any] | None) -> bool:
    return cmd is not None and cmd["rc"] != RC_NOT_FOUND


def parse_output(
    cmd: dict[str, Any] | None, parser: Callable[[str], Any], errors: list[str]
) -> Any | None:
    """parser(stdout), or None with the reason appended to errors. A missing tool is no error."""
    if cmd is None or cmd["rc"] == RC_NOT_FOUND:
        return None
    if cmd["rc"] != 0 and not cmd["stdout"].strip():
        errors.append(f"{command_label(cmd)} exited {cmd['rc']}: {stderr_summary(cmd)}")
        return None
    try:
        return parser(cmd["stdout"])
    except ParseError as exc:
        if cmd["rc"] != 0:
            errors.append(f"{command_label(cmd)} exited {cmd['rc']}: {stderr_summary(cmd)}")
        else:
            errors.append(f"{command_label(cmd)}: {exc}")
        return None


def as_dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
