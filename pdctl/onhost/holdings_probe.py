"""Runs ON a host: the GPUs and ports that pdctl services hold there, for the placement of
another one (pdctl/operations/sharing.py).

``python3 -m pdctl.onhost.holdings_probe`` (a bundle, pdctl/onhost/bundle.py) reads one JSON
document on stdin with where things are (pdctl/core/layout.py):
  config_root   holds a directory per service
  unit_dir      holds the router units
  router_units  the router units' glob, one '*' standing for the service

For each service directory <config_root>/<service>/ it reads:
  <group>-<k>.env  only the PDCTL_GPU_IDS, PDCTL_PORT, PDCTL_BOOTSTRAP_PORT,
                   VLLM_NIXL_SIDE_CHANNEL_PORT and PDCTL_KV_PORT lines (the
                   directory also holds secrets: nothing else of any file leaves the host)
  scaler.json      the scaler's metrics port
and of each router unit the words after --port and --prometheus-port. It prints one JSON
document with the values as found (the controller checks every one of them) and changes
nothing.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SLOT_KEYS = (
    "PDCTL_GPU_IDS",
    "PDCTL_PORT",
    "PDCTL_BOOTSTRAP_PORT",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "PDCTL_KV_PORT",
)
SLOT_FILE = re.compile(r"^(?:prefill|decode)-[0-9]+\.env\Z")
ROUTER_FLAGS = ("--port", "--prometheus-port")


def slots(config_root: Path) -> list[list[Any]]:
    """[service, file stem, {key: value}] per slot env file."""
    found: list[list[Any]] = []
    for path in sorted(config_root.glob("*/*.env")):
        if not SLOT_FILE.match(path.name):
            continue
        values = {}
        try:
            for line in path.read_text(errors="replace").splitlines():
                key, sep, value = line.partition("=")
                if sep and key in SLOT_KEYS:
                    values[key] = value
        except OSError:
            continue
        found.append([path.parent.name, path.name[: -len(".env")], values])
    return found


def listeners(config_root: Path, unit_dir: Path, router_units: str) -> list[list[str]]:
    """[service, flag or "scaler", value] per router flag and scaler metrics port."""
    found: list[list[str]] = []
    head, _, tail = router_units.partition("*")
    router_unit = re.compile(f"^{re.escape(head)}(.+){re.escape(tail)}\\Z")
    for path in sorted(unit_dir.glob(router_units)):
        match = router_unit.match(path.name)
        try:
            words = path.read_text(errors="replace").split()
        except OSError:
            continue
        for flag in ROUTER_FLAGS:
            if match and flag in words[:-1]:
                found.append([match[1], flag, words[words.index(flag) + 1]])
    for path in sorted(config_root.glob("*/scaler.json")):
        try:
            metrics = json.loads(path.read_text()).get("metrics") or {}
            found.append([path.parent.name, "scaler", str(metrics.get("port"))])
        except (OSError, ValueError, AttributeError):
            continue
    return found


def report(root: Path, where: Mapping[str, str]) -> dict[str, Any]:
    """What the services under ``root`` (``/`` on a host) hold; ``where`` as main's."""
    config_root = root / where["config_root"].lstrip("/")
    unit_dir = root / where["unit_dir"].lstrip("/")
    return {
        "slots": slots(config_root),
        "listeners": listeners(config_root, unit_dir, where["router_units"]),
    }


def main(params: str) -> None:
    print(json.dumps(report(Path("/"), json.loads(params))))


if __name__ == "__main__":
    main(sys.stdin.read())
