"""Calls that may hang (a host that stopped answering, a worker that froze), run side by side.

Each call runs on its own thread. A caller waits for the ones it needs until its own deadline
and goes on with what answered: a call still running past it is "no answer", and keeps running
until its own timeout ends it (every SSH command and HTTP request has one). At most one call
per key is in flight: asking again while one runs joins it instead of piling up threads on a
host that does not answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True)
class Answer(Generic[T]):
    """A call's outcome by a deadline: its value, its error, or neither (no answer yet)."""

    value: T | None = None
    error: BaseException | None = None
    answered: bool = False

    @property
    def ok(self) -> bool:
        return self.answered and self.error is None


class Calls:
    """A thread per call, keyed; see the module's docstring."""

    def __init__(self, name: str, max_workers: int = 64) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
        self._inflight: dict[str, Future[object]] = {}

    def submit(self, key: str, work: Callable[[], T]) -> Future[T]:
        """Start ``work`` unless a call under ``key`` is still held: one running (joined), or
        one that finished after its caller stopped waiting and was not forgotten since (its
        answer is handed out now, fresher than a new call's could be by the deadline)."""
        held = self._inflight.get(key)
        if held is not None:
            return held  # type: ignore[return-value]
        future = self._pool.submit(work)
        self._inflight[key] = future  # type: ignore[assignment]
        return future

    def forget(self, key: str) -> None:
        """The call's answer was used: the next submit() under ``key`` starts a new one."""
        held = self._inflight.get(key)
        if held is not None and held.done():
            del self._inflight[key]

    def busy(self, key: str) -> bool:
        running = self._inflight.get(key)
        return running is not None and not running.done()

    def done(self) -> dict[str, Future[object]]:
        """The finished calls, forgotten here (each is handed out once)."""
        finished = {key: f for key, f in self._inflight.items() if f.done()}
        for key in finished:
            del self._inflight[key]
        return finished

    def running(self) -> list[Future[object]]:
        return [f for f in self._inflight.values() if not f.done()]

    def shutdown(self, wait_for: float = 0.0) -> None:
        """Stop taking calls; wait up to ``wait_for`` seconds for those running (a thread stuck
        on a dead host is left to its own timeout: the process does not wait on it)."""
        if wait_for > 0:
            wait_futures(self.running(), timeout=wait_for)
        self._pool.shutdown(wait=False, cancel_futures=True)


def gather(futures: Mapping[K, Future[T]], deadline: float) -> dict[K, Answer[T]]:
    """Each future's answer by ``deadline`` (time.monotonic()); those still running: no
    answer."""
    wait_futures(list(futures.values()), timeout=max(0.0, deadline - time.monotonic()))
    found: dict[K, Answer[T]] = {}
    for key, future in futures.items():
        if not future.done():
            found[key] = Answer()
        elif future.exception() is not None:
            found[key] = Answer(error=future.exception(), answered=True)
        else:
            found[key] = Answer(value=future.result(), answered=True)
    return found
