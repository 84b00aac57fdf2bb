"""`make bench`: pdctl against baselines measured in the same run, on labs this run boots.

    python bench/run.py [--hosts 16] [--small 4] [--actions 10] [--only NAME ...] [--dry-run]

Each benchmark ends with one line `bench NAME: ratio R (pdctl A s, baseline B s, N hosts)`,
R = B / A (higher is better):

- deploy: first deploy of a service filling the lab (two `:4` slots per GPU host), pdctl as
  shipped versus the same playbook under Ansible's defaults, at --small and at --hosts hosts.
  Each deploy starts from hosts without the worker image.
- deploy-cpu: the controller's CPU seconds of those two first deploys at --hosts hosts (the
  process tree of each: pdctl or ansible-playbook, their workers, ssh, Mitogen, and the ssh
  ControlPersist masters they leave running), the lab hosts' own work left out.
- deploy-growth: how pdctl's first deploy grows with the fleet: R = (H/S)·t(S) / t(H) for
  S = --small and H = --hosts hosts (4 and 16: 4·t(4)/t(16); R = H/S means flat, 1 linear).
- redeploy: a no-op redeploy versus the first deploy (--hosts hosts): pdctl's quick check
  reads every host and finds nothing to converge (pdctl/operations/drift.py).
- check: `fleet check` versus the same checks host after host.
- scale-action: p50 of a scale-out (start, health, register) over --actions actions, the
  scaler's pooled SSH versus `playbooks/scale.yml`; p95s in the same line.
- scale-out-warm: p50 of a scale-out (the scaler's decision to the replica serving) with a
  1 GB model on a 4-host lab, the hub and links capped as for model-fanout: pdctl's spare
  starts from the host's model cache versus a worker that downloads the model from the hub at
  start into its container, pdctl planning no cache for it (bench/scale_warm.py).
- model-fanout: a 1 GB model onto 8 and 16 hosts of the big lab, the hub capped at a tenth of
  the hosts' links: pdctl's prefetch (one download, fanned out in the fleet) versus every host
  downloading it from the hub at once (bench/model_fanout.py). Last: its caps stay on.
- host-loss: from a GPU host's power-off until requests succeed again, p50 of 3, on a 4-host
  lab: pdctl's scaler replacing the lost replica from a spare on another host versus a
  person's `pdctl fleet remove --force` + `pdctl deploy` with no scaler recovery
  (bench/host_loss.py).
- scaler-sim: bench/scaler_sim.py (trace replay; CSV and PNG per trace under bench/out/),
  bench/scaler_phases.py (alternating prompt-/answer-heavy phases: per-phase policy vs RPS)
  and bench/scaler_budget.py (two services growing at once under one GPU budget: pdctl's
  ledger versus scalers that do not know of each other, and a first-come counter).
- router-failover: from the power-off of the router host the clients reach until requests
  succeed again, p50 of 3, on a 4-host lab (two CPU hosts): two routers behind a failover
  address (keepalived moves it, the other router was given every worker too) versus today's
  single router, which recovers only by a person's `fleet remove --force` + `deploy`
  (bench/router_failover.py); the failed requests of each round in the same line.
- fabric: `fleet check --fabric` on a lab of --hosts GPU hosts (a full mesh, round-robin
  rounds, every pair of a round at once) versus the same pairs one after another, as a
  hand-run script does them (bench/fabric.py).

--dry-run builds every input (specs, baseline playbooks and config) and runs the simulation,
without a lab: what CI's smoke test runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in {None, ""}:  # `python bench/run.py` from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (
    actions,
    baseline,
    fabric,
    host_loss,
    model_fanout,
    router_failover,
    scale_warm,
    scaler_budget,
    scaler_phases,
    scaler_sim,
)
from bench.lablib import (
    FLEET,
    OUT,
    BenchError,
    BenchLab,
    controller_cpu,
    cpu_busy,
    line,
    percentile,
    stopwatch,
)
from pdctl.core import spec

NAMES = (
    "scaler-sim",
    "check",
    "deploy",
    "redeploy",
    "scale-action",
    "scale-out-warm",
    "host-loss",
    "router-failover",
    "model-fanout",
    "fabric",
)
BIG_LAB = {"check", "deploy", "redeploy", "scale-action", "model-fanout"}
STARTED = time.monotonic()
CONTROLLER_CPU: dict[int, float] = {}  # hosts -> CPU seconds of pdctl's first deploy's process tree
BASELINE_CPU: dict[int, float] = {}  # hosts -> the same for the Ansible-defaults deploy


def progress(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.0f} s] {message}", file=sys.stderr, flush=True)


def result(text: str) -> None:
    print(text, flush=True)


def timed_deploy(lab: BenchLab, spec: Path, first: bool = True) -> tuple[float, dict[str, object]]:
    """Seconds and JSON of `pdctl deploy`; a first deploy's controller CPU: CONTROLLER_CPU."""
    if first:
        lab.forget_images()  # the lab loaded them at boot: a first deploy starts without
    with cpu_busy() as busy, controller_cpu() as mine, stopwatch() as took:
        doc = lab.pdctl("deploy", str(spec), "--fleet", FLEET, "-y")
    progress(
        f"deploy took {took[0]:.1f} s with the CPU {busy[0]:.0%} busy (all cores); "
        f"the controller's share {mine[0]:.1f} CPU s ({mine[1]:.1f} s of it ssh masters)"
    )
    if first:
        CONTROLLER_CPU[lab.hosts] = mine[0]
    return took[0], doc


def baseline_deploy(lab: BenchLab, spec: Path) -> float:
    """Seconds of the Ansible-defaults deploy; its controller CPU: BASELINE_CPU."""
    with cpu_busy() as busy, controller_cpu() as mine:
        took = baseline.deploy_with_ansible_defaults(lab, spec, OUT / f"ws-{lab.hosts}")
    progress(
        f"baseline deploy took {took:.1f} s with the CPU {busy[0]:.0%} busy (all cores); "
        f"the controller's share {mine[0]:.1f} CPU s ({mine[1]:.1f} s of it ssh masters)"
    )
    BASELINE_CPU[lab.hosts] = mine[0]
    return took


def reset(lab: BenchLab) -> None:
    """Back to hosts that never saw the service: a freshly booted lab (faster than a destroy,
    and nothing of the first deploy can linger), registered again, without the images."""
    progress(f"fresh lab: {lab.hosts} hosts")
    lab.fresh()
    lab.forget_images()


def with_lab(hosts: int, body: Callable[[BenchLab], None]) -> None:
    lab = BenchLab(OUT / f"ws-{hosts}", hosts)
    lab.forget_services()
    progress(f"lab up: {hosts} hosts")
    try:
        lab.up()
        progress("fleet add")
        lab.fleet_add()
        body(lab)
    finally:
        progress(f"lab down: {lab.hosts} hosts")
        lab.down()


def other_lab(lab: BenchLab, hosts: int, cpu_hosts: int) -> BenchLab:
    """``lab`` taken down and a lab of another shape booted in its workspace, registered (the
    caller's `finally` takes the workspace's lab down, whatever its shape)."""
    lab.down()
    lab.hosts, lab.cpu_hosts = hosts, cpu_hosts
    progress(f"lab up: {hosts} hosts, {hosts - cpu_hosts} with GPUs")
    lab.forget_services()
    lab.up()
    lab.fleet_add()
    return lab


def small_deploy(wanted: set[str], hosts: int, times: dict[str, float]) -> None:
    def body(lab: BenchLab) -> None:
        spec = lab.write_spec()
        progress(f"deploy with pdctl on {hosts} hosts")
        times["pdctl"], _ = timed_deploy(lab, spec)
        reset(lab)
        progress(f"deploy under Ansible's defaults on {hosts} hosts")
        times["baseline"] = baseline_deploy(lab, spec)
        result(line("deploy", times["pdctl"], times["baseline"], hosts))

    if "deploy" in wanted:
        with_lab(hosts, body)


def scale_out_warm(wanted: set[str]) -> None:
    def body(lab: BenchLab) -> None:
        progress(
            f"scale-out-warm: {scale_warm.ACTIONS} actions each, hub {model_fanout.HUB_RATE}/s, "
            f"links {model_fanout.LINK_RATE}/s, {model_fanout.SIZE} model"
        )
        warm, cold = scale_warm.measure(lab, progress)
        result(
            line(
                "scale-out-warm",
                scale_warm.p50(warm),
                scale_warm.p50(cold),
                lab.hosts,
                f"p50 of {len(warm)} actions each; max pdctl {max(warm):.2f} s, baseline "
                f"{max(cold):.2f} s; {model_fanout.SIZE} model, hub {model_fanout.HUB_RATE}/s",
            )
        )

    if "scale-out-warm" in wanted:
        with_lab(scale_warm.HOSTS, body)


def host_loss_bench(wanted: set[str]) -> None:
    def body(lab: BenchLab) -> None:
        progress(f"host-loss: {host_loss.ROUNDS} rounds each, {host_loss.RPS:g} rps")
        ours = host_loss.measure_pdctl(lab, progress)
        theirs = host_loss.measure_baseline(
            other_lab(lab, 1 + host_loss.BASELINE_GPU_HOSTS, 1), progress
        )
        result(
            line(
                "host-loss",
                host_loss.p50(ours),
                host_loss.p50(theirs),
                host_loss.HOSTS,
                f"p50 of {len(ours)} power-offs each; pdctl "
                + ", ".join(f"{t:.1f}" for t in ours)
                + f" s; baseline (fleet remove --force + deploy, {lab.hosts} hosts, one lost "
                "a round) " + ", ".join(f"{t:.1f}" for t in theirs) + " s",
            )
        )

    if "host-loss" in wanted:
        with_lab(host_loss.HOSTS, body)


def router_failover_bench(wanted: set[str]) -> None:
    def body(lab: BenchLab) -> None:
        progress(f"router-failover: {router_failover.ROUNDS} rounds each, {host_loss.RPS:g} rps")
        ours = router_failover.measure_pdctl(lab, progress)
        cpu_hosts = router_failover.BASELINE_CPU_HOSTS
        gpu_hosts = router_failover.HOSTS - router_failover.CPU_HOSTS
        theirs = router_failover.measure_baseline(
            other_lab(lab, cpu_hosts + gpu_hosts, cpu_hosts), progress
        )
        result(
            line(
                "router-failover",
                router_failover.p50(ours),
                router_failover.p50(theirs),
                router_failover.HOSTS,
                f"p50 of {len(ours)} power-offs each; pdctl "
                + ", ".join(f"{t:.1f} s ({n} failed)" for t, n in ours)
                + f"; baseline (fleet remove --force + deploy, {lab.cpu_hosts} CPU hosts, one "
                "lost a round) " + ", ".join(f"{t:.1f} s ({n} failed)" for t, n in theirs),
            )
        )

    if "router-failover" in wanted:
        lab = BenchLab(OUT / "ws-router", router_failover.HOSTS, router_failover.CPU_HOSTS)
        lab.forget_services()
        progress(f"lab up: {lab.hosts} hosts, {lab.cpu_hosts} without GPUs")
        try:
            lab.up()
            lab.fleet_add()
            body(lab)
        finally:
            lab.down()


def big_lab(wanted: set[str], hosts: int, actions_count: int, small: dict[str, float]) -> None:
    def body(lab: BenchLab) -> None:
        if "check" in wanted:
            progress(f"fleet check, {hosts} hosts at once")
            with stopwatch() as took:
                lab.pdctl("fleet", "check", FLEET)
            progress(f"fleet check, {hosts} hosts one after the other")
            result(line("check", took[0], baseline.check_host_after_host(lab), hosts))
        if not {"deploy", "redeploy", "scale-action"} & wanted:
            fanout(wanted, lab)
            return
        spec = lab.write_spec()
        progress(f"deploy with pdctl on {hosts} hosts")
        first, _ = timed_deploy(lab, spec)
        if "redeploy" in wanted:
            progress("no-op redeploy")
            again, doc = timed_deploy(lab, spec, first=False)
            if doc.get("changes") or doc.get("changed_hosts") or doc.get("converged"):
                raise BenchError(f"the no-op redeploy did more than verify the hosts: {doc}")
            result(
                line(
                    "redeploy",
                    again,
                    first,
                    hosts,
                    "no changes reported; every host verified over SSH, Ansible not needed",
                )
            )
        if "scale-action" in wanted:
            progress(f"scale-out actions: {actions_count} pooled, {actions_count} playbook")
            pooled, played = actions.measure(lab, actions_count, OUT / f"ws-{hosts}")
            result(
                line(
                    "scale-action",
                    percentile(pooled, 50),
                    percentile(played, 50),
                    hosts,
                    f"p50; p95 pdctl {percentile(pooled, 95):.2f} s, "
                    f"baseline {percentile(played, 95):.2f} s; {len(pooled)} actions each",
                )
            )
        if "deploy" in wanted:
            reset(lab)
            progress(f"deploy under Ansible's defaults on {hosts} hosts")
            slow = baseline_deploy(lab, spec)
            result(line("deploy", first, slow, hosts))
            result(line("deploy-cpu", CONTROLLER_CPU[hosts], BASELINE_CPU[hosts], hosts))
            if small.get("pdctl"):
                few = int(small.get("hosts", 0))
                result(line("deploy-growth", first, hosts / few * small["pdctl"], hosts))
                result(
                    f"note: pdctl's deploy at {hosts} hosts took {first / small['pdctl']:.2f}x "
                    f"its time at {few} hosts; its controller's CPU "
                    f"{CONTROLLER_CPU.get(hosts, 0):.1f} s vs {CONTROLLER_CPU.get(few, 0):.1f} s; "
                    f"the baseline's {BASELINE_CPU.get(hosts, 0):.1f} s vs "
                    f"{BASELINE_CPU.get(few, 0):.1f} s"
                )
        fanout(wanted, lab)  # last: the link caps it sets would slow the deploys

    with_lab(hosts, body)


def fanout(wanted: set[str], lab: BenchLab) -> None:
    if "model-fanout" not in wanted:
        return
    progress(
        f"model-fanout: hub {model_fanout.HUB_RATE}/s, links {model_fanout.LINK_RATE}/s, "
        f"{model_fanout.SIZE} model"
    )
    model_fanout.prepare(lab)
    for count in sorted({min(8, lab.hosts), lab.hosts}):
        ours, theirs, downloads = model_fanout.measure(lab, count, progress)
        result(
            line(
                "model-fanout",
                ours,
                theirs,
                count,
                f"{downloads} hub downloads for pdctl's (one per file), all hosts at once for "
                "the baseline",
            )
        )


def fabric_mesh(wanted: set[str], hosts: int) -> None:
    """A lab of GPU hosts only: every one of the --hosts hosts is in the mesh."""
    if "fabric" not in wanted:
        return
    lab = BenchLab(OUT / "ws-fabric", hosts, cpu_hosts=0)
    lab.forget_services()
    progress(f"lab up: {hosts} GPU hosts")
    try:
        lab.up()
        progress("fleet add")
        lab.fleet_add()
        ours, theirs, extra = fabric.measure(lab, progress)
        result(line("fabric", ours, theirs, hosts, extra))
    finally:
        progress(f"lab down: {hosts} hosts")
        lab.down()


def dry_run(hosts: int, small: int) -> None:
    """Every input the lab benchmarks use, built and checked, with no lab."""
    out = OUT / "dry-run"
    for count in (small, hosts):
        lab = BenchLab(out, count)
        spec_path = lab.write_spec()
        spec.load(spec_path, lab.env)  # the spec pdctl would deploy is valid
        progress(f"spec for {count} hosts: valid")
    playbook = baseline.defaults_playbook("deploy.yml", out)
    # Under the baseline's own config, as the benchmark runs it: every module and lookup found.
    lab.run(
        str(Path(sys.executable).with_name("ansible-playbook")),
        "--syntax-check",
        "-i",
        "localhost,",
        str(playbook),
        env={**lab.env, "ANSIBLE_CONFIG": str(baseline.defaults_config(out))},
    )
    progress("baseline playbook (syntax checked under its config) and config written")
    model_fanout.check_inputs()
    progress("model-fanout: the model id and the caps (the hub at a tenth of the links) hold")
    scale_warm.check_inputs(BenchLab(out, scale_warm.HOSTS))
    progress("scale-out-warm: both specs valid; pdctl plans its model cache for the warm one only")
    fabric.check_inputs()
    progress(
        f"fabric: a {fabric.HOSTS}-host mesh is {fabric.HOSTS - 1} rounds; the script's commands"
    )
    host_loss.check_inputs(BenchLab(out, host_loss.HOSTS))
    progress("host-loss: the spec is valid and plans a spare of each group on another host")
    router_failover.check_inputs(BenchLab(out, router_failover.HOSTS, router_failover.CPU_HOSTS))
    progress("router-failover: both specs valid; the two routers go to the two CPU hosts")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--small", type=int, default=4)
    parser.add_argument("--actions", type=int, default=10)
    parser.add_argument("--only", action="append", choices=NAMES)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    wanted = set(args.only or NAMES)
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        if "scaler-sim" in wanted:
            progress("scaler-sim")
            scaler_sim.main(["--seconds", "600"] if args.dry_run else [])
            scaler_phases.main(["--seconds", "1800"] if args.dry_run else [])
            scaler_budget.main(["--seconds", "1200"] if args.dry_run else [])
        if args.dry_run:
            dry_run(args.hosts, args.small)
            return 0
        small: dict[str, float] = {"hosts": args.small}
        small_deploy(wanted, args.small, small)
        scale_out_warm(wanted)
        host_loss_bench(wanted)
        router_failover_bench(wanted)
        if wanted & BIG_LAB:
            big_lab(wanted, args.hosts, args.actions, small)
        fabric_mesh(wanted, args.hosts)
    except BenchError as error:
        print(f"bench: {error}", file=sys.stderr)
        return 1
    progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
