"""The loader every run of pdctl's Python on a host starts with (bundle.py builds what it reads).

A host runs ``python3 -c BOOT ENTRY [ARG...]``; BOOT reads this file's text from stdin and runs
it. It reads what follows on stdin, a bundle: ``{module name: source}`` of ENTRY and of what it
imports of pdctl, and puts a finder over it ahead of every other, so that each of those modules
is imported as itself from the bundle (never from the host's disk, where another pdctl may be
installed) and a pdctl module the bundle lacks is not found at all. It then runs ENTRY as
``__main__`` with the ARGs; the rest of stdin is ENTRY's. Tracebacks show the bundled lines.

Both parts on stdin are framed as ``<length in bytes>\\n<bytes>``. Standard library only,
Python 3.9.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import runpy
import sys
import traceback
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType, TracebackType
from typing import BinaryIO

# What a bundled module's __file__ and tracebacks say (no such directory exists on the host).
ORIGIN = "<pdctl bundle>"


class BundleFinder(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds and loads the bundle's modules; a name with submodules in it is a package."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.sources = dict(sources)
        self.packages = {name.rpartition(".")[0] for name in self.sources} - {""}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname not in self.sources:
            return None
        spec = importlib.util.spec_from_loader(
            fullname,
            self,
            origin=self.filename(fullname),
            is_package=fullname in self.packages,
        )
        if spec is not None:
            spec.has_location = True  # __file__ is set: code that names itself still imports
        return spec

    def filename(self, fullname: str) -> str:
        tail = "/__init__.py" if fullname in self.packages else ".py"
        return f"{ORIGIN}/{fullname.replace('.', '/')}{tail}"

    def is_package(self, fullname: str) -> bool:
        return fullname in self.packages

    def get_source(self, fullname: str) -> str:
        try:
            return self.sources[fullname]
        except KeyError:
            raise ImportError(f"{fullname} is not in the bundle", name=fullname) from None

    def get_code(self, fullname: str) -> CodeType:
        return compile(
            self.get_source(fullname), self.filename(fullname), "exec", dont_inherit=True
        )


def install(sources: dict[str, str]) -> BundleFinder:
    """Make the bundle's modules importable as themselves, ahead of every other finder."""
    finder = BundleFinder(sources)
    sys.meta_path.insert(0, finder)
    return finder


def read_frame(stream: BinaryIO) -> bytes:
    """One ``<length>\\n<bytes>`` frame from ``stream``."""
    head = stream.readline()
    try:
        size = int(head)
    except ValueError:
        raise SystemExit(f"pdctl loader: expected a frame's length, got {head[:40]!r}") from None
    data = stream.read(size)
    if len(data) != size:
        raise SystemExit(f"pdctl loader: a frame of {size} bytes ended after {len(data)}")
    return data


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    # The traceback module reads a bundled line through its loader (Python < 3.13's own hook
    # looks for files on disk only).
    traceback.print_exception(kind, value, tb)


def main() -> None:
    sources = json.loads(read_frame(sys.stdin.buffer))
    if not isinstance(sources, dict) or len(sys.argv) < 2:
        raise SystemExit("pdctl loader: usage: python3 -c BOOT ENTRY [ARG...], the bundle on stdin")
    install(sources)
    sys.excepthook = _excepthook
    entry = sys.argv[1]
    sys.argv = [entry, *sys.argv[2:]]
    runpy.run_module(entry, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
