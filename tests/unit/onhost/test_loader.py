"""pdctl/onhost/loader.py, run as hosts run it (python3 -c BOOT ENTRY, the frames on stdin):
a bundled module is imported from the bundle, never from disk; a pdctl module the bundle lacks
is not found; the entry gets its arguments and the rest of stdin; tracebacks show the bundled
lines; and every entry of pdctl/onhost runs on the hosts' oldest Python (3.9)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pdctl.onhost import bundle

ROOT = Path(__file__).resolve().parents[3]
LOADER = ROOT / "pdctl" / "onhost" / "loader.py"
PY39 = sorted((Path.home() / ".pyenv" / "versions").glob("3.9*/bin/python3"))
PYTHONS = [sys.executable, *[str(p) for p in PY39[:1]]]
ON_HOST = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "pdctl" / "onhost").rglob("*.py")
    if p.name != "__init__.py" and p.stem not in {"router_launch", "bundle"}
)


def _run(root: Path, entry: str, args: list[str], rest: bytes = b"", **kw: Any) -> Any:
    return subprocess.run(
        bundle.argv(entry, args, python=sys.executable),
        input=bundle.stdin(entry, root) + rest,
        capture_output=True,
        check=False,
        **kw,
    )


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_entry_gets_its_arguments_and_the_rest_of_stdin(tmp_path: Path) -> None:
    root = _write(
        tmp_path / "src",
        {
            "pdctl/__init__.py": "",
            "pdctl/onhost/__init__.py": "",
            "pdctl/onhost/echo.py": (
                "import sys\nfrom pdctl.onhost import words\n"
                "if __name__ == '__main__':\n"
                "    print(sys.argv[0], words.join(sys.argv[1:]), sys.stdin.read().upper())\n"
            ),
            "pdctl/onhost/words.py": "def join(items):\n    return '|'.join(items)\n",
        },
    )
    proc = _run(root, "pdctl.onhost.echo", ["a b", "c"], b"after the frames", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # argv[0] is the module's file, as under `python -m`.
    assert proc.stdout == b"<pdctl bundle>/pdctl/onhost/echo.py a b|c AFTER THE FRAMES\n"


def test_a_bundled_module_is_never_read_from_disk(tmp_path: Path) -> None:
    """The checkout's pdctl is importable here (an editable install, and the working
    directory): the bundle's modules still win, and what it lacks of pdctl is not found."""
    root = _write(
        tmp_path / "src",
        {
            "pdctl/__init__.py": "",
            "pdctl/onhost/__init__.py": "",
            "pdctl/onhost/look.py": (
                "import importlib, pdctl.onhost.look as me\n"
                "print(type(me.__loader__).__name__, me.__file__)\n"
                "try:\n    importlib.import_module('pdctl.onhost.loader')\n"
                "except ModuleNotFoundError as exc:\n    print('missing', exc.name)\n"
            ),
        },
    )
    proc = _run(root, "pdctl.onhost.look", [], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split("\n")[:2] == [
        "BundleFinder <pdctl bundle>/pdctl/onhost/look.py",
        "missing pdctl.onhost.loader",
    ]


def test_a_traceback_shows_the_bundled_line(tmp_path: Path) -> None:
    root = _write(
        tmp_path / "src",
        {
            "pdctl/__init__.py": "",
            "pdctl/boom.py": "def go():\n    raise RuntimeError('from the bundle')  # here\n",
            "pdctl/entry.py": "from pdctl import boom\nboom.go()\n",
        },
    )
    proc = _run(root, "pdctl.entry", [], cwd=tmp_path)
    assert proc.returncode == 1
    err = proc.stderr.decode()
    assert 'File "<pdctl bundle>/pdctl/boom.py", line 2, in go' in err
    assert "raise RuntimeError('from the bundle')  # here" in err


def test_a_stdin_cut_short_is_said_so() -> None:
    data = bundle.stdin("pdctl.onhost.drift_probe")
    proc = subprocess.run(
        bundle.argv("pdctl.onhost.drift_probe", python=sys.executable),
        input=data[: len(data) - 10],
        capture_output=True,
        check=False,
    )
    assert proc.returncode == 1
    assert b"pdctl loader: a frame of" in proc.stderr


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: Path(p).parent.parent.name or p)
def test_every_on_host_module_imports_from_its_bundle(python: str, tmp_path: Path) -> None:
    """Each module of pdctl/onhost (router_launch.py needs SMG, bundle.py runs on the
    controller) imports from its bundle alone, on each Python the hosts may have."""
    for entry in ON_HOST:
        shipped = tmp_path / f"{entry}.json"
        shipped.write_text(json.dumps(bundle.modules(entry)))
        script = (
            "import importlib, json, sys\n"
            "loader = {'__name__': 'pdctl_loader'}\n"
            "exec(open(sys.argv[1]).read(), loader)\n"
            "loader['install'](json.load(open(sys.argv[2])))\n"
            "importlib.import_module(sys.argv[3])\n"
        )
        proc = subprocess.run(
            [python, "-I", "-W", "error", "-c", script, str(LOADER), str(shipped), entry],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=False,
        )
        assert proc.returncode == 0, (entry, proc.stderr)


@pytest.fixture
def health() -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: Path(p).parent.parent.name or p)
def test_the_entries_run_on_each_python(python: str, health: int, tmp_path: Path) -> None:
    """The probes the roles and pdctl run, as they run them, on the hosts' Pythons."""

    def run(entry: str, args: list[str], request: object | None) -> Any:
        rest = b"" if request is None else json.dumps(request).encode()
        proc = subprocess.run(
            bundle.argv(entry, args, python=python),
            input=bundle.stdin(entry) + rest,
            capture_output=True,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, (entry, proc.stderr)
        return json.loads(proc.stdout)

    unit = "pdctl-test-no-such.service"
    probe = run("pdctl.onhost.unit_probe", [f"http://127.0.0.1:{health}/health", unit, "5"], None)
    assert probe["status"] == 200
    failing = run("pdctl.onhost.unit_probe", [f"http://127.0.0.1:{health}/x", unit, "5"], None)
    assert failing["status"] == 503
    (tmp_path / "f").write_text("x")
    drift = {"roots": [str(tmp_path)], "units": [], "images": [], "states": None, "key": "00"}
    assert set(run("pdctl.onhost.drift_probe", [], drift)["files"]) == {
        str(tmp_path),
        str(tmp_path / "f"),
    }
    where = {"config_root": str(tmp_path), "unit_dir": str(tmp_path), "router_units": "pd-*.x"}
    assert run("pdctl.onhost.holdings_probe", [], where) == {"slots": [], "listeners": []}
    preflight = {
        "host": "h",
        "kind": "cpu",
        "expected_gpus": 8,
        "gpu_model": "",
        "gpu_vendor": "any",
        "expected_nics": 8,
        "nic_driver": "auto",
        "link_layer": "auto",
        "provider_lib": "/x",
        "gid_index": 3,
        "min_disk_gb": 1.0,
        "storage_paths": ["/"],
    }
    report = run("pdctl.onhost.hardware.preflight", [], preflight)
    assert {c["name"] for c in report["checks"]} >= {"systemd", "disk", "runtime"}
    assert report["facts"]["python"].startswith("3.9." if "3.9" in python else "3.")
