"""Failures explain themselves and can be undone, on a 3-host lab (real sshd, Ansible,
systemd, podman, SMG).

A worker that cannot start fails the deploy soon after systemd gives up on it, with its own
log line in pdctl's error; `status` shows the service as failed with that line; `destroy`
removes everything. The same after pdctl is killed part-way through a first deploy; the next
deploy then serves. The tests run in file order on the session's shared lab.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.support import (
    PREFILL_LAUNCH,
    Lab,
    pdctl,
    pdctl_json,
    private_tmp,
    renamed,
    service_status,
)

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "lab" / "pd.yml"
SERVICE = "lab-undo"
CRASH_LINE = "pdctl-test: cannot load the model weights"


@pytest.fixture(scope="module")
def lab(shared_lab: Lab) -> Lab:
    return shared_lab


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lab example, as this module's service."""
    path = tmp_path_factory.mktemp("undo") / "pd.yml"
    path.write_text(renamed(SPEC.read_text(), SERVICE))
    return path


ENV = {"HF_TOKEN": f"hf_{uuid.uuid4().hex}"}


def _leftovers(lab: Lab) -> dict[str, str]:
    """What of the service is on each host (units, config dir), by node name."""
    found = {}
    for node in (h["name"] for h in lab.status()["hosts"]):
        out = lab.ssh(
            node,
            f"ls /etc/systemd/system | grep '^pd-{SERVICE}-' ;"
            f" ls -d /etc/pdctl/{SERVICE} 2>/dev/null;"
            f" systemctl list-units --all --plain --no-legend 'pd-{SERVICE}-*' | grep -v not-found",
            user="root",
            check=False,
        ).stdout.strip()
        if out:
            found[node] = out
    return found


def test_a_worker_that_cannot_start_fails_the_deploy_with_its_own_log(
    lab: Lab, spec: Path, tmp_path: Path
) -> None:
    # The prefill's command dies at once, as a worker does that cannot load its model. The start
    # timeout is long: the deploy must end because systemd gave up, not because time ran out.
    text = spec.read_text().replace("start_timeout: 2m", "start_timeout: 15m")
    crash = f"      - \"echo '{CRASH_LINE}' >&2 && false\"\n"
    broken = tmp_path / "broken.yml"
    broken.write_text(text.replace(PREFILL_LAUNCH, crash + PREFILL_LAUNCH, 1))
    started = time.monotonic()
    proc = pdctl(
        lab.home, "--json", "deploy", str(broken), "--fleet", "lab", "-y", check=False, env=ENV
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 4, proc.stdout + proc.stderr
    error = json.loads(proc.stdout)["error"]
    prefills = [r for r in error["replicas"] if r["replica"].startswith("prefill/")]
    assert prefills, error
    assert all(r["state"] == "failed" and r["restarts"] >= 1 for r in prefills), prefills
    assert any(CRASH_LINE in line for line in prefills[0]["journal"]), prefills[0]
    assert CRASH_LINE in error["message"] and "prefill/1 on " in error["message"]
    assert ENV["HF_TOKEN"] not in proc.stdout + proc.stderr
    assert elapsed < 6 * 60, elapsed  # systemd gives up within a minute; the start timeout is 15


def test_status_shows_the_failed_deploy_and_its_replicas(lab: Lab) -> None:
    doc = service_status(lab.home, SERVICE, ENV)
    assert doc["state"] == "failed"
    assert doc["health"] == "down"  # no prefill starts: the router is not ready
    failed = [r for r in doc["groups"]["prefill"]["replicas"] if r["state"] == "failed"]
    assert failed and CRASH_LINE in (failed[0]["last_log"] or ""), doc
    proc = pdctl(lab.home, "status", SERVICE, env=ENV, check=False)
    assert proc.returncode == 8 and f"service {SERVICE} is down" in proc.stderr
    text = proc.stdout
    assert "state: failed" in text and f"pdctl destroy {SERVICE}" in text and CRASH_LINE in text


def test_destroy_undoes_the_failed_deploy(lab: Lab) -> None:
    assert _leftovers(lab)  # the failed deploy did change hosts
    pdctl(lab.home, "destroy", SERVICE, "-y", env=ENV)
    assert _leftovers(lab) == {}
    missing = pdctl(lab.home, "status", SERVICE, check=False, env=ENV)
    assert missing.returncode == 7


def _ansible_runs(home: Path) -> list[str]:
    """ansible-playbook processes of this workspace still running (their own session)."""
    found = subprocess.run(
        ["pgrep", "-af", "ansible-playbook"], capture_output=True, text=True, check=False
    ).stdout
    return [
        line for line in found.splitlines() if str(home) in line or str(private_tmp(home)) in line
    ]


def test_a_killed_first_deploy_is_undone_and_the_next_serves(lab: Lab, spec: Path) -> None:
    env = {**os.environ, **ENV, "PDCTL_HOME": str(lab.home), "TMPDIR": str(private_tmp(lab.home))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdctl", "deploy", str(spec), "--fleet", "lab", "-y"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 300
    for line in proc.stderr:  # kill it once the workers' play has begun changing hosts
        if "Run the prefill and decode workers" in line or "Apply the host's worker units" in line:
            break
        assert time.monotonic() < deadline
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 300
    while _ansible_runs(lab.home):  # a run left behind finishes (or dies) on its own
        assert time.monotonic() < deadline
        time.sleep(2)
    doc = service_status(lab.home, SERVICE, ENV)
    assert doc["state"] == "failed", doc
    pdctl(lab.home, "destroy", SERVICE, "-y", env=ENV)
    assert _leftovers(lab) == {}
    done = pdctl_json(lab.home, "deploy", str(spec), "--fleet", "lab", "-y", env=ENV)
    assert done["converged"] is True
    key = service_status(lab.home, SERVICE, ENV)
    assert key["state"] == "applied"
    router = next(
        h for h in lab.status()["hosts"] if h["address"] == key["groups"]["router"]["host"]
    )
    api_key = lab.ssh(router["name"], f"cat /etc/pdctl/{SERVICE}/router.env", user="root").stdout
    request = urllib.request.Request(
        f"{key['endpoint']}/v1/chat/completions",
        data=json.dumps(
            {
                "model": "lab/tiny-llama",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            }
        ).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {api_key.strip().split('=', 1)[1]}",
        },
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200 and json.loads(reply.read())["choices"]
