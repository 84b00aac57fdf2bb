"""The Python files of a lab worker image: the stand-ins, their entry points, their wheels.

The stand-ins (pdctl/lab/worker) are installed as the package ``pdlab_worker``; thin entry
points carry the real engines' spellings (``python3 -m sglang.launch_server``, ``vllm serve``,
``python3 -m vllm.entrypoints.grpc_server``), so pdctl's units run unchanged command lines.
The gRPC stand-ins' third-party packages (grpcio, protobuf, smg-grpc-proto: vLLM's, and
SGLang's in --grpc-mode) are unpacked from the wheelhouse's wheels, as ``pip install`` would lay
them out (no pip in the image). The stand-ins and those packages are the same in every image
(:func:`shared_entries`); only the entry points differ (:func:`engine_entries`).
Tests lay out the same tree in a directory (:func:`write_tree`) and run the stand-ins from it.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pdctl.onhost import bundle

PACKAGE = "pdlab_worker"
WORKER_SOURCE = Path(__file__).parent / "worker"
FETCHER = "pdctl.onhost.model_fetch"
Engine = Literal["sglang", "vllm"]
Area = Literal["site", "bin"]


@dataclass(frozen=True)
class Entry:
    area: Area  # site: the interpreter's site-packages; bin: a directory on PATH
    path: str
    data: bytes
    mode: int = 0o644


def _module_shim(doc: str, module: str, function: str) -> bytes:
    return (
        f'"""{doc}"""\n\nimport sys\n\nfrom {PACKAGE}.{module} import {function}\n\n'
        f'if __name__ == "__main__":\n    sys.exit({function}())\n'
    ).encode()


def _package(doc: str) -> bytes:
    return f'"""{doc}"""\n'.encode()


_SHIMS: dict[Engine, tuple[Entry, ...]] = {
    "sglang": (
        Entry("site", "sglang/__init__.py", _package("pdctl lab: SGLang's entry points.")),
        Entry(
            "site",
            "sglang/launch_server.py",
            _module_shim("python3 -m sglang.launch_server", "sglang.launch_server", "main"),
        ),
    ),
    "vllm": (
        Entry("site", "vllm/__init__.py", _package("pdctl lab: vLLM's entry points.")),
        Entry("site", "vllm/entrypoints/__init__.py", _package("pdctl lab: vLLM's entry points.")),
        Entry(
            "site",
            "vllm/entrypoints/grpc_server.py",
            _module_shim(
                "python3 -m vllm.entrypoints.grpc_server", "vllm.server", "main_grpc_server"
            ),
        ),
        Entry(
            "bin",
            "vllm",
            b"#!/usr/bin/python3\n" + _module_shim("vllm serve", "vllm.server", "main_cli"),
            0o755,
        ),
    ),
}


def stand_in_files() -> Iterator[Entry]:
    for file in sorted(WORKER_SOURCE.rglob("*.py")):
        relative = file.relative_to(WORKER_SOURCE).as_posix()
        yield Entry("site", f"{PACKAGE}/{relative}", file.read_bytes())
    # pdctl's model fetcher and what it imports (its bundle, as the package's own files): a
    # stand-in with no cache mounted downloads its model with it, as an engine does through
    # huggingface_hub (model_cache.py).
    modules = bundle.modules(FETCHER)
    packages = {name.rpartition(".")[0] for name in modules}
    for name, source in modules.items():
        path = name.replace(".", "/") + ("/__init__.py" if name in packages else ".py")
        yield Entry("site", path, source.encode())


def _wheel_target(name: str) -> str | None:
    """Where a wheel member goes under site-packages (pip's layout), or None to leave it."""
    head, sep, rest = name.partition("/")
    if not head.endswith(".data") or not sep:
        return name
    kind, sep, inner = rest.partition("/")
    return inner if kind in ("purelib", "platlib") and sep else None


def wheel_files(wheels: Iterable[Path]) -> Iterator[Entry]:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                target = None if info.is_dir() else _wheel_target(info.filename)
                if target:
                    mode = (info.external_attr >> 16) & 0o777 or 0o644
                    yield Entry("site", target, archive.read(info), mode | 0o644)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project(wheel: Path) -> str:
    """A wheel file's project name, normalized (PEP 503)."""
    return _normalize(wheel.name.split("-")[0])


def _requirements(wheel: Path) -> list[tuple[str, bool]]:
    """(project, conditional) of each Requires-Dist in the wheel's METADATA; requirements of
    extras are left out (the image installs none)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = archive.read(metadata).decode() if metadata else ""
    found = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement, _, marker = line.removeprefix("Requires-Dist:").partition(";")
        if "extra" in marker:
            continue
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        if name:
            found.append((_normalize(name.group(1)), bool(marker.strip())))
    return found


def wheels_for(wheelhouse: Path, packages: Iterable[str]) -> list[Path]:
    """The wheelhouse's wheels of ``packages`` and of what they require (pip resolved the
    wheelhouse: one version of each project is there)."""
    available = {_project(w): w for w in wheelhouse.glob("*.whl")}
    chosen: dict[str, Path] = {}
    todo = [(_normalize(p), False) for p in packages]
    missing = []
    while todo:
        name, conditional = todo.pop()
        if name in chosen:
            continue
        if name not in available:
            if not conditional:  # a marker pip did not meet (another Python, say)
                missing.append(name)
            continue
        chosen[name] = available[name]
        todo.extend(_requirements(available[name]))
    if missing:
        raise FileNotFoundError(f"no wheel of {', '.join(sorted(missing))} in {wheelhouse}")
    return sorted(chosen.values())


def shared_entries(wheels: Iterable[Path] = ()) -> list[Entry]:
    """What every engine's image holds: the stand-ins and the gRPC packages."""
    return [*stand_in_files(), *wheel_files(wheels)]


def engine_entries(engine: Engine) -> list[Entry]:
    """The entry points spelled as the engine's own."""
    return list(_SHIMS[engine])


def entries(engine: Engine, wheels: Iterable[Path] = ()) -> list[Entry]:
    return [*shared_entries(wheels), *engine_entries(engine)]


def digest(engine: Engine, wheels: Iterable[Path] = ()) -> str:
    """Changes with the stand-ins' sources, the entry points and the wheels."""
    value = hashlib.sha256(engine.encode())
    for entry in [*stand_in_files(), *_SHIMS[engine]]:
        value.update(entry.path.encode() + entry.data)
    for wheel in wheels:
        value.update(wheel.name.encode())
    return value.hexdigest()[:16]


def write_tree(dest: Path, engine: Engine, wheels: Iterable[Path] = ()) -> Path:
    """Lay the files out under ``dest/site`` and ``dest/bin``; ``dest/site`` goes on
    PYTHONPATH (an interpreter that has the wheels' packages needs no ``wheels``)."""
    for entry in entries(engine, wheels):
        target = dest / entry.area / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(entry.data)
        target.chmod(entry.mode)
    return dest / "site"
