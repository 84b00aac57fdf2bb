"""A model hub's refusal as the one line a user acts on. PURE.

The hub answers a model it does not have with 404 (``X-Error-Code: RepoNotFound``,
``RevisionNotFound``), a token it does not accept with 401 ("Invalid credentials in
Authorization header"), a gated model the token may not read with 403 (or ``GatedRepo``),
and, to anyone without a token, a private or missing model with the same 401
(docs/facts.md, "Hugging Face Hub API"). Each is the user's to fix (the spec's model or
revision, the HF_TOKEN they export), never the hosts' or their disks'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdctl.core.errors import InputError

REFUSALS = frozenset({401, 403, 404})
ERROR_CODES = frozenset({"RepoNotFound", "RevisionNotFound", "EntryNotFound", "GatedRepo"})
# The hub's words for a token it does not accept (a message, not a secret).
BAD_TOKEN = "Invalid credentials in Authorization header"  # noqa: S105


def describe(status: int, code: str | None, error: str | None) -> dict[str, Any] | None:
    """What a fetcher reports of a hub's refusal (None: not one): the status, the Hub's error
    code when it is one of the known ones, and whether the hub said the token is invalid."""
    if status not in REFUSALS:
        return None
    return {
        "status": status,
        "code": code if code in ERROR_CODES else None,
        "bad_token": (error or "").strip() == BAD_TOKEN,
    }


def refusal(
    report: Mapping[str, Any], endpoint: str, repo: str, revision: str, token: bool
) -> InputError | None:
    """The error for a fetcher's report (describe()'s, read back from a host: checked as
    data); None when the report is no refusal. ``token``: whether HF_TOKEN was sent."""
    status = report.get("status")
    if not isinstance(status, int) or isinstance(status, bool) or status not in REFUSALS:
        return None
    code = report.get("code")
    missing = f"the hub at {endpoint} has no model {repo} at revision {revision}"
    not_found = code in {"RepoNotFound", "RevisionNotFound", "EntryNotFound"}
    if status == 404 or (not_found and token):
        return InputError(missing, hint="check the name and the revision")
    refused_token = status == 403 or code == "GatedRepo" or report.get("bad_token") is True
    if token and refused_token:
        return InputError(
            f"the hub at {endpoint} refused HF_TOKEN for {repo}",
            hint="a gated or private model needs a token with access",
        )
    if token:  # a 401 the hub gives a missing model and a token it ignores alike
        return InputError(
            f"{missing}, or it refused HF_TOKEN for it",
            hint="check the name and the revision; a gated or private model needs a token "
            "with access",
        )
    return InputError(
        f"{missing}, or the model is gated or private and needs a token",
        hint="check the name and the revision; for a gated or private model, export HF_TOKEN "
        "and list it in the spec's env",
    )
