"""What an image archive from a peer would do to a host's runtime, read before any load.

A peer's archive is untrusted: ``load`` applies every name the archive carries (moving the
tags of other images) and loads every image in it. So before a taker loads anything it reads
the archive as each loader would (docs/facts.md, "Container images: save and load"): exactly
one image, named only as the reference the taker asked for (in each place a loader reads names
from), whose config has the expected digest (the image ID of podman and docker's classic store;
its ``rootfs.diff_ids`` name the layers, which both loaders verify as they load them).

Runs on the hosts, in the image fetcher's bundle (image_fetch.py imports it).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import tarfile
from typing import Any

# pdctl checks every reference against the OCI grammar (pdctl/core/validate.py) before it sends it;
# this guard only makes sure an argv element can never read as an option or hold a space.
_IMAGE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@\[\]-]{0,511}\Z")
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})\Z")
METADATA_MAX = 16 << 20  # bytes of manifest.json, index.json, repositories or a config
_MANIFEST_TYPES = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}


def check_image_ref(ref: Any) -> str:
    if not isinstance(ref, str) or not _IMAGE_REF.match(ref):
        raise ValueError(f"{ref!r} is not an image reference")
    return ref


# ---------------------------------------------------------------- names as the loaders read them
def _name_and_tag(ref: str) -> tuple[str, str]:
    check_image_ref(ref)
    if "@" in ref:
        raise ValueError(f"{ref!r}: a name with a digest is not a tag a load applies")
    head, _, last = ref.rpartition("/")
    if ":" in last:
        last, _, tag = last.partition(":")
        return (f"{head}/{last}" if head else last), tag
    return ref, "latest"


def _has_registry(name: str) -> bool:
    first, slash, _ = name.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def docker_name(ref: str) -> str:
    """The name docker gives a tag (distribution/reference ParseNormalizedNamed): docker.io
    for a name without a registry, library/ for an official image, :latest without a tag."""
    name, tag = _name_and_tag(ref)
    if not _has_registry(name):
        name = f"docker.io/{name}"
    registry, _, path = name.partition("/")
    if registry in {"docker.io", "index.docker.io"}:
        registry = "docker.io"
        path = path if "/" in path else f"library/{path}"
    return f"{registry}/{path}:{tag}"


def podman_name(ref: str) -> str:
    """The name podman gives a tag it loads (containers/common libimage NormalizeName): a name
    without a registry goes under localhost/, then docker's rules."""
    name, tag = _name_and_tag(ref)
    return docker_name(f"{name}:{tag}" if _has_registry(name) else f"localhost/{name}:{tag}")


def applied_name(tag: str, runtime: str) -> str:
    return podman_name(tag) if runtime == "podman" else docker_name(tag)


def ref_names(ref: str) -> set[str]:
    """The names a load may give the image of ``ref`` and nothing else: its docker name, and
    podman's localhost/ name of a reference without a registry (podman finds both by ref)."""
    return {docker_name(ref), podman_name(ref)}


# ---------------------------------------------------------------- the archive
def _member_name(raw: str) -> str:
    name = posixpath.normpath(raw.lstrip("/")) if raw.strip("/") else "."
    if name == ".." or name.startswith("../"):
        raise ValueError(f"the archive holds a path outside itself ({raw!r})")
    return name


class _Archive:
    """An archive's members by the name a loader resolves (``./a`` and ``a`` are one)."""

    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.members: dict[str, tarfile.TarInfo] = {}
        for member in tar.getmembers():
            name = _member_name(member.name)
            if name in self.members and not member.isdir():
                raise ValueError(f"the archive holds {name} twice (a loader would read the other)")
            self.members[name] = member

    def read(self, name: str) -> bytes:
        member = self.members.get(_member_name(name))
        if member is None:
            raise ValueError(f"the archive lacks {name}")
        if not member.isfile() or member.size > METADATA_MAX:
            raise ValueError(f"the archive's {name} is not a plain file of at most 16 MiB")
        file = self.tar.extractfile(member)
        if file is None:
            raise ValueError(f"the archive's {name} cannot be read")
        return file.read()

    def json(self, name: str) -> Any:
        try:
            return json.loads(self.read(name))
        except ValueError as exc:
            raise ValueError(f"the archive's {name} is not JSON: {exc}") from None


def _object(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ValueError(f"the archive's {what} is not a JSON object")
    return doc


def _check_names(names: list[Any], where: str, ref: str, runtime: str) -> None:
    allowed = ref_names(ref)
    for name in names:
        try:
            applied = applied_name(name, runtime) if isinstance(name, str) else None
        except ValueError:
            applied = None
        if applied not in allowed:
            raise ValueError(
                f"the archive's {where} also names {name!r}: its load would move that name "
                f"(only {ref} may be named)"
            )


def _docker_view(archive: _Archive, ref: str, expected: str, runtime: str) -> list[str]:
    """manifest.json, as docker load and podman's docker-archive reader take it: the one
    image's config (its digest checked) and its layers' diff IDs."""
    manifest = archive.json("manifest.json")
    if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
        count = len(manifest) if isinstance(manifest, list) else "no list of"
        raise ValueError(f"the archive holds {count} images, not exactly one")
    entry = manifest[0]
    config = archive.read(str(entry.get("Config")))
    digest = hashlib.sha256(config).hexdigest()
    if digest != expected:
        raise ValueError(f"the archive holds image {digest[:12]}, not the expected {expected[:12]}")
    tags = entry.get("RepoTags")
    if not isinstance(tags, list) or not tags:
        raise ValueError(f"the archive's image is not named {ref}")
    _check_names(tags, "manifest.json", ref, runtime)
    rootfs = _object(config, "image config").get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    layers = entry.get("Layers")
    if not isinstance(diff_ids, list) or not isinstance(layers, list):
        raise ValueError("the archive's image lists no layers")
    if len(diff_ids) != len(layers):
        raise ValueError("the archive's image has another count of layers than its config")
    return [str(d) for d in diff_ids]


def _oci_view(archive: _Archive, ref: str, expected: str, runtime: str) -> None:
    """index.json, which podman's load tries before manifest.json (an OCI archive) and docker's
    containerd store reads: the same one image, by the same config, named the same."""
    index = archive.json("index.json")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or len(manifests) != 1 or not isinstance(manifests[0], dict):
        raise ValueError("the archive's index.json lists other than exactly one image")
    descriptor = manifests[0]
    if descriptor.get("mediaType") not in _MANIFEST_TYPES:
        raise ValueError(
            f"the archive's index.json names a {descriptor.get('mediaType')!r}, not one image"
        )
    found = _DIGEST.match(str(descriptor.get("digest")))
    if found is None:
        raise ValueError("the archive's index.json names its image by no sha256 digest")
    blob = archive.read(f"blobs/sha256/{found.group(1)}")
    if hashlib.sha256(blob).hexdigest() != found.group(1):
        raise ValueError("the archive's image manifest does not match its digest")
    described = _object(blob, "image manifest").get("config")
    config = described.get("digest") if isinstance(described, dict) else None
    if config != f"sha256:{expected}":
        raise ValueError(
            f"the archive's index.json names image {str(config)[7:19]}, "
            f"not the expected {expected[:12]}"
        )
    notes = descriptor.get("annotations")
    notes = notes if isinstance(notes, dict) else {}
    ref_name = notes.get("org.opencontainers.image.ref.name")
    full = notes.get("io.containerd.image.name")
    if runtime == "docker":
        names = [full] if full else []
        # docker's own saves put only the tag here, beside the full name
        if ref_name and not (full and ref_name == _name_and_tag(ref)[1]):
            names.append(ref_name)
    else:
        names = [ref_name] if ref_name else []
    _check_names(names, "index.json", ref, runtime)


def _legacy_view(archive: _Archive, ref: str, runtime: str) -> None:
    """repositories ({repo: {tag: layer}}), which docker load reads from older archives."""
    repos = archive.json("repositories")
    if not isinstance(repos, dict):
        raise ValueError("the archive's repositories file is not a mapping")
    names = []
    for repo, tags in repos.items():
        if not isinstance(tags, dict):
            raise ValueError("the archive's repositories file is not {repo: {tag: id}}")
        names += [f"{repo}:{tag}" for tag in tags]
    _check_names(names, "repositories file", ref, runtime)


def inspect_archive(path: str, ref: str, expected: str, runtime: str) -> list[str]:
    """Check the archive at ``path`` before ``runtime`` loads it as ``ref`` (the image whose
    config digest is ``expected``, 64 hex digits): its layers' diff IDs, or ValueError with
    what the archive would have done."""
    try:
        with tarfile.open(path, "r:") as tar:
            archive = _Archive(tar)
            diff_ids = _docker_view(archive, ref, expected, runtime)
            if "index.json" in archive.members:
                _oci_view(archive, ref, expected, runtime)
            if "repositories" in archive.members:
                _legacy_view(archive, ref, runtime)
            return diff_ids
    except (tarfile.TarError, EOFError) as exc:
        raise ValueError(f"the archive is not a tar archive: {exc}") from None
