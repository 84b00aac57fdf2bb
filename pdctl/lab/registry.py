"""Which lab ids are in use on this machine, so labs of several workspaces coexist.

A lab's id picks its bridge (pdlab<id>), subnet (10.77.<id>.0/24) and the
names of its namespaces and veths. /run/pdctl-lab/<id> points at the lab
directory that owns the id. An id whose owner is gone (its lab.json deleted,
or all its hosts dead after a crash) is swept and reused, but ids go round:
a new lab takes the next free id after the last one claimed, so a lab that
starts while another goes down never takes the id (and names) just let go.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from pdctl.core.errors import EnvironmentProblem

REGISTRY = Path("/run/pdctl-lab")
MAX_LABS = 64
_LAST = ".last-claimed"


@contextlib.contextmanager
def locked() -> Iterator[None]:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    with (REGISTRY / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def owner(lab_id: int) -> Path | None:
    pointer = REGISTRY / str(lab_id)
    return Path(pointer.read_text().strip()) if pointer.is_file() else None


def claim(lab_id: int, lab_dir: Path) -> None:
    (REGISTRY / str(lab_id)).write_text(str(lab_dir))
    (REGISTRY / _LAST).write_text(str(lab_id))


def release(lab_id: int) -> None:
    (REGISTRY / str(lab_id)).unlink(missing_ok=True)


def _last_claimed() -> int:
    with contextlib.suppress(OSError, ValueError):
        return int((REGISTRY / _LAST).read_text().strip()) % MAX_LABS
    return MAX_LABS - 1


def free_id(in_use: set[int]) -> int:
    after = _last_claimed() + 1
    for lab_id in ((after + step) % MAX_LABS for step in range(MAX_LABS)):
        if lab_id not in in_use and not (REGISTRY / str(lab_id)).exists():
            return lab_id
    raise EnvironmentProblem(
        f"all {MAX_LABS} lab ids on this machine are in use",
        hint="run `pdctl lab down` in workspaces you no longer need",
    )


def claimed_ids() -> list[int]:
    if not REGISTRY.is_dir():
        return []
    return sorted(int(p.name) for p in REGISTRY.iterdir() if p.name.isdigit())
