"""Which RDMA NICs are nearest a slot's GPUs, from the host's PCI topology. PURE.

A worker's KV cache leaves over RDMA. Handing every worker all of a host's NICs (as the
seeds do) makes each worker's traffic cross the CPU's root complex, or the inter-socket
link, to reach NICs that sit behind other GPUs' PCIe switches. Each GPU of a GPU server
has its own NIC on its own PCIe switch (`nvidia-smi topo -m` calls the pair PIX or PXB);
this module finds those pairs from the facts every host reports: each device's pci_path
(the chain of PCI addresses from the root port down to it, from sysfs) and its NUMA node.

Nearness: the longer the common prefix of two pci_paths, the nearer (behind one switch:
a long prefix); ties go to the same NUMA node, then to the NIC's name and the GPU's index.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdctl.core.fleet_model import natural_key


@dataclass(frozen=True)
class GpuDevice:
    index: int
    pci_path: tuple[str, ...] = ()
    numa: int | None = None


@dataclass(frozen=True)
class Nic:
    name: str
    pci_path: tuple[str, ...] = ()
    numa: int | None = None
    driver: str | None = None
    port: int = 1  # the port UCX is told to use (UCX_NET_DEVICES=name:port)


def _placed(device: GpuDevice | Nic) -> bool:
    """Whether the facts say where the device is."""
    return bool(device.pci_path) or device.numa is not None


def _common(a: Sequence[str], b: Sequence[str]) -> int:
    shared = 0
    for left, right in zip(a, b, strict=False):
        if left != right:
            break
        shared += 1
    return shared


def nearness(gpu: GpuDevice, nic: Nic) -> tuple[int, int]:
    """(shared PCI path elements, 1 if on the same NUMA node): larger is nearer."""
    same_numa = gpu.numa is not None and gpu.numa == nic.numa
    return _common(gpu.pci_path, nic.pci_path), int(same_numa)


def nearest_nics(
    gpu_devices: Sequence[GpuDevice], nic_devices: Sequence[Nic], slot_gpus: Sequence[int]
) -> list[str]:
    """The NICs nearest the slot's GPUs: one per GPU while there are NICs left (each NIC
    once), in the slot's GPU order. Pairs are taken nearest first across all of the slot's
    GPUs, so a GPU whose own NIC is taken does not take another GPU's own NIC.

    Empty when the facts cannot tell: no NICs, a slot GPU with no pci_path and no NUMA
    node, or nothing told apart (no path shared and no NUMA node known): the caller then
    keeps every NIC for every slot, as before this existed.
    """
    by_index: Mapping[int, GpuDevice] = {g.index: g for g in gpu_devices}
    gpus = [by_index.get(index) for index in slot_gpus]
    nics = [n for n in nic_devices if _placed(n)]
    if not nics or not gpus or any(g is None or not _placed(g) for g in gpus):
        return []
    placed = [g for g in gpus if g is not None]
    pairs = [(nearness(g, n), position, g, n) for position, g in enumerate(placed) for n in nics]
    if all(score == (0, 0) for score, *_ in pairs):
        return []
    pairs.sort(key=lambda p: (-p[0][0], -p[0][1], natural_key(p[3].name), p[1]))
    chosen: dict[int, str] = {}
    used: set[str] = set()
    for _score, position, _gpu, nic in pairs:
        if position in chosen or nic.name in used:
            continue
        chosen[position] = nic.name
        used.add(nic.name)
    return [chosen[position] for position in range(len(placed)) if position in chosen]
