"""Issue 16's acceptance on a 4-host lab (1 CPU + 3 GPU hosts): the model comes from the lab's
hub once per file, fanned out inside the fleet into every slot host's cache; the workers load
it from there (read-only, offline); a scale-out and a killed worker download nothing. The
worker image, on one GPU host only (no registry in reach, no archive in the spec), reaches the
other two from their peers before the units start.

One lab and one deployment for the module: the tests run in file order.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import Lab, pdctl, require_lab, service_status, start_lab, wait_for

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "lab" / "pd.yml"
SERVICE = "pdlab"
REPO = "lab/fanout-256m"
CACHE = "/var/lib/pdctl/models"
IMAGE = "localhost/pdctl-lab/sglang-rocm:0.5.4-lab"  # examples/lab/pd.yml's


@dataclass
class Deployed:
    lab: Lab
    env: dict[str, str]
    token: str
    deploy: dict[str, Any]
    image_id: str  # the worker image on the one GPU host that held it
    # The deploys run first with HF_TOKEN=wrong: (exit code, stderr) plain, and the --json doc.
    wrong_token: tuple[int, str, dict[str, Any]]
    units_after_wrong_token: dict[str, str]  # host -> its pd-* units then

    def json(self, *args: str) -> Any:
        return json.loads(pdctl(self.lab.home, "--json", *args, env=self.env).stdout)

    def status(self) -> dict[str, Any]:
        return service_status(self.lab.home, SERVICE, self.env)

    def downloads(self) -> dict[str, int]:
        hub = self.lab.status()["hub"]
        return {k: v for k, v in hub["downloads"].items() if k.startswith(f"{REPO}/")}

    def root(self, node: str, command: str, check: bool = True) -> str:
        return self.lab.ssh(node, command, user="root", check=check).stdout

    def wait(self, what: str, ok: Callable[[dict[str, Any]], bool], timeout: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if ok(self.status()):
                return time.monotonic() - started
            time.sleep(2)
        raise AssertionError(f"{what}: not within {timeout:.0f} s; status: {self.status()}")


def _gpu_entries(lab: Lab) -> list[dict[str, Any]]:
    return [h for h in lab.status()["hosts"] if h["kind"] == "gpu"]


def _image_id(lab: Lab, host: dict[str, Any]) -> str:
    command = f"podman image inspect --format '{{{{.Id}}}}' {IMAGE}"
    found = lab.ssh(host["name"], command, user="root", check=False, host=host)
    return found.stdout.strip() if found.returncode == 0 else ""


def serving(doc: dict[str, Any], role: str, count: int) -> bool:
    group = doc["groups"][role]
    ready = [r for r in group["replicas"] if r["state"] == "active" and r["healthy"]]
    return group["running"] == count and len(ready) == count


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    require_lab()
    lab = start_lab(tmp_path_factory.mktemp("model-cache"), hosts=4, cpu_hosts=1)
    home = lab.home
    try:
        token = f"hf_{uuid.uuid4().hex}"
        token_file = home / "hub-token"
        token_file.write_text(token)
        pdctl(home, "lab", "hub", "token", "--file", str(token_file))
        pdctl(home, "lab", "hub", "add", REPO, "--size", "256M")
        pdctl(home, *lab.status()["fleet_add"].split()[1:])
        spec = home / "pd.yml"
        text = SPEC.read_text().replace("lab/tiny-llama", REPO)
        assert text.count(REPO) == 2  # the env's MODEL_ID and the spec's model
        spec.write_text(text)
        assert IMAGE in text and "image_archive" not in text
        env = {"HF_TOKEN": token}
        # The lab loads its worker images into every GPU host (pdctl/lab/manager.py): keep the
        # image on the first one only.
        first, *others = _gpu_entries(lab)
        image_id = _image_id(lab, first)
        for host in others:
            lab.ssh(host["name"], f"podman rmi -f {IMAGE} >/dev/null", user="root", host=host)
            assert _image_id(lab, host) == ""
        deploy = ("deploy", str(spec), "--fleet", "lab", "-y")
        wrong = {"HF_TOKEN": "hf_wrong"}
        plain = pdctl(home, "-q", *deploy, env=wrong, check=False)  # -q: no progress lines
        as_json = pdctl(home, "--json", *deploy, env=wrong, check=False)
        refused = (plain.returncode, plain.stderr, json.loads(as_json.stdout))
        assert as_json.returncode == plain.returncode
        units = {
            host["name"]: lab.ssh(
                host["name"], "systemctl list-units --all --no-legend 'pd-*'", user="root"
            ).stdout
            for host in lab.status()["hosts"]
        }
        out = pdctl(home, "--json", *deploy, env=env).stdout
        (home / "deploy.json").write_text(out)  # kept with the workspace: a failure's evidence
        doc = json.loads(out)
        yield Deployed(
            lab=lab,
            env=env,
            token=token,
            deploy=doc,
            image_id=image_id,
            wrong_token=refused,
            units_after_wrong_token=units,
        )
    finally:
        pdctl(home, "lab", "down")  # the hosts go with the service: no destroy needed


def test_a_token_the_hub_refuses_stops_the_deploy_before_any_unit_in_one_line(
    deployed: Deployed,
) -> None:
    """`lab hub token T` and HF_TOKEN=wrong: one line naming HF_TOKEN and the model, the exit
    code of a user error, the same in --json; no advice about disks; no unit started."""
    code, stderr, doc = deployed.wrong_token
    said = (
        f"error: the hub at {deployed.lab.status()['hub']['endpoint']} refused HF_TOKEN for "
        f"{REPO} (a gated or private model needs a token with access)"
    )
    assert code == 3 and stderr.strip().splitlines() == [said]
    error = doc["error"]
    assert (error["kind"], error["exit_code"]) == ("invalid_input", 3)
    assert f"{error['message']} ({error['hint']})" == said.removeprefix("error: ")
    assert "disk" not in stderr + json.dumps(doc) and "hf_wrong" not in stderr
    assert deployed.units_after_wrong_token == dict.fromkeys(deployed.units_after_wrong_token, "")


def test_deploy_takes_each_file_from_the_hub_once_and_fills_every_gpu_host(
    deployed: Deployed,
) -> None:
    model = deployed.deploy["model"]
    gpu_addresses = {deployed.lab.host(n)["address"] for n in deployed.lab.gpu_hosts()}
    assert set(model["hosts"]) == gpu_addresses  # spares' hosts too: every slot host
    assert model["bytes"] >= 256 << 20
    sources = sorted(h["source"] for h in model["hosts"].values())
    assert sources.count("hub") == 1, sources  # one host talks to the hub, the rest to peers
    downloads = deployed.downloads()
    assert downloads and set(downloads.values()) == {1}, downloads
    listed = deployed.root(
        deployed.lab.gpu_hosts()[0], f"ls {CACHE}/hub/models--lab--fanout-256m/snapshots/*/"
    )
    assert len(downloads) == len(listed.split())


def test_the_image_on_one_host_reached_the_others_from_peers_and_the_workers_run(
    deployed: Deployed,
) -> None:
    first, *others = _gpu_entries(deployed.lab)
    image = deployed.deploy["images"][IMAGE]
    hosts = image["hosts"]
    assert hosts[first["address"]]["state"] == "present", hosts
    assert [hosts[h["address"]]["state"] for h in others] == ["ready", "ready"], hosts
    # A tree from the one holder: the first taker from it, the second from either of the two.
    sources = [hosts[h["address"]]["source"] for h in others]
    assert sources[0] == first["address"], hosts
    assert sources[1] in {first["address"], others[0]["address"]}, hosts
    assert all(hosts[h["address"]]["bytes"] > 10 << 20 for h in others), hosts
    assert image["id"] == deployed.image_id and image["seconds"] < 60, image
    for host in others:  # the same image, by its ID, in every host's podman
        assert _image_id(deployed.lab, host) == deployed.image_id
    status = deployed.status()  # and the workers it runs serve (pd_runtime pulled nothing)
    assert serving(status, "prefill", 1) and serving(status, "decode", 1), status


def test_an_image_no_host_holds_and_no_registry_serves_is_an_error_naming_host_and_fix(
    deployed: Deployed,
) -> None:
    spec = deployed.lab.home / "absent-image.yml"
    absent = "localhost/pdctl-lab/absent:1"
    spec.write_text((deployed.lab.home / "pd.yml").read_text().replace(IMAGE, absent))
    run = pdctl(
        deployed.lab.home,
        "--json",
        "prefetch",
        str(spec),
        "--fleet",
        "lab",
        check=False,
        env=deployed.env,
    )
    assert run.returncode == 4, run
    error = json.loads(run.stdout)["error"]
    first = _gpu_entries(deployed.lab)[0]["address"]
    assert error["message"].startswith(f"image prefetch failed: {first}: {absent} from registry: ")
    assert "no source" in error["message"]  # the others: nothing to take it from
    assert "set pdctl.image_archive" in error["hint"] and "podman load" in error["hint"]
    hosts = error["details"]["images"][absent]["hosts"]
    assert {h["state"] for h in hosts.values()} == {"failed"}


def test_status_shows_the_model_ready_on_the_three_gpu_hosts(deployed: Deployed) -> None:
    model = deployed.status()["model"]
    gpu_addresses = {deployed.lab.host(n)["address"] for n in deployed.lab.gpu_hosts()}
    assert model["repo"] == REPO and model["revision"] == "main"
    assert model["bytes"] >= 256 << 20
    assert model["hosts"] == dict.fromkeys(gpu_addresses, "ready")


def test_the_cache_is_root_only_and_read_only_offline_in_the_workers(deployed: Deployed) -> None:
    doc = deployed.status()
    replica = next(r for r in doc["groups"]["decode"]["replicas"] if r["state"] == "active")
    node = deployed.lab.node_at(replica["host"])
    assert deployed.root(node, f"stat -c '%U %a' {CACHE}").split() == ["root", "755"]
    writable = deployed.root(node, f"find {CACHE} -perm /022 ! -type l | head -3")
    assert writable == ""
    container = f"pd-{SERVICE}-decode-{replica['slot']}"
    env = deployed.root(node, f"podman exec {container} env")
    assert "HF_HOME=/root/.cache/huggingface" in env and "HF_HUB_OFFLINE=1" in env
    touched = deployed.root(
        node, f"podman exec {container} touch /root/.cache/huggingface/x 2>&1", check=False
    )
    assert "Read-only file system" in touched
    # The stand-in loaded the weights from the cache, as an engine would (else it refuses).
    unit = f"pd-{SERVICE}-decode@{replica['slot']}.service"

    def journal() -> str:
        return deployed.root(node, f"journalctl -u {unit} -o cat --no-pager")

    # journald takes the container's lines through conmon: they may land after the health check
    wait_for(lambda: "Load weight end." in journal(), 30, 1, what=f"{unit} logging its load")
    assert f"Loading weights of {REPO} from /root/.cache/huggingface/hub/" in journal()
    # The token reached the hub (it requires it) and no host's journal or process list.
    for gpu in deployed.lab.gpu_hosts():
        pattern = f"[{deployed.token[0]}]{deployed.token[1:]}"  # matches it, not itself
        seen = deployed.root(
            gpu,
            f"journalctl -o cat | grep -c '{pattern}'; ps -ef | grep -c '{pattern}'",
            check=False,
        )
        assert seen.split() == ["0", "0"], seen


def test_a_pipeline_prefetch_of_a_filled_fleet_downloads_nothing(deployed: Deployed) -> None:
    before = deployed.downloads()
    doc = deployed.json("prefetch", str(deployed.lab.home / "pd.yml"), "--fleet", "lab")
    assert {h["fetched"] for h in doc["model"]["hosts"].values()} == {0}
    assert {h["state"] for h in doc["images"][IMAGE]["hosts"].values()} == {"present"}
    assert deployed.downloads() == before


def test_scale_out_serves_within_a_minute_with_no_new_download(deployed: Deployed) -> None:
    before = deployed.downloads()
    pdctl(deployed.lab.home, "scale", SERVICE, "decode", "2", env=deployed.env)
    took = deployed.wait("decode at 2", lambda d: serving(d, "decode", 2), 60)
    assert took < 60
    assert deployed.downloads() == before


def test_a_killed_worker_comes_back_with_no_new_download(deployed: Deployed) -> None:
    before = deployed.downloads()
    doc = deployed.status()
    replica = next(r for r in doc["groups"]["prefill"]["replicas"] if r["state"] == "active")
    node = deployed.lab.node_at(replica["host"])
    container = f"pd-{SERVICE}-prefill-{replica['slot']}"
    pid = deployed.root(node, f"podman inspect --format '{{{{.State.Pid}}}}' {container}")
    deployed.root(node, f"kill -9 {pid.strip()}")
    time.sleep(3)
    deployed.wait("prefill serving again", lambda d: serving(d, "prefill", 1), 90)
    assert deployed.downloads() == before
