"""A service file read: YAML with each value's line -> Spec and Env (``parse``, ``load``).

dstack fields with no meaning on bare metal are dropped (and listed in the plan's notes), the
model is validated (the first error with its line and field), the cross-field checks run
(checks.py), and the environment is resolved: bare KEYs are secrets taken from the caller's
environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from pdctl.core import validate
from pdctl.core.errors import InputError
from pdctl.core.spec.checks import (
    check_commands,
    check_engine_env,
    check_engines,
    check_groups,
    check_image_ids,
    check_launches,
    check_router,
    check_scaling,
    check_slot_count,
    check_text,
)
from pdctl.core.spec.dstack import Env, Spec
from pdctl.core.spec.values import SpecError, field_name
from pdctl.core.yamlsrc import Located, YamlError, load_text, read_text_capped

# dstack settings that only mean something to dstack's cloud backends or gateway.
IGNORED_DSTACK_FIELDS = frozenset(
    {
        "spot_policy",
        "regions",
        "availability_zones",
        "backends",
        "instance_types",
        "max_price",
        "retry",
        "gateway",
        "https",
        "auth",
        "rate_limits",
        "creation_policy",
        "idle_duration",
        "utilization_policy",
        "reservation",
        "fleets",
        "tags",
        "stop_duration",
        "single_branch",
        "nvcc",
        "python",
        "repos",
        "files",
        "working_dir",
        "user",
        "shell",
        "docker",
        "priority",
        "strip_prefix",
        "replica_group_restart",
        "description",
    }
)

# dstack replica-group settings with no meaning for pdctl's hosts, accepted and ignored.
IGNORED_GROUP_FIELDS = frozenset({"spot_policy", "reservation"})


def _env_items(data: dict[str, Any], path: Path, located: Located) -> list[tuple[str, int | None]]:
    """The env as written, ``KEY=VALUE`` or bare ``KEY``, each with its line.

    A mapping's values are taken as their source text: YAML 1.1 would turn `yes` into True,
    `010` into 8 and `1.10` into 1.1, and the worker must see what the file says.
    """
    raw = data.get("env")
    if raw is None:
        return []
    items: list[tuple[str, int | None]] = []
    if isinstance(raw, dict):
        for key, value in raw.items():
            loc = ("env", key)
            if isinstance(value, dict | list):
                raise SpecError(path, located.line_of(loc), f"env.{key}", "a value must be text")
            text = None if value is None else located.source_text(loc)
            items.append((str(key) if text is None else f"{key}={text}", located.line_of(loc)))
        return items
    if isinstance(raw, list):
        for index, item in enumerate(raw):
            if not isinstance(item, str):
                raise SpecError(
                    path,
                    located.line_of(("env", index)),
                    f"env[{index}]",
                    "an item is KEY=VALUE (or a bare KEY), as text",
                    hint='quote it: - "KEY=VALUE"',
                )
            items.append((item, located.line_of(("env", index))))
        return items
    raise SpecError(
        path,
        located.line_of(("env",)),
        "env",
        "a list of KEY=VALUE (or bare KEY) or a mapping",
    )


def resolve_env(items: list[tuple[str, int | None]], path: Path, environ: Mapping[str, str]) -> Env:
    """Split env into plain values and secrets (bare KEYs, taken from the caller's environment)."""
    env = Env()
    seen: dict[str, int] = {}
    for index, (item, line) in enumerate(items):
        field = f"env[{index}]"
        key, sep, value = item.partition("=")
        if not validate.ENV_NAME.match(key):
            raise SpecError(path, line, field, f"{key!r} is not a variable name")
        if key.startswith("PDCTL_"):
            raise SpecError(path, line, field, f"{key}: PDCTL_ names are set by pdctl per slot")
        if key in seen:
            raise SpecError(
                path,
                line,
                field,
                f"{key} is set twice (first in env[{seen[key]}])",
                hint="keep one: a bare KEY is a secret from your environment, KEY=VALUE plain",
            )
        seen[key] = index
        if not sep:
            if key not in environ:
                raise SpecError(
                    path,
                    line,
                    field,
                    f"{key} is to be taken from your environment, but it is not set",
                    hint=f"export {key}=... before running pdctl",
                )
            value = environ[key]
            env.secrets.append(key)
        bad = validate.control_char(value, allowed="\t")
        if bad is not None:
            what = f"your environment's {key}" if not sep else f"the value of {key}"
            raise SpecError(
                path,
                line,
                field,
                f"{what} holds {validate.describe_char(bad)} "
                "(refused: it would break the worker's environment file into other lines)",
            )
        if sep:
            env.plain[key] = value
    return env


# What a file pdctl does not run should become instead.
_AS_PD_SERVICE = (
    "write it as `type: service` whose `replicas:` list a router group, a prefill group and a "
    'decode group, as dstack\'s services.md shows under "PD disaggregation"'
)


def check_kind(data: dict[str, Any], path: Path, located: Located) -> None:
    """A dstack file pdctl does not run (a task, a dev environment, a one-group service) is
    named as such before any of its fields is judged by a P/D service's rules."""
    kind = data.get("type")
    line: int | None = 1
    if kind != "service":
        if kind is None:
            problem = "missing: pdctl deploys dstack services (type: service)"
        else:
            problem = (
                f"{validate.shown(kind, 'this value')}: pdctl deploys dstack services "
                "(type: service), no other type"
            )
            line = located.line_of(("type",))
        raise SpecError(path, line, "type", problem, hint=_AS_PD_SERVICE)
    groups = data.get("replicas")
    if isinstance(groups, list):
        return
    one_server = " (top-level `commands`: one model server)" if "commands" in data else ""
    if groups is None:
        problem = (
            f"missing: this is a service of one group{one_server}; pdctl runs "
            "Prefill/Decode services, whose `replicas:` are groups"
        )
        line = located.line_of(("commands",)) if one_server else 1
    else:
        problem = (
            f"{validate.shown(groups, 'this value')}: a replica count, as a service of one group"
            f"{one_server} has; pdctl runs Prefill/Decode services, whose `replicas:` are groups"
        )
        line = located.line_of(("replicas",))
    raise SpecError(path, line, "replicas", problem, hint=_AS_PD_SERVICE)


def _strip_ignored(data: dict[str, Any]) -> list[str]:
    ignored = sorted(k for k in data if k in IGNORED_DSTACK_FIELDS)
    for key in ignored:
        del data[key]
    groups = data.get("replicas")
    for index, group in enumerate(groups if isinstance(groups, list) else []):
        if not isinstance(group, dict):
            continue
        for key in sorted(k for k in group if k in IGNORED_GROUP_FIELDS):
            del group[key]
            ignored.append(f"replicas[{index}].{key}")
    return ignored


def parse(text: str, path: Path, environ: Mapping[str, str]) -> tuple[Spec, Env]:
    try:
        located = load_text(text)
    except YamlError as exc:
        raise SpecError(path, exc.line, None, str(exc)) from exc
    data = located.data
    if not isinstance(data, dict):
        raise SpecError(path, 1, None, "expected a mapping (a dstack service file)")
    check_kind(data, path, located)
    ignored = _strip_ignored(data)
    check_text(data, path, located)
    env_items = _env_items(data, path, located)
    if "env" in data:
        data["env"] = [item for item, _line in env_items]
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = tuple(
            part
            for part in error["loc"]
            if not (isinstance(part, str) and part.startswith("function-"))
        )
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (pdctl-only settings go under `pdctl:`)"
        raise SpecError(path, located.line_of(loc), field_name(loc) or None, message) from exc
    spec.ignored = ignored
    check_launches(spec, path, located)
    check_groups(spec, path, located)
    check_engines(spec, path, located)
    check_scaling(spec, path, located)
    check_router(spec, path, located)
    check_image_ids(spec, path, located)
    check_commands(spec, path, located)
    check_slot_count(spec, path, located)
    env = resolve_env(env_items, path, environ)
    check_engine_env(spec, env, path, located)
    return spec, env


def load(path: Path, environ: Mapping[str, str]) -> tuple[Spec, Env]:
    try:
        text = read_text_capped(path)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}", hint="check the path") from exc
    except YamlError as exc:
        raise SpecError(path, exc.line, None, str(exc)) from exc
    return parse(text, path, environ)
