"""No secret on disk or in a process list, even when pdctl is killed mid-run.

Real programs throughout: pdctl's runner, ansible-runner, ansible-playbook against localhost
(connection local, no lab), and pdctl/doors/exec_with_secrets.py under a real pty.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pexpect
import pytest

from pdctl.core.errors import EnvironmentProblem
from pdctl.doors.exec_with_secrets import parse_secrets
from pdctl.doors.runner import STRATEGY_VARIABLE, RunSummary, child_env, run_playbook
from tests.support import wait_for

ROOT = Path(__file__).resolve().parents[3]
PLAYBOOKS = ROOT / "tests" / "data" / "playbooks"
WRAPPER = ROOT / "pdctl" / "doors" / "exec_with_secrets.py"
SECRET_NAME = "PDCTL_TEST_SECRET"
# Started as pdctl would be, in its own process, so that it can be killed mid-run.
CHILD = f"""
import json, os, sys
from pathlib import Path
from pdctl.doors.runner import run_playbook
run_playbook(
    "secret_probe.yml", Path(sys.argv[1]), extravars=json.loads(sys.argv[2]),
    secrets={{"{SECRET_NAME}": os.environ["{SECRET_NAME}"]}}, playbooks=Path(sys.argv[3]),
)
"""


def files_holding(value: str, top: Path) -> list[Path]:
    return [p for p in top.rglob("*") if p.is_file() and value.encode() in p.read_bytes()]


def processes() -> list[str]:
    """Every process's pid and command line."""
    ps = ["ps", "-ww", "-eo", "pid=,args="]  # -ww: whole command lines, whatever the width
    return subprocess.run(ps, capture_output=True, text=True, check=True).stdout.splitlines()


@dataclass
class Probe:
    """One run of tests/data/playbooks/secret_probe.yml: where it writes, what releases it."""

    tmp: Path
    secret: str
    canary: str

    @property
    def inventory(self) -> Path:
        return self.tmp / "hosts"

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    @property
    def release(self) -> Path:
        return self.tmp / "release"

    @property
    def runs(self) -> Path:
        return self.tmp / f"pdctl-runs-{os.getuid()}"

    def extravars(self) -> dict[str, object]:
        return {"probe_out": str(self.out), "probe_release": str(self.release), "probe_hold": 60}

    def run(self, verbosity: int = 0) -> RunSummary:
        return run_playbook(
            "secret_probe.yml",
            self.inventory,
            extravars=self.extravars(),
            secrets={SECRET_NAME: self.secret},
            playbooks=PLAYBOOKS,
            verbosity=verbosity,
        )

    def received(self) -> list[str]:
        """What ansible-playbook found: the secret, then the unrelated variable."""
        return self.out.read_text().splitlines()

    def ansible_pids(self) -> list[int]:
        """The processes of this probe's runs (their command lines name its inventory)."""
        return [int(line.split()[0]) for line in processes() if str(self.inventory) in line]


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Probe]:
    found = Probe(tmp_path, secret=f"hf_{uuid.uuid4().hex}", canary=f"canary-{uuid.uuid4().hex}")
    found.inventory.write_text(
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
    )
    # An operator's shell: a secret pdctl's run needs and a secret of its own it must not pass.
    monkeypatch.setenv(SECRET_NAME, found.secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", found.canary)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() caches its answer
    yield found
    for pid in found.ansible_pids():  # a killed run's ansible-playbook, if it outlived the test
        os.kill(pid, signal.SIGKILL)


def test_a_secret_reaches_ansible_playbook_through_no_file_argv_or_output(
    probe: Probe, capsys: pytest.CaptureFixture[str]
) -> None:
    seen_mid_run: dict[str, object] = {}

    def inspect_then_release() -> None:
        wait_for(probe.out.exists, 120, what="the probe's first task")
        artifacts = list(probe.runs.glob("*/artifacts/*/command"))
        seen_mid_run["command"] = json.loads(artifacts[0].read_text()) if artifacts else None
        seen_mid_run["files"] = files_holding(probe.secret, probe.runs)
        seen_mid_run["canary files"] = files_holding(probe.canary, probe.runs)
        seen_mid_run["ps"] = "\n".join(processes())
        probe.release.touch()

    inspector = threading.Thread(target=inspect_then_release, daemon=True)
    inspector.start()
    summary = probe.run(verbosity=2)  # -vv: ansible-playbook's output is printed, and checked
    inspector.join(timeout=30)

    assert summary.rc == 0, summary
    assert probe.received() == [
        f"secret={probe.secret}",
        "cloud=",
    ]  # the secret arrived; the cloud key did not
    assert seen_mid_run["files"] == []
    assert seen_mid_run["canary files"] == []
    assert probe.secret not in str(seen_mid_run["ps"])
    command = seen_mid_run["command"]
    assert isinstance(command, dict)
    assert "AWS_SECRET_ACCESS_KEY" not in command["env"]
    assert SECRET_NAME not in command["env"]
    printed = capsys.readouterr()
    assert "pdctl: secrets for this run" in printed.out  # the hand-over happened on the pty
    assert probe.secret not in printed.out + printed.err
    assert probe.secret not in repr(summary)
    assert list(probe.runs.iterdir()) == []  # the run removed its private dir


def test_a_killed_run_leaves_no_secret_and_the_next_run_removes_its_dir(probe: Probe) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, probe.inventory, json.dumps(probe.extravars()), PLAYBOOKS],
        cwd=ROOT,  # `-c` imports pdctl from the working directory: this checkout's
        # Under Mitogen, as deploy.yml runs: its ansible-playbook outlives a closed pty.
        env={**os.environ, STRATEGY_VARIABLE: "mitogen"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(
            lambda: probe.out.exists() or child.poll() is not None,
            120,
            what="the probe's first task",
        )
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        time.sleep(1)  # into the next task: a write to the closed pty would end it by itself
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    (dead,) = probe.runs.glob(f"{child.pid}-*")  # no `finally` ran: the dir is still there
    # Its ansible-playbook stops with it, long before the task it runs would end (60 s).
    wait_for(lambda: not probe.ansible_pids(), 20, what="the killed run's ansible-playbook to stop")
    assert probe.received()[0] == f"secret={probe.secret}"
    assert files_holding(probe.secret, probe.tmp) == [probe.out]

    probe.out.unlink()
    probe.release.touch()
    assert probe.run().rc == 0
    assert not dead.exists()
    assert list(probe.runs.iterdir()) == []


def test_ansible_playbook_environment_is_the_allowlist_and_the_runs_settings() -> None:
    operator = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LC_ALL": "C.UTF-8",
        "SSH_AUTH_SOCK": "/run/agent",
        "ANSIBLE_FORKS": "7",
        "ANSIBLE_CONFIG": "/theirs.cfg",
        "AWS_SECRET_ACCESS_KEY": "canary",
        "HF_TOKEN": "hf_secret",
        "ANSIBLE_VAULT_TOKEN": "a secret named like a setting",
        "RUNNER_OMIT_EVENTS": "False",
    }
    prepared = {
        **operator,
        "PATH": "/venv/bin:/usr/bin",  # pdctl's
        "ANSIBLE_CONFIG": "/pdctl/ansible.cfg",  # pdctl's over the operator's
        "AWX_ISOLATED_DATA_DIR": "/private/artifacts/x",  # ansible-runner's
    }
    env = child_env(prepared, operator, {"HF_TOKEN", "ANSIBLE_VAULT_TOKEN"})
    assert env == {
        "PATH": "/venv/bin:/usr/bin",
        "HOME": "/root",
        "LC_ALL": "C.UTF-8",
        "SSH_AUTH_SOCK": "/run/agent",
        "ANSIBLE_FORKS": "7",
        "ANSIBLE_CONFIG": "/pdctl/ansible.cfg",
        "AWX_ISOLATED_DATA_DIR": "/private/artifacts/x",
    }


def test_the_wrapper_adds_the_secrets_to_the_programs_environment_only() -> None:
    show = "import os, sys; print(os.environ['A'], os.environ['B'], sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-I", WRAPPER, "PROMPT", sys.executable, "-c", show, "plain"],
        input=json.dumps({"A": "a value", "B": "line\nbreak"}) + "\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "PROMPT\na value line\nbreak ['plain']\n"


def test_the_wrapper_refuses_anything_but_one_json_object_of_strings() -> None:
    for line in ('["A"]', '{"A": 1}', "not json"):
        with pytest.raises(ValueError):
            parse_secrets(line.encode())
    done = subprocess.run(
        [sys.executable, "-I", WRAPPER, "PROMPT", "true"],
        input="",
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "no secrets received" in done.stderr


def test_a_long_secret_crosses_the_pty_whole_and_is_never_echoed() -> None:
    """A terminal's input line is capped at 4095 bytes unless line editing is off."""
    value = uuid.uuid4().hex * 400  # 12,800 characters
    show = "import os; print(len(os.environ['LONG']), os.environ['LONG'][-8:])"
    child = pexpect.spawn(
        sys.executable,
        ["-I", str(WRAPPER), "PROMPT", sys.executable, "-c", show],
        echo=False,
        encoding="utf-8",
        timeout=30,
    )
    child.expect("PROMPT")
    child.sendline(json.dumps({"LONG": value}))
    child.expect(pexpect.EOF)
    output = str(child.before)
    assert f"{len(value)} {value[-8:]}" in output
    assert value[:64] not in output


def test_runs_dirs_of_other_users_or_shared_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parent = tmp_path / f"pdctl-runs-{os.getuid()}"
    parent.mkdir(mode=0o777)
    parent.chmod(0o777)
    with pytest.raises(EnvironmentProblem, match="only this user"):
        run_playbook("secret_probe.yml", tmp_path, playbooks=PLAYBOOKS)
