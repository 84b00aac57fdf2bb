"""`make bench` starts: its inputs build and check, the simulation runs, lines parse.

The lab benchmarks themselves are not run in CI (minutes each, and ratios on a shared
machine are noise); `python bench/run.py --dry-run` builds every input they use.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench import actions, baseline, host_loss, model_fanout, router_failover, scale_warm
from bench.lablib import controller_cpu, line, percentile, spec_filling
from pdctl.core import spec
from pdctl.core.fleet_model import Fleet, FleetSettings
from pdctl.core.plan import build
from tests.unit.core.plan.test_placement import host

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^bench (?P<name>[\w-]+): ratio (?P<r>[\d.]+|inf) \(pdctl (?P<a>[\d.]+) s, "
    r"baseline (?P<b>[\d.]+) s, (?P<n>\d+) hosts(, .*)?\)$"
)


def test_dry_run_builds_every_input_and_runs_the_simulation() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [m for m in map(LINE.match, proc.stdout.splitlines()) if m]
    assert [m["name"] for m in lines] == ["scaler-sim"]
    assert "baseline playbook (syntax checked under its config)" in proc.stderr
    assert (
        "scale-out-warm: both specs valid; pdctl plans its model cache for the warm one only"
        in (proc.stderr)
    )
    assert "fabric: a 16-host mesh is 15 rounds; the script's commands" in proc.stderr
    assert "host-loss: the spec is valid and plans a spare of each group on another host" in (
        proc.stderr
    )
    assert "router-failover: both specs valid; the two routers go to the two CPU hosts" in (
        proc.stderr
    )
    for trace in ("diurnal", "spike", "sawtooth"):
        assert (ROOT / "bench" / "out" / f"scaler_{trace}.png").stat().st_size > 10_000
    assert "alternating       per-phase" in proc.stdout
    for trace in ("alternating", "alternating-ramp"):
        assert (ROOT / "bench" / "out" / f"phases_{trace}.png").stat().st_size > 10_000


def test_router_failover_runs_two_routers_behind_the_address_against_one() -> None:
    ours = router_failover.service_spec("10.77.0.200")
    assert ours["replicas"][0]["count"] == 2
    assert ours["pdctl"]["router"]["address"] == "10.77.0.200"
    theirs = router_failover.service_spec(None)
    assert theirs["replicas"][0]["count"] == 1 and "address" not in theirs["pdctl"]["router"]
    for doc in (ours, theirs):  # the scaler holds the groups where the deploy put them
        assert [g["count"] for g in doc["replicas"][1:]] == [1, 1]
    assert router_failover.p50([(3.0, 1), (9.0, 0), (4.0, 2)]) == 4.0


def test_host_loss_recovery_is_the_first_request_after_the_last_failure() -> None:
    quiet = host_loss.QUIET
    ok_from = [(t * 0.25, t * 0.25 >= 7.0) for t in range(0, int((7 + quiet) / 0.25) + 2)]
    assert host_loss.recovered_after(ok_from, lost_at=0.0) == pytest.approx(7.0)
    assert host_loss.recovered_after(ok_from[:-8], lost_at=0.0) is None  # not quiet long enough
    never_failed = [(t * 0.5, True) for t in range(60)]
    assert host_loss.recovered_after(never_failed, lost_at=1.0) == 0.0
    assert host_loss.recovered_after([(0.5, False)], lost_at=1.0) is None  # nothing sent since


def test_result_line_is_baseline_over_pdctl() -> None:
    text = line("deploy", 20.0, 50.0, 16)
    assert text == "bench deploy: ratio 2.50 (pdctl 20.00 s, baseline 50.00 s, 16 hosts)"
    assert LINE.match(line("scale-action", 0.5, 9.0, 16, "p50; p95 pdctl 0.70 s"))


def test_percentiles() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile([3.0], 95) == 3.0


@pytest.mark.parametrize("hosts", [4, 16])
def test_benchmark_service_fills_the_lab(hosts: int, tmp_path: Path) -> None:
    path = tmp_path / "pd.yml"
    path.write_text(yaml.safe_dump(spec_filling(hosts)))
    service, _ = spec.load(path, {"HF_TOKEN": "x"})
    counts = [g.count for g in service.replicas if g.role != "router"]
    # Two :4 slots per 8-GPU host: prefill takes one per GPU host, decode the other; a spare each.
    assert sorted(counts) == [(hosts - 2, hosts - 1), (hosts - 2, hosts - 1)]


def test_ansible_defaults_baseline(tmp_path: Path) -> None:
    cfg = baseline.defaults_config(tmp_path).read_text()
    assert "forks = 5" in cfg and "pipelining = False" in cfg
    # Ansible's own ssh_args (ControlPersist included): the baseline is not handicapped.
    assert not [line for line in cfg.splitlines() if line.startswith("ssh_args")]
    plays = yaml.safe_load(baseline.defaults_playbook("deploy.yml", tmp_path).read_text())
    assert plays and all(p["gather_facts"] is True for p in plays)


def test_scale_out_warm_plans_the_cache_for_pdctls_service_only(tmp_path: Path) -> None:
    """The two services differ in the cache alone: pdctl's fetches and mounts it; the
    baseline's gets none (no HF_HOME, online, the hub as HF_ENDPOINT). Both scale from zero."""
    hosts = [host("cpu1", "cpu"), host("gpu1"), host("gpu2"), host("gpu3")]
    fleet = Fleet(name="bench", hosts=hosts, settings=FleetSettings())
    endpoint = "http://10.77.9.2:8080"
    plans = {}
    for name in (scale_warm.WARM, scale_warm.COLD):
        path = tmp_path / f"{name}.yml"
        path.write_text(yaml.safe_dump(scale_warm.service_spec(name, endpoint)))
        service, env = spec.load(path, {"HF_TOKEN": "x", "MODEL_ID": model_fanout.REPO})
        plans[name] = build(service, env, fleet, secrets_digest="")
        assert not any(slot.start for slot in plans[name].slots())
        assert [s.group for s in actions.spares(plans[name])] == ["prefill", "decode"]
        assert plans[name].env["HF_ENDPOINT"] == endpoint
    warm, cold = plans[scale_warm.WARM], plans[scale_warm.COLD]
    assert warm.model_repo == model_fanout.REPO and warm.env["HF_HUB_OFFLINE"] == "1"
    assert any(v.endswith(":/root/.cache/huggingface:ro") for v in warm.volumes)
    assert cold.model_repo is None and cold.model_cache is None
    assert not {"HF_HOME", "HF_HUB_OFFLINE"} & set(cold.env)
    assert not any("huggingface" in v for v in cold.volumes)
    assert "MODEL_ID" in cold.secret_names


# As an OpenSSH ControlPersist master does: the command forks a process that detaches and lives
# on, then returns. The detached one burns CPU, says so in a file, and waits to be killed.
MASTER = """\
import os, sys, time
if os.fork():
    sys.exit(0)
os.setsid()
end = time.process_time() + 0.5
while time.process_time() < end:
    pass
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)
"""


def test_the_controllers_cpu_counts_the_ssh_master_a_command_left_running(tmp_path: Path) -> None:
    ssh = tmp_path / "ssh"  # the process is named ssh, as the client is
    ssh.symlink_to(sys.executable)
    done = tmp_path / "pid"
    try:
        with controller_cpu() as cpu:
            subprocess.run([str(ssh), "-c", MASTER, str(done)], check=True, timeout=30)
            deadline = time.monotonic() + 30
            while not done.exists() or not done.read_text():
                assert time.monotonic() < deadline, "the detached process never finished its work"
                time.sleep(0.05)
        assert cpu[0] >= 0.45, cpu  # the command itself took a few hundredths
    finally:
        if done.exists() and done.read_text():
            os.kill(int(done.read_text()), signal.SIGKILL)
