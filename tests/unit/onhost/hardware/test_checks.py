"""pdctl/onhost/hardware/checks.py's evaluate(): each check's verdict and message per fault,
memlock's among them.
"""

from __future__ import annotations

import json

import pytest

from pdctl.onhost.hardware import runtime
from pdctl.onhost.hardware.checks import (
    CHECK_NAMES,
    CPU_SKIP_MESSAGE,
    Check,
    Expectations,
    evaluate,
)
from pdctl.onhost.hardware.facts import facts
from tests.unit.onhost.hardware.samples import (
    CPU,
    FAILED_LIST,
    GPU,
    HOST,
    MEMLOCK_CAPPED,
    PERFTEST_WARNINGS,
    PROVIDER,
    SGLANG_ABI_WARNINGS,
    by_name,
    cmd,
    failing,
    gpu_commands,
    make_raw,
    missing,
    rdma_commands,
)

# --------------------------------------------------------------------------- evaluate()


def test_evaluate_healthy_gpu_host() -> None:
    checks = evaluate(HOST, make_raw(), GPU)
    assert [c.name for c in checks] == list(CHECK_NAMES)
    assert failing(checks) == {}
    assert not any(c.skipped for c in checks)
    messages = by_name(checks)
    assert (
        messages["gpus"].message == f"{HOST}: 8 x AMD Instinct MI300X (amd-smi), /dev/kfd present"
    )
    assert messages["rdma_devices"].message == f"{HOST}: ibv_devices lists bnxt_re0..bnxt_re7"
    assert "MC_GID_INDEX=3" in messages["roce_gid"].message
    assert all(c.message.startswith(f"{HOST}: ") for c in checks)


def test_evaluate_cpu_host_skips_gpu_and_rdma() -> None:
    checks = evaluate(HOST, make_raw(kind="cpu"), CPU)
    assert [c.name for c in checks] == list(CHECK_NAMES)
    skipped = [c for c in checks if c.skipped]
    assert [c.name for c in skipped] == [
        "gpus",
        "rdma_devices",
        "rdma_ports",
        "provider_lib",
        "roce_gid",
        "perftest",
        "memlock",
    ]
    assert all(c.ok and c.message == CPU_SKIP_MESSAGE for c in skipped)
    assert failing(checks) == {}


def test_evaluate_nic_missing_names_exactly_the_missing_device() -> None:
    raw = make_raw(rdma=rdma_commands(absent=("bnxt_re7",)))
    assert failing(evaluate(HOST, raw, GPU)) == {
        "rdma_devices": (
            "node2: ibv_devices does not list bnxt_re7 (expected bnxt_re0..bnxt_re7); check that "
            "the bnxt_re driver is loaded and the NIC is cabled (ibv_devices, dmesg | grep bnxt)"
        )
    }


def test_evaluate_two_nics_missing() -> None:
    raw = make_raw(rdma=rdma_commands(absent=("bnxt_re2", "bnxt_re5")))
    message = failing(evaluate(HOST, raw, GPU))["rdma_devices"]
    assert "does not list bnxt_re2 and bnxt_re5 (" in message
    for healthy in ("bnxt_re0", "bnxt_re1", "bnxt_re3", "bnxt_re4", "bnxt_re6"):
        assert f"{healthy}," not in message and f"{healthy} " not in message


def test_evaluate_port_down() -> None:
    raw = make_raw(rdma=rdma_commands(down=("bnxt_re3",)))
    bad = failing(evaluate(HOST, raw, GPU))
    assert list(bad) == ["rdma_ports"]
    assert bad["rdma_ports"].startswith("node2: bnxt_re3 port 1 is PORT_DOWN (1); bring the links")
    assert all(f"bnxt_re{k}" not in bad["rdma_ports"] for k in (0, 1, 2, 4, 5, 6, 7))


def test_evaluate_provider_lib_missing_with_warning() -> None:
    bad = failing(evaluate(HOST, make_raw(provider=False), GPU))
    assert list(bad) == ["rdma_devices", "rdma_ports", "provider_lib", "roce_gid"]
    assert bad["provider_lib"] == (
        "node2: libibverbs could not load libbnxt_re-rdmav34.so: cannot open shared object file: "
        "No such file or directory; /usr/lib64/libibverbs/libbnxt_re-rdmav34.so is missing: "
        "install Broadcom's RoCE provider library (libbnxt_re-rdmav34.so) there"
    )
    assert "bnxt_re0, bnxt_re1" in bad["rdma_devices"]
    assert "fix provider_lib first" in bad["rdma_devices"]
    assert "MC_GID_INDEX" in bad["roce_gid"]


def test_evaluate_provider_lib_elsewhere() -> None:
    raw = make_raw()
    raw["provider_lib"] = {
        "path": PROVIDER,
        "exists": False,
        "elsewhere": ["/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so"],
    }
    message = failing(evaluate(HOST, raw, GPU))["provider_lib"]
    assert message == (
        "node2: libbnxt_re-rdmav34.so not found at /usr/lib64/libibverbs/libbnxt_re-rdmav34.so "
        "(the worker containers bind-mount it from there); it is at "
        "/usr/lib/x86_64-linux-gnu/libibverbs/libbnxt_re-rdmav34.so: set provider_lib to that path"
    )


def test_evaluate_provider_abi_mismatch_fails_other_providers_do_not() -> None:
    raw = make_raw(rdma=rdma_commands(stderr=SGLANG_ABI_WARNINGS))
    message = failing(evaluate(HOST, raw, GPU))["provider_lib"]
    assert message.startswith(
        "node2: libibverbs could not load libbnxt_re-rdmav34.so: Driver bnxt_re does not support "
        "the kernel ABI of 6"
    )
    assert "exists but does not suit this libibverbs/kernel" in message
    raw = make_raw(rdma=rdma_commands(stderr=PERFTEST_WARNINGS))
    assert failing(evaluate(HOST, raw, GPU)) == {}
    assert len(facts(raw)["rdma"]["warnings"]) == 2


def test_evaluate_roce_gid_not_v2() -> None:
    raw = make_raw(rdma=rdma_commands(gid3={"bnxt_re4": "RoCE v1"}))
    message = failing(evaluate(HOST, raw, GPU))["roce_gid"]
    assert message.startswith("node2: bnxt_re4 GID[3] is RoCE v1 (::ffff:192.170.5.101);")
    assert "MC_GID_INDEX" in message
    assert all(f"bnxt_re{k}" not in message for k in (0, 1, 2, 3, 5, 6, 7))


def test_evaluate_roce_gid_index_missing() -> None:
    message = failing(evaluate(HOST, make_raw(), Expectations(kind="gpu", gid_index=5)))["roce_gid"]
    assert message.startswith(
        "node2: bnxt_re0, bnxt_re1, bnxt_re2, bnxt_re3, bnxt_re4, bnxt_re5, bnxt_re6 and bnxt_re7 "
        "have no GID[5] (indexes shown: 0, 1, 2, 3);"
    )
    assert "set MC_GID_INDEX to a RoCE v2 index" in message


def test_evaluate_gpu_missing() -> None:
    bad = failing(evaluate(HOST, make_raw(gpu=gpu_commands(gpus=7)), GPU))
    assert bad == {
        "gpus": (
            "node2: amd-smi lists 7 GPUs, expected 8 MI300X GPUs; find the missing one with "
            "amd-smi list and dmesg | grep -i amdgpu (a GPU that fails to initialise drops out "
            "of the list)"
        )
    }


def test_evaluate_more_gpus_than_expected() -> None:
    message = failing(evaluate(HOST, make_raw(), Expectations(kind="gpu", gpus=4)))["gpus"]
    assert message.startswith("node2: amd-smi lists 8 GPUs, expected 4 MI300X GPUs;")
    assert "partition" in message


def test_evaluate_groups_devices_that_share_a_fault() -> None:
    rdma = rdma_commands(down=("bnxt_re1", "bnxt_re4"), gid3={"bnxt_re2": "RoCE v1"})
    bad = failing(evaluate(HOST, make_raw(rdma=rdma), GPU))
    assert bad["rdma_ports"].startswith("node2: bnxt_re1 and bnxt_re4 port 1 is PORT_DOWN (1);")
    # the down ports have no GID[3] to judge; the one wrong GID is named with its address
    assert bad["roce_gid"].startswith("node2: bnxt_re2 GID[3] is RoCE v1 (::ffff:192.170.3.101);")
    rdma = rdma_commands(gid3={"bnxt_re2": "RoCE v1", "bnxt_re6": "RoCE v1"})
    message = failing(evaluate(HOST, make_raw(rdma=rdma), GPU))["roce_gid"]
    assert message.startswith("node2: bnxt_re2 and bnxt_re6 GID[3] is RoCE v1;")


def test_evaluate_unreadable_ibv_devinfo() -> None:
    rdma = rdma_commands()
    rdma["ibv_devinfo"]["stdout"] = "garbage\n" + rdma["ibv_devinfo"]["stdout"]
    message = failing(evaluate(HOST, make_raw(rdma=rdma), GPU))["rdma_ports"]
    assert message.startswith(
        "node2: cannot read port states: ibv_devinfo -v: line 1: expected ibv_devinfo to start "
        "with 'hca_id:"
    )


def test_evaluate_gpu_model_and_kfd() -> None:
    raw = make_raw(gpu=gpu_commands(model="AMD Instinct MI250X"))
    message = failing(evaluate(HOST, raw, GPU))["gpus"]
    assert message.startswith("node2: the GPUs are AMD Instinct MI250X, expected MI300X;")
    assert failing(evaluate(HOST, raw, Expectations(kind="gpu", gpu_model=None))) == {}
    message = failing(evaluate(HOST, make_raw(kfd=False), GPU))["gpus"]
    assert message.startswith("node2: /dev/kfd is missing, so the amdgpu driver is not loaded")


def test_evaluate_no_runtime_and_daemon_down() -> None:
    assert failing(evaluate(HOST, make_raw(runtime="none"), GPU)) == {
        "runtime": (
            "node2: no container runtime: neither podman nor docker is installed; install one "
            "(apt install podman)"
        )
    }
    message = failing(evaluate(HOST, make_raw(runtime="docker-down"), GPU))["runtime"]
    assert message == (
        "node2: docker 28.2.2 is installed but `docker info` failed (Cannot connect to the Docker "
        "daemon at tcp://127.0.0.1:2375. Is the docker daemon running?); fix it "
        "(systemctl start docker)"
    )


def test_evaluate_disk_low() -> None:
    assert failing(evaluate(HOST, make_raw(free_gb=12.34), GPU)) == {
        "disk": (
            "node2: only 12.3 GB free on /var/lib/containers, need 50 GB for worker images; free "
            "space or move container storage to a larger disk"
        )
    }


def test_evaluate_mesh_names_each_unreachable_peer() -> None:
    reach = [
        {"address": "10.0.0.12", "port": 22, "ok": True, "error": None},
        {"address": "10.0.0.13", "port": 30000, "ok": False, "error": "Connection refused"},
        {"address": "10.0.0.14", "port": 22, "ok": False, "error": "timed out after 2 s"},
    ]
    message = failing(evaluate(HOST, make_raw(reach=reach), GPU))["mesh"]
    assert message == (
        "node2: cannot reach 10.0.0.13:30000 (Connection refused) and 10.0.0.14:22 (timed out "
        "after 2 s); open these ports between the hosts (firewall, routes) and check the peers "
        "are up"
    )
    assert "10.0.0.12" not in message


def test_evaluate_systemd_states() -> None:
    raw = make_raw()
    raw["commands"]["systemctl"] = cmd(["systemctl", "is-system-running"], 1, "degraded\n")
    check = by_name(evaluate(HOST, raw, GPU))["systemd"]
    assert check.ok and "degraded" in check.message and "systemctl --failed" in check.message
    raw["commands"]["systemctl"] = cmd(["systemctl", "is-system-running"], 1, "starting\n")
    assert "still booting" in failing(evaluate(HOST, raw, GPU))["systemd"]
    raw["systemd"] = False
    raw["commands"]["systemctl"] = cmd(["systemctl", "is-system-running"], 1, "offline\n")
    assert failing(evaluate(HOST, raw, GPU))["systemd"].startswith(
        "node2: systemd is not PID 1 (/run/systemd/system is missing)"
    )


def test_evaluate_nothing_installed() -> None:
    raw = make_raw(
        rdma={
            "ibv_devices": missing(["ibv_devices"]),
            "ibv_devinfo": missing(["ibv_devinfo", "-v"]),
        },
        gpu={
            "amd_smi_list": missing(["amd-smi", "list", "--json"]),
            "amd_smi_static": missing(["amd-smi", "static", "--asic", "--json"]),
            "rocm_smi": missing(["rocm-smi", "--showproductname", "--json"]),
        },
        runtime="none",
        provider=False,
        kfd=True,
    )
    bad = failing(evaluate(HOST, raw, GPU))
    assert list(bad) == [
        "gpus",
        "rdma_devices",
        "rdma_ports",
        "provider_lib",
        "roce_gid",
        "runtime",
    ]
    assert "neither amd-smi nor rocm-smi is installed" in bad["gpus"]
    assert "ibv_devices is not installed" in bad["rdma_devices"]
    assert "ibv_devinfo is not installed" in bad["rdma_ports"]
    assert "libbnxt_re-rdmav34.so not found at /usr/lib64/libibverbs/" in bad["provider_lib"]


def test_evaluate_ibv_devices_failed() -> None:
    rdma = {
        "ibv_devices": cmd(["ibv_devices"], 255, "", FAILED_LIST),
        "ibv_devinfo": cmd(["ibv_devinfo", "-v"], 255, "", FAILED_LIST),
    }
    message = failing(evaluate(HOST, make_raw(rdma=rdma), GPU))["rdma_devices"]
    assert message == (
        "node2: ibv_devices exited 255: Failed to get IB devices list: Function not implemented; "
        "load the RDMA stack (modprobe bnxt_re ib_uverbs) and check dmesg | grep bnxt"
    )


def test_failure_messages_are_short_and_name_the_host() -> None:
    scenarios = [
        make_raw(provider=False),
        make_raw(rdma=rdma_commands(absent=tuple(f"bnxt_re{k}" for k in range(8)))),
        make_raw(rdma=rdma_commands(down=tuple(f"bnxt_re{k}" for k in range(8)))),
        make_raw(rdma=rdma_commands(stderr=SGLANG_ABI_WARNINGS)),
        make_raw(gpu=gpu_commands(gpus=3), runtime="docker-down", free_gb=1),
        make_raw(
            reach=[
                {"address": f"10.0.0.{i}", "port": 22, "ok": False, "error": "x"} for i in range(40)
            ]
        ),
    ]
    messages = [c.message for raw in scenarios for c in evaluate(HOST, raw, GPU) if not c.ok]
    assert len(messages) >= 10
    assert all(m.startswith("node2: ") and len(m) <= 300 for m in messages), max(messages, key=len)


def test_check_to_dict_and_expectations() -> None:
    check = Check("disk", False, "node2: full", skipped=False)
    assert check.to_dict() == {
        "name": "disk",
        "ok": False,
        "message": "node2: full",
        "skipped": False,
        "emulated": False,
    }
    assert Expectations(kind="gpu").provider_lib == PROVIDER
    with pytest.raises(ValueError, match="kind must be 'gpu' or 'cpu'"):
        Expectations(kind="router")


# --------------------------------------------------------------------------- memlock


def test_memlock_passes_where_root_may_raise_it() -> None:
    check = by_name(evaluate(HOST, make_raw(), GPU))["memlock"]
    assert check.ok and not check.emulated
    assert "memlock unlimited" in check.message


def test_memlock_on_a_host_without_cap_sys_resource_names_the_fix() -> None:
    message = failing(evaluate(HOST, make_raw(memlock=MEMLOCK_CAPPED), GPU))["memlock"]
    assert message.startswith(f"{HOST}: podman cannot give the workers memlock unlimited")
    assert "no CAP_SYS_RESOURCE here" in message and "8388608 bytes" in message
    assert "--rlimit=RLIMIT_MEMLOCK=infinity" in message  # raise it where the host is made
    assert "`pdctl: {memlock: inherit}`" in message  # or do without RDMA's setting


def test_memlock_fix_follows_the_runtime() -> None:
    refused = {**MEMLOCK_CAPPED, "cap_sys_resource": True}
    podman = failing(evaluate(HOST, make_raw(memlock=refused), GPU))["memlock"]
    assert "DefaultLimitMEMLOCK=infinity in /etc/systemd/system.conf" in podman
    assert "setrlimit failed (ValueError: not allowed to raise maximum limit)" in podman
    raw = make_raw(runtime="none", memlock=refused)
    raw["commands"]["docker_version"] = cmd(["docker", "--version"], 0, "Docker version 28.2.2\n")
    raw["commands"]["docker_info"] = cmd(["docker", "info", "--format", "{{json .}}"], 0, "{}\n")
    docker = failing(evaluate(HOST, raw, GPU))["memlock"]
    assert "drop-in for docker.service and containerd.service" in docker


def test_memlock_clamped_by_the_runtime_passes_as_emulated() -> None:
    raw = make_raw(memlock=MEMLOCK_CAPPED)
    version = f"crun version 1.8.1\nspec: 1.0.0\n{runtime.RLIMIT_CLAMP_MARK} to this host's limits"
    info = {"host": {"ociRuntime": {"name": "crun", "path": "/opt/x/crun", "version": version}}}
    raw["commands"]["podman_info"]["stdout"] = json.dumps(info)
    check = by_name(evaluate(HOST, raw, GPU))["memlock"]
    assert check.ok and check.emulated and check.to_dict()["emulated"] is True
    assert "memlock unlimited emulated" in check.message and "/opt/x/crun" in check.message
    assert "workers run with memlock 8388608 bytes" in check.message


def test_memlock_probed_without_root_or_not_at_all() -> None:
    as_user = {**MEMLOCK_CAPPED, "euid": 1000}
    message = failing(evaluate(HOST, make_raw(memlock=as_user), GPU))["memlock"]
    assert "not checked: the probe ran as uid 1000, not root (fix sudo first)" in message
    raw = make_raw()
    del raw["memlock"]  # from a pdctl before the check
    assert "was not probed" in failing(evaluate(HOST, raw, GPU))["memlock"]
