"""The fabric check over SSH: perftest between hosts, round by round, and what it found.

`pdctl fleet check F --fabric` (every pair of GPU hosts, rail by rail) and `pdctl deploy
--certify` / `pdctl status --certify` (a plan's KV paths: each prefill slot's NICs to each
decode slot's) run here. Which pairs and when: pdctl/core/fabric_schedule.py; the commands and
what they print: pdctl/core/perftest.py; the verdicts: pdctl/core/fabric_judge.py.

Each test starts perftest's server on one host (pdctl's SSH pool; under coreutils' timeout,
since it would wait for its client forever), then its client on the other, retried while
the server is not listening yet, and stops the server if the client could not run. Every
remote call has a deadline; a host that does not answer fails its own tests with the
reason, and the others go on.
"""

from __future__ import annotations

import contextlib
import shlex
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pdctl.core import fabric_judge, fabric_nics, fabric_schedule, perftest
from pdctl.core.errors import HostError, InputError
from pdctl.core.fabric_judge import Measurement, Scope
from pdctl.core.fabric_schedule import Link, Schedule
from pdctl.core.fleet_model import Fleet, FleetHost
from pdctl.core.host_devices import FactsError
from pdctl.core.plan import Plan, Slot
from pdctl.doors import inventory, ssh
from pdctl.doors.session import Session
from pdctl.doors.workspace import Workspace

Progress = Callable[[str], None]
DEFAULT_DURATION = 3  # seconds of ib_write_bw per test
DEFAULT_LAT_ITERATIONS = 1000  # ib_write_lat's own default
CONNECT_WINDOW = 15.0  # how long a client keeps trying a server that is not listening yet
# perftest's server opens its device before it listens: the client's first try waits this
# long, and the next ones this long apart.
CONNECT_PAUSE = 0.3
SLACK = 30.0  # on top of a test's own length: process start, perftest's handshakes
PROBE_TIMEOUT = 10.0
# The first line the server's wrapper prints: its PID, to stop it when the client failed.
_WRAPPER = ["sh", "-c", 'echo "$$"; exec "$@"', "pdctl-perftest"]


@dataclass
class Options:
    rails: list[int] | None = None  # None: every rail
    sample: float | None = None  # a fraction of the rounds; None: a full mesh up to a size
    parallel_rails: bool = False
    duration: int = DEFAULT_DURATION
    iterations: int | None = None  # ib_write_bw by iterations (a size-bound run), not time
    lat_iterations: int = DEFAULT_LAT_ITERATIONS
    min_fraction: float = fabric_judge.DEFAULT_MIN_FRACTION
    seed: int | None = None
    tcp_port: int = perftest.DEFAULT_TCP_PORT

    def check(self) -> None:
        if self.sample is not None and not 0 < self.sample <= 1:
            raise InputError(f"--sample {self.sample:g} is not a fraction in (0, 1]")
        if not 0 < self.min_fraction <= 1:
            raise InputError(f"--min-fraction {self.min_fraction:g} is not in (0, 1]")
        if not 1 <= self.duration <= perftest.MAX_SECONDS:
            raise InputError(f"--duration {self.duration} is not 1..{perftest.MAX_SECONDS}")
        if self.iterations is not None and not 5 <= self.iterations <= perftest.MAX_ITERATIONS:
            raise InputError(f"--iterations {self.iterations} is not 5..{perftest.MAX_ITERATIONS}")
        if not 5 <= self.lat_iterations <= 1_000_000:
            raise InputError(f"--lat-iterations {self.lat_iterations} is not 5..1000000")
        if self.rails is not None and any(not 0 <= r <= 1023 for r in self.rails):
            raise InputError("--rails takes rail numbers 0..1023 (NIC i of each host)")
        if not 1024 <= self.tcp_port <= 65000:
            raise InputError(f"--tcp-port {self.tcp_port} is not 1024..65000")


def parse_rails(text: str) -> list[int] | None:
    """``all`` -> None; ``0`` or ``0,3`` -> those rails."""
    if text.strip().lower() == "all":
        return None
    try:
        rails = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        rails = []
    if not rails or any(r < 0 for r in rails):
        raise InputError(
            f"--rails {text!r} is not 'all' or rail numbers",
            hint="all, or NIC numbers: 0 or 0,3 (rail i is NIC i of every host)",
        )
    return rails


@dataclass
class _Context:
    pool: ssh.Pool
    targets: dict[str, ssh.Target]
    addresses: dict[str, str]
    become: bool
    options: Options
    down: dict[str, str] = field(default_factory=dict)  # host -> why it is not tested


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _endpoint(nic: fabric_nics.FabricNic) -> perftest.Endpoint:
    return perftest.Endpoint(nic.name, nic.ib_port, nic.gid_index if nic.roce else None)


def _stop(ctx: _Context, host: str, server: ssh.Running) -> None:
    """Stop a server that is still running (the client never reached it, or it hangs), so
    that it holds no port the next test needs: its PID is the first line it printed."""
    first = server.wait(1.0).stdout.split("\n", 1)[0].strip()
    if first.isdigit() and len(first) <= 10:
        argv = ["kill", "-TERM", first]
        if ctx.become:
            argv = ["sudo", "-n", "--", *argv]
        with contextlib.suppress(HostError, *ssh.CHANNEL_ERRORS):  # its time limit ends it
            ctx.pool.run(ctx.targets[host], shlex.join(argv), timeout=PROBE_TIMEOUT)
    server.close()


def _test(ctx: _Context, link: Link, run: perftest.Run) -> tuple[str, str | None]:
    """One perftest run on the link: the client's output, or why there is none."""
    assert link.client_nic is not None and link.server_nic is not None
    limit = run.seconds_bound + SLACK
    server_argv = perftest.bounded(
        perftest.server_argv(run, _endpoint(link.server_nic)),
        limit + CONNECT_WINDOW,
        become=ctx.become,
    )
    client_argv = perftest.bounded(
        perftest.client_argv(run, _endpoint(link.client_nic), ctx.addresses[link.server]),
        limit,
        become=ctx.become,
    )
    server = ctx.pool.start(ctx.targets[link.server], shlex.join([*_WRAPPER, *server_argv]))
    try:
        deadline = time.monotonic() + CONNECT_WINDOW
        time.sleep(CONNECT_PAUSE)
        while True:
            result = ctx.pool.run(
                ctx.targets[link.client], shlex.join(client_argv), timeout=limit + 5
            )
            waiting = "Couldn't connect to" in result.stderr
            if result.rc == 0 or not waiting or time.monotonic() > deadline or server.done():
                break
            time.sleep(CONNECT_PAUSE)
        if result.rc != 0:
            served = server.wait(0.5) if server.done() else None
            _stop(ctx, link.server, server)
            why = perftest.failure_reason(result.stdout, result.stderr, result.rc)
            if served is not None and served.rc != 0 and "Couldn't connect to" in why:
                why = f"its server on {link.server}: " + perftest.failure_reason(
                    served.stdout, served.stderr, served.rc
                )
            return "", why
        if server.wait(SLACK).rc == 124:  # the client is done, its server is not
            _stop(ctx, link.server, server)
        return result.stdout, None
    finally:
        server.close()


def _why_not(ctx: _Context, link: Link) -> str | None:
    """Why the link is not tested at all (a missing NIC, a host that is down)."""
    if link.problem:
        return link.problem
    return next((ctx.down[host] for host in link.pair if host in ctx.down), None)


def _perftest(ctx: _Context, link: Link, tcp_port: int) -> Measurement:
    """ib_write_bw, then ib_write_lat, on the link."""
    options = ctx.options
    if options.iterations is not None:
        bw_run = perftest.Run("ib_write_bw", tcp_port, iterations=options.iterations)
    else:
        bw_run = perftest.Run("ib_write_bw", tcp_port, duration=options.duration)
    out, why = _test(ctx, link, bw_run)
    if why is not None:
        return Measurement(link, error=f"ib_write_bw: {why}")
    gbps = perftest.parse_bw(out)[-1].average_gbps
    lat_run = perftest.Run("ib_write_lat", tcp_port, iterations=options.lat_iterations)
    out, why = _test(ctx, link, lat_run)
    if why is not None:
        return Measurement(link, gbps=gbps, error=f"ib_write_lat: {why}")
    row = perftest.parse_lat(out)[-1]
    return Measurement(link, gbps=gbps, lat_us=row.typical_us or row.average_us)


def _measure(ctx: _Context, link: Link, tcp_port: int) -> Measurement:
    skip = _why_not(ctx, link)
    if skip is not None:
        return Measurement(link, error=skip)
    try:
        return _perftest(ctx, link, tcp_port)
    except perftest.PerftestError as exc:
        return Measurement(link, error=str(exc))
    except HostError as exc:
        why = f"SSH: {exc.one_line()}"
    except ssh.CHANNEL_ERRORS as exc:
        why = f"SSH: {type(exc).__name__}: {exc}"
    # A host lost mid-run is marked down, so that its later tests fail at once instead of
    # each waiting for a connection timeout.
    _probe(ctx, [host for host in link.pair if host not in ctx.down])
    return Measurement(link, error=why)


def _probe(ctx: _Context, hosts: list[str]) -> None:
    """Hosts that do not answer a trivial command are not tested (their tests fail with the
    reason) instead of holding every wave up."""

    def answer(host: str) -> str | None:
        try:
            result = ctx.pool.run(ctx.targets[host], "true", timeout=PROBE_TIMEOUT)
        except HostError as exc:
            return exc.one_line()
        except ssh.CHANNEL_ERRORS as exc:
            return f"{host}: no answer over SSH ({type(exc).__name__}: {exc})"
        return None if result.rc == 0 else f"{host}: `true` exited {result.rc} over SSH"

    for host, why in ssh.at_once(hosts, answer).items():
        if why is not None:
            ctx.down.setdefault(host, why)


def execute(
    ctx: _Context, schedule: Schedule, progress: Progress
) -> tuple[list[Measurement], float]:
    """Every wave of every round, a wave's tests at once; the measurements and seconds."""
    started = time.monotonic()
    _probe(ctx, [h for h in schedule.hosts if h not in ctx.down])
    found: list[Measurement] = []
    total = len(schedule.rounds)
    for number, waves in enumerate(schedule.rounds, 1):
        for wave_number, wave in enumerate(waves, 1):
            rails = sorted({link.rail for link in wave}, key=str)
            progress(
                f"round {number}/{total}, wave {wave_number}/{len(waves)}: {len(wave)} test(s)"
                f" (rail {', '.join(rails)})"
            )
            # A host is in one test per NIC at most (8 SSH channels for 8 NICs: within
            # sshd's default MaxSessions, 10); each test of a wave on its own TCP port.
            ports = [ctx.options.tcp_port + index for index in range(len(wave))]
            with ThreadPoolExecutor(max_workers=max(1, len(wave))) as workers:
                found += list(
                    workers.map(lambda lp: _measure(ctx, *lp), zip(wave, ports, strict=True))
                )
    return found, time.monotonic() - started


def _context(pool: ssh.Pool, fleet: Fleet, options: Options) -> _Context:
    options.check()
    return _Context(
        pool=pool,
        targets={h.name: inventory.target(fleet, h) for h in fleet.hosts},
        addresses={h.name: h.address for h in fleet.hosts},
        become=fleet.settings.become,
        options=options,
    )


def _driver(fleet: Fleet) -> str | None:
    driver = fleet.settings.nic_driver
    return None if driver == "auto" else driver


def _rails_of(fleet: Fleet, host: FleetHost, ctx: _Context) -> list[fabric_nics.FabricNic]:
    """The host's rails; a host whose facts cannot be used, or whose preflight found no
    perftest or no SSH, is marked down with the reason."""
    try:
        return fabric_nics.rails(host.facts, _driver(fleet), fleet.settings.gid_index)
    except FactsError as exc:
        ctx.down[host.name] = f"{host.name}: {exc}"
        return []


def _unusable(host: FleetHost) -> str | None:
    if host.preflight is None:
        return None
    for check in host.preflight.checks:
        if check.get("name") in ("ssh", "perftest") and not check.get("ok"):
            return str(check.get("message") or f"{host.name}: {check.get('name')} failed")
    return None


def _report(
    schedule: Schedule,
    measurements: list[Measurement],
    seconds: float,
    options: Options,
    scope: Scope,
) -> dict[str, Any]:
    doc = fabric_judge.judge(measurements, min_fraction=options.min_fraction, scope=scope)
    rates = [
        f"{m.link.client}:{m.link.client_nic.name}"
        for m in measurements
        if m.link.client_nic is not None and m.link.client_nic.rate_gbps is None
    ]
    notes = list(schedule.notes)
    if rates:
        notes.append(
            "line rate unknown for some NICs (facts without ibv_devinfo -v's active_width/"
            "active_speed, or a port that is down): those pairs are judged by the median only"
        )
    doc.update(
        rounds=len(schedule.rounds),
        waves=sum(len(r) for r in schedule.rounds),
        full_mesh=schedule.full_mesh,
        seed=schedule.seed,
        seconds=round(seconds, 1),
        notes=notes,
        options={
            "rails": options.rails,
            "parallel_rails": options.parallel_rails,
            "duration": options.duration,
            "iterations": options.iterations,
            "lat_iterations": options.lat_iterations,
            "sample": options.sample,
        },
    )
    return doc


def _store(workspace: Workspace, fleet: Fleet, doc: Mapping[str, Any]) -> None:
    for name, record in fabric_judge.records(doc, _now()).items():
        host = fleet.host(name)
        if host is not None:
            host.fabric = record
    inventory.save(workspace, fleet)


def check_fleet(
    workspace: Workspace,
    fleet: Fleet,
    limit: list[FleetHost] | None,
    options: Options,
    progress: Progress,
) -> dict[str, Any]:
    """Every pair of the fleet's GPU hosts (with ``limit``: the pairs with one of those in
    them), tested and judged; each tested host's record kept in the inventory."""
    known = ssh.KnownHosts(inventory.known_hosts_file(workspace, fleet.name))
    ctx = _context(ssh.Pool(known, fleet.name), fleet, options)
    try:
        gpu = [h for h in fleet.hosts if h.kind == "gpu"]
        rails = {}
        for host in gpu:
            rails[host.name] = _rails_of(fleet, host, ctx)
            why = _unusable(host)
            if why is not None:
                ctx.down.setdefault(host.name, why)
        only = None if limit is None else [h.name for h in limit if h.kind == "gpu"]
        schedule = fabric_schedule.mesh(
            rails,
            rails=options.rails,
            sample=options.sample,
            only=only,
            parallel_rails=options.parallel_rails,
            seed=options.seed if options.seed is not None else time.time_ns() % 1_000_000,
        )
        progress(
            f"fabric: {len(schedule.pairs())} pair(s) of {len(gpu)} GPU host(s) in "
            f"{len(schedule.rounds)} round(s)"
        )
        measurements, seconds = execute(ctx, schedule, progress)
    finally:
        ctx.pool.close()
    doc = _report(schedule, measurements, seconds, options, "mesh")
    if measurements:
        _store(workspace, fleet, doc)
    return doc


def kv_links(plan: Plan, fleet: Fleet) -> list[Link]:
    """Each prefill slot's NICs to each decode slot's on another host (NIC i to NIC i of the
    two slots, the shorter list repeated), once per pair of NICs. A slot without NICs of
    its own (facts without topology) uses its host's."""
    rails: dict[str, dict[str, fabric_nics.FabricNic]] = {}
    for member in fleet.hosts:
        try:
            found = fabric_nics.rails(member.facts, _driver(fleet), fleet.settings.gid_index)
        except FactsError:
            found = []
        rails[member.name] = {nic.name: nic for nic in found}

    def nics(slot: Slot) -> list[str]:
        return list(slot.rdma_devices) or list(rails.get(slot.host, {}))

    links: dict[tuple[str, str, str, str], Link] = {}
    for prefill in plan.groups["prefill"].slots:
        for decode in plan.groups["decode"].slots:
            if prefill.host == decode.host:
                continue  # same host: no fabric between them
            ours, theirs = nics(prefill), nics(decode)
            for i in range(max(len(ours), len(theirs))):
                if not ours or not theirs:
                    break
                a, b = ours[i % len(ours)], theirs[i % len(theirs)]
                key = (prefill.host, a, decode.host, b)
                if key in links:
                    continue
                nic_a = rails.get(prefill.host, {}).get(a)
                nic_b = rails.get(decode.host, {}).get(b)
                problem = None
                if nic_a is None or nic_b is None:
                    where, name = (prefill.host, a) if nic_a is None else (decode.host, b)
                    problem = f"{where}: the facts show no NIC {name} (run `pdctl fleet check`)"
                links[key] = Link(
                    prefill.host,
                    decode.host,
                    f"{prefill.name}>{decode.name} {a}>{b}",
                    nic_a,
                    nic_b,
                    problem,
                )
    return list(links.values())


def certify_plan(
    session: Session, plan: Plan, options: Options, progress: Progress
) -> dict[str, Any]:
    """The plan's KV paths (kv_links), tested and judged against their line rates and each
    other, over the session's pool; the hosts' records kept in the inventory."""
    fleet = session.fleet(plan.fleet)
    ctx = _context(session.pool(plan.fleet), fleet, options)
    links = kv_links(plan, fleet)
    schedule = fabric_schedule.of_links(links, parallel=options.parallel_rails)
    progress(
        f"certify: {len(links)} KV path(s) between {len(schedule.hosts)} host(s) in "
        f"{len(schedule.rounds)} round(s)"
    )
    measurements, seconds = execute(ctx, schedule, progress)
    doc = _report(schedule, measurements, seconds, options, "kv")
    if measurements:
        _store(session.workspace, fleet, doc)
    return doc


def plan_problems(session: Session, plan: Plan) -> list[str]:
    """Why the plan's hosts with slots are not fabric-certified (`pdctl plan` warns, and
    refuses with --strict)."""
    fleet = session.fleet(plan.fleet)
    with_slots = {slot.host for slot in plan.slots()}
    hosts = [h for h in fleet.hosts if h.name in with_slots]
    return fabric_judge.plan_problems(hosts, fleet.name)
