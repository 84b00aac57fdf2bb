"""The lab's NVIDIA host fakes (pdctl/lab/fakes/pdfake.py as nvidia-smi, nvidia-ctk and mlx5
verbs tools), run as real processes and read back with pdctl's own parsers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost.hardware import ibverbs, nvidia, parsing

SCRIPT = Path(__file__).resolve().parents[3] / "pdctl" / "lab" / "fakes" / "pdfake.py"
H200 = {
    "host_index": 2,
    "vendor": "nvidia",
    "gpu_model": "NVIDIA H200",
    "gpu_memory_mib": 143771,
    "nic_driver": "mlx5",
    "link_layer": "ib",
}


class Fake:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cdi = tmp / "cdi"
        self.cdi.mkdir()
        self.provider = tmp / "libmlx5-rdmav34.so"
        self.provider.write_bytes(b"\x7fELF fake\n")
        self.state()

    def state(self, **changes: Any) -> None:
        (self.tmp / "state.json").write_text(json.dumps({**H200, **changes}))

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "PDFAKE_STATE": str(self.tmp / "state.json"),
            "PDFAKE_PROVIDER_LIB": str(self.provider),
            "PDFAKE_CDI_DIRS": str(self.cdi),
        }
        return subprocess.run(
            [sys.executable, str(SCRIPT), *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
            check=False,
        )


@pytest.fixture
def fake(tmp_path: Path) -> Fake:
    return Fake(tmp_path)


QUERY = "--query-gpu=index,name,uuid,memory.total,driver_version,pci.bus_id"


def test_query_csv_forms_parse_with_pdctls_parser(fake: Fake) -> None:
    plain = fake.run("nvidia-smi", QUERY, "--format=csv,noheader")
    rows = nvidia.parse_nvidia_smi_query(plain.stdout)
    assert [(r["index"], r["name"], r["memory.total"]) for r in rows] == [
        (k, "NVIDIA H200", 143771) for k in range(8)
    ]
    assert plain.stdout.splitlines()[0].endswith(", 143771 MiB, 570.211.01, 00000000:18:00.0")
    header = fake.run("nvidia-smi", QUERY, "--format=csv,nounits").stdout.splitlines()
    assert header[0] == "index, name, uuid, memory.total [MiB], driver_version, pci.bus_id"
    assert nvidia.parse_nvidia_smi_query("\n".join(header)) == rows
    bad = fake.run("nvidia-smi", "--query-gpu=index,bogus", "--format=csv")
    assert (bad.returncode, bad.stdout) == (2, 'Field "bogus" is not a valid field to query.\n\n')


def test_list_topology_and_missing_gpu(fake: Fake) -> None:
    fake.state(missing_gpus=[2])
    listed = fake.run("nvidia-smi", "-L").stdout.splitlines()
    assert len(listed) == 7 and listed[0].startswith("GPU 0: NVIDIA H200 (UUID: GPU-")
    topo = fake.run("nvidia-smi", "topo", "-m").stdout
    head = topo.splitlines()[0]
    assert head.startswith("\tGPU0\tGPU1") and head.endswith("\tNUMA Affinity\tGPU NUMA ID")
    assert "NIC Legend:\n\n  NIC0: mlx5_0\n" in topo
    gpu0 = topo.splitlines()[1].split("\t")
    assert gpu0[:3] == ["GPU0", " X ", "NV18"]
    assert gpu0[8] == "PXB" and gpu0[9:12] == ["NODE"] * 3 and gpu0[12:16] == ["SYS"] * 4


def test_no_driver(fake: Fake) -> None:
    fake.state(nvidia_driver=False)
    proc = fake.run("nvidia-smi", QUERY, "--format=csv,noheader")
    assert proc.returncode == 9 and proc.stdout.startswith("NVIDIA-SMI has failed")
    with pytest.raises(parsing.ParseError, match="cannot talk to the driver"):
        nvidia.parse_nvidia_smi_query(proc.stdout)
    generate = fake.run("nvidia-ctk", "cdi", "generate", f"--output={fake.cdi / 'nvidia.yaml'}")
    assert generate.returncode == 1 and "ERROR_DRIVER_NOT_LOADED" in generate.stderr


def test_ctk_generates_and_lists_a_spec(fake: Fake) -> None:
    assert fake.run("nvidia-ctk", "cdi", "list").stdout == ""
    version = fake.run("nvidia-ctk", "--version").stdout
    assert nvidia.parse_nvidia_ctk_version(version) == "1.17.8"
    spec = fake.cdi / "nvidia.yaml"
    assert fake.run("nvidia-ctk", "cdi", "generate", "--output", str(spec)).returncode == 0
    text = spec.read_text()
    assert text.startswith("---\ncdiVersion: 0.5.0\n") and text.endswith("kind: nvidia.com/gpu\n")
    assert "    - path: /dev/nvidia7\n" in text
    listed = fake.run("nvidia-ctk", "cdi", "list")
    names = nvidia.parse_nvidia_ctk_cdi_list(listed.stdout)
    assert names[0] == "0" and names[1].startswith("GPU-") and names[-1] == "all"
    assert len(names) == 17 and listed.stderr == "INFO[0000] Found 17 CDI devices\n"


@pytest.mark.parametrize(("layer", "word"), [("ib", "InfiniBand"), ("eth", "Ethernet")])
def test_mlx5_nics_in_both_link_layers(fake: Fake, layer: str, word: str) -> None:
    fake.state(link_layer=layer, down_ports=["mlx5_1"])
    devices = ibverbs.parse_ibv_devices(fake.run("ibv_devices").stdout)
    assert [name for name, _ in devices] == [f"mlx5_{k}" for k in range(8)]
    info = ibverbs.parse_ibv_devinfo(fake.run("ibv_devinfo", "-v").stdout)
    assert {d.vendor_id for d in info} == {"0x02c9"}
    ports = {d.name: d.port(1) for d in info}
    assert {p.link_layer for p in ports.values() if p} == {word}
    lid = ports["mlx5_0"].lid if ports["mlx5_0"] else None
    assert (lid != 0) == (layer == "ib")
    assert ports["mlx5_1"] is not None and ports["mlx5_1"].state == "PORT_DOWN"
    assert ports["mlx5_1"].lid == 0
    gids = ports["mlx5_0"].gids if ports["mlx5_0"] else []
    assert {g.kind for g in gids} == ({""} if layer == "ib" else {"RoCE v1", "RoCE v2"})


def test_mlx5_provider_missing_warns_like_libibverbs(fake: Fake) -> None:
    fake.provider.unlink()
    proc = fake.run("ibv_devices")
    assert "couldn't load driver 'libmlx5-rdmav34.so'" in proc.stderr
    assert ibverbs.parse_ibv_devices(proc.stdout) == []


def test_slot_topology_is_one_switch_per_gpu_and_nic() -> None:
    spec = importlib.util.spec_from_file_location("pdfake", SCRIPT)
    assert spec is not None and spec.loader is not None
    pdfake = importlib.util.module_from_spec(spec)
    sys.modules["pdfake"] = pdfake  # dataclasses look their module up there
    try:
        spec.loader.exec_module(pdfake)
    finally:
        del sys.modules["pdfake"]
    for vendor in ("amd", "nvidia"):
        slots = [pdfake.slot_topology(k, vendor) for k in range(8)]
        assert [s.numa for s in slots] == [0, 0, 0, 0, 1, 1, 1, 1]
        for k, slot in enumerate(slots):
            assert slot.gpu == pdfake.slot_bdf(k, vendor)
            assert slot.gpu_path[:2] == slot.nic_path[:2] and slot.gpu_path[2] != slot.nic_path[2]
        assert len({s.host_bridge for s in slots}) == 8
