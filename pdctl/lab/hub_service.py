"""The lab's model hub in the lab: its own network namespace on the lab bridge, at the lab
address ``<subnet>.2`` (not a host of the fleet), started by ``lab up``, stopped by ``lab down``.

The hub's directory is ``<lab>/hub`` (hub_models.Store); generated shards are kept
machine-wide under ``<cache>/hub`` so a model added again, in any lab, is not made again. A
repository no one added is made on its first request (``lab up --hub-model-size``, 64 MiB by
default), so a spec runs in the lab with the model it names, with no lab-only step. The
hub caps its own serving rate (its settings file; the site's uplink); each host's link can
be capped too, by a tbf qdisc on both ends of its veth (``--link-rate``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdctl.core.errors import InputError, PdctlError
from pdctl.doors.workspace import cache_dir
from pdctl.lab import hub, hub_models, network
from pdctl.lab.state import LabHost, LabState
from pdctl.lab.system import quiet, run

PORT = 8080
START_TIMEOUT = 20.0
HUB_MODULE = "pdctl.lab.hub"


def address(state: LabState) -> str:
    return f"{state.subnet}.2"


def endpoint(state: LabState) -> str:
    return f"http://{address(state)}:{PORT}"


def netns(state: LabState) -> str:
    return f"pdl{state.lab_id}-hub"  # swept with the hosts' namespaces (network.stray_netns)


def veth(state: LabState) -> str:
    return f"pl{state.lab_id}hub"  # <= 15 characters; swept like the hosts' (network.stray_links)


def root(lab_dir: Path) -> Path:
    return lab_dir / "hub"


def model_cache() -> Path:
    return cache_dir() / "hub"


def parse_rate(text: str | None) -> int | None:
    """``10M`` -> bytes/s (K/M/G are powers of 1024); ``none`` or ``0`` -> no cap."""
    if text is None or text.strip().lower() in {"none", "0", ""}:
        return None
    try:
        return hub_models.parse_size(text)
    except hub_models.HubError as exc:
        raise InputError(f"not a rate: {text!r}", hint="bytes per second: 10M, 1G, none") from exc


def add_model(lab_dir: Path, repo: str, size: str) -> hub_models.Repo:
    try:
        return hub_models.add_model(root(lab_dir), repo, hub_models.parse_size(size), model_cache())
    except hub_models.HubError as exc:
        raise InputError(str(exc)) from exc


def pids(state: LabState) -> list[int]:
    """The processes in the hub's namespace: the hub server."""
    if not network.netns_exists(netns(state)):
        return []
    found = run(["ip", "netns", "pids", netns(state)], check=False).stdout.split()
    return [int(pid) for pid in found if pid.isdigit()]


def is_running(state: LabState) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((address(state), PORT), 0.5):
        return bool(pids(state))
    return False


def ensure(state: LabState, lab_dir: Path) -> None:
    """Start the hub if it is not serving (with lab/tiny-llama in it); idempotent."""
    hub_models.ensure_tiny(root(lab_dir), model_cache())
    hub.write_settings(root(lab_dir), state.hub_rate, _token(lab_dir), state.hub_model_size)
    if is_running(state):
        return
    stop(state)
    network.plug_namespace(state, netns(state), veth(state), address(state))
    log = (lab_dir / "hub.log").open("ab")
    with log:
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                netns(state),
                sys.executable,
                "-m",
                HUB_MODULE,
                "serve",
                "--root",
                str(root(lab_dir)),
                "--host",
                address(state),
                "--port",
                str(PORT),
                "--cache",
                str(model_cache()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT
    while not is_running(state):
        if time.monotonic() > deadline:
            raise PdctlError(
                f"the lab hub did not start at {endpoint(state)}", hint=f"see {lab_dir / 'hub.log'}"
            )
        time.sleep(0.1)


def stop(state: LabState) -> None:
    """Kill the hub and remove its namespace and veth (safe when there is none)."""
    for pid in pids(state):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    network.unplug_namespace(netns(state), veth(state))


def _token(lab_dir: Path) -> str | None:
    token = hub.read_settings(root(lab_dir)).get("token")
    return str(token) if token else None


def set_rate(state: LabState, lab_dir: Path, rate: int | None) -> None:
    state.hub_rate = rate
    hub.write_settings(root(lab_dir), rate, _token(lab_dir), state.hub_model_size)


def set_token(state: LabState, lab_dir: Path, token: str | None) -> None:
    hub.write_settings(root(lab_dir), state.hub_rate, token, state.hub_model_size)


def parse_model_size(text: str) -> int | None:
    """``64M`` -> bytes; ``none`` or ``0`` -> the hub makes no model on request."""
    if text.strip().lower() in {"none", "0", ""}:
        return None
    try:
        size = hub_models.parse_size(text)
    except hub_models.HubError as exc:
        raise InputError(f"not a size: {text!r}", hint="bytes: 64M, 1G; none") from exc
    if not hub_models.MIN_SHARD <= size <= hub_models.MAX_SIZE:
        raise InputError(
            f"--hub-model-size {text}: between {hub_models.MIN_SHARD} bytes and "
            f"{hub_models.MAX_SIZE >> 30}G"
        )
    return size


def limit_link(state: LabState, host: LabHost, rate: int | None) -> None:
    """Cap the host's link both ways (tbf on its veth's two ends); None: no cap."""
    ends = [[state.veth(host)], ["-n", state.netns(host), "eth0"]]
    for end in ends:
        *where, dev = end
        if rate is None:
            quiet(["tc", *where, "qdisc", "del", "dev", dev, "root"])
            continue
        burst = max(rate // 50, 64 << 10)  # 20 ms of traffic, and at least 64 KiB
        run(
            [
                "tc",
                *where,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate * 8}bit",
                "burst",
                str(burst),
                "latency",
                "50ms",
            ]
        )


def status(state: LabState | None, lab_dir: Path) -> dict[str, Any] | None:
    """``lab status``'s hub: endpoint, per-file downloads, rate, token, models."""
    if state is None or not root(lab_dir).is_dir():
        return None
    report = hub.read_downloads(root(lab_dir))
    settings = hub.read_settings(root(lab_dir))
    store = hub_models.Store(root(lab_dir))
    return {
        "endpoint": endpoint(state),
        "state": "running" if is_running(state) else "stopped",
        "downloads": report["downloads"],
        "bytes_served": report["bytes_served"],
        "rate": settings.get("rate"),
        "token": bool(settings.get("token")),
        "model_size": settings.get("generate"),
        "models": {
            repo.repo_id: {"revision": repo.sha, "bytes": repo.size, "files": len(repo.files)}
            for repo in store.all()
        },
    }
