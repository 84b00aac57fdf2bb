"""The worker stand-ins' model loading (pdctl/lab/worker/model_cache.py), on a Hugging Face
cache that the real ``huggingface_hub`` client filled from the lab hub; the SGLang stand-in
refusing to start, as an engine would offline, when its model is missing or corrupt; and,
with no cache mounted but a hub named, downloading the model from the lab hub (on loopback)
into a directory of its own, as an engine does online."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import snapshot_download

from pdctl.lab import hub, hub_models
from pdctl.lab.worker import model_cache
from tests.lab.worker.test_sglang import WORKER_DIR, Launcher, health
from tests.support import lab_hub_on_loopback, wait_for

REPO = "lab/load-me"
SHARD = 1 << 20


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose hub cache holds REPO (3 shards), downloaded through the lab hub."""
    root = tmp_path_factory.mktemp("hub")
    hub_models.add_model(root, REPO, 3 * SHARD, root / ".cache", shards=3)
    server = hub.make_server(root)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    home = tmp_path_factory.mktemp("hf-home")
    try:
        snapshot_download(REPO, endpoint=hub.endpoint(server), cache_dir=home / "hub")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    return home


@pytest.fixture
def home(filled: Path, tmp_path: Path) -> Path:
    """A copy of the filled HF_HOME that a test may damage."""
    copy = tmp_path / "hf-home"
    shutil.copytree(filled, copy, symlinks=True)
    return copy


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __call__(self, message: str, level: str) -> None:
        self.lines.append((level, message))


def _load(
    home: Path, model: str = REPO, revision: str | None = None, rate: float = 0
) -> str | None:
    return model_cache.load_model(
        model, revision, {"HF_HOME": str(home)}, {"load_bytes_per_s": rate}, Lines()
    )


def _folder(home: Path) -> Path:
    return home / "hub" / "models--lab--load-me"


def _shard_blob(home: Path, index: int = 1) -> Path:
    snapshot = next((_folder(home) / "snapshots").iterdir())
    return (snapshot / f"model-0000{index}-of-00003.safetensors").resolve()


def test_a_complete_model_loads_in_time_proportional_to_its_size(home: Path) -> None:
    log = Lines()
    rate = 8 << 20
    started = time.monotonic()
    refused = model_cache.load_model(
        REPO, None, {"HF_HOME": str(home)}, {"load_bytes_per_s": rate}, log
    )
    took = time.monotonic() - started
    assert refused is None, refused
    total = sum(p.stat().st_size for p in (_folder(home) / "blobs").iterdir())
    assert total > 3 * SHARD
    # ~0.4 s at 8 MiB/s; the slack is for a loaded machine, far below an unthrottled 1 B/s
    assert total / rate <= took <= total / rate + 5.0
    assert log.lines[-1][0] == "INFO" and f"Load weight end. {total} bytes" in log.lines[-1][1]
    # The environment's rate wins over the state file's; 0 takes no time.
    started = time.monotonic()
    env = {"HF_HOME": str(home), "PDFAKE_LOAD_BYTES_PER_S": "0"}
    assert model_cache.load_model(REPO, None, env, {"load_bytes_per_s": 1}, log) is None
    assert time.monotonic() - started < 10.0  # the state file's 1 B/s would take days


def test_revisions_and_local_paths(home: Path) -> None:
    commit = (_folder(home) / "refs" / "main").read_text()
    assert _load(home, revision=commit) is None  # a commit names the snapshot directly
    refused = _load(home, revision="v2")
    assert refused is not None and "revision v2" in refused and "refs/v2 is missing" in refused
    assert _load(home, model=str(_folder(home) / "snapshots" / commit)) is None
    refused = _load(home, model="/nonexistent/model")
    assert refused == "Failed to load the model: model path /nonexistent/model is not a directory"


def test_a_missing_model_refuses_to_start(home: Path) -> None:
    refused = _load(home, model="lab/other")
    assert refused is not None
    assert "models--lab--other is missing" in refused and "HF_HUB_OFFLINE=1" in refused
    (_folder(home) / "refs" / "main").unlink()
    refused = _load(home)
    assert refused is not None and "refs/main is missing" in refused
    assert _load(home, model="../../etc") is not None  # not a repo id: no path outside


def test_a_missing_blob_or_shard_refuses_to_start(home: Path) -> None:
    blob = _shard_blob(home, 2)
    blob.unlink()  # an interrupted fetch: the snapshot link dangles
    refused = _load(home)
    assert refused is not None and "points at a missing blob" in refused
    assert "model-00002-of-00003.safetensors" in refused
    snapshot = next((_folder(home) / "snapshots").iterdir())
    (snapshot / "model-00002-of-00003.safetensors").unlink()
    refused = _load(home)
    assert refused is not None
    assert "names missing shard(s): model-00002-of-00003.safetensors" in refused
    (snapshot / "config.json").unlink()
    refused = _load(home)
    assert refused is not None and "config.json is missing" in refused


def test_a_corrupt_blob_refuses_to_start(home: Path) -> None:
    blob = _shard_blob(home, 3)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    refused = _load(home)
    assert refused is not None
    assert f"blob {blob} does not match its sha256 (corrupt)" in refused
    # A small file is checked against its git blob id.
    _shard_blob(home, 3).unlink()
    snapshot = next((_folder(home) / "snapshots").iterdir())
    shutil.copy(
        _shard_blob(home, 1), _folder(home) / "blobs" / blob.name
    )  # size right, bytes wrong
    config = (snapshot / "config.json").resolve()
    config.write_text(config.read_text() + " ")
    refused = _load(home)
    assert refused is not None and "does not match its" in refused


def test_no_cache_and_no_hub_in_the_environment_starts_without_loading() -> None:
    line = (
        "INFO",
        "No Hugging Face cache in this container (HF_HOME unset) and no hub to download from "
        "(HF_ENDPOINT unset or HF_HUB_OFFLINE set): starting without loading org/anything "
        "(lab specs that name neither)",
    )
    for env in ({}, {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "yes"}):
        log = Lines()
        assert model_cache.load_model("org/anything", None, env, {}, log) is None
        assert log.lines == [line]  # offline: not even a request to the (closed) port


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A lab hub on loopback holding REPO: its endpoint and its root."""
    root = tmp_path_factory.mktemp("served-hub")
    hub_models.add_model(root, REPO, 3 * SHARD, root / ".cache", shards=3)
    with lab_hub_on_loopback(root) as endpoint:
        yield endpoint, root


def _downloads(root: Path) -> int:
    counts = hub.read_downloads(root)["downloads"]
    return sum(n for key, n in counts.items() if key.startswith(f"{REPO}/"))


def test_without_a_cache_it_downloads_the_model_into_a_directory_of_its_own(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    endpoint, root = served
    env = {"HF_ENDPOINT": endpoint, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "0"}
    before = _downloads(root)
    log = Lines()
    assert model_cache.load_model(REPO, None, env, {"load_bytes_per_s": 0}, log) is None
    assert _downloads(root) - before == 6  # every file of the repo, each once
    [home] = tmp_path.glob("hf-download-*")
    folder = home / "hub" / "models--lab--load-me"
    commit = (folder / "refs" / "main").read_text()
    assert sorted(p.name for p in (folder / "snapshots" / commit).iterdir()) == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    messages = [m for _level, m in log.lines]
    assert messages[0].startswith(f"No Hugging Face cache mounted: downloading {REPO} from")
    assert messages[1].startswith(f"Downloaded {REPO} at {commit}: ")
    assert messages[-1].startswith("Load weight end.")
    # A start after it downloads again (a container's filesystem does not outlive it); a
    # commit id as the revision names what is downloaded.
    assert model_cache.load_model(REPO, commit, env, {}, Lines()) is None
    assert len(list(tmp_path.glob("hf-download-*"))) == 2
    assert _downloads(root) - before == 12


def test_a_download_that_fails_refuses_to_start(served: tuple[str, Path], tmp_path: Path) -> None:
    endpoint, root = served
    hub_settings_check = hub._SETTINGS_CHECK_SECS + 0.1
    env = {"HF_ENDPOINT": endpoint, "TMPDIR": str(tmp_path)}
    refused = model_cache.load_model("lab/not-there", None, env, {}, Lines())
    assert refused is not None and refused.startswith(
        f"Failed to load the model: model lab/not-there: download from {endpoint} failed: "
    )
    assert "404" in refused
    hub.write_settings(root, None, "hf_right")
    time.sleep(hub_settings_check)  # the hub reads its settings again
    try:
        refused = model_cache.load_model(REPO, None, env, {}, Lines())
        assert refused is not None and "401" in refused
        good = {**env, "HF_TOKEN": "hf_right"}
        assert model_cache.load_model(REPO, None, good, {"load_bytes_per_s": 0}, Lines()) is None
    finally:
        hub.write_settings(root, None, None)
        time.sleep(hub_settings_check)


def test_the_images_copy_of_the_fetcher_downloads_with_the_standard_library_only(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    """In the image there is no pdctl: the stand-in takes the fetcher it carries."""
    endpoint, _root = served
    code = (
        "import sys\n"
        "from pdlab_worker import model_cache\n"
        "env = {'HF_ENDPOINT': sys.argv[1], 'TMPDIR': sys.argv[2]}\n"
        "log = lambda message, level: print(level, message)\n"
        "print('refused:', model_cache.load_model(sys.argv[3], None, env, {}, log))\n"
        "print('fetcher:', model_cache.model_fetch.__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code, endpoint, str(tmp_path), REPO],
        env={"PYTHONPATH": str(WORKER_DIR), "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,  # not the checkout: no pdctl on sys.path
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused: None" in proc.stdout and "Load weight end." in proc.stdout
    assert "fetcher: pdctl.onhost.model_fetch" in proc.stdout


def test_the_sglang_stand_in_downloads_its_model_when_no_cache_is_mounted(
    launcher: Launcher, served: tuple[str, Path], tmp_path: Path
) -> None:
    endpoint, _root = served
    env = {
        "HF_ENDPOINT": endpoint,
        "TMPDIR": str(tmp_path),
        "HF_HOME": None,
        "HF_HUB_CACHE": None,
        "HF_HUB_OFFLINE": None,
        "PDFAKE_LOAD_BYTES_PER_S": "0",
    }
    worker = launcher.start("null", "--model-path", REPO, env=env)
    assert health(worker.port) == 200
    log = worker.log()
    assert f"Downloaded {REPO} at " in log and "Load weight end." in log


def test_the_sglang_stand_in_loads_its_model_or_refuses_to_start(
    launcher: Launcher, home: Path
) -> None:
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    worker = launcher.start("null", "--model-path", REPO, "--revision", "main", env=env)
    assert health(worker.port) == 200
    assert "Load weight end." in worker.log()
    _shard_blob(home, 1).write_bytes(b"truncated")
    broken = launcher.start("null", "--model-path", REPO, env=env, wait=False)
    wait_for(lambda: broken.proc.poll() is not None, 20)
    assert broken.proc.returncode == 1
    errors = [line for line in broken.log().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "does not match its sha256 (corrupt)" in errors[0]
