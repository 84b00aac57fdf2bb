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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for `pytest -n N --dist loadgroup` (make test): a lab module's tests share their
    module's lab and deployment, so they stay on one worker; each molecule scenario boots its
    own lab, so each is a group of its own. Unit tests spread freely."""
    for item in items:
        path = item.path
        if path.parent.name != "integration":
            continue
        scenario = getattr(item, "callspec", None)
        if path.stem == "test_molecule" and scenario is not None:
            group = f"molecule-{scenario.params['scenario']}"
        else:
            group = path.stem
        item.add_marker(pytest.mark.xdist_group(group))
