"""The scaling policy: pure, frozen clock (``now`` is passed in), one decision per group."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdctl.core.scaling.decide import Decision, History, Observation, Policy, decide, recommend

NOW = 10_000.0


def policy(**overrides: Any) -> Policy:
    settings: dict[str, Any] = {
        "group": "decode",
        "min": 1,
        "max": 8,
        "target": 2.0,
        "scale_up_delay": 0.0,
        "scale_down_delay": 60.0,
    }
    settings.update(overrides)
    return Policy(**settings)


def seen(rps: float | None, running: int, at: float = NOW, **extra: Any) -> Observation:
    return Observation(at=at, rps=rps, running=running, **extra)


def run(
    p: Policy, rps: float | None, running: int, history: History | None = None, now: float = NOW
) -> tuple[Decision, History]:
    return decide(p, seen(rps, running, at=now), history or History(), now)


# -- recommendation -----------------------------------------------------------------------------


def test_recommend_is_ceil_of_rps_over_target_clamped() -> None:
    p = policy()
    assert recommend(p, 0.0) == 1  # rps 0 -> min
    assert recommend(p, 0.1) == 1
    assert recommend(p, 6.0) == 3  # exactly on a boundary: no extra replica
    assert recommend(p, 6.01) == 4
    assert recommend(p, 7.9) == 4
    assert recommend(p, 1e12) == 8  # huge -> max
    assert recommend(policy(target=0.1, max=20), 1.1) == 11  # float noise: 1.1/0.1 > 11


def test_rps_zero_goes_to_min() -> None:
    p = policy(stabilization=0.0, scale_down_delay=0.0, max_step_down=8)
    decision, _ = run(p, 0.0, 5)
    assert (decision.recommendation, decision.desired, decision.action) == (1, 1, "down")
    assert decision.reason == "rps 0.0 < 2.0 x 5 (-10%): down to 1"


# -- tolerance band -----------------------------------------------------------------------------


def test_within_tolerance_above_target_holds() -> None:
    # 2 replicas x 2 rps = 4; 4.3 is 7.5% over: recommendation 3, but no action
    decision, history = run(policy(), 4.3, 2)
    assert (decision.recommendation, decision.desired, decision.action) == (3, 2, "hold")
    assert decision.reason == "within tolerance: rps 4.3 vs 2.0 x 2 (+-10%)"
    assert history.recommendations == [(NOW, 2)]  # the band's answer is what is remembered
    assert history.last_scaled_at is None


def test_outside_tolerance_above_target_scales_up() -> None:
    decision, history = run(policy(), 4.5, 2)  # 12.5% over
    assert (decision.recommendation, decision.desired, decision.action) == (3, 3, "up")
    assert decision.reason == "rps 4.5 > 2.0 x 2 (+10%): up to 3"
    assert history.last_scaled_at == NOW


def test_within_tolerance_below_target_holds_and_outside_scales_down() -> None:
    p = policy(min=1, max=30, target=1.0, stabilization=0.0, scale_down_delay=0.0)
    inside, _ = run(p, 18.5, 20)  # 7.5% under: recommendation 19, no action
    assert (inside.recommendation, inside.desired, inside.action) == (19, 20, "hold")
    assert inside.reason.startswith("within tolerance")
    outside, _ = run(p, 17.5, 20)  # 12.5% under
    assert (outside.recommendation, outside.desired, outside.action) == (18, 19, "down")
    assert outside.reason == "rps 17.5 < 1.0 x 20 (-10%): down to 19 (step limit 1)"


def test_at_recommendation_is_steady() -> None:
    decision, history = run(policy(), 5.0, 3)
    assert (decision.recommendation, decision.desired, decision.action) == (3, 3, "hold")
    assert decision.reason == "steady: rps 5.0 needs 3"
    assert history.last_scaled_at is None


# -- delays, per group --------------------------------------------------------------------------


def test_cooldowns_are_per_group() -> None:
    prefill = policy(group="prefill", target=3.0, scale_up_delay=30.0)
    decode = policy(group="decode", target=2.0, scale_up_delay=30.0)
    histories = {"prefill": History(), "decode": History(last_scaled_at=NOW - 300.0)}

    up, histories["prefill"] = run(prefill, 9.0, 1, histories["prefill"], now=NOW)
    assert (up.action, up.desired) == ("up", 3)
    assert histories["prefill"].last_scaled_at == NOW

    # one second later decode needs more: prefill's scaling does not delay it
    decision, histories["decode"] = run(decode, 9.0, 2, histories["decode"], now=NOW + 1)
    assert (decision.action, decision.desired) == ("up", 4)
    assert histories["decode"].last_scaled_at == NOW + 1
    # ... while prefill itself is cooling down
    again, _ = run(prefill, 20.0, 3, histories["prefill"], now=NOW + 1)
    assert (again.action, again.desired) == ("hold", 3)
    assert again.reason == "cooling down: last scaling 1 s ago < scale_up_delay 30 s"


def test_scale_up_delay() -> None:
    p = policy(scale_up_delay=10.0)
    history = History(last_scaled_at=NOW - 4.0)
    held, after = run(p, 7.9, 2, history)
    assert (held.recommendation, held.desired, held.action) == (4, 2, "hold")
    assert held.reason == "cooling down: last scaling 4 s ago < scale_up_delay 10 s"
    assert after.last_scaled_at == NOW - 4.0  # a hold does not restart the timer
    done, later = run(p, 7.9, 2, after, now=NOW + 6.0)  # 10 s after the last scaling
    assert (done.desired, done.action) == (4, "up")
    assert done.reason == "rps 7.9 > 2.0 x 2 (+10%): up to 4"
    assert later.last_scaled_at == NOW + 6.0


def test_scale_down_delay() -> None:
    p = policy(scale_down_delay=60.0, stabilization=0.0)
    history = History(last_scaled_at=NOW - 30.0)
    held, after = run(p, 1.0, 3, history)
    assert (held.recommendation, held.desired, held.action) == (1, 3, "hold")
    assert held.reason == "cooling down: last scaling 30 s ago < scale_down_delay 60 s"
    done, later = run(p, 1.0, 3, after, now=NOW + 30.0)
    assert (done.desired, done.action) == (2, "down")
    assert later.last_scaled_at == NOW + 30.0


def test_scale_up_right_after_a_scale_down_is_not_held_by_the_down_delay() -> None:
    p = policy(scale_up_delay=5.0, scale_down_delay=600.0)
    decision, _ = run(p, 9.0, 2, History(last_scaled_at=NOW - 6.0))
    assert (decision.action, decision.desired) == ("up", 4)


# -- step limits --------------------------------------------------------------------------------


def test_step_limit_up() -> None:
    decision, _ = run(policy(), 15.0, 2)
    assert (decision.recommendation, decision.desired) == (8, 4)
    assert decision.reason == "rps 15.0 > 2.0 x 2 (+10%): up to 4 (step limit 2)"
    wider, _ = run(policy(max_step_up=5), 15.0, 2)
    assert wider.desired == 7


def test_step_limit_down() -> None:
    p = policy(stabilization=0.0, scale_down_delay=0.0)
    decision, _ = run(p, 0.5, 6)
    assert (decision.recommendation, decision.desired, decision.action) == (1, 5, "down")
    wider, _ = run(policy(stabilization=0.0, scale_down_delay=0.0, max_step_down=3), 0.5, 6)
    assert wider.desired == 3


# -- stabilization ------------------------------------------------------------------------------


def test_a_dip_inside_the_window_does_not_scale_down_after_the_window_it_does() -> None:
    p = policy(stabilization=120.0, scale_down_delay=0.0)
    history = History()
    for t in range(0, 101, 10):  # 6 rps on 3 replicas: steady, recommendation 3
        decision, history = run(p, 6.0, 3, history, now=NOW + t)
        assert decision.action == "hold"
    first_down = None
    for t in range(110, 400, 10):  # the load drops to 1 rps
        decision, history = run(p, 1.0, 3, history, now=NOW + t)
        if decision.action == "down":
            first_down = t
            break
        assert decision.reason == "scale-down stabilising: highest recommendation in 120 s is 3"
        assert decision.desired == 3
    assert first_down == 230  # the last 3 (t=100) left the window [t-120, t]
    assert decision.desired == 2
    assert [n for _, n in history.recommendations] == [1] * 13  # t = 110 .. 230


def test_stabilization_defaults_to_scale_down_delay_and_history_is_pruned() -> None:
    p = policy(scale_down_delay=60.0)
    assert p.window == 60.0
    old = History(recommendations=[(NOW - 61.0, 5), (NOW - 60.0, 4), (NOW - 10.0, 3)])
    decision, history = run(p, 1.0, 4, old)
    assert decision.reason == "scale-down stabilising: highest recommendation in 60 s is 4"
    assert history.recommendations == [(NOW - 60.0, 4), (NOW - 10.0, 3), (NOW, 1)]


def test_scale_down_stops_at_the_highest_recent_recommendation() -> None:
    p = policy(stabilization=60.0, scale_down_delay=0.0, max_step_down=4)
    decision, _ = run(p, 0.0, 6, History(recommendations=[(NOW - 30.0, 4)]))
    assert (decision.desired, decision.action) == (4, "down")
    assert decision.reason == "rps 0.0 < 2.0 x 6 (-10%): down to 4 (highest in 60 s)"


def test_counter_reset_drop_to_zero_then_recovery_does_not_flap() -> None:
    # SMG restarted: the rate reads 0 for a while, then recovers. Stabilization holds.
    p = policy()  # window = scale_down_delay = 60 s
    history = History()
    actions = []
    trace = [6.0] * 30 + [0.0] * 6 + [6.0] * 30  # 5 s ticks: 150 s steady, 30 s at 0, back
    for i, rps in enumerate(trace):
        decision, history = run(p, rps, 3, history, now=NOW + 5 * i)
        actions.append((decision.action, decision.desired))
    assert actions == [("hold", 3)] * len(trace)
    assert history.last_scaled_at is None


# -- bounds -------------------------------------------------------------------------------------


def test_bounds() -> None:
    p = policy(min=2, max=8)
    below, after = run(p, 0.0, 1)
    assert (below.desired, below.action, below.reason) == (2, "up", "below min 2: up")
    assert after.last_scaled_at == NOW
    above, _ = run(p, 20.0, 10, History(last_scaled_at=NOW - 1.0))  # ignores delays
    assert (above.desired, above.action, above.reason) == (8, "down", "above max 8: down")
    at_min, _ = run(p, 0.0, 2)
    assert (at_min.recommendation, at_min.desired, at_min.action) == (2, 2, "hold")
    huge, _ = run(p, 1e9, 7)
    assert (huge.recommendation, huge.desired, huge.action) == (8, 8, "up")
    at_max, _ = run(p, 1e9, 8)
    assert (at_max.desired, at_max.action) == (8, "hold")


def test_target_inf_for_a_fixed_group_stays_put() -> None:
    decision, _ = run(policy(min=2, max=2, target=float("inf")), 50.0, 2)
    assert (decision.recommendation, decision.desired, decision.action) == (2, 2, "hold")


# -- missing and stale data ---------------------------------------------------------------------


def test_missing_metrics_hold_and_never_scale_down() -> None:
    p = policy(stabilization=0.0, scale_down_delay=0.0)
    history = History(recommendations=[(NOW - 1.0, 1)])
    for t in range(0, 600, 15):
        decision, history = run(p, None, 5, history, now=NOW + t)
        assert (decision.desired, decision.action, decision.recommendation) == (5, "hold", None)
        assert decision.reason == "metrics missing: hold"
    assert history.last_scaled_at is None


@pytest.mark.parametrize("bad", [-3.0, float("nan"), float("inf")])
def test_invalid_rps_is_missing(bad: float) -> None:
    decision, _ = run(policy(stabilization=0.0, scale_down_delay=0.0), bad, 5)
    assert (decision.desired, decision.reason) == (5, "metrics missing: hold")


def test_stale_metrics_hold() -> None:
    p = policy(stabilization=0.0, scale_down_delay=0.0)
    decision, history = decide(p, seen(0.0, 5, at=NOW - 61.0), History(), NOW)
    assert (decision.desired, decision.action) == (5, "hold")
    assert decision.reason == "metrics stale (61 s old > 60 s): hold"
    assert history.recommendations == []  # stale data is not remembered
    fresh, _ = decide(p, seen(0.0, 5, at=NOW - 59.0), History(), NOW)
    assert (fresh.desired, fresh.action) == (4, "down")


def test_missing_or_stale_metrics_still_floor_to_min() -> None:
    p = policy(min=2)
    missing, _ = run(p, None, 0)
    assert (missing.desired, missing.action, missing.reason) == (2, "up", "below min 2: up")
    stale, _ = decide(p, seen(30.0, 1, at=NOW - 3600.0), History(), NOW)
    assert (stale.desired, stale.action) == (2, "up")


# -- pinned -------------------------------------------------------------------------------------


def test_pinned_is_immediate_and_clamped() -> None:
    recent = History(last_scaled_at=NOW - 1.0, recommendations=[(NOW - 1.0, 8)])
    slow = {"scale_up_delay": 600.0, "scale_down_delay": 600.0}
    down, after = run(policy(pinned=2, **slow), 15.0, 5, recent)
    assert (down.desired, down.action, down.reason) == (2, "down", "pinned to 2")
    assert after.last_scaled_at == NOW
    high, _ = run(policy(pinned=20, **slow), 0.0, 5, recent)
    assert (high.desired, high.action) == (8, "up")
    assert high.reason == "pinned to 8 (asked 20, bounds 1..8)"
    low, _ = run(policy(pinned=0, **slow), None, 5, recent)
    assert (low.desired, low.action) == (1, "down")
    same, after = run(policy(pinned=5), 15.0, 5, recent)
    assert (same.desired, same.action, same.reason) == (5, "hold", "pinned to 5")
    assert after.last_scaled_at == NOW - 1.0


# -- the optional in-flight signal --------------------------------------------------------------


def test_inflight_signal_desired_is_the_max_over_signals() -> None:
    p = policy(inflight_target=4.0)
    # rps says 2 replicas (4.0 rps); 2 replicas with 12 in flight each = 24 -> 6 replicas
    decision, _ = decide(p, seen(4.0, 2, inflight_per_replica=12.0), History(), NOW)
    assert (decision.recommendation, decision.desired, decision.action) == (6, 4, "up")
    assert decision.reason == "inflight 24.0 > 4.0 x 2 (+10%): up to 4 (step limit 2)"


def test_inflight_missing_blocks_scale_down_but_not_up() -> None:
    p = policy(inflight_target=4.0, stabilization=0.0, scale_down_delay=0.0)
    down, _ = decide(p, seen(1.0, 4), History(), NOW)
    assert (down.desired, down.action) == (4, "hold")
    assert down.reason == "some metrics missing: no scale-down, hold"
    up, _ = decide(p, seen(12.0, 4), History(), NOW)
    assert (up.desired, up.action) == (6, "up")


# -- purity and records -------------------------------------------------------------------------


def test_decide_does_not_mutate_its_inputs() -> None:
    p = policy(stabilization=120.0)
    observation = seen(15.0, 2)
    history = History(last_scaled_at=NOW - 500.0, recommendations=[(NOW - 200.0, 7), (NOW - 5, 2)])
    before = (copy.deepcopy(p), copy.deepcopy(observation), copy.deepcopy(history))
    decision, new = decide(p, observation, history, NOW)
    assert (p, observation, history) == before
    assert new is not history
    assert new.recommendations is not history.recommendations
    assert new == History(last_scaled_at=NOW, recommendations=[(NOW - 5, 2), (NOW, 8)], serving=2)
    assert decision.desired == 4


def test_to_dict_and_history_round_trip() -> None:
    decision, history = run(policy(), 7.9, 2)
    assert decision.to_dict() == {
        "group": "decode",
        "current": 2,
        "desired": 4,
        "recommendation": 4,
        "action": "up",
        "reason": "rps 7.9 > 2.0 x 2 (+10%): up to 4",
        "signal": "rps",
        "value": 7.9,
        "target": 2.0,
        "refusal": None,
        "source": None,
    }
    assert History.from_dict(history.to_dict()) == history
    assert History.from_dict({}) == History()


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="min <= max"):
        policy(min=3, max=2)
    with pytest.raises(ValueError, match="target"):
        policy(target=0.0)
    with pytest.raises(ValueError, match="step"):
        policy(max_step_up=0)


# -- latency metrics: an asymmetric band ----------------------------------------------------------


def ttft(**overrides: Any) -> Policy:
    settings: dict[str, Any] = {"group": "prefill", "metric": "ttft", "target": 0.5}
    settings.update(overrides)
    return policy(**settings)


def lat(
    p: Policy,
    value: float | None,
    running: int,
    history: History | None = None,
    now: float = NOW,
    queue: float | None = None,
) -> tuple[Decision, History]:
    observation = seen(None, running, at=now, latency=value, queue_per_replica=queue)
    return decide(p, observation, history or History(), now)


def test_latency_over_target_by_the_margin_scales_out_proportionally() -> None:
    decision, _ = lat(ttft(max_step_up=8), 0.7, 4)  # ceil(4 * 0.7 / 0.5) = 6
    assert (decision.recommendation, decision.desired, decision.action) == (6, 6, "up")
    assert decision.reason == "ttft 700 ms > target 500 ms (+10%): up to 6"
    assert (decision.signal, decision.value, decision.target) == ("ttft", 0.7, 0.5)
    # at most double the serving replicas (a latency with a backlog is not proportional)
    decision, _ = lat(ttft(max_step_up=8), 1.2, 2)  # ceil(2 * 1.2 / 0.5) = 5 -> 4
    assert (decision.recommendation, decision.desired) == (5, 4)
    decision, _ = lat(ttft(), 1.2, 3)  # 6 wanted, step limit 2
    assert decision.reason == "ttft 1200 ms > target 500 ms (+10%): up to 5 (step limit 2)"


def test_a_latency_scale_out_is_sized_on_serving_replicas_and_not_repeated() -> None:
    p = ttft(max_step_up=8)
    observation = seen(None, 3, latency=1.0, serving=1)  # two started, still loading
    decision, history = decide(p, observation, History(), NOW)
    assert decision.action == "hold"
    assert decision.reason == "ttft 1000 ms vs target 500 ms: 2 starting replica(s) will serve it"
    # they serve: the latency takes a while to show them (settle), then it may go on
    observation = seen(None, 3, at=NOW + 10, latency=1.0, serving=3)
    decision, history = decide(p, observation, history, NOW + 10)
    assert decision.action == "hold"
    assert decision.reason == (
        "ttft 1000 ms vs target 500 ms: 3 serving for 0 s < settle 30 s: "
        "letting the latency show them"
    )
    observation = seen(None, 3, at=NOW + 45, latency=1.0, serving=3)
    decision, history = decide(p, observation, history, NOW + 45)
    assert (decision.action, decision.desired) == ("up", 6)
    assert History.from_dict(history.to_dict()) == history


def test_a_small_excess_still_adds_one() -> None:
    decision, _ = lat(ttft(), 0.56, 2)  # ceil(2.24) = 3 anyway; 0.56 > 0.55
    assert decision.desired == 3
    decision, _ = lat(ttft(), 0.56, 1)  # ceil(1.12) = 2
    assert decision.desired == 2


def test_latency_inside_the_asymmetric_band_holds() -> None:
    for value in (0.26, 0.4, 0.5, 0.55):  # between 50% and 110% of the target
        decision, _ = lat(ttft(), value, 3)
        assert decision.action == "hold", (value, decision.reason)
    decision, _ = lat(ttft(), 0.3, 3)
    assert decision.reason == (
        "within band: ttft 300 ms vs target 500 ms (out above 550 ms, in below 250 ms)"
    )


def test_latency_far_below_target_scales_in_to_a_count_that_stays_under_it() -> None:
    p = ttft(scale_down_delay=0.0, stabilization=0.0, max_step_down=8)
    decision, _ = lat(p, 0.1, 4)  # 4 x 100 ms / 450 ms -> 1 replica, estimated 400 ms
    assert (decision.desired, decision.action) == (1, "down")
    assert decision.reason == "ttft 100 ms < target 500 ms (50%): down to 1"
    decision, _ = lat(p, 0.2, 4)  # 4 x 200 / 450 = 1.8 -> 2, estimated 400 ms
    assert decision.desired == 2
    decision, _ = lat(p, 0.24, 2)  # 2 x 240 / 450 = 1.07 -> 2: one would be at 480 ms
    assert decision.action == "hold"
    assert (
        decision.reason == "ttft 240 ms vs target 500 ms: 2 is the fewest that stays under target"
    )


def test_no_latency_scale_in_while_requests_queue() -> None:
    p = ttft(scale_down_delay=0.0, stabilization=0.0)
    decision, _ = lat(p, 0.1, 2, queue=0.6)  # 1.2 queued per replica once down to 1
    assert decision.action == "hold"
    assert decision.reason == "ttft 100 ms vs target 500 ms: 0.6 queued per replica: no scale-in"
    decision, _ = lat(p, 0.1, 2, queue=0.2)
    assert decision.action == "down"


def test_latency_guards_still_apply() -> None:
    # scale-in: cooldown since the last scaling and the stabilization window
    p = ttft(scale_down_delay=60.0)
    decision, _ = lat(p, 0.05, 3, History(last_scaled_at=NOW - 10))
    assert decision.action == "hold" and decision.reason.startswith("cooling down")
    history = History(recommendations=[(NOW - 30, 3)])
    decision, _ = lat(ttft(scale_down_delay=0.0, stabilization=120.0), 0.05, 3, history)
    assert decision.action == "hold" and "stabilising" in decision.reason
    # scale-out: its own cooldown
    decision, _ = lat(ttft(scale_up_delay=30.0), 2.0, 1, History(last_scaled_at=NOW - 10))
    assert decision.action == "hold" and decision.reason.startswith("cooling down")


def test_missing_or_stale_latency_holds() -> None:
    decision, _ = lat(ttft(scale_down_delay=0.0), None, 3)
    assert (decision.action, decision.reason) == ("hold", "metrics missing: hold")
    observation = seen(None, 3, at=NOW - 120, latency=0.01)
    decision, _ = decide(ttft(scale_down_delay=0.0), observation, History(), NOW)
    assert decision.action == "hold" and decision.reason.startswith("metrics stale")
    decision, _ = lat(ttft(), float("nan"), 1)
    assert decision.action == "hold"


def test_idle_latency_goes_back_to_min() -> None:
    p = ttft(scale_down_delay=0.0, stabilization=0.0, max_step_down=8)
    decision, _ = lat(p, 0.0, 3)  # no request in the window
    assert (decision.desired, decision.action) == (1, "down")


def test_itl_on_decode_and_its_own_history() -> None:
    itl = policy(metric="itl", target=0.06)
    decision, history = lat(itl, 0.09, 1)
    assert (decision.desired, decision.signal) == (2, "itl")
    assert history.last_scaled_at == NOW
    assert decision.reason == "itl 90 ms > target 60 ms (+10%): up to 2"


def test_a_high_latency_with_no_request_arriving_scales_nothing() -> None:
    """The streams of a backlog end, and measure their latency, after the load stopped: with
    no request arriving in the window, there is nothing for more replicas to serve."""
    itl = policy(metric="itl", target=0.06)
    ended = seen(0.0, 2, latency=0.095)
    decision, _ = decide(itl, ended, History(), NOW)
    assert (decision.action, decision.desired, decision.recommendation) == ("hold", 2, 2)
    assert decision.reason == (
        "itl 95 ms vs target 60 ms: no request arrived in the window: the latency is the backlog's"
    )
    arriving = seen(0.2, 2, latency=0.095)  # one request in the window: it may need them
    assert decide(itl, arriving, History(), NOW)[0].desired == 4


def test_the_decision_names_its_signal_for_status() -> None:
    decision, _ = lat(ttft(), 0.62, 1)
    assert decision.signal_text() == "ttft 620 ms, target 500 ms"
    decision, _ = run(policy(), 7.9, 2)
    assert decision.signal_text() == "rps 7.90, target 2.00 per replica"
    decision, _ = run(policy(target=float("inf")), None, 1)
    assert decision.signal_text() == "rps none"


# -- latency metrics: the queue's trend sizes a scale-out ---------------------------------------


def queued(
    p: Policy,
    samples: list[tuple[float, float]],
    running: int,
    serving: int,
    rps: float = 6.0,
    latency: float = 2.0,
) -> tuple[Decision, History]:
    """Feed ``(seconds from NOW, queued per serving replica)`` ticks; the last decision."""
    history = History()
    decision: Decision | None = None
    for offset, per in samples:
        at = NOW + offset
        observation = seen(
            rps, running, at=at, latency=latency, queue_per_replica=per, serving=serving
        )
        decision, history = decide(p, observation, history, at)
    assert decision is not None
    return decision, history


def test_a_growing_queue_sizes_the_scale_out_in_one_step() -> None:
    # one serving replica, 6 rps in, the queue grows 4.5 requests/s: it completes 1.5/s, so
    # 6 / 1.5 = 4 replicas carry the load, 5 at the 80% headroom; past the step limit (2)
    # and although one started replica still loads
    ticks = [(float(t), 4.5 * t) for t in range(0, 12, 2)]
    decision, history = queued(ttft(), ticks, running=2, serving=1)
    assert (decision.action, decision.desired) == ("up", 5)
    assert decision.reason == (
        "ttft 2000 ms > target 500 ms (+10%): up to 5 "
        "(queue +4.5/s: sized from the serving replicas' throughput)"
    )
    assert History.from_dict(history.to_dict()) == history
    # under 10 s of trend: no measurement yet, the proportional rule (loading: hold)
    decision, _ = queued(ttft(), ticks[:3], running=2, serving=1)
    assert decision.reason == "ttft 2000 ms vs target 500 ms: 1 starting replica(s) will serve it"
    # a queue that wobbles within the noise (5% of rps) is no trend either
    flat = [(float(t), 3.0 + (0.2 if t % 4 else 0.0)) for t in range(0, 12, 2)]
    decision, _ = queued(ttft(), flat, running=2, serving=1)
    assert decision.reason == "ttft 2000 ms vs target 500 ms: 1 starting replica(s) will serve it"


def test_a_draining_queue_holds_a_latency_above_target() -> None:
    # four serve 6 rps and the backlog shrinks 2/s: they complete 8/s, 4 x 6/8 / 0.8 = 3.75
    ticks = [(float(t), 40.0 - 2.0 * t / 4) for t in range(0, 12, 2)]
    decision, _ = queued(ttft(), ticks, running=4, serving=4)
    assert decision.action == "hold"
    assert decision.reason == (
        "ttft 2000 ms vs target 500 ms: queue -2.0/s: the backlog drains, 4 carry the load"
    )
    # draining too slowly for the headroom: sized out (4 x 6 / 6.4 / 0.8 = 4.7 -> 5)
    slow = [(float(t), 40.0 - 0.4 * t / 4) for t in range(0, 12, 2)]
    decision, _ = queued(ttft(), slow, running=4, serving=4)
    assert (decision.action, decision.desired) == ("up", 5)


def test_the_queue_trend_restarts_when_the_serving_count_changes() -> None:
    ticks = [(float(t), 4.5 * t) for t in range(0, 12, 2)]
    _, history = queued(ttft(), ticks, running=2, serving=1)
    assert len(history.queue) == 6
    observation = seen(6.0, 2, at=NOW + 12, latency=2.0, queue_per_replica=25.0, serving=2)
    _, history = decide(ttft(), observation, history, NOW + 12)
    assert history.queue == [(NOW + 12, 50.0)]  # per serving replica x serving
    # samples older than the span (30 s) drop out
    observation = seen(6.0, 2, at=NOW + 50, latency=2.0, queue_per_replica=1.0, serving=2)
    _, history = decide(ttft(), observation, history, NOW + 50)
    assert history.queue == [(NOW + 50, 2.0)]


def test_a_latency_scale_in_goes_to_its_estimate_in_one_step() -> None:
    # the estimate bounds a latency scale-in: no step limit unless one is set
    p = ttft(scale_down_delay=0.0, stabilization=0.0)
    decision, _ = lat(p, 0.05, 6)  # 6 x 50 ms / 450 ms -> 1
    assert (decision.desired, decision.action) == (1, "down")
    decision, _ = lat(ttft(scale_down_delay=0.0, stabilization=0.0, max_step_down=2), 0.05, 6)
    assert decision.desired == 4
    assert decision.reason == "ttft 50 ms < target 500 ms (50%): down to 4 (step limit 2)"
    # rps keeps its one-at-a-time default
    decision, _ = run(policy(scale_down_delay=0.0, stabilization=0.0), 1.0, 6)
    assert decision.desired == 5
    with pytest.raises(ValueError, match="headroom"):
        ttft(headroom=1.5)
