"""A stand-in for podman's (or docker's) image commands, for the image fan-out's tests: this
machine has no container runtime (the lab tests run the real podman).

It keeps images in a directory (``STAND_IN_STORE``: ``names.json`` name -> ID, ``images/ID``
the config, ``layers/DIFF`` each layer) and speaks the commands pdctl/onhost/image_fetch.py runs as
the real ones do (docs/facts.md, "Container images: save and load"): ``image exists``,
``image inspect`` (a JSON array: Id, RootFS.Layers, Size), ``save`` (a docker-archive on
stdout: manifest.json, the config as ID.json, each layer as DIFF.tar), ``load`` (from stdin or
``--input``: every layer checked against the config's diff_ids, as containers/image and docker
do; the ID is the config's digest; every RepoTag applied, named as the runtime names it:
podman puts a name without a registry under localhost/), ``tag``, ``rmi``, ``pull`` (no
registry: it fails).

What a compromised host's runtime would do instead, by environment: ``STAND_IN_RUNTIME``
(podman | docker: how names are normalized), ``STAND_IN_REBUILD`` (a load keeps the image
under another ID), ``STAND_IN_SAVE_TAGS`` (more RepoTags in what it saves, comma-separated),
``STAND_IN_SAVE_ENTRYPOINT`` (it saves its image with another Entrypoint, the same layers,
while inspect still says the ID it holds), ``STAND_IN_SAVE_SECOND`` (a second image, under
that name, in the archive).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Any


def normalized(name: str, runtime: str = "podman") -> str:
    """A name as the runtime stores it (libimage NormalizeName; docker's ParseNormalizedNamed)."""
    head, _, last = name.rpartition("/")
    tag = "latest"
    if ":" in last:
        last, _, tag = last.partition(":")
    path = f"{head}/{last}" if head else last
    first, slash, _ = path.partition("/")
    if not (slash and ("." in first or ":" in first or first == "localhost")):
        path = f"localhost/{path}" if runtime == "podman" else f"docker.io/{path}"
    registry, _, rest = path.partition("/")
    if registry == "docker.io" and "/" not in rest:
        rest = f"library/{rest}"
    return f"{registry}/{rest}:{tag}"


def config_of(layers: list[bytes], entrypoint: str = "/serve") -> bytes:
    diff_ids = [f"sha256:{hashlib.sha256(layer).hexdigest()}" for layer in layers]
    doc = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [entrypoint]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    return json.dumps(doc, sort_keys=True).encode()


class Store:
    def __init__(self, root: Path, runtime: str = "podman") -> None:
        self.root, self.runtime = root, runtime
        for sub in ("images", "layers"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def names(self) -> dict[str, str]:
        path = self.root / "names.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _save_names(self, names: dict[str, str]) -> None:
        (self.root / "names.json").write_text(json.dumps(names))

    def name(self, name: str, image: str | None) -> None:
        names = self.names
        if image is None:
            names.pop(normalized(name, self.runtime), None)
        else:
            names[normalized(name, self.runtime)] = image
        self._save_names(names)

    def find(self, name: str) -> str | None:
        names = self.names
        if name in names.values():
            return name
        return names.get(normalized(name, self.runtime))

    def add(self, config: bytes, layers: dict[str, bytes]) -> str:
        image = hashlib.sha256(config).hexdigest()
        (self.root / "images" / image).write_bytes(config)
        for diff, data in layers.items():
            (self.root / "layers" / diff).write_bytes(data)
        return image

    def config(self, image: str) -> dict[str, Any]:
        return dict(json.loads((self.root / "images" / image).read_bytes()))

    def diff_ids(self, image: str) -> list[str]:
        return [str(d) for d in self.config(image)["rootfs"]["diff_ids"]]

    def layer(self, diff_id: str) -> bytes:
        return (self.root / "layers" / diff_id.split(":")[1]).read_bytes()


def give(root: Path, ref: str, layers: list[bytes], entrypoint: str = "/serve") -> str:
    """Put an image named ``ref`` in the store at ``root``: its ID."""
    store = Store(root)
    config = config_of(layers, entrypoint)
    image = store.add(config, {hashlib.sha256(layer).hexdigest(): layer for layer in layers})
    store.name(ref, image)
    return image


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _save(store: Store, name: str) -> int:
    image = store.find(name)
    if image is None:
        print(f"Error: {name}: image not known", file=sys.stderr)
        return 125
    layers = [store.layer(d) for d in store.diff_ids(image)]
    config = (store.root / "images" / image).read_bytes()
    entrypoint = os.environ.get("STAND_IN_SAVE_ENTRYPOINT")
    if entrypoint:
        config = config_of(layers, entrypoint)
    extra = [t for t in os.environ.get("STAND_IN_SAVE_TAGS", "").split(",") if t]
    entries = [(config, [normalized(name, store.runtime), *extra], layers)]
    second = os.environ.get("STAND_IN_SAVE_SECOND")
    if second:
        entries.append((config_of([b"second"]), [second], [b"second"]))
    manifest = []
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        for config_bytes, tags, data in entries:
            digest = hashlib.sha256(config_bytes).hexdigest()
            _member(tar, f"{digest}.json", config_bytes)
            names = []
            for layer in data:
                names.append(f"{hashlib.sha256(layer).hexdigest()}.tar")
                _member(tar, names[-1], layer)
            manifest.append({"Config": f"{digest}.json", "RepoTags": tags, "Layers": names})
        _member(tar, "manifest.json", json.dumps(manifest).encode())
    return 0


def _load(store: Store, argv: list[str]) -> int:
    source = argv[argv.index("--input") + 1] if "--input" in argv else None
    mode = {"name": source, "mode": "r:"} if source else {"fileobj": sys.stdin.buffer, "mode": "r|"}
    files: dict[str, bytes] = {}
    with tarfile.open(**mode) as tar:  # type: ignore[call-overload]
        for member in tar:
            file = tar.extractfile(member) if member.isfile() else None
            if file is not None:
                files[member.name.removeprefix("./")] = file.read()
    if "manifest.json" not in files:
        print("Error: payload does not match any of the supported image formats", file=sys.stderr)
        return 125
    for entry in json.loads(files["manifest.json"]):
        config = files[entry["Config"]]
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        layers = {}
        for diff, path in zip(diff_ids, entry["Layers"], strict=True):
            got = hashlib.sha256(files[path]).hexdigest()
            if f"sha256:{got}" != diff:
                print(
                    f"Error: Digest did not match, expected {diff}, got sha256:{got}",
                    file=sys.stderr,
                )
                return 125
            layers[got] = files[path]
        if os.environ.get("STAND_IN_REBUILD"):  # another image under the same name
            config = config_of(list(layers.values()), "/rebuilt")
        image = store.add(config, layers)
        for tag in entry.get("RepoTags") or []:
            store.name(tag, image)
    return 0


def main(argv: list[str]) -> int:
    store = Store(Path(os.environ["STAND_IN_STORE"]), os.environ.get("STAND_IN_RUNTIME", "podman"))
    args = [a for a in argv if a not in ("--quiet", "--format", "docker-archive")]
    if args[:2] == ["image", "exists"]:
        return 0 if store.find(args[2]) else 1
    if args[:2] == ["image", "inspect"]:
        image = store.find(args[2])
        if image is None:
            print(f"Error: {args[2]}: image not known", file=sys.stderr)
            return 1 if store.runtime == "docker" else 125
        diffs = store.diff_ids(image)
        size = sum(len(store.layer(d)) for d in diffs)
        shown = image if store.runtime == "podman" else f"sha256:{image}"
        print(json.dumps([{"Id": shown, "RootFS": {"Layers": diffs}, "Size": size}]))
        return 0
    if args[0] == "save":
        return _save(store, args[1])
    if args[0] == "load":
        return _load(store, args)
    if args[0] == "tag":
        store.name(args[2], args[1].removeprefix("sha256:"))
        return 0
    if args[0] == "rmi":
        store.name(args[1], None)
        return 0
    if args[0] == "pull":
        print(f"Error: initializing source docker://{args[1]}: connection refused", file=sys.stderr)
        return 125
    print("unknown: " + " ".join(argv), file=sys.stderr)
    return 125


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
