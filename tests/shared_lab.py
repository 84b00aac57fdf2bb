"""One 3-host lab for a whole test session (one xdist worker), lent to one module at a time.

Booting a lab and adding it as a fleet takes about a minute of a loaded CI machine; most lab
modules want the same shape (node1 a CPU host, node2 and node3 AMD GPU hosts, fleet `lab`) and
leave its hosts as they found them. So a module borrows the session's lab (the `shared_lab`
fixture), deploys services under names of its own, and gives the lab back at its end: the
services still recorded in the workspace are destroyed, then every host must be clean (no lab
fault, nothing `molecule/shared/leftovers.sh` finds). A lab found dirty is taken down, the next
module boots a fresh one, and the module that left it fails its teardown naming what it left.

Modules that power hosts off, need another shape or time the lab itself keep labs of their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import Lab, lab_fleet, pdctl

LEFTOVERS = Path(__file__).resolve().parents[1] / "molecule" / "shared" / "leftovers.sh"


@dataclass
class SharedLab:
    factory: pytest.TempPathFactory
    lab: Lab | None = None
    lent_to: str | None = None
    booted: int = 0  # labs this session booted (a dirty one is replaced)
    history: list[str] = field(default_factory=list)

    def borrow(self, module: str) -> Lab:
        assert self.lent_to is None, f"the shared lab is still lent to {self.lent_to}"
        if self.lab is None:
            self.lab = lab_fleet(self.factory, "shared-lab")
            self.booted += 1
        self.lent_to = module
        self.history.append(module)
        return self.lab

    def give_back(self, module: str) -> None:
        """Destroy what the module left recorded, then check every host; a dirty lab goes."""
        assert self.lent_to == module and self.lab is not None
        self.lent_to = None
        lab = self.lab
        problems = destroy_services(lab) + leftovers(lab)
        if problems:
            self.lab = None
            pdctl(lab.home, "lab", "down", check=False)
            raise AssertionError(
                f"{module} left the shared lab unclean (taken down; the next module boots"
                " another):\n  " + "\n  ".join(problems)
            )

    def close(self) -> None:
        if self.lab is not None:
            pdctl(self.lab.home, "lab", "down", check=False)
            self.lab = None


def destroy_services(lab: Lab) -> list[str]:
    """`pdctl destroy` every service the workspace still records; what failed, one a line."""
    shown = pdctl(lab.home, "--json", "fleet", "show", "lab", check=False)
    if shown.returncode != 0:
        return [f"fleet show lab exited {shown.returncode}: {shown.stderr.strip()[-300:]}"]
    problems = []
    for service in json.loads(shown.stdout)["services"]:
        proc = pdctl(lab.home, "destroy", service, "-y", check=False)
        if proc.returncode != 0:
            problems.append(f"destroy {service} exited {proc.returncode}: {proc.stderr[-300:]}")
    return problems


def leftovers(lab: Lab) -> list[str]:
    """What is left on the lab's hosts ("node2: unit: pd-x-prefill@1.service"), and any host
    not running or still under a fault."""
    script = LEFTOVERS.read_text()
    found = []
    for host in lab.status()["hosts"]:
        name = host["name"]
        if host["state"] != "running" or host["faults"]:
            found.append(f"{name}: {host['state']}, faults {host['faults']}")
            continue
        proc = lab.ssh(name, "sh -s", user="root", stdin=script, check=False)
        if proc.returncode != 0:
            found.append(f"{name}: the leftovers probe exited {proc.returncode}: {proc.stderr}")
        found += [f"{name}: {line}" for line in proc.stdout.splitlines()]
    return found
