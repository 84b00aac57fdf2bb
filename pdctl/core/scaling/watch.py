"""The scaler's memory of what stopped answering, and its verdicts. PURE (the clock is passed).

Two kinds of loss, each judged from a tick's observations:

- A **host** is lost when it has answered no SSH command for ``host_lost_after`` seconds and
  none of its running engines answers its health check, while some other worker host does
  answer (when none does, the scaler's own network is the likelier fault: it holds). Every
  slot of a lost host is *fenced*: never counted, started or registered until the scaler has
  stopped and disabled it on the host, once the host answers again (its units may still be
  enabled, and boot with it).
- A **replica** is unhealthy when its engine, having served, has failed its health check (or
  the router's) for ``unhealthy_after`` seconds: it is *condemned*, deregistered at once and
  killed once its replacement serves. One whose unit systemd *restarted in place* (its engine
  died and came back as a new process) loads again like a start: it has ``restart_grace``
  seconds from that restart to answer before it is condemned, not ``unhealthy_after`` from its
  first failed check (replacing an engine that is loading again only opens a gap).

Either way the group keeps a *floor*, the replicas it had: replacements (spare slots on other
hosts) restore it without waiting on the scaling policy's delays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Watch:
    host_lost_after: float
    unhealthy_after: float
    restart_grace: float
    silent_since: dict[str, float] = field(default_factory=dict)  # host -> first missed read
    lost: set[str] = field(default_factory=set)  # hosts declared lost
    fenced: set[str] = field(default_factory=set)  # slots to stop and disable before any use
    failing_since: dict[str, float] = field(default_factory=dict)  # slot -> first failed check
    served: set[str] = field(default_factory=set)  # slots whose engine answered since started
    condemned: dict[str, float] = field(default_factory=dict)  # slot -> when found unhealthy
    restarted_since: dict[str, float] = field(
        default_factory=dict
    )  # slot -> first restart unanswered
    restarts: dict[str, int] = field(default_factory=dict)  # slot -> its unit's restart count
    floor: dict[str, int] = field(default_factory=dict)  # group -> replicas to restore

    # -- hosts -------------------------------------------------------------------------------
    def host_answered(self, host: str) -> bool:
        """The host answered: True when it was lost (its fenced slots can now be fenced)."""
        self.silent_since.pop(host, None)
        if host in self.lost:
            self.lost.discard(host)
            return True
        return False

    def host_silent(self, host: str, now: float, *, engines_answer: bool, others: bool) -> bool:
        """The host missed a read: True when it is lost from now on."""
        since = self.silent_since.setdefault(host, now)
        if host in self.lost or now - since < self.host_lost_after:
            return False
        return not engines_answer and others

    def silent_for(self, host: str, now: float) -> float:
        return now - self.silent_since.get(host, now)

    def lose_host(self, host: str, slots: list[str]) -> None:
        self.lost.add(host)
        self.fenced.update(slots)
        for slot in slots:
            self.forget(slot)

    def unfence(self, slot: str) -> None:
        self.fenced.discard(slot)

    # -- replicas ----------------------------------------------------------------------------
    def replica(
        self, slot: str, now: float, *, answers: bool | None, router_unhealthy: bool
    ) -> float | None:
        """A running replica's health check this tick (``answers`` None: not checked). The
        seconds it has been failing when it must be condemned now, else None. A replica that
        never served yet is still starting: the start timeout judges it, not this."""
        if answers is None:
            return None
        if answers and not router_unhealthy:
            self._no_failure(slot)
            self.served.add(slot)
            return None
        if slot not in self.served:
            return None
        restarted = self.restarted_since.get(slot)
        if restarted is not None:
            return now - restarted if now - restarted >= self.restart_grace else None
        since = self.failing_since.setdefault(slot, now)
        return now - since if now - since >= self.unhealthy_after else None

    def unit_read(self, slot: str, restarts: int | None, now: float) -> bool:
        """A running slot's unit restart count (systemd's NRestarts; None: not known) as read
        this tick. True when it moved on an engine that had served: systemd restarted the
        engine in place (same unit, a new process), which loads again like a start. Its grace
        counts from the first restart since it last answered: an engine that crashes over and
        over does not earn a new one with each restart."""
        if restarts is None:
            return False
        before = self.restarts.get(slot)
        self.restarts[slot] = restarts
        if before is None or before == restarts or slot not in self.served:
            return False
        self.failing_since.pop(slot, None)
        self.restarted_since.setdefault(slot, now)
        return True

    def condemn(self, slot: str, now: float) -> None:
        self.condemned[slot] = now
        self._no_failure(slot)

    def stopped(self, slot: str) -> None:
        """The slot's unit is down: what its engine did is history."""
        self.served.discard(slot)
        self._no_failure(slot)

    def _no_failure(self, slot: str) -> None:
        """Whatever the slot's engine was failing (checks, or answering after a restart) is over."""
        self.failing_since.pop(slot, None)
        self.restarted_since.pop(slot, None)

    def forget(self, slot: str) -> None:
        self.stopped(slot)
        self.condemned.pop(slot, None)

    def off_limits(self, slot: str) -> bool:
        """Neither counted as the group's, nor started, nor registered."""
        return slot in self.fenced or slot in self.condemned

    # -- groups ------------------------------------------------------------------------------
    def hold_floor(self, group: str, count: int) -> None:
        self.floor[group] = max(self.floor.get(group, 0), count)

    def members(self, group: str, available: int) -> int:
        """What the policy counts as the group's replicas: those available, or the floor
        while replacements restore it (like replicas still loading, they count)."""
        floor = self.floor.get(group)
        if floor is not None and available >= floor:
            del self.floor[group]
            floor = None
        return max(available, floor or 0)

    def settle(self, group: str, desired: int) -> None:
        """The policy decided: a floor above its decision has no more to restore."""
        floor = self.floor.get(group)
        if floor is not None and desired < floor:
            self.floor[group] = desired

    # -- persistence (the scaler's state file, layout.SCALER_STATE) --------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"lost_hosts": sorted(self.lost), "fenced": sorted(self.fenced)}

    def restore(self, doc: dict[str, Any]) -> None:
        """A restarted scaler keeps its fences: a lost host's units must not serve before
        they are stopped, whoever runs the scaler when the host returns."""
        for key, into in (("lost_hosts", self.lost), ("fenced", self.fenced)):
            value = doc.get(key)
            if isinstance(value, list):
                into.update(str(item) for item in value if isinstance(item, str))
