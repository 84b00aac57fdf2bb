"""Per-slot NIC affinity (pdctl/core/nic_affinity.py): each slot gets the RDMA devices nearest its
GPUs (pure)."""

from __future__ import annotations

import pytest

from pdctl.core.host_devices import HostGpus
from pdctl.core.nic_affinity import GpuDevice, Nic, nearest_nics, nearness
from tests.hostfacts import amd_facts, nvidia_facts


def _host(facts: dict) -> HostGpus:
    return HostGpus.from_facts(facts)


@pytest.mark.parametrize(
    ("facts", "prefix"),
    [(nvidia_facts(), "mlx5_"), (amd_facts(), "bnxt_re")],
    ids=["nvidia", "amd"],
)
def test_a_tp4_slot_gets_the_4_nics_nearest_its_4_gpus(facts: dict, prefix: str) -> None:
    host = _host(facts)
    assert nearest_nics(host.devices, host.nics, [0, 1, 2, 3]) == [f"{prefix}{k}" for k in range(4)]
    assert nearest_nics(host.devices, host.nics, [4, 5, 6, 7]) == [
        f"{prefix}{k}" for k in range(4, 8)
    ]
    # In the slot's GPU order, and for GPUs that are not neighbours.
    assert nearest_nics(host.devices, host.nics, [6, 1]) == [f"{prefix}6", f"{prefix}1"]


def test_the_nic_on_the_gpus_switch_wins_over_numa_and_name_order() -> None:
    host = _host(nvidia_facts())
    gpu, own, other = host.devices[2], host.nics[2], host.nics[0]
    assert nearness(gpu, own) > nearness(gpu, other) > nearness(gpu, host.nics[5])
    for k in range(8):
        assert nearest_nics(host.devices, host.nics, [k]) == [f"mlx5_{k}"]


def test_fewer_nics_than_gpus_shares_them_out_nearest_first() -> None:
    # 4 NICs, NIC j on the switch of GPUs 2j and 2j+1 (paths of the pair's even GPU's NIC).
    host = _host(nvidia_facts())
    nics = [
        Nic(name=f"mlx5_{j}", pci_path=host.nics[2 * j].pci_path, numa=host.nics[2 * j].numa)
        for j in range(4)
    ]
    devices = [
        GpuDevice(index=k, pci_path=host.devices[2 * (k // 2)].pci_path, numa=0 if k < 4 else 1)
        for k in range(8)
    ]
    # GPUs 2 and 3 share mlx5_1; the second takes the nearest left: same NUMA node (mlx5_0).
    assert nearest_nics(devices, nics, [2, 3]) == ["mlx5_1", "mlx5_0"]
    # Eight GPUs, four NICs: each NIC once, every GPU pair's own NIC first.
    found = nearest_nics(devices, nics, list(range(8)))
    assert sorted(found) == [f"mlx5_{j}" for j in range(4)] and len(found) == 4
    assert found == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]  # GPUs 0, 2, 4, 6 took their own


def test_two_nics_for_a_tp4_slot() -> None:
    host = _host(nvidia_facts())
    nics = [host.nics[1], host.nics[6]]
    # GPU 1 takes its own NIC; GPU 0 the one left; in the slot's GPU order.
    assert nearest_nics(host.devices, nics, [0, 1, 2, 3]) == ["mlx5_6", "mlx5_1"]


def test_numa_alone_still_tells_sockets_apart() -> None:
    gpus = [GpuDevice(index=k, numa=0 if k < 4 else 1) for k in range(8)]
    nics = [Nic(name=f"mlx5_{k}", numa=0 if k < 4 else 1) for k in range(8)]
    assert nearest_nics(gpus, nics, [4, 5, 6, 7]) == ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    assert nearest_nics(gpus, nics, [5]) == ["mlx5_4"]  # same node; then name order


def test_a_nic_with_no_topology_is_never_chosen_over_one_with() -> None:
    host = _host(nvidia_facts())
    nics = [Nic(name="mlx5_9"), *host.nics[:2]]
    assert nearest_nics(host.devices, nics, [0, 1]) == ["mlx5_0", "mlx5_1"]


@pytest.mark.parametrize(
    ("gpus", "nics", "slot"),
    [
        # Facts gathered before topology was read: nothing to go by.
        ([GpuDevice(index=k) for k in range(8)], [Nic(name=f"bnxt_re{k}") for k in range(8)], [0]),
        # No device list for the GPUs at all (old facts).
        ([], [Nic(name="mlx5_0", numa=0)], [0]),
        # No NICs.
        ([GpuDevice(index=0, numa=0)], [], [0]),
        # A slot GPU the facts do not list.
        ([GpuDevice(index=0, numa=0)], [Nic(name="mlx5_0", numa=0)], [0, 1]),
        # Every pair as far as every other: nothing tells them apart.
        ([GpuDevice(index=0, numa=0)], [Nic(name="mlx5_0", numa=1)], [0]),
        # An empty slot.
        ([GpuDevice(index=0, numa=0)], [Nic(name="mlx5_0", numa=0)], []),
    ],
    ids=["no-topology", "no-gpu-devices", "no-nics", "unknown-gpu", "all-far", "empty-slot"],
)
def test_degenerate_topologies_give_no_per_slot_nics(
    gpus: list[GpuDevice], nics: list[Nic], slot: list[int]
) -> None:
    assert nearest_nics(gpus, nics, slot) == []
