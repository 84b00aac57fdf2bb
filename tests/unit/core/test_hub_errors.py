"""A hub's refusal as one line (pdctl/core/hub_errors.py), for the answers the Hugging Face Hub
gives (docs/facts.md, "Hugging Face Hub API") and for what a host may send back instead."""

from __future__ import annotations

from typing import Any

import pytest

from pdctl.core.hub_errors import BAD_TOKEN, describe, refusal

HUB = "https://huggingface.co"


def line(status: int, code: str | None, error: str | None, token: bool) -> str | None:
    found = describe(status, code, error)
    refused = refusal(found, HUB, "org/m", "main", token) if found else None
    return refused.one_line() if refused else None


def test_what_the_hub_says_becomes_what_to_do() -> None:
    missing = f"the hub at {HUB} has no model org/m at revision main"
    assert line(404, "RepoNotFound", None, True) == f"{missing} (check the name and the revision)"
    assert line(404, "RevisionNotFound", None, False) == (
        f"{missing} (check the name and the revision)"
    )
    refused = f"the hub at {HUB} refused HF_TOKEN for org/m (a gated or private model needs a "
    assert line(401, None, BAD_TOKEN, True) == refused + "token with access)"
    assert line(403, None, "Access to model org/m is restricted", True) == (
        refused + "token with access)"
    )
    assert line(403, "GatedRepo", None, True) == refused + "token with access)"
    # The hub's 401 to a request without a token: a missing, private or gated model alike.
    anonymous = line(401, "RepoNotFound", "Repository Not Found", False)
    assert anonymous is not None
    assert anonymous.startswith(f"{missing}, or the model is gated or private and needs a token")
    assert "export HF_TOKEN" in anonymous
    # With a token, a RepoNotFound 401 is a missing model.
    assert line(401, "RepoNotFound", None, True) == f"{missing} (check the name and the revision)"
    assert "disk" not in " ".join(
        str(line(s, c, e, t))
        for s in (401, 403, 404)
        for c in (None, "GatedRepo")
        for e in (None, BAD_TOKEN)
        for t in (True, False)
    )


def test_other_answers_are_no_refusal() -> None:
    for status in (200, 416, 429, 500, 503):
        assert describe(status, None, None) is None


@pytest.mark.parametrize(
    "report",
    [
        {"status": "401"},
        {"status": True},
        {"status": 500},
        {},
        {"status": 1e3},
    ],
)
def test_a_hosts_report_is_data(report: dict[str, Any]) -> None:
    assert refusal(report, HUB, "org/m", "main", True) is None


def test_unknown_codes_and_texts_change_nothing() -> None:
    assert describe(401, "Rm -rf /", "x" * 10_000) == {
        "status": 401,
        "code": None,
        "bad_token": False,
    }
