"""The baselines pdctl is measured against, built from pdctl's own playbooks.

- Ansible's defaults: `pdctl prefetch` (a pipeline's first step: the playbooks fetch no model),
  then the same deploy playbook and plan, run by plain `ansible-playbook` with
  forks 5, no pipelining, the ssh plugin's own `ssh_args` (`-C -o ControlMaster=auto
  -o ControlPersist=60s`: one SSH connection per host, reused by its tasks) and facts gathered
  in full at every play, as a playbook that does not opt out gets them.
- Host after host: `pdctl fleet check --limit H` once per host, one after the other.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench.lablib import FLEET, PDCTL, BenchLab, stopwatch
from pdctl.doors import content, inventory
from pdctl.doors.session import Session
from pdctl.doors.workspace import Workspace
from pdctl.operations import deploy, planning

DEFAULTS_CFG = """\
# Ansible's defaults for what pdctl tunes; everything else as pdctl's ansible.cfg.
[defaults]
roles_path = {roles}
lookup_plugins = {lookups}
host_key_checking = True
retry_files_enabled = False
gathering = implicit
forks = 5
interpreter_python = auto_silent
deprecation_warnings = False
localhost_warning = False

[ssh_connection]
pipelining = False
# ssh_args left unset: the ssh plugin's default, ControlPersist included, is what users run.
"""


def defaults_playbook(name: str, out: Path) -> Path:
    """pdctl's playbook with every play gathering facts (Ansible's default `gather_facts`)."""
    plays = yaml.safe_load(content.playbook(name).read_text())
    for play in plays:
        if "hosts" in play and "import_playbook" not in play:
            play["gather_facts"] = True
    path = out / f"defaults-{name}"
    path.write_text(yaml.safe_dump(plays, sort_keys=False))
    return path


def defaults_config(out: Path) -> Path:
    path = out / "ansible-defaults.cfg"
    lookups = content.content_root() / "playbooks" / "lookup_plugins"
    path.write_text(DEFAULTS_CFG.format(roles=content.roles_dir(), lookups=lookups))
    return path


def deploy_with_ansible_defaults(lab: BenchLab, spec: Path, out: Path) -> float:
    """Seconds for the pipeline a user runs without `pdctl deploy`: `pdctl prefetch` (the
    model and images into the hosts: the playbooks fetch no model), then `ansible-playbook
    deploy.yml -e @vars` under Ansible's defaults. Both are timed: pdctl's deploy does both."""
    out.mkdir(parents=True, exist_ok=True)
    workspace = Workspace(lab.home)
    with Session(workspace) as session:
        _, _, plan = planning.make_plan(session, spec, FLEET, environ=lab.env)
    extravars = out / "deploy-vars.json"
    extravars.touch(mode=0o600)
    # The same extra-vars pdctl passes (the plan, the scaler's packages, rollout none).
    extravars.write_text(json.dumps(deploy.playbook_vars(plan)))
    env = {**lab.env, "ANSIBLE_CONFIG": str(defaults_config(out))}
    playbook = defaults_playbook("deploy.yml", out)
    argv = [
        str(Path(PDCTL).with_name("ansible-playbook")),
        "-i",
        str(inventory.fleet_dir(workspace, FLEET)),
        str(playbook),
        "-e",
        f"@{extravars}",
    ]
    with stopwatch() as took:
        lab.pdctl("prefetch", str(spec), "--fleet", FLEET)
        lab.run(*argv, env=env)
    return took[0]


def check_host_after_host(lab: BenchLab) -> float:
    hosts = [h["address"] for h in lab.status()["hosts"]]
    with stopwatch() as took:
        for address in hosts:
            lab.pdctl("fleet", "check", FLEET, "--limit", address)
    return took[0]
