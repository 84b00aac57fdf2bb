"""NVIDIA lab hosts end to end: `pdctl lab up --gpu H200`, the real preflight on them, each
NVIDIA fault failing its check with its fix, the topology in the stored facts, and real
podman CDI handing a container exactly the GPUs it names."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import Lab, pdctl, pdctl_json, require_lab

GPU_HOSTS = ("node2", "node3")


@pytest.fixture(scope="module")
def h200(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """3 hosts (node1 CPU-only), H200 GPU hosts with ConnectX NICs on InfiniBand."""
    require_lab()
    home = tmp_path_factory.mktemp("h200")
    pdctl(home, "lab", "up", "--hosts", "3", "--cpu-hosts", "1", "--gpu", "H200",
          "--link-layer", "ib")  # fmt: skip
    lab = Lab(home)
    yield lab
    pdctl(home, "lab", "down")


@pytest.fixture
def clean(h200: Lab) -> Iterator[Lab]:
    yield h200
    for name in GPU_HOSTS:
        h200.fault(name, "clear")


def fleet_add(lab: Lab) -> tuple[int, dict[str, Any]]:
    line = lab.status()["fleet_add"]
    assert " --gpu H200 --nic-driver mlx5 --link-layer ib " in line
    proc = pdctl(lab.home, "--json", *line.split()[1:], check=False)
    return proc.returncode, json.loads(proc.stdout)


def checks_of(doc: dict[str, Any], address: str) -> dict[str, dict[str, Any]]:
    host = next(h for h in doc["hosts"] if h["address"] == address)
    return {c["name"]: c for c in host["checks"]}


def test_status_reports_vendor_and_model(h200: Lab) -> None:
    hosts = h200.status()["hosts"]
    assert [(h["gpu_vendor"], h["gpu_model"]) for h in hosts] == [
        (None, None),
        ("nvidia", "H200"),
        ("nvidia", "H200"),
    ]
    assert [h["link_layer"] for h in hosts] == [None, "ib", "ib"]


def test_gpu_hosts_look_like_hgx_h200(h200: Lab) -> None:
    for name in GPU_HOSTS:
        rows = h200.ssh(
            name, "nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader"
        ).stdout.splitlines()
        assert rows == [f"{i}, NVIDIA H200, 143771 MiB" for i in range(8)]
        devices = h200.ssh(name, "ibv_devices").stdout.splitlines()[2:]
        assert [line.split()[0] for line in devices] == [f"mlx5_{k}" for k in range(8)]
        assert h200.ssh(name, "test -e /dev/kfd", check=False).returncode == 1
        nodes = h200.ssh(name, "ls /dev").stdout.split()
        assert sorted(n for n in nodes if re.fullmatch(r"nvidia\d+", n)) == [
            f"nvidia{k}" for k in range(8)
        ]
        assert {"nvidiactl", "nvidia-uvm"} <= set(nodes)
        info = h200.ssh(name, "ibv_devinfo -d mlx5_0").stdout
        assert "\tvendor_id:\t\t\t0x02c9\n" in info and "\tvendor_part_id:\t\t\t4129\n" in info
        assert "\t\t\tlink_layer:\t\tInfiniBand\n" in info
        listed = h200.ssh(name, "nvidia-ctk cdi list").stdout.split()
        assert [f"nvidia.com/gpu={k}" for k in range(8)] == [
            d for d in listed if re.fullmatch(r"nvidia\.com/gpu=\d+", d)
        ]
    cpu = h200.ssh("node1", "command -v nvidia-smi; ls /sys/class/infiniband", check=False)
    assert "nvidia-smi" not in cpu.stdout


def _topo_nic_of_gpu(topo: str) -> dict[int, str]:
    """GPU index -> the NIC name topo -m shows behind the same PCIe switch (PIX/PXB)."""
    lines = topo.splitlines()
    head = lines[0].strip("\t").split("\t")
    legend = dict(re.findall(r"^\s+(NIC\d+): (\S+)$", topo, re.MULTILINE))
    own: dict[int, str] = {}
    for line in lines[1:]:
        cells = line.split("\t")
        if not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        near = [head[i] for i, cell in enumerate(cells[1:]) if cell in ("PIX", "PXB")]
        assert len(near) == 1, line
        own[int(cells[0][3:])] = legend[near[0]]
    return own


def test_preflight_passes_and_facts_carry_the_topology(h200: Lab) -> None:
    rc, doc = fleet_add(h200)
    assert rc == 0, doc
    shown = pdctl_json(h200.home, "fleet", "show", "lab")
    for host in shown["hosts"]:
        facts = host["facts"]
        if host["kind"] == "cpu":
            assert facts["gpus"]["vendor"] is None and facts["nvidia"] is None
            continue
        gpus, rdma = facts["gpus"], facts["rdma"]
        assert (gpus["vendor"], gpus["model"], gpus["count"]) == ("nvidia", "H200", 8)
        assert (gpus["memory_mib"], gpus["driver"], gpus["source"]) == (
            143771,
            "570.211.01",
            "nvidia-smi",
        )
        assert facts["nvidia"]["driver_loaded"] and facts["nvidia"]["cdi_spec"]
        assert {str(k) for k in range(8)} | {"all"} <= set(facts["nvidia"]["cdi_devices"])
        assert [d["numa"] for d in gpus["devices"]] == [0, 0, 0, 0, 1, 1, 1, 1]
        nics = {d["name"]: d for d in rdma["devices"]}
        assert {d["driver"] for d in nics.values()} == {"mlx5"}
        assert [nics[f"mlx5_{k}"]["numa"] for k in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert rdma["provider_libs"]["mlx5"].endswith("/libmlx5-rdmav34.so")
        # The nearest NIC by sysfs PCI path is the one topo -m puts behind the GPU's switch.
        name = h200.node_at(host["address"])
        topo = _topo_nic_of_gpu(h200.ssh(name, "nvidia-smi topo -m").stdout)
        for gpu in gpus["devices"]:
            path = gpu["pci_path"]
            assert len(path) == 4 and path[-1] == gpu["pci"]

            def shared(nic: dict[str, Any], gpu_path: list[str] = path) -> int:
                return len([a for a, b in zip(gpu_path, nic["pci_path"], strict=False) if a == b])

            nearest = max(nics.values(), key=shared)
            assert shared(nearest) == 2  # root port and switch
            assert nearest["name"] == topo[gpu["index"]] == f"mlx5_{gpu['index']}"


@pytest.mark.parametrize(
    ("fault", "arg", "check", "words"),
    [
        ("driver-missing", None, "gpus", ["NVIDIA driver is not loaded", "modprobe nvidia"]),
        (
            "cdi-missing",
            None,
            "cdi",
            ["no CDI spec", "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"],
        ),
        ("gpu-missing", "5", "gpus", ["nvidia-smi lists 7 GPUs, expected 8 H200 GPUs"]),
        ("port-down", "mlx5_3", "rdma_ports", ["mlx5_3 port 1 is PORT_DOWN (1)", "bring the"]),
    ],
)
def test_each_nvidia_fault_fails_its_check_with_the_fix(
    clean: Lab, fault: str, arg: str | None, check: str, words: list[str]
) -> None:
    fleet_add(clean)  # the fleet exists (idempotent)
    clean.fault("node3", fault, arg)
    proc = pdctl(clean.home, "--json", "fleet", "check", "lab", check=False)
    assert proc.returncode == 5, proc.stderr
    doc = json.loads(proc.stdout)
    node3 = clean.host("node3")["address"]
    failed = {n: c["message"] for n, c in checks_of(doc, node3).items() if not c["ok"]}
    assert check in failed, failed
    for word in words:
        assert word in failed[check], failed[check]
    node2 = clean.host("node2")["address"]
    assert all(c["ok"] for c in checks_of(doc, node2).values())


def test_a_gpu_missing_makes_the_cdi_spec_stale(clean: Lab) -> None:
    fleet_add(clean)
    clean.fault("node2", "gpu-missing", "7")
    assert "nvidia7" not in clean.ssh("node2", "ls /dev").stdout.split()
    node2 = clean.host("node2")["address"]
    proc = pdctl(clean.home, "--json", "fleet", "check", "lab", "--limit", node2, check=False)
    message = checks_of(json.loads(proc.stdout), node2)["cdi"]
    assert not message["ok"]
    assert "does not list GPU" in message["message"] or "lists GPU" in message["message"]


def test_podman_cdi_gives_a_container_exactly_its_gpus(h200: Lab) -> None:
    image = h200.status()["worker_image"]
    script = "ls /dev"
    proc = h200.ssh(
        "node2",
        f"podman run --rm --network host --device nvidia.com/gpu=2 --device nvidia.com/gpu=3 "
        f"{image} sh -c '{script}'",
        user="root",
    )
    nodes = proc.stdout.split()
    assert sorted(n for n in nodes if re.fullmatch(r"nvidia\d+", n)) == ["nvidia2", "nvidia3"]
    assert {"nvidiactl", "nvidia-uvm"} <= set(nodes)
    unknown = h200.ssh(
        "node2",
        f"podman run --rm --network host --device nvidia.com/gpu=9 {image} true",
        user="root",
        check=False,
    )
    assert unknown.returncode != 0
    assert "unresolvable CDI devices nvidia.com/gpu=9" in unknown.stderr


def test_worker_stand_in_checks_its_gpus_and_nics(h200: Lab) -> None:
    image = h200.status()["worker_image"]
    base = (
        "podman run --rm --network host --device nvidia.com/gpu=2 --device nvidia.com/gpu=3 "
        "--device /dev/infiniband "
        "-v /usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav34.so:"
        "/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav34.so:ro "
        "-e PDFAKE_PROVIDER_LIB=/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav34.so "
        "-e PDFAKE_WARMUP_SECS=0 {env} "
        f"{image} timeout 5 python3 -m sglang.launch_server --model-path m "
        "--disaggregation-mode prefill --disaggregation-transfer-backend nixl --port 31000"
    )
    wrong = h200.ssh("node2", base.format(env="-e PDCTL_GPU_IDS=2,4"), user="root", check=False)
    assert wrong.returncode == 1
    assert "invalid device ordinal" in wrong.stderr and "/dev/nvidia4" in wrong.stderr
    extra = h200.ssh("node2", base.format(env="-e PDCTL_GPU_IDS=2"), user="root", check=False)
    assert "outside its slot (/dev/nvidia3" in extra.stderr
    nic = h200.ssh(
        "node2",
        base.format(env="-e PDCTL_GPU_IDS=2,3 -e PDCTL_RDMA_DEVICES=mlx5_2,mlx5_9"),
        user="root",
        check=False,
    )
    assert "Failed to open RDMA device(s) mlx5_9" in nic.stderr
    good = h200.ssh(
        "node2",
        base.format(env="-e PDCTL_GPU_IDS=2,3 -e PDCTL_RDMA_DEVICES=mlx5_2,mlx5_3"),
        user="root",
        check=False,
    )
    assert "backend=nixl" in good.stderr
    assert "Uvicorn running" in good.stderr, good.stderr
