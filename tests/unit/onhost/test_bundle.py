"""pdctl/onhost/bundle.py: what a bundle holds (an entry and what it imports of pdctl, nothing
else), reproducibly; the argv and stdin it runs with; the text of a module that stands alone;
and bundle.py loaded by its path with the standard library only, as the Ansible lookup does; parses
side by side in threads."""

from __future__ import annotations

import ast
import gc
import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pdctl.onhost import bundle
from pdctl.onhost.bundle import BundleError

ROOT = Path(__file__).resolve().parents[3]


def _package(tmp_path: Path) -> Path:
    """A small pdctl: a scaler that imports a core module, a lab nobody imports, caches."""
    root = tmp_path / "src"
    files = {
        "pdctl/__init__.py": '"""pdctl."""\n',
        "pdctl/scaler/__init__.py": "",
        "pdctl/scaler/__main__.py": "from pdctl.scaler.loop import TICK\nprint(TICK)\n",
        "pdctl/scaler/loop.py": (
            "from typing import TYPE_CHECKING\n"
            "from pdctl.core import plan\n"
            "from . import calls\n"
            "if TYPE_CHECKING:\n    from pdctl.lab import host\n"
            "TICK = plan.STEP\n"
        ),
        "pdctl/scaler/calls.py": "import json\n",
        "pdctl/core/__init__.py": "",
        "pdctl/core/plan.py": "STEP = 2\n",
        "pdctl/lab/__init__.py": "",
        "pdctl/lab/host.py": "BOOTED = True\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "pdctl/scaler/__pycache__").mkdir()
    (root / "pdctl/scaler/__pycache__/loop.cpython-311.pyc").write_bytes(b"\0")
    return root


def test_a_bundle_holds_its_entry_what_it_imports_and_their_packages(tmp_path: Path) -> None:
    root = _package(tmp_path)
    found = bundle.modules("pdctl.scaler", root)
    assert list(found) == [
        "pdctl",
        "pdctl.core",
        "pdctl.core.plan",
        "pdctl.scaler",
        "pdctl.scaler.__main__",
        "pdctl.scaler.calls",
        "pdctl.scaler.loop",
    ]
    assert found["pdctl.core.plan"] == "STEP = 2\n"


def test_a_bundle_is_reproducible_and_follows_its_sources(tmp_path: Path) -> None:
    root = _package(tmp_path)
    first = bundle.stdin("pdctl.scaler", root)
    again = bundle.stdin("pdctl.scaler", _package(tmp_path / "again"))
    assert first == again
    (root / "pdctl/core/plan.py").write_text("STEP = 3\n")
    bundle.modules.cache_clear()
    assert bundle.stdin("pdctl.scaler", root) != first


def test_an_entry_that_is_no_module_of_pdctl_is_refused(tmp_path: Path) -> None:
    root = _package(tmp_path)
    with pytest.raises(BundleError, match="is not a module of pdctl"):
        bundle.modules("pdctl.nothing", root)
    with pytest.raises(BundleError, match="is not a module of pdctl"):
        bundle.modules("json", root)


def test_a_name_imported_from_a_package_is_bundled_when_it_is_a_module(tmp_path: Path) -> None:
    root = _package(tmp_path)
    (root / "pdctl/core/plan.py").write_text("from pdctl.core import rules, STEP\n")
    (root / "pdctl/core/rules.py").write_text("")
    (root / "pdctl/core/__init__.py").write_text("STEP = 2\n")
    assert list(bundle.modules("pdctl.core.plan", root)) == [
        "pdctl",
        "pdctl.core",
        "pdctl.core.plan",
        "pdctl.core.rules",
    ]


def test_the_run_the_hosts_see(tmp_path: Path) -> None:
    root = _package(tmp_path)
    argv = bundle.argv("pdctl.scaler", ["run"])
    assert argv == ["python3", "-c", bundle.BOOT, "pdctl.scaler", "run"]
    assert shlex.split(bundle.command("pdctl.scaler", ["run"], become=True)) == [
        "sudo",
        "-n",
        *argv,
    ]
    proc = subprocess.run(
        bundle.argv("pdctl.scaler", python=sys.executable),
        input=bundle.stdin("pdctl.scaler", root),
        capture_output=True,
        cwd=tmp_path,
        check=True,
    )
    assert proc.stdout == b"2\n"


def test_the_loaders_line_says_nothing_a_unit_file_or_a_shell_would_read() -> None:
    """The scaler's unit runs it as ExecStart=... -c "BOOT": systemd expands % and $ and
    reads backslashes and quotes; it also travels in SSH commands and Ansible argv."""
    assert not set(bundle.BOOT) & set("%$\\\"'`\n")
    assert (ROOT / "pdctl/onhost/loader.py").read_bytes().isascii()  # framed by length


def test_a_module_that_imports_nothing_of_pdctl_stands_alone() -> None:
    text = bundle.source("pdctl.onhost.router_launch")
    assert text == (ROOT / "pdctl/onhost/router_launch.py").read_text()
    with pytest.raises(BundleError, match="cannot stand alone"):
        bundle.source("pdctl.onhost.unit_probe")  # it imports the gRPC health call


def test_the_lookup_loads_bundle_py_by_its_path_with_the_standard_library_only(
    tmp_path: Path,
) -> None:
    """playbooks/lookup_plugins/pd_onhost.py loads bundle.py by its path: Ansible's Python need
    not have pdctl. Under -S -I (no site-packages, so no pdctl) it builds pdctl's bundle."""
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('b', sys.argv[1])\n"
        "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)\n"
        "sys.stdout.buffer.write(b.stdin('pdctl.scaler'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-I", "-c", script, str(ROOT / "pdctl/onhost/bundle.py")],
        capture_output=True,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        check=True,
    )
    assert proc.stdout == bundle.stdin("pdctl.scaler")


def test_the_scalers_bundle_holds_no_lab_no_command_line_and_no_operation() -> None:
    shipped = bundle.modules("pdctl.scaler")
    assert "pdctl.scaler.daemon" in shipped and "pdctl.core.plan" in shipped
    assert not [
        name for name in shipped if name.startswith(("pdctl.lab", "pdctl.cli", "pdctl.operations"))
    ]
    loader, modules = _frames(bundle.stdin("pdctl.scaler"))
    assert loader == (ROOT / "pdctl/onhost/loader.py").read_bytes()
    assert json.loads(modules) == shipped


def _frames(data: bytes) -> list[bytes]:
    """The ``<length>\\n<bytes>`` frames of a host's stdin."""
    found = []
    while data:
        head, _, rest = data.partition(b"\n")
        found.append(rest[: int(head)])
        data = rest[int(head) :]
    return found


class _Finalized:
    """A cycle whose finalizer runs Python code: the garbage collector, collecting it inside
    ast.parse's C code, lets another thread run there."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        sum(range(10))


def _parse_side_by_side(parse: Callable[[str], object]) -> list[SystemError]:
    source = Path(bundle.__file__).read_text()
    failures: list[SystemError] = []

    def work() -> None:
        for _ in range(150):
            try:
                _Finalized()
                parse(source)
            except SystemError as error:
                failures.append(error)

    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(50, 2, 2)
    try:
        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*thresholds)
    return failures


def test_bundles_parse_side_by_side_in_threads_without_cpythons_ast_race() -> None:
    # fleet add bundles for each host in its own thread; CPython 3.11's shared AST state made
    # one of them fail with "AST constructor recursion depth mismatch" (python/cpython#106905).
    if sys.version_info < (3, 12):
        assert _parse_side_by_side(ast.parse), "the stress no longer reproduces the race"
    assert _parse_side_by_side(bundle.parse) == []


def _every_import(tree: ast.Module) -> set[str]:
    """The imports a bundle must follow, found by visiting every node of ``tree``: those under
    ``if TYPE_CHECKING:`` left out. What bundle._imports, which visits statements only, must
    find."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and bundle._type_checking(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return {
        ast.dump(node)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped
    }


NESTED = """
import a
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import hidden
    if x:
        import hidden_deeper
else:
    import shown_in_else
def f():
    import in_function
    class C:
        import in_class
        def g(self):
            with x:
                import in_with
try:
    import in_try
except ImportError:
    import in_handler
else:
    import in_try_else
finally:
    import in_finally
for _ in x:
    import in_for
else:
    import in_for_else
while x:
    import in_while
async def h():
    async with x:
        import in_async_with
    async for _ in x:
        import in_async_for
match x:
    case 1:
        import in_case
"""


SOURCES = sorted((ROOT / "pdctl").rglob("*.py"))


@pytest.mark.parametrize(
    "path",
    [pytest.param(None, id="every-kind-of-block")]
    + [pytest.param(p, id=str(p.relative_to(ROOT))) for p in SOURCES],
)
def test_the_statement_walk_finds_every_import_a_walk_of_all_nodes_finds(path: Path | None) -> None:
    tree = ast.parse(NESTED if path is None else path.read_text(encoding="utf-8"))
    found = {ast.dump(node) for node in bundle._imports(tree)}
    assert found == _every_import(tree)
    if path is None:
        names = {alias.name for node in bundle._imports(tree) for alias in node.names}
        assert names == {"a", "TYPE_CHECKING", "shown_in_else"} | {
            n for n in NESTED.split() if n.startswith("in_")
        }
