"""Restart this host's router without taking the service down (the pd_router role's handler,
one router host at a time).

    router_restart.py UNIT KEEPALIVED_UNIT FAILOVER_ADDRESS URL TIMEOUT MESH ENV_FILE < WORKERS

When this host holds the failover address, its keepalived stops first: it gives the address up
at once (a priority-0 advert) and a backup takes it. Then the router restarts and must answer
URL/health within TIMEOUT seconds. It comes back knowing no worker: without SMG's mesh
(MESH=0) this registers WORKERS again (stdin: a JSON list of POST /workers bodies, the plan's
registrations) with the API key in ENV_FILE; with it (MESH=1) the mesh gives them back.
MESH=first is the first router of a service turning the mesh on: no other router runs meshed
yet, so it registers them too when it served before (a new service's routers get them from the
pd_router role's registration, through one router, once all run). Either
way, a router that was ready before must be ready again (URL/readiness) within TIMEOUT: the
next router's restart may hand it the address. keepalived starts again last, and joins as
backup. KEEPALIVED_UNIT and FAILOVER_ADDRESS are "-" without a failover address. Prints one
JSON line; exits 1 when the router did not come back in time.

Standard library only; runs as root on the router host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def status(url: str, body: object = None, key: str = "") -> int:
    """The status of a GET of ``url`` (a POST of ``body`` as JSON, when given); 0: no answer."""
    if not url.startswith("http://"):
        return 0
    request = urllib.request.Request(url)  # noqa: S310 - http:// only, checked above
    if body is not None:
        request.data = json.dumps(body).encode()
        request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with OPENER.open(request, timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):  # no answer (URLError is an OSError), or a garbled one
        return 0


def api_key(env_file: str) -> str:
    """PDCTL_ROUTER_API_KEY from the router's environment file (root-only)."""
    for line in Path(env_file).read_text(encoding="utf-8").splitlines():
        name, _, value = line.strip().partition("=")
        if name == "PDCTL_ROUTER_API_KEY":
            return value.strip()
    return ""


def post_workers(url: str, workers: list[dict[str, object]], key: str) -> list[tuple[str, int]]:
    """POST each worker, with the drain the scaler's registrations have too; each one's URL and
    the router's answer (202 registered, 409 already there, 0 no answer)."""
    drain = {"health": {"drain_settle_secs": 2}}
    return [(str(w.get("url")), status(f"{url}/workers", {**w, **drain}, key)) for w in workers]


def register(url: str, workers: list[dict[str, object]], key: str) -> list[str]:
    """POST each worker (202 registered, 409 already there); the URLs the router refused."""
    return [u for u, code in post_workers(url, workers, key) if code not in {200, 201, 202, 409}]


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


def registers_itself(mesh: str, was_ready: bool) -> bool:
    """Whether the restarted router gets its workers from this script (MESH, see above)."""
    return mesh == "0" or (mesh == "first" and was_ready)


def main(argv: list[str], workers: list[dict[str, object]]) -> int:
    unit, keepalived, address, url, timeout, mesh, env_file = argv
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
    if healthy and workers and registers_itself(mesh, was_ready):
        done["refused"] = register(url, workers, api_key(env_file))
    ready = healthy and (not was_ready or wait(lambda: status(f"{url}/readiness") == 200, budget))
    if handover:
        run(["systemctl", "start", keepalived], STOP_TIMEOUT)
    done.update(healthy=healthy, ready=ready, health=status(f"{url}/health"))
    print(json.dumps(done))
    return 0 if healthy and ready else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], json.loads(sys.stdin.read() or "[]")))
