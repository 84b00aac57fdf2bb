"""dstack's own AMD P/D file, as published, deploys on the lab: no `pdctl:` key, `privileged:
true`, the router and every worker on port 30000, the model the file names.

The file is tests/data/dstack/lab/amd-pd.dstack.yml: dstack's amd-pd.dstack.yml (SOURCES) with
only its GPU count, cpu/memory minimums and image made lab-sized (a unit test checks that),
deployed on `pdctl lab up --hosts 3 --cpu-hosts 1` with `fleet add` as `lab status` prints it
and no other step: the lab's hub makes Qwen/Qwen2.5-72B-Instruct on its first request (as
the real hub serves it), the fleet carries the lab's wheelhouse (`pip install smg` on hosts
without internet), the router keeps its 30000 on the CPU host and each worker gets 30000 on
its own host, pdctl's defaults ask for `--ulimit memlock=-1:-1` (RDMA) and the workers run
privileged. The lab grants what this machine can (its runtime clamps rlimits, reported as
emulated). The tests run in file order and share one deployment, on the session's shared lab.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdctl.lab.runtime import crun_clamp
from tests.support import Lab, chat, pdctl, pdctl_json

SERVICE = "amd-sglang-pd-service"  # the file's own name
CONF = f"/etc/pdctl/{SERVICE}"
HOST_LIB = "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"
CONTAINER_LIB = "/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so"
NODES = ("node1", "node2", "node3")
# This machine's own verdict: the lab clamps only where rlimits cannot be raised.
CLAMPED = not crun_clamp.can_raise(Path("/proc/self/status").read_text())
DSTACK_FILE = Path(__file__).resolve().parents[1] / "data" / "dstack" / "lab" / "amd-pd.dstack.yml"
MODEL = "Qwen/Qwen2.5-72B-Instruct"  # the file's: SMG routes a request by its model


@dataclass
class Deployment:
    lab: Lab
    spec: Path
    token: str
    fleet: dict[str, Any]  # `pdctl --json fleet add`'s document
    outputs: list[str] = field(default_factory=list)

    def pdctl(self, *args: str, check: bool = True) -> str:
        proc = pdctl(self.lab.home, *args, env={"HF_TOKEN": self.token}, check=check)
        self.outputs.append(proc.stdout + proc.stderr)
        return proc.stdout

    def deploy(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(
            self.pdctl("--json", "deploy", str(self.spec), "--fleet", "lab", "-y")
        )
        return doc

    def root(self, node: str, command: str, stdin: str | None = None) -> str:
        return self.lab.ssh(node, command, user="root", stdin=stdin).stdout

    def router_node(self) -> str:
        status = json.loads(self.pdctl("--json", "status", SERVICE))
        address = status["groups"]["router"]["host"]
        return next(h["name"] for h in self.lab.status()["hosts"] if h["address"] == address)

    def chat(self, text: str) -> dict[str, Any]:
        """Through the router, with its API key (in a root-only file on the router host), once
        SMG has health-checked the new workers (pdctl's default check interval, 10 s)."""
        key = self.root(self.router_node(), f"cat {CONF}/router.env").strip().split("=", 1)[1]
        endpoint = json.loads(self.pdctl("--json", "status", SERVICE))["endpoint"]
        deadline = time.monotonic() + 60
        while True:
            status, body = chat(endpoint, text, key, timeout=15, model=MODEL)
            if status != 503 or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert status == 200, body
        return body


@pytest.fixture(scope="module")
def deployment(shared_lab: Lab) -> Deployment:
    """The shared lab, added as fleet `lab` with the line `lab status` prints."""
    token = f"hf_{uuid.uuid4().hex}"
    fleet = shared_lab.fleet_added
    return Deployment(lab=shared_lab, spec=DSTACK_FILE, token=token, fleet=fleet)


def test_the_file_is_a_dstack_file_with_no_pdctl_settings(deployment: Deployment) -> None:
    doc = yaml.safe_load(deployment.spec.read_text())
    assert "pdctl" not in doc and doc["privileged"] is True and doc["port"] == 30000
    router = doc["replicas"][0]["commands"]
    assert router[0] == "pip install smg" and router[1].startswith("smg launch ")
    assert deployment.lab.status()["worker_image"] == doc["image"]  # the one lab-sized change
    settings = pdctl_json(deployment.lab.home, "fleet", "show", "lab")["settings"]
    assert settings["wheelhouse"] == deployment.lab.status()["wheelhouse"]  # the lab's settings


def test_preflight_says_what_the_lab_emulates(deployment: Deployment) -> None:
    for host in deployment.fleet["hosts"]:
        memlock = next(c for c in host["checks"] if c["name"] == "memlock")
        assert host["ok"] and memlock["ok"], host
        if host["kind"] == "cpu":
            assert memlock["skipped"]  # no worker runs there
        else:
            assert memlock["emulated"] is CLAMPED
            assert ("memlock unlimited emulated" in memlock["message"]) is CLAMPED


def test_deploy_serves_a_chat_request_through_the_router(deployment: Deployment) -> None:
    plan = json.loads(deployment.pdctl("--json", "plan", str(deployment.spec), "--fleet", "lab"))[
        "plan"
    ]
    slots = [s for group in plan["groups"].values() for s in group["slots"]]
    assert plan["router"]["port"] == 30000 and plan["notes"] == []
    first = {s["host"]: s["port"] for s in slots if s["index"] == 1}
    assert set(first.values()) == {30000}  # each host's first worker: 30000, as in the file
    doc = deployment.deploy()
    assert doc["changed_hosts"] and doc["endpoint"].endswith(":30000")
    assert doc["model"]["repo"] == MODEL  # the hub made it on the first request
    hub = deployment.lab.status()["hub"]
    weights = hub["models"][MODEL]["bytes"] - (1 << 20)  # less config.json, tokenizer.json
    assert hub["model_size"] == 64 << 20 and 63 << 20 < weights < 64 << 20
    answer = deployment.chat("hello from dstack")["choices"][0]["message"]["content"]
    assert answer.startswith("[decode ") and "hello from dstack" in answer


def test_workers_ask_for_production_limits_and_the_lab_says_what_it_granted(
    deployment: Deployment,
) -> None:
    unit = deployment.root("node2", f"cat /etc/systemd/system/pd-{SERVICE}-prefill@.service")
    assert "--ulimit memlock=-1:-1" in unit and "--privileged" in unit
    inspect = deployment.root(
        "node2", f"podman inspect --format '{{{{.HostConfig.Privileged}}}}' pd-{SERVICE}-prefill-1"
    )
    assert inspect.strip() == "true"
    status = deployment.lab.status()
    node2 = next(h for h in status["hosts"] if h["name"] == "node2")
    if not CLAMPED:
        assert status["emulated"] == [] and node2["emulated"] == []
        return
    memlock = [line for line in node2["emulated"] if line.startswith("memlock ")]
    assert len(memlock) == 1 and memlock[0].startswith("memlock unlimited requested, ")
    assert memlock[0].endswith(" granted (this machine cannot raise rlimits)")
    granted = memlock[0].split(", ")[1].split()[0]
    limits = deployment.root("node2", f"podman exec pd-{SERVICE}-prefill-1 cat /proc/1/limits")
    assert f"Max locked memory         {granted:<21}{granted:<21}bytes" in limits
    assert set(node2["emulated"]) <= set(status["emulated"])


def test_a_second_deploy_is_a_no_op(deployment: Deployment) -> None:
    doc = deployment.deploy()
    assert doc["converged"] is False and doc["changes"] == [] and doc["changed_hosts"] == []


def test_the_provider_library_is_mounted_into_the_workers(deployment: Deployment) -> None:
    for role in ("prefill", "decode"):
        node = "node2" if role == "prefill" else "node3"
        mounts = json.loads(
            deployment.root(
                node, f"podman inspect --format '{{{{json .Mounts}}}}' pd-{SERVICE}-{role}-1"
            )
        )
        lib = next(m for m in mounts if m["Destination"] == CONTAINER_LIB)
        assert lib["Source"] == HOST_LIB  # the file's own volume, as written (no `:ro`)


def only_root_reads(chain: list[str]) -> bool:
    """``chain``: "mode:owner" of a file, then of each directory above it."""
    modes = [(int(mode, 8), owner) for mode, owner in (entry.split(":") for entry in chain)]
    (mode, owner), directories = modes[0], modes[1:]
    if owner == "root" and mode & 0o044 == 0:
        return True
    return any(owner == "root" and mode & 0o011 == 0 for mode, owner in directories)


def test_the_secret_is_only_in_root_only_files(deployment: Deployment) -> None:
    token = deployment.token
    # Every file holding the token, with the mode and owner of it and of each directory above.
    find = (
        "grep -rlsF -f - /etc /opt /root /home /var/lib/containers /var/log /run /tmp"
        " | while read -r f; do d=$f; line=$f;"
        ' while [ "$d" != / ]; do line="$line $(stat -c %a:%U "$d")"; d=$(dirname "$d");'
        ' done; echo "$line"; done'
    )
    for node in NODES:
        # The token goes in on stdin, never on a command line (`ps` would show it).
        found = [
            line.split() for line in deployment.root(node, find, stdin=token + "\n").splitlines()
        ]
        for path, *chain in found:
            assert only_root_reads(chain), f"{node}: {path} {chain}"
        if node != "node1":  # the env file the workers read; podman keeps its own copies
            assert [f"{CONF}/secrets.env", "600:root"] in [entry[:2] for entry in found]
        for command in ("ps -eo args", "journalctl --no-pager -o cat"):
            assert token not in deployment.root(node, command), f"{node}: {command}"
    assert not any(token in text for text in deployment.outputs)


def test_destroy_leaves_no_pd_unit(deployment: Deployment) -> None:
    deployment.pdctl("destroy", SERVICE, "-y")
    for node in NODES:
        left = deployment.root(
            node,
            "systemctl list-units --all --no-legend 'pd-*' | wc -l;"
            " ls /etc/systemd/system | grep -c '^pd-' || true",
        ).split()
        assert left == ["0", "0"], f"{node}: {left}"
