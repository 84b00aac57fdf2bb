"""A deployed service's slot control: read the slots' states; start, wait healthy, register;
deregister, drain, stop.

The service's, not the scaler's: deploy (its rolling update), status, drift and the scaler
all act on slots through it. Every host action is one command of ``pdctl-unitctl``
(installed by the pd_worker role) over a pooled SSH connection; every router action is
router.py.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from pdctl.core.errors import HostError
from pdctl.core.layout import UNITCTL
from pdctl.core.plan import Plan, Slot
from pdctl.core.scaling.engine_loads import GET_LOADS, EngineLoad, LoadsError, decode_loads
from pdctl.core.unhealthy import Unhealthy, UnhealthyUnits, from_unitctl
from pdctl.doors import ssh
from pdctl.doors.router import Connector, Router, request
from pdctl.onhost.grpc_health import GrpcCallError, grpc_call, grpc_healthy

HEALTH_POLL = 0.2  # seconds between probes of a starting slot
UNIT_CHECK = 2.0  # seconds between looks at a starting slot's unit (has systemd given up?)
STATES_TIMEOUT = 15.0  # one host's `pdctl-unitctl states`, at most
PROBE_TIMEOUT = 5.0  # one health check of one worker, at most
# The state of a slot whose host could not be read.
UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class SlotState:
    slot: Slot
    active: str  # systemd ActiveState: active, inactive, failed, activating, deactivating
    config: str | None  # the running container's pdctl.config label
    restarts: int | None = None  # systemd's NRestarts: a change is the engine restarted in place

    @property
    def running(self) -> bool:
        return self.active in {"active", "activating", "reloading"}


def parse_states(output: str, slots: list[Slot]) -> dict[str, SlotState]:
    """`pdctl-unitctl SERVICE states` output of one host -> the state of each of its slots.
    A line is "GROUP K ACTIVESTATE LABEL RESTARTS" ("-" for a value not known); a host whose
    pdctl-unitctl predates the restart count gives four words."""
    seen: dict[str, SlotState] = {}
    by_name = {slot.name: slot for slot in slots}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) not in (4, 5):
            continue
        slot = by_name.get(f"{parts[0]}/{parts[1]}")
        if slot is None:
            continue
        restarts = parts[4] if len(parts) == 5 else "-"
        seen[slot.name] = SlotState(
            slot=slot,
            active=parts[2],
            config=None if parts[3] == "-" else parts[3],
            restarts=int(restarts) if re.fullmatch(r"[0-9]{1,9}", restarts) else None,
        )
    return {slot.name: seen.get(slot.name) or SlotState(slot, "inactive", None) for slot in slots}


class Actuator:
    def __init__(
        self,
        plan: Plan,
        pool: ssh.Pool,
        targets: dict[str, ssh.Target],
        router: Router,
        *,
        sudo: bool = True,
        log: Callable[[str], None] | None = None,
        connector: Callable[[ssh.Target], Connector] | None = None,
        secrets: Iterable[str] = (),
    ) -> None:
        self.plan, self.pool, self.targets, self.router = plan, pool, targets, router
        self.sudo = sudo
        self.secrets = list(secrets)  # masked in the journal lines an error shows
        self.log = log or (lambda _message: None)
        # How to reach a worker's HTTP port: by default through its host's SSH connection.
        self.connector = connector or pool.connector

    def _unitctl(self, host: str, *args: str, timeout: float = 60.0) -> ssh.Result:
        words = " ".join(shlex.quote(a) for a in (UNITCTL, self.plan.service, *args))
        command = f"sudo -n {words}" if self.sudo else words
        result = self.pool.run(self.targets[host], command, timeout=timeout)
        if result.rc != 0:
            raise HostError(
                f"{host}: pdctl-unitctl {' '.join(args)} failed: "
                f"{(result.stderr.strip() or result.stdout.strip())[-300:]}"
            )
        return result

    def slots_by_host(self) -> dict[str, list[Slot]]:
        found: dict[str, list[Slot]] = {}
        for slot in self.plan.slots():
            found.setdefault(slot.host, []).append(slot)
        return found

    def host_states(
        self, host: str, timeout: float = STATES_TIMEOUT, *, labels: bool = True
    ) -> dict[str, SlotState]:
        """The unit state of each slot on one host (one SSH command, within ``timeout``).
        ``labels=False``: no container's config label (``config`` None), and so no container
        runtime call on the host, only systemd's: what the scaler reads every tick."""
        verb = "states" if labels else "unit-states"
        output = self._unitctl(host, verb, timeout=timeout).stdout
        return parse_states(output, self.slots_by_host().get(host, []))

    def read_states(
        self, timeout: float = STATES_TIMEOUT
    ) -> tuple[dict[str, SlotState], dict[str, str]]:
        """Every slot's unit state, all hosts at once, and why each host that gave none did
        not: its slots are "unreachable". Each host within ``timeout``; a host that does not
        answer holds up no other (its thread is left to the SSH command's own deadline)."""
        by_host = self.slots_by_host()
        calls = ThreadPoolExecutor(max_workers=min(32, len(by_host) or 1))
        futures = {host: calls.submit(self.host_states, host, timeout) for host in by_host}
        wait_futures(list(futures.values()), timeout=timeout + 1)
        calls.shutdown(wait=False)
        found: dict[str, SlotState] = {}
        errors: dict[str, str] = {}
        for host, slots in by_host.items():
            future = futures[host]
            error: BaseException | None = None
            if not future.done():
                error = HostError(f"{host}: no answer within {timeout:g} s")
            else:
                error = future.exception()
            if error is None:
                found.update(future.result())
                continue
            if not isinstance(error, HostError):
                raise error
            errors[host] = error.message
            found.update({s.name: SlotState(s, UNREACHABLE, None) for s in slots})
        return found, errors

    def states(self, *, strict: bool = True) -> dict[str, SlotState]:
        """Every planned slot's unit state, read live (one SSH command per host).
        ``strict=False``: a host that cannot be read gives its slots the state
        "unreachable"; else its error is raised."""
        found, errors = self.read_states()
        if errors and strict:
            host, why = next(iter(errors.items()))
            raise HostError(why, hint=f"is {host} up? `pdctl status {self.plan.service}`")
        return found

    def start(self, slot: Slot, timeout: float = 60.0) -> None:
        self._unitctl(slot.host, "start", slot.group, str(slot.index), timeout=timeout)

    def stop(self, slot: Slot) -> None:
        self._unitctl(
            slot.host, "stop", slot.group, str(slot.index), timeout=self.plan.stop_timeout + 60
        )

    def stop_now(self, slot: Slot, kill_after: float) -> None:
        """Stop the slot without waiting on a drain: what runs after ``kill_after`` seconds is
        killed (a hung worker never finishes one). For a replica that serves nothing."""
        seconds = str(max(0, round(kill_after)))
        self._unitctl(
            slot.host, "stop-now", slot.group, str(slot.index), seconds, timeout=kill_after + 30
        )

    def fence(self, slot: Slot, kill_after: float) -> None:
        """Disable the slot's unit (it no longer starts at boot) and stop it now: a replica
        replaced while its host was away."""
        seconds = str(max(0, round(kill_after)))
        self._unitctl(
            slot.host, "fence", slot.group, str(slot.index), seconds, timeout=kill_after + 30
        )

    def healthy(self, slot: Slot, timeout: float = PROBE_TIMEOUT) -> bool:
        """Whether the slot's worker answers its probe within ``timeout``: the spec's HTTP
        probe, or for a gRPC worker (vLLM, SGLang's gRPC mode) its gRPC health call, through the
        host's SSH connection."""
        try:
            connector = self.connector(self.targets[slot.host])
        except (OSError, HostError):
            return False
        if slot.connection == "grpc":
            try:
                stream = connector(slot.address, slot.port)
            except (OSError, HostError):
                return False
            try:
                authority = f"{slot.address}:{slot.port}"
                return grpc_healthy(stream, authority, slot.grpc_health, timeout=timeout)
            finally:
                stream.close()
        try:
            response = request(
                connector, slot.address, slot.port, "GET", self.plan.probe.url, timeout=timeout
            )
        except HostError:
            return False
        return response.status == 200

    def metrics(self, slot: Slot) -> str:
        """The worker's own Prometheus text (its serving port's /metrics: the engines' latency
        histograms and load gauges, docs/facts.md Worker metrics)."""
        connector = self.connector(self.targets[slot.host])
        response = request(connector, slot.address, slot.port, "GET", "/metrics", timeout=5)
        if response.status != 200:
            raise HostError(f"{slot.name}: GET /metrics answered {response.status}")
        return response.body.decode(errors="replace")

    def loads(self, slot: Slot, timeout: float = PROBE_TIMEOUT) -> EngineLoad:
        """A gRPC worker's load from its engine's GetLoads (running, waiting, tokens/s), asked
        as SMG asks it (docs/facts.md, "A gRPC group's latency and load"). HostError when it
        does not answer in time or answers what is not a GetLoads response."""
        where = f"{slot.name} ({slot.address}:{slot.port})"
        try:
            stream = self.connector(self.targets[slot.host])(slot.address, slot.port)
        except (OSError, HostError) as exc:
            raise HostError(f"{where}: cannot reach its gRPC port: {exc}") from exc
        try:
            message = grpc_call(
                stream, f"{slot.address}:{slot.port}", GET_LOADS[slot.engine], b"", timeout
            )
            return decode_loads(message, slot.engine)
        except (GrpcCallError, LoadsError) as exc:
            raise HostError(f"{where}: GetLoads: {exc}") from exc
        finally:
            stream.close()

    def why(self, slot: Slot) -> Unhealthy:
        """The slot's unit state, restart count and last journal lines (secrets masked)."""
        output = self._unitctl(slot.host, "why", slot.group, str(slot.index)).stdout
        unit = slot.unit(self.plan.service)
        return from_unitctl(slot.name, slot.host, unit, output, self.secrets)

    def wait_healthy(self, slot: Slot, timeout: float | None = None) -> None:
        """Until the slot answers its probe; an error with the unit's journal as soon as
        systemd has given up on it (no waiting out the start timeout on a crash loop)."""
        budget = timeout or self.plan.start_timeout
        deadline = time.monotonic() + budget
        next_check = time.monotonic() + UNIT_CHECK
        hint = f"pdctl logs {self.plan.service} {slot.name}"
        while time.monotonic() < deadline:
            if self.healthy(slot):
                return
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + UNIT_CHECK
                report = self.why(slot)
                if report.state == "failed":
                    raise UnhealthyUnits(f"{slot.name} did not start", [report], hint=hint)
            # A probe is one request over a pooled connection: poll often, so a slot that
            # just came up is registered within a fraction of a second, not a whole interval.
            time.sleep(min(HEALTH_POLL, float(self.plan.probe.interval)))
        raise UnhealthyUnits(
            f"{slot.name} did not become healthy within {budget:.0f} s",
            [self.why(slot)],
            hint=hint,
        )

    def register(self, slot: Slot) -> None:
        """On the router, and on the service's other routers unless SMG's mesh joins them (one
        that is down now gets it from the acting scaler later: pdctl/scaler/mirror.py)."""
        registration = slot.registration()
        self.router.add_worker(registration)
        if not self.plan.router.meshed:
            for missed in self.router.add_to_peers(registration):
                self.log(f"{slot.name}: another router was not told of it ({missed})")

    def wait_in_service(self, slot: Slot, timeout: float = 60.0) -> None:
        """Until the router lists the worker as healthy. SMG answers a registration with 202
        and adds the worker after its own health check: a replica that replaces another must
        be routable before the other one leaves, or its group has a moment with none (503)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            worker = self.router.find(slot.url)
            if worker is not None and worker.healthy:
                return
            time.sleep(HEALTH_POLL)
        raise HostError(
            f"{slot.name} on {slot.host}: the router did not put it in service within "
            f"{timeout:.0f} s",
            hint=f"pdctl status {self.plan.service}; pdctl logs {self.plan.service} {slot.name}",
        )

    def wait_any_in_service(self, slots: list[Slot], timeout: float = 60.0) -> bool:
        """Until the router lists one of ``slots`` as healthy; False when none is by then."""
        urls = {slot.url for slot in slots}
        deadline = time.monotonic() + timeout
        while urls and time.monotonic() < deadline:
            if any(w.healthy and w.url in urls for w in self.router.workers()):
                return True
            time.sleep(HEALTH_POLL)
        return False

    def deregister(self, slot: Slot, drain_timeout: float = 60.0) -> None:
        """Remove the worker from the router and wait until the router has let go of it."""
        self.deregister_all([slot], drain_timeout)

    def deregister_all(self, slots: list[Slot], drain_timeout: float = 60.0) -> None:
        """Remove every one of ``slots`` from the router, then wait until it has let go of
        them all: they drain side by side, so the wait is one drain, not one per worker."""
        listed = {w.url: w for w in self.router.workers()}
        leaving = set()
        for slot in slots:
            worker = listed.get(slot.url)
            if worker is not None:
                self.router.remove_worker(worker.id)
                leaving.add(slot.url)
            for missed in self.router.remove_from_peers(slot.url):
                self.log(f"{slot.name}: another router was not asked to let go of it ({missed})")
        deadline = time.monotonic() + drain_timeout
        while leaving and time.monotonic() < deadline:
            leaving &= {w.url for w in self.router.workers()}
            if leaving:
                time.sleep(0.5)

    def scale_out(self, slot: Slot) -> None:
        self.log(f"starting {slot.name} on {slot.host}")
        self.start(slot)
        self.wait_healthy(slot)
        self.register(slot)
        self.log(f"{slot.name} serving")

    def scale_in(self, slot: Slot) -> None:
        self.log(f"draining {slot.name} on {slot.host}")
        self.deregister(slot)
        self.stop(slot)
        self.log(f"{slot.name} stopped")
