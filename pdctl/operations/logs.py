"""`pdctl logs`: one replica's journal, read (or followed) over SSH from its host only."""

from __future__ import annotations

from collections.abc import Callable

from pdctl.core.errors import HostError, InputError, PdctlError
from pdctl.core.plan import Plan, Slot
from pdctl.doors import service as services
from pdctl.doors.session import Session

LOGS_TIMEOUT = 30.0  # `pdctl logs` (without -f): one journal read


def find_slot(plan: Plan, which: str) -> Slot:
    group, _, index = which.partition("/")
    for slot in plan.slots():
        if slot.group == group and str(slot.index) == index:
            return slot
    names = ", ".join(s.name for s in plan.slots())
    raise InputError(f"no replica {which!r} in service {plan.service}", hint=f"replicas: {names}")


def logs(
    session: Session,
    name: str,
    which: str,
    lines: int,
    follow: bool,
    write: Callable[[str], None],
) -> None:
    plan = services.load_plan(session.workspace, name)
    slot = find_slot(plan, which)
    unit = slot.unit(plan.service)
    command = f"sudo -n journalctl -u {unit} -n {int(lines)} --no-pager -o short-iso"
    # Only the replica's host is contacted (not the router's): logs of a host that answers
    # never depend on one that does not.
    with services.open_handle(session, plan, need_key=False) as handle:
        target = handle.targets[slot.host]
        try:
            if not follow:
                result = handle.pool.run(target, command, timeout=LOGS_TIMEOUT)
                write(result.stdout)
                return
            with handle.pool.session(target) as client:
                _stdin, stdout, _stderr = client.exec_command(command + " -f", get_pty=True)
                for line in iter(stdout.readline, ""):
                    write(line)
        except PdctlError as exc:
            others = [s.name for s in plan.slots() if s.host != slot.host]
            raise HostError(
                f"{which} runs on {slot.host}, which does not answer: {exc.message}",
                hint=f"bring {slot.host} back (`pdctl status {name}` shows what it is); the "
                f"other hosts' replicas' logs still read: {', '.join(others) or 'none'}",
            ) from exc
