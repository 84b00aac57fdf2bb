"""The GPU budget's ledger: who gets the last GPUs, what a dead scaler leaves, and its file's
lock (real flock, real processes)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdctl.onhost import bundle
from pdctl.onhost.gpu_ledger import (
    RESERVE_FOR,
    Answer,
    Ask,
    Ledger,
    draw,
    live_for,
    load,
    pressure,
    release,
)
from pdctl.onhost.gpu_ledger_file import LedgerBusy, peek, transact


def ask(
    service: str,
    using: int,
    wants: dict[str, tuple[int, int, float]] | None = None,
    budget: int = 8,
    interval: float = 2.0,
) -> Ask:
    return Ask(service, budget, using, interval, wants or {})


def run(ledger: Ledger, request: Ask, now: float) -> tuple[Ledger, Answer]:
    """One draw, and the ledger back through its JSON (as every draw goes through the file)."""
    new, answer = draw(ledger, request, now)
    again, note = load(json.loads(json.dumps(new.to_dict())))
    assert note == ""
    return again, answer


def test_a_lone_service_is_granted_at_once_within_the_budget() -> None:
    ledger, answer = run(Ledger(), ask("a", 4, {"decode": (4, 4, 1.5)}), 100.0)
    assert answer.grants["decode"].gpus == 4 and answer.grants["decode"].reason == ""
    assert answer.used == 8 and answer.holders == {"a": 8}
    ledger, answer = run(ledger, ask("a", 8, {"decode": (4, 4, 1.5)}), 102.0)
    assert answer.grants["decode"].gpus == 0
    assert "4 more GPU(s) wanted, 0 granted; 8 in the budget, held: a 8" in (
        answer.grants["decode"].reason
    )


def test_two_services_budget_for_one_the_furthest_from_its_slo_gets_it() -> None:
    """a asks first but is nearer its target; b, asking a moment later, is 2x over: b gets
    the one replica the budget has room for, a is refused and told why. A contested want
    waits until every other live scaler has reported once since it was made."""
    ledger = Ledger()
    ledger, _ = run(ledger, ask("a", 2), 99.0)
    ledger, _ = run(ledger, ask("b", 2), 99.5)
    ledger, first = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.2)}), 100.0)
    assert first.grants["prefill"].gpus == 0
    assert "waiting one tick for b" in first.grants["prefill"].reason
    ledger, for_b = run(ledger, ask("b", 2, {"decode": (4, 4, 2.0)}), 100.5)
    assert for_b.grants["decode"].gpus == 0 and "waiting one tick for a" in (
        for_b.grants["decode"].reason
    )
    ledger, for_a = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.2)}), 102.0)
    assert for_a.grants["prefill"].gpus == 0
    assert "ahead of it: b/decode (2.00x its target)" in for_a.grants["prefill"].reason
    ledger, for_b = run(ledger, ask("b", 2, {"decode": (4, 4, 2.0)}), 102.5)
    assert for_b.grants["decode"].gpus == 4 and for_b.used == 8
    ledger, for_a = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.2)}), 104.0)
    assert for_a.grants["prefill"].gpus == 0
    assert "0 granted; 8 in the budget, held: a 2, b 6" in for_a.grants["prefill"].reason
    # b's scaler reports the replica it started: the grant became use, nothing more is free.
    ledger, _ = run(ledger, ask("b", 6), 104.5)
    ledger, for_a = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.2)}), 106.0)
    assert for_a.grants["prefill"].gpus == 0 and for_a.used == 8


def test_the_first_to_ask_wins_when_both_are_as_far_from_their_slo() -> None:
    ledger = Ledger()
    ledger, _ = run(ledger, ask("a", 2), 99.0)
    ledger, _ = run(ledger, ask("b", 2), 99.5)
    ledger, _ = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.5)}), 100.0)
    ledger, for_b = run(ledger, ask("b", 2, {"decode": (4, 4, 1.5)}), 100.5)
    assert for_b.grants["decode"].gpus == 0
    ledger, for_a = run(ledger, ask("a", 2, {"prefill": (4, 4, 1.5)}), 102.0)
    assert for_a.grants["prefill"].gpus == 4
    ledger, for_b = run(ledger, ask("b", 2, {"decode": (4, 4, 1.5)}), 102.5)
    assert for_b.grants["decode"].gpus == 0 and "held: a 6, b 2" in for_b.grants["decode"].reason


def test_grants_are_whole_replicas_and_a_big_want_does_not_block_a_small_one() -> None:
    ledger, _ = run(Ledger(), ask("a", 4, budget=10), 99.0)
    ledger, _ = run(ledger, ask("b", 2, budget=10), 99.5)
    # a (further from its SLO) wants two 4-GPU replicas; 4 GPUs are free: it gets one.
    ledger, _ = run(ledger, ask("a", 4, {"decode": (8, 4, 3.0)}, budget=10), 100.0)
    ledger, _ = run(ledger, ask("b", 2, {"prefill": (2, 2, 1.1)}, budget=10), 100.5)
    ledger, for_a = run(ledger, ask("a", 4, {"decode": (8, 4, 3.0)}, budget=10), 102.0)
    assert for_a.grants["decode"].gpus == 4
    assert "8 more GPU(s) wanted, 4 granted" in for_a.grants["decode"].reason
    # an 8-GPU replica cannot fit in what is left: the 2-GPU want behind it is not held up.
    ledger, _ = run(ledger, ask("a", 8, {"decode": (8, 8, 3.0)}, budget=12), 103.0)
    ledger, for_b = run(ledger, ask("b", 2, {"prefill": (2, 2, 1.1)}, budget=12), 103.5)
    assert for_b.grants["prefill"].gpus == 2


def test_a_dead_scalers_wants_lapse_but_its_gpus_stay_counted() -> None:
    ledger, _ = run(Ledger(), ask("a", 4), 100.0)
    ledger, answer = run(ledger, ask("b", 2, {"decode": (2, 2, 5.0)}), 100.5)
    assert "waiting one tick for a" in answer.grants["decode"].reason
    # b's scaler dies with its want standing: while it is live, the want ranks first.
    ledger, for_a = run(ledger, ask("a", 4, {"prefill": (2, 2, 1.1)}), 101.0)
    assert for_a.grants["prefill"].gpus == 0 and "ahead of it: b/decode" in (
        for_a.grants["prefill"].reason
    )
    later = 100.5 + live_for(2.0) + 1
    ledger, for_a = run(ledger, ask("a", 4, {"prefill": (2, 2, 1.1)}), later)
    assert for_a.grants["prefill"].gpus == 2  # b's want lapsed with its scaler
    assert for_a.holders == {"a": 6, "b": 2}  # b's replicas still run


def test_an_unreported_grant_is_released_after_its_deadline() -> None:
    ledger, answer = run(Ledger(), ask("a", 4, {"decode": (4, 4, 2.0)}), 100.0)
    assert answer.grants["decode"].gpus == 4
    ledger, view = run(ledger, ask("b", 0), 101.0)
    assert view.holders["a"] == 8  # reserved: a is starting it
    ledger, view = run(ledger, ask("b", 0), 100.0 + RESERVE_FOR + 1)
    assert view.holders["a"] == 4  # a never reported it running: released


def test_a_lowered_budget_holds_at_once() -> None:
    ledger, _ = run(Ledger(), ask("a", 4, budget=16), 100.0)
    ledger, answer = run(ledger, ask("b", 2, {"decode": (4, 4, 2.0)}, budget=8), 100.5)
    assert answer.budget == 8
    ledger, answer = run(ledger, ask("a", 4, {"x": (4, 4, 2.0)}, budget=16), 101.0)
    assert answer.budget == 8


def test_release_forgets_a_destroyed_service() -> None:
    ledger, _ = run(Ledger(), ask("a", 4), 100.0)
    ledger, _ = run(ledger, ask("b", 4), 100.0)
    assert set(release(ledger, "a").services) == {"b"}


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"version": 2, "services": {}},
        {"version": 1},
        {"version": 1, "services": {"a": {"using": "4"}}},
        {"version": 1, "services": {"a": {"using": -1, "at": 1, "interval": 2, "budget": 8}}},
        {"version": 1, "services": {"a": {"using": 1e30, "at": 1, "interval": 2, "budget": 8}}},
    ],
)
def test_a_ledger_that_is_not_one_is_started_afresh(doc: object) -> None:
    ledger, note = load(doc)
    assert ledger.services == {} and note


def test_a_bad_want_is_dropped_and_the_entry_kept() -> None:
    raw = {"using": 2, "at": 1.0, "interval": 2.0, "budget": 8, "wants": {"x": {"gpus": True}}}
    ledger, note = load({"version": 1, "services": {"a": raw}})
    assert ledger.services["a"].using == 2 and ledger.services["a"].wants == {} and note == ""


def test_pressure_is_the_distance_from_the_target() -> None:
    assert pressure("ttft", 0.6, 0.4, 2) == pytest.approx(1.5)
    assert pressure("rps", 9.0, 2.0, 3) == pytest.approx(1.5)
    assert pressure("itl", None, 0.06, 1) == 0.0
    assert pressure("rps", 3.0, float("inf"), 1) == 0.0


# --------------------------------------------------------------------------- the file and lock


def test_transactions_read_and_write_the_file(tmp_path: Path) -> None:
    path = tmp_path / "budget" / "lab.json"
    answer, note = transact(path, lambda ledger: draw(ledger, ask("a", 4, {"d": (4, 4, 1)}), 1))
    assert answer.grants["d"].gpus == 4 and note == ""
    assert json.loads(path.read_text())["services"]["a"]["using"] == 4
    ledger, _ = peek(path)
    assert ledger.services["a"].reserved == 4
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_corrupt_file_starts_afresh_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "lab.json"
    path.write_text("{not json")
    answer, note = transact(path, lambda ledger: draw(ledger, ask("a", 2), 1))
    assert answer.holders == {"a": 2} and "not JSON" in note


def _hold_lock(path: str, ready: multiprocessing.synchronize.Event) -> None:
    def stuck(ledger: Ledger) -> tuple[Ledger, None]:
        ready.set()
        time.sleep(60)  # a scaler stopped mid-transaction
        return ledger, None

    transact(Path(path), stuck)


def test_a_held_lock_refuses_within_the_deadline_and_is_freed_when_its_holder_dies(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lab.json"
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    holder = context.Process(target=_hold_lock, args=(str(path), ready), daemon=True)
    holder.start()
    try:
        assert ready.wait(20)
        started = time.monotonic()
        with pytest.raises(LedgerBusy, match=r"held for more than 0\.5 s"):
            transact(path, lambda ledger: draw(ledger, ask("a", 2), 1), timeout=0.5)
        assert time.monotonic() - started < 5
    finally:
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
    answer, _ = transact(path, lambda ledger: draw(ledger, ask("a", 2), 1), timeout=5)
    assert answer.holders == {"a": 2}


def test_a_symlinked_ledger_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    path = tmp_path / "lab.json"
    (tmp_path / ".lab.json.tmp").symlink_to(target)
    with pytest.raises(OSError):
        transact(path, lambda ledger: draw(ledger, ask("a", 2), 1))
    assert target.read_text() == "keep"


# --------------------------------------------------------------------------- release, on the host


def run_entry(params: dict[str, object], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """The entry as `pdctl destroy` runs it on the router host: the loader and the bundle,
    then the parameters, on stdin of a plain python3 (here this one), from an empty directory."""
    entry = "pdctl.onhost.gpu_ledger_file"
    return subprocess.run(
        bundle.argv(entry, python=sys.executable),
        input=bundle.stdin(entry) + json.dumps(params).encode(),
        capture_output=True,
        cwd=cwd,
        check=False,
        timeout=60,
    )


def test_destroy_releases_the_services_gpus_through_the_bundle(tmp_path: Path) -> None:
    path = tmp_path / "_gpu-budget" / "lab.json"
    transact(path, lambda ledger: draw(ledger, ask("a", 4, {"d": (4, 4, 1.0)}), 1.0))
    transact(path, lambda ledger: draw(ledger, ask("b", 8), 1.0))
    empty = tmp_path / "cwd"
    empty.mkdir()
    proc = run_entry({"path": str(path), "release": "a"}, empty)
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout) == {"released": "a", "held": 8, "note": ""}  # 4 + 4 granted
    ledger, _ = peek(path)
    assert set(ledger.services) == {"b"}
    again = run_entry({"path": str(tmp_path / "none" / "lab.json"), "release": "a"}, empty)
    assert json.loads(again.stdout) == {"released": "a", "held": None}


@pytest.mark.parametrize(
    "params",
    [
        {"path": "/etc/passwd", "release": "a"},
        {"path": "/var/lib/pdctl/_gpu-budget/../x.json", "release": "a"},
        {"path": "relative/lab.json", "release": "a"},
        {"path": "/var/lib/pdctl/_gpu-budget/lab.json", "release": "A; rm -rf /"},
    ],
)
def test_the_release_takes_only_a_ledgers_path_and_a_service_name(
    params: dict[str, object], tmp_path: Path
) -> None:
    proc = run_entry(params, tmp_path)
    assert proc.returncode != 0 and b"not a" in proc.stderr
