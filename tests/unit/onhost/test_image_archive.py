"""What a peer's image archive would do to a taker's runtime, read before any load
(pdctl/onhost/image_archive.py): the archives a real save writes pass; every way an archive can name
another image, hold a second one, or have one loader read other bytes than the check read is
refused, with what it would have done."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost.image_archive import docker_name, inspect_archive, podman_name, ref_names

REF = "lmsysorg/sglang:v0.5.5"
LAYER = b"layer bytes"
DIFF = f"sha256:{hashlib.sha256(LAYER).hexdigest()}"
CONFIG = json.dumps({"rootfs": {"type": "layers", "diff_ids": [DIFF]}}).encode()
ID = hashlib.sha256(CONFIG).hexdigest()
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", link: str | None = None) -> None:
    info = tarfile.TarInfo(name)
    if link is not None:
        info.type, info.linkname = tarfile.SYMTYPE, link
        tar.addfile(info)
        return
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def archive(
    tmp_path: Path,
    tags: list[str] | None = None,
    *,
    entries: list[dict[str, Any]] | None = None,
    extra: list[tuple[str, bytes]] = (),  # type: ignore[assignment]
    links: list[tuple[str, str]] = (),  # type: ignore[assignment]
    config: bytes = CONFIG,
    skip_manifest: bool = False,
) -> str:
    """A docker-archive as podman's save writes it (config, layer, manifest.json), changed."""
    digest = hashlib.sha256(config).hexdigest()
    path = tmp_path / "image.tar"
    with tarfile.open(path, "w") as tar:
        _add(tar, f"{digest}.json", config)
        _add(tar, f"{DIFF[7:]}.tar", LAYER)
        for name, target in links:
            _add(tar, name, link=target)
        if not skip_manifest:
            manifest = entries or [
                {
                    "Config": f"{digest}.json",
                    "RepoTags": tags if tags is not None else [f"docker.io/{REF}"],
                    "Layers": [f"{DIFF[7:]}.tar"],
                }
            ]
            _add(tar, "manifest.json", json.dumps(manifest).encode())
        for name, data in extra:
            _add(tar, name, data)
    return str(path)


def oci(
    config_digest: str = ID, names: dict[str, str] | None = None, count: int = 1
) -> list[tuple[str, bytes]]:
    """index.json and its image manifest, as docker's save (containerd store) adds them."""
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"digest": f"sha256:{config_digest}"},
            "layers": [],
        }
    ).encode()
    digest = hashlib.sha256(manifest).hexdigest()
    descriptor = {
        "mediaType": OCI_MANIFEST,
        "digest": f"sha256:{digest}",
        "size": len(manifest),
        "annotations": names
        if names is not None
        else {
            "io.containerd.image.name": f"docker.io/{REF}",
            "org.opencontainers.image.ref.name": "v0.5.5",
        },
    }
    index = {"schemaVersion": 2, "manifests": [descriptor] * count}
    return [("index.json", json.dumps(index).encode()), (f"blobs/sha256/{digest}", manifest)]


def refused(path: str, runtime: str = "podman", ref: str = REF, expected: str = ID) -> str:
    with pytest.raises(ValueError, match="the archive") as raised:
        inspect_archive(path, ref, expected, runtime)
    return str(raised.value)


def test_names_as_each_runtime_gives_them() -> None:
    assert docker_name("ubuntu") == "docker.io/library/ubuntu:latest"
    assert docker_name(REF) == "docker.io/lmsysorg/sglang:v0.5.5"
    assert podman_name(REF) == "localhost/lmsysorg/sglang:v0.5.5"  # docker's save, podman's load
    assert podman_name("docker.io/ubuntu:22.04") == "docker.io/library/ubuntu:22.04"
    assert podman_name("localhost:5000/a/b") == "localhost:5000/a/b:latest"
    assert ref_names("localhost/pdctl-lab/x:1") == {"localhost/pdctl-lab/x:1"}


@pytest.mark.parametrize("runtime", ["podman", "docker"])
@pytest.mark.parametrize("tag", [f"docker.io/{REF}", REF, f"localhost/{REF}"])
def test_an_archive_of_the_one_expected_image_named_as_the_reference_passes(
    tmp_path: Path, runtime: str, tag: str
) -> None:
    repositories = json.dumps({"docker.io/lmsysorg/sglang": {"v0.5.5": "x"}}).encode()
    path = archive(tmp_path, [tag], extra=[("repositories", repositories)])
    assert inspect_archive(path, REF, ID, runtime) == [DIFF]


def test_a_docker_save_with_its_oci_index_passes_into_docker(tmp_path: Path) -> None:
    path = archive(tmp_path, [REF], extra=[*oci(), ("oci-layout", b"{}")])
    assert inspect_archive(path, REF, ID, "docker") == [DIFF]
    # podman reads index.json first and would name it localhost/v0.5.5:latest
    assert "also names 'v0.5.5'" in refused(path, "podman")


def test_another_image_is_refused_by_its_config_digest(tmp_path: Path) -> None:
    evil = json.dumps({"config": {"Entrypoint": ["/evil"]}, "rootfs": {"diff_ids": [DIFF]}})
    message = refused(archive(tmp_path, config=evil.encode()))
    assert f"not the expected {ID[:12]}" in message


@pytest.mark.parametrize(
    "tags",
    [
        [f"docker.io/{REF}", "docker.io/library/debian:12"],
        ["lmsysorg/sglang:v0.5.6"],
        ["localhost/pdctl-lab/router:1"],
        [f"docker.io/{REF}@sha256:{'0' * 64}"],
        [f"docker.io/{REF} --rm"],
        [7],
    ],
)
def test_a_name_of_another_image_is_refused_before_the_load_moves_it(
    tmp_path: Path, tags: list[Any]
) -> None:
    assert "its load would move that name" in refused(archive(tmp_path, tags))


def test_an_unnamed_image_is_refused(tmp_path: Path) -> None:
    assert f"not named {REF}" in refused(archive(tmp_path, []))


def test_two_images_in_one_archive_are_refused(tmp_path: Path) -> None:
    entry = {"Config": f"{ID}.json", "RepoTags": [REF], "Layers": [f"{DIFF[7:]}.tar"]}
    assert "holds 2 images" in refused(archive(tmp_path, entries=[entry, entry]))


def test_a_second_manifest_a_loader_would_read_instead_is_refused(tmp_path: Path) -> None:
    other = [{"Config": f"{ID}.json", "RepoTags": ["docker.io/library/debian:12"], "Layers": []}]
    path = archive(tmp_path, extra=[("./manifest.json", json.dumps(other).encode())])
    assert "holds manifest.json twice" in refused(path)


def test_metadata_that_is_a_link_or_outside_the_archive_is_refused(tmp_path: Path) -> None:
    linked = archive(tmp_path, skip_manifest=True, links=[("manifest.json", "/etc/passwd")])
    assert "not a plain file" in refused(linked)
    (tmp_path / "image.tar").unlink()
    escaping = archive(tmp_path, extra=[("../../etc/cron.d/x", b"* * * * * root id")])
    assert "a path outside itself" in refused(escaping)


def test_legacy_repositories_naming_another_image_are_refused(tmp_path: Path) -> None:
    repositories = json.dumps({"docker.io/library/debian": {"12": "x"}}).encode()
    path = archive(tmp_path, extra=[("repositories", repositories)])
    assert "repositories file also names 'docker.io/library/debian:12'" in refused(path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (oci(config_digest="f" * 64), "index.json names image ffffffffffff"),  # podman loads it
        (oci(count=2), "lists other than exactly one image"),
        (oci(names={"io.containerd.image.name": "docker.io/library/debian:12"}), "also names"),
        ([("index.json", b"{")], "not JSON"),
    ],
)
def test_an_oci_index_that_says_otherwise_than_manifest_json_is_refused(
    tmp_path: Path, extra: list[tuple[str, bytes]], message: str
) -> None:
    assert message in refused(archive(tmp_path, extra=extra), "docker")


def test_what_is_not_a_tar_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "image.tar"
    path.write_bytes(b"<html>not an archive</html>")
    assert "not a tar archive" in refused(str(path))
