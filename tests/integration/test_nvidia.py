"""dstack's SMG example on NVIDIA hosts, end to end: `pdctl lab up --hosts 3 --cpu-hosts 1
--gpu H200`, dstack's published pd.dstack.yml (NIXL) with only its image and the router's
`cpu: 4` made lab-sized (tests/data/dstack/lab/sglang-pd.dstack.yml; a unit test checks that),
deployed with `pdctl fleet add` as `lab status` prints it and `pdctl deploy`, no other step
(the lab's hub makes the file's model on its first request); a chat through SMG; every worker
container holds exactly its slot's NVIDIA devices (given by real podman CDI) and no ROCm
device, its NIC nearest its GPU in PDCTL_RDMA_DEVICES and UCX_NET_DEVICES; scale and destroy.
Then dstack's gRPC variant of the file (SGLang workers with --grpc-mode, `smg launch
--enable-igw`; tests/data/dstack/lab/sglang-pd-grpc.dstack.yml) on the same hosts: SMG holds
the workers as grpc:// SGLang workers and a chat comes back (that SMG counts gRPC requests for
the scaler's RPS: tests/integration/test_sglang_grpc_worker_with_smg.py).

The tests run in file order and share one deployment. Everything is the real program (sshd,
Ansible, systemd, podman with CDI, SMG, the scaler) but the GPUs and SGLang itself.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdctl.core import layout
from pdctl.core.layout import Layout, Roots
from tests import role_templates
from tests.support import Lab, chat, pdctl, pdctl_json, require_lab, service_status

ROOT = Path(__file__).resolve().parents[2]
DSTACK_FILE = ROOT / "tests" / "data" / "dstack" / "lab" / "sglang-pd.dstack.yml"
GRPC_FILE = DSTACK_FILE.with_name("sglang-pd-grpc.dstack.yml")
SERVICE = "prefill-decode"  # the file's own name
GPU_NODES = ("node2", "node3")


@dataclass
class Deployment:
    lab: Lab
    env: dict[str, str]
    spec: Path

    def pdctl(self, *args: str, check: bool = True) -> Any:
        return pdctl(self.lab.home, *args, env=self.env, check=check)

    def json(self, *args: str) -> Any:
        return json.loads(self.pdctl("--json", *args).stdout)

    def status(self) -> dict[str, Any]:
        return service_status(self.lab.home, SERVICE, self.env)

    def root(self, node: str, command: str) -> str:
        return str(self.lab.ssh(node, command, user="root").stdout)

    def active(self) -> list[tuple[str, str, int]]:
        """(group, node, slot) of every running replica."""
        found = []
        for role in ("prefill", "decode"):
            for replica in self.status()["groups"][role]["replicas"]:
                if replica["state"] == "active":
                    found.append((role, self.lab.node_at(replica["host"]), replica["slot"]))
        return found

    def serving(self, role: str) -> int:
        replicas = self.status()["groups"][role]["replicas"]
        return sum(1 for r in replicas if r["state"] == "active" and r["registered"])

    def api_key(self) -> str:
        return str(self.json("endpoint", SERVICE, "--show-key")["api_key"])


MODEL = "zai-org/GLM-4.5-Air-FP8"  # the example's: SMG routes a request by its model


def chat_when_ready(
    endpoint: str, text: str, key: str, model: str = MODEL
) -> tuple[int, dict[str, Any]]:
    """A chat once SMG has health-checked the new workers: the example keeps SMG's health
    check interval (pdctl's default, 10 s), and a registered worker serves after its first."""
    deadline = time.monotonic() + 90
    while True:
        status, body = chat(endpoint, text, key, model=model)
        if status != 503 or time.monotonic() > deadline:
            return status, body
        time.sleep(2)


def lab_spec(image: str) -> str:
    """dstack's file, lab-sized: its image is the lab's worker image."""
    text = DSTACK_FILE.read_text()
    assert f"image: {image}\n" in text
    return text


@pytest.fixture(scope="module")
def nv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    require_lab()
    home = tmp_path_factory.mktemp("nvidia")
    up = ("lab", "up", "--hosts", "3", "--cpu-hosts", "1", "--gpu", "H200")
    try:
        # `lab up` converges: on a loaded machine a host may miss the boot deadline once.
        if pdctl(home, *up, check=False).returncode != 0:
            pdctl(home, *up)
        lab = Lab(home)
        status = lab.status()
        pdctl(home, *status["fleet_add"].split()[1:])
        lab_spec(status["worker_image"])
        token = f"hf_{uuid.uuid4().hex}"
        deployment = Deployment(lab=lab, env={"HF_TOKEN": token}, spec=DSTACK_FILE)
        yield deployment
    finally:  # the hosts go with the service: no destroy needed
        pdctl(home, "lab", "down", check=False)


def test_plan_gives_each_slot_the_nic_on_its_gpus_switch(nv: Deployment) -> None:
    doc = nv.json("plan", str(nv.spec), "--fleet", "lab")
    slots = [s for group in doc["plan"]["groups"].values() for s in group["slots"]]
    assert len(slots) == 12 and {s["vendor"] for s in slots} == {"nvidia"}
    for slot in slots:
        (gpu,) = slot["gpus"]
        assert slot["rdma_devices"] == [f"mlx5_{gpu}"], slot
        assert slot["ucx_net_devices"] == [f"mlx5_{gpu}:1"], slot
    # CUDA images carry libmlx5: no library mounted; the model cache only (read-only).
    assert doc["plan"]["volumes"] == ["/var/lib/pdctl/models:/root/.cache/huggingface:ro"]
    assert doc["plan"]["notes"] == []
    text = nv.pdctl("plan", str(nv.spec), "--fleet", "lab").stdout
    assert "nics" in text and "mlx5_0" in text


def test_the_smg_example_deploys_and_chats_through_smg(nv: Deployment) -> None:
    doc = nv.json("deploy", str(nv.spec), "--fleet", "lab", "-y")
    assert doc["endpoint"].endswith(":8000") and doc["model"]["repo"] == MODEL
    status, body = chat_when_ready(doc["endpoint"], "hello from an H200", nv.api_key())
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    assert answer.startswith("[decode ") and "hello from an H200" in answer


def _devices(nv: Deployment, node: str, container: str) -> tuple[set[str], str, str]:
    """The container's /dev entries (and /dev/dri's, if any), its env, its mounts."""
    listing = nv.root(
        node, f"podman exec {container} sh -c 'ls /dev; ls /dev/dri 2>/dev/null; true'"
    )
    env = nv.root(node, f"podman exec {container} env")
    mounts = nv.root(node, f"podman inspect --format '{{{{json .Mounts}}}}' {container}")
    return set(listing.split()), env, mounts


def _replica_devices(
    nv: Deployment, role: str, node: str, index: int
) -> tuple[set[str], str, str] | None:
    """_devices of a replica's container; None when the replica left meanwhile. The scaler
    runs: on a loaded machine it may replace a worker whose probe timed out, so a replica
    that status called active can be stopping (or its successor starting) when asked."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return _devices(nv, node, f"pd-{SERVICE}-{role}-{index}")
        except AssertionError:
            if (role, node, index) not in nv.active():
                return None
            if time.monotonic() > deadline:
                raise
        time.sleep(2)


def test_every_worker_container_has_nvidia_devices_only(nv: Deployment) -> None:
    running = nv.active()
    assert {role for role, _node, _slot in running} == {"prefill", "decode"}
    slots = {
        (s["group"], s["index"]): s
        for g in nv.json("plan", str(nv.spec), "--fleet", "lab")["plan"]["groups"].values()
        for s in g["slots"]
    }
    checked = set()
    for role, node, index in running:
        found = _replica_devices(nv, role, node, index)
        if found is None:
            continue
        checked.add(role)
        container = f"pd-{SERVICE}-{role}-{index}"
        devices, env, mounts = found
        (gpu,) = slots[(role, index)]["gpus"]
        gpus = {d for d in devices if re.fullmatch(r"nvidia\d+", d)}
        assert gpus == {f"nvidia{gpu}"}, (container, devices)
        assert {"nvidiactl", "nvidia-uvm"} <= devices, (container, devices)
        assert "kfd" not in devices and not any(d.startswith("renderD") for d in devices)
        assert (
            f"PDCTL_RDMA_DEVICES=mlx5_{gpu}\n" in env and f"UCX_NET_DEVICES=mlx5_{gpu}:1\n" in env
        )
        assert "ROCR_VISIBLE_DEVICES" not in env and "libbnxt_re" not in mounts
    assert checked == {"prefill", "decode"}  # at least one container of each group was read
    unit = nv.root(GPU_NODES[0], f"cat /etc/systemd/system/pd-{SERVICE}-decode@.service")
    assert "$PDCTL_DEVICE_ARGS --device /dev/infiniband" in unit
    assert "/dev/kfd" not in unit and "--group-add video" not in unit


def test_scale_out_and_in(nv: Deployment) -> None:
    nv.pdctl("scale", SERVICE, "decode", "3")
    deadline = time.monotonic() + 180
    while nv.serving("decode") != 3:
        assert time.monotonic() < deadline, nv.status()
        time.sleep(2)
    decodes = [(node, slot) for role, node, slot in nv.active() if role == "decode"]
    seen: set[tuple[str, str]] = set()
    for node, slot in decodes:
        devices, _env, _mounts = _devices(nv, node, f"pd-{SERVICE}-decode-{slot}")
        (gpu,) = [d for d in devices if re.fullmatch(r"nvidia\d+", d)]
        assert (node, gpu) not in seen  # no GPU is handed to two replicas
        seen.add((node, gpu))
    status, body = chat_when_ready(nv.status()["endpoint"], "after scaling out", nv.api_key())
    assert status == 200 and "after scaling out" in body["choices"][0]["message"]["content"]
    nv.pdctl("scale", SERVICE, "decode", "1")
    deadline = time.monotonic() + 180
    while nv.serving("decode") != 1:
        assert time.monotonic() < deadline, nv.status()
        time.sleep(2)
    nv.pdctl("scale", SERVICE, "decode", "auto")


def test_docker_gets_the_slots_gpus_as_one_csv_field(nv: Deployment) -> None:
    """The docker variant of the worker unit, run by the lab host's real systemd with a
    `docker` that records its argv: `--gpus` gets `"device=0,1"`, which docker's CSV reader
    (Go's encoding/csv; Python's csv reads it the same) takes as one field, device=0,1."""
    node, service = GPU_NODES[1], "gpuscheck"
    where = Layout(service, Roots(config_root="/run")).extravar(layout.GROUPS)
    check, env_dir = f"pd-{service}", where["config_dir"]
    unit = role_templates.worker_unit(
        {
            "pd_service": service,
            "pd_layout": where,
            "pd_volumes": [],
            "pd_memlock": "unlimited",
            "pd_privileged": False,
            "pd_start_timeout": 60,
            "pd_stop_timeout": 5,
        },
        "prefill",
        "docker",
        "nvidia",
    )
    shim = f'#!/bin/sh\n[ "$1" = run ] && printf \'%s\\n\' "$@" > {env_dir}/argv\nexit 0\n'
    slot_env = (
        "PDCTL_GPU_IDS=0,1\nPDCTL_DEVICE_ARGS=--device nvidia.com/gpu=0 --device nvidia.com/gpu=1\n"
    )
    files = {
        "/usr/local/sbin/docker": shim,
        where["groups"]["prefill"]["env"]: "PDCTL_IMAGE=img:1\nPDCTL_CONFIG=c0ffee\n",
        where["groups"]["prefill"]["slot_env"].replace("%i", "1"): slot_env,
        f"/etc/systemd/system/{check}-prefill@.service": unit,
    }
    script = f"set -e; mkdir -p {env_dir} /usr/local/sbin; " + "; ".join(
        f"printf %s {shlex.quote(text)} > {path}" for path, text in files.items()
    )
    nv.root(node, script + "; chmod +x /usr/local/sbin/docker; systemctl daemon-reload")
    try:
        nv.root(node, f"systemctl start {check}-prefill@1.service; sleep 1")
        argv = nv.root(node, f"cat {env_dir}/argv").splitlines()
    finally:
        nv.root(
            node,
            f"systemctl stop {check}-prefill@1.service; rm -rf {env_dir} "
            f"/usr/local/sbin/docker /etc/systemd/system/{check}-prefill@.service; "
            "systemctl daemon-reload",
        )
    gpus = argv[argv.index("--gpus") + 1]
    assert gpus == '"device=0,1"'
    assert next(csv.reader([gpus])) == ["device=0,1"]
    assert "/dev/kfd" not in argv and "nvidia.com/gpu=0" not in argv


def test_destroy_leaves_the_hosts_clean(nv: Deployment) -> None:
    nv.pdctl("destroy", SERVICE, "-y")
    for node in ("node1", *GPU_NODES):
        left = nv.lab.ssh(
            node,
            "ls /etc/systemd/system | grep -c '^pd-';"
            " podman ps -a --format '{{.Names}}' 2>/dev/null | grep -c '^pd-'",
            user="root",
            check=False,
        ).stdout.split()
        assert left == ["0", "0"], (node, left)
    assert pdctl_json(nv.lab.home, "fleet", "show", "lab")["services"] == {}


def _router_workers(endpoint: str, key: str) -> list[dict[str, Any]]:
    """SMG's own list of the workers it holds (GET /workers, behind the API key)."""
    ask = urllib.request.Request(f"{endpoint}/workers", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(ask, timeout=10) as reply:
        return list(json.loads(reply.read())["workers"])


def test_dstacks_grpc_file_deploys_and_chats_through_smg(nv: Deployment) -> None:
    """SGLang in gRPC mode, as dstack publishes it (lab-sized): on the hosts the HTTP example
    left clean, no other step."""
    try:
        doc = nv.json("deploy", str(GRPC_FILE), "--fleet", "lab", "-y")
        endpoint, key = doc["endpoint"], nv.api_key()
        assert doc["model"]["repo"] == MODEL  # from the file's MODEL_ID: it names no model
        status, body = chat_when_ready(endpoint, "hello over gRPC", key)
        assert status == 200, body
        answer = body["choices"][0]["message"]["content"]
        assert answer.startswith("[decode ") and "hello over gRPC" in answer
        held = {w["worker_type"]: w for w in _router_workers(endpoint, key)}
        assert set(held) == {"prefill", "decode"}  # count 1..N: one of each running
        for worker in held.values():
            assert worker["url"].startswith("grpc://") and worker["runtime_type"] == "sglang"
            assert worker["connection_mode"] == "grpc" and worker["status"] == "ready"
        assert held["prefill"]["bootstrap_port"] == 8998  # the file's own
    finally:  # the hosts go with the lab (destroy is tested above)
        pdctl(nv.lab.home, "lab", "down")  # before the mixed lab boots: one lab at a time


# ---------------------------------------------------------------- a fleet of both vendors


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """node1 CPU-only, node2 8x MI300X with bnxt_re (RoCE), node3 8x H200 with mlx5 on
    InfiniBand: one fleet, checked by what each host has."""
    require_lab()
    home = tmp_path_factory.mktemp("mixed")
    up = ("lab", "up", "--hosts", "3", "--cpu-hosts", "1", "--gpu", "MI300X", "--gpu", "H200",
          "--link-layer", "ib")  # fmt: skip
    env = {"HF_TOKEN": f"hf_{uuid.uuid4().hex}"}
    try:
        if pdctl(home, *up, check=False).returncode != 0:
            pdctl(home, *up)
        lab = Lab(home)
        pdctl(home, *lab.status()["fleet_add"].split()[1:])
        yield Deployment(lab=lab, env=env, spec=home / "nvidia.yml")
    finally:  # the hosts go with the services: no destroy needed
        pdctl(home, "lab", "down", check=False)


def test_a_mixed_lab_and_fleet_check_each_host_by_what_it_has(mixed: Deployment) -> None:
    """--gpu MI300X --gpu H200: GPU hosts take the models in turn; the fleet that `fleet_add`
    names (--gpu-vendor any --nic-driver auto --link-layer auto) passes both, and the AMD
    host's facts carry the same slot topology (GPU k and NIC k behind one switch)."""
    status = mixed.lab.status()
    hosts = status["hosts"]
    assert [(h["gpu_model"], h["link_layer"]) for h in hosts] == [
        (None, None),
        ("MI300X", "eth"),
        ("H200", "ib"),
    ]
    assert " --gpu-vendor any --nic-driver auto --link-layer auto " in status["fleet_add"]
    shown = {h["address"]: h["facts"] for h in mixed.json("fleet", "show", "lab")["hosts"]}
    amd, nvidia = shown[hosts[1]["address"]], shown[hosts[2]["address"]]
    assert (amd["gpus"]["vendor"], amd["gpus"]["model"], amd["nvidia"]) == ("amd", "MI300X", None)
    assert (nvidia["gpus"]["vendor"], nvidia["gpus"]["model"]) == ("nvidia", "H200")
    for facts, driver in ((amd, "bnxt_re"), (nvidia, "mlx5")):
        nics = facts["rdma"]["devices"]
        assert {n["driver"] for n in nics} == {driver}
        for gpu, nic in zip(facts["gpus"]["devices"], nics, strict=True):
            assert gpu["pci_path"][:2] == nic["pci_path"][:2]
            assert gpu["pci_path"][2] != nic["pci_path"][2]
            assert gpu["numa"] == nic["numa"] == (0 if gpu["index"] < 4 else 1)


def test_a_mixed_fleet_places_each_service_on_its_own_vendor(mixed: Deployment) -> None:
    status = mixed.lab.status()
    assert [h["gpu_model"] for h in status["hosts"]] == [None, "MI300X", "H200"]
    amd_spec = mixed.lab.home / "amd.yml"
    amd_spec.write_text((ROOT / "examples" / "lab" / "pd.yml").read_text())
    # Both routers land on node1: the second gets its own public port from the spec (the
    # first's 8000 is refused, not moved), and pdctl's default metrics port steps to 29001.
    nvidia = lab_spec(status["worker_image"]).replace("port: 8000\nmodel:", "port: 8001\nmodel:")
    mixed.spec.write_text(nvidia)
    amd = mixed.json("deploy", str(amd_spec), "--fleet", "lab", "--allow-partial", "-y")
    nv = mixed.json("deploy", str(mixed.spec), "--fleet", "lab", "--allow-partial", "-y")
    for service, doc, node, vendor in (
        ("pdlab", amd, "node2", "amd"),
        (SERVICE, nv, "node3", "nvidia"),
    ):
        plan = mixed.json("plan", str(amd_spec if vendor == "amd" else mixed.spec), "--fleet",
                          "lab", "--allow-partial")["plan"]  # fmt: skip
        slots = [s for group in plan["groups"].values() for s in group["slots"]]
        assert {mixed.lab.node_at(s["host"]) for s in slots} == {node}, (service, slots)
        assert {s["vendor"] for s in slots} == {vendor}
        if vendor == "nvidia":  # beside pdlab's router: pdctl's own ports stepped aside
            assert (plan["router"]["metrics_port"], plan["scaler_metrics_port"]) == (29001, 29101)
        key = mixed.json("endpoint", service, "--show-key")["api_key"]
        model = "lab/tiny-llama" if vendor == "amd" else MODEL
        code, body = chat_when_ready(doc["endpoint"], f"hello {vendor}", key, model)
        assert code == 200 and f"hello {vendor}" in body["choices"][0]["message"]["content"]
    amd_devices, amd_env, _ = _devices(mixed, "node2", "pd-pdlab-prefill-1")
    assert "kfd" in amd_devices and not any(re.fullmatch(r"nvidia\d*", d) for d in amd_devices)
    assert {"renderD128", "renderD131"} <= amd_devices and "ROCR_VISIBLE_DEVICES=0,1,2,3" in amd_env
    assert "PDCTL_RDMA_DEVICES=bnxt_re0,bnxt_re1,bnxt_re2,bnxt_re3\n" in amd_env
    nv_devices, nv_env, _ = _devices(mixed, "node3", f"pd-{SERVICE}-prefill-1")
    assert "kfd" not in nv_devices and not any(d.startswith("renderD") for d in nv_devices)
    assert {d for d in nv_devices if re.fullmatch(r"nvidia\d+", d)} == {"nvidia0"}
    assert "UCX_NET_DEVICES=mlx5_0:1\n" in nv_env
