"""One home per role fact: what the roles, the templates and the code run on hosts spell is
held equal to the one Python home of each fact (pdctl/core/layout.py, pdctl/core/fleet_model.py),
as tests/unit/core/test_layout.py does for the paths."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from pdctl.core import layout, plan, versions
from pdctl.core.fleet_model import PREFLIGHT_VARS, FleetSettings
from pdctl.onhost import bundle, holdings_probe
from pdctl.onhost.hardware import checks, paths, preflight

REPO = Path(__file__).resolve().parents[3]
CONTENT = ("roles", "playbooks", "templates", "molecule")
# Code that runs on the hosts (pdctl/onhost/) keeps its own copy (standard library only: it
# cannot import pdctl/core/layout.py); each copy is held equal below.
ON_HOST = "onhost"


def _yaml(path: str) -> Any:
    return yaml.safe_load((REPO / path).read_text())


def _content_files() -> list[Path]:
    return sorted(
        p
        for top in CONTENT
        for p in (REPO / top).rglob("*")
        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts
    )


def _product_modules() -> list[Path]:
    """pdctl's own modules, the lab and the on-host copies left out."""
    return sorted(
        p
        for p in (REPO / "pdctl").rglob("*.py")
        if not {"lab", ON_HOST} & set(p.relative_to(REPO).parts)
    )


def _spelled_in(paths: list[Path], pattern: str) -> list[str]:
    found = re.compile(pattern)
    return sorted(str(p.relative_to(REPO)) for p in paths if found.search(p.read_text()))


@functools.cache
def _strings(path: Path) -> frozenset[str]:
    """The string constants of a Python module (f-strings' literal parts included)."""
    return frozenset(
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def _holding(paths: list[Path], value: str) -> list[str]:
    """The modules with ``value`` as a string constant of their own."""
    return sorted(str(p.relative_to(REPO)) for p in paths if value in _strings(p))


# --------------------------------------------------------------------------- preflight


def test_the_preflight_expectations_have_one_home() -> None:
    """FleetSettings' defaults are what a GPU host must have: the role's defaults and their
    documentation say the same, the on-host checks default to the same, and the probe the
    role runs on the host (pdctl/onhost/hardware/preflight.py) requires them all."""
    home = FleetSettings()
    defaults = _yaml("roles/pd_preflight/defaults/main.yml")
    specs = _yaml("roles/pd_preflight/meta/argument_specs.yml")["argument_specs"]["main"]
    options = preflight._TYPES
    expect = {f.name: f.default for f in dataclasses.fields(checks.Expectations)}
    on_host = {"expected_gpus": "gpus", "expected_nics": "nics"}
    for var, setting in PREFLIGHT_VARS.items():
        value = getattr(home, setting)
        param = var.removeprefix("pd_preflight_")
        assert defaults[var] == value, var
        assert specs["options"][var]["default"] == value, var
        assert expect[on_host.get(param, param)] == value, var
        assert param in options and param in preflight._REQUIRED, param
    assert home.provider_lib == paths.DEFAULT_PROVIDER_LIB
    # Every fleet setting the role checks is one PREFLIGHT_VARS maps, and nothing else.
    assert set(PREFLIGHT_VARS) == {
        var for var in defaults if var.removeprefix("pd_preflight_") in options
    } - {"pd_preflight_nic_prefix", "pd_preflight_storage_paths"}


def test_pdctl_writes_the_preflight_expectations_under_the_roles_names() -> None:
    assert set(PREFLIGHT_VARS) <= set(_yaml("roles/pd_preflight/defaults/main.yml"))
    assert set(PREFLIGHT_VARS.values()) <= set(FleetSettings.model_fields)


def test_the_preflight_expectations_are_spelled_in_one_place() -> None:
    """The GPU model and the NIC driver of the default fleet: FleetSettings', nowhere else in
    the product or the roles (the lab emulates such hosts: it names them itself)."""
    home = FleetSettings()
    for value in (home.gpu_model, home.nic_driver, home.provider_lib):
        assert _holding(_product_modules(), str(value)) == ["pdctl/core/fleet_model.py"], value
    assert _spelled_in(_content_files(), re.escape(home.provider_lib)) == [
        "roles/pd_preflight/defaults/main.yml",
        "roles/pd_preflight/meta/argument_specs.yml",
    ]


# --------------------------------------------------------------------------- a slot's env

ENV_NAME = r"PDCTL_[A-Z][A-Z_]*"
# The molecule harness's own switch (scenarios sharing one lab): read by Ansible on the control
# node, never written to a host.
HARNESS_ENV = {"PDCTL_MOLECULE_WORKSPACE"}


def test_the_slot_env_names_are_spelled_in_one_place() -> None:
    """pdctl's code uses layout.py's names; the Ansible content and the code run on hosts
    name no variable that layout.py does not."""
    names = {*layout.SLOT_ENV_NAMES, layout.ENV_ROUTER_API_KEY}
    for name in names:
        assert _holding(_product_modules(), name) == ["pdctl/core/layout.py"], name
    for path in _content_files():
        used = set(re.findall(ENV_NAME, path.read_text())) - HARNESS_ENV
        assert used <= names, (path, used - names)
    assert set(holdings_probe.SLOT_KEYS) - {"VLLM_NIXL_SIDE_CHANNEL_PORT"} <= names
    # What the plan writes into a slot's env file, and the group's env file the role writes.
    configure = (REPO / "roles/pd_worker/vars/main.yml").read_text()
    assert {layout.ENV_IMAGE, layout.ENV_CONFIG} <= set(re.findall(ENV_NAME, configure))


def test_the_router_launcher_reads_the_layouts_key_name() -> None:
    launcher = (REPO / "pdctl/onhost/router_launch.py").read_text()
    assert f'KEY_VARIABLE = "{layout.ENV_ROUTER_API_KEY}"' in launcher


# --------------------------------------------------------------------------- groups

# The groups as a pattern: a regex's group, a shell case.
GROUP_PATTERNS = (r"\((?:\?:)?prefill\|decode\)", r"\bprefill\|decode\)")
# ... or as a list in the content (pdctl's code has Literal types, which mypy holds equal to
# layout.Group wherever they meet).
GROUP_LIST = r"""\[\s*["']prefill["'],\s*["']decode["']\s*\]"""


def test_the_groups_are_spelled_in_one_place() -> None:
    """No regex or case pattern in the content or in pdctl's code spells the groups, nor a
    list in the content: the roles read them from pd_layout.groups, the code from
    layout.GROUPS; the on-host probe's pattern names the same."""
    assert plan.WORKER_ROLES == layout.GROUPS
    for pattern in GROUP_PATTERNS:
        assert _spelled_in([*_content_files(), *_product_modules()], pattern) == [], pattern
    assert _spelled_in(_content_files(), GROUP_LIST) == []
    probe_groups = re.match(r"\^\(\?:([a-z|]+)\)", holdings_probe.SLOT_FILE.pattern)
    assert probe_groups and tuple(probe_groups[1].split("|")) == layout.GROUPS


# --------------------------------------------------------------------------- the scaler


def test_the_scalers_metrics_port_has_one_home() -> None:
    assert plan.Plan.model_fields["scaler_metrics_port"].default == layout.SCALER_METRICS_PORT
    defaults = _yaml("roles/pd_scaler/defaults/main.yml")
    assert defaults["pd_scaler_metrics_port"] == layout.SCALER_METRICS_PORT
    port = rf"\b{layout.SCALER_METRICS_PORT}\b"
    assert _spelled_in(_product_modules(), port) == ["pdctl/core/layout.py"]
    assert _spelled_in(_content_files(), port) == [
        "roles/pd_scaler/defaults/main.yml",
        "roles/pd_scaler/meta/argument_specs.yml",
    ]


def test_the_scalers_files_have_their_own_names() -> None:
    state_dir = {layout.SCALER_STATE, layout.SCALER_PINS}
    config_dir = {
        layout.SCALER_CONFIG,
        layout.SCALER_KEY,
        layout.SCALER_KNOWN_HOSTS,
        layout.SERVICE_ENV,
        layout.SECRETS_ENV,
        layout.ROUTER_ENV,
    }
    assert len(state_dir) == 2 and not state_dir & config_dir
    for name in (layout.SCALER_STATE, layout.SCALER_PINS, layout.SCALER_CONFIG):
        assert _holding(_product_modules(), name) == ["pdctl/core/layout.py"], name
    # holdings_probe.py reads each service's scaler config for its metrics port.
    assert f'"*/{layout.SCALER_CONFIG}"' in (REPO / "pdctl/onhost/holdings_probe.py").read_text()


def test_the_scaler_role_installs_what_the_scaler_imports() -> None:
    defaults = _yaml("roles/pd_scaler/defaults/main.yml")
    assert defaults["pd_scaler_packages"] == list(versions.SCALER_PACKAGES)
    # What its bundle imports beyond the standard library, by distribution: nothing more goes
    # into its venv (each package costs every router host's first deploy), nothing less.
    imported = set()
    for source in bundle.modules("pdctl.scaler").values():
        for node in ast.walk(bundle.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"pdctl"}
    distributions = metadata.packages_distributions()
    wanted = {distributions[name][0].lower().replace("_", "-") for name in third_party}
    assert wanted == {name.lower() for name in versions.SCALER_PACKAGES}
