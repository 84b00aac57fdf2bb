"""dstack's service file, as pdctl reads it: replica groups (the router group and the prefill
and decode worker groups) with their commands, scaling, resources and images; probes; the
router; and Spec, the whole file (pdctl's own settings under ``pdctl:``, settings.py); Env, the
service's environment once resolved.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdctl.core import layout, validate
from pdctl.core.entrypoint import find_launch
from pdctl.core.launch import Connection, Engine, Launch
from pdctl.core.shell import CommandError
from pdctl.core.spec.settings import PdctlSettings
from pdctl.core.spec.values import (
    IMAGE_ID_HELP,
    Delay,
    Duration,
    Gpu,
    Image,
    ImageId,
    Name,
    Port,
    Resources,
    Strict,
    to_seconds,
)

GroupRole = Literal["router", "prefill", "decode"]

# dstack replica-group settings that pick dstack's own base image (python, nvcc) or a
# docker-in-docker one: meaningless for the router group, which pdctl runs from a pinned SMG
# venv, not an image; a worker group without an `image` of its own or the service's cannot run.
BASE_IMAGE_FIELDS = ("python", "nvcc", "docker")

# At most this many slots (replicas up to each group's max) per service: each is planned,
# written and probed at every deploy.
MAX_SLOTS = 1024

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
    window: Annotated[float, BeforeValidator(to_seconds)] = Field(
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
            seconds = to_seconds(value)
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

    @field_validator("type", mode="before")
    @classmethod
    def _smg_only(cls, value: Any) -> Any:
        """dstack's other router (Dynamo: its own frontend, etcd and NATS) is named, not
        listed among the allowed values as if it were a typo."""
        if value != "sglang":
            raise ValueError(
                f"{validate.shown(value, 'this router')}: pdctl runs SMG, the router of "
                "`router: {type: sglang}`, and no other"
            )
        return value


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
    # check_groups decides what each means for the group's role.
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
        """How SMG reaches the group's workers (pdctl/core/launch.py)."""
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


class Spec(Strict):
    type: Literal["service"]
    name: Name
    # Optional as in dstack: worker groups may each name their own (check_groups).
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
