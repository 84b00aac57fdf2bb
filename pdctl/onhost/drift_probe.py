"""Runs ON a host: what a deploy left there, for pdctl's quick no-op check
(pdctl/operations/drift.py) to compare with its record.

``python3 -m pdctl.onhost.drift_probe`` (a bundle, pdctl/onhost/bundle.py) reads one JSON
document on stdin, after the bundle (so no key is in any argv), with:
  roots   paths whose owner, mode and content are read: a file, a symlink, or a directory
          (walked; __pycache__ skipped). A directory holding pyvenv.cfg is a venv: its
          pyvenv.cfg and each package's dist-info RECORD (which lists every installed file
          with its hash) stand for the whole tree, so a 200 MB venv is read in milliseconds.
  units   systemd units whose ActiveState and UnitFileState are read
  images  container images that must be present (podman, else docker)
  states  argv of `pdctl-unitctl SERVICE states`, or null on a host without slots
  key     hex key for HMAC-SHA256 of file contents: no plain hash of a secrets file leaves
          the host, and the record pdctl keeps cannot be checked against guessed secrets
It prints one JSON document and changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SKIP = frozenset({"__pycache__"})
VENV_RECORDS = "lib*/python*/site-packages/*.dist-info/RECORD"


def signature(path: Path, key: bytes) -> str:
    """`dir MODE UID GID`, `link TARGET`, or `MODE UID GID HMAC` for a regular file."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return f"link {path.readlink()}"
    owner = f"{stat.S_IMODE(info.st_mode):o} {info.st_uid} {info.st_gid}"
    if stat.S_ISDIR(info.st_mode):
        return f"dir {owner}"
    mac = hmac.new(key, digestmod=hashlib.sha256)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            mac.update(chunk)
    return f"{owner} {mac.hexdigest()[:32]}"


def paths(root: Path) -> Iterator[Path]:
    if not (root.is_symlink() or root.exists()):
        return
    yield root
    if root.is_symlink() or not root.is_dir():
        return
    if (root / "pyvenv.cfg").is_file():
        yield root / "pyvenv.cfg"
        yield from sorted(root.glob(VENV_RECORDS))
        return
    for entry in sorted(root.iterdir()):
        if entry.name not in SKIP:
            yield from paths(entry)


def units(names: list[str]) -> dict[str, list[str]]:
    """Per unit [ActiveState, UnitFileState]; `systemctl show` prints one block per unit."""
    if not names:
        return {}
    proc = subprocess.run(
        ["systemctl", "show", "--property=ActiveState,UnitFileState", *names],
        capture_output=True,
        text=True,
        check=False,
    )
    blocks = proc.stdout.strip().split("\n\n") if proc.stdout.strip() else []
    blocks += [""] * (len(names) - len(blocks))
    found: dict[str, list[str]] = {}
    for name, block in zip(names, blocks, strict=False):
        fields = dict(line.partition("=")[::2] for line in block.splitlines())
        found[name] = [fields.get("ActiveState", "unknown"), fields.get("UnitFileState") or "-"]
    return found


def images(names: list[str]) -> dict[str, bool]:
    runtime = shutil.which("podman") or shutil.which("docker")
    if not runtime:
        return dict.fromkeys(names, False)
    present = {}
    for name in names:
        if runtime.endswith("podman"):
            argv = [runtime, "image", "exists", name]
        else:
            argv = [runtime, "image", "inspect", "--format", "present", name]
        present[name] = subprocess.run(argv, capture_output=True, check=False).returncode == 0
    return present


def main(text: str) -> None:
    params: dict[str, Any] = json.loads(text)
    key = bytes.fromhex(params["key"])
    files: dict[str, str] = {}
    for root in params.get("roots") or []:
        for path in paths(Path(root)):
            try:
                files[str(path)] = signature(path, key)
            except OSError as exc:
                files[str(path)] = f"unreadable {exc.strerror}"
    doc: dict[str, Any] = {
        "files": files,
        "units": units(params.get("units") or []),
        "images": images(params.get("images") or []),
        "states": None,
    }
    if params.get("states"):
        proc = subprocess.run(params["states"], capture_output=True, text=True, check=False)
        doc["states"] = proc.stdout if proc.returncode == 0 else None
    print(json.dumps(doc))


if __name__ == "__main__":
    main(sys.stdin.read())
