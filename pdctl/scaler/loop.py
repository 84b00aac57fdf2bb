"""The scaler daemon: observe -> judge -> decide -> act -> record, every few seconds.

Restart-safe: every tick starts from what actually runs (unit states and the
router's registrations), so a crash or ``kill -9`` at any point leaves
nothing orphaned after the next start. One scaler per service (a lock on the
host that runs it). SIGTERM finishes the actions in hand, then exits.

No host and no replica holds up the loop. Each tick reads every host's unit states and the
router at once, then checks every running engine's health at once, each phase by its own
deadline: what did not answer in time is a finding (pdctl/core/scaling/watch.py), not a wait.
Every action (start, register, deregister, drain and stop, kill, fence) runs in the
background with its own timeout, at most one per slot; the tick after it ends takes its
result. So a hung drain, a host that stopped answering or a frozen worker delays nothing
else: pins and decisions for every group go on.

Scale-out starts the lowest free slot's unit; the worker is registered with the router once
its health check answers (a later tick). Scale-in deregisters the newest slot, waits for the
router to let go of it (drain), then stops its unit (which drains in-flight requests). A
replica that stops answering is replaced first (a spare starts, and it is deregistered at
once) and killed second; a lost host's replicas are replaced on other hosts and, when it
returns, stopped and disabled there before they can serve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from pdctl.core import layout
from pdctl.core.errors import HostError, PdctlError
from pdctl.core.plan import WORKER_ROLES, Plan, Slot
from pdctl.core.scaling.decide import Decision, History, Observation, Policy, decide
from pdctl.core.scaling.engine_loads import EngineLoad
from pdctl.core.scaling.observe import (
    LATENCY_HISTOGRAMS,
    QUEUE_GAUGES,
    RUNNING_GAUGES,
    CounterRate,
    LatencyWindow,
    gauge,
    histogram,
)
from pdctl.core.scaling.router_latency import Reading, RouterLatency
from pdctl.core.scaling.watch import Watch
from pdctl.doors.router import Router, Worker, open_circuits, requests_total
from pdctl.doors.slots import UNREACHABLE, Actuator, SlotState
from pdctl.scaler.budget_hold import BudgetHold
from pdctl.scaler.calls import Answer, Calls, gather
from pdctl.scaler.groups import WorkerSignals, policies, scale_in_order
from pdctl.scaler.leader import Leadership
from pdctl.scaler.ledger_door import LedgerDoor
from pdctl.scaler.metrics import Metrics
from pdctl.scaler.mirror import Mirror
from pdctl.scaler.store import Store
from pdctl.scaler.view import Pending, View

Log = Callable[[str], None]


# Actions after which a slot no longer serves: while one runs, the slot counts for nothing.
LEAVING = frozenset({"stop", "kill", "fence"})
# A condemned replica is killed once a replacement serves, or after this long regardless.
KILL_DEADLINE = 30.0
# For this long after a loss, workers whose circuit breaker the loss opened are registered
# afresh (at most once per BREAKER_REFRESH each).
RECOVERY_WINDOW = 180.0
BREAKER_REFRESH = 30.0
# A registration SMG has accepted is absent from its list until its health check passes:
# not posted again for this long.
PENDING_GRACE = 10.0
STATES_TIMEOUT = 15.0  # one host's unit states over SSH, at most (a tick waits less)
READ_WAIT = 3.0  # what a tick waits for them (one command per host: well under a second)


class Scaler:
    def __init__(
        self,
        plan: Plan,
        actuator: Actuator,
        router: Router,
        store: Store,
        *,
        interval: float | None = None,
        rps_window: float = 30.0,
        log: Log = print,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        advise: bool | None = None,
        ledger: LedgerDoor | None = None,
        leader: Leadership | None = None,
    ) -> None:
        self.plan, self.actuator, self.router, self.store = plan, actuator, router, store
        # Several router hosts run a scaler each: this one acts only while ``leader`` says its
        # host holds the failover address (None: it always acts).
        self.leader = leader
        self.acting: bool | None = None
        failover = plan.failover
        self.interval = failover.interval if interval is None else interval
        self.log, self.clock = log, clock
        # Advising: observe and decide, act on nothing (the spec's pdctl.scaling.mode, or
        # `pdctl scaler advise` beside the acting scaler).
        self.advise = plan.scaling_mode == "advise" if advise is None else advise
        self.probe_timeout = failover.probe_timeout
        # How long a tick waits for the hosts' unit states and the router: a host that takes
        # longer is silent for this tick (its last states stand) and holds up nothing.
        self.read_wait = READ_WAIT
        self.rate = CounterRate(window=rps_window, min_span=min(5.0, rps_window / 2))
        self.histories: dict[str, History] = {role: History() for role in WORKER_ROLES}
        self.started_at: dict[
            str, float
        ] = {}  # slot -> when this scaler started it (newest goes first)
        self.out_of_service_since: dict[str, float] = {}  # running, not (yet) routed to
        self.metrics = metrics or Metrics()
        self.metrics.advising.set(1 if self.advise else 0)
        self.stop = threading.Event()
        self.last: dict[str, Decision] = {}
        self.rps: float | None = None
        self.windows: dict[str, LatencyWindow] = {}  # group -> its latency window
        # gRPC latency groups: the router's histograms, windowed as each group's spec says
        self.router_latency: dict[str, RouterLatency] = {}
        self.router_key = f"{plan.router.address}:{plan.router.metrics_port}"
        for role in WORKER_ROLES:
            group = plan.groups[role]
            span = float((group.scaling or {}).get("window") or 60.0)
            if group.connection == "grpc" and role in self._latency_groups():
                self.router_latency[role] = RouterLatency(span, min(5.0, span / 2))
        self.scrape_errors: dict[str, str] = {}  # slot -> last scrape problem (logged once)
        self.watch = Watch(failover.host_lost_after, failover.unhealthy_after, plan.start_timeout)
        self.known: dict[str, SlotState] = {}  # slot -> its state when its host last answered
        self.host_errors: dict[str, str] = {}  # host -> why it did not answer (last time)
        self.pending: dict[str, Pending] = {}  # slot -> the action in flight on it
        self.said: set[str] = set()  # conditions logged once until they clear
        self.budget = BudgetHold(
            plan,
            ledger,
            self.metrics,
            advise=self.advise,
            interval=self.interval,
            say=self._say,
            clear=self.said.discard,
        )
        self.open_circuits: set[str] = set()  # worker URLs whose breaker SMG has open
        self.recovering: float | None = None  # when a replica was last lost or condemned
        self.refreshed: dict[str, float] = {}  # slot -> when its registration was renewed
        self.posted: dict[str, float] = {}  # slot -> when registered (monotonic)
        self.by_name = {s.name: s for s in plan.slots()}
        slots = len(plan.slots())
        hosts = len({s.host for s in plan.slots()})
        self.reads = Calls("pdctl-scaler-read", max_workers=2 * (hosts + 2 * slots) + 8)
        self.actions = Calls("pdctl-scaler-act", max_workers=2 * slots + 4)
        # Several routers without SMG's mesh: the acting one's registrations, kept on the others.
        meshless = bool(router.peers) and not plan.router.meshed
        self.mirror = Mirror(router.peers, slots, self.log) if meshless else None
        self._restore()

    def _restore(self) -> None:
        try:
            previous = json.loads(self.store.state() or "{}")
        except (ValueError, PdctlError, OSError):
            return
        if not isinstance(previous, dict) or previous.get("service") != self.plan.service:
            return
        for role, data in (previous.get("histories") or {}).items():
            if role in self.histories and isinstance(data, dict):
                self.histories[role] = History.from_dict(data)
        self.watch.restore(previous)

    # -- one acts, the others stand by -----------------------------------------------------
    def _leading(self) -> bool:
        """Whether this scaler acts this tick. Standing by, it keeps the acting scaler's
        recorded state (and pins) as its own, so that it goes on from there when the failover
        address comes to its host: it restores that state first."""
        if self.leader is None:
            return True
        try:
            holds = self.leader.holds()
        except (OSError, subprocess.SubprocessError) as exc:
            self._say("holds", f"cannot tell whether this host holds {self.leader.address}: {exc}")
            holds = False
        if not holds:
            self._adopt(self.leader.pull())
            if self.acting is not False:
                self.log(
                    f"standing by: the failover address {self.leader.address} is on another "
                    "router host (its scaler acts)"
                )
            self.acting = False
            return False
        if self.acting is not True:
            self._restore()
            self.log(f"acting: this host holds the failover address {self.leader.address}")
            self.acting = True
        return True

    def _adopt(self, doc: dict[str, Any] | None) -> None:
        """The acting scaler's state (and pins), kept as this one's."""
        if doc is None:
            return
        try:
            self.store.write(layout.SCALER_STATE, json.dumps(doc, indent=2))
            pins = doc.get("pins")
            if isinstance(pins, dict) and pins != self._pins():
                self.store.write(layout.SCALER_PINS, json.dumps(pins, indent=2, sort_keys=True))
        except (OSError, PdctlError) as exc:
            self._say("adopt", f"could not keep the acting scaler's state: {exc}")

    def close(self) -> None:
        """Stop taking calls (threads stuck on a dead host end with their own timeouts)."""
        self.reads.shutdown()
        self.actions.shutdown()
        if self.mirror is not None:
            self.mirror.close()

    # -- observe -------------------------------------------------------------
    def _observe(self, now: float) -> View | None:
        """Every host's unit states, the router's registrations and metrics, then every
        running engine's health check, each phase by its own deadline: a host or a worker
        that does not answer is a finding of this tick, never a wait for the next."""
        by_host = self.actuator.slots_by_host()
        reads = {
            host: self.reads.submit(
                f"states {host}",
                partial(self.actuator.host_states, host, STATES_TIMEOUT, labels=False),
            )
            for host in by_host
        }
        listed = self.reads.submit("router workers", self.router.workers)
        scraped = self.reads.submit("router metrics", self.router.metrics_text)
        asked = self.mirror.read() if self.mirror is not None else {}
        deadline = time.monotonic() + self.read_wait
        # A host already silent is not waited for: its read, still running or done since,
        # is taken as it stands (the tick does not pay the wait again every time).
        gather({h: f for h, f in reads.items() if h not in self.watch.silent_since}, deadline)
        answers = gather(reads, time.monotonic())
        workers_answer = gather({"workers": listed}, deadline)["workers"]
        metrics_answer = gather({"metrics": scraped}, deadline)["metrics"]
        others = self.mirror.listed(asked, deadline) if self.mirror is not None else {}
        for host, answer in answers.items():
            if answer.answered:
                self.reads.forget(f"states {host}")
        if workers_answer.answered:
            self.reads.forget("router workers")
        if metrics_answer.answered:
            self.reads.forget("router metrics")
        self._scrape(now, metrics_answer)
        if not workers_answer.ok or workers_answer.value is None:
            self.log(f"router unavailable: {_why(workers_answer)}; holding")
            return None
        workers = {w.url: w for w in workers_answer.value}
        states: dict[str, SlotState] = {}
        fresh: set[str] = set()
        errors: dict[str, str] = {}
        for host, slots in by_host.items():
            answer = answers[host]
            if answer.ok and answer.value is not None:
                fresh.add(host)
                self.known.update(answer.value)
                self.host_errors.pop(host, None)
            else:
                errors[host] = self.host_errors[host] = _why(answer)
            for slot in slots:
                states[slot.name] = self.known.get(slot.name) or SlotState(slot, UNREACHABLE, None)
        health, texts, loads = self._check_engines(states, workers)
        return View(states, fresh, errors, workers, health, texts, loads, others)

    def _check_engines(
        self, states: dict[str, SlotState], workers: dict[str, Worker]
    ) -> tuple[dict[str, bool], dict[str, Answer[str]], dict[str, Answer[EngineLoad]]]:
        """Each running engine's own health check (and a latency group's routed engines'
        /metrics, or GetLoads for a gRPC worker), side by side, within the probe timeout."""
        checked = [
            s.slot for s in states.values() if s.running and not self.watch.off_limits(s.slot.name)
        ]
        probes = {
            slot.name: self.reads.submit(
                f"health {slot.name}", partial(self.actuator.healthy, slot, self.probe_timeout)
            )
            for slot in checked
        }
        routed = [
            slot
            for slot in checked
            if slot.group in self._latency_groups()
            and (w := workers.get(slot.url)) is not None
            and w.healthy
        ]
        scrapes = {
            slot.name: self.reads.submit(
                f"metrics {slot.name}", partial(self.actuator.metrics, slot)
            )
            for slot in routed
            if slot.connection != "grpc"
        }
        asked = {
            slot.name: self.reads.submit(
                f"loads {slot.name}", partial(self.actuator.loads, slot, self.probe_timeout)
            )
            for slot in routed
            if slot.connection == "grpc"
        }
        deadline = time.monotonic() + self.probe_timeout + 0.25
        # Not waited for again: the engines already failing and those of silent hosts (their
        # checks, still running or done since, are taken as they stand).
        gather({n: f for n, f in probes.items() if not self._known_failing(n)}, deadline)
        answered = gather(probes, time.monotonic())
        texts = gather(scrapes, deadline)
        loads = gather(asked, deadline)
        for name, answer in answered.items():
            if answer.answered:
                self.reads.forget(f"health {name}")
        for name, text in texts.items():
            if text.answered:
                self.reads.forget(f"metrics {name}")
        for name, load in loads.items():
            if load.answered:
                self.reads.forget(f"loads {name}")
        health = {name: bool(a.ok and a.value) for name, a in answered.items()}
        return health, texts, loads

    def _latency_groups(self) -> set[str]:
        return {
            role
            for role in WORKER_ROLES
            if (self.plan.groups[role].scaling or {}).get("metric") not in (None, "rps")
        }

    def _known_failing(self, name: str) -> bool:
        slot = self._slot(name)
        return name in self.watch.failing_since or (
            slot is not None and slot.host in self.watch.silent_since
        )

    def _scrape(self, now: float, answer: Answer[str]) -> None:
        if answer.ok and answer.value is not None:
            try:
                self.rate.add(now, requests_total(answer.value))
            except ValueError as exc:
                self.log(f"metrics unreadable: {exc}")
            self.open_circuits = open_circuits(answer.value)
            for latency in self.router_latency.values():
                latency.add(self.router_key, now, answer.value)
        else:
            self.log(f"metrics unavailable: {_why(answer)}")
        self.rps = self.rate.rate(now, stale_after=max(30.0, 5 * self.interval))

    def _scrape_workers(
        self,
        role: str,
        policy: Policy,
        states: dict[str, SlotState],
        workers: dict[str, Worker],
        now: float,
        texts: dict[str, Answer[str]] | None = None,
        loads: dict[str, Answer[EngineLoad]] | None = None,
    ) -> WorkerSignals:
        """A latency group's percentile, queue and in-flight per replica, from the workers
        the router routes to (a replica still starting serves nothing yet). ``texts``: their
        /metrics fetched already (by the tick, side by side); else fetched here. A gRPC
        group's come from the router's histograms and its engines' GetLoads (``loads``)."""
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
            and not self.watch.off_limits(s.slot.name)
            and (w := workers.get(s.slot.url)) is not None
            and w.healthy
        ]
        if role in self.router_latency:
            return self._grpc_signals(role, policy, routed, now, loads or {})
        queued: list[float | None] = []
        running: list[float | None] = []
        for slot in routed:
            try:
                text = self._metrics_text(slot, texts)
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

    def _grpc_signals(
        self,
        role: str,
        policy: Policy,
        routed: list[Slot],
        now: float,
        loads: dict[str, Answer[EngineLoad]],
    ) -> WorkerSignals:
        """A gRPC group's signals: its latency from the router's histograms and totals
        (router_latency.py), its queue and in-flight from each routed engine's GetLoads."""
        scaling = self.plan.groups[role].scaling or {}
        stale_after = max(30.0, 5 * self.interval)
        q = float(scaling.get("percentile") or 90.0) / 100
        found: list[EngineLoad | None] = []
        for slot in routed:
            answer = loads.get(slot.name)
            if answer is not None and answer.ok and answer.value is not None:
                self.scrape_errors.pop(slot.name, None)
                found.append(answer.value)
                continue
            why = _why(answer) if answer is not None else "not asked"
            self._scrape_problem(slot.name, f"GetLoads of {slot.name} unavailable: {why}")
            found.append(None)
        known = [x for x in found if x is not None]
        complete = bool(found) and len(known) == len(found)
        latency = self.router_latency[role]
        routers = {self.router_key}
        if policy.metric == "ttft":
            reading = latency.ttft(routers, q, now, stale_after)
        else:
            reading = latency.tpot(routers, q, now, stale_after)
        queue = sum(x.waiting for x in known) / len(known) if complete else None
        inflight = sum(x.running for x in known) / len(known) if complete else None
        if not routed:
            reading = Reading(None, "no routed replica")
        return WorkerSignals(reading.value, queue, inflight, len(routed), reading.source)

    def _metrics_text(self, slot: Slot, texts: dict[str, Answer[str]] | None) -> str:
        if texts is None:
            return self.actuator.metrics(slot)
        answer = texts.get(slot.name)
        if answer is None or not answer.ok or answer.value is None:
            raise HostError(_why(answer) if answer is not None else "not fetched")
        return answer.value

    def _scrape_problem(self, slot: str, message: str) -> None:
        if self.scrape_errors.get(slot) != message:
            self.log(message)
        self.scrape_errors[slot] = message

    def _pins(self) -> dict[str, int]:
        try:
            text = self.store.pins()
        except (PdctlError, OSError) as exc:
            self.log(f"pins unreadable ({exc}): none applied this tick")
            return {}
        try:
            pins = json.loads(text) if text else {}
        except ValueError:
            self.log(f"{layout.SCALER_PINS} is not JSON: ignored")
            return {}
        return {k: int(v) for k, v in pins.items() if k in WORKER_ROLES and isinstance(v, int)}

    # -- act: every action in the background, with its own deadline ---------------------------
    def _act(
        self,
        action: str,
        slot: Slot,
        work: Callable[[], object],
        done: Callable[[bool], None] | None = None,
    ) -> bool:
        """Start ``action`` on ``slot`` unless one runs on it already; ``done(ok)`` runs in the
        loop once it ends (the tick after). False when the slot is busy."""
        if slot.name in self.pending or self.actions.busy(slot.name):
            return False
        self.pending[slot.name] = Pending(action, slot, time.monotonic(), done or _ignore)
        self.actions.submit(slot.name, work)
        return True

    def _collect(self) -> None:
        """The actions that ended since the last tick: their metrics, failures and follow-ups."""
        for name, future in self.actions.done().items():
            pending = self.pending.pop(name, None)
            if pending is None:
                continue
            self.metrics.actions.labels(pending.action).observe(time.monotonic() - pending.started)
            error = future.exception()
            if error is not None:
                self.metrics.failures.labels(pending.action).inc()
                message = error.message if isinstance(error, PdctlError) else repr(error)
                self.log(f"{pending.action} {name} failed: {message}")
            pending.done(error is None)

    def _leaving(self, name: str) -> bool:
        pending = self.pending.get(name)
        return pending is not None and pending.action in LEAVING

    def _starting(self, name: str) -> bool:
        pending = self.pending.get(name)
        return pending is not None and pending.action == "start"

    # -- judge: hosts and replicas that stopped answering ---------------------------------------
    def _judge_hosts(self, view: View, now: float) -> None:
        by_host = self.actuator.slots_by_host()
        for host, slots in by_host.items():
            if host in view.fresh:
                if self.watch.host_answered(host):
                    fenced = [s.name for s in slots if s.name in self.watch.fenced]
                    self.log(
                        f"{host} answers again: stopping and disabling {', '.join(fenced)} "
                        "before they can serve (replaced while it was away)"
                    )
                self._fence(view, slots)
                continue
            running = [
                s
                for s in slots
                if view.states[s.name].running and not self.watch.off_limits(s.name)
            ]
            engines = any(view.health.get(s.name) for s in running)
            others = any(h in view.fresh for h in by_host if h != host)
            if self.watch.host_silent(host, now, engines_answer=engines, others=others):
                self._lose_host(host, slots, running, view, now)
            elif not others and self.watch.silent_for(host, now) >= self.watch.host_lost_after:
                self._say("no-host", "no worker host answers: holding (is this host's network up?)")
        if view.fresh:
            self.said.discard("no-host")

    def _lose_host(
        self, host: str, slots: list[Slot], running: list[Slot], view: View, now: float
    ) -> None:
        for role in {s.group for s in running}:
            self.watch.hold_floor(role, self._count(role))
        self.watch.lose_host(host, [s.name for s in slots])
        self.recovering = now
        why = view.errors.get(host, "no answer")
        replaced = ", ".join(s.name for s in running) or "none"
        self.log(
            f"{host} lost: no answer for {self.watch.silent_for(host, now):.0f} s ({why}) and "
            f"none of its engines answers; replacing its replicas ({replaced}) elsewhere"
        )
        self.metrics.lost.labels(host).set(1)
        for slot in running:
            self.metrics.replaced.labels(slot.group, "host lost").inc()
        for slot in slots:
            if slot.url in view.workers:
                self._deregister_now(slot)

    def _fence(self, view: View, slots: list[Slot]) -> None:
        """A returned host's fenced slots: stopped and disabled before anything else."""
        for slot in slots:
            if slot.name not in self.watch.fenced:
                continue
            self.metrics.lost.labels(slot.host).set(0)
            if slot.url in view.workers:
                self._deregister_now(slot)
                continue

            def fenced(ok: bool, slot: Slot = slot) -> None:
                if ok:
                    self.watch.unfence(slot.name)
                    self.known[slot.name] = SlotState(slot, "inactive", None)
                    self.log(f"fenced {slot.name} on {slot.host}: stopped and disabled")

            self._act(
                "fence",
                slot,
                partial(self.actuator.fence, slot, self.plan.failover.kill_after),
                fenced,
            )

    def _judge_replicas(self, view: View, now: float) -> None:
        for slot in self.plan.slots():
            state = view.states[slot.name]
            if slot.host in view.fresh and not state.running:
                self.watch.stopped(slot.name)
                continue
            if slot.host in view.fresh and self.watch.unit_read(slot.name, state.restarts, now):
                self.log(
                    f"{slot.name} on {slot.host}: systemd restarted its engine in place; it has "
                    f"{self.plan.start_timeout} s to answer again before it is replaced"
                )
            if (
                slot.host not in view.fresh
                or self.watch.off_limits(slot.name)
                or slot.name in self.pending
            ):
                continue
            worker = view.workers.get(slot.url)
            router_unhealthy = worker is not None and not worker.healthy
            failing = self.watch.replica(
                slot.name,
                now,
                answers=view.health.get(slot.name),
                router_unhealthy=router_unhealthy,
            )
            if failing is not None:
                why = (
                    "its engine's health check fails"
                    if not view.health.get(slot.name)
                    else "the router marks it unhealthy"
                )
                self._condemn(slot, failing, why, view, now)

    def _condemn(self, slot: Slot, failing: float, why: str, view: View, now: float) -> None:
        self.watch.hold_floor(slot.group, self._count(slot.group))
        self.watch.condemn(slot.name, now)
        self.recovering = now
        self.metrics.replaced.labels(slot.group, "unhealthy").inc()
        self.log(
            f"{slot.name} on {slot.host} unhealthy for {failing:.0f} s ({why}): replacing it "
            "(deregistered now, stopped once a spare serves)"
        )
        if slot.url in view.workers:
            self._deregister_now(slot)

    def _deregister_now(self, slot: Slot) -> None:
        """Out of the router at once (no drain: it serves nothing)."""
        self.posted.pop(slot.name, None)

        def done(ok: bool) -> None:
            if ok:
                self.log(f"deregistered {slot.name} ({slot.url})")

        self._act("deregister", slot, partial(self.actuator.deregister, slot, 0.0), done)

    def _kill_condemned(self, view: View, now: float) -> None:
        """A condemned replica is stopped, with a short timeout and a kill, once its group
        serves its count again (or the deadline passes, or there is no spare to wait for)."""
        for name, since in list(self.watch.condemned.items()):
            slot = self._slot(name)
            if slot is None:
                self.watch.condemned.pop(name, None)
                continue
            if name in self.pending or slot.host not in view.fresh:
                continue
            if not view.states[name].running:
                self.watch.forget(name)
                continue
            if slot.url in view.workers:
                self._deregister_now(slot)
                continue
            want = self.last[slot.group].desired if slot.group in self.last else 1
            served = self._in_service(slot.group, view) >= want
            no_spare = not self._free(slot.group, view)
            if not (served or no_spare or now - since >= KILL_DEADLINE):
                continue

            def stopped(ok: bool, slot: Slot = slot) -> None:
                if ok:
                    self.watch.forget(slot.name)
                    self.known[slot.name] = SlotState(slot, "inactive", None)
                    self.log(f"stopped {slot.name} on {slot.host} (it did not answer)")

            self._act(
                "kill",
                slot,
                partial(self.actuator.stop_now, slot, self.plan.failover.kill_after),
                stopped,
            )

    def _reset_breakers(self, view: View, now: float) -> None:
        """After a replica was lost, the router's circuit breaker may keep its partners out:
        SMG counts a failed prefill+decode request against both workers, so a dead decode
        opens the breaker of a healthy prefill too, for a minute. Once the failing worker is
        out of the router, such a worker (its engine answers) is registered afresh, a new
        breaker with it, while the replacement starts (a request with no partner to pair is
        refused before any worker is tried: it opens no breaker). Only in the minutes after
        a loss: otherwise an open breaker is SMG's own verdict."""
        if self.recovering is None or now - self.recovering > RECOVERY_WINDOW:
            return
        if not self.open_circuits:
            return
        if any(self.watch.off_limits(s.name) and s.url in view.workers for s in self.plan.slots()):
            return  # a failing worker is still routed to: a fresh breaker would trip again
        for slot in self.plan.slots():
            if (
                slot.url not in self.open_circuits
                or slot.url not in view.workers
                or not view.health.get(slot.name)
                or self.watch.off_limits(slot.name)
                or slot.name in self.pending
                or now - self.refreshed.get(slot.name, -math.inf) < BREAKER_REFRESH
            ):
                continue
            self.refreshed[slot.name] = now

            def renew(slot: Slot = slot) -> None:
                self.actuator.deregister(slot, drain_timeout=15.0)
                self.actuator.register(slot)

            def renewed(ok: bool, slot: Slot = slot) -> None:
                if ok:
                    self.posted[slot.name] = time.monotonic()
                    self.log(
                        f"registered {slot.name} afresh: the router's circuit breaker kept it "
                        "out after another worker's failures"
                    )

            self._act("refresh", slot, renew, renewed)

    # -- reconcile: registrations follow what runs and answers ----------------------------------
    def _reconcile(self, view: View) -> None:
        for slot in self.plan.slots():
            if slot.name in self.pending or slot.host not in view.fresh:
                continue
            state, worker = view.states[slot.name], view.workers.get(slot.url)
            if self.watch.off_limits(slot.name):
                continue  # fenced or condemned: handled above
            posted = self.posted.get(slot.name)
            if state.running and worker is None and view.health.get(slot.name):
                if posted is not None and time.monotonic() - posted < PENDING_GRACE:
                    continue  # registered: SMG lists it once its own health check passes

                def registered(ok: bool, slot: Slot = slot) -> None:
                    if ok:
                        self.posted[slot.name] = time.monotonic()
                        self.log(f"registered {slot.name} ({slot.url})")

                self._act("register", slot, partial(self.actuator.register, slot), registered)
            elif not state.running and worker is not None:
                self.log(f"removing stale registration of {slot.name} (unit {state.active})")
                self._deregister_now(slot)

    # -- the groups ----------------------------------------------------------------------------
    def _slot(self, name: str) -> Slot | None:
        return self.by_name.get(name)

    def _available(self, role: str, view: View) -> list[Slot]:
        """The group's replicas: running or being started, neither leaving nor off limits."""
        return [
            s
            for s in self.plan.groups[role].slots
            if (view.states[s.name].running or self._starting(s.name))
            and not self.watch.off_limits(s.name)
            and not self._leaving(s.name)
        ]

    def _count(self, role: str) -> int:
        """The replicas the group has (its last decision's), before a loss."""
        decision = self.last.get(role)
        return decision.desired if decision is not None else self.plan.groups[role].min

    def _in_service(self, role: str, view: View) -> int:
        return sum(
            1
            for s in self.plan.groups[role].slots
            if not self.watch.off_limits(s.name)
            and (w := view.workers.get(s.url)) is not None
            and w.healthy
        )

    def _free(self, role: str, view: View) -> list[Slot]:
        """Slots a replica can start on now: on a host that answered, not running, not off
        limits, no action on them; units systemd gave up on last, then by index."""
        free = [
            s
            for s in self.plan.groups[role].slots
            if s.host in view.fresh
            and not view.states[s.name].running
            and not self.watch.off_limits(s.name)
            and s.name not in self.pending
        ]
        return sorted(free, key=lambda s: (view.states[s.name].active == "failed", s.index))

    def _converge(self, role: str, decision: Decision, view: View) -> None:
        """Start or stop replicas toward the decision. Short of it (a scale-up, or replicas
        lost or condemned), start spare slots at once; above it, scale in only on a decision
        to (the policy's delays and stabilization apply)."""
        available = self._available(role, view)
        if decision.desired > len(available):
            wanted = decision.desired - len(available)
            free = self._free(role, view)
            if len(free) < wanted:
                self._say(
                    f"short {role}",
                    f"{role}: {len(available)} of {decision.desired} replica(s) and only "
                    f"{len(free)} slot(s) to start (the others are in use, on hosts that do "
                    "not answer, or being stopped)",
                )
            else:
                self.said.discard(f"short {role}")
            for slot in free[:wanted]:
                self._start(slot)
        elif decision.desired < len(available) and decision.action == "down":
            running = [s for s in available if not self._starting(s.name)]
            victims, starting = scale_in_order(
                running,
                view.workers,
                self.started_at,
                self.out_of_service_since,
                now=self.clock(),
                start_timeout=self.plan.start_timeout,
            )
            if starting:
                self.log(f"scale-in of {role} waits: {', '.join(starting)} not in service yet")
            for slot in victims[: len(available) - decision.desired]:
                self._scale_in(slot)

    def _start(self, slot: Slot) -> None:
        def started(ok: bool) -> None:
            if ok:
                self.started_at[slot.name] = self.clock()
                self.log(f"started {slot.name} on {slot.host}; it registers once healthy")

        self._act("start", slot, partial(self.actuator.start, slot, 30.0), started)

    def _scale_in(self, slot: Slot) -> None:
        def stopped(ok: bool) -> None:
            if ok:
                self.started_at.pop(slot.name, None)
                self.known[slot.name] = SlotState(slot, "inactive", None)
                self.log(f"drained and stopped {slot.name} on {slot.host}")

        self._act("stop", slot, partial(self.actuator.scale_in, slot), stopped)

    # -- one tick --------------------------------------------------------------
    def tick(self) -> dict[str, Decision]:
        """One round: observe, judge, decide, hold to the budget, act. An advising scaler
        observes and decides only: it starts, stops, registers and replaces nothing."""
        self._collect()
        if not self._leading():
            return {}
        now = self.clock()
        view = self._observe(now)
        if view is None:
            return {}
        if not self.advise:
            self._judge_hosts(view, now)
            self._judge_replicas(view, now)
            self._kill_condemned(view, now)
            self._reconcile(view)
            if self.mirror is not None:
                self.mirror.apply(self.plan.slots(), view, self.pending, self.watch.off_limits)
            self._reset_breakers(view, now)
        pins = self._pins()
        decisions: dict[str, Decision] = {}
        befores: dict[str, History] = {}
        signals: dict[str, WorkerSignals] = {}
        for role, policy in policies(self.plan, pins).items():
            if self.stop.is_set():
                break
            available = len(self._available(role, view))
            members = self.watch.members(role, available)
            signals[role] = found = self._scrape_workers(
                role, policy, view.states, view.workers, now, view.texts, view.loads
            )
            observation = Observation(
                at=now,
                rps=self.rps,
                running=members,
                inflight_per_replica=found.inflight_per_replica,
                latency=found.latency,
                queue_per_replica=found.queue_per_replica,
                serving=found.serving,
            )
            befores[role] = self.histories[role]
            decision, self.histories[role] = decide(policy, observation, befores[role], now)
            if found.source is not None:
                decision = dataclasses.replace(decision, source=found.source)
            decisions[role] = decision
        if self.plan.gpu_budget is not None or self.plan.max_gpus is not None:
            decisions = self.budget.apply(
                decisions,
                befores,
                self.histories,
                {role: len(self._available(role, view)) for role in decisions},
                {role: len(self._free(role, view)) for role in decisions},
                now,
            )
        for role, decision in decisions.items():
            available = len(self._available(role, view))
            self.watch.settle(role, decision.desired)
            self.metrics.decisions.labels(role, decision.action).inc()
            self.metrics.desired.labels(role).set(decision.desired)
            self.metrics.running.labels(role).set(available)
            self._export(role, decision, signals[role])
            if decision.action != "hold" or self._changed(role, decision):
                rps = "none" if self.rps is None else f"{self.rps:.2f}"
                source = f" source={decision.source}" if decision.source else ""
                self.log(
                    f"{'advice' if self.advise else 'decision'} {role}: "
                    f"signal={decision.signal} "
                    f"value={_show(decision.signal, decision.value)} "
                    f"target={_show(decision.signal, decision.target)} rps={rps}{source} "
                    f"desired={decision.desired} actual={available} "
                    f"action={decision.action} reason={decision.reason}"
                )
            self.last[role] = decision
            if not self.stop.is_set() and not self.advise:
                self._converge(role, decision, view)
        if self.rps is not None:
            self.metrics.rps.set(self.rps)
        self._record(now, pins)
        return decisions

    def _say(self, key: str, message: str) -> None:
        """Log a standing condition once, until it clears (``said.discard``)."""
        if key not in self.said:
            self.said.add(key)
            self.log(message)

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
        hosts = {
            host: {
                "state": "lost" if host in self.watch.lost else "silent",
                "since": self.watch.silent_since.get(host),
                "error": self.host_errors.get(host),
            }
            for host in sorted({*self.watch.lost, *self.watch.silent_since})
        }
        doc: dict[str, Any] = {
            "service": self.plan.service,
            "at": now,
            "rps": self.rps,
            "interval": self.interval,
            "pins": pins,
            "groups": {role: d.to_dict() for role, d in self.last.items()},
            # Each group's memory (last scale, stabilization window): its cooldowns hold
            # across a restart, and across a move to another router host's scaler.
            "histories": {role: h.to_dict() for role, h in self.histories.items()},
            "hosts": hosts,
            "condemned": sorted(self.watch.condemned),
            "mode": "advise" if self.advise else "act",
            "budget": self.budget.record,
            **self.watch.to_dict(),
        }
        try:
            self.store.write(layout.SCALER_STATE, json.dumps(doc, indent=2))
        except (OSError, PdctlError) as exc:
            self.log(f"could not record state: {exc}")

    def run(self) -> None:
        self.log(f"scaler for {self.plan.service}: every {self.interval:g} s")
        try:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    self.tick()
                except PdctlError as exc:
                    self.log(f"tick failed: {exc.message}")
                self.stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
            # finish the actions in hand (a drain), within the unit's stop timeout
            self.actions.shutdown(wait_for=self.plan.stop_timeout + 30)
            self._collect()
        finally:
            self.close()
        self.log("scaler stopped")


def _ignore(_ok: bool) -> None:
    return None


def _why(answer: Answer[Any]) -> str:
    if not answer.answered:
        return "no answer in time"
    if isinstance(answer.error, PdctlError):
        return answer.error.message
    return str(answer.error or "nothing")


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
