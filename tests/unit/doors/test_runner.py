"""The Ansible strategy pdctl's own runs use (the lab tests run every playbook under it)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.errors import InputError
from pdctl.doors.content import content_root
from pdctl.doors.runner import STRATEGY_VARIABLE, strategy_env


def test_auto_runs_the_long_playbooks_under_mitogen_and_the_preflight_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(STRATEGY_VARIABLE, raising=False)
    for name in ("deploy.yml", "destroy.yml"):
        env = strategy_env(name)
        assert env["ANSIBLE_STRATEGY"] == "pd_mitogen_linear"
        mitogen, ours = (Path(p) for p in env["ANSIBLE_STRATEGY_PLUGINS"].split(os.pathsep))
        assert (mitogen / "mitogen_linear.py").is_file()
        assert (ours / "pd_mitogen_linear.py").is_file() and (ours / "pd_linear.py").is_file()
    assert strategy_env("preflight.yml") == {"ANSIBLE_STRATEGY": "pd_linear"}


def test_a_strategy_can_be_forced_and_anything_else_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(STRATEGY_VARIABLE, "linear")
    assert strategy_env("deploy.yml") == {"ANSIBLE_STRATEGY": "pd_linear"}
    monkeypatch.setenv(STRATEGY_VARIABLE, "mitogen")
    assert strategy_env("preflight.yml")["ANSIBLE_STRATEGY"] == "pd_mitogen_linear"
    monkeypatch.setenv(STRATEGY_VARIABLE, "free")
    with pytest.raises(InputError, match="PDCTL_ANSIBLE_STRATEGY='free'"):
        strategy_env("deploy.yml")


# A lookup that runs in the task's worker process and says how many objects it inherited frozen.
FREEZE_COUNT = """
import gc
from ansible.plugins.lookup import LookupBase
class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        return [gc.get_freeze_count()]
"""
PLAY = """
- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - ansible.builtin.debug:
        msg: "found={{{{ lookup('{lookup}') }}}}"
    - ansible.builtin.debug:
        msg: "scaler={{{{ lookup('pd_onhost', 'pdctl.scaler').entry }}}}"
"""


def _found_in_worker(tmp_path: Path, lookup: str, source: str, env: dict[str, str]) -> int:
    """What the lookup ``lookup`` (its ``source``) returns in a task's worker process, under the
    project's ansible.cfg and ``env``; a later task runs the pd_onhost lookup."""
    (tmp_path / "lookups").mkdir(exist_ok=True)
    (tmp_path / "lookups" / f"{lookup}.py").write_text(source)
    (tmp_path / "play.yml").write_text(PLAY.format(lookup=lookup))
    ours = content_root() / "playbooks" / "lookup_plugins"
    done = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), str(tmp_path / "play.yml")],
        env={
            **os.environ,
            "ANSIBLE_CONFIG": str(content_root() / "ansible.cfg"),
            "ANSIBLE_LOOKUP_PLUGINS": f"{tmp_path / 'lookups'}{os.pathsep}{ours}",
            "ANSIBLE_INVENTORY": "localhost,",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "scaler=pdctl.scaler" in done.stdout, done.stdout
    found = re.search(r"found=(\d+)", done.stdout)
    assert found, done.stdout
    return int(found.group(1))


def _frozen_in_worker(tmp_path: Path, env: dict[str, str]) -> int:
    return _found_in_worker(tmp_path, "freeze_count", FREEZE_COUNT, env)


@pytest.mark.parametrize("strategy", ["linear", "mitogen"])
def test_pdctls_strategies_fork_each_worker_from_a_frozen_heap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    monkeypatch.setenv(STRATEGY_VARIABLE, strategy)
    assert _frozen_in_worker(tmp_path, strategy_env("deploy.yml")) > 10_000
    # What a plain ansible-playbook run with the project's ansible.cfg gets: pd_linear too.
    assert _frozen_in_worker(tmp_path, {}) > 10_000
    # Ansible's own linear strategy forks without freezing: what the count above tells apart.
    assert _frozen_in_worker(tmp_path, {"ANSIBLE_STRATEGY": "linear"}) == 0


# A lookup that says how many of the pd_onhost lookup's entries the task's worker found computed.
ONHOST_WARM = """
from ansible.plugins.loader import lookup_loader
from ansible.plugins.lookup import LookupBase
import sys
class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        onhost = sys.modules[type(lookup_loader.get("pd_onhost")).__module__]
        return [onhost._entry.cache_info().currsize]
"""


def _warm_in_worker(tmp_path: Path, env: dict[str, str]) -> int:
    return _found_in_worker(tmp_path, "onhost_warm", ONHOST_WARM, env)


@pytest.mark.parametrize("strategy", ["linear", "mitogen"])
def test_every_worker_inherits_the_on_host_bundles_computed_once_before_the_forks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    entries = re.findall(
        r"lookup\('pd_onhost', '([^']+)'\)",
        (content_root() / "playbooks" / "group_vars" / "all.yml").read_text(),
    )
    onhost = _pd_onhost_module()
    assert set(entries) == set(onhost.ENTRIES)  # what the playbooks run is what is computed
    monkeypatch.setenv(STRATEGY_VARIABLE, strategy)
    assert _warm_in_worker(tmp_path, strategy_env("deploy.yml")) == len(onhost.ENTRIES)
    # Ansible's own linear strategy: each worker starts from nothing (what the count tells apart).
    assert _warm_in_worker(tmp_path, {"ANSIBLE_STRATEGY": "linear"}) == 0


def _pd_onhost_module() -> Any:
    path = content_root() / "playbooks" / "lookup_plugins" / "pd_onhost.py"
    spec = importlib.util.spec_from_file_location("_pd_onhost_lookup", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
