"""What pdctl writes for operators to keep (inventories, plan files) passes yamllint."""

from __future__ import annotations

from pathlib import Path

from yamllint import linter
from yamllint.config import YamlLintConfig

from pdctl.core.plan import build
from pdctl.doors import inventory
from pdctl.doors.workspace import Workspace
from pdctl.operations.planning import write_plan_file
from tests.unit.core.plan.test_placement import fleet, host, lab_spec

REPO = Path(__file__).resolve().parents[3]


def problems(path: Path) -> list[str]:
    config = YamlLintConfig(file=str(REPO / ".yamllint"))
    return [f"{path.name}:{p.line}: {p.desc}" for p in linter.run(path.read_text(), config)]


def test_inventory_and_plan_file_are_lint_clean(tmp_path: Path) -> None:
    gpu = host("gpu1")
    # Facts nest lists inside mappings inside lists: the case PyYAML indents wrongly by default.
    gpu.facts = {
        **(gpu.facts or {}),
        "rdma": {"devices": [{"name": "bnxt_re0", "ports": [{"port": 1, "state": "PORT_ACTIVE"}]}]},
    }
    lab = fleet(host("cpu1", "cpu"), gpu, host("gpu2"))
    directory = inventory.save(Workspace(tmp_path), lab)
    written = sorted(directory.rglob("*.yml"))
    assert len(written) >= 4  # hosts.yml, group_vars, one host_vars file per host
    spec, env = lab_spec()
    plan_file = tmp_path / "plan.yml"
    write_plan_file(build(spec, env, lab, secrets_digest=""), plan_file)
    found = [line for path in [*written, plan_file] for line in problems(path)]
    assert found == []
    # And they still read back as what was written.
    assert inventory.load(Workspace(tmp_path), "f").hosts[1].facts == gpu.facts


def test_fleet_wheelhouse_is_a_fleet_setting(tmp_path: Path) -> None:
    lab = fleet(host("cpu1", "cpu"), host("gpu1"))
    lab.settings.wheelhouse = "/opt/pdctl-lab/wheelhouse"
    directory = inventory.save(Workspace(tmp_path), lab)
    assert (
        "pd_fleet_wheelhouse: /opt/pdctl-lab/wheelhouse\n"
        in (directory / "group_vars/all.yml").read_text()
    )
    assert inventory.load(Workspace(tmp_path), "f").settings.wheelhouse == lab.settings.wheelhouse
