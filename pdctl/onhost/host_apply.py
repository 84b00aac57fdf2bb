"""Runs ON a host: converge it to the desired state a role sends, in one step, and report.

A role sends the host's whole desired state at once (its directories, files and units, the
units to start, the units whose health to wait for) instead of a task per file and per unit,
each a round trip. This applies it idempotently and prints one JSON report: what changed
(file by file), the units' states before, what it started, and each waited unit's health.
With ``check`` it changes nothing and reports what it would change; with ``diff`` the report
carries a unified diff of every file that is not secret. Secret files (an env file of the
secrets' values) are written 0600 and never appear in the report, in a diff or in an argv.

The request (JSON on stdin, after the bundle):

    {"check": bool, "diff": bool,
     "users": [{"name", "home", "shell"}],  # system users, made when missing (no password)
     "dirs":  [{"path", "mode", "owner"?}],
     "files": [{"path", "mode", "owner"?, "validate"?: "visudo",
                "content" | "secret_env": [NAME...] | "match" + "line"}],
     "secrets": {NAME: value},              # the values secret_env files are made of
     "units":  [UNIT...],                   # whose ActiveState the report gives (before)
     "start":  [UNIT...],                   # started and enabled; a failed one reset first
     "restart": {UNIT: [PATH...]},          # restarted when one of its files changed
     "restart_now": [UNIT...],              # restarted whatever changed here (its venv did)
     "labels": {"runtime", "containers": {KEY: CONTAINER}, "label"},  # config label of each
                                            # running container (a rollout's stale slots)
     "wait":  {"units": [{"unit", "probe_url", "name"?}], "timeout", "interval",
               "probe_timeout"}}

A file's owner is a user (root by default; the group is the user's own). A "match" + "line"
file is shared: only the line holding match is this request's, the others stay as they are.

Everything is data: paths must be absolute and plain, modes octal, unit names systemd's; a
request that breaks that changes nothing and fails with the reason. A unit file among the
changed files reloads systemd before anything starts. The wait probes with unit_probe, as the
pd_health role's does. Standard library and this package only, Python 3.9 (it ships as a bundle,
pdctl/onhost/bundle.py).
"""

from __future__ import annotations

import difflib
import json
import os
import pwd
import re
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.onhost import unit_probe

UNIT = re.compile(r"[A-Za-z0-9][A-Za-z0-9@._:-]*\.(service|socket|timer|target)")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
MODE = re.compile(r"0?[0-7]{3,4}")
UNIT_DIRS = ("/etc/systemd/system/", "/usr/lib/systemd/system/", "/run/systemd/system/")
COMMAND_TIMEOUT = 120.0  # one systemctl or runtime call
# A start or a stop returns once its jobs ran: ExecStartPre (a container's removal), a
# worker's drain within its TimeoutStopSec.
JOB_TIMEOUT = 600.0
JOURNAL_LINES = 15

Probe = Callable[[str, str, float], dict[str, Any]]


class RequestError(ValueError):
    """The request is not what a role sends: nothing was changed."""


@dataclass
class File:
    path: str
    mode: int
    content: bytes | None  # None: a secret file, made from secret_env names
    secret_env: list[str] = field(default_factory=list)
    owner: str = "root"  # a user; the group is its primary group
    validate: str | None = None  # "visudo": installed only if `visudo -cf` accepts it
    line: tuple[str, str] | None = None  # (match, line): only the line holding match is ours

    @property
    def secret(self) -> bool:
        return self.content is None and self.line is None


def plain_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise RequestError(f"not an absolute path: {value!r}")
    parts = value.split("/")
    if any(part in {".", ".."} for part in parts) or "//" in value or value.endswith("/"):
        raise RequestError(f"not a plain absolute path: {value!r}")
    return value


def below_top(value: Any) -> str:
    """A plain absolute path deep enough to remove (or replace) with its contents: never / nor
    a directory right under it."""
    path = plain_path(value)
    if path.count("/") < 2:
        raise RequestError(f"{path} is a top-level directory: refusing it")
    return path


def _mode(value: Any) -> int:
    if not isinstance(value, str) or not MODE.fullmatch(value):
        raise RequestError(f"not an octal mode: {value!r}")
    return int(value, 8)


def unit_name(value: Any) -> str:
    if not isinstance(value, str) or not UNIT.fullmatch(value):
        raise RequestError(f"not a unit name: {value!r}")
    return value


def _units(values: Any) -> list[str]:
    if not isinstance(values, list):
        raise RequestError(f"not a list of units: {values!r}")
    return [unit_name(v) for v in values]


def _owner(value: Any) -> str:
    if value is None:
        return "root"
    if not isinstance(value, str) or not USER.fullmatch(value):
        raise RequestError(f"not a user name: {value!r}")
    return value


def _file(entry: Any) -> File:
    if not isinstance(entry, dict):
        raise RequestError(f"not a file entry: {entry!r}")
    path, mode, owner = (
        plain_path(entry.get("path")),
        _mode(entry.get("mode")),
        _owner(entry.get("owner")),
    )
    validate = entry.get("validate")
    if validate not in {None, "visudo"}:
        raise RequestError(f"{path}: unknown validation {validate!r} (visudo is the one known)")
    if "secret_env" in entry:
        names = entry["secret_env"]
        if not isinstance(names, list) or not all(
            isinstance(n, str) and ENV_NAME.fullmatch(n) for n in names
        ):
            raise RequestError(f"{path}: secret_env is not a list of variable names")
        if mode & 0o077:
            raise RequestError(f"{path}: a secret file must not be readable by others")
        return File(path, mode, None, list(names), owner, validate)
    if isinstance(entry.get("line"), str) and isinstance(entry.get("match"), str):
        line, match = entry["line"], entry["match"]
        if not match or match not in line or "\n" in line:
            raise RequestError(f"{path}: a line must be one line holding its match")
        return File(path, mode, None, [], owner, validate, (match, line))
    if isinstance(entry.get("content"), str):
        return File(path, mode, entry["content"].encode(), [], owner, validate)
    raise RequestError(f"{path}: neither content, secret_env nor line")


def parse_files(request: dict[str, Any]) -> list[File]:
    files = [_file(entry) for entry in request.get("files") or []]
    seen = set()
    for item in files:
        if item.path in seen:
            raise RequestError(f"{item.path} is given twice")
        seen.add(item.path)
    return files


def secret_content(item: File, secrets: dict[str, Any]) -> bytes:
    """NAME=value lines; a value that an env file cannot hold is refused by its name only."""
    lines = []
    for name in item.secret_env:
        value = secrets.get(name)
        if not isinstance(value, str):
            raise RequestError(f"{item.path}: the value of {name} was not sent")
        if "\n" in value or "\r" in value or "\0" in value:
            raise RequestError(
                f"{item.path}: {name} holds a line break or NUL, which an env file cannot"
            )
        lines.append(f"{name}={value}\n")
    return "".join(lines).encode()


def with_line(before: bytes | None, match: str, line: str) -> bytes:
    """The file's lines with the one holding ``match`` replaced by ``line`` (appended when
    none does): other services' lines stay as they are."""
    kept = [old for old in (before or b"").decode().splitlines() if match not in old]
    return "".join(f"{old}\n" for old in [*kept, line]).encode()


def _read(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _ids(owner: str) -> tuple[int, int] | None:
    """(uid, gid) of ``owner``; None while it does not exist (check mode, before its creation)."""
    try:
        found = pwd.getpwnam(owner)
    except KeyError:
        return None
    return found.pw_uid, found.pw_gid


def _write(path: str, data: bytes, mode: int, owner: str, validate: str | None) -> None:
    """Replace ``path`` at once: a reader sees the old file or the new one, never a part."""
    fd, temp = tempfile.mkstemp(dir=Path(path).parent, prefix=".pdctl-")
    try:
        os.fchmod(fd, mode)
        ids = _ids(owner)
        if os.geteuid() == 0 and ids is not None:
            os.fchown(fd, *ids)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if validate == "visudo":
            checked = run(["visudo", "-cf", temp])
            if checked.returncode != 0:
                raise ApplyError(
                    f"{path}: visudo refused it: {checked.stdout.strip()} {checked.stderr.strip()}"
                )
        Path(temp).replace(path)
    except BaseException:
        with suppress(FileNotFoundError):
            Path(temp).unlink()
        raise


def _diff(path: str, before: bytes | None, after: bytes) -> str:
    old = (before or b"").decode(errors="replace").splitlines(keepends=True)
    new = after.decode(errors="replace").splitlines(keepends=True)
    head = "/dev/null" if before is None else path
    return "".join(difflib.unified_diff(old, new, fromfile=head, tofile=path))


@dataclass
class Changes:
    """What converging the host takes, found before anything is changed."""

    users: list[dict[str, str]] = field(default_factory=list)
    dirs: list[tuple[str, int, str, bool]] = field(
        default_factory=list
    )  # path, mode, owner, exists
    files: list[tuple[File, bytes]] = field(default_factory=list)  # (File, its content)
    diffs: list[str] = field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        return (
            [f"user {user['name']}" for user in self.users]
            + [path for path, _, _, _ in self.dirs]
            + [item.path for item, _ in self.files]
        )


def _users(request: dict[str, Any]) -> list[dict[str, str]]:
    users = []
    for entry in request.get("users") or []:
        if not isinstance(entry, dict):
            raise RequestError(f"not a user entry: {entry!r}")
        name = _owner(entry.get("name"))
        shell = entry.get("shell", "/bin/sh")
        users.append(
            {"name": name, "home": plain_path(entry.get("home")), "shell": plain_path(shell)}
        )
    return users


def _dir_entries(request: dict[str, Any]) -> list[tuple[str, int, str]]:
    entries = []
    for entry in request.get("dirs") or []:
        if not isinstance(entry, dict):
            raise RequestError(f"not a directory entry: {entry!r}")
        entries.append(
            (plain_path(entry.get("path")), _mode(entry.get("mode")), _owner(entry.get("owner")))
        )
    return entries


def _differs(st: os.stat_result, mode: int, owner: str) -> bool:
    if (st.st_mode & 0o7777) != mode:
        return True
    if os.geteuid() != 0:
        return False  # a test's own files: ownership is not ours to set
    ids = _ids(owner)
    return ids is None or (st.st_uid, st.st_gid) != ids


def changes(request: dict[str, Any], files: list[File], diff: bool) -> Changes:
    """Every user, directory and file that differs from the request: read-only, and refusing
    (RequestError) anything it could not converge, so that a refusal changes nothing."""
    found = Changes(users=[u for u in _users(request) if _ids(u["name"]) is None])
    made = set()
    for path, mode, owner in _dir_entries(request):
        now = _lstat(path)
        if now is None:
            found.dirs.append((path, mode, owner, False))
            made.add(path)
        elif not stat.S_ISDIR(now.st_mode):
            raise RequestError(f"{path} exists and is not a directory")
        elif _differs(now, mode, owner):
            found.dirs.append((path, mode, owner, True))
    secrets = request.get("secrets") or {}
    for item in files:
        folder = str(Path(item.path).parent)
        if folder not in made and not Path(folder).is_dir():
            raise RequestError(
                f"{folder} does not exist (and is not among the directories to make)"
            )
        now = _lstat(item.path)
        if now is not None and not stat.S_ISREG(now.st_mode):
            raise RequestError(f"{item.path} exists and is not a regular file")
        before = _read(item.path) if now is not None else None
        if item.line is not None:
            data = with_line(before, *item.line)
        elif item.content is None:
            data = secret_content(item, secrets)
        else:
            data = item.content
        if now is not None and before == data and not _differs(now, item.mode, item.owner):
            continue
        found.files.append((item, data))
        if diff and not item.secret and before != data:
            found.diffs.append(_diff(item.path, before, data))
    return found


def converge(found: Changes) -> None:
    for user in found.users:
        done = run(
            [
                "useradd",
                "--system",
                "--create-home",
                "--home-dir",
                user["home"],
                "--shell",
                user["shell"],
                user["name"],
            ]
        )
        if done.returncode != 0:
            raise ApplyError(f"useradd {user['name']} failed: {done.stderr.strip()}")
    for path, mode, owner, exists in found.dirs:
        if not exists:
            Path(path).mkdir(mode=mode, parents=True, exist_ok=True)
        Path(path).chmod(mode)
        ids = _ids(owner)
        if os.geteuid() == 0 and ids is not None:
            os.chown(path, *ids)
    for item, data in found.files:
        _write(item.path, data, item.mode, item.owner, item.validate)


def run(argv: list[str], timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
    )


def unit_states(units: list[str]) -> dict[str, str]:
    """ActiveState of each unit; ``not-found`` for one systemd cannot load."""
    if not units:
        return {}
    shown = run(["systemctl", "show", "--property=Id,LoadState,ActiveState", "--", *units])
    states = dict.fromkeys(units, "unknown")
    for block in shown.stdout.split("\n\n"):
        props = dict(line.partition("=")[::2] for line in block.splitlines() if "=" in line)
        unit = props.get("Id", "")
        if unit in states:
            loaded = props.get("LoadState") == "loaded"
            states[unit] = props.get("ActiveState", "unknown") if loaded else "not-found"
    return states


def _enabled(unit: str) -> bool:
    return run(["systemctl", "is-enabled", "--quiet", "--", unit]).returncode == 0


def systemctl(*args: str) -> None:
    done = run(
        ["systemctl", *args],
        timeout=JOB_TIMEOUT if args[0] in {"start", "restart", "stop"} else COMMAND_TIMEOUT,
    )
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise ApplyError(
            f"systemctl {' '.join(args)} failed: {why[-1] if why else done.returncode}"
        )


class ApplyError(RuntimeError):
    """A step on the host failed: the report says which, and what was done before it."""


def container_labels(spec: dict[str, Any]) -> dict[str, str]:
    """KEY -> the config label of its running container (a container that is gone: left out)."""
    runtime = spec.get("runtime")
    if runtime not in {"podman", "docker"}:
        raise RequestError(f"not a container runtime: {runtime!r}")
    label = spec.get("label")
    if not isinstance(label, str) or not re.fullmatch(r"[a-z0-9.]+", label):
        raise RequestError(f"not a label name: {label!r}")
    containers = spec.get("containers") or {}
    found = {}
    for key, name in containers.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise RequestError(f"not a container name: {name!r}")
        done = run(
            [
                runtime,
                "container",
                "inspect",
                "--format",
                '{{index .Config.Labels "' + label + '"}}',
                name,
            ]
        )
        if done.returncode == 0 and done.stdout.strip():
            found[str(key)] = done.stdout.strip()
    return found


def wait_healthy(
    units: list[dict[str, str]], probe: Probe, timeout: float, interval: float, probe_timeout: float
) -> list[dict[str, Any]]:
    """Probe every unit until each answers 200, or systemd gave up on it (failed), or the
    deadline: all at once, each round. One entry per unit: its last probe and how many."""
    deadline = time.monotonic() + timeout
    results: dict[str, dict[str, Any]] = {}
    pending = list(units)
    while pending:
        for target in list(pending):
            seen = probe(target["probe_url"], target["unit"], probe_timeout)
            seen["probes"] = results.get(target["unit"], {}).get("probes", 0) + 1
            seen.update(target)
            results[target["unit"]] = seen
            if seen.get("status") == 200 or seen.get("state") == "failed":
                pending.remove(target)
        if pending and time.monotonic() + interval > deadline:
            break
        if pending:
            time.sleep(interval)
    return [results[t["unit"]] for t in units]


def serving(active: list[str], health: list[dict[str, Any]]) -> list[str]:
    """The active units less those systemd gave up on while waited for: a router that
    registered one would wait for its readiness in vain, and the deploy fails on it anyway."""
    gave_up = {h["unit"] for h in health if h.get("state") == "failed"}
    return [u for u in active if u not in gave_up]


def _wait_targets(request: dict[str, Any]) -> list[dict[str, str]]:
    targets = []
    for target in (request.get("wait") or {}).get("units") or []:
        url = target.get("probe_url") if isinstance(target, dict) else None
        if not isinstance(url, str) or not re.match(r"(https?|grpc)://", url):
            raise RequestError(f"not a probe URL: {url!r}")
        name = target.get("name")
        unit = unit_name(target.get("unit"))
        targets.append(
            {"unit": unit, "probe_url": url, "name": name if isinstance(name, str) else unit}
        )
    return targets


def _unhealthy(health: dict[str, Any]) -> str:
    journal = str(health.get("journal") or "").strip().splitlines()[-JOURNAL_LINES:]
    return (
        f"{health['name']} ({health['unit']}) is not healthy: {health['probe_url']} answered "
        f"{health.get('status') or 'nothing'}, unit {health.get('state')} after "
        f"{health.get('restarts', 0)} restart(s), {health['probes']} probe(s); "
        "its journal ends with:\n"
        + "\n".join(f"    | {line}" for line in journal)
        + f"\nSee journalctl -u {health['unit']} on the host."
    )


def apply(request: dict[str, Any], probe: Probe | None = None) -> dict[str, Any]:
    """Converge this host to ``request``; the report (see the module's docstring)."""
    check, diff = bool(request.get("check")), bool(request.get("diff"))
    files = parse_files(request)
    units, start = _units(request.get("units") or []), _units(request.get("start") or [])
    restart_on = request.get("restart") or {}
    if not isinstance(restart_on, dict):
        raise RequestError(f"not a mapping of units to files: {restart_on!r}")
    restart = {unit_name(u): [plain_path(p) for p in paths] for u, paths in restart_on.items()}
    restart_now = _units(request.get("restart_now") or [])
    targets = _wait_targets(request)
    found = changes(request, files, diff)
    changed = found.paths
    states = unit_states(sorted(set(units) | set(start) | set(restart) | set(restart_now)))
    reload = any(p.startswith(UNIT_DIRS) for p in changed)
    report: dict[str, Any] = {
        "changed": False,
        "failed": False,
        "msg": "",
        "files": changed,
        "before": states,
        "reloaded": reload,
        "reset": [u for u in start if states.get(u) == "failed"],
        "started": [u for u in start if states.get(u) != "active"],
        # What runs once the step is done: the units it starts and those already running
        # (a scaler may have started some), less those that fail the wait; what the router
        # registers.
        "active": sorted(set(start) | {u for u, state in states.items() if state == "active"}),
        # A unit not running yet is started with its new files, not restarted.
        "restarted": sorted(
            u
            for u in set(restart) | set(restart_now)
            if states.get(u) == "active"
            and (u in restart_now or set(restart.get(u, [])) & set(changed))
        ),
    }
    if diff:
        report["diff"] = found.diffs
    if request.get("labels") and "active" in states.values():
        report["labels"] = container_labels(request["labels"])
    report["enabled"] = [u for u in start if states.get(u) == "not-found" or not _enabled(u)]
    report["changed"] = bool(
        changed or report["reset"] or report["started"] or report["enabled"] or report["restarted"]
    )
    if check:
        return report
    try:
        converge(found)
        if reload:
            systemctl("daemon-reload")
        if report["reset"]:
            systemctl("reset-failed", "--", *report["reset"])
        if report["enabled"]:
            systemctl("enable", "--", *report["enabled"])
        if report["started"]:
            systemctl("start", "--", *report["started"])
        if report["restarted"]:
            systemctl("restart", "--", *report["restarted"])
    except (ApplyError, OSError, subprocess.TimeoutExpired) as exc:
        report.update(failed=True, msg=str(exc))
        return report
    if targets and probe is not None:
        wait = request.get("wait") or {}
        report["health"] = health = wait_healthy(
            targets,
            probe,
            timeout=float(wait.get("timeout", 600)),
            interval=max(1.0, float(wait.get("interval", 2))),
            probe_timeout=float(wait.get("probe_timeout", 5)),
        )
        sick = [h for h in health if h.get("status") != 200]
        report["active"] = serving(report["active"], health)
        if sick:
            report["failed"] = True
            report["msg"] = "\n".join(_unhealthy(h) for h in sick)
    return report


def serve(step: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Run a host-side step on the request on stdin and print its one JSON report: a request
    out of shape, or a failure while the step reads what is there, is a report too."""
    try:
        request = json.loads(sys.stdin.read())
        if not isinstance(request, dict):
            raise RequestError("the request is not a JSON object")
        report = step(request)
    except (RequestError, ValueError) as exc:
        report = {"changed": False, "failed": True, "msg": f"refused, nothing changed: {exc}"}
    except (ApplyError, OSError, subprocess.TimeoutExpired) as exc:
        report = {"changed": False, "failed": True, "msg": f"nothing changed: {exc}"}
    print(json.dumps(report))


def main() -> None:
    serve(lambda request: apply(request, probe=unit_probe.probe))


if __name__ == "__main__":
    main()
