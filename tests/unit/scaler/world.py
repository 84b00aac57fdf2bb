"""A small world of real processes and sockets for the scaler's tick, on loopback.

- Worker hosts are real SSH servers (paramiko, in threads) that run pdctl-unitctl's verbs on
  a table of units; a running unit is a real worker process (an HTTP server answering
  /health). A host can be frozen (it stops answering: its SSH connections stall, new ones get
  no banner, its workers are SIGSTOPped) and thawed; a slot's `stop` can be made to never
  return.
- The router is an HTTP server speaking SMG's worker API (GET/POST /workers, DELETE
  /workers/ID) and serving its request counter at /metrics; other routers of the service
  (``peers``) are more of them, and one can be frozen (it takes connections and answers none).
- The scaler reaches them through pdctl's own SSH pool, Actuator and Router client.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import paramiko

from pdctl.core import layout
from pdctl.core.plan import Plan, Slot, build
from pdctl.core.spec import parse
from pdctl.doors import ssh
from pdctl.doors.router import Router, tcp_connector
from pdctl.doors.slots import Actuator
from pdctl.scaler.loop import Scaler
from pdctl.scaler.store import Store
from tests.unit.core.plan.test_placement import ENV, REPO, fleet, host

# The lab example with fast failover settings (pdctl.scaler of the spec).
FAST = """\
  scaler:
    interval: 0.2s
    host_lost_after: 1.5s
    unhealthy_after: 1s
    probe_timeout: 0.5s
    kill_after: 1s
"""
WORKER = """\
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/metrics") else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def fast_plan() -> Plan:
    """dstack's AMD example as the lab runs it, on 1 CPU host and 3 GPU hosts: prefill/1 on
    gpu1, decode/1 on gpu2, the spares prefill/2 on gpu3 and decode/2 on gpu1."""
    text = (REPO / "examples/lab/pd.yml").read_text()
    assert text.rstrip().endswith("health_check_interval: 2s")
    spec, env = parse(text.rstrip() + "\n" + FAST, Path("pd.yml"), ENV)
    hosts = fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2"), host("gpu3"))
    return build(spec, env, hosts, secrets_digest="")


@dataclass
class Unit:
    slot: Slot
    state: str = "inactive"
    enabled: bool = False
    process: subprocess.Popen[str] | None = None
    port: int | None = None
    restarts: int = 0  # systemd's NRestarts


class WorkerHost(paramiko.ServerInterface):
    """One worker host: an SSH server on loopback running pdctl-unitctl's verbs."""

    def __init__(self, name: str, key: paramiko.PKey, slots: list[Slot], service: str) -> None:
        self.name, self.key, self.service = name, key, service
        self.units = {s.name: Unit(s) for s in slots}
        self.hang_stop: set[str] = set()  # slots whose `stop` never returns
        self.running = threading.Event()  # set: answering; clear: frozen
        self.running.set()
        self.released = threading.Event()  # set at teardown: hung commands end
        self.commands: list[str] = []
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held: list[socket.socket] = []
        self.transports: list[paramiko.Transport] = []
        threading.Thread(target=self._accept, daemon=True).start()

    # -- the SSH server ----------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if not self.running.is_set():
                self.held.append(conn)  # a host that stopped answering sends no banner
                continue
            transport = paramiko.Transport(conn)
            transport.add_server_key(self.key)
            transport.start_server(server=self)
            self.transports.append(transport)

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL

    def check_channel_request(self, kind: str, chanid: int) -> int:
        # A frozen host stalls here, in its transport's thread: no packet answered at all.
        while not self.running.is_set() and not self.released.is_set():
            time.sleep(0.05)
        return paramiko.OPEN_SUCCEEDED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        threading.Thread(target=self._exec, args=(channel, command.decode()), daemon=True).start()
        return True

    def _exec(self, channel: paramiko.Channel, command: str) -> None:
        # paramiko acknowledges the request once check_channel_exec_request returns: an answer
        # and a close sent before that would reach the client first (sshd never does that)
        time.sleep(0.05)
        self.commands.append(command)
        try:
            rc, out = self.unitctl(shlex.split(command))
        except Exception as exc:  # the stand-in's own failure: shown as the command's
            rc, out = 1, f"stand-in failed: {exc!r}\n"
        if self.released.is_set():
            channel.close()
            return
        channel.sendall(out.encode())
        channel.send_exit_status(rc)
        channel.close()

    # -- pdctl-unitctl ---------------------------------------------------------------------
    def unitctl(self, words: list[str]) -> tuple[int, str]:
        assert words[:2] == ["/usr/local/libexec/pdctl-unitctl", self.service], words
        verb, args = words[2], words[3:]
        if verb in {"states", "unit-states"}:  # the stand-in runs no container: no label
            with self.lock:
                lines = [
                    f"{u.slot.group} {u.slot.index} {u.state} - {u.restarts}"
                    for u in self.units.values()
                ]
            return 0, "".join(f"{line}\n" for line in lines)
        unit = self.units[f"{args[0]}/{args[1]}"]
        if verb == "start":
            self.start(unit)
            return 0, ""
        if verb == "stop":
            if unit.slot.name in self.hang_stop:
                self.released.wait()  # a drain that never ends
                return 1, ""
            self.kill(unit)
            return 0, ""
        if verb in {"stop-now", "fence"}:
            if verb == "fence":
                unit.enabled = False
            self.kill(unit)
            return 0, "inactive\n"
        if verb == "why":
            return 0, f"ActiveState={unit.state}\nNRestarts=0\n--\n"
        return 2, f"unknown verb {verb}\n"

    def start(self, unit: Unit, *, enable: bool = False) -> None:
        with self.lock:
            unit.enabled = unit.enabled or enable
            if unit.process is not None and unit.process.poll() is None:
                return
            process = subprocess.Popen(
                [sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True
            )
            assert process.stdout is not None
            unit.port = int(process.stdout.readline())
            unit.process, unit.state = process, "active"

    def restart_in_place(self, unit: Unit, after: float) -> None:
        """What systemd's Restart=on-failure does with an engine that died: the unit stays up
        (activating), its restart count moves, and a new process answers ``after`` seconds
        later (systemd's RestartSec and the engine's load)."""
        with self.lock:
            assert unit.process is not None
            unit.process.kill()
            unit.process.wait(10)
            unit.process, unit.port, unit.state = None, None, "activating"
            unit.restarts += 1
        threading.Timer(after, self.start, (unit,)).start()

    def kill(self, unit: Unit) -> None:
        with self.lock:
            if unit.process is not None:
                unit.process.kill()  # SIGKILL ends a stopped process too
                unit.process.wait(10)
            unit.process, unit.port, unit.state = None, None, "inactive"

    def freeze(self) -> None:
        """Stops answering at once: SSH stalls, every worker process stops."""
        self.running.clear()
        for unit in self.units.values():
            if unit.process is not None:
                os.kill(unit.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Answers again, with the units it had (as after a power cut, enabled ones run)."""
        for conn in self.held:
            conn.close()
        self.held.clear()
        for unit in self.units.values():
            if unit.process is not None:
                os.kill(unit.process.pid, signal.SIGCONT)
        self.running.set()

    def close(self) -> None:
        self.released.set()
        self.running.set()
        self.server.close()
        for unit in self.units.values():
            self.kill(unit)
        for transport in self.transports:
            transport.close()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up on a frozen router: its connection is gone, nothing to say."""


class RouterStandIn:
    """SMG's worker API and metrics, as pdctl's Router client uses them (docs/facts.md)."""

    def __init__(self, api_key: str = "key") -> None:
        self.workers: dict[str, dict[str, Any]] = {}  # id -> worker
        # SMG keeps a removed worker listed while it drains (drain_settle_secs); 0: gone at once
        self.drain_secs = 0.0
        self.deleted_at: dict[str, float] = {}  # url -> when its DELETE came
        self.left_at: dict[str, float] = {}  # url -> when it left the list
        self.requests = 0.0
        # URLs whose circuit breaker is open; a new registration comes with a closed one
        self.cb_open: set[str] = set()
        self.lock = threading.Lock()
        self.thawed = threading.Event()  # cleared: every request waits (a hung router)
        self.thawed.set()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, doc: Any, text: str | None = None) -> None:
                body = (text if text is not None else json.dumps(doc)).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _refused(self) -> bool:
                """SMG's worker API wants the key (401 invalid_api_key without it)."""
                if self.headers.get("Authorization") == f"Bearer {api_key}":
                    return False
                self._send(401, {"error": {"code": "invalid_api_key"}})
                return True

            def do_GET(self) -> None:
                owner.thawed.wait()
                if self.path == "/metrics":
                    with owner.lock:
                        lines = [
                            f'smg_router_requests_total{{router_type="pd"}} {owner.requests}',
                            *(
                                f'smg_worker_cb_state{{worker="{w["url"]}"}} '
                                f"{1 if w['url'] in owner.cb_open else 0}"
                                for w in owner.workers.values()
                            ),
                        ]
                    self._send(200, None, "".join(f"{line}\n" for line in lines))
                    return
                if self._refused():
                    return
                with owner.lock:
                    listed = list(owner.workers.values())
                self._send(200, {"workers": listed, "total": len(listed)})

            def do_POST(self) -> None:
                owner.thawed.wait()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._refused():
                    return
                with owner.lock:
                    if any(w["url"] == body["url"] for w in owner.workers.values()):
                        self._send(409, {"code": "WORKER_ALREADY_EXISTS"})
                        return
                    worker_id = str(uuid.uuid4())
                    owner.cb_open.discard(body["url"])
                    owner.workers[worker_id] = {
                        "id": worker_id,
                        "url": body["url"],
                        "worker_type": body["worker_type"],
                        "is_healthy": True,
                        "status": "ready",
                    }
                self._send(202, {"status": "accepted", "worker_id": worker_id})

            def do_DELETE(self) -> None:
                owner.thawed.wait()
                if self._refused():
                    return
                worker_id = self.path.rsplit("/", 1)[-1]
                with owner.lock:
                    worker = owner.workers.get(worker_id)
                    if worker is not None:
                        owner.deleted_at[worker["url"]] = time.monotonic()
                        worker["status"] = "draining"
                if owner.drain_secs > 0:
                    threading.Timer(owner.drain_secs, owner.leave, (worker_id,)).start()
                else:
                    owner.leave(worker_id)
                self._send(202, {"status": "accepted"})

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def freeze(self) -> None:
        """It takes connections and answers nothing, until thawed."""
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    def leave(self, worker_id: str) -> None:
        with self.lock:
            worker = self.workers.pop(worker_id, None)
            if worker is not None:
                self.left_at[worker["url"]] = time.monotonic()

    def urls(self) -> set[str]:
        with self.lock:
            return {w["url"] for w in self.workers.values()}

    def close(self) -> None:
        self.thawed.set()
        self.server.shutdown()
        self.server.server_close()


@dataclass
class World:
    plan: Plan
    hosts: dict[str, WorkerHost]
    router: RouterStandIn
    scaler: Scaler
    files: dict[str, str]
    logged: list[str] = field(default_factory=list)
    peers: list[RouterStandIn] = field(default_factory=list)  # the service's other routers

    def unit(self, name: str) -> Unit:
        slot = next(s for s in self.plan.slots() if s.name == name)
        return self.hosts[slot.host].units[name]

    def slot(self, name: str) -> Slot:
        return next(s for s in self.plan.slots() if s.name == name)

    def registered(self, group: str) -> set[str]:
        urls = self.router.urls()
        return {s.name for s in self.plan.groups[group].slots if s.url in urls}

    def pin(self, group: str, count: int) -> None:
        pins = json.loads(self.files.get(layout.SCALER_PINS, "{}"))
        pins[group] = count
        self.files[layout.SCALER_PINS] = json.dumps(pins)


@dataclass
class Keys:
    host: paramiko.RSAKey
    client: Path


def make_keys(directory: Path) -> Keys:
    client = paramiko.RSAKey.generate(2048)
    path = directory / "id_rsa"
    client.write_private_key_file(str(path))
    return Keys(paramiko.RSAKey.generate(2048), path)


def unused_router() -> Router:
    """A router client for the tests that never reach the router (a call would be refused)."""
    return Router("127.0.0.1", 9, 9, None, tcp_connector(0.5))


def worker_connector(world_hosts: dict[str, WorkerHost], timeout: float) -> Any:
    """A slot's (address, port), reached at its worker process on loopback."""
    by_address: dict[tuple[str, int], Unit] = {}
    for worker_host in world_hosts.values():
        for unit in worker_host.units.values():
            by_address[(unit.slot.address, unit.slot.port)] = unit

    def connect(address: str, port: int) -> socket.socket:
        unit = by_address.get((address, port))
        if unit is None or unit.port is None:
            raise ConnectionRefusedError(f"{address}:{port}")
        return socket.create_connection(("127.0.0.1", unit.port), timeout=timeout)

    return connect


def make_world(tmp: Path, keys: Keys, plan: Plan | None = None, peers: int = 0) -> Iterator[World]:
    """The world of ``plan`` (the fast lab plan by default), deployed; with ``peers`` more
    routers, the scaler's router being the acting one (no mesh between them)."""
    plan = plan or fast_plan()
    by_host: dict[str, list[Slot]] = {}
    for slot in plan.slots():
        by_host.setdefault(slot.host, []).append(slot)
    hosts = {
        name: WorkerHost(name, keys.host, slots, plan.service) for name, slots in by_host.items()
    }
    known = tmp / "known_hosts"
    known.write_text(
        "".join(
            f"[127.0.0.1]:{h.port} {keys.host.get_name()} {keys.host.get_base64()}\n"
            for h in hosts.values()
        )
    )
    pool = ssh.Pool(ssh.KnownHosts(known), plan.fleet)
    targets = {
        name: ssh.Target("127.0.0.1", h.port, "pdctl-scaler", identity_file=str(keys.client))
        for name, h in hosts.items()
    }
    router_standin = RouterStandIn()
    router = Router("127.0.0.1", router_standin.port, router_standin.port, "key", tcp_connector())
    peer_standins = [RouterStandIn() for _ in range(peers)]
    wait = plan.failover.probe_timeout
    router.peers = [
        Router("127.0.0.1", p.port, p.port, "key", tcp_connector(wait), wait) for p in peer_standins
    ]
    connect = worker_connector(hosts, plan.failover.probe_timeout)
    actuator = Actuator(plan, pool, targets, router, sudo=False, connector=lambda _t: connect)
    files: dict[str, str] = {}
    world_log: list[str] = []
    scaler = Scaler(
        plan, actuator, router, Store(files.get, files.__setitem__), log=world_log.append
    )
    world = World(plan, hosts, router_standin, scaler, files, world_log, peer_standins)
    # As a deploy leaves it: the slots planned to start run, enabled, and are registered (on
    # every router).
    for slot in plan.slots():
        if slot.start:
            world.hosts[slot.host].start(world.unit(slot.name), enable=True)
            for each in [router, *router.peers]:
                each.add_worker(slot.registration())
    try:
        yield world
    finally:
        scaler.stop.set()
        scaler.close()
        for worker_host in hosts.values():
            worker_host.close()
        pool.close()
        for standin in [router_standin, *peer_standins]:
            standin.close()


class Ticks:
    """Every tick's duration and decisions, checked as they come."""

    def __init__(self, world: World) -> None:
        self.world = world
        scaler = world.scaler
        # A tick waits for the hosts (read_wait), then for the engines (probe timeout):
        # never for a host or an action that does not answer.
        self.bound = scaler.read_wait + scaler.probe_timeout + 1.0
        self.longest = 0.0
        self.count = 0

    def one(self) -> None:
        started = time.monotonic()
        decisions = self.world.scaler.tick()
        took = time.monotonic() - started
        self.longest = max(self.longest, took)
        self.count += 1
        assert took < self.bound, f"a tick took {took:.1f} s:\n" + "\n".join(self.world.logged)
        assert set(decisions) == {"prefill", "decode"}, self.world.logged[-5:]

    def until(self, what: str, done: object, seconds: float, each: object = None) -> None:
        deadline = time.monotonic() + seconds
        while not done():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}:\n" + "\n".join(self.world.logged)
                )
            self.one()
            if each is not None:
                each()  # type: ignore[operator]
            time.sleep(self.world.scaler.interval)


def settled(world: World) -> bool:
    return world.registered("prefill") == {"prefill/1"} and world.registered("decode") == {
        "decode/1"
    }
