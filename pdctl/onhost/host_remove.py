"""Runs ON a host: remove what a role put there, in one step, and report.

The counterpart of host_apply for destroy: a role sends everything of its service on the host
(units, containers, files, its line of a shared file, its failover address) and the rules by
which what other services share stays, instead of a task per unit, file and rule, each a round
trip. It is idempotent: what is gone already is not reported, so a second run changes nothing.
With ``check`` it changes nothing and reports what it would remove.

The request (JSON on stdin, after the bundle):

    {"check": bool,
     "units": [UNIT...],       # a unit, or a template's instances ("x@*.service"): every
                               # loaded or enabled one is stopped, disabled and forgotten
                               # (reset-failed)
     "links": DIR,             # where the units' enablement links are (the unit directory)
     "containers": REGEX,      # containers whose whole name matches, in podman and docker
     "lines": [{"path", "match"}],  # the lines holding match go; the file's others stay
     "paths": [PATH...],       # removed: a file, a link (never what it points to) or a tree
     "prune": [DIR...],        # removed when empty, in order (before and after "unused")
     "unused": [{"glob", "users", "named"?: bool}],
                               # each path the glob finds is removed unless a file that
                               # "users" finds exists (or, with named, holds its path)
     "users": [{"name", "unless_lines_in": PATH}],  # a system user removed (its processes
                               # ended, its home with it) once that file has no line left
     "addresses": [IPV4...]}   # removed from whichever interface still holds them

Everything is data: paths absolute and plain (and, for what is removed with its contents, not
a top-level directory), globs only in a last component, unit names systemd's; a request that
breaks that changes nothing and fails with the reason. Standard library and this package only,
Python 3.9 (it ships as a bundle, pdctl/onhost/bundle.py).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import pwd
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdctl.onhost.host_apply import (
    UNIT_DIRS,
    USER,
    ApplyError,
    RequestError,
    below_top,
    plain_path,
    run,
    serve,
    systemctl,
    unit_name,
)

UNIT_GLOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9@._:-]*@\*\.(service|socket|timer)")
INSTANCE = re.compile(r"[^@]+@[^.]+\.(service|socket|timer)")
RUNTIMES = ("podman", "docker")
USER_GONE_WAIT = 5.0  # for a removed user's processes to end


def _list(request: dict[str, Any], key: str) -> list[Any]:
    value = request.get(key) or []
    if not isinstance(value, list):
        raise RequestError(f"{key} is not a list: {value!r}")
    return value


def _unit_pattern(value: Any) -> str:
    if isinstance(value, str) and UNIT_GLOB.fullmatch(value):
        return value
    return unit_name(value)


def _glob(value: Any) -> str:
    """A plain absolute path whose last component alone may hold * or ?."""
    path = plain_path(value)
    head, _, last = path.rpartition("/")
    if any(c in head for c in "*?[]") or any(c in last for c in "[]"):
        raise RequestError(f"{path}: only the last component of a glob may hold * or ?")
    return path


def _container_pattern(value: Any) -> re.Pattern[str] | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise RequestError(f"not a container name pattern: {value!r}")
    try:
        return re.compile(value)
    except re.error as exc:
        raise RequestError(f"not a container name pattern: {value!r} ({exc})") from None


def loaded_units(patterns: list[str]) -> list[str]:
    """The units systemd has loaded (active or not) that match: a template's instances only."""
    if not patterns:
        return []
    listing = ["systemctl", "list-units", "--all", "--plain", "--no-legend", "--full", "--"]
    listed = run([*listing, *patterns])
    found = []
    for line in listed.stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and words[1] != "not-found" and _matches(words[0], patterns):
            found.append(words[0])
    return found


def _matches(unit: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if "*" in pattern:
            if INSTANCE.fullmatch(unit) and fnmatch.fnmatchcase(unit, pattern):
                return True
        elif unit == pattern:
            return True
    return False


def enablement_links(folder: str | None, patterns: list[str]) -> list[str]:
    """The links under ``folder`` (its *.wants/ and *.requires/) that enable a matching unit."""
    if not folder or not patterns or not Path(folder).is_dir():
        return []
    return sorted(
        str(path)
        for path in Path(folder).rglob("*")
        if path.is_symlink() and _matches(path.name, patterns)
    )


def containers(pattern: re.Pattern[str] | None) -> list[tuple[str, str]]:
    """(runtime, name) of every container, running or not, whose whole name matches."""
    if pattern is None:
        return []
    found = []
    for runtime in RUNTIMES:
        if shutil.which(runtime) is None:
            continue
        listed = run([runtime, "ps", "--all", "--format", "{{.Names}}"])
        if listed.returncode != 0:
            raise ApplyError(f"{runtime} ps failed: {listed.stderr.strip()[-300:]}")
        found += [(runtime, n) for n in listed.stdout.split() if pattern.fullmatch(n)]
    return found


def _lines_kept(path: str, match: str) -> bytes | None:
    """The file's text without the lines holding ``match``; None when none does."""
    try:
        lines = Path(path).read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return None
    kept = [line for line in lines if match.encode() not in line]
    return None if len(kept) == len(lines) else b"".join(kept)


def _lines_left(path: str, edits: dict[str, bytes]) -> bool:
    """Whether ``path`` holds a line once the edits are made (check mode: would hold)."""
    text = edits.get(path)
    if text is None:
        try:
            text = Path(path).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return False
    return any(line.strip() for line in text.splitlines())


def _found(pattern: str) -> list[str]:
    folder, _, last = pattern.rpartition("/")
    if not Path(folder or "/").is_dir():
        return []
    return sorted(str(p) for p in Path(folder or "/").glob(last))


def _going(path: str, gone: frozenset[str]) -> bool:
    """Whether ``path`` is, or is under, one of the paths a check run counts as removed."""
    return any(path == g or path.startswith(g + "/") for g in gone)


def unused(rule: dict[str, Any], gone: frozenset[str] = frozenset()) -> list[str]:
    """What ``rule``'s glob finds that no file its ``users`` glob finds uses (in a check run,
    ``gone``: what the run would have removed by then, counted as not there)."""
    found = [p for p in _found(rule["glob"]) if not _going(p, gone)]
    users = [u for u in _found(rule["users"]) if not _going(u, gone)]
    if not rule.get("named"):
        return [] if users else found
    texts = []
    for user in users:
        try:
            texts.append(Path(user).read_text(errors="replace"))
        except OSError:
            texts.append("")
    # Named as a whole path: /opt/x/smg-1.1 is not named by /opt/x/smg-1.13.0/bin/python.
    return [p for p in found if not any(_names(text, p) for text in texts)]


def _names(text: str, path: str) -> bool:
    return re.search(re.escape(path) + r"(?![^/\s])", text) is not None


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _addresses(values: list[Any]) -> list[str]:
    found = []
    for value in values:
        try:
            found.append(str(ipaddress.IPv4Address(value)))
        except (ipaddress.AddressValueError, ValueError):
            raise RequestError(f"not an IPv4 address: {value!r}") from None
    return found


def held_addresses(addresses: list[str]) -> list[tuple[str, str]]:
    """(cidr, device) of each of ``addresses`` this host still holds."""
    if not addresses:
        return []
    shown = run(["ip", "-o", "-4", "addr", "show"])
    held = []
    for line in shown.stdout.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] == "inet" and words[3].split("/")[0] in addresses:
            held.append((words[3], words[1]))
    return held


def _remove_path(path: str) -> None:
    target = Path(path)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)


def _prune(folders: list[str], check: bool, gone: frozenset[str] = frozenset()) -> list[str]:
    pruned: list[str] = []
    for folder in folders:
        target = Path(folder)
        if not target.is_dir() or target.is_symlink() or _going(folder, gone):
            continue
        left = [e for e in target.iterdir() if not _going(str(e), gone | set(pruned))]
        if not left:
            if not check:
                target.rmdir()
            pruned.append(folder)
    return pruned


def _end_user(name: str) -> None:
    """End the user's processes (an SSH session leaves its systemd manager running a while)
    and remove it with its home."""
    run(["loginctl", "terminate-user", name])
    run(["pkill", "-KILL", "-u", name])
    deadline = time.monotonic() + USER_GONE_WAIT
    while run(["pgrep", "-u", name]).returncode == 0:
        if time.monotonic() > deadline:
            raise ApplyError(f"user {name} still has processes after pkill -KILL")
        time.sleep(0.2)
    done = run(["userdel", "--remove", name])
    if done.returncode not in (0, 12):  # 12: its home was not there to remove
        raise ApplyError(f"userdel {name} failed: {done.stderr.strip()}")


@dataclass
class Removal:
    """A request, checked: nothing in it is used before all of it is."""

    check: bool
    units: list[str]
    links: str | None
    containers: re.Pattern[str] | None
    lines: list[tuple[str, str]]
    paths: list[str]
    prune: list[str]
    unused: list[dict[str, Any]]
    users: list[tuple[str, str]]
    addresses: list[str]


def parse(request: dict[str, Any]) -> Removal:
    lines = []
    for entry in _list(request, "lines"):
        match = entry.get("match") if isinstance(entry, dict) else None
        if not isinstance(match, str) or not match:
            raise RequestError(f"not a line entry: {entry!r}")
        lines.append((plain_path(entry.get("path")), match))
    rules = _list(request, "unused")
    for rule in rules:
        if not isinstance(rule, dict):
            raise RequestError(f"not a rule: {rule!r}")
        below_top(_glob(rule.get("glob"))), _glob(rule.get("users"))
    users = []
    for entry in _list(request, "users"):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not USER.fullmatch(name) or name == "root":
            raise RequestError(f"not a user pdctl made: {entry!r}")
        users.append((name, plain_path(entry.get("unless_lines_in"))))
    return Removal(
        check=bool(request.get("check")),
        units=[_unit_pattern(u) for u in _list(request, "units")],
        links=plain_path(request["links"]) if request.get("links") else None,
        containers=_container_pattern(request.get("containers")),
        lines=lines,
        paths=[below_top(p) for p in _list(request, "paths")],
        prune=[plain_path(p) for p in _list(request, "prune")],
        unused=rules,
        users=users,
        addresses=_addresses(_list(request, "addresses")),
    )


def _stop(units: list[str]) -> None:
    systemctl("stop", "--", *units)
    run(["systemctl", "disable", "--", *units])  # the links of a unit systemd lost go too


def _take_away(
    units: list[str],
    found_containers: list[tuple[str, str]],
    edits: dict[str, bytes],
    held: list[tuple[str, str]],
    paths: list[str],
) -> None:
    """Units stopped first (a container goes with its unit), then what they leave."""
    if units:
        _stop(units)
    for runtime, name in found_containers:
        done = run([runtime, "rm", "--force", name])
        if done.returncode != 0:
            raise ApplyError(f"{runtime} rm {name} failed: {done.stderr.strip()}")
    for path, text in edits.items():
        Path(path).write_bytes(text)
    for cidr, device in held:
        run(["ip", "addr", "del", cidr, "dev", device])
    for path in paths:
        _remove_path(path)


def remove(request: dict[str, Any]) -> dict[str, Any]:
    """Remove what ``request`` names from this host; the report (see the module's docstring)."""
    todo = parse(request)
    check = todo.check
    units = loaded_units(todo.units)
    links = enablement_links(todo.links, todo.units)
    found_containers = containers(todo.containers)
    edits = {
        path: kept for path, match in todo.lines if (kept := _lines_kept(path, match)) is not None
    }
    doomed = [p for p in todo.paths if Path(p).exists() or Path(p).is_symlink()]
    held = held_addresses(todo.addresses)
    report: dict[str, Any] = {
        "changed": False,
        "failed": False,
        "msg": "",
        "stopped": units,
        "containers": [f"{runtime} {name}" for runtime, name in found_containers],
        "files": doomed + links + list(edits),
        "addresses": [cidr for cidr, _ in held],
        "users": [],
    }

    def gone() -> frozenset[str]:
        """A check run removes nothing: what it would have removed by then counts as gone."""
        return frozenset(report["files"]) if check else frozenset()

    try:
        if not check:
            _take_away(units, found_containers, edits, held, doomed + links)
        report["files"] += _prune(todo.prune, check, gone())
        for rule in todo.unused:
            extra = [p for p in unused(rule, gone()) if p not in report["files"]]
            if not check:
                for path in extra:
                    _remove_path(path)
            report["files"] += extra
        pruned = _prune(todo.prune, check, gone())
        report["files"] += [p for p in pruned if p not in report["files"]]
        report["users"] = [
            name for name, keys in todo.users if _user_exists(name) and not _lines_left(keys, edits)
        ]
        if not check:
            for name in report["users"]:
                _end_user(name)
            if any(p.startswith(UNIT_DIRS) for p in report["files"]):
                systemctl("daemon-reload")  # a unit file or an enablement link went
            if todo.units:
                run(["systemctl", "reset-failed", "--", *todo.units])
    except (ApplyError, OSError, subprocess.TimeoutExpired) as exc:
        report.update(failed=True, msg=str(exc))
    report["changed"] = any(
        report[k] for k in ("stopped", "containers", "files", "addresses", "users")
    )
    return report


def main() -> None:
    serve(remove)


if __name__ == "__main__":
    main()
