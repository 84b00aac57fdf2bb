"""The scaler's tick when a host or a replica stops answering, against real processes.

Real SSH servers stand for the worker hosts, real worker processes for the engines (SIGSTOP
hangs one as a wedged collective would), an HTTP server speaking SMG's worker API for the
router (tests/unit/scaler_world.py); the scaler reaches them through pdctl's SSH pool,
Actuator and Router client. What each test pins down: no tick waits on what does not answer,
and the group gets its replicas back from spare slots.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl import layout
from tests.unit.scaler_world import Keys, World, make_keys, make_world


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def world(tmp_path: Path, keys: Keys) -> Iterator[World]:
    yield from make_world(tmp_path, keys)


class Ticks:
    """Every tick's duration and decisions, checked as they come."""

    def __init__(self, world: World) -> None:
        self.world = world
        scaler = world.scaler
        # A tick waits for the hosts (read_wait), then for the engines (probe timeout):
        # never for a host or an action that does not answer.
        self.bound = scaler.read_wait + scaler.probe_timeout + 1.0
        self.longest = 0.0
        self.count = 0

    def one(self) -> None:
        started = time.monotonic()
        decisions = self.world.scaler.tick()
        took = time.monotonic() - started
        self.longest = max(self.longest, took)
        self.count += 1
        assert took < self.bound, f"a tick took {took:.1f} s:\n" + "\n".join(self.world.logged)
        assert set(decisions) == {"prefill", "decode"}, self.world.logged[-5:]

    def until(self, what: str, done: object, seconds: float, each: object = None) -> None:
        deadline = time.monotonic() + seconds
        while not done():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}:\n" + "\n".join(self.world.logged)
                )
            self.one()
            if each is not None:
                each()  # type: ignore[operator]
            time.sleep(self.world.scaler.interval)


def settled(world: World) -> bool:
    return world.registered("prefill") == {"prefill/1"} and world.registered("decode") == {
        "decode/1"
    }


def test_a_host_that_stops_answering_is_replaced_elsewhere_and_fenced_on_return(
    world: World,
) -> None:
    ticks = Ticks(world)
    ticks.until("the deployed replicas to be known healthy", lambda: settled(world), 20)
    for _ in range(3):
        ticks.one()
    gpu2 = world.hosts["gpu2"]  # decode/1's host
    assert world.slot("decode/1").host == "gpu2"
    gpu2.freeze()
    # SMG counts a failed prefill+decode request against both: decode/1's failures open
    # prefill/1's circuit breaker too
    world.router.cb_open.add(world.slot("prefill/1").url)
    world.pin("prefill", 2)  # a pin for the other group, while a host hangs
    ticks.until(
        "decode/1 replaced on another host and prefill pinned to 2",
        lambda: (
            world.registered("decode") == {"decode/2"}
            and world.registered("prefill") == {"prefill/1", "prefill/2"}
        ),
        30,
    )
    assert world.slot("decode/2").host != "gpu2"
    assert any(line.startswith("gpu2 lost:") for line in world.logged), world.logged
    ticks.until(
        "prefill/1 registered afresh (a closed breaker)",
        lambda: world.slot("prefill/1").url not in world.router.cb_open,
        20,
    )
    ticks.until(
        "the renewal logged",
        lambda: any("registered prefill/1 afresh" in line for line in world.logged),
        10,
    )
    assert world.unit("decode/1").state == "active"  # untouched: its host cannot be reached
    assert "decode/1" in world.files[layout.SCALER_STATE]  # fenced

    def never_twice() -> None:
        assert "decode/1" not in world.registered("decode"), world.logged[-10:]
        assert len(world.registered("decode")) <= 1

    gpu2.thaw()  # back, with decode/1 running and enabled as before it went
    assert world.unit("decode/1").enabled
    ticks.until(
        "decode/1 stopped and disabled on its returned host",
        lambda: world.unit("decode/1").state == "inactive" and not world.unit("decode/1").enabled,
        30,
        never_twice,
    )
    for _ in range(5):
        ticks.one()
        never_twice()
    assert world.registered("decode") == {"decode/2"}
    assert any("gpu2 answers again" in line for line in world.logged)
    assert "decode/1" not in world.scaler.watch.fenced


def test_a_stop_that_never_returns_holds_up_no_tick_and_no_other_group(world: World) -> None:
    ticks = Ticks(world)
    ticks.until("the deployed replicas to be known healthy", lambda: settled(world), 20)
    world.pin("decode", 2)
    ticks.until("decode at 2", lambda: world.registered("decode") == {"decode/1", "decode/2"}, 20)
    world.hosts[world.slot("decode/2").host].hang_stop.add("decode/2")
    world.pin("decode", 1)  # scale-in: decode/2 (the newest) drains, then its stop hangs
    ticks.until("decode/2 deregistered", lambda: world.registered("decode") == {"decode/1"}, 20)
    world.pin("prefill", 2)
    ticks.until(
        "prefill pinned to 2 while decode/2's stop hangs",
        lambda: world.registered("prefill") == {"prefill/1", "prefill/2"},
        20,
    )
    for _ in range(5):
        ticks.one()
    host = world.hosts[world.slot("decode/2").host]
    assert any(c.split()[2:4] == ["stop", "decode"] for c in host.commands)
    assert world.scaler.pending["decode/2"].action == "stop"  # still in flight, in the background
    assert world.scaler.last["decode"].desired == 1
    assert world.scaler.metrics.running.labels("decode")._value.get() == 1  # leaving: not counted


def test_a_hung_worker_is_replaced_first_then_killed(world: World) -> None:
    ticks = Ticks(world)
    ticks.until("the deployed replicas to be known healthy", lambda: settled(world), 20)
    for _ in range(3):
        ticks.one()
    hung = world.unit("decode/1")
    assert hung.process is not None
    hung.process.send_signal(19)  # SIGSTOP: alive, listening, answering nothing
    started = time.monotonic()
    ticks.until(
        "the spare serving in decode/1's place",
        lambda: world.registered("decode") == {"decode/2"},
        20,
    )
    replaced = time.monotonic() - started
    ticks.until("decode/1 killed", lambda: hung.state == "inactive", 20)
    assert hung.process is None
    unhealthy = [line for line in world.logged if "decode/1 on gpu2 unhealthy" in line]
    assert unhealthy, world.logged
    # detection took about unhealthy_after (1 s), not the old 60 s; the whole replacement a
    # few ticks more
    assert replaced < 15, replaced
    assert world.registered("prefill") == {"prefill/1"}  # the other group untouched
