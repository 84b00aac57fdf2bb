"""pdctl/core/perftest.py on perftest's real output (tests/data/perftest/, sources in its README),
its command lines (what reaches a host's argv), and pdctl/core/fabric_nics.py's line rate and
rails from real `ibv_devinfo -v` output."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.core import fabric_nics, perftest
from pdctl.core.perftest import Endpoint, PerftestError, Run
from pdctl.onhost.hardware import ibverbs

DATA = Path(__file__).resolve().parents[2] / "data"
MIB_TO_GBPS = 8 * 2**20 / 1e9


def sample(name: str) -> str:
    return (DATA / "perftest" / name).read_bytes().decode()


# --------------------------------------------------------------------------- bandwidth


def test_bw_infiniband_report_gbits() -> None:
    rows = perftest.parse_bw(sample("ib_write_bw.ib.gbits.client.txt"))
    assert rows == [perftest.BwRow(65536, 5000, 392.38, 392.34, 0.748336)]


def test_bw_roce_mb_per_sec_is_mebibytes() -> None:
    # Older perftest printed MB/sec for what print_report_bw divides by 0x100000.
    (row,) = perftest.parse_bw(sample("ib_write_bw.roce.mb.client.txt"))
    assert row.size == 65536 and row.iterations == 5000
    assert row.average_gbps == pytest.approx(11660.12 * MIB_TO_GBPS)
    assert row.average_gbps == pytest.approx(97.81, abs=0.01)  # a 100GbE port


def test_bw_duration_has_no_peak() -> None:
    (row,) = perftest.parse_bw(sample("ib_write_bw.roce.mb.duration.client.txt"))
    assert row.peak_gbps == 0.0
    assert row.iterations == 24777100
    assert row.average_gbps == pytest.approx(10322.23 * MIB_TO_GBPS)


def test_bw_roce_gbits_as_posted() -> None:
    (row,) = perftest.parse_bw(sample("ib_write_bw.roce.gbits.post-list.client.txt"))
    assert (row.size, row.average_gbps, row.msg_rate_mpps) == (8, 0.48, 7.498617)


def test_bw_client_and_server_in_one_log() -> None:
    rows = perftest.parse_bw(sample("ib_write_bw.ib.mb.loopback.txt"))
    assert len(rows) == 2
    assert rows[0] == rows[1]
    assert rows[0].average_gbps == pytest.approx(24056.72 * MIB_TO_GBPS)


def test_bw_server_side() -> None:
    (row,) = perftest.parse_bw(sample("ib_write_bw.ib.mb.server.txt"))
    assert row.size == 8388608
    assert row.average_gbps == pytest.approx(195.6, abs=0.1)  # HDR 200


def test_bw_without_a_table_says_what_it_expected() -> None:
    for text in (
        "",
        sample("ib_write_lat.roce.client.txt"),
        "Couldn't connect to 10.0.0.2:18515\n",
    ):
        with pytest.raises(PerftestError, match="no results table in ib_write_bw"):
            perftest.parse_bw(text)


def test_bw_rows_that_are_not_numbers_are_refused() -> None:
    header = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
    with pytest.raises(PerftestError, match="columns"):
        perftest.parse_bw(header + " 65536      5000             392.38\n")


# --------------------------------------------------------------------------- latency


def test_lat_roce_iterations() -> None:
    (row,) = perftest.parse_lat(sample("ib_write_lat.roce.client.txt"))
    assert row == perftest.LatRow(
        size=2,
        iterations=1000,
        average_us=0.78,
        typical_us=0.78,
        min_us=0.76,
        max_us=0.95,
        p99_us=0.83,
        p999_us=0.95,
    )


def test_lat_roce_duration_has_the_average_only() -> None:
    (row,) = perftest.parse_lat(sample("ib_write_lat.roce.duration.client.txt"))
    assert (row.size, row.iterations, row.average_us, row.typical_us) == (2, 58732912, 1.28, None)


def test_lat_infiniband_rows_between_frequency_warnings() -> None:
    rows = perftest.parse_lat(sample("ib_write_lat.ib.server.txt"))
    assert [(r.size, r.typical_us, r.max_us) for r in rows] == [
        (2, 1.87, 5.36),
        (4, 1.85, 5.32),
        (8, 1.88, 9.58),
    ]


def test_lat_without_a_table() -> None:
    with pytest.raises(PerftestError, match="no results table in ib_write_lat"):
        perftest.parse_lat(sample("ib_write_bw.ib.gbits.client.txt"))


# --------------------------------------------------------------------------- command lines


def test_server_and_client_argv() -> None:
    run = Run("ib_write_bw", 18516, duration=3)
    side = Endpoint("bnxt_re3", 1, 3)
    assert perftest.server_argv(run, side) == [
        "ib_write_bw",
        "-d",
        "bnxt_re3",
        "-i",
        "1",
        "-x",
        "3",
        "-p",
        "18516",
        "-F",
        "-D",
        "3",
        "--report_gbits",
    ]
    lat = Run("ib_write_lat", iterations=1000)
    assert perftest.client_argv(lat, Endpoint("mlx5_0"), "10.0.0.12") == [
        "ib_write_lat",
        "-d",
        "mlx5_0",
        "-i",
        "1",
        "-p",
        "18515",
        "-F",
        "-n",
        "1000",
        "10.0.0.12",
    ]  # InfiniBand: no GID index, the LID is used
    assert perftest.client_argv(lat, Endpoint("mlx5_0"), "fd00::12")[-2:] == ["--ipv6", "fd00::12"]


@pytest.mark.parametrize(
    "nic", ["mlx5_0; reboot", "-d", "bnxt re0", "bnxt_re0\n", "", "../x", "a" * 65, "mlx5:0"]
)
def test_device_names_from_facts_are_checked(nic: str) -> None:
    with pytest.raises(PerftestError, match="is not an RDMA device name"):
        Endpoint(nic)


@pytest.mark.parametrize("address", ["10.0.0.1 && reboot", "-h", "$(id)", "a..b", "", "x" * 300])
def test_server_addresses_are_checked(address: str) -> None:
    with pytest.raises(PerftestError, match="not an IP address or a host name"):
        perftest.client_argv(Run("ib_write_bw", duration=1), Endpoint("mlx5_0"), address)


def test_numbers_are_bounded() -> None:
    with pytest.raises(PerftestError, match="GID index"):
        Endpoint("mlx5_0", 1, 300)
    with pytest.raises(PerftestError, match="IB port"):
        Endpoint("mlx5_0", 0)
    with pytest.raises(PerftestError, match="TCP port"):
        Run("ib_write_bw", 70000, duration=1)
    with pytest.raises(PerftestError, match="a duration"):
        Run("ib_write_bw")
    with pytest.raises(PerftestError, match="is not one of"):
        Run("ib_send_bw", duration=1)  # type: ignore[arg-type]


def test_bounded_wraps_in_timeout_and_sudo() -> None:
    argv = ["ib_write_bw", "-d", "mlx5_0"]
    assert perftest.bounded(argv, 33.2, become=False) == ["timeout", "-k", "5", "34", *argv]
    assert perftest.bounded(argv, 10, become=True)[:5] == ["sudo", "-n", "--", "timeout", "-k"]


def test_failure_reasons() -> None:
    assert perftest.failure_reason("", "Couldn't connect to 10.0.0.2:18515\n", 1) == (
        "Couldn't connect to 10.0.0.2:18515"
    )
    assert (
        perftest.failure_reason("", "IB device mlx5_9 not found\n Unable to find the ...\n", 1)
        == "IB device mlx5_9 not found"
    )
    assert perftest.failure_reason("", "", 124).startswith("timed out")
    assert "install the package perftest" in perftest.failure_reason("", "sh: 1: nope\n", 127)
    assert perftest.failure_reason("", "", 3) == "exited 3: no output"


# --------------------------------------------------------------------------- line rate, rails


@pytest.mark.parametrize(
    ("width", "speed", "gbps"),
    [
        ("4X (2)", "100.0 Gbps (128)", 400.0),  # NDR
        ("4X (2)", "50.0 Gbps (64)", 200.0),  # HDR
        ("4X (2)", "25.0 Gbps (32)", 100.0),  # EDR / 100GbE RoCE
        ("2X (16)", "100.0 Gbps (128)", 200.0),  # 200GbE on two NDR lanes
        ("4X (2)", "10.0 Gbps (4)", 32.0),  # QDR: 8b/10b
        ("1X (1)", "10.0 Gbps (8)", 10.0),  # FDR10: 10GbE RoCE
        ("4X (2)", "14.0 Gbps (16)", pytest.approx(54.545, abs=0.01)),  # FDR: 64b/66b
        ("1X (1)", "2.5 Gbps (1)", 2.0),  # SDR: the lab's NICs
        ("4X (2)", "invalid speed (0)", None),  # a port that is down
        ("invalid widthX (0)", "25.0 Gbps (32)", None),
        ("", "", None),
        (None, "25.0 Gbps (32)", None),
    ],
)
def test_line_rate(width: object, speed: object, gbps: object) -> None:
    assert fabric_nics.line_rate_gbps(width, speed) == gbps


def test_rails_from_real_ibv_devinfo() -> None:
    text = (DATA / "hardware" / "ibv_devinfo-vv.mlx5-hdr-ucx.txt").read_text()
    devices = ibverbs.parse_ibv_devinfo(text)
    port = devices[0].port(1)
    assert port is not None and (port.active_width, port.active_speed) == (
        "4X (2)",
        "50.0 Gbps (64)",
    )
    facts = {
        "rdma": {
            "devices": [
                {
                    "name": d.name,
                    "driver": "mlx5",
                    "ports": [
                        {
                            "port": p.number,
                            "state": p.state,
                            "link_layer": p.link_layer,
                            "active_width": p.active_width,
                            "active_speed": p.active_speed,
                            "gids": [],
                        }
                        for p in d.ports
                    ],
                }
                for d in devices
            ]
        }
    }
    rails = fabric_nics.rails(facts, "mlx5", 3)
    assert [(n.name, n.roce, n.gid_index, n.rate_gbps, n.active) for n in rails] == [
        ("mlx5_0", False, None, 200.0, True),  # InfiniBand: a LID, no GID index
        ("mlx5_1", False, None, None, False),
    ]


def test_roce_gid_index_is_one_the_host_shows() -> None:
    def facts(gids: list[dict[str, object]]) -> dict[str, object]:
        port = {"port": 1, "state": "PORT_ACTIVE", "link_layer": "Ethernet", "gids": gids}
        return {"rdma": {"devices": [{"name": "bnxt_re0", "driver": "bnxt_re", "ports": [port]}]}}

    v2 = [
        {"index": 1, "address": "fe80::1", "kind": "RoCE v2"},
        {"index": 5, "address": "::ffff:10.1.0.5", "kind": "RoCE v2"},
    ]
    assert fabric_nics.rails(facts(v2), "bnxt_re", 3)[0].gid_index == 5  # IPv4 first
    v2.append({"index": 3, "address": "::ffff:10.1.0.5", "kind": "RoCE v2"})
    assert fabric_nics.rails(facts(v2), "bnxt_re", 3)[0].gid_index == 3  # the fleet's own
    assert fabric_nics.rails(facts([]), "bnxt_re", 3)[0].gid_index == 3  # older facts
