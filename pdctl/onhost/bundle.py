"""How pdctl's Python reaches a host: one way, a bundle read by the loader (loader.py).

A bundle is ``{module name: source}``: an entry module and every pdctl module it imports, found
by reading their import statements (those under ``if TYPE_CHECKING:`` left out), with the
packages above them; nothing else of pdctl. A host runs ``python3 -c BOOT ENTRY [ARG...]``
(``argv()``) and reads on stdin, framed, the loader's text and the bundle (``stdin()``), then
whatever the entry itself reads. So nothing of a bundle is in any argv, and the same modules
import the same way on the controller and on the host.

- over SSH, pdctl sends ``command()`` and ``stdin()`` (pdctl/doors/ssh.py, run_onhost);
- in the Ansible content, the ``pd_onhost`` lookup (playbooks/lookup_plugins/pd_onhost.py) loads
  this file and gives the roles the same argv and stdin;
- a daemon (the scaler) keeps ``stdin()`` in a file its unit feeds to its stdin;
- the router's launcher imports nothing of pdctl: a bundle of one module, installed as its file
  (``source()``).

Runs on the controller, from pdctl or from the Ansible lookup without pdctl installed: standard
library only and no pdctl import, like the code it ships.
"""

from __future__ import annotations

import ast
import functools
import json
import shlex
import threading
from collections.abc import Sequence
from pathlib import Path

# The directory that holds the pdctl package (a checkout's root, or site-packages).
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "pdctl"
# The one fixed program in a host's argv: it runs the loader that comes first on stdin.
BOOT = "import sys;exec(sys.stdin.buffer.read(int(sys.stdin.buffer.readline())))"
LOADER = Path(__file__).with_name("loader.py")
# CPython 3.11 keeps ast.parse's recursion depth in one state shared by every thread: two
# threads parsing at once (fleet add bundles for each host side by side) can fail with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). One parse at
# a time, then; a bundle is computed once per process (modules() is cached).
_PARSE_LOCK = threading.Lock()


class BundleError(ValueError):
    """An entry that cannot be bundled: not a pdctl module, or one importing what is missing."""


def _path(name: str, root: Path) -> Path | None:
    base = root.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def parse(source: str) -> ast.Module:
    """``ast.parse``, one thread at a time (see _PARSE_LOCK)."""
    with _PARSE_LOCK:
        return ast.parse(source)


# Where a statement holds statements (an except clause's and a match case's included). An import
# is a statement, and no expression holds one, so the walk below visits statements only: about a
# tenth of a module's nodes. ast.walk over every node cost five times the parse itself, and Ansible
# builds a bundle again in each task's worker process.
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, nested ones too, but those run only by a type checker."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
        else:
            for field in _BODIES:
                stack.extend(getattr(node, field, ()))
    return found


def imported(name: str, source: str, root: Path) -> set[str]:
    """The pdctl modules ``source`` (module ``name``) imports: modules, not their attributes."""
    path = _path(name, root)
    package = name if path is not None and path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        found.add(base)
        found.update(f"{base}.{alias.name}" for alias in node.names)
    return {
        module
        for module in found
        if (module == PACKAGE or module.startswith(PACKAGE + ".")) and _path(module, root)
    }


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@functools.cache
def modules(entry: str, root: Path = ROOT) -> dict[str, str]:
    """The bundle of ``entry``: it, the pdctl modules it imports (again and again), and the
    packages above each, as ``{module name: source}`` in a stable order."""
    path = _path(entry, root)
    if not (entry == PACKAGE or entry.startswith(PACKAGE + ".")) or path is None:
        raise BundleError(f"{entry} is not a module of {PACKAGE} under {root}")
    wanted = [entry]
    if path.name == "__init__.py":
        wanted.append(f"{entry}.__main__")  # what `python -m PACKAGE` runs
    sources: dict[str, str] = {}
    while wanted:
        name = wanted.pop()
        if name in sources:
            continue
        path = _path(name, root)
        if path is None:
            raise BundleError(f"{name} (imported on the way to {entry}) is missing under {root}")
        sources[name] = path.read_text(encoding="utf-8")
        wanted += _parents(name)
        wanted += sorted(imported(name, sources[name], root) - sources.keys())
    return dict(sorted(sources.items()))


def frame(data: bytes) -> bytes:
    return str(len(data)).encode() + b"\n" + data


def stdin(entry: str, root: Path = ROOT) -> bytes:
    """What a host reads first on stdin: the loader, then the bundle of ``entry``."""
    bundle = json.dumps(
        modules(entry, root), sort_keys=True
    ).encode()  # ASCII (json escapes the rest)
    return frame(LOADER.read_bytes()) + frame(bundle)


def argv(entry: str, args: Sequence[str] = (), python: str = "python3") -> list[str]:
    """The argv that runs ``entry`` on a host with ``stdin()`` on its stdin."""
    return [python, "-c", BOOT, entry, *args]


def command(entry: str, args: Sequence[str] = (), *, become: bool = False) -> str:
    """``argv()`` as one shell command for SSH, through ``sudo -n`` when ``become``."""
    words = shlex.join(argv(entry, args))
    return f"sudo -n {words}" if become else words


def source(entry: str, root: Path = ROOT) -> str:
    """The text of a module that imports nothing of pdctl, to install as a file of its own."""
    bundle = modules(entry, root)
    others = sorted(name for name in bundle if name != entry and name not in _parents(entry))
    if others:
        raise BundleError(f"{entry} imports {', '.join(others)}: it cannot stand alone")
    return bundle[entry]
