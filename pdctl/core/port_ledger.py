"""Which ports are taken on each host, and by whom: the plan's port accounting. PURE.

pdctl places several slots (and maybe the router) on one host, beside other services, so
listeners are judged per host after placement. A port the user set (the router's `port`, an
explicit `pdctl.router.metrics_port`, a vLLM `kv_port`) is fixed: it is entered first, and two
fixed ports that meet on one host are refused naming the host and both owners. Every port
pdctl picks (worker ranges, bootstrap and side channel ports, its default router and metrics
ports, the scaler's) then steps past whatever is already entered on its host.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

MAX_PORT = 65535


@dataclass(frozen=True)
class Span:
    """The ports first..last on one host, and who takes them (as a message names it)."""

    first: int
    last: int
    owner: str
    held: bool = False  # by another service (not by this plan)

    def meets(self, first: int, last: int) -> bool:
        return self.first <= last and first <= self.last


class Ledger:
    """The spans taken on each host."""

    def __init__(self) -> None:
        self._taken: dict[str, list[Span]] = {}

    def take(self, host: str, first: int, last: int, owner: str, held: bool = False) -> None:
        self._taken.setdefault(host, []).append(Span(first, last, owner, held))

    def clash(self, host: str, first: int, last: int) -> Span | None:
        """The first span on ``host`` that meets first..last (None: they are free)."""
        return next((s for s in self._taken.get(host, []) if s.meets(first, last)), None)

    def free_port(self, host: str, port: int) -> int | None:
        """``port``, or the next one up that nothing on ``host`` takes (None: none left)."""
        while port <= MAX_PORT:
            span = self.clash(host, port, port)
            if span is None:
                return port
            port = span.last + 1
        return None

    def free_position(
        self, host: str, nth: int, spans: Callable[[int], list[tuple[int, int]]]
    ) -> int | None:
        """The first slot position from ``nth`` on whose spans (``spans(position)``: every
        position takes higher ports than the one before) are apart from each other and free
        on ``host``; None when they would run past the last port first."""
        while True:
            wanted = sorted(spans(nth))
            if any(last > MAX_PORT for _first, last in wanted):
                return None
            apart = all(a[1] < b[0] for a, b in itertools.pairwise(wanted))
            if apart and not any(self.clash(host, first, last) for first, last in wanted):
                return nth
            nth += 1
