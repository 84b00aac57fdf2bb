"""Scale-out actions: the scaler's pooled-SSH path versus `playbooks/scale.yml`.

One action = start a planned spare slot, wait until its probe answers, register it with SMG.
Both paths act on the same two spare decode slots of a deployed service, taking turns: while
one action is timed, the slot of the previous action is taken back out (deregister, drain,
stop: untimed, and slow in the lab, where podman takes ~10 s to reap a container) in the
background. The first action of each path warms caches and connections and is not counted.
The lab worker's own warm-up (`worker_warmup_secs` in the lab state) is subtracted: what
remains is pdctl's overhead plus the container start.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from bench.lablib import FLEET, PDCTL, SERVICE, BenchError, BenchLab, stopwatch
from pdctl import content, inventory
from pdctl import service as services
from pdctl.lab.state import FakeHardware
from pdctl.plan import Plan, Slot
from pdctl.workspace import Workspace

WORKER_WARMUP = FakeHardware(host_index=0).worker_warmup_secs


def _spares(plan: Plan) -> list[Slot]:
    spares = sorted(
        (s for s in plan.slots() if s.group == "decode" and not s.start), key=lambda s: s.index
    )
    if len(spares) < 2:
        raise BenchError("the benchmark service needs two spare decode slots to scale out")
    return spares[-2:]


def measure(lab: BenchLab, actions: int, out: Path) -> tuple[list[float], list[float]]:
    """Per-action seconds (warm-up excluded) for the pooled path and for the playbook path."""
    workspace = Workspace(lab.home)
    plan = services.load_plan(workspace, SERVICE)
    spares = _spares(plan)
    plan_vars = out / "scale-vars.json"
    plan_vars.touch(mode=0o600)
    plan_vars.write_text(json.dumps(plan.extravars()))
    playbook = [
        str(Path(PDCTL).with_name("ansible-playbook")),
        "-i",
        str(inventory.fleet_dir(workspace, FLEET)),
        str(content.playbook("scale.yml")),
        "-e",
        f"@{plan_vars}",
        "-e",
        "pd_scale_group=decode",
    ]
    env = {**lab.env, "ANSIBLE_CONFIG": str(content.content_root() / "ansible.cfg")}
    timings: dict[str, list[float]] = {"pooled": [], "playbook": []}
    with services.open_handle(workspace, plan) as handle, ThreadPoolExecutor(1) as background:
        router_host = handle.targets[plan.router.host]
        # The scaler would fight the benchmark over the spare slots: park it.
        handle.pool.run(router_host, f"sudo -n systemctl stop pd-{SERVICE}-scaler.service")
        actuator = handle.actuator
        leaving: Future[None] | None = None

        try:
            # Pooled: the two spares take turns, the previous one leaving in the background.
            for i in range(actions + 1):
                slot = spares[i % 2]
                with stopwatch() as took:
                    actuator.scale_out(slot)
                if i:
                    timings["pooled"].append(took[0] - WORKER_WARMUP)
                if leaving is not None:
                    leaving.result()
                leaving = background.submit(actuator.scale_in, slot)
            if leaving is not None:
                leaving.result()
            # scale.yml runs slots 1..N and stops the others: N = the lower spare starts just
            # that one, so this path reuses one slot and waits for it to leave each time.
            slot = spares[0]
            for i in range(actions + 1):
                with stopwatch() as took:
                    lab.run(*playbook, "-e", f"pd_scale_replicas={slot.index}", env=env)
                if not actuator.healthy(slot) or actuator.router.find(slot.url) is None:
                    raise BenchError(f"scale.yml did not leave {slot.name} serving")
                if i:
                    timings["playbook"].append(took[0] - WORKER_WARMUP)
                actuator.scale_in(slot)
        finally:
            handle.pool.run(router_host, f"sudo -n systemctl start pd-{SERVICE}-scaler.service")
    return timings["pooled"], timings["playbook"]
