"""pdctl's own settings, under one extra top-level key ``pdctl:`` (a dstack file stays readable
by both): the fleet, the runtime and images, timeouts, the router's policies and ports, the
port stride, placement, the scaler's timings, the model's revision.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    StrictInt,
)

from pdctl.core import failover, layout, router_replicas, validate
from pdctl.core.router_flags import group_policy
from pdctl.core.spec.values import IMAGE_ID_HELP, Delay, Duration, HostPath, ImageId, Port, Strict
from pdctl.onhost import hf_layout

# A worker takes the ports from its --port on: SGLang opens internal ones up to --port + 233,
# so no stride may be shorter than this.
MIN_PORT_STRIDE = 300

DEFAULT_PORT_STRIDE = 1000

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
    mesh: bool = Field(
        False,
        description="Join several routers by SMG's mesh, for what only it shares (the "
        "cache-aware policy's tree, rate limits). Off, pdctl registers every worker on every "
        "router; SMG 1.13's mesh costs each router about half a core, idle (docs/facts.md).",
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
        "than its min count (pdctl/core/failover.py).",
    )


class PdctlScaler(Strict):
    """How fast the scaler acts on a replica or host that stops answering
    (pdctl/core/failover.py)."""

    interval: Annotated[Duration, Field(ge=0.2, le=60)] = failover.INTERVAL
    host_lost_after: Annotated[Duration, Field(ge=1, le=600)] = failover.HOST_LOST_AFTER
    unhealthy_after: Annotated[Duration, Field(ge=1, le=600)] = failover.UNHEALTHY_AFTER
    probe_timeout: Annotated[Duration, Field(ge=0.2, le=60)] = failover.PROBE_TIMEOUT
    kill_after: Annotated[Delay, Field(le=600)] = failover.KILL_AFTER


class PdctlScaling(Strict):
    """What the service's scaler may do: act or only advise, and how many GPUs it may hold."""

    mode: Literal["act", "advise"] = Field(
        "act",
        description="advise: the scaler observes and decides, records and exports its "
        "decisions, and acts on nothing (trust the policy first; `pdctl scaler advise` shows it).",
    )
    max_gpus: Annotated[StrictInt, Field(ge=1, le=1_000_000)] | None = Field(
        None,
        description="GPUs the service's replicas may hold at most: a scale-out past it is "
        "refused, and shown so (status, metrics). The fleet's --gpu-budget applies too.",
    )


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
    scaling: PdctlScaling = Field(default_factory=PdctlScaling)
    wheelhouse: HostPath | None = Field(
        None, description="Directory of wheels on the router host (offline SMG install)."
    )
    model_revision: Annotated[str, AfterValidator(hf_layout.check_revision)] | None = Field(
        None, description="The model's branch, tag or commit fetched into the cache (main)."
    )
