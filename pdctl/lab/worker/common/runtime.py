"""What a running stand-in keeps (standard library only): its start and warm-up, the lab's
state file, the drain flag, its in-flight generations and their counts, its capacity."""

from __future__ import annotations

import threading
import time
from collections import deque

from . import settings
from .capacity import Capacity, Rates

THROUGHPUT_WINDOW_SECS = 10.0


class Runtime:
    def __init__(self, state: settings.StateFile, warmup_secs: float, capacity: Capacity) -> None:
        self.state = state
        self.warmup_secs = warmup_secs
        self.capacity = capacity
        self.started = time.monotonic()
        self._cond = threading.Condition()
        self._draining = False
        self.inflight = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._recent: deque[tuple[float, int]] = deque()

    @property
    def draining(self) -> bool:
        return self._draining

    def warm(self) -> bool:
        return time.monotonic() - self.started >= self.warmup_secs

    def healthy(self) -> bool:
        if self._draining or not self.warm():
            return False
        return not settings.unhealthy(self.state.read())

    def latency_secs(self) -> float:
        return settings.latency_secs(self.state.read())

    def rates(self) -> Rates:
        return settings.rates(self.state.read())

    def load(self) -> tuple[int, int]:
        """(running, queued) generations: queued ones wait for the prefill slot."""
        _, queued = self.capacity.prefill.load()
        queued = min(queued, self.inflight)
        return self.inflight - queued, queued

    def begin(self) -> bool:
        """Admit one generation; False once draining."""
        with self._cond:
            if self._draining:
                return False
            self.inflight += 1
            self.requests_total += 1
            return True

    def record(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Count a finished answer's tokens. Called before the answer's last bytes go out, as
        SGLang's tokenizer manager counts a request (collect_metrics) in the same step that
        wakes the HTTP handler to send it: a client that has its whole answer sees it counted."""
        with self._cond:
            self.prompt_tokens_total += prompt_tokens
            self.generation_tokens_total += completion_tokens
            self._recent.append((time.monotonic(), completion_tokens))

    def end(self) -> None:
        """One generation left (answered, refused or aborted)."""
        with self._cond:
            self.inflight -= 1
            self._cond.notify_all()

    def start_draining(self) -> int:
        """Admit no more generations; the number still in flight."""
        with self._cond:
            self._draining = True
            return self.inflight

    def wait_idle(self) -> None:
        with self._cond:
            while self.inflight:
                self._cond.wait()

    def gen_throughput(self) -> float:
        """Generated tokens per second over the last few seconds."""
        horizon = time.monotonic() - THROUGHPUT_WINDOW_SECS
        with self._cond:
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            tokens = sum(count for _, count in self._recent)
        return round(tokens / THROUGHPUT_WINDOW_SECS, 2)
