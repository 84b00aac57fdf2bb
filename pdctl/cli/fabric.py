"""The fabric check's options and table, shared by `fleet check/add --fabric` and
`deploy/status --certify`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from pdctl.cli.app import App
from pdctl.core import fabric_judge, fabric_schedule
from pdctl.operations import fabric_run

F = TypeVar("F", bound=Callable[..., Any])


def run_options(function: F) -> F:
    """How each test runs (both the mesh and the KV paths)."""
    for option in reversed(
        [
            click.option(
                "--duration",
                type=int,
                default=fabric_run.DEFAULT_DURATION,
                show_default=True,
                help="Seconds of ib_write_bw per test (ib_write_lat runs 1000 iterations).",
            ),
            click.option(
                "--iterations",
                type=int,
                help="Run ib_write_bw for this many messages (64 KiB each) instead of "
                "--duration seconds: a size-bound test.",
            ),
            click.option(
                "--parallel-rails",
                is_flag=True,
                help="Test every rail of a round's pairs at once (each NIC in one test at a "
                "time) instead of rail by rail: faster, but host-side limits (PCIe, memory) "
                "then weigh on every rail's numbers.",
            ),
            click.option(
                "--min-fraction",
                type=float,
                default=fabric_judge.DEFAULT_MIN_FRACTION,
                show_default=True,
                help="A pair fails below this fraction of its NICs' line rate or of its "
                "rail's median.",
            ),
        ]
    ):
        function = option(function)
    return function


def mesh_options(function: F) -> F:
    """`--fabric` and which pairs and rails it tests (listed first), then run_options."""
    function = run_options(function)
    for option in reversed(
        [
            click.option(
                "--fabric",
                is_flag=True,
                help="Then test the RDMA links between the GPU hosts: perftest's ib_write_bw "
                "and ib_write_lat for every pair, rail by rail, in rounds (no host in two "
                "tests at once); name the host or link that is slow.",
            ),
            click.option(
                "--sample",
                type=float,
                metavar="FRACTION",
                help="Test this fraction of the pairs (whole rounds, chosen at random). "
                f"[default: every pair up to {fabric_schedule.FULL_MESH_MAX} GPU "
                f"hosts, {fabric_schedule.DEFAULT_SAMPLE:g} beyond]",
            ),
            click.option(
                "--rails",
                default="all",
                show_default=True,
                metavar="all|N[,N...]",
                help="Which rails: all, or NIC numbers (rail i is NIC i of every host).",
            ),
            click.option("--seed", type=int, help="The sample's random seed (to repeat one)."),
        ]
    ):
        function = option(function)
    return function


def options(
    *,
    duration: int,
    iterations: int | None,
    parallel_rails: bool,
    min_fraction: float,
    rails: str = "all",
    sample: float | None = None,
    seed: int | None = None,
) -> fabric_run.Options:
    found = fabric_run.Options(
        rails=fabric_run.parse_rails(rails),
        sample=sample,
        parallel_rails=parallel_rails,
        duration=duration,
        iterations=iterations,
        min_fraction=min_fraction,
        seed=seed,
    )
    found.check()
    return found


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def render(app: App, doc: dict[str, Any], title: str) -> None:
    """One row per test, then who is to blame and the summary."""
    rows = []
    for pair in doc["pairs"]:
        ends = [n or "-" for n in pair["nics"]]
        nics = ends[0] if len(set(ends)) == 1 else "/".join(ends)
        verdict = "ok" if pair["ok"] else "FAILED"
        if not pair["ok"]:
            verdict += f": {pair['why']}"
            if pair.get("cause"):
                verdict += f" (cause: {pair['cause']})"
        rows.append(
            (
                " - ".join(pair["hosts"]),
                pair["rail"],
                nics,
                _fmt(pair["gbps"]),
                _fmt(pair["expected_gbps"]),
                _fmt(pair["lat_us"]),
                verdict,
            )
        )
    app.out.table(
        ["hosts", "rail", "nics", "Gb/s", "expected", "lat (us)", "verdict"], rows, title=title
    )
    for host, entry in doc["hosts"].items():
        if entry["named"]:
            app.out.line(
                f"{host}: every test on rail {', '.join(entry['rails'])} failed while its peers "
                "passed with others: its own link (cable, port or NIC) is the cause"
            )
    for note in doc.get("notes") or []:
        app.out.line(f"note: {note}")
    app.out.line(
        f"fabric: {doc['summary']} ({doc.get('rounds', 0)} round(s), {doc.get('seconds', 0)} s)"
    )
