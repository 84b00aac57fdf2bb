"""The GPU budget's ledger: who gets the last GPUs, what a dead scaler leaves, and its file's
lock (real flock, real processes)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from pdctl.errors import CheckFailed, InputError
from pdctl.fleet import AddOptions
from pdctl.fleet import _settings as fleet_settings
from pdctl.plan import Plan, build
from pdctl.scaler.budget import Need, check_budgets, hold, need, within_cap
from pdctl.scaler.decide import Action, Decision, History
from pdctl.scaler.gpu_ledger import (
    RESERVE_FOR,
    Answer,
    Ask,
    Ledger,
    draw,
    live_for,
    load,
    pressure,
    release,
)
from pdctl.scaler.ledger_file import LedgerBusy, peek, transact
from pdctl.spec import SpecError, parse
from tests.unit.test_plan import ENV, REPO, fleet, host


def ask(
    service: str,
    using: int,
    wants: dict[str, tuple[int, int, float]] | None = None,
    budget: int = 8,
    interval: float = 2.0,
) -> Ask:
    return Ask(service, budget, using, interval, wants or {})


def run(ledger: Ledger, request: Ask, now: float) -> tuple[Ledger, Answer]:
    """One draw, and the ledger back through its JSON (as every draw goes through the file)."""
    new, answer = draw(ledger, request, now)
    again, note = load(json.loads(json.dumps(new.to_dict())))
    assert note == ""
    return again, answer


def test_a_lone_service_is_granted_at_once_within_the_budget() -> None:
    ledger, answer = run(Ledger(), ask("a", 4, {"decode": (4, 4, 1.5)}), 100.0)
    assert answer.grants["decode"].gpus == 4 and answer.grants["decode"].reason == ""
    assert answer.used == 8 and answer.holders == {"a": 8}
    ledger, answer = run(ledger, ask("a", 8, {"decode": (4, 4, 1.5)}), 102.0)
    assert answer.grants["decode"].gpus == 0
    assert "4 more GPU(s) wanted, 0 granted; 8 in the budget, held: a 8" in (
        answer.grants["decode"].reason
    )


def test_two_services_budget_for_one_the_furthest_from_its_slo_gets_it() -> None:
    """a asks first but is nearer its target; b, asking a moment later, is 2x over: b gets
    the one replica the budget has room for, a is refused and told why. A contested want
    waits until every other live scaler has reported once since it was made."""
    ledger = Ledger()
    ledger, _ = run(ledger, ask("a", 2), 99.0)
    ledger, _ = run(ledger, ask("b", 2), 99.5)
    ledger, first = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.2)}), 100.0)
    assert first.grants["prefill"].gpus == 0
    assert "waiting one tick for b" in first.grants["prefill"].reason
    ledger, for_b = run(ledger, ask("b", 2, {"decode": (4, 4, 2.0)}), 100.5)
    assert for_b.grants["decode"].gpus == 0 and "waiting one tick for a" in (
        for_b.grants["decode"].reason
    )
    ledger, for_a = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.2)}), 102.0)
    assert for_a.grants["prefill"].gpus == 0
    assert "ahead of it: b/decode (2.00x its target)" in for_a.grants["prefill"].reason
    ledger, for_b = run(ledger, ask("b", 2, {"decode": (4, 4, 2.0)}), 102.5)
    assert for_b.grants["decode"].gpus == 4 and for_b.used == 8
    ledger, for_a = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.2)}), 104.0)
    assert for_a.grants["prefill"].gpus == 0
    assert "0 granted; 8 in the budget, held: a 2, b 6" in for_a.grants["prefill"].reason
    # b's scaler reports the replica it started: the grant became use, nothing more is free.
    ledger, _ = run(ledger, ask("b", 6), 104.5)
    ledger, for_a = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.2)}), 106.0)
    assert for_a.grants["prefill"].gpus == 0 and for_a.used == 8


def test_the_first_to_ask_wins_when_both_are_as_far_from_their_slo() -> None:
    ledger = Ledger()
    ledger, _ = run(ledger, ask("a", 2), 99.0)
    ledger, _ = run(ledger, ask("b", 2), 99.5)
    ledger, _ = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.5)}), 100.0)
    ledger, for_b = run(ledger, ask("b", 2, {"decode": (4, 4, 1.5)}), 100.5)
    assert for_b.grants["decode"].gpus == 0
    ledger, for_a = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.5)}), 102.0)
    assert for_a.grants["prefill"].gpus == 4
    ledger, for_b = run(ledger, ask("b", 2, {"decode": (4, 4, 1.5)}), 102.5)
    assert for_b.grants["decode"].gpus == 0 and "held: a 6, b 2" in for_b.grants["decode"].reason


def test_grants_are_whole_replicas_and_a_big_want_does_not_block_a_small_one() -> None:
    ledger, _ = run(Ledger(), ask("a", 4, budget=10), 99.0)
    ledger, _ = run(ledger, ask("b", 2, budget=10), 99.5)
    # a (further from its SLO) wants two 4-GPU replicas; 4 GPUs are free: it gets one.
    ledger, _ = run(ledger, ask("a", 4, {"decode": (8, 4, 3.0)}, budget=10), 100.0)
    ledger, _ = run(ledger, ask("b", 2, {"prefill": (2, 2, 1.1)}, budget=10), 100.5)
    ledger, for_a = run(ledger, ask("a", 4, {"decode": (8, 4, 3.0)}, budget=10), 102.0)
    assert for_a.grants["decode"].gpus == 4
    assert "8 more GPU(s) wanted, 4 granted" in for_a.grants["decode"].reason
    # an 8-GPU replica cannot fit in what is left: the 2-GPU want behind it is not held up.
    ledger, _ = run(ledger, ask("a", 8, {"decode": (8, 8, 3.0)}, budget=12), 103.0)
    ledger, for_b = run(ledger, ask("b", 2, {"prefill": (2, 2, 1.1)}, budget=12), 103.5)
    assert for_b.grants["prefill"].gpus == 2


def test_a_dead_scalers_wants_lapse_but_its_gpus_stay_counted() -> None:
    ledger, _ = run(Ledger(), ask("a", 4), 100.0)
    ledger, answer = run(ledger, ask("b", 2, {"decode": (2, 2, 5.0)}), 100.5)
    assert "waiting one tick for a" in answer.grants["decode"].reason
    # b's scaler dies with its want standing: while it is live, the want ranks first.
    ledger, for_a = run(ledger, ask("a", 4, {"prefill": (2, 2, 1.1)}), 101.0)
    assert for_a.grants["prefill"].gpus == 0 and "ahead of it: b/decode" in (
        for_a.grants["prefill"].reason
    )
    later = 100.5 + live_for(2.0) + 1
    ledger, for_a = run(ledger, ask("a", 4, {"prefill": (2, 2, 1.1)}), later)
    assert for_a.grants["prefill"].gpus == 2  # b's want lapsed with its scaler
    assert for_a.holders == {"a": 6, "b": 2}  # b's replicas still run


def test_an_unreported_grant_is_released_after_its_deadline() -> None:
    ledger, answer = run(Ledger(), ask("a", 4, {"decode": (4, 4, 2.0)}), 100.0)
    assert answer.grants["decode"].gpus == 4
    ledger, view = run(ledger, ask("b", 0), 101.0)
    assert view.holders["a"] == 8  # reserved: a is starting it
    ledger, view = run(ledger, ask("b", 0), 100.0 + RESERVE_FOR + 1)
    assert view.holders["a"] == 4  # a never reported it running: released


def test_a_lowered_budget_holds_at_once() -> None:
    ledger, _ = run(Ledger(), ask("a", 4, budget=16), 100.0)
    ledger, answer = run(ledger, ask("b", 2, {"decode": (4, 4, 2.0)}, budget=8), 100.5)
    assert answer.budget == 8
    ledger, answer = run(ledger, ask("a", 4, {"x": (4, 4, 2.0)}, budget=16), 101.0)
    assert answer.budget == 8


def test_release_forgets_a_destroyed_service() -> None:
    ledger, _ = run(Ledger(), ask("a", 4), 100.0)
    ledger, _ = run(ledger, ask("b", 4), 100.0)
    assert set(release(ledger, "a").services) == {"b"}


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"version": 2, "services": {}},
        {"version": 1},
        {"version": 1, "services": {"a": {"using": "4"}}},
        {"version": 1, "services": {"a": {"using": -1, "at": 1, "interval": 2, "budget": 8}}},
        {"version": 1, "services": {"a": {"using": 1e30, "at": 1, "interval": 2, "budget": 8}}},
    ],
)
def test_a_ledger_that_is_not_one_is_started_afresh(doc: object) -> None:
    ledger, note = load(doc)
    assert ledger.services == {} and note


def test_a_bad_want_is_dropped_and_the_entry_kept() -> None:
    raw = {"using": 2, "at": 1.0, "interval": 2.0, "budget": 8, "wants": {"x": {"gpus": True}}}
    ledger, note = load({"version": 1, "services": {"a": raw}})
    assert ledger.services["a"].using == 2 and ledger.services["a"].wants == {} and note == ""


def test_pressure_is_the_distance_from_the_target() -> None:
    assert pressure("ttft", 0.6, 0.4, 2) == pytest.approx(1.5)
    assert pressure("rps", 9.0, 2.0, 3) == pytest.approx(1.5)
    assert pressure("itl", None, 0.06, 1) == 0.0
    assert pressure("rps", 3.0, float("inf"), 1) == 0.0


# --------------------------------------------------------------------------- the file and lock


def test_transactions_read_and_write_the_file(tmp_path: Path) -> None:
    path = tmp_path / "budget" / "lab.json"
    answer, note = transact(path, lambda ledger: draw(ledger, ask("a", 4, {"d": (4, 4, 1)}), 1))
    assert answer.grants["d"].gpus == 4 and note == ""
    assert json.loads(path.read_text())["services"]["a"]["using"] == 4
    ledger, _ = peek(path)
    assert ledger.services["a"].reserved == 4
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_corrupt_file_starts_afresh_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "lab.json"
    path.write_text("{not json")
    answer, note = transact(path, lambda ledger: draw(ledger, ask("a", 2), 1))
    assert answer.holders == {"a": 2} and "not JSON" in note


def _hold_lock(path: str, ready: multiprocessing.synchronize.Event) -> None:
    def stuck(ledger: Ledger) -> tuple[Ledger, None]:
        ready.set()
        time.sleep(60)  # a scaler stopped mid-transaction
        return ledger, None

    transact(Path(path), stuck)


def test_a_held_lock_refuses_within_the_deadline_and_is_freed_when_its_holder_dies(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lab.json"
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    holder = context.Process(target=_hold_lock, args=(str(path), ready), daemon=True)
    holder.start()
    try:
        assert ready.wait(20)
        started = time.monotonic()
        with pytest.raises(LedgerBusy, match=r"held for more than 0\.5 s"):
            transact(path, lambda ledger: draw(ledger, ask("a", 2), 1), timeout=0.5)
        assert time.monotonic() - started < 5
    finally:
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
    answer, _ = transact(path, lambda ledger: draw(ledger, ask("a", 2), 1), timeout=5)
    assert answer.holders == {"a": 2}


def test_a_symlinked_ledger_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    path = tmp_path / "lab.json"
    (tmp_path / ".lab.json.tmp").symlink_to(target)
    with pytest.raises(OSError):
        transact(path, lambda ledger: draw(ledger, ask("a", 2), 1))
    assert target.read_text() == "keep"


# --------------------------------------------------------------------------- a decision held to it


def decision(current: int, desired: int, value: float = 0.8, target: float = 0.4) -> Decision:
    action: Action = "up" if desired > current else "down" if desired < current else "hold"
    return Decision(
        "prefill", current, desired, desired, action, "ttft 800 ms > target", "ttft", value, target
    )


def test_only_growth_above_the_floor_draws_from_the_budget() -> None:
    assert need(decision(2, 2), 2, 1, 3, 4) is None  # a hold
    assert need(decision(2, 1), 2, 1, 3, 4) is None  # a scale-in
    assert need(decision(0, 1), 0, 1, 3, 4) is None  # back to min: counted already
    grown = need(decision(0, 3), 0, 1, 3, 4)
    assert grown is not None and grown.replicas == 2 and grown.gpus == 8
    assert grown.pressure == pytest.approx(2.0)
    one_slot = need(decision(2, 4), 2, 1, 1, 4)
    assert one_slot is not None and (one_slot.replicas, one_slot.gpus) == (1, 4)


def test_the_services_own_cap_cuts_in_whole_replicas_the_most_pressed_first() -> None:
    needs = [Need("prefill", 2, 4, 1.2), Need("decode", 2, 2, 3.0)]
    kept, why = within_cap(needs, using=8, max_gpus=14)
    assert kept == [Need("decode", 2, 2, 3.0)]
    assert "max_gpus 14: the service uses 8 GPU(s), room for 0 more of its 2" in why["prefill"]
    assert within_cap(needs, 8, None) == (needs, {})


def test_a_refused_scale_out_is_a_hold_that_says_so_and_leaves_no_cool_down() -> None:
    before = History(last_scaled_at=10.0)
    after = History(last_scaled_at=50.0)
    held, history = hold(decision(2, 4), before, after, 2, 2, 0, "GPU budget: 0 granted")
    assert held.action == "hold" and held.desired == 2
    assert held.reason.endswith("; refused: GPU budget: 0 granted")
    assert held.refusal == "GPU budget: 0 granted"
    assert history.last_scaled_at == 10.0
    cut, history = hold(decision(2, 4), before, after, 2, 2, 1, "GPU budget: 4 of 8")
    assert cut.desired == 3 and cut.action == "up" and cut.refusal == "GPU budget: 4 of 8"
    assert "1 of 2 granted: GPU budget" in cut.reason and history.last_scaled_at == 50.0
    whole, history = hold(decision(2, 4), before, after, 2, 2, 2, "")
    assert whole.refusal is None and whole.desired == 4


# --------------------------------------------------------------------------- the spec, the plan


def lab_plan(extra: str = "", gpu_budget: int | None = None, router: str | None = None) -> Plan:
    text = (REPO / "examples/lab/pd.yml").read_text() + extra
    spec, env = parse(text, Path("pd.yml"), ENV)
    hosts = fleet(host("cpu1", "cpu"), host("cpu2", "cpu"), host("gpu1"), host("gpu2"))
    hosts.settings.gpu_budget = gpu_budget
    plan = build(spec, env, hosts, secrets_digest="")
    if router is not None:
        plan.router.host = router
    return plan


def test_the_spec_and_the_fleet_set_the_plans_mode_and_caps() -> None:
    plan = lab_plan("  scaling: {mode: advise, max_gpus: 12}\n", gpu_budget=20)
    assert (plan.scaling_mode, plan.max_gpus, plan.gpu_budget) == ("advise", 12, 20)
    default = lab_plan()
    assert (default.scaling_mode, default.max_gpus, default.gpu_budget) == ("act", None, None)
    for bad in ("{mode: sometimes}", "{max_gpus: 0}", "{max_gpus: true}", "{budget: 3}"):
        with pytest.raises(SpecError, match="scaling"):
            lab_plan(f"  scaling: {bad}\n")


def test_deploy_refuses_caps_that_cannot_hold_the_min_counts() -> None:
    with pytest.raises(CheckFailed, match="max_gpus 4 is below the 8 GPUs"):
        check_budgets(lab_plan("  scaling: {max_gpus: 4}\n"), [])
    other = lab_plan(gpu_budget=20).model_copy(update={"service": "other"})
    check_budgets(lab_plan(gpu_budget=20), [other])  # 8 + 8 of 20
    with pytest.raises(CheckFailed, match=r"GPU budget \(12\) cannot hold every service") as no:
        check_budgets(lab_plan(gpu_budget=12), [other])
    assert "pdctl needs 8, the others other 8" in str(no.value).replace("pdlab", "pdctl")


def test_budgeted_services_share_the_router_host_that_keeps_the_ledger() -> None:
    other = lab_plan(gpu_budget=20, router="cpu2").model_copy(update={"service": "other"})
    with pytest.raises(CheckFailed, match="one ledger on the router host") as elsewhere:
        check_budgets(lab_plan(gpu_budget=20), [other])
    assert elsewhere.value.hint == "put the router there too: pdctl.router.host: cpu2"
    unbudgeted = other.model_copy(update={"gpu_budget": None})
    check_budgets(lab_plan(gpu_budget=20), [unbudgeted])  # deployed before the budget


def test_fleet_add_sets_and_clears_the_budget() -> None:
    settings = fleet_settings(None, AddOptions(hosts=[], gpu_budget=24))
    assert settings.gpu_budget == 24
    assert fleet_settings(settings, AddOptions(hosts=[])).gpu_budget == 24  # unchanged
    assert fleet_settings(settings, AddOptions(hosts=[], gpu_budget=0)).gpu_budget is None
    with pytest.raises(InputError, match="--gpu-budget -1"):
        fleet_settings(None, AddOptions(hosts=[], gpu_budget=-1))
