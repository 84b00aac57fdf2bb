"""bench host-loss: from a GPU host's power-off until requests succeed again.

A 4-host lab (a CPU host for the router, three GPU hosts), the lab example with prefill and
decode at `count: 1..2` (a replica each, and a spare each on another host: N+1, required with
`survive_host_loss`), a steady stream of chat requests through the router (RPS a second,
each with a short timeout). Each round powers off the host that runs the decode replica
(`pdctl lab fault HOST power-off`: no packet in or out, every process gone) and measures,
from that moment, the send time of the first request after which every request succeeds
for QUIET seconds. The scaler runs with pdctl's defaults (no `pdctl.scaler` in the spec).

- pdctl: the scaler finds the host lost, deregisters its replica and starts the spare on
  another host. Between rounds the host is powered on again and fenced (its replaced
  replica stopped and disabled); the next round powers off the host that serves decode then.
- baseline: what an operator had before this (a scaler that recovers nothing until the host
  returns): the scaler stopped, and at the power-off a person's `pdctl fleet remove --force`
  of the host and `pdctl deploy`, counted from the power-off itself (no time to notice). The
  lost host stays gone from the fleet, so the baseline runs on a lab of BASELINE_GPU_HOSTS GPU
  hosts, one deploy, and each round loses another host: the last round still leaves the two
  GPU hosts the service's four slots need (no fresh lab and deploy between rounds).

The result is p50 of ROUNDS rounds each way.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.lablib import FLEET, PDCTL, REPO, BenchError, BenchLab
from pdctl.core import spec
from pdctl.core.failover import plan_host_loss
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import build

HOSTS = 4
ROUNDS = 3
# The baseline's lab: each round removes a host for good; two stay for the four slots.
BASELINE_GPU_HOSTS = ROUNDS + 2
RPS = 4.0
REQUEST_TIMEOUT = 5.0  # a request to a lost host's replica fails by then
QUIET = 10.0  # recovered: every request for this long succeeds
ROUND_LIMIT = 240.0  # a round that has not recovered by then fails the benchmark
SERVICE = "hostloss"
MODEL = "lab/tiny-llama"


def service_spec(n_plus_one: bool = True) -> dict[str, Any]:
    """The lab example as service SERVICE: one replica and one spare per group, an rps target
    out of reach (the scaler holds the groups where the deploy put them). ``n_plus_one``:
    the spec asks for it (the baseline's does not: its redeploy is on one host fewer, where
    the spares share hosts)."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "lab" / "pd.yml").read_text())
    doc["name"] = SERVICE
    for group in doc["replicas"][1:]:
        group["count"] = "1..2"
        group["scaling"]["target"] = 1000
    if n_plus_one:
        doc["pdctl"]["placement"] = {"survive_host_loss": True}
    return doc


def write_spec(lab: BenchLab, n_plus_one: bool = True) -> Path:
    path = lab.home / "hostloss.yml"
    path.write_text(yaml.safe_dump(service_spec(n_plus_one), sort_keys=False))
    return path


def check_inputs(lab: BenchLab) -> None:
    """The spec is valid and, on this lab's shape, plans a spare of each group on a host
    other than its replica's; the baseline's still plans on the hosts its last round leaves
    (no lab needed)."""
    theirs, their_env = spec.load(write_spec(lab, n_plus_one=False), lab.env)
    left = BASELINE_GPU_HOSTS - ROUNDS
    hosts = [_host("cpu1", "cpu"), *(_host(f"gpu{i}", "gpu") for i in range(1, left + 1))]
    build(theirs, their_env, Fleet(name=FLEET, hosts=hosts), secrets_digest="")
    service, env = spec.load(write_spec(lab), lab.env)
    hosts = [_host("cpu1", "cpu"), *(_host(f"gpu{i}", "gpu") for i in range(1, HOSTS))]
    plan = build(service, env, Fleet(name=FLEET, hosts=hosts), secrets_digest="")
    short = [loss.describe() for loss in plan_host_loss(plan).values() if not loss.survives]
    if short:
        raise BenchError(f"host-loss: the plan does not survive a host's loss: {short}")


def _host(name: str, kind: str) -> FleetHost:
    gpus = 8 if kind == "gpu" else 0
    return FleetHost(
        name=name,
        address=f"10.77.0.{10 + int(name[-1])}",
        user="pdops",
        kind=kind,
        facts={
            "cpus": 8,
            "memory_gb": 64.0,
            "gpus": {"count": gpus, "model": "AMD Instinct MI300X"},
        },
        preflight=Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00"),
    )


class Prober(threading.Thread):
    """Chat requests at RPS through the router: (send time, succeeded) each."""

    def __init__(self, endpoint: str, key: str) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.key = endpoint, key
        self.stop = threading.Event()
        self.results: list[tuple[float, bool]] = []
        self.lock = threading.Lock()

    def one(self) -> None:
        sent = time.monotonic()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        request = urllib.request.Request(
            f"{self.endpoint}/v1/chat/completions",
            method="POST",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
                ok = response.status == 200
        except (urllib.error.URLError, OSError):
            ok = False
        with self.lock:
            self.results.append((sent, ok))

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            threading.Thread(target=self.one, daemon=True).start()
            next_at += 1.0 / RPS
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def outcomes(self) -> list[tuple[float, bool]]:
        with self.lock:
            return sorted(self.results)


def recovered_after(outcomes: list[tuple[float, bool]], lost_at: float) -> float | None:
    """Seconds from ``lost_at`` to the send time of the first request after which every
    request (for at least QUIET s, with answers in) succeeded; None: not yet."""
    after = [(at, ok) for at, ok in outcomes if at >= lost_at]
    if not after:
        return None
    failed = [at for at, ok in after if not ok]
    start = lost_at if not failed else next((at for at, ok in after if at > failed[-1]), None)
    if start is None or after[-1][0] - start < QUIET:
        return None
    return start - lost_at


def _endpoint(lab: BenchLab) -> tuple[str, str]:
    doc = lab.pdctl("endpoint", SERVICE, "--show-key")
    return str(doc["endpoint"]), str(doc["api_key"])


def _status(lab: BenchLab) -> dict[str, Any]:
    """`pdctl status` (exit 8 is an answer too: the service is down)."""
    proc = lab.run(PDCTL, "--json", "-q", "status", SERVICE, ok_codes=(0, 8))
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def _wait(lab: BenchLab, what: str, ok: Callable[[dict[str, Any]], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        doc = _status(lab)
        if ok(doc):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"host-loss: timed out waiting for {what}: {doc['groups']}")
        time.sleep(1)


def _healthy(doc: dict[str, Any]) -> bool:
    return doc["health"] == "serving" and not doc["scaler"]["fenced"] and not doc["unreachable"]


def _decode_node(lab: BenchLab, doc: dict[str, Any]) -> str:
    host = next(
        r["host"]
        for r in doc["groups"]["decode"]["replicas"]
        if r["registered"] and r["router_status"] == "ready"
    )
    return str(next(h["name"] for h in lab.status()["hosts"] if h["address"] == host))


def _round(lab: BenchLab, node: str, endpoint: str, key: str, act: Callable[[], None]) -> float:
    """Power ``node`` off under the probe load, run ``act`` (the baseline's operator), and
    return the seconds until requests succeed again."""
    prober = Prober(endpoint, key)
    prober.start()
    try:
        time.sleep(3)
        lost_at = time.monotonic()
        lab.pdctl("lab", "fault", node, "power-off")
        act()
        deadline = lost_at + ROUND_LIMIT
        while time.monotonic() < deadline:
            took = recovered_after(prober.outcomes(), lost_at)
            if took is not None:
                return took
            time.sleep(1)
        raise BenchError(f"host-loss: requests did not succeed again within {ROUND_LIMIT:.0f} s")
    finally:
        prober.stop.set()
        prober.join(5)


def measure_pdctl(lab: BenchLab, log: Callable[[str], None]) -> list[float]:
    path = write_spec(lab)
    lab.pdctl("deploy", str(path), "--fleet", FLEET, "-y")
    endpoint, key = _endpoint(lab)
    timings = []
    for number in range(1, ROUNDS + 1):
        _wait(lab, "the service serving on every host", _healthy, 180)
        node = _decode_node(lab, _status(lab))
        took = _round(lab, node, endpoint, key, lambda: None)
        log(f"host-loss: pdctl round {number}: {node} off, requests succeed after {took:.1f} s")
        timings.append(took)
        lab.pdctl("lab", "fault", node, "power-on")
    return timings


def measure_baseline(lab: BenchLab, log: Callable[[str], None]) -> list[float]:
    """On a lab of 1 + BASELINE_GPU_HOSTS hosts: one deploy, then each round loses the host
    serving decode then, and the operator's remove + deploy moves it to the hosts left."""
    path = write_spec(lab, n_plus_one=False)
    lab.pdctl("deploy", str(path), "--fleet", FLEET, "-y")
    endpoint, key = _endpoint(lab)
    router = next(h["name"] for h in lab.status()["hosts"] if h["kind"] == "cpu")
    timings = []
    for number in range(1, ROUNDS + 1):
        _wait(lab, "the service serving", _healthy, 180)
        # No recovery; the operator's deploy of the round before started it again.
        lab.ssh_root(router, f"systemctl stop pd-{SERVICE}-scaler.service")
        node = _decode_node(lab, _status(lab))
        address = next(h["address"] for h in lab.status()["hosts"] if h["name"] == node)

        def operator(address: str = address) -> None:
            lab.pdctl("fleet", "remove", FLEET, "--host", address, "--force", "-y")
            lab.pdctl("deploy", str(path), "--fleet", FLEET, "-y")

        took = _round(lab, node, endpoint, key, operator)
        log(
            f"host-loss: baseline round {number}: {node} off, fleet remove --force + deploy: "
            f"{took:.1f} s"
        )
        timings.append(took)
    return timings


def p50(values: list[float]) -> float:
    return statistics.median(values)
