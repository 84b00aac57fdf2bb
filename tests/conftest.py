from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Lab, pdctl, require_lab, start_lab


@pytest.fixture(scope="session")
def lab3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A 3-host lab for the session: node1 is a CPU host, node2 and node3 GPU hosts."""
    require_lab()
    home = tmp_path_factory.mktemp("lab3")
    lab = start_lab(home, hosts=3, cpu_hosts=1)
    yield lab
    pdctl(home, "lab", "down")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """An empty PDCTL_HOME."""
    return tmp_path
