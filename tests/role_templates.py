"""The roles' templates rendered with plain Jinja2 from the variables Ansible gives them: the
plan's extra-vars, the role's defaults, and what its task sets per unit. The templates read
every value by its one name, so a test renders them from a plan the way the role does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jinja2
import yaml

ROOT = Path(__file__).resolve().parents[1]
_TRUE = {"yes", "on", "1", "true", "y", "t"}


def _bool(value: Any) -> bool:
    """Ansible's bool filter: a string is true only when it says so ('false' is false)."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)


# The Ansible filters the templates use, as Ansible applies them.
FILTERS = {"bool": _bool, "basename": os.path.basename}


def environment(role: str, *, trim_blocks: bool = False) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(ROOT / "roles" / role / "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=trim_blocks,
        autoescape=False,
    )
    env.filters.update(FILTERS)
    return env


def role_defaults(role: str) -> dict[str, Any]:
    """The role's defaults/main.yml: its own settings (those that are literals)."""
    doc = yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()) or {}
    return {k: v for k, v in doc.items() if not (isinstance(v, str) and "{{" in v)}


def render(
    role: str, template: str, variables: dict[str, Any], *, trim_blocks: bool = False
) -> str:
    """``template`` of ``role`` with its defaults under ``variables`` (the plan's, and more)."""
    return (
        environment(role, trim_blocks=trim_blocks)
        .get_template(template)
        .render({**role_defaults(role), **variables})
    )


def worker_unit(
    plan_vars: dict[str, Any],
    group: str,
    runtime: str,
    vendor: str = "amd",
    *,
    trim_blocks: bool = False,
    **more: Any,
) -> str:
    """A group's templated unit as pd_worker writes it on a host whose GPUs are ``vendor``'s."""
    per_unit = {
        "_pd_worker_group": group,
        "_pd_worker_runtime": runtime,
        "_pd_worker_vendors": {group: vendor},
    }
    return render(
        "pd_worker", "worker.service.j2", {**plan_vars, **per_unit, **more}, trim_blocks=trim_blocks
    )


def router_vars(plan_vars: dict[str, Any], host: str | None = None) -> dict[str, Any]:
    """What pd_router's vars/main.yml derives on ``host`` (default: the first router)."""
    router = plan_vars["pd_router"]
    replicas = router["replicas"]
    host = host or replicas[0]["host"]
    me = next(r for r in replicas if r["host"] == host)
    return {
        "_pd_router_venv": f"{plan_vars['pd_layout']['smg_venv_prefix']}{router['smg_version']}",
        "_pd_router_self": me,
        "_pd_router_peers": [r["address"] for r in replicas if r["host"] != host],
        "_pd_router_mesh": len(replicas) > 1 and bool(router.get("mesh")),
        "_pd_router_failover": router["failover"],
        "_pd_router_listen": "0.0.0.0" if router["failover"] else me["address"],
        "_pd_router_priority": 150 - [r["host"] for r in replicas].index(host),
    }


def router_unit(
    plan_vars: dict[str, Any], *, host: str | None = None, trim_blocks: bool = False, **more: Any
) -> str:
    """The router's unit as pd_router writes it on ``host`` (default: the first router)."""
    return render(
        "pd_router",
        "router.service.j2",
        {**plan_vars, **router_vars(plan_vars, host), **more},
        trim_blocks=trim_blocks,
    )


def keepalived_conf(
    plan_vars: dict[str, Any],
    host: str,
    net: dict[str, Any],
    *,
    trim_blocks: bool = False,
) -> str:
    """keepalived's config as pd_router writes it on ``host``, whose router address is on the
    interface and prefix ``net`` names (what the role reads on the host)."""
    return render(
        "pd_router",
        "keepalived.conf.j2",
        {**plan_vars, **router_vars(plan_vars, host), "_pd_router_net": net},
        trim_blocks=trim_blocks,
    )


def keepalived_unit(plan_vars: dict[str, Any], program: str = "/usr/sbin/keepalived") -> str:
    """keepalived's unit as pd_router writes it."""
    return render(
        "pd_router",
        "keepalived.service.j2",
        {**plan_vars, "_pd_router_keepalived": program},
    )


def unitctl(pd_layout: dict[str, Any]) -> str:
    """pdctl-unitctl as pd_worker installs it."""
    return render("pd_worker", "pdctl-unitctl.sh.j2", {"pd_layout": pd_layout})
