"""The fabric check end to end on `pdctl lab up --hosts 5 --cpu-hosts 1`: real sshd, sudo and
the perftest stand-ins moving bytes between the lab hosts over their links; one host's link
capped with tc (`lab fault HOST link-slow 20M`) fails exactly its pairs and is named."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest

from tests.support import Lab, pdctl, pdctl_json, require_lab, start_lab

# Size-bound tests (200 x 64 KiB): what the lab's 2 Gb/s NICs move in a fraction of a second.
QUICK = ("--iterations", "200")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_lab()
    home = tmp_path_factory.mktemp("fabric")
    lab = start_lab(home, hosts=5, cpu_hosts=1)
    pdctl(home, *lab.status()["fleet_add"].split()[1:])
    yield lab
    pdctl(home, "lab", "down")


def check(lab: Lab, *args: str) -> tuple[int, dict]:
    proc = pdctl(
        lab.home, "--json", "fleet", "check", "lab", "--fabric", *QUICK, *args, check=False
    )
    assert "Traceback" not in proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def records(lab: Lab) -> dict[str, dict | None]:
    shown = pdctl_json(lab.home, "fleet", "show", "lab")
    return {h["address"]: h["fabric"] for h in shown["hosts"]}


def test_every_pair_passes_then_a_slow_link_is_named(lab: Lab) -> None:
    status = lab.status()
    gpu = sorted(h["address"] for h in status["hosts"] if h["kind"] == "gpu")
    cpu = next(h["address"] for h in status["hosts"] if h["kind"] == "cpu")
    assert len(gpu) == 4

    rc, doc = check(lab)
    fabric = doc["fabric"]
    assert rc == 0, fabric["summary"]
    assert all(h["ok"] for h in doc["hosts"])  # the preflight, perftest's check among them
    assert fabric["ok"] and fabric["rounds"] == 3
    pairs = fabric["pairs"]
    assert {frozenset(p["hosts"]) for p in pairs} == {
        frozenset(p) for p in itertools.combinations(gpu, 2)
    }
    assert len(pairs) == 6 * 8  # every pair of the 4 GPU hosts, on each of the 8 rails
    for pair in pairs:
        assert pair["ok"] and pair["expected_gbps"] == 2.0  # 1X SDR, the lab's NICs
        assert 0 < pair["gbps"] <= 2.0 * 1.02 and pair["lat_us"] > 0
        assert pair["nics"] == [f"bnxt_re{pair['rail']}"] * 2
    stored = records(lab)
    assert stored[cpu] is None
    assert all(stored[a] and stored[a]["ok"] and stored[a]["pairs"] == 24 for a in gpu)

    slow = gpu[1]
    node = lab.node_at(slow)
    pdctl(lab.home, "lab", "fault", node, "link-slow", "20M")
    assert lab.host(node)["faults"] == ["link-slow 20M"]
    try:
        human = pdctl(
            lab.home,
            "fleet",
            "check",
            "lab",
            "--fabric",
            *QUICK,
            "--rails",
            "0",
            env={"COLUMNS": "250"},
            check=False,
        )
    finally:
        pdctl(lab.home, "lab", "fault", node, "clear")
    assert human.returncode == 5, human.stderr
    assert "Traceback" not in human.stderr
    assert f"{slow}: every test on rail 0 failed while its peers passed" in human.stdout
    assert f"fabric: 3 of 6 test(s) failed; the cause: {slow}" in human.stderr
    stored = records(lab)
    bad = stored[slow]
    assert bad is not None and not bad["ok"] and bad["named"] and bad["pairs"] == 3
    assert sorted(f["peer"] for f in bad["failed"]) == [a for a in gpu if a != slow]
    for failure in bad["failed"]:
        assert failure["rail"] == "0" and failure["gbps"] < 0.5  # 20 MiB/s: 0.17 Gb/s
        assert "below 80% of the line rate 2 Gb/s" in failure["why"]
    for other in (a for a in gpu if a != slow):
        record = stored[other]
        assert record is not None and record["ok"] and record["pairs"] == 3
        assert [f["peer"] for f in record["failed"]] == [slow]  # its two other pairs passed
        assert record["summary"] == f"passed but with {slow}, named as the cause"

    rc, doc = check(lab, "--rails", "0", "--limit", slow)  # `clear` lifted the cap
    assert rc == 0, doc["fabric"]["summary"]
    assert len(doc["fabric"]["pairs"]) == 3
    assert records(lab)[slow]["ok"]


def test_a_host_that_does_not_answer_fails_its_pairs_the_rest_go_on(lab: Lab) -> None:
    gpu = sorted(h["address"] for h in lab.status()["hosts"] if h["kind"] == "gpu")
    gone = gpu[-1]
    node = lab.node_at(gone)
    pdctl(lab.home, "lab", "fault", node, "sshd-down")
    try:
        rc, doc = check(lab, "--rails", "0")
    finally:
        pdctl(lab.home, "lab", "fault", node, "clear")
    assert rc == 5
    fabric = doc["fabric"]
    assert len(fabric["pairs"]) == 6
    for pair in fabric["pairs"]:
        assert pair["ok"] == (gone not in pair["hosts"]), pair
        if not pair["ok"]:
            assert pair["gbps"] is None
            assert gone in pair["why"] and "22" in pair["why"]  # the SSH failure, named
    assert [h for h, e in fabric["hosts"].items() if e["named"]] == [gone]
