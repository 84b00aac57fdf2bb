"""Runs ON a host: one health probe of a unit, what the roles' health waits repeat.

``python3 -c BOOT pdctl.onhost.unit_probe URL UNIT TIMEOUT`` (the roles get argv and stdin from
the pd_onhost lookup). A ``grpc://HOST:PORT/package.Service/Method`` URL (a gRPC worker: vLLM,
SGLang's --grpc-mode) is asked that health method by grpc_health.grpc_healthy, the one
implementation of the call that pdctl and the scaler use too: 200 when healthy, 503 when it
answers otherwise. Without a method (a plan from before the URL named one) it asks vLLM's
HealthCheck, grpc_healthy's default.

Prints one JSON line: {"status": HTTP status of URL (0: no answer), "state": the unit's
ActiveState, "restarts": its NRestarts, "journal": its last lines when not healthy}. The roles
wait on it until status is 200 or systemd gave up on the unit (state failed), and report state,
restarts and journal when a unit never became healthy. The journal is what the unit's own
processes wrote (_SYSTEMD_UNIT=), not systemd's lines about it: the state and restart count
already say those.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

from pdctl.onhost.grpc_health import grpc_healthy

JOURNAL_LINES = 15


def status(url: str, timeout: float) -> int:
    """The HTTP status URL answers with (gRPC: 200 healthy, 503 not), 0 for no answer."""
    try:
        if url.startswith("grpc://"):
            authority, slash, method = url[len("grpc://") :].partition("/")
            address, _, port = authority.rpartition(":")
            asked = {"path": f"/{method}"} if slash and method else {}
            with socket.create_connection((address.strip("[]"), int(port)), timeout=timeout) as s:
                return 200 if grpc_healthy(s, authority, timeout=timeout, **asked) else 503
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - the plan's probe URL
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except Exception:  # no answer, whatever the reason: the unit's state says more
        return 0


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def main() -> None:
    url, unit, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    found = status(url, timeout)
    shown = _run(["systemctl", "show", "--property=ActiveState,NRestarts", unit])
    props = dict(line.partition("=")[::2] for line in shown.splitlines())
    journal = ""
    if found != 200:
        lines = str(JOURNAL_LINES)
        journal = _run(
            [
                "journalctl",
                f"_SYSTEMD_UNIT={unit}",
                "--lines",
                lines,
                "--no-pager",
                "--output",
                "cat",
            ]
        )
    print(
        json.dumps(
            {
                "status": found,
                "state": props.get("ActiveState", "unknown"),
                "restarts": int(props.get("NRestarts") or 0),
                "journal": journal,
            }
        )
    )


if __name__ == "__main__":
    main()
