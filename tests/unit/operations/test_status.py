"""What `pdctl status` takes from the scaler's record: its own file on the router host, read as
data (checked, not trusted)."""

from __future__ import annotations

from typing import Any

import pytest

from pdctl.operations.status import _scaler_budget


def test_the_budget_is_kept_as_numbers_and_names() -> None:
    recorded: dict[str, Any] = {
        "budget": {
            "budget": 20,
            "used": 20,
            "using": 8,
            "max_gpus": 12,
            "holders": {"a": 8, "b": 12, "c": "12; rm -rf /", "d": True},
            "grants": {"decode": {"gpus": 0, "reason": "x" * 10_000}},
            "error": "e" * 2000,
        }
    }
    kept = _scaler_budget(recorded)
    assert kept is not None
    assert {k: kept[k] for k in ("budget", "used", "using", "max_gpus")} == {
        "budget": 20,
        "used": 20,
        "using": 8,
        "max_gpus": 12,
    }
    assert kept["holders"] == {"a": 8, "b": 12}
    assert "grants" not in kept and len(kept["error"]) == 500


@pytest.mark.parametrize("recorded", [None, {}, {"budget": None}, {"budget": [1, 2]}])
def test_no_budget_is_none(recorded: dict[str, Any] | None) -> None:
    assert _scaler_budget(recorded) is None
