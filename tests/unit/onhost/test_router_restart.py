"""pdctl/onhost/router_restart.py gives a restarted router (it keeps no state) its workers
again, with the API key from the router's environment file; a worker it has already (409) is
fine, one it refuses is named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl.onhost import router_restart
from tests.unit.scaler.world import RouterStandIn, fast_plan


@pytest.fixture
def router() -> Iterator[RouterStandIn]:
    standin = RouterStandIn(api_key="the-key")
    yield standin
    standin.close()


def test_a_restarted_router_gets_its_workers_again(router: RouterStandIn, tmp_path: Path) -> None:
    env = tmp_path / "router.env"
    env.write_text("# written by pdctl\nPDCTL_ROUTER_API_KEY=the-key\n")
    workers = [slot.registration() for slot in fast_plan().slots() if slot.start]
    url = f"http://127.0.0.1:{router.port}"
    key = router_restart.api_key(str(env))
    assert key == "the-key"
    assert router_restart.register(url, workers, key) == []
    assert router.urls() == {w["url"] for w in workers} != set()
    assert router_restart.register(url, workers, key) == []  # each one already there: 409


def test_a_refused_worker_is_named(router: RouterStandIn) -> None:
    workers = [slot.registration() for slot in fast_plan().slots() if slot.start]
    url = f"http://127.0.0.1:{router.port}"
    refused = router_restart.register(url, workers, "not-the-key")
    assert refused == [w["url"] for w in workers]
    assert router.urls() == set()
    assert router_restart.register("file:///etc/passwd", workers, "the-key") == refused


def test_only_a_router_no_meshed_peer_can_fill_registers_its_workers_itself() -> None:
    assert router_restart.registers_itself("0", was_ready=False)
    assert not router_restart.registers_itself("1", was_ready=True)  # the mesh gives them
    # the first router of a service turning the mesh on: nobody else runs meshed yet
    assert router_restart.registers_itself("first", was_ready=True)
    # ... but a router that never served is a new service's: the role registers through one
    assert not router_restart.registers_itself("first", was_ready=False)
