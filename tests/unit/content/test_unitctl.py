"""pdctl-unitctl (roles/pd_worker/templates/pdctl-unitctl.sh.j2): `why`'s journal lines leave the
worker host with the service's secret values masked (issue 22, finding 7); `states` reads every
slot with one systemctl and one container runtime call.

The script is rendered as the pd_worker role renders it and run by /bin/sh; systemctl,
journalctl and podman are stand-ins that print what the real ones would (the lab tests run the
real ones)."""

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


def _config_dir(tmp_path: Path) -> Path:
    """The service's config directory under a config root of its own."""
    service_dir = tmp_path / "etc" / "pdctl" / "svc"
    service_dir.mkdir(parents=True)
    return service_dir


def _unitctl(tmp_path: Path, tools: dict[str, str], *args: str) -> str:
    """The rendered script run by /bin/sh with ``tools`` (name: shell text) first on PATH;
    its stdout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "pdctl-unitctl"
    script.write_text(_render(tmp_path / "etc" / "pdctl"))
    done = subprocess.run(
        ["/bin/sh", str(script), "svc", *args],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        check=True,
        timeout=30,
    )
    return done.stdout


def _why(tmp_path: Path, secrets: dict[str, str] | None) -> list[str]:
    service_dir = _config_dir(tmp_path)
    if secrets is not None:
        lines = "".join(f"{name}={value}\n" for name, value in secrets.items())
        (service_dir / layout.SECRETS_ENV).write_text(lines)
    journal = tmp_path / "journal.txt"
    journal.write_text("".join(f"{line}\n" for line in JOURNAL))
    tools = {
        "systemctl": "#!/bin/sh\nprintf 'ActiveState=failed\\nNRestarts=3\\n'\n",
        "journalctl": f"#!/bin/sh\ncat {journal}\n",
    }
    head, _, tail = _unitctl(tmp_path, tools, "why", "decode", "0").partition("--\n")
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


def _states(
    tmp_path: Path, slots: dict[str, str], containers: dict[str, str], verb: str = "states"
) -> tuple[str, str]:
    """`states` (or ``verb``) on a host whose slot files are ``slots`` (name: ActiveState, or
    "ActiveState NRestarts") and whose runtime holds ``containers`` (name: config label); its
    output and the stand-ins' call log. The stand-in systemctl writes each unit's block as
    systemd does, NRestarts before ActiveState on odd restart counts (systemd orders a block's
    names its own way)."""
    service_dir = _config_dir(tmp_path)
    for name in slots:
        (service_dir / f"{name}.env").write_text("")
    (service_dir / "decode.env").write_text("")  # the group's file, no slot

    def block(value: str) -> str:
        state, _, restarts = value.partition(" ")
        lines = [f"ActiveState={state}", f"NRestarts={restarts or 0}"]
        if restarts and int(restarts) % 2:
            lines.reverse()
        return "\\n".join(lines) + "\\n\\n"

    calls = tmp_path / "calls.log"
    cases = "".join(
        f"        pd-svc-{name.rsplit('-', 1)[0]}@{name.rsplit('-', 1)[1]}.service) "
        f"printf '{block(state)}' ;;\n"
        for name, state in slots.items()
        if name.rsplit("-", 1)[1].isdigit()  # systemd could name no other unit
    )
    listing = "".join(f"{name} {label}\n" for name, label in containers.items())
    tools = {
        "systemctl": f'#!/bin/sh\necho "systemctl $*" >> {calls}\nshift 2\n'
        f'for unit; do\n    case "$unit" in\n{cases}'
        "        *) printf 'ActiveState=inactive\\nNRestarts=0\\n\\n' ;;\n    esac\ndone\n",
        "podman": f'#!/bin/sh\necho "podman $*" >> {calls}\nprintf %s "{listing}"\n',
    }
    out = _unitctl(tmp_path, tools, verb)
    return out, calls.read_text() if calls.exists() else ""


def test_states_reads_every_slot_with_one_systemctl_and_one_runtime_call(tmp_path: Path) -> None:
    slots = {"prefill-1": "active 3", "prefill-2": "inactive", "decode-1": "activating 12"}
    containers = {"pd-svc-prefill-1": "90c54fb38083", "pd-svc-decode-1": "7f4808c3d7b9"}
    out, calls = _states(tmp_path, slots, containers)
    assert sorted(out.splitlines()) == [
        "decode 1 activating 7f4808c3d7b9 12",
        "prefill 1 active 90c54fb38083 3",
        "prefill 2 inactive - 0",
    ]
    assert [line.split()[0] for line in calls.splitlines()] == ["podman", "systemctl"]
    assert "label=pdctl.service=svc" in calls
    assert "--property=ActiveState,NRestarts" in calls


def test_unit_states_reads_systemd_alone_and_gives_no_label(tmp_path: Path) -> None:
    slots = {"prefill-1": "active", "decode-1": "failed 5"}
    containers = {"pd-svc-prefill-1": "90c54fb38083"}
    out, calls = _states(tmp_path, slots, containers, verb="unit-states")
    assert sorted(out.splitlines()) == ["decode 1 failed - 5", "prefill 1 active - 0"]
    assert [line.split()[0] for line in calls.splitlines()] == ["systemctl"]


def test_states_of_a_host_without_slots_calls_nothing(tmp_path: Path) -> None:
    assert _states(tmp_path, {}, {}) == ("", "")


def test_states_skips_a_slot_file_whose_index_is_not_a_number(tmp_path: Path) -> None:
    out, _ = _states(tmp_path, {"decode-1": "active", "decode-x y": "active"}, {})
    assert out.splitlines() == ["decode 1 active - 0"]
