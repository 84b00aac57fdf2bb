"""bench router-failover: from a router host's power-off until requests succeed again.

A 4-host lab (two CPU hosts for the routers, two GPU hosts), the lab example with a steady
stream of chat requests (RPS a second, each with a short timeout) through the service's
endpoint. Each round powers off the host that runs the router the clients reach
(`pdctl lab fault HOST power-off`: no packet in or out, every process gone) and measures,
from that moment, the send time of the first request after which every request succeeds
for QUIET seconds, and how many requests failed in the round.

- pdctl: the router group at `count: 2` behind a failover address (`pdctl: {router:
  {address: ...}}`, the first address the lab leaves free): keepalived on the other router
  host takes the address over; its router already has every worker (pdctl gave it each). Between
  rounds the host is powered on again and its router rejoins as backup; the next round
  powers off whichever host holds the address then.
- baseline: today's single router (`count: 1`, no address), which never recovers by itself:
  at the power-off a person's `pdctl fleet remove --force` of the router host and `pdctl
  deploy` (the router moves to the other CPU host), counted from the power-off itself (no
  time to notice), until a request through the new endpoint succeeds (the clients learn the
  new endpoint at once). The lost host stays gone from the fleet, so the baseline runs on a
  lab of BASELINE_CPU_HOSTS CPU hosts, one deploy, and each round loses the router's host of
  then (no fresh lab and deploy between rounds).

The result is p50 of ROUNDS rounds each way, with the failed requests of each.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.host_loss import Prober, recovered_after
from bench.lablib import FLEET, PDCTL, REPO, BenchError, BenchLab
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import build
from pdctl.core.spec import load

HOSTS = 4
CPU_HOSTS = 2
ROUNDS = 3
# The baseline's lab: each round removes the router's host for good; one is left at the end.
BASELINE_CPU_HOSTS = ROUNDS + 1
SERVICE = "routerha"
ROUND_LIMIT = 600.0  # a round that has not recovered by then fails the benchmark
SETTLE = 180.0  # seconds to wait for both routers to serve again between rounds
# The address the lab leaves free for a failover address (`pdctl lab status` says the range).
ADDRESS_OFFSET = 200


def service_spec(address: str | None) -> dict[str, Any]:
    """The lab example as service SERVICE: two routers behind ``address``, or (None) the one
    router of today; a replica of each worker group, the rps target out of reach (the scaler
    holds the groups where the deploy put them)."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "lab" / "pd.yml").read_text())
    doc["name"] = SERVICE
    router, prefill, decode = doc["replicas"]
    for group in (prefill, decode):
        group["count"] = 1
        group.pop("scaling", None)
    if address is not None:
        router["count"] = 2
        doc["pdctl"]["router"]["address"] = address
    return doc


def write_spec(lab: BenchLab, address: str | None) -> Path:
    path = lab.home / ("routerha.yml" if address else "router-single.yml")
    path.write_text(yaml.safe_dump(service_spec(address), sort_keys=False))
    return path


def free_address(lab: BenchLab) -> str:
    """The first address of the range `pdctl lab status` says no lab host takes."""
    first = str(lab.status()["free_addresses"]).split("-", 1)[0]
    if not first.endswith(f".{ADDRESS_OFFSET}"):
        raise BenchError(f"router-failover: the lab leaves {first} free, not .{ADDRESS_OFFSET}")
    return first


def check_inputs(lab: BenchLab) -> None:
    """Both specs are valid and, on this lab's shape, the HA one plans its two routers on the
    two CPU hosts behind the address (no lab needed)."""
    address = f"10.77.0.{ADDRESS_OFFSET}"
    theirs, their_env = load(write_spec(lab, None), lab.env)
    gpu_hosts = [_host(f"gpu{i}", "gpu") for i in range(1, HOSTS - CPU_HOSTS + 1)]
    last = [_host(f"cpu{BASELINE_CPU_HOSTS}", "cpu"), *gpu_hosts]  # the baseline's last round
    single = build(theirs, their_env, Fleet(name=FLEET, hosts=last), secrets_digest="")
    if [r.host for r in single.router.replicas] != [last[0].name]:
        raise BenchError("router-failover: the baseline's router is not planned on its CPU host")
    service, env = load(write_spec(lab, address), lab.env)
    hosts = [_host(f"cpu{i}", "cpu") for i in range(1, CPU_HOSTS + 1)] + gpu_hosts
    plan = build(service, env, Fleet(name=FLEET, hosts=hosts), secrets_digest="")
    placed = [r.host for r in plan.router.replicas]
    if placed != ["cpu1", "cpu2"] or plan.router.failover is None:
        raise BenchError(f"router-failover: the routers are planned on {placed}, not cpu1, cpu2")
    if plan.router.failover.address != address:
        raise BenchError(f"router-failover: the plan's address is {plan.router.failover}")


def _host(name: str, kind: str) -> FleetHost:
    number = int(name[-1]) + (0 if kind == "cpu" else BASELINE_CPU_HOSTS)
    return FleetHost(
        name=name,
        address=f"10.77.0.{10 + number}",
        user="pdops",
        kind=kind,
        facts={
            "cpus": 8,
            "memory_gb": 64.0,
            "gpus": {"count": 8 if kind == "gpu" else 0, "model": "AMD Instinct MI300X"},
        },
        preflight=Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00"),
    )


def _status(lab: BenchLab) -> dict[str, Any]:
    """`pdctl status` (exit 8 is an answer too: the service is down)."""
    proc = lab.run(PDCTL, "--json", "-q", "status", SERVICE, ok_codes=(0, 8))
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def _node(lab: BenchLab, address: str) -> str:
    return str(next(h["name"] for h in lab.status()["hosts"] if h["address"] == address))


def _routers_serving(doc: dict[str, Any]) -> bool:
    states = sorted(r["state"] for r in doc.get("routers") or [])
    return doc.get("health") == "serving" and states == ["active", "backup"]


def wait_routers(lab: BenchLab, seconds: float = SETTLE) -> dict[str, Any]:
    """Until status shows one active router and one backup, the service serving."""
    deadline = time.monotonic() + seconds
    while True:
        doc = _status(lab)
        if _routers_serving(doc):
            return doc
        if time.monotonic() > deadline:
            raise BenchError(f"router-failover: the routers never settled: {doc.get('routers')}")
        time.sleep(1)


def _round(
    lab: BenchLab, node: str, endpoint: str, key: str, act: Callable[[], dict[str, Any] | None]
) -> tuple[float, int]:
    """Power ``node`` off under the probe load; ``act`` (the baseline's operator) may return
    a new endpoint and key (`pdctl endpoint`) for the probe. Seconds until requests succeed
    again, and the requests that failed."""
    prober = Prober(endpoint, key)
    prober.start()
    try:
        time.sleep(3)
        lost_at = time.monotonic()
        lab.pdctl("lab", "fault", node, "power-off")
        moved = act()
        if moved is not None:
            prober.endpoint, prober.key = str(moved["endpoint"]), str(moved["api_key"])
        deadline = lost_at + ROUND_LIMIT
        while time.monotonic() < deadline:
            took = recovered_after(prober.outcomes(), lost_at)
            if took is not None:
                failed = sum(1 for _at, ok in prober.outcomes() if not ok)
                return took, failed
            time.sleep(1)
        raise BenchError(f"router-failover: requests never succeeded within {ROUND_LIMIT:.0f} s")
    finally:
        prober.stop.set()
        prober.join(5)


def measure_pdctl(lab: BenchLab, log: Callable[[str], None]) -> list[tuple[float, int]]:
    path = write_spec(lab, free_address(lab))
    lab.pdctl("deploy", str(path), "--fleet", FLEET, "-y")
    doc = lab.pdctl("endpoint", SERVICE, "--show-key")
    endpoint, key = str(doc["endpoint"]), str(doc["api_key"])
    rounds = []
    for number in range(1, ROUNDS + 1):
        status = wait_routers(lab)
        holder = next(r for r in status["routers"] if r["state"] == "active")
        node = _node(lab, holder["host"])
        took, failed = _round(lab, node, endpoint, key, lambda: None)
        log(
            f"router-failover: pdctl round {number}: {node} off, requests succeed after "
            f"{took:.1f} s, {failed} failed"
        )
        rounds.append((took, failed))
        lab.pdctl("lab", "fault", node, "power-on")
    wait_routers(lab)  # the last one rejoined as backup
    return rounds


def measure_baseline(lab: BenchLab, log: Callable[[str], None]) -> list[tuple[float, int]]:
    """On a lab of BASELINE_CPU_HOSTS CPU hosts: one deploy, then each round loses the host of
    the router, and the operator's remove + deploy moves it to the next CPU host."""
    path = write_spec(lab, None)
    lab.pdctl("deploy", str(path), "--fleet", FLEET, "-y")
    doc: dict[str, Any] = lab.pdctl("endpoint", SERVICE, "--show-key")
    rounds = []
    for number in range(1, ROUNDS + 1):
        endpoint, key = str(doc["endpoint"]), str(doc["api_key"])
        router = str(_status(lab)["groups"]["router"]["host"])
        node = _node(lab, router)

        def operator(address: str = router) -> dict[str, Any]:
            lab.pdctl("fleet", "remove", FLEET, "--host", address, "--force", "-y")
            lab.pdctl("deploy", str(path), "--fleet", FLEET, "-y")
            doc.update(lab.pdctl("endpoint", SERVICE, "--show-key"))  # the next round's
            return doc

        took, failed = _round(lab, node, endpoint, key, operator)
        log(
            f"router-failover: baseline round {number}: {node} off, fleet remove --force + "
            f"deploy: {took:.1f} s, {failed} failed"
        )
        rounds.append((took, failed))
    return rounds


def p50(rounds: list[tuple[float, int]]) -> float:
    return statistics.median(took for took, _failed in rounds)
