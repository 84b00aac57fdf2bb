"""Runs ON a router host: give this router the service's active workers, then wait until it is
ready (the pd_router role's registration: one step, instead of a task per request).

    router_register.py URL ENV_FILE REGISTER READY_TIMEOUT < WORKERS

WORKERS (stdin, after the bundle): a JSON list of POST /workers bodies, the plan's registrations.
With REGISTER=1 the router's workers are listed (GET /workers) and each one it lacks is
registered (202; 409 means it has it already), with the API key read from ENV_FILE: the key
never leaves the host. With READY_TIMEOUT above 0 the router must then answer /readiness (a
healthy prefill and decode) within that many seconds. Prints one JSON report, {"registered":
[URL...], "refused": [{"url", "status"}...], "listed": bool, "ready": bool | null, "msg"}, and
exits 1 when the router refused a worker or was not ready in time (msg says which).

Standard library and router_restart only; runs as root on the router host.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

from pdctl.onhost.router_restart import OPENER, api_key, post_workers, status, wait

LIST_TIMEOUT = 10.0


def listed(url: str, key: str) -> set[str] | None:
    """The worker URLs the router has; None when it did not say (then every worker is
    registered, and 409 says which it had)."""
    if not url.startswith("http://"):
        return None
    request = urllib.request.Request(f"{url}/workers")  # noqa: S310 - http:// only, checked above
    request.add_header("Authorization", f"Bearer {key}")
    try:
        with OPENER.open(request, timeout=LIST_TIMEOUT) as answer:
            doc = json.loads(answer.read())
    except (OSError, ValueError):  # no answer, an error status (HTTPError), or no JSON
        return None
    workers = doc.get("workers") if isinstance(doc, dict) else None
    if not isinstance(workers, list):
        return None
    return {str(w["url"]) for w in workers if isinstance(w, dict) and "url" in w}


def main(argv: list[str], workers: list[dict[str, object]]) -> int:
    url, env_file, register, ready_timeout = argv
    report: dict[str, Any] = {"registered": [], "refused": [], "listed": False, "ready": None}
    if register == "1" and workers:
        key = api_key(env_file)
        known = listed(url, key)
        report["listed"] = known is not None
        missing = [w for w in workers if known is None or str(w.get("url")) not in known]
        answers = post_workers(url, missing, key)
        report["registered"] = [u for u, code in answers if code in {200, 201, 202}]
        report["refused"] = [
            {"url": u, "status": code} for u, code in answers if code not in {200, 201, 202, 409}
        ]
    if float(ready_timeout) > 0:
        report["ready"] = wait(lambda: status(f"{url}/readiness") == 200, float(ready_timeout))
    report["msg"] = problem(url, report, ready_timeout)
    print(json.dumps(report))
    return 1 if report["msg"] else 0


def problem(url: str, report: dict[str, Any], ready_timeout: str) -> str:
    """What failed, for the operator ("" when nothing did)."""
    refused = report["refused"]
    if refused:
        answers = "; ".join(f"{r['url']} -> {r['status'] or 'no answer'}" for r in refused)
        return f"the router {url} refused {len(refused)} worker(s): {answers}"
    if report["ready"] is False:
        return (
            f"the router {url} was not ready (a healthy prefill and decode) within "
            f"{ready_timeout} s"
        )
    return ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], json.loads(sys.stdin.read() or "[]")))
