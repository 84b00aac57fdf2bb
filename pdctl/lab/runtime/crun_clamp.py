#!/usr/bin/python3 -IS
"""The lab hosts' OCI runtime: crun, with each container's rlimits clamped to what the host grants.

Worker units ask for what production needs (``--ulimit memlock=-1:-1`` for RDMA), and podman
adds its own defaults beside any ``--ulimit`` (nofile and nproc 1048576). Raising a hard limit
takes CAP_SYS_RESOURCE, which no process has on machines of this project's kind, so crun
fails with EPERM and no worker starts. Podman runs this instead of crun (the lab's
containers.conf drop-in): for ``create``, ``run`` and ``exec`` it lowers every rlimit of the
container's process to this host's current hard limit, appends what it changed to ``LOG``
(``pdctl lab status`` reports it), and execs the real crun with the same arguments. A host
that can raise its limits gets its containers' rlimits untouched.

Standard library only, and quick to start (``-IS``): podman runs the runtime for every
container step (create, start, exec, kill, delete). pdctl imports this file too, to read
``LOG`` (``emulated()``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REAL_RUNTIME = "/usr/bin/crun"
LOG_DIR = "/var/log/pdctl-lab"
LOG = f"{LOG_DIR}/rlimits.jsonl"
# RLIM_INFINITY as an OCI config writes it (uint64); Python's resource module says -1.
INFINITY = 2**64 - 1
CAP_SYS_RESOURCE = 24
WHY = "this machine cannot raise rlimits"
# Added to crun's --version (which `podman info` shows as host.ociRuntime.version): how the
# preflight (pdctl/onhost/hardware/runtime.py, RLIMIT_CLAMP_MARK) learns that container rlimits
# are emulated.
VERSION_NOTE = "rlimits: clamped to this host's hard limits (pdctl lab)"
# crun's global options (before the command) that take the next word as their value.
_GLOBAL_VALUED = frozenset(
    {"--root", "--log", "--log-format", "--log-level", "--cgroup-manager", "--rootless"}
)
Rlimit = dict[str, Any]  # an OCI process.rlimits entry: {"type", "soft", "hard"}
Change = dict[str, Any]  # {"rlimit", "requested": [soft, hard], "granted": [soft, hard]}


def command_of(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """crun's command word and the arguments after it (global options skipped)."""
    skip = False
    for index, word in enumerate(argv):
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in _GLOBAL_VALUED
        else:
            return word, list(argv[index + 1 :])
    return None, []


def option(args: Sequence[str], *names: str) -> str | None:
    """The value of an option given as ``--name VALUE``, ``--name=VALUE`` or ``-n VALUE``."""
    for index, word in enumerate(args):
        if word in names and index + 1 < len(args):
            return args[index + 1]
        for name in names:
            if name.startswith("--") and word.startswith(f"{name}="):
                return word[len(name) + 1 :]
    return None


def process_file(command: str | None, args: Sequence[str], cwd: str) -> Path | None:
    """The JSON file whose rlimits crun applies: a bundle's config.json, or exec's process."""
    if command in ("create", "run"):
        return Path(cwd, option(args, "--bundle", "-b") or ".", "config.json")
    if command == "exec":
        process = option(args, "--process", "-p")
        return Path(cwd, process) if process else None
    return None


def _uint(value: int) -> int:
    return INFINITY if value < 0 or value >= INFINITY else value


def can_raise(status: str) -> bool:
    """Whether a process with this /proc/<pid>/status holds CAP_SYS_RESOURCE (effective)."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def ceilings() -> dict[str, int]:
    """RLIMIT_* name -> the highest hard limit this process can set: its current one."""
    if can_raise(Path("/proc/self/status").read_text()):
        return {}
    names = [name for name in dir(resource) if name.startswith("RLIMIT_")]
    return {name: _uint(resource.getrlimit(getattr(resource, name))[1]) for name in names}


def clamp(
    rlimits: Iterable[Rlimit], limits: Mapping[str, int]
) -> tuple[list[Rlimit], list[Change]]:
    """Each rlimit lowered to its ceiling in ``limits`` (soft never above hard); what changed."""
    kept: list[Rlimit] = []
    changes: list[Change] = []
    for entry in rlimits:
        ceiling = limits.get(str(entry.get("type")))
        soft, hard = int(entry.get("soft", 0)), int(entry.get("hard", 0))
        if ceiling is None or hard <= ceiling:
            kept.append(entry)
            continue
        granted = {**entry, "hard": ceiling, "soft": min(soft, ceiling)}
        kept.append(granted)
        changes.append(
            {
                "rlimit": entry["type"],
                "requested": [soft, hard],
                "granted": [granted["soft"], granted["hard"]],
            }
        )
    return kept, changes


def clamp_document(doc: dict[str, Any], command: str, limits: Mapping[str, int]) -> list[Change]:
    """Clamp the rlimits of a config.json (create, run) or a process file (exec) in place."""
    process = doc.get("process") if command in ("create", "run") else doc
    if not isinstance(process, dict) or not process.get("rlimits"):
        return []
    process["rlimits"], changes = clamp(process["rlimits"], limits)
    return changes


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``path`` whole, keeping its owner and mode: it holds the container's secrets."""
    before = path.stat()
    temporary = path.with_name(f".{path.name}.pdctl-lab")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(json.dumps(doc))
        os.fchown(handle.fileno(), before.st_uid, before.st_gid)
        os.fchmod(handle.fileno(), before.st_mode & 0o7777)
    temporary.replace(path)


def record(changes: Iterable[Change], log: Path) -> None:
    """Append the changes not yet in the log (one JSON line each; a log stays a few lines)."""
    seen = set(log.read_text().splitlines()) if log.is_file() else set()
    lines = [json.dumps(change, sort_keys=True) for change in changes]
    fresh = [line for line in dict.fromkeys(lines) if line not in seen]
    if fresh:
        with log.open("a") as handle:
            handle.write("".join(f"{line}\n" for line in fresh))


def _value(value: int) -> str:
    return "unlimited" if value >= INFINITY else str(value)


def describe(change: Change) -> str:
    """'memlock unlimited requested, 8388608 granted (this machine cannot raise rlimits)'."""
    name = str(change["rlimit"]).removeprefix("RLIMIT_").lower()
    asked, got = change["requested"], change["granted"]

    def pair(soft: int, hard: int) -> str:
        return _value(hard) if soft == hard else f"{_value(soft)}:{_value(hard)}"

    return f"{name} {pair(*asked)} requested, {pair(*got)} granted ({WHY})"


def emulated(log: Path) -> list[str]:
    """What a host's runtime clamped so far, one sentence each, sorted."""
    if not log.is_file():
        return []
    found = set()
    for line in log.read_text().splitlines():
        try:
            found.add(describe(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            continue  # a torn line from a crash: the next container writes it again
    return sorted(found)


def adjust(argv: Sequence[str], cwd: str, log: Path) -> None:
    """Clamp the rlimits crun is about to apply for this command, and log what changed."""
    command, args = command_of(argv)
    path = process_file(command, args, cwd)
    if command is None or path is None or not path.is_file():
        return
    limits = ceilings()
    if not limits:
        return
    doc = json.loads(path.read_text())
    changes = clamp_document(doc, command, limits)
    if changes:
        _write_json(path, doc)
        record(changes, log)


def _version() -> None:
    import subprocess  # noqa: PLC0415 - only here: every other call must start fast

    real = subprocess.run([REAL_RUNTIME, "--version"], capture_output=True, text=True, check=False)
    sys.stdout.write(f"{real.stdout.rstrip()}\n{VERSION_NOTE}\n")
    sys.stderr.write(real.stderr)
    sys.exit(real.returncode)


def main(argv: Sequence[str]) -> None:
    if list(argv) == ["--version"]:
        _version()
    try:
        adjust(argv, str(Path.cwd()), Path(LOG))
    except Exception as exc:  # crun then fails as it would have, with its own error
        sys.stderr.write(f"pdctl lab runtime: rlimits left as asked: {exc}\n")
    os.execv(REAL_RUNTIME, [REAL_RUNTIME, *argv])  # noqa: S606 - crun, with podman's arguments


if __name__ == "__main__":
    main(sys.argv[1:])
