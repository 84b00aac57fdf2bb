"""pdctl-unitctl's `why` (roles/pd_worker/templates/pdctl-unitctl.sh.j2): the journal lines it
returns to the scaler leave the worker host with the service's secret values masked (issue 22,
finding 7).

The script is rendered as the pd_worker role renders it and run by /bin/sh; systemctl and
journalctl are stand-ins that print what a worker that echoes its secrets would leave in the
journal (the lab tests run the real ones)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pdctl.core import layout
from pdctl.core.layout import Layout, Roots
from tests import role_templates

SECRETS = {
    "HF_TOKEN": "hf_abcdefghij0123456789",
    "DB_PASSWORD": "p@ss.*[w0rd]$1\\n",  # regex and escape characters: taken as text
    "INNER": "hf_abcdef",  # inside HF_TOKEN's value: the longer is masked whole
    "SHORT": "abc",  # too short to mask (it would garble ordinary words)
}
JOURNAL = [
    "Loading model with token hf_abcdefghij0123456789 from the hub",
    "connecting with p@ss.*[w0rd]$1\\n twice: p@ss.*[w0rd]$1\\n",
    "partial hf_abcdef only",
    "abc is fine",
]


def _render(config_root: Path) -> str:
    roots = Roots(config_root=str(config_root))
    return role_templates.unitctl(Layout("svc", roots).extravar(layout.GROUPS))


def _why(tmp_path: Path, secrets: dict[str, str] | None) -> list[str]:
    config_root = tmp_path / "etc" / "pdctl"
    (config_root / "svc").mkdir(parents=True)
    if secrets is not None:
        lines = "".join(f"{name}={value}\n" for name, value in secrets.items())
        (config_root / "svc" / layout.SECRETS_ENV).write_text(lines)
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "systemctl").write_text("#!/bin/sh\nprintf 'ActiveState=failed\\nNRestarts=3\\n'\n")
    journal = tmp_path / "journal.txt"
    journal.write_text("".join(f"{line}\n" for line in JOURNAL))
    (tools / "journalctl").write_text(f"#!/bin/sh\ncat {journal}\n")
    for tool in tools.iterdir():
        tool.chmod(0o755)
    script = tmp_path / "pdctl-unitctl"
    script.write_text(_render(config_root))
    done = subprocess.run(
        ["/bin/sh", str(script), "svc", "why", "decode", "0"],
        capture_output=True,
        text=True,
        env={"PATH": f"{tools}:/usr/bin:/bin"},
        check=True,
        timeout=30,
    )
    head, _, tail = done.stdout.partition("--\n")
    assert head == "ActiveState=failed\nNRestarts=3\n"
    return tail.splitlines()


def test_why_masks_every_secret_value_of_the_service_on_the_worker_host(tmp_path: Path) -> None:
    lines = _why(tmp_path, SECRETS)
    assert lines == [
        "Loading model with token *** from the hub",
        "connecting with *** twice: ***",
        "partial *** only",
        "abc is fine",
    ]


def test_why_of_a_service_without_secrets_passes_the_journal_as_it_is(tmp_path: Path) -> None:
    assert _why(tmp_path, None) == JOURNAL
