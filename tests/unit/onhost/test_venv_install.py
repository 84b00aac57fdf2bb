"""The host-side venv step (pdctl/onhost/venv_install.py) with the real venv module and pip,
from a wheelhouse of wheels built here (no index): a venv made without pip's own install, a
second run that runs nothing, a new version installed, check mode, a failed install that
leaves nothing, and requests refused before anything runs. The lab's deploys run it as the
router and scaler roles do (tests/integration/test_playbooks.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost import bundle, venv_install

PYTHON = sys.executable


def wheel(house: Path, name: str, version: str) -> None:
    """A pure-Python wheel of one module, ``name``, whose VERSION is ``version``."""
    house.mkdir(exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(house / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        for path, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(path, text)


def request(tmp_path: Path, *requirements: str, **extra: Any) -> dict[str, Any]:
    return {
        "venv": str(tmp_path / "opt" / "venv"),
        "python": PYTHON,
        "requirements": list(requirements),
        "find_links": str(tmp_path / "house"),
        **extra,
    }


def version_in(tmp_path: Path, module: str) -> str:
    python = tmp_path / "opt" / "venv" / "bin" / "python"
    done = subprocess.run([python, "-c", f"import {module}; print({module}.VERSION)"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.strip()


def test_a_venv_is_made_without_pip_holds_its_packages_and_a_second_run_runs_nothing(
    tmp_path: Path,
) -> None:
    wheel(tmp_path / "house", "pdtdemo", "1.0")
    wheel(tmp_path / "house", "pdtother", "2.0")
    report = venv_install.install(request(tmp_path, "pdtdemo==1.0", "pdtother"))
    assert report["changed"] and report["installed"] == ["pdtdemo==1.0", "pdtother"]
    assert version_in(tmp_path, "pdtdemo") == "1.0"
    site = next((tmp_path / "opt" / "venv" / "lib").glob("python3*/site-packages"))
    if report["pip"] == "wheel":  # this interpreter has ensurepip's wheel: pip stays out
        assert not (site / "pip").exists()
    assert venv_install.install(request(tmp_path, "pdtdemo==1.0", "pdtother")) == {
        "changed": False, "installed": [], "files": []}  # fmt: skip
    # 1.0 and 1.0.0 are one version: nothing to do either.
    assert not venv_install.install(request(tmp_path, "pdtdemo==1.0.0"))["changed"]


def test_a_new_version_goes_into_the_venv_and_check_mode_changes_nothing(tmp_path: Path) -> None:
    wheel(tmp_path / "house", "pdtdemo", "1.0")
    wheel(tmp_path / "house", "pdtdemo", "1.1")
    venv = tmp_path / "opt" / "venv"
    checked = venv_install.install(request(tmp_path, "pdtdemo==1.0", check=True))
    assert checked == {"changed": True, "installed": ["pdtdemo==1.0"], "files": [str(venv)]}
    assert not venv.exists()
    venv_install.install(request(tmp_path, "pdtdemo==1.0"))
    assert venv_install.install(request(tmp_path, "pdtdemo==1.1", check=True))["changed"]
    assert version_in(tmp_path, "pdtdemo") == "1.0"
    assert venv_install.install(request(tmp_path, "pdtdemo==1.1"))["installed"] == ["pdtdemo==1.1"]
    assert version_in(tmp_path, "pdtdemo") == "1.1"


def test_a_failed_install_leaves_no_venv_it_made_and_names_what_pip_said(tmp_path: Path) -> None:
    wheel(tmp_path / "house", "pdtdemo", "1.0")
    with pytest.raises(venv_install.ApplyError, match=r"pip could not install pdtdemo==9\.9"):
        venv_install.install(request(tmp_path, "pdtdemo==9.9"))
    assert not (tmp_path / "opt" / "venv").exists()
    # Into a venv that was there, the failure is a report: that venv stays, as it was used.
    venv_install.install(request(tmp_path, "pdtdemo==1.0"))
    report = venv_install.install(request(tmp_path, "pdtdemo==9.9"))
    assert report["failed"] and "pdtdemo==9.9" in report["msg"]
    assert version_in(tmp_path, "pdtdemo") == "1.0"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"venv": "/opt"}, "top-level"),
        ({"venv": "/opt/../etc/x"}, "not a plain absolute path"),
        ({"venv": "venv"}, "not an absolute path"),
        ({"requirements": ["--index-url=http://evil/ x"]}, "not a requirement"),
        ({"requirements": ["smg==1.0; rm -rf /"]}, "not a requirement"),
        ({"requirements": ["-e", "git+https://x"]}, "not a requirement"),
        ({"requirements": []}, "not a list of requirements"),
        ({"python": "python3 -c x"}, "not an absolute path"),
        ({"find_links": "wheels"}, "not an absolute path"),
    ],
)
def test_a_request_out_of_shape_runs_nothing(
    tmp_path: Path, change: dict[str, Any], why: str
) -> None:
    with pytest.raises(venv_install.RequestError, match=why):
        venv_install.install(request(tmp_path, "pdtdemo==1.0") | change)
    assert not (tmp_path / "opt").exists()


def test_the_bundled_step_reads_its_request_and_prints_one_report(tmp_path: Path) -> None:
    wheel(tmp_path / "house", "pdtdemo", "1.0")

    def step(request: dict[str, Any]) -> dict[str, Any]:
        done = subprocess.run(
            bundle.argv("pdctl.onhost.venv_install", python=PYTHON),
            input=bundle.stdin("pdctl.onhost.venv_install") + json.dumps(request).encode(),
            capture_output=True,
            check=True,
        )
        report: dict[str, Any] = json.loads(done.stdout)
        return report

    assert step(request(tmp_path, "pdtdemo==1.0"))["changed"]
    assert version_in(tmp_path, "pdtdemo") == "1.0"
    refused = step(request(tmp_path, "pdtdemo==1.0", venv="/"))
    assert refused["failed"] and refused["msg"].startswith("refused, nothing changed")
