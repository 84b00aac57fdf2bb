"""pdctl/core/fabric_judge.py: each pair's verdict, which host or path is blamed, the records the
inventory keeps and the warnings `pdctl plan` gives from them."""

from __future__ import annotations

import itertools

from pdctl.core.fabric_judge import Measurement, judge, plan_problems, records
from pdctl.core.fabric_nics import FabricNic
from pdctl.core.fabric_schedule import Link
from pdctl.core.fleet_model import FabricRecord, FleetHost

HOSTS = ["a", "b", "c", "d", "e"]


def link(x: str, y: str, rail: int = 0, rate: float | None = 400.0) -> Link:
    nic = FabricNic(f"mlx5_{rail}", rate_gbps=rate)
    return Link(x, y, str(rail), nic, nic)


def mesh(
    speed: dict[frozenset[str], float], default: float = 390.0, rails: int = 1
) -> list[Measurement]:
    return [
        Measurement(link(x, y, r), gbps=speed.get(frozenset((x, y)), default), lat_us=2.0)
        for r in range(rails)
        for x, y in itertools.combinations(HOSTS, 2)
    ]


def verdicts(doc: dict) -> dict[frozenset[str], bool]:
    return {frozenset(p["hosts"]): p["ok"] for p in doc["pairs"]}


def test_a_healthy_fabric_passes() -> None:
    doc = judge(mesh({}))
    assert doc["ok"] and doc["summary"] == "all 10 test(s) passed"
    assert not any(h["named"] for h in doc["hosts"].values())
    pair = doc["pairs"][0]
    assert pair["expected_gbps"] == 400.0 and pair["median_gbps"] == 390.0 and pair["why"] is None


def test_a_slow_host_fails_exactly_its_pairs_and_is_named() -> None:
    slow = {frozenset(("c", other)): 95.0 for other in HOSTS if other != "c"}
    doc = judge(mesh(slow, rails=2))
    assert not doc["ok"]
    for pair in doc["pairs"]:
        assert pair["ok"] == ("c" not in pair["hosts"])
        if not pair["ok"]:
            assert pair["cause"] == "host c"
            assert "95 Gb/s is below 80% of the line rate 400 Gb/s" in pair["why"]
    named = {h for h, entry in doc["hosts"].items() if entry["named"]}
    assert named == {"c"} and doc["hosts"]["c"]["rails"] == ["0", "1"]
    assert doc["summary"] == "8 of 20 test(s) failed; the cause: c"


def test_one_bad_path_is_named_as_the_pair() -> None:
    doc = judge(mesh({frozenset(("a", "d")): 40.0}))
    assert [frozenset(p["hosts"]) for p in doc["pairs"] if not p["ok"]] == [frozenset("ad")]
    bad = next(p for p in doc["pairs"] if not p["ok"])
    assert bad["cause"] == "the path between them"
    assert not any(h["named"] for h in doc["hosts"].values())


def test_below_the_median_fails_even_when_the_line_rate_is_unknown() -> None:
    measurements = [
        Measurement(link(x, y, rate=None), gbps=50.0 if "b" in (x, y) else 190.0)
        for x, y in itertools.combinations(HOSTS, 2)
    ]
    doc = judge(measurements)
    failed = [p for p in doc["pairs"] if not p["ok"]]
    assert {frozenset(p["hosts"]) for p in failed} == {frozenset(("b", h)) for h in "acde"}
    assert all(p["expected_gbps"] is None for p in doc["pairs"])
    assert "of rail 0's median" in failed[0]["why"]
    assert doc["hosts"]["b"]["named"]


def test_the_line_rate_is_the_lower_of_the_two_nics() -> None:
    slow_nic = FabricNic("mlx5_0", rate_gbps=200.0)  # trained at half its width
    fast = FabricNic("mlx5_0", rate_gbps=400.0)
    doc = judge([Measurement(Link("a", "b", "0", fast, slow_nic), gbps=190.0)])
    assert doc["pairs"][0]["expected_gbps"] == 200.0 and doc["ok"]


def test_when_every_pair_fails_nobody_is_singled_out() -> None:
    doc = judge(mesh({}, default=10.0))
    assert not doc["ok"]
    assert doc["summary"] == "all 10 test(s) failed: no single host or link to blame"
    assert not any(h["named"] for h in doc["hosts"].values())
    assert all(p["cause"] is None for p in doc["pairs"])


def test_two_hosts_cannot_tell_which_one() -> None:
    doc = judge([Measurement(link("a", "b"), gbps=12.0)])
    assert not doc["ok"] and not doc["hosts"]["a"]["named"] and not doc["hosts"]["b"]["named"]


def test_a_host_that_does_not_answer_fails_its_pairs_with_the_reason() -> None:
    why = "c: SSH connection timed out after 8 s"
    measurements = [
        Measurement(link(x, y), error=why) if "c" in (x, y) else Measurement(link(x, y), gbps=390)
        for x, y in itertools.combinations(HOSTS, 2)
    ]
    doc = judge(measurements)
    for pair in doc["pairs"]:
        assert pair["ok"] == ("c" not in pair["hosts"])
        if not pair["ok"]:
            assert pair["why"] == why and pair["gbps"] is None
    assert doc["hosts"]["c"]["named"]


def test_a_missing_nic_fails_without_a_run() -> None:
    broken = Link("a", "b", "3", FabricNic("mlx5_3"), None, "b has no NIC on rail 3")
    doc = judge([Measurement(broken, error=broken.problem)])
    assert doc["pairs"][0]["why"] == "b has no NIC on rail 3"
    assert doc["pairs"][0]["nics"] == ["mlx5_3", None]


def test_kv_paths_are_compared_together() -> None:
    nic = FabricNic("bnxt_re0", rate_gbps=None)
    paths = [
        Measurement(Link("p1", "d1", "prefill/0>decode/0 x>y", nic, nic), gbps=380.0),
        Measurement(Link("p1", "d2", "prefill/0>decode/1 x>y", nic, nic), gbps=385.0),
        Measurement(Link("p2", "d1", "prefill/1>decode/0 x>y", nic, nic), gbps=382.0),
        Measurement(Link("p2", "d2", "prefill/1>decode/1 x>y", nic, nic), gbps=20.0),
    ]
    doc = judge(paths, scope="kv")
    assert [p["ok"] for p in doc["pairs"]] == [True, True, True, False]
    assert "the KV paths' median" in doc["pairs"][3]["why"]
    assert doc["pairs"][3]["cause"] == "the path between them"


def test_records_and_plan_warnings() -> None:
    slow = {frozenset(("c", other)): 95.0 for other in HOSTS if other != "c"}
    doc = judge(mesh(slow))
    found = records(doc, "2026-11-26T12:00:00+00:00")
    assert set(found) == set(HOSTS)
    assert found["a"].ok and found["a"].summary == "passed but with c, named as the cause"
    c = found["c"]
    assert not c.ok and c.named and c.pairs == 4 and len(c.failed) == 4
    assert c.summary.startswith("all its tests on rail 0 failed: its own link (95 Gb/s")
    assert {f["peer"] for f in c.failed} == {"a", "b", "d", "e"}
    assert not found["a"].named and len(found["a"].failed) == 1
    assert found["d"].failed == [
        {
            "peer": "c",
            "rail": "0",
            "gbps": 95.0,
            "expected_gbps": 400.0,
            "why": found["d"].failed[0]["why"],
        }
    ]

    def host(name: str, record: FabricRecord | None) -> FleetHost:
        return FleetHost(name=name, address=name, user="root", kind="gpu", fabric=record)

    path = records(judge(mesh({frozenset(("a", "d")): 40.0})), "2026-11-26T13:00:00+00:00")
    assert not path["a"].ok and not path["d"].ok and path["b"].ok  # a bad path: both ends
    assert path["a"].summary.startswith("1 of 4 test(s) failed (40 Gb/s is below")
    problems = plan_problems([host("a", found["a"]), host("c", c), host("n", None)], "lab")
    assert problems == [
        f"c: its last fabric check (2026-11-26T12:00:00+00:00, mesh) failed: {c.summary}",
        "n: no fabric check on record (`pdctl fleet check lab --fabric`)",
    ]
