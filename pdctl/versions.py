"""Pinned versions of what pdctl installs on hosts: one home for each."""

# The Shepherd Model Gateway (PyPI `smg`), installed in its own venv on the router host.
SMG_VERSION = "1.13.0"
