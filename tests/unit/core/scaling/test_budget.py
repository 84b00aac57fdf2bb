"""A decision held to the GPU budget (budget.py), and the caps as the spec, the fleet and
deploy's checks set them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.core.errors import CheckFailed, InputError
from pdctl.core.plan import Plan, build
from pdctl.core.scaling.budget import Need, check_budgets, hold, need, within_cap
from pdctl.core.scaling.decide import Action, Decision, History
from pdctl.core.spec import SpecError, parse
from pdctl.operations.fleet import AddOptions
from pdctl.operations.fleet import _settings as fleet_settings
from tests.unit.core.plan.test_placement import ENV, REPO, fleet, host

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
        plan.router.replicas[0].host = router
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


def test_a_budget_is_refused_to_a_service_with_several_routers() -> None:
    """The ledger is a file on one router host: the scaler acting on another (after a
    failover) would draw from a ledger of its own."""
    plan = lab_plan(gpu_budget=20)
    second = plan.router.replicas[0].model_copy(update={"host": "cpu2"})
    plan.router.replicas.append(second)
    with pytest.raises(CheckFailed, match="several routers") as refused:
        check_budgets(plan, [])
    assert "max_gpus" in refused.value.hint


def test_fleet_add_sets_and_clears_the_budget() -> None:
    settings = fleet_settings(None, AddOptions(hosts=[], gpu_budget=24))
    assert settings.gpu_budget == 24
    assert fleet_settings(settings, AddOptions(hosts=[])).gpu_budget == 24  # unchanged
    assert fleet_settings(settings, AddOptions(hosts=[], gpu_budget=0)).gpu_budget is None
    with pytest.raises(InputError, match="--gpu-budget -1"):
        fleet_settings(None, AddOptions(hosts=[], gpu_budget=-1))
