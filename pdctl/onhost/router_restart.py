"""Restart this host's router without taking the service down (the pd_router role's handler,
one router host at a time).

    router_restart.py UNIT KEEPALIVED_UNIT FAILOVER_ADDRESS URL TIMEOUT MESH

When this host holds the failover address, its keepalived stops first: it gives the address up
at once (a priority-0 advert) and a backup takes it. Then the router restarts and must answer
URL/health within TIMEOUT seconds, and URL/readiness too when it was ready before and has
peers (MESH=1: the mesh gives a restarted router its workers back; a lone router gets them
from the registration that follows). keepalived starts again last, and joins as backup.
KEEPALIVED_UNIT and FAILOVER_ADDRESS are "-" without a failover address. Prints one JSON
line; exits 1 when the router did not come back in time.

Standard library only; runs as root on the router host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Callable

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def status(url: str) -> int:
    try:
        with OPENER.open(url, timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):  # no answer (URLError is an OSError), or a garbled one
        return 0


# A quick query (ip, systemctl is-active) answers in well under this; a stop or restart may
# take the unit's own stop timeout (systemd's default 90 s) on top of the start budget.
QUERY_TIMEOUT = 10.0
STOP_TIMEOUT = 90.0


def run(argv: list[str], timeout: float, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)


def holds(address: str) -> bool:
    out = run(["ip", "-o", "-4", "addr", "show"], QUERY_TIMEOUT).stdout
    return any(f" {address}/" in line for line in out.splitlines())


def active(unit: str) -> bool:
    return run(["systemctl", "is-active", "--quiet", unit], QUERY_TIMEOUT).returncode == 0


def wait(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return predicate()


def main(argv: list[str]) -> int:
    unit, keepalived, address, url, timeout, mesh = argv
    budget = float(timeout)
    done: dict[str, object] = {"unit": unit, "handed_over": False}
    was_ready = status(f"{url}/readiness") == 200
    handover = keepalived != "-" and active(keepalived) and holds(address)
    if handover:
        run(["systemctl", "stop", keepalived], STOP_TIMEOUT, check=True)
        done["handed_over"] = True
        # Someone else answers on the address before this router goes (when someone can).
        on_address = f"http://{address}:{url.rsplit(':', 1)[1]}/health"
        wait(lambda: not holds(address) and status(on_address) == 200, 10)
    run(["systemctl", "restart", unit], STOP_TIMEOUT + budget, check=True)
    healthy = wait(lambda: status(f"{url}/health") == 200, budget)
    ready = healthy and (
        not (was_ready and mesh == "1") or wait(lambda: status(f"{url}/readiness") == 200, budget)
    )
    if handover:
        run(["systemctl", "start", keepalived], STOP_TIMEOUT)
    done.update(healthy=healthy, ready=ready, health=status(f"{url}/health"))
    print(json.dumps(done))
    return 0 if healthy and ready else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
