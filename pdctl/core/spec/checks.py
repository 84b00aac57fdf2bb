"""What holds across a service file's fields, checked once each field is valid: the groups (one
router, one prefill, one decode), their images and engines agreeing, their launch commands
(parsed as shell: pdctl/core/shell.py), scaling and latency metrics, the router's launch
line, pinned image IDs, text pdctl will write into units, and the slot count. Each refusal is a
SpecError with the line and field.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from pdctl.core import router_replicas, validate
from pdctl.core.entrypoint import find_launch, worker_script
from pdctl.core.launch import GRPC_MODE, Connection, Engine
from pdctl.core.router_flags import RouterFlagError, kept_flags, launch_line
from pdctl.core.shell import CommandError
from pdctl.core.spec.dstack import (
    BASE_IMAGE_FIELDS,
    LATENCY_METRICS,
    MAX_SLOTS,
    METRIC_ROLE,
    Env,
    ReplicaGroup,
    Spec,
)
from pdctl.core.spec.values import SpecError, field_name
from pdctl.core.yamlsrc import Located

# Set by pdctl per vLLM slot (pdctl/core/plan/model.py Slot.env): a service-wide value would give
# every worker on a host one side channel port, and the second would not start.
PER_SLOT_VLLM_ENV = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST")


def check_engine_env(spec: Spec, env: Env, path: Path, located: Located) -> None:
    if spec.engine != "vllm":
        return
    for key in PER_SLOT_VLLM_ENV:
        if key in env.plain or key in env.secrets:
            raise SpecError(
                path,
                located.line_of(("env",)),
                "env",
                f"{key} is set by pdctl for each vLLM slot (a port of its own on its host, "
                "the host's address)",
                hint="remove it; pdctl.ports.side_channel_base moves the ports",
            )


def _allowed_controls(loc: tuple[str | int, ...]) -> str:
    """Control characters a value may hold where it is used: a command is shell text (its
    lines are the script's), an env value a line of an env file (a tab is fine)."""
    if len(loc) == 4 and loc[0] == "replicas" and loc[2] == "commands":
        return "\n\t"
    if len(loc) == 2 and loc[0] == "env":
        return "\t"
    return ""


def check_text(data: dict[str, Any], path: Path, located: Located) -> None:
    """No control character in any text but commands (nothing may start a new line in a
    unit, an env file or a path), and every mapping key is text."""
    for loc, text in validate.walk_strings(data):
        bad = validate.control_char(text, allowed=_allowed_controls(loc))
        if bad is not None:
            raise SpecError(
                path,
                located.line_of(loc),
                field_name(loc),
                f"holds {validate.describe_char(bad)}: refused (it could start a new line "
                "in a unit or an environment file on the hosts)",
            )
    for loc, key in _non_text_keys(data):
        raise SpecError(
            path, located.line_of(loc), field_name(loc) or None, f"key {key!r} is not text"
        )


def _non_text_keys(
    data: Any, loc: tuple[str | int, ...] = ()
) -> list[tuple[tuple[str | int, ...], Any]]:
    found: list[tuple[tuple[str | int, ...], Any]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(key, str):
                found.append((loc, key))
            found += _non_text_keys(value, (*loc, str(key)))
    elif isinstance(data, list):
        for index, item in enumerate(data):
            found += _non_text_keys(item, (*loc, index))
    return found


def check_groups(spec: Spec, path: Path, located: Located) -> None:
    roles: dict[str, list[int]] = {}
    for index, group in enumerate(spec.replicas):
        role = group.role
        if role is None:
            raise SpecError(
                path,
                located.line_of(("replicas", index)),
                f"replicas[{index}]",
                "cannot tell whether this group is prefill or decode",
                hint="pass --disaggregation-mode prefill|decode in its command, or name it",
            )
        roles.setdefault(role, []).append(index)
    if "router" not in roles and spec.router is not None:
        roles["router"] = []  # dstack's older form: a top-level router, no router group
    for role in ("router", "prefill", "decode"):
        if role not in roles:
            raise SpecError(
                path,
                located.line_of(("replicas",)),
                "replicas",
                f"PD disaggregation needs a {role} group",
                hint="one router group (router: {type: sglang}), a prefill and a decode group",
            )
        if len(roles[role]) > 1:
            second = roles[role][1]
            raise SpecError(
                path,
                located.line_of(("replicas", second)),
                f"replicas[{second}]",
                f"a second {role} group (pdctl runs one of each)",
            )
    for index in roles["router"]:
        group = spec.replicas[index]
        low, high = group.count
        if low != high or not 1 <= low <= router_replicas.MAX_ROUTERS:
            raise SpecError(
                path,
                located.line_of(("replicas", index, "count")),
                f"replicas[{index}].count",
                "the router group runs a fixed number of routers, 1 to "
                f"{router_replicas.MAX_ROUTERS}, each on its own host",
                hint="count: 2 runs two routers (with pdctl.router.address in front of them)",
            )
    for index in roles["router"]:
        # SMG runs from pdctl's pinned venv, not from an image or dstack's base image.
        group = spec.replicas[index]
        keys = (*BASE_IMAGE_FIELDS, "privileged", "image")
        spec.ignored += [f"replicas[{index}].{k}" for k in keys if getattr(group, k) is not None]
    _check_worker_images(spec, roles, path, located)
    for worker in ("prefill", "decode"):
        index = roles[worker][0]
        group = spec.replicas[index]
        if not group.commands:
            raise SpecError(
                path,
                located.line_of(("replicas", index)),
                f"replicas[{index}].commands",
                f"the {worker} group has no commands to run",
            )
        gpus = spec.gpus(group)
        if gpus is None:
            raise SpecError(
                path,
                located.line_of(("replicas", index)),
                f"replicas[{index}].resources.gpu",
                f"the {worker} group must say how many GPUs a replica needs (e.g. gpu: MI300X:4)",
            )


def _check_worker_images(
    spec: Spec, roles: dict[str, list[int]], path: Path, located: Located
) -> None:
    """Each worker group runs an image (its own or the service's), as a plain container, and
    both run with one privileged setting (the unit template's)."""
    for worker in ("prefill", "decode"):
        index = roles[worker][0]
        group = spec.replicas[index]
        where = f"replicas[{index}]"
        if group.docker:
            raise SpecError(
                path,
                located.line_of(("replicas", index, "docker")),
                f"{where}.docker",
                "a docker-in-docker worker group: pdctl runs each worker as one container of "
                "its image",
                hint="remove `docker: true` and give the group the image that runs the server",
            )
        if group.image is None and spec.image is None:
            chosen = next((k for k in BASE_IMAGE_FIELDS if getattr(group, k) is not None), None)
            said = f" (`{chosen}` picks dstack's own base image)" if chosen else ""
            raise SpecError(
                path,
                located.line_of(("replicas", index)),
                f"{where}.image",
                f"the {worker} group names no image to run{said}",
                hint="set `image` in the group, or at the top of the file for every group",
            )
        for key in BASE_IMAGE_FIELDS:
            if getattr(group, key) is not None:
                spec.ignored.append(f"{where}.{key}")
    groups = [spec.replicas[roles[w][0]] for w in ("prefill", "decode")]
    settings = {spec.privileged if g.privileged is None else g.privileged for g in groups}
    if len(settings) > 1:
        index = roles["decode"][0]
        raise SpecError(
            path,
            located.line_of(("replicas", index)),
            f"replicas[{index}].privileged",
            "the prefill and decode groups differ in `privileged`: pdctl runs both worker "
            "groups with one setting",
            hint="set `privileged` at the top of the file (or the same in both groups)",
        )


def check_launches(spec: Spec, path: Path, located: Located) -> None:
    """Each worker group's launch command readable, and a vLLM group's role said once."""
    for index, group in enumerate(spec.replicas):
        if group.router is not None:
            continue
        loc: tuple[str | int, ...] = ("replicas", index, "commands")
        try:
            launch = find_launch(group.commands)
        except CommandError as exc:
            if exc.index is not None:
                loc = (*loc, exc.index)
            raise SpecError(
                path, located.line_of(loc), field_name(loc), exc.problem, hint=exc.hint
            ) from exc
        if launch is None or launch.engine != "vllm":
            continue
        named = group.named_role
        where = f"replicas[{index}]"
        if launch.role is None and named is None:
            raise SpecError(
                path,
                located.line_of(("replicas", index)),
                where,
                f"kv_role {launch.kv_role} does not say whether this vLLM group is prefill or "
                "decode",
                hint="name the group (name: prefill or decode), set `pdctl: {role: prefill}` "
                "in it, or use kv_role kv_producer (prefill) / kv_consumer (decode)",
            )
        if launch.role is not None and named is not None and named != launch.role:
            said = "its pdctl.role" if group.pdctl and group.pdctl.role else "its name"
            raise SpecError(
                path,
                located.line_of(("replicas", index)),
                where,
                f"kv_role {launch.kv_role} makes this a {launch.role} group, but {said} says "
                f"{named}",
                hint="make them agree: kv_producer is prefill, kv_consumer is decode",
            )


def check_engines(spec: Spec, path: Path, located: Located) -> None:
    """One service, one engine and one connection: SMG routes a service's requests from
    prefill to decode over one protocol, and the two halves must speak the same KV transfer."""
    groups = {role: spec.group(role) for role in ("prefill", "decode")}
    runs = {role: _engine_name(g.engine, g.connection) for role, g in groups.items()}
    if runs["prefill"] == runs["decode"]:
        return
    index = spec.replicas.index(groups["decode"])
    same_engine = groups["prefill"].engine == groups["decode"].engine
    raise SpecError(
        path,
        located.line_of(("replicas", index, "commands")),
        f"replicas[{index}].commands",
        f"the prefill group runs {runs['prefill']} and the decode group {runs['decode']}: "
        "a service runs one engine for both, over one connection",
        hint=(
            f"give both groups {GRPC_MODE} or neither (SMG talks to a service's workers one way)"
            if same_engine
            else "launch both groups with the same engine (pdctl finds the engine in the launch "
            "command: sglang.launch_server, vllm serve --grpc, vllm.entrypoints.grpc_server)"
        ),
    )


def _engine_name(engine: Engine, connection: Connection) -> str:
    """How messages name a group's workers: "sglang", "sglang over gRPC", "vllm"."""
    return f"{engine} over gRPC" if engine == "sglang" and connection == "grpc" else engine


def _scaling_error(path: Path, located: Located, index: int, problem: str, hint: str) -> SpecError:
    return SpecError(
        path,
        located.line_of(("replicas", index, "scaling", "metric")),
        f"replicas[{index}].scaling.metric",
        problem,
        hint=hint,
    )


def check_scaling(spec: Spec, path: Path, located: Located) -> None:
    """A latency metric scales the phase it measures: an HTTP worker's from its /metrics, a
    gRPC worker's (vLLM, SGLang --grpc-mode) from the router's histograms and its engine's
    GetLoads (pdctl/core/scaling/router_latency.py)."""
    for index, group in enumerate(spec.replicas):
        worker = group.role
        scaling = group.scaling
        if worker not in ("prefill", "decode") or scaling is None:
            continue
        refuse = partial(_scaling_error, path, located, index)
        if METRIC_ROLE.get(scaling.metric, worker) != worker:
            right = next(m for m, r in METRIC_ROLE.items() if r == worker)
            raise refuse(
                f"{scaling.metric} measures the {METRIC_ROLE[scaling.metric]} phase: "
                f"the {worker} group cannot move it",
                f"scale the {worker} group on {right} (or rps)",
            )


# SGLang serves /metrics only with this flag; pdctl adds it where a group scales on latency.
METRICS_FLAG = "--enable-metrics"


def added_flags(group: ReplicaGroup) -> tuple[str, ...]:
    """Flags pdctl adds to a worker group's launch: --enable-metrics for an SGLang HTTP group
    that scales on ttft or itl (the scaler reads them from the workers' /metrics) and lacks it
    (a gRPC group's come from the router and GetLoads)."""
    scaling = group.scaling
    if scaling is None or scaling.metric not in LATENCY_METRICS or group.engine != "sglang":
        return ()
    if group.connection == "grpc":
        return ()
    launch = find_launch(group.commands)
    return () if launch is None or launch.has_flag(METRICS_FLAG) else (METRICS_FLAG,)


def check_router(spec: Spec, path: Path, located: Located) -> None:
    """The router group's `smg launch` flags are ones pdctl can pass to SMG as they are."""
    for index, group in enumerate(spec.replicas):
        if group.role != "router":
            continue
        line = launch_line(group.commands)
        if line is None:
            continue
        number = group.commands.index(line)
        try:
            kept_flags(line)
        except RouterFlagError as exc:
            loc = ("replicas", index, "commands", number)
            raise SpecError(path, located.line_of(loc), field_name(loc), str(exc)) from exc


def image_pin(spec: Spec, group: ReplicaGroup) -> str | None:
    """The image ID the operator pins for what ``group`` runs: the group's own pdctl.image_id,
    else the spec's pdctl.image_id when the group runs the spec's image."""
    if group.pdctl is not None and group.pdctl.image_id is not None:
        return group.pdctl.image_id
    return spec.pdctl.image_id if group.image in {None, spec.image} else None


def check_image_ids(spec: Spec, path: Path, located: Located) -> None:
    """One image, one pinned ID: two groups that run one image cannot pin two."""
    pins: dict[str, tuple[str, int]] = {}
    for index, group in enumerate(spec.replicas):
        pin = image_pin(spec, group)
        if group.role not in {"prefill", "decode"} or pin is None:
            continue
        image = group.image or spec.image
        if (
            image is None
        ):  # refused elsewhere: a worker group needs an image of its own or the file's
            continue
        first = pins.setdefault(image, (pin, index))
        if first[0] != pin:
            loc = ("replicas", index, "pdctl", "image_id")
            raise SpecError(
                path,
                located.line_of(loc),
                field_name(loc),
                f"{image} is pinned to {first[0]} by replicas[{first[1]}] and to {pin} here",
                hint="one image has one ID: pin it once (pdctl.image_id for the spec's image)",
            )


def check_commands(spec: Spec, path: Path, located: Located) -> None:
    """Each worker group's commands make a script pdctl can wire to a slot's ports."""
    for index, group in enumerate(spec.replicas):
        role = group.role
        if role not in {"prefill", "decode"}:
            continue
        try:
            worker_script(group.commands, role)
        except CommandError as exc:
            loc: tuple[str | int, ...] = ("replicas", index, "commands")
            if exc.index is not None:
                loc = (*loc, exc.index)
            raise SpecError(
                path, located.line_of(loc), field_name(loc), exc.problem, hint=exc.hint
            ) from exc


def check_slot_count(spec: Spec, path: Path, located: Located) -> None:
    """Slots within bounds. Ports are judged per host, after placement (pdctl/core/plan/): in a
    dstack file the router and every worker may well say the same port."""
    slots = sum(spec.group(role).count[1] for role in ("prefill", "decode"))
    if slots > MAX_SLOTS:
        raise SpecError(
            path,
            located.line_of(("replicas",)),
            "replicas",
            f"{slots} prefill and decode replicas at most: pdctl plans up to {MAX_SLOTS}",
            hint="lower the groups' max counts",
        )
