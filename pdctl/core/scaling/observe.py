"""Observing a service: request rate from SMG's counter; latency and load from the workers'.

The RPS signal is the rate of ``smg_router_requests_total`` (summed over its
labels) over a sliding window, from samples this process took itself: a
counter that goes down (SMG restarted) counts from zero again, and a window
with too few samples (scrape gaps) yields None, which the policy treats as
missing data (hold, never scale down).

The latency signals (TTFT on prefill, ITL on decode) are percentiles of the workers' own
histograms over a window: each replica's bucket increases between scrapes (a worker restart
counts from zero), summed over the group's routed replicas, then Prometheus's
histogram_quantile. Parsing here is pure: the scaler's loop fetches the text.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

S = TypeVar("S")  # what a timed sample holds


@dataclass
class CounterRate:
    """Per-second rate of a monotonic counter over a sliding window."""

    window: float = 60.0
    min_span: float = 5.0  # a rate over less time than this is noise
    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, at: float, total: float) -> None:
        if self.samples and at <= self.samples[-1][0]:
            return  # out of order or duplicate: keep time moving forward
        self.samples.append((at, total))
        # keep one sample older than the window as the rate's left anchor
        while len(self.samples) > 2 and self.samples[1][0] <= at - self.window:
            self.samples.popleft()

    def rate(self, now: float, stale_after: float) -> float | None:
        if not self.samples or now - self.samples[-1][0] > stale_after:
            return None
        start = now - self.window
        points = [s for s in self.samples if s[0] >= start]
        anchor = next((s for s in reversed(self.samples) if s[0] < start), None)
        if anchor is not None:
            points.insert(0, anchor)
        if len(points) < 2 or points[-1][0] - points[0][0] < self.min_span:
            return None
        increase = 0.0
        for (_, before), (_, after) in itertools.pairwise(points):
            increase += after - before if after >= before else after  # reset: restarted from 0
        return increase / (points[-1][0] - points[0][0])


# -- the workers' own metrics: latency histograms and load gauges --------------------------------

# The engines' metric names (docs/facts.md, Worker metrics): SGLang's first, then vLLM's.
LATENCY_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("sglang:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    "itl": (
        "sglang:inter_token_latency_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
}
QUEUE_GAUGES = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")
RUNNING_GAUGES = ("sglang:num_running_reqs", "vllm:num_requests_running")

Buckets = dict[float, float]  # upper bound (le, seconds; inf for +Inf) -> cumulative count


def _families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    found: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found.setdefault(family.name, []).append(
                    (sample.name, sample.labels, float(sample.value))
                )
    except ValueError:
        return {}  # not Prometheus text: no metric (the caller holds on missing data)
    return found


def _buckets(samples: list[tuple[str, dict[str, str], float]], name: str) -> Buckets:
    buckets: Buckets = {}
    for sample, labels, value in samples:
        if sample != f"{name}_bucket" or "le" not in labels:
            continue
        try:
            le = float(labels["le"])
        except ValueError:
            continue
        if math.isfinite(value) and value >= 0 and not math.isnan(le):
            buckets[le] = buckets.get(le, 0.0) + value
    return buckets


def histogram(text: str, names: tuple[str, ...]) -> Buckets | None:
    """The first of ``names`` found: its cumulative bucket counts summed over its label sets
    (one per served model), or None when the worker exports none of them."""
    families = _families(text)
    for name in names:
        buckets = _buckets(families.get(name) or [], name)
        if buckets:
            return buckets
    return None


def histograms(text: str, names: tuple[str, ...]) -> dict[str, Buckets] | None:
    """Each of ``names`` the text exports, summed over its label sets ({} for one it does not
    export yet: a histogram appears with its first observation); None when the text is not
    Prometheus text (parsed once for all of them)."""
    families = _families(text)
    if not families and text.strip():
        return None
    return {name: _buckets(families.get(name) or [], name) for name in names}


Totals = dict[str, float]  # name -> a counter's (or a histogram's _sum) total


def totals(text: str, wanted: dict[str, tuple[str, str, dict[str, str]]]) -> Totals | None:
    """Counters' totals, by the caller's names: ``name -> (family, sample, labels)``, the
    sample summed over the label sets that carry ``labels`` (0.0 for one not exported yet);
    None when the text is not Prometheus text."""
    families = _families(text)
    if not families and text.strip():
        return None
    found: Totals = {}
    for name, (family, sample, labels) in wanted.items():
        values = [
            v
            for s, tags, v in families.get(family, [])
            if s == sample and all(tags.get(k) == x for k, x in labels.items())
        ]
        found[name] = sum(v for v in values if math.isfinite(v) and v >= 0)
    return found


def gauge(text: str, names: tuple[str, ...]) -> float | None:
    """The first of ``names`` found, summed over its label sets."""
    families = _families(text)
    for name in names:
        values = [v for sample, _, v in families.get(name, []) if sample == name]
        if values and all(math.isfinite(v) for v in values):
            return sum(values)
    return None


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's histogram_quantile: linear inside the bucket holding rank q x count; in
    the +Inf bucket, the highest finite bound. None without observations."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None  # a histogram always has +Inf: without it the text was cut short
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _increase(before: Buckets, after: Buckets) -> Buckets:
    """What was observed between two scrapes; a bucket that went down means the worker
    restarted (its counters start from zero), so everything it counted since is new."""
    if any(after.get(le, 0.0) < count for le, count in before.items()):
        return dict(after)
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


@dataclass
class LatencyWindow:
    """A group's latency percentile over a sliding window, from the bucket increases of each
    replica's histogram between this process's own scrapes, summed over the replicas."""

    window: float = 60.0
    min_span: float = 5.0  # a window covering less than this is no measurement yet
    series: dict[str, deque[tuple[float, Buckets]]] = field(default_factory=dict)

    def add(self, replica: str, at: float, buckets: Buckets) -> None:
        samples = self.series.setdefault(replica, deque())
        if samples and at <= samples[-1][0]:
            return
        samples.append((at, buckets))
        while len(samples) > 2 and samples[1][0] <= at - self.window:
            samples.popleft()

    def forget(self, keep: set[str]) -> None:
        """Drop the replicas that left the group (a returning one starts afresh)."""
        for replica in set(self.series) - keep:
            del self.series[replica]

    def observed(self, replicas: set[str], now: float, stale_after: float) -> Buckets | None:
        """The bucket increases over the window summed over ``replicas``; None when one of
        them has no fresh scrape (missing data) or no replica covers ``min_span`` yet."""
        total: Buckets = {}
        covered = False
        for replica in replicas:
            samples = self.series.get(replica)
            if not samples or now - samples[-1][0] > stale_after:
                return None
            points = in_window(samples, now - self.window)
            covered = covered or spans(points, self.min_span)
            for (_, before), (_, after) in itertools.pairwise(points):
                for le, count in _increase(before, after).items():
                    total[le] = total.get(le, 0.0) + count
        return total if covered else None

    def percentile(
        self, replicas: set[str], q: float, now: float, stale_after: float
    ) -> float | None:
        """The q-quantile (0 < q < 1) in seconds; 0.0 when nothing was served in the window
        (an idle group), None on missing or stale data."""
        buckets = self.observed(replicas, now, stale_after)
        if buckets is None:
            return None
        if max(buckets.values(), default=0.0) <= 0:
            return 0.0
        return quantile(q, buckets)


def in_window(samples: Sequence[tuple[float, S]], start: float) -> list[tuple[float, S]]:
    """The timed samples from ``start`` on, after the last one before it: a window's increase
    counts from that anchor."""
    points = [sample for sample in samples if sample[0] >= start]
    anchor = next((sample for sample in reversed(samples) if sample[0] < start), None)
    return [anchor, *points] if anchor is not None else points


def spans(points: Sequence[tuple[float, object]], min_span: float) -> bool:
    """At least two points, ``min_span`` seconds or more apart."""
    return len(points) >= 2 and points[-1][0] - points[0][0] >= min_span
