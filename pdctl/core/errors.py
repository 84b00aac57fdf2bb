"""The one error path: every failure a user can cause or fix is a PdctlError.

The CLI turns these into one line on stderr (or an ``{"error": ...}`` document
with ``--json``) and the class's exit code. Anything else is a bug and is
reported as such (with a traceback only under ``PDCTL_DEBUG=1``).
"""

from __future__ import annotations

from typing import Any


class PdctlError(Exception):
    """A failure the user can act on: what happened, where, and how to fix it."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": self.kind,
            "message": self.message,
            "exit_code": self.exit_code,
        }
        if self.hint:
            doc["hint"] = self.hint
        if self.details:
            doc["details"] = self.details
        return doc


class InputError(PdctlError):
    """A file or argument the user gave is malformed (spec, inventory, option)."""

    exit_code = 3
    kind = "invalid_input"


class HostError(PdctlError):
    """A host could not be reached or a remote step failed on it."""

    exit_code = 4
    kind = "host"


class CheckFailed(PdctlError):
    """A validation ran and found problems (preflight, plan capacity)."""

    exit_code = 5
    kind = "check_failed"


class EnvironmentProblem(PdctlError):
    """This machine lacks what the command needs (root, a tool, a kernel feature)."""

    exit_code = 6
    kind = "environment"


class NotFound(PdctlError):
    """A named thing (fleet, service, host, replica) does not exist."""

    exit_code = 7
    kind = "not_found"


class ServiceDown(PdctlError):
    """The service does not serve: its router does not answer or is not ready (no healthy
    prefill and decode). `pdctl status` still prints everything it could read."""

    exit_code = 8
    kind = "service_down"


class Interrupted(PdctlError):
    exit_code = 130
    kind = "interrupted"
