"""`pdctl lab ...`: the emulated bare-metal fleet."""

from __future__ import annotations

import os
from typing import Any

import click

from pdctl.cli.app import App, pass_app
from pdctl.lab import faults, manager
from pdctl.lab.state import DEFAULT_GPU, LAB_GPUS, LinkLayer


@click.group()
def lab() -> None:
    """An emulated bare-metal GPU fleet on this machine (needs root)."""


def _render_status(app: App, doc: dict[str, Any]) -> None:
    if not doc["hosts"]:
        app.out.line("no lab in this workspace: `pdctl lab up --hosts 3 --cpu-hosts 1` makes one")
        return
    rows = [
        (
            h["name"],
            h["kind"],
            h["address"],
            f"{h['gpus']} {h['gpu_model']}" if h["gpus"] else "0",
            h["state"],
            ", ".join(h["faults"]),
        )
        for h in doc["hosts"]
    ]
    app.out.table(["host", "kind", "address", "gpus", "state", "faults"], rows)
    images = "   ".join(f"{engine}: {name}" for engine, name in doc["worker_images"].items())
    app.out.line(f"worker images: {images}   wheelhouse: {doc['wheelhouse']}")
    for line in doc["emulated"]:
        app.out.line(f"emulated: {line}")
    app.out.line("register these hosts as a fleet with:")
    app.out.line(f"  {doc['fleet_add']}")


@lab.command()
@click.option("--hosts", "hosts", type=int, required=True, help="How many hosts in all.")
@click.option(
    "--cpu-hosts",
    type=int,
    default=0,
    show_default=True,
    help="How many of them (the first ones) have no GPUs and no RDMA NICs: router hosts.",
)
@click.option(
    "--gpu",
    "gpus",
    type=click.Choice(list(LAB_GPUS)),
    multiple=True,
    help="The GPU hosts' model: MI300X (with Broadcom bnxt_re RoCE NICs) or H200/H100 (with "
    "ConnectX mlx5 NICs, nvidia-smi, nvidia-ctk and a CDI spec). Repeat it for a mixed lab: "
    f"GPU hosts take the models in turn. [default: {DEFAULT_GPU}]",
)
@click.option(
    "--link-layer",
    type=click.Choice(["eth", "ib"]),
    default="eth",
    show_default=True,
    help="The NICs' link layer: eth (RoCE) or ib (InfiniBand; NVIDIA hosts only).",
)
@pass_app
def up(app: App, hosts: int, cpu_hosts: int, gpus: tuple[str, ...], link_layer: LinkLayer) -> None:
    """Boot (or converge to) N emulated hosts. Idempotent."""
    with app.out.progress("lab up") as progress:
        doc = manager.up(
            app.workspace, hosts, cpu_hosts, progress, gpus or (DEFAULT_GPU,), link_layer
        )
    app.out.result(doc, lambda: _render_status(app, doc))


@lab.command()
@pass_app
def status(app: App) -> None:
    """Hosts, addresses, state and injected faults."""
    doc = manager.status(app.workspace)
    app.out.result(doc, lambda: _render_status(app, doc))


@lab.command()
@click.argument("host")
@click.argument("kind", type=click.Choice(list(faults.KINDS)))
@click.argument("arg", required=False)
@pass_app
def fault(app: App, host: str, kind: str, arg: str | None) -> None:
    """Inject a fault into a running host (`clear` removes them all).

    \b
    KIND: nic-missing DEV | port-down DEV | provider-lib-missing | no-runtime |
          sshd-down | sudo-password | gpu-missing N | worker-unhealthy |
          driver-missing | cdi-missing (NVIDIA hosts) | clear
    """
    doc = manager.fault(app.workspace, host, kind, arg)
    app.out.result(
        doc,
        lambda: app.out.line(f"{doc['host']}: faults now: {', '.join(doc['faults']) or 'none'}"),
    )


@lab.command()
@pass_app
def down(app: App) -> None:
    """Remove every host, namespace, veth, bridge, mount and cgroup the lab made."""
    with app.out.progress("lab down") as progress:
        doc = manager.down(app.workspace, progress)
    app.out.result(
        doc, lambda: app.out.line(f"lab down: removed {len(doc['removed_hosts'])} host(s)")
    )


@lab.command(context_settings={"ignore_unknown_options": True})
@click.option("--user", default="pdops", show_default=True, help="pdops (sudo user) or root.")
@click.argument("host")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@pass_app
def ssh(app: App, user: str, host: str, command: tuple[str, ...]) -> None:
    """SSH into a lab host (optionally running COMMAND)."""
    argv = manager.ssh_argv(app.workspace, host, user, command)
    os.execvp(argv[0], argv)  # noqa: S606 - replace pdctl with ssh, as `ssh` itself would run
