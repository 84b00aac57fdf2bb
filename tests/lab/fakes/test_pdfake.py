"""The lab's fake hardware tools (pdctl/lab/fakes/pdfake.py), run as real processes.

Expected outputs are spelled out byte for byte from rdma-core's printf formats
and amd-smi / rocm-smi's key names, so a drift in the fake fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "pdctl" / "lab" / "fakes" / "pdfake.py"
PROVIDER_WARNING = (
    "libibverbs: Warning: couldn't load driver 'libbnxt_re-rdmav34.so': "
    "libbnxt_re-rdmav34.so: cannot open shared object file: No such file or directory\n"
)
DEVICES_HEADER = "    device          \t   node GUID\n    ------          \t----------------\n"
SLOT_BDFS = [
    "0000:05:00.0",
    "0000:26:00.0",
    "0000:46:00.0",
    "0000:65:00.0",
    "0000:85:00.0",
    "0000:a6:00.0",
    "0000:c6:00.0",
    "0000:e5:00.0",
]


@dataclass
class Fake:
    tmp: Path

    @property
    def state_file(self) -> Path:
        return self.tmp / "state.json"

    @property
    def provider(self) -> Path:
        return self.tmp / "libbnxt_re-rdmav34.so"

    def state(self, **state: Any) -> None:
        self.state_file.write_text(json.dumps(state))

    def run(self, tool: str, *args: str, argv0: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "PDFAKE_STATE": str(self.state_file),
            "PDFAKE_PROVIDER_LIB": str(self.provider),
        }
        command = [sys.executable, str(argv0)] + ([tool] if tool else []) + list(args)
        return subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=30, check=False
        )

    def json(self, tool: str, *args: str) -> Any:
        proc = self.run(tool, *args)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


@pytest.fixture
def fake(tmp_path: Path) -> Fake:
    f = Fake(tmp_path)
    f.provider.write_bytes(b"\x7fELF fake\n")
    f.state(host_index=1)
    return f


def devinfo_blocks(stdout: str) -> dict[str, str]:
    assert stdout.endswith("\n\n")
    blocks = stdout[:-2].split("\n\n")
    return {block.split("\n", 1)[0].removeprefix("hca_id:\t"): block for block in blocks}


# ----------------------------------------------------------------------------- ibv_devices


def test_ibv_devices_prints_rdma_core_layout_for_eight_nics(fake: Fake) -> None:
    proc = fake.run("ibv_devices")
    rows = "".join(f"    bnxt_re{k}        \tb22628fffe01{k:02x}f0\n" for k in range(8))
    assert proc.stdout == DEVICES_HEADER + rows
    assert (proc.returncode, proc.stderr) == (0, "")


def test_guids_are_unique_per_host_and_nic(fake: Fake) -> None:
    guids = []
    for host in (1, 2, 3):
        fake.state(host_index=host)
        rows = fake.run("ibv_devices").stdout.splitlines()[2:]
        guids += [row.split("\t")[1] for row in rows]
    assert len(guids) == 24
    assert len(set(guids)) == 24
    assert all(len(g) == 16 and g.startswith("b22628fffe") for g in guids)


def test_symlinked_name_selects_the_tool(fake: Fake) -> None:
    link = fake.tmp / "ibv_devices"
    link.symlink_to(SCRIPT)
    proc = fake.run("", argv0=link)
    assert proc.returncode == 0
    assert proc.stdout.startswith(DEVICES_HEADER)
    assert "    bnxt_re7        \tb22628fffe0107f0\n" in proc.stdout


# ----------------------------------------------------------------------------- ibv_devinfo


BNXT_RE0_HOST1 = (
    "hca_id:\tbnxt_re0\n"
    "\ttransport:\t\t\tInfiniBand (0)\n"
    "\tfw_ver:\t\t\t\t230.2.49.0\n"
    "\tnode_guid:\t\t\tb226:28ff:fe01:00f0\n"
    "\tsys_image_guid:\t\t\tb226:28ff:fe01:00f0\n"
    "\tvendor_id:\t\t\t0x14e4\n"
    "\tvendor_part_id:\t\t\t5984\n"
    "\thw_ver:\t\t\t\t0x1D42\n"
    "\tphys_port_cnt:\t\t\t1\n"
    "\t\tport:\t1\n"
    "\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n"
    "\t\t\tmax_mtu:\t\t4096 (5)\n"
    "\t\t\tactive_mtu:\t\t4096 (5)\n"
    "\t\t\tsm_lid:\t\t\t0\n"
    "\t\t\tport_lid:\t\t0\n"
    "\t\t\tport_lmc:\t\t0x00\n"
    "\t\t\tlink_layer:\t\tEthernet\n"
    "\n"
)


def test_ibv_devinfo_blocks_match_rdma_core_layout(fake: Fake) -> None:
    proc = fake.run("ibv_devinfo")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.startswith(BNXT_RE0_HOST1 + "hca_id:\tbnxt_re1\n")
    blocks = devinfo_blocks(proc.stdout)
    assert list(blocks) == [f"bnxt_re{k}" for k in range(8)]
    assert "\tnode_guid:\t\t\tb226:28ff:fe01:07f0" in blocks["bnxt_re7"]
    assert all("\t\t\tstate:\t\t\tPORT_ACTIVE (4)" in b for b in blocks.values())


def test_down_port_is_port_down_and_others_stay_active(fake: Fake) -> None:
    fake.state(host_index=2, down_ports=["bnxt_re3"])
    blocks = devinfo_blocks(fake.run("ibv_devinfo").stdout)
    assert "\t\t\tstate:\t\t\tPORT_DOWN (1)\n" in blocks["bnxt_re3"] + "\n"
    assert "PORT_ACTIVE" not in blocks["bnxt_re3"]
    for name, block in blocks.items():
        if name != "bnxt_re3":
            assert "\t\t\tstate:\t\t\tPORT_ACTIVE (4)" in block, name


def test_verbose_gid_table_has_roce_v2_ipv4_at_index_3(fake: Fake) -> None:
    fake.state(host_index=1, down_ports=["bnxt_re3"])
    blocks = devinfo_blocks(fake.run("ibv_devinfo", "-v").stdout)
    gids = [line for line in blocks["bnxt_re0"].splitlines() if "GID[" in line]
    assert gids == [
        "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:b226:28ff:fe01:00f0, RoCE v1",
        "\t\t\tGID[  1]:\t\tfe80::b226:28ff:fe01:f0, RoCE v2",
        "\t\t\tGID[  2]:\t\t0000:0000:0000:0000:0000:ffff:c0aa:0165, RoCE v1",
        "\t\t\tGID[  3]:\t\t::ffff:192.170.1.101, RoCE v2",
    ]
    assert blocks["bnxt_re0"].endswith(gids[-1])  # the GID table closes the port block
    assert "\t\t\tGID[  3]:\t\t::ffff:192.170.6.101, RoCE v2" in blocks["bnxt_re5"]
    down = [line.split(":\t\t")[0] for line in blocks["bnxt_re3"].splitlines() if "GID[" in line]
    assert down == ["\t\t\tGID[  0]", "\t\t\tGID[  1]"]
    assert "\t\t\tphys_state:\t\tDISABLED (3)" in blocks["bnxt_re3"]


def test_roce_ip_follows_host_index_and_base(fake: Fake) -> None:
    fake.state(host_index=7, roce_ip_base="10.200")
    out = fake.run("ibv_devinfo", "-v", "-d", "bnxt_re2").stdout
    assert "\t\t\tGID[  3]:\t\t::ffff:10.200.3.107, RoCE v2\n" in out
    assert list(devinfo_blocks(out)) == ["bnxt_re2"]


def test_devinfo_d_unknown_device_and_l_listing(fake: Fake) -> None:
    proc = fake.run("ibv_devinfo", "-d", "bnxt_re9")
    assert (proc.returncode, proc.stdout) == (255, "")
    assert proc.stderr == "IB device 'bnxt_re9' wasn't found\n"
    listing = fake.run("ibv_devinfo", "-l")
    expected = "8 HCAs found:\n" + "".join(f"\tbnxt_re{k}\n" for k in range(8)) + "\n"
    assert (listing.returncode, listing.stdout) == (0, expected)


def test_devinfo_bad_option_is_getopt_error_and_usage(fake: Fake) -> None:
    proc = fake.run("ibv_devinfo", "-x")
    assert proc.returncode == 255
    assert proc.stderr == "ibv_devinfo: invalid option -- 'x'\n"
    assert proc.stdout.startswith("Usage: ibv_devinfo ")
    assert fake.run("ibv_devinfo", "-i", "2").returncode == 4


def test_missing_nic_is_absent_from_every_ibverbs_output(fake: Fake) -> None:
    fake.state(host_index=1, missing_nics=["bnxt_re7"])
    devices = fake.run("ibv_devices").stdout
    assert "bnxt_re7" not in devices
    assert len(devices.splitlines()) == 2 + 7
    assert list(devinfo_blocks(fake.run("ibv_devinfo", "-v").stdout)) == [
        f"bnxt_re{k}" for k in range(7)
    ]
    listing = fake.run("ibv_devinfo", "-l").stdout
    assert listing.startswith("7 HCAs found:\n")
    assert "bnxt_re7" not in listing
    assert fake.run("ibv_devinfo", "-d", "bnxt_re7").returncode == 255


def test_missing_provider_library_warns_and_hides_all_devices(fake: Fake) -> None:
    fake.provider.unlink()
    devices = fake.run("ibv_devices")
    assert (devices.returncode, devices.stdout, devices.stderr) == (
        0,
        DEVICES_HEADER,
        PROVIDER_WARNING,
    )
    devinfo = fake.run("ibv_devinfo")
    assert (devinfo.returncode, devinfo.stdout) == (255, "")
    assert devinfo.stderr == PROVIDER_WARNING + "No IB devices found\n"
    listing = fake.run("ibv_devinfo", "-l")
    assert (listing.returncode, listing.stdout, listing.stderr) == (
        0,
        "0 HCAs found:\n\n",
        PROVIDER_WARNING,
    )


def test_host_without_nics_has_no_devices_and_no_warning(fake: Fake) -> None:
    fake.provider.unlink()
    fake.state(host_index=3, gpus=0, nics=0)
    devices = fake.run("ibv_devices")
    assert (devices.returncode, devices.stdout, devices.stderr) == (0, DEVICES_HEADER, "")
    devinfo = fake.run("ibv_devinfo")
    assert (devinfo.returncode, devinfo.stdout) == (255, "")
    assert devinfo.stderr == "No IB devices found\n"


def test_state_is_reread_on_every_call(fake: Fake) -> None:
    assert "PORT_DOWN" not in fake.run("ibv_devinfo", "-d", "bnxt_re1").stdout
    fake.state(host_index=1, down_ports=["bnxt_re1"])
    assert "\t\t\tstate:\t\t\tPORT_DOWN (1)\n" in fake.run("ibv_devinfo", "-d", "bnxt_re1").stdout


# ----------------------------------------------------------------------------- amd-smi


def test_amd_smi_list_json_is_a_list_of_present_gpus(fake: Fake) -> None:
    records = fake.json("amd-smi", "list", "--json")
    assert [r["gpu"] for r in records] == list(range(8))
    assert [r["bdf"] for r in records] == SLOT_BDFS
    assert all(
        set(r) == {"gpu", "bdf", "uuid", "kfd_id", "node_id", "partition_id"} for r in records
    )
    assert [r["node_id"] for r in records] == list(range(2, 10))
    assert len({r["uuid"] for r in records}) == 8
    assert all(r["uuid"][2:].startswith("ff74a1-0000-1000-80") for r in records)
    assert len({r["kfd_id"] for r in records}) == 8


def test_amd_smi_gpu_data_format_wraps_the_same_records(fake: Fake) -> None:
    plain = fake.json("amd-smi", "list", "--json")
    fake.state(host_index=1, amd_smi_format="gpu_data")
    assert fake.json("amd-smi", "list", "--json") == {"gpu_data": plain}
    asic = fake.json("amd-smi", "static", "--asic", "--json")
    assert list(asic) == ["gpu_data"]
    assert [r["asic"]["market_name"] for r in asic["gpu_data"]] == ["AMD Instinct MI300X"] * 8


def test_amd_smi_static_asic_json_keys_and_values(fake: Fake) -> None:
    records = fake.json("amd-smi", "static", "--asic", "--json")
    assert len(records) == 8
    asic = records[0]["asic"]
    assert records[0]["gpu"] == 0
    assert {k: v for k, v in asic.items() if k != "asic_serial"} == {
        "market_name": "AMD Instinct MI300X",
        "vendor_id": "0x1002",
        "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
        "subvendor_id": "0x1002",
        "device_id": "0x74a1",
        "subsystem_id": "0x74a1",
        "rev_id": "0x00",
        "oam_id": 0,
        "num_compute_units": 304,
        "target_graphics_version": "gfx942",
    }
    serials = [r["asic"]["asic_serial"] for r in records]
    assert all(s.startswith("0x") and len(s) == 18 for s in serials)
    assert len(set(serials)) == 8
    assert fake.json("amd-smi", "static", "--json") == records


def test_gpu_identity_follows_host_index(fake: Fake) -> None:
    host1 = fake.json("amd-smi", "list", "--json")
    fake.state(host_index=2)
    host2 = fake.json("amd-smi", "list", "--json")
    assert [r["bdf"] for r in host1] == [r["bdf"] for r in host2]
    assert not {r["uuid"] for r in host1} & {r["uuid"] for r in host2}


def test_missing_gpu_is_omitted_and_survivors_renumbered(fake: Fake) -> None:
    full = fake.json("amd-smi", "list", "--json")
    fake.state(host_index=1, missing_gpus=[3])
    records = fake.json("amd-smi", "list", "--json")
    assert [r["gpu"] for r in records] == list(range(7))
    assert [r["bdf"] for r in records] == SLOT_BDFS[:3] + SLOT_BDFS[4:]
    assert [r["uuid"] for r in records] == [r["uuid"] for i, r in enumerate(full) if i != 3]
    asic = fake.json("amd-smi", "static", "--asic", "--json")
    assert [r["asic"]["oam_id"] for r in asic] == [0, 1, 2, 4, 5, 6, 7]


def test_amd_smi_list_text_form(fake: Fake) -> None:
    fake.state(host_index=1, gpus=2)
    record = fake.json("amd-smi", "list", "--json")[1]
    out = fake.run("amd-smi", "list").stdout
    assert out.startswith("GPU: 0\n    BDF: 0000:05:00.0\n    UUID: ")
    assert out.endswith(
        f"GPU: 1\n    BDF: 0000:26:00.0\n    UUID: {record['uuid']}\n"
        f"    KFD_ID: {record['kfd_id']}\n    NODE_ID: 3\n    PARTITION_ID: 0\n\n"
    )
    static = fake.run("amd-smi", "static", "--asic").stdout
    assert "GPU: 1\n    ASIC:\n        MARKET_NAME: AMD Instinct MI300X\n" in static


def test_amd_smi_bad_arguments_exit_2(fake: Fake) -> None:
    for args in (["metric"], ["list", "--bogus"], []):
        proc = fake.run("amd-smi", *args)
        assert proc.returncode == 2, args
        assert proc.stderr.startswith("usage: amd-smi"), args
        assert proc.stdout == ""


# ----------------------------------------------------------------------------- rocm-smi


def test_rocm_smi_productname_json(fake: Fake) -> None:
    cards = fake.json("rocm-smi", "--showproductname", "--json")
    assert list(cards) == [f"card{i}" for i in range(8)]
    amd = fake.json("amd-smi", "list", "--json")
    for i, card in enumerate(cards.values()):
        assert card == {
            "Card Series": "AMD Instinct MI300X",
            "Card Model": "0x74a1",
            "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
            "Card SKU": "M3000100",
            "Subsystem ID": "0x74a1",
            "Device Rev": "0x00",
            "Node ID": str(2 + i),
            "GUID": str(amd[i]["kfd_id"]),
            "GFX Version": "gfx942",
        }


def test_rocm_smi_follows_missing_gpus_and_model(fake: Fake) -> None:
    fake.state(host_index=1, missing_gpus=[0, 5], gpu_model="AMD Instinct MI325X")
    cards = fake.json("rocm-smi", "--showproductname", "--json")
    assert list(cards) == [f"card{i}" for i in range(6)]
    assert {c["Card Series"] for c in cards.values()} == {"AMD Instinct MI325X"}
    ids = fake.json("rocm-smi", "-i", "--json")
    assert ids["card0"]["Device Name"] == "AMD Instinct MI325X"
    assert ids["card0"]["Device ID"] == "0x74a1"


def test_rocm_smi_text_form(fake: Fake) -> None:
    fake.state(host_index=1, gpus=1)
    out = fake.run("rocm-smi", "--showproductname").stdout
    banner = "=" * 28 + " ROCm System Management Interface " + "=" * 28
    assert out.startswith("\n\n" + banner + "\n")
    assert "=" * 38 + " Product Info " + "=" * 38 + "\n" in out
    assert "GPU[0]\t\t: Card Series: \t\tAMD Instinct MI300X\n" in out
    assert "GPU[0]\t\t: GFX Version: \t\tgfx942\n" in out
    assert out.endswith("=" * 34 + " End of ROCm SMI Log =" + "=" * 34 + "\n")


# ----------------------------------------------------------------------------- CPU host


def test_cpu_host_has_no_gpus(fake: Fake) -> None:
    fake.state(host_index=4, gpus=0, nics=0)
    for fmt, empty in (("list", []), ("gpu_data", {"gpu_data": []})):
        fake.state(host_index=4, gpus=0, nics=0, amd_smi_format=fmt)
        assert fake.json("amd-smi", "list", "--json") == empty
        assert fake.json("amd-smi", "static", "--asic", "--json") == empty
    rocm = fake.run("rocm-smi", "--showproductname", "--json")
    # real rocm-smi exits 0 and only warns on stderr
    assert (rocm.returncode, rocm.stdout) == (0, "")
    assert rocm.stderr == "WARNING: No AMD GPUs specified\nWARNING: No JSON data to report\n"


def test_all_gpus_missing_looks_like_no_gpus(fake: Fake) -> None:
    fake.state(host_index=1, missing_gpus=list(range(8)))
    assert fake.json("amd-smi", "list", "--json") == []
    rocm = fake.run("rocm-smi", "--showproductname", "--json")
    assert (rocm.returncode, rocm.stdout) == (0, "")
    assert "WARNING: No AMD GPUs specified" in rocm.stderr


def test_no_amdgpu_driver_fails_like_the_real_tools(fake: Fake) -> None:
    fake.state(host_index=1, amdgpu_driver=False)
    amd = fake.run("amd-smi", "list", "--json")
    assert (amd.returncode, amd.stdout) == (255, "")
    assert "driver not initialized (amdgpu not found in modules)" in amd.stderr
    rocm = fake.run("rocm-smi", "--showproductname", "--json")
    assert (rocm.returncode, rocm.stdout) == (0, "")
    assert rocm.stderr == "ERROR:root:Driver not initialized (amdgpu not found in modules)\n"


# ----------------------------------------------------------------------------- dispatch and state


def test_unknown_tool_is_a_usage_error(fake: Fake) -> None:
    proc = fake.run("lspci")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.startswith("usage: pdfake.py TOOL")


def test_missing_state_file_means_default_host(fake: Fake) -> None:
    fake.state_file.unlink()
    assert len(fake.json("amd-smi", "list", "--json")) == 8
    assert "    bnxt_re0        \tb22628fffe0100f0\n" in fake.run("ibv_devices").stdout


@pytest.mark.parametrize(
    "state",
    [
        {"host_index": 999},
        {"gpus": "8"},
        {"missing_nics": [7]},
        {"amd_smi_format": "yaml"},
        {"roce_ip_base": "192"},
    ],
)
def test_impossible_state_is_reported(fake: Fake, state: dict[str, Any]) -> None:
    fake.state(**state)
    proc = fake.run("ibv_devices")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.startswith("pdfake: bad state: ")


def test_unrelated_state_keys_are_ignored(fake: Fake) -> None:
    fake.state(host_index=1, worker_unhealthy=True, worker_warmup_secs=2.5)
    assert fake.run("ibv_devices").returncode == 0
    assert len(fake.json("amd-smi", "list", "--json")) == 8
