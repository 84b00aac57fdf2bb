"""What a GPU host looks like: observe it, parse what the tools print, summarise, check.

One file, three audiences:

* on the host, ``collect()`` runs the hardware tools (``ibv_devices``,
  ``ibv_devinfo -v``, ``nvidia-smi`` and ``nvidia-ctk`` or ``amd-smi``/``rocm-smi``,
  ``podman``/``docker``, ``systemctl``) concurrently, reads a few files and the PCI
  topology in sysfs, tries the rlimit the workers need, probes TCP peers, and returns
  the raw observations as JSON-serialisable data. It never raises: a missing program
  is rc 127, a hung one rc 124.
* pdctl (and the ``pd_preflight`` Ansible role, which links this file in as a
  module_util) turns those observations into a stored summary with ``facts()``
  and into named pass/fail checks with ``evaluate()``.
* ``python3 -`` on a host: pdctl pipes this file's source over SSH with the
  request in ``$PD_HARDWARE_INPUT`` (stdin carries the source) and reads
  ``collect()``'s JSON from stdout. See ``main()``.

So: standard library only, no pdctl imports, and runtime syntax that Python 3.9
accepts (annotations are strings here, so ``X | None`` in them is fine).

The parsers read the real tools' formats (rdma-core's ``devinfo.c`` and
``device_list.c``, amd-smi's and rocm-smi's JSON, nvidia-smi's CSV, nvidia-ctk's lists;
samples in docs/facts.md and tests/data/hardware/) and raise
``ParseError`` with what they expected when the text is something else.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "CHECK_NAMES",
    "CPU_SKIP_MESSAGE",
    "DEFAULT_PROVIDER_LIB",
    "INPUT_ENV",
    "Check",
    "Expectations",
    "Gid",
    "ParseError",
    "RdmaDevice",
    "RdmaPort",
    "collect",
    "dstack_gpu_name",
    "evaluate",
    "facts",
    "main",
    "normalize_bdf",
    "parse_amd_smi_list",
    "parse_amd_smi_static",
    "parse_ibv_devices",
    "parse_ibv_devinfo",
    "parse_nvidia_ctk_cdi_list",
    "parse_nvidia_ctk_version",
    "parse_nvidia_smi_query",
    "parse_rocm_smi_products",
    "pci_chain",
    "probe_peer",
    "provider_driver",
    "provider_warnings",
    "run_command",
]

SCHEMA = 1
INPUT_ENV = "PD_HARDWARE_INPUT"
DEFAULT_PROVIDER_LIB = "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"
# pdctl/layout.py's STORAGE_PATHS: this file runs on hosts without pdctl, so it keeps a copy,
# which tests/unit/test_layout.py holds equal.
DEFAULT_STORAGE_PATHS = ("/var/lib/containers", "/var/lib/docker", "/var/lib")
# Where distributions put libibverbs providers (RHEL-style, Debian multiarch, local builds).
PROVIDER_DIRS = (
    "/usr/lib64/libibverbs",
    "/usr/lib/x86_64-linux-gnu/libibverbs",
    "/usr/lib/aarch64-linux-gnu/libibverbs",
    "/usr/local/lib64/libibverbs",
    "/usr/local/lib/libibverbs",
)
# A non-interactive SSH session's PATH often lacks ROCm's bin directory and sbin.
EXTRA_PATH = ("/opt/rocm/bin", "/usr/sbin", "/sbin")
CONNECT_TIMEOUT = 2.0
# Host files read by collect() (module attributes, so tests can point them elsewhere).
OS_RELEASE_PATHS = ("/etc/os-release", "/usr/lib/os-release")
MEMINFO_PATH = "/proc/meminfo"
KFD_PATH = "/dev/kfd"
DRI_DIR = "/dev/dri"
# The topology the NIC affinity comes from (docs/facts.md, "NVIDIA hosts"): a GPU's and an
# RDMA device's PCI chain is the realpath of these links, its NUMA node the numa_node file.
SYSFS_PCI_DEVICES = "/sys/bus/pci/devices"
SYSFS_INFINIBAND = "/sys/class/infiniband"
# Where nvidia-ctk writes the CDI spec (toolkit >= 1.18 also keeps the /var/run one fresh).
CDI_SPEC_PATHS = ("/etc/cdi/nvidia.yaml", "/var/run/cdi/nvidia.yaml")
CDI_GENERATE = "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"
NVIDIA_DEV_DIR = "/dev"
NVIDIA_DEV_GLOB = "nvidia*"
SYSTEMD_RUN_DIR = "/run/systemd/system"  # exists iff systemd is PID 1 (sd_booted(3))
MAX_OUTPUT = 1_000_000  # characters kept of one stream
GIB = 1024**3
RC_NOT_FOUND = 127
RC_NOT_EXECUTABLE = 126
RC_TIMEOUT = 124

RUNTIMES = ("podman", "docker")
COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ibv_devices", ("ibv_devices",)),
    ("ibv_devinfo", ("ibv_devinfo", "-v")),
    ("amd_smi_static", ("amd-smi", "static", "--asic", "--json")),
    ("podman_version", ("podman", "--version")),
    ("docker_version", ("docker", "--version")),
    ("systemctl", ("systemctl", "is-system-running")),
)
AMD_SMI_LIST = ("amd-smi", "list", "--json")
NVIDIA_QUERY_FIELDS = ("index", "name", "uuid", "memory.total", "driver_version", "pci.bus_id")
NVIDIA_SMI_QUERY = (
    "nvidia-smi",
    f"--query-gpu={','.join(NVIDIA_QUERY_FIELDS)}",
    "--format=csv,noheader",
)
NVIDIA_CTK_VERSION = ("nvidia-ctk", "--version")
NVIDIA_CTK_CDI_LIST = ("nvidia-ctk", "cdi", "list")
ROCM_SMI = ("rocm-smi", "--showproductname", "--json")
# The call an OCI runtime (crun, runc) makes in a container's init for `--ulimit
# memlock=-1:-1`, the worker units' RDMA setting: made by a throwaway child, so the probe
# keeps its own limits.
MEMLOCK_PROBE = (
    "import resource as r; r.setrlimit(r.RLIMIT_MEMLOCK, (r.RLIM_INFINITY, r.RLIM_INFINITY))"
)
CAP_SYS_RESOURCE = 24
# An OCI runtime that lowers containers' rlimits to what the host grants instead of failing
# (the pdctl lab's crun wrapper) says so in its --version, which `podman info` shows.
RLIMIT_CLAMP_MARK = "rlimits: clamped"
RUNTIME_INFO = {
    "podman": ("podman", "info", "--format", "json"),
    "docker": ("docker", "info", "--format", "{{json .}}"),
}
# Stable order of raw["commands"].
COMMAND_ORDER = (
    "ibv_devices",
    "ibv_devinfo",
    "amd_smi_list",
    "amd_smi_static",
    "rocm_smi",
    "nvidia_smi",
    "nvidia_ctk_version",
    "nvidia_ctk_cdi_list",
    "podman_version",
    "docker_version",
    "podman_info",
    "docker_info",
    "systemctl",
)

CPU_SKIP_MESSAGE = "CPU-only host (router candidate): GPU/RDMA checks skipped"
CHECK_NAMES = (
    "systemd",
    "gpus",
    "container_toolkit",
    "cdi",
    "rdma_devices",
    "rdma_ports",
    "provider_lib",
    "roce_gid",
    "perftest",
    "runtime",
    "memlock",
    "disk",
    "mesh",
)
# Workers (and so RDMA and their rlimits) run on GPU hosts only.
GPU_ONLY_CHECKS = frozenset(
    {"gpus", "rdma_devices", "rdma_ports", "provider_lib", "roce_gid", "perftest", "memlock"}
)
# perftest's tools, which `pdctl fleet check --fabric` runs between GPU hosts (package
# `perftest` on Debian/Ubuntu and RHEL).
PERFTEST_TOOLS = ("ib_write_bw", "ib_write_lat")
# NVIDIA-only checks: AMD GPUs reach containers as plain device nodes, no toolkit or CDI.
NVIDIA_ONLY_CHECKS = frozenset({"container_toolkit", "cdi"})


class ParseError(ValueError):
    """Tool output that is not in the expected format; the message says what was expected."""


# --------------------------------------------------------------------------- small helpers


def _snippet(text: str, limit: int = 90) -> str:
    """The first non-blank line of text, shortened, for messages."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    if not line:
        return "(empty)"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _decode(data: bytes | None) -> str:
    text = (data or b"").decode("utf-8", errors="replace")
    return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + "\n[output truncated]\n"


def _named_list(items: Sequence[str], limit: int = 8) -> str:
    """'a, b and c', with 'and N more' past limit."""
    shown = list(items[:limit])
    if len(items) > limit:
        return ", ".join(shown) + f" and {len(items) - limit} more"
    if len(shown) == 1:
        return shown[0]
    return ", ".join(shown[:-1]) + " and " + shown[-1]


def _grouped(problems: Sequence[tuple[str, str, str]]) -> str:
    """(device, issue, detail) triples as 'a and b <issue>; c <issue> <detail>'.

    Devices sharing an issue are named together, so every faulty device fits in
    one short message; the detail (what is there) is kept when they share it.
    """
    groups: dict[str, list[tuple[str, str]]] = {}
    for name, issue, detail in problems:
        groups.setdefault(issue, []).append((name, detail))
    parts = []
    for issue, members in groups.items():
        names = _named_list([name for name, _ in members], 16)
        details = {detail for _, detail in members}
        detail = f" {members[0][1]}" if len(details) == 1 and members[0][1] else ""
        verb = issue
        if len(members) > 1:  # "bnxt_re1 and bnxt_re4 have no GID[3]"
            verb = re.sub(
                r"^(has|is) ", lambda m: {"has": "have ", "is": "are "}[m.group(1)], issue
            )
        parts.append(f"{names} {verb}{detail}")
    return "; ".join(parts)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _gb(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return round(float(value) / GIB, 1)


# --------------------------------------------------------------------------- running commands


def _result(argv: Sequence[str], rc: int, stdout: str, stderr: str) -> dict[str, Any]:
    return {"argv": list(argv), "rc": rc, "stdout": stdout, "stderr": stderr}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # our child leads its own session
    except OSError:
        proc.kill()


def run_command(
    argv: Sequence[str], timeout: float = 20.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run argv; {"argv", "rc", "stdout", "stderr"}. Never raises.

    A missing program is rc 127 and an unexecutable one rc 126, with the error in
    stderr; a run past timeout is killed (with its process group) and is rc 124.
    """
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        return _result(argv, RC_NOT_FOUND, "", f"{argv[0]}: command not found ({exc.strerror})")
    except PermissionError as exc:
        return _result(argv, RC_NOT_EXECUTABLE, "", f"{argv[0]}: {exc.strerror}")
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return _result(argv, RC_NOT_EXECUTABLE, "", f"{argv[0]}: {exc}")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:  # a grandchild holds the pipes open
            out, err = b"", b""
        note = f"{argv[0]}: timed out after {timeout:g} s\n"
        return _result(argv, RC_TIMEOUT, _decode(out), note + _decode(err))
    return _result(argv, proc.returncode, _decode(out), _decode(err))


def _tool_env() -> dict[str, str]:
    env = dict(os.environ)
    parts = [p for p in env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep) if p]
    parts += [extra for extra in EXTRA_PATH if extra not in parts]
    env["PATH"] = os.pathsep.join(parts)
    return env


def _gpu_commands(timeout: float, env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """amd-smi list, then rocm-smi only when amd-smi is missing or lists no GPU."""
    results = {"amd_smi_list": run_command(AMD_SMI_LIST, timeout, env)}
    try:
        listed = bool(parse_amd_smi_list(results["amd_smi_list"]["stdout"]))
    except ParseError:
        listed = False
    if results["amd_smi_list"]["rc"] != 0 or not listed:
        results["rocm_smi"] = run_command(ROCM_SMI, timeout, env)
    return results


def _nvidia_commands(timeout: float, env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """nvidia-smi's GPU table, and the container toolkit, only where nvidia-smi is installed."""
    smi = run_command(NVIDIA_SMI_QUERY, timeout, env)
    if smi["rc"] == RC_NOT_FOUND:
        return {}
    return {
        "nvidia_smi": smi,
        "nvidia_ctk_version": run_command(NVIDIA_CTK_VERSION, timeout, env),
        "nvidia_ctk_cdi_list": run_command(NVIDIA_CTK_CDI_LIST, timeout, env),
    }


# --------------------------------------------------------------------------- PCI topology

_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def normalize_bdf(text: str) -> str | None:
    """'00000000:1B:00.0' (nvidia-smi) or '0000:1b:00.0' (sysfs) -> '0000:1b:00.0'."""
    match = _BDF.match(text.strip())
    if not match:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def pci_chain(realpath: str | None) -> list[str]:
    """The PCI addresses from the root port down to the device in a sysfs realpath.

    /sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:1b:00.0 -> [0000:15:01.0,
    0000:16:00.0, 0000:1b:00.0]; a trailing non-PCI part (an auxiliary device) is dropped.
    """
    if not realpath:
        return []
    chain = [normalize_bdf(part) for part in realpath.split("/")]
    return [bdf for bdf in chain if bdf]


def _read_int(path: Path) -> int | None:
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return None if value < 0 else value  # numa_node -1: the platform does not say


def _sysfs_node(link: Path) -> dict[str, Any]:
    return {"realpath": os.path.realpath(link), "numa_node": _read_int(link / "numa_node")}


def _sysfs(gpu_bdfs: Iterable[str]) -> dict[str, Any]:
    """Each GPU's and each RDMA device's sysfs PCI path, NUMA node and (NICs) kernel driver."""
    pci = {}
    for bdf in gpu_bdfs:
        link = Path(SYSFS_PCI_DEVICES) / bdf
        if link.exists():
            pci[bdf] = _sysfs_node(link)
    infiniband: dict[str, Any] = {}
    base = Path(SYSFS_INFINIBAND)
    for entry in sorted(base.iterdir()) if base.is_dir() else []:
        device = entry / "device"
        node: dict[str, Any] = {"realpath": None, "numa_node": None}
        if device.exists():
            node = _sysfs_node(device)
        driver = device / "driver"
        node["driver"] = driver.readlink().name if driver.is_symlink() else None
        infiniband[entry.name] = node
    return {"pci": pci, "infiniband": infiniband}


def _gpu_bdfs(commands: dict[str, Any]) -> list[str]:
    """The GPUs' PCI addresses from whichever GPU tool answered (sysfs is read for these)."""
    found: list[str] = []
    smi = commands.get("nvidia_smi")
    if isinstance(smi, dict) and smi.get("rc") == 0:
        rows = _safe(lambda: parse_nvidia_smi_query(str(smi.get("stdout") or "")), [])
        found += [row["pci"] for row in rows if row.get("pci")]
    amd = commands.get("amd_smi_list")
    if isinstance(amd, dict) and amd.get("rc") == 0:
        records = _safe(lambda: parse_amd_smi_list(str(amd.get("stdout") or "")), [])
        found += [normalize_bdf(str(r.get("bdf") or "")) or "" for r in records]
    return _unique(bdf for bdf in found if bdf)


def _provider_libs() -> dict[str, list[str]]:
    """Every libibverbs provider library, by the name in lib<name>-rdmav<ABI>.so.

    The ABI suffix follows rdma-core's version (rdmav34, rdmav57, ...), and distributions put
    the directory in different places: found by glob, never by one file name (docs/facts.md).
    """
    found: dict[str, list[str]] = {}
    for directory in PROVIDER_DIRS:
        for path in sorted(Path(directory).glob("lib*-rdmav*.so")):
            match = re.match(r"^lib(.+?)-rdmav\d+\.so$", path.name)
            if match and path.is_file():
                found.setdefault(match.group(1), []).append(str(path))
    return found


def _nvidia_files() -> dict[str, Any]:
    return {
        "cdi_specs": [p for p in CDI_SPEC_PATHS if Path(p).is_file()],
        "device_nodes": sorted(str(p) for p in Path(NVIDIA_DEV_DIR).glob(NVIDIA_DEV_GLOB)),
    }


# --------------------------------------------------------------------------- host facts


def _read_os_release() -> dict[str, str]:
    for candidate in OS_RELEASE_PATHS:
        try:
            text = Path(candidate).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        values: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() in ("PRETTY_NAME", "ID", "VERSION_ID"):
                try:
                    words = shlex.split(value)
                except ValueError:
                    words = [value.strip().strip("\"'")]
                values[key.strip()] = words[0] if words else ""
        return {
            "pretty_name": values.get("PRETTY_NAME", ""),
            "id": values.get("ID", ""),
            "version_id": values.get("VERSION_ID", ""),
        }
    return {"pretty_name": "", "id": "", "version_id": ""}


def _memory_bytes() -> int | None:
    try:
        text = Path(MEMINFO_PATH).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _storage(paths: Sequence[str]) -> dict[str, Any]:
    for candidate in paths:
        if Path(candidate).exists():
            try:
                free: int | None = shutil.disk_usage(candidate).free
                error = None
            except OSError as exc:
                free, error = None, exc.strerror or str(exc)
            return {
                "path": candidate,
                "free_bytes": free,
                "error": error,
                "candidates": list(paths),
            }
    return {"path": None, "free_bytes": None, "error": None, "candidates": list(paths)}


def _provider(provider_lib: str) -> dict[str, Any]:
    name = Path(provider_lib).name
    elsewhere = [
        str(Path(d) / name)
        for d in PROVIDER_DIRS
        if str(Path(d) / name) != provider_lib and (Path(d) / name).is_file()
    ]
    return {"path": provider_lib, "exists": Path(provider_lib).is_file(), "elsewhere": elsewhere}


def _render_nodes() -> list[str]:
    return sorted(str(p) for p in Path(DRI_DIR).glob("renderD*"))


def _bounding_set_has(capability: int) -> bool | None:
    """Whether this process's capability bounding set holds ``capability`` (None: unknown)."""
    status = Path("/proc/self/status").read_text(encoding="utf-8", errors="replace")
    match = re.search(r"^CapBnd:\s*([0-9a-fA-F]+)", status, re.MULTILINE)
    return bool(int(match.group(1), 16) >> capability & 1) if match else None


def _memlock(timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Whether root here can have RLIMIT_MEMLOCK unlimited, and what decides it."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    tried = run_command((sys.executable, "-c", MEMLOCK_PROBE), timeout, env)
    errors = [line.strip() for line in tried["stderr"].splitlines() if line.strip()]
    return {
        "euid": os.geteuid(),
        "hard": None if hard == resource.RLIM_INFINITY else hard,
        "cap_sys_resource": _safe(lambda: _bounding_set_has(CAP_SYS_RESOURCE), None),
        "unlimited": tried["rc"] == 0,
        "error": _clip(errors[-1], 100) if tried["rc"] and errors else None,
    }


def _safe(fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except Exception:  # a fact we cannot read must not cost the others
        return default


def probe_peer(address: str, port: int, timeout: float | None = None) -> dict[str, Any]:
    """Whether address is reachable: a TCP connect to port is accepted or refused in time."""
    timeout = CONNECT_TIMEOUT if timeout is None else timeout
    entry: dict[str, Any] = {"address": address, "port": port, "ok": False, "error": None}
    try:
        with socket.create_connection((address, port), timeout=timeout):
            entry["ok"] = True
    except ConnectionRefusedError:
        # The peer answered (a reset): the network path between the hosts works, which is
        # what the mesh is about; a closed port there is that service's own business.
        entry["ok"] = True
        entry["refused"] = True
    except (TimeoutError, socket.timeout):  # noqa: UP041 - distinct classes before Python 3.10
        entry["error"] = f"timed out after {timeout:g} s"
    except socket.gaierror as exc:
        entry["error"] = f"cannot resolve {address}: {exc.strerror or exc}"
    except OSError as exc:
        entry["error"] = exc.strerror or str(exc)
    except (ValueError, TypeError, OverflowError) as exc:
        entry["error"] = f"invalid peer: {exc}"
    return entry


def _peer_job(peer: object) -> Callable[[], dict[str, Any]]:
    if (
        isinstance(peer, (list, tuple))
        and len(peer) == 2
        and isinstance(peer[0], str)
        and isinstance(peer[1], int)
        and not isinstance(peer[1], bool)
    ):
        address, port = peer[0], peer[1]
        return lambda: probe_peer(address, port)
    bad = {"address": str(peer), "port": None, "ok": False, "error": "invalid peer"}
    return lambda: bad


def collect(
    provider_lib: str,
    storage_paths: list[str],
    peers: list[tuple[str, int]],
    timeout: float = 20.0,
) -> dict[str, Any]:
    """Observe this host: tool outputs, a few files, TCP reachability of peers.

    Runs ON the host. Commands and peer probes run concurrently, each command
    with its own timeout; nothing here raises. The result is JSON-serialisable.
    """
    started = time.monotonic()
    env = _tool_env()
    search_path = env["PATH"]
    jobs: dict[str, Callable[[], Any]] = {}
    for key, argv in COMMANDS:
        jobs[key] = functools.partial(run_command, argv, timeout, env)
    jobs["gpu"] = lambda: _gpu_commands(timeout, env)
    jobs["nvidia"] = lambda: _nvidia_commands(timeout, env)
    jobs["memlock"] = lambda: _safe(lambda: _memlock(timeout, env), {})
    for runtime in RUNTIMES:
        if shutil.which(runtime, path=search_path):
            jobs[f"{runtime}_info"] = functools.partial(
                run_command, RUNTIME_INFO[runtime], timeout, env
            )
    peer_jobs = [_peer_job(peer) for peer in peers or []]
    workers = len(jobs) + min(len(peer_jobs), 64)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        peer_futures = [pool.submit(job) for job in peer_jobs]
        raw: dict[str, Any] = {
            "schema": SCHEMA,
            "hostname": _safe(socket.gethostname, ""),
            "os": _safe(_read_os_release, {"pretty_name": "", "id": "", "version_id": ""}),
            "kernel": _safe(platform.release, ""),
            "cpus": _safe(os.cpu_count, None),
            "memory_bytes": _safe(_memory_bytes, None),
            "storage": _safe(lambda: _storage(list(storage_paths or [])), {"path": None}),
            "kfd": _safe(lambda: Path(KFD_PATH).exists(), False),
            "render_nodes": _safe(_render_nodes, []),
            "provider_lib": _safe(lambda: _provider(provider_lib), {"path": provider_lib}),
            "systemd": _safe(lambda: Path(SYSTEMD_RUN_DIR).is_dir(), False),
            "python": platform.python_version(),
        }
        done: dict[str, Any] = {}
        for key, future in futures.items():
            try:
                value = future.result()
            except Exception as exc:  # run_command never raises; this is a last resort
                value = _result([key], RC_NOT_EXECUTABLE, "", f"{key}: {exc}")
            if key in ("gpu", "nvidia") and isinstance(value, dict):
                done.update(value)
            else:
                done[key] = value
        raw["commands"] = {key: done[key] for key in COMMAND_ORDER if key in done}
        raw["memlock"] = done["memlock"]
        raw["reach"] = [future.result() for future in peer_futures]
    raw["sysfs"] = _safe(lambda: _sysfs(_gpu_bdfs(done)), {"pci": {}, "infiniband": {}})
    raw["provider_libs"] = _safe(_provider_libs, {})
    raw["nvidia_files"] = _safe(_nvidia_files, {"cdi_specs": [], "device_nodes": []})
    raw["tools"] = {name: shutil.which(name, path=search_path) for name in PERFTEST_TOOLS}
    raw["elapsed_s"] = round(time.monotonic() - started, 3)
    return raw


# --------------------------------------------------------------------------- ibverbs parsers


@dataclass
class Gid:
    index: int
    address: str
    kind: str  # "RoCE v2", "RoCE v1"; "" when not shown (InfiniBand, old rdma-core)


@dataclass
class RdmaPort:
    number: int
    state: str  # "PORT_ACTIVE", "PORT_DOWN", ...
    state_code: int  # 4 for PORT_ACTIVE; -1 when not printed
    link_layer: str = ""
    active_mtu: int | None = None
    gids: list[Gid] = field(default_factory=list)
    lid: int | None = None  # port_lid: non-zero once an InfiniBand subnet manager assigned one
    # `-v` only, as printed ("4X (2)", "100.0 Gbps (128)"): the line rate (pdctl/linerate.py).
    active_width: str = ""
    active_speed: str = ""

    def gid(self, index: int) -> Gid | None:
        return next((gid for gid in self.gids if gid.index == index), None)


@dataclass
class RdmaDevice:
    name: str
    node_guid: str = ""
    fw_ver: str = ""
    vendor_id: str = ""
    ports: list[RdmaPort] = field(default_factory=list)

    def port(self, number: int) -> RdmaPort | None:
        return next((port for port in self.ports if port.number == number), None)


_DEVICES_HEADER = re.compile(r"^\s*device\s+node GUID\s*$")
_DEVICES_RULE = re.compile(r"^\s*-+\s+-+\s*$")
_DEVICES_ROW = re.compile(r"^\s*(\S+)\s+([0-9a-fA-F]{16})\s*$")
_GID_LINE = re.compile(r"^GID\[\s*(\d+)\]:\s*(\S+?)(?:,\s*(.*?))?\s*$")
_CODED = re.compile(r"^(.*?)\s*\((-?\d+)\)$")
_PORT_STATES = {"PORT_DOWN": 1, "PORT_INIT": 2, "PORT_ARMED": 3, "PORT_ACTIVE": 4}
_NO_DEVICE_LINES = ("No IB devices found", "Failed to get IB devices list")


def parse_ibv_devices(stdout: str) -> list[tuple[str, str]]:
    """(device, node GUID) pairs from ``ibv_devices``; [] for the header alone."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if lines and lines[0].strip().startswith("Failed to get IB devices list"):
        raise ParseError(f"ibv_devices could not list devices: {_snippet(lines[0])}")
    if not lines or not _DEVICES_HEADER.match(lines[0]):
        got = _snippet(lines[0]) if lines else "empty output"
        raise ParseError(f"expected ibv_devices' header 'device  node GUID', got {got!r}")
    devices: list[tuple[str, str]] = []
    for line in lines[1:]:
        if _DEVICES_RULE.match(line):
            continue
        match = _DEVICES_ROW.match(line)
        if not match:
            raise ParseError(
                "expected an ibv_devices row '<device> <16 hex digit GUID>', "
                f"got {_snippet(line)!r}"
            )
        devices.append((match.group(1), match.group(2).lower()))
    return devices


def _coded(value: str) -> tuple[str, int | None]:
    """'PORT_ACTIVE (4)' -> ('PORT_ACTIVE', 4); 'Ethernet' -> ('Ethernet', None)."""
    match = _CODED.match(value)
    if match:
        return match.group(1).strip(), int(match.group(2))
    return value.strip(), None


def _set_device_field(device: RdmaDevice, key: str, value: str) -> None:
    if key == "node_guid":
        device.node_guid = value
    elif key == "fw_ver":
        device.fw_ver = value
    elif key == "vendor_id":
        device.vendor_id = value


def _set_port_field(port: RdmaPort, key: str, value: str) -> None:
    if key == "state":
        state, code = _coded(value)
        port.state = state
        port.state_code = code if code is not None else _PORT_STATES.get(state, -1)
    elif key == "link_layer":
        port.link_layer = value
    elif key == "active_mtu":
        mtu = _coded(value)[0]
        port.active_mtu = int(mtu) if mtu.isdigit() else None
    elif key in ("active_width", "active_speed"):
        setattr(port, key, _clip(value, 40))
    elif key == "port_lid":
        try:
            port.lid = int(value, 0)
        except ValueError:
            port.lid = None


def _devinfo_line(
    devices: list[RdmaDevice], line: str, number: int
) -> tuple[RdmaDevice, RdmaPort | None] | None:
    """Handle a line that opens a device or a port; None for any other line."""
    key, sep, value = (part.strip() for part in line.partition(":"))
    if key == "hca_id" and sep and value:
        devices.append(RdmaDevice(name=value))
        return devices[-1], None
    if not devices:
        if line.startswith(_NO_DEVICE_LINES):
            raise ParseError(f"ibv_devinfo found no device: {_snippet(line)}")
        raise ParseError(
            f"line {number}: expected ibv_devinfo to start with 'hca_id:<TAB><device>', "
            f"got {_snippet(line)!r}"
        )
    if key == "port" and sep:
        if not value.isdigit():
            raise ParseError(f"line {number}: expected a port number after 'port:', got {value!r}")
        port = RdmaPort(number=int(value), state="", state_code=-1)
        devices[-1].ports.append(port)
        return devices[-1], port
    return None


def parse_ibv_devinfo(stdout: str) -> list[RdmaDevice]:
    """Devices, ports and GID tables from ``ibv_devinfo [-v]``; [] for empty output.

    Tolerates tabs turned into spaces (copies from web pages), unknown keys, and
    rdma-core versions that print GIDs without their type.
    """
    devices: list[RdmaDevice] = []
    port: RdmaPort | None = None
    for number, raw_line in enumerate(stdout.splitlines(), 1):
        line = raw_line.strip()
        if not line:
            continue
        gid = _GID_LINE.match(line)
        if gid and port is not None:
            port.gids.append(Gid(int(gid.group(1)), gid.group(2), gid.group(3) or ""))
            continue
        opened = _devinfo_line(devices, line, number)
        if opened is not None:
            port = opened[1]
            continue
        key, sep, value = (part.strip() for part in line.partition(":"))
        if sep and port is not None:
            _set_port_field(port, key, value)
        elif sep:
            _set_device_field(devices[-1], key, value)
    for dev in devices:
        for p in dev.ports:
            if not p.state:
                raise ParseError(f"expected a 'state:' line in port {p.number} of {dev.name}")
    return devices


def provider_warnings(stderr: str) -> list[str]:
    """libibverbs' provider warnings, deduplicated, in order.

    Chiefly "couldn't load driver '<lib>': <why>", but also "Driver <x> does not
    support the kernel ABI ..." and "no userspace device-specific driver found
    ...": every way libibverbs says a device's provider is unusable.
    """
    return _unique(
        line.strip()
        for line in stderr.splitlines()
        if line.strip().startswith("libibverbs: Warning")
    )


# --------------------------------------------------------------------------- GPU parsers


def _load_json(text: str, what: str) -> Any:
    stripped = text.strip()
    if not stripped:
        raise ParseError(f"expected JSON from {what}, got empty output")
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    # Some builds print warnings (Python SyntaxWarnings, "WARNING: ...") ahead of the document.
    decoder = json.JSONDecoder()
    for match in re.finditer(r"^[\[{]", stripped, re.MULTILINE):
        try:
            return decoder.raw_decode(stripped, match.start())[0]
        except ValueError:
            continue
    raise ParseError(f"expected JSON from {what}, got {_snippet(stripped)!r}")


def _gpu_records(data: object, what: str) -> list[dict[str, Any]]:
    if isinstance(data, dict) and "gpu_data" in data:
        data = data["gpu_data"]  # amd-smi >= 26 wraps its list
    if not isinstance(data, list):
        kind = f"an object with keys {sorted(data)[:5]}" if isinstance(data, dict) else type(data)
        raise ParseError(
            f'expected a JSON list of GPU records or {{"gpu_data": [...]}} from {what}, got {kind}'
        )
    for index, record in enumerate(data):
        if not isinstance(record, dict):
            raise ParseError(f"expected GPU record {index} from {what} to be an object")
    return data


def parse_amd_smi_list(text: str) -> list[dict[str, Any]]:
    """GPU records ({"gpu", "bdf", "uuid", ...}) from ``amd-smi list --json``."""
    return _gpu_records(_load_json(text, "amd-smi list --json"), "amd-smi list --json")


def _market_name(record: dict[str, Any], index: int) -> str:
    asic = record.get("asic")
    if not isinstance(asic, dict):
        raise ParseError(
            f"expected an 'asic' object in GPU record {index} of amd-smi static --asic --json"
        )
    name = asic.get("market_name")
    if isinstance(name, str) and name.strip() and name.strip() != "N/A":
        return name.strip()
    board = record.get("board")
    product = board.get("product_name") if isinstance(board, dict) else None
    if isinstance(product, str) and product.strip() and product.strip() != "N/A":
        return product.strip()
    raise ParseError(f"expected asic.market_name in GPU record {index}, got {name!r}")


def parse_amd_smi_static(text: str) -> list[str]:
    """Market names, one per GPU, from ``amd-smi static --asic --json``."""
    what = "amd-smi static --asic --json"
    records = _gpu_records(_load_json(text, what), what)
    return [_market_name(record, index) for index, record in enumerate(records)]


def parse_rocm_smi_products(text: str) -> list[str]:
    """Card series, one per card, from ``rocm-smi --showproductname --json``.

    Empty output is [] (rocm-smi prints nothing but a warning when it sees no
    GPU, and exits 0). The key is "Card Series" or "Card series" by version.
    """
    if not text.strip():
        return []
    data = _load_json(text, "rocm-smi --showproductname --json")
    if not isinstance(data, dict):
        raise ParseError('expected a JSON object {"card0": {...}} from rocm-smi --showproductname')
    names: list[str] = []
    for card, fields in data.items():
        if not str(card).lower().startswith("card"):
            continue  # "system" and similar
        if not isinstance(fields, dict):
            raise ParseError(f"expected {card} to be an object in rocm-smi's JSON")
        series = next((v for k, v in fields.items() if str(k).lower() == "card series"), None)
        if not isinstance(series, str):
            raise ParseError(f"expected a 'Card Series' key for {card} in rocm-smi's JSON")
        names.append(series.strip())
    return names


# --------------------------------------------------------------------------- NVIDIA parsers

_NVIDIA_NO_DRIVER = "NVIDIA-SMI has failed"
_NVIDIA_NO_DEVICE = "No devices were found"
_HEADER_UNIT = re.compile(r"\s*\[[^\]]*\]$")  # "memory.total [MiB]"
_MIB = re.compile(r"^(\d+)(?:\s*MiB)?$")
_NOT_AVAILABLE = ("[N/A]", "N/A", "[Not Supported]")


def _nvidia_value(field_name: str, value: str, number: int) -> Any:
    if value in _NOT_AVAILABLE:
        return None
    if field_name == "index":
        if not value.isdigit():
            raise ParseError(f"line {number}: expected a GPU index, got {value!r}")
        return int(value)
    if field_name == "memory.total":
        match = _MIB.match(value)
        if not match:
            raise ParseError(
                f"line {number}: expected memory.total as '<N> MiB' or '<N>', got {value!r}"
            )
        return int(match.group(1))
    if field_name == "pci.bus_id":
        bdf = normalize_bdf(value)
        if bdf is None:
            raise ParseError(
                f"line {number}: expected pci.bus_id like 00000000:1B:00.0, got {value!r}"
            )
        return bdf
    return value


def parse_nvidia_smi_query(
    text: str, fields: Sequence[str] = NVIDIA_QUERY_FIELDS
) -> list[dict[str, Any]]:
    """Rows of ``nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits]``.

    One dict per GPU keyed by field name (``pci.bus_id`` also as ``pci``, normalised);
    memory in MiB with or without the unit; ``[N/A]`` is None; no device is [].
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith(_NVIDIA_NO_DRIVER):
        raise ParseError(f"nvidia-smi cannot talk to the driver: {_snippet(lines[0])}")
    if lines and lines[0].startswith(_NVIDIA_NO_DEVICE):
        return []
    header = [_HEADER_UNIT.sub("", part.strip()) for part in lines[0].split(",")] if lines else []
    if header == list(fields):
        lines = lines[1:]
    rows = []
    for number, line in enumerate(lines, 1):
        parts = [part.strip() for part in line.split(", ")]
        if len(parts) != len(fields):
            raise ParseError(
                f"line {number}: expected {len(fields)} comma-separated values "
                f"({', '.join(fields)}), got {_snippet(line)!r}"
            )
        row = {name: _nvidia_value(name, value, number) for name, value in zip(fields, parts)}  # noqa: B905 - 3.9 has no strict=; lengths checked
        if "pci.bus_id" in row:
            row["pci"] = row["pci.bus_id"]
        rows.append(row)
    return rows


_CDI_NAME = re.compile(r"^([a-z0-9][a-z0-9.-]*/[a-zA-Z0-9][a-zA-Z0-9_.-]*)=(\S+)$")
_LOG_LINE = re.compile(r"^(INFO|WARN|WARNING|DEBUG)\[\d+\]")


def parse_nvidia_ctk_cdi_list(text: str, kind: str = "nvidia.com/gpu") -> list[str]:
    """Device names of KIND from ``nvidia-ctk cdi list`` ('nvidia.com/gpu=0' -> '0').

    Its 'INFO[0000] Found N CDI devices' log line (stderr, sometimes merged) is skipped.
    """
    names = []
    for number, raw_line in enumerate(text.splitlines(), 1):
        line = raw_line.strip()
        if not line or _LOG_LINE.match(line):
            continue
        match = _CDI_NAME.match(line)
        if not match:
            raise ParseError(
                f"line {number}: expected a CDI device name like nvidia.com/gpu=0, "
                f"got {_snippet(line)!r}"
            )
        if match.group(1) == kind:
            names.append(match.group(2))
    return names


def parse_nvidia_ctk_version(text: str) -> str:
    """'NVIDIA Container Toolkit CLI version 1.17.8' (first line of --version) -> '1.17.8'."""
    match = re.search(r"\bversion\s+v?(\d+\.\d+[^\s]*)", text)
    if not match:
        raise ParseError(
            "expected 'NVIDIA Container Toolkit CLI version X.Y.Z' from nvidia-ctk --version, "
            f"got {_snippet(text)!r}"
        )
    return match.group(1)


def dstack_gpu_name(name: str) -> str:
    """A GPU's model as dstack spells it: 'NVIDIA H100 80GB HBM3' -> 'H100',
    'NVIDIA A100-SXM4-80GB' -> 'A100', 'AMD Instinct MI300X' -> 'MI300X'."""
    amd = re.search(r"\b(MI\d{3}[A-Z]?)\b", name, re.IGNORECASE)
    if amd:
        return amd.group(1).upper()
    words = re.sub(r"^(NVIDIA|Tesla|AMD|Radeon|Instinct)\s+", "", name.strip(), flags=re.I)
    words = re.sub(r"^(NVIDIA|Tesla|GeForce|Quadro)\s+", "", words, flags=re.I)
    parts = re.split(r"[\s-]+", words)
    if len(parts) > 1 and parts[0].upper() in ("RTX", "GTX") and parts[1]:
        return parts[0].upper() + parts[1].upper()  # "RTX 4090" -> "RTX4090"
    model = parts[0] if parts and parts[0] else name.strip()
    if len(parts) > 1 and parts[1].upper() == "NVL":
        return model + "NVL"
    return model


# Kernel driver of an RDMA device's PCI function -> the libibverbs provider's name (the
# <name> in lib<name>-rdmav*.so, which pdctl calls the NIC driver).
_PROVIDERS = {
    "mlx5_core": "mlx5",
    "mlx5_ib": "mlx5",
    "mlx4_core": "mlx4",
    "mlx4_ib": "mlx4",
    "bnxt_en": "bnxt_re",
    "bnxt_re": "bnxt_re",
    "ice": "irdma",
    "i40e": "irdma",
    "irdma": "irdma",
    "qede": "qedr",
    "qedr": "qedr",
    "hns3": "hns",
    "hns_roce_hw_v2": "hns",
    "mana": "mana",
    "mana_ib": "mana",
    "ionic": "ionic",
    "ionic_rdma": "ionic",
}


_NAMED_AFTER_DRIVER = re.compile(
    r"^(mlx5|mlx4|bnxt_re|irdma|qedr|efa|erdma|hns|mana|rxe|siw)_?\d+$"
)


def provider_driver(kernel_driver: str | None, device_name: str = "") -> str | None:
    """The NIC driver name pdctl uses (mlx5, bnxt_re, ...): from the kernel driver sysfs shows,
    else guessed from a device named after it (mlx5_0, bnxt_re3); None for names udev chose
    (rocep1s0f1) without sysfs."""
    if kernel_driver:
        return _PROVIDERS.get(kernel_driver, kernel_driver)
    match = _NAMED_AFTER_DRIVER.match(device_name)
    return match.group(1) if match else None


# --------------------------------------------------------------------------- interpretation


def _command(raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    commands = raw.get("commands")
    cmd = commands.get(key) if isinstance(commands, dict) else None
    if not isinstance(cmd, dict) or not isinstance(cmd.get("rc"), int):
        return None
    return {
        "argv": cmd.get("argv") or [key],
        "rc": cmd["rc"],
        "stdout": str(cmd.get("stdout") or ""),
        "stderr": str(cmd.get("stderr") or ""),
    }


def _stderr_summary(cmd: dict[str, Any]) -> str:
    """The line that says why a command failed: the first that is not a provider warning."""
    lines = [line.strip() for line in cmd["stderr"].splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith("libibverbs: Warning")]
    if useful:
        return _clip(useful[0], 100)
    if lines:
        return _clip(lines[0], 100)
    return f"exit status {cmd['rc']}, no error text"


def _label(cmd: dict[str, Any]) -> str:
    return " ".join(str(part) for part in cmd["argv"])


def _installed(cmd: dict[str, Any] | None) -> bool:
    return cmd is not None and cmd["rc"] != RC_NOT_FOUND


def _parse(
    cmd: dict[str, Any] | None, parser: Callable[[str], Any], errors: list[str]
) -> Any | None:
    """parser(stdout), or None with the reason appended to errors. A missing tool is no error."""
    if cmd is None or cmd["rc"] == RC_NOT_FOUND:
        return None
    if cmd["rc"] != 0 and not cmd["stdout"].strip():
        errors.append(f"{_label(cmd)} exited {cmd['rc']}: {_stderr_summary(cmd)}")
        return None
    try:
        return parser(cmd["stdout"])
    except ParseError as exc:
        if cmd["rc"] != 0:
            errors.append(f"{_label(cmd)} exited {cmd['rc']}: {_stderr_summary(cmd)}")
        else:
            errors.append(f"{_label(cmd)}: {exc}")
        return None


def _model(names: Sequence[str]) -> str | None:
    distinct = _unique(names)
    return ", ".join(distinct) if distinct else None


@dataclass
class _View:
    """What the raw document says, parsed once for facts() and evaluate()."""

    errors: list[str]
    gpus: dict[str, Any]
    gpu_tools: bool  # amd-smi or rocm-smi is installed
    listed: list[str] | None  # ibv_devices' names; None when it did not run or parse
    devinfo: list[RdmaDevice] | None
    warnings: list[str]
    runtime: dict[str, Any]
    runtime_error: str | None
    nvidia: dict[str, Any] | None = None  # None: no nvidia-smi on this host
    sysfs: dict[str, Any] = field(default_factory=dict)
    provider_libs: dict[str, list[str]] = field(default_factory=dict)

    def nic(self, name: str) -> dict[str, Any]:
        """What sysfs says of RDMA device NAME ({} when it does not show it)."""
        return _dict(_dict(self.sysfs.get("infiniband")).get(name))

    def nic_driver(self, name: str) -> str | None:
        return provider_driver(self.nic(name).get("driver"), name)


def _nvidia_gpus(raw: dict[str, Any], errors: list[str]) -> dict[str, Any] | None:
    """GPUs as nvidia-smi lists them; None when nvidia-smi is not installed."""
    smi = _command(raw, "nvidia_smi")
    if smi is None or smi["rc"] == RC_NOT_FOUND:
        return None
    gpus: dict[str, Any] = {"count": 0, "model": None, "source": "nvidia-smi", "bdfs": []}
    gpus.update(vendor="nvidia", devices=[], memory_mib=None, driver=None)
    if smi["rc"] != 0:  # no driver: nvidia-smi says so on stdout and exits 9
        why = _snippet(smi["stdout"] or smi["stderr"], 110)
        errors.append(f"{_label(smi)} exited {smi['rc']}: {why}")
        return gpus
    rows = _parse(smi, parse_nvidia_smi_query, errors) or []
    rows = sorted(rows, key=lambda r: r.get("index") if isinstance(r.get("index"), int) else -1)
    memories = [r["memory.total"] for r in rows if isinstance(r.get("memory.total"), int)]
    gpus.update(
        count=len(rows),
        model=_model([str(r.get("name") or "") for r in rows if r.get("name")]),
        bdfs=[r["pci"] for r in rows if r.get("pci")],
        devices=[
            {
                "index": r.get("index"),
                "pci": r.get("pci"),
                "memory_mib": r.get("memory.total"),
                "uuid": r.get("uuid"),
            }
            for r in rows
        ],
        memory_mib=min(memories) if memories else None,
        driver=next((str(r["driver_version"]) for r in rows if r.get("driver_version")), None),
    )
    return gpus


def _nvidia_view(raw: dict[str, Any], errors: list[str]) -> dict[str, Any] | None:
    """The NVIDIA driver, container toolkit and CDI spec; None without nvidia-smi."""
    smi = _command(raw, "nvidia_smi")
    if smi is None or smi["rc"] == RC_NOT_FOUND:
        return None
    version_cmd, cdi_cmd = _command(raw, "nvidia_ctk_version"), _command(raw, "nvidia_ctk_cdi_list")
    files = _dict(raw.get("nvidia_files"))
    specs = [str(p) for p in files.get("cdi_specs") or [] if isinstance(p, str)]
    return {
        "driver_loaded": smi["rc"] == 0,
        "ctk_installed": _installed(version_cmd),
        "ctk_version": _parse(version_cmd, parse_nvidia_ctk_version, errors),
        "cdi_devices": _parse(cdi_cmd, parse_nvidia_ctk_cdi_list, errors),
        "cdi_spec": specs[0] if specs else None,
        "device_nodes": [str(p) for p in files.get("device_nodes") or []],
    }


def _amd_devices(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    devices = []
    for position, record in enumerate(records):
        index = record.get("gpu")
        devices.append(
            {
                "index": index
                if isinstance(index, int) and not isinstance(index, bool)
                else position,
                "pci": normalize_bdf(str(record.get("bdf") or "")),
                "memory_mib": None,
                "uuid": str(record["uuid"]) if isinstance(record.get("uuid"), str) else None,
            }
        )
    return sorted(devices, key=lambda d: d["index"])


def _gpu_view(raw: dict[str, Any], errors: list[str]) -> tuple[dict[str, Any], bool]:
    amd_list, amd_static = _command(raw, "amd_smi_list"), _command(raw, "amd_smi_static")
    rocm = _command(raw, "rocm_smi")
    records = _parse(amd_list, parse_amd_smi_list, errors)
    nvidia = _nvidia_gpus(raw, errors)
    if nvidia is not None and (nvidia["count"] or not records):
        return nvidia, True
    gpus: dict[str, Any] = {"count": 0, "model": None, "source": None, "bdfs": []}
    gpus.update(vendor=None, devices=[], memory_mib=None, driver=None)
    if records:
        names = _parse(amd_static, parse_amd_smi_static, errors)
        bdfs = [str(r["bdf"]) for r in records if isinstance(r.get("bdf"), str)]
        gpus.update(count=len(records), model=_model(names or []), source="amd-smi", bdfs=bdfs)
        gpus.update(vendor="amd", devices=_amd_devices(records))
        return gpus, True
    series = _parse(rocm, parse_rocm_smi_products, errors)
    if rocm is not None and rocm["rc"] == 0:
        # rocm-smi exits 0 even when the driver is not loaded; its ERROR lines say so.
        errors += [
            f"{_label(rocm)}: {_clip(line.strip(), 100)}"
            for line in rocm["stderr"].splitlines()
            if line.strip().startswith("ERROR")
        ]
    if series:
        gpus.update(count=len(series), model=_model(series), source="rocm-smi", vendor="amd")
        gpus["devices"] = [
            {"index": i, "pci": None, "memory_mib": None, "uuid": None} for i in range(len(series))
        ]
    elif records is not None:
        gpus["source"] = "amd-smi"
    elif series is not None:
        gpus["source"] = "rocm-smi"
    return gpus, _installed(amd_list) or _installed(rocm)


def _runtime_view(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """{"name", "version", "usable"} and, when not usable, why."""
    found: list[tuple[str, str, dict[str, Any] | None]] = []
    for name in RUNTIMES:
        cmd = _command(raw, f"{name}_version")
        if cmd is None or cmd["rc"] != 0:
            continue
        match = re.search(r"\bversion\s+v?(\d[^\s,]*)", cmd["stdout"])
        version = match.group(1) if match else _snippet(cmd["stdout"], 40)
        if name == "docker" and cmd["stdout"].strip().lower().startswith("podman"):
            if any(n == "podman" for n, _, _ in found):
                continue  # podman-docker's shim: the same runtime
            name = "podman"  # noqa: PLW2901 - the shim is podman under another name
        found.append((name, version, _command(raw, f"{name}_info")))
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
        return _stderr_summary(info)
    if name == "docker":
        # docker info can exit 0 with the daemon unreachable (docker/cli#5900); the JSON says so.
        try:
            data = json.loads(info["stdout"])
        except ValueError:
            return f"unexpected `docker info` output: {_snippet(info['stdout'], 60)!r}"
        server_errors = data.get("ServerErrors") if isinstance(data, dict) else None
        if server_errors:
            return _clip(str(server_errors[0]), 100)
    return None


def _view(raw: dict[str, Any]) -> _View:
    errors: list[str] = []
    gpus, gpu_tools = _gpu_view(raw, errors)
    devices_cmd, devinfo_cmd = _command(raw, "ibv_devices"), _command(raw, "ibv_devinfo")
    pairs = _parse(devices_cmd, parse_ibv_devices, errors)
    devinfo = None
    if devinfo_cmd is not None and devinfo_cmd["rc"] != RC_NOT_FOUND:
        if "hca_id" in devinfo_cmd["stdout"] or devinfo_cmd["rc"] == 0:
            devinfo = _parse(devinfo_cmd, parse_ibv_devinfo, errors)
        else:  # "No IB devices found" (exit 255) is an answer: no device
            devinfo = []
            if "No IB devices found" not in devinfo_cmd["stderr"]:
                errors.append(
                    f"{_label(devinfo_cmd)} exited {devinfo_cmd['rc']}: "
                    f"{_stderr_summary(devinfo_cmd)}"
                )
    warnings = _unique(
        w
        for cmd in (devices_cmd, devinfo_cmd)
        if cmd is not None
        for w in provider_warnings(cmd["stderr"])
    )
    runtime, runtime_error = _runtime_view(raw)
    if runtime["name"] and runtime_error:
        errors.append(f"{runtime['name']} info: {runtime_error}")
    libs = _dict(raw.get("provider_libs"))
    return _View(
        nvidia=_nvidia_view(raw, errors),
        sysfs=_dict(raw.get("sysfs")),
        provider_libs={str(k): [str(p) for p in v] for k, v in libs.items() if isinstance(v, list)},
        errors=errors,
        gpus=gpus,
        gpu_tools=gpu_tools,
        listed=[name for name, _ in pairs] if pairs is not None else None,
        devinfo=devinfo,
        warnings=warnings,
        runtime=runtime,
        runtime_error=runtime_error,
    )


def _topology(node: dict[str, Any]) -> dict[str, Any]:
    realpath = node.get("realpath") if isinstance(node.get("realpath"), str) else None
    chain = pci_chain(realpath)
    numa = node.get("numa_node")
    return {
        "pci": chain[-1] if chain else None,
        "numa": numa if isinstance(numa, int) and not isinstance(numa, bool) else None,
        "pci_path": chain,
    }


def _nic_facts(view: _View, name: str) -> dict[str, Any]:
    return {"driver": view.nic_driver(name), **_topology(view.nic(name))}


def _gpu_device_facts(view: _View) -> list[dict[str, Any]]:
    pci = _dict(view.sysfs.get("pci"))
    devices = []
    for device in view.gpus.get("devices") or []:
        node = _dict(pci.get(device.get("pci") or ""))
        topology = _topology(node)
        devices.append(
            {
                "index": device.get("index"),
                "pci": device.get("pci"),
                "numa": topology["numa"],
                "memory_mib": device.get("memory_mib"),
                "uuid": device.get("uuid"),
                "pci_path": topology["pci_path"],
            }
        )
    return devices


def _provider_lib_fact(raw: dict[str, Any], view: _View, devices: list[dict[str, Any]]) -> bool:
    """The configured provider library exists, or every present device's driver has one."""
    if _dict(raw.get("provider_lib")).get("exists") is True:
        return True
    drivers = {d.get("driver") for d in devices}
    return bool(devices) and all(d and view.provider_libs.get(d) for d in drivers)


def _device_facts(view: _View) -> list[dict[str, Any]]:
    devices = [
        {
            "name": dev.name,
            "ports": [
                {
                    "port": p.number,
                    "state": p.state,
                    "link_layer": p.link_layer,
                    "active_width": p.active_width,
                    "active_speed": p.active_speed,
                    "gids": [
                        {"index": g.index, "address": g.address, "kind": g.kind} for g in p.gids
                    ],
                }
                for p in dev.ports
            ],
        }
        for dev in view.devinfo or []
    ]
    known = {dev["name"] for dev in devices}
    devices += [{"name": n, "ports": []} for n in view.listed or [] if n not in known]
    return [{**device, **_nic_facts(view, str(device["name"]))} for device in devices]


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def facts(raw: dict[str, Any]) -> dict[str, Any]:
    """The per-host summary pdctl stores. Never raises: problems land in "errors"."""
    raw = _dict(raw)
    try:
        view = _view(raw)
    except Exception as exc:  # a raw document no collect() wrote
        view = _View([f"unreadable observations: {exc}"], {}, False, None, None, [], {}, None)
    gpus = view.gpus
    devices = _device_facts(view)
    nvidia = view.nvidia
    os_release, storage = _dict(raw.get("os")), _dict(raw.get("storage"))
    render_nodes = raw.get("render_nodes")
    cpus = raw.get("cpus")
    return {
        "hostname": str(raw.get("hostname") or ""),
        "os": {
            "pretty_name": str(os_release.get("pretty_name") or ""),
            "id": str(os_release.get("id") or ""),
            "version_id": str(os_release.get("version_id") or ""),
        },
        "kernel": str(raw.get("kernel") or ""),
        "cpus": cpus if isinstance(cpus, int) else None,
        "memory_gb": _gb(raw.get("memory_bytes")),
        "disk_free_gb": _gb(storage.get("free_bytes")),
        "disk_path": storage.get("path") if isinstance(storage.get("path"), str) else None,
        "systemd": raw.get("systemd") is True,
        "python": str(raw.get("python") or ""),
        "gpus": {
            "count": gpus.get("count", 0),
            "model": dstack_gpu_name(str(gpus["model"])) if gpus.get("model") else None,
            "vendor": gpus.get("vendor"),
            "memory_mib": gpus.get("memory_mib"),
            "driver": gpus.get("driver"),
            "source": gpus.get("source"),
            "bdfs": gpus.get("bdfs", []),
            "devices": _gpu_device_facts(view),
        },
        "kfd": raw.get("kfd") is True,
        "render_nodes": len(render_nodes) if isinstance(render_nodes, list) else 0,
        "rdma": {
            "devices": devices,
            "provider_libs": {
                name: paths[0] for name, paths in view.provider_libs.items() if paths
            },
            "provider_lib": _provider_lib_fact(raw, view, devices),
            "warnings": view.warnings,
        },
        "nvidia": None
        if nvidia is None
        else {
            "driver_loaded": nvidia["driver_loaded"],
            "ctk_version": nvidia["ctk_version"],
            "cdi_devices": nvidia["cdi_devices"] or [],
            "cdi_spec": nvidia["cdi_spec"],
        },
        "runtime": {
            "name": view.runtime.get("name"),
            "version": view.runtime.get("version"),
            "usable": view.runtime.get("usable", False),
        },
        "errors": view.errors,
    }


# --------------------------------------------------------------------------- checks


# "any", "auto": a fleet that mixes vendors; each host is checked by what it has (_resolve).
GPU_VENDORS = ("amd", "nvidia", "any")
LINK_LAYERS = ("eth", "ib", "auto")
AUTO_NIC_DRIVER = "auto"
# The NICs such servers usually carry: what a mixed fleet's host without a NIC is told to have.
USUAL_NIC_DRIVER = {"amd": "bnxt_re", "nvidia": "mlx5"}
_LINK_LAYER_NAMES = {"eth": "Ethernet", "ib": "InfiniBand"}


@dataclass
class Expectations:
    """What a host of a fleet must have; kind "cpu" hosts skip the GPU/RDMA checks."""

    kind: str  # "gpu" | "cpu"
    gpus: int = 8
    gpu_model: str | None = "MI300X"
    nics: int = 8
    # Device names the NICs usually have (bnxt_re0.., mlx5_0..); None: from nic_driver.
    nic_prefix: str | None = None
    provider_lib: str = DEFAULT_PROVIDER_LIB
    gid_index: int = 3
    min_disk_gb: float = 50.0
    gpu_vendor: str = "amd"  # "amd" | "nvidia" | "any"
    # The libibverbs provider's name: bnxt_re, mlx5, irdma, ...; "auto": the host's own.
    nic_driver: str = "bnxt_re"
    link_layer: str = "eth"  # "eth" (RoCE) | "ib" (InfiniBand) | "auto" (the host's own)

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"Expectations.kind must be 'gpu' or 'cpu', got {self.kind!r}")
        if self.gpu_vendor not in GPU_VENDORS:
            raise ValueError(f"Expectations.gpu_vendor must be one of {GPU_VENDORS}")
        if self.link_layer not in LINK_LAYERS:
            raise ValueError(f"Expectations.link_layer must be one of {LINK_LAYERS}")
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", self.nic_driver):
            raise ValueError(f"Expectations.nic_driver is not a driver name: {self.nic_driver!r}")


@dataclass
class Check:
    name: str
    ok: bool
    message: str
    skipped: bool = False
    emulated: bool = False  # passed only because the host emulates it (the pdctl lab)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _prefix(expect: Expectations) -> str:
    """bnxt_re -> bnxt_re (bnxt_re0..), mlx5 -> mlx5_ (mlx5_0..)."""
    if expect.nic_prefix:
        return expect.nic_prefix
    driver = expect.nic_driver
    return f"{driver}_" if driver[-1:].isdigit() else driver


def _expected_nics(expect: Expectations) -> list[str]:
    return [f"{_prefix(expect)}{i}" for i in range(expect.nics)]


def _nic_range(expect: Expectations) -> str:
    if expect.nics == 1:
        return f"{_prefix(expect)}0"
    return f"{_prefix(expect)}0..{_prefix(expect)}{expect.nics - 1}"


def _driver(expect: Expectations) -> str:
    return expect.nic_driver


def _fleet_nics(view: _View, expect: Expectations) -> list[str]:
    """The present RDMA devices of the fleet's NIC driver: by the kernel driver sysfs shows
    (so udev names like rocep1s0f1 count), else by their name; the usual names first."""
    usual = _expected_nics(expect)
    mine = [name for name in _present(view) if view.nic_driver(name) == expect.nic_driver]
    return sorted(mine, key=lambda n: (usual.index(n) if n in usual else len(usual), n))


def _provider_stem(path: str) -> str:
    """libbnxt_re-rdmav34.so -> bnxt_re (the name libibverbs also uses for it)."""
    match = re.match(r"^lib(.+?)-rdmav\d+\.so", Path(path).name)
    return match.group(1) if match else Path(path).name


def _relevant_warnings(view: _View, expect: Expectations) -> list[str]:
    return [w for w in view.warnings if expect.nic_driver in w]


def _warning_detail(warning: str) -> str:
    text = warning.split("Warning:", 1)[-1].strip()
    match = re.match(r"couldn't load driver '([^']*)':\s*(.*)$", text)
    if match:
        reason = match.group(2)
        # "libx.so: cannot open shared object file: ..." repeats the name first
        prefix = match.group(1) + ": "
        return reason[len(prefix) :] if reason.startswith(prefix) else reason
    return text


def _check_systemd(host: str, raw: dict[str, Any]) -> Check:
    cmd = _command(raw, "systemctl")
    state = _snippet(cmd["stdout"], 30) if cmd and cmd["stdout"].strip() else "unknown"
    if raw.get("systemd") is not True:
        return Check(
            "systemd",
            False,
            f"{host}: systemd is not PID 1 (/run/systemd/system is missing); pdctl runs workers "
            "as systemd units, so boot the host with systemd as init",
        )
    if state == "running":
        return Check("systemd", True, f"{host}: systemd is PID 1 and running")
    if state == "degraded":
        return Check(
            "systemd",
            True,
            f"{host}: systemd is PID 1 but degraded (some unit failed: systemctl --failed)",
        )
    hint = (
        "it is still booting: re-run the check in a minute"
        if state in ("starting", "initializing")
        else "see systemctl --failed and journalctl -b"
    )
    return Check("systemd", False, f"{host}: systemd reports {state!r}; {hint}")


def _check_amd_gpus(host: str, raw: dict[str, Any], view: _View, expect: Expectations) -> Check:
    gpus, count = view.gpus, int(view.gpus.get("count") or 0)
    source, model = gpus.get("source") or "amd-smi", gpus.get("model")
    want = f"{expect.gpus} {expect.gpu_model or 'AMD'} GPU{'s' if expect.gpus != 1 else ''}"
    if gpus.get("vendor") == "nvidia" and count:
        problem = (
            f"the GPUs are {model} ({source}), expected {want}; put this host in a fleet for "
            "NVIDIA GPUs (pdctl fleet add --gpu MODEL)"
        )
    elif raw.get("kfd") is not True:
        problem = (
            "/dev/kfd is missing, so the amdgpu driver is not loaded; load it (modprobe amdgpu) "
            "and check dmesg | grep -i amdgpu"
        )
    elif not view.gpu_tools:
        problem = (
            "neither amd-smi nor rocm-smi is installed; install ROCm's amd-smi (amd-smi-lib) "
            "so GPUs can be counted"
        )
    elif gpus.get("source") is None:
        why = next((e for e in view.errors if "smi" in e), "no output")
        problem = (
            f"no GPU tool could list GPUs ({_clip(why, 110)}); check the amdgpu driver "
            "(dmesg | grep -i amdgpu) and the ROCm install"
        )
    elif count > expect.gpus:
        problem = (
            f"{source} lists {count} GPUs, expected {want}; a compute partition mode (CPX) or "
            "an extra card changes the count: see amd-smi list"
        )
    elif count < expect.gpus:
        problem = (
            f"{source} lists {count} GPU{'s' if count != 1 else ''}, expected {want}; find the "
            "missing one with amd-smi list and dmesg | grep -i amdgpu (a GPU that fails to "
            "initialise drops out of the list)"
        )
    elif expect.gpu_model and not model:
        problem = (
            f"could not read the GPU model (expected {expect.gpu_model}); run amd-smi static "
            "--asic to see why"
        )
    elif expect.gpu_model and expect.gpu_model.lower() not in str(model).lower():
        problem = (
            f"the GPUs are {model}, expected {expect.gpu_model}; put this host in a fleet for "
            "its GPU model or change the fleet's gpu_model"
        )
    else:
        return Check(
            "gpus", True, f"{host}: {count} x {model or 'GPU'} ({source}), /dev/kfd present"
        )
    return Check("gpus", False, f"{host}: {problem}")


def _check_nvidia_gpus(host: str, view: _View, expect: Expectations) -> Check:
    gpus, count, nvidia = view.gpus, int(view.gpus.get("count") or 0), view.nvidia
    model = gpus.get("model")
    want = f"{expect.gpus} {expect.gpu_model or 'NVIDIA'} GPU{'s' if expect.gpus != 1 else ''}"
    if nvidia is None:
        if gpus.get("vendor") == "amd" and count:
            problem = (
                f"the GPUs are {model} ({gpus.get('source')}), expected {want}; put this host in "
                "a fleet for AMD GPUs (pdctl fleet add --gpu MI300X)"
            )
        else:
            problem = (
                "nvidia-smi is not installed, so the NVIDIA driver is not either; install the "
                "driver (its utilities ship nvidia-smi) and reboot"
            )
    elif not nvidia["driver_loaded"]:
        why = next((e for e in view.errors if e.startswith("nvidia-smi")), "nvidia-smi failed")
        problem = (
            f"the NVIDIA driver is not loaded ({_clip(why, 140)}); load it (modprobe nvidia, "
            "dmesg | grep -i nvrm) or reinstall the driver for this kernel"
        )
    elif count > expect.gpus:
        problem = f"nvidia-smi lists {count} GPUs, expected {want}; see nvidia-smi -L"
    elif count < expect.gpus:
        problem = (
            f"nvidia-smi lists {count} GPU{'s' if count != 1 else ''}, expected {want}; find the "
            "missing one with nvidia-smi -L and dmesg | grep -i -e nvrm -e xid (a GPU that "
            "falls off the bus drops out of the list)"
        )
    elif expect.gpu_model and not model:
        problem = f"could not read the GPU model (expected {expect.gpu_model}); run nvidia-smi -L"
    elif expect.gpu_model and expect.gpu_model.lower() not in str(model).lower():
        problem = (
            f"the GPUs are {model}, expected {expect.gpu_model}; put this host in a fleet for "
            "its GPU model or change the fleet's gpu_model"
        )
    else:
        driver = gpus.get("driver") or "unknown"
        return Check("gpus", True, f"{host}: {count} x {model} (nvidia-smi, driver {driver})")
    return Check("gpus", False, f"{host}: {problem}")


def _check_gpus(host: str, raw: dict[str, Any], view: _View, expect: Expectations) -> Check:
    if expect.gpu_vendor == "nvidia":
        return _check_nvidia_gpus(host, view, expect)
    return _check_amd_gpus(host, raw, view, expect)


_TOOLKIT_FIX = (
    "install the NVIDIA Container Toolkit (apt install nvidia-container-toolkit, or dnf install "
    f"nvidia-container-toolkit), then {CDI_GENERATE}"
)


def _why_failed(raw: dict[str, Any], key: str) -> str:
    """A failed command's stderr, short enough for a check's message."""
    cmd = _command(raw, key)
    return _clip(_stderr_summary(cmd) if cmd else "no output", 100)


def _check_container_toolkit(host: str, raw: dict[str, Any], view: _View) -> Check:
    nvidia = view.nvidia or {}
    if not nvidia.get("ctk_installed"):
        return Check(
            "container_toolkit",
            False,
            f"{host}: nvidia-ctk is not installed, so containers cannot get the GPUs through "
            f"CDI; {_TOOLKIT_FIX}",
        )
    version = nvidia.get("ctk_version")
    if version is None:
        why = _why_failed(raw, "nvidia_ctk_version")
        return Check(
            "container_toolkit",
            False,
            f"{host}: nvidia-ctk --version failed ({why}); reinstall the NVIDIA Container Toolkit",
        )
    return Check("container_toolkit", True, f"{host}: NVIDIA Container Toolkit {version}")


def _check_cdi(host: str, raw: dict[str, Any], view: _View) -> Check:
    nvidia = view.nvidia or {}
    if not nvidia.get("ctk_installed"):
        return Check(
            "cdi",
            False,
            f"{host}: cannot list CDI devices without nvidia-ctk; fix container_toolkit first",
        )
    spec = nvidia.get("cdi_spec")
    if spec is None:
        return Check(
            "cdi",
            False,
            f"{host}: no CDI spec for the GPUs ({' and '.join(CDI_SPEC_PATHS)} are missing), so "
            f"podman cannot resolve --device nvidia.com/gpu=N; generate it: {CDI_GENERATE}",
        )
    listed = nvidia.get("cdi_devices")
    if listed is None:
        why = _why_failed(raw, "nvidia_ctk_cdi_list")
        return Check(
            "cdi",
            False,
            f"{host}: nvidia-ctk cdi list failed ({why}); regenerate the spec: {CDI_GENERATE}",
        )
    gpus = [d for d in view.gpus.get("devices") or [] if view.gpus.get("vendor") == "nvidia"]
    names = set(listed)
    missing = [
        str(d["index"]) for d in gpus if str(d["index"]) not in names or d.get("uuid") not in names
    ]
    indexes = {str(d["index"]) for d in gpus}
    stale = sorted((n for n in names if n.isdigit() and n not in indexes), key=int)
    if missing or stale:
        parts = []
        if missing:
            parts.append(f"does not list GPU {_named_list(missing)} (by index and UUID)")
        if stale:
            parts.append(f"lists GPU {_named_list(stale)} that nvidia-smi does not show")
        return Check(
            "cdi",
            False,
            f"{host}: the CDI spec {spec} {' and '.join(parts)}; regenerate it after every "
            f"driver or GPU change: {CDI_GENERATE}",
        )
    return Check(
        "cdi",
        True,
        f"{host}: CDI spec {spec} lists all {len(gpus)} GPUs (nvidia.com/gpu=0..{len(gpus) - 1})"
        if gpus
        else f"{host}: CDI spec {spec} present",
    )


def _present(view: _View) -> list[str]:
    names = list(view.listed or [])
    names += [dev.name for dev in view.devinfo or [] if dev.name not in names]
    return names


def _check_rdma_devices(host: str, raw: dict[str, Any], view: _View, expect: Expectations) -> Check:
    expected = _expected_nics(expect)
    if not expected:
        return Check("rdma_devices", True, f"{host}: no RDMA NIC expected")
    cmd = _command(raw, "ibv_devices")
    if not _installed(cmd):
        return Check(
            "rdma_devices",
            False,
            f"{host}: ibv_devices is not installed; install rdma-core's tools "
            "(apt install ibverbs-utils, or dnf install libibverbs-utils)",
        )
    if view.listed is None and cmd is not None:
        why = next((e for e in view.errors if e.startswith("ibv_devices")), _stderr_summary(cmd))
        return Check(
            "rdma_devices",
            False,
            f"{host}: {_clip(why, 140)}; load the RDMA stack (modprobe {_driver(expect)} "
            f"ib_uverbs) and check dmesg | grep {_driver(expect).split('_')[0]}",
        )
    mine = _fleet_nics(view, expect)
    if mine[: len(expected)] == expected:
        return Check("rdma_devices", True, f"{host}: ibv_devices lists {_nic_range(expect)}")
    if len(mine) >= expect.nics:
        return Check(
            "rdma_devices",
            True,
            f"{host}: ibv_devices lists {len(mine)} {_driver(expect)} devices "
            f"({_named_list(mine, 16)})",
        )
    listed = set(mine)
    missing = [name for name in expected if name not in listed][: expect.nics - len(mine)]
    others = sorted(
        {d for d in (view.nic_driver(n) for n in _present(view)) if d and d != expect.nic_driver}
    )
    if _relevant_warnings(view, expect):
        fix = (
            f"libibverbs could not load its {_provider_stem(expect.provider_lib)} provider "
            "library, so no device shows: fix provider_lib first"
        )
    else:
        fix = (
            f"check that the {_driver(expect)} driver is loaded and the NIC is cabled "
            f"(ibv_devices, dmesg | grep {_driver(expect).split('_')[0]})"
        )
    if others:
        fix += (
            f"; this host has {_named_list(others)} devices instead: if that is right, set the "
            f"fleet's NIC driver (pdctl fleet add ... --nic-driver {others[0]})"
        )
    return Check(
        "rdma_devices",
        False,
        f"{host}: ibv_devices does not list {_named_list(missing, 16)} "
        f"(expected {_nic_range(expect)}); {fix}",
    )


def _port_problem(view: _View, name: str, link_layer: str) -> tuple[str, str, str] | None:
    device = next((dev for dev in view.devinfo or [] if dev.name == name), None)
    if device is None:
        return name, "is missing from ibv_devinfo", ""
    port = device.port(1)
    if port is None:
        return name, "has no port 1 in ibv_devinfo", ""
    if port.state != "PORT_ACTIVE":
        return name, f"port 1 is {port.state} ({port.state_code})", ""
    want = _LINK_LAYER_NAMES[link_layer]
    if port.link_layer != want:
        layer = port.link_layer or "not shown"
        return name, f"port 1 link_layer is {layer}, expected {want}", ""
    if link_layer == "ib" and not port.lid:
        return name, "port 1 has no LID (port_lid 0)", ""
    return None


def _check_rdma_ports(host: str, raw: dict[str, Any], view: _View, expect: Expectations) -> Check:
    names = _fleet_nics(view, expect)
    if not _expected_nics(expect):
        return Check("rdma_ports", True, f"{host}: no RDMA NIC expected")
    cmd = _command(raw, "ibv_devinfo")
    if not _installed(cmd):
        return Check(
            "rdma_ports",
            False,
            f"{host}: ibv_devinfo is not installed; install rdma-core's tools "
            "(apt install ibverbs-utils, or dnf install libibverbs-utils)",
        )
    if not names:
        return Check(
            "rdma_ports",
            False,
            f"{host}: no {_driver(expect)} device to check ports on; fix rdma_devices first",
        )
    if view.devinfo is None and cmd is not None:
        why = next((e for e in view.errors if e.startswith("ibv_devinfo")), _stderr_summary(cmd))
        return Check(
            "rdma_ports",
            False,
            f"{host}: cannot read port states: {_clip(why, 150)}; run ibv_devinfo -v to see why",
        )
    layer = _LINK_LAYER_NAMES[expect.link_layer]
    problems = [p for p in (_port_problem(view, n, expect.link_layer) for n in names) if p]
    if not problems:
        lids = ", LID assigned" if expect.link_layer == "ib" else ""
        return Check(
            "rdma_ports",
            True,
            f"{host}: port 1 is PORT_ACTIVE ({layer}{lids}) on {len(names)} {_driver(expect)} "
            "devices",
        )
    fix = "bring the links up (cables, switch ports, ip link; ibv_devinfo -d DEV)"
    if any("link_layer" in issue for _, issue, _ in problems):
        fix = (
            f"the fleet expects {layer}: set the fleet's link layer (pdctl fleet add ... "
            "--link-layer ib|eth) or switch the port's mode (mlxconfig LINK_TYPE_P1)"
        )
    elif any("LID" in issue for _, issue, _ in problems):
        fix = (
            "an InfiniBand port gets its LID from the subnet manager: run one (opensm) or "
            "check the switch's SM (sminfo, ibstat)"
        )
    return Check("rdma_ports", False, f"{host}: {_grouped(problems)}; {fix}")


_PROVIDER_FIX = (
    "install rdma-core's provider libraries (apt install ibverbs-providers, or dnf install "
    "libibverbs)"
)


def _provider_label(expect: Expectations) -> str:
    if expect.nic_driver == "bnxt_re":
        return "Broadcom's RoCE provider library"
    return f"the {expect.nic_driver} provider library"


def _check_provider_lib(host: str, raw: dict[str, Any], view: _View, expect: Expectations) -> Check:
    provider = _dict(raw.get("provider_lib"))
    path = str(provider.get("path") or expect.provider_lib)
    if _provider_stem(path) != expect.nic_driver:
        return _check_provider_glob(host, view, expect)
    soname = Path(path).name
    exists = provider.get("exists") is True
    relevant = _relevant_warnings(view, expect)
    if relevant:
        detail = _clip(_warning_detail(relevant[0]), 90)
        fix = (
            f"{path} is missing: install {_provider_label(expect)} ({soname}) there"
            if not exists
            else f"{path} exists but does not suit this libibverbs/kernel: install the matching one"
        )
        return Check(
            "provider_lib", False, f"{host}: libibverbs could not load {soname}: {detail}; {fix}"
        )
    if not exists:
        elsewhere = [str(p) for p in provider.get("elsewhere") or []]
        elsewhere += [p for p in view.provider_libs.get(expect.nic_driver, []) if p != path]
        fix = (
            f"it is at {elsewhere[0]}: set provider_lib to that path"
            if elsewhere
            else f"install {_provider_label(expect)} ({soname}) there"
        )
        return Check(
            "provider_lib",
            False,
            f"{host}: {soname} not found at {path} (the worker containers bind-mount it from "
            f"there); {fix}",
        )
    return Check("provider_lib", True, f"{host}: {soname} present at {path}")


def _check_provider_glob(host: str, view: _View, expect: Expectations) -> Check:
    """The fleet's provider by glob in every provider directory (no path configured for it)."""
    pattern = f"lib{expect.nic_driver}-rdmav*.so"
    relevant = _relevant_warnings(view, expect)
    found = view.provider_libs.get(expect.nic_driver, [])
    if relevant:
        detail = _clip(_warning_detail(relevant[0]), 90)
        return Check(
            "provider_lib",
            False,
            f"{host}: libibverbs could not load its {expect.nic_driver} provider: {detail}; "
            f"{_PROVIDER_FIX}",
        )
    if not found:
        return Check(
            "provider_lib",
            False,
            f"{host}: no {pattern} in {' or '.join(PROVIDER_DIRS[:2])} (libibverbs' "
            f"{expect.nic_driver} provider, without which no device shows); {_PROVIDER_FIX}",
        )
    return Check("provider_lib", True, f"{host}: {Path(found[0]).name} present at {found[0]}")


def _gid_problem(view: _View, name: str, index: int) -> tuple[str, str, str] | None:
    device = next((dev for dev in view.devinfo or [] if dev.name == name), None)
    port = device.port(1) if device else None
    if port is None:
        return None
    gid = port.gid(index)
    if gid is None:
        shown = ", ".join(str(g.index) for g in port.gids[:6]) or "none"
        return name, f"has no GID[{index}]", f"(indexes shown: {shown})"
    if gid.kind != "RoCE v2":
        return name, f"GID[{index}] is {gid.kind or 'untyped'}", f"({_clip(gid.address, 40)})"
    return None


def _check_roce_gid(host: str, view: _View, expect: Expectations) -> Check:
    active = []
    for name in _fleet_nics(view, expect):
        device = next((dev for dev in view.devinfo or [] if dev.name == name), None)
        port = device.port(1) if device else None
        if port is not None and port.state == "PORT_ACTIVE":
            active.append(name)
    if not _expected_nics(expect):
        return Check("roce_gid", True, f"{host}: no RDMA NIC expected")
    if expect.link_layer == "ib":
        return Check(
            "roce_gid",
            True,
            f"{host}: InfiniBand fabric: ports are addressed by LID (rdma_ports), no RoCE GID",
            skipped=True,
        )
    if not active:
        return Check(
            "roce_gid",
            False,
            f"{host}: no active {_driver(expect)} port to read GID[{expect.gid_index}] from "
            f"(MC_GID_INDEX); fix rdma_devices/rdma_ports first",
        )
    problems = [p for p in (_gid_problem(view, name, expect.gid_index) for name in active) if p]
    if not problems:
        return Check(
            "roce_gid",
            True,
            f"{host}: GID[{expect.gid_index}] is RoCE v2 on {len(active)} active ports "
            f"(MC_GID_INDEX={expect.gid_index})",
        )
    return Check(
        "roce_gid",
        False,
        f"{host}: {_grouped(problems)}; RoCE v2 GIDs appear once the NIC's netdev has an "
        f"IP address: assign one, or set MC_GID_INDEX to a RoCE v2 index (ibv_devinfo -v)",
    )


def _check_perftest(host: str, raw: dict[str, Any]) -> Check:
    tools = raw.get("tools")
    if not isinstance(tools, dict):
        return Check("perftest", False, f"{host}: perftest was not probed (re-run the check)")
    missing = [name for name in PERFTEST_TOOLS if not tools.get(name)]
    if missing:
        return Check(
            "perftest",
            False,
            f"{host}: {' and '.join(missing)} not found (perftest, which `pdctl fleet check "
            "--fabric` runs between hosts); install the package perftest (apt install perftest; "
            "dnf install perftest)",
        )
    return Check("perftest", True, f"{host}: perftest's ib_write_bw and ib_write_lat present")


def _check_runtime(host: str, view: _View) -> Check:
    name, version = view.runtime.get("name"), view.runtime.get("version")
    if not name:
        return Check(
            "runtime",
            False,
            f"{host}: no container runtime: neither podman nor docker is installed; install one "
            "(apt install podman)",
        )
    if not view.runtime.get("usable"):
        start = "systemctl start docker" if name == "docker" else "podman info"
        return Check(
            "runtime",
            False,
            f"{host}: {name} {version} is installed but `{name} info` failed "
            f"({_clip(view.runtime_error or '', 110)}); fix it ({start})",
        )
    return Check("runtime", True, f"{host}: {name} {version} works (`{name} info` succeeds)")


def _memlock_fix(runtime: str, cap_sys_resource: object) -> str:
    if cap_sys_resource is False:
        return (
            "raise RLIMIT_MEMLOCK to unlimited where this host is made (e.g. `--ulimit "
            "memlock=-1:-1`, nspawn `--rlimit=RLIMIT_MEMLOCK=infinity`) or grant it "
            "CAP_SYS_RESOURCE"
        )
    if runtime == "docker":
        return "LimitMEMLOCK=infinity in a drop-in for docker.service and containerd.service"
    return "DefaultLimitMEMLOCK=infinity in /etc/systemd/system.conf (podman runs in pdctl's units)"


def _check_memlock(host: str, raw: dict[str, Any], view: _View) -> Check:
    memlock = _dict(raw.get("memlock"))
    if "unlimited" not in memlock:
        return Check("memlock", False, f"{host}: memlock was not probed (re-run the check)")
    if memlock["unlimited"] is True:
        return Check(
            "memlock",
            True,
            f"{host}: root can set memlock unlimited (the workers' --ulimit memlock=-1:-1, RDMA)",
        )
    hard = memlock.get("hard")
    limit = "unlimited" if hard is None else f"{hard} bytes"
    cap = memlock.get("cap_sys_resource")
    why = (
        f"no CAP_SYS_RESOURCE here (a container or sandbox host) and the hard limit is {limit}"
        if cap is False
        else f"setrlimit failed ({memlock.get('error') or 'no error text'}), hard limit {limit}"
    )
    if view.runtime.get("clamps_rlimits"):
        return Check(
            "memlock",
            True,
            f"{host}: memlock unlimited emulated: {why}; the OCI runtime "
            f"{view.runtime.get('oci_runtime') or ''} lowers containers' rlimits to what the host "
            f"grants, so workers run with memlock {limit}",
            emulated=True,
        )
    if memlock.get("euid") != 0:
        return Check(
            "memlock",
            False,
            f"{host}: memlock not checked: the probe ran as uid {memlock.get('euid')}, not root "
            "(fix sudo first)",
        )
    runtime = str(view.runtime.get("name") or "the container runtime")
    return Check(
        "memlock",
        False,
        f"{host}: {runtime} cannot give the workers memlock unlimited (--ulimit memlock=-1:-1, "
        f"for RDMA): {why}; fix: {_memlock_fix(runtime, cap)}; or, without RDMA, set "
        "`pdctl: {memlock: inherit}` in the spec",
    )


def _check_disk(host: str, raw: dict[str, Any], expect: Expectations) -> Check:
    storage = _dict(raw.get("storage"))
    path, free = storage.get("path"), _gb(storage.get("free_bytes"))
    if not path:
        tried = ", ".join(str(p) for p in storage.get("candidates") or []) or "no path given"
        return Check(
            "disk",
            False,
            f"{host}: none of the container storage paths exist ({_clip(tried, 120)}); create it "
            "or configure the storage path",
        )
    if free is None:
        why = storage.get("error") or "unknown error"
        return Check("disk", False, f"{host}: cannot read free space on {path} ({why})")
    if free < expect.min_disk_gb:
        return Check(
            "disk",
            False,
            f"{host}: only {free:.1f} GB free on {path}, need {expect.min_disk_gb:g} GB for worker "
            "images; free space or move container storage to a larger disk",
        )
    return Check(
        "disk", True, f"{host}: {free:.1f} GB free on {path} (need {expect.min_disk_gb:g})"
    )


def _check_mesh(host: str, raw: dict[str, Any]) -> Check:
    reach = [r for r in raw.get("reach") or [] if isinstance(r, dict)]
    if not reach:
        return Check("mesh", True, f"{host}: no peers to check")
    bad = [
        f"{r.get('address')}:{r.get('port')} ({_clip(str(r.get('error') or 'unreachable'), 60)})"
        for r in reach
        if r.get("ok") is not True
    ]
    if not bad:
        return Check("mesh", True, f"{host}: reached all {len(reach)} peers")
    return Check(
        "mesh",
        False,
        f"{host}: cannot reach {_named_list(bad, 4)}; open these ports between the hosts "
        "(firewall, routes) and check the peers are up",
    )


def _resolve(expect: Expectations, view: _View) -> Expectations:
    """A mixed fleet's expectations for one host: its vendor (nvidia-smi installed or not),
    its NICs' driver (the most common among its devices) and their ports' link layer."""
    vendor, driver, layer = expect.gpu_vendor, expect.nic_driver, expect.link_layer
    if vendor == "any":
        vendor = "nvidia" if view.nvidia is not None else "amd"
    if driver == AUTO_NIC_DRIVER:
        found = [d for d in (view.nic_driver(n) for n in _present(view)) if d]
        driver = max(sorted(set(found)), key=found.count) if found else USUAL_NIC_DRIVER[vendor]
    resolved = replace(expect, gpu_vendor=vendor, nic_driver=driver)
    if layer == "auto":
        ports = [
            port.link_layer
            for device in view.devinfo or []
            if device.name in _fleet_nics(view, resolved)
            for port in device.ports[:1]
        ]
        layer = "ib" if ports and set(ports) == {"InfiniBand"} else "eth"
    return replace(resolved, link_layer=layer)


def evaluate(host: str, raw: dict[str, Any], expect: Expectations) -> list[Check]:
    """The preflight checks, in CHECK_NAMES order. Never raises on odd observations."""
    raw = _dict(raw)
    view = _view(raw)
    try:
        expect = _resolve(expect, view)
    except Exception:  # odd observations: the checks below say what is wrong
        expect = replace(
            expect,
            gpu_vendor="amd" if expect.gpu_vendor == "any" else expect.gpu_vendor,
            nic_driver="bnxt_re" if expect.nic_driver == AUTO_NIC_DRIVER else expect.nic_driver,
            link_layer="eth" if expect.link_layer == "auto" else expect.link_layer,
        )
    builders: dict[str, Callable[[], Check]] = {
        "systemd": lambda: _check_systemd(host, raw),
        "gpus": lambda: _check_gpus(host, raw, view, expect),
        "container_toolkit": lambda: _check_container_toolkit(host, raw, view),
        "cdi": lambda: _check_cdi(host, raw, view),
        "rdma_devices": lambda: _check_rdma_devices(host, raw, view, expect),
        "rdma_ports": lambda: _check_rdma_ports(host, raw, view, expect),
        "provider_lib": lambda: _check_provider_lib(host, raw, view, expect),
        "roce_gid": lambda: _check_roce_gid(host, view, expect),
        "perftest": lambda: _check_perftest(host, raw),
        "runtime": lambda: _check_runtime(host, view),
        "memlock": lambda: _check_memlock(host, raw, view),
        "disk": lambda: _check_disk(host, raw, expect),
        "mesh": lambda: _check_mesh(host, raw),
    }
    checks = []
    for name in CHECK_NAMES:
        if expect.gpu_vendor != "nvidia" and name in NVIDIA_ONLY_CHECKS:
            # Not a skipped check: on an AMD fleet there is nothing of the kind to have.
            message = f"{host}: AMD fleet: ROCm devices reach containers directly, no CDI needed"
            checks.append(Check(name, True, message))
            continue
        if expect.kind == "cpu" and name in GPU_ONLY_CHECKS | NVIDIA_ONLY_CHECKS:
            checks.append(Check(name, True, CPU_SKIP_MESSAGE, skipped=True))
            continue
        try:
            checks.append(builders[name]())
        except Exception as exc:  # a check that cannot judge says so instead of raising
            checks.append(Check(name, False, f"{host}: could not evaluate {name}: {exc}"))
    return checks


# --------------------------------------------------------------------------- script entry


def _request(text: str) -> dict[str, Any]:
    data = json.loads(text) if text.strip() else {}
    if not isinstance(data, dict):
        raise ValueError("the input must be a JSON object")
    unknown = sorted(set(data) - {"provider_lib", "storage_paths", "peers", "timeout"})
    if unknown:
        raise ValueError(f"unknown input keys: {', '.join(unknown)}")
    provider_lib = data.get("provider_lib", DEFAULT_PROVIDER_LIB)
    storage_paths = data.get("storage_paths", list(DEFAULT_STORAGE_PATHS))
    peers = data.get("peers", [])
    timeout = data.get("timeout", 20.0)
    if not isinstance(provider_lib, str):
        raise ValueError("provider_lib must be a string")
    if not isinstance(storage_paths, list) or not all(isinstance(p, str) for p in storage_paths):
        raise ValueError("storage_paths must be a list of strings")
    if not isinstance(peers, list):
        raise ValueError("peers must be a list of [address, port]")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError("timeout must be a positive number")
    return {
        "provider_lib": provider_lib,
        "storage_paths": storage_paths,
        "peers": [tuple(p) if isinstance(p, list) else p for p in peers],
        "timeout": float(timeout),
    }


def main() -> int:
    """Print collect()'s JSON for the request in $PD_HARDWARE_INPUT (else stdin, else defaults).

    Meant for ``ssh HOST python3 - < hardware.py`` with the request in the
    environment, since stdin carries the source. Stdin is read only when the
    module runs as a file (``python3 hardware.py < request.json``): under
    ``python3 -`` or ``python3 -c`` it is the source or an SSH channel that may
    never close. Exit 2 on a bad request.
    """
    text = os.environ.get(INPUT_ENV)
    from_file = bool(sys.argv) and sys.argv[0] not in ("", "-", "-c")
    if text is None:
        readable = from_file and sys.stdin is not None and not sys.stdin.isatty()
        text = sys.stdin.read() if readable else ""
    try:
        request = _request(text)
    except ValueError as exc:
        sys.stdout.write(json.dumps({"error": f"{INPUT_ENV}: {exc}"}) + "\n")
        return 2
    sys.stdout.write(json.dumps(collect(**request)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
