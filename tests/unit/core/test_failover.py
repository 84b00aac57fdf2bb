"""N+1 in the plan (pdctl/core/failover.py), the spec's failover settings, and the scaler's
verdicts on hosts and replicas that stop answering (pdctl/core/scaling/watch.py, a frozen clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.core.errors import CheckFailed
from pdctl.core.failover import FailoverPlan, host_loss, plan_host_loss
from pdctl.core.plan import build
from pdctl.core.scaling.watch import Watch
from pdctl.core.spec import SpecError, parse
from tests.unit.core.plan.test_placement import ENV, REPO, fleet, host

THREE_GPU_HOSTS = (host("cpu1", "cpu"), host("gpu1"), host("gpu2"), host("gpu3"))
TWO_GPU_HOSTS = (host("cpu1", "cpu"), host("gpu1"), host("gpu2"))


def lab_spec(extra: str = "") -> str:
    text = (REPO / "examples/lab/pd.yml").read_text().rstrip() + "\n"
    return text + extra


def planned(text: str, hosts: tuple = THREE_GPU_HOSTS):  # type: ignore[no-untyped-def]
    spec, env = parse(text, Path("pd.yml"), ENV)
    return build(spec, env, fleet(*hosts), secrets_digest="")


def test_losing_the_host_with_most_slots_is_what_counts() -> None:
    loss = host_loss("decode", ["a", "a", "b"], need=2, hosts=["c"])
    assert (loss.worst_host, loss.slots, loss.left, loss.survives) == ("a", 3, 1, False)
    assert host_loss("decode", ["a", "b"], need=1).survives
    assert host_loss("decode", [], need=1).worst_host is None


def test_three_gpu_hosts_keep_a_spare_of_each_group_elsewhere() -> None:
    plan = planned(lab_spec("  placement:\n    survive_host_loss: true\n"))
    losses = plan_host_loss(plan)
    assert all(loss.survives for loss in losses.values()), losses
    assert plan.failover.survive_host_loss
    # one host more away: nothing is left to lose for a group whose other slot was there
    after = plan_host_loss(plan, lost=[plan.groups["decode"].slots[0].host])
    assert after["decode"].slots == 1 and not after["decode"].survives


def test_survive_host_loss_refuses_a_plan_whose_spares_share_a_host() -> None:
    text = lab_spec("  placement:\n    survive_host_loss: true\n")
    with pytest.raises(CheckFailed) as refused:
        planned(text, TWO_GPU_HOSTS)
    message = refused.value.message
    assert "survive_host_loss" in message and "does NOT survive" in message
    assert "prefill" in message and "raise the group's max count" in (refused.value.hint or "")
    assert not plan_host_loss(planned(lab_spec(), TWO_GPU_HOSTS))["prefill"].survives


def test_the_spec_sets_the_scalers_failover_timings() -> None:
    text = lab_spec(
        "  scaler:\n    interval: 500ms\n    host_lost_after: 4s\n    unhealthy_after: 3s\n"
        "    probe_timeout: 1s\n    kill_after: 0s\n"
    )
    assert planned(text).failover == FailoverPlan(
        interval=0.5, host_lost_after=4, unhealthy_after=3, probe_timeout=1, kill_after=0
    )
    assert planned(lab_spec()).failover == FailoverPlan()
    for bad in ("interval: 0s", "host_lost_after: 0.5s", "probe_timeout: 2m", "stray: 1s"):
        with pytest.raises(SpecError):
            planned(lab_spec(f"  scaler:\n    {bad}\n"))


def test_a_host_is_lost_only_when_its_engines_are_silent_too_and_another_host_answers() -> None:
    watch = Watch(host_lost_after=5, unhealthy_after=3, restart_grace=60)
    assert not watch.host_silent("h", 0, engines_answer=False, others=True)
    assert not watch.host_silent("h", 4, engines_answer=False, others=True)  # grace
    assert not watch.host_silent("h", 6, engines_answer=True, others=True)  # only sshd is down
    assert not watch.host_silent("h", 6, engines_answer=False, others=False)  # our network?
    assert watch.host_silent("h", 6, engines_answer=False, others=True)
    watch.lose_host("h", ["decode/1", "prefill/2"])
    assert watch.off_limits("decode/1") and watch.off_limits("prefill/2")
    assert not watch.host_silent("h", 9, engines_answer=False, others=True)  # lost once
    assert watch.host_answered("h") and not watch.host_answered("h")  # back: fence once
    assert watch.off_limits("decode/1")  # until stopped and disabled there
    watch.unfence("decode/1")
    assert not watch.off_limits("decode/1")
    again = Watch(5, 3, 60)
    again.restore(watch.to_dict())
    assert again.fenced == {"prefill/2"}


def test_a_replica_is_condemned_after_failing_once_it_has_served() -> None:
    watch = Watch(host_lost_after=5, unhealthy_after=3, restart_grace=60)
    assert watch.replica("d/1", 0, answers=False, router_unhealthy=False) is None  # starting
    assert watch.replica("d/1", 1, answers=True, router_unhealthy=False) is None
    assert watch.replica("d/1", 2, answers=False, router_unhealthy=False) is None
    assert watch.replica("d/1", 3, answers=None, router_unhealthy=False) is None  # unchecked
    assert watch.replica("d/1", 5, answers=False, router_unhealthy=False) == 3
    assert watch.replica("d/2", 0, answers=True, router_unhealthy=False) is None
    assert watch.replica("d/2", 1, answers=True, router_unhealthy=True) is None
    assert watch.replica("d/2", 4.5, answers=True, router_unhealthy=True) == 3.5
    watch.condemn("d/1", 5)
    assert watch.off_limits("d/1") and "d/1" not in watch.failing_since
    watch.forget("d/1")
    assert not watch.off_limits("d/1") and "d/1" not in watch.served


def test_an_engine_restarted_in_place_has_the_grace_from_its_first_restart() -> None:
    watch = Watch(host_lost_after=5, unhealthy_after=3, restart_grace=60)
    assert not watch.unit_read("d/1", 0, 0)  # the first read: nothing to compare
    assert watch.replica("d/1", 0, answers=True, router_unhealthy=False) is None
    assert watch.replica("d/1", 1, answers=False, router_unhealthy=False) is None
    assert not watch.unit_read("d/1", None, 2)  # a host whose unitctl gives no count
    assert watch.unit_read("d/1", 1, 2)  # systemd restarted it
    assert watch.replica("d/1", 10, answers=False, router_unhealthy=False) is None  # loading
    assert watch.unit_read("d/1", 2, 20)  # it crashed again: the grace still runs from 2 s
    assert watch.replica("d/1", 61, answers=True, router_unhealthy=True) is None
    assert watch.replica("d/1", 62, answers=True, router_unhealthy=True) == 60
    watch.condemn("d/1", 62)
    assert "d/1" not in watch.restarted_since
    # one that answers again (router included) is an ordinary replica once more
    assert watch.replica("d/2", 0, answers=True, router_unhealthy=False) is None
    assert watch.unit_read("d/2", 4, 0) is False and watch.unit_read("d/2", 5, 1)
    assert watch.replica("d/2", 8, answers=True, router_unhealthy=False) is None
    assert watch.replica("d/2", 9, answers=False, router_unhealthy=False) is None
    assert watch.replica("d/2", 12, answers=False, router_unhealthy=False) == 3
    # a slot that never served: the start timeout judges it, a restart changes nothing
    assert watch.unit_read("d/3", 0, 0) is False and watch.unit_read("d/3", 1, 1) is False


def test_a_lost_replica_counts_until_its_replacement_does() -> None:
    watch = Watch(5, 3, 60)
    watch.hold_floor("decode", 2)
    assert watch.members("decode", 1) == 2  # like a replica still loading: no second start
    watch.settle("decode", 1)  # the policy went down to 1 meanwhile
    assert watch.members("decode", 1) == 1 and "decode" not in watch.floor
    watch.hold_floor("prefill", 1)
    assert watch.members("prefill", 0) == 1
    assert watch.members("prefill", 1) == 1 and "prefill" not in watch.floor
