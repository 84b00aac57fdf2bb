"""What an engine finds of its host's hardware at start, as libibverbs, CUDA and HIP would
(standard library only): the RDMA provider library, the slot's GPUs, its RDMA devices."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

DEFAULT_PROVIDER_LIB = "/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so"
PROVIDER_DIRS = ("/usr/lib/x86_64-linux-gnu/libibverbs", "/usr/lib64/libibverbs")
DEV = Path("/dev")
# Where the lab mounts its fake verbs tools into containers (real engine images ship
# ibverbs-utils; the stand-in asks ibv_devices what libibverbs would enumerate).
LAB_TOOLS = "/opt/pdctl-lab/bin"
RENDER_MINOR_BASE = 128


def missing_provider(env: Mapping[str, str]) -> str | None:
    """The provider library libibverbs would fail to load (its file name), or None when the
    host's library is mounted where libibverbs looks (``PDFAKE_PROVIDER_LIB`` overrides)."""
    override = env.get("PDFAKE_PROVIDER_LIB")
    if override:
        return None if Path(override).exists() else Path(override).name
    # As libibverbs: any provider in its directories serves its NIC (a ROCm image gets
    # the host's mounted; CUDA images carry libmlx5 themselves).
    if any(sorted(Path(d).glob("lib*-rdmav*.so")) for d in PROVIDER_DIRS):
        return None
    return Path(DEFAULT_PROVIDER_LIB).name


def verbs_warning(name: str) -> str:
    """What real libibverbs prints (raw, on stderr) when a provider library is missing."""
    return (
        f"libibverbs: Warning: couldn't load driver '{name}': {name}: "
        "cannot open shared object file: No such file or directory"
    )


def _gpu_ids(text: str) -> list[int] | None:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return sorted(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def _visible_gpus(dev: Path) -> tuple[str, set[int]]:
    """('nvidia', /dev/nvidiaN numbers) when the NVIDIA control node is there, else ('amd',
    renderD<128+N> numbers): the GPUs this container can open."""
    if (dev / "nvidiactl").exists():
        found = {int(p.name[6:]) for p in dev.glob("nvidia*") if p.name[6:].isdigit()}
        return "nvidia", found
    found = {
        int(p.name[7:]) - RENDER_MINOR_BASE
        for p in (dev / "dri").glob("renderD*")
        if p.name[7:].isdigit()
    }
    return "amd", found


def gpu_failure(env: Mapping[str, str], dev: Path = DEV) -> str | None:
    """What CUDA/HIP would make of a container that lacks its slot's GPUs (PDCTL_GPU_IDS), or,
    on NVIDIA, holds others' (CDI hands a container exactly the GPUs it names)."""
    raw = env.get("PDCTL_GPU_IDS")
    if raw is None:
        return None
    wanted = _gpu_ids(raw)
    if wanted is None:
        return f"PDCTL_GPU_IDS={raw!r} is not a comma-separated list of GPU ids"
    vendor, seen = _visible_gpus(dev)
    node = "/dev/nvidia{}" if vendor == "nvidia" else "/dev/dri/renderD{}"
    offset = 0 if vendor == "nvidia" else RENDER_MINOR_BASE
    missing = [g for g in wanted if g not in seen]
    if missing:
        names = ", ".join(node.format(g + offset) for g in missing)
        runtime = "CUDA" if vendor == "nvidia" else "HIP"
        return (
            f"RuntimeError: {runtime} error: invalid device ordinal: this worker's GPUs "
            f"{raw} need {names}, which the container does not have ({len(seen)} GPU(s) "
            "visible); pass them to the container"
            + (" (--device nvidia.com/gpu=N, CDI)" if vendor == "nvidia" else "")
        )
    extra = sorted(seen - set(wanted))
    if vendor == "nvidia" and extra:
        names = ", ".join(node.format(g) for g in extra)
        return (
            f"RuntimeError: the container sees GPUs outside its slot ({names}; slot GPUs "
            f"{raw}): another worker's GPUs would be shared; give it only its own CDI devices"
        )
    return None


def nic_failure(env: Mapping[str, str]) -> str | None:
    """Every RDMA device of PDCTL_RDMA_DEVICES must be one libibverbs lists (ibv_devices)."""
    wanted = [d.strip() for d in (env.get("PDCTL_RDMA_DEVICES") or "").split(",") if d.strip()]
    if not wanted:
        return None
    path = os.pathsep.join([env.get("PATH") or "/usr/bin:/bin", LAB_TOOLS])
    tool = shutil.which("ibv_devices", path=path)
    if tool is None:
        return "no RDMA device found: ibv_devices is not installed in the image"
    proc = subprocess.run([tool], capture_output=True, text=True, timeout=20, check=False)
    listed = {
        line.split()[0]
        for line in proc.stdout.splitlines()[2:]
        if line.strip() and not line.strip().startswith("-")
    }
    missing = [d for d in wanted if d not in listed]
    if not missing:
        return None
    return (
        f"RuntimeError: Failed to open RDMA device(s) {', '.join(missing)} (ibv_get_device_list "
        f"lists {', '.join(sorted(listed)) or 'none'}): check PDCTL_RDMA_DEVICES and that the "
        "container has /dev/infiniband and the NIC's provider library"
    )
