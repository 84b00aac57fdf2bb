"""The model cache's fetcher and its fan-out, run for real on loopback: each "host" is a
python3 process started with the loader pdctl sends over SSH (pdctl/operations/prefetch.py), with
its own cache directory; the hub is the lab's (pdctl/lab/hub.py), counting downloads per file.
The real huggingface_hub then reads the cache offline."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.errors import HostError, InputError
from pdctl.lab import hub as lab_hub
from pdctl.lab import hub_models
from pdctl.onhost import bundle, hf_layout, model_fetch, peer_auth
from pdctl.operations import prefetch

REPO = "lab/unit-model"
TOKEN = "hf_unit_token"
SIZE = 3 << 20  # two shards


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Hub:
    """The lab's hub (pdctl/lab/hub.py) on loopback, over a model of SIZE in two shards."""

    def __init__(self, root: Path, token: str | None = TOKEN) -> None:
        self.root = root
        for name in ("downloads.json", "settings.json"):
            (root / name).unlink(missing_ok=True)
        lab_hub.write_settings(root, None, token)
        self.server = lab_hub.make_server(root)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.endpoint = lab_hub.endpoint(self.server)
        repo = hub_models.Store(root).get(REPO)
        assert repo is not None
        self.repo = repo
        self.files = {
            f.path: hub_models.Store(root).blob(f.sha256).read_bytes() for f in repo.files
        }
        self.commit = repo.sha

    @property
    def downloads(self) -> dict[str, int]:
        """Downloads per file (a resumed tail is not one), as the hub counts them."""
        counts = lab_hub.read_downloads(self.root)["downloads"]
        return {k.removeprefix(f"{REPO}/"): v for k, v in counts.items() if v}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class HostileHub:
    """A hub that lists a hostile file path: what the real one never sends."""

    def __init__(self, good: Hub, path: str) -> None:
        tree = [
            {"type": "file", "path": "config.json", "size": 2, "oid": _git_oid(b"{}")},
            {"type": "file", "path": path, "size": 2, "oid": _git_oid(b"{}")},
        ]
        commit = good.commit

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                doc: Any = {"sha": commit} if "/revision/" in self.path else tree
                if "/resolve/" in self.path:
                    self.send_error(500, "a resolve was asked for")
                    return
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


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


class LocalChannel(prefetch.Channel):
    """A "host": python3 started with pdctl's loader, as over SSH, with its own cache
    directory (on a fleet every host has the same path; here they share one machine)."""

    def __init__(self, cache: Path, python: str = sys.executable) -> None:
        self.cache = cache
        self.proc = subprocess.Popen(
            bundle.argv(prefetch.FETCHER, python=python),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        super().__init__(self.proc.stdin, self.proc.stdout, self.proc.stderr)

    def send(self, doc: dict[str, Any] | None) -> None:
        if doc and "op" in doc:
            doc = {**doc, "cache": str(self.cache)}
        super().send(doc)


def request(hub: Hub, token: str | None = TOKEN) -> prefetch.Request:
    return prefetch.Request(
        repo=REPO, revision="main", cache="/unused", endpoint=hub.endpoint, token=token
    )


class LostHost(LocalChannel):
    """A host lost once it has its order (the fetcher killed): its peers see it go."""

    def send(self, doc: dict[str, Any] | None) -> None:
        super().send(doc)
        if doc and "source" in doc:
            self.proc.kill()


def fan_out(
    hub: Hub,
    caches: dict[str, Path],
    token: str | None = TOKEN,
    request_doc: prefetch.Request | None = None,
    lost: dict[str, int] | None = None,  # host -> how many of its runs are lost
) -> dict[str, Any]:
    lines: list[str] = []
    channels: list[LocalChannel] = []
    losses = dict(lost or {})

    def open_channel(host: str) -> prefetch.Channel:
        kind = LostHost if losses.get(host, 0) > 0 else LocalChannel
        losses[host] = losses.get(host, 0) - 1
        channels.append(kind(caches[host]))
        return channels[-1]

    try:
        doc = prefetch.prefetch(
            open_channel,
            dict.fromkeys(caches, "127.0.0.1"),
            request_doc or request(hub, token),
            lines.append,
        )
    except HostError as exc:
        exc.lines = lines  # type: ignore[attr-defined]
        raise
    finally:
        for channel in channels:
            assert channel.proc.wait(timeout=30) is not None
    doc["lines"] = lines
    return doc


def check(hub: Hub, cache: Path) -> dict[str, Any]:
    found = prefetch.check(lambda host: LocalChannel(cache), ["h"], request(hub))
    return dict(found["h"])


@pytest.fixture
def caches(tmp_path: Path) -> dict[str, Path]:
    return {f"h{i}": tmp_path / f"h{i}" / "models" for i in range(1, 5)}


def blobs(cache: Path) -> Path:
    return cache / "hub" / "models--lab--unit-model" / "blobs"


def test_one_download_per_file_fanned_out_and_huggingface_hub_reads_it_offline(
    served: Hub, caches: dict[str, Path]
) -> None:
    doc = fan_out(served, caches)
    assert dict(served.downloads) == dict.fromkeys(served.files, 1)
    assert doc["commit"] == served.commit and doc["bytes"] == sum(map(len, served.files.values()))
    assert {h["state"] for h in doc["hosts"].values()} == {"ready"}
    assert sorted(h["source"] for h in doc["hosts"].values()) == ["h1", "h2", "h3", "hub"]
    assert any("from hub" in line for line in doc["lines"]), doc["lines"]
    for cache in caches.values():
        assert check(served, cache)["state"] == "ready"
        assert (
            cache / "hub" / "models--lab--unit-model" / "refs" / "main"
        ).read_text() == served.commit
        assert oct(cache.stat().st_mode & 0o777) == "0o755"
        for blob in blobs(cache).iterdir():
            assert blob.stat().st_mode & 0o777 == 0o644 and blob.stat().st_uid == os.getuid()
    # The real library, offline, on the last host's cache: the engines' view of it.
    script = (
        "import sys; from huggingface_hub import hf_hub_download, snapshot_download;"
        f"p = snapshot_download({REPO!r}, local_files_only=True);"
        f"print(p); print(open(hf_hub_download({REPO!r}, 'config.json'), 'rb').read().decode())"
    )
    env = {**os.environ, "HF_HOME": str(caches["h4"]), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[0].endswith(f"snapshots/{served.commit}")
    assert "model_type" in out
    shard = Path(out.splitlines()[0]) / "model-00002-of-00002.safetensors"
    assert shard.read_bytes() == served.files["model-00002-of-00002.safetensors"]


def test_a_second_prefetch_downloads_nothing_even_with_the_hub_gone(
    served: Hub, caches: dict[str, Path]
) -> None:
    fan_out(served, caches)
    before = served.downloads
    assert fan_out(served, caches)["hosts"]["h1"]["fetched"] == 0
    assert served.downloads == before
    served.close()  # a restart, or a redeploy, while the hub is away: the cache is enough
    doc = fan_out(served, caches)
    assert {h["fetched"] for h in doc["hosts"].values()} == {0}


def test_a_corrupt_or_missing_file_is_found_and_fetched_again_from_a_peer(
    served: Hub, caches: dict[str, Path]
) -> None:
    fan_out(served, caches)
    shard = hashlib.sha256(served.files["model-00001-of-00002.safetensors"]).hexdigest()
    blob = blobs(caches["h3"]) / shard
    data = bytearray(blob.read_bytes())
    data[1000] ^= 0xFF
    blob.write_bytes(bytes(data))  # same size, other bytes
    (blobs(caches["h4"]) / _git_oid(served.files["config.json"])).unlink()
    assert check(served, caches["h3"])["state"] == "corrupt"
    assert check(served, caches["h4"])["state"] == "missing"
    before = served.downloads
    doc = fan_out(served, caches)
    assert served.downloads == before  # the hub's host had them all: the peers repaired
    assert doc["hosts"]["h3"]["fetched"] == len(data)
    assert blob.read_bytes() == served.files["model-00001-of-00002.safetensors"]
    assert check(served, caches["h3"])["state"] == check(served, caches["h4"])["state"] == "ready"


def test_a_host_lost_mid_chain_cuts_off_no_one_after_it(
    served: Hub, caches: dict[str, Path]
) -> None:
    """h2 is lost once it has its order: h3 and h4 (which took the model from it) take it
    again from h1 in a second chain, and h2 too; the hub still sends each file once."""
    doc = fan_out(served, caches, lost={"h2": 1})
    assert {h["state"] for h in doc["hosts"].values()} == {"ready"}, doc["hosts"]
    assert dict(served.downloads) == dict.fromkeys(served.files, 1)
    assert any("taking it again from h1" in line for line in doc["lines"]), doc["lines"]
    for cache in caches.values():
        assert check(served, cache)["state"] == "ready"


def test_a_host_that_fails_every_time_fails_only_itself(
    served: Hub, caches: dict[str, Path]
) -> None:
    with pytest.raises(HostError) as raised:
        fan_out(served, caches, lost={"h2": 2})
    message = raised.value.one_line()
    assert "h2: " in message and "h3" not in message and "h4" not in message, message
    assert dict(served.downloads) == dict.fromkeys(served.files, 1)
    for host in ("h1", "h3", "h4"):
        assert check(served, caches[host])["state"] == "ready", host


def test_an_offline_fleet_fills_its_caches_from_a_local_mirror(
    served: Hub, caches: dict[str, Path], tmp_path: Path
) -> None:
    mirror = {"m": tmp_path / "mirror"}
    fan_out(served, mirror)  # an HF cache copied to a disk or NFS the hosts mount
    shutil.rmtree(mirror["m"] / "pdctl")  # as huggingface_hub leaves it: no pdctl records
    served.close()  # no hub at all
    offline = prefetch.Request(
        repo=REPO, revision="main", cache="/unused", endpoint=str(mirror["m"]), token=TOKEN
    )
    doc = fan_out(served, caches, request_doc=offline)
    assert [h["source"] for h in doc["hosts"].values()] == ["mirror", "h1", "h2", "h3"]
    for cache in caches.values():
        assert check(served, cache)["state"] == "ready"


def test_a_partial_download_resumes_with_a_range(served: Hub, caches: dict[str, Path]) -> None:
    one = {"h1": caches["h1"]}
    name = "model-00001-of-00002.safetensors"
    partial = blobs(caches["h1"]) / (hashlib.sha256(served.files[name]).hexdigest() + ".incomplete")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(served.files[name][:100_000])
    doc = fan_out(served, one)
    assert name not in served.downloads  # a resumed tail: the hub counts no new download
    assert doc["hosts"]["h1"]["fetched"] == len(served.files[name]) - 100_000 + sum(
        len(d) for n, d in served.files.items() if n != name
    )


@pytest.mark.parametrize(
    ("token", "repo", "revision", "said"),
    [
        (
            "hf_wrong",
            REPO,
            "main",
            f"the hub at {{endpoint}} refused HF_TOKEN for {REPO} "
            "(a gated or private model needs a token with access)",
        ),
        (
            None,
            REPO,
            "main",
            f"the hub at {{endpoint}} has no model {REPO} at revision main, or the model is "
            "gated or private and needs a token (check the name and the revision; for a gated "
            "or private model, export HF_TOKEN and list it in the spec's env)",
        ),
        (
            TOKEN,
            "lab/no-such-model",
            "main",
            "the hub at {endpoint} has no model lab/no-such-model at revision main "
            "(check the name and the revision)",
        ),
        (
            TOKEN,
            REPO,
            "v9",
            f"the hub at {{endpoint}} has no model {REPO} at revision v9 "
            "(check the name and the revision)",
        ),
    ],
    ids=["wrong-token", "no-token", "no-such-model", "no-such-revision"],
)
def test_a_hub_refusal_is_one_line_the_user_acts_on(
    served: Hub,
    caches: dict[str, Path],
    token: str | None,
    repo: str,
    revision: str,
    said: str,
) -> None:
    """The real fetcher, refused by the hub: a user error (exit 3) naming the model, the
    revision or HF_TOKEN; no host blamed, no advice about disks, the token nowhere."""
    ask = prefetch.Request(
        repo=repo, revision=revision, cache="/unused", endpoint=served.endpoint, token=token
    )
    with pytest.raises(InputError) as raised:
        fan_out(served, {"h1": caches["h1"], "h2": caches["h2"]}, request_doc=ask)
    line = raised.value.one_line()
    assert line == said.format(endpoint=served.endpoint)
    assert raised.value.exit_code == 3 and "disk" not in line
    assert TOKEN not in line and "hf_wrong" not in line
    assert served.downloads == {}
    # pdctl asks the hub itself before any host starts: no host's cache was even made
    assert not caches["h1"].exists() and not caches["h2"].exists()


@pytest.mark.parametrize(
    "path", ["../../etc/passwd", "/etc/passwd", "a/../../b", "a//b", "a b", ".."]
)
def test_a_hostile_file_path_from_the_hub_is_refused_before_anything_is_written(
    served: Hub, caches: dict[str, Path], path: str
) -> None:
    hostile = HostileHub(served, path)
    try:
        with pytest.raises(HostError, match="not a model file path"):
            fan_out(hostile, {"h1": caches["h1"]})  # type: ignore[arg-type]
    finally:
        hostile.server.shutdown()
    assert not caches["h1"].exists()  # pdctl refused the list itself: no host was started


@pytest.mark.parametrize(
    "repo", ["../x", "a/b/c", "a--b/c", "a/..", "-a/b", "a/b;rm", "a/b\n", "", "a/" + "b" * 97]
)
def test_hostile_model_ids_are_refused(repo: str) -> None:
    with pytest.raises(ValueError, match="not a hub model id"):
        hf_layout.check_repo_id(repo)


@pytest.mark.parametrize("revision", ["../main", "refs/pr/1", "a b", "..", "main\n", ""])
def test_hostile_revisions_are_refused(revision: str) -> None:
    with pytest.raises(ValueError, match="not a revision"):
        hf_layout.check_revision(revision)


def test_a_peer_serves_only_the_fleet_holding_the_secret(tmp_path: Path) -> None:
    cache = model_fetch.Cache(str(tmp_path / "models"), REPO)
    cache.prepare()
    data = b"weights" * 1000
    name = hashlib.sha256(data).hexdigest()
    cache.blob(name).write_bytes(data)

    def get(server: model_fetch.PeerServer, secret: str, blob: str = name) -> int:
        where = f"127.0.0.1:{server.port}"
        signed = peer_auth.sign_request(secret, "GET", where, f"/blobs/{blob}")
        req = urllib.request.Request(
            f"http://{where}/blobs/{blob}", headers={"Authorization": signed}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as response:
                assert response.read() == data
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError):
            return 0  # closed without an answer

    server = model_fetch.PeerServer(cache, "127.0.0.1", ["127.0.0.1"], "s3cret")
    server.expected = {name: len(data)}
    server.ordered.set()
    server.done.set()
    server.start()
    try:
        assert get(server, "s3cret") == 200
        assert get(server, "wrong") == 403
        assert get(server, "s3cret", "0" * 64) == 404  # not this model's: nothing else is served
    finally:
        server.stop()
    stranger = model_fetch.PeerServer(cache, "127.0.0.1", ["192.0.2.1"], "s3cret")
    stranger.expected, _ = {name: len(data)}, stranger.start()
    try:
        assert get(stranger, "s3cret") == 0  # not a host of the fleet: closed, never answered
    finally:
        stranger.stop()
