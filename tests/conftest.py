from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.shared_lab import SharedLab
from tests.support import Lab

# The lab modules, longest first (a loaded 2-core run with --durations=0; rough is enough).
# `make test` runs modules side by side (--dist loadfile) in collection order
# (--no-loadscope-reorder: xdist's default puts modules with many tests first, so the few-test
# lab modules that take minutes started last and made the suite's tail). The unit and CLI
# modules go first (about a minute and a half, and some time their stand-ins: better before
# the labs load the machine), then these, longest first, then any lab module not listed.
LONGEST_FIRST = (
    "test_scaler_vllm",
    "test_molecule",
    "test_nvidia",
    "test_host_loss",
    "test_playbooks",
    "test_deploy",
    "test_router_ha",
    "test_scaler",
    "test_vllm",
    "test_undo",
    "test_gpu_budget",
    "test_scaler_latency",
    "test_model_cache",
    "test_sharing",
    "test_fleet",
    "test_lab_any_spec",
    "test_lab_nvidia",
    "test_fabric",
    "test_lab",
    "test_lab_hub",
)


def _rank(item: pytest.Item) -> tuple[int, int]:
    if "integration" not in item.path.parts:
        return (0, 0)
    module = item.path.stem
    return (1, LONGEST_FIRST.index(module)) if module in LONGEST_FIRST else (2, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: a module's tests keep their order


@pytest.fixture(scope="session")
def shared_labs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedLab]:
    """The session's 3-host lab, booted when a module first borrows it (tests/shared_lab.py)."""
    labs = SharedLab(tmp_path_factory)
    yield labs
    labs.close()


@pytest.fixture(scope="module")
def shared_lab(shared_labs: SharedLab, request: pytest.FixtureRequest) -> Iterator[Lab]:
    """The session's 3-host lab (node1 a CPU host, node2 and node3 AMD GPU hosts, added as fleet
    `lab`), clean, for this module; what the module left is destroyed at its end, and the hosts
    must then be clean."""
    module = request.module.__name__
    lab = shared_labs.borrow(module)
    yield lab
    shared_labs.give_back(module)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """An empty PDCTL_HOME."""
    return tmp_path
