"""The scaler daemon: observe -> decide -> act -> record, every few seconds.

Restart-safe: every tick starts from what actually runs (unit states and the
router's registrations), so a crash or ``kill -9`` at any point leaves
nothing orphaned after the next start. One scaler per service (a lock on the
host that runs it). SIGTERM finishes the action in hand, then exits.

Scale-out starts the lowest free slot's unit; the worker is registered with the
router once its probe answers (a later tick), so a long model load never blocks
the other group. Scale-in deregisters the newest slot, waits for the router to
let go of it (drain), then stops its unit (which drains in-flight requests).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdctl.errors import EnvironmentProblem, PdctlError
from pdctl.plan import WORKER_ROLES, Plan, Slot
from pdctl.router import Router, Worker, requests_total
from pdctl.scaler.decide import Decision, History, Observation, Policy, decide
from pdctl.scaler.observe import (
    LATENCY_HISTOGRAMS,
    QUEUE_GAUGES,
    RUNNING_GAUGES,
    CounterRate,
    LatencyWindow,
    gauge,
    histogram,
)
from pdctl.slots import Actuator, SlotState

Log = Callable[[str], None]
# A registered worker that stays unhealthy this long is replaced by another slot.
UNHEALTHY_GRACE = 60.0


class Store:
    """Where the scaler keeps its state and reads pins: local files, or files over SSH."""

    def __init__(
        self, read: Callable[[str], str | None], write: Callable[[str, str], None]
    ) -> None:
        self.read, self.write = read, write

    @classmethod
    def directory(cls, path: Path) -> Store:
        def read(name: str) -> str | None:
            file = path / name
            return file.read_text() if file.is_file() else None

        def write(name: str, text: str) -> None:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(path / name)

        return cls(read, write)


def policies(plan: Plan, pins: dict[str, int]) -> dict[str, Policy]:
    found: dict[str, Policy] = {}
    for role in WORKER_ROLES:
        group = plan.groups[role]
        scaling = group.scaling or {}
        up = scaling.get("scale_up_delay")
        down = scaling.get("scale_down_delay")
        found[role] = Policy(
            group=role,
            min=group.min,
            max=group.max,
            target=float(scaling.get("target") or math.inf),
            metric=scaling.get("metric") or "rps",
            scale_up_delay=float(up) if up is not None else 0.0,
            scale_down_delay=float(down) if down is not None else 60.0,
            pinned=pins.get(role),
        )
    return found


@dataclass(frozen=True)
class WorkerSignals:
    """One group's signals from its workers' own metrics (None: missing)."""

    latency: float | None = None  # the windowed percentile, seconds
    queue_per_replica: float | None = None
    inflight_per_replica: float | None = None
    serving: int | None = None  # replicas routed to (a started one serves once registered)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.desired = Gauge(
            "pdctl_scaler_desired_replicas", "Replicas the policy wants", ["group"], registry=r
        )
        self.running = Gauge(
            "pdctl_scaler_running_replicas", "Replicas whose unit is active", ["group"], registry=r
        )
        self.rps = Gauge(
            "pdctl_scaler_rps", "Client requests per second through the router", registry=r
        )
        self.signal = Gauge(
            "pdctl_scaler_signal_value",
            "The deciding signal's observed value (rps, or seconds for ttft/itl)",
            ["group", "signal"],
            registry=r,
        )
        self.target = Gauge(
            "pdctl_scaler_signal_target",
            "The deciding signal's target (rps per replica, or seconds for ttft/itl)",
            ["group", "signal"],
            registry=r,
        )
        self.queue = Gauge(
            "pdctl_scaler_queue_per_replica",
            "Requests waiting per routed replica (the workers' own gauge)",
            ["group"],
            registry=r,
        )
        self.decisions = Counter(
            "pdctl_scaler_decisions", "Decisions by action", ["group", "action"], registry=r
        )
        self.actions = Histogram(
            "pdctl_scaler_action_seconds", "Time an action took", ["action"], registry=r
        )
        self.failures = Counter(
            "pdctl_scaler_action_failures", "Actions that failed", ["action"], registry=r
        )


@contextlib.contextmanager
def service_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise EnvironmentProblem(
                f"another scaler holds {path}",
                hint="one scaler per service: stop the other one first",
            ) from exc
        yield


def scale_in_order(
    running: list[Slot],
    workers: dict[str, Worker],
    started_at: dict[str, float],
    out_of_service_since: dict[str, float],
    *,
    now: float,
    start_timeout: float,
) -> tuple[list[Slot], list[str]]:
    """Which running replicas leave first, and the names of those still starting.

    A replica that runs but is not routed to yet (someone else started it: a deploy, a
    restart) is about to serve: taking an in-service replica away meanwhile could leave the
    group with none (503s), so nothing leaves while one is starting, up to the start timeout
    (``out_of_service_since`` remembers since when, across ticks). Past that it serves nothing
    and leaves first; then the newest this scaler started, then the highest index."""
    out = []
    for slot in running:
        worker = workers.get(slot.url)
        if worker is not None and worker.healthy:
            out_of_service_since.pop(slot.name, None)
        else:
            out.append(slot)
    starting = [
        s.name for s in out if now - out_of_service_since.setdefault(s.name, now) < start_timeout
    ]
    if starting:
        return [], starting
    newest = sorted(running, key=lambda s: (started_at.get(s.name, 0.0), s.index), reverse=True)
    return out + [s for s in newest if s not in out], []


class Scaler:
    def __init__(
        self,
        plan: Plan,
        actuator: Actuator,
        router: Router,
        store: Store,
        *,
        interval: float = 2.0,
        rps_window: float = 30.0,
        log: Log = print,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        self.plan, self.actuator, self.router, self.store = plan, actuator, router, store
        self.interval, self.log, self.clock = interval, log, clock
        self.rate = CounterRate(window=rps_window, min_span=min(5.0, rps_window / 2))
        self.histories: dict[str, History] = {role: History() for role in WORKER_ROLES}
        self.started_at: dict[
            str, float
        ] = {}  # slot -> when this scaler started it (newest goes first)
        self.unhealthy_since: dict[str, float] = {}
        self.out_of_service_since: dict[str, float] = {}  # running, not (yet) routed to
        self.metrics = metrics or Metrics()
        self.stop = threading.Event()
        self.last: dict[str, Decision] = {}
        self.rps: float | None = None
        self.windows: dict[str, LatencyWindow] = {}  # group -> its latency window
        self.scrape_errors: dict[str, str] = {}  # slot -> last scrape problem (logged once)
        self._restore()

    def _restore(self) -> None:
        try:
            previous = json.loads(self.store.read("scaler.json") or "{}")
        except (ValueError, PdctlError, OSError):
            return
        if previous.get("service") != self.plan.service:
            return
        for role, data in (previous.get("histories") or {}).items():
            if role in self.histories and isinstance(data, dict):
                self.histories[role] = History.from_dict(data)

    # -- observe -------------------------------------------------------------
    def _scrape(self, now: float) -> None:
        try:
            self.rate.add(now, requests_total(self.router.metrics_text()))
        except PdctlError as exc:
            self.log(f"metrics unavailable: {exc.message}")
        self.rps = self.rate.rate(now, stale_after=max(30.0, 5 * self.interval))

    def _scrape_workers(
        self,
        role: str,
        policy: Policy,
        states: dict[str, SlotState],
        workers: dict[str, Worker],
        now: float,
    ) -> WorkerSignals:
        """A latency group's percentile, queue and in-flight per replica, from the workers
        the router routes to (a replica still starting serves nothing yet)."""
        if policy.metric == "rps":
            return WorkerSignals()
        scaling = self.plan.groups[role].scaling or {}
        window = self.windows.get(role)
        if window is None:
            span = float(scaling.get("window") or 60.0)
            window = self.windows[role] = LatencyWindow(window=span, min_span=min(5.0, span / 2))
        routed = [
            s.slot
            for s in states.values()
            if s.slot.group == role
            and s.running
            and (w := workers.get(s.slot.url)) is not None
            and w.healthy
        ]
        queued: list[float | None] = []
        running: list[float | None] = []
        for slot in routed:
            try:
                text = self.actuator.metrics(slot)
            except PdctlError as exc:
                self._scrape_problem(slot.name, f"metrics of {slot.name} unavailable: {exc}")
                queued.append(None)
                running.append(None)
                continue
            buckets = histogram(text, LATENCY_HISTOGRAMS[policy.metric])
            if buckets is None:
                self._scrape_problem(slot.name, f"{slot.name} exports no {policy.metric} histogram")
            else:
                self.scrape_errors.pop(slot.name, None)
                window.add(slot.name, now, buckets)
            queued.append(gauge(text, QUEUE_GAUGES))
            running.append(gauge(text, RUNNING_GAUGES))
        names = {s.name for s in routed}
        window.forget(names)
        stale_after = max(30.0, 5 * self.interval)
        percentile = float(scaling.get("percentile") or 90.0) / 100
        latency = window.percentile(names, percentile, now, stale_after) if names else None
        return WorkerSignals(latency, _per_replica(queued), _per_replica(running), len(routed))

    def _scrape_problem(self, slot: str, message: str) -> None:
        if self.scrape_errors.get(slot) != message:
            self.log(message)
        self.scrape_errors[slot] = message

    def _pins(self) -> dict[str, int]:
        text = self.store.read("overrides.json")
        try:
            pins = json.loads(text) if text else {}
        except ValueError:
            self.log("overrides.json is not JSON: ignored")
            return {}
        return {k: int(v) for k, v in pins.items() if k in WORKER_ROLES and isinstance(v, int)}

    # -- reconcile: registrations follow what runs ------------------------------
    def _reconcile(
        self, states: dict[str, SlotState], workers: dict[str, Worker], now: float
    ) -> None:
        for state in states.values():
            slot, worker = state.slot, workers.get(state.slot.url)
            if state.running and worker is None and self.actuator.healthy(slot):
                self._do("register", partial(self.actuator.register, slot))
                self.log(f"registered {slot.name} ({slot.url})")
            elif not state.running and worker is not None:
                self._do("deregister", partial(self.actuator.deregister, slot))
                self.log(f"removed stale registration of {slot.name} (unit {state.active})")
            if state.running and worker is not None and not worker.healthy:
                since = self.unhealthy_since.setdefault(slot.name, now)
                if now - since > UNHEALTHY_GRACE:
                    self.log(f"{slot.name} unhealthy for {now - since:.0f} s: replacing it")
                    self._do("replace", partial(self.actuator.scale_in, slot))
                    self.unhealthy_since.pop(slot.name, None)
                    states[slot.name] = SlotState(slot, "failed", None)
            else:
                self.unhealthy_since.pop(slot.name, None)

    # -- act -----------------------------------------------------------------
    def _do(self, action: str, work: Callable[[], object]) -> bool:
        started = time.monotonic()
        try:
            work()
        except PdctlError as exc:
            self.metrics.failures.labels(action).inc()
            self.log(f"{action} failed: {exc.message}")
            return False
        finally:
            self.metrics.actions.labels(action).observe(time.monotonic() - started)
        return True

    def _scale(
        self,
        role: str,
        decision: Decision,
        states: dict[str, SlotState],
        workers: dict[str, Worker],
    ) -> None:
        group = [s for s in states.values() if s.slot.group == role]
        running = [s.slot for s in group if s.running]
        if decision.desired > len(running):
            # lowest free slots first; failed units only when nothing else is left
            free = sorted(
                (s for s in group if not s.running),
                key=lambda s: (s.active == "failed", s.slot.index),
            )
            for state in free[: decision.desired - len(running)]:
                if self.stop.is_set():
                    return
                slot = state.slot
                if self._do("start", partial(self.actuator.start, slot)):
                    self.started_at[slot.name] = self.clock()
                    self.log(f"started {slot.name} on {slot.host}; it registers once healthy")
        elif decision.desired < len(running):
            victims, starting = scale_in_order(
                running,
                workers,
                self.started_at,
                self.out_of_service_since,
                now=self.clock(),
                start_timeout=self.plan.start_timeout,
            )
            if starting:
                self.log(f"scale-in of {role} waits: {', '.join(starting)} not in service yet")
            for slot in victims[: len(running) - decision.desired]:
                if self.stop.is_set():
                    return
                if self._do("stop", partial(self.actuator.scale_in, slot)):
                    self.started_at.pop(slot.name, None)
                    self.log(f"drained and stopped {slot.name} on {slot.host}")

    # -- one tick --------------------------------------------------------------
    def tick(self) -> dict[str, Decision]:
        now = self.clock()
        self._scrape(now)
        states = self.actuator.states()
        try:
            workers = {w.url.rstrip("/"): w for w in self.router.workers()}
        except PdctlError as exc:
            self.log(f"router unavailable: {exc.message}; holding")
            return {}
        self._reconcile(states, workers, now)
        pins = self._pins()
        decisions = {}
        for role, policy in policies(self.plan, pins).items():
            if self.stop.is_set():
                break
            running = sum(1 for s in states.values() if s.slot.group == role and s.running)
            signals = self._scrape_workers(role, policy, states, workers, now)
            observation = Observation(
                at=now,
                rps=self.rps,
                running=running,
                inflight_per_replica=signals.inflight_per_replica,
                latency=signals.latency,
                queue_per_replica=signals.queue_per_replica,
                serving=signals.serving,
            )
            decision, self.histories[role] = decide(policy, observation, self.histories[role], now)
            decisions[role] = decision
            self.metrics.decisions.labels(role, decision.action).inc()
            self.metrics.desired.labels(role).set(decision.desired)
            self.metrics.running.labels(role).set(running)
            self._export(role, decision, signals)
            if decision.action != "hold" or self._changed(role, decision):
                rps = "none" if self.rps is None else f"{self.rps:.2f}"
                self.log(
                    f"decision {role}: signal={decision.signal} "
                    f"value={_show(decision.signal, decision.value)} "
                    f"target={_show(decision.signal, decision.target)} rps={rps} "
                    f"desired={decision.desired} actual={running} "
                    f"action={decision.action} reason={decision.reason}"
                )
            if decision.action != "hold":
                self._scale(role, decision, states, workers)
        if self.rps is not None:
            self.metrics.rps.set(self.rps)
        self.last.update(decisions)
        self._record(now, pins)
        return decisions

    def _export(self, role: str, decision: Decision, signals: WorkerSignals) -> None:
        name = decision.signal or "rps"
        if decision.value is not None:
            self.metrics.signal.labels(role, name).set(decision.value)
        if decision.target is not None and math.isfinite(decision.target):
            self.metrics.target.labels(role, name).set(decision.target)
        if signals.queue_per_replica is not None:
            self.metrics.queue.labels(role).set(signals.queue_per_replica)

    def _changed(self, role: str, decision: Decision) -> bool:
        previous = self.last.get(role)
        return previous is None or previous.reason != decision.reason

    def _record(self, now: float, pins: dict[str, int]) -> None:
        doc: dict[str, Any] = {
            "service": self.plan.service,
            "at": now,
            "rps": self.rps,
            "interval": self.interval,
            "pins": pins,
            "groups": {role: d.to_dict() for role, d in self.last.items()},
        }
        try:
            self.store.write("scaler.json", json.dumps(doc, indent=2))
        except (OSError, PdctlError) as exc:
            self.log(f"could not record state: {exc}")

    def run(self) -> None:
        self.log(f"scaler for {self.plan.service}: every {self.interval:g} s")
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except PdctlError as exc:
                self.log(f"tick failed: {exc.message}")
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
        self.log("scaler stopped")


def _per_replica(values: list[float | None]) -> float | None:
    """The average over the routed replicas; None when one of them did not say."""
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None) / len(values)


def _show(signal: str | None, value: float | None) -> str:
    if value is None:
        return "none"
    if signal in {"ttft", "itl"}:
        return f"{value * 1000:.0f}ms"
    return f"{value:.2f}"


@contextlib.contextmanager
def stop_on_signals(scaler: Scaler) -> Iterator[None]:
    """SIGTERM/SIGINT: finish the action in hand, then leave the loop."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        scaler.log(f"signal {signum}: finishing the current action, then exiting")
        scaler.stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def serve_metrics(metrics: Metrics, host: str, port: int) -> None:
    start_http_server(port, addr=host, registry=metrics.registry)
