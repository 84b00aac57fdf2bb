"""perftest's ib_write_bw and ib_write_lat: their command lines and their results. PURE.

The argv is built here from validated parts only (NIC names, IB port, GID index, TCP port,
the server's address): the caller runs it over SSH as argv words, never as shell text.

The output formats are perftest's own (linux-rdma/perftest, src/perftest_parameters.h and
.c: RESULT_FMT*, REPORT_FMT*; print_report_bw, print_full_bw_report, print_report_lat,
print_report_lat_duration). Samples from real runs, RoCE and InfiniBand, are in
tests/data/perftest/ (docs/facts.md says where each came from). What the parsers rely on:

* the results header, ``#bytes #iterations BW peak[UNIT] BW average[UNIT] MsgRate[Mpps]``
  with UNIT ``Gb/sec`` (``--report_gbits``), ``MiB/sec`` (perftest since 2022) or ``MB/sec``
  (older perftest; the same 2**20 bytes);
* latency: ``#bytes #iterations t_min[usec] ... 99.9% percentile[usec]`` after ``-n``, or
  ``#bytes #iterations t_avg[usec] tps average`` after ``-D``;
* one row per message size under the header (``-a`` prints many), numbers separated by
  spaces and tabs, an optional CPU utilisation column at the end; perftest may print other
  lines in between ("Conflicting CPU frequency values detected ...").
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Literal

from pdctl.core.host_devices import NIC_NAME, NIC_NAME_RULE

Tool = Literal["ib_write_bw", "ib_write_lat"]
TOOLS: tuple[Tool, ...] = ("ib_write_bw", "ib_write_lat")
DEFAULT_TCP_PORT = 18515  # perftest's own default (DEF_PORT)
MAX_GID_INDEX = 255
MAX_SECONDS = 3600
MAX_ITERATIONS = 10_000_000
MAX_SIZE = 1 << 31  # perftest refuses more than UINT_MAX / 2
# The unit perftest's bandwidth columns are in, to Gb/s: Gb/sec is 125,000,000 bytes;
# MiB/sec (and the MB/sec of older versions) 2**20 bytes (format_factor in print_report_bw).
_TO_GBPS = {"Gb/sec": 1.0, "MiB/sec": 8 * 2**20 / 1e9, "MB/sec": 8 * 2**20 / 1e9}
_BW_HEADER = re.compile(
    r"^\s*#bytes\s+#?iterations\s+BW peak\[(?P<unit>Gb/sec|MiB/sec|MB/sec)\]\s+"
    r"BW average\[(?P=unit)\]\s+MsgRate\[Mpps\]"
)
_LAT_HEADER = re.compile(r"^\s*#bytes\s+#iterations\s+t_min\[usec\]\s+t_max\[usec\]")
_LAT_DURATION_HEADER = re.compile(r"^\s*#bytes\s+#iterations\s+t_avg\[usec\]\s+tps average")
_NUMBER = r"-?\d+(?:\.\d+)?"
_ROW = re.compile(rf"^\s*(\d+)\s+(\d+)((?:\s+{_NUMBER})+)\s*$")
_RULE = re.compile(r"^-{20,}\s*$")
# Hostnames as DNS spells them (the inventory's address when it is not an IP address).
_HOSTNAME = re.compile(
    r"^(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*\Z"
)


class PerftestError(ValueError):
    """perftest's output held no results table, or a value pdctl will not put on a host."""


@dataclass(frozen=True)
class Endpoint:
    """One side of a test: the RDMA device, its IB port, and the GID index on RoCE (None on
    InfiniBand, where perftest addresses the port by its LID)."""

    nic: str
    ib_port: int = 1
    gid_index: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nic, str) or not NIC_NAME.match(self.nic):
            raise PerftestError(f"{self.nic!r} is not an RDMA device name ({NIC_NAME_RULE})")
        if not 1 <= self.ib_port <= 255:
            raise PerftestError(f"IB port {self.ib_port} is not 1..255")
        if self.gid_index is not None and not 0 <= self.gid_index <= MAX_GID_INDEX:
            raise PerftestError(f"GID index {self.gid_index} is not 0..{MAX_GID_INDEX}")


@dataclass(frozen=True)
class Run:
    """What both sides of one test are told: the tool, its TCP port, and how long it runs
    (seconds for ib_write_bw, iterations for ib_write_lat, both when given)."""

    tool: Tool
    tcp_port: int = DEFAULT_TCP_PORT
    duration: int | None = None  # -D
    iterations: int | None = None  # -n
    size: int | None = None  # -s

    def __post_init__(self) -> None:
        if self.tool not in TOOLS:
            raise PerftestError(f"{self.tool!r} is not one of {', '.join(TOOLS)}")
        if not 1 <= self.tcp_port <= 65535:
            raise PerftestError(f"TCP port {self.tcp_port} is not 1..65535")
        if self.duration is not None and not 1 <= self.duration <= MAX_SECONDS:
            raise PerftestError(f"duration {self.duration} s is not 1..{MAX_SECONDS}")
        if self.iterations is not None and not 5 <= self.iterations <= MAX_ITERATIONS:
            raise PerftestError(f"iterations {self.iterations} is not 5..{MAX_ITERATIONS}")
        if self.size is not None and not 1 <= self.size <= MAX_SIZE:
            raise PerftestError(f"message size {self.size} is not 1..{MAX_SIZE}")
        if self.duration is None and self.iterations is None:
            raise PerftestError("a test needs a duration (-D) or iterations (-n)")

    @property
    def seconds_bound(self) -> float:
        """About how long the test itself lasts (for deadlines: a slow link's iterations take
        longer, the caller adds its slack)."""
        return float(self.duration or 0) + (self.iterations or 0) * 1e-3


def check_address(address: str) -> str:
    """The server's address as the client is given it: an IP address or a DNS name."""
    try:
        ipaddress.ip_address(address)
        return address
    except ValueError:
        pass
    if not _HOSTNAME.match(address):
        raise PerftestError(f"{address!r} is not an IP address or a host name")
    return address


def _common(run: Run, side: Endpoint) -> list[str]:
    argv = [run.tool, "-d", side.nic, "-i", str(side.ib_port)]
    if side.gid_index is not None:
        argv += ["-x", str(side.gid_index)]
    argv += ["-p", str(run.tcp_port), "-F"]
    if run.duration is not None:
        argv += ["-D", str(run.duration)]
    if run.iterations is not None:
        argv += ["-n", str(run.iterations)]
    if run.size is not None:
        argv += ["-s", str(run.size)]
    if run.tool == "ib_write_bw":
        argv.append("--report_gbits")
    return argv


def server_argv(run: Run, side: Endpoint) -> list[str]:
    """The server's command: no address, it waits for the client."""
    return _common(run, side)


def client_argv(run: Run, side: Endpoint, server_address: str) -> list[str]:
    address = check_address(server_address)
    extra = ["--ipv6"] if ":" in address else []
    return [*_common(run, side), *extra, address]


def bounded(argv: list[str], seconds: float, *, become: bool) -> list[str]:
    """ARGV under coreutils' timeout (TERM after ``seconds``, KILL 5 s later), through sudo
    when ``become``: perftest never gives up waiting for its peer on its own."""
    limit = max(1, int(seconds + 0.999))
    wrapped = ["timeout", "-k", "5", str(limit), *argv]
    return ["sudo", "-n", "--", *wrapped] if become else wrapped


@dataclass(frozen=True)
class BwRow:
    size: int
    iterations: int
    peak_gbps: float
    average_gbps: float
    msg_rate_mpps: float


@dataclass(frozen=True)
class LatRow:
    size: int
    iterations: int
    average_us: float
    typical_us: float | None = None  # the median; None after -D (perftest prints t_avg only)
    min_us: float | None = None
    max_us: float | None = None
    p99_us: float | None = None
    p999_us: float | None = None


def _rows(text: str, header: re.Pattern[str]) -> list[tuple[re.Match[str], list[list[float]]]]:
    """Each header match with the numeric rows under it (other lines skipped, until a rule
    line after rows or the next header)."""
    found: list[tuple[re.Match[str], list[list[float]]]] = []
    for line in text.splitlines():
        match = header.match(line)
        if match:
            found.append((match, []))
            continue
        if not found:
            continue
        rows = found[-1][1]
        row = _ROW.match(line)
        if row:
            numbers = [float(row.group(1)), float(row.group(2))]
            numbers += [float(n) for n in row.group(3).split()]
            rows.append(numbers)
    return found


def _check_finite(values: list[float], what: str) -> None:
    for value in values:
        if value < 0 or not math.isfinite(value):
            raise PerftestError(f"{what}: {value} is not a measurement")


def parse_bw(text: str) -> list[BwRow]:
    """ib_write_bw's result rows, in Gb/s (whatever unit it printed); PerftestError when
    the output has no results table with at least one row."""
    tables = _rows(text, _BW_HEADER)
    rows: list[BwRow] = []
    for header, numbers in tables:
        factor = _TO_GBPS[header.group("unit")]
        for values in numbers:
            if len(values) < 5:
                raise PerftestError(f"a bandwidth row with {len(values)} columns, not 5")
            _check_finite(values, "ib_write_bw")
            rows.append(
                BwRow(
                    size=int(values[0]),
                    iterations=int(values[1]),
                    peak_gbps=values[2] * factor,
                    average_gbps=values[3] * factor,
                    msg_rate_mpps=values[4],
                )
            )
    if not rows:
        raise PerftestError(
            "no results table in ib_write_bw's output (expected a '#bytes #iterations BW "
            "peak[...] BW average[...] MsgRate[Mpps]' header and a row)"
        )
    return rows


def parse_lat(text: str) -> list[LatRow]:
    """ib_write_lat's result rows (after -n: min, max, typical, average, percentiles; after
    -D: the average only); PerftestError when there are none."""
    rows: list[LatRow] = []
    for _, numbers in _rows(text, _LAT_HEADER):
        for values in numbers:
            if len(values) < 8:
                raise PerftestError(f"a latency row with {len(values)} columns, not 9")
            _check_finite(values, "ib_write_lat")
            rows.append(
                LatRow(
                    size=int(values[0]),
                    iterations=int(values[1]),
                    min_us=values[2],
                    max_us=values[3],
                    typical_us=values[4],
                    average_us=values[5],
                    p99_us=values[7],
                    p999_us=values[8] if len(values) > 8 else None,
                )
            )
    for _, numbers in _rows(text, _LAT_DURATION_HEADER):
        for values in numbers:
            if len(values) < 4:
                raise PerftestError(f"a latency row with {len(values)} columns, not 4")
            _check_finite(values, "ib_write_lat")
            rows.append(
                LatRow(size=int(values[0]), iterations=int(values[1]), average_us=values[2])
            )
    if not rows:
        raise PerftestError(
            "no results table in ib_write_lat's output (expected a '#bytes #iterations "
            "t_min[usec] ...' or '#bytes #iterations t_avg[usec] tps average' header and a row)"
        )
    return rows


# What perftest says on stderr when it cannot run, most telling first.
_FAILURES = (
    "Couldn't connect to",
    "IB device",
    "Port number",
    "No IB devices found",
    "Unable to find",
    "Couldn't listen to port",
    "Failed to",
    "Unable to",
    "Couldn't",
)


def failure_reason(stdout: str, stderr: str, rc: int) -> str:
    """Why a perftest run gave no result, in one line: its own error if it printed one."""
    if rc == 124:
        return "timed out (no peer, or a hung test)"
    lines = [line.strip() for line in (stderr + "\n" + stdout).splitlines() if line.strip()]
    for marker in _FAILURES:
        for line in lines:
            if line.startswith(marker):
                return line[:200]
    if rc == 127:
        return "not installed (install the package perftest)"
    tail = lines[-1][:200] if lines else "no output"
    return f"exited {rc}: {tail}"
