"""Runs ON the host: observe it, and print what was seen (a Raw document, documents.py).

``collect()`` runs the hardware tools (``ibv_devices``, ``ibv_devinfo -v``, ``nvidia-smi`` and
``nvidia-ctk`` or ``amd-smi``/``rocm-smi``, ``podman``/``docker``, ``systemctl``) concurrently,
reads a few files and the PCI topology in sysfs, tries the rlimit the workers need and probes
TCP peers. It never raises: a missing program is rc 127, a hung one rc 124.

As an entry (``python3 -m pdctl.onhost.hardware.collect``, shipped by pdctl/onhost/bundle.py):
one JSON request on stdin (provider_lib, storage_paths, peers, timeout), collect()'s JSON on
stdout; exit 2 on a bad request.
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
from pathlib import Path
from typing import Any

from pdctl.onhost.hardware.amd import parse_amd_smi_list
from pdctl.onhost.hardware.documents import (
    COMMAND_ORDER,
    PERFTEST_TOOLS,
    RC_NOT_EXECUTABLE,
    RC_NOT_FOUND,
    RC_TIMEOUT,
    RUNTIMES,
    SCHEMA,
    Raw,
    Reach,
)
from pdctl.onhost.hardware.nvidia import NVIDIA_QUERY_FIELDS, parse_nvidia_smi_query
from pdctl.onhost.hardware.parsing import ParseError, clip, unique
from pdctl.onhost.hardware.paths import (
    CDI_SPEC_PATHS,
    DEFAULT_PROVIDER_LIB,
    DEFAULT_STORAGE_PATHS,
    PROVIDER_DIRS,
)
from pdctl.onhost.hardware.pci import normalize_bdf

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

NVIDIA_DEV_DIR = "/dev"

NVIDIA_DEV_GLOB = "nvidia*"

SYSTEMD_RUN_DIR = "/run/systemd/system"  # exists iff systemd is PID 1 (sd_booted(3))

MAX_OUTPUT = 1_000_000  # characters kept of one stream

COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ibv_devices", ("ibv_devices",)),
    ("ibv_devinfo", ("ibv_devinfo", "-v")),
    ("amd_smi_static", ("amd-smi", "static", "--asic", "--json")),
    ("podman_version", ("podman", "--version")),
    ("docker_version", ("docker", "--version")),
    ("systemctl", ("systemctl", "is-system-running")),
)

AMD_SMI_LIST = ("amd-smi", "list", "--json")

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

RUNTIME_INFO = {
    "podman": ("podman", "info", "--format", "json"),
    "docker": ("docker", "info", "--format", "{{json .}}"),
}


def _decode(data: bytes | None) -> str:
    text = (data or b"").decode("utf-8", errors="replace")
    return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + "\n[output truncated]\n"


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
    return unique(bdf for bdf in found if bdf)


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
        "error": clip(errors[-1], 100) if tried["rc"] and errors else None,
    }


def _safe(fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except Exception:  # a fact we cannot read must not cost the others
        return default


def probe_peer(address: str, port: int, timeout: float | None = None) -> Reach:
    """Whether address is reachable: a TCP connect to port is accepted or refused in time."""
    timeout = CONNECT_TIMEOUT if timeout is None else timeout
    entry: Reach = {"address": address, "port": port, "ok": False, "error": None}
    try:
        with socket.create_connection((address, port), timeout=timeout):
            entry["ok"] = True
    except ConnectionRefusedError:
        # The peer answered (a reset): the network path between the hosts works, which is
        # what the mesh is about; a closed port there is that service's own business.
        entry["ok"] = True
        entry["refused"] = True
    except (TimeoutError, socket.timeout):  # distinct classes before Python 3.10
        entry["error"] = f"timed out after {timeout:g} s"
    except socket.gaierror as exc:
        entry["error"] = f"cannot resolve {address}: {exc.strerror or exc}"
    except OSError as exc:
        entry["error"] = exc.strerror or str(exc)
    except (ValueError, TypeError, OverflowError) as exc:
        entry["error"] = f"invalid peer: {exc}"
    return entry


def _peer_job(peer: object) -> Callable[[], Reach]:
    if (
        isinstance(peer, (list, tuple))
        and len(peer) == 2
        and isinstance(peer[0], str)
        and isinstance(peer[1], int)
        and not isinstance(peer[1], bool)
    ):
        address, port = peer[0], peer[1]
        return lambda: probe_peer(address, port)
    bad: Reach = {"address": str(peer), "port": None, "ok": False, "error": "invalid peer"}
    return lambda: bad


def collect(
    provider_lib: str,
    storage_paths: list[str],
    peers: list[tuple[str, int]],
    timeout: float = 20.0,
) -> Raw:
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
        # Read while the tools run.
        hostname = _safe(socket.gethostname, "")
        os_release = _safe(_read_os_release, {"pretty_name": "", "id": "", "version_id": ""})
        kernel = _safe(platform.release, "")
        cpus = _safe(os.cpu_count, None)
        memory_bytes = _safe(_memory_bytes, None)
        storage = _safe(lambda: _storage(list(storage_paths or [])), {"path": None})
        kfd = _safe(lambda: Path(KFD_PATH).exists(), False)
        render_nodes = _safe(_render_nodes, [])
        provider = _safe(lambda: _provider(provider_lib), {"path": provider_lib})
        systemd = _safe(lambda: Path(SYSTEMD_RUN_DIR).is_dir(), False)
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
        reach = [future.result() for future in peer_futures]
    return {
        "schema": SCHEMA,
        "hostname": hostname,
        "os": os_release,
        "kernel": kernel,
        "cpus": cpus,
        "memory_bytes": memory_bytes,
        "storage": storage,
        "kfd": kfd,
        "render_nodes": render_nodes,
        "provider_lib": provider,
        "systemd": systemd,
        "python": platform.python_version(),
        "commands": {key: done[key] for key in COMMAND_ORDER if key in done},
        "memlock": done["memlock"],
        "reach": reach,
        "sysfs": _safe(lambda: _sysfs(_gpu_bdfs(done)), {"pci": {}, "infiniband": {}}),
        "provider_libs": _safe(_provider_libs, {}),
        "nvidia_files": _safe(_nvidia_files, {"cdi_specs": [], "device_nodes": []}),
        "tools": {name: shutil.which(name, path=search_path) for name in PERFTEST_TOOLS},
        "elapsed_s": round(time.monotonic() - started, 3),
    }


REQUEST_KEYS = ("provider_lib", "storage_paths", "peers", "timeout")


def read_request(data: object) -> dict[str, Any]:
    """collect()'s keyword arguments from a JSON request (absent keys: the defaults);
    ValueError says what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("the request must be a JSON object")
    unknown = sorted(set(data) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"unknown request keys: {', '.join(unknown)}")
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
    """Print collect()'s JSON for the JSON request on stdin (nothing: the defaults).

    Exit 2, with {"error": ...}, on a bad request.
    """
    text = sys.stdin.read() if sys.stdin is not None else ""
    try:
        request = read_request(json.loads(text) if text.strip() else {})
    except ValueError as exc:
        sys.stdout.write(json.dumps({"error": f"the request: {exc}"}) + "\n")
        return 2
    sys.stdout.write(json.dumps(collect(**request)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
