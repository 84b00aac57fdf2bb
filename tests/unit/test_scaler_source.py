"""pdctl packed for the router host's scaler: one reproducible archive, as pdctl and a plain
ansible-playbook run (roles/pd_scaler/tasks/install.yml: `python3 -m pdctl.scaler_source DIR`
with the checkout on PYTHONPATH) both make it."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from pdctl import scaler_source

ROOT = Path(__file__).resolve().parents[2]


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "src" / "pdctl"
    (package / "scaler" / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "scaler" / "loop.py").write_text("TICK = 2\n")
    (package / "scaler" / "__pycache__" / "loop.cpython-311.pyc").write_bytes(b"\0")
    return package


def test_the_archive_is_reproducible_and_named_by_its_content(tmp_path: Path) -> None:
    package = _package(tmp_path)
    first = scaler_source.archive(tmp_path / "a", package)
    second = scaler_source.archive(tmp_path / "b", package)
    assert first.name == second.name and first.read_bytes() == second.read_bytes()
    with tarfile.open(first) as tar:
        assert sorted(tar.getnames()) == ["pdctl/__init__.py", "pdctl/scaler/loop.py"]
        assert {m.mtime for m in tar.getmembers()} == {0}
    (package / "scaler" / "loop.py").write_text("TICK = 3\n")
    assert scaler_source.archive(tmp_path / "a", package).name != first.name


def test_the_role_packs_a_checkout_with_only_the_standard_library(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); "
            "import runpy; sys.argv[1:] = sys.argv[2:]; "
            "runpy.run_module('pdctl.scaler_source', run_name='__main__')",
            str(ROOT),
            str(tmp_path / "packed"),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    )
    archive = Path(out.stdout.strip())
    assert archive.parent == tmp_path / "packed" and archive.is_file()
    assert archive.name == scaler_source.archive(tmp_path / "again").name
