"""The lab's model hub (pdctl/lab/hub.py) on loopback, downloaded from by the real
``huggingface_hub`` client (snapshot_download, hf_hub_download) and by plain HTTP."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from pdctl.lab import hub, hub_models
from tests.support import lab_hub_on_loopback

REPO = "lab/test-model"
SIZE = 3 << 20  # three shards of 1 MiB
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    cache = tmp_path_factory.mktemp("hub-cache")
    hub_models.ensure_tiny(root, cache)
    hub_models.add_model(root, REPO, SIZE, cache, shards=3)
    return root


@pytest.fixture
def served(hub_root: Path) -> Iterator[tuple[str, Path]]:
    """A fresh hub process state (counts from zero) over the module's models."""
    for name in ("downloads.json", "settings.json"):
        (hub_root / name).unlink(missing_ok=True)
    with lab_hub_on_loopback(hub_root) as endpoint:
        yield endpoint, hub_root


def _downloads(root: Path) -> dict[str, int]:
    return dict(hub.read_downloads(root)["downloads"])


def _request(
    url: str, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_snapshot_download_with_the_real_client_fills_the_hf_cache(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, root = served
    repo = hub_models.Store(root).get(REPO)
    assert repo is not None
    folder = Path(snapshot_download(REPO, endpoint=url, cache_dir=tmp_path))
    # The Hub cache layout: refs/main -> the commit, snapshot files -> blobs named by ETag.
    cached = tmp_path / "models--lab--test-model"
    assert folder == cached / "snapshots" / repo.sha
    assert (cached / "refs" / "main").read_text() == repo.sha
    assert sorted(p.name for p in folder.iterdir()) == sorted(f.path for f in repo.files)
    for item in repo.files:
        link = folder / item.path
        assert link.is_symlink() and not Path(os.readlink(link)).is_absolute()
        blob = link.resolve()
        assert blob.parent == cached / "blobs"
        assert blob.name == (item.sha256 if item.lfs else item.oid)  # sha256 for LFS files
        assert _sha256(blob) == item.sha256
    shards = [f for f in repo.files if f.lfs]
    assert len(shards) == 3 and sum(f.size for f in shards) == SIZE
    assert _downloads(root) == {f"{REPO}/{f.path}": 1 for f in repo.files}
    # Cached already: the client asks (HEAD) but takes nothing again.
    again = hf_hub_download(REPO, shards[0].path, endpoint=url, cache_dir=tmp_path)
    assert Path(again).resolve().name == shards[0].sha256
    assert _downloads(root)[f"{REPO}/{shards[0].path}"] == 1


def test_files_are_what_git_and_safetensors_say(served: tuple[str, Path]) -> None:
    url, root = served
    status, _, body = _request(url, f"/api/models/{REPO}/tree/main?recursive=true")
    assert status == 200
    tree = {entry["path"]: entry for entry in json.loads(body)}
    config = tree["config.json"]
    assert "lfs" not in config
    data = (root / "blobs" / hashlib.sha256(_get(url, "config.json")).hexdigest()).read_bytes()
    git = subprocess.run(
        ["git", "hash-object", "--stdin"], input=data, capture_output=True, check=True
    )
    assert config["oid"] == git.stdout.decode().strip()  # the git blob oid, as the Hub gives
    shard = tree["model-00001-of-00003.safetensors"]
    assert shard["lfs"]["oid"] == hashlib.sha256(_get(url, shard["path"])).hexdigest()
    assert shard["lfs"]["size"] == shard["size"]
    pointer = hub_models.lfs_pointer(shard["lfs"]["oid"], shard["size"])
    assert shard["lfs"]["pointerSize"] == len(pointer)
    assert shard["oid"] == hub_models.git_blob_oid(pointer)
    raw = _get(url, shard["path"])  # a valid safetensors file: u64 header length, JSON, data
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    begin, end = header["weight"]["data_offsets"]
    assert 8 + length + end == len(raw) and begin == 0
    index = json.loads(_get(url, "model.safetensors.index.json"))
    assert sorted(set(index["weight_map"].values())) == sorted(p for p in tree if "-of-" in p)


def _get(url: str, path: str, repo: str = REPO) -> bytes:
    status, _, body = _request(url, f"/{repo}/resolve/main/{path}")
    assert status == 200
    return body


def test_ranges_and_what_counts_as_a_download(served: tuple[str, Path]) -> None:
    url, root = served
    name = "model-00002-of-00003.safetensors"
    path = f"/{REPO}/resolve/main/{name}"
    whole = _get(url, name)
    size = len(whole)
    assert _downloads(root) == {f"{REPO}/{name}": 1}
    status, headers, body = _request(url, path, headers={"Range": "bytes=1000-"})
    assert (status, body) == (206, whole[1000:])
    assert headers["Content-Range"] == f"bytes 1000-{size - 1}/{size}"
    status, _, body = _request(url, path, headers={"Range": "bytes=10-19"})
    assert (status, body) == (206, whole[10:20])
    status, _, body = _request(url, path, headers={"Range": "bytes=-5"})
    assert (status, body) == (206, whole[-5:])
    assert _downloads(root) == {f"{REPO}/{name}": 1}  # resumed tails are not downloads
    status, _, body = _request(url, path, headers={"Range": "bytes=0-99"})
    assert (status, body) == (206, whole[:100])
    assert _downloads(root) == {f"{REPO}/{name}": 2}  # a range from 0 is a new download
    status, headers, _ = _request(url, path, headers={"Range": f"bytes={size}-"})
    assert status == 416
    status, headers, body = _request(url, path, method="HEAD")
    repo = hub_models.Store(root).get(REPO)
    assert repo is not None
    assert (status, body) == (200, b"")
    assert headers["Content-Length"] == str(size)
    assert headers["ETag"] == f'"{hashlib.sha256(whole).hexdigest()}"'
    assert headers["X-Repo-Commit"] == repo.sha
    assert headers["Accept-Ranges"] == "bytes"
    assert _downloads(root) == {f"{REPO}/{name}": 2}  # HEAD is no download
    # The commit works as a revision, as huggingface_hub uses it after resolving main.
    status, _, body = _request(url, f"/{REPO}/resolve/{repo.sha}/{name}")
    assert (status, body) == (200, whole)
    served_bytes = 2 * size + (size - 1000) + 10 + 5 + 100
    deadline = time.monotonic() + 5  # bytes are booked once a response is sent out
    while hub.read_downloads(root)["bytes_served"] < served_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hub.read_downloads(root)["bytes_served"] == served_bytes


def test_a_hub_with_a_token_refuses_requests_without_it(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, root = served
    hub.write_settings(root, rate=None, token="hf_lab_secret")
    assert (root / "settings.json").stat().st_mode & 0o777 == 0o600
    time.sleep(0.6)  # the hub re-reads its settings every half second
    status, _, _ = _request(url, f"/api/models/{REPO}/revision/main")
    assert status == 401
    status, _, _ = _request(url, f"/{REPO}/resolve/main/config.json", method="HEAD")
    assert status == 401
    with pytest.raises(HfHubHTTPError) as refused:
        hf_hub_download(REPO, "config.json", endpoint=url, cache_dir=tmp_path, token=False)
    assert refused.value.response.status_code == 401
    wrong = {"Authorization": "Bearer hf_other"}
    assert _request(url, f"/{REPO}/resolve/main/config.json", headers=wrong)[0] == 401
    got = hf_hub_download(
        REPO, "config.json", endpoint=url, cache_dir=tmp_path, token="hf_lab_secret"
    )
    assert (
        Path(got).read_bytes()
        == _request(
            url,
            f"/{REPO}/resolve/main/config.json",
            headers={"Authorization": "Bearer hf_lab_secret"},
        )[2]
    )
    assert _downloads(root) == {f"{REPO}/config.json": 2}  # refused requests count nothing


def test_unknown_repo_revision_and_file_are_the_hubs_errors(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, _ = served
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("lab/nope", "config.json", endpoint=url, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="v9", endpoint=url, cache_dir=tmp_path)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "nope.bin", endpoint=url, cache_dir=tmp_path)


def test_a_repository_no_one_added_is_made_on_its_first_request(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    """With ``generate`` set (the lab's `--hub-model-size`), any model a spec names is there:
    made once (concurrent first requests wait for it), as `add` would make it at that size,
    and only for a request the hub authorizes; a bad repository id stays a 404."""
    url, root = served
    size = 256 << 10
    hub.write_settings(root, rate=None, token="hf_lab_secret", generate=size)
    time.sleep(0.6)
    assert _request(url, "/api/models/org/made-on-request/revision/main")[0] == 401
    assert hub_models.Store(root).get("org/made-on-request") is None  # refused: not made
    auth = {"Authorization": "Bearer hf_lab_secret"}
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda _: _request(
                    url, "/api/models/org/made-on-request/revision/main", "GET", auth
                ),
                range(4),
            )
        )
    commits = {json.loads(body)["sha"] for status, _, body in answers if status == 200}
    assert len(commits) == 1 and len(answers) == 4 and all(a[0] == 200 for a in answers)
    expected = hub_models.add_model(tmp_path / "other", "org/made-on-request", size, tmp_path)
    assert commits == {expected.sha}  # deterministic: what `add` makes at that size
    got = snapshot_download(
        "org/made-on-request", endpoint=url, cache_dir=tmp_path / "hf", token="hf_lab_secret"
    )
    assert (Path(got) / "config.json").is_file()
    assert _request(url, "/api/models/bad..id/revision/main", "GET", auth)[0] == 404
    hub.write_settings(root, rate=None, token=None)  # generate: none again
    time.sleep(0.6)
    assert _request(url, "/api/models/org/never-added/revision/main")[0] == 404


def test_the_rate_cap_is_shared_by_all_downloads(served: tuple[str, Path]) -> None:
    url, root = served
    rate = 4 << 20
    hub.write_settings(root, rate=rate, token=None)
    time.sleep(0.6)
    names = ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        bodies = list(pool.map(lambda name: _get(url, name), names))
    took = time.monotonic() - started
    total = sum(len(b) for b in bodies)
    # 2 MiB at 4 MiB/s: ~0.5 s. Two caps of 4 MiB/s each would take half that: the lower
    # bound is the check; the upper one only allows for a loaded machine.
    assert total / rate * 0.9 <= took <= total / rate * 10, took
    hub.write_settings(root, rate=None, token=None)


def test_models_are_deterministic_and_made_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = hub_models.add_model(tmp_path / "a", "org/m", 300_000, cache, shards=2)
    blobs = sorted((cache / "blobs").iterdir())
    stamps = [b.stat().st_mtime_ns for b in blobs]
    second = hub_models.add_model(tmp_path / "b", "org/m", 300_000, cache, shards=2)
    assert first == second
    assert sorted((cache / "blobs").iterdir()) == blobs  # reused, not made again
    assert [b.stat().st_mtime_ns for b in blobs] == stamps
    other = hub_models.add_model(tmp_path / "a", "org/other", 300_000, cache, shards=2)
    assert {f.sha256 for f in other.files if f.lfs}.isdisjoint(f.sha256 for f in first.files)
    assert hub_models.shard_count(256 << 20) == 2
    assert hub_models.shard_count(1 << 30) == 4
    assert hub_models.parse_size("256M") == 256 << 20
    assert hub_models.parse_size("1.5G") == 3 << 29
    for bad_repo in ("../x", "a/b/c", "", "-a/b"):
        with pytest.raises(hub_models.HubError):
            hub_models.add_model(tmp_path / "a", bad_repo, 1000, cache)
    with pytest.raises(hub_models.HubError):
        hub_models.parse_size("ten")


def test_the_module_runs_on_its_own(tmp_path: Path) -> None:
    """``python3 -m pdctl.lab.hub``: add a model, set a token, serve on a free port."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    py = [sys.executable, "-m", "pdctl.lab.hub"]
    root = tmp_path / "hub"
    added = subprocess.run(
        [*py, "add", "--root", str(root), "lab/cli-model", "--size", "64K"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert json.loads(added.stdout)["id"] == "lab/cli-model"
    bad = subprocess.run(
        [*py, "add", "--root", str(root), "lab/x", "--size", "lots"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "not a size" in bad.stderr
    port_file = tmp_path / "port"
    server = subprocess.Popen(
        [*py, "serve", "--root", str(root), "--port", "0", "--port-file", str(port_file)],
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        status, _, body = _request(url, "/api/models/lab/cli-model")
        assert status == 200 and json.loads(body)["id"] == "lab/cli-model"
    finally:
        server.terminate()
        server.wait(10)
