"""Each role's molecule scenario (converge, idempotence, verify) on a 3-host lab.

The scenarios live under molecule/ and share .config/molecule/config.yml; molecule itself runs
them, as `molecule test -s pd_worker` from the checkout would, on the session's shared lab
(PDCTL_MOLECULE_WORKSPACE, molecule/shared/create.yml): each scenario starts on clean hosts, and
its destroy step cleans them for the next.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import Lab

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.parent.name for p in (ROOT / "molecule").glob("*/molecule.yml"))

pytestmark = pytest.mark.lab


def test_every_role_has_a_scenario() -> None:
    roles = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "tasks").is_dir())
    assert roles == SCENARIOS


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(scenario: str, shared_lab: Lab) -> None:
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "NO_COLOR": "1",
        "PDCTL_MOLECULE_WORKSPACE": str(shared_lab.home),
    }
    proc = subprocess.run(
        [f"{bin_dir}/molecule", "test", "-s", scenario],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    # Every step of the sequence ran: a converge that changes nothing the second time, a verify.
    for step in ("converge", "idempotence", "verify"):
        assert f"[{scenario} > {step}] Executed: Successful" in output, output[-4000:]
    assert "Idempotence test failed" not in output
