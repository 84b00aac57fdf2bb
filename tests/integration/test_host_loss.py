"""A GPU host that loses power, a decode worker that hangs, a prefill host that loses power:
the service serves again within seconds, `pdctl status` answers throughout, and a returning
host's replaced replicas never serve twice.

dstack's AMD PD example (tests/data/dstack-amd-pd-disaggregation.yml, from its blog) made
lab-sized on `pdctl lab up --hosts 4 --cpu-hosts 1`: the lab's image and tiny model,
`MI300X:4` replicas, prefill and decode at `count: 1..2` (the plan puts prefill/1, decode/1
and the spares on three hosts: N+1, required with `survive_host_loss`), and a `pdctl:` block
with the lab's short waits and a fast scaler. The file's router and workers all say port
30000; pdctl's workers take theirs from `pdctl.ports.base` (31000 here, off the router's).
The tests run in file order and share one deployment; the hosts are lost and hung for real:
`pdctl lab fault HOST power-off` (no packet in or out, every process gone), SIGSTOP.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import Lab, pdctl, require_lab, start_lab

DSTACK_FILE = Path(__file__).resolve().parents[1] / "data" / "dstack-amd-pd-disaggregation.yml"
MODEL = "lab/tiny-llama"
SERVICE = "amd-sglang-pd-service"  # the example's own name
LAB_SETTINGS = {
    "ports": {"base": 31000},  # the file's workers say 30000, its router's port (issue 21)
    "start_timeout": "2m",
    "stop_timeout": "30s",
    "router": {"health_check_interval": "2s"},
    "placement": {"survive_host_loss": True},
    "scaler": {
        "interval": "1s",
        "host_lost_after": "4s",
        "unhealthy_after": "4s",
        "probe_timeout": "1s",
        "kill_after": "5s",
    },
}


def lab_sized(image: str) -> str:
    """dstack's file with the lab's image, model, GPU sizes and counts, and lab settings."""
    doc = yaml.safe_load(DSTACK_FILE.read_text())
    doc.update(image=image, model=MODEL)
    doc["env"] = [f"MODEL_ID={MODEL}" if e.startswith("MODEL_ID=") else e for e in doc["env"]]
    for group in doc["replicas"][1:]:
        group["count"] = "1..2"
        group["resources"] = {"gpu": "MI300X:4"}  # two replicas per 8-GPU lab host
    doc["replicas"][0].pop("resources", None)  # `cpu: 4..`: the lab's hosts have this machine's
    doc["probes"][0]["interval"] = "2s"
    doc["pdctl"] = LAB_SETTINGS
    return str(yaml.safe_dump(doc, sort_keys=False))


# SIGSTOP a process and all its descendants (argv[1]: the container's first process).
FREEZE = """\
import os, signal, sys
frozen = {int(sys.argv[1])}
grew = True
while grew:
    grew = False
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in frozen:
            continue
        try:
            parent = int(open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent in frozen:
            frozen.add(int(name))
            grew = True
for pid in frozen:
    os.kill(pid, signal.SIGSTOP)
print(sorted(frozen))
"""


@dataclass
class Sent:
    at: float  # time.monotonic() when sent
    ok: bool
    detail: str


class Load(threading.Thread):
    """Chat requests at a steady rate, each on its own thread; every outcome with its send
    time."""

    def __init__(self, endpoint: str, key: str, rps: float) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.key, self.rps = endpoint, key, rps
        self.stop = threading.Event()
        self.sent: list[Sent] = []
        self.count = 0  # requests sent
        self.lock = threading.Lock()

    def one(self) -> None:
        at = time.monotonic()
        request = urllib.request.Request(
            f"{self.endpoint}/v1/chat/completions",
            method="POST",
            data=json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            ).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                ok, detail = response.status == 200, str(response.status)
        except urllib.error.HTTPError as exc:
            ok, detail = False, f"{exc.code} {exc.read()[:100]!r}"
        except OSError as exc:
            ok, detail = False, str(exc)
        with self.lock:
            self.sent.append(Sent(at, ok, detail))

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            threading.Thread(target=self.one, daemon=True).start()
            self.count += 1
            next_at += 1.0 / self.rps
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def finish(self) -> list[Sent]:
        """Stop sending; every request's outcome (each ends by its own timeout)."""
        self.stop.set()
        self.join(5)
        deadline = time.monotonic() + 35
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.sent) >= self.count:
                    break
            time.sleep(0.2)
        with self.lock:
            return list(self.sent)


@dataclass
class Service:
    lab: Lab
    env: dict[str, str]
    spec: Path
    endpoint: str = ""
    key: str = ""
    nodes: dict[str, str] = field(default_factory=dict)  # address -> lab node

    def pdctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return pdctl(self.lab.home, *args, env=self.env, check=check, timeout=300)

    def status(self) -> tuple[int, dict[str, Any]]:
        proc = self.pdctl("--json", "status", SERVICE, check=False)
        return proc.returncode, json.loads(proc.stdout)

    def node(self, replica: str) -> str:
        group, index = replica.split("/")
        found = self.status()[1]["groups"][group]["replicas"]
        host = str(next(r["host"] for r in found if r["slot"] == int(index)))
        return self.nodes.get(host, host)

    def root(self, node: str, command: str, check: bool = True) -> str:
        return self.lab.ssh(node, command, user="root", check=check).stdout

    def wait(self, what: str, ok: Callable[[dict[str, Any]], bool], seconds: float) -> float:
        """Poll `pdctl status` until ``ok``; the seconds it took."""
        started = time.monotonic()
        doc: dict[str, Any] = {}
        while time.monotonic() - started < seconds:
            _, doc = self.status()
            if ok(doc):
                return time.monotonic() - started
            time.sleep(1)
        raise AssertionError(f"timed out waiting for {what}: {json.dumps(doc, indent=1)[:4000]}")


def serving(doc: dict[str, Any], group: str) -> set[int]:
    """The group's slots the router routes to."""
    return {
        r["slot"]
        for r in doc["groups"][group]["replicas"]
        if r["registered"] and r["router_status"] == "ready"
    }


def registered(doc: dict[str, Any], group: str) -> set[int]:
    return {r["slot"] for r in doc["groups"][group]["replicas"] if r["registered"]}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    require_lab()
    home = tmp_path_factory.mktemp("hostloss")
    lab = start_lab(home, hosts=4, cpu_hosts=1)
    try:
        status = lab.status()
        pdctl(home, *status["fleet_add"].split()[1:])
        spec = home / "pd.yml"
        spec.write_text(lab_sized(status["worker_image"]))
        found = Service(lab, {"HF_TOKEN": f"hf_{uuid.uuid4().hex}"}, spec)
        found.nodes = {h["address"]: h["name"] for h in status["hosts"]}
        found.pdctl("deploy", str(spec), "--fleet", "lab", "-y")
        _, doc = found.status()
        found.endpoint = doc["endpoint"]
        router = found.nodes[doc["groups"]["router"]["host"]]
        env = found.root(router, f"cat /etc/pdctl/{SERVICE}/router.env")
        found.key = env.strip().split("=", 1)[1]
        yield found
    finally:
        pdctl(home, "lab", "down", check=False)


def test_the_plan_keeps_a_spare_on_another_host_for_each_group(service: Service) -> None:
    doc = json.loads(service.pdctl("--json", "plan", str(service.spec), "--fleet", "lab").stdout)
    for group in ("prefill", "decode"):
        loss = doc["host_loss"][group]
        assert loss["survives"] and loss["need"] == 1 and loss["left"] >= 1, loss
    slots = {
        f"{s['group']}/{s['index']}": s["host"]
        for s in doc["plan"]["groups"]["prefill"]["slots"]
        + doc["plan"]["groups"]["decode"]["slots"]
    }
    assert slots["prefill/1"] != slots["prefill/2"] and slots["decode/1"] != slots["decode/2"]
    code, status = service.status()
    assert code == 0 and status["health"] == "serving", status
    for group in ("prefill", "decode"):
        assert status["groups"][group]["host_loss"]["survives"]
        assert status["groups"][group]["spares"] == 1
        assert serving(status, group) == {1}


def lose_a_host_under_load(service: Service, replica: str) -> None:
    """Power off ``replica``'s host under 4 rps: every request sent 20 s or more after the
    loss succeeds, status answers while it is off, the group gets its spare; powering it
    back on, the group has exactly its replica count registered, the old one fenced."""
    group, _, number = replica.partition("/")
    index = int(number)
    node = service.node(replica)
    load = Load(service.endpoint, service.key, rps=4)
    load.start()
    time.sleep(4)
    lost_at = time.monotonic()
    service.lab.fault(node, "power-off")
    asked = time.monotonic()
    code, doc = service.status()
    took = time.monotonic() - asked
    address = next(a for a, n in service.nodes.items() if n == node)
    assert code in (0, 8), doc  # answers; 8 only while no replica of a group serves
    assert address in doc["unreachable"] and doc["unreachable"][address], doc["unreachable"]
    assert took < 60, took
    replaced = service.wait(
        f"a spare {group} serving",
        lambda d: len(serving(d, group)) == 1 and d["health"] in {"serving", "degraded"},
        60,
    )
    remaining = 35 - (time.monotonic() - lost_at)
    if remaining > 0:
        time.sleep(remaining)
    sent = load.finish()
    late = [s for s in sent if s.at - lost_at >= 20]
    assert late and all(s.ok for s in late), [s.detail for s in late if not s.ok]
    print(f"{replica}'s host {node} lost: a spare serves {replaced:.0f} s after status answered")
    code, doc = service.status()
    assert code == 0 and doc["health"] == "degraded" and address in doc["unreachable"]
    assert doc["scaler"]["hosts"].get(address, {}).get("state") == "lost", doc["scaler"]

    service.lab.fault(node, "power-on")
    unit = f"pd-{SERVICE}-{group}@{index}.service"
    deadline = time.monotonic() + 90
    while True:
        code, doc = service.status()
        assert index not in registered(doc, group), doc["groups"][group]  # never served twice
        assert len(registered(doc, group)) <= 1, doc["groups"][group]
        fenced = address not in doc["unreachable"] and replica not in doc["scaler"]["fenced"]
        state = next(r["state"] for r in doc["groups"][group]["replicas"] if r["slot"] == index)
        if fenced and state in {"inactive", "failed"}:
            break
        assert time.monotonic() < deadline, doc
        time.sleep(1)
    assert service.root(node, f"systemctl is-enabled {unit} || true").strip() == "disabled"
    for _ in range(5):  # and it stays so
        code, doc = service.status()
        assert (
            code == 0 and len(registered(doc, group)) == 1 and index not in registered(doc, group)
        )
        time.sleep(1)


def test_status_logs_and_deploy_with_a_host_off(service: Service) -> None:
    # a spare's host (nothing is replaced), before any loss: the deploy that converges the
    # other hosts finds the plan's replicas running (after a loss it would start the replaced
    # ones again, and the scaler would scale the group back in later)
    node = service.node("prefill/2")
    service.lab.fault(node, "power-off")
    try:
        code, doc = service.status()
        assert code == 0 and doc["health"] == "degraded", doc
        proc = service.pdctl("logs", SERVICE, "prefill/2", check=False)
        assert proc.returncode == 4 and "does not answer" in proc.stderr, proc.stderr
        assert service.pdctl("logs", SERVICE, "prefill/1", "-n", "3").returncode == 0
        proc = service.pdctl("deploy", str(service.spec), "--fleet", "lab", "-y", check=False)
        assert proc.returncode == 4 and "cannot be reached" in proc.stderr, proc.stderr
        assert "--skip-unreachable" in proc.stderr
        address = next(a for a, n in service.nodes.items() if n == node)
        done = json.loads(
            service.pdctl(
                "--json",
                "deploy",
                str(service.spec),
                "--fleet",
                "lab",
                "-y",
                "--skip-unreachable",
                "--converge",
            ).stdout
        )
        assert done["skipped_hosts"] == [address] and done["converged"], done
        assert address not in done["changed_hosts"]
        lab_host = service.lab.host(node)
        assert (lab_host["state"], lab_host["power"]) == ("off", "off")
    finally:
        service.lab.fault(node, "power-on")


def test_a_decode_host_losing_power_under_load(service: Service) -> None:
    lose_a_host_under_load(service, "decode/1")


def test_a_hung_decode_worker_is_replaced_then_killed(service: Service) -> None:
    _, doc = service.status()
    (index,) = serving(doc, "decode")
    node = service.node(f"decode/{index}")
    container = f"pd-{SERVICE}-decode-{index}"
    # SIGSTOP the engine and every process of its container: what a wedged collective or a
    # GPU fault looks like from outside (alive, its port open, answering nothing)
    service.lab.ssh(
        node,
        f"python3 - $(podman inspect --format '{{{{.State.Pid}}}}' {container})",
        user="root",
        stdin=FREEZE,
    )
    hung_at = time.monotonic()
    load = Load(service.endpoint, service.key, rps=4)
    load.start()
    recorded: list[float] = []

    def replaced(d: dict[str, Any]) -> bool:
        recorded.append(d["scaler"]["recorded_at"] or 0)
        assert d["scaler"]["running"], d["scaler"]  # deciding throughout
        return bool(serving(d, "decode")) and index not in registered(d, "decode")

    took = service.wait("the spare serving in the hung worker's place", replaced, 60)
    assert time.monotonic() - hung_at < 30 + 5, took  # within 30 s (a status call's margin)
    unit = f"pd-{SERVICE}-decode@{index}.service"
    deadline = hung_at + 60
    while service.root(node, f"systemctl is-active {unit} || true").strip() in {
        "active",
        "deactivating",
    }:
        assert time.monotonic() < deadline, "the hung unit was not stopped within a minute"
        time.sleep(1)
    while time.monotonic() - hung_at < 40:  # the scaler keeps ticking and deciding
        _, doc = service.status()
        assert doc["scaler"]["running"], doc["scaler"]
        recorded.append(doc["scaler"]["recorded_at"] or 0)
        assert all(doc["groups"][g]["last_decision"] for g in ("prefill", "decode"))
        time.sleep(1)
    sent = load.finish()
    late = [s for s in sent if s.at - hung_at >= 30]
    assert late and all(s.ok for s in late), [s.detail for s in late if not s.ok]
    assert len(set(recorded)) >= 5, recorded  # a new tick recorded between most polls
    journal = service.root(
        service.nodes[service.status()[1]["groups"]["router"]["host"]],
        f"journalctl -u pd-{SERVICE}-scaler --no-pager -o cat",
    )
    assert f"decode/{index} on" in journal and "unhealthy for" in journal
    assert "tick failed" not in journal


def test_a_prefill_host_losing_power_under_load(service: Service) -> None:
    _, doc = service.status()
    (index,) = serving(doc, "prefill")
    lose_a_host_under_load(service, f"prefill/{index}")
