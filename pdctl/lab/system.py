"""Running this machine's programs for the lab, with errors that say what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from pdctl.core.errors import EnvironmentProblem, PdctlError

# What `make install` puts on the machine for the lab, by the program pdctl runs.
LAB_PROGRAMS = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "ip": "iproute2",
    "nsenter": "util-linux",
    "mount": "mount",
    "ssh-keygen": "openssh-client",
}


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise EnvironmentProblem(
            f"{what} needs root (network namespaces, mounts, cgroups)",
            hint="run it as root, e.g. `sudo -E pdctl ...`",
        )


def require_programs(names: Sequence[str] = tuple(LAB_PROGRAMS)) -> None:
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        packages = sorted({LAB_PROGRAMS.get(name, name) for name in missing})
        raise EnvironmentProblem(
            f"missing program(s) on this machine: {', '.join(missing)}",
            hint=f"run `make install`, or `apt-get install {' '.join(packages)}`",
        )


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    input_text: str | None = None,
    timeout: float | None = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a program, capturing its output; a failure names the command and its stderr."""
    try:
        proc = subprocess.run(
            list(argv),
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except FileNotFoundError as exc:
        raise EnvironmentProblem(
            f"program not found: {argv[0]}", hint="run `make install`"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise PdctlError(f"`{' '.join(argv)}` did not finish within {timeout} s") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        last = detail[-1] if detail else f"exit {proc.returncode}"
        raise PdctlError(f"`{' '.join(argv)}` failed: {last}")
    return proc


def quiet(argv: Sequence[str]) -> bool:
    """Run a clean-up step whose failure only means there was nothing to clean."""
    return run(argv, check=False, timeout=30).returncode == 0


def remove_tree(path: Path, seconds: float = 10.0) -> None:
    """Remove a directory tree that a process just killed may still be adding to (its last
    write lands after the kill is sent): try again until it is gone, then say what is left."""
    deadline = time.monotonic() + seconds
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        if time.monotonic() > deadline:
            left = sorted(str(p) for p in path.rglob("*"))[:5]
            raise PdctlError(
                f"could not remove {path} within {seconds:g} s; left: {', '.join(left)}",
                hint="see what still uses it (`fuser -vm PATH`), then remove it by hand",
            )
        time.sleep(0.1)
