"""The lab's system helpers: removing a tree that a dying process still writes into."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from pdctl.core.errors import PdctlError
from pdctl.lab import system


def test_a_tree_written_after_a_pass_is_removed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed process's last writes land after a removal pass (deterministic here: each of
    the first two passes is followed by one more write); the removal goes on until it is gone."""
    tree = tmp_path / "lab"
    (tree / "hosts" / "node1").mkdir(parents=True)
    (tree / "hosts" / "node1" / "console.log").write_text("x")
    passes: list[Path] = []
    real = shutil.rmtree

    def then_a_late_write(path: Path, ignore_errors: bool = False) -> None:
        real(path, ignore_errors=ignore_errors)
        passes.append(path)
        if len(passes) <= 2:
            (path / "hosts").mkdir(parents=True, exist_ok=True)
            (path / "hosts" / "late.log").write_text("x")

    monkeypatch.setattr(shutil, "rmtree", then_a_late_write)
    system.remove_tree(tree, seconds=10)
    assert not tree.exists()
    assert passes == [tree, tree, tree]


def test_a_tree_that_will_not_go_is_named_with_what_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "lab"
    (tree / "hosts").mkdir(parents=True)
    (tree / "hosts" / "busy").write_text("x")
    monkeypatch.setattr(shutil, "rmtree", lambda *_a, **_k: None)  # EBUSY everywhere
    started = time.monotonic()
    with pytest.raises(PdctlError, match=rf"could not remove {tree} within 0.3 s; left: "):
        system.remove_tree(tree, seconds=0.3)
    assert time.monotonic() - started < 3
