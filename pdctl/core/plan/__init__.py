"""The placement plan: spec + fleet facts -> which replica slot runs where. PURE.

Every slot up to each group's max is planned now (the scaler only starts and
stops planned slots); the min are started. A slot owns its GPUs, serving port
and bootstrap port on its host. Services share a fleet: what the others hold
(their GPUs and ports, spares included; the caller gathers it) is left alone.
Ports are judged per host once the slots are placed (ports.py): the ports
the spec sets stay, pdctl's own step past whatever else listens on the host.
Deterministic: the same inputs give the same plan, byte for byte, so plans diff
cleanly. The plan is also the extra-vars document of playbooks/deploy.yml.

- model.py      the plan as a document: Plan, its groups and slots, its extra-vars
- placement.py  build(): which hosts may take which group, the router's host, the slots
                placed on free GPUs, the capacity refusals
- ports.py      every listener's port judged on its host, and what others hold (Held)
- wiring.py     each slot's NICs, the provider library's mount, the volumes
"""

from pdctl.core.plan.model import (
    CONTAINER_PROVIDER_LIB,
    SCALER_METRICS_PORT,
    WORKER_ROLES,
    Plan,
    Slot,
    WorkerRole,
    plan_from_extravars,
)
from pdctl.core.plan.placement import build, router_args, unusable
from pdctl.core.plan.ports import (
    ROUTER,
    ROUTER_METRICS,
    SCALER_METRICS,
    Held,
    bootstrap_of,
    held_by,
    kv_of,
    listeners,
    side_channel_of,
)

__all__ = [
    "CONTAINER_PROVIDER_LIB",
    "ROUTER",
    "ROUTER_METRICS",
    "SCALER_METRICS",
    "SCALER_METRICS_PORT",
    "WORKER_ROLES",
    "Held",
    "Plan",
    "Slot",
    "WorkerRole",
    "bootstrap_of",
    "build",
    "held_by",
    "kv_of",
    "listeners",
    "plan_from_extravars",
    "router_args",
    "side_channel_of",
    "unusable",
]
