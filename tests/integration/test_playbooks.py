"""deploy.yml and destroy.yml, run by the real ansible-playbook on the session's shared lab.

node1 (CPU) runs the router, node2 and node3 (GPU) the workers; SSH, sudo, systemd, podman
and SMG are the real programs, only the GPUs and SGLang are stand-ins. The tests run in
file order and share one deployment: each step builds on the state the previous one left.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdctl.core import layout, plan, spec
from pdctl.core.ansible_data import unsafe_yaml
from pdctl.doors import inventory
from pdctl.doors.workspace import Workspace
from pdctl.operations.planning import write_plan_file
from tests import role_templates
from tests.support import (
    Lab,
    pdctl,
    renamed,
    template_text,
    with_template_text,
)

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SPEC = ROOT / "examples" / "lab" / "pd.yml"
SERVICE = "lab-playbooks"
CONF = f"/etc/pdctl/{SERVICE}"
CONTAINER_LIB = "/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so"
NEW_IMAGE = "localhost/pdctl-lab/sglang-rocm:0.5.5-lab"
RECAP = re.compile(
    r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M
)


@dataclass
class Run:
    rc: int
    output: str

    def recap(self) -> dict[str, dict[str, int]]:
        """PLAY RECAP per host (localhost, the plan check, left out)."""
        return {
            host: {"ok": int(ok), "changed": int(ch), "unreachable": int(un), "failed": int(fa)}
            for host, ok, ch, un, fa in RECAP.findall(self.output)
            if host != "localhost"
        }


@dataclass
class Deployment:
    lab: Lab
    token: str  # the HF_TOKEN value: unique, so that finding it anywhere means it leaked
    plan: dict[str, Any]
    plan_file: Path
    canary: Path  # created only if the controller rendered the spec's text as a template
    router: str  # node name
    router_address: str
    workers: list[str]  # node names
    nodes: dict[str, str]  # inventory host (address) -> node name
    hosts: dict[str, dict[str, Any]]  # node name -> `pdctl lab status` entry
    runs: list[Run] = field(default_factory=list)

    def slots(self, group: str | None = None, start: bool | None = None) -> list[dict[str, Any]]:
        return [
            slot
            for slots in self.plan["pd_host_slots"].values()
            for slot in slots
            if (group is None or slot["group"] == group)
            and (start is None or slot["start"] == start)
        ]

    def playbook(
        self, name: str, *args: str, plan_file: Path | None = None, **env: str | None
    ) -> Run:
        """Run a playbook as a user would (HF_TOKEN exported); env=None unsets a variable."""
        environ = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")},
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "HF_TOKEN": self.token,
        }
        for key, value in env.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        proc = subprocess.run(
            [
                str(BIN / "ansible-playbook"),
                "-i",
                str(self.lab.home / "inventories" / "lab"),
                str(ROOT / "playbooks" / name),
                "-e",
                f"@{plan_file or self.plan_file}",
                *args,
            ],
            capture_output=True,
            text=True,
            env=environ,
            timeout=600,
            check=False,
        )
        run = Run(proc.returncode, proc.stdout + proc.stderr)
        self.runs.append(run)
        return run

    def root(self, node: str, command: str, check: bool = True) -> str:
        """Run a command as root on a node (Lab.ssh, minus its `pdctl lab status` per call)."""
        host = self.hosts[node]
        proc = subprocess.run(
            [
                "ssh",
                "-i",
                host["identity_file"],
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "LogLevel=ERROR",
                "-o",
                "BatchMode=yes",
                f"root@{host['address']}",
                command,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check:
            assert proc.returncode == 0, f"{node}: {command}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    def api_key(self) -> str:
        line = self.root(self.router, f"cat {CONF}/router.env").strip()
        assert line.startswith("PDCTL_ROUTER_API_KEY=")
        return line.split("=", 1)[1]

    def http(
        self, method: str, path: str, body: object = None, key: str | None = None
    ) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"http://{self.router_address}:8000{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {key}"} if key else {}),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def workers_listed(self) -> list[dict[str, Any]]:
        status, doc = self.http("GET", "/workers", key=self.api_key())
        assert status == 200, doc
        return list(doc["workers"])

    def container(self, node: str, name: str) -> dict[str, Any]:
        inspected = json.loads(self.root(node, f"podman container inspect {name}"))
        return dict(inspected[0])


def _ok(run: Run) -> None:
    assert run.rc == 0, run.output[-6000:]
    recap = run.recap()
    assert recap, run.output[-3000:]
    assert all(h["failed"] == 0 and h["unreachable"] == 0 for h in recap.values()), recap


def _wait_healthy(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=3) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered 200"
        time.sleep(0.5)


def _scaler_run(deployment: Deployment) -> str:
    """The scaler unit's current run (systemd's InvocationID: a new one at each start)."""
    unit = f"pd-{SERVICE}-scaler.service"
    run = deployment.root(deployment.router, f"systemctl show -p InvocationID --value {unit}")
    assert run.strip(), unit
    return run.strip()


def _changed(run: Run) -> dict[str, int]:
    return {host: counts["changed"] for host, counts in run.recap().items()}


@pytest.fixture(scope="module")
def deployment(shared_lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    lab, here = shared_lab, tmp_path_factory.mktemp("playbooks")
    token = f"hf_{uuid.uuid4().hex}"
    # Template text in the spec (an env value, a command) must reach the hosts as written.
    canary = here / "controller-ran-a-lookup"
    spec_file = here / "pd.yml"
    spec_file.write_text(with_template_text(renamed(SPEC.read_text(), SERVICE), canary))
    the_spec, env = spec.load(spec_file, {"HF_TOKEN": token})
    fleet = inventory.load(Workspace(lab.home), "lab")
    planned = plan.build(the_spec, env, fleet, secrets_digest="")
    extravars = planned.extravars()
    plan_file = here / "plan.yml"
    write_plan_file(planned, plan_file)  # what `pdctl plan -o` writes for a pipeline
    # A pipeline's first step: the model into the hosts' cache (`pdctl deploy` does it).
    pdctl(lab.home, "prefetch", str(spec_file), "--fleet", "lab", env={"HF_TOKEN": token})
    hosts = {h["name"]: h for h in lab.status()["hosts"]}
    nodes = {h["address"]: name for name, h in hosts.items()}
    return Deployment(
        nodes=nodes,
        hosts=hosts,
        lab=lab,
        token=token,
        plan=extravars,
        plan_file=plan_file,
        canary=canary,
        router=nodes[extravars["pd_router_hosts"][0]],
        router_address=extravars["pd_router"]["replicas"][0]["address"],
        workers=[nodes[h] for h in extravars["pd_worker_hosts"]],
    )


# --------------------------------------------------------------------------- deploy


def test_unset_secret_fails_before_any_change(deployment: Deployment) -> None:
    run = deployment.playbook("deploy.yml", HF_TOKEN=None)
    assert run.rc != 0
    assert "HF_TOKEN not set in the environment" in run.output, run.output[-3000:]
    for node in (deployment.router, *deployment.workers):
        assert deployment.root(node, "ls /etc/pdctl /opt/pdctl 2>&1; true").count("No such") == 2
        assert "pd-" not in deployment.root(node, "ls /etc/systemd/system")


def test_a_host_failing_a_preflight_check_stops_the_deploy_before_any_change(
    deployment: Deployment,
) -> None:
    """deploy.yml's gate: the probe fails on its report, saying each failed check by host."""
    run = deployment.playbook("deploy.yml", "-e", "pd_preflight_expected_gpus=9")
    assert run.rc != 0
    for worker in deployment.plan["pd_worker_hosts"]:
        assert re.search(rf"{re.escape(worker)}: \S+ lists 8 GPUs, expected 9", run.output), (
            run.output[-3000:]
        )
    assert "Run the prefill and decode workers" not in run.output
    for node in (deployment.router, *deployment.workers):
        assert deployment.root(node, "ls /etc/pdctl /opt/pdctl 2>&1; true").count("No such") == 2


def test_first_deploy_changes_every_host_and_second_changes_nothing(
    deployment: Deployment,
) -> None:
    first = deployment.playbook("deploy.yml")
    _ok(first)
    changed = _changed(first)
    assert set(changed) == set(deployment.plan["pd_plan_hosts"])
    assert all(count > 0 for count in changed.values()), changed
    key = deployment.api_key()
    scaler = _scaler_run(deployment)

    second = deployment.playbook("deploy.yml")
    _ok(second)
    assert _changed(second) == dict.fromkeys(changed, 0), second.output[-4000:]
    assert deployment.api_key() == key  # generated once, never again
    assert _scaler_run(deployment) == scaler  # nothing of it changed: not restarted


def test_check_mode_on_the_converged_fleet_changes_nothing(deployment: Deployment) -> None:
    run = deployment.playbook("deploy.yml", "--check", "--diff")
    _ok(run)
    assert set(_changed(run).values()) == {0}, run.output[-4000:]


def test_template_text_reaches_the_hosts_as_written(deployment: Deployment) -> None:
    """A plain ansible-playbook run on `pdctl plan -o`'s file renders none of the spec's text:
    the controller ran no lookup, and the env file and script hold the text unchanged."""
    assert not deployment.canary.exists()
    values = template_text(deployment.canary)
    node = deployment.nodes[deployment.slots("prefill")[0]["host"]]
    service_env = deployment.root(node, f"cat {CONF}/service.env").splitlines()
    assert values["env_jinja"] in service_env and values["env_shell"] in service_env
    assert values["command"] in deployment.root(node, f"cat {CONF}/prefill.sh").splitlines()


def test_planned_slots_run_and_the_others_do_not(deployment: Deployment) -> None:
    for host, slots in deployment.plan["pd_host_slots"].items():
        units = [slot["unit"] for slot in slots]
        states = deployment.root(
            deployment.nodes[host], f"systemctl is-active {' '.join(units)}", check=False
        )
        assert states.split() == ["active" if s["start"] else "inactive" for s in slots], units
    # What pdctl's rolling update and the scaler read through pdctl-unitctl, as the fleet user.
    for host, slots in deployment.plan["pd_host_slots"].items():
        node = deployment.nodes[host]
        listed = deployment.lab.ssh(
            node, f"sudo -n /usr/local/libexec/pdctl-unitctl {SERVICE} states"
        ).stdout.split("\n")
        assert sorted(filter(None, listed)) == sorted(
            f"{s['group']} {s['index']} "
            + (
                f"active {deployment.plan['pd_groups'][s['group']]['config']}"
                if s["start"]
                else "inactive -"
            )
            + " 0"  # systemd has restarted none of them
            for s in slots
        )


def test_chat_through_the_router_needs_the_key_and_is_the_decodes_answer(
    deployment: Deployment,
) -> None:
    prompt = f"hello {uuid.uuid4().hex[:8]}"
    body = {"model": "lab/tiny-llama", "messages": [{"role": "user", "content": prompt}]}
    status, doc = deployment.http("POST", "/v1/chat/completions", body)
    assert status == 401, doc
    assert doc["error"]["code"] == "invalid_api_key"

    status, doc = deployment.http("POST", "/v1/chat/completions", body, key=deployment.api_key())
    assert status == 200, doc
    (decode,) = deployment.slots("decode", start=True)
    node = deployment.nodes[decode["host"]]
    assert doc["choices"][0]["message"]["content"] == (
        f"[decode {node}:{decode['port']} model=lab/tiny-llama] echo: {prompt}"
    )
    listed = {(w["worker_type"], w["url"], w["status"]) for w in deployment.workers_listed()}
    assert listed == {
        (s["group"], f"http://{s['address']}:{s['port']}", "ready")
        for s in deployment.slots(start=True)
    }


def test_provider_library_is_mounted_read_only(deployment: Deployment) -> None:
    (prefill,) = deployment.slots("prefill", start=True)
    node = deployment.nodes[prefill["host"]]
    mounts = deployment.container(node, f"pd-{SERVICE}-prefill-{prefill['index']}")["Mounts"]
    library = [m for m in mounts if m["Destination"] == CONTAINER_LIB]
    assert len(library) == 1, mounts
    assert library[0]["Source"] == "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"
    assert library[0]["RW"] is False


def test_hf_token_reaches_only_the_secrets_file_and_the_container(
    deployment: Deployment,
) -> None:
    token = deployment.token
    for node in deployment.workers:
        containers = [
            f"pd-{SERVICE}-{s['group']}-{s['index']}"
            for s in deployment.slots(start=True)
            if deployment.nodes[s["host"]] == node
        ]
        secrets, *environments = deployment.root(
            node,
            f"stat -c '%a %U' {CONF}/secrets.env; cat {CONF}/secrets.env"
            + "".join(f"; echo @@; podman exec {name} env" for name in containers),
        ).split("@@\n")
        assert secrets.splitlines() == ["600 root", f"HF_TOKEN={token}"]
        assert len(environments) == len(containers)
        for name, environment in zip(containers, environments, strict=True):
            assert f"HF_TOKEN={token}" in environment.splitlines(), name
    for node in (deployment.router, *deployment.workers):
        # Read everything back and search here: the token never goes onto a remote command line.
        files, processes, journal = deployment.root(
            node,
            "find /etc/systemd/system /etc/pdctl -type f ! -name secrets.env -exec cat {} +;"
            " echo @@; ps -eo args; echo @@; journalctl --no-pager -o cat",
        ).split("@@\n")
        assert f"pd-{SERVICE}" in files, node  # the units are among what was read
        assert "ps -eo args" in processes, node
        assert f"pd-{SERVICE}-" in journal, node  # the units' logs are among what was read
        assert token not in files, node
        assert token not in processes, node
        assert token not in journal, node
    for run in deployment.runs:
        assert token not in run.output


def test_api_key_is_in_no_process_arguments(deployment: Deployment) -> None:
    key = deployment.api_key()
    assert len(key) >= 32
    mode, router_args, cmdline = deployment.root(
        deployment.router,
        f"stat -c '%a %U' {CONF}/router.env; echo @@; ps -eo args; echo @@;"
        f" tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value pd-{SERVICE}-router)/cmdline",
    ).split("@@\n")
    assert mode.strip() == "600 root"
    # The router runs (SMG retitles itself) and neither ps nor /proc/PID/cmdline shows the key.
    assert "smg::router" in router_args
    assert cmdline.strip()
    assert key not in router_args
    assert key not in cmdline
    for node in deployment.workers:
        assert key not in deployment.root(node, "ps -eo args"), node
    for run in deployment.runs:
        assert key not in run.output


def test_units_render_the_same_with_plain_jinja2(deployment: Deployment) -> None:
    """The roles' templates rendered with plain jinja2 from the plan's variables are what the
    roles wrote (so the templates stay plain Jinja2, read each value by its one name, and the
    unit tests' renderings are the real units)."""
    plan_vars = deployment.plan
    where = plan_vars["pd_layout"]
    prefill_node = deployment.nodes[deployment.slots("prefill")[0]["host"]]
    worker_unit = deployment.root(
        prefill_node, f"cat {where['unit_dir']}/{where['groups']['prefill']['unit']}"
    )
    router_unit = deployment.root(
        deployment.router, f"cat {where['unit_dir']}/{where['router_unit']}"
    )
    for trim_blocks in (False, True):
        worker = role_templates.worker_unit(plan_vars, "prefill", "podman", trim_blocks=trim_blocks)
        router = role_templates.router_unit(plan_vars, trim_blocks=trim_blocks)
        assert worker == worker_unit
        assert router == router_unit
    # What production asks for; the lab's runtime grants what this machine can (crun_clamp.py).
    assert "--ulimit memlock=-1:-1" in worker
    assert "--shm-size" not in worker  # podman refuses it with --ipc host


# --------------------------------------------------------------------------- config changes


def test_config_change_rolls_running_slots_one_at_a_time(deployment: Deployment) -> None:
    """rollout=none leaves running containers alone; the default restarts every running slot of
    the changed group one at a time, a slot the scaler started included (kept running and
    registered); the other group is untouched."""
    (spare,) = deployment.slots("prefill", start=False)
    spare_node = deployment.nodes[spare["host"]]
    # Pin prefill to 2 the way `pdctl scale` does: the scaler the playbook installed starts the
    # spare (and, unpinned, it would stop a slot started behind its back).
    deployment.root(
        deployment.router,
        f"mkdir -p /var/lib/pdctl/{SERVICE} && "
        f"echo '{{\"prefill\": 2}}' > /var/lib/pdctl/{SERVICE}/{layout.SCALER_PINS}",
    )
    _wait_healthy(f"http://{spare['address']}:{spare['port']}/health", timeout=90)
    (decode,) = deployment.slots("decode", start=True)
    decode_node = deployment.nodes[decode["host"]]
    decode_name = f"pd-{SERVICE}-decode-{decode['index']}"
    decode_id = deployment.container(decode_node, decode_name)["Id"]

    changed = json.loads(json.dumps(deployment.plan))
    old_config = changed["pd_groups"]["prefill"]["config"]
    changed["pd_groups"]["prefill"]["image"] = NEW_IMAGE
    changed["pd_groups"]["prefill"]["config"] = new_config = uuid.uuid4().hex[:12]
    changed_file = deployment.plan_file.with_name("plan-changed.yml")
    changed_file.write_text(unsafe_yaml(changed))  # as `pdctl plan -o` writes it
    prefills = [
        (deployment.nodes[s["host"]], f"pd-{SERVICE}-prefill-{s['index']}", s["unit"])
        for s in deployment.slots("prefill")
    ]

    def labels() -> dict[str, str]:
        return {
            name: deployment.container(node, name)["Config"]["Labels"]["pdctl.config"]
            for node, name, _ in prefills
        }

    assert set(labels().values()) == {old_config}  # the spare included
    scaler = _scaler_run(deployment)
    # pd_worker_rollout=none (pdctl surges itself): the files change, running containers do not.
    quiet = deployment.playbook(
        "deploy.yml", "-e", "pd_worker_rollout=none", plan_file=changed_file
    )
    _ok(quiet)
    # The scaler's config carries the plan's groups: its step restarted it on the new one.
    assert _scaler_run(deployment) != scaler
    assert new_config in deployment.root(deployment.router, f"cat {CONF}/{layout.SCALER_CONFIG}")
    assert "Restart the slot with the new config" not in quiet.output
    assert set(labels().values()) == {old_config}
    assert f"PDCTL_CONFIG={new_config}" in deployment.root(
        prefills[0][0], f"cat {CONF}/prefill.env"
    )

    rolled = deployment.playbook("deploy.yml", plan_file=changed_file)
    _ok(rolled)
    assert set(labels().values()) == {new_config}
    assert f"PDCTL_CONFIG={new_config}" in deployment.root(
        prefills[0][0], f"cat {CONF}/prefill.env"
    )
    # The scaler's slot was restarted like the others, not stopped, and is registered.
    assert deployment.root(spare_node, f"systemctl is-active {spare['unit']}").strip() == "active"
    urls = {w["url"] for w in deployment.workers_listed()}
    assert f"http://{spare['address']}:{spare['port']}" in urls
    for node, name, _ in prefills:
        assert deployment.container(node, name)["ImageName"] == NEW_IMAGE
    assert deployment.container(decode_node, decode_name)["Id"] == decode_id  # untouched
    # One slot at a time: restart, health, then the next restart.
    steps = [
        m.start()
        for unit in (unit for _, _, unit in prefills)
        for m in re.finditer(
            # The wait includes the pd_health role: Ansible names such a task without its role.
            rf"TASK \[(?:pd_worker : )?(Restart the slot|Wait for the restarted slot)[^\n]*"
            rf" {re.escape(unit)}\]",
            rolled.output,
        )
    ]
    banners = [line for line in rolled.output.splitlines() if "slot" in line and "TASK [" in line]
    assert len(steps) == 4 and steps == sorted(steps), "\n".join(banners)
    # Serving still works after the rollout.
    body = {"model": "lab/tiny-llama", "messages": [{"role": "user", "content": "after"}]}
    deadline = time.monotonic() + 30
    while True:
        status, doc = deployment.http("POST", "/v1/chat/completions", body, deployment.api_key())
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status == 200, doc


# --------------------------------------------------------------------------- destroy


def test_destroy_leaves_hosts_clean_and_runs_twice(deployment: Deployment) -> None:
    image = deployment.plan["pd_groups"]["decode"]["image"]
    node = deployment.workers[-1]
    # A container the units lost track of, and one of another service that must stay.
    deployment.root(node, f"podman create --name pd-{SERVICE}-decode-9 {image} true")
    deployment.root(node, f"podman create --name pd-{SERVICE}x-decode-1 {image} true")
    first = deployment.playbook("destroy.yml")
    _ok(first)
    others = deployment.root(node, "podman ps -a --format '{{.Names}}'").split()
    assert others == [f"pd-{SERVICE}x-decode-1"]
    deployment.root(node, f"podman rm pd-{SERVICE}x-decode-1")
    for node in (deployment.router, *deployment.workers):
        units = deployment.root(
            node,
            "systemctl list-units --all --plain --no-legend 'pd-*'; "
            "systemctl list-unit-files --no-legend 'pd-*'; "
            "find /etc/systemd/system -name 'pd-*'",
        )
        assert units.strip() == "", (node, units)
        gone = "ls -d /etc/pdctl /opt/pdctl /usr/local/libexec/pdctl-unitctl 2>&1; true"
        assert deployment.root(node, gone).count("No such") == 3
        assert deployment.root(node, "podman ps -a --format '{{.Names}}'").strip() == ""
    assert "pdctl-lab/sglang-rocm" in deployment.root(deployment.workers[0], "podman images")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{deployment.router_address}:8000/health", timeout=3)

    second = deployment.playbook("destroy.yml")
    _ok(second)
    assert set(_changed(second).values()) == {0}, second.output[-4000:]
    for run in deployment.runs:
        assert deployment.token not in run.output
