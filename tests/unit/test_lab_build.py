"""The lab's build steps that need no root: mirror discovery, recipe, worker image archive."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest

from pdctl.lab import image, rootfs

WORKER_SRC = Path(__file__).resolve().parents[2] / "pdctl/lab/worker/sglang"


def test_mirror_from_deb822_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
    )
    assert rootfs.apt_mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_from_one_line_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://ftp.example/debian bookworm main\n"
    )
    assert rootfs.apt_mirror(tmp_path) == "http://ftp.example/debian"


def test_mirror_falls_back_to_debian(tmp_path: Path) -> None:
    assert rootfs.apt_mirror(tmp_path) == "http://deb.debian.org/debian"


def test_recipe_hash_follows_the_package_list(monkeypatch: pytest.MonkeyPatch) -> None:
    first = rootfs.recipe_hash()
    assert first == rootfs.recipe_hash()
    monkeypatch.setattr(rootfs, "PACKAGES", (*rootfs.PACKAGES, "curl"))
    assert rootfs.recipe_hash() != first


def _fake_rootfs(root: Path) -> Path:
    """A rootfs with a dpkg database, merged /usr and a few files of python3's closure."""
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/python3.11/test").mkdir(parents=True)
    for top in ("bin", "lib"):
        (root / top).symlink_to(f"usr/{top}")
    (root / "usr/bin/python3.11").write_bytes(b"\x7fELF python")
    (root / "usr/bin/python3").symlink_to("python3.11")
    (root / "usr/bin/dash").write_bytes(b"\x7fELF dash")
    (root / "usr/bin/sh").symlink_to("dash")
    (root / "usr/lib/x86_64-linux-gnu/libc.so.6").write_bytes(b"\x7fELF libc")
    (root / "usr/lib/python3.11/os.py").write_text("# os\n")
    (root / "usr/lib/python3.11/test/big.py").write_text("# skipped\n")
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text(
        "Package: python3-minimal\nPre-Depends: python3.11-minimal (>= 3.11.2-1~)\n\n"
        "Package: python3.11-minimal\nDepends: libc6 (>= 2.34), dpkg | other\n\n"
        "Package: libpython3.11-stdlib\nDepends: libc6\n\n"
        "Package: dash\nPre-Depends: libc6:any\n\n"
        "Package: coreutils\n\n"
        "Package: libc6\n\nPackage: dpkg\nDepends: tar\n\nPackage: tar\n"
    )
    (info / "python3-minimal.list").write_text("/usr/bin/python3\n")
    (info / "python3.11-minimal.list").write_text("/usr/bin\n/usr/bin/python3.11\n")
    (info / "libpython3.11-stdlib:amd64.list").write_text(
        "/usr/lib/python3.11/os.py\n/usr/lib/python3.11/test/big.py\n"
    )
    (info / "dash.list").write_text("/bin/dash\n/bin/sh\n")
    (info / "libc6:amd64.list").write_text(
        "/lib/x86_64-linux-gnu/libc.so.6\n/usr/share/doc/libc6\n"
    )
    (info / "dpkg.list").write_text("/usr/bin/dpkg\n")
    return root


def test_worker_image_archive_is_a_loadable_docker_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDCTL_CACHE", str(tmp_path / "cache"))
    archive = image.ensure_image(_fake_rootfs(tmp_path / "rootfs"), WORKER_SRC)
    assert image.ensure_image(tmp_path / "rootfs", WORKER_SRC) == archive  # cached
    with tarfile.open(archive) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert manifest[0]["RepoTags"] == [f"{image.REPOSITORY}:{t}" for t in image.TAGS]
        config = json.load(outer.extractfile(manifest[0]["Config"]))  # type: ignore[arg-type]
        layer_bytes = outer.extractfile(manifest[0]["Layers"][0]).read()  # type: ignore[union-attr]
    assert config["rootfs"]["diff_ids"] == [f"sha256:{hashlib.sha256(layer_bytes).hexdigest()}"]
    layer_path = tmp_path / "layer.tar"
    layer_path.write_bytes(layer_bytes)
    with tarfile.open(layer_path) as layer:
        names = layer.getnames()
        members = {m.name: m for m in layer.getmembers()}
    assert len(names) == len(set(names)), "a layer with duplicate paths is refused by podman"
    assert members["lib"].issym() and members["lib"].linkname == "usr/lib"
    assert "usr/lib/x86_64-linux-gnu/libc.so.6" in names  # /lib path stored under /usr
    assert "usr/lib/python3.11/os.py" in names
    assert "usr/lib/python3.11/test/big.py" not in names  # the stdlib's tests are left out
    assert "usr/bin/dpkg" not in names  # package machinery is left out
    assert members["usr/bin/python"].linkname == "python3.11"
    assert "usr/lib/python3/dist-packages/sglang/launch_server.py" in names
    assert "usr/lib/python3/dist-packages/model_cache.py" in names  # the stand-ins' common code
    assert "video:x:44:" in layer_bytes.decode("latin-1")  # --group-add video needs the group
