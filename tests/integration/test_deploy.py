"""`pdctl deploy` end to end on a 3-host lab (1 CPU host, 2 GPU hosts, `:4` replicas).

The tests run in file order and share one deployment, on the session's shared lab. Everything
is the real program (sshd, Ansible, systemd, podman, SMG) but the GPUs and SGLang itself.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    Lab,
    chat,
    pdctl,
    pdctl_json,
    private_tmp,
    renamed,
    template_text,
    with_template_text,
)

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "lab" / "pd.yml"
SERVICE = "lab-deploy"


@dataclass
class Service:
    lab: Lab
    token: str
    env: dict[str, str]
    spec: Path  # the lab example with template text in its env and a command
    canary: Path  # created only if the controller rendered that text as a template
    outputs: list[str] = field(default_factory=list)
    endpoint: str | None = None

    def pdctl(self, *args: str, check: bool = True) -> Any:
        proc = pdctl(self.lab.home, *args, env=self.env, check=check)
        self.outputs.append(proc.stdout + proc.stderr)
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.pdctl("--json", *args).stdout)

    def status(self) -> dict[str, Any]:
        proc = self.pdctl("--json", "status", SERVICE, check=False)
        assert proc.returncode in (0, 8), proc.stderr  # 8: the service is down (it says why)
        doc: dict[str, Any] = json.loads(proc.stdout)
        return doc

    def router_node(self) -> str:
        return self.lab.node_at(self.status()["groups"]["router"]["host"])

    def api_key(self) -> str:
        """The router's API key as a client gets it: `pdctl endpoint --show-key`."""
        return str(self.json("endpoint", SERVICE, "--show-key")["api_key"])

    def workspace_files(self) -> Iterator[Path]:
        """The workspace's files (not the lab hosts' own disks), to search for secrets."""
        hosts_disks = self.lab.home / ".pdctl" / "lab" / "hosts"
        for path in self.lab.home.rglob("*"):
            if path.is_file() and hosts_disks not in path.parents and path.stat().st_size < 5e6:
                yield path

    def container_env(self, role: str) -> str:
        """The environment inside ROLE's running replicas' containers."""
        found = ""
        for replica in self.status()["groups"][role]["replicas"]:
            if replica["state"] == "active":
                container = f"pd-{SERVICE}-{role}-{replica['slot']}"
                node = self.lab.node_at(replica["host"])
                found += self.lab.ssh(node, f"podman exec {container} env", user="root").stdout
        return found

    def router_log(self, what: str = "router") -> str:
        """The router's (or the scaler's) journal of the last minutes, for a failure's message."""
        node = self.router_node()
        unit = f"pd-{SERVICE}-{what}.service"
        command = f"journalctl -u {unit} --since -4min --no-pager -o short-precise | tail -n 80"
        return str(self.lab.ssh(node, command, user="root").stdout)

    def chat(self, text: str, key: str | None, timeout: float = 10) -> tuple[int, dict[str, Any]]:
        return chat(self.endpoint or self.status()["endpoint"], text, key, timeout)


@pytest.fixture(scope="module")
def svc(shared_lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Service:
    token = f"hf_{uuid.uuid4().hex}"
    here = tmp_path_factory.mktemp("deploy")
    canary = here / "controller-ran-a-lookup"
    spec = here / "pd.yml"
    spec.write_text(with_template_text(renamed(SPEC.read_text(), SERVICE), canary))
    return Service(lab=shared_lab, token=token, env={"HF_TOKEN": token}, spec=spec, canary=canary)


def test_dry_run_changes_nothing(svc: Service) -> None:
    doc = svc.json("deploy", str(svc.spec), "--fleet", "lab", "--dry-run")
    assert doc["dry_run"] is True and doc["changes"][0].startswith(f"+ new service {SERVICE}")
    units = svc.lab.ssh("node2", "ls /etc/systemd/system | grep '^pd-' || true").stdout
    assert units.strip() == ""  # a dry run changes no host
    assert not (svc.lab.home / ".pdctl" / "services" / SERVICE).exists()  # nor the workspace


def test_deploy_serves_a_chat_request_through_the_router(svc: Service) -> None:
    doc = svc.json("deploy", str(svc.spec), "--fleet", "lab", "-y")
    assert doc["changed_hosts"] and doc["endpoint"].endswith(":8000")
    status, body = svc.chat("hello there", svc.api_key())
    assert status == 200
    answer = body["choices"][0]["message"]["content"]
    assert answer.startswith("[decode ") and "hello there" in answer  # the decode worker answered
    assert svc.chat("no key", None)[0] == 401


def test_endpoint_gives_the_key_only_when_asked(svc: Service) -> None:
    key = svc.api_key()  # pdctl --json endpoint pdlab --show-key
    status, body = svc.chat("through the endpoint's key", key)
    assert (
        status == 200 and "through the endpoint's key" in body["choices"][0]["message"]["content"]
    )
    endpoint = svc.status()["endpoint"]
    assert svc.json("endpoint", SERVICE) == {
        "service": SERVICE,
        "endpoint": endpoint,
        "endpoints": [endpoint],  # one router: its URL is the endpoint
    }
    hint = f"pdctl endpoint {SERVICE} --show-key"
    plain = svc.pdctl("endpoint", SERVICE)
    assert endpoint in plain.stdout and hint in plain.stdout and key not in plain.stdout
    shown = svc.pdctl("-v", "endpoint", SERVICE, "--show-key")
    assert key in shown.stdout and key not in shown.stderr
    assert hint in svc.pdctl("status", SERVICE).stdout and key not in svc.outputs[-1]
    for path in svc.workspace_files():  # read from the router host each time, kept nowhere
        assert key.encode() not in path.read_bytes(), f"the router's API key in {path}"


def test_template_text_reaches_the_hosts_as_written(svc: Service) -> None:
    """The dry run and the deploy rendered none of the spec's text on the controller; the
    hosts hold it exactly as written."""
    assert not svc.canary.exists()
    values = template_text(svc.canary)
    node = svc.lab.node_at(svc.status()["groups"]["prefill"]["replicas"][0]["host"])
    conf = f"/etc/pdctl/{SERVICE}"
    service_env = svc.lab.ssh(node, f"cat {conf}/service.env", user="root").stdout.splitlines()
    assert values["env_jinja"] in service_env and values["env_shell"] in service_env
    script = svc.lab.ssh(node, f"cat {conf}/prefill.sh", user="root").stdout.splitlines()
    assert values["command"] in script


def test_status_reads_everything_live(svc: Service) -> None:
    doc = svc.status()
    assert set(doc) >= {"service", "endpoint", "api_key_file", "groups"}
    assert doc["groups"]["router"]["state"] == "ready"
    for role in ("prefill", "decode"):
        group = doc["groups"][role]
        assert (group["min"], group["max"], group["running"]) == (1, 2, 1)
        running = [r for r in group["replicas"] if r["state"] == "active"]
        assert len(running) == 1 and running[0]["registered"] is True
        assert set(running[0]) >= {"host", "slot", "port", "state", "registered"}
    human = svc.pdctl("status", SERVICE).stdout
    assert "prefill/1" in human and "decode/2" in human


def test_redeploy_is_a_no_op(svc: Service) -> None:
    started = time.monotonic()
    doc = svc.json("deploy", str(svc.spec), "--fleet", "lab", "-y")
    assert doc["changes"] == [] and doc["changed_hosts"] == [] and doc["rolled"] == [], doc
    assert doc["converged"] is False and doc["drift"] == []  # the quick check decided
    human = svc.pdctl("deploy", str(svc.spec), "--fleet", "lab", "-y").stdout
    assert "no changes" in human and f"pdctl endpoint {SERVICE} --show-key" in human
    assert time.monotonic() - started < 300
    forced = svc.json("deploy", str(svc.spec), "--fleet", "lab", "-y", "--converge")
    assert forced["converged"] is True
    # A change here once came and went (issue 29): say what the scaler was doing meanwhile.
    assert forced["changed_hosts"] == [], (
        forced,
        svc.status()["groups"],
        svc.router_log("scaler"),
    )


def test_redeploy_repairs_what_drifted_on_a_host(svc: Service) -> None:
    env = f"/etc/pdctl/{SERVICE}/service.env"
    unit = f"pd-{SERVICE}-decode@1.service"
    decode_host = next(r for r in svc.status()["groups"]["decode"]["replicas"] if r["slot"] == 1)
    node = svc.lab.node_at(decode_host["host"])
    svc.lab.ssh(node, f"echo EDITED=by-hand >> {env}; systemctl disable {unit}", user="root")
    doc = svc.json("deploy", str(svc.spec), "--fleet", "lab", "-y")
    assert doc["converged"] is True
    assert f"{decode_host['host']}: {env} changed since the last deploy" in doc["drift"]
    assert f"{decode_host['host']}: {unit} is disabled, not enabled" in doc["drift"]
    assert decode_host["host"] in doc["changed_hosts"]
    repaired = svc.lab.ssh(
        node, f"grep -c EDITED {env}; systemctl is-enabled {unit}", user="root", check=False
    ).stdout.split()
    assert repaired == ["0", "enabled"]
    again = svc.json("deploy", str(svc.spec), "--fleet", "lab", "-y")
    assert again["converged"] is False, again["drift"]


def test_the_secret_is_only_where_it_belongs(svc: Service) -> None:
    token = svc.token
    for node in ("node1", "node2", "node3"):
        # ps and the journal are read back and searched here; files are searched there with
        # the token on stdin: a token on a remote command line would find itself in `ps`.
        args = svc.lab.ssh(node, "ps -eo args", user="root").stdout
        journal = svc.lab.ssh(node, "journalctl --no-pager -o cat", user="root").stdout
        assert token not in args and token not in journal, (
            f"{node}: HF_TOKEN value in ps or journal"
        )
        secrets = svc.lab.ssh(
            node, f"cat /etc/pdctl/{SERVICE}/secrets.env 2>/dev/null || true", user="root"
        ).stdout
        # the token goes in on stdin (grep -f -), never on a command line
        found = svc.lab.ssh(
            node,
            "grep -rlF -f - /etc/systemd/system /etc/pdctl /opt/pdctl /var/log 2>/dev/null || true",
            user="root",
            stdin=token + "\n",
        ).stdout.split()
        assert [f for f in found if not f.endswith("/secrets.env")] == [], (
            f"{node}: HF_TOKEN in {found}"
        )
        if node != "node1":
            assert token in secrets
    mode = svc.lab.ssh("node2", f"stat -c %a /etc/pdctl/{SERVICE}/secrets.env", user="root").stdout
    assert mode.strip() == "600"
    inside = svc.lab.ssh("node2", f"podman exec pd-{SERVICE}-prefill-1 env", user="root").stdout
    assert f"HF_TOKEN={token}" in inside  # it does reach the worker, through --env-file
    for text in svc.outputs:
        assert token not in text
    for path in svc.workspace_files():
        assert token.encode() not in path.read_bytes(), f"HF_TOKEN value in {path}"
    # The runner's private dirs (pdctl-runs-<uid>/<pid>-*) are removed after each run.
    assert not list(private_tmp(svc.lab.home).glob("pdctl-runs-*/*"))


def test_logs_show_the_replica_journal(svc: Service) -> None:
    recent = svc.pdctl("logs", SERVICE, "decode/1", "-n", "5").stdout.splitlines()
    assert 1 <= len(recent) <= 5 and all(f"pd-{SERVICE}-decode-1" in line for line in recent)
    history = svc.pdctl("logs", SERVICE, "decode/1", "-n", "100000").stdout
    assert "fired up and ready to roll" in history and "Uvicorn running on" in history
    bad = svc.pdctl("logs", SERVICE, "decode/9", check=False)
    assert bad.returncode == 3 and "no replica 'decode/9'" in bad.stderr


class Client(threading.Thread):
    """A steady client: one chat request every 0.1 s (a gap in service of a moment shows)."""

    def __init__(self, svc: Service, key: str) -> None:
        super().__init__(daemon=True)
        self.svc, self.key = svc, key
        svc.endpoint = svc.status()["endpoint"]
        self.done = threading.Event()
        self.ok = 0
        self.failed: list[int] = []
        self.why: list[str] = []  # each failure's time and answer, for the assertion message

    def run(self) -> None:
        while not self.done.is_set():
            body: object = {}
            try:
                status, body = self.svc.chat("rolling", self.key, timeout=15)
            except OSError as exc:
                status, body = 0, str(exc)
            if status == 200:
                self.ok += 1
            else:
                self.failed.append(status)
                self.why.append(f"{time.strftime('%H:%M:%S')} {status} {body}")
            time.sleep(0.1)


def serving(groups: dict[str, Any]) -> tuple[int, int]:
    """Replicas of prefill and of decode running and registered with the router."""

    def count(role: str) -> int:
        replicas = groups[role]["replicas"]
        return sum(1 for r in replicas if r["state"] == "active" and r["registered"])

    return count("prefill"), count("decode")


def pin(svc: Service, prefill: int, decode: int) -> None:
    """Pin both groups' counts and wait until exactly that many replicas serve (a replica
    takes seconds to start and register: one status a poll, every 2 s)."""
    svc.pdctl("scale", SERVICE, "prefill", str(prefill))
    svc.pdctl("scale", SERVICE, "decode", str(decode))
    deadline = time.monotonic() + 120
    while serving(groups := svc.status()["groups"]) != (prefill, decode):
        assert time.monotonic() < deadline, groups
        time.sleep(2)


def release(svc: Service) -> None:
    """Hand both groups back to the scaler."""
    for role in ("prefill", "decode"):
        svc.pdctl("scale", SERVICE, role, "auto")


def test_a_new_image_and_a_rotated_secret_roll_with_zero_failed_requests(
    svc: Service, tmp_path: Path
) -> None:
    """Both ways a replica rolls, under load, in one deploy that changes the image and rotates
    HF_TOKEN: prefill pinned at its maximum (2) has no spare slot, so its replicas restart in
    place one after the other, the other one serving; decode pinned at 1 rolls onto its spare
    slot, then the old replica drains. The new token reaches the hosts and every container,
    the old one is gone, and the client sees no failed request."""
    rotated = f"hf_{uuid.uuid4().hex}"
    secrets = f"/etc/pdctl/{SERVICE}/secrets.env"

    def on_host(token: str) -> str:  # the token goes on stdin: never into a process's argv
        found = svc.lab.ssh(
            "node2", f"grep -c -F -f - {secrets}", user="root", check=False, stdin=token + "\n"
        )
        return found.stdout.strip()

    pin(svc, prefill=2, decode=1)
    changed = tmp_path / "pd.yml"
    image = ("sglang-rocm:0.5.4-lab", "sglang-rocm:0.5.5-lab")
    changed.write_text(svc.spec.read_text().replace(*image))
    plan = svc.json("plan", str(changed), "--fleet", "lab")
    assert any("rolling update" in line for line in plan["changes"])
    client = Client(svc, svc.api_key())
    client.start()
    try:
        time.sleep(2)
        proc = pdctl(
            svc.lab.home,
            "--json",
            "deploy",
            str(changed),
            "--fleet",
            "lab",
            "-y",
            env={"HF_TOKEN": rotated},
        )
        time.sleep(2)
    finally:
        client.done.set()
        client.join(30)
    doc = json.loads(proc.stdout)
    assert doc["converged"] is True and rotated not in proc.stdout + proc.stderr
    for role in ("prefill", "decode"):
        assert f"~ {role}: image, secret values changed: rolling update" in doc["changes"], doc
    assert set(doc["rolled"]) == {"prefill/1", "prefill/2", "decode/1"}
    assert client.failed == [] and client.ok > 20, (client.why, svc.router_log())
    groups = svc.status()["groups"]
    active = {
        role: sorted(r["slot"] for r in groups[role]["replicas"] if r["state"] == "active")
        for role in ("prefill", "decode")
    }
    assert active == {"prefill": [1, 2], "decode": [2]}  # in place; onto the spare
    assert not any(r["stale"] for role in active for r in groups[role]["replicas"])
    images = "".join(
        svc.lab.ssh(
            node, f"podman ps --format '{{{{.Image}}}}' --filter name=pd-{SERVICE}-", user="root"
        ).stdout
        for node in ("node2", "node3")
    )
    assert "0.5.5-lab" in images and "0.5.4-lab" not in images
    assert (on_host(rotated), on_host(svc.token)) == ("1", "0")
    for role in ("prefill", "decode"):
        inside = svc.container_env(role)
        assert f"HF_TOKEN={rotated}\n" in inside and svc.token not in inside, role
    release(svc)


def test_destroy_dry_run_names_what_would_go_and_changes_nothing(svc: Service) -> None:
    doc = svc.json("destroy", SERVICE, "--dry-run")
    assert doc["dry_run"] is True
    assert {name.split("/")[0] for name in doc["deregistered"]} == {"prefill", "decode"}
    would = doc["would_remove"]
    assert sorted(would) == doc["hosts"] and all(would.values()), would
    everything = [item for items in would.values() for item in items]
    assert f"unit pd-{SERVICE}-router.service" in everything
    assert any(i.startswith("container ") and f"pd-{SERVICE}-decode" in i for i in everything)
    # Nothing went: the router still has its workers and answers, the workspace keeps it.
    assert svc.chat("still here", svc.api_key())[0] == 200
    assert (svc.lab.home / ".pdctl" / "services" / SERVICE).exists()


def test_destroy_leaves_hosts_clean(svc: Service) -> None:
    svc.pdctl("destroy", SERVICE, "-y")
    for node in ("node1", "node2", "node3"):
        left = svc.lab.ssh(
            node,
            (
                "systemctl list-units --all --no-legend 'pd-*' | wc -l;"
                " ls /etc/systemd/system | grep -c '^pd-';"
                " test -e /etc/pdctl && echo etc-pdctl;"
                " podman ps -a --format '{{.Names}}' 2>/dev/null | grep -c '^pd-'"
            ),
            user="root",
            check=False,
        ).stdout.split()
        assert left[:2] == ["0", "0"] and "etc-pdctl" not in left and left[-1] == "0", (
            f"{node}: {left}"
        )
    assert not (svc.lab.home / ".pdctl" / "services" / SERVICE).exists()
    again = svc.pdctl("destroy", SERVICE, "-y", check=False)
    assert again.returncode == 7  # nothing left to destroy: a clear "not found"
    assert pdctl_json(svc.lab.home, "fleet", "show", "lab")["services"] == {}
