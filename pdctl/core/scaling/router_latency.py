"""A gRPC service's latency signals, from its router's own histograms (PURE: text in, seconds out).

A gRPC worker (vLLM; SGLang in --grpc-mode) serves no HTTP /metrics, so its TTFT and
inter-token latency are read where they are measured: at SMG, which in gRPC P/D mode exports
(docs/facts.md, "SMG's metrics in gRPC mode"; seen on SMG 1.13.0):

- ``smg_router_ttft_seconds``: the client's time to first token, observed on streamed requests
  only (a request that is not streamed has no first token the router sees);
- ``smg_pd_prefill_duration_seconds``: the prefill leg of every P/D request: the part of a
  TTFT a prefill replica moves (its queue and its prompt work);
- ``smg_router_tpot_seconds``: a streamed request's time per output token.

The prefill group's ``ttft`` is the client's TTFT while at least half the window's requests
were streamed (``STREAMED_SHARE``: its percentile then speaks for the traffic), else the prefill
leg's. The decode group's ``itl`` is the TPOT under the same condition, else None here: the
caller then takes the engines' own estimate (``EngineLoad.seconds_per_token``, from GetLoads).

The histograms are per router, not per replica: each router's bucket increases between this
process's scrapes, summed over the routers (one today; several behind a mesh), then
Prometheus's histogram_quantile (observe.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdctl.core.scaling.observe import Buckets, LatencyWindow, histograms, quantile

CLIENT_TTFT = "smg_router_ttft_seconds"
PREFILL_LEG = "smg_pd_prefill_duration_seconds"
CLIENT_TPOT = "smg_router_tpot_seconds"
ROUTER_HISTOGRAMS = (CLIENT_TTFT, PREFILL_LEG, CLIENT_TPOT)
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

    def __post_init__(self) -> None:
        for name in ROUTER_HISTOGRAMS:
            self.windows.setdefault(name, LatencyWindow(self.window, self.min_span))

    def add(self, router: str, at: float, text: str) -> bool:
        """One scrape of ``router``'s metrics text; False when it is not Prometheus text."""
        found = histograms(text, ROUTER_HISTOGRAMS)
        if found is None:
            return False
        for name, buckets in found.items():
            self.windows[name].add(router, at, buckets)
        return True

    def forget(self, keep: set[str]) -> None:
        for window in self.windows.values():
            window.forget(keep)

    def _observed(
        self, name: str, routers: set[str], now: float, stale_after: float
    ) -> Buckets | None:
        return self.windows[name].observed(routers, now, stale_after)

    def ttft(self, routers: set[str], q: float, now: float, stale_after: float) -> Reading:
        """The prefill group's TTFT percentile over the window."""
        client = self._observed(CLIENT_TTFT, routers, now, stale_after)
        leg = self._observed(PREFILL_LEG, routers, now, stale_after)
        if client is None and leg is None:
            return Reading(None, "no fresh router metrics")
        streamed, requests = _count(client), _count(leg)
        if streamed <= 0 and requests <= 0:
            return Reading(0.0, "no request in the window")
        if client and streamed > 0 and streamed >= STREAMED_SHARE * requests:
            return _reading(client, q, f"{CLIENT_TTFT} ({streamed:.0f} streamed)")
        if leg and requests > 0:
            return _reading(leg, q, f"{PREFILL_LEG} ({requests:.0f} requests, few streamed)")
        return Reading(None, "no prefill measurement in the window")

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
        return Reading(None, f"{streamed:.0f} of {requests:.0f} requests streamed")


def _reading(buckets: Buckets, q: float, source: str) -> Reading:
    value = quantile(q, buckets)
    if value is None or not math.isfinite(value):
        return Reading(None, f"{source}: no percentile")
    return Reading(value, source)
