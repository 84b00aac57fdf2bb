"""The scaler end to end on a 3-host lab: load drives both groups up and back down,
a killed worker comes back, and a scaler killed mid scale-in leaves nothing orphaned.

The scaler under test is the deployed one: pd-lab-scaler-scaler.service on the router
host, reaching the worker hosts with its restricted key, on the session's shared lab.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdctl.core import layout
from tests.support import Lab, pdctl, renamed, service_status, wait_for

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "lab" / "pd.yml"
SERVICE = "lab-scaler"


@dataclass
class Deployed:
    lab: Lab
    env: dict[str, str]
    endpoint: str = ""
    key: str = ""

    def status(self) -> dict[str, Any]:
        return service_status(self.lab.home, SERVICE, self.env)

    def root(self, node: str, command: str, check: bool = True) -> str:
        return self.lab.ssh(node, command, user="root", check=check).stdout

    def wait(
        self, what: str, ok: Callable[[dict[str, Any]], bool], seconds: float
    ) -> dict[str, Any]:
        deadline = time.monotonic() + seconds
        doc = self.status()
        while not ok(doc):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}: {json.dumps(doc['groups'], indent=1)}"
                )
            time.sleep(2)
            doc = self.status()
        return doc


class Load(threading.Thread):
    """Chat requests at a steady rate from a few threads; counts failures per phase."""

    def __init__(self, deployed: Deployed, rps: float) -> None:
        super().__init__(daemon=True)
        self.deployed, self.rps = deployed, rps
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def one(self) -> None:
        request = urllib.request.Request(
            f"{self.deployed.endpoint}/v1/chat/completions",
            method="POST",
            data=json.dumps(
                {
                    "model": "lab/tiny-llama",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                }
            ).encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {self.deployed.key}",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=20) as response:
                ok = response.status == 200
                detail = str(response.status)
        except urllib.error.HTTPError as exc:
            ok, detail = False, f"{exc.code} {exc.read()[:120]!r}"
        except OSError as exc:
            ok, detail = False, str(exc)
        with self.lock:
            if ok:
                self.ok += 1
            else:
                self.failures.append(detail)

    def run(self) -> None:
        period = 1.0 / self.rps
        next_at = time.monotonic()
        while not self.stop.is_set():
            threading.Thread(target=self.one, daemon=True).start()
            next_at += period
            self.stop.wait(max(0.0, next_at - time.monotonic()))


@pytest.fixture(scope="module")
def deployed(shared_lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Deployed:
    env = {"HF_TOKEN": f"hf_{uuid.uuid4().hex}"}
    spec = tmp_path_factory.mktemp("scaler") / "pd.yml"
    spec.write_text(renamed(SPEC.read_text(), SERVICE))
    pdctl(shared_lab.home, "deploy", str(spec), "--fleet", "lab", "-y", env=env)
    d = Deployed(lab=shared_lab, env=env)
    d.endpoint = d.status()["endpoint"]
    d.key = d.root("node1", f"cat /etc/pdctl/{SERVICE}/router.env").strip().split("=", 1)[1]
    return d


def both(doc: dict[str, Any], running: int, registered: int | None = None) -> bool:
    for role in ("prefill", "decode"):
        group = doc["groups"][role]
        reg = sum(r["registered"] and r["router_status"] == "ready" for r in group["replicas"])
        if group["running"] != running or reg != (running if registered is None else registered):
            return False
    return True


def answers(deployed: Deployed, host: str, port: int) -> bool:
    """The worker at HOST:PORT answers its /health (asked on its own host)."""
    url = f"http://{host}:{port}/health"
    probe = f"python3 -c 'import urllib.request as u; u.urlopen(\"{url}\", timeout=2)' && echo up"
    return deployed.root(deployed.lab.node_at(host), probe, check=False).strip() == "up"


def routed(deployed: Deployed) -> bool:
    """A chat through the router answers."""
    probe = Load(deployed, rps=1)
    probe.one()
    return probe.ok == 1


def test_scaler_runs_as_a_unit_with_a_restricted_key(deployed: Deployed) -> None:
    assert (
        deployed.root("node1", f"systemctl is-active pd-{SERVICE}-scaler.service").strip()
        == "active"
    )
    keys = deployed.root("node2", "cat /var/lib/pdctl-scaler/.ssh/authorized_keys")
    assert keys.startswith(f'restrict,command="/usr/local/libexec/pdctl-unitctl --ssh {SERVICE}"')
    probe = deployed.root(
        "node1",
        (
            f"ssh -i /etc/pdctl/{SERVICE}/scaler_id_ed25519"
            f" -o UserKnownHostsFile=/etc/pdctl/{SERVICE}/scaler_known_hosts"
            f" -o BatchMode=yes pdctl-scaler@{deployed.lab.host('node2')['address']}"
            " id 2>&1; echo rc=$?"
        ),
        check=False,
    )
    assert "not allowed" in probe and "uid=" not in probe  # anything but pdctl-unitctl is refused


def test_load_drives_both_groups_up_then_down_without_failed_requests(deployed: Deployed) -> None:
    load = Load(deployed, rps=8)
    load.start()
    try:
        doc = deployed.wait("both groups at 2", lambda d: both(d, 2), 150)
    finally:
        load.stop.set()
        load.join(5)
    for role in ("prefill", "decode"):
        assert doc["groups"][role]["desired"] == 2
    assert load.ok > 30 and load.failures == [], load.failures
    trickle = Load(deployed, rps=0.5)
    trickle.start()
    try:
        deployed.wait("both groups back to 1", lambda d: both(d, 1), 240)
        time.sleep(3)
    finally:
        trickle.stop.set()
        trickle.join(5)
    assert trickle.failures == [], trickle.failures
    assert trickle.ok > 10


def test_a_killed_worker_is_replaced_within_90_s(deployed: Deployed) -> None:
    doc = deployed.status()
    decode = next(r for r in doc["groups"]["decode"]["replicas"] if r["state"] == "active")
    node = deployed.lab.node_at(decode["host"])
    container = f"pd-{SERVICE}-decode-{decode['slot']}"
    inspect = f"podman inspect --format '{{{{.State.Pid}}}}' {container} 2>/dev/null || true"
    pid = deployed.root(node, inspect).strip()
    deployed.root(node, f"kill -9 {pid}")
    started = time.monotonic()

    # Right after the kill, status may still show the dead replica registered and ready (SMG
    # has not checked it yet), and a worker restarted in place can answer before SMG has seen
    # it die: only what is read once the container is another process (restarted in place) or
    # gone (replaced on another slot) counts, and serving means a chat through the router too.
    wait_for(lambda: deployed.root(node, inspect).strip() != pid, 90, 1, what="the restart")

    def serving(doc: dict[str, Any]) -> bool:
        if not both(doc, 1):
            return False
        active = [r for r in doc["groups"]["decode"]["replicas"] if r["state"] == "active"]
        return all(answers(deployed, r["host"], r["port"]) for r in active) and routed(deployed)

    deployed.wait("decode serving again", serving, max(0.0, 90 - (time.monotonic() - started)))
    assert time.monotonic() - started < 90
    load = Load(deployed, rps=2)
    load.start()
    time.sleep(3)
    load.stop.set()
    load.join(5)
    assert load.failures == [] and load.ok >= 4


def test_scaler_killed_mid_scale_in_leaves_units_and_registrations_agreeing(
    deployed: Deployed,
) -> None:
    pdctl(deployed.lab.home, "scale", SERVICE, "decode", "2", env=deployed.env)
    deployed.wait(
        "decode pinned at 2",
        lambda d: (
            d["groups"]["decode"]["running"] == 2
            and sum(r["registered"] for r in d["groups"]["decode"]["replicas"]) == 2
        ),
        90,
    )
    since = deployed.root("node1", "date +%s").strip()
    pdctl(deployed.lab.home, "scale", SERVICE, "decode", "1", env=deployed.env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        journal = deployed.root(
            "node1", f"journalctl -u pd-{SERVICE}-scaler --since @{since} --no-pager"
        )
        if "draining decode/" in journal:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the scale-in never started")
    deployed.root("node1", f"systemctl kill --signal=SIGKILL pd-{SERVICE}-scaler.service")
    pdctl(deployed.lab.home, "scale", SERVICE, "decode", "auto", env=deployed.env)
    deployed.wait(
        "the restarted scaler to settle",
        lambda d: (
            d["groups"]["decode"]["running"] == 1
            and all(
                r["registered"] == (r["state"] == "active")
                for r in d["groups"]["decode"]["replicas"]
            )
        ),
        120,
    )
    # systemd brought the killed scaler back (it may still be in its restart delay or start-up
    # on a busy machine: "activating")
    unit = f"pd-{SERVICE}-scaler.service"
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline:
        state = deployed.root("node1", f"systemctl is-active {unit} || true").strip()
        if state == "active":
            break
        time.sleep(0.5)
    assert state == "active"
    for role in ("prefill", "decode"):
        for replica in deployed.status()["groups"][role]["replicas"]:
            assert replica["registered"] == (replica["state"] == "active"), replica


def test_scaler_decisions_and_metrics_are_visible(deployed: Deployed) -> None:
    doc = deployed.status()
    for role in ("prefill", "decode"):
        assert doc["groups"][role]["desired"] is not None
        assert doc["groups"][role]["last_decision"]["reason"]

    def journal() -> str:
        return deployed.root("node1", f"journalctl -u pd-{SERVICE}-scaler --no-pager")

    wait_for(lambda: "decision decode: signal=rps value=" in journal(), 60, 1, what="a decision")
    journal_text = journal()
    assert "target=2.00 rps=" in journal_text
    assert "desired=" in journal_text and "reason=" in journal_text
    # a scaler systemd just restarted (the test before kills it) knows no rate until its
    # window holds two scrapes: the signal's value is absent until then, not zero
    signal = 'pdctl_scaler_signal_value{group="decode",signal="rps"}'
    deadline = time.monotonic() + 60
    while True:
        metrics = deployed.root(
            "node1",
            'python3 -c "import urllib.request as u; print(u.urlopen('
            f"'http://127.0.0.1:{layout.SCALER_METRICS_PORT}/metrics').read().decode())\"",
        )
        if signal in metrics or time.monotonic() > deadline:
            break
        time.sleep(2)
    for name in (
        "pdctl_scaler_desired_replicas",
        "pdctl_scaler_running_replicas",
        "pdctl_scaler_rps",
        "pdctl_scaler_decisions_total",
        "pdctl_scaler_action_seconds",
        'pdctl_scaler_signal_value{group="decode",signal="rps"}',
        'pdctl_scaler_signal_target{group="decode",signal="rps"} 2.0',
    ):
        assert name in metrics
