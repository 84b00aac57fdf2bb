"""What deploy, status, destroy and endpoint return: typed results. PURE.

pdctl/operations/deploy.py builds them, the command line renders them for people, and ``--json``
prints ``model_dump(mode="json")``: these fields, in this order, are that document's keys.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from pdctl.core.plan import WorkerRole
from pdctl.core.scaling.decide import Decision

# Where a service's record stands: its last deploy completed ("applied"), or one started and
# is still running ("applying") or died half-way ("failed"); pdctl/doors/service.py tells which.
RecordState = Literal["applied", "applying", "failed"]


class DeployResult(BaseModel):
    """`pdctl deploy`: what changed, on which hosts, and where clients go."""

    service: str
    fleet: str
    dry_run: bool
    changes: list[str]  # the plan's diff against the one that runs, one line each
    changed_hosts: list[str] = Field(default_factory=list)
    rolled: list[str] = Field(
        default_factory=list
    )  # the replicas replaced by a rolling update ("decode/2", ...)
    converged: bool = False  # the playbooks ran (False: the quick check found nothing to do)
    # hosts of the plan left as they were: unreachable, and --skip-unreachable given
    skipped_hosts: list[str] = Field(default_factory=list)
    drift: list[str] = Field(
        default_factory=list
    )  # why the hosts needed a converge ([] when it was not checked)
    endpoint: str
    api_key_file: str  # host:path
    # The model prefetch: repo, revision, commit, bytes, seconds, and per host its state,
    # source, bytes fetched, rate (None: the plan fetches no model, or nothing ran).
    model: dict[str, Any] | None = None
    # The worker images: per image its id, bytes, seconds and per host its state (present |
    # ready | failed), source (a host, registry, archive; "" when present), bytes, rate, id
    # (pdctl/operations/image_prefetch.py; None: nothing ran).
    images: dict[str, Any] | None = None


class ModelStatus(BaseModel):
    """The plan's model in the caches of the hosts with a slot."""

    repo: str
    revision: str
    bytes: int | None
    hosts: dict[str, str]  # host -> ready | fetching | missing | corrupt | unknown


class RouterStatus(BaseModel):
    host: str
    address: str
    port: int
    state: str  # "ready", "not ready" or "unreachable: <why>"
    unit: str


class RouterReplicaStatus(BaseModel):
    """One of the service's routers: active (clients reach it: it holds the failover address,
    or there is none), backup (it runs and would take the address over), or down."""

    host: str
    address: str
    url: str
    state: Literal["active", "backup", "down"]
    unit: str  # its unit's systemd state ("unreachable": its host did not answer)
    vrrp: str | None = None  # keepalived's state there (MASTER, BACKUP, FAULT)
    error: str | None = None  # why its host did not answer


class ReplicaStatus(BaseModel):
    """One planned slot: its unit on its host and the router's view of it."""

    host: str
    slot: int
    port: int
    gpus: list[int]
    state: str  # systemd's ActiveState of the slot's unit
    registered: bool
    router_status: str | None  # the router's word for the worker (None: not registered)
    healthy: bool | None
    stale: bool  # running an older config than the plan's: the next deploy rolls it
    restarts: int | None  # for a failed unit: systemd's restart count
    last_log: str | None  # for a failed unit: its journal's last line


class HostLossStatus(BaseModel):
    """The group against the loss of one more host (N+1): pdctl/core/failover.py HostLoss."""

    need: int  # the replicas it must keep: the scaler's desired count, else its min
    slots: int  # its slots on hosts that answer
    worst_host: str | None  # the host whose loss would leave the fewest
    left: int  # the slots left then
    survives: bool  # left >= need


class GroupStatus(BaseModel):
    min: int
    max: int
    desired: int | None  # the live scaler's last decision (None: no scaler runs)
    pinned: int | None  # `pdctl scale`'s pin (None: the scaler decides)
    running: int
    last_decision: Decision | None  # as the scaler recorded it
    replicas: list[ReplicaStatus]
    spares: int = 0  # slots that could start now: not running, on hosts that answer
    host_loss: HostLossStatus | None = None


class StatusGroups(BaseModel):
    router: RouterStatus
    prefill: GroupStatus
    decode: GroupStatus

    def worker(self, role: WorkerRole) -> GroupStatus:
        return self.prefill if role == "prefill" else self.decode


class ScalerStatus(BaseModel):
    running: bool
    rps: float | None
    recorded_at: float | None  # when the scaler last recorded its state (Unix time)
    # worker hosts the scaler finds silent or has declared lost: host -> {state, since, error}
    hosts: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # slots it keeps out of service until it has stopped and disabled them (a lost host's)
    fenced: list[str] = Field(default_factory=list)
    # act, or advise (pdctl.scaling.mode: it decides and records, and acts on nothing)
    mode: Literal["act", "advise"] = "act"
    # the GPU budget as the scaler last saw it: {budget, used, holders: {service: GPUs},
    # using (this service), max_gpus, grants} or {error}; None: the service has none
    budget: dict[str, Any] | None = None


# serving: the router is ready and every host answers; degraded: the router is ready, but a
# host does not answer or a group runs fewer replicas than desired; down: the router does
# not answer or is not ready (no healthy prefill and decode): `pdctl status` exits 8.
ServiceHealth = Literal["serving", "degraded", "down"]


class StatusResult(BaseModel):
    """`pdctl status`: the service's record, its replicas, the router's and the scaler's view."""

    service: str
    fleet: str
    state: RecordState
    endpoint: str
    api_key_file: str
    scaler: ScalerStatus
    groups: StatusGroups  # groups.router: the router clients reach (the address holder)
    # Every router of the service, and the failover address in front of them (None: none).
    routers: list[RouterReplicaStatus] = Field(default_factory=list)
    failover_address: str | None = None
    model: ModelStatus | None = None
    health: ServiceHealth = "serving"
    # hosts of the plan that did not answer (their replicas' state is "unreachable"): the SSH
    # error, host -> why
    unreachable: dict[str, str] = Field(default_factory=dict)


class DestroyResult(BaseModel):
    service: str
    deregistered: list[str]  # the replicas taken out of the router first
    hosts: list[str]
    dry_run: bool = False
    # With dry_run, per host what its removal steps would take away: "unit U", "container
    # RUNTIME NAME", "user U", and paths.
    would_remove: dict[str, list[str]] = Field(default_factory=dict)


class EndpointResult(BaseModel):
    """`pdctl endpoint`: the URL, and the router's API key only when asked for (--show-key):
    without it the document has no ``api_key`` key at all."""

    service: str
    endpoint: str  # the failover address's URL, else the first router's
    endpoints: list[str] = Field(default_factory=list)  # every router's own URL
    api_key: str | None = None

    @model_serializer(mode="wrap")
    def _without_an_absent_key(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        doc: dict[str, Any] = handler(self)
        if self.api_key is None:
            doc.pop("api_key", None)
        return doc
