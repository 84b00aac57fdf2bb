"""`make demo`: the user's journey on an emulated bare-metal fleet, command by command.

Each step prints the exact pdctl command it runs, so the transcript doubles as
a tutorial: boot a lab, register it as a fleet (preflight included), deploy the
PD service, send a chat request through the router, scale decode up and down.
The workspace is ``$PDCTL_HOME`` or ``.demo/`` in the checkout; the lab and the
service stay up afterwards for exploring (``pdctl destroy pdlab -y; pdctl lab down``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOME = Path(os.environ.get("PDCTL_HOME", REPO / ".demo")).resolve()
PDCTL = str(Path(sys.executable).parent / "pdctl")
SPEC = REPO / "examples" / "lab" / "pd.yml"
ENV = {
    **os.environ,
    "PDCTL_HOME": str(HOME),
    "HF_TOKEN": os.environ.get("HF_TOKEN", "hf_demo_not_a_real_token"),
}


def step(title: str, *argv: str, show: bool = True) -> str:
    print(f"\n== {title}\n$ {shlex.join(['pdctl', *argv])}", flush=True)
    proc = subprocess.run([PDCTL, *argv], env=ENV, stdout=subprocess.PIPE, text=True, check=False)
    if show:
        print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        sys.exit(f"demo: `pdctl {' '.join(argv)}` failed with exit {proc.returncode}")
    return proc.stdout


def chat(endpoint: str, key: str, text: str) -> str:
    request = urllib.request.Request(  # noqa: S310 - http to the lab's own router
        f"{endpoint}/v1/chat/completions",
        method="POST",
        data=json.dumps(
            {"model": "lab/tiny-llama", "messages": [{"role": "user", "content": text}]}
        ).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - the lab's router
        return str(json.loads(response.read())["choices"][0]["message"]["content"])


def forget_an_earlier_labs_hosts(lab_addresses: set[str]) -> None:
    """This workspace's fleet `lab` may list the hosts of an earlier demo's lab, booted under
    other addresses (another lab held its id then): they are gone for good, and the preflight
    would look for them (each host checks that it reaches the others)."""
    proc = subprocess.run(
        [PDCTL, "--json", "fleet", "show", "lab"],
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return  # no fleet `lab` yet
    hosts = json.loads(proc.stdout)["hosts"]
    gone = [f"--host={h['name']}" for h in hosts if h["address"] not in lab_addresses]
    if gone:
        step("Forget the hosts of an earlier lab", "fleet", "remove", "lab", *gone, "--force", "-y")


def wait_running(group: str, count: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        doc = json.loads(
            step(f"waiting for {group} to run {count}", "--json", "status", "pdlab", show=False)
        )
        replicas = doc["groups"][group]["replicas"]
        if sum(r["state"] == "active" and r["registered"] for r in replicas) == count:
            return
        time.sleep(2)
    sys.exit(f"demo: {group} did not reach {count} replicas")


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
    status = json.loads(step("The lab as a script sees it", "--json", "lab", "status"))
    step(
        "SSH into a GPU host and list its RDMA devices", "lab", "ssh", "node2", "--", "ibv_devices"
    )
    forget_an_earlier_labs_hosts({h["address"] for h in status["hosts"]})
    # --repin: a lab booted anew (after `lab down`) has new host keys; this workspace's fleet
    # `lab` may still pin the old ones from an earlier demo.
    step(
        "Register the hosts as a fleet: keys pinned, facts gathered, preflight run",
        *status["fleet_add"].split()[1:],
        "--repin",
    )
    step(
        "Deploy the PD service (router, prefill and decode pools)",
        "deploy",
        str(SPEC),
        "--fleet",
        "lab",
        "-y",
    )
    step("Its status, read live", "status", "pdlab")
    step("Where clients go (the API key: --show-key)", "endpoint", "pdlab")
    # The key is read from the router host each time (pdctl keeps no copy); not printed here.
    doc = json.loads(
        step(
            "The URL and API key, for a script",
            "--json",
            "endpoint",
            "pdlab",
            "--show-key",
            show=False,
        )
    )
    endpoint, key = doc["endpoint"], doc["api_key"]
    print(f"\n== A chat request through the router at {endpoint}")
    print(f"$ curl {endpoint}/v1/chat/completions -H 'Authorization: Bearer $KEY' -d '...'")
    print(chat(endpoint, key, "What is prefill/decode disaggregation?"))
    step("Scale decode up to 2 (a pin, within the group's bounds)", "scale", "pdlab", "decode", "2")
    wait_running("decode", 2)
    step("Two decode replicas now", "status", "pdlab")
    step("And back down to 1", "scale", "pdlab", "decode", "1")
    wait_running("decode", 1)
    step("Hand decode back to the autoscaler", "scale", "pdlab", "decode", "auto")
    print(chat(endpoint, key, "still there?"))
    print(
        f"\nThe lab and the service are still up. Explore: `PDCTL_HOME={HOME} pdctl status pdlab`,"
        f" `pdctl logs pdlab decode/1`. Clean up: `PDCTL_HOME={HOME} pdctl destroy pdlab -y;"
        f" PDCTL_HOME={HOME} pdctl lab down`."
    )


if __name__ == "__main__":
    main()
