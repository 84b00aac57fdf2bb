"""Locate the Ansible content (playbooks/, roles/, templates/).

In a checkout (an editable install) it sits beside the package; in a wheel it
is packed under ``pdctl/_content`` (see pyproject.toml).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # pdctl/, this file being pdctl/doors/content.py


@cache
def content_root() -> Path:
    for root in (_PACKAGE / "_content", _PACKAGE.parent):
        if (root / "playbooks").is_dir() and (root / "roles").is_dir():
            return root
    raise RuntimeError(f"pdctl's Ansible content is missing next to {_PACKAGE}: reinstall pdctl")


def playbook(name: str) -> Path:
    return content_root() / "playbooks" / name


def roles_dir() -> Path:
    return content_root() / "roles"
