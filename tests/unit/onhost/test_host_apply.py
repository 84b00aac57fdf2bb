"""The host-side apply step (pdctl/onhost/host_apply.py) on real files: idempotence, check mode,
diff, secrets kept out of the report, and refusals that change nothing. Its systemd half runs on the
lab hosts (tests/integration/test_playbooks.py); here the request names no unit."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost import bundle, host_apply

SECRET = "hf_do_not_show_this_0123456789"


def request(root: Path, **extra: Any) -> dict[str, Any]:
    conf = root / "etc" / "svc"
    return {
        "dirs": [{"path": str(conf), "mode": "0755"}],
        "files": [
            {"path": str(conf / "service.env"), "mode": "0644", "content": "A=1\nB=two words\n"},
            {"path": str(conf / "prefill.sh"), "mode": "0755", "content": "#!/bin/sh\nexec x\n"},
            {"path": str(conf / "secrets.env"), "mode": "0600", "secret_env": ["HF_TOKEN"]},
        ],
        "secrets": {"HF_TOKEN": SECRET},
        **extra,
    }


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_first_apply_writes_everything_then_nothing_changes(tmp_path: Path) -> None:
    first = host_apply.apply(request(tmp_path))
    conf = tmp_path / "etc" / "svc"
    assert first["changed"] and not first["failed"]
    assert set(first["files"]) == {
        str(conf),
        *(str(conf / n) for n in ("service.env", "prefill.sh", "secrets.env")),
    }
    assert (conf / "secrets.env").read_text() == f"HF_TOKEN={SECRET}\n"
    assert mode(conf / "secrets.env") == 0o600
    assert mode(conf / "prefill.sh") == 0o755
    assert mode(conf) == 0o755
    again = host_apply.apply(request(tmp_path))
    assert not again["changed"] and again["files"] == []


def test_check_mode_reports_and_changes_nothing(tmp_path: Path) -> None:
    report = host_apply.apply(request(tmp_path, check=True, diff=True))
    assert report["changed"]
    assert not (tmp_path / "etc").exists()
    # a new file's diff is against /dev/null; the secret file has none
    assert any("+++ " in d and "service.env" in d for d in report["diff"])
    assert not any("secrets.env" in d for d in report["diff"])


def test_a_changed_file_is_the_only_one_reported_with_its_diff(tmp_path: Path) -> None:
    host_apply.apply(request(tmp_path))
    changed = request(tmp_path, diff=True)
    changed["files"][0]["content"] = "A=1\nB=three words\n"
    report = host_apply.apply(changed)
    conf = tmp_path / "etc" / "svc"
    assert report["files"] == [str(conf / "service.env")]
    head = f"--- {conf}/service.env\n+++ {conf}/service.env\n"
    assert report["diff"] == [head + "@@ -1,2 +1,2 @@\n A=1\n-B=two words\n+B=three words\n"]
    assert (conf / "service.env").read_text() == "A=1\nB=three words\n"


def test_a_mode_drift_is_put_back(tmp_path: Path) -> None:
    host_apply.apply(request(tmp_path))
    secret = tmp_path / "etc" / "svc" / "secrets.env"
    secret.chmod(0o644)
    report = host_apply.apply(request(tmp_path))
    assert report["files"] == [str(secret)]
    assert mode(secret) == 0o600


def test_the_secret_value_is_in_no_report_even_when_it_changes(tmp_path: Path) -> None:
    host_apply.apply(request(tmp_path))
    changed = request(tmp_path, diff=True)
    changed["secrets"] = {"HF_TOKEN": SECRET + "_rotated"}
    for check in (True, False):
        report = host_apply.apply({**changed, "check": check})
        assert report["files"] == [str(tmp_path / "etc" / "svc" / "secrets.env")]
        assert SECRET not in json.dumps(report)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"path": "relative/file"}, "not an absolute path"),
        ({"path": "/etc/../etc/passwd"}, "not a plain absolute path"),
        ({"mode": "rwx"}, "not an octal mode"),
        (
            {"mode": "0644", "secret_env": ["HF_TOKEN"], "content": None},
            "must not be readable by others",
        ),
    ],
)
def test_a_bad_entry_is_refused_before_anything_changes(
    tmp_path: Path, change: dict[str, Any], reason: str
) -> None:
    bad = request(tmp_path)
    files: list[dict[str, Any]] = bad["files"]
    entry: dict[str, Any] = {**files[0], **change}
    if entry.get("content") is None:
        entry.pop("content")
    files.append(entry)
    with pytest.raises(host_apply.RequestError, match=reason):
        host_apply.apply(bad)
    assert not (tmp_path / "etc").exists()


def test_a_secret_with_a_line_break_is_refused_by_name_only(tmp_path: Path) -> None:
    bad = request(tmp_path)
    bad["secrets"] = {"HF_TOKEN": "abc\nINJECTED=1"}
    with pytest.raises(host_apply.RequestError, match="HF_TOKEN holds a line break") as caught:
        host_apply.apply(bad)
    assert "INJECTED" not in str(caught.value)
    assert not (tmp_path / "etc").exists()


def test_a_symlink_in_place_of_a_file_is_refused(tmp_path: Path) -> None:
    host_apply.apply(request(tmp_path))
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    env = tmp_path / "etc" / "svc" / "service.env"
    env.unlink()
    env.symlink_to(target)
    with pytest.raises(host_apply.RequestError, match="not a regular file"):
        host_apply.apply(request(tmp_path))
    assert target.read_text() == "keep\n"


def test_bad_unit_names_and_probe_urls_are_refused(tmp_path: Path) -> None:
    with pytest.raises(host_apply.RequestError, match="not a unit name"):
        host_apply.apply(request(tmp_path, start=["--global"]))
    with pytest.raises(host_apply.RequestError, match="not a probe URL"):
        host_apply.apply(
            request(
                tmp_path, wait={"units": [{"unit": "a.service", "probe_url": "file:///etc/shadow"}]}
            )
        )
    assert not (tmp_path / "etc").exists()


def test_wait_probes_every_unit_until_healthy_or_failed() -> None:
    answers: dict[str, list[int | str]] = {"a.service": [0, 0, 200], "b.service": [0, "failed"]}

    def probe(url: str, unit: str, timeout: float) -> dict[str, Any]:
        seen = answers[unit].pop(0)
        if seen == "failed":
            return {"status": 0, "state": "failed", "restarts": 5, "journal": "boom\n"}
        return {"status": seen, "state": "active", "restarts": 0, "journal": ""}

    units = [
        {"unit": "a.service", "probe_url": "http://127.0.0.1:1/health"},
        {"unit": "b.service", "probe_url": "http://127.0.0.1:2/health"},
    ]
    found = host_apply.wait_healthy(units, probe, timeout=60, interval=0.01, probe_timeout=1)
    assert [(f["unit"], f["status"], f["state"], f["probes"]) for f in found] == [
        ("a.service", 200, "active", 3),
        ("b.service", 0, "failed", 2),
    ]


def test_a_unit_systemd_gave_up_on_is_not_reported_active() -> None:
    """The router registers the report's active units and waits for their readiness: one that
    failed for good must not be among them; one still starting may yet serve."""
    health = [
        {"unit": "a.service", "status": 200, "state": "active"},
        {"unit": "b.service", "status": 0, "state": "failed"},
        {"unit": "c.service", "status": 0, "state": "activating"},
    ]
    active = ["a.service", "b.service", "c.service", "d.service"]
    assert host_apply.serving(active, health) == ["a.service", "c.service", "d.service"]


def test_wait_ends_at_its_deadline() -> None:
    def probe(url: str, unit: str, timeout: float) -> dict[str, Any]:
        return {"status": 0, "state": "activating", "restarts": 0, "journal": ""}

    units = [{"unit": "a.service", "probe_url": "http://127.0.0.1:1/health"}]
    found = host_apply.wait_healthy(units, probe, timeout=0.05, interval=0.02, probe_timeout=1)
    assert found[0]["status"] == 0 and 1 <= found[0]["probes"] <= 4


def test_the_entry_reads_stdin_and_prints_one_report(tmp_path: Path) -> None:
    """As a host runs it: the bundle's argv, the loader and the bundle, then the request."""

    def run(request: dict[str, Any]) -> Any:
        done = subprocess.run(
            bundle.argv("pdctl.onhost.host_apply", python=sys.executable),
            input=bundle.stdin("pdctl.onhost.host_apply") + json.dumps(request).encode(),
            capture_output=True,
            check=True,
            env={"PATH": os.environ["PATH"]},
            cwd=tmp_path,
        )
        return json.loads(done.stdout)

    report = run(request(tmp_path, check=True))
    assert report["changed"] and not report["failed"]
    refused = run({"files": [{"path": "x", "mode": "0644", "content": ""}]})
    assert refused == {
        "changed": False,
        "failed": True,
        "msg": "refused, nothing changed: not an absolute path: 'x'",
    }


def test_a_shared_file_keeps_the_other_lines_and_replaces_its_own(tmp_path: Path) -> None:
    keys = tmp_path / "authorized_keys"
    keys.write_text('command="x --ssh other" ssh-ed25519 AAAA other\n')
    entry = {
        "path": str(keys),
        "mode": "0600",
        "match": '--ssh svc"',
        "line": 'restrict,command="x --ssh svc" ssh-ed25519 BBBB svc',
    }
    first = host_apply.apply({"files": [entry], "diff": True})
    assert first["files"] == [str(keys)]
    assert keys.read_text().splitlines() == [
        'command="x --ssh other" ssh-ed25519 AAAA other',
        'restrict,command="x --ssh svc" ssh-ed25519 BBBB svc',
    ]
    assert not host_apply.apply({"files": [entry]})["changed"]
    rotated = {**entry, "line": 'restrict,command="x --ssh svc" ssh-ed25519 CCCC svc'}
    host_apply.apply({"files": [rotated]})
    assert keys.read_text().splitlines()[1:] == [rotated["line"]]
    assert mode(keys) == 0o600


def test_a_file_of_a_user_not_made_yet_is_a_change_in_check_mode(tmp_path: Path) -> None:
    entry = {"path": str(tmp_path / "f"), "mode": "0600", "content": "x\n", "owner": "pdctl-nobody"}
    report = host_apply.apply(
        {
            "check": True,
            "users": [{"name": "pdctl-nobody", "home": str(tmp_path / "home")}],
            "files": [entry],
        }
    )
    assert report["changed"] and report["files"] == ["user pdctl-nobody", str(tmp_path / "f")]
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ({"owner": "Root; rm -rf /"}, "not a user name"),
        ({"validate": "sh -c true"}, "unknown validation"),
        ({"content": None, "match": "a", "line": "b"}, "one line holding its match"),
        ({"content": None, "match": "a", "line": "a\nEVIL"}, "one line holding its match"),
    ],
)
def test_owners_validations_and_lines_are_checked(
    tmp_path: Path, entry: dict[str, Any], reason: str
) -> None:
    bad: dict[str, Any] = {"path": str(tmp_path / "f"), "mode": "0644", "content": "x\n", **entry}
    if bad["content"] is None:
        bad.pop("content")
    with pytest.raises(host_apply.RequestError, match=reason):
        host_apply.apply({"files": [bad]})
    assert not (tmp_path / "f").exists()


def test_a_running_unit_restarts_when_its_files_changed_or_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision only: systemd's half (a real restart) runs in the lab's deploys, whose
    scaler the step restarts when its config changes (tests/integration/test_playbooks.py)."""
    states = {"pd-a.service": "active", "pd-b.service": "inactive"}
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(host_apply, "unit_states", lambda units: {u: states[u] for u in units})
    monkeypatch.setattr(host_apply, "_enabled", lambda unit: True)
    monkeypatch.setattr(host_apply, "systemctl", lambda *args: calls.append(args))
    env = str(tmp_path / "etc" / "svc" / "service.env")
    units = ["pd-a.service", "pd-b.service"]
    on_change = {"restart": {unit: [env] for unit in units}}

    first = host_apply.apply(request(tmp_path, start=units, **on_change))
    assert first["restarted"] == ["pd-a.service"]  # b was not running: started, with the file
    assert first["started"] == ["pd-b.service"]
    assert ("restart", "--", "pd-a.service") in calls and ("start", "--", "pd-b.service") in calls

    calls.clear()
    states["pd-b.service"] = "active"
    again = host_apply.apply(request(tmp_path, start=units, **on_change))
    assert again["restarted"] == [] and not again["changed"] and calls == []

    calls.clear()
    states["pd-b.service"] = "failed"  # not running: nothing to restart
    asked = host_apply.apply(request(tmp_path, restart_now=units, check=True, **on_change))
    assert asked["restarted"] == ["pd-a.service"] and asked["changed"] and calls == []
    asked = host_apply.apply(request(tmp_path, restart_now=units, **on_change))
    assert asked["restarted"] == ["pd-a.service"] and calls == [("restart", "--", "pd-a.service")]

    with pytest.raises(host_apply.RequestError):
        host_apply.apply(request(tmp_path, restart_now=["not a unit"]))
