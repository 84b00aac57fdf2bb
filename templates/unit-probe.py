# pdctl unit probe: run on a host as `python3 -c "$(cat unit-probe.py)" URL UNIT TIMEOUT`.
# A grpc://HOST:PORT/package.Service/Method URL (a gRPC worker: vLLM, SGLang's --grpc-mode) is
# asked that health method by pdctl/grpc_health.py's grpc_healthy, whose text the roles put
# ahead of this one (one implementation of the call, shared with pdctl and the scaler): 200 when
# healthy, 503 when it answers otherwise. Without a method (a plan from before the URL named
# one) it asks vLLM's HealthCheck, grpc_healthy's default.
# Prints one JSON line: {"status": HTTP status of URL (0: no answer), "state": the unit's
# ActiveState, "restarts": its NRestarts, "journal": its last lines when not healthy}.
# The roles wait on it until status is 200 or systemd gave up on the unit (state failed),
# and report state, restarts and journal when a unit never became healthy. The journal is
# what the unit's own processes wrote (_SYSTEMD_UNIT=), not systemd's lines about it: the
# state and restart count already say those.
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

url, unit, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
    if url.startswith("grpc://"):
        authority, slash, method = url[len("grpc://"):].partition("/")
        address, _, port = authority.rpartition(":")
        asked = {"path": f"/{method}"} if slash and method else {}
        with socket.create_connection((address.strip("[]"), int(port)), timeout=timeout) as stream:
            healthy = grpc_healthy(stream, authority, timeout=timeout, **asked)  # noqa: F821
            status = 200 if healthy else 503
    else:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            status = reply.status
except urllib.error.HTTPError as error:
    status = error.code
except Exception:
    status = 0
shown = subprocess.run(
    ["systemctl", "show", "--property=ActiveState,NRestarts", unit],
    capture_output=True, text=True, check=False,
).stdout
props = dict(line.partition("=")[::2] for line in shown.splitlines())
journal = "" if status == 200 else subprocess.run(
    ["journalctl", f"_SYSTEMD_UNIT={unit}", "--lines", "15", "--no-pager", "--output", "cat"],
    capture_output=True, text=True, check=False,
).stdout
print(json.dumps({
    "status": status,
    "state": props.get("ActiveState", "unknown"),
    "restarts": int(props.get("NRestarts") or 0),
    "journal": journal,
}))
