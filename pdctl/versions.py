"""Pinned versions of what pdctl installs on hosts: one home for each."""

from importlib import metadata

# The Shepherd Model Gateway (PyPI `smg`), installed in its own venv on the router host.
SMG_VERSION = "1.13.0"

# What `pdctl scaler run` imports on the router host (no Ansible there).
SCALER_PACKAGES = ("paramiko", "pydantic", "click", "pyyaml", "rich", "prometheus-client")


def scaler_requirements() -> list[str]:
    """The scaler's packages at the versions this control node runs, so it behaves as tested."""
    pinned = []
    for name in SCALER_PACKAGES:
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pinned.append(name)
    return pinned
