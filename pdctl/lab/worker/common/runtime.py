"""What a running stand-in keeps (standard library only): its start and warm-up, the lab's
state file, the drain flag, its in-flight generations and their counts, its capacity."""

from __future__ import annotations

import threading
import time

from . import settings
from .capacity import Capacity, Rates

# The KV pool both engines report in their loads: a running request is said to hold this many
# tokens of it (the stand-ins keep no real KV cache).
MAX_TOTAL_NUM_TOKENS = 131072
TOKENS_PER_RUNNING_REQUEST = 512


def rank_share(total: int, ranks: int, rank: int) -> int:
    """DP rank ``rank``'s part of ``total`` spread over ``ranks`` (the first ones take the
    remainder), as an engine's ranks each report their own queue."""
    return total // ranks + (1 if rank < total % ranks else 0)


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
        """Generated tokens per second over the last few seconds, as they were produced."""
        return self.capacity.tokens.per_second()

    def token_usage(self, running: int | None = None) -> float:
        """Share of the KV pool the running requests are said to hold."""
        used = (self.inflight if running is None else running) * TOKENS_PER_RUNNING_REQUEST
        return round(min(1.0, used / MAX_TOTAL_NUM_TOKENS), 4)

    def queued_tokens(self) -> int:
        """Prompt tokens of the generations waiting for the prefill slot."""
        return self.capacity.prefill.queued_tokens()
