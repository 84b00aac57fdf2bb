"""`pdctl lab ...`: the emulated bare-metal fleet."""

from __future__ import annotations

import os
from pathlib import Path
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
    hub = doc.get("hub")
    if hub:
        rate = f"{hub['rate']} B/s" if hub["rate"] else "uncapped"
        links = f"{doc['link_rate']} B/s" if doc.get("link_rate") else "uncapped"
        made = f"{hub['model_size']} B" if hub.get("model_size") else "none (404)"
        app.out.line(
            f"model hub: {hub['endpoint']} ({hub['state']}; rate {rate}; host links {links}; "
            f"models: {', '.join(hub['models']) or 'none'}; an unknown model: {made})"
        )
        for name, count in hub["downloads"].items():
            app.out.line(f"  downloaded {count}x: {name}")
    for line in doc["emulated"]:
        app.out.line(f"emulated: {line}")
    if doc.get("free_addresses"):
        app.out.line(
            f"free for failover addresses (pdctl: {{router: {{address: IP}}}}): "
            f"{doc['free_addresses']}"
        )
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
@click.option(
    "--hub-rate",
    default=None,
    help="Cap the model hub's serving rate, all downloads together (the site's uplink), in "
    "bytes/s: 10M, 1G; none: no cap. [default: as before; none at first]",
)
@click.option(
    "--hub-model-size",
    default=None,
    help="The size of the model the hub makes when a spec names one it has never seen "
    "(as the real hub would serve it): 64M, 1G; none: unknown models are 404. "
    "[default: as before; 64M at first]",
)
@click.option(
    "--link-rate",
    default=None,
    help="Cap each host's link, both ways, in bytes/s: 100M; none: no cap. "
    "[default: as before; none at first]",
)
@pass_app
def up(
    app: App,
    hosts: int,
    cpu_hosts: int,
    gpus: tuple[str, ...],
    link_layer: LinkLayer,
    hub_rate: str | None,
    hub_model_size: str | None,
    link_rate: str | None,
) -> None:
    """Boot (or converge to) N emulated hosts and the model hub. Idempotent."""
    with app.out.progress("lab up") as progress:
        doc = manager.up(
            app.workspace,
            hosts,
            cpu_hosts,
            progress,
            gpus or (DEFAULT_GPU,),
            link_layer,
            hub_rate=hub_rate,
            link_rate=link_rate,
            hub_model_size=hub_model_size,
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
    """Inject a fault into a running host (`clear` removes them all), or power it off and on.

    \b
    KIND: nic-missing DEV | port-down DEV | provider-lib-missing | no-runtime |
          sshd-down | sudo-password | gpu-missing N | worker-unhealthy |
          driver-missing | cdi-missing (NVIDIA hosts) |
          link-slow RATE (bytes/s, both ways: 20M) | clear |
          power-off (at once: no packet in or out, every process gone, disk kept) |
          power-on (boots it again; its enabled units start)
    """
    with app.out.progress(f"lab fault {host} {kind}") as progress:
        doc = manager.fault(app.workspace, host, kind, arg, progress)

    def render() -> None:
        faults_now = ", ".join(doc["faults"]) or "none"
        app.out.line(f"{doc['host']}: power {doc['power']}; faults now: {faults_now}")

    app.out.result(doc, render)


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


@lab.group()
def hub() -> None:
    """The lab's model hub (what huggingface_hub downloads from), at `lab status`'s endpoint."""


@hub.command("add")
@click.argument("repo")
@click.option("--size", required=True, help="The weights' bytes: 256M, 1G (K/M/G: 1024-based).")
@pass_app
def hub_add(app: App, repo: str, size: str) -> None:
    """Add a model REPO (ORG/NAME) of deterministic bytes: config.json, tokenizer.json and
    safetensors shards (one per 128 MiB, at most 4). Made once per machine, then instant."""
    doc = manager.hub_add(app.workspace, repo, size)
    app.out.result(
        doc,
        lambda: app.out.line(
            f"{doc['repo']}@{doc['revision'][:12]}: {len(doc['files'])} files, {doc['bytes']} bytes"
        ),
    )


@hub.command("limit")
@click.argument("rate")
@pass_app
def hub_limit(app: App, rate: str) -> None:
    """Cap the hub's serving rate (bytes/s, all downloads together): 10M; none: no cap."""
    doc = manager.hub_limit(app.workspace, rate)
    app.out.result(doc, lambda: app.out.line(f"hub rate: {doc['hub_rate'] or 'uncapped'}"))


@hub.command("token")
@click.option(
    "--file",
    "token_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A file holding the token the hub then requires (Authorization: Bearer).",
)
@click.option("--none", "no_token", is_flag=True, help="The hub requires no token.")
@pass_app
def hub_token(app: App, token_file: Path | None, no_token: bool) -> None:
    """Make the hub require a token (401 without it), or none."""
    if (token_file is None) == (not no_token):
        raise click.UsageError("give --file PATH or --none")
    token = token_file.read_text().strip() if token_file else None
    if token_file is not None and not token:
        raise click.UsageError(f"{token_file} is empty")
    doc = manager.hub_token(app.workspace, token)
    app.out.result(
        doc, lambda: app.out.line("hub token: " + ("required" if doc["token"] else "none"))
    )


@lab.command("link-rate")
@click.argument("rate")
@pass_app
def link_rate(app: App, rate: str) -> None:
    """Cap every host's link, both ways (bytes/s): 100M; none: no cap."""
    doc = manager.link_limit(app.workspace, rate)
    app.out.result(doc, lambda: app.out.line(f"host links: {doc['link_rate'] or 'uncapped'}"))
