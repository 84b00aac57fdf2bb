"""Host facts in the shape pdctl/onhost/hardware/facts.py's facts() stores them (CONTRACT: issue
14),
built
for tests: 8 GPUs and 8 NICs where GPU k and NIC k share a PCIe switch, GPUs and NICs 0-3 on
NUMA node 0 and 4-7 on node 1 (the lab's hosts, and a DGX-like server)."""

from __future__ import annotations

from typing import Any

MI300X_MIB = 196592  # amd-smi's VRAM total of an MI300X (192 GB)
H200_MIB = 143771  # nvidia-smi's memory.total of an H200
H100_MIB = 81559


def _paths(k: int) -> tuple[list[str], list[str]]:
    """GPU k's and NIC k's pci_path: one root port per pair, on the pair's NUMA node's root
    complex, then the pair's PCIe switch (upstream port, one downstream port each)."""
    root_bus = 0x00 if k < 4 else 0x80
    root = f"0000:{root_bus:02x}:{k % 4 + 1:02x}.0"
    switch_bus = root_bus + 0x10 * (k % 4 + 1)
    upstream = f"0000:{switch_bus:02x}:00.0"
    gpu = [root, upstream, f"0000:{switch_bus + 1:02x}:00.0", f"0000:{switch_bus + 2:02x}:00.0"]
    nic = [root, upstream, f"0000:{switch_bus + 1:02x}:01.0", f"0000:{switch_bus + 3:02x}:00.0"]
    return gpu, nic


def gpu_devices(count: int = 8, memory_mib: int | None = None) -> list[dict[str, Any]]:
    return [
        {
            "index": k,
            "pci": _paths(k)[0][-1],
            "numa": 0 if k < 4 else 1,
            "memory_mib": memory_mib,
            "uuid": None,
            "pci_path": _paths(k)[0],
        }
        for k in range(count)
    ]


def nic_devices(prefix: str, driver: str, count: int = 8) -> list[dict[str, Any]]:
    return [
        {
            "name": f"{prefix}{k}",
            "ports": [{"port": 1, "state": "PORT_ACTIVE", "link_layer": "InfiniBand", "gids": []}],
            "driver": driver,
            "pci": _paths(k)[1][-1],
            "numa": 0 if k < 4 else 1,
            "pci_path": _paths(k)[1],
        }
        for k in range(count)
    ]


def nvidia_facts(model: str = "H200", memory_mib: int = H200_MIB, gpus: int = 8) -> dict[str, Any]:
    return {
        "cpus": 224,
        "memory_gb": 2048.0,
        "gpus": {
            "count": gpus,
            "model": model,
            "vendor": "nvidia",
            "memory_mib": memory_mib,
            "driver": "570.211.01",
            "source": "nvidia-smi",
            "bdfs": [d["pci"] for d in gpu_devices(gpus)],
            "devices": gpu_devices(gpus, memory_mib),
        },
        "kfd": False,
        "render_nodes": 0,
        "rdma": {
            "devices": nic_devices("mlx5_", "mlx5"),
            "provider_libs": {"mlx5": "/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav34.so"},
            "provider_lib": True,
            "warnings": [],
        },
        "nvidia": {
            "driver_loaded": True,
            "ctk_version": "1.18.0",
            "cdi_devices": [*(str(k) for k in range(gpus)), "all"],
            "cdi_spec": "/etc/cdi/nvidia.yaml",
        },
    }


def amd_facts(model: str = "MI300X", gpus: int = 8) -> dict[str, Any]:
    return {
        "cpus": 192,
        "memory_gb": 2048.0,
        "gpus": {
            "count": gpus,
            "model": model,
            "vendor": "amd",
            "memory_mib": MI300X_MIB,
            "driver": None,
            "source": "amd-smi",
            "bdfs": [d["pci"] for d in gpu_devices(gpus)],
            "devices": gpu_devices(gpus, MI300X_MIB),
        },
        "kfd": True,
        "render_nodes": gpus,
        "rdma": {
            "devices": nic_devices("bnxt_re", "bnxt_re"),
            "provider_libs": {"bnxt_re": "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"},
            "provider_lib": True,
            "warnings": [],
        },
        "nvidia": None,
    }
