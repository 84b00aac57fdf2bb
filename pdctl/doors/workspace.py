"""Where pdctl keeps its files: the workspace (PDCTL_HOME) and the machine cache."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pdctl.core import validate
from pdctl.core.errors import InputError


@dataclass(frozen=True)
class Workspace:
    """PDCTL_HOME: fleets' inventories, service state and lab files."""

    home: Path

    @property
    def inventories(self) -> Path:
        return self.home / "inventories"

    @property
    def state(self) -> Path:
        return self.home / ".pdctl"

    @property
    def lab(self) -> Path:
        return self.state / "lab"

    @property
    def services(self) -> Path:
        return self.state / "services"

    def fleet_dir(self, name: str) -> Path:
        if not validate.FLEET_NAME.match(name):  # a name, never a path
            raise InputError(f"bad fleet name {name!r}", hint=f"use {validate.FLEET_NAME_RULE}")
        return self.inventories / name

    def service_dir(self, name: str) -> Path:
        if not validate.SERVICE_NAME.match(name):
            raise InputError(f"bad service name {name!r}", hint=f"use {validate.SERVICE_NAME_RULE}")
        return self.services / name


def write_atomic(path: Path, text: str, *, private: bool = False) -> None:
    """Write PATH whole or not at all (a reader never sees half of it); ``private``: 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if private:
        tmp.touch(mode=0o600)
    tmp.write_text(text)
    tmp.replace(path)


def cache_dir() -> Path:
    """Machine-wide cache shared by every workspace (lab rootfs, wheels, images).

    Shared on purpose: the lab's rootfs takes a minute to build and is the
    same for every workspace on the machine.
    """
    return Path(os.environ.get("PDCTL_CACHE", "/var/cache/pdctl"))
