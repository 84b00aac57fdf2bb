"""One GPU budget for the services sharing a fleet: the ledger and its one operation (PURE).

Every scaler of a budgeted fleet calls ``draw()`` once per tick, under the ledger's lock
(gpu_ledger_file.py): it reports the GPUs its service uses now and asks for what its scale-outs
need. The ledger is soft state, rebuilt from those reports: a lost or corrupt file costs one
tick of each scaler, never GPUs. What it decides:

- **used** = every service's reported GPUs (a service whose scaler stopped reporting still
  runs its replicas: its last report stands until ``release()``, at its destroy) plus the
  grants not yet reported as running (``reserved``, held ``RESERVE_FOR`` at most);
- **the budget** is the smallest any live scaler was deployed with (a lowered budget holds at
  once, a raised one once every service runs the new deploy);
- **priority**: the wants of live scalers are served in order of their pressure, how far the
  group is from its SLO (``pressure()``: observed / target, so 1.5 is 50% over), then the
  oldest first; each takes whole replicas of what is left. A want is granted only once every
  other live scaler has reported since it was made (one tick of theirs): a service further
  from its SLO that asks a moment later is not beaten to the last GPUs by the clock;
- **live** is a report within ``live_for(interval)``; a dead scaler's wants lapse with it, so
  they never hold the others up, and its reservations lapse after ``RESERVE_FOR``.

The file is data written by other processes: ``load()`` keeps only well-formed entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

VERSION = 1
RESERVE_FOR = 120.0  # a grant not reported as running by then is released
MIN_LIVE = 15.0  # a scaler is live while it reported within max(this, 3 x its interval)
_MAX_SERVICES = 512
_MAX_GPUS = 1 << 20


def live_for(interval: float) -> float:
    return max(MIN_LIVE, 3.0 * interval)


def pressure(signal: str | None, value: float | None, target: float | None, current: int) -> float:
    """How far a group is from its SLO: observed latency / target, or the load per replica /
    its target for rps and in-flight (1.0 is on target). 0 when unknown."""
    if value is None or target is None or not (math.isfinite(value) and target > 0):
        return 0.0
    if not math.isfinite(target):
        return 0.0
    if signal in ("ttft", "itl"):
        return value / target
    return value / (target * max(current, 1))


@dataclass
class Want:
    """A group's standing request for more GPUs."""

    gpus: int
    unit: int  # GPUs per replica: grants come in whole replicas
    pressure: float
    since: float  # when the service first asked (its priority among equals)
    at: float  # when it last asked

    def to_dict(self) -> dict[str, float]:
        return {
            "gpus": self.gpus,
            "unit": self.unit,
            "pressure": self.pressure,
            "since": self.since,
            "at": self.at,
        }


@dataclass
class Entry:
    """One service's line of the ledger."""

    using: int
    at: float  # its scaler's last report
    interval: float
    budget: int  # the budget its plan was deployed with
    reserved: int = 0  # granted, not yet reported as running
    reserved_until: float = 0.0
    wants: dict[str, Want] = field(default_factory=dict)

    def live(self, now: float) -> bool:
        return now - self.at <= live_for(self.interval)

    def to_dict(self) -> dict[str, Any]:
        return {
            "using": self.using,
            "at": self.at,
            "interval": self.interval,
            "budget": self.budget,
            "reserved": self.reserved,
            "reserved_until": self.reserved_until,
            "wants": {group: want.to_dict() for group, want in self.wants.items()},
        }


@dataclass
class Ledger:
    services: dict[str, Entry] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "services": {name: e.to_dict() for name, e in sorted(self.services.items())},
        }


@dataclass(frozen=True)
class Ask:
    """What one scaler asks of the ledger in one tick."""

    service: str
    budget: int
    using: int  # GPUs of its replicas running or starting now
    interval: float
    wants: dict[str, tuple[int, int, float]]  # group -> (gpus, gpus per replica, pressure)


@dataclass(frozen=True)
class Grant:
    """The ledger's answer to one group's want."""

    gpus: int  # granted now (whole replicas); 0: refused this tick
    reason: str  # why not all of it (empty when all)


@dataclass(frozen=True)
class Answer:
    grants: dict[str, Grant]
    budget: int
    used: int  # after this draw, grants included
    holders: dict[str, int]  # service -> its GPUs (reported + reserved)
    note: str = ""  # e.g. the ledger was unreadable and started afresh

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "used": self.used,
            "holders": self.holders,
            "grants": {g: {"gpus": x.gpus, "reason": x.reason} for g, x in self.grants.items()},
            "note": self.note,
        }


def _number(value: object, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and low <= number <= high else None


def _want(raw: object) -> Want | None:
    if not isinstance(raw, dict):
        return None
    gpus, unit = _number(raw.get("gpus"), 1, _MAX_GPUS), _number(raw.get("unit"), 1, _MAX_GPUS)
    level = _number(raw.get("pressure"), 0, 1e9)
    since, at = _number(raw.get("since"), 0, 1e12), _number(raw.get("at"), 0, 1e12)
    if gpus is None or unit is None or level is None or since is None or at is None:
        return None
    return Want(int(gpus), int(unit), level, since, at)


def _entry(raw: object) -> Entry | None:
    if not isinstance(raw, dict):
        return None
    using = _number(raw.get("using"), 0, _MAX_GPUS)
    at = _number(raw.get("at"), 0, 1e12)
    interval = _number(raw.get("interval"), 0.01, 3600)
    budget = _number(raw.get("budget"), 0, _MAX_GPUS)
    if using is None or at is None or interval is None or budget is None:
        return None
    reserved = _number(raw.get("reserved", 0), 0, _MAX_GPUS) or 0.0
    until = _number(raw.get("reserved_until", 0), 0, 1e12) or 0.0
    wants_raw = raw.get("wants")
    wants = {}
    if isinstance(wants_raw, dict):
        for group, item in wants_raw.items():
            want = _want(item)
            if isinstance(group, str) and want is not None:
                wants[group] = want
    return Entry(int(using), at, interval, int(budget), int(reserved), until, wants)


def load(doc: object) -> tuple[Ledger, str]:
    """The ledger from its file's JSON, and a note when some (or all) of it was not usable."""
    if doc is None:
        return Ledger(), ""
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        return Ledger(), "the ledger was not one this pdctl reads: started afresh"
    services = doc.get("services")
    if not isinstance(services, dict):
        return Ledger(), "the ledger had no services: started afresh"
    ledger = Ledger()
    dropped = 0
    for name, raw in list(services.items())[:_MAX_SERVICES]:
        entry = _entry(raw)
        if isinstance(name, str) and entry is not None:
            ledger.services[name] = entry
        else:
            dropped += 1
    return ledger, f"{dropped} malformed entr(y/ies) dropped" if dropped else ""


def _holding(entry: Entry, now: float) -> int:
    reserved = entry.reserved if entry.reserved_until > now else 0
    return entry.using + reserved


def _rank(item: tuple[str, str, Want]) -> tuple[float, float, str, str]:
    service, group, want = item
    return (-want.pressure, want.since, service, group)


def draw(ledger: Ledger, ask: Ask, now: float) -> tuple[Ledger, Answer]:
    """One scaler's report and request: the new ledger and its answer (inputs untouched)."""
    services = {name: _copy(entry) for name, entry in ledger.services.items()}
    previous = services.get(ask.service)
    mine = Entry(ask.using, now, ask.interval, ask.budget)  # its report replaces its reservation
    for group, (gpus, unit, level) in ask.wants.items():
        if gpus <= 0 or unit <= 0:
            continue
        before = previous.wants.get(group) if previous else None
        since = before.since if before is not None else now
        mine.wants[group] = Want(gpus, unit, max(0.0, level), since, now)
    services[ask.service] = mine
    for name, entry in services.items():
        if name != ask.service and not entry.live(now):
            entry.wants = {}  # a dead scaler's wants lapse; its replicas still count
        if entry.reserved_until <= now:
            entry.reserved, entry.reserved_until = 0, 0.0
    live = [e for e in services.values() if e.live(now)]
    budget = min(e.budget for e in live)
    used = sum(_holding(e, now) for e in services.values())
    # Serve every live want in priority order from what is free: each takes whole replicas.
    free = budget - used
    allotted: dict[tuple[str, str], int] = {}
    wants = [(s, g, w) for s, e in services.items() for g, w in e.wants.items()]
    for service, group, want in sorted(wants, key=_rank):
        take = min(want.gpus, max(0, free) // want.unit * want.unit)
        allotted[(service, group)] = take
        free -= take
    others = {n: e for n, e in services.items() if n != ask.service and e.live(now)}
    grants: dict[str, Grant] = {}
    granted_total = 0
    for group, want in sorted(mine.wants.items()):
        take = allotted.get((ask.service, group), 0)
        waiting = sorted(n for n, e in others.items() if e.at < want.since)
        if take > 0 and waiting:
            grants[group] = Grant(
                0,
                f"waiting one tick for {', '.join(waiting)} to weigh in (priority goes to "
                "the service furthest from its SLO)",
            )
            continue
        if take < want.gpus:
            grants[group] = Grant(
                take, _short(ask.service, group, want, take, budget, services, now)
            )
        else:
            grants[group] = Grant(take, "")
        if take > 0:
            granted_total += take
            del mine.wants[group]  # served: a further need is a new want
    if granted_total:
        mine.reserved = granted_total
        mine.reserved_until = now + max(RESERVE_FOR, live_for(ask.interval))
    holders = {n: _holding(e, now) for n, e in sorted(services.items())}
    answer = Answer(grants, budget, sum(holders.values()), holders)
    return Ledger(services), answer


def _short(
    service: str,
    group: str,
    want: Want,
    take: int,
    budget: int,
    services: dict[str, Entry],
    now: float,
) -> str:
    """Why a want got less than it asked: the budget's state and who is ahead of it."""
    held = ", ".join(
        f"{name} {_holding(e, now)}" for name, e in sorted(services.items()) if _holding(e, now)
    )
    ahead = sorted(
        f"{name}/{g} ({w.pressure:.2f}x its target)"
        for name, e in services.items()
        for g, w in e.wants.items()
        if _rank((name, g, w)) < _rank((service, group, want))
    )
    text = (
        f"GPU budget: {want.gpus} more GPU(s) wanted, {take} granted; "
        f"{budget} in the budget, held: {held or 'none'}"
    )
    return text + (f"; ahead of it: {', '.join(ahead)}" if ahead else "")


def release(ledger: Ledger, service: str) -> Ledger:
    """The service is gone (destroyed): its GPUs and wants leave the ledger."""
    return Ledger({n: _copy(e) for n, e in ledger.services.items() if n != service})


def _copy(entry: Entry) -> Entry:
    return Entry(
        entry.using,
        entry.at,
        entry.interval,
        entry.budget,
        entry.reserved,
        entry.reserved_until,
        {g: Want(w.gpus, w.unit, w.pressure, w.since, w.at) for g, w in entry.wants.items()},
    )
