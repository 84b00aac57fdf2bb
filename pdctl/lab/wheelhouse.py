"""A local wheelhouse: the pinned SMG wheel, the scaler's packages, their dependencies, and
the gRPC stand-ins' packages (image.py unpacks those into the worker images).

Lab hosts, like many real GPU clusters, have no internet: the router and
scaler roles install from this directory (mounted at /opt/pdctl-lab/wheelhouse).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path

from pdctl.core.errors import EnvironmentProblem
from pdctl.core.versions import GRPC_STANDIN_PACKAGES, SMG_VERSION, scaler_requirements
from pdctl.doors.workspace import cache_dir
from pdctl.lab.system import run

# Lab hosts run Debian bookworm's python3 (3.11, glibc 2.36).
_TARGET = [
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--abi",
    "abi3",
    "--abi",
    "none",
    "--only-binary=:all:",
]
_PLATFORMS = [
    "manylinux_2_36_x86_64",
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
    "any",
]


def ensure_wheelhouse(progress: Callable[[str], None]) -> Path:
    standin = [f"{name}=={version}" for name, version in GRPC_STANDIN_PACKAGES.items()]
    wanted = [f"smg=={SMG_VERSION}", *scaler_requirements(), *standin]
    digest = hashlib.sha256(" ".join(wanted).encode()).hexdigest()[:12]
    target = cache_dir() / "wheelhouse" / f"smg-{SMG_VERSION}-{digest}"
    stamp = target / ".complete"
    if stamp.is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    progress(
        f"downloading smg=={SMG_VERSION}, the scaler's and the gRPC stand-ins' packages "
        "and their dependencies"
    )
    platforms = [arg for platform in _PLATFORMS for arg in ("--platform", platform)]
    proc = run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--dest",
            str(target),
            *_TARGET,
            *platforms,
            *wanted,
        ],
        check=False,
        timeout=900,
    )
    if proc.returncode != 0:
        raise EnvironmentProblem(
            f"could not download smg=={SMG_VERSION} for the lab wheelhouse: "
            f"{(proc.stderr.strip().splitlines() or ['pip failed'])[-1]}",
            hint="check that this machine reaches PyPI (pip's configured index)",
        )
    stamp.write_text(SMG_VERSION)
    return target
