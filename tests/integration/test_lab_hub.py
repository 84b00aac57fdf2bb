"""The lab's model hub in a real lab: its own namespace on the lab bridge, reached from a lab
host (python3's stdlib over the lab network, as pdctl's fetcher does), counted in
``pdctl --json lab status``, rate-capped, token-guarded, gone at ``lab down``.

One CPU host: the hub needs no GPU host and no worker image (a short lab)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Lab, pdctl, pdctl_json, require_lab

pytestmark = pytest.mark.lab

# Runs on the lab host: download every file of REPO at the hub's main, check each against the
# tree's sha256 (LFS) or size, print {"files": {path: bytes}, "seconds": s}.
FETCH = """
import hashlib, json, sys, time, urllib.request
endpoint, repo, token = sys.argv[1], sys.argv[2], sys.argv[3]
headers = {"Authorization": f"Bearer {token}"} if token else {}
def get(path):
    request = urllib.request.Request(endpoint + path, headers=headers)
    return urllib.request.urlopen(request, timeout=60)
info = json.load(get(f"/api/models/{repo}/revision/main"))
tree = json.load(get(f"/api/models/{repo}/tree/{info['sha']}?recursive=true"))
started, files = time.monotonic(), {}
for entry in tree:
    with get(f"/{repo}/resolve/{info['sha']}/{entry['path']}") as answer:
        assert answer.headers["X-Repo-Commit"] == info["sha"]
        data = answer.read()
    assert len(data) == entry["size"], entry
    if "lfs" in entry:
        assert hashlib.sha256(data).hexdigest() == entry["lfs"]["oid"], entry
    files[entry["path"]] = len(data)
print(json.dumps({"files": files, "seconds": time.monotonic() - started}))
"""


@pytest.fixture(scope="module")
def lab1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_lab()
    home = tmp_path_factory.mktemp("labhub")
    up = pdctl(home, "lab", "up", "--hosts", "1", "--cpu-hosts", "1", check=False)
    try:
        assert up.returncode == 0, up.stderr
        yield Lab(home)
    finally:
        pdctl(home, "lab", "down", check=False)


def fetch(lab: Lab, repo: str, token: str = "") -> dict[str, object]:
    endpoint = lab.status()["hub"]["endpoint"]
    run = lab.ssh("node1", f"python3 - {endpoint} {repo} '{token}'", stdin=FETCH, check=False)
    assert run.returncode == 0, run.stderr
    doc: dict[str, object] = json.loads(run.stdout)
    return doc


def test_a_lab_host_downloads_from_the_hub_and_status_counts_it(lab1: Lab) -> None:
    hub = lab1.status()["hub"]
    subnet = lab1.host("node1")["address"].rsplit(".", 1)[0]
    assert hub["endpoint"] == f"http://{subnet}.2:8080"  # a lab address, not a fleet host
    assert hub["state"] == "running" and "lab/tiny-llama" in hub["models"]
    assert hub["downloads"] == {} and hub["rate"] is None and hub["token"] is False
    got = fetch(lab1, "lab/tiny-llama")
    files = got["files"]
    assert isinstance(files, dict) and "model.safetensors" in files
    hub = lab1.status()["hub"]
    assert hub["downloads"] == {f"lab/tiny-llama/{name}": 1 for name in files}
    assert hub["bytes_served"] == sum(files.values())
    assert hub["models"]["lab/tiny-llama"]["bytes"] == sum(files.values())


def test_added_models_are_served_at_once_within_the_rate_caps(lab1: Lab) -> None:
    added = pdctl_json(lab1.home, "lab", "hub", "add", "lab/capped", "--size", "2M")
    assert added["bytes"] > 2 << 20 and "model.safetensors" in added["files"]
    pdctl(lab1.home, "lab", "hub", "limit", "1M")
    time.sleep(0.6)  # the hub re-reads its settings every half second
    capped = fetch(lab1, "lab/capped")
    seconds = capped["seconds"]
    # ~2 MiB at 1 MiB/s; above, only room for a loaded machine
    assert isinstance(seconds, float) and 1.8 <= seconds <= 15, seconds
    assert lab1.status()["hub"]["rate"] == 1 << 20
    pdctl(lab1.home, "lab", "hub", "limit", "none")
    # The host's own link, capped both ways by tbf on its veth.
    pdctl(lab1.home, "lab", "link-rate", "1M")
    doc = lab1.status()
    assert doc["link_rate"] == 1 << 20 and doc["hub"]["rate"] is None
    assert "tbf" in lab1.ssh("node1", "tc qdisc show dev eth0", user="root").stdout
    slow = fetch(lab1, "lab/capped")["seconds"]
    assert isinstance(slow, float) and 1.5 <= slow <= 15, slow
    pdctl(lab1.home, "lab", "link-rate", "none")
    fast = fetch(lab1, "lab/capped")["seconds"]
    assert isinstance(fast, float) and fast < slow / 2, (fast, slow)  # 2 MiB uncapped: ~0.1 s
    assert lab1.status()["hub"]["downloads"]["lab/capped/model.safetensors"] == 3


def test_a_hub_token_is_required_once_set(lab1: Lab, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("hf_lab_token\n")
    pdctl(lab1.home, "lab", "hub", "token", "--file", str(token))
    time.sleep(0.6)
    endpoint = lab1.status()["hub"]["endpoint"]
    code = lab1.ssh(
        "node1",
        f'python3 -c "import urllib.request as u, urllib.error as e\ntry: '
        f"u.urlopen('{endpoint}/api/models/lab/tiny-llama')\nexcept e.HTTPError as x: "
        f'print(x.code)"',
    )
    assert code.stdout.strip() == "401"
    assert fetch(lab1, "lab/tiny-llama", token="hf_lab_token")["files"]
    assert lab1.status()["hub"]["token"] is True
    pdctl(lab1.home, "lab", "hub", "token", "--none")


def test_lab_down_stops_the_hub(lab1: Lab) -> None:
    lab_id = lab1.status()["hub"]["endpoint"].split(".")[2]
    pdctl(lab1.home, "lab", "down")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    namespaces = listed.stdout
    assert f"pdl{lab_id}-hub" not in namespaces
    assert not Path(f"/sys/class/net/pl{lab_id}hub").exists()
    assert lab1.status()["hub"] is None
