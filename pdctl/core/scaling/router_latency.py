"""A gRPC service's latency signals, from its router's own histograms (PURE: text in, seconds out).

A gRPC worker (vLLM; SGLang in --grpc-mode) serves no HTTP /metrics, so its TTFT and
inter-token latency are read where they are measured: at SMG, which in gRPC P/D mode exports
(docs/facts.md, "SMG's metrics in gRPC mode"; seen on SMG 1.13.0):

- ``smg_router_ttft_seconds``: the client's time to first token, observed on streamed requests
  only (a request that is not streamed has no first token the router sees);
- ``smg_pd_prefill_duration_seconds``: the prefill leg of every P/D request: the part of a
  TTFT a prefill replica moves (its queue and its prompt work);
- ``smg_router_tpot_seconds``: a streamed request's time per output token.

The prefill group's ``ttft`` is the prefill leg's: the prefill worker's own time to its first
token as SMG measures it on every request (its queue and its prompt work, what a prefill
replica moves), as an HTTP SGLang group's is its workers' own histogram; the client's TTFT
(``smg_router_ttft_seconds``, streamed requests only, which the decode's first token and the KV
transfer add to) stands in only where the router exports no prefill leg. The decode group's
``itl`` is the TPOT while at least half the window's requests were streamed
(``STREAMED_SHARE``: its percentile then speaks for the traffic), else the router's mean
seconds per output token over the window: what its requests spent after their prefill leg
(``smg_router_request_duration_seconds`` less ``smg_pd_prefill_duration_seconds``, their sums)
over the tokens they produced (``smg_router_tokens_total{token_type="output"}``); a mean, not a
percentile, but measured on every request. That mean is blind to streams (SMG ends a stream's
request duration at its first chunk, and observes its TPOT when it ends): under a growing
backlog of streams, few end in a window, and the mean reads about 0. So when some streams did
end, the larger of their TPOT percentile and the mean is the ``itl``.

The histograms are per router, not per replica: each router's bucket increases between this
process's scrapes, summed over the routers (one today; several behind a mesh), then
Prometheus's histogram_quantile (observe.py).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from pdctl.core.scaling.observe import (
    Buckets,
    LatencyWindow,
    Totals,
    histograms,
    in_window,
    quantile,
    spans,
    totals,
)

CLIENT_TTFT = "smg_router_ttft_seconds"
PREFILL_LEG = "smg_pd_prefill_duration_seconds"
CLIENT_TPOT = "smg_router_tpot_seconds"
ROUTER_HISTOGRAMS = (CLIENT_TTFT, PREFILL_LEG, CLIENT_TPOT)
# The sums and counters the decode fallback divides: (family, sample, labels).
TOTALS = {
    "request_seconds": (
        "smg_router_request_duration_seconds",
        "smg_router_request_duration_seconds_sum",
        {},
    ),
    "prefill_seconds": (PREFILL_LEG, f"{PREFILL_LEG}_sum", {}),
    "output_tokens": ("smg_router_tokens", "smg_router_tokens_total", {"token_type": "output"}),
}
# The share of a window's requests that must be streamed for the client's own measurement
# (TTFT, TPOT) to stand for the traffic.
STREAMED_SHARE = 0.5


@dataclass(frozen=True)
class Reading:
    """A latency signal: its value in seconds (0.0: no request in the window; None: missing)
    and where it came from, for the decision's log line and the operator."""

    value: float | None
    source: str


def _count(buckets: Buckets | None) -> float:
    return 0.0 if not buckets else max(buckets.values(), default=0.0)


@dataclass
class RouterLatency:
    """The router histograms' windows, fed with each scrape of each router."""

    window: float = 60.0
    min_span: float = 5.0
    windows: dict[str, LatencyWindow] = field(default_factory=dict)
    sums: dict[str, deque[tuple[float, Totals]]] = field(default_factory=dict)
    legs_seen: bool = False  # the router exports the prefill leg (a P/D router does)

    def __post_init__(self) -> None:
        for name in ROUTER_HISTOGRAMS:
            self.windows.setdefault(name, LatencyWindow(self.window, self.min_span))

    def add(self, router: str, at: float, text: str) -> bool:
        """One scrape of ``router``'s metrics text; False when it is not Prometheus text."""
        found = histograms(text, ROUTER_HISTOGRAMS)
        counted = totals(text, TOTALS)
        if found is None or counted is None:
            return False
        for name, buckets in found.items():
            self.windows[name].add(router, at, buckets)
        self.legs_seen = self.legs_seen or bool(found[PREFILL_LEG])
        samples = self.sums.setdefault(router, deque())
        if not samples or at > samples[-1][0]:
            samples.append((at, counted))
            while len(samples) > 2 and samples[1][0] <= at - self.window:
                samples.popleft()
        return True

    def forget(self, keep: set[str]) -> None:
        for window in self.windows.values():
            window.forget(keep)
        for router in set(self.sums) - keep:
            del self.sums[router]

    def _increase(self, routers: set[str], now: float, stale_after: float) -> Totals | None:
        """Each total's increase over the window, summed over ``routers`` (a total that went
        down: the router restarted, and all it counted since is new); None when one router
        has no fresh scrape or none covers ``min_span``."""
        found: Totals = dict.fromkeys(TOTALS, 0.0)
        covered = False
        for router in routers:
            samples = self.sums.get(router)
            if not samples or now - samples[-1][0] > stale_after:
                return None
            points = in_window(samples, now - self.window)
            covered = covered or spans(points, self.min_span)
            for (_, before), (_, after) in itertools.pairwise(points):
                for name in TOTALS:
                    old, new = before.get(name, 0.0), after.get(name, 0.0)
                    found[name] += new - old if new >= old else new
        return found if covered else None

    def _observed(
        self, name: str, routers: set[str], now: float, stale_after: float
    ) -> Buckets | None:
        return self.windows[name].observed(routers, now, stale_after)

    def ttft(self, routers: set[str], q: float, now: float, stale_after: float) -> Reading:
        """The prefill group's TTFT percentile over the window: the prefill leg's, else (a
        router without it) the client's."""
        leg = self._observed(PREFILL_LEG, routers, now, stale_after)
        client = self._observed(CLIENT_TTFT, routers, now, stale_after)
        if leg is None and client is None:
            return Reading(None, "no fresh router metrics")
        requests, streamed = _count(leg), _count(client)
        if leg and requests > 0:
            return _reading(leg, q, f"{PREFILL_LEG} ({requests:.0f} requests)")
        if client and streamed > 0 and not self.legs_seen:
            return _reading(client, q, f"{CLIENT_TTFT} ({streamed:.0f} streamed)")
        if requests <= 0 and streamed <= 0:
            return Reading(0.0, "no request in the window")
        return Reading(None, "streamed requests but no prefill leg in the window")

    def tpot(self, routers: set[str], q: float, now: float, stale_after: float) -> Reading:
        """The decode group's time per output token over the window; None (with why) when too
        few requests were streamed for the router to have measured it."""
        client = self._observed(CLIENT_TPOT, routers, now, stale_after)
        leg = self._observed(PREFILL_LEG, routers, now, stale_after)
        if client is None:
            return Reading(None, "no fresh router metrics")
        streamed, requests = _count(client), _count(leg)
        if streamed <= 0 and requests <= 0:
            return Reading(0.0, "no request in the window")
        if streamed > 0 and streamed >= STREAMED_SHARE * requests:
            return _reading(client, q, f"{CLIENT_TPOT} ({streamed:.0f} streamed)")
        mean = self._mean_per_token(routers, now, stale_after, streamed, requests)
        if streamed <= 0:
            return mean
        # A stream's duration ends at its first chunk, so the mean misses its decoding; the few
        # streams that ended do measure the same decode pool: the larger of the two stands.
        few = _reading(client, q, f"{CLIENT_TPOT} ({streamed:.0f} of {requests:.0f} streamed)")
        if few.value is None or (mean.value is not None and mean.value >= few.value):
            return mean
        return few

    def _mean_per_token(
        self, routers: set[str], now: float, stale_after: float, streamed: float, requests: float
    ) -> Reading:
        few = f"{streamed:.0f} of {requests:.0f} requests streamed"
        grown = self._increase(routers, now, stale_after)
        if grown is None:
            return Reading(None, f"{few}; no fresh router totals")
        tokens = grown["output_tokens"]
        decoding = grown["request_seconds"] - grown["prefill_seconds"]
        if tokens <= 0:
            return Reading(None, f"{few}; no output token counted in the window")
        return Reading(
            max(0.0, decoding) / tokens,
            f"the router's mean seconds per output token ({tokens:.0f} tokens; {few})",
        )


def _reading(buckets: Buckets, q: float, source: str) -> Reading:
    value = quantile(q, buckets)
    if value is None or not math.isfinite(value):
        return Reading(None, f"{source}: no percentile")
    return Reading(value, source)
