"""`pdctl endpoint` without a lab: the error path, and no SSH unless the key is asked for.

The lab test (tests/integration/test_deploy.py) reads the key from a real router host.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from pdctl.core.fleet_model import Fleet
from pdctl.core.plan import build
from pdctl.core.spec import parse
from pdctl.doors import inventory
from pdctl.doors import service as services
from pdctl.doors.workspace import Workspace
from tests.support import pdctl
from tests.unit.core.plan.test_placement import ENV, REPO, host, lab_spec


def deployed(home: Path, port: int) -> None:
    """A workspace as a deploy of the lab example leaves it, every host at 127.0.0.1:PORT."""
    hosts = [host("cpu1", "cpu"), host("gpu1"), host("gpu2")]
    for each in hosts:
        each.address, each.port = "127.0.0.1", port
    fleet = Fleet(name="f", hosts=hosts)
    inventory.save(Workspace(home), fleet)
    spec, env = lab_spec()
    services.save_plan(Workspace(home), build(spec, env, fleet, secrets_digest=""))


def test_unknown_service_is_not_found(workspace: Path) -> None:
    for show_key in ((), ("--show-key",)):
        proc = pdctl(workspace, "--json", "endpoint", "nosuch", *show_key, check=False)
        assert proc.returncode == 7
        error = json.loads(proc.stdout)["error"]
        assert error["kind"] == "not_found" and "'nosuch'" in error["message"]
    human = pdctl(workspace, "endpoint", "nosuch", check=False)
    assert human.returncode == 7 and "Traceback" not in human.stderr
    assert len(human.stderr.strip().splitlines()) == 1


def test_the_url_needs_no_host(workspace: Path, listener: socket.socket) -> None:
    deployed(workspace, listener.getsockname()[1])
    doc = json.loads(pdctl(workspace, "--json", "endpoint", "pdlab").stdout)
    assert doc == {
        "service": "pdlab",
        "endpoint": "http://127.0.0.1:8000",
        "endpoints": ["http://127.0.0.1:8000"],
    }
    human = pdctl(workspace, "endpoint", "pdlab").stdout
    assert "http://127.0.0.1:8000" in human and "pdctl endpoint pdlab --show-key" in human
    with pytest.raises(BlockingIOError):
        listener.accept()  # no host was contacted


def two_routers(home: Path, address: str | None) -> None:
    """A workspace after a deploy of the lab example with two routers (cpu1, cpu2)."""
    hosts = [host("cpu1", "cpu"), host("cpu2", "cpu"), host("gpu1"), host("gpu2")]
    for number, each in enumerate(hosts, start=1):
        each.address = f"10.0.0.{10 + number}"
    fleet = Fleet(name="f", hosts=hosts)
    inventory.save(Workspace(home), fleet)
    doc = yaml.safe_load((REPO / "examples/lab/pd.yml").read_text())
    doc["replicas"][0]["count"] = 2
    if address:
        doc["pdctl"]["router"]["address"] = address
    spec, env = parse(yaml.safe_dump(doc), Path("pd.yml"), ENV)
    services.save_plan(Workspace(home), build(spec, env, fleet, secrets_digest=""))


def test_two_routers_give_the_address_or_every_url(workspace: Path) -> None:
    routers = ["http://10.0.0.11:8000", "http://10.0.0.12:8000"]
    two_routers(workspace, "10.0.0.200")
    doc = json.loads(pdctl(workspace, "--json", "endpoint", "pdlab").stdout)
    assert doc["endpoint"] == "http://10.0.0.200:8000" and doc["endpoints"] == routers
    assert "every router" not in pdctl(workspace, "endpoint", "pdlab").stdout
    two_routers(workspace, None)  # no address: clients that fail over themselves take both
    doc = json.loads(pdctl(workspace, "--json", "endpoint", "pdlab").stdout)
    assert doc["endpoint"] == routers[0] and doc["endpoints"] == routers
    human = pdctl(workspace, "endpoint", "pdlab").stdout
    assert f"every router: {routers[0]} {routers[1]}" in human


def test_an_unreachable_router_host_is_a_host_error(workspace: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on: the connection is refused
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    deployed(workspace, closed)
    proc = pdctl(workspace, "--json", "endpoint", "pdlab", "--show-key", check=False)
    assert proc.returncode == 4
    error = json.loads(proc.stdout)["error"]
    assert error["kind"] == "host" and "api_key" not in proc.stdout
