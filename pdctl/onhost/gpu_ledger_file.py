"""The GPU ledger's file and lock on the host the budgeted scalers run on (gpu_ledger.py decides).

One transaction: take the lock (``flock`` on a file beside the ledger) within a deadline, read
the ledger, apply one operation, write it back atomically (a temporary file renamed over it),
let go. Scalers hold the lock for a read and a write of a small file; one that cannot get it
in time gets LedgerBusy and refuses its scale-outs for that tick (its other work goes on): a
scaler stopped while holding it (SIGSTOP) keeps the others from growing, never from ticking,
and the kernel releases the lock the moment that process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from pdctl.onhost.gpu_ledger import Ledger, load, release

LOCK_TIMEOUT = 2.0  # what a tick waits for the lock at most
MAX_BYTES = 1 << 20  # a ledger of hundreds of services is a few tens of KB

T = TypeVar("T")


class LedgerBusy(Exception):
    """The lock was not free within the deadline."""


@contextlib.contextmanager
def _locked(lock: Path, timeout: float) -> Iterator[None]:
    lock.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LedgerBusy(
                        f"the GPU ledger's lock {lock} was held for more than {timeout:g} s "
                        "(another scaler holds it, stopped mid-transaction?): scale-outs wait "
                        "until it lets go"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _read(path: Path) -> tuple[object, str]:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None, ""
    if len(data) > MAX_BYTES:
        return None, f"{path} is larger than {MAX_BYTES} bytes: started afresh"
    try:
        return json.loads(data), ""
    except ValueError:
        return None, f"{path} is not JSON: started afresh"


def _write(path: Path, ledger: Ledger) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(ledger.to_dict(), handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def transact(
    path: Path,
    operation: Callable[[Ledger], tuple[Ledger, T]],
    *,
    timeout: float = LOCK_TIMEOUT,
) -> tuple[T, str]:
    """Apply ``operation`` to the ledger at ``path`` under its lock; its result, and a note
    when the file was unusable (the ledger then starts afresh: every scaler reports again)."""
    with _locked(path.with_suffix(".lock"), timeout):
        doc, problem = _read(path)
        ledger, note = load(doc)
        new, result = operation(ledger)
        _write(path, new)
    return result, problem or note


def peek(path: Path) -> tuple[Ledger, str]:
    """The ledger as it stands, without the lock (for status: a moment's view)."""
    doc, problem = _read(path)
    ledger, note = load(doc)
    return ledger, problem or note


_LEDGER = re.compile(r"^(/[A-Za-z0-9_.+-]+)+/[a-z0-9][a-z0-9_-]{0,62}\.json$")


def main(text: str) -> None:
    """On the ledger's host (pdctl destroy, through the bundle): ``{"path": P, "release": S}``
    takes service S's GPUs and wants out of the ledger at P; prints what it held."""
    params = json.loads(text)
    path, service = params.get("path"), params.get("release")
    if not isinstance(path, str) or not _LEDGER.match(path) or "/../" in path:
        raise SystemExit(f"not a GPU ledger's path: {path!r}")
    if not isinstance(service, str) or not re.fullmatch(r"[a-z][a-z0-9-]{0,39}", service):
        raise SystemExit(f"not a service name: {service!r}")
    if not Path(path).exists():
        print(json.dumps({"released": service, "held": None}))
        return

    def forget(ledger: Ledger) -> tuple[Ledger, int | None]:
        entry = ledger.services.get(service)
        return release(ledger, service), (entry.using + entry.reserved if entry else None)

    held, note = transact(Path(path), forget, timeout=10.0)
    print(json.dumps({"released": service, "held": held, "note": note}))


if __name__ == "__main__":
    main(sys.stdin.read())
