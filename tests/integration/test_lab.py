"""The lab end to end: real nspawn hosts, real sshd, real podman, real systemd."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from pdctl.lab.worker.common import tokenizer
from tests.support import Lab, pdctl, pdctl_json, require_lab, start_lab, wait_for

PROVIDER_WARNING = "libibverbs: Warning: couldn't load driver 'libbnxt_re-rdmav34.so'"


@pytest.fixture
def clean_faults(lab3: Lab) -> Iterator[Lab]:
    yield lab3
    for name in ("node1", "node2", "node3"):
        lab3.fault(name, "clear")


def test_status_contract(lab3: Lab) -> None:
    doc = lab3.status()
    assert [h["name"] for h in doc["hosts"]] == ["node1", "node2", "node3"]
    for host in doc["hosts"]:
        assert set(host) >= {"name", "address", "port", "user", "identity_file", "gpus", "state"}
        assert host["state"] == "running"
        assert host["address"].startswith("10.77.")
        assert Path(host["identity_file"]).is_file()
    assert [h["gpus"] for h in doc["hosts"]] == [0, 8, 8]
    assert doc["worker_image"].startswith("localhost/pdctl-lab/sglang-rocm:")
    assert doc["worker_images"] == {
        "sglang": doc["worker_image"],
        "vllm": "localhost/pdctl-lab/vllm-rocm:0.11.0-lab",
    }
    assert doc["fleet_add"].startswith("pdctl fleet add lab --identity-file ")


def test_up_is_idempotent(lab3: Lab) -> None:
    before = lab3.status()
    started = time.monotonic()
    again = pdctl_json(lab3.home, "lab", "up", "--hosts", "3", "--cpu-hosts", "1")
    assert time.monotonic() - started < 30
    assert again["hosts"] == before["hosts"]


def test_a_stale_copy_of_a_lab_cannot_take_down_the_lab_that_holds_its_id(
    lab3: Lab, tmp_path: Path
) -> None:
    """A workspace whose lab was swept as stale (its id reused by a live lab) runs `lab down`:
    only its own records go; the live lab's hosts, named after the same id, keep running."""
    stale = tmp_path / "stale"
    (stale / ".pdctl" / "lab").mkdir(parents=True)
    lab_json = lab3.home / ".pdctl" / "lab" / "lab.json"
    (stale / ".pdctl" / "lab" / "lab.json").write_text(lab_json.read_text())
    doc = pdctl_json(stale, "lab", "down")
    assert doc["removed_hosts"] == [], doc
    assert not (stale / ".pdctl" / "lab").exists()
    for name in ("node1", "node2", "node3"):
        assert lab3.ssh(name, "cat /proc/sys/kernel/hostname").stdout.strip() == name


def test_ssh_as_root_and_sudo_user_with_own_identity(lab3: Lab) -> None:
    seen_ids, seen_keys = set(), set()
    for name in ("node1", "node2", "node3"):
        assert lab3.ssh(name, "cat /proc/sys/kernel/hostname").stdout.strip() == name
        assert lab3.ssh(name, "id -un", user="root").stdout.strip() == "root"
        user = lab3.ssh(name, "id -un; sudo -n id -u").stdout.split()
        assert user == ["pdops", "0"]
        assert lab3.ssh(name, "systemctl is-system-running").stdout.strip() == "running"
        seen_ids.add(lab3.ssh(name, "cat /etc/machine-id").stdout.strip())
        seen_keys.add(lab3.ssh(name, "cat /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[1])
    assert len(seen_ids) == 3 and len(seen_keys) == 3  # each host its own identity


def test_hosts_reach_each_other_but_not_the_outside(lab3: Lab) -> None:
    node3 = lab3.host("node3")["address"]
    probe = (
        f"python3 -c \"import socket; socket.create_connection(('{node3}', 22), 2); print('ok')\""
    )
    assert lab3.ssh("node2", probe).stdout.strip() == "ok"
    routes = lab3.ssh("node2", "ip route").stdout
    assert "default" not in routes


def test_gpu_host_tools_speak_real_formats(lab3: Lab) -> None:
    devices = lab3.ssh("node2", "ibv_devices").stdout.splitlines()
    assert devices[0] == "    device          \t   node GUID"
    assert devices[1] == "    ------          \t----------------"
    assert [line.split()[0] for line in devices[2:]] == [f"bnxt_re{i}" for i in range(8)]
    info = lab3.ssh("node2", "ibv_devinfo").stdout
    assert info.count("hca_id:\tbnxt_re") == 8
    assert info.count("PORT_ACTIVE (4)") == 8
    assert "\t\t\tlink_layer:\t\tEthernet" in info
    verbose = lab3.ssh("node2", "ibv_devinfo -v -d bnxt_re0").stdout
    assert "GID[  3]:\t\t::ffff:" in verbose and "RoCE v2" in verbose
    gpus = json.loads(lab3.ssh("node2", "amd-smi list --json").stdout)
    gpus = gpus["gpu_data"] if isinstance(gpus, dict) else gpus
    assert [g["gpu"] for g in gpus] == list(range(8))
    static = json.loads(lab3.ssh("node2", "amd-smi static --asic --json").stdout)
    static = static["gpu_data"] if isinstance(static, dict) else static
    assert {g["asic"]["market_name"] for g in static} == {"AMD Instinct MI300X"}
    rocm = json.loads(lab3.ssh("node2", "rocm-smi --showproductname --json").stdout)
    assert sorted(rocm) == [f"card{i}" for i in range(8)]
    lab3.ssh(
        "node2",
        "test -c /dev/kfd && test -c /dev/dri/renderD135 && test -c /dev/infiniband/uverbs7",
    )
    lab3.ssh("node2", "test -f /usr/lib64/libibverbs/libbnxt_re-rdmav34.so")


def test_cpu_host_has_no_gpu_or_rdma(lab3: Lab) -> None:
    probe = lab3.ssh("node1", "command -v ibv_devices amd-smi; test -e /dev/kfd", check=False)
    assert probe.returncode != 0 and probe.stdout.strip() == ""


def test_nic_missing_and_port_down(clean_faults: Lab) -> None:
    lab = clean_faults
    lab.fault("node2", "nic-missing", "bnxt_re7")
    lab.fault("node2", "port-down", "bnxt_re3")
    names = [line.split()[0] for line in lab.ssh("node2", "ibv_devices").stdout.splitlines()[2:]]
    assert names == [f"bnxt_re{i}" for i in range(7)]
    block = lab.ssh("node2", "ibv_devinfo -d bnxt_re3").stdout
    assert "PORT_DOWN (1)" in block
    assert "bnxt_re7" not in lab.ssh("node2", "ibv_devinfo").stdout
    assert lab.host("node2")["faults"] == ["nic-missing bnxt_re7", "port-down bnxt_re3"]
    lab.fault("node2", "clear")
    assert lab.ssh("node2", "ibv_devinfo").stdout.count("PORT_ACTIVE (4)") == 8


def test_provider_lib_missing(clean_faults: Lab) -> None:
    lab = clean_faults
    lab.fault("node3", "provider-lib-missing")
    proc = lab.ssh("node3", "ibv_devices")
    assert PROVIDER_WARNING in proc.stderr
    assert len(proc.stdout.splitlines()) == 2  # header only: no device without its provider
    assert (
        lab.ssh(
            "node3", "test -e /usr/lib64/libibverbs/libbnxt_re-rdmav34.so", check=False
        ).returncode
        == 1
    )


def test_gpu_missing(clean_faults: Lab) -> None:
    lab = clean_faults
    lab.fault("node2", "gpu-missing", "5")
    gpus = json.loads(lab.ssh("node2", "amd-smi list --json").stdout)
    gpus = gpus["gpu_data"] if isinstance(gpus, dict) else gpus
    # Like real amd-smi, survivors are renumbered; the slot shows in the stable BDF.
    assert len(gpus) == 7
    assert len({g["bdf"] for g in gpus}) == 7
    slots = json.loads(lab.ssh("node2", "amd-smi static --asic --json").stdout)
    slots = slots["gpu_data"] if isinstance(slots, dict) else slots
    assert sorted(g["asic"]["oam_id"] for g in slots) == [0, 1, 2, 3, 4, 6, 7]
    assert lab.ssh("node2", "test -e /dev/dri/renderD133", check=False).returncode == 1


def test_no_runtime(clean_faults: Lab) -> None:
    lab = clean_faults
    lab.fault("node2", "no-runtime")
    assert lab.ssh("node2", "command -v podman docker", check=False).stdout.strip() == ""
    lab.fault("node2", "clear")
    assert lab.ssh("node2", "command -v podman").stdout.strip() == "/usr/bin/podman"


def test_sshd_down(clean_faults: Lab) -> None:
    lab = clean_faults
    address = lab.host("node3")["address"]
    lab.fault("node3", "sshd-down")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, 22), timeout=3)
    assert lab.ssh("node3", "true", check=False).returncode == 255
    lab.fault("node3", "clear")
    assert lab.ssh("node3", "echo back").stdout.strip() == "back"


def test_bad_fault_input_is_one_clear_line(lab3: Lab) -> None:
    proc = pdctl(lab3.home, "lab", "fault", "node1", "nic-missing", "bnxt_re0", check=False)
    assert proc.returncode == 3
    assert "node1 is a CPU host" in proc.stderr and "Traceback" not in proc.stderr
    proc = pdctl(lab3.home, "lab", "fault", "nodeX", "clear", check=False)
    assert proc.returncode == 7 and "no lab host named 'nodeX'" in proc.stderr
    doc = json.loads(
        pdctl(lab3.home, "--json", "lab", "fault", "node2", "port-down", "eth9", check=False).stdout
    )
    assert doc["error"]["kind"] == "invalid_input" and "eth9" in doc["error"]["message"]


WORKER_UNIT = """\
[Unit]
Description=lab worker smoke test
[Service]
ExecStartPre=-/usr/bin/podman rm -f labsmoke
ExecStart=/usr/bin/podman run --rm --name labsmoke --network host --ipc host \
  --device /dev/kfd --device /dev/dri --device /dev/infiniband \
  --group-add video --cap-add SYS_PTRACE --security-opt seccomp=unconfined \
  -v {lib}:/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so:ro \
  {image} python3 -m sglang.launch_server --model-path lab/model \
  --disaggregation-mode prefill --host 0.0.0.0 --port 30000 --disaggregation-bootstrap-port 8998
ExecStop=/usr/bin/podman stop -t 30 labsmoke
KillSignal=SIGTERM
"""


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _wait_status(url: str, wanted: int, seconds: float) -> int:
    deadline, status = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        status = _http_status(url)
        if status == wanted:
            return status
        time.sleep(0.3)
    return status


def test_worker_image_serves_health_under_systemd(clean_faults: Lab) -> None:
    lab = clean_faults
    image = lab.status()["worker_image"]
    unit = WORKER_UNIT.format(image=image, lib="/usr/lib64/libibverbs/libbnxt_re-rdmav34.so")
    lab.ssh(
        "node2",
        f"cat > /etc/systemd/system/labsmoke.service <<'EOF'\n{unit}EOF\n"
        "systemctl daemon-reload && systemctl start labsmoke",
        user="root",
    )
    health = f"http://{lab.host('node2')['address']}:30000/health"
    try:
        assert _wait_status(health, 200, 60) == 200
        lab.fault("node2", "worker-unhealthy")
        assert _wait_status(health, 503, 10) == 503
        lab.fault("node2", "clear")
        assert _wait_status(health, 200, 10) == 200
        state = lab.ssh("node2", "systemctl is-active labsmoke", user="root").stdout.strip()
        assert state == "active"
    finally:
        lab.ssh(
            "node2",
            "systemctl stop labsmoke; rm -f /etc/systemd/system/labsmoke.service",
            user="root",
            check=False,
        )


def test_worker_refuses_to_start_without_provider_library(lab3: Lab) -> None:
    image = lab3.status()["worker_image"]
    proc = lab3.ssh(
        "node3",
        f"podman run --rm --network host {image} python3 -m sglang.launch_server"
        " --model-path m --disaggregation-mode decode --port 30100",
        user="root",
        check=False,
    )
    assert proc.returncode != 0
    assert PROVIDER_WARNING in proc.stderr + proc.stdout


def _leftovers(home: Path) -> dict[str, list[str]]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    mounts = Path("/proc/mounts").read_text()
    return {
        "netns": [line for line in netns.stdout.splitlines() if line.startswith("pdl")],
        "links": [line for line in links.stdout.splitlines() if ": pl" in line or "pdlab" in line],
        "mounts": [line for line in mounts.splitlines() if str(home) in line],
        "cgroups": [str(p) for p in Path("/sys/fs/cgroup/systemd").glob("pdctl-lab*")],
    }


def test_down_removes_everything_and_twice_is_fine(tmp_path: Path) -> None:
    require_lab()
    lab = start_lab(tmp_path, hosts=2, cpu_hosts=0)
    # Other labs (tests side by side) come and go meanwhile: look at this lab's own names.
    lab_id = lab.status()["hosts"][0]["address"].split(".")[2]
    mine = (f"pdl{lab_id}-", f"pl{lab_id}h", f"pdlab{lab_id}:", f"pdctl-lab{lab_id}")

    def own(found: dict[str, list[str]]) -> dict[str, list[str]]:
        # Mounts are this lab's already (found under its own workspace); the rest by name.
        return {
            kind: items if kind == "mounts" else [x for x in items if any(m in x for m in mine)]
            for kind, items in found.items()
        }

    during = own(_leftovers(tmp_path))
    assert len(during["netns"]) == 3  # the two hosts' and the model hub's
    assert len(during["mounts"]) == 2 and during["links"]
    pdctl(lab.home, "lab", "down")
    after = own(_leftovers(tmp_path))
    assert after == {"netns": [], "links": [], "mounts": [], "cgroups": []}
    assert not (tmp_path / ".pdctl" / "lab").exists()
    assert "removed 0 host" in pdctl(lab.home, "lab", "down").stdout


def test_up_recovers_from_a_killed_lab(tmp_path: Path) -> None:
    """Processes die with a killed run; namespaces, veths and mounts stay. up must clear them."""
    require_lab()
    lab = start_lab(tmp_path, hosts=1, cpu_hosts=0)
    pid = json.loads((tmp_path / ".pdctl/lab/lab.json").read_text())["hosts"][0]["nspawn_pid"]
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    subprocess.run(["kill", "-9", *children, str(pid)], check=True)
    wait_for(
        lambda: lab.status()["hosts"][0]["state"] == "stopped", 30, 0.5, what="the host stopped"
    )
    doc = pdctl_json(tmp_path, "lab", "up", "--hosts", "1")
    assert doc["hosts"][0]["state"] == "running"
    assert lab.ssh("node1", "echo alive").stdout.strip() == "alive"
    pdctl(tmp_path, "lab", "down")
    assert _leftovers(tmp_path)["mounts"] == []


VLLM_PROVIDER_MOUNT = (
    "-v /usr/lib64/libibverbs/libbnxt_re-rdmav34.so:"
    "/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so:ro"
)
VLLM_KV = '--kv-transfer-config \'{"kv_connector":"NixlConnector","kv_role":"%s"}\''


def _vllm_health(address: str, port: int) -> int | None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"{address}:{port}"))
    try:
        return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
    except grpc.RpcError:
        return None


def test_vllm_image_runs_p_and_d_on_two_lab_hosts(lab3: Lab) -> None:
    """Both tags of the vLLM image are loaded; a prefill (``vllm serve --grpc``) on node2 and a
    decode (``python3 -m vllm.entrypoints.grpc_server``) on node3 serve gRPC, and the decode
    fetches the prefill's KV over node2's side channel. Without the provider library the image
    refuses to start. (SMG routing the same stand-in: test_vllm_worker_with_smg.py.)"""
    status = lab3.status()
    hosts = {h["name"]: h for h in status["hosts"]}
    node2, node3 = hosts["node2"]["address"], hosts["node3"]["address"]
    vllm = status["worker_images"]["vllm"]
    other_tag = vllm.replace(":0.11.0-lab", ":0.11.1-lab")

    def root(node: str, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return lab3.ssh(node, command, user="root", check=check, host=hosts[node])

    def start(node: str, name: str, image: str, command: str) -> None:
        side = f"-e VLLM_NIXL_SIDE_CHANNEL_HOST={hosts[node]['address']}"
        options = f"--rm --name {name} --network host {VLLM_PROVIDER_MOUNT} {side}"
        root(node, f"podman run -d {options} {image} {command} -tp 4 --block-size 128")

    try:
        serve = "vllm serve lab/tiny-llama --grpc --port 50100"
        start("node2", "vlab-prefill", vllm, f"{serve} {VLLM_KV % 'kv_producer'}")
        module = "python3 -m vllm.entrypoints.grpc_server --model lab/tiny-llama"
        start("node3", "vlab-decode", other_tag, f"{module} --port 50101 {VLLM_KV % 'kv_consumer'}")
        bare = f"podman run --rm --network host {vllm} {module} --port 50102"
        refused = root("node3", f"{bare} {VLLM_KV % 'kv_consumer'}", check=False)
        assert refused.returncode != 0
        assert PROVIDER_WARNING in refused.stderr + refused.stdout
        serving = health_pb2.HealthCheckResponse.SERVING
        for address, port in ((node2, 50100), (node3, 50101)):
            wait_for(lambda a=address, p=port: _vllm_health(a, p) == serving, 60, 0.3)
        prompt = [tokenizer.USER, *(i for w in tokenizer.encode_words("hi lab") for i in w)]
        prefill = pb_grpc.VllmEngineStub(grpc.insecure_channel(f"{node2}:50100"))
        (first,) = prefill.Generate(
            pb.GenerateRequest(
                request_id="lab-1",
                tokenized=pb.TokenizedInput(input_ids=prompt),
                sampling_params=pb.SamplingParams(max_tokens=1),
                kv_transfer_params_json=json.dumps({"do_remote_decode": True}),
            ),
            timeout=20,
        )
        handoff = json.loads(first.complete.kv_transfer_params_json)
        assert (handoff["remote_host"], handoff["remote_port"]) == (node2, 5600)
        decode = pb_grpc.VllmEngineStub(grpc.insecure_channel(f"{node3}:50101"))
        ids = [
            i
            for reply in decode.Generate(
                pb.GenerateRequest(
                    request_id="lab-1",
                    tokenized=pb.TokenizedInput(input_ids=prompt),
                    stream=True,
                    kv_transfer_params_json=first.complete.kv_transfer_params_json,
                ),
                timeout=20,
            )
            for i in reply.chunk.token_ids
        ]
        answer = tokenizer.decode(ids)
        assert answer.startswith("[decode ")
        assert answer.endswith(":50101 model=lab/tiny-llama] echo: hi lab")
        logs = root("node2", "podman logs vlab-prefill")
        assert f"NIXL side channel: {node3} fetched lab-1: True" in logs.stdout + logs.stderr
    finally:
        for node, name in (("node2", "vlab-prefill"), ("node3", "vlab-decode")):
            root(node, f"podman rm -f -t 0 {name}", check=False)
