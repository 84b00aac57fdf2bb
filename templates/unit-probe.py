# pdctl unit probe: run on a host as `python3 -c "$(cat unit-probe.py)" URL UNIT TIMEOUT`.
# Prints one JSON line: {"status": HTTP status of URL (0: no answer), "state": the unit's
# ActiveState, "restarts": its NRestarts, "journal": its last lines when not healthy}.
# The roles wait on it until status is 200 or systemd gave up on the unit (state failed),
# and report state, restarts and journal when a unit never became healthy. The journal is
# what the unit's own processes wrote (_SYSTEMD_UNIT=), not systemd's lines about it: the
# state and restart count already say those.
import json
import subprocess
import sys
import urllib.error
import urllib.request

url, unit, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
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
