"""The quick no-op check: what it reads on a host (drift_probe, run here on a temp tree), the
inputs digest, and the verdict (pure); the keyed digest of the secrets that the groups' configs
cover. The lab test in test_deploy.py runs it on real hosts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.errors import CheckFailed
from pdctl.core.plan import Plan, build
from pdctl.doors import inventory
from pdctl.doors import service as services
from pdctl.doors.session import Session
from pdctl.doors.slots import SlotState
from pdctl.doors.workspace import Workspace
from pdctl.onhost import bundle, drift_probe
from pdctl.operations import drift, planning
from pdctl.operations.drift import Observed
from pdctl.operations.planning import write_plan_file
from tests.unit.core.plan.test_placement import REPO, fleet, host, lab_spec

KEY = bytes(32)


@pytest.fixture(scope="module")
def plan() -> Plan:
    spec, env = lab_spec()
    return build(
        spec, env, fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2")), secrets_digest=""
    )


def make_plan(workspace: Workspace, *args: Any, **kwargs: Any) -> Any:
    """planning.make_plan as one command makes it: in a session of its own."""
    with Session(workspace) as session:
        return planning.make_plan(session, *args, **kwargs)


def in_sync(plan: Plan) -> tuple[dict[str, object], dict[str, Observed], set[str]]:
    """A record and observations that agree: every planned unit up, every runner registered."""
    record: dict[str, object] = {"inputs": "I", "hosts": {}}
    observed = {}
    registered = set()
    for name, expect in drift.expectations(plan).items():
        files = {root: "644 0 0 abc" for root in expect.roots}
        record["hosts"][name] = dict(files)  # type: ignore[index]
        states = {}
        for slot in (s for s in plan.slots() if s.host == name):
            config = plan.groups[slot.group].config
            states[slot.name] = SlotState(slot, "active" if slot.start else "inactive", config)
            if slot.start:
                registered.add(slot.url)
        observed[name] = Observed(
            files=files,
            units={u: ["active", "enabled"] for u in expect.units},
            images=dict.fromkeys(expect.images, True),
            states=states,
        )
    return record, observed, registered


def test_hosts_as_recorded_need_nothing(plan: Plan) -> None:
    record, observed, registered = in_sync(plan)
    assert drift.compare(plan, record, "I", observed, registered) == []


def test_each_kind_of_drift_is_named(plan: Plan) -> None:
    record, observed, registered = in_sync(plan)
    assert drift.compare(plan, None, "I", observed, registered) == [
        "no record of a completed deploy"
    ]
    assert "changed" in drift.compare(plan, record, "other", observed, registered)[0]
    worker = next(s for s in plan.slots() if s.start)
    seen = observed[worker.host]
    path = next(iter(seen.files))
    seen.files[path] = "600 0 0 edited"
    seen.units[worker.unit(plan.service)] = ["failed", "disabled"]
    seen.images[plan.groups[worker.group].image] = False
    seen.states[worker.name] = SlotState(worker, "active", "an-old-config")
    reasons = drift.compare(plan, record, "I", observed, registered - {worker.url})
    assert f"{worker.host}: {path} changed since the last deploy" in reasons
    assert f"{worker.host}: {worker.unit(plan.service)} is failed, planned to run" in reasons
    assert f"{worker.host}: {worker.unit(plan.service)} is disabled, not enabled" in reasons
    assert any("image" in r and "missing" in r for r in reasons)
    assert f"{worker.host}: {worker.name} runs a stale config" in reasons
    assert f"{worker.host}: {worker.name} runs but the router does not have it" in reasons


def test_unreadable_hosts_and_an_unanswering_router_mean_converge(plan: Plan) -> None:
    record, observed, _ = in_sync(plan)
    observed[plan.router.host] = Observed({}, {}, {}, {}, error="cannot read it: refused")
    reasons = drift.compare(plan, record, "I", observed, None)
    assert f"{plan.router.host}: cannot read it: refused" in reasons
    assert "the router could not be asked for its workers" in reasons


def test_spares_the_scaler_runs_are_not_drift(plan: Plan) -> None:
    record, observed, registered = in_sync(plan)
    spare = next(s for s in plan.slots() if not s.start)
    config = plan.groups[spare.group].config
    observed[spare.host].states[spare.name] = SlotState(spare, "active", config)
    assert drift.compare(plan, record, "I", observed, registered | {spare.url}) == []


def test_inputs_digest_follows_inputs_but_not_check_records(tmp_path: Path) -> None:
    inventory = tmp_path / "inv"
    (inventory / "host_vars").mkdir(parents=True)
    hosts = inventory / "hosts.yml"
    hosts.write_text("all: {hosts: {a: {ansible_port: 22}}}\n")
    host_vars = inventory / "host_vars" / "a.yml"
    host_vars.write_text("pd_facts: {gpus: 8}\npd_preflight: {checked_at: '1'}\nx: 1\n")
    base = drift.inputs_digest(KEY, {"pd_service": "s"}, inventory)
    host_vars.write_text("pd_facts: {gpus: 7}\npd_preflight: {checked_at: '2'}\nx: 1\n")
    assert drift.inputs_digest(KEY, {"pd_service": "s"}, inventory) == base
    changed = [
        drift.inputs_digest(KEY, {"pd_service": "t"}, inventory),
        drift.inputs_digest(bytes([1]) * 32, {"pd_service": "s"}, inventory),
    ]
    host_vars.write_text("pd_facts: {gpus: 7}\nx: 2\n")
    changed.append(drift.inputs_digest(KEY, {"pd_service": "s"}, inventory))
    assert base not in changed and len(set(changed)) == len(changed)


def test_probe_reads_files_links_and_venvs_without_bulk(tmp_path: Path) -> None:
    root = tmp_path / "opt"
    (root / "app" / "__pycache__").mkdir(parents=True)
    (root / "app" / "__pycache__" / "x.pyc").write_bytes(b"changes at run time")
    secret = root / "app" / "secrets.env"
    secret.write_text("HF_TOKEN=hf_secret\n")
    secret.chmod(0o600)
    (root / "app" / "link").symlink_to("secrets.env")
    venv = root / "venv"
    record = venv / "lib" / "python3.11" / "site-packages" / "pkg-1.0.dist-info" / "RECORD"
    record.parent.mkdir(parents=True)
    record.write_text("pkg/__init__.py,sha256=abc,0\n")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "lib" / "python3.11" / "site-packages" / "pkg.py").write_text("big = 1\n")
    found = {
        str(p.relative_to(root)): drift_probe.signature(p, KEY) for p in drift_probe.paths(root)
    }
    assert set(found) == {
        ".",
        "app",
        "app/secrets.env",
        "app/link",
        "venv",
        "venv/pyvenv.cfg",
        "venv/lib/python3.11/site-packages/pkg-1.0.dist-info/RECORD",
    }
    assert found["app/link"] == "link secrets.env"
    mode, uid, gid, mac = found["app/secrets.env"].split()
    assert (mode, int(uid), int(gid)) == ("600", os.getuid(), os.getgid())
    assert (
        "hf_secret" not in mac and drift_probe.signature(secret, bytes([1]) * 32).split()[3] != mac
    )
    assert list(drift_probe.paths(tmp_path / "absent")) == []


def test_probe_runs_as_the_hosts_run_it(tmp_path: Path) -> None:
    """The same argv, bundle and parameters pdctl sends over SSH, under a new python3."""
    (tmp_path / "f").write_text("x")
    params = {"roots": [str(tmp_path)], "units": [], "images": [], "states": None, "key": KEY.hex()}
    proc = subprocess.run(
        bundle.argv(drift.PROBE, python=sys.executable),
        input=bundle.stdin(drift.PROBE) + json.dumps(params).encode(),
        capture_output=True,
        check=True,
    )
    doc = json.loads(proc.stdout)
    assert set(doc["files"]) == {str(tmp_path), str(tmp_path / "f")}
    assert doc["units"] == {} and doc["states"] is None


def _plan_with(token: str, key: bytes | None = KEY) -> Plan:
    spec, env = lab_spec()
    digest = drift.secrets_digest(key, env.secrets, {"HF_TOKEN": token})
    hosts = fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2"))
    return build(spec, env, hosts, secrets_digest=digest)


def test_a_rotated_secret_changes_the_config_through_a_keyed_digest_only(tmp_path: Path) -> None:
    one, same, other = _plan_with("hf_one"), _plan_with("hf_one"), _plan_with("hf_two")
    for role in ("prefill", "decode"):
        config = one.groups[role].config
        assert config == same.groups[role].config != other.groups[role].config
    # Keyed: the same value under another workspace's key gives another digest.
    assert _plan_with("hf_one", bytes([1]) * 32).secrets_digest != one.secrets_digest
    plan_file = tmp_path / "plan.yml"  # what `pdctl plan -o` writes for ansible-playbook
    write_plan_file(one, plan_file)
    for text in (one.model_dump_json(), json.dumps(one.extravars()), plan_file.read_text()):
        assert "hf_one" not in text and one.secrets_digest in text


def test_without_a_key_the_digest_is_a_fixed_marker() -> None:
    assert _plan_with("hf_one", None).secrets_digest == "unkeyed"
    assert _plan_with("hf_one", None).groups["decode"].config == (
        _plan_with("hf_two", None).groups["decode"].config
    )
    assert drift.secrets_digest(None, [], {}) == drift.secrets_digest(KEY, [], {}) == ""


def test_only_a_deploy_of_a_valid_plan_makes_the_key(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path)
    inventory.save(workspace, fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2")))
    spec = REPO / "examples" / "lab" / "pd.yml"
    environ = {"HF_TOKEN": "hf_one"}
    key_file = services.state_dir(workspace, "pdlab") / drift.KEY
    unread: list[str] = []  # the fleet's hosts are not real: their holdings go unread
    _, _, planned = make_plan(workspace, spec, "f", environ=environ, warn=unread.append)
    assert planned.secrets_digest == "unkeyed" and not key_file.exists()
    too_big = tmp_path / "pd.yml"  # refused by the plan: no key either
    too_big.write_text(spec.read_text().replace("count: 1..2", "count: 1..9"))
    with pytest.raises(CheckFailed):
        make_plan(workspace, too_big, "f", environ=environ, create_key=True, warn=unread.append)
    assert not key_file.exists()
    _, _, deployed = make_plan(
        workspace, spec, "f", environ=environ, create_key=True, warn=unread.append
    )
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert deployed.secrets_digest == drift.secrets_digest(
        drift.stored_key(workspace, "pdlab"), ["HF_TOKEN"], environ
    )
    # The key, once made, is used.
    _, _, again = make_plan(workspace, spec, "f", environ=environ, warn=unread.append)
    assert again.groups["decode"].config == deployed.groups["decode"].config
