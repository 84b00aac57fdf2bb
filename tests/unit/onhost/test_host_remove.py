"""The host-side removal step (pdctl/onhost/host_remove.py) on real files: what is removed, what
other services keep (shared roots, a venv another router names, other lines of a shared file),
check mode, a second run that changes nothing, and refusals that change nothing. Its systemd,
container and user half runs on the lab hosts (tests/integration/test_playbooks.py: destroy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost import bundle, host_remove


def host(root: Path) -> dict[str, Path]:
    """A host where services a and b are installed; b stays."""
    tree = {
        "units": root / "etc/systemd/system",
        "config": root / "etc/pdctl",
        "install": root / "opt/pdctl",
        "keys": root / "home/scaler/.ssh/authorized_keys",
    }
    for name in ("a", "b"):
        (tree["config"] / name).mkdir(parents=True)
        (tree["config"] / name / "service.env").write_text("A=1\n")
    (tree["units"] / "multi-user.target.wants").mkdir(parents=True)
    for name, venv in (("a", "smg-1.13.0"), ("b", "smg-1.12.0")):
        unit = tree["units"] / f"pd-{name}-router.service"
        unit.write_text(f"ExecStart={tree['install']}/{venv}/bin/python launch\n")
        link = tree["units"] / "multi-user.target.wants" / unit.name
        link.symlink_to(unit)
    for venv in ("smg-1.13.0", "smg-1.12.0", "smg-1.1"):
        (tree["install"] / venv / "bin").mkdir(parents=True)
    tree["keys"].parent.mkdir(parents=True)
    tree["keys"].write_text('command="x --ssh a" key-a\ncommand="x --ssh b" key-b\n')
    return tree


def removal(tree: dict[str, Path], service: str = "a", **extra: Any) -> dict[str, Any]:
    unit = tree["units"] / f"pd-{service}-router.service"
    return {
        "units": [unit.name],  # no systemd here: its enablement link is what is found
        "links": str(tree["units"]),
        "paths": [str(unit), str(tree["config"] / service)],
        "lines": [{"path": str(tree["keys"]), "match": f"--ssh {service}"}],
        "prune": [str(tree["config"]), str(tree["install"])],
        "unused": [
            {
                "glob": f"{tree['install']}/smg-*",
                "users": f"{tree['units']}/pd-*-router.service",
                "named": True,
            }
        ],
        **extra,
    }


def test_a_service_goes_and_what_another_uses_stays(tmp_path: Path) -> None:
    tree = host(tmp_path)
    report = host_remove.remove(removal(tree))
    assert report["changed"] and not report["failed"], report
    assert not (tree["units"] / "pd-a-router.service").exists()
    assert not (tree["config"] / "a").exists()
    assert (tree["config"] / "b" / "service.env").is_file()
    # b's router names smg-1.12.0 only: 1.13.0 (a's) and 1.1 (nobody's, and a prefix of
    # 1.13.0's path) go.
    assert sorted(p.name for p in tree["install"].iterdir()) == ["smg-1.12.0"]
    assert tree["keys"].read_text() == 'command="x --ssh b" key-b\n'
    assert str(tree["install"] / "smg-1.1") in report["files"]
    again = host_remove.remove(removal(tree))
    assert not again["changed"] and again["files"] == [], again


def test_the_last_service_takes_the_shared_roots_with_it(tmp_path: Path) -> None:
    tree = host(tmp_path)
    host_remove.remove(removal(tree, "a"))
    report = host_remove.remove(removal(tree, "b"))
    assert not report["failed"], report
    assert not tree["config"].exists() and not tree["install"].exists()
    assert tree["keys"].read_text() == ""
    assert list((tree["units"] / "multi-user.target.wants").iterdir()) == []


def test_check_mode_names_what_the_run_then_removes(tmp_path: Path) -> None:
    """Its rules see what the run would have removed by then as gone: the venv only the
    removed unit named, the roots that only held what goes (pdctl destroy --dry-run)."""
    for service in ("a", "b"):  # b: the last service, with the shared roots
        tree = host(tmp_path / service)
        if service == "b":
            host_remove.remove(removal(tree, "a"))
        checked = host_remove.remove(removal(tree, service, check=True))
        done = host_remove.remove(removal(tree, service))
        assert sorted(checked["files"]) == sorted(done["files"]), service
    assert {str(tree["install"] / "smg-1.12.0"), str(tree["install"])} <= set(checked["files"])


def test_a_link_goes_not_what_it_points_to(tmp_path: Path) -> None:
    tree = host(tmp_path)
    link = tree["units"] / "multi-user.target.wants" / "pd-a-router.service"
    kept = tmp_path / "elsewhere"
    kept.mkdir()
    (kept / "data").write_text("mine")
    link.unlink()
    link.symlink_to(kept)
    host_remove.remove({"paths": [str(link)]})
    assert not link.is_symlink() and (kept / "data").read_text() == "mine"


def test_an_unused_rule_without_names_keeps_the_path_while_a_user_exists(tmp_path: Path) -> None:
    tree = host(tmp_path)
    rule = {"glob": str(tree["install"] / "smg-1.1"), "users": str(tree["config"])}
    assert host_remove.remove({"unused": [rule]})["files"] == []
    assert (tree["install"] / "smg-1.1").is_dir()
    host_remove.remove({"paths": [str(tree["config"])]})
    assert host_remove.remove({"unused": [rule]})["files"] == [str(tree["install"] / "smg-1.1")]
    assert not (tree["install"] / "smg-1.1").exists()


def test_check_mode_reports_and_changes_nothing(tmp_path: Path) -> None:
    tree = host(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    keys = tree["keys"].read_text()
    report = host_remove.remove(removal(tree, check=True))
    assert report["changed"]
    assert str(tree["config"] / "a") in report["files"]
    assert str(tree["keys"]) in report["files"]
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert tree["keys"].read_text() == keys


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"paths": ["/etc"]}, "top-level directory"),
        ({"paths": ["/"]}, "not a plain absolute path"),
        ({"paths": ["/etc/pdctl/../shadow"]}, "not a plain absolute path"),
        ({"paths": ["etc/pdctl"]}, "not an absolute path"),
        ({"units": ["pd-a.service; rm -rf /"]}, "not a unit name"),
        ({"units": ["*.service"]}, "not a unit name"),
        ({"unused": [{"glob": "/opt/*/smg", "users": "/etc/x"}]}, "last component"),
        ({"unused": [{"glob": "/opt*", "users": "/etc/x"}]}, "top-level directory"),
        ({"users": [{"name": "root", "unless_lines_in": "/root/.ssh/x"}]}, "not a user"),
        ({"addresses": ["10.0.0.300"]}, "not an IPv4 address"),
        ({"containers": "pd-(a"}, "not a container name pattern"),
        ({"lines": [{"path": "/etc/x", "match": ""}]}, "not a line entry"),
    ],
)
def test_a_request_out_of_shape_is_refused_before_anything_changes(
    tmp_path: Path, change: dict[str, Any], why: str
) -> None:
    tree = host(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    request = removal(tree) | change
    with pytest.raises(host_remove.RequestError, match=why):
        host_remove.remove(request)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_the_bundled_step_reads_its_request_and_prints_one_report(tmp_path: Path) -> None:
    tree = host(tmp_path)

    def step(request: dict[str, Any]) -> dict[str, Any]:
        done = subprocess.run(
            bundle.argv("pdctl.onhost.host_remove", python=sys.executable),
            input=bundle.stdin("pdctl.onhost.host_remove") + json.dumps(request).encode(),
            capture_output=True,
            check=True,
        )
        report: dict[str, Any] = json.loads(done.stdout)
        return report

    report = step(removal(tree))
    assert report["changed"] and not report["failed"]
    assert not (tree["config"] / "a").exists()
    refused = step({"paths": ["/usr"]})
    assert refused["failed"] and refused["msg"].startswith("refused, nothing changed: /usr")
