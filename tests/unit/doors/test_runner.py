"""The Ansible strategy pdctl's own runs use (the lab tests run every playbook under it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.core.errors import InputError
from pdctl.doors.runner import STRATEGY_VARIABLE, strategy_env


def test_auto_runs_the_long_playbooks_under_mitogen_and_the_preflight_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(STRATEGY_VARIABLE, raising=False)
    for name in ("deploy.yml", "destroy.yml"):
        env = strategy_env(name)
        assert env["ANSIBLE_STRATEGY"] == "mitogen_linear"
        assert (Path(env["ANSIBLE_STRATEGY_PLUGINS"]) / "mitogen_linear.py").is_file()
    assert strategy_env("preflight.yml") == {"ANSIBLE_STRATEGY": "linear"}


def test_a_strategy_can_be_forced_and_anything_else_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(STRATEGY_VARIABLE, "linear")
    assert strategy_env("deploy.yml") == {"ANSIBLE_STRATEGY": "linear"}
    monkeypatch.setenv(STRATEGY_VARIABLE, "mitogen")
    assert strategy_env("preflight.yml")["ANSIBLE_STRATEGY"] == "mitogen_linear"
    monkeypatch.setenv(STRATEGY_VARIABLE, "free")
    with pytest.raises(InputError, match="PDCTL_ANSIBLE_STRATEGY='free'"):
        strategy_env("deploy.yml")
