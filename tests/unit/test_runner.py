"""The Ansible strategy pdctl's own runs use (the lab tests run every playbook under it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.errors import InputError
from pdctl.runner import STRATEGY_VARIABLE, strategy_env


def test_mitogen_by_default_from_its_installed_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRATEGY_VARIABLE, raising=False)
    env = strategy_env()
    assert env["ANSIBLE_STRATEGY"] == "mitogen_linear"
    assert (Path(env["ANSIBLE_STRATEGY_PLUGINS"]) / "mitogen_linear.py").is_file()


def test_linear_on_request_and_anything_else_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRATEGY_VARIABLE, "linear")
    assert strategy_env() == {"ANSIBLE_STRATEGY": "linear"}
    monkeypatch.setenv(STRATEGY_VARIABLE, "free")
    with pytest.raises(InputError, match="PDCTL_ANSIBLE_STRATEGY='free'"):
        strategy_env()
