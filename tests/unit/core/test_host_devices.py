"""A host's devices read from its stored facts (pdctl/core/host_devices.py): facts from before
topology was gathered still read."""

from __future__ import annotations

from pdctl.core.host_devices import HostGpus
from pdctl.core.nic_affinity import nearest_nics


def _host(facts: dict) -> HostGpus:
    return HostGpus.from_facts(facts)


def test_old_facts_read_without_topology() -> None:
    old = {
        "gpus": {"count": 8, "model": "AMD Instinct MI300X"},
        "rdma": {"devices": [{"name": f"bnxt_re{k}", "ports": []} for k in range(8)]},
    }
    host = _host(old)
    assert host.vendor == "amd" and host.provider_libs is None and host.devices == ()
    assert nearest_nics(host.devices, host.nics, [0, 1, 2, 3]) == []
