"""Scale-out actions: the scaler's pooled-SSH path versus `playbooks/scale.yml`.

One action = start a planned spare slot, wait until its probe answers, register it with SMG.
Both paths act on the same spare decode slot of a deployed service; after each timed action
the slot is taken back out (deregister, drain, stop) untimed, so every action starts from
the same state. The first action of each path warms caches and connections and is not
counted. The lab worker's own warm-up (`worker_warmup_secs` in the lab state) is subtracted:
what remains is pdctl's overhead plus the container start.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.lablib import FLEET, PDCTL, SERVICE, BenchError, BenchLab, stopwatch
from pdctl import content, inventory
from pdctl import service as services
from pdctl.lab.state import FakeHardware
from pdctl.plan import Plan, Slot
from pdctl.workspace import Workspace

WORKER_WARMUP = FakeHardware(host_index=0).worker_warmup_secs


def _spare(plan: Plan) -> Slot:
    spares = [s for s in plan.slots() if s.group == "decode" and not s.start]
    if not spares:
        raise BenchError("the benchmark service has no spare decode slot to scale out")
    return max(spares, key=lambda s: s.index)


def measure(lab: BenchLab, actions: int, out: Path) -> tuple[list[float], list[float]]:
    """Per-action seconds (warm-up excluded) for the pooled path and for the playbook path."""
    workspace = Workspace(lab.home)
    plan = services.load_plan(workspace, SERVICE)
    slot = _spare(plan)
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
    pooled: list[float] = []
    played: list[float] = []
    with services.open_handle(workspace, plan) as handle:
        router_host = handle.targets[plan.router.host]
        # The scaler would fight the benchmark over the spare slot: park it.
        handle.pool.run(router_host, f"sudo -n systemctl stop pd-{SERVICE}-scaler.service")
        actuator = handle.actuator
        try:
            for i in range(actions + 1):
                with stopwatch() as took:
                    actuator.scale_out(slot)
                actuator.scale_in(slot)
                if i:
                    pooled.append(took[0] - WORKER_WARMUP)
            saved, lab.env = lab.env, env
            try:
                for i in range(actions + 1):
                    with stopwatch() as took:
                        lab.run(*playbook, "-e", f"pd_scale_replicas={slot.index}")
                    if not actuator.healthy(slot) or actuator.router.find(slot.url) is None:
                        raise BenchError(f"scale.yml did not leave {slot.name} serving")
                    actuator.scale_in(slot)
                    if i:
                        played.append(took[0] - WORKER_WARMUP)
            finally:
                lab.env = saved
        finally:
            handle.pool.run(router_host, f"sudo -n systemctl start pd-{SERVICE}-scaler.service")
    return pooled, played
