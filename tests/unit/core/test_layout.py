"""One layout: the roles see the paths and names pdctl/core/layout.py gives for a plan (rendered by
Ansible itself), moving the roots in the plan moves both views, and no other module or role
spells them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdctl.core import layout, spec
from pdctl.core.layout import Layout, Roots
from pdctl.core.plan import WORKER_ROLES, Plan, build, plan_from_extravars
from pdctl.onhost.hardware import paths
from pdctl.operations import drift
from pdctl.operations.planning import write_plan_file
from tests import role_templates
from tests.unit.core.plan.test_placement import REPO, fleet, host, lab_spec

ROLES = ("pd_worker", "pd_router", "pd_scaler")
MOVED = Roots(config_root="/srv/pd/etc", install_root="/srv/pd/opt", state_root="/srv/pd/state")
# What each role resolves, by the names its tasks and templates use: the plan's pd_layout and
# what a role's vars/main.yml derives from it.
ROLE_VIEW = {
    "worker": {
        "config_dir": "pd_layout.config_dir",
        "unit_dir": "pd_layout.unit_dir",
        "unitctl": "pd_layout.unitctl",
        "unit_files": "_pd_worker_unit_files",
        "service_env": "pd_layout.service_env",
        "secrets_env": "pd_layout.secrets_env",
        "groups": "pd_layout.groups",
        "start_timeout": "pd_start_timeout | int",
        "stop_timeout": "pd_stop_timeout | int",
        "probe": "pd_probe",
    },
    "router": {
        "config_dir": "pd_layout.config_dir",
        "home": "pd_layout.router_home",
        "venv": "_pd_router_venv",
        "unit": "pd_layout.router_unit",
        "unit_path": "_pd_router_unit_path",
        "key_file": "pd_layout.router_env",
        "launcher": "pd_layout.router_launcher",
    },
    "scaler": {
        "config_dir": "pd_layout.config_dir",
        "state_dir": "pd_layout.state_dir",
        "home": "pd_layout.scaler_home",
        "user": "pd_layout.scaler_user",
        "user_home": "pd_layout.scaler_user_home",
        "authorized_keys": "_pd_scaler_authorized_keys",
        "unit": "pd_layout.scaler_unit",
        "unit_path": "_pd_scaler_unit_path",
        "config_file": "pd_layout.scaler_config",
        "key": "pd_layout.scaler_key",
        "known_hosts": "pd_layout.scaler_known_hosts",
        "router_env": "pd_layout.router_env",
        "stop_timeout": "_pd_scaler_stop_timeout | int",
        "sudoers": "pd_layout.scaler_sudoers",
    },
}


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    spec_, env = lab_spec()
    plan = build(
        spec_, env, fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2")), secrets_digest=""
    )
    return {"default": plan, "moved": plan.model_copy(update={"roots": MOVED})}


def python_view(plan: Plan) -> dict[str, dict[str, Any]]:
    where, svc = plan.layout, plan.service
    return {
        "worker": {
            "config_dir": where.config_dir,
            "unit_dir": layout.UNIT_DIR,
            "unitctl": layout.UNITCTL,
            "unit_files": [layout.unit_file(layout.worker_unit(svc, g)) for g in WORKER_ROLES],
            "service_env": where.config_file(layout.SERVICE_ENV),
            "secrets_env": where.config_file(layout.SECRETS_ENV),
            "groups": {
                g: {
                    "env": where.group_env(g),
                    "script": where.group_script(g),
                    "slot_env": where.slot_env(g, "%i"),
                    "container": layout.container(svc, g, "%i"),
                    "unit": layout.worker_unit(svc, g),
                    "instances": layout.slot_unit(svc, g, "*"),
                }
                for g in WORKER_ROLES
            },
            "start_timeout": plan.start_timeout,
            "stop_timeout": plan.stop_timeout,
            "probe": plan.probe.model_dump(mode="json"),
        },
        "router": {
            "config_dir": where.config_dir,
            "home": where.router_home,
            "venv": layout.smg_venv(plan.router.smg_version, plan.roots),
            "unit": layout.router_unit(svc),
            "unit_path": layout.unit_file(layout.router_unit(svc)),
            "key_file": where.config_file(layout.ROUTER_ENV),
            "launcher": f"{where.router_home}/{layout.ROUTER_LAUNCHER}",
        },
        "scaler": {
            "config_dir": where.config_dir,
            "state_dir": where.state_dir,
            "home": where.scaler_home,
            "user": layout.SCALER_USER,
            "user_home": layout.SCALER_USER_HOME,
            "authorized_keys": f"{layout.SCALER_USER_HOME}/.ssh/authorized_keys",
            "unit": layout.scaler_unit(svc),
            "unit_path": layout.unit_file(layout.scaler_unit(svc)),
            "config_file": where.config_file(layout.SCALER_CONFIG),
            "key": where.config_file(layout.SCALER_KEY),
            "known_hosts": where.config_file(layout.SCALER_KNOWN_HOSTS),
            "router_env": where.config_file(layout.ROUTER_ENV),
            "stop_timeout": plan.stop_timeout + 60,
            "sudoers": where.scaler_sudoers,
        },
    }


def _playbook(out: Path) -> list[dict[str, Any]]:
    """Each host loads its plan (<host>.yml), then every role's defaults and vars, as the roles
    would see them, and writes the view: Ansible resolves every value itself."""
    load = [
        {"ansible.builtin.include_vars": {"file": str(REPO / "roles" / role / kind / "main.yml")}}
        for role in ROLES
        for kind in ("defaults", "vars")
    ]
    view = {
        part: {key: f"{{{{ {expr} }}}}" for key, expr in names.items()}
        for part, names in ROLE_VIEW.items()
    }
    write = {
        "ansible.builtin.copy": {
            "content": "{{ view | to_json }}",
            "dest": f"{out}/{{{{ inventory_hostname }}}}.json",
            "mode": "0644",
        },
        "vars": {"view": view},
    }
    plan = {"ansible.builtin.include_vars": {"file": f"{out}/{{{{ inventory_hostname }}}}.yml"}}
    return [{"hosts": "all", "gather_facts": False, "tasks": [plan, *load, write]}]


@pytest.fixture(scope="module")
def role_views(plans: dict[str, Plan], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("layout")
    for name, plan in plans.items():
        write_plan_file(plan, out / f"{name}.yml")
    (out / "play.yml").write_text(yaml.safe_dump(_playbook(out), sort_keys=False))
    (out / "ansible.cfg").write_text("[defaults]\n")  # Ansible's own defaults, not the project's
    env = {**os.environ, "ANSIBLE_CONFIG": str(out / "ansible.cfg")}
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            *("-i", f"{','.join(plans)},", "-c", "local"),
            *("-e", f"ansible_python_interpreter={sys.executable}"),
            str(out / "play.yml"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in plans}


@pytest.mark.parametrize("name", ["default", "moved"])
def test_the_roles_see_the_layout_pdctl_reads(
    name: str, plans: dict[str, Plan], role_views: dict[str, Any]
) -> None:
    assert role_views[name] == python_view(plans[name])


def test_moving_the_roots_in_the_plan_moves_both_views(
    plans: dict[str, Plan], role_views: dict[str, Any]
) -> None:
    moved = role_views["moved"]
    assert moved["worker"]["config_dir"] == f"{MOVED.config_root}/{plans['moved'].service}"
    assert moved["router"]["home"].startswith(f"{MOVED.install_root}/")
    assert moved["scaler"]["state_dir"].startswith(f"{MOVED.state_root}/")
    # The quick no-op check reads what the roles wrote, not the default places.
    for name, plan in plans.items():
        seen = role_views[name]
        written = {
            *(seen["worker"][k] for k in ("config_dir", "unitctl")),
            *seen["worker"]["unit_files"],
            *(seen["router"][k] for k in ("home", "venv", "unit_path")),
            *(seen["scaler"][k] for k in ("home", "unit_path", "sudoers")),
            f"{seen['scaler']['user_home']}/.ssh",
        }
        for expect in drift.expectations(plan).values():
            assert set(expect.roots) - {f"{r}.d" for r in written} <= written, name


def test_a_plan_keeps_its_roots_through_its_extra_vars(plans: dict[str, Plan]) -> None:
    for plan in plans.values():
        doc = plan.extravars()
        assert doc["pd_layout"] == plan.layout.extravar(WORKER_ROLES)
        assert plan_from_extravars(doc) == plan
        for entries in doc["pd_host_slots"].values():
            for entry in entries:
                assert entry["env_file"] == plan.layout.slot_env(entry["group"], entry["index"])
                assert entry["unit"] == layout.slot_unit(
                    plan.service, entry["group"], entry["index"]
                )


@pytest.mark.parametrize("bad", ["etc/pdctl", "/etc/pdctl/", "/etc/../x", "/etc/./x", "/a b", "/"])
def test_a_root_is_a_plain_absolute_directory(bad: str) -> None:
    with pytest.raises(ValueError):
        Roots(config_root=bad)


def test_the_templates_name_the_layouts_files(plans: dict[str, Plan]) -> None:
    plan = plans["moved"]
    where = plan.layout
    worker = role_templates.worker_unit(plan.extravars(), "decode", "podman")
    for path in (
        where.group_env("decode"),
        where.slot_env("decode", "%i"),
        where.group_script("decode"),
        where.config_file(layout.SERVICE_ENV),
        where.config_file(layout.SECRETS_ENV),
    ):
        assert path in worker
    router = role_templates.router_unit(plan.extravars())
    assert f"EnvironmentFile={where.config_file(layout.ROUTER_ENV)}\n" in router
    assert f" {where.router_home}/{layout.ROUTER_LAUNCHER} " in router


def test_pdctl_unitctl_is_rendered_from_the_layout() -> None:
    """One script serves every service of a host: it spells the names per service in shell,
    and they must be layout.py's."""
    root = MOVED.config_root
    script = role_templates.unitctl(Layout("x", MOVED).extravar(WORKER_ROLES))
    assert f"\nself={layout.UNITCTL}\n" in script
    assert f'{root}/"$service"/{layout.SECRETS_ENV}' in script  # why masks its values
    assert layout.slot_unit("$service", "$1", "$2") in script
    assert layout.slot_unit("$service", "$group", "$k") in script
    assert layout.container("$service", "$group", "$k") in script
    assert f'case "$1" in {"|".join(layout.GROUPS)})' in script
    for group in WORKER_ROLES:
        slot_env = Path(Layout("x").slot_env(group, "*")).name
        assert f'{root}/"$service"/{slot_env}' in script
    # The runtimes' own templates: podman's `ps` has a map of labels, docker's a function.
    assert '{{index .Labels "pdctl.config"}}' in script
    assert '{{.Label "pdctl.config"}}' in script


def test_the_defaults_have_one_value_each() -> None:
    settings = spec.PdctlSettings()
    assert (settings.start_timeout, settings.stop_timeout) == (
        layout.START_TIMEOUT,
        layout.STOP_TIMEOUT,
    )
    probe = spec.Probe()
    assert (probe.url, probe.interval, probe.timeout) == (
        layout.PROBE_URL,
        layout.PROBE_INTERVAL,
        layout.PROBE_TIMEOUT,
    )
    # The preflight runs without a plan: its role and the host-side script keep a copy.
    preflight = yaml.safe_load((REPO / "roles/pd_preflight/defaults/main.yml").read_text())
    assert tuple(preflight["pd_preflight_storage_paths"]) == layout.STORAGE_PATHS
    assert paths.DEFAULT_STORAGE_PATHS == layout.STORAGE_PATHS


ANSIBLE_CONTENT = ("roles", "playbooks", "templates", "ansible.cfg")
PLACES = (layout.CONFIG_ROOT, layout.INSTALL_ROOT, layout.STATE_ROOT, layout.UNITCTL)


def _spelling(paths: list[Path], text: str) -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in paths if text in p.read_text(errors="ignore"))


def test_the_layout_is_spelled_in_one_place() -> None:
    python = [p for p in (REPO / "pdctl").rglob("*.py") if "lab" not in p.relative_to(REPO).parts]
    ansible = [
        p
        for top in ANSIBLE_CONTENT
        for p in ([REPO / top] if (REPO / top).is_file() else (REPO / top).rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    ]
    for place in PLACES:
        assert _spelling(python, place) == ["pdctl/core/layout.py"], place
        assert _spelling(ansible, place) == [], place  # the roles read pd_layout
