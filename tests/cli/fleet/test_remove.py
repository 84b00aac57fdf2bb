"""`pdctl fleet remove` while a service deployed from the workspace uses the hosts."""

from __future__ import annotations

import json
from pathlib import Path

from pdctl.doors import inventory
from pdctl.doors.workspace import Workspace
from tests.support import pdctl
from tests.unit.operations.test_fleet import deployed


def test_a_host_in_use_is_refused_in_one_line_naming_the_service(workspace: Path) -> None:
    plan = deployed(Workspace(workspace))
    router = plan.router.host
    proc = pdctl(workspace, "fleet", "remove", "f", "--host", router, "-y", check=False)
    assert proc.returncode == 5 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: fleet f: hosts still in use (service {plan.service} has router on {router}) "
        "(`pdctl destroy SERVICE` first, or pass --force to forget the hosts and their keys "
        "anyway)"
    ]
    doc = json.loads(pdctl(workspace, "--json", "fleet", "remove", "f", check=False).stdout)
    assert doc["error"]["kind"] == "check_failed" and doc["error"]["exit_code"] == 5
    assert len(inventory.load(Workspace(workspace), "f").hosts) == 5  # nothing removed
    forced = pdctl(workspace, "--json", "fleet", "remove", "f", "--host", router, "--force")
    assert json.loads(forced.stdout)["removed_hosts"] == [router]
