"""Which lab ids are in use on this machine, so labs of several workspaces coexist.

A lab's id picks its bridge (pdlab<id>), subnet (10.77.<id>.0/24) and the
names of its namespaces and veths. /run/pdctl-lab/<id> points at the lab
directory that owns the id. An id whose owner is gone (its lab.json deleted,
or all its hosts dead after a crash) is swept and reused. A workspace whose lab
comes up again gets the id it had (the same addresses: its fleet's inventory
still holds them); any other new lab takes the next free id after the last one
claimed, one no workspace let go of if it can, so a lab that starts while
another goes down never takes the id (and names) just let go.
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
_RELEASED = ".released-"  # + id: the lab directory that last held the id


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
    (REGISTRY / f"{_RELEASED}{lab_id}").unlink(missing_ok=True)


def release(lab_id: int) -> None:
    held_by = owner(lab_id)
    (REGISTRY / str(lab_id)).unlink(missing_ok=True)
    if held_by is not None:
        (REGISTRY / f"{_RELEASED}{lab_id}").write_text(str(held_by))


def _released_by(lab_id: int) -> Path | None:
    record = REGISTRY / f"{_RELEASED}{lab_id}"
    return Path(record.read_text().strip()) if record.is_file() else None


def _last_claimed() -> int:
    with contextlib.suppress(OSError, ValueError):
        return int((REGISTRY / _LAST).read_text().strip()) % MAX_LABS
    return MAX_LABS - 1


def free_id(in_use: set[int], lab_dir: Path | None = None) -> int:
    """A free id for LAB_DIR's lab: the one it let go of last, else the next one round."""
    after = _last_claimed() + 1
    free = [
        lab_id
        for lab_id in ((after + step) % MAX_LABS for step in range(MAX_LABS))
        if lab_id not in in_use and not (REGISTRY / str(lab_id)).exists()
    ]
    released = {lab_id: _released_by(lab_id) for lab_id in free}
    its_own = [i for i in free if lab_dir is not None and released[i] == lab_dir]
    let_go_by_none = [i for i in free if released[i] is None]
    for choice in (its_own, let_go_by_none, free):
        if choice:
            return choice[0]
    raise EnvironmentProblem(
        f"all {MAX_LABS} lab ids on this machine are in use",
        hint="run `pdctl lab down` in workspaces you no longer need",
    )


def claimed_ids() -> list[int]:
    if not REGISTRY.is_dir():
        return []
    return sorted(int(p.name) for p in REGISTRY.iterdir() if p.name.isdigit())
