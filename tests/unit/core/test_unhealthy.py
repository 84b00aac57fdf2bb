"""Why a unit did not become healthy, from the roles' probes and from pdctl-unitctl; the
service's record of a deploy that did not complete."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.synchronize
from pathlib import Path

import pytest

from pdctl.core.errors import InputError, NotFound
from pdctl.core.plan import Plan, build
from pdctl.core.spec import Env, Spec
from pdctl.core.unhealthy import UnhealthyUnits, from_run, from_unitctl
from pdctl.doors import service as services
from pdctl.doors.runner import RunSummary, TaskResult
from pdctl.doors.workspace import Workspace
from tests.unit.core.plan.test_placement import fleet, host, lab_spec

SECRET = "hf_supersecretvalue"


def probe(status: int, state: str, restarts: int, journal: str) -> str:
    return json.dumps({"status": status, "state": state, "restarts": restarts, "journal": journal})


SLOT = {"group": "prefill", "index": 1, "unit": "pd-s-prefill@1.service", "host": "h2"}
JOURNAL = f"loading\ntoken={SECRET}\ncrun: setrlimit RLIMIT_NOFILE: Operation not permitted\n"


def failed(res: dict[str, object], task: str = "Check") -> TaskResult:
    return TaskResult("h2", task, "assert", "failed", False, False, res)


def test_an_assert_over_probes_names_each_unit_with_its_journal() -> None:
    item = {
        "failed": True,
        "msg": "h2: not healthy",
        "item": {"stdout": probe(0, "failed", 5, JOURNAL), "item": SLOT},
    }
    ok_item = {
        "failed": False,
        "item": {"stdout": probe(200, "active", 0, ""), "item": {**SLOT, "index": 2}},
    }
    summary = RunSummary(
        2, "failed", [failed({"msg": "One or more items failed", "results": [ok_item, item]})]
    )
    (unit,) = from_run(summary, [SECRET])
    assert (unit.replica, unit.host, unit.unit) == ("prefill/1", "h2", "pd-s-prefill@1.service")
    assert (unit.state, unit.restarts, unit.status) == ("failed", 5, 0)
    assert unit.journal[-1] == "crun: setrlimit RLIMIT_NOFILE: Operation not permitted"
    assert "token=***" in unit.journal and SECRET not in json.dumps(unit.journal)
    assert summary.results[0].message == "h2: not healthy"  # not "One or more items failed"


def test_a_probe_whose_retries_ran_out_is_read_too() -> None:
    item = {
        "failed": True,
        "stdout": probe(503, "active", 0, "warming up"),
        "item": {"name": "router", "unit": "pd-s-router.service"},
    }
    (unit,) = from_run(RunSummary(2, "failed", [failed({"results": [item]}, "Wait")]))
    assert (unit.replica, unit.state, unit.status, unit.journal) == (
        "router",
        "active",
        503,
        ["warming up"],
    )


@pytest.mark.parametrize(
    "junk",
    [
        {"failed": True, "item": {"stdout": "not json", "item": SLOT}},
        {"failed": True, "item": "x"},
        {"failed": True, "stdout": json.dumps([1, 2]), "item": SLOT},
        "string item",
    ],
)
def test_host_output_that_does_not_parse_is_ignored(junk: object) -> None:
    assert from_run(RunSummary(2, "failed", [failed({"results": [junk]})])) == []


def test_the_error_lists_units_in_text_and_json() -> None:
    output = f"ActiveState=failed\nNRestarts=5\n--\nstarting\nsecret {SECRET}\nfatal: no model\n"
    unit = from_unitctl("decode/2", "h3", "pd-s-decode@2.service", output, [SECRET])
    assert (unit.state, unit.restarts, unit.journal[-1]) == ("failed", 5, "fatal: no model")
    error = UnhealthyUnits("deploy failed", [unit], hint="re-run")
    assert "decode/2 on h3 (pd-s-decode@2.service): unit failed after 5 restart(s)" in error.message
    assert "| fatal: no model" in error.message and SECRET not in error.message
    doc = error.as_dict()
    assert doc["exit_code"] == 4 and doc["replicas"][0]["journal"][-1] == "fatal: no model"


def test_a_deploy_that_does_not_complete_stays_recorded(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path)
    spec, env = lab_spec()
    plan = build_plan(spec, env)
    with pytest.raises(NotFound):
        services.load_plan(workspace, plan.service)
    with pytest.raises(RuntimeError), services.applying(workspace, plan):
        assert services.record_state(workspace, plan.service) == "applying"
        raise RuntimeError("the run failed")
    assert services.record_state(workspace, plan.service) == "failed"
    assert services.load_plan(workspace, plan.service) == plan  # status and destroy find it
    assert services.stored_plan(workspace, plan.service) is None  # never applied
    with services.applying(workspace, plan):
        services.save_plan(workspace, plan)
    assert services.record_state(workspace, plan.service) == "applied"
    assert services.plans(workspace, plan.service) == [plan]


def _hold(
    home: str, ready: multiprocessing.synchronize.Event, done: multiprocessing.synchronize.Event
) -> None:
    spec, env = lab_spec()
    plan = build_plan(spec, env)
    with services.applying(Workspace(Path(home)), plan):
        ready.set()
        done.wait(30)


def test_a_deploy_still_running_is_told_apart_and_not_run_twice(tmp_path: Path) -> None:
    ready, done = multiprocessing.Event(), multiprocessing.Event()
    other = multiprocessing.Process(target=_hold, args=(str(tmp_path), ready, done))
    other.start()
    try:
        assert ready.wait(30)
        spec, env = lab_spec()
        plan = build_plan(spec, env)
        assert services.record_state(Workspace(tmp_path), plan.service) == "applying"
        with (
            pytest.raises(InputError, match="another pdctl is deploying"),
            services.applying(Workspace(tmp_path), plan),
        ):
            pass
    finally:
        done.set()
        other.join(30)
    assert services.applying_plan(Workspace(tmp_path), plan.service) is None  # it completed


def build_plan(spec: Spec, env: Env) -> Plan:
    return build(
        spec, env, fleet(host("cpu1", "cpu"), host("gpu1"), host("gpu2")), secrets_digest=""
    )
