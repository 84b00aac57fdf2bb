"""Runs ON a host (standard library only; pdctl sends this source on stdin): the GPUs and
ports that pdctl services hold there, for the placement of another one (pdctl/sharing.py).

For each service directory /etc/pdctl/<service>/ it reads:
  <group>-<k>.env  only the PDCTL_GPU_IDS, PDCTL_PORT and PDCTL_BOOTSTRAP_PORT lines (the
                   directory also holds secrets: nothing else of any file leaves the host)
  scaler.json      the scaler's metrics port
and of each router unit /etc/systemd/system/pd-<service>-router.service the words after
--port and --prometheus-port. It prints one JSON document with the values as found (the
controller checks every one of them) and changes nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SLOT_KEYS = ("PDCTL_GPU_IDS", "PDCTL_PORT", "PDCTL_BOOTSTRAP_PORT")
SLOT_FILE = re.compile(r"^(?:prefill|decode)-[0-9]+\.env\Z")
ROUTER_UNIT = re.compile(r"^pd-(.+)-router\.service\Z")
ROUTER_FLAGS = ("--port", "--prometheus-port")


def slots(root: Path) -> list[list[Any]]:
    """[service, file stem, {key: value}] per slot env file."""
    found: list[list[Any]] = []
    for path in sorted((root / "etc/pdctl").glob("*/*.env")):
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


def listeners(root: Path) -> list[list[str]]:
    """[service, flag or "scaler", value] per router flag and scaler metrics port."""
    found: list[list[str]] = []
    for path in sorted((root / "etc/systemd/system").glob("pd-*-router.service")):
        match = ROUTER_UNIT.match(path.name)
        try:
            words = path.read_text(errors="replace").split()
        except OSError:
            continue
        for flag in ROUTER_FLAGS:
            if match and flag in words[:-1]:
                found.append([match[1], flag, words[words.index(flag) + 1]])
    for path in sorted((root / "etc/pdctl").glob("*/scaler.json")):
        try:
            metrics = json.loads(path.read_text()).get("metrics") or {}
            found.append([path.parent.name, "scaler", str(metrics.get("port"))])
        except (OSError, ValueError, AttributeError):
            continue
    return found


def report(root: Path) -> dict[str, Any]:
    return {"slots": slots(root), "listeners": listeners(root)}


if __name__ == "__main__":
    print(json.dumps(report(Path("/"))))
