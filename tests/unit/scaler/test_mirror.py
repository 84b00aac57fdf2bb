"""Several routers without SMG's mesh (pdctl/scaler/mirror.py): a worker the scaler registers
reaches every router; the acting scaler gives a router that restarted empty its workers back,
takes from another router a worker that no longer runs, leaves a draining one to its drain;
a router that hangs holds up no tick, and is brought up to date once it answers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl.core.plan import Slot
from pdctl.doors.router import Router, Worker, tcp_connector
from pdctl.scaler.mirror import Repair, repairs
from tests.unit.scaler.world import (
    Keys,
    RouterStandIn,
    Ticks,
    World,
    make_keys,
    make_world,
    settled,
)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def world(tmp_path: Path, keys: Keys) -> Iterator[World]:
    yield from make_world(tmp_path, keys, peers=1)


def started(world: World) -> Ticks:
    ticks = Ticks(world)
    ticks.until("the deployed replicas to be known healthy", lambda: settled(world), 20)
    return ticks


def other_where(standin: RouterStandIn) -> str:
    return f"127.0.0.1:{standin.port}"


def test_a_router_that_restarted_empty_gets_every_worker_back(world: World) -> None:
    ticks = started(world)
    other = world.peers[0]
    assert other.urls() == world.router.urls() != set()
    with other.lock:
        other.workers.clear()  # restarted: SMG keeps no state
    ticks.until(
        "the other router to list every worker again",
        lambda: other.urls() == world.router.urls(),
        10,
    )
    ticks.until(  # a repair is said the tick after it ends
        "the repairs logged",
        lambda: any(
            f"on router {other_where(other)}: it lacked it" in line for line in world.logged
        ),
        5,
    )


def test_a_scale_out_reaches_every_router(world: World) -> None:
    ticks = started(world)
    other = world.peers[0]
    world.pin("decode", 2)
    ticks.until(
        "decode/2 registered", lambda: world.registered("decode") == {"decode/1", "decode/2"}, 20
    )
    # The scaler's registration posts to every router: no tick later.
    assert world.slot("decode/2").url in other.urls()


def test_a_worker_that_no_longer_runs_leaves_the_other_router_and_a_draining_one_is_left(
    world: World,
) -> None:
    ticks = started(world)
    other = world.peers[0]
    spare, draining = world.slot("prefill/2"), world.slot("decode/2")  # neither runs
    client = Router("127.0.0.1", other.port, other.port, "key", tcp_connector())
    for slot in (spare, draining):  # registrations a router cut off kept
        client.add_worker(slot.registration())
    with other.lock:
        entry = next(w for w in other.workers.values() if w["url"] == draining.url)
        entry["status"] = "draining"
    ticks.until("the stale registration removed", lambda: spare.url not in other.urls(), 10)
    ticks.until(
        "the removal logged",
        lambda: any(f"removed {spare.name} ({spare.url}) from router" in x for x in world.logged),
        5,
    )
    assert draining.url in other.urls()  # its drain is SMG's: it leaves when that ends


def test_a_hung_router_holds_up_no_tick_and_is_brought_up_to_date_when_it_answers(
    world: World,
) -> None:
    ticks = started(world)
    other = world.peers[0]
    other.freeze()
    world.pin("decode", 2)
    # Ticks.one asserts every tick ends within its bound, the hung router notwithstanding.
    ticks.until(
        "decode/2 registered", lambda: world.registered("decode") == {"decode/1", "decode/2"}, 20
    )
    assert any("cannot be read" in line for line in world.logged), world.logged
    other.thaw()
    deadline = time.monotonic() + 15
    while world.slot("decode/2").url not in other.urls():
        assert time.monotonic() < deadline, "\n".join(world.logged)
        ticks.one()
        time.sleep(world.scaler.interval)
    assert other.urls() == world.router.urls()


# -- the repairs, as a table -------------------------------------------------------------------


def _worker(slot: Slot, status: str = "ready") -> Worker:
    return Worker(
        id=f"id-{slot.name}", url=slot.url, worker_type=slot.group, status=status, healthy=True
    )


def test_repairs_follow_the_acting_router_and_leave_drains_and_busy_slots_alone(
    world: World,
) -> None:
    running, stopped, busy, draining = (
        world.slot(n) for n in ("prefill/1", "prefill/2", "decode/1", "decode/2")
    )
    acting = {
        running.url: _worker(running),
        busy.url: _worker(busy),
        draining.url: _worker(draining, "draining"),
    }
    other = {stopped.url: _worker(stopped)}
    found = repairs(
        [running, stopped, busy, draining],
        acting,
        other,
        settled=lambda s: s is not busy,
        gone=lambda s: s is stopped,
    )
    assert found == [Repair("add", running), Repair("remove", stopped, other[stopped.url])]
