"""pdctl/operations/fleet.py without a lab: a fleet's hardware expectations (`fleet add
--gpu/--gpu-vendor/--nic-driver/--link-layer` become settings and reach the pd_preflight role's
variables), and its host keys and hosts in use (what is refused, named and kept)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import paramiko
import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from pdctl.core.errors import CheckFailed, HostError, InputError
from pdctl.core.fleet_model import Fleet, FleetHost, FleetSettings
from pdctl.core.plan import Plan, build
from pdctl.doors import inventory, ssh
from pdctl.doors import service as services
from pdctl.doors.workspace import Workspace
from pdctl.operations import fleet as fleets
from pdctl.scaler import setup
from tests.support import contacted, listener, pdctl
from tests.unit.core.plan.test_placement import fleet, host, lab_spec

# ------------------------------------------------------------------ a fleet's hardware expectations


def test_defaults_are_todays_amd_fleet() -> None:
    settings = fleets._settings(None, fleets.AddOptions(hosts=[]))
    assert (settings.gpu_model, settings.gpu_vendor) == ("MI300X", "amd")
    assert (settings.nic_driver, settings.link_layer) == ("bnxt_re", "eth")
    assert settings.provider_lib == "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"


def test_nvidia_settings_reach_the_role(tmp_path: Path) -> None:
    options = fleets.AddOptions(hosts=[], gpu_model="H200", nic_driver="mlx5", link_layer="ib")
    settings = fleets._settings(None, options)
    assert (settings.gpu_model, settings.gpu_vendor) == ("H200", "nvidia")
    workspace = Workspace(tmp_path)
    inventory.save(workspace, Fleet(name="hgx", settings=settings))
    all_vars = yaml.safe_load(
        (inventory.fleet_dir(workspace, "hgx") / "group_vars/all.yml").read_text()
    )
    assert (
        all_vars.items()
        >= {
            "pd_preflight_gpu_model": "H200",
            "pd_preflight_gpu_vendor": "nvidia",
            "pd_preflight_nic_driver": "mlx5",
            "pd_preflight_link_layer": "ib",
            "pd_preflight_expected_nics": 8,
        }.items()
    )
    assert inventory.load(workspace, "hgx").settings == settings
    # A later add without the options keeps them; --expect-nics still works.
    again = fleets._settings(settings, fleets.AddOptions(hosts=[], expect_nics=4))
    assert (again.gpu_vendor, again.nic_driver, again.expect_nics) == ("nvidia", "mlx5", 4)


def test_explicit_vendor_wins_over_the_models() -> None:
    options = fleets.AddOptions(hosts=[], gpu_model="MI300X", gpu_vendor="nvidia")
    assert fleets._settings(None, options).gpu_vendor == "nvidia"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (fleets.AddOptions(hosts=[], gpu_model="H200;rm"), "--gpu 'H200;rm' is not a GPU model"),
        (fleets.AddOptions(hosts=[], nic_driver="../mlx5"), "--nic-driver '../mlx5'"),
        (fleets.AddOptions(hosts=[], link_layer="fc"), "fleet settings"),
    ],
)
def test_bad_values_are_refused(options: fleets.AddOptions, words: str) -> None:
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(";", ";")):
        fleets._settings(None, options)


def test_the_cli_refuses_before_contacting_any_host(workspace: Path) -> None:
    proc = pdctl(
        workspace, "fleet", "add", "f", "--host", "127.0.0.1:1", "--nic-driver", "mlx5 x",
        check=False,
    )  # fmt: skip
    assert proc.returncode == 3
    assert "--nic-driver 'mlx5 x' is not a driver name" in proc.stderr
    assert not (workspace / "inventories" / "f").exists()
    usage = pdctl(workspace, "fleet", "add", "f", "--host", "h", "--link-layer", "x", check=False)
    assert usage.returncode == 2


def test_stored_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="nic_driver"):
        FleetSettings(nic_driver="mlx5/../x")


# ----------------------------------------------------------------------- host keys and hosts in use

# What OpenSSH prints when it refuses a key (tests/unit/test_ssh.py has more).
CHANGED_JUMP = "Host key for 10.0.0.1 has changed and you have requested strict checking."
MITOGEN = "Host key checking is enabled, and SSH reported an unrecognized or mismatching host key."
PROXY_CLOSED = "kex_exchange_identification: Connection closed by remote host\r\n" + (
    "Connection closed by UNKNOWN port 65535"
)


def _no_progress(_line: str) -> None:
    pass


def _rendered(settings: FleetSettings, inventory_dir: str) -> list[str]:
    """ansible_ssh_common_args as Ansible's ssh and Mitogen get it: templated, then split
    (both split with shlex.split)."""
    templar = Templar(loader=DataLoader(), variables={"inventory_dir": inventory_dir})
    return shlex.split(templar.template(trust_as_template(inventory.ssh_common_args(settings))))


def test_ansible_accepts_only_the_fleets_pins() -> None:
    assert _rendered(FleetSettings(), "/ws/inventories/f") == [
        "-o",
        "UserKnownHostsFile=/ws/inventories/f/known_hosts.txt",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "StrictHostKeyChecking=yes",
    ]


def test_the_jump_hop_is_checked_against_the_same_pins_and_strictness() -> None:
    settings = FleetSettings(proxy_jump="hop@10.0.0.1:2222", identity_file="/keys/id_ed25519")
    args = _rendered(settings, "/ws/$HOME/inventories/f")  # no shell expands the $
    assert args[:6] == _rendered(FleetSettings(), "/ws/$HOME/inventories/f")
    assert args[6] == "-o" and args[7].startswith("ProxyCommand=") and len(args) == 8
    # ssh hands the ProxyCommand to a shell once it has put the host and port in.
    command = args[7].removeprefix("ProxyCommand=").replace("%h", "10.0.0.7").replace("%p", "22")
    assert shlex.split(command) == [
        "ssh",
        "-o",
        "UserKnownHostsFile=/ws/$HOME/inventories/f/known_hosts.txt",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-i",
        "/keys/id_ed25519",
        "-p",
        "2222",
        "-l",
        "hop",
        "-W",
        "[10.0.0.7]:22",
        "10.0.0.1",
    ]


def test_pdctl_reaches_the_jump_host_as_ansible_does() -> None:
    settings = FleetSettings(proxy_jump="hop@10.0.0.1:2222", identity_file="/keys/id_ed25519")
    member = FleetHost(name="10.0.0.7", address="10.0.0.7", user="pdops")
    target = inventory.target(Fleet(name="f", settings=settings, hosts=[member]), member)
    assert target.proxy_jump == ssh.Target("10.0.0.1", 2222, "hop", "/keys/id_ed25519")


def test_the_jump_host_is_stored_with_the_user_the_hosts_get() -> None:
    options = fleets.AddOptions(hosts=[], user="pdops", proxy_jump="10.0.0.1")
    assert fleets._settings(None, options).proxy_jump == "pdops@10.0.0.1"
    assert fleets._settings(None, fleets.AddOptions(hosts=[], proxy_jump="j:2222")).proxy_jump == (
        "root@j:2222"
    )


def test_a_key_path_the_jump_command_cannot_carry_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "my keys" / "id"
    key.parent.mkdir()
    key.write_text("")
    options = fleets.AddOptions(hosts=[], identity_file=str(key), proxy_jump="10.0.0.1")
    with pytest.raises(InputError, match="identity file"):
        fleets._settings(None, options)
    assert fleets._settings(None, fleets.AddOptions(hosts=[], identity_file=str(key)))


def _pinned_fleet(workspace: Workspace, hosts: list[FleetHost], pinned: list[FleetHost]) -> Fleet:
    chosen = Fleet(name="f", hosts=hosts)
    inventory.save(workspace, chosen)
    known = ssh.KnownHosts(inventory.known_hosts_file(workspace, "f"))
    for member in pinned:
        known.pin(inventory.target(chosen, member), paramiko.ECDSAKey.generate())
    known.save()
    return chosen


def test_check_refuses_a_host_without_a_pinned_key_and_checks_the_others(
    tmp_path: Path,
) -> None:
    workspace = Workspace(tmp_path)
    with listener() as closed:
        closed_port = closed.getsockname()[1]  # nothing listens there once the block ends
    with listener() as unpinned_server:
        unpinned_port = unpinned_server.getsockname()[1]
        pinned = FleetHost(name="a", address="127.0.0.1", port=closed_port, user="pdops")
        unpinned = FleetHost(name="b", address="127.0.0.1", port=unpinned_port, user="pdops")
        _pinned_fleet(workspace, [pinned, unpinned], [pinned])
        doc = fleets.check(workspace, "f", None, _no_progress)
        assert not contacted(unpinned_server)
    ssh_checks = {h["name"]: h["checks"][0] for h in doc["hosts"]}
    assert "SSH connection failed" in ssh_checks["a"]["message"]  # contacted (nothing there)
    assert ssh_checks["b"]["message"] == (
        f"pdops@127.0.0.1:{unpinned_port}: no host key is pinned for it; refusing to contact it "
        f"(if the key it offers now is the right one, pin it: "
        f"`pdctl fleet add f --host 127.0.0.1:{unpinned_port} --repin`)"
    )
    assert [c["name"] for h in doc["hosts"] for c in h["checks"]] == ["ssh", "ssh"]
    assert fleets.failure(doc) is not None
    # a check pins nothing
    assert not ssh.KnownHosts(inventory.known_hosts_file(workspace, "f")).lookup(
        ssh.Target("127.0.0.1", unpinned_port)
    )


def test_add_through_an_unreachable_jump_host_writes_nothing(tmp_path: Path) -> None:
    with listener() as closed:
        port = closed.getsockname()[1]
    options = fleets.AddOptions(hosts=["10.0.0.7"], proxy_jump=f"127.0.0.1:{port}")
    with pytest.raises(HostError, match=rf"^jump host root@127.0.0.1:{port}: SSH connection"):
        fleets.add(Workspace(tmp_path), "f", options, _no_progress)
    assert not (tmp_path / "inventories").exists()


def _jumped_fleet() -> Fleet:
    member = FleetHost(name="10.0.0.7", address="10.0.0.7", user="pdops")
    return Fleet(name="f", settings=FleetSettings(proxy_jump="hop@10.0.0.1"), hosts=[member])


@pytest.mark.parametrize(
    ("jumped", "output", "expected"),
    [
        (True, CHANGED_JUMP, "jump host hop@10.0.0.1: Ansible's ssh refused its host key"),
        (True, PROXY_CLOSED, "jump host hop@10.0.0.1: Ansible's ssh could not get through it"),
        (True, MITOGEN, "jump host hop@10.0.0.1: Ansible's ssh could not get through it"),
        (False, MITOGEN, "pdops@10.0.0.7: Ansible's ssh refused its host key"),
        (False, "Connection timed out", "10.0.0.7: Ansible could not reach it: Connection"),
    ],
)
def test_ansible_refusals_name_whose_key_and_the_fix(
    jumped: bool, output: str, expected: str
) -> None:
    chosen = _jumped_fleet()
    if not jumped:
        chosen.settings = FleetSettings()
    reason = fleets.unreachable_reason(chosen, "10.0.0.7", output)
    assert reason.startswith(expected), reason
    if "refused" in expected or "through" in expected:
        option = "--proxy-jump hop@10.0.0.1" if jumped else "--host 10.0.0.7"
        assert reason.endswith(f"`pdctl fleet add f {option} --repin`)")


def _hosts(*names: str) -> list[FleetHost]:
    """test_plan's hosts (cpuN or gpuN), each at an address of its own."""
    return [
        host(name, name[:3]).model_copy(update={"address": f"10.0.1.{i}"})
        for i, name in enumerate(names, start=1)
    ]


def deployed(workspace: Workspace) -> Plan:
    """A fleet f of CPU and GPU hosts, and a service deployed on some of them."""
    hosts = _hosts("cpu1", "cpu2", "gpu1", "gpu2", "gpu3")
    _pinned_fleet(workspace, hosts, hosts)
    spec, env = lab_spec()
    plan = build(spec, env, fleet(*hosts), secrets_digest="")
    services.save_plan(workspace, plan)
    return plan


def _what(plan: Plan, name: str) -> str:
    parts = ["router"] if plan.router.host == name else []
    parts += [s.name if s.start else f"{s.name} (spare)" for s in plan.slots() if s.host == name]
    return ", ".join(parts)


def test_remove_refuses_hosts_a_service_uses_naming_what_it_has_there(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path)
    plan = deployed(workspace)
    spare_host = next(s.host for s in plan.slots() if not s.start)
    for name in (plan.router.host, spare_host):
        with pytest.raises(CheckFailed) as refused:
            fleets.remove(workspace, "f", [name], force=False)
        assert f"service {plan.service} has {_what(plan, name)} on {name}" in refused.value.message
        assert "(spare)" in _what(plan, spare_host)
    with pytest.raises(CheckFailed, match=f"service {plan.service} has router on cpu1"):
        fleets.remove(workspace, "f", [], force=False)  # the whole fleet
    assert len(inventory.load(workspace, "f").hosts) == 5
    assert fleets.show(workspace, "f")["services"] == {plan.service: plan.hosts()}


def test_remove_takes_an_unused_host_and_with_force_a_used_one(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path)
    plan = deployed(workspace)
    unused = [h.name for h in inventory.load(workspace, "f").hosts if h.name not in plan.hosts()]
    assert unused, "the lab spec leaves a host of this fleet free"
    fleets.remove(workspace, "f", unused, force=False)
    used = plan.slots()[0]
    fleets.remove(workspace, "f", [used.host], force=True)
    kept = inventory.load(workspace, "f")
    assert used.host not in {h.name for h in kept.hosts}
    known = ssh.KnownHosts(inventory.known_hosts_file(workspace, "f"))
    assert not known.lookup(ssh.Target(used.address))  # its pin went with it
    assert all(known.lookup(inventory.target(kept, h)) for h in kept.hosts)


def test_an_unreadable_plan_may_use_any_host(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path)
    plan = deployed(workspace)
    (workspace.service_dir(plan.service) / "plan.json").write_text("{not json")
    with pytest.raises(CheckFailed, match=f"cannot tell what service {plan.service} uses"):
        fleets.remove(workspace, "f", ["cpu2"], force=False)


def test_a_removed_host_that_is_the_jump_host_keeps_its_pin(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path)
    hosts = _hosts("gpu1", "gpu2")
    chosen = _pinned_fleet(workspace, hosts, hosts)
    chosen.settings.proxy_jump = f"root@{hosts[0].address}"
    inventory.save(workspace, chosen)
    fleets.remove(workspace, "f", ["gpu1"], force=False)
    known = ssh.KnownHosts(inventory.known_hosts_file(workspace, "f"))
    assert known.lookup(ssh.Target(hosts[0].address))


def test_the_scaler_goes_straight_to_the_workers_and_only_to_pinned_ones(
    tmp_path: Path,
) -> None:
    spec, env = lab_spec()
    plan = build(spec, env, fleet(*_hosts("cpu1", "gpu1", "gpu2")), secrets_digest="")
    (tmp_path / "router.env").write_text("PDCTL_ROUTER_API_KEY=k\n")
    ssh.KnownHosts(tmp_path / "scaler_known_hosts").save()  # as pd_scaler copies it: no pin
    with listener() as worker:
        config = {  # what roles/pd_scaler writes
            "plan": plan.extravars(),
            "hosts": {name: ["127.0.0.1", worker.getsockname()[1]] for name in plan.hosts()},
            "ssh_user": "pdctl-scaler",
            "identity_file": str(tmp_path / "scaler_id_ed25519"),
            "known_hosts": str(tmp_path / "scaler_known_hosts"),
            "api_key_file": str(tmp_path / "router.env"),
            "state_dir": str(tmp_path / "state"),
        }
        (tmp_path / "scaler.json").write_text(json.dumps(config))
        with setup.on_host(tmp_path / "scaler.json", _no_progress) as (scaler, _):
            targets = scaler.actuator.targets
            assert all(t.proxy_jump is None for t in targets.values())
            with pytest.raises(HostError, match="no host key is pinned for it"):
                scaler.actuator.pool.run(targets[plan.slots()[0].host], "true")
        assert not contacted(worker)
