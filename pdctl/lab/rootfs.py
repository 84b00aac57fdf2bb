"""The lab hosts' shared root filesystem: Debian bookworm, built once and cached.

debootstrap takes about a minute, so the result is cached machine-wide under
``$PDCTL_CACHE/rootfs/<recipe hash>`` and rebuilt only when the recipe (the
package list or the customisation below) changes. Hosts boot on overlays of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

from pdctl.core.errors import EnvironmentProblem
from pdctl.doors.workspace import cache_dir
from pdctl.lab.system import run

SUITE = "bookworm"
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "sudo",
    "python3",
    "python3-venv",
    "iproute2",
    "podman",
    "crun",
    "containernetworking-plugins",
    "procps",
    # Router HA: VRRP between the router hosts moves the service's failover address.
    "keepalived",
)
# The sudo user every lab host has besides root (key login, passwordless sudo).
SUDO_USER = "pdops"
# Bump when _customize() changes in a way hosts must see.
CUSTOMIZE_VERSION = 2

# Timers and services that wake up for nothing on an emulated host.
_MASKED_UNITS = (
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
    "podman-auto-update.timer",
    "podman-restart.service",
    "e2scrub_reap.service",
)

# One ed25519 key, the only one sshd offers: `ssh-keygen -A` also made an RSA key, half a
# CPU-second on every host's first boot (the suite boots about fifty), that nothing used.
_HOSTKEYS_UNIT = """\
[Unit]
Description=Generate this host's own SSH host key on first boot
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -q -t ed25519 -N "" -f /etc/ssh/ssh_host_ed25519_key

[Install]
WantedBy=multi-user.target
"""

# Podman inside an nspawn host on this kind of machine (LAB-NOTES.md): no
# cgroups, no rlimits, crun, and the fake-hardware state visible in every
# container so a worker can see injected faults.
_CONTAINERS_CONF = """\
[containers]
cgroups = "disabled"
pids_limit = 0
keyring = false
default_ulimits = []
log_driver = "k8s-file"
volumes = ["/etc/pd-fake:/etc/pd-fake:ro"]

[engine]
runtime = "crun"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""

_SSHD_CONF = """\
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UseDNS no
MaxStartups 100:30:200
HostKey /etc/ssh/ssh_host_ed25519_key
"""

_JOURNALD_CONF = """\
[Journal]
SystemMaxUse=16M
RuntimeMaxUse=16M
"""


def recipe() -> dict[str, object]:
    return {
        "suite": SUITE,
        "packages": sorted(PACKAGES),
        "customize": CUSTOMIZE_VERSION,
        "user": SUDO_USER,
    }


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:16]


def apt_mirror(etc_apt: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's own apt uses (hosts are built like it)."""
    sources = [etc_apt / "sources.list", *sorted((etc_apt / "sources.list.d").glob("*"))]
    for source in sources:
        if not source.is_file() or source.suffix not in {"", ".list", ".sources"}:
            continue
        text = source.read_text(errors="replace")
        if SUITE not in text:
            continue
        for match in re.finditer(r"(?:^URIs:\s*|^deb\s+(?:\[[^\]]*\]\s+)?)(\S+)", text, re.M):
            uri = match.group(1)
            if "debian" in uri and "security" not in uri:
                return uri
    return "http://deb.debian.org/debian"


def ensure_rootfs(progress: Callable[[str], None]) -> Path:
    """Return the cached rootfs for the current recipe, building it if needed."""
    base = cache_dir() / "rootfs"
    base.mkdir(parents=True, exist_ok=True)
    final = base / recipe_hash()
    if (final / ".pdctl-rootfs").is_file():
        return final
    with (base / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pdctl may be building the same one
        if (final / ".pdctl-rootfs").is_file():
            return final
        build = base / f".build-{recipe_hash()}"
        shutil.rmtree(build, ignore_errors=True)
        mirror = apt_mirror()
        progress(f"debootstrap {SUITE} from {mirror} (once, about a minute)")
        proc = run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(build),
                mirror,
            ],
            check=False,
            timeout=1800,
        )
        if proc.returncode != 0:
            log = build / "debootstrap" / "debootstrap.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
            raise EnvironmentProblem(
                f"debootstrap of the lab rootfs failed: {' / '.join(tail) or proc.stderr.strip()}",
                hint=f"check that this machine reaches the Debian mirror {mirror}",
            )
        progress("customising the lab rootfs")
        _customize(build)
        (build / ".pdctl-rootfs").write_text(json.dumps(recipe(), indent=2))
        build.rename(final)
        in_use = _mounted_lowerdirs()
        # Earlier recipes are dead weight (~450 MB each), unless a running lab boots on one.
        for old in base.iterdir():
            earlier = old.is_dir() and old != final and not old.name.startswith(".build")
            if earlier and str(old) not in in_use:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _mounted_lowerdirs(mountinfo: Path = Path("/proc/self/mountinfo")) -> set[str]:
    """The lower directories of this machine's overlay mounts (a lab host's root sits on the
    rootfs it booted from)."""
    found: set[str] = set()
    for line in mountinfo.read_text(errors="replace").splitlines():
        for option in line.split(" - ", 1)[-1].split()[-1].split(","):
            if option.startswith("lowerdir="):
                found.update(option.removeprefix("lowerdir=").split(":"))
    return found


def _write(root: Path, path: str, text: str, mode: int = 0o644) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink():
        target.unlink()
    target.write_text(text)
    target.chmod(mode)


def _customize(root: Path) -> None:
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (root / junk).glob("*"):
            if item.is_file():
                item.unlink()
    _write(root, "/etc/resolv.conf", "")  # hosts have no DNS and no default route
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()  # each host makes its own on first boot
    _write(root, "/etc/machine-id", "")  # each host gets its own at boot
    dbus_id = root / "var/lib/dbus/machine-id"
    dbus_id.unlink(missing_ok=True)
    dbus_id.parent.mkdir(parents=True, exist_ok=True)
    dbus_id.symlink_to("/etc/machine-id")
    _write(root, "/etc/systemd/system/pdlab-hostkeys.service", _HOSTKEYS_UNIT)
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / "pdlab-hostkeys.service"
    link.unlink(missing_ok=True)
    link.symlink_to("/etc/systemd/system/pdlab-hostkeys.service")
    for unit in _MASKED_UNITS:
        masked = root / "etc/systemd/system" / unit
        masked.unlink(missing_ok=True)
        masked.symlink_to("/dev/null")
    _write(root, "/etc/containers/containers.conf", _CONTAINERS_CONF)
    _write(root, "/etc/ssh/sshd_config.d/pdlab.conf", _SSHD_CONF)
    _write(root, "/etc/systemd/journald.conf.d/pdlab.conf", _JOURNALD_CONF)
    run(
        [
            "chroot",
            str(root),
            "useradd",
            "--create-home",
            "--shell",
            "/bin/bash",
            "--groups",
            "sudo",
            SUDO_USER,
        ]
    )
    _write(root, f"/etc/sudoers.d/{SUDO_USER}", f"{SUDO_USER} ALL=(ALL) NOPASSWD:ALL\n", 0o440)
    _write(root, "/etc/hostname", "")
    _write(
        root,
        "/etc/motd",
        textwrap.dedent("""\
        pdctl lab host: an emulated bare-metal GPU server (GPUs and RDMA NICs are fakes).
        """),
    )
