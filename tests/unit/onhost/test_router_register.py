"""pdctl/onhost/router_register.py, the pd_router role's registration on the router host: the
workers the router lacks are registered with the key from its environment file, one it refuses
is named with the router's answer, and a router that never gets ready fails the step. Against
SMG itself it runs in every lab deploy (tests/integration/test_playbooks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost import bundle, router_register, router_restart
from tests.unit.scaler.world import RouterStandIn, fast_plan

ENTRY = "pdctl.onhost.router_register"


@pytest.fixture
def router() -> Iterator[RouterStandIn]:
    standin = RouterStandIn(api_key="the-key")
    yield standin
    standin.close()


def _workers() -> list[dict[str, Any]]:
    return [slot.registration() for slot in fast_plan().slots() if slot.start]


def _run(argv: list[str], workers: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """As a host runs it: the bundle's argv, the loader and the bundle, then the workers."""
    done = subprocess.run(
        bundle.argv(ENTRY, argv, python=sys.executable),
        input=bundle.stdin(ENTRY) + json.dumps(workers).encode(),
        capture_output=True,
        check=False,
        env={"PATH": os.environ["PATH"]},
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout)


def test_the_router_gets_the_workers_it_lacks(router: RouterStandIn, tmp_path: Path) -> None:
    env = tmp_path / "router.env"
    env.write_text("PDCTL_ROUTER_API_KEY=the-key\n")
    workers = _workers()
    assert len(workers) > 1
    url = f"http://127.0.0.1:{router.port}"
    assert router_restart.register(url, workers[:1], "the-key") == []  # one it has already

    rc, report = _run([url, str(env), "1", "0"], workers)
    assert rc == 0 and report["listed"] and report["refused"] == [], report
    assert report["registered"] == [str(w["url"]) for w in workers[1:]]
    assert report["ready"] is None  # not asked
    assert router.urls() == {w["url"] for w in workers}

    rc, report = _run([url, str(env), "1", "0"], workers)
    assert rc == 0 and report["registered"] == [] and report["refused"] == []


def test_a_refused_worker_is_named_with_the_routers_answer(
    router: RouterStandIn, tmp_path: Path
) -> None:
    env = tmp_path / "router.env"
    env.write_text("PDCTL_ROUTER_API_KEY=not-the-key\n")
    workers = _workers()
    rc, report = _run([f"http://127.0.0.1:{router.port}", str(env), "1", "0"], workers)
    assert rc == 1 and not report["listed"] and report["registered"] == []
    assert report["refused"] == [{"url": w["url"], "status": 401} for w in workers]
    assert router.urls() == set()


def test_a_router_never_ready_fails_the_step_at_its_deadline(router: RouterStandIn) -> None:
    # The stand-in answers /readiness 401 (it wants the key there): never 200.
    url = f"http://127.0.0.1:{router.port}"
    rc, report = _run([url, "/nonexistent", "0", "0.5"], _workers())
    assert rc == 1 and report["ready"] is False and report["registered"] == []
    assert router_register.listed("file:///etc/passwd", "the-key") is None
