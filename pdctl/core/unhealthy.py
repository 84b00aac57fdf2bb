"""Why a unit did not become healthy: what the roles' health waits saw, as data.

The roles wait on pdctl/onhost/unit_probe.py (HTTP status, the unit's state and restart count,
its journal) for every worker slot, the router and the scaler. A run that fails there
leaves those probes in its task results; this turns them into one record per unit, so the
operator reads the reason (the worker's own last log lines) in pdctl's error, not only in
the journal on the host. Host output is untrusted: every field is type-checked and cut to
size, and the secrets' values are masked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from pdctl.core.errors import HostError
from pdctl.onhost.secret_mask import Masker

JOURNAL_LINES = 15
SHOWN_LINES = 5  # per unit, in the one-line-per-unit text form
_LINE_MAX = 400


@dataclass
class Unhealthy:
    replica: str  # "prefill/1", "router", "scaler"
    host: str
    unit: str
    state: str  # systemd's ActiveState when the wait ended
    restarts: int
    status: int  # the health probe's HTTP status (0: nothing answered)
    journal: list[str] = field(default_factory=list)

    def describe(self) -> str:
        answered = f"answered {self.status}" if self.status else "answered nothing"
        head = (
            f"{self.replica} on {self.host} ({self.unit}): unit {self.state} after "
            f"{self.restarts} restart(s), health {answered}"
        )
        return "\n".join([head, *(f"    | {line}" for line in self.journal[-SHOWN_LINES:])])


class UnhealthyUnits(HostError):
    """Units that did not become healthy, each with its state and last log lines."""

    def __init__(self, what: str, units: list[Unhealthy], *, hint: str) -> None:
        lines = [f"{what}: {len(units)} unit(s) not healthy:"]
        lines += [f"  {unit.describe()}" for unit in units]
        super().__init__("\n".join(lines), hint=hint)
        self.units = units

    def as_dict(self) -> dict[str, Any]:
        doc = super().as_dict()
        doc["replicas"] = [asdict(unit) for unit in self.units]
        return doc


def _text(value: Any, limit: int = 200) -> str:
    return str(value)[:limit] if isinstance(value, str | int) else ""


def _probe(item: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the probe's output, the unit it probed) of one failed loop item: a probe task's own
    item (retries ran out) or an assert's item (the probe result it judged)."""
    result = item if "stdout" in item else item.get("item")
    if not isinstance(result, dict) or not isinstance(result.get("stdout"), str):
        return None
    try:
        output = json.loads(result["stdout"][-65536:])
    except ValueError:
        return None
    target = result.get("item")
    if not isinstance(output, dict) or not isinstance(target, dict):
        return None
    return output, target


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def from_unitctl(
    replica: str, host: str, unit: str, output: str, secrets: Iterable[str] = ()
) -> Unhealthy:
    """One unit's record from `pdctl-unitctl SERVICE why GROUP K` (its state, restarts and
    journal; the health probe's status is not part of it)."""
    head, _, journal = output.partition("\n--\n")
    props = dict(line.partition("=")[::2] for line in head.splitlines())
    restarts = props.get("NRestarts", "0")
    lines = Masker(secrets).text(journal[-65536:]).splitlines()
    return Unhealthy(
        replica=replica,
        host=host,
        unit=unit,
        state=props.get("ActiveState", "unknown")[:32] or "unknown",
        restarts=int(restarts) if restarts.isdigit() else 0,
        status=0,
        journal=[line[:_LINE_MAX] for line in lines[-JOURNAL_LINES:]],
    )


class TaskResultView(Protocol):
    """What this module reads of one task result (runner.TaskResult): the core does not
    import the runner."""

    @property
    def host(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def ignored(self) -> bool: ...
    @property
    def res(self) -> dict[str, Any]: ...


class RunView(Protocol):
    """What this module reads of a run (runner.RunSummary)."""

    @property
    def results(self) -> Sequence[TaskResultView]: ...


def from_run(summary: RunView, secrets: Iterable[str] = ()) -> list[Unhealthy]:
    """Every unit whose health wait failed in this run (one record per unit)."""
    masker = Masker(secrets)
    found: dict[tuple[str, str], Unhealthy] = {}
    for result in summary.results:
        if result.status != "failed" or result.ignored:
            continue
        for item in result.res.get("results") or []:
            if not isinstance(item, dict) or not item.get("failed"):
                continue
            probed = _probe(item)
            if probed is None:
                continue
            output, target = probed
            group, index = target.get("group"), target.get("index")
            replica = f"{group}/{index}" if group and index is not None else target.get("name")
            journal = masker.text(_text(output.get("journal"), 65536)).splitlines()
            unit = Unhealthy(
                replica=_text(replica) or "unknown",
                host=result.host,
                unit=_text(target.get("unit")),
                state=_text(output.get("state"), 32) or "unknown",
                restarts=_int(output.get("restarts")),
                status=_int(output.get("status")),
                journal=[line[:_LINE_MAX] for line in journal[-JOURNAL_LINES:]],
            )
            found[(unit.host, unit.unit)] = unit
    return list(found.values())
