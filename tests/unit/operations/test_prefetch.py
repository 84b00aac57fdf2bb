"""Issue 22: one host cannot poison the others. Each test puts a lying host (or an on-path
observer) into a fan-out whose other hosts run the real host script on loopback, as pdctl
starts it over SSH (tests/unit/onhost/test_model_fetch.py, test_image_prefetch.py), and
checks that the lie is refused or has no effect, and that pdctl's message names the host and
what it did.

The liars: a host whose cache claims a foreign file list (a real script on a planted cache);
tests/unit/operations/lying_host.py, a compromised host that answers pdctl and its peers as it likes
(other bytes, redirects, claims); image holders whose runtime lies (runtime_stand_in's knobs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.errors import HostError
from pdctl.lab import hub_models
from pdctl.onhost import hf_layout, model_fetch, peer_auth
from pdctl.operations import image_prefetch, prefetch
from tests.unit.onhost.test_model_fetch import (
    REPO,
    SIZE,
    TOKEN,
    Hub,
    LocalChannel,
    blobs,
    check,
    request,
)
from tests.unit.operations import runtime_stand_in as stand_in
from tests.unit.operations.test_image_prefetch import ID, IMAGE, LAYER, StandInHost, give, names
from tests.unit.operations.test_image_prefetch import fan_out as image_fan_out

LIAR = Path(__file__).with_name("lying_host.py")
CONFIG = "config.json"


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    hub_models.add_model(root, REPO, SIZE, tmp_path_factory.mktemp("hub-cache"), shards=2)
    return root


@pytest.fixture
def served(hub_root: Path) -> Iterator[Hub]:
    server = Hub(hub_root)
    yield server
    server.close()


@pytest.fixture
def caches(tmp_path: Path) -> dict[str, Path]:
    return {f"h{i}": tmp_path / f"h{i}" / "models" for i in range(1, 5)}


class LyingHost(prefetch.Channel):
    """A compromised host (tests/unit/operations/lying_host.py): ``lies`` is its environment."""

    def __init__(self, tmp: Path, **lies: Any) -> None:
        env = {"PATH": "/usr/bin:/bin"}
        for key, value in lies.items():
            if isinstance(value, dict | list):
                path = tmp / f"{key}.json"
                path.write_text(json.dumps(value))
            env[key] = str(path if isinstance(value, dict | list) else value)
        self.proc = subprocess.Popen(
            [sys.executable, str(LIAR)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        super().__init__(self.proc.stdin, self.proc.stdout, self.proc.stderr)


class Internal:
    """An address inside the hosts' reach that no fetch may be pointed at (a metadata service,
    an admin API): it counts the requests it gets."""

    def __init__(self) -> None:
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                outer.hits += 1
                self.send_response(200)
                self.send_header("Content-Length", "6")
                self.end_headers()
                self.wfile.write(b"secret")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/latest/meta-data"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def internal() -> Iterator[Internal]:
    found = Internal()
    yield found
    found.close()


def model_fan_out(
    hosts: dict[str, Callable[[], prefetch.Channel]],
    req: prefetch.Request,
) -> tuple[dict[str, Any], list[str]]:
    """A model prefetch over ``hosts`` (name -> how to start its "host"), all on loopback."""
    lines: list[str] = []
    started: list[prefetch.Channel] = []

    def open_channel(host: str) -> prefetch.Channel:
        started.append(hosts[host]())
        return started[-1]

    try:
        doc = prefetch.prefetch(open_channel, dict.fromkeys(hosts, "127.0.0.1"), req, lines.append)
    except HostError as exc:
        exc.lines = lines  # type: ignore[attr-defined]
        raise
    finally:
        for channel in started:
            assert channel.proc.wait(timeout=30) is not None  # type: ignore[attr-defined]
    return doc, lines


def real(cache: Path) -> Callable[[], prefetch.Channel]:
    return lambda: LocalChannel(cache)


def snapshot_files(cache: Path, commit: str) -> set[str]:
    root = cache / "hub" / "models--lab--unit-model" / "snapshots" / commit
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def foreign_list(served: Hub) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A file list a compromised host would hand on: its own commit, a config.json that makes
    transformers import its code (auto_map, run under trust_remote_code), and that code."""
    files = {
        CONFIG: json.dumps(
            {"model_type": "llama", "auto_map": {"AutoModel": "evil.Model"}}
        ).encode(),
        "evil.py": b"import os; os.system('id > /tmp/owned')\n",
    }
    commit = "e" * 40
    manifest = {
        "repo": REPO,
        "commit": commit,
        "files": [
            {
                "path": p,
                "size": len(d),
                "blob": hashlib.sha1(b"blob %d\0" % len(d) + d).hexdigest(),
                "lfs": False,
            }
            for p, d in files.items()
        ],
    }
    return hf_layout.check_manifest(manifest), files


def plant(cache: Path, manifest: dict[str, Any], files: dict[str, bytes]) -> None:
    """A cache that holds ``manifest`` whole for main, as pdctl's fetcher leaves one."""
    store = model_fetch.Cache(str(cache), REPO)
    store.prepare()
    for entry in manifest["files"]:
        store.blob(entry["blob"]).write_bytes(files[entry["path"]])
        store.stamp(entry["blob"])
        store.link(manifest, entry)
    store.save_manifest(manifest)
    store.set_ref("main", manifest["commit"])


# ---------------------------------------------------------------- 1: the model's file list
def test_a_cache_that_claims_a_foreign_file_list_is_named_and_hands_on_nothing(
    served: Hub, caches: dict[str, Path]
) -> None:
    manifest, files = foreign_list(served)
    plant(caches["h1"], manifest, files)  # h1 would head the chain: it "holds" main
    doc, lines = model_fan_out({n: real(c) for n, c in caches.items()}, request(served))
    said = [line for line in lines if line.startswith("model on h1: its cache says")]
    assert said and f"commit {'e' * 12}" in said[0] and "not used" in said[0], lines
    assert doc["commit"] == served.commit
    assert {h["state"] for h in doc["hosts"].values()} == {"ready"}
    for name, cache in caches.items():
        ref = cache / "hub" / "models--lab--unit-model" / "refs" / "main"
        assert ref.read_text() == served.commit, name
        assert snapshot_files(cache, served.commit) == set(served.files), name
        if name != "h1":  # the foreign commit's files reached no other host
            foreign = cache / "hub" / "models--lab--unit-model" / "snapshots" / ("e" * 40)
            assert not foreign.exists(), name
            assert all(b"auto_map" not in blob.read_bytes() for blob in blobs(cache).iterdir()), (
                name
            )
    assert dict(served.downloads) == dict.fromkeys(served.files, 1)


def test_a_host_that_claims_the_model_and_sends_other_bytes_is_no_source_again(
    served: Hub, caches: dict[str, Path], tmp_path: Path
) -> None:
    """A compromised host claims the hub's own list (so it heads the chain) and sends zeros:
    the next host's checksums fail, pdctl names the sender, and the rest take the model from
    the hub instead: the lie fails nobody but costs one more download per file."""
    trusted = model_fetch.hub_manifest(served.endpoint, REPO, "main", TOKEN)
    hosts = {"h1": lambda: LyingHost(tmp_path, LIE_CLAIM=trusted, LIE_SERVE="garbage")}
    hosts.update({n: real(caches[n]) for n in ("h2", "h3", "h4")})
    doc, lines = model_fan_out(hosts, request(served))
    blamed = [line for line in lines if line.startswith("model on h2: h1 sent what is not")]
    assert blamed and "checksum mismatch" in blamed[0], lines
    assert "model lab/unit-model: 3 host(s) did not get it; taking it again from the hub" in lines
    for name in ("h2", "h3", "h4"):
        assert doc["hosts"][name]["state"] == "ready", doc["hosts"]
        assert check(served, caches[name])["state"] == "ready"


def test_offline_hosts_that_disagree_on_the_file_list_stop_the_prefetch_naming_them(
    served: Hub, caches: dict[str, Path], tmp_path: Path
) -> None:
    mirror = tmp_path / "mirror"
    model_fan_out({"m": real(mirror)}, request(served))  # a mirror the hosts mount
    manifest, files = foreign_list(served)
    plant(caches["h2"], manifest, files)
    offline = prefetch.Request(repo=REPO, revision="main", cache="/unused", endpoint=str(mirror))
    with pytest.raises(HostError) as raised:
        model_fan_out({n: real(c) for n, c in caches.items()}, offline)
    message = raised.value.one_line()
    assert "the hosts do not agree on its files, so none is used" in message, message
    assert f"h2 (its cache): commit {'e' * 12}" in message
    assert f"h1 (the mirror): commit {served.commit[:12]}" in message
    for name in ("h1", "h3", "h4"):  # nothing moved
        assert not blobs(caches[name]).exists() or not list(blobs(caches[name]).iterdir())


# ---------------------------------------------------------------- 2: an image's identity
EVIL = hashlib.sha256(stand_in.config_of([LAYER], "/evil")).hexdigest()


def test_a_holder_of_another_image_under_the_pinned_name_is_no_source_and_is_fixed(
    tmp_path: Path,
) -> None:
    give(tmp_path / "h1", entrypoint="/evil")  # its own image under the name
    give(tmp_path / "h2")  # the pinned one
    doc, lines = image_fan_out(tmp_path, ["h1", "h2", "h3"], pins={IMAGE: ID})
    said = f"image {IMAGE} on h1: holds {EVIL[:12]}, not the pinned {ID[:12]}: not used"
    assert f"{said}; it takes the pinned one" in lines
    hosts = doc[IMAGE]["hosts"]
    assert hosts["h2"]["state"] == "present"
    assert hosts["h1"]["source"] == "h2" and hosts["h3"]["source"] in {"h2", "h1"}
    for name in ("h1", "h2", "h3"):
        assert stand_in.Store(tmp_path / name / "store").find(IMAGE) == ID, name


def test_holders_that_disagree_without_a_pin_stop_the_image_naming_each(tmp_path: Path) -> None:
    give(tmp_path / "h1", entrypoint="/evil")
    give(tmp_path / "h2")
    with pytest.raises(HostError) as raised:
        image_fan_out(tmp_path, ["h1", "h2", "h3"])
    message = raised.value.one_line()
    assert (
        f"the hosts hold different images named {IMAGE} (h1 {EVIL[:12]}, h2 {ID[:12]})" in message
    )
    assert "pin the one you mean (pdctl.image_id" in message
    assert names(tmp_path / "h3") == {}  # nothing was taken


def test_an_archive_with_more_names_moves_no_other_image(tmp_path: Path) -> None:
    give(tmp_path / "h1")
    base = give(tmp_path / "h2", "docker.io/library/debian:12", b"debian")  # h2's own image
    extra = "docker.io/library/debian:12,localhost/pdctl-lab/router:1"
    with pytest.raises(HostError) as raised:
        image_fan_out(tmp_path, ["h1", "h2"], knobs={"h1": {"STAND_IN_SAVE_TAGS": extra}})
    message = raised.value.one_line()
    assert f"h2: {IMAGE} from h1: the archive's manifest.json also names" in message, message
    assert "its load would move that name" in message
    assert names(tmp_path / "h2") == {"docker.io/library/debian:12": base}  # untouched


def test_an_archive_of_two_images_is_refused(tmp_path: Path) -> None:
    give(tmp_path / "h1")
    with pytest.raises(HostError) as raised:
        image_fan_out(
            tmp_path, ["h1", "h2"], knobs={"h1": {"STAND_IN_SAVE_SECOND": "localhost/x:1"}}
        )
    assert "the archive holds 2 images, not exactly one" in raised.value.one_line()
    assert names(tmp_path / "h2") == {}


def test_a_holder_that_says_docker_and_sends_another_entrypoint_is_refused_before_load(
    tmp_path: Path,
) -> None:
    """Its runtime says it holds the expected ID (it runs docker, whose IDs pdctl once compared
    by layers); the archive it sends has the same layers and another Entrypoint."""
    give(tmp_path / "h1")
    give(tmp_path / "h3")  # a second holder agrees on the ID: the expected image is ID
    with pytest.raises(HostError) as raised:
        image_fan_out(
            tmp_path,
            ["h1", "h3", "h2"],
            knobs={"h1": {"STAND_IN_SAVE_ENTRYPOINT": "/evil"}},
            runtimes={"h1": "docker"},
        )
    message = raised.value.one_line()
    assert (
        f"h2: {IMAGE} from h1: the archive holds image {EVIL[:12]}, not the expected {ID[:12]}"
        in message
    )
    assert "sent an archive that is not the expected image" in message  # the fix names the sender
    assert names(tmp_path / "h2") == {}
    assert not list((tmp_path / "h2" / "store" / "images").iterdir())  # nothing was loaded


def test_a_failed_take_puts_back_the_image_the_name_had(tmp_path: Path) -> None:
    give(tmp_path / "h1")
    old = give(tmp_path / "h2", entrypoint="/old")  # a stale image under the name
    with pytest.raises(HostError) as raised:
        image_fan_out(tmp_path, ["h1", "h2"], rebuild=frozenset({"h2"}), pins={IMAGE: ID})
    assert "loaded another image than expected" in raised.value.one_line()
    assert stand_in.Store(tmp_path / "h2" / "store").find(IMAGE) == old


# ---------------------------------------------------------------- 3: redirects
def test_a_peer_that_redirects_is_refused_and_the_address_it_named_sees_nothing(
    served: Hub, caches: dict[str, Path], tmp_path: Path, internal: Internal
) -> None:
    trusted = model_fetch.hub_manifest(served.endpoint, REPO, "main", TOKEN)
    lie = {"LIE_CLAIM": trusted, "LIE_SERVE": f"redirect:{internal.url}"}
    hosts = {"h1": lambda: LyingHost(tmp_path, **lie)}
    hosts.update({n: real(caches[n]) for n in ("h2", "h3")})
    doc, lines = model_fan_out(hosts, request(served))
    blamed = [line for line in lines if line.startswith("model on h2: h1 sent what is not")]
    assert blamed and f"answered with a redirect to {internal.url}: refused" in blamed[0], lines
    assert internal.hits == 0
    assert doc["hosts"]["h2"]["state"] == doc["hosts"]["h3"]["state"] == "ready"


def test_an_image_holder_that_redirects_is_refused(tmp_path: Path, internal: Internal) -> None:
    held = {IMAGE: {"id": ID, "layers": [], "size": len(LAYER)}}
    started: list[prefetch.Channel] = []

    def open_channel(host: str) -> prefetch.Channel:
        if host == "h1":
            lie = {"LIE_IMAGES": held, "LIE_SERVE": f"redirect:{internal.url}"}
            started.append(LyingHost(tmp_path, **lie))
        else:
            started.append(StandInHost(tmp_path / host))
        return started[-1]

    lines: list[str] = []
    try:
        with pytest.raises(HostError) as raised:
            image_prefetch.spread(
                open_channel,
                {"h1": "127.0.0.1", "h2": "127.0.0.1"},
                {IMAGE: ["h1", "h2"]},
                lines.append,
            )
    finally:
        for channel in started:
            channel.proc.wait(timeout=30)  # type: ignore[attr-defined]
    message = raised.value.one_line()
    assert f"h2: {IMAGE} from h1: HTTP 302 answered with a redirect to {internal.url}" in message
    assert internal.hits == 0
    assert names(tmp_path / "h2") == {}


def test_a_hub_may_redirect_only_to_https_or_to_itself(
    served: Hub, caches: dict[str, Path], internal: Internal
) -> None:
    """A hub (or whoever answers for it) that sends a download on to an internal http URL:
    the host refuses to follow, and that address sees nothing."""

    class Redirecting(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def do_GET(self) -> None:
            if "/resolve/" in self.path:
                self.send_response(302)
                self.send_header("Location", internal.url)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            auth = {"Authorization": str(self.headers.get("Authorization"))}
            forward = urllib.request.Request(served.endpoint + self.path, headers=auth)
            with urllib.request.urlopen(forward, timeout=10) as answer:
                body = answer.read()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    hub = prefetch.Request(
        repo=REPO, revision="main", cache="/unused", endpoint=endpoint, token=TOKEN
    )
    try:
        with pytest.raises(HostError) as raised:
            model_fan_out({"h1": real(caches["h1"])}, hub)
    finally:
        server.shutdown()
        server.server_close()
    message = raised.value.one_line()
    assert f"redirected to {internal.url}: refused (a hub may redirect only to https" in message
    assert message.startswith("model prefetch failed: h1: ")
    assert internal.hits == 0


# ---------------------------------------------------------------- 4: the peer server's doors
def _session(
    cache: Path, secret: str = "k3y", allow: str = "127.0.0.1"
) -> tuple[LocalChannel, int]:
    """A real host's fetch session serving peers (its order: nothing to fetch)."""
    host = LocalChannel(cache)
    host.send(
        {
            "op": "fetch",
            "cache": str(cache),
            "repo": REPO,
            "revision": "main",
            "bind": "127.0.0.1",
            "allow": [allow],
            "secret": secret,
        }
    )
    hello = host.receive()
    assert hello and hello["event"] == "hello", hello
    host.send({"source": None, "manifest": {"repo": REPO, "commit": "0" * 40, "files": []}})
    assert (host.receive() or {}).get("event") == "manifest"
    return host, int(hello["port"])


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _signed_get(port: int, path: str, secret: str = "k3y", header: str | None = None) -> int:
    where = f"127.0.0.1:{port}"
    auth = header or peer_auth.sign_request(secret, "GET", where, path)
    req = urllib.request.Request(f"http://{where}{path}", headers={"Authorization": auth})
    try:
        with urllib.request.urlopen(req, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_idle_connections_from_outside_the_fleet_cost_no_thread_and_starve_no_one(
    tmp_path: Path,
) -> None:
    host, port = _session(tmp_path / "h" / "models")
    try:
        before = _threads(host.proc.pid)
        idle = []
        for _ in range(200):  # from 127.0.0.3: an address outside the fleet
            sock = socket.create_connection(
                ("127.0.0.1", port), timeout=5, source_address=("127.0.0.3", 0)
            )
            idle.append(sock)
        deadline = time.monotonic() + 10
        for sock in idle:  # each is closed by the host before a thread starts
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
        assert _threads(host.proc.pid) <= before + 2
        started = time.monotonic()
        assert _signed_get(port, "/blobs/" + "0" * 64) == 404  # a fleet host is still answered
        assert time.monotonic() - started < 5
    finally:
        for sock in idle:
            sock.close()
        host.send({"stop": True})
        host.close()
        host.proc.wait(timeout=30)


def test_idle_fleet_connections_time_out_and_are_capped(tmp_path: Path) -> None:
    cache = model_fetch.Cache(str(tmp_path / "models"), REPO)
    cache.prepare()

    class Quick(model_fetch.PeerServer):
        max_connections = 4
        read_timeout = 1.0

    server = Quick(cache, "127.0.0.1", ["127.0.0.1"], "k3y")
    server.ordered.set()
    server.start()
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert extra.recv(1) == b""  # one over the cap: closed at once, unanswered
        started = time.monotonic()
        for sock in idle:  # silent for longer than the read timeout: closed
            assert sock.recv(1) == b""
        assert time.monotonic() - started < 4
        assert _signed_get(server.port, "/blobs/" + "0" * 64) == 404  # their places are free
    finally:
        for sock in [*idle, extra]:
            sock.close()
        server.stop()


# ---------------------------------------------------------------- 5: secrets in messages
def test_a_host_masks_the_hub_token_in_what_it_says(served: Hub, tmp_path: Path) -> None:
    """A token with a carriage return (a CRLF env file): http.client quotes it in its error;
    the real host script masks it before a word leaves the host."""
    token = f"{TOKEN}\r"
    trusted = model_fetch.hub_manifest(served.endpoint, REPO, "main", TOKEN)
    host = LocalChannel(tmp_path / "models")
    host.send(
        {
            "op": "fetch",
            "cache": "x",
            "repo": REPO,
            "revision": "main",
            "bind": "127.0.0.1",
            "allow": ["127.0.0.1"],
            "secret": "k3y",
        }
    )
    assert (host.receive() or {}).get("event") == "hello"
    host.send(
        {
            "source": {"kind": "hub", "endpoint": served.endpoint, "token": token},
            "manifest": trusted,
        }
    )
    said = []
    while True:
        doc = host.receive()
        if doc is None or doc.get("event") in {"error", "done"}:
            said.append(json.dumps(doc))
            break
        said.append(json.dumps(doc))
    host.send({"stop": True})
    host.close()
    host.proc.wait(timeout=30)
    text = "\n".join(said) + host.last_error()
    assert "Invalid header value" in text and "***" in text, text
    assert TOKEN not in text


def test_pdctl_masks_every_secret_of_the_plan_in_what_a_host_says(
    served: Hub, caches: dict[str, Path], tmp_path: Path
) -> None:
    """A host that echoes a secret it was never given (it read it elsewhere): the message
    reaches the terminal masked."""
    secret = "db-password-42"
    trusted = model_fetch.hub_manifest(served.endpoint, REPO, "main", TOKEN)
    hosts = {
        "h1": lambda: LyingHost(
            tmp_path, LIE_CLAIM=trusted, LIE_SERVE=f"redirect:http://127.0.0.1:9/{secret}"
        )
    }
    hosts["h2"] = real(caches["h2"])
    req = prefetch.Request(
        repo=REPO,
        revision="main",
        cache="/unused",
        endpoint=served.endpoint,
        token=TOKEN,
        secrets=(secret,),
    )
    _, lines = model_fan_out(hosts, req)
    assert any("answered with a redirect to http://127.0.0.1:9/***" in line for line in lines), (
        lines
    )
    assert all(secret not in line for line in lines)


# ---------------------------------------------------------------- 6: signed requests
def test_a_peer_request_carries_no_key_and_cannot_be_replayed(tmp_path: Path) -> None:
    """What an on-path observer sees of a request (its headers) gives it nothing to use: the
    key is not in it, and the same request again, to the same host or another, is refused."""
    seen: list[str] = []

    class Recorder(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def do_GET(self) -> None:
            seen.append(str(self.headers.get("Authorization")))
            self.send_error(503)

    recorder = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    victim = LocalChannel(tmp_path / "v" / "models")
    victim.send(
        {
            "op": "fetch",
            "cache": "x",
            "repo": REPO,
            "revision": "main",
            "bind": "127.0.0.1",
            "allow": ["127.0.0.1"],
            "secret": "k3y",
        }
    )
    assert (victim.receive() or {}).get("event") == "hello"
    data = b"weights"
    blob = hashlib.sha256(data).hexdigest()
    manifest = {
        "repo": REPO,
        "commit": "1" * 40,
        "files": [{"path": "w.bin", "size": len(data), "blob": blob, "lfs": True}],
    }
    url = f"http://127.0.0.1:{recorder.server_address[1]}"
    victim.send({"source": {"kind": "peer", "url": url}, "manifest": manifest})
    while (victim.receive() or {"event": "error"}).get("event") not in {"error", "done"}:
        pass
    victim.send({"stop": True})
    victim.close()
    victim.proc.wait(timeout=30)
    recorder.shutdown()
    recorder.server_close()
    assert seen and all("k3y" not in header for header in seen)
    assert all(header.startswith("PDCTL-HMAC nonce=") for header in seen)
    host, port = _session(tmp_path / "h" / "models")
    try:
        path = f"/blobs/{blob}"
        assert _signed_get(port, path, header=seen[0]) == 403  # seen on the wire: refused
        header = peer_auth.sign_request("k3y", "GET", f"127.0.0.1:{port}", path)
        assert _signed_get(port, path, header=header) == 404  # signed right: answered
        assert _signed_get(port, path, header=header) == 403  # the same nonce again: refused
        assert _signed_get(port, path, header="Bearer k3y") == 403  # the key itself: refused
        other = peer_auth.sign_request("k3y", "GET", f"127.0.0.1:{port}", "/blobs/" + "0" * 64)
        assert _signed_get(port, path, header=other) == 403  # signed for another path
    finally:
        host.send({"stop": True})
        host.close()
        host.proc.wait(timeout=30)


# ---------------------------------------------------------------- the hosts' Python
PY39 = sorted((Path.home() / ".pyenv" / "versions").glob("3.9*/bin/python3"))


@pytest.mark.skipif(not PY39, reason="no Python 3.9 on this machine")
def test_the_host_script_runs_on_python_3_9(
    served: Hub, caches: dict[str, Path], tmp_path: Path
) -> None:
    """The hosts may have Python 3.9 (RHEL 9): the shipped modules, signed requests, masks and
    archive checks included, run there."""
    python = str(PY39[0])
    hosts = {n: (lambda c=c: LocalChannel(c, python)) for n, c in list(caches.items())[:2]}
    doc, _ = model_fan_out(hosts, request(served))
    assert {h["state"] for h in doc["hosts"].values()} == {"ready"}
    give(tmp_path / "i1")
    started: list[StandInHost] = []

    def open_channel(host: str) -> prefetch.Channel:
        started.append(StandInHost(tmp_path / host, python=python))
        return started[-1]

    try:
        images = image_prefetch.spread(
            open_channel, {"i1": "127.0.0.1", "i2": "127.0.0.1"}, {IMAGE: ["i1", "i2"]}, print
        )
    finally:
        for host in started:
            assert host.proc.wait(timeout=30) == 0, host.proc.stderr.read()  # type: ignore[union-attr]
    assert images[IMAGE]["hosts"]["i2"]["state"] == "ready"
    assert stand_in.Store(tmp_path / "i2" / "store").find(IMAGE) == ID
