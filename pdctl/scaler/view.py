"""What one tick of the scaler saw, and the actions it has in flight."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdctl.core.plan import Slot
from pdctl.core.scaling.engine_loads import EngineLoad
from pdctl.doors.router import Worker
from pdctl.doors.slots import SlotState
from pdctl.scaler.calls import Answer


@dataclass
class View:
    """One tick's observation: what answered by its deadlines."""

    # every slot: its unit state read this tick, else as last read (its host did not answer)
    states: dict[str, SlotState]
    fresh: set[str]  # the hosts read this tick
    errors: dict[str, str]  # the hosts not read this tick: why
    workers: dict[str, Worker]  # the router's registrations, by URL
    health: dict[str, bool]  # running slots: whether the engine answered its health check
    texts: dict[str, Answer[str]]  # latency groups' routed HTTP slots: their /metrics
    # latency groups' routed gRPC slots: their engines' GetLoads
    loads: dict[str, Answer[EngineLoad]] = field(default_factory=dict)
    # the service's other routers that answered (without SMG's mesh): their registrations
    others: dict[str, dict[str, Worker]] = field(default_factory=dict)


@dataclass(frozen=True)
class Pending:
    """An action in flight on a slot."""

    action: str
    slot: Slot
    started: float  # time.monotonic()
    done: Callable[[bool], None]
