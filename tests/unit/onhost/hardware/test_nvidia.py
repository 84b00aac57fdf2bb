"""NVIDIA hosts and vendor-neutral fabric facts in pdctl/onhost/hardware/: the parsers on
real-format samples (tests/data/hardware/), facts() and evaluate() on NVIDIA observations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost.hardware.checks import Expectations, evaluate
from pdctl.onhost.hardware.facts import dstack_gpu_name, facts
from pdctl.onhost.hardware.ibverbs import parse_ibv_devinfo, provider_driver
from pdctl.onhost.hardware.nvidia import (
    parse_nvidia_ctk_cdi_list,
    parse_nvidia_ctk_version,
    parse_nvidia_smi_query,
)
from pdctl.onhost.hardware.parsing import ParseError
from pdctl.onhost.hardware.pci import normalize_bdf, pci_chain

DATA = Path(__file__).resolve().parents[3] / "data" / "hardware"
HOST = "gpu7"
H200 = Expectations(
    kind="gpu", gpu_model="H200", gpu_vendor="nvidia", nic_driver="mlx5", link_layer="ib"
)


def sample(name: str) -> str:
    return (DATA / name).read_text()


def cmd(argv: list[str], rc: int, stdout: str = "", stderr: str = "") -> dict[str, Any]:
    return {"argv": argv, "rc": rc, "stdout": stdout, "stderr": stderr}


# --------------------------------------------------------------------------- parsers


def test_nvidia_smi_query_noheader_with_units() -> None:
    rows = parse_nvidia_smi_query(sample("nvidia-smi-query-noheader.csv"))
    assert [(r["index"], r["name"], r["memory.total"], r["pci"]) for r in rows] == [
        (0, "NVIDIA H200", 143771, "0000:18:00.0"),
        (1, "NVIDIA H200", 143771, "0000:2a:00.0"),
    ]
    assert rows[0]["uuid"] == "GPU-1a4626a2-1754-c017-fdb7-6d7d682f4165"
    assert rows[0]["driver_version"] == "570.211.01"


def test_nvidia_smi_query_header_and_nounits() -> None:
    rows = parse_nvidia_smi_query(sample("nvidia-smi-query-header-nounits.csv"))
    assert [(r["index"], r["name"], r["memory.total"]) for r in rows] == [
        (0, "NVIDIA H100 80GB HBM3", 81559)
    ]


def test_nvidia_smi_query_other_fields_and_na() -> None:
    rows = parse_nvidia_smi_query(
        "0, NVIDIA A100-SXM4-80GB, [N/A]\n", ("index", "name", "memory.total")
    )
    assert rows == [{"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory.total": None}]
    assert parse_nvidia_smi_query("No devices were found\n") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (sample("nvidia-smi-no-driver.txt"), "cannot talk to the driver"),
        ("0, NVIDIA H200, GPU-x\n", "expected 6 comma-separated values"),
        ("x, NVIDIA H200, GPU-x, 1 MiB, 570, 00000000:18:00.0\n", "expected a GPU index"),
        ("0, NVIDIA H200, GPU-x, lots, 570, 00000000:18:00.0\n", "memory.total"),
        ("0, NVIDIA H200, GPU-x, 1 MiB, 570, 18:00\n", "pci.bus_id"),
    ],
)
def test_nvidia_smi_query_refuses_other_text(text: str, expected: str) -> None:
    with pytest.raises(ParseError, match=expected):
        parse_nvidia_smi_query(text)


def test_nvidia_ctk_samples() -> None:
    names = parse_nvidia_ctk_cdi_list(
        "INFO[0000] Found 5 CDI devices\n" + sample("nvidia-ctk-cdi-list.txt")
    )
    assert names == [
        "0",
        "GPU-1a4626a2-1754-c017-fdb7-6d7d682f4165",
        "1",
        "GPU-2b5737b3-2865-d128-0ec8-7e8e793f5276",
        "all",
    ]
    assert parse_nvidia_ctk_cdi_list("") == []
    with pytest.raises(ParseError, match="CDI device name"):
        parse_nvidia_ctk_cdi_list("nvidia-ctk: command failed\n")
    assert parse_nvidia_ctk_version(sample("nvidia-ctk-version.txt")) == "1.17.8"
    with pytest.raises(ParseError, match="NVIDIA Container Toolkit CLI version"):
        parse_nvidia_ctk_version("Usage: nvidia-ctk\n")


def test_ibv_devinfo_infiniband_lids() -> None:
    devices = parse_ibv_devinfo(sample("ibv_devinfo-mlx5-ib.txt"))
    assert [(d.name, d.vendor_id) for d in devices] == [("mlx5_0", "0x02c9"), ("mlx5_1", "0x02c9")]
    ports = [d.port(1) for d in devices]
    assert [(p.link_layer, p.lid) for p in ports if p] == [("InfiniBand", 130), ("InfiniBand", 0)]


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA H100 NVL", "H100NVL"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("AMD Instinct MI300X", "MI300X"),
        ("AMD Instinct MI325X", "MI325X"),
    ],
)
def test_dstack_gpu_names(name: str, model: str) -> None:
    assert dstack_gpu_name(name) == model


def test_bdfs_chains_and_drivers() -> None:
    assert normalize_bdf("00000000:1B:00.0") == "0000:1b:00.0"
    assert normalize_bdf("GPU0") is None
    real = "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0"
    assert pci_chain(real) == ["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0"]
    assert pci_chain(real + "/mlx5_core.rdma.0") == pci_chain(real)
    assert pci_chain(None) == []
    # udev's names say nothing: the kernel driver sysfs shows does
    assert provider_driver("mlx5_core", "rocep1s0f1") == "mlx5"
    assert provider_driver("bnxt_en", "rocep65s0f0") == "bnxt_re"
    assert provider_driver(None, "rocep1s0f1") is None
    assert provider_driver(None, "mlx5_3") == "mlx5"
    assert provider_driver(None, "bnxt_re7") == "bnxt_re"


# --------------------------------------------------------------------------- facts, checks

MLX5_NAMES = tuple(f"mlx5_{k}" for k in range(8))
UUIDS = [f"GPU-0000000{k}-1754-c017-fdb7-6d7d682f4165" for k in range(8)]
BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def nvidia_raw(
    *,
    gpus: int = 8,
    driver: bool = True,
    ctk: bool = True,
    cdi: list[str] | None = None,
    spec: bool = True,
    port_lid: int = 130,
    link_layer: str = "InfiniBand",
    names: tuple[str, ...] = MLX5_NAMES,
    lib: bool = True,
) -> dict[str, Any]:
    """collect()'s document for an HGX H200 with ConnectX-7 NICs on InfiniBand."""
    rows = "".join(
        f"{k}, NVIDIA H200, {UUIDS[k]}, 143771 MiB, 570.211.01, 00000000:{BUSES[k]:02X}:00.0\n"
        for k in range(gpus)
    )
    smi = (
        cmd(["nvidia-smi"], 0, rows)
        if driver
        else cmd(["nvidia-smi"], 9, sample("nvidia-smi-no-driver.txt"))
    )
    listed = cdi if cdi is not None else [n for k in range(8) for n in (str(k), UUIDS[k])] + ["all"]
    devices = "    device          \t   node GUID\n    ------          \t----------------\n"
    devices += "".join(f"    {n:<16}\t946dae030002{k:02x}f0\n" for k, n in enumerate(names))
    devinfo = "".join(
        f"hca_id:\t{n}\n\tvendor_id:\t\t\t0x02c9\n\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n"
        f"\t\t\tport_lid:\t\t{port_lid}\n\t\t\tlink_layer:\t\t{link_layer}\n\n"
        for n in names
    )
    sysfs_ib = {}
    for k, n in enumerate(names):
        b = BUSES[k]
        sysfs_ib[n] = {
            "realpath": f"/sys/devices/pci0000:{b - 3:02x}/0000:{b - 3:02x}:01.0/"
            f"0000:{b - 2:02x}:00.0/0000:{b - 1:02x}:01.0/0000:{b + 1:02x}:00.0",
            "numa_node": 0 if k < 4 else 1,
            "driver": "mlx5_core",
        }
    sysfs_pci = {
        f"0000:{b:02x}:00.0": {
            "realpath": f"/sys/devices/pci0000:{b - 3:02x}/0000:{b - 3:02x}:01.0/"
            f"0000:{b - 2:02x}:00.0/0000:{b - 1:02x}:00.0/0000:{b:02x}:00.0",
            "numa_node": 0 if k < 4 else 1,
        }
        for k, b in enumerate(BUSES)
    }
    commands = {
        "ibv_devices": cmd(["ibv_devices"], 0, devices),
        "ibv_devinfo": cmd(["ibv_devinfo", "-v"], 0, devinfo),
        "amd_smi_list": cmd(["amd-smi"], 127),
        "amd_smi_static": cmd(["amd-smi"], 127),
        "rocm_smi": cmd(["rocm-smi"], 127),
        "nvidia_smi": smi,
        "nvidia_ctk_version": cmd(["nvidia-ctk", "--version"], 0, sample("nvidia-ctk-version.txt"))
        if ctk
        else cmd(["nvidia-ctk", "--version"], 127),
        "nvidia_ctk_cdi_list": cmd(
            ["nvidia-ctk", "cdi", "list"], 0, "".join(f"nvidia.com/gpu={n}\n" for n in listed)
        )
        if ctk
        else cmd(["nvidia-ctk"], 127),
        "podman_version": cmd(["podman", "--version"], 0, "podman version 4.3.1\n"),
        "podman_info": cmd(["podman", "info"], 0, "{}"),
        "systemctl": cmd(["systemctl"], 0, "running\n"),
    }
    return {
        "hostname": HOST,
        "systemd": True,
        "kfd": False,
        "render_nodes": [],
        "provider_lib": {"path": "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so", "exists": False},
        "provider_libs": {"mlx5": ["/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav59.so"]}
        if lib
        else {},
        "storage": {"path": "/var/lib/containers", "free_bytes": 400 * 1024**3},
        "memlock": {"euid": 0, "unlimited": True},
        "reach": [],
        "commands": commands,
        "sysfs": {"pci": sysfs_pci, "infiniband": sysfs_ib},
        "nvidia_files": {"cdi_specs": ["/etc/cdi/nvidia.yaml"] if spec else [], "device_nodes": []},
        "tools": {"ib_write_bw": "/usr/bin/ib_write_bw", "ib_write_lat": "/usr/bin/ib_write_lat"},
    }


def failing(raw: dict[str, Any], expect: Expectations = H200) -> dict[str, str]:
    return {c.name: c.message for c in evaluate(HOST, raw, expect) if not c.ok}


def test_facts_of_an_hgx_h200() -> None:
    summary = facts(nvidia_raw())
    gpus = summary["gpus"]
    assert {k: gpus[k] for k in ("count", "model", "vendor", "memory_mib", "driver", "source")} == {
        "count": 8,
        "model": "H200",
        "vendor": "nvidia",
        "memory_mib": 143771,
        "driver": "570.211.01",
        "source": "nvidia-smi",
    }
    assert gpus["devices"][1] == {
        "index": 1,
        "pci": "0000:2a:00.0",
        "numa": 0,
        "memory_mib": 143771,
        "uuid": UUIDS[1],
        "pci_path": ["0000:27:01.0", "0000:28:00.0", "0000:29:00.0", "0000:2a:00.0"],
    }
    nic = summary["rdma"]["devices"][5]
    assert {k: nic[k] for k in ("name", "driver", "pci", "numa")} == {
        "name": "mlx5_5",
        "driver": "mlx5",
        "pci": "0000:ac:00.0",
        "numa": 1,
    }
    assert nic["pci_path"][:2] == gpus["devices"][5]["pci_path"][:2]  # the same switch
    assert summary["rdma"]["provider_libs"] == {
        "mlx5": "/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav59.so"
    }
    assert summary["rdma"]["provider_lib"] is True
    assert summary["nvidia"] == {
        "driver_loaded": True,
        "ctk_version": "1.17.8",
        "cdi_devices": [n for k in range(8) for n in (str(k), UUIDS[k])] + ["all"],
        "cdi_spec": "/etc/cdi/nvidia.yaml",
    }
    assert summary["errors"] == []


def test_healthy_h200_passes_every_check() -> None:
    checks = {c.name: c for c in evaluate(HOST, nvidia_raw(), H200)}
    assert all(c.ok for c in checks.values()), {n: c.message for n, c in checks.items()}
    assert checks["gpus"].message == f"{HOST}: 8 x NVIDIA H200 (nvidia-smi, driver 570.211.01)"
    assert checks["roce_gid"].skipped  # InfiniBand: LIDs, not GIDs
    assert "libmlx5-rdmav59.so present" in checks["provider_lib"].message


def test_udev_renamed_nics_count_by_their_driver() -> None:
    names = tuple(f"rocep{k}s0f0" for k in range(8))
    assert failing(nvidia_raw(names=names)) == {}


@pytest.mark.parametrize(
    ("raw", "check", "words"),
    [
        (nvidia_raw(driver=False), "gpus", ["NVIDIA driver is not loaded", "modprobe nvidia"]),
        (nvidia_raw(gpus=7), "gpus", ["nvidia-smi lists 7 GPUs, expected 8 H200 GPUs"]),
        (nvidia_raw(ctk=False), "container_toolkit", ["apt install nvidia-container-toolkit"]),
        (nvidia_raw(spec=False), "cdi", ["no CDI spec", "--output=/etc/cdi/nvidia.yaml"]),
        (
            nvidia_raw(cdi=["0", UUIDS[0], "1", UUIDS[1], "all"]),
            "cdi",
            ["does not list GPU 2, 3, 4, 5, 6 and 7 (by index and UUID)", "cdi generate"],
        ),
        (nvidia_raw(port_lid=0), "rdma_ports", ["has no LID", "opensm"]),
        (nvidia_raw(link_layer="Ethernet"), "rdma_ports", ["expected InfiniBand", "--link-layer"]),
        (nvidia_raw(lib=False), "provider_lib", ["no libmlx5-rdmav*.so in /usr/lib64/libibverbs"]),
    ],
)
def test_each_nvidia_problem_fails_its_check_with_the_fix(
    raw: dict[str, Any], check: str, words: list[str]
) -> None:
    failed = failing(raw)
    assert check in failed, failed
    for word in words:
        assert word in failed[check]


def test_a_stale_spec_after_a_gpu_is_gone() -> None:
    message = failing(nvidia_raw(gpus=7))["cdi"]
    assert "lists GPU 7 that nvidia-smi does not show" in message


def test_vendor_mismatch_names_the_fleet_setting() -> None:
    amd_fleet = Expectations(kind="gpu", nic_driver="mlx5", link_layer="ib")
    message = failing(nvidia_raw(), amd_fleet)["gpus"]
    assert "the GPUs are NVIDIA H200 (nvidia-smi), expected 8 MI300X GPUs" in message
    bnxt_fleet = Expectations(kind="gpu", gpu_model="H200", gpu_vendor="nvidia")
    message = failing(nvidia_raw(), bnxt_fleet)["rdma_devices"]
    assert "has mlx5 devices instead" in message and "--nic-driver mlx5" in message


def test_amd_fleets_need_no_toolkit_and_cpu_hosts_skip() -> None:
    amd = {c.name: c for c in evaluate(HOST, nvidia_raw(), Expectations(kind="gpu"))}
    assert amd["cdi"].ok and not amd["cdi"].skipped
    cpu = {c.name: c for c in evaluate(HOST, {}, Expectations(kind="cpu", gpu_vendor="nvidia"))}
    assert cpu["cdi"].skipped and cpu["container_toolkit"].skipped


def test_expectations_refuse_unknown_settings() -> None:
    with pytest.raises(ValueError, match="gpu_vendor"):
        Expectations(kind="gpu", gpu_vendor="intel")
    with pytest.raises(ValueError, match="link_layer"):
        Expectations(kind="gpu", link_layer="fc")
    with pytest.raises(ValueError, match="nic_driver"):
        Expectations(kind="gpu", nic_driver="../x")
