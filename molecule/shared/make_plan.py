"""Write the deploy extra-vars for the lab, with molecule's host names (node1..) for addresses.

Usage: make_plan.py WORKSPACE SPEC OUT. HF_TOKEN must be set (the spec takes it from the
environment); the plan itself holds only its name. MOLECULE_PD_ROUTERS=N (a scenario's
molecule.yml sets it) runs the router group at count N behind a failover address: the first
address the lab leaves free.
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
    routers = int(os.environ.get("MOLECULE_PD_ROUTERS") or 1)
    if routers > 1:
        doc = yaml.safe_load(spec_path.read_text())
        doc["replicas"][0]["count"] = routers
        free = str(manager.status(workspace)["free_addresses"]).split("-", 1)[0]
        router = doc.setdefault("pdctl", {}).setdefault("router", {})
        router["address"] = free
        spec_path = out.with_name("pd.yml")
        spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    service, env = spec.load(spec_path, os.environ)
    # The extra-vars pdctl itself passes: the plan, plus the packages the scaler needs.
    digest = drift.secrets_digest(
        drift.stored_key(workspace, service.name), env.secrets, os.environ
    )
    built = plan.build(service, env, fleet, secrets_digest=digest)
    out.write_text(yaml.safe_dump(deploy.playbook_vars(built), sort_keys=False))


if __name__ == "__main__":
    main()
