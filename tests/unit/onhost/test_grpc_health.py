"""The h2c gRPC health call (pdctl/onhost/grpc_health.py) against a real grpcio server on loopback:
healthy, unhealthy, a failed call, the standard health service, a peer that is no gRPC server;
and the host probe (pdctl/onhost/unit_probe.py, from its bundle, as the roles
run it) reporting the same."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdctl.onhost import bundle
from pdctl.onhost.grpc_health import (
    GRPC_HEALTH_CHECK,
    GRPC_STANDARD_HEALTH,
    grpc_call,
    grpc_healthy,
)

PROBE = "pdctl.onhost.unit_probe"
REPO = Path(__file__).resolve().parents[3]


class Answers:
    """What the server's health methods answer next (bytes: a message; None: UNAVAILABLE)."""

    vllm: bytes | None = b"\x08\x01"
    standard: bytes | None = b"\x08\x01"
    calls: int = 0


def _handler(name: str) -> Any:
    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        Answers.calls += 1
        reply = getattr(Answers, name)
        if reply is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        return reply

    return grpc.unary_unary_rpc_method_handler(answer)  # no (de)serializers: raw bytes


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    grpc_server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "vllm.grpc.engine.VllmEngine", {"HealthCheck": _handler("vllm")}
            ),
            grpc.method_handlers_generic_handler(
                "grpc.health.v1.Health", {"Check": _handler("standard")}
            ),
        )
    )
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield port
    grpc_server.stop(None)


@pytest.fixture(autouse=True)
def _reset() -> None:
    Answers.vllm = Answers.standard = b"\x08\x01"


def _ask(port: int, path: str = GRPC_HEALTH_CHECK) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as stream:
        return grpc_healthy(stream, f"127.0.0.1:{port}", path)


def test_a_healthy_worker_is_healthy(server: int) -> None:
    before = Answers.calls
    assert _ask(server)
    assert Answers.calls == before + 1  # the server ran the method: the call really went


def test_unhealthy_answers_and_failed_calls_are_not_healthy(server: int) -> None:
    Answers.vllm = b""  # healthy = false is proto3's default: an empty message
    assert not _ask(server)
    Answers.vllm = b"\x08\x00\x12\x07loading"
    assert not _ask(server)
    Answers.vllm = None  # UNAVAILABLE: a trailers-only answer, no message
    assert not _ask(server)


def test_field_one_is_found_after_other_fields(server: int) -> None:
    Answers.vllm = b"\x12\x02ok\x08\x01"  # message = "ok", then healthy = true
    assert _ask(server)


def test_the_standard_health_service_reads_the_same(server: int) -> None:
    assert _ask(server, GRPC_STANDARD_HEALTH)
    Answers.standard = b"\x08\x02"  # NOT_SERVING
    assert not _ask(server, GRPC_STANDARD_HEALTH)


def test_an_unknown_method_is_not_healthy(server: int) -> None:
    assert not _ask(server, "/vllm.grpc.engine.VllmEngine/NoSuchMethod")


def test_a_long_path_and_authority_encode(server: int) -> None:
    # Past HPACK's 7-bit length prefix: a multi-byte length must still parse on the server.
    with socket.create_connection(("127.0.0.1", server), timeout=5) as stream:
        assert grpc_call(stream, "h" * 300 + ":1", GRPC_HEALTH_CHECK, b"", 5) == b"\x08\x01"


@pytest.fixture(scope="module")
def http_server() -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # a worker that speaks HTTP/1 only
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def test_a_peer_that_is_no_grpc_server_is_not_healthy(http_server: int) -> None:
    assert not _ask(http_server)


def _probe(url: str) -> dict[str, Any]:
    """The host probe as the roles run it: the loader's line, then URL UNIT TIMEOUT, and the
    bundle of pdctl/onhost/unit_probe.py on stdin."""
    unit = "pdctl-test-no-such.service"
    proc = subprocess.run(
        bundle.argv(PROBE, [url, unit, "5"], python=sys.executable),
        input=bundle.stdin(PROBE),
        capture_output=True,
        check=True,
        timeout=60,
    )
    return dict(json.loads(proc.stdout))


def test_the_host_probe_asks_a_grpc_worker(server: int) -> None:
    assert _probe(f"grpc://127.0.0.1:{server}")["status"] == 200
    Answers.vllm = None
    assert _probe(f"grpc://127.0.0.1:{server}")["status"] == 503
    # The method the URL names (a plan's probe_url): grpc.health.v1 for SGLang's gRPC mode.
    assert _probe(f"grpc://127.0.0.1:{server}{GRPC_STANDARD_HEALTH}")["status"] == 200
    assert _probe(f"grpc://127.0.0.1:{server}{GRPC_HEALTH_CHECK}")["status"] == 503
    Answers.standard = None
    assert _probe(f"grpc://127.0.0.1:{server}{GRPC_STANDARD_HEALTH}")["status"] == 503
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert _probe(f"grpc://127.0.0.1:{port}")["status"] == 0


PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  vars_files: [{vars}]
  tasks:
    - name: Probe as the pd_health role does
      ansible.builtin.command:
        argv: "{{{{ pd_health_probe.argv + ['{url}', 'x.service', '5'] }}}}"
        stdin: "{{{{ pd_health_probe.stdin }}}}"
      register: probe
    - name: Keep what it printed
      ansible.builtin.copy:
        content: "{{{{ probe.stdout }}}}"
        dest: {out}
        mode: "0600"
"""


def test_the_pd_health_probe_runs_from_its_bundle(server: int, tmp_path: Path) -> None:
    """What the playbooks give the pd_health role (playbooks/group_vars/all.yml: the pd_onhost
    lookup), run by Ansible with the project's ansible.cfg as the role's wait does: the probe and
    its gRPC call reach python3 as one bundle."""
    playbook = tmp_path / "probe.yml"
    playbook.write_text(
        PLAYBOOK.format(
            vars=REPO / "playbooks/group_vars/all.yml",
            url=f"grpc://127.0.0.1:{server}",
            out=tmp_path / "out.json",
        )
    )
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), str(playbook)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            "PATH": "/usr/bin:/bin",
            "ANSIBLE_NOCOLOR": "1",
            "HOME": str(tmp_path),
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        },
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "out.json").read_text())["status"] == 200
