"""The lab's worker images: Debian's python3 plus an engine stand-in, as docker-archives.

Real clusters often load images from an archive (no registry in reach); the
lab does the same: these archives are loaded into each GPU host's podman. They are
built from the lab rootfs's own packages and the wheelhouse's wheels (no registry, no
podman needed here) and cached by content. One image per engine, SGLang's and vLLM's, each of
three layers: Debian's python3, the stand-ins with their gRPC packages (the same bytes in both,
so a host that loaded one image loads only the other's last layer), the engine's entry points
(worker_tree.py says which Python files each holds).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import marshal
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdctl.core.versions import GRPC_STANDIN_PACKAGES
from pdctl.doors.workspace import cache_dir
from pdctl.lab import worker_tree
from pdctl.lab.worker_tree import Engine

# What every image's base layer holds: these packages and what they depend on (per the
# rootfs's dpkg database), less the package-management machinery a container never runs.
# libstdc++6: grpcio's and protobuf's native modules (the gRPC stand-ins) link it.
_ROOT_PACKAGES = ("python3-minimal", "libpython3.11-stdlib", "dash", "coreutils", "libstdc++6")
# The images' Python (bookworm's). Each .py goes in with its bytecode: a container starts from
# the image every time (`--rm`), so without it every worker start compiled all it imports
# (0.3 CPU-s of the stand-in's 0.4 to import its modules) and never kept it.
IMAGE_PYTHON = (3, 11)
# Only the image's own Python version makes bytecode the image's Python will load.
_MAKES_BYTECODE = sys.version_info[:2] == IMAGE_PYTHON


@dataclass(frozen=True)
class WorkerImage:
    engine: Engine
    repository: str
    # Two tags of the same content, so a rolling update can be shown by changing the tag.
    tags: tuple[str, str]
    archive_name: str
    title: str
    cmd: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.repository}:{self.tags[0]}"


SGLANG = WorkerImage(
    engine="sglang",
    repository="localhost/pdctl-lab/sglang-rocm",
    tags=("0.5.4-lab", "0.5.5-lab"),
    archive_name="sglang-rocm-lab.tar",
    title="pdctl lab SGLang stand-in",
    cmd=("python3", "-m", "sglang.launch_server", "--help"),
)
VLLM = WorkerImage(
    engine="vllm",
    repository="localhost/pdctl-lab/vllm-rocm",
    tags=("0.11.0-lab", "0.11.1-lab"),
    archive_name="vllm-rocm-lab.tar",
    title="pdctl lab vLLM stand-in",
    cmd=("vllm", "serve", "--help"),
)
IMAGES = (SGLANG, VLLM)
WORKER_IMAGE = SGLANG.name  # what `worker_image` has always named
_EXCLUDED_PACKAGES = frozenset(
    {
        "dpkg",
        "debconf",
        "perl-base",
        "tar",
        "media-types",
        "tzdata",
        "readline-common",
        "netbase",
        "debianutils",
    }
)
_SKIP_PREFIXES = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/info",
    "usr/lib/x86_64-linux-gnu/gconv",
    "usr/share/i18n",
)
# Where worker_tree's areas are in the image (Debian's python3 reads dist-packages).
_AREAS = {"site": "usr/lib/python3/dist-packages", "bin": "usr/bin"}
_SKIP_STDLIB = ("test", "idlelib", "tkinter", "ensurepip", "lib2to3", "pydoc_data", "turtledemo")
# Debian's merged /usr: the top-level directories are links into /usr.
_MERGED = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
_ETC = {
    "etc/passwd": (
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
    ),
    "etc/group": "root:x:0:\nvideo:x:44:\nrender:x:105:\nnogroup:x:65534:\n",
}


def _canonical(path: str) -> str:
    path = path.lstrip("/")
    top, _, rest = path.partition("/")
    return f"{_MERGED[top]}/{rest}" if top in _MERGED and rest else path


def _dependencies(rootfs: Path) -> dict[str, list[str]]:
    """Package -> the packages it (pre-)depends on, from the rootfs's dpkg status."""
    graph: dict[str, list[str]] = {}
    for stanza in (rootfs / "var/lib/dpkg/status").read_text().split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, re.M))
        if "Package" not in fields:
            continue
        wanted = ", ".join(fields.get(key, "") for key in ("Pre-Depends", "Depends"))
        # "a (>= 1) | b, c:any" -> a, c: the first alternative, without versions or arch
        graph[fields["Package"]] = [
            re.split(r"[\s:(]", alternative.split("|")[0].strip())[0]
            for alternative in wanted.split(",")
            if alternative.strip()
        ]
    return graph


def _package_files(rootfs: Path) -> Iterator[str]:
    graph = _dependencies(rootfs)
    todo, chosen = list(_ROOT_PACKAGES), set[str]()
    while todo:
        package = todo.pop()
        if package in chosen or package in _EXCLUDED_PACKAGES or package not in graph:
            continue
        chosen.add(package)
        todo.extend(graph[package])
    info = rootfs / "var/lib/dpkg/info"
    for package in sorted(chosen):
        for listing in (info / f"{package}.list", info / f"{package}:amd64.list"):
            if listing.is_file():
                yield from listing.read_text().splitlines()


def _wanted(path: str) -> bool:
    if not path or path.startswith(_SKIP_PREFIXES):
        return False
    parts = path.split("/")
    return not (
        len(parts) > 3 and parts[:3] == ["usr", "lib", "python3.11"] and parts[3] in _SKIP_STDLIB
    )


def _digest(rootfs: Path, spec: WorkerImage, wheels: list[Path]) -> str:
    digest = hashlib.sha256(rootfs.name.encode())
    bytecode = list(IMAGE_PYTHON) if _MAKES_BYTECODE else None
    digest.update(
        json.dumps([_ROOT_PACKAGES, sorted(_EXCLUDED_PACKAGES), repr(spec), bytecode]).encode()
    )
    digest.update(worker_tree.digest(spec.engine, wheels).encode())
    return digest.hexdigest()[:16]


# Each change to what goes into the images (a stand-in, a recipe, a wheel) makes a new cache
# directory of about 150 MB: one that no lab has used for this long is removed. Not at once:
# another checkout's lab may be loading its images right now.
UNUSED_IMAGES_KEPT = 24 * 3600.0


def ensure_images(rootfs: Path, wheelhouse: Path) -> Path:
    """The directory holding every worker image's archive (IMAGES), built when missing."""
    wheels = worker_tree.wheels_for(wheelhouse, GRPC_STANDIN_PACKAGES)
    key = hashlib.sha256("".join(_digest(rootfs, s, wheels) for s in IMAGES).encode())
    target = cache_dir() / "images" / key.hexdigest()[:16]
    images = target.parent
    if all((target / spec.archive_name).is_file() for spec in IMAGES):
        with contextlib.suppress(OSError):  # a cache this user may read, not write: kept as is
            os.utime(target)  # in use: kept
            prune_images(images, target, time.time())
        return target
    images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=images) as tmp:
        base, shared = Path(tmp) / "base.tar", Path(tmp) / "shared.tar"
        _write_base_layer(base, rootfs)
        _write_layer(shared, worker_tree.shared_entries(wheels))
        for spec in IMAGES:
            layer = Path(tmp) / "engine.tar"
            _write_layer(layer, worker_tree.engine_entries(spec.engine))
            _write_archive(Path(tmp) / spec.archive_name, [base, shared, layer], spec)
            layer.unlink()
        target.mkdir(exist_ok=True)
        for spec in IMAGES:
            (Path(tmp) / spec.archive_name).replace(target / spec.archive_name)
    prune_images(images, target, time.time())
    return target


def prune_images(images: Path, current: Path, now: float) -> list[Path]:
    """Remove the image caches under ``images`` (a left-over build's directory included) that
    were last used more than UNUSED_IMAGES_KEPT before ``now``; ``current`` stays. What went."""
    removed = []
    for entry in sorted(images.iterdir()):
        try:
            stale = (
                entry != current
                and entry.is_dir()
                and entry.stat().st_mtime < now - UNUSED_IMAGES_KEPT
            )
        except OSError:  # removed meanwhile by another lab's prune
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _info(
    name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, size: int = 0
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime, info.uid, info.gid = kind, mode, size, 0, 0, 0
    return info


class _Layer:
    """A layer tar being written: each path once, its parent directories first."""

    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.seen: set[str] = set()

    def dirs(self, path: str) -> None:
        parts = path.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            directory = "/".join(parts[:depth])
            if directory not in self.seen:
                self.seen.add(directory)
                self.tar.addfile(_info(directory, tarfile.DIRTYPE, 0o755))

    def link(self, name: str, target: str) -> None:
        self.seen.add(name)
        link = _info(name, tarfile.SYMTYPE, 0o777)
        link.linkname = target
        self.tar.addfile(link)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self.dirs(name)
        self.seen.add(name)
        self.tar.addfile(_info(name, mode=mode, size=len(data)), io.BytesIO(data))
        compiled = _bytecode(name, data) if name.endswith(".py") else None
        if compiled is not None:
            pyc = _pyc_name(name)
            self.dirs(pyc)
            self.seen.add(pyc)
            self.tar.addfile(_info(pyc, size=len(compiled)), io.BytesIO(compiled))


def _pyc_name(name: str) -> str:
    folder, _, file = name.rpartition("/")
    return f"{folder}/__pycache__/{file[:-3]}.cpython-{IMAGE_PYTHON[0]}{IMAGE_PYTHON[1]}.pyc"


def _bytecode(name: str, source: bytes) -> bytes | None:
    """The image's .pyc of a source file (PEP 552, unchecked hash: an image's sources never
    change), or None where this Python cannot make it (another version than the image's, or a
    file that is not Python 3: a test fixture, a template)."""
    if not _MAKES_BYTECODE:
        return None
    try:
        code = compile(source, f"/{name}", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return None
    flags = 0b01  # hash-based, unchecked
    header = importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little")
    return header + importlib.util.source_hash(source) + marshal.dumps(code)


def _write_base_layer(path: Path, rootfs: Path) -> None:
    """Debian's python3 and what it needs, from the rootfs."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        layer = _Layer(tar)
        for top, target in _MERGED.items():
            layer.link(top, target)
        for directory in ("tmp", "proc", "sys", "dev", "root", "etc", "run", "var/tmp"):
            layer.dirs(f"{directory}/x")
        for raw in sorted(set(_package_files(rootfs))):
            name = _canonical(raw)
            source = rootfs / name
            if name in layer.seen or not _wanted(name):
                continue
            if source.is_symlink():
                layer.dirs(name)
                layer.link(name, str(source.readlink()))
            elif source.is_file():
                layer.file(name, source.read_bytes(), source.stat().st_mode & 0o7777)
        for name, text in _ETC.items():
            if name not in layer.seen:
                layer.file(name, text.encode())
        for name, target in (("usr/bin/sh", "dash"), ("usr/bin/python", "python3.11")):
            if name not in layer.seen:
                layer.link(name, target)


def _write_layer(path: Path, entries: list[worker_tree.Entry]) -> None:
    """A layer of worker_tree's files (the stand-ins and wheels, or an engine's entry points)."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        layer = _Layer(tar)
        for entry in entries:
            name = f"{_AREAS[entry.area]}/{entry.path}"
            if name not in layer.seen:
                layer.file(name, entry.data, entry.mode)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_archive(archive: Path, layers: list[Path], spec: WorkerImage) -> None:
    """docker-archive layout: manifest.json, <config>.json, <layer>/layer.tar for each layer."""
    layer_ids = [_sha256(layer) for layer in layers]
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": {
                "Env": [
                    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "LANG=C.UTF-8",
                    "PYTHONUNBUFFERED=1",
                ],
                "Cmd": list(spec.cmd),
                "WorkingDir": "/",
                "Labels": {"org.opencontainers.image.title": spec.title},
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{i}" for i in layer_ids]},
            "history": [
                {"created": "1970-01-01T00:00:00Z", "created_by": f"pdctl lab image: {what}"}
                for what in ("python3", "stand-ins", spec.engine)
            ],
        },
        sort_keys=True,
    ).encode()
    config_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps(
        [
            {
                "Config": f"{config_id}.json",
                "RepoTags": [f"{spec.repository}:{tag}" for tag in spec.tags],
                "Layers": [f"{i}/layer.tar" for i in layer_ids],
            }
        ]
    ).encode()
    with tarfile.open(archive, "w") as tar:
        for layer, layer_id in zip(layers, layer_ids, strict=True):
            tar.addfile(_info(f"{layer_id}", tarfile.DIRTYPE, 0o755))
            tar.add(layer, arcname=f"{layer_id}/layer.tar")
        tar.addfile(_info(f"{config_id}.json", size=len(config)), io.BytesIO(config))
        tar.addfile(_info("manifest.json", size=len(manifest)), io.BytesIO(manifest))
