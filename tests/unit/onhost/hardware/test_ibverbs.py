"""pdctl/onhost/hardware/ibverbs.py on real tool output: ibv_devices, ibv_devinfo, libibverbs'
provider warnings (samples in tests/data/hardware/, sources in its README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdctl.onhost.hardware.ibverbs import (
    Gid,
    parse_ibv_devices,
    parse_ibv_devinfo,
    provider_warnings,
)
from pdctl.onhost.hardware.parsing import ParseError
from tests.unit.onhost.hardware.samples import (
    BYTEPS_WARNING,
    FAILED_LIST,
    MOONCAKE_IBV_DEVICES,
    OFED_DEVINFO,
    OLD_GIDS_DEVINFO,
    PDFAKE,
    PERFTEST_WARNINGS,
    PIB_NO_DEVICES_STDERR,
    RDMATOP_IBV_DEVICES,
    REF_GID3,
    REF_IBV_DEVICES,
    REF_IBV_DEVINFO,
    REF_PROVIDER_WARNING,
    RXE_DEVINFO,
    RXE_HEADER_ONLY_STDOUT,
    SGLANG_ABI_WARNINGS,
    devinfo_block,
    rdma_commands,
)


def test_ibv_devices_reference_sample() -> None:
    assert parse_ibv_devices(REF_IBV_DEVICES) == [("bnxt_re0", "b22628fffed3b0f0")]


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        (RDMATOP_IBV_DEVICES, [("mlx5_bond_0", "e8ebd30300381588")]),
        (
            MOONCAKE_IBV_DEVICES,
            [("mlx5_bond_0", "08c0eb0300da0fce"), ("mlx5_bond_1", "08c0eb0300da0fc2")],
        ),
    ],
    ids=["tabs", "spaces"],
)
def test_ibv_devices_real_outputs(sample: str, expected: list[tuple[str, str]]) -> None:
    assert parse_ibv_devices(sample) == expected


def test_ibv_devices_header_only_is_no_device() -> None:
    assert parse_ibv_devices(RXE_HEADER_ONLY_STDOUT) == []
    assert parse_ibv_devices(rdma_commands(provider=False)["ibv_devices"]["stdout"]) == []


def test_ibv_devices_failure_outputs_raise_with_what_was_expected() -> None:
    with pytest.raises(ParseError, match="could not list devices: Failed to get IB devices list"):
        parse_ibv_devices(FAILED_LIST)
    with pytest.raises(ParseError, match=r"expected ibv_devices' header .* got 'empty output'"):
        parse_ibv_devices("")
    with pytest.raises(ParseError, match="expected an ibv_devices row"):
        parse_ibv_devices(REF_IBV_DEVICES + "    bnxt_re1        \tnot-a-guid\n")
    assert issubclass(ParseError, ValueError)


def test_ibv_devinfo_reference_block() -> None:
    [device] = parse_ibv_devinfo(REF_IBV_DEVINFO)
    assert (device.name, device.fw_ver, device.node_guid, device.vendor_id) == (
        "bnxt_re0",
        "230.2.49.0",
        "b226:28ff:fed3:b0f0",
        "0x14e4",
    )
    [port] = device.ports
    assert (port.number, port.state, port.state_code) == (1, "PORT_ACTIVE", 4)
    assert (port.link_layer, port.active_mtu, port.gids) == ("Ethernet", 4096, [])


def test_ibv_devinfo_verbose_gid_table() -> None:
    text = (
        REF_IBV_DEVINFO.rstrip("\n")
        + "\n"
        + (
            "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:b226:28ff:fed3:b0f0, RoCE v1\n"
            "\t\t\tGID[  1]:\t\tfe80::b226:28ff:fed3:b0f0, RoCE v2\n" + REF_GID3 + "\n"
        )
    )
    port = parse_ibv_devinfo(text)[0].ports[0]
    assert port.gids == [
        Gid(0, "fe80:0000:0000:0000:b226:28ff:fed3:b0f0", "RoCE v1"),
        Gid(1, "fe80::b226:28ff:fed3:b0f0", "RoCE v2"),
        Gid(3, "::ffff:192.170.1.101", "RoCE v2"),
    ]
    assert port.gid(3) == Gid(3, "::ffff:192.170.1.101", "RoCE v2")
    assert port.gid(2) is None


def test_ibv_devinfo_real_output_with_spaces_and_no_link_layer() -> None:
    [device] = parse_ibv_devinfo(RXE_DEVINFO)
    assert (device.name, device.node_guid, device.fw_ver) == (
        "rxe0",
        "428d:5cff:fe35:bb12",
        "0.0.0",
    )
    [port] = device.ports
    assert (port.state, port.state_code, port.active_mtu, port.link_layer) == (
        "PORT_ACTIVE",
        4,
        1024,
        "",
    )


def test_ibv_devinfo_ofed_output() -> None:
    [device] = parse_ibv_devinfo(OFED_DEVINFO)
    assert device.name == "mlx4_2"
    assert device.vendor_id == "0x02c9"
    assert [(p.number, p.state, p.link_layer) for p in device.ports] == [
        (1, "PORT_ACTIVE", "InfiniBand")
    ]


def test_ibv_devinfo_untyped_gids_of_old_rdma_core() -> None:
    port = parse_ibv_devinfo(OLD_GIDS_DEVINFO)[0].ports[0]
    assert port.gids == [Gid(0, "fe80:0000:0000:0000:0002:c903:00f3:3a01", "")]


def test_ibv_devinfo_multiple_devices_and_states() -> None:
    devices = parse_ibv_devinfo(devinfo_block(0) + devinfo_block(3, active=False))
    assert [d.name for d in devices] == ["bnxt_re0", "bnxt_re3"]
    down = devices[1].ports[0]
    assert (down.state, down.state_code) == ("PORT_DOWN", 1)
    assert [g.index for g in down.gids] == [0, 1]
    assert [g.kind for g in devices[0].ports[0].gids] == ["RoCE v1", "RoCE v2"] * 2


def test_ibv_devinfo_failure_outputs() -> None:
    assert parse_ibv_devinfo("") == []
    with pytest.raises(ParseError, match="found no device: No IB devices found"):
        parse_ibv_devinfo("No IB devices found\n")
    with pytest.raises(ParseError, match="found no device: Failed to get IB devices list"):
        parse_ibv_devinfo(FAILED_LIST)
    with pytest.raises(ParseError, match=r"line 1: expected ibv_devinfo to start with 'hca_id:"):
        parse_ibv_devinfo(REF_PROVIDER_WARNING + "\n" + REF_IBV_DEVINFO)
    with pytest.raises(ParseError, match="expected a 'state:' line in port 1 of bnxt_re0"):
        parse_ibv_devinfo("hca_id:\tbnxt_re0\n\t\tport:\t1\n\t\t\tlink_layer:\t\tEthernet\n")
    with pytest.raises(ParseError, match="expected a port number after 'port:'"):
        parse_ibv_devinfo("hca_id:\tbnxt_re0\n\t\tport:\tone\n")


def test_ibv_devinfo_of_the_lab_fake(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"host_index": 2, "nics": 3, "down_ports": ["bnxt_re1"]}))
    lib = tmp_path / "libbnxt_re-rdmav34.so"
    lib.write_bytes(b"\x7fELF")
    env = {**os.environ, "PDFAKE_STATE": str(state), "PDFAKE_PROVIDER_LIB": str(lib)}
    proc = subprocess.run(
        [sys.executable, str(PDFAKE), "ibv_devinfo", "-v"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=True,
    )
    devices = parse_ibv_devinfo(proc.stdout)
    assert [(d.name, d.ports[0].state, d.ports[0].state_code) for d in devices] == [
        ("bnxt_re0", "PORT_ACTIVE", 4),
        ("bnxt_re1", "PORT_DOWN", 1),
        ("bnxt_re2", "PORT_ACTIVE", 4),
    ]
    assert devices[2].ports[0].gid(3) == Gid(3, "::ffff:192.170.3.102", "RoCE v2")
    assert devices[1].ports[0].gid(3) is None


def test_provider_warnings() -> None:
    assert provider_warnings(REF_PROVIDER_WARNING + "\nNo IB devices found\n") == [
        REF_PROVIDER_WARNING
    ]
    assert len(provider_warnings(PERFTEST_WARNINGS)) == 2
    abi = SGLANG_ABI_WARNINGS.splitlines()
    assert provider_warnings(SGLANG_ABI_WARNINGS) == [abi[0], abi[2]]  # deduplicated, in order
    assert provider_warnings(PIB_NO_DEVICES_STDERR) == PIB_NO_DEVICES_STDERR.splitlines()[:2]
    assert provider_warnings(BYTEPS_WARNING) == [BYTEPS_WARNING]
    assert provider_warnings("") == []
    assert provider_warnings(FAILED_LIST) == []
