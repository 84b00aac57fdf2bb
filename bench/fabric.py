"""bench fabric: `pdctl fleet check --fabric` (a full mesh in round-robin rounds, every pair of
a round at once) against the same pairs one after another, as a hand-run script does them.

Both run the same tests (ib_write_bw for 200 x 64 KiB, then ib_write_lat's 1000 iterations,
on rail 0) on a lab of GPU hosts. The script, per pair: `ssh` to start the server in the
background, `sleep 1` for it to listen (what such scripts do), `ssh` the client, wait for the
server; the same for the latency test. pdctl is timed by its report's own clock (the fabric
part: its SSH probe and every round), its whole command (preflight included) is in the line.
"""

from __future__ import annotations

import itertools
import json
import shlex
import subprocess
import time
from collections.abc import Callable

from bench.lablib import FLEET, PDCTL, BenchError, BenchLab, stopwatch
from pdctl.core import fabric_schedule, perftest
from pdctl.core.fabric_nics import FabricNic

HOSTS = 16
ITERATIONS = 200
LAT_ITERATIONS = 1000
RAIL = 0
NIC = f"bnxt_re{RAIL}"
GID_INDEX = 3  # the lab's RoCE v2 IPv4 GID (pdfake.py's GID table)
SERVER_WAIT = 60.0

Progress = Callable[[str], None]


def runs() -> list[perftest.Run]:
    return [
        perftest.Run("ib_write_bw", iterations=ITERATIONS),
        perftest.Run("ib_write_lat", iterations=LAT_ITERATIONS),
    ]


def _ssh(lab: BenchLab, address: str, argv: list[str]) -> list[str]:
    """The real ssh client, as the operator's script runs it (the lab's key; lab hosts get
    fresh host keys at every boot, so none is pinned here)."""
    key = str(lab.home / ".pdctl" / "lab" / "id_ed25519")
    return [
        "ssh",
        "-i",
        key,
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "BatchMode=yes",
        f"root@{address}",
        shlex.join(argv),
    ]


def _pair(lab: BenchLab, client: str, server: str) -> bool:
    """One pair's tests, as the script runs them; whether both printed their results."""
    side = perftest.Endpoint(NIC, 1, GID_INDEX)
    ok = True
    for run in runs():
        limit = run.seconds_bound + 30
        server_argv = perftest.bounded(perftest.server_argv(run, side), limit, become=False)
        client_argv = perftest.bounded(perftest.client_argv(run, side, server), limit, become=False)
        with subprocess.Popen(
            _ssh(lab, server, server_argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ) as background:
            time.sleep(1)
            done = subprocess.run(
                _ssh(lab, client, client_argv),
                capture_output=True,
                text=True,
                timeout=limit + 10,
                check=False,
            )
            background.wait(timeout=SERVER_WAIT)
        try:
            parse = perftest.parse_bw if run.tool == "ib_write_bw" else perftest.parse_lat
            parse(done.stdout)
        except perftest.PerftestError:
            ok = False
    return ok


def one_after_another(lab: BenchLab, gpu: list[str], progress: Progress) -> tuple[float, int]:
    """Seconds for every pair in turn, and how many pairs gave their results."""
    pairs = list(itertools.combinations(gpu, 2))
    good = 0
    with stopwatch() as took:
        for number, (client, server) in enumerate(pairs, 1):
            if number % 20 == 1:
                progress(f"fabric baseline: pair {number}/{len(pairs)}")
            good += _pair(lab, client, server)
    return took[0], good


def pdctl_mesh(lab: BenchLab) -> tuple[float, float, dict[str, object]]:
    """`pdctl fleet check --fabric` on rail 0: the fabric part's seconds (its report), the
    whole command's, and the report (it may fail: the lab's CPU carries every pair of a
    round at once; the benchmark measures time)."""
    argv = [PDCTL, "--json", "-q", "fleet", "check", FLEET, "--fabric"]
    argv += ["--rails", str(RAIL), "--iterations", str(ITERATIONS)]
    with stopwatch() as took:
        proc = subprocess.run(argv, env=lab.env, capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 5):
        raise BenchError(f"fleet check --fabric exited {proc.returncode}: {proc.stderr[-2000:]}")
    fabric: dict[str, object] = json.loads(proc.stdout)["fabric"]
    return float(str(fabric["seconds"])), took[0], fabric


def measure(lab: BenchLab, progress: Progress) -> tuple[float, float, str]:
    status = lab.status()
    gpu = sorted(h["address"] for h in status["hosts"] if h["kind"] == "gpu")
    progress(f"fabric: pdctl, {len(gpu)} GPU hosts in rounds")
    ours, whole, fabric = pdctl_mesh(lab)
    progress(f"fabric: the same pairs one after another ({len(gpu) * (len(gpu) - 1) // 2})")
    theirs, good = one_after_another(lab, gpu, progress)
    pairs = fabric["pairs"]
    count = len(pairs) if isinstance(pairs, list) else 0
    extra = (
        f"{count} pairs in {fabric['rounds']} rounds, {fabric['summary']}; whole command "
        f"{whole:.1f} s (preflight included); the script's pairs with results: {good}"
    )
    return ours, theirs, extra


def check_inputs() -> None:
    """The schedule a 16-host mesh gets, and the script's commands (no lab)."""
    nics = [FabricNic(NIC, gid_index=GID_INDEX, rate_gbps=2.0)]
    schedule = fabric_schedule.mesh({f"10.77.9.{11 + i}": nics for i in range(HOSTS)})
    if len(schedule.rounds) != HOSTS - 1 or len(schedule.pairs()) != HOSTS * (HOSTS - 1) // 2:
        raise BenchError(f"a {HOSTS}-host mesh should be {HOSTS - 1} rounds: {schedule.rounds}")
    for waves in schedule.rounds:
        hosts = [h for wave in waves for link in wave for h in link.pair]
        if len(hosts) != len(set(hosts)) or len(hosts) != HOSTS:
            raise BenchError("a round with a host twice, or without every host")
    side = perftest.Endpoint(NIC, 1, GID_INDEX)
    for run in runs():
        perftest.client_argv(run, side, "10.77.9.12")
        perftest.server_argv(run, side)
