#!/usr/bin/env python3
"""Stand-ins for perftest's ib_write_bw and ib_write_lat on lab hosts (chosen by the name
it is invoked as, through symlinks).

They speak perftest's command line (server: no address; client: the server's address;
-d, -i, -x, -p, -D, -n, -s, -F, --report_gbits), check the device and its port against
the host's fake hardware (pdfake.py's state: a missing NIC, a port that is down), and
print perftest's own output: the test's parameters, the local and remote address lines
and the results table, in the formats of linux-rdma/perftest's perftest_parameters.[ch]
and perftest_communication.h (RESULT_FMT*, REPORT_FMT*, BASIC_ADDR_FMT, PERF_GID_FMT).

They move real bytes between the lab hosts over TCP to the server's address (perftest's
own out-of-band channel is TCP too; here the data rides it as well): ib_write_bw streams
for the duration (or the iterations' bytes), paced to the lower line rate of the two NICs
(a NIC moves no more than its line rate), so a link capped with tc (`pdctl lab fault HOST
link-slow RATE`) shows in the numbers; ib_write_lat ping-pongs the message. Zero-copy
(sendfile, splice) where the host's Python has it, so many tests at once stay cheap.

Standard library only: it runs on emulated hosts that have just python3.
"""

from __future__ import annotations

import contextlib
import getopt
import itertools
import json
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdctl.lab.fakes import pdfake
else:  # on a lab host: the fake hardware's state and NICs, in the file beside this one
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import pdfake

LINE = "-" * 87 + "\n"
TOOLS = ("ib_write_bw", "ib_write_lat")
SHORT = "p:d:i:x:D:n:s:FaV"
LONG = [
    "port=",
    "ib-dev=",
    "ib-port=",
    "gid-index=",
    "duration=",
    "iters=",
    "size=",
    "CPU-freq",
    "report_gbits",
    "ipv6",
    "version",
]
CHUNK = 1 << 20
DEFAULT_PORT = 18515
LAT_MEASURE_TAIL = 2  # perftest drops this many of the largest samples


class Failed(Exception):
    """perftest's own error lines (stderr), then exit 1."""


class Version(Exception):
    """-V: print the version and exit 0 (perftest's VERSION_EXIT)."""


@dataclass
class Options:
    tool: str
    port: int = DEFAULT_PORT
    device: str | None = None
    ib_port: int = 1
    gid_index: int | None = None
    duration: int | None = None
    iterations: int | None = None
    size: int | None = None
    gbits: bool = False
    server: str | None = None  # the client's server address; None: this is the server

    @property
    def bw(self) -> bool:
        return self.tool == "ib_write_bw"

    @property
    def message_size(self) -> int:
        return self.size or (65536 if self.bw else 2)


def _int(text: str, what: str, low: int, high: int) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise Failed(f" Invalid {what} value: {text}\n Parser function exited with Error\n")
    return value


def _size(text: str) -> int:
    factor = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
    digits = text[:-1] if factor > 1 else text
    return _int(digits, "Message Size", 1, 2**31) * factor


_SETTERS = {
    "-p": ("port", "Port", 1, 65535),
    "--port": ("port", "Port", 1, 65535),
    "-i": ("ib_port", "IB Port", 1, 255),
    "--ib-port": ("ib_port", "IB Port", 1, 255),
    "-x": ("gid_index", "Gid index", 0, 255),
    "--gid-index": ("gid_index", "Gid index", 0, 255),
    "-D": ("duration", "Duration period", 1, 86400),
    "--duration": ("duration", "Duration period", 1, 86400),
    "-n": ("iterations", "Iteration num", 5, 2**32),
    "--iters": ("iterations", "Iteration num", 5, 2**32),
}


def parse_args(tool: str, args: Sequence[str]) -> Options:
    try:
        opts, rest = getopt.gnu_getopt(list(args), SHORT, LONG)
    except getopt.GetoptError as exc:
        raise Failed(
            pdfake._getopt_error(tool, exc) + " Parser function exited with Error\n"
        ) from None
    options = Options(tool=tool)
    for opt, value in opts:
        if opt in _SETTERS:
            field, what, low, high = _SETTERS[opt]
            setattr(options, field, _int(value, what, low, high))
        elif opt in ("-d", "--ib-dev"):
            options.device = value
        elif opt in ("-s", "--size"):
            options.size = _size(value)
        elif opt == "--report_gbits":
            options.gbits = True
        elif opt in ("-V", "--version"):
            raise Version
    if len(rest) > 1:
        raise Failed(" Parser function exited with Error\n")
    options.server = rest[0] if rest else None
    if options.duration is None and options.iterations is None:
        options.iterations = 5000 if options.bw else 1000  # perftest's defaults
    return options


def find_nic(options: Options, state: pdfake.State) -> pdfake.Nic:
    nics, _warning = pdfake.get_device_list(state)
    if not nics:
        raise Failed("No IB devices found\n")
    nic = next((n for n in nics if n.name == options.device), None) if options.device else nics[0]
    if nic is None:
        raise Failed(
            f"IB device {options.device} not found\n Unable to find the Infiniband/RoCE device\n"
        )
    if options.ib_port != 1:
        raise Failed(f" Unable to query port {options.ib_port} attributes\n")
    if not nic.active:
        raise Failed(" Port number 1 state is Down\n Couldn't get context for the device\n")
    return nic


# --------------------------------------------------------------------------- printing


def c_hex(value: int, width: int) -> str:
    """C's %#0<width>x: 0x and zero padding, but a bare zero without the 0x."""
    if value == 0:
        return "0" * width
    return f"{value:#0{width}x}"


def test_info(options: Options, nic: pdfake.Nic) -> str:
    title = "RDMA_Write BW Test" if options.bw else "RDMA_Write Latency Test"
    link = "IB" if nic.link_layer == "ib" else "Ethernet"
    lines = [
        LINE,
        f"                    {title}\n",
        f" Dual-port       : OFF\t\tDevice         : {nic.name}\n",
        " Number of qps   : 1\t\tTransport type : IB\n",
        " Connection type : RC\t\tUsing SRQ      : OFF\n",
        " PCIe relax order: ON\t\tLock-free      : OFF\n",
        " ibv_wr* API     : ON\t\tUsing Enhanced Reorder      : OFF\n",
    ]
    if options.server is not None:
        lines.append(f" TX depth        : {128 if options.bw else 1}\n")
    if options.bw:
        lines += [" CQ Moderation   : 1\n", " CQE Poll Batch  : Dynamic\n"]
    lines += [" Mtu             : 4096[B]\n", f" Link type       : {link}\n"]
    if options.gid_index is not None:
        lines.append(f" GID index       : {options.gid_index}\n")
    lines += [
        f" Max inline data : {0 if options.bw else 220}[B]\n",
        " rdma_cm QPs\t : OFF\n",
        " Data ex. method : Ethernet\n",
        LINE,
    ]
    return "".join(lines)


def _gid(nic: pdfake.Nic, index: int | None) -> bytes:
    if index is None:
        return b"\0" * 16
    if nic.link_layer == "eth" and index in (2, 3) and nic.active:
        return b"\0" * 10 + b"\xff\xff" + bytes(int(octet) for octet in nic.ipv4.split("."))
    return b"\xfe\x80" + b"\0" * 6 + nic.guid.to_bytes(8, "big")


def address_lines(side: str, record: dict[str, int | str]) -> str:
    line = (
        f" {side} address: LID {c_hex(int(record['lid']), 4)} QPN {c_hex(int(record['qpn']), 6)}"
        f" PSN {c_hex(int(record['psn']), 6)} RKey {c_hex(int(record['rkey']), 8)}"
        f" VAddr {c_hex(int(record['vaddr']), 16)}\n"
    )
    gid = str(record.get("gid") or "")
    if gid:
        line += " GID: " + ":".join(f"{b:02d}" for b in bytes.fromhex(gid)) + "\n"
    return line


def my_address(options: Options, nic: pdfake.Nic) -> dict[str, int | str]:
    seed = int.from_bytes(os.urandom(8), "big")
    return {
        "lid": nic.lid,
        "qpn": 0x100 + seed % 0x7F00,
        "psn": seed >> 8 & 0xFFFFFF,
        "rkey": 0x1FFF00 + seed % 0xFF,
        "vaddr": 0x7F0000000000 + (seed >> 20 & 0xFFFFFF) * 0x1000,
        "gid": _gid(nic, options.gid_index).hex() if options.gid_index is not None else "",
    }


def bw_report(options: Options, total: int, seconds: float) -> str:
    size = options.message_size
    iterations = max(1, total // size)
    unit = 1e9 / 8 if options.gbits else float(1 << 20)
    average = total / seconds / unit if seconds > 0 else 0.0
    # -D measures no peak (" WARNING: BW peak won't be measured in this run.").
    peak = 0.0 if options.duration else average
    rate = iterations / seconds / 1e6 if seconds > 0 else 0.0
    header = (
        " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
        if options.gbits
        else " #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]\n"
    )
    if options.gbits and average < 0.1:  # REPORT_FMT_EXT: more digits for a slow link
        row = f" {size:<7}    {iterations}           {peak:<7.6f}            {average:<7.6f}"
        row += f"            {rate:<7.6f}\n"
    else:
        row = f" {size:<7}    {iterations:<10}       {peak:<7.2f}            {average:<7.2f}"
        row += f"\t\t     {rate:<7.6f}\n"
    return header + row


def lat_report(options: Options, stamps: list[float], seconds: float) -> str:
    """perftest's print_report_lat (-n) or print_report_lat_duration (-D), from the times
    each iteration started (one round trip apart; latency is half of one)."""
    size, iterations = options.message_size, len(stamps)
    if options.duration:
        average = seconds * 1e6 / 2 / max(iterations, 1)
        tps = iterations / seconds if seconds > 0 else 0.0
        header = " #bytes        #iterations       t_avg[usec]    tps average\n"
        return (
            header
            + f" {size:<7}       {iterations}            {average:<7.2f}        {tps:<7.2f}\n"
        )
    deltas = sorted((b - a) * 1e6 / 2 for a, b in itertools.pairwise(stamps))
    count = max(1, len(deltas) - LAT_MEASURE_TAIL)
    kept = deltas[:count] or [0.0]
    median = (
        kept[len(kept) // 2]
        if len(kept) % 2
        else (kept[len(kept) // 2 - 1] + kept[len(kept) // 2]) / 2
    )
    average = sum(kept) / len(kept)
    stdev = math.sqrt(sum((average - d) ** 2 for d in kept) / len(kept))
    top = deltas[min(count, len(deltas) - 1)] if deltas else 0.0
    p99 = deltas[min(math.ceil(count * 0.99), len(deltas) - 1)] if deltas else 0.0
    p999 = deltas[min(math.ceil(count * 0.999), len(deltas) - 1)] if deltas else 0.0
    header = (
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]"
        "    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n"
    )
    row = (
        f" {size:<7} {iterations}          {kept[0]:<7.2f}        {top:<7.2f}      "
        f"{median:<7.2f}  \t       {average:<7.2f}     \t{stdev:<7.2f}\t\t{p99:<7.2f} "
        f"\t\t{p999:<7.2f}\n"
    )
    return header + row


# --------------------------------------------------------------------------- the wire


def _send_line(sock: socket.socket, doc: dict[str, object]) -> None:
    sock.sendall(json.dumps(doc).encode() + b"\n")


def _recv_line(sock: socket.socket, buffer: bytearray) -> dict[str, object]:
    while b"\n" not in buffer:
        chunk = sock.recv(4096)
        if not chunk:
            raise Failed(" Failed to exchange data between server and clients\n")
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    doc = json.loads(line)
    if not isinstance(doc, dict):
        raise Failed(" Failed to exchange data between server and clients\n")
    return doc


def _recv_exact(sock: socket.socket, size: int, buffer: bytearray) -> None:
    while len(buffer) < size:
        chunk = sock.recv(max(size - len(buffer), 4096))
        if not chunk:
            raise Failed(" Failed to exchange data between server and clients\n")
        buffer += chunk
    del buffer[:size]


def _sink(sock: socket.socket, pending: int) -> int:
    """Read the stream to its end into nothing; the bytes read (``pending`` already were)."""
    total = pending
    splice = getattr(os, "splice", None)
    if splice is not None:
        read_end, write_end = os.pipe()
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            while moved := splice(sock.fileno(), write_end, CHUNK):
                total += moved
                while moved:
                    moved -= splice(read_end, null, moved)
        finally:
            for fd in (read_end, write_end, null):
                os.close(fd)
        return total
    buffer = bytearray(CHUNK)
    while received := sock.recv_into(buffer):
        total += received
    return total


def _stream(sock: socket.socket, options: Options, rate_bps: float) -> tuple[int, float]:
    """Send for the duration (or the iterations' bytes) at no more than ``rate_bps``."""
    size = options.message_size
    budget = None if options.duration else (options.iterations or 0) * size
    memfd = os.memfd_create("pdperf") if hasattr(os, "memfd_create") else None
    if memfd is not None:
        os.ftruncate(memfd, CHUNK)
    payload = bytes(CHUNK)
    started = time.monotonic()
    end = started + (options.duration or 0)
    sent = 0
    try:
        while True:
            now = time.monotonic()
            if (options.duration and now >= end) or (budget is not None and sent >= budget):
                break
            count = CHUNK if budget is None else min(CHUNK, budget - sent)
            early = (sent + count) / rate_bps - (now - started)  # never ahead of the line rate
            if early > 0:
                time.sleep(min(early, 0.05))
                continue
            if memfd is not None:
                sent += os.sendfile(sock.fileno(), memfd, 0, count)
            else:
                sock.sendall(payload[:count])
                sent += count
    finally:
        if memfd is not None:
            os.close(memfd)
    return sent, started


def _serve_bw(control: socket.socket, listener: socket.socket) -> None:
    """The bytes come on a second connection, to its end; their count goes back on the
    first (as perftest's server and client exchange their reports on theirs)."""
    data, _ = listener.accept()
    with data:
        total = _sink(data, 0)
    _send_line(control, {"bytes": total})


def _client_bw(control: socket.socket, options: Options, rate_bps: float) -> tuple[int, float]:
    with socket.create_connection(control.getpeername()[:2], timeout=10) as data:
        data.settimeout(None)
        sent, started = _stream(data, options, rate_bps)
    reply = _recv_line(control, bytearray())
    return int(str(reply.get("bytes", sent))), time.monotonic() - started


def _ping_pong(sock: socket.socket, options: Options, *, client: bool) -> tuple[list[float], float]:
    size = options.message_size
    message = bytes(size)
    buffer = bytearray()
    stamps: list[float] = []
    started = time.monotonic()
    end = started + (options.duration or 0)
    count = options.iterations or 0
    while True:
        now = time.monotonic()
        if options.duration:
            if client and now >= end:
                break
        elif len(stamps) >= count:
            break
        stamps.append(now)
        if client:
            sock.sendall(message)
            try:
                _recv_exact(sock, size, buffer)
            except Failed:
                break
        else:
            try:
                _recv_exact(sock, size, buffer)
            except Failed:
                break  # the client's -D ran out: it closed its side
            sock.sendall(message)
    return stamps, time.monotonic() - started


# --------------------------------------------------------------------------- the two roles


def run_server(options: Options, nic: pdfake.Nic) -> str:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("0.0.0.0", options.port))  # noqa: S104 - perftest's server listens on all
        listener.listen(2)
    except OSError:
        raise Failed(
            f"Couldn't listen to port {options.port}\n Unable to init the socket connection\n"
        ) from None
    banner = "\n************************************\n* Waiting for client to connect... *\n"
    banner += "************************************\n"
    sys.stdout.write(banner)
    sys.stdout.flush()
    sock, _ = listener.accept()
    with sock, listener:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = bytearray()
        hello = _recv_line(sock, buffer)
        mine = my_address(options, nic)
        _send_line(sock, {"rate_bps": pdfake.data_rate_gbps(nic) * 1e9 / 8, "address": mine})
        peer = hello.get("address")
        out = test_info(options, nic) + address_lines("local", mine)
        out += address_lines("remote", peer if isinstance(peer, dict) else {}) + LINE
        if options.bw:
            _serve_bw(sock, listener)
            report = _recv_line(sock, bytearray())
            out += str(report.get("table", "")) + LINE
        else:
            stamps, seconds = _ping_pong(sock, options, client=False)
            out += lat_report(options, stamps, seconds) + LINE
    return out


def run_client(options: Options, nic: pdfake.Nic) -> str:
    assert options.server is not None
    try:
        sock = socket.create_connection((options.server, options.port), timeout=10)
    except OSError:
        raise Failed(
            f"Couldn't connect to {options.server}:{options.port}\n"
            " Unable to init the socket connection\n"
        ) from None
    sock.settimeout(None)
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mine = my_address(options, nic)
        _send_line(sock, {"tool": options.tool, "address": mine})
        reply = _recv_line(sock, bytearray())
        peer_rate = float(str(reply.get("rate_bps", 0)))
        rate = min(pdfake.data_rate_gbps(nic) * 1e9 / 8, peer_rate or math.inf)
        peer = reply.get("address")
        out = (
            " WARNING: BW peak won't be measured in this run.\n"
            if options.bw and options.duration
            else ""
        )
        out += test_info(options, nic) + address_lines("local", mine)
        out += address_lines("remote", peer if isinstance(peer, dict) else {}) + LINE
        if options.bw:
            total, seconds = _client_bw(sock, options, rate)
            table = bw_report(options, total, seconds)
            _send_line(sock, {"table": table})
        else:
            stamps, seconds = _ping_pong(sock, options, client=True)
            table = lat_report(options, stamps, seconds)
        out += table + LINE
    return out


def main(argv: Sequence[str]) -> int:
    tool = Path(argv[0]).name if argv else ""
    args = list(argv[1:])
    if tool in ("pdperf.py", "pdperf"):
        tool = args.pop(0) if args else ""
    if tool not in TOOLS:
        sys.stderr.write(f"usage: pdperf.py {{{'|'.join(TOOLS)}}} [ARGS...]\n")
        return 2
    try:
        options = parse_args(tool, args)
        state = pdfake.load_state()
        nic = find_nic(options, state)
        out = run_client(options, nic) if options.server else run_server(options, nic)
    except pdfake.StateError as exc:
        sys.stderr.write(f"pdperf: bad state: {exc}\n")
        return 1
    except Failed as exc:
        sys.stderr.write(str(exc))
        return 1
    except Version:
        sys.stdout.write("Version: 6.22 (pdctl lab stand-in)\n")
        return 0
    except (OSError, ValueError) as exc:
        sys.stderr.write(f" Failed to exchange data between server and clients ({exc})\n")
        return 1
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.write(out)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
