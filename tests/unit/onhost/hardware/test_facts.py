"""pdctl/onhost/hardware/facts.py's facts() on collect-shaped documents, and facts() and the
checks computed from the preflight's bundle under each Python the hosts may have."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost import bundle
from pdctl.onhost.hardware.checks import CHECK_NAMES, evaluate
from pdctl.onhost.hardware.facts import facts
from tests.unit.onhost.hardware.samples import (
    AMD_LIST_RECORD,
    AMD_LIST_TEXT,
    AMD_SMI_NO_DRIVER,
    BDFS,
    FAILED_LIST,
    GPU,
    HOST,
    LOADER,
    REF_PROVIDER_WARNING,
    ROCM_SMI_NO_DRIVER,
    ROCM_SMI_NO_JSON,
    ROCM_SMI_SERIES_LOWER,
    by_name,
    cmd,
    gpu_commands,
    make_raw,
    missing,
    rdma_commands,
)

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


PY39 = sorted((Path.home() / ".pyenv" / "versions").glob("3.9*/bin/python3"))


PYTHONS = [sys.executable, *[str(p) for p in PY39[:1]]]


# The checks and the facts computed on a host as the pd_preflight role's entry does
# (hardware/preflight.py), from the bundle alone.
PORTABLE_SCRIPT = """\
import json, sys
loader = {"__name__": "pdctl_loader"}
exec(open(sys.argv[1]).read(), loader)
loader["install"](json.load(open(sys.argv[2])))
from pdctl.onhost.hardware import checks, facts
raw = json.load(sys.stdin)
found = checks.evaluate("node2", raw, checks.Expectations(kind="gpu"))
print(json.dumps({"facts": facts.facts(raw), "checks": [c.to_dict() for c in found]}))
"""


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: Path(p).parent.parent.name or p)
def test_facts_and_evaluate_under_each_python(python: str, tmp_path: Path) -> None:
    raw = make_raw(rdma=rdma_commands(down=("bnxt_re5",)))
    shipped = tmp_path / "bundle.json"
    shipped.write_text(json.dumps(bundle.modules("pdctl.onhost.hardware.preflight")))
    proc = subprocess.run(
        [python, "-I", "-W", "error", "-c", PORTABLE_SCRIPT, str(LOADER), str(shipped)],
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
