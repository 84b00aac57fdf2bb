"""The lab hosts' OCI runtime wrapper (pdctl/lab/runtime/crun_clamp.py) and the inotify budget."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pdctl.lab import inotify, manager, registry, state
from pdctl.lab.runtime import crun_clamp
from pdctl.lab.runtime.crun_clamp import INFINITY, clamp, clamp_document
from pdctl.lab.state import LabHost, LabState
from pdctl.onhost.hardware import runtime

# What podman 4.3 writes for `--ulimit memlock=-1:-1` as root (it adds nofile and nproc).
PODMAN_RLIMITS = [
    {"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576},
    {"type": "RLIMIT_MEMLOCK", "hard": INFINITY, "soft": INFINITY},
    {"type": "RLIMIT_NPROC", "hard": 1048576, "soft": 1048576},
]
# A machine of this project's kind: `prlimit --nofile=20000:20000 --nproc=96364:96364
# --memlock=8388608:8388608`, no CAP_SYS_RESOURCE.
LOW = {"RLIMIT_NOFILE": 20000, "RLIMIT_MEMLOCK": 8388608, "RLIMIT_NPROC": 96364}
CONMON_CREATE = [
    "--log-format=json",
    "--log",
    "/run/containers/storage/overlay-containers/c1/userdata/oci-log",
    "--cgroup-manager",
    "disabled",
    "create",
    "--bundle",
    "/var/lib/containers/storage/overlay-containers/c1/userdata",
    "--pid-file",
    "/run/containers/storage/overlay-containers/c1/userdata/pidfile",
    "--no-new-keyring",
    "c1",
]


def test_podman_defaults_are_clamped_to_the_low_limits() -> None:
    granted, changes = clamp(PODMAN_RLIMITS, LOW)
    assert granted == [
        {"type": "RLIMIT_NOFILE", "hard": 20000, "soft": 20000},
        {"type": "RLIMIT_MEMLOCK", "hard": 8388608, "soft": 8388608},
        {"type": "RLIMIT_NPROC", "hard": 96364, "soft": 96364},
    ]
    assert [crun_clamp.describe(c) for c in changes] == [
        "nofile 1048576 requested, 20000 granted (this machine cannot raise rlimits)",
        "memlock unlimited requested, 8388608 granted (this machine cannot raise rlimits)",
        "nproc 1048576 requested, 96364 granted (this machine cannot raise rlimits)",
    ]


@pytest.mark.parametrize(
    ("entry", "granted"),
    [
        # within what the host grants: left exactly as asked
        ({"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 4096}, None),
        ({"type": "RLIMIT_MEMLOCK", "soft": 8388608, "hard": 8388608}, None),
        # a soft limit below the host's hard one stays; only the hard one comes down
        ({"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 1048576}, (1024, 20000)),
        ({"type": "RLIMIT_MEMLOCK", "soft": 65536, "hard": INFINITY}, (65536, 8388608)),
        # a type the host says nothing about: crun's business
        ({"type": "RLIMIT_BOGUS", "soft": 5, "hard": 9}, None),
    ],
)
def test_one_rlimit(entry: dict[str, Any], granted: tuple[int, int] | None) -> None:
    kept, changes = clamp([entry], LOW)
    if granted is None:
        assert kept == [entry] and changes == []
    else:
        assert (kept[0]["soft"], kept[0]["hard"]) == granted
        assert changes == [
            {
                "rlimit": entry["type"],
                "requested": [entry["soft"], entry["hard"]],
                "granted": list(granted),
            }
        ]
        assert kept[0]["soft"] <= kept[0]["hard"]


def test_a_host_that_can_raise_keeps_every_rlimit() -> None:
    assert clamp(PODMAN_RLIMITS, {}) == (PODMAN_RLIMITS, [])


def test_config_json_and_exec_process_documents() -> None:
    config = {"ociVersion": "1.0.2", "process": {"args": ["sh"], "rlimits": list(PODMAN_RLIMITS)}}
    assert len(clamp_document(config, "create", LOW)) == 3
    assert config["process"]["rlimits"][1] == {
        "type": "RLIMIT_MEMLOCK",
        "hard": 8388608,
        "soft": 8388608,
    }
    # podman exec copies the container's process, rlimits included, into --process's file
    process = {"args": ["true"], "rlimits": list(PODMAN_RLIMITS)}
    assert len(clamp_document(process, "exec", LOW)) == 3
    assert process["rlimits"] == clamp(PODMAN_RLIMITS, LOW)[0]
    assert clamp_document({"process": {"args": ["sh"]}}, "run", LOW) == []  # no rlimits asked
    assert clamp_document({"args": ["sh"]}, "create", LOW) == []


def test_command_and_files_from_crun_arguments(tmp_path: Path) -> None:
    command, args = crun_clamp.command_of(CONMON_CREATE)
    assert command == "create" and args[-1] == "c1"
    bundle = "/var/lib/containers/storage/overlay-containers/c1/userdata"
    assert crun_clamp.process_file(command, args, "/") == Path(bundle, "config.json")
    assert crun_clamp.process_file("run", ["--bundle=/b", "c"], "/") == Path("/b/config.json")
    assert crun_clamp.process_file("run", ["c"], str(tmp_path)) == tmp_path / "config.json"
    exec_args = ["--pid-file", "/p", "--process", "exec-process-1", "--detach", "c1"]
    assert crun_clamp.command_of(["--root", "/run/crun", "exec", *exec_args])[0] == "exec"
    assert crun_clamp.process_file("exec", exec_args, "/d") == Path("/d/exec-process-1")
    for other in (["start", "c1"], ["kill", "c1", "9"], ["delete", "--force", "c1"], ["--version"]):
        assert crun_clamp.process_file(*crun_clamp.command_of(other), "/") is None


def test_capability_parsing() -> None:
    assert crun_clamp.can_raise("Name:\tx\nCapEff:\t000001ffffffffff\n")
    assert not crun_clamp.can_raise("CapEff:\t00000000fcecafff\n")  # an nspawn host here
    assert not crun_clamp.can_raise("")


def test_adjust_rewrites_the_bundle_and_logs_each_change_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(crun_clamp, "ceilings", lambda: LOW)
    config = tmp_path / "config.json"
    log = tmp_path / "rlimits.jsonl"
    for mode in (0o600, 0o640):  # a second container asks the same: the log does not grow
        config.write_text(json.dumps({"process": {"rlimits": PODMAN_RLIMITS}}))
        config.chmod(mode)
        crun_clamp.adjust(["create", "--bundle", str(tmp_path), "c"], "/", log)
        assert json.loads(config.read_text())["process"]["rlimits"][1]["hard"] == 8388608
        assert config.stat().st_mode & 0o777 == mode  # it holds the container's secrets
    assert len(log.read_text().splitlines()) == 3
    assert crun_clamp.emulated(log)[0] == (
        "memlock unlimited requested, 8388608 granted (this machine cannot raise rlimits)"
    )
    log.write_text(log.read_text() + '{"torn": \n')  # a crash mid-line loses nothing else
    assert len(crun_clamp.emulated(log)) == 3
    assert crun_clamp.emulated(tmp_path / "none.jsonl") == []


def test_main_execs_crun_with_the_same_arguments_even_when_it_cannot_clamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[tuple[str, list[str]]] = []

    def execv(path: str, argv: list[str]) -> None:
        ran.append((path, argv))

    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    crun_clamp.main(["create", "c"])  # unreadable config: crun gets it as it is
    crun_clamp.main(["start", "c"])
    assert ran == [
        ("/usr/bin/crun", ["/usr/bin/crun", "create", "c"]),
        ("/usr/bin/crun", ["/usr/bin/crun", "start", "c"]),
    ]


def test_the_wrapper_is_an_executable_that_tells_the_preflight_it_clamps() -> None:
    path = Path(crun_clamp.__file__)
    assert os.access(path, os.X_OK)
    assert path.read_text().startswith("#!/usr/bin/python3 -IS\n")
    assert crun_clamp.VERSION_NOTE.startswith(runtime.RLIMIT_CLAMP_MARK)


# --------------------------------------------------------------------------- inotify


def test_inotify_rises_for_every_lab_and_returns_with_the_last(tmp_path: Path) -> None:
    sysctl, restore = tmp_path / "max_user_instances", tmp_path / "restore"
    sysctl.write_text("128\n")
    inotify.ensure(6, sysctl, restore)  # two test labs: the default suffices
    assert sysctl.read_text() == "128\n" and not restore.exists()
    inotify.ensure(9, sysctl, restore)  # a third: past the default's room
    assert int(sysctl.read_text()) == inotify.FLOOR and restore.read_text() == "128\n"
    inotify.ensure(9 + 16, sysctl, restore)  # a 16-host lab beside them
    assert int(sysctl.read_text()) == inotify.FLOOR and restore.read_text() == "128\n"
    inotify.ensure(200, sysctl, restore)
    assert int(sysctl.read_text()) == 200 * inotify.PER_HOST
    assert restore.read_text() == "128\n"  # the machine's own value, recorded once
    inotify.ensure(25, sysctl, restore)
    assert int(sysctl.read_text()) == 200 * inotify.PER_HOST  # never lowered while labs run
    inotify.restore_when_idle(3, sysctl, restore)  # another lab still runs
    assert int(sysctl.read_text()) == 200 * inotify.PER_HOST
    inotify.restore_when_idle(0, sysctl, restore)
    assert sysctl.read_text() == "128" and not restore.exists()
    inotify.restore_when_idle(0, sysctl, restore)  # nothing to put back
    assert sysctl.read_text() == "128"


def test_inotify_leaves_a_higher_machine_value_alone(tmp_path: Path) -> None:
    sysctl, restore = tmp_path / "max_user_instances", tmp_path / "restore"
    sysctl.write_text("65536\n")
    inotify.ensure(100, sysctl, restore)
    assert sysctl.read_text() == "65536\n" and not restore.exists()


def test_running_hosts_are_counted_in_every_workspace_lab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "REGISTRY", tmp_path / "registry")
    (tmp_path / "registry").mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    labs = {"mine": [os.getpid()] * 3, "other": [os.getpid()] * 16, "crashed": [dead.pid] * 4}
    for lab_id, (name, pids) in enumerate(labs.items()):
        lab_dir = tmp_path / name / ".pdctl" / "lab"
        hosts = [
            LabHost(name=f"node{i}", index=i, kind="gpu", address=f"10.0.0.{i}", nspawn_pid=pid)
            for i, pid in enumerate(pids, 1)
        ]
        state.save(lab_dir / "lab.json", LabState(lab_id=lab_id, hosts=hosts))
        registry.claim(lab_id, lab_dir)
    mine = tmp_path / "mine" / ".pdctl" / "lab"
    assert manager._hosts_running(except_lab=mine) == 16  # the crashed lab's hosts are gone
    assert manager._hosts_running(except_lab=tmp_path / "elsewhere") == 19
