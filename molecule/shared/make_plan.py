"""Write the deploy extra-vars for the lab, with molecule's host names (node1..) for addresses.

Usage: make_plan.py WORKSPACE SPEC OUT. HF_TOKEN must be set (the spec takes it from the
environment); the plan itself holds only its name.
"""

import os
import sys
from pathlib import Path

import yaml

from pdctl.core import plan, spec
from pdctl.doors import inventory
from pdctl.doors.workspace import Workspace
from pdctl.lab import manager
from pdctl.operations import deploy, drift


def main() -> None:
    workspace, spec_path, out = Workspace(Path(sys.argv[1])), Path(sys.argv[2]), Path(sys.argv[3])
    names = {h["address"]: h["name"] for h in manager.status(workspace)["hosts"]}
    fleet = inventory.load(workspace, "lab")
    for host in fleet.hosts:
        host.name = names[host.address]
    service, env = spec.load(spec_path, os.environ)
    # The extra-vars pdctl itself passes: the plan, plus the packages the scaler needs.
    digest = drift.secrets_digest(
        drift.stored_key(workspace, service.name), env.secrets, os.environ
    )
    built = plan.build(service, env, fleet, secrets_digest=digest)
    out.write_text(yaml.safe_dump(deploy.playbook_vars(built), sort_keys=False))


if __name__ == "__main__":
    main()
