"""Which replicas the scaler takes away: never the last routable one while another starts."""

from __future__ import annotations

from pdctl.plan import Slot
from pdctl.router import Worker
from pdctl.scaler.loop import scale_in_order


def _slot(index: int) -> Slot:
    return Slot(
        group="prefill",
        index=index,
        host="10.0.0.12",
        address="10.0.0.12",
        gpus=[index],
        port=30000 + 1000 * (index - 1),
        bootstrap_port=8998 + index,
        start=index == 1,
    )


def _serving(*slots: Slot) -> dict[str, Worker]:
    return {s.url: Worker(str(s.index), s.url, "prefill", "ready", True) for s in slots}


def test_nothing_leaves_while_a_running_replica_is_not_yet_routed_to() -> None:
    # A deploy started slot 1; slot 2 serves. Taking slot 2 now would leave no prefill.
    one, two = _slot(1), _slot(2)
    since: dict[str, float] = {}
    victims, starting = scale_in_order(
        [one, two], _serving(two), {}, since, now=100.0, start_timeout=600
    )
    assert victims == [] and starting == ["prefill/1"]
    # Registered but not healthy yet counts as starting too.
    pending = {**_serving(two), one.url: Worker("1", one.url, "prefill", "pending", False)}
    victims, starting = scale_in_order([one, two], pending, {}, since, now=200.0, start_timeout=600)
    assert victims == [] and starting == ["prefill/1"] and since == {"prefill/1": 100.0}


def test_once_in_service_the_newest_leaves_first() -> None:
    one, two, three = _slot(1), _slot(2), _slot(3)
    since = {"prefill/1": 100.0}
    victims, starting = scale_in_order(
        [one, two, three],
        _serving(one, two, three),
        {"prefill/2": 50.0},  # this scaler started slot 2 last; 1 and 3 were there before
        since,
        now=300.0,
        start_timeout=600,
    )
    assert starting == [] and victims == [two, three, one] and since == {}


def test_a_replica_never_routed_to_past_its_start_timeout_leaves_first() -> None:
    one, two = _slot(1), _slot(2)
    since: dict[str, float] = {}
    assert scale_in_order([one, two], _serving(one), {}, since, now=0.0, start_timeout=60)[0] == []
    victims, starting = scale_in_order(
        [one, two], _serving(one), {}, since, now=61.0, start_timeout=60
    )
    assert starting == [] and victims == [two, one]
