"""Two services on one fleet, one GPU budget with room for one more replica: two real scalers
(each with its own worker hosts over real SSH, its worker processes and its router) draw from
one ledger file under its lock. Exactly one scale-out happens: the service further from its
SLO gets it; the other's refusal is in its decision, its record and its metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from pdctl.core import layout
from pdctl.onhost.gpu_ledger_file import peek
from pdctl.scaler.ledger_door import local
from pdctl.scaler.loop import Scaler
from pdctl.scaler.store import Store
from tests.unit.scaler.world import Keys, World, fast_plan, make_keys, make_world

BUDGET = 20  # both services at 1 prefill + 1 decode of 4 GPUs: 16, room for one more


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def worlds(tmp_path: Path, keys: Keys) -> Iterator[dict[str, World]]:
    with ExitStack() as stack:
        found = {}
        for name in ("calm", "busy"):
            plan = fast_plan().model_copy(update={"service": name, "gpu_budget": BUDGET})
            (tmp_path / name).mkdir()
            found[name] = stack.enter_context(
                contextmanager(make_world)(tmp_path / name, keys, plan)
            )
        yield found


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_one_replica_of_room_goes_to_the_service_furthest_from_its_slo(
    worlds: dict[str, World], tmp_path: Path
) -> None:
    ledger_path = tmp_path / "ledger" / "lab.json"
    clock = Clock()
    logs: dict[str, list[str]] = {name: [] for name in worlds}
    scalers = {}
    for name, world in worlds.items():
        world.scaler.close()
        scalers[name] = Scaler(
            world.plan,
            world.scaler.actuator,
            world.scaler.router,
            Store(world.files.get, world.files.__setitem__),
            clock=clock,
            log=logs[name].append,
            ledger=local(ledger_path),
        )
    rps = {"calm": 5.0, "busy": 9.0}  # per replica target 2: busy is 4.5x over, calm 2.5x
    try:
        for _ in range(12):
            clock.now += 2.0
            for name, scaler in scalers.items():
                worlds[name].router.requests += rps[name] * 2.0
                scaler.tick()
            time.sleep(0.2)
        for scaler in scalers.values():
            deadline = time.monotonic() + 20
            while scaler.actions.running():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            scaler.tick()
    finally:
        for scaler in scalers.values():
            scaler.close()
    started = {
        name: [line for line in log if line.startswith("started ")] for name, log in logs.items()
    }
    assert started["calm"] == [], logs["calm"][-6:]
    assert len(started["busy"]) == 1, logs["busy"][-6:]  # exactly one scale-out, of one replica
    # The refusals are visible: in the decisions, the record `pdctl status` reads, the metrics.
    calm = json.loads(worlds["calm"].files[layout.SCALER_STATE])
    refusals = [g["refusal"] for g in calm["groups"].values() if g.get("refusal")]
    assert refusals and all("GPU budget" in r for r in refusals), calm["groups"]
    assert calm["budget"]["budget"] == BUDGET and calm["budget"]["used"] == BUDGET
    assert calm["budget"]["holders"] == {"busy": 12, "calm": 8}
    metric = scalers["calm"].metrics.registry.get_sample_value
    assert (metric("pdctl_scaler_budget_refusals_total", {"group": "decode"}) or 0) > 0
    assert metric("pdctl_scaler_gpus", {"kind": "fleet_used"}) == BUDGET
    assert any("refused: GPU budget" in line for line in logs["calm"])
    busy = json.loads(worlds["busy"].files[layout.SCALER_STATE])
    assert [g for g in busy["groups"].values() if g.get("refusal")], busy["groups"]  # its second
    ledger, note = peek(ledger_path)
    assert note == "" and {n: e.using for n, e in ledger.services.items()} == {
        "busy": 12,
        "calm": 8,
    }
