"""pd.yml: a dstack service file, plus pdctl's own settings under one extra key, ``pdctl:``.

A file written for dstack (replica groups, scaling, resources, env, volumes,
probes) is accepted unchanged; dstack fields with no meaning on bare metal
(spot_policy, regions, a router group's python, ...) are accepted and ignored (the
plan's notes list them); anything else unknown is refused. Every error names the
file, the line and the field. Ports are not judged here but per host, after
placement (pdctl/plan.py): a dstack file may give the router and every worker one.
PURE: no network, no disk beyond reading the file it is given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdctl import failover, hf_layout, layout, router_replicas, validate
from pdctl.commands import CommandError, find_launch, worker_script
from pdctl.errors import InputError
from pdctl.fleet_model import GpuVendor
from pdctl.launch import GRPC_MODE, Connection, Engine, Launch
from pdctl.router_flags import RouterFlagError, group_policy, kept_flags, launch_line
from pdctl.yamlsrc import Located, YamlError, load_text, read_text_capped

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
# dstack replica-group settings with no meaning for pdctl's hosts, accepted and ignored.
IGNORED_GROUP_FIELDS = frozenset({"spot_policy", "reservation"})
# dstack replica-group settings that pick dstack's own base image (python, nvcc) or a
# docker-in-docker one: meaningless for the router group, which pdctl runs from a pinned SMG
# venv, not an image; a worker group without an `image` of its own or the service's cannot run.
BASE_IMAGE_FIELDS = ("python", "nvcc", "docker")
# At most this many slots (replicas up to each group's max) per service: each is planned,
# written and probed at every deploy.
MAX_SLOTS = 1024
# A worker takes the ports from its --port on: SGLang opens internal ones up to --port + 233,
# so no stride may be shorter than this.
MIN_PORT_STRIDE = 300
DEFAULT_PORT_STRIDE = 1000

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
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
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return float(match[1]) * units[match[2] or "s"]


def _delay(value: float) -> float:
    return validate.seconds(value, zero_ok=True)


# A time span: positive and finite (a delay may be 0).
Duration = Annotated[float, BeforeValidator(_seconds), AfterValidator(validate.seconds)]
Delay = Annotated[float, BeforeValidator(_seconds), AfterValidator(_delay)]
Port = Annotated[int, AfterValidator(validate.port)]
HostPath = Annotated[str, AfterValidator(validate.host_path)]
Image = Annotated[str, AfterValidator(validate.image)]
ImageId = Annotated[str, AfterValidator(validate.image_id)]
IMAGE_ID_HELP = (
    "The worker image's ID (sha256:...), as the operator knows it: the image every host must "
    "run under that name, checked before a host takes it from another."
)
Name = Annotated[str, AfterValidator(validate.service_name)]


def _gib(value: Any) -> float:
    match = _MEMORY.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (use e.g. 512GB)")
    return float(match[1]) * {"MB": 1 / 1024, "GB": 1, "TB": 1024}[(match[2] or "GB").upper()]


class Range(BaseModel):
    """``N``, ``N..``, ``..M`` or ``N..M`` (dstack's range syntax)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)
    min: float | None = Field(None, ge=0)
    max: float | None = Field(None, ge=0)

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


# dstack's vendor tokens (gpuhunt's AcceleratorVendor and its aliases); pdctl places on two.
_VENDORS: dict[str, GpuVendor | None] = {
    "amd": "amd",
    "nvidia": "nvidia",
    "google": None,
    "tpu": None,
    "intel": None,
    "tenstorrent": None,
    "tt": None,
}
# A GPU name as dstack spells it (H200, MI300X, A100, RTX4090, ...): it starts with a letter.
_GPU_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.+-]{0,63}\Z")
GPU_FORMS = "e.g. H200, H200:8, 8, nvidia:2, MI300X:4, H100:80GB:2, H100,H200:8, 80GB..:4"


def _gpu_vendor(token: str) -> GpuVendor | None:
    vendor = _VENDORS[token.lower()]
    if vendor is None:
        raise ValueError(f"GPU vendor {token!r}: pdctl places workers on amd or nvidia GPUs")
    return vendor


def _gpu_names(value: Any) -> tuple[str, ...]:
    names = value if isinstance(value, list | tuple) else str(value).split(",")
    found = []
    for name in names:
        text = str(name).strip()
        if not _GPU_NAME.match(text):
            raise ValueError(
                f"GPU name {text!r}: a letter, then letters, digits, '.', '_', '+' or '-' "
                "(dstack's spelling: H200, H100, A100, MI300X)"
            )
        found.append(text)
    if not found:
        raise ValueError("an empty list of GPU names")
    return tuple(found)


def _gpu_count(value: Any) -> int:
    """The GPUs one replica takes: a count, or the low end of a range (dstack picks the
    smallest offer that fits; a replica's launch command fixes its tensor parallelism)."""
    if isinstance(value, bool):
        raise ValueError("a GPU count: N or MIN..MAX")
    text = str(value).replace(" ", "")
    if not re.fullmatch(r"\d+|\d*\.\.\d*", text) or text == "..":
        raise ValueError(f"{value!r} is not a GPU count (use N or MIN..MAX, e.g. 8 or 1..8)")
    low, sep, high = text.partition("..")
    count = int(low) if low else 1
    if sep and high and int(high) < count:
        raise ValueError(f"GPU count {text}: MIN is above MAX")
    if not 1 <= count <= 64:
        raise ValueError(f"GPU count {text}: a replica takes 1..64 GPUs")
    return count


def _gpu_memory(value: Any) -> Range:
    text = str(value).replace(" ", "")
    if not re.fullmatch(r"[0-9.]*(MB|GB|TB)?(\.\.([0-9.]+(MB|GB|TB)?)?)?", text, re.I) or not text:
        raise ValueError(f"{value!r} is not a GPU memory size (use e.g. 80GB, 80GB.., 40GB..80GB)")
    try:
        memory = Range.parse(text, _gib)
    except ValueError:
        raise ValueError(f"{value!r} is not a GPU memory size (use e.g. 80GB, 80GB..)") from None
    if memory.min is None and memory.max is None:
        raise ValueError(f"{value!r}: an empty memory range")
    if memory.min is not None and memory.max is not None and memory.min > memory.max:
        raise ValueError(f"GPU memory {value}: MIN is above MAX")
    return memory


class Gpu(BaseModel):
    """A replica's GPUs in dstack's grammar: ``H200``, ``H200:8``, ``8``, ``nvidia``,
    ``MI300X:192GB:4``, ``H100,H200:8``, ``80GB..:2``, or the mapping form
    ``{vendor, name: [H100, H200], count, memory, total_memory}``. Tokens of the text form are
    told apart as dstack does: a vendor, a name (starts with a letter; ``,`` separates
    alternatives), a memory (has a unit), a count (the rest)."""

    model_config = ConfigDict(frozen=True)
    vendor: GpuVendor | None = None
    names: tuple[str, ...] = ()
    count: int = Field(1, ge=1, le=64, description="GPUs per replica, on one host.")
    memory: Range | None = Field(None, description="Per GPU, in GB (GiB, as dstack counts).")
    total_memory: Range | None = Field(None, description="Of the replica's GPUs together, in GB.")

    @model_validator(mode="before")
    @classmethod
    def _model_alias(cls, data: Any) -> Any:
        # Gpu(model="MI300X") reads as one name: the form pdctl's own code and tests use.
        if isinstance(data, dict) and "model" in data:
            data = dict(data)
            model = data.pop("model")
            if model is not None:
                data["names"] = (model,)
        return data

    @property
    def model(self) -> str | None:
        """The names as written (``H100,H200``), None when any model will do."""
        return ",".join(self.names) if self.names else None

    @classmethod
    def parse(cls, value: Any) -> Gpu:
        if isinstance(value, Gpu):
            return value
        if isinstance(value, dict):
            return cls._parse_mapping(value)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"a GPU spec is text, a count or a mapping ({GPU_FORMS})")
        found: dict[str, Any] = {}
        text = str(value).replace(" ", "")
        for token in text.split(":"):
            if not token:
                raise ValueError(f"GPU spec {value!r} has an empty part ({GPU_FORMS})")
            parsed: Any
            if token.lower() in _VENDORS:
                kind, parsed = "vendor", _gpu_vendor(token)
            elif token[0].isalpha():
                kind, parsed = "names", _gpu_names(token)
            elif any(c.isalpha() for c in token):
                kind, parsed = "memory", _gpu_memory(token)
            else:
                kind, parsed = "count", _gpu_count(token)
            if kind in found:
                raise ValueError(f"GPU spec {value!r} gives the {kind} twice ({GPU_FORMS})")
            found[kind] = parsed
        return cls(**found)

    @classmethod
    def _parse_mapping(cls, value: dict[str, Any]) -> Gpu:
        allowed = {"vendor", "name", "count", "memory", "total_memory"}
        if "compute_capability" in value:
            raise ValueError(
                "compute_capability: pdctl cannot check it (the hosts' facts do not carry it); "
                "name the GPUs instead (name: [H100, H200])"
            )
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise ValueError(
                f"unknown GPU field(s) {', '.join(unknown)} (allowed: {sorted(allowed)})"
            )
        found: dict[str, Any] = {}
        if value.get("vendor") is not None:
            if str(value["vendor"]).lower() not in _VENDORS:
                raise ValueError(f"GPU vendor {value['vendor']!r}: use amd or nvidia")
            found["vendor"] = _gpu_vendor(str(value["vendor"]))
        if value.get("name") is not None:
            found["names"] = _gpu_names(value["name"])
        if value.get("count") is not None:
            found["count"] = _gpu_count(value["count"])
        for key in ("memory", "total_memory"):
            if value.get(key) is not None:
                found[key] = _gpu_memory(value[key])
        return cls(**found)

    def describe(self) -> str:
        """As the spec would write it: ``H200:1``, ``nvidia:80GB..:2``, ``MI300X:192GB:4``."""
        parts: list[str] = [self.vendor] if self.vendor else []
        if self.names:
            parts.append(",".join(self.names))
        if self.memory:
            parts.append(describe_gb(self.memory))
        parts.append(str(self.count))
        text = ":".join(parts)
        if self.total_memory:
            text += f" (total {describe_gb(self.total_memory)})"
        return text


def describe_gb(memory: Range) -> str:
    low = "" if memory.min is None else f"{memory.min:g}GB"
    high = "" if memory.max is None else f"{memory.max:g}GB"
    return low if memory.min == memory.max else f"{low}..{high}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


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


# Latency targets and windows: sane bounds (a TTFT or ITL target beyond a minute, or a
# window the scaler cannot fill with scrapes, is a typo rather than a policy).
LATENCY_TARGET_MAX = 60.0
WINDOW_MIN, WINDOW_MAX = 10.0, 3600.0
LATENCY_METRICS = ("ttft", "itl")
# Which phase a latency metric measures (docs/facts.md, Worker metrics): TTFT is the prefill
# worker's queue + prompt processing, ITL the decode worker's per-token time.
METRIC_ROLE = {"ttft": "prefill", "itl": "decode"}


def _percentile(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("a percentile: p50, p90, p99 (or 50..99.9)")
    text = str(value).strip()
    number = text[1:] if text[:1] in {"p", "P"} else text
    try:
        result = float(number)
    except ValueError:
        raise ValueError(f"{value!r} is not a percentile (use e.g. p90)") from None
    if not 50 <= result < 100:
        raise ValueError(f"{value!r}: a percentile between p50 and p99.9")
    return result


class Scaling(Strict):
    metric: Literal["rps", "ttft", "itl"] = Field(
        description="rps: requests per second through the router (dstack's metric); "
        "ttft: time to first token (prefill groups); itl: inter-token latency (decode groups)."
    )
    target: float = Field(
        description="rps: what one replica should carry (a number); ttft/itl: the latency "
        "to keep the percentile under (a duration: 500ms, 0.5s)."
    )
    percentile: Annotated[float, BeforeValidator(_percentile)] = Field(
        90.0, description="ttft/itl: which percentile of the window is compared (p90)."
    )
    window: Annotated[float, BeforeValidator(_seconds)] = Field(
        60.0, description="ttft/itl: the span the percentile covers."
    )
    scale_up_delay: Delay | None = None
    scale_down_delay: Delay | None = None

    @field_validator("target", mode="before")
    @classmethod
    def _target(cls, value: Any, info: ValidationInfo) -> float:
        metric = info.data.get("metric")
        if isinstance(value, bool):
            raise ValueError("a number (rps) or a duration (ttft, itl)")
        if metric in LATENCY_METRICS:
            seconds = _seconds(value)
            validate.seconds(seconds)
            if seconds > LATENCY_TARGET_MAX:
                raise ValueError(
                    f"{seconds:g} s is not a sane {metric} target (at most "
                    f"{LATENCY_TARGET_MAX:g} s; a bare number is seconds: write e.g. 500ms)"
                )
            return seconds
        if isinstance(value, str):
            raise ValueError(f"{value!r}: an rps target is a number of requests per second")
        rps = float(value)
        if not (math.isfinite(rps) and 0 < rps <= 1e6):
            raise ValueError(f"{value!r}: an rps target is a number in (0, 1000000]")
        return rps

    @field_validator("window")
    @classmethod
    def _window(cls, value: float) -> float:
        validate.seconds(value)
        if not WINDOW_MIN <= value <= WINDOW_MAX:
            raise ValueError(f"{value:g} s: a window between {WINDOW_MIN:g} s and 1h")
        return value


class Router(Strict):
    type: Literal["sglang"]
    pd_disaggregation: bool = True


class Probe(Strict):
    type: Literal["http"] = "http"
    url: Annotated[str, AfterValidator(validate.url_path)] = layout.PROBE_URL
    method: Literal["get", "post", "GET", "POST"] = "get"
    interval: Annotated[Duration, Field(ge=1)] = float(layout.PROBE_INTERVAL)
    timeout: Duration = float(layout.PROBE_TIMEOUT)
    ready_after: int = Field(1, ge=1, le=100)
    headers: list[dict[str, str]] = Field(default_factory=list)
    body: str | None = None


def _count(value: Any) -> tuple[int, int]:
    if isinstance(value, bool):
        raise ValueError("a count: N or MIN..MAX")
    if isinstance(value, int):
        return value, value
    if not isinstance(value, str):
        raise ValueError("a count: N or MIN..MAX")
    low, sep, high = str(value).partition("..")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ValueError(f"{value!r} is not a count (use N or MIN..MAX, e.g. 1..4)") from None


class GroupSettings(Strict):
    """A replica group's pdctl-only settings (``pdctl:`` inside the group)."""

    role: Literal["prefill", "decode"] | None = Field(
        None,
        description="The group's P/D role, where neither its command nor its name says it "
        "(a vLLM worker with kv_role kv_both).",
    )
    image_id: ImageId | None = Field(None, description=IMAGE_ID_HELP + " (the group's image)")


class ReplicaGroup(Strict):
    name: Name | None = None
    count: Annotated[tuple[int, int], BeforeValidator(_count)] = (1, 1)
    scaling: Scaling | None = None
    commands: list[str] = Field(default_factory=list)
    resources: Resources | None = None
    router: Router | None = None
    image: Image | None = None
    # dstack's base-image choices (BASE_IMAGE_FIELDS) and per-group privileged mode:
    # _check_groups decides what each means for the group's role.
    python: str | float | None = None
    nvcc: bool | None = None
    docker: bool | None = None
    privileged: bool | None = None
    pdctl: GroupSettings | None = None

    @model_validator(mode="before")
    @classmethod
    def _replicas_is_count(cls, data: Any) -> Any:
        # dstack's own name for a group's count (`count` is its alias there too).
        if isinstance(data, dict) and "replicas" in data:
            data = {k: v for k, v in data.items() if k != "count"}
            data["count"] = data.pop("replicas")
        return data

    @model_validator(mode="after")
    def _check(self) -> ReplicaGroup:
        low, high = self.count
        if low < 0 or high < low or high < 1:
            raise ValueError(f"count {low}..{high}: need 0 <= MIN <= MAX and MAX >= 1")
        if high > MAX_SLOTS:
            raise ValueError(f"count {low}..{high}: at most {MAX_SLOTS} replicas per service")
        if low != high and self.scaling is None:
            raise ValueError("a range count needs `scaling` (metric: rps, target: N)")
        if low == high and self.scaling is not None:
            raise ValueError(
                f"a fixed count ({low}) with `scaling`: give a range "
                f"(e.g. count: 1..{max(high, 2)}) or remove `scaling` (dstack refuses this too)"
            )
        return self

    @property
    def launch(self) -> Launch | None:
        """The server the group's commands launch (None: none pdctl knows, or unreadable
        commands, which parse() refuses with the reason)."""
        try:
            return find_launch(self.commands)
        except CommandError:
            return None

    @property
    def engine(self) -> Engine:
        launch = self.launch
        return launch.engine if launch is not None else "sglang"

    @property
    def connection(self) -> Connection:
        """How SMG reaches the group's workers (pdctl/launch.py)."""
        launch = self.launch
        return launch.connection if launch is not None else "http"

    @property
    def named_role(self) -> Literal["prefill", "decode"] | None:
        """The role said outside the command: pdctl.role, else the group's name."""
        if self.pdctl is not None and self.pdctl.role is not None:
            return self.pdctl.role
        name = (self.name or "").lower()
        return "prefill" if "prefill" in name else "decode" if "decode" in name else None

    @property
    def role(self) -> GroupRole | None:
        if self.router is not None:
            return "router"
        launch = self.launch
        if launch is not None and launch.engine == "vllm":
            return launch.role or self.named_role
        mode = re.search(r"--disaggregation-mode[=\s]+(\w+)", " ".join(self.commands))
        if mode and mode[1] in {"prefill", "decode"}:
            return mode[1]  # type: ignore[return-value]
        return self.named_role


Policy = Literal[
    "random",
    "round_robin",
    "cache_aware",
    "power_of_two",
    "least_load",
    "consistent_hashing",
    "prefix_hash",
    "manual",
    "passthrough",
    "bucket",
]


class PdctlRouter(Strict):
    host: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,252}$",
        description="Inventory host for the router (default: a CPU host).",
    )
    metrics_port: Port = 29000
    policy: Policy | None = None
    prefill_policy: Annotated[
        Policy, AfterValidator(lambda v: group_policy("--prefill-policy", v))
    ] = "round_robin"
    decode_policy: Annotated[
        Policy, AfterValidator(lambda v: group_policy("--decode-policy", v))
    ] = "round_robin"
    health_check_interval: Annotated[Duration, Field(ge=1)] = 10.0
    address: Annotated[str, AfterValidator(router_replicas.check_address)] | None = Field(
        None,
        description="A failover address: an unused IPv4 address of the router hosts' subnet "
        "that keepalived holds on one healthy router (the service's endpoint).",
    )
    virtual_router_id: int | None = Field(
        None,
        ge=1,
        le=255,
        description="VRRP's virtual router id of the address, unique on its network segment "
        "(default: the address's last octet).",
    )


class PdctlPorts(Strict):
    base: Port = Field(30000, description="First worker port on a host.")
    stride: int = Field(
        DEFAULT_PORT_STRIDE,
        ge=MIN_PORT_STRIDE,
        le=10000,
        description="Between two workers on one host (SGLang uses port+233...).",
    )
    bootstrap_base: Port = Field(8998, description="First prefill bootstrap port on a host.")
    side_channel_base: Port = Field(
        5600,
        description="vLLM: first NIXL side channel port on a host (VLLM_NIXL_SIDE_CHANNEL_PORT; "
        "a slot takes one per GPU).",
    )


class PdctlPlacement(Strict):
    survive_host_loss: bool = Field(
        False,
        description="Refuse a plan in which losing any one host leaves a group fewer slots "
        "than its min count (pdctl/failover.py).",
    )


class PdctlScaler(Strict):
    """How fast the scaler acts on a replica or host that stops answering (pdctl/failover.py)."""

    interval: Annotated[Duration, Field(ge=0.2, le=60)] = failover.INTERVAL
    host_lost_after: Annotated[Duration, Field(ge=1, le=600)] = failover.HOST_LOST_AFTER
    unhealthy_after: Annotated[Duration, Field(ge=1, le=600)] = failover.UNHEALTHY_AFTER
    probe_timeout: Annotated[Duration, Field(ge=0.2, le=60)] = failover.PROBE_TIMEOUT
    kill_after: Annotated[Delay, Field(le=600)] = failover.KILL_AFTER


class PdctlSettings(Strict):
    """Settings only pdctl reads; they sit under one top-level key so dstack files stay readable."""

    fleet: Annotated[str, AfterValidator(validate.fleet_name)] | None = None
    runtime: Literal["auto", "podman", "docker"] = "auto"
    image_archive: HostPath | None = Field(
        None, description="Load the image from this archive (air-gapped hosts)."
    )
    image_id: ImageId | None = Field(None, description=IMAGE_ID_HELP + " (the spec's image)")
    memlock: Literal["unlimited", "inherit"] = Field(
        "unlimited",
        description="RDMA needs unlimited locked memory; 'inherit' where rlimits cannot be raised.",
    )
    provider_lib: Literal["auto", "host", "image"] = Field(
        "auto",
        description=(
            "The RDMA provider library (lib<driver>-rdmav*.so) the workers use: 'host' mounts "
            "the host's read-only, 'image' uses the image's own; 'auto' mounts it on AMD hosts "
            "(ROCm images lack bnxt_re's) and not on NVIDIA hosts (CUDA images carry libmlx5)."
        ),
    )
    start_timeout: Duration = float(layout.START_TIMEOUT)
    stop_timeout: Duration = float(layout.STOP_TIMEOUT)
    router: PdctlRouter = Field(default_factory=PdctlRouter)
    ports: PdctlPorts = Field(default_factory=PdctlPorts)
    placement: PdctlPlacement = Field(default_factory=PdctlPlacement)
    scaler: PdctlScaler = Field(default_factory=PdctlScaler)
    wheelhouse: HostPath | None = Field(
        None, description="Directory of wheels on the router host (offline SMG install)."
    )
    model_revision: Annotated[str, AfterValidator(hf_layout.check_revision)] | None = Field(
        None, description="The model's branch, tag or commit fetched into the cache (main)."
    )


class Spec(Strict):
    type: Literal["service"]
    name: Name
    # Optional as in dstack: worker groups may each name their own (_check_groups).
    image: Image | None = None
    privileged: bool = False
    env: list[str] = Field(default_factory=list, max_length=1024)
    replicas: list[ReplicaGroup] = Field(min_length=1, max_length=16)
    port: Port = 8000
    model: (
        Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,199}$")]
        | dict[str, Any]
        | None
    ) = None
    probes: list[Probe] = Field(default_factory=list, max_length=8)
    volumes: list[Annotated[str, AfterValidator(validate.volume)]] = Field(default_factory=list)
    router: Router | None = None
    resources: Resources | None = None
    pdctl: PdctlSettings = Field(default_factory=PdctlSettings)
    ignored: list[str] = Field(default_factory=list, exclude=True)

    @property
    def routers(self) -> int:
        """How many routers the service runs: its router group's count (one of dstack's
        older top-level router)."""
        group = next((g for g in self.replicas if g.role == "router"), None)
        return group.count[0] if group is not None else 1

    @property
    def model_name(self) -> str | None:
        if isinstance(self.model, dict):
            return str(self.model.get("name")) if self.model.get("name") else None
        return self.model

    def group(self, role: GroupRole) -> ReplicaGroup:
        return next(g for g in self.replicas if g.role == role)

    @property
    def engine(self) -> Engine:
        """The engine of the service's workers (parse() checks both groups run the same)."""
        return self.group("prefill").engine

    @property
    def connection(self) -> Connection:
        """How SMG reaches the service's workers (parse() checks both groups' agree)."""
        return self.group("prefill").connection

    def gpus(self, group: ReplicaGroup) -> Gpu | None:
        resources = group.resources or self.resources
        return resources.gpu if resources else None

    def image_of(self, group: ReplicaGroup) -> str:
        """The image a worker group runs (parse() checks that each has one)."""
        image = group.image or self.image
        assert image is not None
        return image

    @property
    def workers_privileged(self) -> bool:
        """Whether the worker containers run privileged: the groups' own setting, else the
        service's (parse() checks that both worker groups agree)."""
        group = self.group("prefill")
        return self.privileged if group.privileged is None else group.privileged


class Env(BaseModel):
    """The service's environment: plain values, and the names of secrets from the caller."""

    plain: dict[str, str] = Field(default_factory=dict)
    secrets: list[str] = Field(default_factory=list)


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


def _field(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


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
    ignored = _strip_ignored(data)
    _check_text(data, path, located)
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
        raise SpecError(path, located.line_of(loc), _field(loc) or None, message) from exc
    spec.ignored = ignored
    _check_launches(spec, path, located)
    _check_groups(spec, path, located)
    _check_engines(spec, path, located)
    _check_scaling(spec, path, located)
    _check_router(spec, path, located)
    _check_image_ids(spec, path, located)
    _check_commands(spec, path, located)
    _check_slot_count(spec, path, located)
    env = resolve_env(env_items, path, environ)
    _check_engine_env(spec, env, path, located)
    return spec, env


# Set by pdctl per vLLM slot (pdctl/plan.py Slot.env): a service-wide value would give every
# worker on a host one side channel port, and the second would not start.
PER_SLOT_VLLM_ENV = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST")


def _check_engine_env(spec: Spec, env: Env, path: Path, located: Located) -> None:
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


def _check_text(data: dict[str, Any], path: Path, located: Located) -> None:
    """No control character in any text but commands (nothing may start a new line in a
    unit, an env file or a path), and every mapping key is text."""
    for loc, text in validate.walk_strings(data):
        bad = validate.control_char(text, allowed=_allowed_controls(loc))
        if bad is not None:
            raise SpecError(
                path,
                located.line_of(loc),
                _field(loc),
                f"holds {validate.describe_char(bad)}: refused (it could start a new line "
                "in a unit or an environment file on the hosts)",
            )
    for loc, key in _non_text_keys(data):
        raise SpecError(path, located.line_of(loc), _field(loc) or None, f"key {key!r} is not text")


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


def _check_launches(spec: Spec, path: Path, located: Located) -> None:
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
                path, located.line_of(loc), _field(loc), exc.problem, hint=exc.hint
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


def _check_engines(spec: Spec, path: Path, located: Located) -> None:
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


def _check_scaling(spec: Spec, path: Path, located: Located) -> None:
    """A latency metric scales the phase it measures, from metrics the worker exports."""
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
        if scaling.metric not in LATENCY_METRICS:
            continue
        if group.connection == "grpc":
            worker_kind = "a vLLM" if group.engine == "vllm" else f"an SGLang ({GRPC_MODE})"
            raise refuse(
                f"{scaling.metric} is read from the workers' HTTP /metrics, and {worker_kind} "
                "gRPC worker serves no HTTP",
                f"scale the {worker} group on rps (SMG counts its requests)",
            )


# SGLang serves /metrics only with this flag; pdctl adds it where a group scales on latency.
METRICS_FLAG = "--enable-metrics"


def added_flags(group: ReplicaGroup) -> tuple[str, ...]:
    """Flags pdctl adds to a worker group's launch: --enable-metrics for an SGLang group that
    scales on ttft or itl (the scaler reads them from the workers' /metrics) and lacks it."""
    scaling = group.scaling
    if scaling is None or scaling.metric not in LATENCY_METRICS or group.engine != "sglang":
        return ()
    launch = find_launch(group.commands)
    return () if launch is None or launch.has_flag(METRICS_FLAG) else (METRICS_FLAG,)


def _check_router(spec: Spec, path: Path, located: Located) -> None:
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
            raise SpecError(path, located.line_of(loc), _field(loc), str(exc)) from exc


def image_pin(spec: Spec, group: ReplicaGroup) -> str | None:
    """The image ID the operator pins for what ``group`` runs: the group's own pdctl.image_id,
    else the spec's pdctl.image_id when the group runs the spec's image."""
    if group.pdctl is not None and group.pdctl.image_id is not None:
        return group.pdctl.image_id
    return spec.pdctl.image_id if group.image in {None, spec.image} else None


def _check_image_ids(spec: Spec, path: Path, located: Located) -> None:
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
                _field(loc),
                f"{image} is pinned to {first[0]} by replicas[{first[1]}] and to {pin} here",
                hint="one image has one ID: pin it once (pdctl.image_id for the spec's image)",
            )


def _check_commands(spec: Spec, path: Path, located: Located) -> None:
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
                path, located.line_of(loc), _field(loc), exc.problem, hint=exc.hint
            ) from exc


def _check_slot_count(spec: Spec, path: Path, located: Located) -> None:
    """Slots within bounds. Ports are judged per host, after placement (pdctl/plan.py): in a
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


def load(path: Path, environ: Mapping[str, str]) -> tuple[Spec, Env]:
    try:
        text = read_text_capped(path)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}", hint="check the path") from exc
    except YamlError as exc:
        raise SpecError(path, exc.line, None, str(exc)) from exc
    return parse(text, path, environ)
