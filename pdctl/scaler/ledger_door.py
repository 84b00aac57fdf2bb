"""How a scaler reaches its fleet's GPU ledger (pdctl/onhost/gpu_ledger.py decides, and
gpu_ledger_file.py keeps it in a file under a lock): on the router host it runs on, or, for
`pdctl scaler advise` from the control node, read over SSH and only looked at."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdctl.core.errors import HostError
from pdctl.onhost.gpu_ledger import Answer, Ask, draw, load
from pdctl.onhost.gpu_ledger_file import LOCK_TIMEOUT, peek, transact


@dataclass(frozen=True)
class LedgerDoor:
    """How a scaler reaches its fleet's ledger: ``draw`` (report, ask, take what is granted,
    under the lock) or ``look`` (the answer a draw would get now; nothing written: advice)."""

    draw: Callable[[Ask, float], tuple[Answer, str]]
    look: Callable[[Ask, float], tuple[Answer, str]]


def local(path: Path, timeout: float = LOCK_TIMEOUT) -> LedgerDoor:
    """The ledger in a file on this host (the router host the budgeted scalers run on)."""

    def take(ask: Ask, now: float) -> tuple[Answer, str]:
        return transact(path, lambda ledger: draw(ledger, ask, now), timeout=timeout)

    def look(ask: Ask, now: float) -> tuple[Answer, str]:
        ledger, note = peek(path)
        return draw(ledger, ask, now)[1], note

    return LedgerDoor(take, look)


def read_only(read: Callable[[], str | None]) -> LedgerDoor:
    """A ledger read from elsewhere (over SSH, for `pdctl scaler advise`): look only."""

    def look(ask: Ask, now: float) -> tuple[Answer, str]:
        text = read()
        try:
            doc = json.loads(text) if text else None
        except ValueError:
            doc = None
        ledger, note = load(doc)
        return draw(ledger, ask, now)[1], note

    def refuse(ask: Ask, now: float) -> tuple[Answer, str]:
        raise HostError("this scaler only looks at the GPU ledger: it may not draw from it")

    return LedgerDoor(refuse, look)
