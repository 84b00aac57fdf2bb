"""The lab's perftest stand-ins (pdctl/lab/fakes/pdperf.py) as real processes on loopback:
perftest's command line and errors, output that pdctl's parsers read, bytes paced to the
fake NICs' line rate; and the fake ibv_devinfo's line rate as pdctl reads it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdctl.core import fabric_nics, perftest
from pdctl.lab.fakes import pdfake
from pdctl.lab.state import FakeHardware
from pdctl.onhost.hardware import ibverbs

FAKES = Path(__file__).resolve().parents[3] / "pdctl" / "lab" / "fakes"
PDPERF, PDFAKE = FAKES / "pdperf.py", FAKES / "pdfake.py"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    state = tmp_path / "state.json"
    state.write_text(FakeHardware(host_index=2).model_dump_json())
    provider = tmp_path / "libbnxt_re-rdmav34.so"
    provider.write_bytes(b"\x7fELF fake\n")
    return {**os.environ, "PDFAKE_STATE": str(state), "PDFAKE_PROVIDER_LIB": str(provider)}


def set_state(env: dict[str, str], **changes: Any) -> None:
    path = Path(env["PDFAKE_STATE"])
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PDPERF), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def pair(env: dict[str, str], tool: str, *args: str) -> tuple[str, str]:
    """Server and client of one test; both outputs."""
    port = str(free_port())
    server = subprocess.Popen(
        [sys.executable, str(PDPERF), tool, "-d", "bnxt_re1", "-p", port, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # as pdctl does: the client tries again until the server listens
            client = run(env, tool, "-d", "bnxt_re1", "-p", port, *args, "127.0.0.1")
            if "Couldn't connect to" not in client.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        out, err = server.communicate(timeout=60)
    finally:
        server.kill()
    assert client.returncode == 0, client.stderr
    assert server.returncode == 0, err
    return out, client.stdout


def test_bw_moves_bytes_at_no_more_than_the_line_rate(env: dict[str, str]) -> None:
    server, client = pair(env, "ib_write_bw", "-x", "3", "-F", "--report_gbits", "-n", "100")
    (row,) = perftest.parse_bw(client)
    assert row.size == 65536 and row.iterations == 100
    assert 0 < row.average_gbps <= 2.0 * 1.01  # 1X SDR: 2 Gb/s of data
    assert perftest.parse_bw(server) == [row]  # the server prints the client's report
    assert " Link type       : Ethernet\n GID index       : 3\n" in client
    assert " GID: 00:00:00:00:00:00:00:00:00:00:255:255:192:170:02:102\n" in client
    assert "* Waiting for client to connect... *" in server


def test_bw_duration_and_mebibytes(env: dict[str, str]) -> None:
    _, client = pair(env, "ib_write_bw", "-D", "1")
    assert client.startswith(" WARNING: BW peak won't be measured in this run.\n")
    assert "BW peak[MiB/sec]    BW average[MiB/sec]" in client
    (row,) = perftest.parse_bw(client)
    assert row.peak_gbps == 0.0 and 0 < row.average_gbps <= 2.0 * 1.01


def test_lat_iterations_and_duration(env: dict[str, str]) -> None:
    server, client = pair(env, "ib_write_lat", "-n", "200")
    (row,) = perftest.parse_lat(client)
    assert row.iterations == 200 and row.size == 2
    assert row.min_us is not None and row.typical_us is not None
    assert 0 < row.min_us <= row.typical_us
    assert perftest.parse_lat(server)[0].iterations == 200
    _, client = pair(env, "ib_write_lat", "-D", "1")
    (row,) = perftest.parse_lat(client)
    assert row.typical_us is None and row.average_us > 0 and row.iterations > 10


def test_perftest_errors(env: dict[str, str]) -> None:
    missing = run(env, "ib_write_bw", "-d", "bnxt_re9")
    assert missing.returncode == 1
    assert missing.stderr.startswith("IB device bnxt_re9 not found\n")
    set_state(env, down_ports=["bnxt_re1"])
    down = run(env, "ib_write_bw", "-d", "bnxt_re1")
    assert down.returncode == 1 and down.stderr.startswith(" Port number 1 state is Down\n")
    port = free_port()
    alone = run(env, "ib_write_bw", "-d", "bnxt_re0", "-p", str(port), "127.0.0.1")
    assert alone.returncode == 1
    assert alone.stderr.startswith(f"Couldn't connect to 127.0.0.1:{port}\n")
    assert perftest.failure_reason(alone.stdout, alone.stderr, alone.returncode) == (
        f"Couldn't connect to 127.0.0.1:{port}"
    )
    bad = run(env, "ib_write_bw", "--frobnicate")
    assert bad.returncode == 1
    assert "unrecognized option '--frobnicate'" in bad.stderr
    assert "Parser function exited with Error" in bad.stderr


def test_fake_devinfo_line_rate_is_what_pdctl_reads(env: dict[str, str]) -> None:
    def rates() -> list[float | None]:
        out = subprocess.run(
            [sys.executable, str(PDFAKE), "ibv_devinfo", "-v"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return [
            fabric_nics.line_rate_gbps(p.active_width, p.active_speed)
            for d in ibverbs.parse_ibv_devinfo(out)
            for p in d.ports
        ]

    assert rates() == [2.0] * 8  # the lab's NICs: 1X SDR, what its links carry
    set_state(env, link_width=4, link_speed=100.0, down_ports=["bnxt_re5"])
    assert rates() == [400.0] * 5 + [None] + [400.0] * 2
    set_state(env, link_width=3)
    assert (
        "bad state: link_width must be one of"
        in subprocess.run(
            [sys.executable, str(PDFAKE), "ibv_devinfo", "-v"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        ).stderr
    )


def test_the_stand_in_and_pdctl_agree_on_data_rates() -> None:
    assert pdfake.LANE_DATA_GBPS == fabric_nics.LANE_GBPS
    for speed, code in pdfake.SPEED_CODES.items():
        printed = f"{speed:.1f} Gbps ({code})"
        assert fabric_nics.line_rate_gbps("12X (8)", printed) == pytest.approx(
            12 * pdfake.LANE_DATA_GBPS[code], abs=1e-3
        )
