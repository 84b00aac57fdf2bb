"""The stand-in's finite capacity: its slots, the pace of each request's tokens, a decode's
wait for its prefill's KV hand-off, and the latency histograms it exports (standard library
only).

Why: a scaler that sizes prefill on TTFT and decode on inter-token latency can only be tested
against workers whose latencies respond to load. The model is deliberately simple:

* one prefill slot processes prompt tokens at ``prefill_tokens_per_s``, one request at a time
  in arrival order, so a request's TTFT is its wait behind earlier prompts plus its own;
* one decode slot produces ``decode_tokens_per_s`` shared by its concurrent streams, so each
  stream's inter-token latency is ``max(floor, streams / decode_tokens_per_s)``.

Histogram names and default bucket bounds are SGLang's own (docs/facts.md, SGLang workers,
Metrics).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import quote

# SGLang's TokenizerMetricsCollector default buckets (docs/facts.md).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
    0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
    1200, 1800, 2400,
)  # fmt: skip

DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
DEFAULT_DECODE_TOKENS_PER_S = 400.0
DEFAULT_DECODE_TOKEN_FLOOR_MS = 10.0
# How long a decode waits for its prefill's request to reach the prefill worker (the router
# sends both legs at once), and for that prefill to finish, before it decodes anyway.
KV_ARRIVAL_GRACE_SECS = 2.0
KV_WAIT_LIMIT_SECS = 300.0  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT's default (docs/facts.md)
ROOMS_KEPT = 4096
THROUGHPUT_WINDOW_SECS = 10.0  # the span gen_throughput averages over


@dataclass(frozen=True)
class Rates:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_floor_s: float

    def itl(self, streams: int) -> float:
        """Seconds between two tokens of one stream while ``streams`` share the decode slot."""
        rate = self.decode_tokens_per_s
        shared = max(1, streams) / rate if rate > 0 else 0.0
        return max(self.decode_floor_s, shared)


class PrefillSlot:
    """One request at a time, in arrival order, booked in monotonic time: a request's prefill
    starts when the previous one ends, so the queue needs no thread of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._booked: list[tuple[float, float, int]] = []  # start, end, prompt tokens

    def book(self, tokens: int, tokens_per_s: float) -> tuple[float, float]:
        """(start, end) of a prefill of ``tokens`` arriving now."""
        work = tokens / tokens_per_s if tokens_per_s > 0 else 0.0
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            end = start + work
            self._free_at = end
            self._booked.append((start, end, tokens))
            return start, end

    def _pending(self, now: float) -> list[tuple[float, float, int]]:
        self._booked = [b for b in self._booked if b[1] > now]
        return self._booked

    def load(self) -> tuple[int, int]:
        """(running, queued) prefills now."""
        now = time.monotonic()
        with self._lock:
            pending = self._pending(now)
            running = sum(1 for start, _, _ in pending if start <= now)
            return running, len(pending) - running

    def queued_tokens(self) -> int:
        """Prompt tokens of the prefills still waiting for the slot (what vLLM's and SGLang's
        ``num_waiting_uncached_tokens`` count: this model has no prefix cache)."""
        now = time.monotonic()
        with self._lock:
            return sum(tokens for start, _, tokens in self._pending(now) if start > now)


class TokenRate:
    """Tokens generated per second over the last ``window`` seconds, counted as each token is
    produced (as an engine's scheduler reports ``gen_throughput``), not when answers end."""

    def __init__(self, window: float = THROUGHPUT_WINDOW_SECS) -> None:
        self.window = window
        self._lock = threading.Lock()
        self._seen: deque[tuple[float, int]] = deque()

    def add(self, tokens: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self._seen.append((now, tokens))
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._seen and self._seen[0][0] < now - self.window:
            self._seen.popleft()

    def per_second(self) -> float:
        with self._lock:
            self._prune(time.monotonic())
            return round(sum(n for _, n in self._seen) / self.window, 2)


class DecodeSlot:
    """Counts the streams that share the decode rate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.streams = 0

    def enter(self) -> None:
        with self._lock:
            self.streams += 1

    def leave(self) -> None:
        with self._lock:
            self.streams -= 1


class Histogram:
    """A Prometheus histogram: per-bucket counts, a sum and a count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self._lock = threading.Lock()
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def render(self, name: str, help_text: str, labels: str) -> list[str]:
        """The text exposition lines, buckets cumulative, ``le`` spelled as prometheus_client
        spells it (``1.0``, ``+Inf``)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), counts, strict=True):
            running += count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(running)}')
        lines.append(f"{name}_count{{{labels}}} {float(running)}")
        lines.append(f"{name}_sum{{{labels}}} {total}")
        return lines


class KvRooms:
    """The prefill's side of the KV hand-off: a decode may start once the prefill of its
    ``bootstrap_room`` has finished (as it waits for the KV cache in SGLang)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rooms: OrderedDict[str, bool] = OrderedDict()  # room -> prefill finished

    def arrived(self, room: str) -> None:
        with self._cond:
            self._rooms[room] = False
            while len(self._rooms) > ROOMS_KEPT:
                self._rooms.popitem(last=False)
            self._cond.notify_all()

    def finished(self, room: str) -> None:
        with self._cond:
            if room in self._rooms:
                self._rooms[room] = True
            self._cond.notify_all()

    def wait(self, room: str) -> str:
        """``ready`` once the room's prefill finished; ``unknown`` when no prefill request for it
        arrived within the grace period; ``timeout`` past the waiting limit."""
        arrival = time.monotonic() + KV_ARRIVAL_GRACE_SECS
        limit = time.monotonic() + KV_WAIT_LIMIT_SECS
        with self._cond:
            while True:
                done = self._rooms.get(room)
                if done:
                    return "ready"
                now = time.monotonic()
                if done is None and now >= arrival:
                    return "unknown"
                if now >= limit:
                    return "timeout"
                self._cond.wait(min(arrival if done is None else limit, limit) - now)


class Capacity:
    """One worker's slots, its KV rooms (a prefill's) and the latencies it records."""

    def __init__(
        self,
        ttft_buckets: tuple[float, ...] = TTFT_BUCKETS,
        itl_buckets: tuple[float, ...] = ITL_BUCKETS,
        e2e_buckets: tuple[float, ...] = E2E_BUCKETS,
    ) -> None:
        self.prefill = PrefillSlot()
        self.decode = DecodeSlot()
        self.rooms = KvRooms()
        self.ttft = Histogram(ttft_buckets)
        self.itl = Histogram(itl_buckets)
        self.e2e = Histogram(e2e_buckets)
        self.tokens = TokenRate()


def wait_for_kv(host: str, port: int, room: str) -> str:
    """Ask the prefill's bootstrap server to answer once the room's prefill has finished (the
    decode cannot start before the KV cache arrives): ``ready``, ``unknown``, ``timeout``, or
    the error that cut the wait short."""
    conn = http.client.HTTPConnection(host, port, timeout=KV_WAIT_LIMIT_SECS + 10)
    try:
        conn.request("GET", f"/kv?room={quote(room)}")
        reply = conn.getresponse()
        data = json.loads(reply.read() or b"{}")
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return f"error: {exc}"
    finally:
        conn.close()
    state = data.get("state") if isinstance(data, dict) else None
    return state if isinstance(state, str) else "error: no state in the answer"


@dataclass
class Pace:
    """When each token of one request is due, and the TTFT, ITL and end-to-end latencies it
    records. The first token follows the prompt's turn on the prefill slot (a decode worker
    instead waits for its prefill's KV hand-off, ``kv_from`` = bootstrap host, port, room);
    each later one the decode slot's share."""

    capacity: Capacity
    mode: str  # null, prefill or decode
    rates: Rates
    latency: float  # a fixed cost before the first token
    prompt_tokens: int
    kv_from: tuple[str, int, str] | None
    started: float
    warn: Callable[[str], None]
    last: float | None = field(default=None, init=False)
    decoding: bool = field(default=False, init=False)
    finished: bool = field(default=False, init=False)

    def token(self, index: int) -> None:
        """Wait until token ``index`` (0-based) of the answer is due."""
        if self.last is None:
            self._first()
        elif index > 0:
            self._next()

    def run(self, tokens: int) -> None:
        """The whole answer's time, for a reply that is not streamed."""
        self._first()
        for _ in range(1, tokens):
            self._next()

    def _first(self) -> None:
        time.sleep(self.latency)
        cap = self.capacity
        if self.mode == "decode":
            if self.kv_from is not None:
                outcome = wait_for_kv(*self.kv_from)
                if outcome != "ready":
                    self.warn(f"KV hand-off for room {self.kv_from[2]}: {outcome}; decoding anyway")
        else:
            _, end = cap.prefill.book(self.prompt_tokens, self.rates.prefill_tokens_per_s)
            time.sleep(max(0.0, end - time.monotonic()))
        self.last = time.monotonic()
        cap.ttft.observe(self.last - self.started)
        cap.tokens.add()
        if self.mode != "prefill":
            cap.decode.enter()
            self.decoding = True

    def _next(self) -> None:
        time.sleep(self.rates.itl(self.capacity.decode.streams))
        now = time.monotonic()
        if self.last is not None:
            self.capacity.itl.observe(now - self.last)
        self.capacity.tokens.add()
        self.last = now

    def finish(self) -> None:
        """The answer's last token is out of the engine: its end-to-end latency is recorded
        (before the client gets the end of the answer, as ``Runtime.record``)."""
        if not self.finished:
            self.finished = True
            self.capacity.e2e.observe(time.monotonic() - self.started)
        self.close()

    def close(self) -> None:
        """Leave the decode slot (an aborted answer records no end-to-end latency)."""
        if self.decoding:
            self.capacity.decode.leave()
            self.decoding = False
