"""A worker stand-in's model loading at start, as a real engine does it offline.

``load_model`` (the one entry point; the SGLang and vLLM stand-ins call it before they
listen) resolves the model id of ``--model-path``/``--model`` in the Hugging Face hub cache
(docs/facts.md, "Hugging Face Hub API and cache"): ``$HF_HUB_CACHE`` or ``$HF_HOME/hub``,
``models--ORG--NAME/refs/<revision>`` -> ``snapshots/<commit>/``, each file a symlink to
``blobs/<sha256 or git oid>``. A commit id as revision names the snapshot directly; a model id
that starts with ``/`` is a local directory. It reads every file, checks each blob against its
name (sha256 for LFS files, the git blob id for small ones) and takes time in proportion to the
bytes: ``load_bytes_per_s`` in the lab's state file (``PDFAKE_LOAD_BYTES_PER_S`` overrides it;
0: no wait). A missing model, revision, snapshot, blob, config.json, weight file or shard of
the safetensors index, or a blob that does not match its name, refuses the start with one
line, like an engine that cannot download offline.

No Hugging Face cache in the environment (neither ``HF_HOME`` nor ``HF_HUB_CACHE`` set, and
the model not a path) means pdctl mounted none. With ``HF_ENDPOINT`` set and outgoing traffic
allowed (``HF_HUB_OFFLINE`` not 1/ON/YES/TRUE, huggingface_hub's reading), the stand-in then
does what an engine does through ``huggingface_hub.snapshot_download``: it downloads the model
from that hub (``HF_TOKEN`` as the bearer token) into a temporary directory of its own (under
``$TMPDIR``: inside a container, its throw-away filesystem, so every start downloads again),
then verifies and loads it from there as above. The download is pdctl's own fetcher
(pdctl/onhost/model_fetch.py, which the lab image carries with what it imports, as
pdctl.onhost's own files: the hub API, every name checked before it becomes a path, resumes and
retries). Only when no endpoint
is given either does it start without loading (an INFO line says so), for lab specs that name
neither a cache nor a hub.

Standard library only: it runs in the lab's worker image, beside the stand-ins' packages.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdctl.onhost import model_fetch  # the image carries it and its bundle (worker_tree.py)

DEFAULT_LOAD_BYTES_PER_S = 1e9
LOAD_RATE_ENV = "PDFAKE_LOAD_BYTES_PER_S"
LOAD_RATE_KEY = "load_bytes_per_s"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 4 << 20

Log = Callable[[str, str], None]


class ModelNotLoaded(Exception):
    """The model cannot be loaded: the message is the stand-in's refusal line."""


def hub_cache(env: Mapping[str, str]) -> Path | None:
    """The hub cache the engine would use; None when the environment names none."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    return None


def offline(env: Mapping[str, str]) -> bool:
    """huggingface_hub's reading of HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE): docs/facts.md,
    "Hugging Face Hub API and cache"."""
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


def download(
    model: str, revision: str | None, endpoint: str, env: Mapping[str, str], log: Log
) -> tuple[Path, str]:
    """The model from the hub at ``endpoint`` into a new temporary hub cache: that cache and
    the commit downloaded, or ModelNotLoaded."""
    rev = revision or "main"
    home = Path(tempfile.mkdtemp(prefix="hf-download-", dir=env.get("TMPDIR") or None))
    token = env.get("HF_TOKEN") or None
    started = time.monotonic()
    log(f"No Hugging Face cache mounted: downloading {model} from {endpoint} into {home}", "INFO")
    try:
        manifest = model_fetch.hub_manifest(endpoint, model, rev, token)
        target = model_fetch.Cache(str(home), model)
        target.prepare()
        source = {"kind": "hub", "endpoint": endpoint, "token": token}
        model_fetch.Fetcher(target, manifest, source, lambda _event: None).run(rev)
    except (OSError, ValueError, RuntimeError, http.client.HTTPException) as exc:
        raise ModelNotLoaded(f"model {model}: download from {endpoint} failed: {exc}") from None
    total = sum(entry["size"] for entry in manifest["files"])
    took = time.monotonic() - started
    log(f"Downloaded {model} at {manifest['commit']}: {total} bytes in {took:.2f} s", "INFO")
    return home / "hub", str(manifest["commit"])


def load_rate(env: Mapping[str, str], state: Mapping[str, Any]) -> float:
    raw: object = env.get(LOAD_RATE_ENV) or state.get(LOAD_RATE_KEY, DEFAULT_LOAD_BYTES_PER_S)
    try:
        rate = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return DEFAULT_LOAD_BYTES_PER_S
    return rate if rate >= 0 else DEFAULT_LOAD_BYTES_PER_S


def snapshot_dir(model: str, revision: str | None, cache: Path) -> Path:
    """The snapshot directory of ``model`` at ``revision`` in ``cache``, or ModelNotLoaded."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?", model):
        raise ModelNotLoaded(f"{model!r} is neither a Hugging Face repo id nor an absolute path")
    folder = cache / ("models--" + model.replace("/", "--"))
    offline = (
        "not in the Hugging Face cache and outgoing traffic is disabled (HF_HUB_OFFLINE=1): "
        "pdctl fetches models into the host's cache before it starts workers"
    )
    if not folder.is_dir():
        raise ModelNotLoaded(f"model {model}: {folder} is missing: {offline}")
    rev = revision or "main"
    if _COMMIT.fullmatch(rev):
        commit = rev
    else:
        ref = folder / "refs" / rev
        try:
            commit = ref.read_text().strip()
        except OSError:
            raise ModelNotLoaded(
                f"model {model}: revision {rev}: {ref} is missing: {offline}"
            ) from None
        if not _COMMIT.fullmatch(commit):
            raise ModelNotLoaded(f"model {model}: {ref} holds no commit id (corrupt cache)")
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        raise ModelNotLoaded(f"model {model}: snapshot {snapshot} is missing: {offline}")
    return snapshot


def _files(model_dir: Path) -> list[Path]:
    found = sorted(p for p in model_dir.rglob("*") if p.is_symlink() or p.is_file())
    for path in found:
        if not path.exists():
            raise ModelNotLoaded(
                f"model file {path} points at a missing blob ({path.readlink()}): "
                "incomplete cache; pdctl fetches it again"
            )
    if not (model_dir / "config.json").is_file():
        raise ModelNotLoaded(f"{model_dir}/config.json is missing: not a model directory")
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in found):
        raise ModelNotLoaded(f"Cannot find any model weights in {model_dir}")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelNotLoaded(f"{index} is not a safetensors index (corrupt)") from None
        missing = sorted(str(s) for s in shards if not (model_dir / str(s)).is_file())
        if missing:
            raise ModelNotLoaded(f"{index} names missing shard(s): {', '.join(missing)}")
    return found


def _expected(blob: Path) -> tuple[str, str] | None:
    """What a cached blob's name says its contents hash to: (algorithm, hex), or None."""
    if _SHA256.fullmatch(blob.name):
        return "sha256", blob.name
    if _COMMIT.fullmatch(blob.name):
        return "git", blob.name
    return None


def _read(path: Path, pace: Callable[[int], None]) -> int:
    """Read one file through, checking its blob name; returns its size."""
    blob = path.resolve()
    expected = _expected(blob)
    size = blob.stat().st_size
    digest = hashlib.sha256() if expected is None or expected[0] == "sha256" else None
    if digest is None:
        digest = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)
    with blob.open("rb") as source:
        while block := source.read(_CHUNK):
            digest.update(block)
            pace(len(block))
    if expected is not None and digest.hexdigest() != expected[1]:
        raise ModelNotLoaded(
            f"model file {path}: blob {blob} does not match its "
            f"{'sha256' if expected[0] == 'sha256' else 'git blob id'} (corrupt); "
            "pdctl fetches it again"
        )
    return size


def load_model(
    model: str,
    revision: str | None,
    env: Mapping[str, str],
    state: Mapping[str, Any],
    log: Log,
) -> str | None:
    """Load the model like an engine at start: None once loaded (or when no cache is
    mounted), else the refusal line."""
    cache = hub_cache(env)
    endpoint = env.get("HF_ENDPOINT", "")
    if not model.startswith("/") and cache is None and (not endpoint or offline(env)):
        log(
            f"No Hugging Face cache in this container (HF_HOME unset) and no hub to download "
            f"from (HF_ENDPOINT unset or HF_HUB_OFFLINE set): starting without loading {model} "
            "(lab specs that name neither)",
            "INFO",
        )
        return None
    rate = load_rate(env, state)
    try:
        if cache is None and not model.startswith("/"):
            cache, revision = download(model, revision, endpoint, env, log)
        if model.startswith("/"):
            model_dir = Path(model)
            if not model_dir.is_dir():
                raise ModelNotLoaded(f"model path {model} is not a directory")
        else:
            assert cache is not None
            model_dir = snapshot_dir(model, revision, cache)
        files = _files(model_dir)
        log(f"Loading weights of {model} from {model_dir} ({len(files)} files)", "INFO")
        started = time.monotonic()
        done = 0

        def pace(count: int) -> None:
            nonlocal done
            done += count
            if rate > 0:
                ahead = done / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

        total = sum(_read(path, pace) for path in files)
    except ModelNotLoaded as exc:
        return f"Failed to load the model: {exc}"
    except OSError as exc:
        return f"Failed to load the model {model}: {exc}"
    took = time.monotonic() - started
    log(f"Load weight end. {total} bytes in {took:.2f} s ({len(files)} files)", "INFO")
    return None
