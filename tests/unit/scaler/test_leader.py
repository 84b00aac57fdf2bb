"""One scaler acts: the one whose router host holds the failover address. The other stands by,
keeps the acting one's state (pulled from its state server, behind the router's API key), and
goes on from it when the address comes to its host: pins and cooldowns survive the move."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl.core import layout
from pdctl.scaler import leader
from pdctl.scaler.leader import Leadership
from pdctl.scaler.loop import Scaler
from pdctl.scaler.store import Store
from tests.unit.scaler.world import Keys, World, make_keys, make_world

KEY = "the-routers-api-key"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def world(tmp_path: Path, keys: Keys) -> Iterator[World]:
    yield from make_world(tmp_path, keys)


def test_a_host_holds_only_its_own_addresses() -> None:
    assert leader.holds("127.0.0.1")
    assert not leader.holds("192.0.2.77")  # TEST-NET-1: on no host


def test_the_state_server_answers_only_with_the_key() -> None:
    server = leader.serve_state("127.0.0.1", 0, KEY, lambda: '{"service": "s", "at": 5}')
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert leader.pull_state([base], KEY, "s") == {"service": "s", "at": 5}
        assert leader.pull_state([base], "another key", "s") is None
        assert leader.pull_state([base], KEY, "another service") is None
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(base + "/state", timeout=5)
        assert caught.value.code == 401
        assert leader.pull_state(["http://127.0.0.1:1", base], KEY, "s") is not None
    finally:
        server.shutdown()


def test_the_standby_keeps_the_acting_state_and_goes_on_from_it(world: World) -> None:
    holder = {"address": "a"}
    acting = world.scaler  # host a's scaler
    server = leader.serve_state("127.0.0.1", 0, KEY, acting.store.state)
    peer = f"http://127.0.0.1:{server.server_address[1]}"
    acting.leader = Leadership("10.0.0.200", lambda: holder["address"] == "a", lambda: None)
    files: dict[str, str] = {}
    log: list[str] = []
    standby = Scaler(
        world.plan,
        acting.actuator,
        acting.router,
        Store(files.get, files.__setitem__),
        log=log.append,
        leader=Leadership(
            "10.0.0.200",
            lambda: holder["address"] == "b",
            lambda: leader.pull_state([peer], KEY, world.plan.service),
        ),
    )
    try:
        world.pin("decode", 2)
        for _ in range(3):
            assert set(acting.tick()) == {"prefill", "decode"}
            time.sleep(acting.interval)
        assert standby.tick() == {}  # it stands by: no decision, no action
        assert not standby.pending and "standing by" in log[-1]
        kept = json.loads(files[layout.SCALER_STATE])
        assert kept["service"] == world.plan.service and kept["pins"] == {"decode": 2}
        assert json.loads(files[layout.SCALER_PINS]) == {"decode": 2}
        scaled_at = acting.histories["decode"].last_scaled_at
        assert scaled_at is not None  # pinned to 2: the acting scaler scaled decode out

        holder["address"] = "b"  # keepalived moves the address to b
        assert acting.tick() == {}
        decisions = standby.tick()
        assert set(decisions) == {"prefill", "decode"}
        assert "acting: this host holds the failover address 10.0.0.200" in log
        # What the acting scaler knew: the pin, and when it last scaled (its cooldowns).
        assert decisions["decode"].desired == 2
        assert standby.histories["decode"].last_scaled_at == scaled_at
    finally:
        server.shutdown()
        standby.close()
