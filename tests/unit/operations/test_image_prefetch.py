"""The worker images' fan-out: its tree, the requests a host accepts, the peer that serves
only the images its prefetch named to the fleet holding the secret (pdctl/onhost/image_fetch.py,
pdctl/operations/image_prefetch.py), and the whole fan-out through the real host script. This
machine has no container runtime: the end-to-end tests give each "host" a stand-in for podman's
command line; the lab test (tests/integration/test_model_cache.py) runs the real podman."""

from __future__ import annotations

import hashlib
import http.client
import io
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.errors import HostError
from pdctl.onhost import bundle, image_fetch, peer_auth
from pdctl.operations import image_prefetch, prefetch
from tests.unit.core.test_model_cache import LAB, plan_of
from tests.unit.operations import runtime_stand_in as stand_in

IMAGE = "localhost/pdctl-lab/sglang-rocm:0.5.4-lab"
OTHER = "lmsysorg/sglang:v0.5.5"
SIZE = 3 << 20
LAYER = b"x" * SIZE
ID = hashlib.sha256(stand_in.config_of([LAYER])).hexdigest()  # the image hosts hold as IMAGE


def rounds(holders: list[str], pending: list[str]) -> list[list[tuple[str, str]]]:
    """The transfers round by round when every one succeeds (as image_prefetch runs them)."""
    done: list[list[tuple[str, str]]] = []
    holders, pending = list(holders), list(pending)
    while pending:
        pairs = image_prefetch.next_round(holders, pending)
        pending = pending[len(pairs) :]
        holders += [taker for _, taker in pairs]
        done.append(pairs)
    return done


def test_one_holder_serves_one_host_a_round_and_the_holders_double() -> None:
    takers = [f"h{i}" for i in range(2, 9)]
    order = rounds(["h1"], takers)
    assert order == [
        [("h1", "h2")],
        [("h1", "h3"), ("h2", "h4")],
        [("h1", "h5"), ("h2", "h6"), ("h3", "h7"), ("h4", "h8")],
    ]
    for pairs in order:  # no host serves two at once, none takes twice
        givers = [giver for giver, _ in pairs]
        assert len(givers) == len(set(givers))
    assert sorted(taker for pairs in order for _, taker in pairs) == sorted(takers)


def test_many_holders_share_the_takers_and_64_hosts_take_6_rounds() -> None:
    assert rounds(["a", "b", "c"], ["d", "e"]) == [[("a", "d"), ("b", "e")]]
    assert len(rounds(["h0"], [f"h{i}" for i in range(1, 64)])) == 6
    assert rounds(["a"], []) == []


def test_the_plan_images_are_the_groups_per_slot_host_and_digests_are_left_to_pulls(
    tmp_path: Path,
) -> None:
    plan = plan_of(LAB, tmp_path)
    assert image_prefetch.plan_images(plan) == {IMAGE: ["gpu1", "gpu2", "gpu3"]}
    decode_image = LAB.replace(
        "    resources:\n      gpu: MI300X:4\n\nport",
        f"    image: {OTHER}\n    resources:\n      gpu: MI300X:4\n\nport",
    )
    plan = plan_of(decode_image, tmp_path)
    prefill = sorted({s.host for s in plan.groups["prefill"].slots})
    decode = sorted({s.host for s in plan.groups["decode"].slots})
    assert image_prefetch.plan_images(plan) == {IMAGE: prefill, OTHER: decode}
    assert image_prefetch.fanned_out(IMAGE) and image_prefetch.fanned_out(OTHER)
    assert not image_prefetch.fanned_out(f"{OTHER}@sha256:{'b' * 64}")


def test_the_plan_pins_the_image_ids_the_spec_names_per_image(tmp_path: Path) -> None:
    assert image_prefetch.plan_pins(plan_of(LAB, tmp_path)) == {}
    pinned = LAB.replace("pdctl:\n", f"pdctl:\n  image_id: sha256:{ID}\n", 1)
    assert image_prefetch.plan_pins(plan_of(pinned, tmp_path)) == {IMAGE: ID}
    own = pinned.replace(
        "    resources:\n      gpu: MI300X:4\n\nport",
        f"    image: {OTHER}\n    resources:\n      gpu: MI300X:4\n"
        f"    pdctl:\n      image_id: {'c' * 64}\n\nport",
    )
    assert image_prefetch.plan_pins(plan_of(own, tmp_path)) == {IMAGE: ID, OTHER: "c" * 64}


@pytest.mark.parametrize(
    "ref",
    ["-oProxyCommand=x", "--output=/etc/passwd", "a b", "a;rm -rf /", "a\nb", "", "$(id)", 7],
)
def test_a_host_refuses_what_is_not_an_image_reference(ref: object) -> None:
    with pytest.raises(ValueError, match="not an image reference"):
        image_fetch.check_image_ref(ref)
    with pytest.raises(ValueError):
        image_fetch.save_argv("podman", ref)  # type: ignore[arg-type]


def test_save_and_load_are_argv_lists_of_exactly_the_image() -> None:
    assert image_fetch.save_argv("podman", IMAGE) == [
        "podman",
        "save",
        "--quiet",
        "--format",
        "docker-archive",
        IMAGE,
    ]
    assert image_fetch.save_argv("docker", OTHER) == ["docker", "save", OTHER]
    assert image_fetch.load_argv("docker") == ["docker", "load", "--quiet"]
    assert image_fetch.load_argv("podman", "/srv/a.tar")[-2:] == ["--input", "/srv/a.tar"]


@pytest.mark.parametrize("value", ["sha256:" + "z" * 64, "a" * 63, "../" + "a" * 64, None])
def test_image_ids_are_64_hex_digits(value: object) -> None:
    with pytest.raises(ValueError, match="not an image ID"):
        image_fetch.image_id_hex(value)
    assert image_fetch.image_id_hex("sha256:" + ID) == image_fetch.image_id_hex(ID) == ID


def test_a_loaded_image_is_the_expected_one_by_its_id_or_in_docker_by_the_checked_layers() -> None:
    layers = ["sha256:" + "1" * 64]
    loaded = {"id": ID, "layers": layers, "size": 1}
    assert image_fetch.same_image(ID, loaded, "podman")
    other_id = {**loaded, "id": "b" * 64}
    assert not image_fetch.same_image(ID, other_id, "podman")
    # docker's containerd store names an image by a manifest digest: the layers of the archive
    # this host checked (its config had the expected digest) must be what it loaded
    assert image_fetch.same_image(ID, other_id, "docker", layers)
    assert not image_fetch.same_image(ID, other_id, "docker")  # no archive checked: a pull
    assert not image_fetch.same_image(ID, other_id, "docker", ["sha256:" + "2" * 64])


def test_a_runtime_that_is_not_podman_or_docker_is_refused() -> None:
    with pytest.raises(ValueError, match="not a container runtime"):
        image_fetch.pick_runtime("sh")


class Held:
    """An ImageServer on loopback holding IMAGE (the ID a real one reads with inspect)."""

    def __init__(self, allow: list[str], refs: list[str] | None = None) -> None:
        self.server = image_fetch.ImageServer(
            "podman", refs if refs is not None else [IMAGE], "127.0.0.1", allow, "s3cret"
        )
        self.server.hold(IMAGE, {"id": ID, "layers": [], "size": 1})
        self.server.start()

    def get(self, image: str = ID, secret: str = "s3cret") -> int:
        where = f"127.0.0.1:{self.server.port}"
        signed = peer_auth.sign_request(secret, "GET", where, f"/images/{image}")
        req = urllib.request.Request(
            f"http://{where}/images/{image}", headers={"Authorization": signed}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError):
            return 0  # closed without an answer


def test_the_peer_serves_no_image_its_request_did_not_name() -> None:
    held = Held(["127.0.0.1"])
    try:
        assert held.get("b" * 64) == 404  # an image this host may hold, not one requested
        assert held.get("../../etc") == 404
        assert held.get(ID, secret="wrong") == 403
    finally:
        held.server.stop()
    unnamed = Held(["127.0.0.1"], refs=[OTHER])  # holds IMAGE, but the request named OTHER
    try:
        assert unnamed.server.held == {}
        assert unnamed.get() == 404
    finally:
        unnamed.server.stop()
    stranger = Held(["192.0.2.1"])  # not a host of the fleet: closed, never answered
    try:
        assert stranger.get() == 0
    finally:
        stranger.server.stop()


def test_a_host_takes_only_an_image_of_its_request_from_a_known_source() -> None:
    peer = {"kind": "peer", "url": "http://10.0.0.12:4321/", "expect": {"id": ID, "size": 9}}
    assert image_fetch.check_take({"take": IMAGE, "source": peer}, [IMAGE]) == (
        IMAGE,
        {**peer, "url": "http://10.0.0.12:4321"},
    )
    registry = {"kind": "registry"}
    assert image_fetch.check_take({"take": IMAGE, "source": registry}, [IMAGE])[0] == IMAGE
    refused = [
        ({"take": OTHER, "source": registry}, "not an image of this prefetch"),
        ({"take": "--rm", "source": registry}, "not an image reference"),
        ({"take": IMAGE, "source": {"kind": "ftp"}}, "not an image source"),
        ({"take": IMAGE, "source": {**peer, "url": "file:///etc/passwd"}}, "not a peer's URL"),
        ({"take": IMAGE, "source": {**peer, "url": "http://h:1/x?y"}}, "not a peer's URL"),
        (
            {"take": IMAGE, "source": {**peer, "expect": {"id": "../x", "size": 1}}},
            "not an image ID",
        ),
        ({"take": IMAGE, "source": {**peer, "expect": {"id": ID}}}, "not an image size"),
        (
            {"take": IMAGE, "source": {**peer, "expect": {"id": ID, "size": -1}}},
            "not an image size",
        ),
        ({"take": IMAGE, "source": {"kind": "archive", "path": "a.tar"}}, "not an absolute"),
        ({"take": IMAGE, "source": {"kind": "archive", "path": "/a/../b"}}, "not an absolute"),
    ]
    for order, message in refused:
        with pytest.raises(ValueError, match=message):
            image_fetch.check_take(order, [IMAGE])


def test_the_fetchers_bundle_holds_what_it_imports_each_as_itself() -> None:
    """The hosts run the image fetcher (whose main serves model sessions too) from its bundle:
    the fetcher modules, each importable as itself, and nothing else of pdctl."""
    shipped = bundle.modules(prefetch.FETCHER)
    fetchers = {"hf_layout", "image_archive", "image_fetch", "model_fetch", "peer_auth"}
    assert set(shipped) == {"pdctl", "pdctl.onhost"} | {
        f"pdctl.onhost.{name}" for name in (*fetchers, "secret_mask")
    }
    for name, source in shipped.items():
        compile(source, name, "exec")
    entry = shipped[prefetch.FETCHER]
    assert entry.count('if __name__ == "__main__"') == 1
    assert entry.rstrip().endswith("sys.exit(host_main())")


class Silent(prefetch.Channel):
    """A host whose fetcher says nothing and ends: what a host without python3 looks like."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), io.BytesIO(), io.BytesIO(b"sudo: python3: not found\n"))


def test_a_host_whose_fetcher_does_not_start_is_named_with_the_cause() -> None:
    with pytest.raises(HostError) as raised:
        image_prefetch.spread(
            lambda host: Silent(),
            {"10.0.0.11": "10.0.0.11"},
            {IMAGE: ["10.0.0.11"]},
            lambda line: None,
        )
    assert "10.0.0.11: the image fetcher did not start: sudo: python3: not found" in str(
        raised.value
    )


def test_an_image_pinned_by_digest_is_left_to_each_host() -> None:
    pinned = f"{OTHER}@sha256:{'c' * 64}"
    lines: list[str] = []
    doc = image_prefetch.spread(
        lambda host: Silent(), {"h": "10.0.0.1"}, {pinned: ["h"]}, lines.append
    )
    assert doc == {pinned: {"skipped": "pinned by digest: each host pulls it (pd_runtime)"}}
    assert lines == [f"image {pinned}: pinned by digest, each host pulls it"]


# ---------------------------------------------------------------- the fan-out, end to end
# Each "host" is python3 started with pdctl's loader (as over SSH) and its own image store. Its
# runtime is a stand-in for podman's command line (tests/unit/operations/runtime_stand_in.py: real
# docker-archives, loads that apply every name the archive carries): this machine has no
# container runtime. The lab test runs the real podman.
STAND_IN = Path(__file__).with_name("runtime_stand_in.py")


class StandInHost(prefetch.Channel):
    """A host whose runtime (``podman``, or ``docker``) is the stand-in; ``knobs``: what a
    compromised host's runtime does instead (runtime_stand_in's environment)."""

    def __init__(
        self, root: Path, runtime: str = "podman", python: str = sys.executable, **knobs: str
    ) -> None:
        self.root = root
        binary = root / "bin"
        binary.mkdir(parents=True, exist_ok=True)
        (binary / runtime).write_text(f'#!/bin/sh\nexec {sys.executable} {STAND_IN} "$@"\n')
        (binary / runtime).chmod(0o755)
        (root / "store").mkdir(exist_ok=True)
        (root / "tmp").mkdir(exist_ok=True)
        env = {
            "PATH": f"{binary}:/usr/bin:/bin",
            "STAND_IN_STORE": str(root / "store"),
            "STAND_IN_RUNTIME": runtime,
            "TMPDIR": str(root / "tmp"),  # where a take spools the archive
            **knobs,
        }
        self.proc = subprocess.Popen(
            bundle.argv(prefetch.FETCHER, python=python),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        super().__init__(self.proc.stdin, self.proc.stdout, self.proc.stderr)


def give(root: Path, ref: str = IMAGE, layer: bytes = LAYER, entrypoint: str = "/serve") -> str:
    return stand_in.give(root / "store", ref, [layer], entrypoint)


def names(root: Path) -> dict[str, str]:
    """What each name in a host's store names (an image ID)."""
    return stand_in.Store(root / "store").names


def fan_out(
    tmp_path: Path,
    hosts: list[str],
    rebuild: frozenset[str] = frozenset(),
    knobs: dict[str, dict[str, str]] | None = None,
    runtimes: dict[str, str] | None = None,
    pins: dict[str, str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    lines: list[str] = []
    started: list[StandInHost] = []

    def open_channel(host: str) -> prefetch.Channel:
        extra = dict((knobs or {}).get(host, {}))
        if host in rebuild:
            extra["STAND_IN_REBUILD"] = "1"
        runtime = (runtimes or {}).get(host, "podman")
        started.append(StandInHost(tmp_path / host, runtime, **extra))
        return started[-1]

    try:
        doc = image_prefetch.spread(
            open_channel,
            dict.fromkeys(hosts, "127.0.0.1"),
            {IMAGE: hosts},
            lines.append,
            pins=pins,
        )
    except HostError as exc:
        exc.lines = lines  # type: ignore[attr-defined]
        raise
    finally:
        for host in started:
            assert host.proc.wait(timeout=30) == 0, host.proc.stderr.read()  # type: ignore[union-attr]
            assert not list((host.root / "tmp").iterdir())  # no spooled archive left behind
    return doc, lines


def test_one_holder_spreads_the_image_as_a_tree_through_the_real_host_script(
    tmp_path: Path,
) -> None:
    names = [f"h{i}" for i in range(1, 5)]
    give(tmp_path / "h3")  # the one holder need not come first
    doc, lines = fan_out(tmp_path, names)
    hosts = doc[IMAGE]["hosts"]
    assert doc[IMAGE]["id"] == ID and doc[IMAGE]["bytes"] == SIZE
    assert hosts["h3"]["state"] == "present" and hosts["h3"]["source"] == ""
    assert {n: h["state"] for n, h in hosts.items() if n != "h3"} == dict.fromkeys(
        ["h1", "h2", "h4"], "ready"
    )
    # round 1: h3 -> h1; round 2: h3 -> h2 and h1 -> h4 (the holders doubled)
    assert {n: h["source"] for n, h in hosts.items()} == {
        "h3": "",
        "h1": "h3",
        "h2": "h3",
        "h4": "h1",
    }
    assert all(h["bytes"] > SIZE and h["id"] == ID for n, h in hosts.items() if n != "h3")
    assert (
        "image localhost/pdctl-lab/sglang-rocm:0.5.4-lab: 1 host(s) hold it, 3 take it from peers"
        in lines
    )
    assert any(
        line.startswith(f"image {IMAGE} on h4: ready, ") and "from h1" in line for line in lines
    )
    again, _ = fan_out(tmp_path, names)  # every host holds it now: nothing moves
    assert {h["state"] for h in again[IMAGE]["hosts"].values()} == {"present"}


def test_a_taker_that_loads_another_image_says_so_with_both_ids_and_puts_the_name_back(
    tmp_path: Path,
) -> None:
    give(tmp_path / "h1")
    rebuilt = hashlib.sha256(stand_in.config_of([LAYER], "/rebuilt")).hexdigest()
    with pytest.raises(HostError) as raised:
        fan_out(tmp_path, ["h1", "h2"], rebuild=frozenset({"h2"}))
    message = raised.value.one_line()
    assert f"h2: {IMAGE} from h1: loaded another image than expected" in message
    assert f"ID {rebuilt[:12]}, expected {ID[:12]}" in message
    assert "remove the stale ones (podman rmi" in message
    assert raised.value.details["images"][IMAGE]["hosts"]["h2"]["state"] == "failed"
    assert names(tmp_path / "h2") == {}  # the name it loaded is gone again: it had none


def test_no_holder_and_no_registry_names_the_first_host_the_cause_and_the_fix(
    tmp_path: Path,
) -> None:
    with pytest.raises(HostError) as raised:
        fan_out(tmp_path, ["h1", "h2"])
    message = raised.value.one_line()
    cause = "podman pull exited 125: Error: initializing source"
    assert f"h1: {IMAGE} from registry: {cause}" in message
    assert "h2: " in message and "no source: h1 could not take it from the registry" in message
    assert "set pdctl.image_archive" in message
