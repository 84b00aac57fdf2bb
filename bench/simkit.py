"""What the scaler simulations share: the simulated fleet, dstack's policy, pdctl's timers, the
command line, and the CSV and PNG each trace writes (bench/scaler_sim.py replays rps traces,
bench/scaler_phases.py traces whose prompt/answer mix alternates).

A started replica serves only after the warm-up (model load) and counts as a replica while it
loads (dstack counts provisioning replicas; pdctl's ``running`` counts active units); a
removed replica stops at once.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MIN_REPLICAS, MAX_REPLICAS = 1, 8
WARMUP = 120.0  # seconds of model load, the same for every policy

PDCTL_WINDOW = 30  # seconds of rate (and latency) the observer hands to decide()
PDCTL_UP, PDCTL_DOWN, PDCTL_STABILIZATION = 30.0, 120.0, 120.0
BASELINE_WINDOW = 60
BASELINE_UP, BASELINE_DOWN = 300.0, 600.0

OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Group:
    name: str
    target: float  # rps per replica (what dstack's policy divides by)
    ready_at: list[float] = field(default_factory=list)  # per replica: when it starts serving
    directions: list[str] = field(default_factory=list)  # "up"/"down", one per scaling event

    @property
    def replicas(self) -> int:
        return len(self.ready_at)

    def serving(self, now: float) -> int:
        return sum(1 for at in self.ready_at if at <= now)

    def scale_to(self, count: int, now: float, warmup: float) -> None:
        if count == self.replicas:
            return
        self.directions.append("up" if count > self.replicas else "down")
        if count > self.replicas:
            self.ready_at += [now + warmup] * (count - self.replicas)
        else:  # the newest (still loading ones first) go; removal is immediate
            self.ready_at = sorted(self.ready_at)[:count]

    @property
    def reversals(self) -> int:
        return sum(1 for a, b in zip(self.directions, self.directions[1:], strict=False) if a != b)


def average(trace: Sequence[float], t: int, window: int) -> float:
    """Mean rps over the last ``window`` seconds up to t (the load before 0 is trace[0])."""
    return sum(trace[max(0, i)] for i in range(t - window + 1, t + 1)) / window


class Baseline:
    """dstack's RPS autoscaler as docs/facts.md (Autoscaling) states it: rps averaged over
    60 s, desired = ceil(rps / target) clipped to [min, max], scale up 5 min and down 10 min
    after the LAST scaling event, one cooldown shared by all groups, no tolerance, no step
    limit."""

    def __init__(self, warmup: float = WARMUP) -> None:
        self.warmup = warmup
        self.last_scaled_at: float | None = None

    def step(self, now: float, trace: Sequence[float], t: int, groups: dict[str, Group]) -> None:
        rps = average(trace, t, BASELINE_WINDOW)
        since = math.inf if self.last_scaled_at is None else now - self.last_scaled_at
        for group in groups.values():  # both groups see the cooldown as it was at this tick
            desired = max(MIN_REPLICAS, min(MAX_REPLICAS, math.ceil(rps / group.target)))
            up = desired > group.replicas and since >= BASELINE_UP
            down = desired < group.replicas and since >= BASELINE_DOWN
            if up or down:
                group.scale_to(desired, now, self.warmup)
                self.last_scaled_at = now


# -- command line ---------------------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    """--warmup, --seconds, --seed and --out, as every simulation takes them."""
    found = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    found.add_argument("--warmup", type=float, default=WARMUP, help="model load, seconds")
    found.add_argument("--seconds", type=int, default=7200, help="length of each trace")
    found.add_argument("--seed", type=int, default=0, help="noise seed")
    found.add_argument("--out", type=Path, default=OUT, help="where CSVs and PNGs go")
    return found


def parse(found: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = found.parse_args(argv)
    if args.seconds < 60 or args.warmup < 0:
        found.error("--seconds must be >= 60 and --warmup >= 0")
    return args


# -- what each trace writes -----------------------------------------------------------------------


@dataclass(frozen=True)
class Panel:
    """One row of a trace's figure: named series, one value per second."""

    label: str
    lines: Mapping[str, Sequence[float]]
    target: float | None = None  # a red line, and a log scale (a latency)
    steps: bool = True  # replica counts change in steps; a rate is a line
    shade: Sequence[float] | None = None  # 0/1 per second: a phase to shade


def write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def write_png(path: Path, title: str, panels: Sequence[Panel]) -> None:
    try:  # optional: skip silently without matplotlib
        importlib.import_module("matplotlib").use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return
    figure, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(10, 2.2 * len(panels)))
    for axis, panel in zip(axes, panels, strict=True):
        for name, values in panel.lines.items():
            x = range(len(values))
            if panel.steps:
                axis.step(x, values, label=name, linewidth=0.8)
            else:
                axis.plot(x, values, label=name, linewidth=0.6, color="gray")
        if panel.shade is not None:
            top = max((max(v, default=0.0) for v in panel.lines.values()), default=1.0)
            x = range(len(panel.shade))
            axis.fill_between(x, 0, [s * top for s in panel.shade], alpha=0.15, label="shaded")
        if panel.target is not None:
            axis.axhline(panel.target, color="red", linewidth=0.6, label="target")
            axis.set_yscale("log")
        axis.set_ylabel(panel.label)
        axis.legend(loc="upper right", fontsize="small")
    axes[0].set_title(title)
    axes[-1].set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def save(
    out: Path,
    stem: str,
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    title: str,
    panels: Sequence[Panel],
) -> None:
    """``<stem>.csv`` and ``<stem>.png`` (when matplotlib is importable) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{stem}.csv", header, rows)
    write_png(out / f"{stem}.png", title, panels)
