"""pdctl/onhost/hardware/collect.py for real: on this machine, over the lab's fake tools (read
back through facts()), its peer probes, and run from its bundle as a host runs it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost import bundle
from pdctl.onhost.hardware import collect as hw_collect
from pdctl.onhost.hardware import paths
from pdctl.onhost.hardware.checks import Expectations, evaluate
from pdctl.onhost.hardware.collect import collect
from pdctl.onhost.hardware.facts import facts
from tests.unit.onhost.hardware.samples import (
    CPU,
    HOST,
    PDFAKE,
    PROVIDER,
    REF_PROVIDER_WARNING,
    ROOT,
    failing,
)


def test_run_command_missing_unexecutable_and_timeout(tmp_path: Path) -> None:
    assert hw_collect.run_command(["pd-no-such-tool", "--x"])["rc"] == 127
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\necho hi\n")
    result = hw_collect.run_command([str(plain)])
    assert (result["rc"], result["stdout"]) == (126, "")
    assert "Permission denied" in result["stderr"]
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\necho started\nsleep 30\n")
    slow.chmod(0o755)
    started = time.monotonic()
    result = hw_collect.run_command([str(slow)], timeout=0.5)
    assert time.monotonic() - started < 15  # killed at its timeout, long before its 30 s sleep
    assert (result["rc"], result["stdout"]) == (124, "started\n")
    assert result["stderr"].startswith(f"{slow}: timed out after 0.5 s")


def test_collect_on_this_machine_without_any_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    started = time.monotonic()
    raw = collect(PROVIDER, ["/nonexistent-storage", str(tmp_path)], [])
    assert time.monotonic() - started < 10  # no tool waited for: each would take its 20 s timeout
    commands = raw["commands"]
    assert list(commands) == [
        "ibv_devices",
        "ibv_devinfo",
        "amd_smi_list",
        "amd_smi_static",
        "rocm_smi",
        "podman_version",
        "docker_version",
        "systemctl",
    ]
    assert {k: c["rc"] for k, c in commands.items()} == dict.fromkeys(commands, 127)
    assert commands["ibv_devinfo"] == {
        "argv": ["ibv_devinfo", "-v"],
        "rc": 127,
        "stdout": "",
        "stderr": "ibv_devinfo: command not found (No such file or directory)",
    }
    assert raw["storage"]["path"] == str(tmp_path)
    assert raw["storage"]["free_bytes"] > 0
    assert raw["provider_lib"]["path"] == PROVIDER
    assert raw["python"] == ".".join(map(str, sys.version_info[:3]))
    assert raw["cpus"] == os.cpu_count()
    assert json.loads(json.dumps(raw)) == raw
    summary = facts(raw)
    assert summary["gpus"]["source"] is None and summary["runtime"]["name"] is None
    assert summary["errors"] == []


@pytest.mark.skipif(
    any(shutil.which(t) for t in ("ibv_devices", "ibv_devinfo", "amd-smi", "rocm-smi")),
    reason="this machine has real RDMA/ROCm tools",
)
def test_collect_on_this_machine_with_its_path() -> None:
    raw = collect(PROVIDER, ["/"], [])
    for key in ("ibv_devices", "ibv_devinfo", "amd_smi_list", "amd_smi_static", "rocm_smi"):
        assert raw["commands"][key]["rc"] == 127, key
    assert raw["os"]["id"]
    assert raw["kernel"] == os.uname().release
    assert raw["memory_bytes"] > 0
    assert raw["hostname"] == socket.gethostname()


def test_collect_tries_memlock_unlimited_as_the_runtime_would() -> None:
    """The probe's answer follows the rules setrlimit(2) applies to this very machine."""
    memlock = collect(PROVIDER, ["/"], [])["memlock"]
    may_raise = memlock["euid"] == 0 and memlock["cap_sys_resource"] is not False
    assert memlock["unlimited"] == (memlock["hard"] is None or may_raise)
    if not memlock["unlimited"]:
        assert memlock["error"] == "ValueError: not allowed to raise maximum limit"
        assert memlock["hard"] is not None


FAKE_PODMAN = """\
#!/bin/sh
case "$1" in
  --version) echo "podman version 4.3.1" ;;
  info) echo '{"host": {"arch": "amd64"}, "store": {"graphRoot": "/var/lib/containers"}}' ;;
  *) echo "Error: unknown command $1" >&2; exit 125 ;;
esac
"""


FAKE_SYSTEMCTL = '#!/bin/sh\n[ "$1" = is-system-running ] && echo running\n'


class FakeHost:
    """A bin dir of fake tools on PATH, the fake hardware state, and host files under tmp."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        for tool in ("ibv_devices", "ibv_devinfo", "amd-smi", "rocm-smi"):
            (self.bin / tool).symlink_to(PDFAKE)
        for tool in ("ib_write_bw", "ib_write_lat"):  # the lab's perftest stand-in
            (self.bin / tool).symlink_to(PDFAKE.with_name("pdperf.py"))
        for name, text in (("podman", FAKE_PODMAN), ("systemctl", FAKE_SYSTEMCTL)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.state_file = tmp / "state.json"
        self.provider = tmp / "libbnxt_re-rdmav34.so"
        self.provider.write_bytes(b"\x7fELF fake\n")
        (tmp / "kfd").touch()
        (tmp / "dri").mkdir()
        for i in range(8):
            (tmp / "dri" / f"renderD{128 + i}").touch()
        (tmp / "systemd").mkdir()
        self.storage = tmp / "storage"
        self.storage.mkdir()
        monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("PDFAKE_STATE", str(self.state_file))
        monkeypatch.setenv("PDFAKE_PROVIDER_LIB", str(self.provider))
        monkeypatch.setattr(hw_collect, "KFD_PATH", str(tmp / "kfd"))
        monkeypatch.setattr(hw_collect, "DRI_DIR", str(tmp / "dri"))
        monkeypatch.setattr(hw_collect, "SYSTEMD_RUN_DIR", str(tmp / "systemd"))
        # A bare-metal host's root may raise rlimits, whatever this machine allows.
        monkeypatch.setattr(hw_collect, "MEMLOCK_PROBE", "")
        self.state(host_index=1)

    def state(self, **state: Any) -> None:
        self.state_file.write_text(json.dumps(state))

    def collect(self, peers: list[tuple[str, int]] | None = None) -> dict[str, Any]:
        return collect(str(self.provider), [str(self.storage)], peers or [])

    def expect(self) -> Expectations:
        return Expectations(kind="gpu", provider_lib=str(self.provider))


@pytest.fixture
def fake_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHost:
    return FakeHost(tmp_path, monkeypatch)


def test_fakes_healthy_host_end_to_end(fake_host: FakeHost) -> None:
    started = time.monotonic()
    raw = fake_host.collect()
    assert time.monotonic() - started < 10  # no tool waited for: each would take its 20 s timeout
    assert "rocm_smi" not in raw["commands"]  # amd-smi answered
    assert raw["commands"]["ibv_devinfo"]["argv"] == ["ibv_devinfo", "-v"]
    assert (raw["kfd"], raw["systemd"], len(raw["render_nodes"])) == (True, True, 8)
    summary = facts(raw)
    assert summary["gpus"]["count"] == 8
    assert summary["gpus"]["model"] == "MI300X"
    assert summary["gpus"]["bdfs"][0] == "0000:05:00.0"
    assert [d["name"] for d in summary["rdma"]["devices"]] == [f"bnxt_re{k}" for k in range(8)]
    assert summary["runtime"] == {"name": "podman", "version": "4.3.1", "usable": True}
    assert summary["errors"] == []
    checks = evaluate(HOST, raw, fake_host.expect())
    assert failing(checks) == {}, failing(checks)


def test_fakes_nic_missing_and_port_down_end_to_end(fake_host: FakeHost) -> None:
    fake_host.state(host_index=1, missing_nics=["bnxt_re7"], down_ports=["bnxt_re3"])
    bad = failing(evaluate(HOST, fake_host.collect(), fake_host.expect()))
    assert list(bad) == ["rdma_devices", "rdma_ports"]
    assert "does not list bnxt_re7 (expected bnxt_re0..bnxt_re7)" in bad["rdma_devices"]
    assert bad["rdma_ports"].startswith("node2: bnxt_re3 port 1 is PORT_DOWN (1);")
    named = bad["rdma_devices"].split("(expected")[0] + bad["rdma_ports"]
    for healthy in ("bnxt_re0", "bnxt_re1", "bnxt_re2", "bnxt_re4", "bnxt_re5", "bnxt_re6"):
        assert healthy not in named


def test_fakes_provider_lib_missing_end_to_end(fake_host: FakeHost) -> None:
    fake_host.provider.unlink()
    raw = fake_host.collect()
    assert raw["commands"]["ibv_devinfo"]["rc"] == 255
    summary = facts(raw)
    assert summary["rdma"]["warnings"] == [REF_PROVIDER_WARNING]
    bad = failing(evaluate(HOST, raw, fake_host.expect()))
    assert list(bad) == ["rdma_devices", "rdma_ports", "provider_lib", "roce_gid"]
    assert bad["provider_lib"].startswith(
        "node2: libibverbs could not load libbnxt_re-rdmav34.so: cannot open shared object file"
    )
    assert str(fake_host.provider) in bad["provider_lib"]


def test_fakes_gpu_missing_gpu_data_format(fake_host: FakeHost) -> None:
    fake_host.state(host_index=1, missing_gpus=[2], amd_smi_format="gpu_data")
    raw = fake_host.collect()
    summary = facts(raw)
    assert summary["gpus"]["count"] == 7
    assert "0000:46:00.0" not in summary["gpus"]["bdfs"]
    assert failing(evaluate(HOST, raw, fake_host.expect())) == {
        "gpus": (
            "node2: amd-smi lists 7 GPUs, expected 8 MI300X GPUs; find the missing one with "
            "amd-smi list and dmesg | grep -i amdgpu (a GPU that fails to initialise drops out "
            "of the list)"
        )
    }


def test_fakes_amdgpu_not_loaded_falls_back_to_rocm_smi(fake_host: FakeHost) -> None:
    fake_host.state(host_index=1, amdgpu_driver=False)
    raw = fake_host.collect()
    assert raw["commands"]["amd_smi_list"]["rc"] == 255
    assert raw["commands"]["rocm_smi"]["rc"] == 0  # rocm-smi exits 0 with no GPU
    summary = facts(raw)
    assert summary["gpus"]["count"] == 0
    assert any("Driver not initialized" in e for e in summary["errors"])
    message = failing(evaluate(HOST, raw, fake_host.expect()))["gpus"]
    assert message.startswith("node2: rocm-smi lists 0 GPUs, expected 8 MI300X GPUs")


def test_fakes_cpu_host(fake_host: FakeHost) -> None:
    fake_host.state(host_index=1, gpus=0, nics=0)
    raw = fake_host.collect()
    summary = facts(raw)
    assert summary["gpus"]["count"] == 0
    assert summary["rdma"]["devices"] == []
    checks = evaluate(HOST, raw, Expectations(kind="cpu"))
    assert failing(checks) == {}
    assert [c.name for c in checks if c.skipped] == [
        "gpus",
        "rdma_devices",
        "rdma_ports",
        "provider_lib",
        "roce_gid",
        "perftest",
        "memlock",
    ]


def test_fakes_no_runtime(fake_host: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    (fake_host.bin / "podman").unlink()
    monkeypatch.setenv("PATH", f"{fake_host.bin}{os.pathsep}/usr/bin{os.pathsep}/bin")
    if shutil.which("docker") or shutil.which("podman"):
        pytest.skip("a runtime is installed in /usr/bin here")
    raw = fake_host.collect()
    assert "podman_info" not in raw["commands"] and "docker_info" not in raw["commands"]
    assert failing(evaluate(HOST, raw, fake_host.expect()))["runtime"].startswith(
        "node2: no container runtime"
    )


@pytest.fixture
def listener() -> Iterator[int]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def closed_port() -> int:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port: int = probe.getsockname()[1]
    probe.close()
    return port


def test_reach_counts_open_and_refusing_ports_as_reachable(listener: int, tmp_path: Path) -> None:
    closed = closed_port()
    raw = collect(PROVIDER, [str(tmp_path)], [("127.0.0.1", listener), ("127.0.0.1", closed)])
    assert raw["reach"] == [
        {"address": "127.0.0.1", "port": listener, "ok": True, "error": None},
        # refused: the host answered, so the path between the hosts works
        {"address": "127.0.0.1", "port": closed, "ok": True, "error": None, "refused": True},
    ]
    checks = {c.name: c for c in evaluate(HOST, raw, CPU)}
    assert checks["mesh"].ok and "reached all 2 peers" in checks["mesh"].message


def test_reach_rejects_malformed_peers(tmp_path: Path) -> None:
    raw = collect(PROVIDER, [str(tmp_path)], [("127.0.0.1", "22"), ["only-address"]])  # type: ignore[list-item]
    assert [r["error"] for r in raw["reach"]] == ["invalid peer", "invalid peer"]


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A loopback port whose accept queue is full: further connects hang until they time out."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    held = []
    for _ in range(16):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.settimeout(0.3)
        try:
            client.connect(("127.0.0.1", port))
        except OSError:
            client.close()
            break
        held.append(client)
    else:
        server.close()
        pytest.skip("this kernel never fills a loopback accept queue")
    yield port
    for client in held:
        client.close()
    server.close()


def test_reach_forty_hanging_peers_run_concurrently(full_backlog: int, tmp_path: Path) -> None:
    peers = [("127.0.0.1", full_backlog)] * 40
    started = time.monotonic()
    raw = collect(PROVIDER, [str(tmp_path)], peers)
    elapsed = time.monotonic() - started
    assert elapsed < 8, elapsed  # serially: 40 x 2 s
    assert len(raw["reach"]) == 40
    assert {r["error"] for r in raw["reach"]} == {"timed out after 2 s"}


PY39 = sorted((Path.home() / ".pyenv" / "versions").glob("3.9*/bin/python3"))


PYTHONS = [sys.executable, *[str(p) for p in PY39[:1]]]


COLLECT = "pdctl.onhost.hardware.collect"


def _collect_on_host(python: str, request: str, env: dict[str, str] | None = None) -> Any:
    """collect.py as pdctl runs it on a host: the loader's line, its bundle and the request."""
    return subprocess.run(
        [python, "-I", "-c", bundle.BOOT, COLLECT],
        input=bundle.stdin(COLLECT) + request.encode(),
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: Path(p).parent.parent.name or p)
def test_collection_runs_from_its_bundle(python: str, listener: int, tmp_path: Path) -> None:
    request = {
        "provider_lib": str(tmp_path / "libbnxt_re-rdmav34.so"),
        "storage_paths": ["/nonexistent", str(tmp_path)],
        "peers": [["127.0.0.1", listener]],
    }
    proc = _collect_on_host(python, json.dumps(request))
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout)
    assert raw["schema"] == 1
    assert raw["storage"]["path"] == str(tmp_path)
    assert raw["provider_lib"] == {
        "path": request["provider_lib"],
        "exists": False,
        "elsewhere": [],
    }
    assert raw["reach"] == [{"address": "127.0.0.1", "port": listener, "ok": True, "error": None}]
    assert raw["commands"]["ibv_devices"]["argv"] == ["ibv_devices"]
    if "3.9" in python:
        assert raw["python"].startswith("3.9.")
    assert facts(raw)["hostname"] == socket.gethostname()


def test_collection_refuses_a_bad_request_with_exit_2() -> None:
    proc = _collect_on_host(sys.executable, json.dumps({"peers": "10.0.0.1", "typo": 1}))
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == {"error": "the request: unknown request keys: typo"}


def test_collection_runs_as_a_module_of_the_source_tree(tmp_path: Path) -> None:
    request = {"storage_paths": [str(tmp_path)], "peers": [], "provider_lib": "/nonexistent.so"}
    proc = subprocess.run(
        [sys.executable, "-m", COLLECT],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout)
    assert raw["storage"]["path"] == str(tmp_path)
    assert raw["provider_lib"]["path"] == "/nonexistent.so"


def test_an_empty_request_collects_with_the_defaults(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no tools: the output stays small
    proc = _collect_on_host(sys.executable, "", env=env)
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout)
    assert raw["storage"]["candidates"] == list(paths.DEFAULT_STORAGE_PATHS)
    assert raw["provider_lib"]["path"] == paths.DEFAULT_PROVIDER_LIB


def test_importing_the_module_does_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", f"import {COLLECT}"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
        check=False,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
