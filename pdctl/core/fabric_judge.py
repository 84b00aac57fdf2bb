"""What the fabric check's numbers say: each pair's verdict, and which host or link to blame.
PURE.

A pair passes when its bandwidth reaches ``min_fraction`` of the line rate both its NICs
report (the lower of the two) and of the median of its rail's pairs (the fleet's own
normal, which also catches a link that trained at a lower width and so reports a lower
rate itself). Then, per rail:

* a host all of whose pairs failed, while its peers passed with others, is named: the
  fault is its own link (cable, port, NIC);
* a pair that failed while both its hosts passed with others is named as a pair: the path
  between them (a switch port or route in between);
* when every pair failed, nothing is singled out: the fabric (or every host) is at fault.

The per-host records that the inventory keeps (FabricRecord) and the warnings `pdctl plan`
gives from them are made here too.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdctl.core.fabric_schedule import Link
from pdctl.core.fleet_model import FabricRecord, FleetHost, natural_key

DEFAULT_MIN_FRACTION = 0.8
MEDIAN_MIN_PAIRS = 3  # fewer pairs on a rail make no median worth comparing with
RECORD_FAILURES = 16
Scope = Literal["mesh", "kv"]


@dataclass(frozen=True)
class Measurement:
    link: Link
    gbps: float | None = None
    lat_us: float | None = None
    error: str | None = None  # why no bandwidth was measured


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def expected_gbps(link: Link) -> float | None:
    rates = [nic.rate_gbps for nic in (link.client_nic, link.server_nic) if nic is not None]
    if len(rates) < 2 or any(rate is None for rate in rates):
        return None
    return min(rate for rate in rates if rate is not None)


def _group(link: Link, scope: Scope) -> str:
    """What a test is compared with: its rail's tests (the mesh), or all of a plan's KV paths
    (each of those has its own NICs)."""
    return link.rail if scope == "mesh" else "kv"


def _medians(measurements: Sequence[Measurement], scope: Scope) -> dict[str, float]:
    by_rail: dict[str, list[float]] = {}
    for m in measurements:
        if m.gbps is not None and m.error is None:
            by_rail.setdefault(_group(m.link, scope), []).append(m.gbps)
    return {
        rail: statistics.median(values)
        for rail, values in by_rail.items()
        if len(values) >= MEDIAN_MIN_PAIRS
    }


def _why(
    m: Measurement, expected: float | None, median: float | None, fraction: float, scope: Scope
) -> str:
    """Why the pair failed ("" when it did not)."""
    if m.link.problem:
        return m.link.problem
    if m.error or m.gbps is None:
        return m.error or "no bandwidth measured"
    reasons = []
    if expected is not None and m.gbps < fraction * expected:
        reasons.append(f"below {fraction:.0%} of the line rate {_fmt(expected)} Gb/s")
    if median is not None and m.gbps < fraction * median:
        peers = f"rail {m.link.rail}'s" if scope == "mesh" else "the KV paths'"
        reasons.append(f"below {fraction:.0%} of {peers} median {_fmt(median)} Gb/s")
    if not reasons:
        return ""
    return f"{_fmt(m.gbps)} Gb/s is " + " and ".join(reasons)


def judge(
    measurements: Sequence[Measurement],
    *,
    min_fraction: float = DEFAULT_MIN_FRACTION,
    scope: Scope = "mesh",
) -> dict[str, Any]:
    """The fabric report: ``pairs`` (one entry per test), ``hosts`` (per host: its pairs,
    its failures, whether it is named and on which rails), ``ok`` and a ``summary``."""
    medians = _medians(measurements, scope)
    pairs = []
    for m in measurements:
        expected = expected_gbps(m.link)
        median = medians.get(_group(m.link, scope))
        why = _why(m, expected, median, min_fraction, scope)
        pairs.append(
            {
                "hosts": [m.link.client, m.link.server],
                "rail": m.link.rail,
                "nics": [
                    nic.name if nic else None for nic in (m.link.client_nic, m.link.server_nic)
                ],
                "gbps": None if m.gbps is None else round(m.gbps, 3),
                "expected_gbps": expected,
                "median_gbps": median,
                "lat_us": None if m.lat_us is None else round(m.lat_us, 3),
                "ok": not why,
                "why": why or None,
                "cause": None,
                "blamed": [],  # the hosts named as the cause of this pair's failure
            }
        )
    hosts = _blame(pairs, "rail" if scope == "mesh" else None)
    failed = [p for p in pairs if not p["ok"]]
    named = sorted((h for h, doc in hosts.items() if doc["named"]), key=natural_key)
    if not pairs:
        summary = "no pairs to test"
    elif not failed:
        summary = f"all {len(pairs)} test(s) passed"
    elif len(failed) == len(pairs):
        summary = f"all {len(pairs)} test(s) failed: no single host or link to blame"
    else:
        blamed = f"; the cause: {', '.join(named)}" if named else ""
        summary = f"{len(failed)} of {len(pairs)} test(s) failed{blamed}"
    return {
        "ok": not failed,
        "scope": scope,
        "min_fraction": min_fraction,
        "summary": summary,
        "pairs": pairs,
        "hosts": hosts,
    }


def _host_entries(pairs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    hosts: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        for host in pair["hosts"]:
            entry = hosts.setdefault(
                host, {"ok": True, "pairs": 0, "failed": 0, "named": False, "rails": []}
            )
            entry["pairs"] += 1
            entry["failed"] += 0 if pair["ok"] else 1
            entry["ok"] = entry["ok"] and pair["ok"]
    return hosts


def _name_in_group(
    group: str, pairs: list[dict[str, Any]], hosts: dict[str, dict[str, Any]]
) -> None:
    passed: dict[str, bool] = {}
    for pair in pairs:
        for host in pair["hosts"]:
            passed[host] = passed.get(host, False) or pair["ok"]
    if not any(passed.values()):
        return  # every pair of the group failed: nothing to single out
    for host, any_ok in passed.items():
        peers = {p for pair in pairs if host in pair["hosts"] for p in pair["hosts"]} - {host}
        if not any_ok and any(passed.get(peer) for peer in peers):
            hosts[host]["named"] = True
            hosts[host]["rails"].append(group)
    for pair in pairs:
        culprits = [h for h in pair["hosts"] if group in hosts[h]["rails"]]
        if pair["ok"]:
            continue
        if culprits:
            pair["cause"] = f"host {', '.join(culprits)}"
            pair["blamed"] = culprits
        elif all(passed.get(h) for h in pair["hosts"]):
            pair["cause"] = "the path between them"


def _blame(pairs: list[dict[str, Any]], key: str | None) -> dict[str, dict[str, Any]]:
    """Name hosts and pairs (see the module's docstring), within each group of pairs (by
    ``key``, or all together when None); fills each pair's ``cause``."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for pair in pairs:
        groups.setdefault(pair[key] if key else "kv", []).append(pair)
    hosts = _host_entries(pairs)
    for group, group_pairs in groups.items():
        _name_in_group(group, group_pairs, hosts)
    return hosts


def records(report: Mapping[str, Any], checked_at: str) -> dict[str, FabricRecord]:
    """Each tested host's FabricRecord from a report. A host passes when each of its pairs
    passed or failed because of another host named as the cause (a slow peer is not this
    host's fault)."""
    found = {}
    for host, entry in report["hosts"].items():
        failures = [
            {
                "peer": next((h for h in p["hosts"] if h != host), host),
                "rail": p["rail"],
                "gbps": p["gbps"],
                "expected_gbps": p["expected_gbps"],
                "why": p["why"],
            }
            for p in report["pairs"]
            if host in p["hosts"] and not p["ok"]
        ]
        own = [
            p
            for p in report["pairs"]
            if host in p["hosts"] and not p["ok"] and (not p["blamed"] or host in p["blamed"])
        ]
        if not failures:
            summary = f"all {entry['pairs']} test(s) passed"
        elif not own:
            peers = sorted({b for p in report["pairs"] if host in p["hosts"] for b in p["blamed"]})
            summary = f"passed but with {', '.join(peers)}, named as the cause"
        elif entry["named"]:
            summary = (
                f"all its tests on rail {', '.join(entry['rails'])} failed: its own link "
                f"({own[0]['why']})"
            )
        else:
            summary = f"{len(own)} of {entry['pairs']} test(s) failed ({own[0]['why']})"
        found[host] = FabricRecord(
            ok=not own,
            checked_at=checked_at,
            scope=report["scope"],
            pairs=entry["pairs"],
            named=entry["named"],
            summary=summary,
            failed=failures[:RECORD_FAILURES],
        )
    return found


def plan_problems(hosts: Iterable[FleetHost], fleet: str) -> list[str]:
    """Why each of these hosts (a plan's GPU hosts) is not fabric-certified: no fabric check
    on record, or its last one failed. Empty: all are."""
    problems = []
    for host in hosts:
        record = host.fabric
        if record is None:
            problems.append(
                f"{host.name}: no fabric check on record (`pdctl fleet check {fleet} --fabric`)"
            )
        elif not record.ok:
            problems.append(
                f"{host.name}: its last fabric check ({record.checked_at}, {record.scope}) "
                f"failed: {record.summary}"
            )
    return problems
