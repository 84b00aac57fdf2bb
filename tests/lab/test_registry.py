"""Lab ids go round, so a lab starting while another goes down never takes the id just let go."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.core.errors import EnvironmentProblem
from pdctl.lab import registry


@pytest.fixture(autouse=True)
def _own_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "REGISTRY", tmp_path / "registry")
    (tmp_path / "registry").mkdir()


def _claim_next(lab_dir: str) -> int:
    lab_id = registry.free_id(set())
    registry.claim(lab_id, Path(lab_dir))
    return lab_id


def test_a_released_id_is_not_the_next_one_given() -> None:
    assert [_claim_next(f"/labs/{n}") for n in range(3)] == [0, 1, 2]
    registry.release(1)
    assert _claim_next("/labs/new") == 3
    assert registry.owner(1) is None and registry.owner(3) == Path("/labs/new")
    assert registry.claimed_ids() == [0, 2, 3]


def test_a_workspace_whose_lab_comes_up_again_gets_its_id_back() -> None:
    """Its fleet's inventory still holds the addresses the id gave its hosts."""
    assert [_claim_next(f"/labs/{n}") for n in range(3)] == [0, 1, 2]
    registry.release(1)
    registry.release(2)
    assert registry.free_id(set(), Path("/labs/1")) == 1
    assert registry.free_id(set(), Path("/labs/2")) == 2
    assert registry.free_id(set(), Path("/labs/new")) == 3


def test_once_every_free_id_was_let_go_of_a_new_lab_goes_on_round() -> None:
    for lab_id in range(registry.MAX_LABS):
        registry.claim(lab_id, Path(f"/labs/{lab_id}"))
    for lab_id in (5, 9):
        registry.release(lab_id)
    registry.claim(7, Path("/labs/7"))  # the last one claimed: the round goes on after it
    assert registry.free_id(set(), Path("/labs/new")) == 9
    assert registry.free_id(set(), Path("/labs/5")) == 5


def test_ids_wrap_round_and_skip_those_held() -> None:
    registry.claim(1, Path("/labs/held"))
    registry.claim(registry.MAX_LABS - 1, Path("/labs/last"))
    assert _claim_next("/labs/a") == 0
    assert _claim_next("/labs/b") == 2
    assert registry.free_id({3, 4}) == 5


def test_an_unreadable_record_of_the_last_claim_starts_from_zero() -> None:
    (registry.REGISTRY / ".last-claimed").write_text("../../etc\n")
    assert registry.free_id(set()) == 0


def test_all_ids_held_is_an_error_naming_the_fix() -> None:
    for lab_id in range(registry.MAX_LABS):
        registry.claim(lab_id, Path(f"/labs/{lab_id}"))
    with pytest.raises(EnvironmentProblem, match="in use") as raised:
        registry.free_id(set())
    assert "pdctl lab down" in str(raised.value.hint)
