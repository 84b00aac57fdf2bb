"""What the benchmarks share: a lab in its own workspace, pdctl as a user runs it, timing.

Every benchmark runs the real programs (pdctl's CLI, ansible-playbook, SSH, systemd, podman,
SMG) on lab hosts that this run boots, on addresses inside namespaces it created.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdctl.doors.workspace import Workspace
from pdctl.lab.host import SHARE_MOUNT
from pdctl.lab.image import SGLANG

BENCH = Path(__file__).resolve().parent
OUT = BENCH / "out"
REPO = BENCH.parent
PDCTL = str(Path(sys.executable).parent / "pdctl")
SERVICE = "bench"
FLEET = "bench"


class BenchError(RuntimeError):
    """A benchmark step failed: its output says why."""


def line(name: str, pdctl: float, baseline: float, hosts: int, extra: str = "") -> str:
    """The one result line per benchmark: R = baseline / pdctl, higher is better."""
    ratio = baseline / pdctl if pdctl > 0 else float("inf")
    tail = f", {extra}" if extra else ""
    return (
        f"bench {name}: ratio {ratio:.2f} (pdctl {pdctl:.2f} s, baseline {baseline:.2f} s, "
        f"{hosts} hosts{tail})"
    )


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@contextmanager
def cpu_busy() -> Iterator[list[float]]:
    """`with cpu_busy() as b: ...` then b[0] is the share of all cores kept busy meanwhile:
    the lab's hosts run on this machine's cores, so near 1.0 means the run was CPU-bound."""
    box: list[float] = []
    busy, total = cpu_ticks()
    try:
        yield box
    finally:
        busy2, total2 = cpu_ticks()
        box.append((busy2 - busy) / max(1, total2 - total))


def ssh_clients() -> dict[tuple[int, int], float]:
    """CPU seconds so far of each OpenSSH client running in this machine's own mount namespace
    (the lab hosts' processes run in namespaces of their own), by (pid, start time)."""
    own = Path("/proc/self/ns/mnt").readlink()
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[tuple[int, int], float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "ns" / "mnt").readlink() != own:
                continue
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if name != "ssh":
            continue
        fields = rest.split()  # proc(5): from field 3 (state) on; utime 14, stime 15, start 22
        found[(int(entry.name), int(fields[19]))] = (int(fields[11]) + int(fields[12])) / tick
    return found


@contextmanager
def controller_cpu() -> Iterator[list[float]]:
    """`with controller_cpu() as c: ...` then c[0] is the CPU seconds of the commands this
    process ran and waited for meanwhile (pdctl and its Ansible, Mitogen and ssh children),
    and of the OpenSSH ControlPersist masters they left running: a master forks itself away
    from the command that started it, so it is no waited child, yet it carries the encryption
    of every later task to its host. The lab hosts' own work is left out (not descendants,
    other namespaces). c[1] is the masters' part of c[0]."""
    box: list[float] = []

    def used() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    before, masters = used(), ssh_clients()
    try:
        yield box
    finally:
        # What ran meanwhile has been waited for: an ssh still running is a master.
        left = sum(cpu - masters.get(key, 0.0) for key, cpu in ssh_clients().items())
        box += [used() - before + left, left]


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """`with stopwatch() as t: ...` then t[0] holds the seconds the block took."""
    box: list[float] = []
    start = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - start)


def spec_filling(hosts: int, cpu_hosts: int = 1) -> dict[str, Any]:
    """The lab example, sized to fill every GPU host: two `:4` slots per 8-GPU host.

    Prefill takes one slot per GPU host, decode the other; each group runs all its slots but
    one spare (the slots the scale-action benchmark starts and stops, taking turns). The rps
    target is out of reach, so the scaler holds the groups where the deploy put them.
    """
    example: dict[str, Any] = yaml.safe_load((REPO / "examples" / "lab" / "pd.yml").read_text())
    gpu_hosts = hosts - cpu_hosts
    if gpu_hosts < 3:
        raise BenchError(
            "a benchmark fleet needs at least three GPU hosts (two spare decode slots)"
        )
    example["name"] = SERVICE
    router, prefill, decode = example["replicas"]
    for group in (prefill, decode):
        group["scaling"]["target"] = 1000
    prefill["count"] = f"{gpu_hosts - 1}..{gpu_hosts}"
    decode["count"] = f"{gpu_hosts - 1}..{gpu_hosts}"
    example["replicas"] = [router, prefill, decode]
    # Each measured first deploy loads the image from the archive every lab host holds, as on
    # an air-gapped cluster (forget_images removes what the lab or an earlier deploy loaded).
    example["pdctl"]["image_archive"] = f"{SHARE_MOUNT}/images/{SGLANG.archive_name}"
    return example


@dataclass
class BenchLab:
    """A lab of `hosts` hosts (the first `cpu_hosts` CPU-only) in workspace `home`."""

    home: Path
    hosts: int
    cpu_hosts: int = 1
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "PDCTL_HOME": str(self.home),
            "HF_TOKEN": "hf_bench_not_a_real_token",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def run(
        self,
        *argv: str,
        timeout: float = 1800,
        env: dict[str, str] | None = None,
        ok_codes: tuple[int, ...] = (0,),
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            list(argv),
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode not in ok_codes:
            raise BenchError(
                f"{' '.join(argv[:6])} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
                f"\n{proc.stderr[-3000:]}"
            )
        return proc

    def pdctl(self, *args: str, timeout: float = 1800) -> Any:
        """`pdctl --json ARGS` as a user runs it; its JSON document."""
        return json.loads(self.run(PDCTL, "--json", "-q", *args, timeout=timeout).stdout)

    def up(self) -> None:
        self.pdctl("lab", "up", "--hosts", str(self.hosts), "--cpu-hosts", str(self.cpu_hosts))

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = self.pdctl("lab", "status")
        return doc

    def fleet_add(self) -> None:
        """Register every lab host as fleet `bench` (the command `lab status` suggests)."""
        words = self.status()["fleet_add"].split()
        # `pdctl fleet add lab --host ...`: the same, under the benchmark's fleet name.
        self.pdctl(*words[1:3], FLEET, *words[4:])

    def write_spec(self) -> Path:
        path = self.home / "pd.yml"
        path.write_text(yaml.safe_dump(spec_filling(self.hosts, self.cpu_hosts), sort_keys=False))
        return path

    def ssh_root(self, host: str, command: str) -> str:
        return str(
            self.run(PDCTL, "lab", "ssh", "--user", "root", host, "--", command, timeout=300).stdout
        )

    def forget_images(self) -> None:
        """Remove the worker images from every host, so the next deploy loads them again."""

        def forget(host: str) -> None:
            self.ssh_root(
                host,
                "podman images --format '{{.Repository}}:{{.Tag}}' | grep pdctl-lab "
                "| xargs -r podman rmi -f >/dev/null",
            )

        gpu_hosts = [h["name"] for h in self.status()["hosts"] if h["kind"] == "gpu"]
        with ThreadPoolExecutor(4) as workers:  # a `pdctl lab ssh` each: a few at once
            list(workers.map(forget, gpu_hosts))  # raises the first error

    def forget_services(self) -> None:
        """The workspace's fleets and deployed services: new hosts, new host keys, nothing
        deployed (a recorded service would hold its ports and GPUs in the next plan)."""
        workspace = Workspace(self.home)
        shutil.rmtree(workspace.inventories, ignore_errors=True)
        shutil.rmtree(workspace.services, ignore_errors=True)

    def fresh(self) -> None:
        """Back to hosts that never saw a service: a freshly booted lab, registered again
        (faster than a destroy, and nothing of an earlier deploy can linger)."""
        self.down()
        self.forget_services()
        self.up()
        self.fleet_add()

    def down(self) -> None:
        subprocess.run([PDCTL, "-q", "lab", "down"], env=self.env, capture_output=True, check=False)
