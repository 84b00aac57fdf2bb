"""What real hosts answered (tests/data/real-hosts/, copied from the shared real-hosts set):
read on the controller as `fleet add` reads them, they keep the verdicts a person checked by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdctl.onhost.hardware.checks import Expectations, evaluate
from pdctl.onhost.hardware.facts import facts

REAL_HOSTS = Path(__file__).resolve().parents[3] / "data" / "real-hosts"


def test_an_h100_vm_without_systemd_toolkit_or_runtime() -> None:
    """One H100 in a VM (Ubuntu 24.04, driver 580.159.04): the GPU is read right; what the host
    lacks (systemd as init, the container toolkit, CDI, a runtime) fails with its fix; the
    rest passes, perftest included (no RDMA NIC is expected of it)."""
    raw = json.loads((REAL_HOSTS / "h100-ubuntu24" / "collect.json").read_text())
    gpus = facts(raw)["gpus"]
    assert (gpus["count"], gpus["model"], gpus["vendor"]) == (1, "H100", "nvidia")
    assert (gpus["memory_mib"], gpus["driver"]) == (81559, "580.159.04")
    assert gpus["devices"][0]["pci"] == "0000:00:06.0"
    assert gpus["devices"][0]["uuid"].startswith("GPU-0da4d00e-")

    expect = Expectations(
        kind="gpu", gpus=1, gpu_model="H100", nics=0, gpu_vendor="nvidia", nic_driver="mlx5"
    )
    verdicts = {check.name: check for check in evaluate("h100", raw, expect)}
    failed = sorted(name for name, check in verdicts.items() if not check.ok)
    assert failed == ["cdi", "container_toolkit", "runtime", "systemd"], verdicts
    assert "boot the host with systemd as init" in verdicts["systemd"].message
    assert "install the NVIDIA Container Toolkit" in verdicts["container_toolkit"].message
    assert "fix container_toolkit first" in verdicts["cdi"].message
    assert "install one" in verdicts["runtime"].message
    assert verdicts["perftest"].message == "h100: no RDMA NIC expected"
    assert "1 x NVIDIA H100 80GB HBM3" in verdicts["gpus"].message
