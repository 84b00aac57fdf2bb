"""`pdctl fleet ...`: register SSH hosts and check they can run PD inference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from pdctl.cli import fabric as fabric_cli
from pdctl.cli.app import App, emit, pass_app
from pdctl.core import layout
from pdctl.core.fleet_model import DEFAULT_ENDPOINT, FleetSettings
from pdctl.operations import fleet as fleets

# What every GPU host must have unless the options say otherwise (FleetSettings is its home).
EXPECT = FleetSettings()


@click.group()
def fleet() -> None:
    """Fleets of SSH hosts: add, list, show, check, remove."""


def _render_report(app: App, doc: dict[str, Any]) -> None:
    rows = []
    for host in doc["hosts"]:
        failed = [c for c in host["checks"] if not c["ok"]]
        verdict = "ok" if host["ok"] else "FAILED"
        emulated = [c["name"] for c in host["checks"] if c.get("emulated")]
        detail = "; ".join(c["message"] for c in failed) or (
            "CPU host: GPU/RDMA checks skipped" if host["kind"] == "cpu" else "all checks passed"
        )
        if emulated:  # a lab host: say what passed only by emulation
            detail += f" (emulated: {', '.join(emulated)})"
        rows.append((host["name"], host["kind"], verdict, detail))
    if rows:  # none when `fleet add --proxy-jump J --repin` only re-pinned the jump host
        app.out.table(
            ["host", "kind", "preflight", "findings"], rows, title=f"fleet {doc['fleet']}"
        )
    jump = doc.get("proxy_jump")
    if jump:
        key = f"host key {jump['fingerprint']}" if jump["fingerprint"] else "no host key pinned"
        app.out.line(f"jump host {jump['host']}: {key}")
    if doc.get("fabric") is not None:
        fabric_cli.render(app, doc["fabric"], f"fleet {doc['fleet']}: fabric")


@fleet.command()
@click.argument("name")
@click.option(
    "--host", "hosts", multiple=True, metavar="[USER@]ADDR[:PORT]", help="A host (repeatable)."
)
@click.option(
    "--hosts-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A file with one [USER@]ADDR[:PORT] per line (# comments).",
)
@click.option("--user", help="SSH user for hosts given without one. [default: root]")
@click.option("--identity-file", type=click.Path(dir_okay=False), help="SSH private key.")
@click.option(
    "--proxy-jump", metavar="[USER@]HOST[:PORT]", help="Reach the hosts through this jump host."
)
@click.option("--become/--no-become", default=None, help="Use sudo on the hosts. [default: become]")
@click.option(
    "--expect-nics",
    type=int,
    help=f"RDMA NICs every GPU host must have. [default: {EXPECT.expect_nics}]",
)
@click.option(
    "--expect-gpus",
    type=int,
    help=f"GPUs every GPU host must have. [default: {EXPECT.expect_gpus}]",
)
@click.option(
    "--gpu",
    "gpu_model",
    metavar="MODEL",
    help="The GPU model every GPU host must have, as dstack spells it (H200, H100, A100, "
    f"MI300X); sets the GPU vendor too. [default: {EXPECT.gpu_model}]",
)
@click.option(
    "--gpu-vendor",
    type=click.Choice(["amd", "nvidia", "any"]),
    help="amd (amd-smi, /dev/kfd), nvidia (nvidia-smi, nvidia-ctk, CDI), or any (a fleet mixing "
    "both: each host is checked by what it has; any GPU model unless --gpu). [default: from --gpu]",
)
@click.option(
    "--nic-driver",
    metavar="DRIVER",
    help="The RDMA NICs' driver (the libibverbs provider's name): bnxt_re, mlx5, irdma, ..., or "
    f"auto (each host's own; a mixed fleet). [default: {EXPECT.nic_driver}]",
)
@click.option(
    "--link-layer",
    type=click.Choice(["eth", "ib", "auto"]),
    help="The RDMA fabric: eth (RoCE: a RoCE v2 GID at MC_GID_INDEX), ib (InfiniBand: a LID "
    f"per port), or auto (each host's own). [default: {EXPECT.link_layer}]",
)
@click.option(
    "--wheelhouse",
    metavar="DIR",
    help="Wheels on the hosts (absolute path) to install SMG and the scaler from, for hosts "
    "without internet; a spec's pdctl.wheelhouse wins.",
)
@click.option(
    "--model-cache",
    metavar="DIR",
    help="The hosts' model cache (absolute path; the Hugging Face hub cache layout), mounted "
    f"read-only into the workers. [default: {layout.MODEL_CACHE}]",
)
@click.option(
    "--model-endpoint",
    metavar="URL|DIR",
    help="Where the models come from: a hub or a mirror of one, HF_ENDPOINT-style "
    "(http(s)://HOST[:PORT][/PATH]), or a directory on the hosts holding a hub cache (an "
    f"offline fleet's mirror). [default: {DEFAULT_ENDPOINT}]",
)
@click.option(
    "--repin",
    is_flag=True,
    help="Forget and re-pin the host keys of the given hosts (and of --proxy-jump's host).",
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask (nothing here asks yet; for scripts).")
@fabric_cli.mesh_options
@pass_app
def add(
    app: App,
    name: str,
    hosts: tuple[str, ...],
    hosts_file: Path | None,
    user: str | None,
    identity_file: str | None,
    proxy_jump: str | None,
    become: bool | None,
    expect_nics: int | None,
    expect_gpus: int | None,
    gpu_model: str | None,
    gpu_vendor: str | None,
    nic_driver: str | None,
    link_layer: str | None,
    wheelhouse: str | None,
    model_cache: str | None,
    model_endpoint: str | None,
    repin: bool,
    yes: bool,
    fabric: bool,
    sample: float | None,
    rails: str,
    seed: int | None,
    duration: int,
    iterations: int | None,
    parallel_rails: bool,
    min_fraction: float,
) -> None:
    """Add hosts to fleet NAME: pin keys, gather facts, run the preflight (and, with --fabric,
    test the new hosts' RDMA links to the fleet's GPU hosts)."""
    fabric_options = None
    if fabric:
        fabric_options = fabric_cli.options(
            duration=duration,
            iterations=iterations,
            parallel_rails=parallel_rails,
            min_fraction=min_fraction,
            rails=rails,
            sample=sample,
            seed=seed,
        )
    options = fleets.AddOptions(
        hosts=list(hosts),
        hosts_file=hosts_file,
        user=user,
        identity_file=identity_file,
        proxy_jump=proxy_jump,
        become=become,
        expect_nics=expect_nics,
        expect_gpus=expect_gpus,
        gpu_model=gpu_model,
        gpu_vendor=gpu_vendor,
        nic_driver=nic_driver,
        link_layer=link_layer,
        wheelhouse=wheelhouse,
        model_cache=model_cache,
        model_endpoint=model_endpoint,
        repin=repin,
        fabric=fabric_options,
    )
    with app.out.progress(f"fleet add {name}") as progress:
        doc = fleets.add(app.workspace, name, options, progress)
    emit(app, doc, lambda: _render_report(app, doc), fleets.failure(doc))


@fleet.command()
@click.argument("name")
@click.option(
    "--limit",
    "limit",
    multiple=True,
    metavar="HOST",
    help="Only this host (repeatable); with --fabric, the pairs it is in.",
)
@click.option(
    "--fabric-only",
    is_flag=True,
    help="The fabric check alone (implies --fabric), on the facts on record: no preflight.",
)
@fabric_cli.mesh_options
@pass_app
def check(
    app: App,
    name: str,
    limit: tuple[str, ...],
    fabric_only: bool,
    fabric: bool,
    sample: float | None,
    rails: str,
    seed: int | None,
    duration: int,
    iterations: int | None,
    parallel_rails: bool,
    min_fraction: float,
) -> None:
    """Re-run the preflight: which host fails which check, and why. With --fabric, then
    measure the RDMA links between the GPU hosts and name the slow host or link."""
    fabric_options = None
    if fabric or fabric_only:
        fabric_options = fabric_cli.options(
            duration=duration,
            iterations=iterations,
            parallel_rails=parallel_rails,
            min_fraction=min_fraction,
            rails=rails,
            sample=sample,
            seed=seed,
        )
    with app.out.progress(f"fleet check {name}") as progress:
        doc = fleets.check(
            app.workspace,
            name,
            list(limit),
            progress,
            fabric_options,
            preflight=not fabric_only,
        )
    emit(app, doc, lambda: _render_report(app, doc), fleets.failure(doc))


@fleet.command(name="list")
@pass_app
def list_(app: App) -> None:
    """The fleets in this workspace."""
    doc = fleets.list_all(app.workspace)

    def render() -> None:
        if not doc["fleets"]:
            app.out.line("no fleets yet: `pdctl fleet add NAME --host [USER@]ADDR ...`")
            return
        app.out.table(
            ["fleet", "hosts", "gpu", "cpu", "failed", "services"],
            [
                (
                    f["name"],
                    f["hosts"],
                    f["gpu_hosts"],
                    f["cpu_hosts"],
                    f["failed"],
                    ", ".join(f["services"]),
                )
                for f in doc["fleets"]
            ],
        )

    app.out.result(doc, render)


@fleet.command()
@click.argument("name")
@pass_app
def show(app: App, name: str) -> None:
    """Hosts, facts, last check, and the services placed on them."""
    doc = fleets.show(app.workspace, name)

    def render() -> None:
        rows = []
        for h in doc["hosts"]:
            facts = h["facts"] or {}
            gpus = facts.get("gpus") or {}
            runtime = facts.get("runtime") or {}
            preflight = h["preflight"]
            fabric = h.get("fabric")
            rows.append(
                (
                    h["name"],
                    h["kind"],
                    f"{h['user']}@{h['address']}:{h['port']}",
                    f"{gpus.get('count', '?')} {gpus.get('model') or ''}".strip(),
                    len((facts.get("rdma") or {}).get("devices") or []),
                    runtime.get("name") or "-",
                    "-" if preflight is None else ("ok" if preflight["ok"] else "FAILED"),
                    preflight["checked_at"] if preflight else "never",
                    "-" if fabric is None else ("ok" if fabric["ok"] else "FAILED"),
                    ", ".join(h["services"]),
                )
            )
        app.out.table(
            [
                "host",
                "kind",
                "ssh",
                "gpus",
                "rdma",
                "runtime",
                "preflight",
                "checked",
                "fabric",
                "services",
            ],
            rows,
            title=f"fleet {name} ({doc['inventory']})",
        )

    app.out.result(doc, render)


@fleet.command()
@click.argument("name")
@click.option("--host", "hosts", multiple=True, help="Remove only this host (repeatable).")
@click.option("--force", is_flag=True, help="Even while services have replicas there.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_app
def remove(app: App, name: str, hosts: tuple[str, ...], force: bool, yes: bool) -> None:
    """Remove a fleet, or some of its hosts, from the workspace (hosts are not touched)."""
    what = f"hosts {', '.join(hosts)} from fleet {name}" if hosts else f"fleet {name}"
    if not yes and not app.out.json_mode:
        click.confirm(f"Remove {what}?", abort=True, err=True)
    doc = fleets.remove(app.workspace, name, list(hosts), force)
    app.out.result(doc, lambda: app.out.line(f"removed {', '.join(doc['removed_hosts'])}"))
