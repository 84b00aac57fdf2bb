"""Every listener of a service judged on its host: what other services hold there (Held) and
the ports the spec sets are entered first (two that meet are refused); every port pdctl picks
steps past what is taken (the router's and its metrics' defaults, each slot's worker range,
bootstrap, side channel and KV ports, the scaler's). Each listener is named in plans and
refusals the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from pdctl.core.errors import InputError
from pdctl.core.fleet_model import natural_key
from pdctl.core.plan.model import SCALER_METRICS_PORT, WORKER_ROLES, Plan, Slot, WorkerRole
from pdctl.core.port_ledger import MAX_PORT, Ledger, Span
from pdctl.core.spec import (
    Spec,
)

# What the listeners of a service are called in plans and refusals.
ROUTER = "router"

ROUTER_METRICS = "router's metrics"
ROUTER_MESH = "router's mesh"

SCALER_METRICS = "scaler's metrics"


@dataclass(frozen=True)
class Listener:
    """The ports first..last that one listener of a plan takes on its host."""

    host: str
    first: int
    last: int
    what: str  # ROUTER, "prefill/2", "prefill/2's bootstrap port", ...
    field: str | None  # the spec field that moves it (None: pdctl picks the port)

    def describe(self) -> str:
        return f"{self.what} ({self.field})" if self.field else self.what


@dataclass(frozen=True)
class Held:
    """GPUs, or the ports first..last, that a service holds on a host."""

    service: str
    host: str
    what: str  # as Listener.what, or a slot's name for its GPUs
    gpus: tuple[int, ...] = ()
    ports: tuple[int, int] | None = None

    @property
    def owner(self) -> str:
        return f"service {self.service}'s {self.what}"


def bootstrap_of(slot_name: str) -> str:
    """What a slot's bootstrap port is called (a Listener's or Held's ``what``)."""
    return f"{slot_name}'s bootstrap port"


def side_channel_of(slot_name: str) -> str:
    """What a vLLM slot's NIXL side channel ports are called."""
    return f"{slot_name}'s NIXL side channel"


def kv_of(slot_name: str) -> str:
    """What a vLLM slot's KV connector listener (kv_port) is called."""
    return f"{slot_name}'s KV connector"


KV_PORT_FIELD = "kv_port in --kv-transfer-config"


def listeners(plan: Plan) -> list[Listener]:
    """Every port the plan listens on. A worker takes `port_stride` ports from its own on."""
    router = plan.router
    found = []
    for host in router.hosts:  # every router host runs the router, its metrics and a scaler
        found += [
            Listener(host, router.port, router.port, ROUTER, "port"),
            Listener(
                host,
                router.metrics_port,
                router.metrics_port,
                ROUTER_METRICS,
                "pdctl.router.metrics_port",
            ),
            Listener(
                host, plan.scaler_metrics_port, plan.scaler_metrics_port, SCALER_METRICS, None
            ),
        ]
        if router.meshed:
            found.append(Listener(host, router.mesh_port, router.mesh_port, ROUTER_MESH, None))
    for slot in plan.slots():
        last = slot.port + plan.port_stride - 1
        found.append(Listener(slot.host, slot.port, last, slot.name, "pdctl.ports.base, stride"))
        if slot.bootstrap_port is not None:
            boot = slot.bootstrap_port
            found.append(
                Listener(
                    slot.host, boot, boot, bootstrap_of(slot.name), "pdctl.ports.bootstrap_base"
                )
            )
        if slot.side_channel_port is not None:
            first = slot.side_channel_port
            found.append(
                Listener(
                    slot.host,
                    first,
                    first + len(slot.gpus) - 1,
                    side_channel_of(slot.name),
                    "pdctl.ports.side_channel_base",
                )
            )
        if slot.kv_port is not None:
            first = slot.kv_port
            last = first + len(slot.gpus) - 1
            found.append(Listener(slot.host, first, last, kv_of(slot.name), KV_PORT_FIELD))
    return found


def held_by(plan: Plan) -> list[Held]:
    """What a deployed plan holds: every slot's GPUs (spares too: they are its scaler's
    room) and every listener's ports."""
    ports = [
        Held(plan.service, item.host, item.what, ports=(item.first, item.last))
        for item in listeners(plan)
    ]
    gpus = [Held(plan.service, s.host, s.name, gpus=tuple(s.gpus)) for s in plan.slots()]
    return ports + gpus


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _side_channel_span(spec: Spec) -> int:
    """The ports between two slot positions' NIXL side channels: vLLM's ranks each take the
    next port from the slot's, so a slot takes as many as its GPUs (docs/facts.md)."""
    return max(g.count for g in (spec.gpus(spec.group(r)) for r in WORKER_ROLES) if g)


def _slot_ports(spec: Spec, role: WorkerRole, nth: int) -> tuple[int, int | None, int | None]:
    """The serving port, the bootstrap port (SGLang prefill) and the first NIXL side channel
    port (vLLM) of the nth slot position on a host."""
    ports = spec.pdctl.ports
    vllm = spec.engine == "vllm"
    return (
        ports.base + nth * ports.stride,
        ports.bootstrap_base + nth if role == "prefill" and not vllm else None,
        ports.side_channel_base + nth * _side_channel_span(spec) if vllm else None,
    )


def _position_spans(spec: Spec, role: WorkerRole, gpus: int, nth: int) -> list[tuple[int, int]]:
    """The ports the nth slot position takes on a host: its worker range, bootstrap port and
    side channel (every position's are above the one before's)."""
    return [(first, last) for first, last, _what in _position_parts(spec, role, gpus, nth)]


def _position_parts(
    spec: Spec, role: WorkerRole, gpus: int, nth: int
) -> list[tuple[int, int, str]]:
    port, bootstrap, side_channel = _slot_ports(spec, role, nth)
    parts = [(port, port + spec.pdctl.ports.stride - 1, "worker ports (pdctl.ports.base, stride)")]
    if bootstrap is not None:
        parts.append((bootstrap, bootstrap, "bootstrap port (pdctl.ports.bootstrap_base)"))
    if side_channel is not None:
        last = side_channel + gpus - 1
        parts.append((side_channel, last, "NIXL side channel (pdctl.ports.side_channel_base)"))
    return parts


def _fixed_listeners(spec: Spec, plan: Plan, placed: list[Slot]) -> list[Listener]:
    """The ports the user set, which pdctl never moves: the router's `port` and metrics port
    when the spec gives them, and each vLLM slot's kv_port (its ranks' too)."""
    router = plan.router
    found = []
    for host in router.hosts:
        if "port" in spec.model_fields_set:
            found.append(Listener(host, router.port, router.port, ROUTER, "port"))
        if "metrics_port" in spec.pdctl.router.model_fields_set:
            metrics = router.metrics_port
            found.append(
                Listener(host, metrics, metrics, ROUTER_METRICS, "pdctl.router.metrics_port")
            )
    for slot in placed:
        if slot.kv_port is not None:
            last = slot.kv_port + len(slot.gpus) - 1
            found.append(Listener(slot.host, slot.kv_port, last, kv_of(slot.name), KV_PORT_FIELD))
    return found


def wire_ports(spec: Spec, plan: Plan, placed: list[Slot], held: Sequence[Held]) -> list[str]:
    """Every listener's port, judged on its host: what other services hold there and the
    ports the user set are entered first (two that meet are refused); every port pdctl picks
    then steps past what is taken on its host: the router's and its metrics' defaults, each
    slot's position (worker range, bootstrap, side channel) in placement order, the scaler's.
    Returns the plan's notes on ports that moved from what the spec says."""
    ledger = Ledger()
    for item in held:
        if item.ports is not None:
            ledger.take(item.host, *item.ports, item.owner, held=True)
    for listener in _fixed_listeners(spec, plan, placed):
        span = ledger.clash(listener.host, listener.first, listener.last)
        if span is not None:
            raise _meets(plan.service, listener, span)
        ledger.take(listener.host, listener.first, listener.last, _named(listener))
    notes = _router_ports(spec, plan, ledger)
    positions: dict[str, int] = {}
    for slot in placed:
        nth = ledger.free_position(
            slot.host,
            positions.get(slot.host, 0),
            partial(_position_spans, spec, slot.group, len(slot.gpus)),
        )
        if nth is None:
            raise _past_the_end(spec, slot, positions.get(slot.host, 0))
        positions[slot.host] = nth + 1
        slot.port, slot.bootstrap_port, slot.side_channel_port = _slot_ports(spec, slot.group, nth)
        for first, last in _position_spans(spec, slot.group, len(slot.gpus), nth):
            ledger.take(slot.host, first, last, slot.name)
    plan.scaler_metrics_port = _free_on_all(
        ledger, plan.router.hosts, SCALER_METRICS_PORT, SCALER_METRICS, None
    )
    return notes


def _router_ports(spec: Spec, plan: Plan, ledger: Ledger) -> list[str]:
    """The ports pdctl picks for the routers: one of each (the routers', their metrics', their
    mesh's) free on every router host, since clients and the failover address use one."""
    notes = []
    router = plan.router
    if "port" not in spec.model_fields_set:
        router.port = _free_on_all(ledger, router.hosts, router.port, ROUTER, "port")
        if router.port != spec.port:
            notes.append(
                f"router: port {spec.port} is taken on {_one_of(router.hosts)}: the router "
                f"listens on {router.port} (set `port` in the spec to choose)"
            )
    if "metrics_port" not in spec.pdctl.router.model_fields_set:
        field = "pdctl.router.metrics_port"
        router.metrics_port = _free_on_all(
            ledger, router.hosts, router.metrics_port, ROUTER_METRICS, field
        )
    for host in router.hosts:
        if "port" not in spec.model_fields_set:
            ledger.take(host, router.port, router.port, f"the {ROUTER}")
        if "metrics_port" not in spec.pdctl.router.model_fields_set:
            ledger.take(host, router.metrics_port, router.metrics_port, f"the {ROUTER_METRICS}")
    if router.meshed:
        router.mesh_port = _free_on_all(ledger, router.hosts, router.mesh_port, ROUTER_MESH, None)
        for host in router.hosts:
            ledger.take(host, router.mesh_port, router.mesh_port, f"the {ROUTER_MESH}")
    return notes


def _past_the_end(spec: Spec, slot: Slot, nth: int) -> InputError:
    """No position from ``nth`` on fits below 65536 on the slot's host: say which of its
    ports runs past the end first."""
    while True:
        parts = _position_parts(spec, slot.group, len(slot.gpus), nth)
        past = [(last, what) for _first, last, what in parts if last > MAX_PORT]
        if past:
            last, what = max(past)
            return InputError(
                f"{slot.host}: no free ports for {slot.name}: its {what} would reach {last}, "
                "past 65535",
                hint="lower pdctl.ports.base, stride or the other bases, or the groups' max counts",
            )
        nth += 1


def _free(ledger: Ledger, host: str, port: int, what: str, field: str | None) -> int:
    found = ledger.free_port(host, port)
    if found is None:
        raise InputError(
            f"{host}: no free port for the {what} from {port} up to 65535",
            hint=f"set {field} in the spec" if field else "free ports on the host",
        )
    return found


def _one_of(hosts: Sequence[str]) -> str:
    return hosts[0] if len(hosts) == 1 else f"one of the router hosts ({', '.join(hosts)})"


def _free_on_all(
    ledger: Ledger, hosts: Sequence[str], port: int, what: str, field: str | None
) -> int:
    """The first port from ``port`` on that is free on every one of ``hosts``."""
    while True:
        found = port
        for host in hosts:
            found = _free(ledger, host, found, what, field)
        if all(_free(ledger, host, found, what, field) == found for host in hosts):
            return found
        port = found


def _named(listener: Listener) -> str:
    """A listener of this plan as a message names it: "the router (port)", "prefill/2's KV
    connector (kv_port in --kv-transfer-config)"."""
    service_wide = listener.what in {ROUTER, ROUTER_METRICS, ROUTER_MESH, SCALER_METRICS}
    return f"the {listener.describe()}" if service_wide else listener.describe()


def _meets(service: str, listener: Listener, span: Span) -> InputError:
    """A port the user set that meets another listener on its host: another service's
    (``span.held``) or another port the user set."""
    port = max(listener.first, span.first)
    if not span.held:
        return InputError(
            f"{listener.host}: port {port} is wanted by {span.owner} and by "
            f"{_named(listener)}, both set in the spec",
            hint="set one of them to another port",
        )
    if listener.what == ROUTER:
        return InputError(
            f"{listener.host}: the router of service {service} cannot listen on port {port}: "
            f"{span.owner} does, and the router's port is the service's public endpoint, "
            "so pdctl does not move it",
            hint="set another `port` in the spec (or pdctl.router.host to another host)",
        )
    return InputError(
        f"{listener.host}: port {port} for service {service}'s {listener.what} is taken by "
        f"{span.owner}",
        hint=f"set another {listener.field or 'port'} in the spec",
    )


def check_listeners(plan: Plan, held: Sequence[Held]) -> None:
    """What wire_ports gave, checked once more as a whole: no two listeners of the plan on
    one (host, port), none on a port another service holds there, every port a TCP port.

    A worker's port starts a range of `pdctl.ports.stride` ports: SGLang opens internal
    ports from --port + 233, so every other listener on its host stays out of that range.
    """
    mine: dict[str, list[Listener]] = {}
    for listener in listeners(plan):
        mine.setdefault(listener.host, []).append(listener)
    for host in sorted(mine, key=natural_key):
        spans = sorted(mine[host], key=lambda x: (x.first, x.last, x.what))
        _check_own(host, spans)
        for listener in spans:
            for other in held:
                span = (listener.first, listener.last)
                if other.host == host and other.ports and _overlaps(span, other.ports):
                    start = max(span[0], other.ports[0])
                    raise _meets(plan.service, listener, Span(start, start, other.owner, True))


def _check_own(host: str, spans: list[Listener]) -> None:
    """The plan's own listeners on one host (sorted by first port) apart and below 65536."""
    previous: Listener | None = None
    for listener in spans:
        if listener.last > 65535:
            raise InputError(
                f"{host}: {listener.describe()} would use ports up to {listener.last}, past 65535",
                hint="lower pdctl.ports.base or pdctl.ports.stride, or the groups' max counts",
            )
        if previous is not None and listener.first <= previous.last:
            raise InputError(
                f"{host}: port {listener.first} is wanted by {previous.describe()} "
                f"and by {listener.describe()}",
                hint="move one: pdctl.ports.base/stride/bootstrap_base, port or "
                "pdctl.router.metrics_port in the spec",
            )
        if previous is None or listener.last > previous.last:
            previous = listener
