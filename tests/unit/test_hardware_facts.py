"""pdctl/hardware.py's facts() on collect-shaped documents, and collect() for real: on this
machine, over the lab's fake tools, its peer probes, and as the script a host runs.
"""

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

from pdctl import hardware as hw
from pdctl.hardware import (
    CHECK_NAMES,
    Expectations,
    collect,
    evaluate,
    facts,
)
from tests.unit.hardware_data import (
    AMD_LIST_RECORD,
    AMD_LIST_TEXT,
    AMD_SMI_NO_DRIVER,
    BDFS,
    CPU,
    FAILED_LIST,
    GPU,
    HOST,
    MODULE,
    PDFAKE,
    PROVIDER,
    REF_PROVIDER_WARNING,
    ROCM_SMI_NO_DRIVER,
    ROCM_SMI_NO_JSON,
    ROCM_SMI_SERIES_LOWER,
    by_name,
    cmd,
    failing,
    gpu_commands,
    make_raw,
    missing,
    rdma_commands,
)

# --------------------------------------------------------------------------- facts()

# What facts() says of a host with no GPU it can see, and no RDMA device.
NO_GPUS = {
    "count": 0,
    "model": None,
    "source": None,
    "bdfs": [],
    "vendor": None,
    "memory_mib": None,
    "driver": None,
    "devices": [],
}
NO_RDMA = {"devices": [], "provider_libs": {}, "provider_lib": False, "warnings": []}


def test_facts_healthy_gpu_host() -> None:
    summary = facts(make_raw())
    assert list(summary) == [
        "hostname",
        "os",
        "kernel",
        "cpus",
        "memory_gb",
        "disk_free_gb",
        "disk_path",
        "systemd",
        "python",
        "gpus",
        "kfd",
        "render_nodes",
        "rdma",
        "nvidia",
        "runtime",
        "errors",
    ]
    assert summary["hostname"] == HOST
    assert summary["os"]["pretty_name"] == "Debian GNU/Linux 12 (bookworm)"
    assert (summary["cpus"], summary["memory_gb"], summary["disk_free_gb"]) == (192, 2048.0, 400.0)
    assert summary["disk_path"] == "/var/lib/containers"
    gpus = summary["gpus"]
    assert {k: gpus[k] for k in ("count", "model", "source", "bdfs", "vendor")} == {
        "count": 8,
        "model": "MI300X",  # dstack's spelling, from "AMD Instinct MI300X"
        "source": "amd-smi",
        "bdfs": BDFS,
        "vendor": "amd",
    }
    assert [d["index"] for d in gpus["devices"]] == list(range(8))
    assert summary["nvidia"] is None
    assert (summary["kfd"], summary["render_nodes"], summary["systemd"]) == (True, 8, True)
    rdma = summary["rdma"]
    assert [d["name"] for d in rdma["devices"]] == [f"bnxt_re{k}" for k in range(8)]
    port = rdma["devices"][0]["ports"][0]
    assert (port["port"], port["state"], port["link_layer"]) == (1, "PORT_ACTIVE", "Ethernet")
    assert port["gids"][3] == {"index": 3, "address": "::ffff:192.170.1.101", "kind": "RoCE v2"}
    assert (rdma["provider_lib"], rdma["warnings"]) == (True, [])
    assert summary["runtime"] == {"name": "podman", "version": "4.3.1", "usable": True}
    assert summary["errors"] == []
    assert json.loads(json.dumps(summary)) == summary


def test_facts_cpu_host() -> None:
    summary = facts(make_raw(kind="cpu"))
    assert summary["gpus"] == NO_GPUS
    assert summary["rdma"] == NO_RDMA
    assert (summary["kfd"], summary["render_nodes"], summary["cpus"]) == (False, 0, 32)
    assert summary["runtime"]["usable"] is True
    assert summary["errors"] == []


def test_facts_nic_missing_and_port_down() -> None:
    rdma = rdma_commands(absent=("bnxt_re7",), down=("bnxt_re3",))
    devices = facts(make_raw(rdma=rdma))["rdma"]["devices"]
    assert [d["name"] for d in devices] == [f"bnxt_re{k}" for k in range(7)]
    states = {d["name"]: d["ports"][0]["state"] for d in devices}
    assert states["bnxt_re3"] == "PORT_DOWN"
    assert {s for n, s in states.items() if n != "bnxt_re3"} == {"PORT_ACTIVE"}


def test_facts_provider_lib_missing_with_warning() -> None:
    summary = facts(make_raw(provider=False))
    assert summary["rdma"] == {
        "devices": [],
        "provider_libs": {},
        "provider_lib": False,
        "warnings": [REF_PROVIDER_WARNING],
    }
    assert summary["errors"] == []  # "No IB devices found" is an answer, not a failure


def test_facts_gpu_missing_renumbered() -> None:
    records = [
        {**AMD_LIST_RECORD, "gpu": i, "bdf": bdf} for i, bdf in enumerate(BDFS) if bdf != BDFS[2]
    ]
    gpu = gpu_commands(gpus=7, wrap=True)
    gpu["amd_smi_list"]["stdout"] = json.dumps({"gpu_data": records})
    summary = facts(make_raw(gpu=gpu))
    assert summary["gpus"]["count"] == 7
    assert summary["gpus"]["bdfs"] == [b for b in BDFS if b != "0000:46:00.0"]
    assert summary["gpus"]["model"] == "MI300X"


def test_facts_no_runtime() -> None:
    assert facts(make_raw(runtime="none"))["runtime"] == {
        "name": None,
        "version": None,
        "usable": False,
    }


def test_facts_docker_daemon_down_despite_exit_0() -> None:
    summary = facts(make_raw(runtime="docker-down"))
    assert summary["runtime"] == {"name": "docker", "version": "28.2.2", "usable": False}
    assert summary["errors"] == [
        "docker info: Cannot connect to the Docker daemon at tcp://127.0.0.1:2375. "
        "Is the docker daemon running?"
    ]


def test_facts_podman_docker_shim_is_podman() -> None:
    raw = make_raw()
    raw["commands"]["docker_version"] = cmd(["docker", "--version"], 0, "podman version 4.3.1\n")
    assert facts(raw)["runtime"] == {"name": "podman", "version": "4.3.1", "usable": True}


def test_facts_nothing_installed() -> None:
    raw = make_raw(
        rdma={
            "ibv_devices": missing(["ibv_devices"]),
            "ibv_devinfo": missing(["ibv_devinfo", "-v"]),
        },
        gpu={
            "amd_smi_list": missing(["amd-smi", "list", "--json"]),
            "amd_smi_static": missing(["amd-smi", "static", "--asic", "--json"]),
            "rocm_smi": missing(["rocm-smi", "--showproductname", "--json"]),
        },
        runtime="none",
        provider=False,
        kfd=False,
    )
    summary = facts(raw)
    assert summary["gpus"] == NO_GPUS
    assert summary["rdma"] == NO_RDMA
    assert summary["runtime"]["name"] is None
    assert summary["errors"] == []


def test_facts_rocm_smi_fallback_when_amd_smi_fails() -> None:
    gpu = {
        "amd_smi_list": cmd(["amd-smi", "list", "--json"], 1, "", "Traceback ...\nImportError\n"),
        "amd_smi_static": cmd(["amd-smi", "static", "--asic", "--json"], 1, "", "ImportError\n"),
        "rocm_smi": cmd(["rocm-smi", "--showproductname", "--json"], 0, ROCM_SMI_SERIES_LOWER),
    }
    summary = facts(make_raw(gpu=gpu))
    gpus = summary["gpus"]
    assert {k: gpus[k] for k in ("count", "model", "source", "bdfs", "vendor")} == {
        "count": 1,
        "model": "MI200",  # dstack's spelling, from "AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2"
        "source": "rocm-smi",
        "bdfs": [],
        "vendor": "amd",
    }
    assert summary["errors"] == ["amd-smi list --json exited 1: Traceback ..."]


def test_facts_amdgpu_not_loaded() -> None:
    gpu = {
        "amd_smi_list": cmd(["amd-smi", "list", "--json"], 255, "", AMD_SMI_NO_DRIVER),
        "amd_smi_static": cmd(
            ["amd-smi", "static", "--asic", "--json"], 255, "", AMD_SMI_NO_DRIVER
        ),
        "rocm_smi": cmd(
            ["rocm-smi", "--showproductname", "--json"],
            0,
            "",
            ROCM_SMI_NO_DRIVER + ROCM_SMI_NO_JSON,
        ),
    }
    summary = facts(make_raw(gpu=gpu, kfd=False))
    assert summary["gpus"] == {**NO_GPUS, "source": "rocm-smi"}
    assert summary["errors"] == [
        "amd-smi list --json exited 255: ERROR:root:Unable to get devices, driver not initialized "
        "(amdgpu not found in modules)",
        "rocm-smi --showproductname --json: ERROR:root:Driver not initialized (amdgpu not found "
        "in modules)",
    ]


def test_facts_parse_errors_become_errors_entries() -> None:
    gpu = gpu_commands()
    gpu["amd_smi_list"]["stdout"] = AMD_LIST_TEXT
    rdma = rdma_commands()
    rdma["ibv_devinfo"]["stdout"] = "garbage before hca_id\n" + rdma["ibv_devinfo"]["stdout"]
    summary = facts(make_raw(gpu=gpu, rdma=rdma))
    assert summary["gpus"]["count"] == 0
    assert summary["errors"][0] == (
        "amd-smi list --json: expected JSON from amd-smi list --json, got 'GPU: 0'"
    )
    assert summary["errors"][1].startswith(
        "ibv_devinfo -v: line 1: expected ibv_devinfo to start with 'hca_id:"
    )
    # ibv_devices still parsed: the devices are listed without port details
    assert [d["ports"] for d in summary["rdma"]["devices"]] == [[]] * 8


def test_facts_ibv_devices_failed_list() -> None:
    rdma = {
        "ibv_devices": cmd(["ibv_devices"], 255, "", FAILED_LIST),
        "ibv_devinfo": cmd(["ibv_devinfo", "-v"], 255, "", FAILED_LIST),
    }
    summary = facts(make_raw(rdma=rdma))
    assert summary["rdma"]["devices"] == []
    assert summary["errors"] == [
        "ibv_devices exited 255: Failed to get IB devices list: Function not implemented",
        "ibv_devinfo -v exited 255: Failed to get IB devices list: Function not implemented",
    ]


@pytest.mark.parametrize(
    "raw",
    [{}, {"commands": 5}, {"commands": {"ibv_devices": {"rc": "x"}}}, {"storage": [], "os": 3}],
)
def test_facts_never_raises_on_odd_documents(raw: dict[str, Any]) -> None:
    summary = facts(raw)
    assert summary["gpus"]["count"] == 0
    assert summary["rdma"]["devices"] == []
    assert summary["disk_free_gb"] is None
    checks = evaluate(HOST, raw, GPU)
    assert [c.name for c in checks] == list(CHECK_NAMES)
    assert not by_name(checks)["gpus"].ok


# --------------------------------------------------------------------------- collect(): for real


def test_run_command_missing_unexecutable_and_timeout(tmp_path: Path) -> None:
    assert hw.run_command(["pd-no-such-tool", "--x"])["rc"] == 127
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\necho hi\n")
    result = hw.run_command([str(plain)])
    assert (result["rc"], result["stdout"]) == (126, "")
    assert "Permission denied" in result["stderr"]
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\necho started\nsleep 30\n")
    slow.chmod(0o755)
    started = time.monotonic()
    result = hw.run_command([str(slow)], timeout=0.5)
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


# --------------------------------------------------------------------------- collect(): fakes

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
        monkeypatch.setattr(hw, "KFD_PATH", str(tmp / "kfd"))
        monkeypatch.setattr(hw, "DRI_DIR", str(tmp / "dri"))
        monkeypatch.setattr(hw, "SYSTEMD_RUN_DIR", str(tmp / "systemd"))
        # A bare-metal host's root may raise rlimits, whatever this machine allows.
        monkeypatch.setattr(hw, "MEMLOCK_PROBE", "")
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


# --------------------------------------------------------------------------- reach


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


# --------------------------------------------------------------------------- python3 - on a host

PY39 = sorted((Path.home() / ".pyenv" / "versions").glob("3.9*/bin/python3"))
PYTHONS = [sys.executable, *[str(p) for p in PY39[:1]]]


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: Path(p).parent.parent.name or p)
def test_source_piped_to_python_stdin(python: str, listener: int, tmp_path: Path) -> None:
    request = {
        "provider_lib": str(tmp_path / "libbnxt_re-rdmav34.so"),
        "storage_paths": ["/nonexistent", str(tmp_path)],
        "peers": [["127.0.0.1", listener]],
    }
    env = {**os.environ, hw.INPUT_ENV: json.dumps(request)}
    proc = subprocess.run(
        [python, "-"],
        input=MODULE.read_text(),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
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


PORTABLE_SCRIPT = """\
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("pd_hardware", sys.argv[1])
hw = importlib.util.module_from_spec(spec)
sys.modules["pd_hardware"] = hw  # as Ansible's module_utils loader does
spec.loader.exec_module(hw)
raw = json.load(sys.stdin)
checks = hw.evaluate("node2", raw, hw.Expectations(kind="gpu"))
print(json.dumps({"facts": hw.facts(raw), "checks": [c.to_dict() for c in checks]}))
"""


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: Path(p).parent.parent.name or p)
def test_facts_and_evaluate_under_each_python(python: str) -> None:
    raw = make_raw(rdma=rdma_commands(down=("bnxt_re5",)))
    proc = subprocess.run(
        [python, "-W", "error", "-c", PORTABLE_SCRIPT, str(MODULE)],
        input=json.dumps(raw),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(proc.stdout)
    assert result["facts"] == facts(raw)
    assert result["checks"] == [c.to_dict() for c in evaluate(HOST, raw, GPU)]
    assert [c["name"] for c in result["checks"] if not c["ok"]] == ["rdma_ports"]


def test_source_with_bad_input_exits_2() -> None:
    env = {**os.environ, hw.INPUT_ENV: json.dumps({"peers": "10.0.0.1", "typo": 1})}
    proc = subprocess.run(
        [sys.executable, "-"],
        input=MODULE.read_text(),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == {"error": "PD_HARDWARE_INPUT: unknown input keys: typo"}


def test_script_reads_its_request_from_stdin_when_run_as_a_file(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != hw.INPUT_ENV}
    request = {"storage_paths": [str(tmp_path)], "peers": [], "provider_lib": "/nonexistent.so"}
    proc = subprocess.run(
        [sys.executable, str(MODULE)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    raw = json.loads(proc.stdout)
    assert raw["storage"]["path"] == str(tmp_path)
    assert raw["provider_lib"]["path"] == "/nonexistent.so"


def test_python_c_does_not_wait_on_an_open_stdin(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != hw.INPUT_ENV}
    env["PATH"] = str(tmp_path)  # no tools: the output stays far below a pipe's buffer
    with subprocess.Popen(
        [sys.executable, "-c", MODULE.read_text()],
        stdin=subprocess.PIPE,  # like an SSH channel nobody closes
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("main() waited on stdin under python3 -c")
        out = proc.stdout.read() if proc.stdout else ""
    assert rc == 0
    raw = json.loads(out)
    assert raw["storage"]["candidates"] == list(hw.DEFAULT_STORAGE_PATHS)
    assert raw["provider_lib"]["path"] == hw.DEFAULT_PROVIDER_LIB


def test_importing_the_module_does_nothing() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import runpy; runpy.run_path({str(MODULE)!r}, run_name='pd_hardware')",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
