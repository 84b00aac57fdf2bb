"""The container runtime: which of podman and docker answers, its version, and what
``podman info`` / ``docker info`` say of it (a daemon that does not answer, the OCI runtime).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdctl.onhost.hardware.documents import RUNTIMES
from pdctl.onhost.hardware.parsing import clip, command_result, snippet, stderr_summary

# An OCI runtime that lowers containers' rlimits to what the host grants instead of failing
# (the pdctl lab's crun wrapper) says so in its --version, which `podman info` shows.
RLIMIT_CLAMP_MARK = "rlimits: clamped"


def runtime_view(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """{"name", "version", "usable"} and, when not usable, why."""
    found: list[tuple[str, str, dict[str, Any] | None]] = []
    for name in RUNTIMES:
        cmd = command_result(raw, f"{name}_version")
        if cmd is None or cmd["rc"] != 0:
            continue
        match = re.search(r"\bversion\s+v?(\d[^\s,]*)", cmd["stdout"])
        version = match.group(1) if match else snippet(cmd["stdout"], 40)
        if name == "docker" and cmd["stdout"].strip().lower().startswith("podman"):
            if any(n == "podman" for n, _, _ in found):
                continue  # podman-docker's shim: the same runtime
            name = "podman"  # noqa: PLW2901 - the shim is podman under another name
        found.append((name, version, command_result(raw, f"{name}_info")))
    if not found:
        return {"name": None, "version": None, "usable": False}, None
    judged = [(name, version, info, _info_problem(name, info)) for name, version, info in found]
    name, version, info, problem = next((j for j in judged if j[3] is None), judged[0])
    view = {"name": name, "version": version, "usable": problem is None}
    return {**view, **_oci_runtime(info)}, problem


def _oci_runtime(info: dict[str, Any] | None) -> dict[str, Any]:
    """From `podman info`: the OCI runtime's path and whether it clamps rlimits ({}: not shown)."""
    try:
        oci = json.loads(info["stdout"])["host"]["ociRuntime"] if info else {}
        lines = str(oci.get("version") or "").splitlines()
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}
    return {
        "oci_runtime": str(oci.get("path") or oci.get("name") or ""),
        "clamps_rlimits": any(line.startswith(RLIMIT_CLAMP_MARK) for line in lines),
    }


def _info_problem(name: str, info: dict[str, Any] | None) -> str | None:
    if info is None:
        return f"`{name} info` was not run"
    if info["rc"] != 0:
        return stderr_summary(info)
    if name == "docker":
        # docker info can exit 0 with the daemon unreachable (docker/cli#5900); the JSON says so.
        try:
            data = json.loads(info["stdout"])
        except ValueError:
            return f"unexpected `docker info` output: {snippet(info['stdout'], 60)!r}"
        server_errors = data.get("ServerErrors") if isinstance(data, dict) else None
        if server_errors:
            return clip(str(server_errors[0]), 100)
    return None
