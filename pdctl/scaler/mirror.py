"""Several routers without SMG's mesh: each router knows only the workers it is told of.

pdctl tells every router: the deploy registers the workers on each, and Actuator.register and
deregister reach each. What a router missed (it was down, or restarted empty, when a worker
came; it was cut off when one left), the acting scaler repairs: every tick it reads each other
router's list, by the tick's deadline, and brings it to its own router's registrations. A
registration the acting router holds and another lacks is added there; one another router
holds for a replica that no longer runs (or is fenced or condemned) is removed there. A worker
draining is left to its drain. Each repair is a call of its own, in the background: a router
that does not answer holds nothing up, and the next tick tries again.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from pdctl.core.errors import PdctlError
from pdctl.core.plan import Slot
from pdctl.doors.router import Router, Worker
from pdctl.scaler.calls import Calls, gather
from pdctl.scaler.view import View

DRAINING = "draining"


@dataclass(frozen=True)
class Repair:
    """One change to another router: add ``slot``'s worker, or remove ``worker`` (its entry)."""

    verb: str  # "add" | "remove"
    slot: Slot
    worker: Worker | None = None


def repairs(
    slots: Iterable[Slot],
    acting: dict[str, Worker],
    other: dict[str, Worker],
    settled: Callable[[Slot], bool],
    gone: Callable[[Slot], bool],
) -> list[Repair]:
    """What brings ``other`` (a router's workers by URL) to ``acting`` (the acting router's),
    for the slots that are ``settled`` (no action in flight, their host read this tick).
    ``gone``: the slot's replica does not run, or is fenced or condemned."""
    found = []
    for slot in slots:
        if not settled(slot):
            continue
        here, there = acting.get(slot.url), other.get(slot.url)
        if here is not None and here.status != DRAINING and not gone(slot):
            if there is None:
                found.append(Repair("add", slot))
        elif here is None and there is not None and there.status != DRAINING and gone(slot):
            found.append(Repair("remove", slot, there))
    return found


class Mirror:
    """The acting router's registrations, kept on the service's other routers."""

    def __init__(self, peers: list[Router], slots: int, log: Callable[[str], None]) -> None:
        self.peers = {peer.where: peer for peer in peers}
        self.log = log
        self.reads = Calls("pdctl-scaler-peer-read", max_workers=2 * len(peers) + 2)
        self.writes = Calls("pdctl-scaler-peer-write", max_workers=2 * slots + 2)
        self.silent: set[str] = set()  # routers that did not answer last time: said once
        self.failing: set[str] = set()  # repairs that failed: said once, until one succeeds

    def read(self) -> dict[str, Future[list[Worker]]]:
        """Ask every other router for its workers (gathered by listed())."""
        return {where: self.reads.submit(where, peer.workers) for where, peer in self.peers.items()}

    def listed(
        self, asked: dict[str, Future[list[Worker]]], deadline: float
    ) -> dict[str, dict[str, Worker]]:
        """The other routers' workers by URL, those that answered by ``deadline``."""
        found: dict[str, dict[str, Worker]] = {}
        for where, answer in gather(asked, deadline).items():
            if answer.answered:
                self.reads.forget(where)
            if answer.ok and answer.value is not None:
                found[where] = {w.url: w for w in answer.value}
                if where in self.silent:
                    self.silent.discard(where)
                    self.log(f"router {where} answers again")
            elif where not in self.silent:
                self.silent.add(where)
                why = str(answer.error) if answer.error is not None else "no answer in time"
                self.log(f"router {where} cannot be read ({why}): it is brought up to date later")
        return found

    def apply(
        self,
        slots: list[Slot],
        view: View,
        busy: Container[str],
        off_limits: Callable[[str], bool],
    ) -> None:
        """Say how the repairs started earlier ended, then start those this tick needs:
        ``view``, this tick's (the acting router's workers and the others'); ``busy``, the
        slots with an action in flight; ``off_limits``, whether a slot is fenced or condemned."""

        def settled(slot: Slot) -> bool:
            return slot.name not in busy and slot.host in view.fresh

        def gone(slot: Slot) -> bool:
            return not view.states[slot.name].running or off_limits(slot.name)

        for key, future in self.writes.done().items():
            error = future.exception()
            if error is None:
                self.failing.discard(key)
                self.log(key)
            elif key not in self.failing:
                self.failing.add(key)
                message = error.message if isinstance(error, PdctlError) else repr(error)
                self.log(f"{key} failed: {message}")
        for where, other in view.others.items():
            peer = self.peers[where]
            for repair in repairs(slots, view.workers, other, settled, gone):
                slot = repair.slot
                work: Callable[[], object]
                if repair.worker is None:
                    key = f"registered {slot.name} ({slot.url}) on router {where}: it lacked it"
                    work = partial(peer.add_worker, slot.registration())
                else:
                    key = f"removed {slot.name} ({slot.url}) from router {where}: it no longer runs"
                    work = partial(peer.remove_worker, repair.worker.id)
                if not self.writes.busy(key):
                    self.writes.submit(key, work)

    def close(self) -> None:
        self.reads.shutdown()
        self.writes.shutdown()
