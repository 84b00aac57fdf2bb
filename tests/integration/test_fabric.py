"""The fabric check end to end on `pdctl lab up --hosts 5 --cpu-hosts 1`: real sshd, sudo and
the perftest stand-ins moving bytes between the lab hosts over their links; one host's link
capped with tc (`lab fault HOST link-slow 20M`) fails exactly its pairs and is named."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Lab, pdctl, pdctl_json, require_lab, start_lab

REPO = Path(__file__).resolve().parents[2]

# Size-bound tests (1000 x 64 KiB, a quarter of a second at the lab NICs' 2 Gb/s): long enough
# that a loaded machine's scheduling hiccups do not decide a verdict, short enough for CI.
QUICK = ("--iterations", "1000")
# Where a link is capped: a size-bound test would crawl, one second of perftest does not.
TIMED = ("--duration", "1")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_lab()
    home = tmp_path_factory.mktemp("fabric")
    lab = start_lab(home, hosts=5, cpu_hosts=1)
    try:
        # Registered with --fabric: the new hosts' pairs are tested at once (rail 0 here).
        add = pdctl(
            home,
            "--json",
            *lab.status()["fleet_add"].split()[1:],
            "--fabric",
            *QUICK,
            "--rails",
            "0",
            check=False,
        )
        fabric = json.loads(add.stdout)["fabric"]
        assert add.returncode == 0 and len(fabric["pairs"]) == 6, failures(fabric)
        yield lab
    finally:
        pdctl(home, "lab", "down")


def failures(fabric: dict) -> str:
    bad = [f"{p['hosts']} rail {p['rail']}: {p['why']}" for p in fabric["pairs"] if not p["ok"]]
    return f"{fabric['summary']}: " + "; ".join(bad)


def check(
    lab: Lab, *args: str, run: tuple[str, ...] = QUICK, only: bool = False
) -> tuple[int, dict]:
    """`fleet check lab --fabric` (``only``: --fabric-only, no preflight) as JSON."""
    flag = "--fabric-only" if only else "--fabric"
    proc = pdctl(lab.home, "--json", "fleet", "check", "lab", flag, *run, *args, check=False)
    assert "Traceback" not in proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def check_settled(
    lab: Lab, *args: str, run: tuple[str, ...] = QUICK, only: bool = False, but: str | None = None
) -> tuple[int, dict]:
    """check(), tried up to three times until every pair without host ``but`` passes.

    The lab's links move real bytes paced to their line rate: on the loaded CI machine a stall
    near a test's end can leave a healthy pair under 80 % of it (seen at 1.4 of 2 Gb/s). A pair
    that fails for its link's own reason (a cap, a silent host) fails every try."""
    for _ in range(3):
        rc, doc = check(lab, *args, run=run, only=only)
        if all(p["ok"] or but in p["hosts"] for p in doc["fabric"]["pairs"]):
            break
    return rc, doc


def records(lab: Lab) -> dict[str, dict | None]:
    shown = pdctl_json(lab.home, "fleet", "show", "lab")
    return {h["address"]: h["fabric"] for h in shown["hosts"]}


def test_every_pair_passes_then_a_slow_link_is_named(lab: Lab) -> None:
    status = lab.status()
    gpu = sorted(h["address"] for h in status["hosts"] if h["kind"] == "gpu")
    cpu = next(h["address"] for h in status["hosts"] if h["kind"] == "cpu")
    assert len(gpu) == 4

    rc, doc = check_settled(lab, "--rails", "0,7")  # the first and the last NIC (and at add)
    fabric = doc["fabric"]
    assert rc == 0, failures(fabric)
    assert all(h["ok"] for h in doc["hosts"])  # the preflight, perftest's check among them
    assert fabric["ok"] and fabric["rounds"] == 3 and fabric["waves"] == 6  # rail by rail
    pairs = fabric["pairs"]
    assert {frozenset(p["hosts"]) for p in pairs} == {
        frozenset(p) for p in itertools.combinations(gpu, 2)
    }
    assert len(pairs) == 6 * 2  # every pair of the 4 GPU hosts, on each of the two rails
    assert {p["rail"] for p in pairs} == {"0", "7"}
    for pair in pairs:
        assert pair["ok"] and pair["expected_gbps"] == 2.0  # 1X SDR, the lab's NICs
        assert 0 < pair["gbps"] <= 2.0 * 1.02 and pair["lat_us"] > 0
        assert pair["nics"] == [f"bnxt_re{pair['rail']}"] * 2
    stored = records(lab)
    assert stored[cpu] is None
    assert all(stored[a] and stored[a]["ok"] and stored[a]["pairs"] == 6 for a in gpu)

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
            "--fabric-only",
            *TIMED,
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

    # `clear` lifted the cap: its pairs pass again (a second's test: a short one is the more
    # likely to end in a stall).
    rc, doc = check_settled(lab, "--rails", "0", "--limit", slow, run=TIMED, only=True)
    assert rc == 0, doc["fabric"]["summary"]
    assert len(doc["fabric"]["pairs"]) == 3
    assert records(lab)[slow]["ok"]


def test_a_host_that_does_not_answer_fails_its_pairs_the_rest_go_on(lab: Lab) -> None:
    gpu = sorted(h["address"] for h in lab.status()["hosts"] if h["kind"] == "gpu")
    gone = gpu[-1]
    node = lab.node_at(gone)
    pdctl(lab.home, "lab", "fault", node, "sshd-down")
    try:
        # No preflight: its probe finds the host silent, and its tests fail with the reason.
        rc, doc = check_settled(lab, "--rails", "0", only=True, but=gone)
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


def test_deploy_certify_refuses_a_slow_kv_path_and_deploys_nothing(lab: Lab) -> None:
    env = {"HF_TOKEN": "hf_lab_not_a_token"}
    spec = str(REPO / "examples" / "lab" / "pd.yml")
    planned = pdctl_json(lab.home, "plan", spec, "--fleet", "lab", env=env)["plan"]
    slots = {g: planned["groups"][g]["slots"] for g in ("prefill", "decode")}
    decode = next(
        d for d in slots["decode"] if any(p["host"] != d["host"] for p in slots["prefill"])
    )
    slow = decode["host"]
    node = lab.node_at(slow)
    pdctl(lab.home, "lab", "fault", node, "link-slow", "20M")
    try:
        proc = pdctl(
            lab.home,
            "--json",
            "deploy",
            spec,
            "--fleet",
            "lab",
            "--certify",
            "-y",
            *TIMED,
            env=env,
            check=False,
        )
    finally:
        pdctl(lab.home, "lab", "fault", node, "clear")
    assert proc.returncode == 5, proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert error["message"].startswith("KV path certification: ")
    report = error["details"]["certify"]
    assert report["scope"] == "kv" and report["pairs"]
    nics = {(s["host"], n) for group in slots.values() for s in group for n in s["rdma_devices"]}
    for pair in report["pairs"]:
        a, b = pair["hosts"]
        assert {a, b} <= {s["host"] for s in slots["prefill"] + slots["decode"]} and a != b
        assert (a, pair["nics"][0]) in nics and (b, pair["nics"][1]) in nics  # the slots' own
        assert pair["ok"] == (slow not in pair["hosts"]), pair
    assert any(slow in p["hosts"] for p in report["pairs"])
    gone = pdctl(lab.home, "status", "pdlab", check=False)
    assert gone.returncode == 7  # nothing was deployed
