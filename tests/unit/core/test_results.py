"""The typed results' JSON: `pdctl --json deploy|status|destroy|endpoint` print these dumps, and
scripts read them by key, so a key renamed, moved, added or dropped fails here first."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdctl.cli.output import Output
from pdctl.core.results import (
    DeployResult,
    DestroyResult,
    EndpointResult,
    GroupStatus,
    ReplicaStatus,
    RouterStatus,
    ScalerStatus,
    StatusGroups,
    StatusResult,
)
from pdctl.core.scaling.decide import Decision


def dumped(result: Any) -> Any:
    """The document as `--json` prints it (through JSON text: what a script parses)."""
    return json.loads(json.dumps(result.model_dump(mode="json")))


def test_deploy_result_keys_and_defaults() -> None:
    doc = dumped(
        DeployResult(
            service="svc",
            fleet="f",
            dry_run=False,
            changes=["+ new service svc"],
            endpoint="http://10.0.0.1:8000",
            api_key_file="cpu1:/etc/pdctl/svc/router.env",
        )
    )
    assert doc == {
        "service": "svc",
        "fleet": "f",
        "dry_run": False,
        "changes": ["+ new service svc"],
        "changed_hosts": [],
        "rolled": [],
        "converged": False,
        "skipped_hosts": [],
        "drift": [],
        "endpoint": "http://10.0.0.1:8000",
        "api_key_file": "cpu1:/etc/pdctl/svc/router.env",
        "model": None,
        "images": None,
    }
    assert list(doc) == [
        "service",
        "fleet",
        "dry_run",
        "changes",
        "changed_hosts",
        "rolled",
        "converged",
        "skipped_hosts",
        "drift",
        "endpoint",
        "api_key_file",
        "model",
        "images",
    ]


def replica(index: int, state: str = "active", **changes: Any) -> ReplicaStatus:
    fields: dict[str, Any] = {
        "host": "gpu1",
        "slot": index,
        "port": 8100 + index,
        "gpus": [index],
        "state": state,
        "registered": state == "active",
        "router_status": "ready" if state == "active" else None,
        "healthy": True if state == "active" else None,
        "stale": False,
        "restarts": None,
        "last_log": None,
    }
    return ReplicaStatus(**{**fields, **changes})


def status_result() -> StatusResult:
    decision = Decision(
        group="decode", current=1, desired=2, recommendation=2, action="up", reason="rps 3 > 2"
    )
    return StatusResult(
        service="svc",
        fleet="f",
        state="applied",
        endpoint="http://10.0.0.1:8000",
        api_key_file="cpu1:/etc/pdctl/svc/router.env",
        scaler=ScalerStatus(running=True, rps=3.25, recorded_at=1700000000.5),
        groups=StatusGroups(
            router=RouterStatus(
                host="cpu1", address="10.0.0.1", port=8000, state="ready", unit="pd-svc-router"
            ),
            prefill=GroupStatus(
                min=1,
                max=2,
                desired=None,
                pinned=1,
                running=1,
                last_decision=None,
                replicas=[
                    replica(1),
                    replica(2, "failed", restarts=3, last_log="OOM", stale=True),
                ],
            ),
            decode=GroupStatus(
                min=1,
                max=2,
                desired=2,
                pinned=None,
                running=1,
                last_decision=decision,
                replicas=[replica(1)],
            ),
        ),
    )


def test_status_result_keys() -> None:
    doc = dumped(status_result())
    assert list(doc) == [
        "service",
        "fleet",
        "state",
        "endpoint",
        "api_key_file",
        "scaler",
        "groups",
        "routers",
        "failover_address",
        "model",
        "health",
        "unreachable",
    ]
    assert doc["scaler"] == {
        "running": True,
        "rps": 3.25,
        "recorded_at": 1700000000.5,
        "hosts": {},
        "fenced": [],
        "mode": "act",
        "budget": None,
    }
    assert (doc["health"], doc["unreachable"]) == ("serving", {})
    assert list(doc["groups"]) == ["router", "prefill", "decode"]
    assert doc["groups"]["router"] == {
        "host": "cpu1",
        "address": "10.0.0.1",
        "port": 8000,
        "state": "ready",
        "unit": "pd-svc-router",
    }
    for role in ("prefill", "decode"):
        assert list(doc["groups"][role]) == [
            "min",
            "max",
            "desired",
            "pinned",
            "running",
            "last_decision",
            "replicas",
            "spares",
            "host_loss",
        ]
    assert doc["groups"]["prefill"]["replicas"][1] == {
        "host": "gpu1",
        "slot": 2,
        "port": 8102,
        "gpus": [2],
        "state": "failed",
        "registered": False,
        "router_status": None,
        "healthy": None,
        "stale": True,
        "restarts": 3,
        "last_log": "OOM",
    }
    assert (doc["groups"]["prefill"]["pinned"], doc["groups"]["decode"]["desired"]) == (1, 2)


def test_a_recorded_decision_is_dumped_as_the_scaler_records_it() -> None:
    doc = dumped(status_result())
    decision = status_result().groups.decode.last_decision
    assert decision is not None
    assert doc["groups"]["decode"]["last_decision"] == decision.to_dict()
    assert list(doc["groups"]["decode"]["last_decision"]) == list(decision.to_dict())
    assert doc["groups"]["prefill"]["last_decision"] is None
    # What status reads back from the scaler's record validates into the same decision.
    again = GroupStatus.model_validate({**doc["groups"]["decode"]})
    assert again.last_decision == decision


def test_status_groups_by_role() -> None:
    groups = status_result().groups
    assert groups.worker("prefill") is groups.prefill
    assert groups.worker("decode") is groups.decode


def test_destroy_result_keys() -> None:
    doc = dumped(DestroyResult(service="svc", deregistered=["decode/1"], hosts=["cpu1", "gpu1"]))
    assert doc == {
        "service": "svc",
        "deregistered": ["decode/1"],
        "hosts": ["cpu1", "gpu1"],
        "dry_run": False,
        "would_remove": {},
    }
    assert list(doc) == ["service", "deregistered", "hosts", "dry_run", "would_remove"]


def test_endpoint_result_has_an_api_key_only_when_asked() -> None:
    without = dumped(EndpointResult(service="svc", endpoint="http://10.0.0.1:8000"))
    assert without == {"service": "svc", "endpoint": "http://10.0.0.1:8000", "endpoints": []}
    shown = dumped(EndpointResult(service="svc", endpoint="http://10.0.0.1:8000", api_key="k1"))
    assert list(shown) == ["service", "endpoint", "endpoints", "api_key"]
    assert shown["api_key"] == "k1"


@pytest.mark.parametrize(
    "result",
    [
        EndpointResult(service="svc", endpoint="http://10.0.0.1:8000"),
        DestroyResult(service="svc", deregistered=[], hosts=["cpu1"]),
        status_result(),
    ],
    ids=["endpoint", "destroy", "status"],
)
def test_json_mode_prints_the_dump_alone(result: Any, capsys: pytest.CaptureFixture[str]) -> None:
    Output(json_mode=True).result(result, lambda: pytest.fail("rendered in JSON mode"))
    printed = capsys.readouterr().out
    assert json.loads(printed) == result.model_dump(mode="json")
    assert printed == json.dumps(result.model_dump(mode="json"), indent=2) + "\n"
