"""Services sharing a fleet, end to end on a 3-host lab (node1 without GPUs, node2 and node3
with 8 each; the lab example's replicas take 4).

Service a (one prefill and one decode replica, no spares: 8 of the 16 GPUs) deploys first.
Service b then lands on the GPUs a left, with no (host, GPU) and no (host, port) in common,
and both answer. Service c no longer fits and is refused naming who holds the GPUs: from
this workspace's plans, and from the hosts themselves in a workspace that never deployed a
or b. The tests run in file order on the session's shared lab.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.plan import Plan
from tests.support import Lab, assert_apart, chat, lab_service, pdctl

pytestmark = pytest.mark.lab

SPEC = Path(__file__).resolve().parents[2] / "examples" / "lab" / "pd.yml"
# Each service's router port and router metrics port: their routers share node1.
PORTS = {"a": (8000, 29000), "b": (8001, 29001), "c": (8002, 29002)}


@dataclass
class Fleet:
    lab: Lab
    env: dict[str, str]
    specs: Path  # the services' spec files

    def pdctl(self, *args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
        return pdctl(home or self.lab.home, *args, env=self.env, check=False)

    def json(self, *args: str, home: Path | None = None) -> Any:
        return json.loads(self.pdctl("--json", *args, home=home).stdout)

    def spec(self, name: str) -> str:
        return str(self.specs / f"{name}.yml")

    def deploy(self, name: str) -> dict[str, Any]:
        doc: dict[str, Any] = self.json("deploy", self.spec(name), "--fleet", "lab", "-y")
        assert "error" not in doc, doc
        return doc

    def plan(self, name: str, home: Path | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = self.json("plan", self.spec(name), "--fleet", "lab", home=home)
        return doc

    def answers(self, name: str) -> None:
        status = self.json("status", name)
        node = self.lab.node_at(status["groups"]["router"]["host"])
        env = self.lab.ssh(node, f"cat /etc/pdctl/{name}/router.env", user="root").stdout
        code, body = chat(status["endpoint"], f"hello {name}", env.strip().split("=", 1)[1])
        assert code == 200, body
        assert f"hello {name}" in body["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def fleet(shared_lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    specs = tmp_path_factory.mktemp("sharing")
    for name, (port, metrics) in PORTS.items():
        (specs / f"{name}.yml").write_text(lab_service(SPEC.read_text(), name, port, metrics))
    return Fleet(lab=shared_lab, env={"HF_TOKEN": f"hf_{uuid.uuid4().hex}"}, specs=specs)


def test_b_lands_on_what_a_left_free_and_both_answer(fleet: Fleet) -> None:
    fleet.deploy("a")
    preview = fleet.plan("b")
    # every host was read (the lab's hosts have no fabric check on record: pdctl says so)
    assert [w for w in preview["warnings"] if not w.startswith("fabric: ")] == []
    fleet.deploy("b")
    plans = {}
    for name in ("a", "b"):
        doc = fleet.plan(name)
        assert doc["changes"] == [], doc["changes"]  # a re-plan keeps the placement
        plans[name] = Plan.model_validate(doc["plan"])
    assert_apart(plans["a"], plans["b"])
    assert [len(plans[n].slots()) for n in ("a", "b")] == [2, 2]
    assert plans["a"].router.host == plans["b"].router.host  # both routers on node1
    assert (plans["a"].scaler_metrics_port, plans["b"].scaler_metrics_port) == (29100, 29101)
    for name in ("a", "b"):
        fleet.answers(name)
    _scalers_serve_their_own_metrics(fleet, plans)


def _scalers_serve_their_own_metrics(fleet: Fleet, plans: dict[str, Plan]) -> None:
    """Each scaler listens on the port its plan gave it (the role took it from the plan)."""
    script = (
        "import sys, urllib.request as u\n"
        "u.urlopen(f'http://127.0.0.1:{sys.argv[1]}/metrics', timeout=5).read()\n"
    )
    for name, plan in plans.items():
        node = fleet.lab.node_at(plan.router.host)
        port = plan.scaler_metrics_port
        deadline = time.monotonic() + 90  # the scaler starts its listener after its setup
        while True:
            probe = fleet.lab.ssh(node, f"python3 - {port}", user="root", stdin=script, check=False)
            if probe.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(2)
        unit = f"pd-{name}-scaler.service"
        why = fleet.lab.ssh(
            node,
            f"systemctl status --no-pager {unit}; journalctl -u {unit} --no-pager | tail -n 40",
            user="root",
            check=False,
        ).stdout
        assert probe.returncode == 0, f"{name}'s scaler on {port}: {probe.stderr[-300:]}\n{why}"
        config = fleet.lab.ssh(node, f"cat /etc/pdctl/{name}/scaler.json", user="root").stdout
        assert json.loads(config)["metrics"]["port"] == port


def test_c_no_longer_fits_and_is_refused_naming_the_holders(fleet: Fleet) -> None:
    proc = fleet.pdctl("--json", "deploy", fleet.spec("c"), "--fleet", "lab", "-y")
    error = json.loads(proc.stdout)["error"]
    assert proc.returncode == 5 and error["kind"] == "check_failed", error
    for holder in ("service a's prefill/1", "service a's decode/1", "service b's prefill/1"):
        assert holder in error["message"], error["message"]
    assert not (fleet.lab.home / ".pdctl" / "services" / "c").exists()


def test_another_workspace_sees_them_on_the_hosts(fleet: Fleet, tmp_path: Path) -> None:
    """No stored plan of a or b there: what they hold is read from the hosts' units."""
    other = tmp_path / "other"
    shutil.copytree(fleet.lab.home / "inventories", other / "inventories")
    proc = fleet.pdctl("--json", "plan", fleet.spec("c"), "--fleet", "lab", home=other)
    error = json.loads(proc.stdout)["error"]
    assert proc.returncode == 5, error
    assert (
        "service a's prefill/1" in error["message"] and "service b's decode/1" in error["message"]
    )
    # a itself, planned from there, ignores its own units and keeps its placement (its
    # configs differ: the other workspace has no key for a's secrets, see drift.secrets_digest)
    there, here = fleet.plan("a", home=other)["plan"], fleet.plan("a")["plan"]
    assert placement(there) == placement(here)


def placement(plan: dict[str, Any]) -> dict[str, Any]:
    """Where a plan puts things: its router and each slot (host, GPUs, ports)."""
    slots = [s for role in ("prefill", "decode") for s in plan["groups"][role]["slots"]]
    return {"router": plan["router"], "slots": slots, "scaler": plan["scaler_metrics_port"]}


def test_destroying_b_leaves_a_serving(fleet: Fleet) -> None:
    assert fleet.pdctl("destroy", "b", "-y").returncode == 0
    fleet.answers("a")
    # What the two shared stays for a: its scaler, its install and its access on the workers
    # (the scaler's user, a's line of its keys, a's sudo rule), b's alone gone.
    router = fleet.lab.ssh(
        "node1", "systemctl is-active pd-a-scaler; ls /opt/pdctl", user="root", check=False
    ).stdout.split()
    assert router[0] == "active" and "scaler" in router, router
    for node in ("node2", "node3"):
        keys = fleet.lab.ssh(
            node, "cat /var/lib/pdctl-scaler/.ssh/authorized_keys", user="root"
        ).stdout
        assert '--ssh a"' in keys and '--ssh b"' not in keys, (node, keys)
        rules = fleet.lab.ssh(node, "ls /etc/sudoers.d", user="root").stdout.split()
        assert "pdctl-scaler-a" in rules and "pdctl-scaler-b" not in rules, (node, rules)
    assert fleet.pdctl("destroy", "a", "-y").returncode == 0
    for node in ("node1", "node2", "node3"):
        left = fleet.lab.ssh(node, "ls /etc/systemd/system | grep -c '^pd-'", check=False)
        assert left.stdout.strip() == "0", (node, left.stdout)
