"""`pdctl scaler advise` without a lab: its errors (one line, no traceback, nothing contacted).
Advice beside an acting scaler is tests/unit/scaler/test_advise.py (real SSH hosts and workers)
and tests/integration/test_scaler_vllm.py (a lab)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.cli.service.test_endpoint import deployed
from tests.support import pdctl


@pytest.mark.parametrize("duration", ["10x", "-5m", "0", "forever"])
def test_a_bad_duration_is_one_line(
    workspace: Path, listener: socket.socket, duration: str
) -> None:
    deployed(workspace, listener.getsockname()[1])
    proc = pdctl(workspace, "scaler", "advise", "pdlab", "--for", duration, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--for" in proc.stderr and "duration" in proc.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()  # refused before any host was contacted


def test_an_unknown_service_is_not_found(workspace: Path) -> None:
    proc = pdctl(workspace, "--json", "scaler", "advise", "nosuch", "--for", "5s", check=False)
    assert proc.returncode == 7
    assert json.loads(proc.stdout)["error"]["kind"] == "not_found"


def test_the_help_says_it_acts_on_nothing(workspace: Path) -> None:
    text = pdctl(workspace, "scaler", "advise", "--help").stdout
    assert "acting on nothing" in text and "--for" in text
