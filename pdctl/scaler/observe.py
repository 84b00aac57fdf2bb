"""Observing a service: request rate from SMG's counter, workers, unit states.

The RPS signal is the rate of ``smg_router_requests_total`` (summed over its
labels) over a sliding window, from samples this process took itself: a
counter that goes down (SMG restarted) counts from zero again, and a window
with too few samples (scrape gaps) yields None, which the policy treats as
missing data (hold, never scale down).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field


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
