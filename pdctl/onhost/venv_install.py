"""Runs ON a host: a venv that holds the given packages, made in one step, and a report.

The router's SMG and the scaler's packages each live in a venv on the router host. ``python3
-m venv`` spends most of its time installing pip (and, up to Python 3.11, setuptools) into the
new venv: about 2 CPU-s, every first deploy, for a tool the venv needs only while packages go
in. So the venv is made without pip, and the pip wheel that its interpreter's own ``ensurepip``
would install (the distribution's ``WHEEL_PKG_DIR``, or ``ensurepip/_bundled``) installs the
packages from outside it, run from the wheel as ``ensurepip`` itself runs it. An interpreter
that has no such wheel gets a venv with pip, as before.

The request (JSON on stdin, after the bundle):

    {"check": bool,
     "venv": PATH,              # the venv's directory
     "python": PYTHON,          # the interpreter that makes it: a name on PATH or a path
     "requirements": [REQ...],  # "name==version" or "name"
     "find_links": PATH|null}   # install from this directory only (no index), else pip's index

It is idempotent: when the venv's interpreter reports every requirement installed (at its
version), nothing runs. With ``check`` it reports what it would install and changes nothing. A
venv this step made is removed again when its install fails. Everything is data: paths plain
and absolute, requirements a name and a version, never a pip option. Standard library and this
package only, Python 3.9 (it ships as a bundle, pdctl/onhost/bundle.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from pdctl.onhost.host_apply import ApplyError, RequestError, below_top, plain_path, serve

REQUIREMENT = re.compile(r"([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(?:==([A-Za-z0-9.+!_-]+))?")
PYTHON_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
QUERY_TIMEOUT = 60.0
VENV_TIMEOUT = 300.0
PIP_TIMEOUT = 1200.0  # a large wheel (SMG's) from an index over a slow link

# Run by the venv's interpreter: every installed distribution's version, by normalized name.
INSTALLED = (
    "import json, re, importlib.metadata as m\n"
    "print(json.dumps({re.sub(r'[-_.]+', '-', (d.metadata['Name'] or '')).lower(): d.version"
    " for d in m.distributions()}))"
)
# Run by the interpreter that makes the venv: the pip wheel its ensurepip would install.
PIP_WHEEL = """\
import ensurepip, glob, json, os, re, sysconfig
dirs = [sysconfig.get_config_var("WHEEL_PKG_DIR") or "",
        os.path.join(os.path.dirname(ensurepip.__file__), "_bundled")]
def version(path):
    return [int(n) for n in re.findall(r"[0-9]+", os.path.basename(path).split("-")[1])]
for d in dirs:
    found = glob.glob(os.path.join(d, "pip-*.whl")) if d else []
    if found:
        print(max(found, key=version))
        break
"""
# Run by the venv's interpreter: pip from the wheel given first, as ensurepip runs it.
PIP_FROM_WHEEL = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('pip', run_name='__main__', alter_sys=True)"
)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> str:
    """1.13 and 1.13.0 are one version; anything not plain dotted numbers compares as given."""
    if re.fullmatch(r"[0-9]+(\.[0-9]+)*", version):
        parts = version.split(".")
        while len(parts) > 1 and int(parts[-1]) == 0:
            parts.pop()
        return ".".join(str(int(p)) for p in parts)
    return version


def _requirements(values: Any) -> list[tuple[str, str | None]]:
    if not isinstance(values, list) or not values:
        raise RequestError(f"not a list of requirements: {values!r}")
    parsed = []
    for value in values:
        match = REQUIREMENT.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise RequestError(f"not a requirement (NAME or NAME==VERSION): {value!r}")
        parsed.append((match.group(1), match.group(2)))
    return parsed


def _python(value: Any) -> str:
    if isinstance(value, str) and PYTHON_NAME.fullmatch(value):
        return value
    return plain_path(value)


def _run(argv: list[str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        raise ApplyError(f"{what} did not finish within {timeout:.0f} s") from exc
    except OSError as exc:
        raise ApplyError(f"{what}: {exc}") from exc
    return done


def installed(python: str) -> dict[str, str]:
    """The venv's distributions and their versions, by normalized name ({} with no venv)."""
    if not Path(python).exists():
        return {}
    done = _run([python, "-I", "-c", INSTALLED], QUERY_TIMEOUT, "listing the venv's packages")
    if done.returncode != 0:
        return {}  # a broken venv: the install below mends it or reports pip's error
    versions = json.loads(done.stdout)
    return {str(k): str(v) for k, v in versions.items()} if isinstance(versions, dict) else {}


def missing(requirements: list[tuple[str, str | None]], have: dict[str, str]) -> list[str]:
    wanted = []
    for name, version in requirements:
        there = have.get(_normalized(name))
        if there is None or (version is not None and _release(there) != _release(version)):
            wanted.append(f"{name}=={version}" if version else name)
    return wanted


def pip_wheel(python: str) -> str | None:
    """The pip wheel ``python``'s ensurepip would install, or None (then the venv gets pip)."""
    done = _run([python, "-I", "-c", PIP_WHEEL], QUERY_TIMEOUT, f"{python} finding its pip")
    found = done.stdout.strip()
    return found if done.returncode == 0 and found.endswith(".whl") else None


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stderr.strip() or done.stdout.strip())[-2000:]


def install(request: dict[str, Any]) -> dict[str, Any]:
    venv = below_top(request.get("venv"))  # a failed install removes it again
    python = _python(request.get("python", "python3"))
    requirements = _requirements(request.get("requirements"))
    find_links = request.get("find_links")
    source = ["--no-index", "--find-links", plain_path(find_links)] if find_links else []
    venv_python = f"{venv}/bin/python"
    wanted = missing(requirements, installed(venv_python))
    if not wanted:
        return {"changed": False, "installed": [], "files": []}
    if request.get("check"):
        return {"changed": True, "installed": wanted, "files": [venv]}
    made = not Path(venv_python).exists()
    wheel = pip_wheel(python)
    try:
        if made:
            argv = [python, "-m", "venv", *(["--without-pip"] if wheel else []), venv]
            done = _run(argv, VENV_TIMEOUT, f"making the venv {venv}")
            if done.returncode != 0:
                raise ApplyError(f"{python} -m venv {venv} failed: {_tail(done)}")
        pip = [venv_python, "-m", "pip"]
        if wheel:
            pip = [venv_python, "-I", "-c", PIP_FROM_WHEEL, wheel]
        # Every requirement, not only those missing: pip resolves them as one set.
        names = [f"{n}=={v}" if v else n for n, v in requirements]
        done = _run([*pip, "install", "--quiet", *source, *names], PIP_TIMEOUT, "pip install")
        if done.returncode != 0:
            raise ApplyError(f"pip could not install {' '.join(wanted)} in {venv}: {_tail(done)}")
        still = missing(requirements, installed(venv_python))
        if still:
            raise ApplyError(f"pip finished but {venv} does not hold {' '.join(still)}")
    except ApplyError as exc:
        if made:  # nothing is left of this run
            shutil.rmtree(venv, ignore_errors=True)
            raise
        msg = f"{exc} (pip may have installed part of it; a next run completes it)"
        return {"changed": True, "failed": True, "msg": msg, "installed": [], "files": [venv]}
    report = {"changed": True, "installed": wanted, "files": [venv]}
    return {**report, "pip": "wheel" if wheel else "venv"}


def main() -> None:
    serve(install)


if __name__ == "__main__":
    main()
