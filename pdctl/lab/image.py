"""The lab's worker image: Debian's python3 plus the SGLang stand-in, as a docker-archive.

Real clusters often load images from an archive (no registry in reach); the
lab does the same: this archive is loaded into each GPU host's podman. It is
built from the lab rootfs's own packages (no registry, no podman needed here)
and cached by content.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pdctl.workspace import cache_dir

REPOSITORY = "localhost/pdctl-lab/sglang-rocm"
# Two tags of the same content, so a rolling update can be shown by changing the tag.
TAGS = ("0.5.4-lab", "0.5.5-lab")
WORKER_IMAGE = f"{REPOSITORY}:{TAGS[0]}"
ARCHIVE_NAME = "sglang-rocm-lab.tar"

# What the image holds: these packages and what they depend on (per the rootfs's
# dpkg database), less the package-management machinery a container never runs.
_ROOT_PACKAGES = ("python3-minimal", "libpython3.11-stdlib", "dash", "coreutils")
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


def _sources_digest(rootfs: Path, worker_src: Path) -> str:
    digest = hashlib.sha256(rootfs.name.encode())
    digest.update(json.dumps([_ROOT_PACKAGES, sorted(_EXCLUDED_PACKAGES), TAGS]).encode())
    for file in sorted([*worker_src.rglob("*.py"), *_common_modules(worker_src)]):
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()[:16]


def _common_modules(worker_src: Path) -> list[Path]:
    """The stand-ins' shared modules (pdctl/lab/worker/*.py): top-level modules in the image."""
    return sorted(worker_src.parent.glob("*.py"))


def ensure_image(rootfs: Path, worker_src: Path) -> Path:
    """Return the cached archive for this rootfs and stand-in, building it if needed."""
    target = cache_dir() / "images" / _sources_digest(rootfs, worker_src) / ARCHIVE_NAME
    if target.is_file():
        return target
    images = target.parent.parent
    images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=images) as tmp:
        layer = Path(tmp) / "layer.tar"
        _write_layer(layer, rootfs, worker_src)
        _write_archive(Path(tmp) / ARCHIVE_NAME, layer)
        target.parent.mkdir(exist_ok=True)
        (Path(tmp) / ARCHIVE_NAME).replace(target)
    return target


def _info(
    name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, size: int = 0
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime, info.uid, info.gid = kind, mode, size, 0, 0, 0
    return info


def _write_layer(layer: Path, rootfs: Path, worker_src: Path) -> None:
    seen: set[str] = set()
    with tarfile.open(layer, "w", format=tarfile.GNU_FORMAT) as tar:

        def add_dirs(path: str) -> None:
            parts = path.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                directory = "/".join(parts[:depth])
                if directory not in seen:
                    seen.add(directory)
                    tar.addfile(_info(directory, tarfile.DIRTYPE, 0o755))

        for top, target in _MERGED.items():
            seen.add(top)
            link = _info(top, tarfile.SYMTYPE, 0o777)
            link.linkname = target
            tar.addfile(link)
        for directory in ("tmp", "proc", "sys", "dev", "root", "etc", "run", "var/tmp"):
            add_dirs(f"{directory}/x")
        for raw in sorted(set(_package_files(rootfs))):
            name = _canonical(raw)
            source = rootfs / name
            if name in seen or not _wanted(name) or not (source.is_symlink() or source.is_file()):
                continue
            add_dirs(name)
            seen.add(name)
            if source.is_symlink():
                link = _info(name, tarfile.SYMTYPE, 0o777)
                link.linkname = str(source.readlink())
                tar.addfile(link)
            else:
                with source.open("rb") as handle:
                    stat = source.stat()
                    tar.addfile(_info(name, mode=stat.st_mode & 0o7777, size=stat.st_size), handle)
        extras = {**_ETC, "usr/bin/sh": None, "usr/bin/python": None}
        for name, text in extras.items():
            if name in seen:
                continue
            if text is None:
                link = _info(name, tarfile.SYMTYPE, 0o777)
                link.linkname = "dash" if name.endswith("/sh") else "python3.11"
                tar.addfile(link)
                continue
            data = text.encode()
            tar.addfile(_info(name, size=len(data)), io.BytesIO(data))
        package_dir = "usr/lib/python3/dist-packages/sglang"
        add_dirs(f"{package_dir}/x")
        for file in sorted(worker_src.glob("*.py")):
            data = file.read_bytes()
            tar.addfile(_info(f"{package_dir}/{file.name}", size=len(data)), io.BytesIO(data))
        for file in _common_modules(worker_src):
            data = file.read_bytes()
            name = f"usr/lib/python3/dist-packages/{file.name}"
            tar.addfile(_info(name, size=len(data)), io.BytesIO(data))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_archive(archive: Path, layer: Path) -> None:
    """docker-archive layout: manifest.json, <config>.json, <layer>/layer.tar."""
    layer_id = _sha256(layer)
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
                "Cmd": ["python3", "-m", "sglang.launch_server", "--help"],
                "WorkingDir": "/",
                "Labels": {"org.opencontainers.image.title": "pdctl lab SGLang stand-in"},
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "pdctl lab image"}],
        },
        sort_keys=True,
    ).encode()
    config_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps(
        [
            {
                "Config": f"{config_id}.json",
                "RepoTags": [f"{REPOSITORY}:{tag}" for tag in TAGS],
                "Layers": [f"{layer_id}/layer.tar"],
            }
        ]
    ).encode()
    with tarfile.open(archive, "w") as tar:
        tar.addfile(_info(f"{layer_id}", tarfile.DIRTYPE, 0o755))
        tar.add(layer, arcname=f"{layer_id}/layer.tar")
        tar.addfile(_info(f"{config_id}.json", size=len(config)), io.BytesIO(config))
        tar.addfile(_info("manifest.json", size=len(manifest)), io.BytesIO(manifest))
