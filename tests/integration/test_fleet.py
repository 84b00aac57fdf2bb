"""Fleets end to end on a 5-host lab: real sshd, real Ansible, the fake hardware's faults."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdctl.doors import inventory
from pdctl.doors.runner import STRATEGY_VARIABLE, run_playbook
from pdctl.doors.workspace import Workspace
from pdctl.operations import fleet as fleets
from tests.support import Lab, pdctl, pdctl_json, require_lab, start_lab

FAULTS = {
    "node2": ("nic-missing", "bnxt_re7"),
    "node3": ("port-down", "bnxt_re3"),
    "node4": ("provider-lib-missing", None),
    "node5": ("sshd-down", None),
}


@pytest.fixture(scope="module")
def lab5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_lab()
    home = tmp_path_factory.mktemp("lab5")
    lab = start_lab(home, hosts=5, cpu_hosts=0)
    yield lab
    pdctl(home, "lab", "down")


def _add_line(lab: Lab) -> list[str]:
    return lab.status()["fleet_add"].split()[1:]  # drop the leading "pdctl"


def _failed(doc: dict) -> dict[str, list[dict]]:
    return {
        h["address"]: [c for c in h["checks"] if not c["ok"]] for h in doc["hosts"] if not h["ok"]
    }


def test_faulty_hosts_are_named_with_their_findings(lab5: Lab) -> None:
    for host, (kind, arg) in FAULTS.items():
        lab5.fault(host, kind, arg)
    address = {h["name"]: h["address"] for h in lab5.status()["hosts"]}
    try:
        add = pdctl(lab5.home, *_add_line(lab5), check=False)
        assert add.returncode == 5, add.stderr
        assert "Traceback" not in add.stderr
        assert "4 of 5 host(s) failed preflight" in add.stderr
        shown = {h["address"]: h for h in pdctl_json(lab5.home, "fleet", "show", "lab")["hosts"]}
        at_add = shown[address["node5"]]["preflight"]["checks"]
        assert [c["name"] for c in at_add] == ["ssh"]
        assert "Unable to connect to port 22" in at_add[0]["message"]

        check = pdctl(lab5.home, "--json", "fleet", "check", "lab", check=False)
        assert check.returncode == 5
        doc = json.loads(check.stdout)
        assert doc["fleet"] == "lab"
        for host in doc["hosts"]:
            assert set(host) >= {"name", "address", "ok", "checks"}
            for entry in host["checks"]:
                assert set(entry) >= {"name", "ok", "message"}
        failed = _failed(doc)
        assert sorted(failed) == sorted(address[h] for h in FAULTS)  # exactly the four
        text = {addr: " ".join(c["message"] for c in checks) for addr, checks in failed.items()}
        assert "bnxt_re7" in text[address["node2"]]
        assert [c["name"] for c in failed[address["node2"]]] == ["rdma_devices"]
        assert "bnxt_re3 port 1 is PORT_DOWN" in text[address["node3"]]
        assert "libbnxt_re-rdmav34.so" in text[address["node4"]]
        # never reached, so no key is pinned for it: refused, nothing checked on it
        assert [c["name"] for c in failed[address["node5"]]] == ["ssh"]
        assert "no host key is pinned for it" in text[address["node5"]]
        healthy = next(h for h in doc["hosts"] if h["address"] == address["node1"])
        assert healthy["ok"] and {c["name"] for c in healthy["checks"]} >= {
            "ssh",
            "sudo",
            "gpus",
            "rdma_devices",
            "rdma_ports",
            "provider_lib",
            "roce_gid",
            "runtime",
            "memlock",
            "disk",
            "mesh",
        }
    finally:
        for host in FAULTS:
            lab5.fault(host, "clear")
    # Reachable again, node5 is still refused (and only it) until the fix it names pins it.
    doc = pdctl_json(lab5.home, "fleet", "check", "lab", check=False)
    refused = _failed(doc)
    assert list(refused) == [address["node5"]]
    fix = f"pdctl fleet add lab --host {address['node5']} --repin"
    assert fix in refused[address["node5"]][0]["message"]
    pdctl(lab5.home, *fix.split()[1:])
    doc = pdctl_json(lab5.home, "fleet", "check", "lab")
    assert all(h["ok"] for h in doc["hosts"]) and len(doc["hosts"]) == 5
    node5 = next(h for h in doc["hosts"] if h["address"] == address["node5"])
    assert node5["kind"] == "gpu"  # its facts were gathered when it was pinned


def test_a_host_without_passwordless_sudo_is_named_and_still_probed(lab5: Lab) -> None:
    address = {h["name"]: h["address"] for h in lab5.status()["hosts"]}
    pdctl(lab5.home, *_add_line(lab5), check=False)
    lab5.fault("node1", "sudo-password")
    try:
        check = pdctl(
            lab5.home, "--json", "fleet", "check", "lab", "--limit", address["node1"], check=False
        )
        assert check.returncode == 5 and "Traceback" not in check.stderr
        failed = _failed(json.loads(check.stdout))[address["node1"]]
        # sudo first; the probe ran without it (rootless podman fails too, which is true)
        assert failed[0]["name"] == "sudo"
        assert "probe" not in {c["name"] for c in failed}
        assert "needs a password" in failed[0]["message"]
        assert "--no-become" in failed[0]["message"]  # the fix is named
        host = json.loads(check.stdout)["hosts"][0]
        # the probe still ran (as the SSH user): the hardware checks are there and pass
        assert {c["name"] for c in host["checks"] if c["ok"]} >= {"gpus", "rdma_devices"}
    finally:
        lab5.fault("node1", "clear")
    again = pdctl_json(lab5.home, "fleet", "check", "lab", "--limit", address["node1"])
    assert again["hosts"][0]["ok"]


def test_second_add_is_a_no_op(lab5: Lab) -> None:
    pdctl(lab5.home, *_add_line(lab5), check=False)
    inventory = lab5.home / "inventories" / "lab"
    before = {p: p.read_bytes() for p in sorted(inventory.rglob("*")) if p.is_file()}
    again = pdctl(lab5.home, "--json", *_add_line(lab5), check=False)
    assert json.loads(again.stdout)["changed"] is False
    after = {p: p.read_bytes() for p in sorted(inventory.rglob("*")) if p.is_file()}
    assert after == before


def test_inventory_is_plain_ansible(lab5: Lab) -> None:
    pdctl(lab5.home, *_add_line(lab5), check=False)
    inventory = lab5.home / "inventories" / "lab"
    listed = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(inventory), "--list"],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(listed.stdout)
    assert sorted(doc["pd_gpu_hosts"]["hosts"]) == sorted(
        h["address"] for h in lab5.status()["hosts"]
    )
    assert "WARNING" not in listed.stderr
    ping = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible"),
            "-i",
            str(inventory),
            "all",
            "-m",
            "ansible.builtin.ping",
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=lab5.home,
    )
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert ping.stdout.count("SUCCESS") == 5


def test_changed_host_key_is_refused_until_repinned(
    lab5: Lab, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pdctl(lab5.home, *_add_line(lab5), check=False)
    address = lab5.host("node3")["address"]
    lab5.ssh(
        "node3",
        "rm -f /etc/ssh/ssh_host_*; ssh-keygen -A >/dev/null; systemctl restart ssh",
        user="root",
    )
    proc = pdctl(lab5.home, "--json", "fleet", "check", "lab", "--limit", address, check=False)
    assert proc.returncode == 5
    ssh_check = json.loads(proc.stdout)["hosts"][0]["checks"][0]
    assert ssh_check["name"] == "ssh" and not ssh_check["ok"]
    assert "host key changed" in ssh_check["message"] and "--repin" in ssh_check["message"]
    # Ansible, under both strategies pdctl can run it with, refuses the host as well.
    inventory_dir = lab5.home / "inventories" / "lab"
    # A ControlPersist master opened before the key changed (earlier tests) is still the same
    # authenticated session and would be reused: new connections are what must be refused.
    monkeypatch.setenv("ANSIBLE_SSH_CONTROL_PATH_DIR", str(tmp_path / "cp"))
    for strategy in ("mitogen", "linear"):
        monkeypatch.setenv(STRATEGY_VARIABLE, strategy)
        summary = run_playbook("preflight.yml", inventory_dir, limit=address)
        assert summary.rc != 0 and address in summary.unreachable(), (strategy, summary)
        # Only the role's argument check (on the controller) ran: nothing reached the host.
        reached = {r.action for r in summary.results if r.host == address and r.status == "ok"}
        assert reached <= {"ansible.builtin.validate_argument_spec"}, (strategy, reached)
    repin = pdctl(
        lab5.home, "--json", "fleet", "add", "lab", "--host", f"pdops@{address}", "--repin"
    )
    assert json.loads(repin.stdout)["hosts"][0]["ok"] is True


def test_list_show_and_remove(lab5: Lab, tmp_path: Path) -> None:
    pdctl(lab5.home, *_add_line(lab5), check=False)
    listing = pdctl_json(lab5.home, "fleet", "list")["fleets"]
    assert [f["name"] for f in listing] == ["lab"] and listing[0]["hosts"] == 5
    shown = pdctl_json(lab5.home, "fleet", "show", "lab")
    host = shown["hosts"][0]
    assert (
        host["facts"]["gpus"]["count"] == 8
        and host["facts"]["gpus"]["model"] == "MI300X"  # dstack's spelling
    )
    assert len(host["facts"]["rdma"]["devices"]) == 8
    assert host["preflight"]["checked_at"]
    other = pdctl(
        lab5.home, "fleet", "add", "other", "--host", f"pdops@{host['address']}", check=False
    )
    assert other.returncode == 3 and "already belongs to fleet 'lab'" in other.stderr
    missing = pdctl(lab5.home, "fleet", "show", "nope", check=False)
    assert missing.returncode == 7 and "no fleet named 'nope'" in missing.stderr
    pdctl(lab5.home, "fleet", "remove", "lab", "--host", host["address"], "-y")
    assert pdctl_json(lab5.home, "fleet", "list")["fleets"][0]["hosts"] == 4
    pdctl(lab5.home, "fleet", "remove", "lab", "-y")
    assert pdctl_json(lab5.home, "fleet", "list")["fleets"] == []


def _host_key(lab: Lab, name: str) -> str:
    """The fingerprint of a lab host's ED25519 key, read on the host itself."""
    line = lab.ssh(name, "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub", user="root").stdout
    return line.split()[1]


def test_a_jump_host_is_pinned_at_add_and_checked_on_every_path(
    lab5: Lab, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pdctl(lab5.home, "fleet", "remove", "lab", "-y", check=False)  # node2 and node3 are ours
    jump, hosts = lab5.host("node1"), [lab5.host("node2"), lab5.host("node3")]
    via = f"pdops@{jump['address']}"
    add = [
        *("fleet", "add", "jumped", "--identity-file", jump["identity_file"]),
        *(arg for h in hosts for arg in ("--host", f"pdops@{h['address']}")),
        *("--proxy-jump", via),
    ]
    try:
        added = pdctl_json(lab5.home, *add)
        assert added["proxy_jump"] == {"host": via, "fingerprint": _host_key(lab5, "node1")}
        assert all(h["ok"] for h in added["hosts"])  # the preflight reached them through it
        lab5.ssh(
            "node1",
            "rm -f /etc/ssh/ssh_host_*; ssh-keygen -A >/dev/null; systemctl restart ssh",
            user="root",
        )
        repin = f"pdctl fleet add jumped --proxy-jump {via} --repin"
        # pdctl's SSH refuses every host behind it, naming the jump host and the fix
        check = pdctl(lab5.home, "--json", "fleet", "check", "jumped", check=False)
        assert check.returncode == 5
        for host in json.loads(check.stdout)["hosts"]:
            assert [c["name"] for c in host["checks"]] == ["ssh"]
            message = host["checks"][0]["message"]
            assert message.startswith(f"jump host {via}: host key changed!"), message
            assert repin in message
        # Ansible refuses them too, under both strategies (its ProxyCommand pins the jump hop)
        jumped = inventory.load(Workspace(lab5.home), "jumped")
        inventory_dir = inventory.fleet_dir(Workspace(lab5.home), "jumped")
        monkeypatch.setenv("ANSIBLE_SSH_CONTROL_PATH_DIR", str(tmp_path / "cp"))
        target = hosts[0]["address"]
        for strategy in ("linear", "mitogen"):
            monkeypatch.setenv(STRATEGY_VARIABLE, strategy)
            summary = run_playbook("preflight.yml", inventory_dir, limit=target)
            assert summary.rc != 0 and target in summary.unreachable(), (strategy, summary)
            reached = {r.action for r in summary.results if r.status == "ok"}
            assert reached <= {"ansible.builtin.validate_argument_spec"}, (strategy, reached)
            reason = fleets.unreachable_reason(jumped, target, summary.unreachable()[target])
            assert reason.startswith(f"jump host {via}: ") and repin in reason, reason
        # the fix named: the new key is pinned and shown, and every path gets through again
        repinned = pdctl_json(lab5.home, *repin.split()[1:])
        assert repinned["proxy_jump"]["fingerprint"] == _host_key(lab5, "node1")
        assert all(h["ok"] for h in pdctl_json(lab5.home, "fleet", "check", "jumped")["hosts"])
        summary = run_playbook("preflight.yml", inventory_dir, limit=target)
        assert summary.rc == 0, summary  # under Mitogen (still set)
    finally:
        pdctl(lab5.home, "fleet", "remove", "jumped", "-y", check=False)
