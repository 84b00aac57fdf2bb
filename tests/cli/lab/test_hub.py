"""`pdctl lab hub ...` without a running lab: adding models, and the errors of the rest."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import pdctl


def test_hub_add_makes_a_deterministic_model_before_any_lab(
    workspace: Path, tmp_path: Path
) -> None:
    env = {"PDCTL_CACHE": str(tmp_path / "cache")}
    first = pdctl(workspace, "--json", "lab", "hub", "add", "org/m", "--size", "300K", env=env)
    doc = json.loads(first.stdout)
    assert doc["repo"] == "org/m" and len(doc["revision"]) == 40
    assert sorted(doc["files"]) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert doc["files"]["model.safetensors"]["size"] == 300 << 10
    again = json.loads(
        pdctl(workspace, "--json", "lab", "hub", "add", "org/m", "--size", "300K", env=env).stdout
    )
    assert again == doc
    status = json.loads(pdctl(workspace, "--json", "lab", "status").stdout)
    assert status["hub"] is None  # no lab, no hub yet: `lab up` serves the model added


def test_hub_errors_are_one_line_each(workspace: Path) -> None:
    bad = pdctl(workspace, "lab", "hub", "add", "../etc", "--size", "1M", check=False)
    assert bad.returncode == 3 and "not a Hub repository id" in bad.stderr
    bad = pdctl(workspace, "lab", "hub", "add", "org/m", "--size", "lots", check=False)
    assert bad.returncode == 3 and "not a size" in bad.stderr
    none = pdctl(workspace, "lab", "hub", "limit", "10M", check=False)
    assert none.returncode == 7 and "no lab in this workspace" in none.stderr
    usage = pdctl(workspace, "lab", "hub", "token", check=False)
    assert usage.returncode == 2 and "--file PATH or --none" in usage.stderr
    for result in (bad, none, usage):
        assert "Traceback" not in result.stderr
