"""Several routers as pd_router writes them: each router's unit (on its own by default; with
pdctl.router.mesh the mesh over mutual TLS, its peers, the mesh key as a systemd credential),
keepalived's config (unicast peers, nopreempt,
the address on the router's interface), keepalived's check of the local router."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from pdctl.core import layout
from pdctl.core.plan import Plan, build
from pdctl.core.spec import parse
from tests import role_templates
from tests.unit.core.plan.test_placement import ENV, REPO, fleet, host

CHECK = REPO / "pdctl" / "onhost" / "router_check.py"
NET = {"interface": "eth0", "prefix": 24, "network": "10.0.0.0/24", "in_subnet": True}


def plan_vars(
    routers: int, address: str | None = "10.0.0.200", mesh: bool = False
) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples/lab/pd.yml").read_text())
    doc["replicas"][0]["count"] = routers
    if address:
        doc["pdctl"]["router"]["address"] = address
    if mesh:
        doc["pdctl"]["router"]["mesh"] = True
    spec, env = parse(yaml.safe_dump(doc), Path("pd.yml"), ENV)
    hosts = [host("cpu1", "cpu"), host("cpu2", "cpu"), host("gpu1"), host("gpu2")]
    plan: Plan = build(spec, env, fleet(*hosts), secrets_digest="")
    return plan.extravars()


def exec_start(unit: str) -> str:
    lines = unit.split("ExecStart=", 1)[1].splitlines()
    words = []
    for line in lines:
        words.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return " ".join(words)


def test_two_routers_run_on_their_own_by_default() -> None:
    # Without the mesh: pdctl registers every worker on each (SMG 1.13's mesh costs each
    # router half a core, idle: docs/facts.md).
    extra = plan_vars(2)
    assert extra["pd_router"]["mesh"] is False
    for me in ("cpu1", "cpu2"):
        unit = role_templates.router_unit(extra, host=me)
        assert "--host 0.0.0.0 --port 8000" in exec_start(unit)
        assert "mesh" not in unit and "LoadCredential" not in unit


def test_each_of_two_routers_meshes_with_the_other_over_mutual_tls() -> None:
    extra = plan_vars(2, mesh=True)
    where = extra["pd_layout"]
    for me, peer in (("cpu1", "10.0.0.6"), ("cpu2", "10.0.0.5")):
        unit = role_templates.router_unit(extra, host=me)
        own = next(r["address"] for r in extra["pd_router"]["replicas"] if r["host"] == me)
        line = exec_start(unit)
        assert "--host 0.0.0.0 --port 8000" in line  # the failover address may come here
        assert f"--enable-mesh --mesh-server-name pdlab-{own}" in line
        assert f"--mesh-host {own} --mesh-advertise-host {own} --mesh-port 39527" in line
        assert f"--mesh-peer-urls {peer}:39527 " in line
        assert f"--mesh-tls-ca-cert {where['mesh_ca_cert']}" in line
        assert f"--mesh-tls-cert {where['mesh_cert']} --mesh-tls-key %d/mesh.key" in line
        # The key reaches SMG's dynamic user as a credential; the file stays root-only.
        assert f"\nLoadCredential=mesh.key:{where['mesh_key']}\n" in unit
        assert "DynamicUser=yes" in unit


def test_one_router_without_an_address_listens_on_its_own_and_has_no_mesh() -> None:
    extra = plan_vars(1, address=None)
    unit = role_templates.router_unit(extra)
    assert "--host 10.0.0.5 --port 8000" in exec_start(unit)
    assert "mesh" not in unit and "LoadCredential" not in unit


@pytest.mark.parametrize("routers", [1, 2])
def test_the_units_read_the_same_with_or_without_trim_blocks(routers: int) -> None:
    extra = plan_vars(routers)
    assert role_templates.router_unit(extra) == role_templates.router_unit(extra, trim_blocks=True)
    assert role_templates.keepalived_conf(extra, "cpu1", NET) == role_templates.keepalived_conf(
        extra, "cpu1", NET, trim_blocks=True
    )


def test_keepalived_holds_the_address_by_unicast_and_never_preempts() -> None:
    extra = plan_vars(2)
    where = extra["pd_layout"]
    first = role_templates.keepalived_conf(extra, "cpu1", NET)
    second = role_templates.keepalived_conf(extra, "cpu2", NET)
    for text, own, peer, priority in (
        (first, "10.0.0.5", "10.0.0.6", 150),
        (second, "10.0.0.6", "10.0.0.5", 149),
    ):
        body = " ".join(text.split())
        assert "state BACKUP nopreempt interface eth0 virtual_router_id 200" in body
        assert f"priority {priority} advert_int 1 " in body
        assert f"unicast_src_ip {own}" in body
        assert "garp_master_repeat 3 garp_master_delay 1 garp_master_refresh 60" in body
        assert f"unicast_peer {{ {peer} }}" in body
        assert "virtual_ipaddress { 10.0.0.200/24 dev eth0 }" in body
        assert "track_script { pd_pdlab_router }" in body
        assert "script_user root enable_script_security" in body
        check = f"{where['router_check']} health {own} 8000 2 {where['keepalived_state']}"
        assert check in text
        assert "interval 2" in body and "fall 3" in body and "rise 2" in body
        assert f"{where['router_check']} notify {where['keepalived_state']}" in text
        assert "-I -S" in text  # the check starts fast on a busy host
        assert "multicast" not in body.replace("no multicast", "")


def test_a_lone_router_holds_its_address_without_peers() -> None:
    text = role_templates.keepalived_conf(plan_vars(1), "cpu1", NET)
    assert "unicast_peer" not in text and "unicast_src_ip" not in text
    assert "virtual_ipaddress {\n        10.0.0.200/24 dev eth0\n    }" in text


def test_keepalived_runs_apart_from_the_hosts_own() -> None:
    extra = plan_vars(2)
    where = extra["pd_layout"]
    unit = role_templates.keepalived_unit(extra)
    line = exec_start(unit)
    assert line.startswith("/usr/sbin/keepalived --dont-fork --log-console --no-syslog --vrrp")
    assert f"--use-file={where['keepalived_conf']}" in line
    for pid in ("--pid=", "--vrrp_pid=", "--checkers_pid="):
        assert f"{pid}{where['keepalived_run_dir']}/" in line
    assert f"RuntimeDirectory={where['keepalived_run_dir'].removeprefix('/run/')}\n" in unit
    assert where["keepalived_unit"] == layout.keepalived_unit("pdlab")
    assert where["keepalived_state"].startswith(where["keepalived_run_dir"] + "/")


# --------------------------------------------------------------------------- the check


class _Router(http.server.BaseHTTPRequestHandler):
    answers: ClassVar[dict[str, int]] = {"/health": 200, "/readiness": 503}

    def do_GET(self) -> None:
        self.send_response(self.answers.get(self.path, 404))
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def router() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()


def check(*args: str) -> int:
    return subprocess.run(
        [sys.executable, "-I", "-S", str(CHECK), *args], check=False, timeout=30
    ).returncode


def test_the_holder_stays_while_its_router_lives_a_backup_takes_over_only_ready(
    router: int, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    port = str(router)
    assert check("notify", str(state), "INSTANCE", "pd_x", "MASTER", "150") == 0
    assert state.read_text() == "MASTER\n" and state.stat().st_mode & 0o777 == 0o644
    assert check("health", "127.0.0.1", port, "2", str(state)) == 0  # /health: 200
    check("notify", str(state), "INSTANCE", "pd_x", "BACKUP", "150")
    assert check("health", "127.0.0.1", port, "2", str(state)) == 1  # /readiness: 503
    _Router.answers = {"/health": 200, "/readiness": 200}
    try:
        assert check("health", "127.0.0.1", port, "2", str(tmp_path / "none")) == 0
    finally:
        _Router.answers = {"/health": 200, "/readiness": 503}
    assert check("health", "127.0.0.1", "1", "1", str(state)) == 1  # nothing listens
    assert check("notify", str(state), "INSTANCE", "pd_x", "bogus", "1") == 1
    assert state.read_text() == "BACKUP\n"
    assert check("what") == 2
