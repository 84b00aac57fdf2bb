"""An advising scaler beside the acting one, on the same load, against real processes (real SSH
servers for the worker hosts, real worker processes, an HTTP server speaking SMG's worker API
and request counter: tests/unit/scaler/world.py).

Each round both observe the same fleet at the same moment (the advising one first, the acting
one right after, no action of the acting one in flight between): the advice must be the acting
scaler's decision, group by group, tick by tick, through a scale-out and a scale-in, while the
advising scaler starts, stops and registers nothing and writes no state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl.core import layout
from pdctl.core.scaling.decide import Decision
from pdctl.scaler.advise import advise
from pdctl.scaler.loop import Scaler
from pdctl.scaler.store import Store
from tests.unit.scaler.world import Keys, World, make_keys, make_world


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def world(tmp_path: Path, keys: Keys) -> Iterator[World]:
    yield from make_world(tmp_path, keys)


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def settle(scaler: Scaler, seconds: float = 20.0) -> None:
    """Until no action of ``scaler`` is in flight (its results are taken at its next tick)."""
    deadline = time.monotonic() + seconds
    while scaler.actions.running():
        assert time.monotonic() < deadline, "an action of the acting scaler never ended"
        time.sleep(0.05)


def test_the_advice_is_the_acting_scalers_decision_on_the_same_load(world: World) -> None:
    world.scaler.close()  # the world's own scaler: replaced by two on one clock
    clock = Clock()
    actuator, router = world.scaler.actuator, world.scaler.router
    acting_log: list[str] = []
    advice_log: list[str] = []
    acting = Scaler(
        world.plan,
        actuator,
        router,
        Store(world.files.get, world.files.__setitem__),
        clock=clock,
        log=acting_log.append,
    )
    # As `pdctl scaler advise` gives it (pdctl/scaler/setup.py): the acting scaler's record to
    # read (its histories), nothing written.
    advising = Scaler(
        world.plan,
        actuator,
        router,
        Store(world.files.get, lambda _name, _text: None),
        clock=clock,
        log=advice_log.append,
        advise=True,
    )
    # rps per round of 2 s: quiet, a peak well above 2 rps per replica, quiet again.
    profile = [0.5] * 10 + [7.0] * 25 + [0.5] * 45
    acted: list[Decision] = []
    try:
        for rps in profile:
            clock.now += 2.0
            world.router.requests += rps * 2.0
            settle(acting)
            advice = advising.tick()
            decisions = acting.tick()
            assert set(advice) == set(decisions) == {"prefill", "decode"}
            for group, decision in decisions.items():
                seen = advice[group]
                assert (seen.current, seen.desired, seen.action, seen.reason) == (
                    decision.current,
                    decision.desired,
                    decision.action,
                    decision.reason,
                ), f"{group}: advised {seen}, acted {decision}\n" + "\n".join(acting_log[-8:])
                acted.append(decision)
        settle(acting)
    finally:
        acting.close()
        advising.close()
    actions = {(d.group, d.action) for d in acted}
    assert {("prefill", "up"), ("decode", "up"), ("prefill", "down"), ("decode", "down")} <= actions
    assert any(line.startswith("started ") for line in acting_log)
    # The advising scaler acted on nothing; its lines say they are advice; the record is the
    # acting scaler's.
    assert not advising.pending and not advising.actions.running()
    assert not any(line.startswith(("started", "registered", "drained")) for line in advice_log)
    assert any(line.startswith("advice prefill: ") for line in advice_log)
    assert json.loads(world.files[layout.SCALER_STATE])["mode"] == "act"
    gauge = advising.metrics.registry.get_sample_value("pdctl_scaler_advise_only")
    assert gauge == 1 and acting.metrics.registry.get_sample_value("pdctl_scaler_advise_only") == 0


def test_advise_runs_for_its_span_and_reports_every_decision(world: World) -> None:
    world.scaler.close()
    advising = Scaler(
        world.plan,
        world.scaler.actuator,
        world.scaler.router,
        Store(world.files.get, lambda _name, _text: None),
        interval=0.3,
        log=lambda _line: None,
        advise=True,
    )
    shown: list[tuple[float, Decision]] = []
    started = time.monotonic()
    doc = advise(advising, 2.0, lambda at, decision: shown.append((at, decision)))
    took = time.monotonic() - started
    assert 2.0 <= took < 2.0 + advising.read_wait + advising.probe_timeout + 2
    assert doc["mode"] == "advise" and doc["ticks"] >= 2
    assert len(doc["decisions"]) == 2 * doc["ticks"]
    assert {d["group"] for d in doc["decisions"]} == {"prefill", "decode"}
    assert doc["summary"]["prefill"]["hold"] == doc["ticks"]
    # Each group's first decision is shown; a hold with the same reason is not shown again.
    assert sorted(d.group for _, d in shown) == ["decode", "prefill"]
    assert (
        doc["metrics"]['pdctl_scaler_decisions_total{action="hold",group="prefill"}']
        == doc["ticks"]
    )
    assert doc["metrics"]["pdctl_scaler_advise_only"] == 1
