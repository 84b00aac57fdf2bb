"""pd.yml: a dstack service file, plus pdctl's own settings under one extra key, ``pdctl:``.

A file written for dstack (replica groups, scaling, resources, env, volumes,
probes) is accepted unchanged; dstack fields with no meaning on bare metal
(spot_policy, regions, ...) are accepted and ignored with a warning; anything
else unknown is refused. Every error names the file, the line and the field.
PURE: no network, no disk beyond reading the file it is given.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from pdctl.errors import InputError
from pdctl.yamlsrc import Located, YamlError, load_text

GroupRole = Literal["router", "prefill", "decode"]

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
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(MB|GB|TB)?\s*$", re.I)


class SpecError(InputError):
    """A pd.yml problem: file, line, field, what is wrong."""

    def __init__(
        self, path: Path, line: int | None, field: str | None, problem: str, hint: str | None = None
    ) -> None:
        where = f"{path}:{line}" if line else str(path)
        subject = f" {field}:" if field else ""
        super().__init__(
            f"{where}:{subject} {problem}", hint=hint, file=str(path), line=line, field=field
        )


def _seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("a duration: a number of seconds or e.g. 30s, 5m, 1h")
    if isinstance(value, int | float):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a duration (use e.g. 30s, 5m, 1h)")
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2] or "s"]


Duration = Annotated[float, BeforeValidator(_seconds)]


def _gib(value: Any) -> float:
    match = _MEMORY.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (use e.g. 512GB)")
    return float(match[1]) * {"MB": 1 / 1024, "GB": 1, "TB": 1024}[(match[2] or "GB").upper()]


class Range(BaseModel):
    """``N``, ``N..``, ``..M`` or ``N..M`` (dstack's range syntax)."""

    model_config = ConfigDict(frozen=True)
    min: float | None = None
    max: float | None = None

    @classmethod
    def parse(cls, value: Any, unit: Any = float) -> Range:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return cls(min=float(value), max=float(value))
        text = str(value).strip()
        low, sep, high = text.partition("..")
        if not sep:
            number = unit(text)
            return cls(min=number, max=number)
        return cls(min=unit(low) if low.strip() else None, max=unit(high) if high.strip() else None)

    def contains(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def describe(self) -> str:
        low = "" if self.min is None else f"{self.min:g}"
        high = "" if self.max is None else f"{self.max:g}"
        return low if self.min == self.max else f"{low}..{high}"


def _cpu_range(value: Any) -> Range:
    return Range.parse(value, float)


def _mem_range(value: Any) -> Range:
    return Range.parse(value, _gib)


class Gpu(BaseModel):
    """``MI300X:8``, ``8``, ``MI300X`` (one), or dstack's ``MI300X:192GB:8``."""

    model_config = ConfigDict(frozen=True)
    model: str | None = None
    count: int = 1

    @classmethod
    def parse(cls, value: Any) -> Gpu:
        if isinstance(value, Gpu):
            return value
        if isinstance(value, dict):
            return cls(
                model=value.get("name"), count=int(Range.parse(value.get("count", 1)).max or 1)
            )
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(count=value)
        model, count = None, 1
        for raw in str(value).split(":"):
            token = raw.strip()
            if re.fullmatch(r"\d+(\.\.\d*)?", token):
                count = int(token.split("..")[0])
            elif _MEMORY.match(token) and token[-2:].upper() in {"GB", "TB", "MB"}:
                continue  # GPU memory: every MI300X has 192GB; nothing to choose
            elif token:
                model = token
        if count < 1:
            raise ValueError("a GPU count must be at least 1")
        return cls(model=model, count=count)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Resources(Strict):
    gpu: Annotated[Gpu | None, BeforeValidator(lambda v: None if v is None else Gpu.parse(v))] = (
        None
    )
    cpu: Annotated[
        Range | None, BeforeValidator(lambda v: None if v is None else _cpu_range(v))
    ] = None
    memory: Annotated[
        Range | None, BeforeValidator(lambda v: None if v is None else _mem_range(v))
    ] = None
    disk: Annotated[
        Range | None, BeforeValidator(lambda v: None if v is None else _mem_range(v))
    ] = None
    shm_size: Annotated[float | None, BeforeValidator(lambda v: None if v is None else _gib(v))] = (
        None
    )


class Scaling(Strict):
    metric: Literal["rps"] = Field(
        description="Requests per second through the router (dstack's only metric)."
    )
    target: float = Field(gt=0, description="RPS one replica of this group should carry.")
    scale_up_delay: Duration | None = None
    scale_down_delay: Duration | None = None


class Router(Strict):
    type: Literal["sglang"]
    pd_disaggregation: bool = True


class Probe(Strict):
    type: Literal["http"] = "http"
    url: str = "/health"
    method: Literal["get", "post", "GET", "POST"] = "get"
    interval: Duration = 15.0
    timeout: Duration = 10.0
    ready_after: int = 1
    headers: list[dict[str, str]] = Field(default_factory=list)
    body: str | None = None


def _count(value: Any) -> tuple[int, int]:
    if isinstance(value, bool):
        raise ValueError("a count: N or MIN..MAX")
    if isinstance(value, int):
        return value, value
    low, sep, high = str(value).partition("..")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ValueError(f"{value!r} is not a count (use N or MIN..MAX, e.g. 1..4)") from None


class ReplicaGroup(Strict):
    name: str | None = None
    count: Annotated[tuple[int, int], BeforeValidator(_count)] = (1, 1)
    scaling: Scaling | None = None
    commands: list[str] = Field(default_factory=list)
    resources: Resources | None = None
    router: Router | None = None
    image: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ReplicaGroup:
        low, high = self.count
        if low < 0 or high < low or high < 1:
            raise ValueError(f"count {low}..{high}: need 0 <= MIN <= MAX and MAX >= 1")
        if low != high and self.scaling is None:
            raise ValueError("a range count needs `scaling` (metric: rps, target: N)")
        return self

    @property
    def role(self) -> GroupRole | None:
        if self.router is not None:
            return "router"
        mode = re.search(r"--disaggregation-mode[=\s]+(\w+)", " ".join(self.commands))
        if mode and mode[1] in {"prefill", "decode"}:
            return mode[1]  # type: ignore[return-value]
        name = (self.name or "").lower()
        return "prefill" if "prefill" in name else "decode" if "decode" in name else None


class PdctlRouter(Strict):
    host: str | None = Field(
        None, description="Inventory host for the router (default: a CPU host)."
    )
    metrics_port: int = 29000
    policy: str | None = None
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    health_check_interval: Duration = 10.0


class PdctlPorts(Strict):
    base: int = Field(30000, description="First worker port on a host.")
    stride: int = Field(
        1000, ge=300, description="Between two workers on one host (SGLang uses port+233...)."
    )
    bootstrap_base: int = Field(8998, description="First prefill bootstrap port on a host.")


class PdctlSettings(Strict):
    """Settings only pdctl reads; they sit under one top-level key so dstack files stay readable."""

    fleet: str | None = None
    runtime: Literal["auto", "podman", "docker"] = "auto"
    image_archive: str | None = Field(
        None, description="Load the image from this archive (air-gapped hosts)."
    )
    memlock: Literal["unlimited", "inherit"] = Field(
        "unlimited",
        description="RDMA needs unlimited locked memory; 'inherit' where rlimits cannot be raised.",
    )
    start_timeout: Duration = 1800.0
    stop_timeout: Duration = 600.0
    router: PdctlRouter = Field(default_factory=PdctlRouter)
    ports: PdctlPorts = Field(default_factory=PdctlPorts)
    wheelhouse: str | None = Field(
        None, description="Directory of wheels on the router host (offline SMG install)."
    )


def _env_list(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [k if v is None else f"{k}={v}" for k, v in value.items()]
    if isinstance(value, list):
        return [str(item) for item in value]
    raise ValueError("env: a list of KEY=VALUE (or bare KEY) or a mapping")


class Spec(Strict):
    type: Literal["service"]
    name: str
    image: str
    privileged: bool = False
    env: Annotated[list[str], BeforeValidator(_env_list)] = Field(default_factory=list)
    replicas: list[ReplicaGroup]
    port: int = 8000
    model: str | dict[str, Any] | None = None
    probes: list[Probe] = Field(default_factory=list)
    volumes: list[str] = Field(default_factory=list)
    router: Router | None = None
    resources: Resources | None = None
    pdctl: PdctlSettings = Field(default_factory=PdctlSettings)
    ignored: list[str] = Field(default_factory=list, exclude=True)

    @property
    def model_name(self) -> str | None:
        if isinstance(self.model, dict):
            return str(self.model.get("name")) if self.model.get("name") else None
        return self.model

    def group(self, role: GroupRole) -> ReplicaGroup:
        return next(g for g in self.replicas if g.role == role)

    def gpus(self, group: ReplicaGroup) -> Gpu | None:
        resources = group.resources or self.resources
        return resources.gpu if resources else None


class Env(BaseModel):
    """The service's environment: plain values, and the names of secrets from the caller."""

    plain: dict[str, str] = Field(default_factory=dict)
    secrets: list[str] = Field(default_factory=list)


def resolve_env(
    spec: Spec, path: Path, environ: Mapping[str, str], located: Located | None = None
) -> Env:
    """Split env into plain values and secrets (bare KEYs, taken from the caller's environment)."""
    env = Env()
    for index, item in enumerate(spec.env):
        line = located.line_of(("env", index)) if located else None
        key, sep, value = item.partition("=")
        if not _ENV_KEY.match(key):
            raise SpecError(path, line, f"env[{index}]", f"{key!r} is not a variable name")
        if not sep:
            if key not in environ:
                raise SpecError(
                    path,
                    line,
                    f"env[{index}]",
                    f"{key} is to be taken from your environment, but it is not set",
                    hint=f"export {key}=... before running pdctl",
                )
            value = environ[key]
            env.secrets.append(key)
        if "\n" in value or "\0" in value or "\r" in value:
            raise SpecError(
                path,
                line,
                f"env[{index}]",
                f"the value of {key} has a newline or NUL "
                "(refused: it would inject lines into the unit's environment file)",
            )
        if sep:
            env.plain[key] = value
    return env


def _field(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _strip_ignored(data: dict[str, Any]) -> list[str]:
    ignored = sorted(k for k in data if k in IGNORED_DSTACK_FIELDS)
    for key in ignored:
        del data[key]
    return ignored


def parse(text: str, path: Path, environ: Mapping[str, str]) -> tuple[Spec, Env]:
    try:
        located = load_text(text)
    except YamlError as exc:
        raise SpecError(path, exc.line, None, str(exc)) from exc
    data = located.data
    if not isinstance(data, dict):
        raise SpecError(path, 1, None, "expected a mapping (a dstack service file)")
    ignored = _strip_ignored(data)
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
        raise SpecError(path, located.line_of(loc), _field(loc) or None, message) from exc
    spec.ignored = ignored
    _check_groups(spec, path, located)
    _check_volumes(spec, path, located)
    return spec, resolve_env(spec, path, environ, located)


def _check_groups(spec: Spec, path: Path, located: Located) -> None:
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
        if group.count != (1, 1):
            raise SpecError(
                path,
                located.line_of(("replicas", index, "count")),
                f"replicas[{index}].count",
                "the router group runs exactly one replica (count: 1)",
            )
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


def _check_volumes(spec: Spec, path: Path, located: Located) -> None:
    for index, volume in enumerate(spec.volumes):
        parts = volume.split(":")
        ok = (
            len(parts) in {2, 3}
            and parts[0].startswith("/")
            and parts[1].startswith("/")
            and (len(parts) == 2 or parts[2] in {"ro", "rw"})
        )
        if not ok:
            raise SpecError(
                path,
                located.line_of(("volumes", index)),
                f"volumes[{index}]",
                f"{volume!r}: use /host/path:/container/path[:ro]",
                hint="bare metal has no network volumes: mount host paths",
            )


def load(path: Path, environ: Mapping[str, str]) -> tuple[Spec, Env]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}", hint="check the path") from exc
    return parse(text, path, environ)


def command_flags(commands: list[str]) -> list[str]:
    """The words of a group's commands (for reading flags like --tp)."""
    words: list[str] = []
    for command in commands:
        try:
            words += shlex.split(command.replace("\\\n", " "))
        except ValueError:
            words += command.split()
    return words
