"""The Actuator (pdctl/doors/slots.py) against the scaler's small world: real SSH hosts and
workers on loopback, a router stand-in that keeps a removed worker listed while it drains, as
SMG does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pdctl.doors.slots import SlotState, parse_states
from tests.unit.scaler.world import Keys, World, fast_plan, make_keys, make_world


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    keys: Keys = make_keys(tmp_path)
    yield from make_world(tmp_path, keys)


def test_workers_deregistered_together_drain_side_by_side(world: World) -> None:
    """`pdctl destroy` takes every worker off the router, then waits once: each DELETE goes
    out before the first worker has left, and the call returns when all have."""
    world.router.drain_secs = 1.0
    registered = [s for s in world.plan.slots() if s.url in world.router.urls()]
    assert len(registered) >= 2
    world.scaler.actuator.deregister_all(registered)
    urls = [s.url for s in registered]
    assert world.router.urls().isdisjoint(urls)  # every one gone when the call returns
    last_delete = max(world.router.deleted_at[u] for u in urls)
    first_left = min(world.router.left_at[u] for u in urls)
    assert last_delete < first_left  # one drain for all, not one after another


def test_a_worker_the_router_does_not_list_is_not_waited_for(world: World) -> None:
    """A slot that is not registered (stopped, or a spare) is no DELETE and no wait."""
    world.router.drain_secs = 30.0  # a wait for it would outlast the test's patience
    spare = next(s for s in world.plan.slots() if s.url not in world.router.urls())
    world.scaler.actuator.deregister_all([spare], drain_timeout=60.0)
    assert spare.url not in world.router.deleted_at


def test_a_registration_and_a_removal_reach_every_router(tmp_path: Path) -> None:
    """Several routers without SMG's mesh: each knows only what it is told, so register and
    deregister go to every one; a router that does not answer holds neither up."""
    with contextmanager(make_world)(tmp_path, make_keys(tmp_path), peers=2) as world:
        actuator, (other, hung) = world.scaler.actuator, world.peers
        said: list[str] = []
        actuator.log = said.append
        hung.freeze()
        spare = next(s for s in world.plan.slots() if s.url not in world.router.urls())
        started = time.monotonic()
        actuator.register(spare)
        assert spare.url in world.router.urls() and spare.url in other.urls()
        actuator.deregister(spare)
        assert spare.url not in world.router.urls() | other.urls()
        # Each call to the hung router waits its connector's timeout (the probe timeout), no more.
        assert time.monotonic() - started < 10 * world.plan.failover.probe_timeout + 5
        assert any("another router was not told of it" in line for line in said), said
        assert any("another router was not asked to let go of it" in line for line in said), said


def test_states_lines_give_each_slot_its_state_label_and_restart_count() -> None:
    """What a host's pdctl-unitctl printed is data: a line that is not a slot's, or a count
    that is not a plain number, changes nothing; an older unitctl's four words still read."""
    plan = fast_plan()
    slots = [s for s in plan.slots() if s.host == "gpu1"]
    names = sorted(s.name for s in slots)
    first, second = (n.split("/") for n in names)
    output = (
        f"{first[0]} {first[1]} active 90c54fb38083 3\n"
        f"{second[0]} {second[1]} activating - \N{SUPERSCRIPT TWO}\n"
        "decode 99 active - 1\n"  # no such slot on this host
        "nonsense\n"
    )
    by_name = {s.name: s for s in slots}
    states = parse_states(output, slots)
    assert states[names[0]] == SlotState(by_name[names[0]], "active", "90c54fb38083", 3)
    assert states[names[1]].restarts is None and states[names[1]].running
    assert parse_states(f"{first[0]} {first[1]} failed -\n", slots)[names[0]] == SlotState(
        by_name[names[0]], "failed", None, None
    )
    assert parse_states("", slots)[names[1]].active == "inactive"


def test_a_worker_listed_with_a_slash_at_the_end_is_the_slots_worker(world: World) -> None:
    """SMG may list a URL as posted, "/" at the end included: the router door gives every
    reader the plan's form, so status, drift, destroy and the scaler all match it."""
    slot = next(s for s in world.plan.slots() if s.url in world.router.urls())
    with world.router.lock:
        listed = next(w for w in world.router.workers.values() if w["url"] == slot.url)
        listed["url"] = slot.url + "/"
    assert slot.url in {w.url for w in world.scaler.router.workers()}
    found = world.scaler.router.find(slot.url)
    assert found is not None and found.id == listed["id"]
    world.scaler.actuator.deregister_all([slot], drain_timeout=5.0)
    assert listed["id"] not in world.router.workers  # found, removed, and waited for
