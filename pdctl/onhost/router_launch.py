"""Start SMG (the router) with its API key, keeping the key out of every process's arguments.

SMG takes its API key only as ``--api-key KEY``, which anyone on the host could read in
``ps``. pdctl's router unit runs this launcher instead, with SMG's venv python and the key
in ``PDCTL_ROUTER_API_KEY`` (from the root-only EnvironmentFile router.env): the launcher
removes the key from its environment and hands it to SMG's own argument parser
in-process. /proc/PID/cmdline keeps showing only the arguments systemd passed.

Runs ON the router host, on the venv's python (3.9+), standard library and ``smg`` only: the
one on-host module that imports a third-party package (.importlinter says so), and imports
nothing of pdctl, so the pd_router role installs its text (the pd_onhost lookup's ``source``)
as pd_layout.router_launcher, a file of its own that the unit runs for the router's lifetime.
"""

from __future__ import annotations

import os
import sys

from smg.launch_router import launch_router, parse_router_args

KEY_VARIABLE = "PDCTL_ROUTER_API_KEY"


def main() -> None:
    key = os.environ.pop(KEY_VARIABLE, "").strip()
    if not key:
        sys.exit(f"{KEY_VARIABLE} is not set: the unit's EnvironmentFile must provide it")
    if "--api-key" in sys.argv[1:] or any(a.startswith("--api-key=") for a in sys.argv[1:]):
        sys.exit("--api-key must not be passed on the command line: pdctl supplies it")

    # "--api-key=KEY" in one word: a key that starts with "-" stays a value.
    launch_router(parse_router_args([*sys.argv[1:], f"--api-key={key}"]))


if __name__ == "__main__":
    main()
