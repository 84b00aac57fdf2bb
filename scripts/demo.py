"""`make demo`: the user's journey on an emulated bare-metal fleet, command by command.

Each step prints the exact pdctl command it runs, so the transcript doubles as
a tutorial. The workspace is ``$PDCTL_HOME`` or ``.demo/`` in the checkout;
the lab stays up afterwards for exploring (``pdctl lab down`` removes it).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOME = Path(os.environ.get("PDCTL_HOME", REPO / ".demo")).resolve()
PDCTL = str(Path(sys.executable).parent / "pdctl")


def step(title: str, *argv: str) -> str:
    print(f"\n== {title}\n$ {shlex.join(['pdctl', *argv])}", flush=True)
    proc = subprocess.run(
        [PDCTL, *argv],
        env={**os.environ, "PDCTL_HOME": str(HOME)},
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        sys.exit(f"demo: `pdctl {' '.join(argv)}` failed with exit {proc.returncode}")
    return proc.stdout


def main() -> None:
    HOME.mkdir(parents=True, exist_ok=True)
    print(f"pdctl demo: workspace {HOME}")
    step(
        "Boot an emulated fleet: 1 CPU host (router) and 2 GPU hosts",
        "lab",
        "up",
        "--hosts",
        "3",
        "--cpu-hosts",
        "1",
    )
    step("The lab as a script sees it", "--json", "lab", "status")
    step(
        "SSH into a GPU host and list its RDMA devices", "lab", "ssh", "node2", "--", "ibv_devices"
    )
    print(
        f"\nThe lab is still up. Explore it with `PDCTL_HOME={HOME} pdctl lab ssh node2`;"
        f" remove it with `PDCTL_HOME={HOME} pdctl lab down`."
    )


if __name__ == "__main__":
    main()
