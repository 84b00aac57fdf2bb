"""The autoscaling policy: one decision per replica group per tick. PURE (the clock is injected).

Per group, in this order:

1. ``pinned`` (``pdctl scale``) wins: clamped into [min, max], applied at once, no delays.
2. Out of bounds (below min, above max): go to the bound at once, whatever the metrics say.
3. Missing or stale metrics: hold; never scale down on no data (HPA).
4. recommendation = ceil(rps / target) clamped to [min, max] (rps 0 -> min). No action while
   the load per replica is within +-tolerance of the target (HPA's 10% band).
   A latency metric (ttft on prefill, itl on decode; ``target`` in seconds) has an asymmetric
   band instead: out when the observed percentile exceeds the target by more than the
   tolerance (to HPA's proportional ceil(serving * value / target), at least one more, at
   most double the serving replicas; not while replicas it started still load, nor until
   the serving count has held ``settle`` seconds: a latency shows new replicas late; nor
   while no request arrives: the latency is then a backlog's, measured as it ends), in
   only below ``scale_in_below`` x target, and only to a count whose estimated latency
   (value x current / fewer: latency grows with the load per replica) stays under the target
   less the tolerance, and never while requests queue (the replicas are at capacity).
   While requests queue, the queue's own trend sizes a latency scale-out (``_capacity``):
   growing, the serving replicas are saturated and complete ``rps - growth`` requests/s, so
   ``serving x rps / (rps - growth) / headroom`` replicas carry the load at ``headroom``
   utilisation: one step to that count, even while replicas it started still load, when it
   is more than run; shrinking, they carry the load and the latency above target is the
   backlog's: hold while it drains.
5. Up: only ``scale_up_delay`` after this group's last scaling, at most ``max_step_up`` at once
   (a capacity-sized latency step is measured, not extrapolated: not step-limited).
   Down: the HIGHEST recommendation within the stabilization window wins (HPA), then
   ``scale_down_delay``, then at most ``max_step_down`` at once (a latency scale-in is
   bounded by its own estimate instead: it goes to the estimated count in one step).

Deliberate differences from dstack's RPS autoscaler (docs/facts.md, Autoscaling): each group
has its own History, so scaling prefill never resets decode's timers (dstack shares one
cooldown); a tolerance band, step limits and a scale-down stabilization window damp flapping;
no data means hold, not "0 rps, scale to min"; an optional in-flight-requests signal (desired
is the max over signals); and shorter default delays (0 s up, 60 s down rather than 5 and
10 min), which are safe because a replica that is still loading its model already counts in
``running`` (so a scale-up is not repeated while it loads) and the step limits and the window
bound each move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Action = Literal["up", "down", "hold"]
Metric = Literal["rps", "ttft", "itl"]

# ceil(1.1 / 0.1) would be 12: forgive float noise just above an integer.
_EPSILON = 1e-9
# The queue's trend: measured over at most QUEUE_SPAN s, and only once it covers QUEUE_MIN_SPAN
# (a gauge scraped every few seconds is noisy); a change under TREND_NOISE x rps is no trend.
QUEUE_SPAN, QUEUE_MIN_SPAN, TREND_NOISE = 30.0, 10.0, 0.05


@dataclass(frozen=True)
class Policy:
    """One group's scaling settings, from the spec (``replicas[].scaling``) and pins."""

    group: str  # "prefill" or "decode"
    min: int
    max: int
    target: float  # rps: what one replica carries (inf: no scaling); ttft/itl: seconds
    metric: Metric = "rps"
    tolerance: float = 0.1  # no action while the load per replica is within +-10% of target
    scale_up_delay: float = 0.0  # seconds since this group's last scaling before an up
    scale_down_delay: float = 60.0  # ... before a down
    stabilization: float | None = None  # scale-down window; None -> scale_down_delay
    max_step_up: int = 2  # replicas added per decision
    # replicas removed per decision (None: 1 on rps, the estimate alone on a latency metric)
    max_step_down: int | None = None
    stale_after: float = 60.0  # an observation older than this is missing data
    pinned: int | None = None  # manual override (pdctl scale)
    inflight_target: float | None = None  # optional second signal: in-flight per replica
    scale_in_below: float = 0.5  # latency metrics: scale in only below this x target
    # latency metrics: no scale-out until the serving count has held this long (a latency
    # takes a while to show new replicas: the window, the backlog they drain)
    settle: float = 30.0
    # latency metrics: the utilisation a scale-out sized from the queue's trend aims at
    headroom: float = 0.8

    def __post_init__(self) -> None:
        if self.min < 0 or self.max < self.min:
            raise ValueError(f"{self.group}: need 0 <= min <= max, got {self.min}..{self.max}")
        if not self.target > 0:
            raise ValueError(f"{self.group}: target must be > 0, got {self.target}")
        if self.inflight_target is not None and not self.inflight_target > 0:
            raise ValueError(f"{self.group}: inflight_target must be > 0")
        if self.max_step_up < 1 or (self.max_step_down is not None and self.max_step_down < 1):
            raise ValueError(f"{self.group}: step limits must be >= 1")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"{self.group}: headroom must be in (0, 1]")
        if not 0 < self.scale_in_below < 1:
            raise ValueError(f"{self.group}: scale_in_below must be in (0, 1)")
        if self.tolerance < 0 or self.scale_up_delay < 0 or self.scale_down_delay < 0:
            raise ValueError(f"{self.group}: tolerance and delays must be >= 0")

    @property
    def window(self) -> float:
        """The scale-down stabilization window, in seconds."""
        return self.scale_down_delay if self.stabilization is None else self.stabilization

    def clamp(self, replicas: int) -> int:
        return max(self.min, min(self.max, replicas))

    @property
    def step_down(self) -> int:
        """Replicas removed per decision at most."""
        if self.max_step_down is not None:
            return self.max_step_down
        return 1 if self.metric == "rps" else max(self.max, 1)


@dataclass(frozen=True)
class Observation:
    """What the observer measured for one group.

    ``running`` counts the group's replicas whose unit runs, serving or still loading the
    model: a replica being started counts, so a scale-up in progress is not repeated.
    ``rps`` is the request rate through the router (None: metrics missing; a negative or
    non-finite value is treated the same way). ``inflight_per_replica`` is the average number
    of in-flight requests per running replica (only used when ``Policy.inflight_target``).
    ``latency`` is the group's windowed percentile of the policy's latency metric in seconds
    (0.0: no request in the window; None: missing), ``queue_per_replica`` the requests
    waiting per serving replica (a latency scale-in needs it at zero, or unknown; its trend
    sizes a latency scale-out).
    ``serving`` counts the running replicas that serve already: a latency only falls once a
    started replica serves, so a scale-out is sized on the serving ones and not repeated
    while the replicas it started still load.
    """

    at: float  # when measured, on the same clock as ``now``
    rps: float | None
    running: int
    inflight_per_replica: float | None = None
    latency: float | None = None
    queue_per_replica: float | None = None
    serving: int | None = None  # of ``running``, those serving (None: all of them)


@dataclass
class History:
    """One group's memory between ticks. decide() returns a new one; keep one per group.

    An empty History (a fresh scaler) has no window to stabilise on: persist it with
    to_dict()/from_dict() if a restart must not forget a recent peak.
    """

    last_scaled_at: float | None = None
    # (time, recommendation after the tolerance band), pruned to the stabilization window
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    # the serving count last seen and since when (None: unknown, or from the start)
    serving: int | None = None
    serving_since: float | None = None
    # (time, requests queued in the group) since the serving count last changed, pruned to
    # QUEUE_SPAN: the queue's trend on the replicas serving now
    queue: list[tuple[float, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {
            "last_scaled_at": self.last_scaled_at,
            "recommendations": [[at, n] for at, n in self.recommendations],
            "serving": self.serving,
            "serving_since": self.serving_since,
            "queue": [[at, n] for at, n in self.queue],
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> History:
        last = data.get("last_scaled_at")
        raw = data.get("recommendations")
        recs = [(at, int(n)) for at, n in _pairs(raw)]
        serving, since = data.get("serving"), data.get("serving_since")
        return cls(
            last_scaled_at=float(last) if isinstance(last, int | float) else None,
            recommendations=recs,
            serving=serving if isinstance(serving, int) else None,
            serving_since=float(since) if isinstance(since, int | float) else None,
            queue=_pairs(data.get("queue")),
        )


def _pairs(raw: object) -> list[tuple[float, float]]:
    """[[time, number], ...] from a saved History; anything else is skipped."""
    found: list[tuple[float, float]] = []
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, list | tuple) and len(item) == 2:
                at, n = item
                if isinstance(at, int | float) and isinstance(n, int | float):
                    found.append((float(at), float(n)))
    return found


@dataclass(frozen=True)
class Decision:
    group: str
    current: int  # replicas running when deciding
    desired: int  # replicas after this decision
    recommendation: int | None  # what the signals ask for (None: no data)
    action: Action
    reason: str  # one short human sentence
    signal: str | None = None  # the metric that decided ("rps", "ttft", "itl", "inflight")
    value: float | None = None  # its observed value (rps, or seconds)
    target: float | None = None  # its target (per replica for rps, seconds for latency)
    # why a scale-out the signals asked for was refused or cut (the GPU budget, max_gpus)
    refusal: str | None = None
    source: str | None = None  # where a latency came from, when not the workers' own metrics

    def signal_text(self) -> str | None:
        """e.g. "ttft 620 ms, target 500 ms" or "rps 3.20, target 2.00 per replica"."""
        if self.signal is None:
            return None
        latency = self.signal in {"ttft", "itl"}
        value = (
            "none" if self.value is None else _ms(self.value) if latency else f"{self.value:.2f}"
        )
        if self.target is None or not math.isfinite(self.target):
            return f"{self.signal} {value}"
        target = _ms(self.target) if latency else f"{self.target:.2f} per replica"
        return f"{self.signal} {value}, target {target}"

    def to_dict(self) -> dict[str, object]:
        return {
            "group": self.group,
            "current": self.current,
            "desired": self.desired,
            "recommendation": self.recommendation,
            "action": self.action,
            "reason": self.reason,
            "signal": self.signal,
            "value": self.value,
            "target": self.target,
            "refusal": self.refusal,
            "source": self.source,
        }


def recommend(policy: Policy, rps: float) -> int:
    """ceil(rps / target) clamped to [min, max]; rps 0 (or less) -> min."""
    return _need(policy, rps, policy.target)


def _need(policy: Policy, load: float, per_replica: float) -> int:
    if load <= 0:
        return policy.min
    ratio = load / per_replica
    return policy.clamp(math.ceil(ratio - _EPSILON) if math.isfinite(ratio) else policy.max)


@dataclass(frozen=True)
class _Signal:
    name: str  # "rps" or "inflight"
    load: float  # the group's total load for this signal
    per_replica: float  # the target load of one replica
    recommendation: int  # ceil(load / per_replica), clamped
    proposal: int  # the recommendation, or current when within the tolerance band
    latency: bool = False  # load is an observed latency (s), per_replica its target (s)
    note: str = ""  # why a latency scale-in was refused
    sized: bool = False  # a latency scale-out sized from the measured capacity


def _signal(policy: Policy, name: str, load: float, per_replica: float, current: int) -> _Signal:
    need = _need(policy, load, per_replica)
    proposal = need
    if current > 0 and math.isfinite(per_replica):
        ratio = load / (per_replica * current)
        if abs(ratio - 1.0) <= policy.tolerance:
            proposal = current
    return _Signal(name, load, per_replica, need, proposal)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


@dataclass(frozen=True)
class _Capacity:
    """What the queue's trend says about the serving replicas."""

    need: int  # replicas that carry the load at the policy's headroom
    growth: float  # requests/s the queue grows by (negative: it drains)


def _serving(observation: Observation) -> int:
    current = observation.running
    return current if observation.serving is None else min(observation.serving, current)


def _capacity(
    policy: Policy, observation: Observation, queue: list[tuple[float, float]]
) -> _Capacity | None:
    """While requests queue, the serving replicas complete ``rps - growth`` requests/s
    (all they can: nothing waits on an idle replica), so ``serving x rps / (rps - growth)``
    replicas carry the load at full utilisation. None without a trend: no rate, no queue, too
    short a span, or a change within the noise."""
    rps, serving = observation.rps, _serving(observation)
    if rps is None or not _valid(rps) or rps <= 0 or serving <= 0 or len(queue) < 2:
        return None
    (start, before), (end, after) = queue[0], queue[-1]
    if end - start < QUEUE_MIN_SPAN:
        return None
    growth = (after - before) / (end - start)
    if abs(growth) <= TREND_NOISE * rps or growth >= rps:
        return None
    completed = rps - growth
    need = policy.clamp(math.ceil(serving * rps / completed / policy.headroom - _EPSILON))
    return _Capacity(need, growth)


def _latency(
    policy: Policy,
    value: float,
    observation: Observation,
    settled: float | None,
    capacity: _Capacity | None,
) -> _Signal:
    target, name = policy.target, policy.metric
    current = observation.running
    serving = _serving(observation)
    if value <= 0 or serving <= 0:  # idle (no request in the window) or nothing serving
        need = policy.min
    else:
        need = policy.clamp(math.ceil(serving * value / target - _EPSILON))
    proposal, note = current, ""
    queue_per_replica = observation.queue_per_replica
    if serving > 0 and value > target * (1 + policy.tolerance) and observation.rps == 0:
        # Requests measure their latency as they end: a backlog's streams, ending after the
        # load stopped, still show it high. Nothing arrives for more replicas to serve.
        note = "no request arrived in the window: the latency is the backlog's"
        return _Signal(name, value, target, current, current, latency=True, note=note)
    if serving > 0 and value > target * (1 + policy.tolerance):
        # at most double the serving replicas (HPA's 100% rate): a latency holding a backlog
        # is not proportional to the load, and the new replicas' effect shows only once
        # they serve
        proposal = policy.clamp(max(min(need, 2 * serving), serving + 1))
        if capacity is not None and capacity.need > current:
            trend = f"queue {capacity.growth:+.1f}/s"
            return _Signal(name, value, target, need, capacity.need, True, trend, sized=True)
        if capacity is not None and capacity.growth < 0:
            proposal = current
            note = f"queue {capacity.growth:+.1f}/s: the backlog drains, {current} carry the load"
        elif proposal <= current:
            proposal, note = current, f"{current - serving} starting replica(s) will serve it"
        elif settled is not None and settled < policy.settle:
            proposal = current
            note = (
                f"{serving} serving for {_ago(settled)} < settle {_ago(policy.settle)}: "
                "letting the latency show them"
            )
    elif current > 0 and value < target * policy.scale_in_below:
        # the fewest replicas whose estimate (value x current / fewer) stays under the target
        # less the tolerance; load spreads over fewer replicas, so latency grows with it
        keep = target * (1 - policy.tolerance)
        fewer = min(current, policy.clamp(math.ceil(current * value / keep - _EPSILON)))
        queued = (queue_per_replica or 0.0) * max(serving, 1) / max(fewer, 1)
        if fewer < current and queued >= 1:
            note = f"{queue_per_replica:.1f} queued per replica: no scale-in"
        else:
            proposal = fewer
    return _Signal(name, value, target, need, proposal, latency=True, note=note)


def _valid(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value >= 0


def _signals(
    policy: Policy,
    observation: Observation,
    current: int,
    settled: float | None,
    queue: list[tuple[float, float]],
) -> tuple[list[_Signal], bool]:
    """The usable signals, and whether every configured signal was usable."""
    found: list[_Signal] = []
    complete = True
    if policy.metric != "rps":
        value = observation.latency
        if value is not None and _valid(value):
            capacity = _capacity(policy, observation, queue)
            found.append(_latency(policy, value, observation, settled, capacity))
        else:
            complete = False
    elif observation.rps is not None and _valid(observation.rps):
        found.append(_signal(policy, "rps", observation.rps, policy.target, current))
    else:
        complete = False
    if policy.inflight_target is not None:
        per = observation.inflight_per_replica
        if per is not None and _valid(per) and observation.running > 0:
            load = per * observation.running
            found.append(_signal(policy, "inflight", load, policy.inflight_target, current))
        else:
            complete = False
    return found, complete


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s"


def _compare(s: _Signal, sign: str, current: int, policy: Policy) -> str:
    tolerance = policy.tolerance
    if s.latency:
        band = f"+{tolerance * 100:.0f}%" if sign == ">" else f"{policy.scale_in_below:.0%}"
        bound = f"target {_ms(s.per_replica)} ({band})"
        return f"{s.name} {_ms(s.load)} {sign} {bound}"
    return (
        f"{s.name} {s.load:.1f} {sign} {s.per_replica:.1f} x {current} "
        f"({'+' if sign == '>' else '-'}{tolerance * 100:.0f}%)"
    )


@dataclass(frozen=True)
class _Tick:
    """What one decision works from (the inputs, digested)."""

    policy: Policy
    current: int
    now: float
    since: float | None  # seconds since this group's last scaling (None: never)
    kept: list[tuple[float, int]]  # recommendations still inside the window
    signals: list[_Signal]
    complete: bool  # every configured signal was usable
    proposal: int | None  # max over signals of the tolerance-applied recommendation


def _cooling(t: _Tick, delay: float, name: str) -> str | None:
    if t.since is not None and t.since < delay:
        return f"cooling down: last scaling {_ago(t.since)} ago < {name} {_ago(delay)}"
    return None


def _up(t: _Tick, proposal: int, lead: _Signal) -> tuple[int, str]:
    p = t.policy
    cooling = _cooling(t, p.scale_up_delay, "scale_up_delay")
    if cooling:
        return t.current, cooling
    desired = proposal if lead.sized else min(proposal, t.current + p.max_step_up)
    limit = f" (step limit {p.max_step_up})" if desired < proposal else ""
    sized = f" ({lead.note}: sized from the serving replicas' throughput)" if lead.sized else ""
    return desired, f"{_compare(lead, '>', t.current, p)}: up to {desired}{limit}{sized}"


def _down(t: _Tick, proposal: int, lead: _Signal) -> tuple[int, str]:
    p = t.policy
    if not t.complete:
        return t.current, "some metrics missing: no scale-down, hold"
    highest = max([proposal, *(n for _, n in t.kept)])
    if highest >= t.current:
        return (
            t.current,
            f"scale-down stabilising: highest recommendation in {_ago(p.window)} is {highest}",
        )
    cooling = _cooling(t, p.scale_down_delay, "scale_down_delay")
    if cooling:
        return t.current, cooling
    desired = max(highest, t.current - p.step_down)
    limit = f" (step limit {p.step_down})" if desired > highest else ""
    held = f" (highest in {_ago(p.window)})" if desired == highest > proposal else ""
    text = _compare(lead, "<", t.current, p)
    return desired, f"{text}: down to {desired}{limit}{held}"


def _no_data(t: _Tick, observation: Observation) -> str:
    age = t.now - observation.at
    if age > t.policy.stale_after:
        return f"metrics stale ({_ago(age)} old > {_ago(t.policy.stale_after)}): hold"
    return "metrics missing: hold"


def _steady(t: _Tick, lead: _Signal) -> str:
    if lead.latency:
        p = t.policy
        low, high = lead.per_replica * p.scale_in_below, lead.per_replica * (1 + p.tolerance)
        text = f"{lead.name} {_ms(lead.load)} vs target {_ms(lead.per_replica)}"
        if lead.note:
            return f"{text}: {lead.note}"
        if lead.load < low:
            return f"{text}: {t.current} is the fewest that stays under target"
        return f"within band: {text} (out above {_ms(high)}, in below {_ms(low)})"
    if any(s.recommendation != t.current for s in t.signals):
        detail = "; ".join(
            f"{s.name} {s.load:.1f} vs {s.per_replica:.1f} x {t.current}" for s in t.signals
        )
        return f"within tolerance: {detail} (+-{t.policy.tolerance * 100:.0f}%)"
    return f"steady: {lead.name} {lead.load:.1f} needs {t.current}"


def _rule(t: _Tick, observation: Observation) -> tuple[int, str]:
    p, current = t.policy, t.current
    if current < p.min:  # the floor holds whatever the metrics say
        return p.min, f"below min {p.min}: up"
    if current > p.max:
        return p.max, f"above max {p.max}: down"
    if t.proposal is None:  # no data: hold, never scale down
        return current, _no_data(t, observation)
    lead = max(t.signals, key=lambda s: (s.proposal, s.name == "rps"))
    if t.proposal > current:
        return _up(t, t.proposal, lead)
    if t.proposal < current:
        return _down(t, t.proposal, lead)
    return current, _steady(t, lead)


def _queue(
    history: History, observation: Observation, serving: int, now: float, stale: bool
) -> list[tuple[float, float]]:
    """The queue samples the trend is measured on: the requests queued in the group (per
    serving replica x serving) over the last QUEUE_SPAN s, since the serving count changed
    (the trend of fewer replicas says nothing about the ones serving now)."""
    kept = history.queue if history.serving in (None, serving) else []
    kept = [(at, n) for at, n in kept if now - QUEUE_SPAN <= at < now]
    per = observation.queue_per_replica
    if not stale and per is not None and _valid(per):
        kept.append((now, per * serving))
    return kept


def decide(
    policy: Policy, observation: Observation, history: History, now: float
) -> tuple[Decision, History]:
    """One decision for one group; returns it with the group's new History (inputs untouched)."""
    current = observation.running
    last = history.last_scaled_at
    kept = [(at, n) for at, n in history.recommendations if now - policy.window <= at <= now]
    stale = now - observation.at > policy.stale_after
    serving = current if observation.serving is None else observation.serving
    if history.serving is None or history.serving == serving:
        serving_since = history.serving_since if history.serving is not None else None
    else:
        serving_since = now
    settled = None if serving_since is None else now - serving_since
    queue = _queue(history, observation, serving, now, stale)
    signals, complete = (
        ([], False) if stale else _signals(policy, observation, current, settled, queue)
    )
    proposal = max((s.proposal for s in signals), default=None)
    recommendation = max((s.recommendation for s in signals), default=None)
    if policy.pinned is not None:  # a pin wins, clamped, at once, no delays
        desired = policy.clamp(policy.pinned)
        recommendation = desired
        reason = f"pinned to {desired}"
        if desired != policy.pinned:
            reason += f" (asked {policy.pinned}, bounds {policy.min}..{policy.max})"
    else:
        since = None if last is None else now - last
        tick = _Tick(policy, current, now, since, kept, signals, complete, proposal)
        desired, reason = _rule(tick, observation)
    action: Action = "up" if desired > current else "down" if desired < current else "hold"
    lead = max(signals, key=lambda s: (s.proposal, s.name == "rps"), default=None)
    if proposal is not None:
        kept.append((now, proposal))
    new = History(
        last_scaled_at=now if desired != current else last,
        recommendations=kept,
        serving=serving,
        serving_since=serving_since,
        queue=queue,
    )
    decision = Decision(
        policy.group,
        current,
        desired,
        recommendation,
        action,
        reason,
        signal=lead.name if lead else policy.metric,
        value=lead.load if lead else None,
        target=lead.per_replica if lead else policy.target,
    )
    return decision, new
