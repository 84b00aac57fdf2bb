"""Scale-out actions: the scaler's pooled-SSH path versus `playbooks/scale.yml`.

One action = start a planned spare slot, wait until its probe answers, register it with SMG.
Both paths act on the same two spare slots of a deployed service, the prefill spare and the
decode spare, taking turns: while one action is timed, the slot of the previous action is
taken back out (deregister, drain, stop: untimed, and slow in the lab, where podman takes
~10 s to reap a container) in the background. The first action of each path warms caches
and connections and is not counted. The lab worker's own warm-up (`worker_warmup_secs` in
the lab state) is subtracted: what remains is pdctl's overhead plus the container start.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from bench.lablib import FLEET, PDCTL, SERVICE, BenchError, BenchLab, stopwatch
from pdctl.core.plan import Plan, Slot
from pdctl.doors import content, inventory
from pdctl.doors import service as services
from pdctl.doors.session import Session
from pdctl.doors.slots import Actuator
from pdctl.doors.workspace import Workspace
from pdctl.lab.state import FakeHardware

WORKER_WARMUP = FakeHardware(host_index=0).worker_warmup_secs


def spares(plan: Plan) -> list[Slot]:
    """The spare of each group; its index is the group's highest (scale.yml runs 1..N)."""
    idle = [s for s in plan.slots() if not s.start]
    by_group = {s.group: s for s in sorted(idle, key=lambda s: s.index)}
    if sorted(by_group) != ["decode", "prefill"]:
        raise BenchError("the benchmark service needs a spare prefill and a spare decode slot")
    for slot in by_group.values():
        if slot.index != max(s.index for s in plan.slots() if s.group == slot.group):
            raise BenchError(f"{slot.name} is a spare but not its group's last slot")
    return [by_group["prefill"], by_group["decode"]]


@contextmanager
def parked_scaler(lab: BenchLab, service: str) -> Iterator[tuple[Plan, Actuator]]:
    """The deployed service's plan and its slot actuator (the scaler's own, pdctl/doors/slots.py),
    with the service's scaler stopped meanwhile: it would fight the benchmark over the spares."""
    workspace = Workspace(lab.home)
    plan = services.load_plan(workspace, service)
    with Session(workspace) as session, services.open_handle(session, plan) as handle:
        router_host = handle.targets[plan.router.host]
        handle.pool.run(router_host, f"sudo -n systemctl stop pd-{service}-scaler.service")
        try:
            yield plan, handle.actuator
        finally:
            handle.pool.run(router_host, f"sudo -n systemctl start pd-{service}-scaler.service")


def take_turns(
    actuator: Actuator, pair: list[Slot], actions: int, scale_out: Callable[[Slot], None]
) -> list[float]:
    """Seconds of ``actions`` scale-outs onto the spares in turn, each slot taken back out
    (untimed) in the background while the next is timed; one more first, not counted."""
    timings: list[float] = []
    leaving: Future[None] | None = None
    with ThreadPoolExecutor(1) as background:
        try:
            for i in range(actions + 1):
                slot = pair[i % 2]
                with stopwatch() as took:
                    scale_out(slot)
                if i:
                    timings.append(took[0])
                if leaving is not None:
                    leaving.result()
                leaving = background.submit(actuator.scale_in, slot)
        finally:
            if leaving is not None:
                leaving.result()
    return timings


def measure(lab: BenchLab, actions: int, out: Path) -> tuple[list[float], list[float]]:
    """Per-action seconds (warm-up excluded) for the pooled path and for the playbook path."""
    with parked_scaler(lab, SERVICE) as (plan, actuator):
        plan_vars = out / "scale-vars.json"
        plan_vars.touch(mode=0o600)
        plan_vars.write_text(json.dumps(plan.extravars()))
        playbook = [
            str(Path(PDCTL).with_name("ansible-playbook")),
            "-i",
            str(inventory.fleet_dir(Workspace(lab.home), FLEET)),
            str(content.playbook("scale.yml")),
            "-e",
            f"@{plan_vars}",
        ]
        env = {**lab.env, "ANSIBLE_CONFIG": str(content.content_root() / "ansible.cfg")}

        def playbook_out(slot: Slot) -> None:
            argv = [*playbook, "-e", f"pd_scale_group={slot.group}"]
            lab.run(*argv, "-e", f"pd_scale_replicas={slot.index}", env=env)
            if not actuator.healthy(slot) or actuator.router.find(slot.url) is None:
                raise BenchError(f"scale.yml did not leave {slot.name} serving")

        pair = spares(plan)
        pooled = take_turns(actuator, pair, actions, actuator.scale_out)
        played = take_turns(actuator, pair, actions, playbook_out)
    return [t - WORKER_WARMUP for t in pooled], [t - WORKER_WARMUP for t in played]
