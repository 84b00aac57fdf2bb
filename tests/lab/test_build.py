"""The lab's build steps that need no root: mirror discovery, recipe, worker image archive."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from pdctl.core.versions import GRPC_STANDIN_PACKAGES
from pdctl.lab import image, rootfs, worker_tree


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


def test_a_rootfs_a_running_lab_boots_on_is_in_use(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "27 1 0:26 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
        "54 27 0:106 / /ws/.pdctl/lab/hosts/node1/root rw,relatime - overlay overlay "
        "rw,lowerdir=/var/cache/pdctl/rootfs/aaaa:/extra,upperdir=/ws/u,workdir=/ws/w,uuid=on\n"
    )
    assert rootfs._mounted_lowerdirs(mountinfo) == {"/var/cache/pdctl/rootfs/aaaa", "/extra"}


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


def _fake_wheelhouse(root: Path) -> Path:
    """One wheel per package the images take, with pip's layout details in them."""
    root.mkdir()
    for name, version in GRPC_STANDIN_PACKAGES.items():
        module = name.replace("-", "_")
        with zipfile.ZipFile(root / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", f"# {name}\n")
            wheel.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {name}\n")
            wheel.writestr(f"{module}-{version}.data/purelib/{module}_extra.py", "# extra\n")
            wheel.writestr(f"{module}-{version}.data/scripts/{module}-tool", "#!/bin/sh\n")
    (root / "smg-1.13.0-cp38-abi3-manylinux_2_17_x86_64.whl").write_bytes(b"not taken")
    return root


def _layer(
    tmp_path: Path, archive: Path, spec: image.WorkerImage
) -> tuple[list[bytes], dict[str, tarfile.TarInfo]]:
    """The archive's layers (checked against its manifest and config): their bytes and every
    layer's members."""
    with tarfile.open(archive) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert manifest[0]["RepoTags"] == [f"{spec.repository}:{t}" for t in spec.tags]
        config = json.load(outer.extractfile(manifest[0]["Config"]))  # type: ignore[arg-type]
        layers = [outer.extractfile(name).read() for name in manifest[0]["Layers"]]  # type: ignore[union-attr]
    assert config["rootfs"]["diff_ids"] == [
        f"sha256:{hashlib.sha256(layer).hexdigest()}" for layer in layers
    ]
    assert len(config["history"]) == len(layers) == 3  # python3, the stand-ins, the engine
    assert config["config"]["Cmd"] == list(spec.cmd)
    members: dict[str, tarfile.TarInfo] = {}
    for index, layer_bytes in enumerate(layers):
        with tarfile.open(fileobj=io.BytesIO(layer_bytes)) as layer:
            names = layer.getnames()
            assert len(names) == len(set(names)), "podman refuses a layer with duplicate paths"
            members |= {m.name: m for m in layer.getmembers() if not m.isdir() or index == 0}
    return layers, members


def test_worker_image_archives_are_loadable_docker_archives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDCTL_CACHE", str(tmp_path / "cache"))
    wheels = _fake_wheelhouse(tmp_path / "wheels")
    folder = image.ensure_images(_fake_rootfs(tmp_path / "rootfs"), wheels)
    assert image.ensure_images(tmp_path / "rootfs", wheels) == folder  # cached
    assert sorted(p.name for p in folder.iterdir()) == sorted(s.archive_name for s in image.IMAGES)
    layers, members = _layer(tmp_path, folder / image.SGLANG.archive_name, image.SGLANG)
    vllm_layers, _ = _layer(tmp_path, folder / image.VLLM.archive_name, image.VLLM)
    # python3 and the stand-ins are one layer each: a host loads them once for both images.
    assert vllm_layers[:2] == layers[:2] and vllm_layers[2] != layers[2]
    layer_bytes = layers[0]
    names = set(members)
    assert members["lib"].issym() and members["lib"].linkname == "usr/lib"
    assert "usr/lib/x86_64-linux-gnu/libc.so.6" in names  # /lib path stored under /usr
    assert "usr/lib/python3.11/os.py" in names
    assert "usr/lib/python3.11/test/big.py" not in names  # the stdlib's tests are left out
    assert "usr/bin/dpkg" not in names  # package machinery is left out
    assert members["usr/bin/python"].linkname == "python3.11"
    assert "usr/lib/python3/dist-packages/sglang/launch_server.py" in names  # the entry point
    assert "usr/lib/python3/dist-packages/pdlab_worker/common/capacity.py" in names
    assert "usr/lib/python3/dist-packages/pdlab_worker/model_cache.py" in names
    assert "usr/lib/python3/dist-packages/smg_grpc_proto/__init__.py" in names  # --grpc-mode
    assert "usr/lib/python3/dist-packages/pdlab_worker/sglang/grpc_server.py" in names
    assert "video:x:44:" in layer_bytes.decode("latin-1")  # --group-add video needs the group


def test_each_image_holds_its_entry_points_and_the_unpacked_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDCTL_CACHE", str(tmp_path / "cache"))
    folder = image.ensure_images(
        _fake_rootfs(tmp_path / "rootfs"), _fake_wheelhouse(tmp_path / "w")
    )
    _, members = _layer(tmp_path, folder / image.VLLM.archive_name, image.VLLM)
    _, sglang = _layer(tmp_path, folder / image.SGLANG.archive_name, image.SGLANG)
    site = "usr/lib/python3/dist-packages"
    assert members["usr/bin/vllm"].mode == 0o755
    assert f"{site}/vllm/entrypoints/grpc_server.py" in members
    assert f"{site}/pdlab_worker/vllm/server.py" in members
    assert f"{site}/sglang/launch_server.py" not in members  # SGLang's entry point is not here
    assert f"{site}/vllm/__init__.py" not in sglang and "usr/bin/vllm" not in sglang
    for name in GRPC_STANDIN_PACKAGES:
        module = name.replace("-", "_")
        for image_members in (members, sglang):
            assert f"{site}/{module}/__init__.py" in image_members
            assert f"{site}/{module}_extra.py" in image_members  # .data/purelib: site-packages
            assert not any(f"{module}-tool" in m for m in image_members)  # no scripts
            assert any(
                m.startswith(f"{site}/{module}-") and m.endswith("/METADATA") for m in image_members
            )


def _wheel(folder: Path, name: str, *requires: str) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        lines = [f"Name: {name}", *(f"Requires-Dist: {r}" for r in requires)]
        wheel.writestr(f"{name}-1.0.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_image_wheels_are_the_packages_and_what_they_require(tmp_path: Path) -> None:
    grpcio = _wheel(
        tmp_path,
        "grpcio",
        "typing-extensions~=4.12",
        "grpcio-tools>=1.85 ; extra == 'protobuf'",  # an extra: not installed
        "futures ; python_version < '3.2'",  # a marker pip did not meet: not in the wheelhouse
    )
    with pytest.raises(FileNotFoundError, match="no wheel of smg-grpc-proto, typing-extensions"):
        worker_tree.wheels_for(tmp_path, ["grpcio", "smg_grpc_proto"])
    typing = _wheel(tmp_path, "typing_extensions")
    _wheel(tmp_path, "unrelated")
    assert worker_tree.wheels_for(tmp_path, ["GRPCIO"]) == [grpcio, typing]


def test_smg_grpc_proto_pins_agree() -> None:
    """The venv's smg-grpc-proto (the tests' stand-in) is the image's (versions.py)."""
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    pin = GRPC_STANDIN_PACKAGES["smg-grpc-proto"]
    assert f'"smg-grpc-proto=={pin}"' in pyproject


@pytest.mark.skipif(
    sys.version_info[:2] != image.IMAGE_PYTHON, reason="bytecode is made by the image's Python"
)
def test_each_module_goes_in_with_the_bytecode_its_python_loads_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker container starts from the image each time: bytecode it compiled is never kept,
    so the image carries it, and Python takes it without reading the source."""
    monkeypatch.setenv("PDCTL_CACHE", str(tmp_path / "cache"))
    folder = image.ensure_images(
        _fake_rootfs(tmp_path / "rootfs"), _fake_wheelhouse(tmp_path / "w")
    )
    layers, members = _layer(tmp_path, folder / image.SGLANG.archive_name, image.SGLANG)
    assert "usr/lib/python3.11/__pycache__/os.cpython-311.pyc" in members
    site = "usr/lib/python3/dist-packages"
    module = next(iter(GRPC_STANDIN_PACKAGES)).replace("-", "_") + "_extra"
    source, compiled = f"{site}/{module}.py", f"{site}/__pycache__/{module}.cpython-311.pyc"
    with tarfile.open(fileobj=io.BytesIO(layers[1])) as layer:
        layer.extractall(
            tmp_path / "image", members=[layer.getmember(source), layer.getmember(compiled)]
        )
    run = subprocess.run(
        [sys.executable, "-v", "-c", f"import {module}"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "image" / site), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"code object from '{tmp_path / 'image' / compiled}'" in run.stderr


def test_image_caches_no_lab_used_for_a_day_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDCTL_CACHE", str(tmp_path / "cache"))
    images = tmp_path / "cache" / "images"
    day = image.UNUSED_IMAGES_KEPT
    ages = {"old": day + 60, "recent": day - 60, "tmpabc": day * 2}  # tmp*: a build cut short
    for name, age in ages.items():
        (images / name).mkdir(parents=True)
        (images / name / "sglang-rocm-lab.tar").write_bytes(b"x")
        stamp = time.time() - age
        os.utime(images / name, (stamp, stamp))
    wheels = _fake_wheelhouse(tmp_path / "wheels")
    folder = image.ensure_images(_fake_rootfs(tmp_path / "rootfs"), wheels)
    assert sorted(p.name for p in images.iterdir()) == sorted([folder.name, "recent"])
    # the current one is kept however old, and using it makes it recent again
    os.utime(folder, (0, 0))
    assert image.ensure_images(tmp_path / "rootfs", wheels) == folder
    assert folder.stat().st_mtime > time.time() - 60
    assert image.prune_images(images, folder, time.time() + 2 * day) == [images / "recent"]
