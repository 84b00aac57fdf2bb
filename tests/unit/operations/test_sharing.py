"""What other services hold: the hosts' report parsed strictly, and make_plan's gathering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.errors import HostError, InputError
from pdctl.core.plan import Held, held_by
from pdctl.doors import inventory
from pdctl.doors import service as services
from pdctl.doors.session import Session
from pdctl.doors.workspace import Workspace
from pdctl.onhost.holdings_probe import report
from pdctl.operations import deploy, planning, sharing
from tests.support import lab_service
from tests.unit.core.plan.test_placement import ENV, REPO, host, lab_fleet, place

ROUTER_UNIT = """[Service]
EnvironmentFile=/etc/pdctl/a/router.env
ExecStart=/opt/pdctl/smg-1/bin/python /opt/pdctl/a/router_launch.py \\
  --host 10.0.0.5 --port 8000 --pd-disaggregation \\
  --prometheus-host 127.0.0.1 --prometheus-port 29000 \\
  --worker-startup-check-interval 1
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_probe_reports_slots_and_listeners_and_no_secret(tmp_path: Path) -> None:
    write(
        tmp_path / "etc/pdctl/a/prefill-1.env",
        "PDCTL_SLOT=prefill/1\nPDCTL_PORT=30000\nPDCTL_GPU_IDS=0,1,2,3\n"
        "PDCTL_BOOTSTRAP_PORT=8998\nROCR_VISIBLE_DEVICES=0,1,2,3\n",
    )
    write(tmp_path / "etc/pdctl/a/decode-2.env", "PDCTL_PORT=31000\nPDCTL_GPU_IDS=4,5\n")
    write(tmp_path / "etc/pdctl/a/secrets.env", "HF_TOKEN=hf_secret\n")
    write(tmp_path / "etc/pdctl/a/router.env", "PDCTL_ROUTER_API_KEY=key_secret\n")
    write(tmp_path / "etc/pdctl/a/scaler.json", json.dumps({"metrics": {"port": 29100}}))
    write(tmp_path / "etc/systemd/system/pd-a-router.service", ROUTER_UNIT)
    text = json.dumps(report(tmp_path, sharing.PROBE_WHERE))
    assert "secret" not in text
    assert set(sharing.parse_report("h1", text)) == {
        Held("a", "h1", "prefill/1", gpus=(0, 1, 2, 3)),
        Held("a", "h1", "prefill/1", ports=(30000, 30299)),
        Held("a", "h1", "prefill/1's bootstrap port", ports=(8998, 8998)),
        Held("a", "h1", "decode/2", gpus=(4, 5)),
        Held("a", "h1", "decode/2", ports=(31000, 31299)),
        Held("a", "h1", "router", ports=(8000, 8000)),
        Held("a", "h1", "router's metrics", ports=(29000, 29000)),
        Held("a", "h1", "scaler's metrics", ports=(29100, 29100)),
    }


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[1, 2]",
        '{"slots": "x", "listeners": {"a": 1}}',
        json.dumps({"slots": [["../etc", "prefill-1", {"PDCTL_PORT": "30000"}]]}),
        json.dumps({"slots": [["A", "prefill-1", {"PDCTL_PORT": "30000"}]]}),
        json.dumps({"slots": [["a\n", "prefill-1", {"PDCTL_PORT": "30000"}]]}),
        json.dumps({"slots": [["a", "prefill-0", {"PDCTL_PORT": "30000"}]]}),
        json.dumps({"slots": [["a", "router", {"PDCTL_PORT": "30000"}]]}),
        json.dumps({"slots": [["a", "prefill-1", ["PDCTL_PORT", "30000"]]]}),
        json.dumps({"slots": [["a", "prefill-1"]]}),
        json.dumps(
            {
                "slots": [
                    [
                        "a",
                        "prefill-1",
                        {
                            "PDCTL_PORT": "70000",
                            "PDCTL_GPU_IDS": "0,x",
                            "PDCTL_BOOTSTRAP_PORT": "8998\n",
                        },
                    ],
                    ["a", "decode-1", {"PDCTL_PORT": 30000, "PDCTL_GPU_IDS": [0, 1]}],
                    ["a", "decode-2", {"PDCTL_PORT": "{{ lookup('pipe', 'id') }}"}],
                    ["a", "decode-3", {"PDCTL_PORT": "0", "PDCTL_GPU_IDS": "-1"}],
                    ["a", "decode-4", {"PDCTL_PORT": "08000", "PDCTL_GPU_IDS": "1,2,"}],
                ]
            }
        ),
        json.dumps(
            {
                "listeners": [
                    ["a", "--evil", "1"],
                    ["a", "scaler", "None"],
                    ["a", "--port", "$(reboot)"],
                    ["a;b", "--port", "8000"],
                    [1, "--port", "8000"],
                ]
            }
        ),
    ],
)
def test_host_output_that_does_not_parse_is_ignored(text: str) -> None:
    assert sharing.parse_report("h1", text) == []


def test_a_bad_value_drops_only_itself() -> None:
    text = json.dumps({"slots": [["a", "decode-1", {"PDCTL_PORT": "x", "PDCTL_GPU_IDS": "0,1"}]]})
    assert sharing.parse_report("h1", text) == [Held("a", "h1", "decode/1", gpus=(0, 1))]


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    """Fleet f of the unit tests' hosts: no host key pinned, so none can be read (or reached)."""
    ws = Workspace(tmp_path / "home")
    inventory.save(ws, lab_fleet())
    return ws


def make_plan(workspace: Workspace, *args: Any, **kwargs: Any) -> Any:
    """planning.make_plan as one command makes it: in a session of its own."""
    with Session(workspace) as session:
        return planning.make_plan(session, *args, **kwargs)


def spec_file(tmp_path: Path, name: str, port: int, metrics: int) -> Path:
    path = tmp_path / f"{name}.yml"
    path.write_text(lab_service((REPO / "examples/lab/pd.yml").read_text(), name, port, metrics))
    return path


def test_make_plan_goes_around_the_workspaces_other_services(
    workspace: Workspace, tmp_path: Path
) -> None:
    a = place("a")
    services.save_plan(workspace, a)
    elsewhere = place("z").model_copy(update={"fleet": "other"})  # another fleet: not held
    services.save_plan(workspace, elsewhere)
    warnings: list[str] = []
    _, _, b = make_plan(
        workspace, spec_file(tmp_path, "b", 8001, 29001), "f", environ=ENV, warn=warnings.append
    )
    assert b == place("b", held_by(a), port=8001, metrics=29001)
    assert {(s.host, tuple(s.gpus)) for s in b.slots()} == {
        ("gpu1", (4, 5, 6, 7)),
        ("gpu2", (4, 5, 6, 7)),
    }
    assert [w.split(":")[0] for w in warnings] == ["cpu1", "gpu1", "gpu2"]
    assert "no host key is pinned" in warnings[0]
    _, _, again = make_plan(
        workspace, spec_file(tmp_path, "a", 8000, 29000), "f", environ=ENV, warn=warnings.append
    )
    assert again == a  # its own stored plan is not in its way


def test_deploy_refuses_a_plan_on_hosts_it_could_not_read_naming_every_one(
    workspace: Workspace, tmp_path: Path
) -> None:
    with pytest.raises(HostError) as refused:
        make_plan(workspace, spec_file(tmp_path, "b", 8001, 29001), "f", environ=ENV)
    message = refused.value.message
    assert message.startswith("3 host(s) of the plan cannot be reached: cpu1: ")
    assert "; gpu1: " in message and "; gpu2: " in message
    assert "--skip-unreachable" in (refused.value.hint or "")
    assert refused.value.details["unreachable"] == ["cpu1", "gpu1", "gpu2"]


def test_skip_unreachable_plans_and_says_which_hosts_it_leaves(
    workspace: Workspace, tmp_path: Path
) -> None:
    unreachable: dict[str, str] = {}
    _, _, plan = make_plan(
        workspace, spec_file(tmp_path, "b", 8001, 29001), "f", environ=ENV, unreachable=unreachable
    )
    assert sorted(unreachable) == ["cpu1", "gpu1", "gpu2"]
    assert "no host key is pinned" in unreachable["gpu1"]
    left = deploy.without_hosts(plan, {"gpu1"})
    assert {s.host for s in left.slots()} == {s.host for s in plan.slots()} - {"gpu1"}
    assert left.router == plan.router


def test_hosts_that_placement_never_uses_are_not_read(workspace: Workspace) -> None:
    fleet = lab_fleet()
    fleet.hosts.append(host("gpu3", ok=False))
    with Session(workspace) as session:
        found = sharing.read_hosts(session, fleet, set())
    assert sorted(found.unread) == ["cpu1", "gpu1", "gpu2"] and found.held == []


def test_a_deploy_that_did_not_complete_holds_its_plan_too(
    workspace: Workspace, tmp_path: Path
) -> None:
    """A failed first deploy of a may have started its units: b goes around them."""
    a = place("a")
    directory = services.state_dir(workspace, "a")
    directory.mkdir(parents=True)
    (directory / services.APPLYING).write_text(a.model_dump_json())
    spec = spec_file(tmp_path, "b", 8001, 29001)
    _, _, b = make_plan(workspace, spec, "f", environ=ENV, warn=lambda _: None)
    assert b == place("b", held_by(a), port=8001, metrics=29001)


def test_an_unreadable_plan_of_another_service_refuses_the_plan(
    workspace: Workspace, tmp_path: Path
) -> None:
    directory = services.state_dir(workspace, "a")
    directory.mkdir(parents=True)
    (directory / services.PLAN).write_text("{not json")
    with pytest.raises(InputError, match=r"plan\.json is unreadable"):
        make_plan(workspace, spec_file(tmp_path, "b", 8001, 29001), "f", environ=ENV)
