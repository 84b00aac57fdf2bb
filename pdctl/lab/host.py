"""One lab host: an overlay root, a cgroup, and systemd-nspawn booting systemd inside.

Pitfalls found on this kind of machine (LAB-NOTES.md) and handled here: each
host gets its own cgroup directory before nspawn starts (else same-named units
on two hosts collide), its own machine id and host keys, and is stopped by a
SIGKILL to its PID 1 (a SIGKILL to nspawn would orphan the host).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pdctl.core.errors import PdctlError
from pdctl.lab import network
from pdctl.lab.rootfs import SUDO_USER
from pdctl.lab.runtime import crun_clamp
from pdctl.lab.state import NICS_PER_HOST, LabHost, LabState, write_hardware
from pdctl.lab.system import quiet, run

CGROUP_HIERARCHIES = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd"))
# RHEL-style for the AMD hosts (the path pdctl's units mount), Debian/Ubuntu's multiarch one
# for the NVIDIA hosts: pdctl finds a provider library on either by glob.
PROVIDER_DIRS = {"amd": "/usr/lib64/libibverbs", "nvidia": "/usr/lib/x86_64-linux-gnu/libibverbs"}
FAKE_TOOLS = {
    "amd": ("ibv_devices", "ibv_devinfo", "amd-smi", "rocm-smi"),
    "nvidia": ("ibv_devices", "ibv_devinfo", "nvidia-smi", "nvidia-ctk"),
}
# perftest's tools, on every GPU host (the fabric check's; fakes/pdperf.py).
PERFTEST_TOOLS = ("ib_write_bw", "ib_write_lat")
# Inside worker containers: the fake verbs tools (the worker stand-in checks its NICs with
# ibv_devices, as SGLang would through libibverbs) and, on NVIDIA hosts, the libmlx5 that
# CUDA images carry themselves (docs/facts.md, "NVIDIA hosts").
CONTAINER_TOOLS = "/opt/pdctl-lab/bin"
CONTAINER_PROVIDER_DIR = "/usr/lib/x86_64-linux-gnu/libibverbs"
CONTAINERS_DROP_IN = "etc/containers/containers.conf.d/51-pdctl-lab-volumes.conf"
# Run at boot, before sshd: device nodes, the CDI spec and the sysfs topology (pdfake.py).
HARDWARE_UNIT = "pdlab-hardware.service"
_HARDWARE_UNIT_TEXT = """\
[Unit]
Description=pdctl lab: the fake GPU server's device nodes, CDI spec and sysfs topology
DefaultDependencies=no
Before=sysinit.target ssh.service ssh.socket

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/opt/pdctl-lab/fakes/pdfake.py pdlab-hardware --cdi

[Install]
WantedBy=sysinit.target
"""


def provider_lib(host: LabHost) -> str:
    """The provider library file name of the host's NICs (libbnxt_re-rdmav34.so, ...)."""
    return f"lib{host.model.nic_driver if host.model else 'bnxt_re'}-rdmav34.so"


def vendor(host: LabHost) -> str:
    return host.model.vendor if host.model else "amd"


RENDER_MINOR_BASE = 128
# Where the lab's shared, read-only files appear inside every host.
SHARE_MOUNT = "/opt/pdctl-lab"
# Podman in every host runs crun through the lab's rlimit clamp (runtime/crun_clamp.py): the
# units ask for production's limits, the host grants what this machine can.
RUNTIME_DROP_IN = "etc/containers/containers.conf.d/50-pdctl-lab-runtime.conf"
_RUNTIME_CONF = f"""\
# pdctl lab: crun through a wrapper that clamps container rlimits to what this host grants
[engine.runtimes]
crun = ["{SHARE_MOUNT}/runtime/{Path(crun_clamp.__file__).name}"]
"""


@dataclass(frozen=True)
class Shared:
    """Read-only things every host sees under /opt/pdctl-lab."""

    rootfs: Path
    fakes: Path  # directory holding pdfake.py
    runtime: Path  # directory holding crun_clamp.py
    images: Path  # directory holding the worker images' archives (image.py)
    wheelhouse: Path
    public_key: str


@dataclass(frozen=True)
class HostPaths:
    base: Path

    @property
    def root(self) -> Path:
        return self.base / "root"

    @property
    def upper(self) -> Path:
        return self.base / "upper"

    @property
    def work(self) -> Path:
        return self.base / "work"

    @property
    def fake(self) -> Path:
        return self.base / "fake"

    @property
    def hardware(self) -> Path:
        return self.fake / "state.json"

    @property
    def bin(self) -> Path:
        return self.base / "bin"

    @property
    def libibverbs(self) -> Path:
        return self.base / "libibverbs"

    @property
    def dev(self) -> Path:
        return self.base / "dev"

    @property
    def containers(self) -> Path:
        return self.base / "containers"

    @property
    def emulation(self) -> Path:
        """The host's crun_clamp.LOG_DIR: what its runtime emulated."""
        return self.base / "emulation"

    @property
    def rlimit_log(self) -> Path:
        return self.emulation / Path(crun_clamp.LOG).name

    @property
    def console(self) -> Path:
        return self.base / "console.log"


def _mknod_null(path: Path) -> None:
    """A character device like /dev/null (1,3): opens fine, reads empty."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))
        path.chmod(0o666)  # mknod's mode passes through the umask


def render_node(paths: HostPaths, gpu: int) -> Path:
    return paths.dev / "dri" / f"renderD{RENDER_MINOR_BASE + gpu}"


def prepare(state: LabState, host: LabHost, paths: HostPaths, shared: Shared) -> None:
    """Lay out the host's directories, fake hardware and overlay root (not yet booted)."""
    directories = (paths.upper, paths.work, paths.root, paths.fake, paths.bin, paths.containers)
    for directory in (*directories, paths.emulation):
        directory.mkdir(parents=True, exist_ok=True)
    if not paths.hardware.exists():
        write_hardware(paths.hardware, host.hardware())
    if host.kind == "gpu":
        prepare_hardware(host, paths)
    if not os.path.ismount(paths.root):
        run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={shared.rootfs},upperdir={paths.upper},workdir={paths.work}",
                str(paths.root),
            ]
        )
    _personalize(state, host, paths.root, shared.public_key)
    drop_in = paths.root / RUNTIME_DROP_IN
    drop_in.parent.mkdir(parents=True, exist_ok=True)
    drop_in.write_text(_RUNTIME_CONF)
    if host.kind == "gpu":
        _install_boot_hardware(host, paths.root)


def _install_boot_hardware(host: LabHost, root: Path) -> None:
    unit = root / "etc/systemd/system" / HARDWARE_UNIT
    unit.write_text(_HARDWARE_UNIT_TEXT)
    wants = root / "etc/systemd/system/sysinit.target.wants" / HARDWARE_UNIT
    wants.parent.mkdir(parents=True, exist_ok=True)
    if not wants.is_symlink():
        wants.symlink_to(f"/etc/systemd/system/{HARDWARE_UNIT}")
    # An array in a containers.conf drop-in replaces the base one: repeat /etc/pd-fake.
    volumes = [
        "/etc/pd-fake:/etc/pd-fake:ro",
        f"{SHARE_MOUNT}/fakes:{SHARE_MOUNT}/fakes:ro",
        f"/usr/local/bin:{CONTAINER_TOOLS}:ro",
    ]
    if vendor(host) == "nvidia":
        lib = f"{PROVIDER_DIRS['nvidia']}/{provider_lib(host)}"
        volumes.append(f"{lib}:{CONTAINER_PROVIDER_DIR}/{provider_lib(host)}:ro")
    conf = root / CONTAINERS_DROP_IN
    conf.write_text(
        "# pdctl lab: the fake hardware state and verbs tools in every container\n"
        f"[containers]\nvolumes = {json.dumps(volumes)}\n"
    )


def prepare_hardware(host: LabHost, paths: HostPaths) -> None:
    """The fake GPU server's files: tools, provider library, device nodes (idempotent).

    NVIDIA's /dev/nvidia* nodes are made inside the host by pdlab-hardware.service, since
    they sit in /dev itself and faults remove them one by one."""
    tools = {tool: "pdfake.py" for tool in FAKE_TOOLS[vendor(host)]}
    tools.update({tool: "pdperf.py" for tool in PERFTEST_TOOLS})
    for tool, script in tools.items():
        link = paths.bin / tool
        if not link.is_symlink():
            link.symlink_to(f"{SHARE_MOUNT}/fakes/{script}")
    paths.libibverbs.mkdir(exist_ok=True)
    (paths.libibverbs / provider_lib(host)).write_bytes(b"\x7fELF fake RDMA provider\n")
    if vendor(host) == "amd":
        _mknod_null(paths.dev / "kfd")
        for gpu in range(host.gpus):
            _mknod_null(render_node(paths, gpu))
            _mknod_null(paths.dev / "dri" / f"card{gpu}")
    for nic in range(NICS_PER_HOST):
        _mknod_null(paths.dev / "infiniband" / f"uverbs{nic}")
    _mknod_null(paths.dev / "infiniband" / "rdma_cm")


def _personalize(state: LabState, host: LabHost, root: Path, public_key: str) -> None:
    (root / "etc/hostname").write_text(f"{host.name}\n")
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{host.name}"]
    lines += [f"{other.address}\t{other.name}" for other in state.hosts if other.name != host.name]
    (root / "etc/hosts").write_text("\n".join(lines) + "\n")
    for home, uid in (("root", 0), (f"home/{SUDO_USER}", 1000)):
        ssh_dir = root / home / ".ssh"
        ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        keys = ssh_dir / "authorized_keys"
        keys.write_text(public_key.strip() + "\n")
        keys.chmod(0o600)
        for path in (ssh_dir, keys):
            os.chown(path, uid, uid)


def _nspawn_argv(state: LabState, host: LabHost, paths: HostPaths, shared: Shared) -> list[str]:
    argv = [
        "systemd-nspawn",
        "--quiet",
        "-D",
        str(paths.root),
        "--boot",
        f"--uuid={uuid.uuid4()}",
        f"--machine={state.netns(host)}",
        "--register=no",
        "--keep-unit",
        "--console=passive",
        f"--network-namespace-path=/run/netns/{state.netns(host)}",
        # Its own namespace's addresses: keepalived adds and removes a failover address (a
        # host of its own network namespace changes nothing outside it).
        "--capability=CAP_NET_ADMIN",
        f"--bind-ro={paths.fake}:/etc/pd-fake",
        f"--bind={paths.containers}:/var/lib/containers",
        f"--bind-ro={paths.bin}:/usr/local/bin",
        f"--bind-ro={shared.fakes}:{SHARE_MOUNT}/fakes",
        f"--bind-ro={shared.runtime}:{SHARE_MOUNT}/runtime",
        f"--bind={paths.emulation}:{crun_clamp.LOG_DIR}",
        f"--bind-ro={shared.images}:{SHARE_MOUNT}/images",
        f"--bind-ro={shared.wheelhouse}:{SHARE_MOUNT}/wheelhouse",
    ]
    if host.kind == "gpu":
        argv += [
            f"--bind={paths.libibverbs}:{PROVIDER_DIRS[vendor(host)]}",
            f"--bind={paths.dev / 'infiniband'}:/dev/infiniband",
        ]
    if host.kind == "gpu" and vendor(host) == "amd":
        argv += [
            f"--bind={paths.dev / 'kfd'}:/dev/kfd",
            f"--bind={paths.dev / 'dri'}:/dev/dri",
        ]
    return argv


def _enter_cgroup(name: str) -> None:
    """Runs in the child before exec: give this host a cgroup of its own."""
    for hierarchy in CGROUP_HIERARCHIES:
        if hierarchy.is_dir():
            directory = hierarchy / name
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "cgroup.procs").write_text(str(os.getpid()))


def boot(state: LabState, host: LabHost, paths: HostPaths, shared: Shared) -> None:
    network.plug(state, host)
    env = {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
    with paths.console.open("wb") as console:
        proc = subprocess.Popen(
            _nspawn_argv(state, host, paths, shared),
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: _enter_cgroup(state.cgroup(host)),  # noqa: PLW1509 - single-threaded here
        )
    host.nspawn_pid = proc.pid


def wait_ssh(host: LabHost, paths: HostPaths, deadline: float) -> None:
    """Wait until the host's sshd accepts TCP connections, or say why it never will."""
    while time.monotonic() < deadline:
        if host.nspawn_pid is None or not _alive(host.nspawn_pid):
            tail = paths.console.read_text(errors="replace").strip().splitlines()[-3:]
            raise PdctlError(
                f"lab host {host.name} stopped while booting: {' / '.join(tail)}",
                hint=f"see {paths.console}",
            )
        with (
            contextlib.suppress(OSError),
            socket.create_connection((host.address, 22), timeout=0.5),
        ):
            return
        time.sleep(0.1)
    raise PdctlError(
        f"lab host {host.name} ({host.address}) did not open SSH in time",
        hint=f"see {paths.console}",
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def has_process(host: LabHost) -> bool:
    """Whether the host's nspawn still runs (it may still be booting)."""
    return host.nspawn_pid is not None and _alive(host.nspawn_pid)


def is_running(host: LabHost) -> bool:
    return host.nspawn_pid is not None and _alive(host.nspawn_pid) and init_pid(host) is not None


def init_pid(host: LabHost) -> int | None:
    """The host's PID 1 as seen from this machine: nspawn's child."""
    if host.nspawn_pid is None:
        return None
    try:
        children = Path(f"/proc/{host.nspawn_pid}/task/{host.nspawn_pid}/children").read_text()
    except OSError:
        return None
    pids = [int(p) for p in children.split()]
    return pids[0] if pids else None


def exec_in(
    host: LabHost, argv: list[str], *, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a command inside the host (all its namespaces), as its root."""
    pid = init_pid(host)
    if pid is None:
        raise PdctlError(f"lab host {host.name} is not running", hint="run `pdctl lab up`")
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
    }
    return run(["nsenter", "-t", str(pid), "-a", *argv], timeout=timeout, check=check, env=env)


def stop(state: LabState, host: LabHost, paths: HostPaths) -> None:
    """Kill the host and remove everything made for it; safe on a half-built host."""
    _kill_host(host)
    if os.path.ismount(paths.root) and not quiet(["umount", str(paths.root)]):
        quiet(["umount", "-l", str(paths.root)])
    network.unplug(state, host)
    remove_cgroup(state.cgroup(host))
    shutil.rmtree(paths.base, ignore_errors=True)


def power_off(state: LabState, host: LabHost, paths: HostPaths) -> None:
    """Cut the host off at once, as a pulled plug or a dead PSU would: its link goes dark
    first (no packet in or out, so its peers see silence, never a reset or a FIN), then every
    process of the host dies with its PID 1. Its disk stays (the overlay's upper layer and the
    container storage): power_on() boots the same host again. Idempotent."""
    veth = state.veth(host)
    if network.link_exists(veth):
        run(["ip", "link", "set", veth, "down"])
    _kill_host(host)
    network.unplug(state, host)
    remove_cgroup(state.cgroup(host))


def power_on(state: LabState, host: LabHost, paths: HostPaths, shared: Shared) -> None:
    """Boot a powered-off host from the disk it had: systemd starts the units it has enabled
    (a deploy's worker slots among them), exactly as after a real power cut."""
    prepare(state, host, paths, shared)  # remounts the root only if it is not mounted
    boot(state, host, paths, shared)


def _kill_host(host: LabHost) -> None:
    pid1 = init_pid(host)
    if pid1 is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid1, signal.SIGKILL)
    if host.nspawn_pid is not None:
        _wait_gone(host.nspawn_pid, 10)
        if _alive(host.nspawn_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.nspawn_pid, signal.SIGKILL)
            _wait_gone(host.nspawn_pid, 5)
    host.nspawn_pid = None


def _wait_gone(pid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_cgroup(name: str) -> None:
    """rmdir a cgroup subtree, deepest first; a cgroup empties a moment after its tasks die."""
    for hierarchy in CGROUP_HIERARCHIES:
        top = hierarchy / name
        if not top.is_dir():
            continue
        deadline = time.monotonic() + 5
        while top.exists() and time.monotonic() < deadline:
            for directory in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if directory.is_dir():
                    with contextlib.suppress(OSError):
                        directory.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
            if top.exists():
                time.sleep(0.1)
