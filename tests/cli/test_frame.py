"""The CLI frame: global options, --json documents, one error path, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click

from pdctl import cli
from tests.support import pdctl


def test_version_and_help(workspace: Path) -> None:
    assert "pdctl, version" in pdctl(workspace, "--version").stdout
    helptext = pdctl(workspace, "--help").stdout
    for option in ("--json", "--verbose", "--quiet", "--home", "PDCTL_HOME"):
        assert option in helptext


def test_json_status_without_a_lab_is_an_empty_document(workspace: Path) -> None:
    doc = json.loads(pdctl(workspace, "--json", "lab", "status").stdout)
    assert doc["hosts"] == [] and doc["fleet_add"] is None
    assert doc["worker_image"].startswith("localhost/pdctl-lab/")


def test_json_from_the_environment(workspace: Path) -> None:
    proc = pdctl(workspace, "lab", "status", env={"PDCTL_JSON": "1"})
    assert json.loads(proc.stdout)["hosts"] == []


def test_home_option_and_variable_choose_the_workspace(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    proc = pdctl(tmp_path, "--home", str(other), "lab", "status")
    assert "no lab in this workspace" in proc.stdout


def test_usage_error_is_one_line_and_exit_2(workspace: Path) -> None:
    proc = pdctl(workspace, "lab", "up", "--hosts", "many", check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_usage_error_in_json_mode_is_a_document(workspace: Path) -> None:
    proc = pdctl(workspace, "--json", "no-such-command", check=False)
    assert proc.returncode == 2
    error = json.loads(proc.stdout)["error"]
    assert error["kind"] == "usage" and "no-such-command" in error["message"]


def test_an_error_in_json_mode_is_a_document_whatever_the_global_options_order(
    workspace: Path,
) -> None:
    for options in (["--json", "--home", str(workspace)], ["--home", str(workspace), "--json"]):
        proc = pdctl(workspace, *options, "status", "nothing-here", check=False)
        assert proc.returncode == 7, options
        assert json.loads(proc.stdout)["error"]["kind"] == "not_found", options
        assert proc.stderr == "", options


def test_user_error_names_the_fix(workspace: Path) -> None:
    proc = pdctl(workspace, "lab", "up", "--hosts", "2", "--cpu-hosts", "3", check=False)
    assert proc.returncode == 3
    assert "--cpu-hosts must be between 0 and --hosts (2); got 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_debug_shows_the_traceback(workspace: Path) -> None:
    quiet = pdctl(workspace, "lab", "up", "--hosts", "0", check=False)
    loud = pdctl(workspace, "lab", "up", "--hosts", "0", check=False, env={"PDCTL_DEBUG": "1"})
    assert quiet.returncode == loud.returncode == 3
    assert "Traceback" not in quiet.stderr and "Traceback" in loud.stderr


def test_fault_on_unknown_lab_host_is_not_found(workspace: Path) -> None:
    doc = json.loads(
        pdctl(workspace, "--json", "lab", "fault", "node9", "clear", check=False).stdout
    )
    assert doc["error"]["exit_code"] in {6, 7}  # 6 when not root, 7: no such host


def test_fleet_wheelhouse_is_checked_like_any_path(workspace: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is never contacted: the path is refused first.
    for bad in ("wheels", "/opt/../wheels", "/opt/my wheels"):
        proc = pdctl(
            workspace, "fleet", "add", "f", "--wheelhouse", bad, "--host", "192.0.2.1", check=False
        )
        assert proc.returncode == 3 and "--wheelhouse" in proc.stderr, proc.stderr
    assert not (workspace / "inventories" / "f").exists()


def test_every_command_is_listed_and_loads(workspace: Path) -> None:
    """The commands are imported by name when they run (pdctl.cli.COMMANDS): each name
    resolves to its command, and --help lists them all."""
    group = cli.cli
    assert isinstance(group, click.Group)
    with click.Context(group) as ctx:
        assert group.list_commands(ctx) == sorted(cli.COMMANDS)
        for name in cli.COMMANDS:
            command = group.get_command(ctx, name)
            assert command is not None and command.name in {name, name.replace("-", "_")}
    helptext = pdctl(workspace, "--help").stdout
    assert all(f"\n  {name} " in helptext for name in cli.COMMANDS), helptext


def test_a_command_imports_only_what_it_runs(workspace: Path) -> None:
    """`pdctl status` neither loads the lab nor the fleet's commands: every command pays for
    its own imports only (the tests and users' scripts run pdctl many times). Nor invoke,
    which paramiko loads (with asyncio and unittest.mock) for ssh_config files pdctl never reads,
    nor, in JSON mode, rich (it draws the human output)."""
    probe = (
        "import sys, runpy; sys.argv = ['pdctl', '--json', 'status', 'nothing-here']\n"
        "try:\n    runpy.run_module('pdctl', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "watched = ('pdctl.lab', 'pdctl.cli.', 'invoke', 'rich')\n"
        "print(sorted(m for m, v in sys.modules.items() if m.startswith(watched) and v))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={"PDCTL_HOME": str(workspace), "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=True,
    )
    loaded = done.stdout.strip().splitlines()[-1]
    assert "pdctl.lab" not in loaded and "pdctl.cli.fleet" not in loaded, loaded
    assert "'invoke" not in loaded and "'rich" not in loaded, loaded
    assert "pdctl.cli.service" in loaded, loaded
