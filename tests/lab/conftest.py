"""Fixtures shared by the lab stand-ins' unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lab.worker.test_sglang import PROVIDER_NAME, Launcher


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """Starts SGLang stand-ins with a fake RDMA provider library; stops them all afterwards."""
    provider = tmp_path / PROVIDER_NAME
    provider.write_bytes(b"\x7fELF fake provider")
    launch = Launcher(tmp_path, provider)
    try:
        yield launch
    finally:
        launch.stop_all()
