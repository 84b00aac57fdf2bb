"""fs.inotify.max_user_instances for every lab on this machine: one sysctl, shared by all.

Each lab host's systemd, journald and podman hold inotify instances, all as root, so every
workspace's lab hosts draw on one per-user budget: past about 15 hosts machine-wide the
default (128) runs out, and a host fails to boot with "Too many open files" (or hangs). ``ensure``
makes room for every running lab host on the machine, and the first raise records the
machine's own value in the lab registry; ``restore_when_idle`` puts it back only once no
lab host runs anywhere. Call both with the registry locked.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from pdctl.doors.workspace import write_atomic
from pdctl.lab import registry

SYSCTL = Path("/proc/sys/fs/inotify/max_user_instances")
RESTORE = registry.REGISTRY / "inotify-restore"
# Hosts the kernel's default leaves room for, and what to allow per host past that (a
# host uses about six, more with running containers: 18 hosts were seen holding 147).
FREE_HOSTS = 8
PER_HOST = 32
FLOOR = 4096


def wanted(hosts: int) -> int | None:
    """The value ``hosts`` running lab hosts need (None: the default is enough)."""
    return None if hosts <= FREE_HOSTS else max(FLOOR, hosts * PER_HOST)


def ensure(hosts: int, sysctl: Path = SYSCTL, restore: Path = RESTORE) -> None:
    """Room for ``hosts`` lab hosts machine-wide; never lowers the value."""
    target = wanted(hosts)
    current = int(sysctl.read_text())
    if target is None or current >= target:
        return
    if not restore.exists():
        write_atomic(restore, f"{current}\n")
    sysctl.write_text(str(target))


def restore_when_idle(running: int, sysctl: Path = SYSCTL, restore: Path = RESTORE) -> None:
    """Put the machine's value back once ``running`` (lab hosts anywhere) is zero."""
    if running or not restore.is_file():
        return
    with contextlib.suppress(OSError, ValueError):
        sysctl.write_text(str(int(restore.read_text())))
    restore.unlink(missing_ok=True)
