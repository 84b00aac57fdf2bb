"""The lab's model hub: the part of the Hugging Face Hub's HTTP API that downloads use.

What ``huggingface_hub`` (``hf_hub_download``, ``snapshot_download``) and pdctl's fetcher ask
(docs/facts.md, "Hugging Face Hub API"):

* ``GET /api/models/REPO`` and ``/api/models/REPO/revision/REV``: ``{"id", "sha",
  "siblings": [{"rfilename"}]}`` (``HfApi.repo_info``);
* ``GET /api/models/REPO/tree/REV[/PATH]?recursive=true``: ``[{"type": "file", "path",
  "size", "oid", "lfs": {"oid": SHA256, "size", "pointerSize"}}]`` (``list_repo_tree``);
* ``HEAD``/``GET /REPO/resolve/REV/PATH``, with ``Range: bytes=A-``, ``A-B`` or ``-N`` (206);
  headers ``X-Repo-Commit``, ``ETag`` (the sha256 of an LFS file, the git blob oid of
  others: huggingface_hub names the cached blob after it), ``Content-Length``,
  ``Accept-Ranges``. REV is ``main`` or the commit. Unknown repository, revision or file:
  404 with the Hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound).

The lab's own additions: each GET of a resolve URL that starts at byte 0 (no range, or a
range from 0) counts one download of ``REPO/PATH`` (a resumed tail does not), kept in
``ROOT/downloads.json`` and at ``GET /api/pdctl-lab/downloads``; ``ROOT/settings.json``
(re-read when it changes) may set ``rate`` (bytes/s the hub serves in all, its uplink; null:
no cap), ``token`` (then every request needs ``Authorization: Bearer TOKEN``, else 401) and
``generate`` (bytes: a repository the hub has never seen is made on its first authorized
request, as ``add`` makes one of that size, so any model a spec names is there, as on the
real hub; null: unknown repositories are 404).

Run it with ``python3 -m pdctl.lab.hub serve --root DIR --host ADDR --port PORT``; ``add``
makes a model (hub_models.py). Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import re
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote, urlsplit

from pdctl.lab.hub_models import HubError, Repo, RepoFile, Store, add_model, check_repo, parse_size

DEFAULT_PORT = 8080
DOWNLOADS_PATH = "/api/pdctl-lab/downloads"
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_MAX_CHUNK = 1 << 20
_SETTINGS_CHECK_SECS = 0.5


class Throttle:
    """One serving rate for all connections together (the site's uplink).

    Each chunk books the next free stretch of a shared timeline and the sender sleeps until
    its stretch ends, so N concurrent downloads share ``rate`` bytes/s between them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, nbytes: int, rate: float | None) -> None:
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / rate
            wait = self._free_at - now
        time.sleep(wait)


class HubState:
    """What every request handler shares: the store, the settings, counts, the throttle."""

    def __init__(self, root: Path, cache: Path | None = None) -> None:
        self.store = Store(root)
        self.cache = cache or root / ".cache"  # where generated shards are made once
        self._generating = threading.Lock()
        self.settings_file = root / "settings.json"
        self.downloads_file = root / "downloads.json"
        self.throttle = Throttle()
        self._lock = threading.Lock()
        self._settings: dict[str, Any] = {}
        self._settings_seen: tuple[float, float] = (-1.0, 0.0)  # (mtime, checked at)
        saved = _read_json(self.downloads_file) or {}
        self.downloads: dict[str, int] = dict(saved.get("downloads", {}))
        self.bytes_served = int(saved.get("bytes_served", 0))

    def settings(self) -> dict[str, Any]:
        """settings.json, re-read at most every half second when its mtime changed."""
        now = time.monotonic()
        if now - self._settings_seen[1] >= _SETTINGS_CHECK_SECS:
            try:
                mtime = self.settings_file.stat().st_mtime
            except OSError:
                mtime = 0.0
            if mtime != self._settings_seen[0]:
                self._settings = _read_json(self.settings_file) or {}
            self._settings_seen = (mtime, now)
        return self._settings

    def rate(self) -> float | None:
        rate = self.settings().get("rate")
        return float(rate) if rate else None

    def token(self) -> str | None:
        token = self.settings().get("token")
        return str(token) if token else None

    def repo(self, repo_id: str) -> Repo | None:
        """The repository, made on its first request when the settings say ``generate``
        (None: unknown, or not a repository id)."""
        found = self.store.get(repo_id)
        size = self.settings().get("generate")
        if found is not None or not size:
            return found
        with self._generating:  # one request makes it; the others wait and find it
            found = self.store.get(repo_id)
            if found is None:
                try:
                    found = add_model(self.store.root, check_repo(repo_id), int(size), self.cache)
                except HubError:
                    return None
                sys.stderr.write(f"hub: made {repo_id} ({int(size)} bytes) on first request\n")
        return found

    def record(self, key: str | None, sent: int) -> None:
        with self._lock:
            if key is not None:
                self.downloads[key] = self.downloads.get(key, 0) + 1
            self.bytes_served += sent
            _write_json(self.downloads_file, self.report())

    def report(self) -> dict[str, Any]:
        return {
            "downloads": dict(sorted(self.downloads.items())),
            "bytes_served": self.bytes_served,
        }


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.{threading.get_ident()}")
    partial.write_text(json.dumps(doc, indent=2) + "\n")
    partial.replace(path)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``Range`` -> the inclusive (first, last) byte; None: the whole file.

    Raises ValueError when the range cannot be satisfied (416)."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if not match or match.groups() == ("", ""):
        return None  # a syntax the server does not honour: the whole file, as RFC 9110 allows
    first, last = match.groups()
    if first == "":  # the last N bytes
        count = int(last)
        if count == 0:
            raise ValueError("empty suffix range")
        return max(0, size - count), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or end < start:
        raise ValueError("range outside the file")
    return start, end


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "pdctl-lab-hub/1"
    hub: ClassVar[HubState]

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"{self.address_string()} {format % args}\n")

    # ---- answers

    def _send_json(self, status: int, doc: object, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        self._send_json(status, {"error": message}, {"X-Error-Code": code} if code else None)

    def _authorized(self) -> bool:
        token = self.hub.token()
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        expected = f"Bearer {token}"
        if hmac.compare_digest(given.encode(), expected.encode()):
            return True
        self._error(401, "Invalid credentials in Authorization header")
        return False

    # ---- routing

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        if not self._authorized():
            return
        if url.path == DOWNLOADS_PATH:
            self._send_json(200, self.hub.report())
        elif parts[:2] == ["api", "models"] and len(parts) > 2:
            self._api(parts[2:], parse_qs(url.query))
        elif "resolve" in parts[1:3]:
            at = parts.index("resolve", 1)
            self._resolve("/".join(parts[:at]), parts[at + 1 :])
        else:
            self._error(404, f"no such endpoint: {url.path}")

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repo(repo_id)
        if repo is None:
            self._error(404, f"Repository Not Found for url: {self.path}", "RepoNotFound")
        return repo

    def _at_revision(self, repo: Repo, revision: str) -> bool:
        if revision in {"main", "refs/heads/main", repo.sha}:
            return True
        self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return False

    def _api(self, parts: list[str], query: dict[str, list[str]]) -> None:
        for marker in ("revision", "tree"):
            if marker in parts[1:3]:
                at = parts.index(marker, 1)
                repo_id, rest = "/".join(parts[:at]), parts[at + 1 :]
                break
        else:
            marker, repo_id, rest = "revision", "/".join(parts), ["main"]
        repo = self._repo(repo_id)
        if repo is None or not rest or not self._at_revision(repo, rest[0]):
            if repo is not None and not rest:
                self._error(404, "no revision given", "RevisionNotFound")
            return
        if marker == "revision":
            self._send_json(200, _info(repo))
            return
        prefix = "/".join(rest[1:])
        recursive = query.get("recursive", ["false"])[0].lower() in {"1", "true"}
        self._send_json(200, _tree(repo, prefix, recursive))

    def _resolve(self, repo_id: str, rest: list[str]) -> None:
        repo = self._repo(repo_id)
        if repo is None or len(rest) < 2 or not self._at_revision(repo, rest[0]):
            if repo is not None and len(rest) < 2:
                self._error(404, "no file given", "EntryNotFound")
            return
        entry = repo.file("/".join(rest[1:]))
        if entry is None:
            self._error(404, f"Entry not found: {'/'.join(rest[1:])}", "EntryNotFound")
            return
        self._send_file(repo, entry)

    def _send_file(self, repo: Repo, entry: RepoFile) -> None:
        try:
            span = parse_range(self.headers.get("Range"), entry.size)
        except ValueError:
            self._error(416, "Requested Range Not Satisfiable")
            return
        first, last = span if span is not None else (0, entry.size - 1)
        length = last - first + 1 if entry.size else 0
        self.send_response(206 if span is not None else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{entry.etag}"')
        self.send_header("X-Repo-Commit", repo.sha)
        if span is not None:
            self.send_header("Content-Range", f"bytes {first}-{last}/{entry.size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        if first == 0:  # counted before sending, so a client that has the file sees its count
            self.hub.record(f"{repo.repo_id}/{entry.path}", 0)
        sent = 0
        try:
            sent = self._stream(self.hub.store.blob(entry.sha256), first, length)
        finally:
            self.hub.record(None, sent)

    def _stream(self, blob: Path, first: int, length: int) -> int:
        rate = self.hub.rate()
        chunk = _MAX_CHUNK if not rate else int(min(64 << 10, max(1 << 10, rate / 50)))
        sent = 0
        with blob.open("rb") as source:
            source.seek(first)
            while sent < length:
                data = source.read(min(chunk, length - sent))
                if not data:
                    break
                self.hub.throttle.take(len(data), self.hub.rate())
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    break
                sent += len(data)
        return sent


def _info(repo: Repo) -> dict[str, Any]:
    return {
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "sha": repo.sha,
        "private": False,
        "gated": False,
        "disabled": False,
        "tags": ["pdctl-lab"],
        "library_name": "transformers",
        "siblings": [{"rfilename": f.path} for f in repo.files],
        "usedStorage": repo.size,
    }


def _tree(repo: Repo, prefix: str, recursive: bool) -> list[dict[str, Any]]:
    base = f"{prefix.rstrip('/')}/" if prefix else ""
    entries: list[dict[str, Any]] = []
    folders: set[str] = set()
    for item in repo.files:
        if not item.path.startswith(base):
            continue
        rest = item.path[len(base) :]
        if "/" in rest and not recursive:
            folders.add(base + rest.split("/", 1)[0])
            continue
        entries.append(item.tree_entry())
    return [{"type": "directory", "path": p, "oid": repo.sha} for p in sorted(folders)] + entries


class HubServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def make_server(
    root: Path, host: str = "127.0.0.1", port: int = 0, cache: Path | None = None
) -> HubServer:
    """A hub serving ``root`` (not yet serving: call serve_forever, e.g. in a thread);
    ``cache``: where models it generates keep their shards [ROOT/.cache]."""

    class BoundHubHandler(HubHandler):
        pass

    BoundHubHandler.hub = HubState(root, cache)
    return HubServer((host, port), BoundHubHandler)


def endpoint(server: HubServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}"


def write_settings(
    root: Path, rate: float | None, token: str | None, generate: int | None = None
) -> None:
    """The running hub picks these up within half a second. ``generate``: the size of the
    models it makes on first request (None: it makes none)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "settings.json"
    partial = path.with_name(".settings.json.partial")
    partial.touch(mode=0o600)
    partial.chmod(0o600)  # the token is a secret
    doc = {"rate": rate, "token": token, "generate": generate}
    partial.write_text(json.dumps(doc) + "\n")
    partial.replace(path)


def read_settings(root: Path) -> dict[str, Any]:
    return _read_json(root / "settings.json") or {}


def read_downloads(root: Path) -> dict[str, Any]:
    return _read_json(root / "downloads.json") or {"downloads": {}, "bytes_served": 0}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m pdctl.lab.hub", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the hub directory ROOT")
    serve.add_argument("--root", type=Path, required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port")
    serve.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    serve.add_argument("--cache", type=Path, help="where generated shards are kept [ROOT/.cache]")
    add = commands.add_parser("add", help="add a generated model to ROOT")
    add.add_argument("--root", type=Path, required=True)
    add.add_argument("--cache", type=Path, help="where generated shards are kept [ROOT/.cache]")
    add.add_argument("repo")
    add.add_argument("--size", required=True, help="weights' bytes: 256M, 1G, ...")
    add.add_argument("--shards", type=int, default=None, help="[one per 128 MiB, at most 4]")
    settings = commands.add_parser("settings", help="set the serving rate and token")
    settings.add_argument("--root", type=Path, required=True)
    settings.add_argument("--rate", default=None, help="bytes/s in all (10M, ...); none: no cap")
    settings.add_argument("--token-file", type=Path, default=None)
    settings.add_argument(
        "--generate", default=None, help="make unknown repositories of this size (64M); none"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "add":
            cache = args.cache or args.root / ".cache"
            size = parse_size(args.size)
            model = add_model(args.root, args.repo, size, cache, args.shards)
            print(json.dumps(model.to_json(), indent=2))
            return 0
        if args.command == "settings":
            rate = parse_size(args.rate) if args.rate and args.rate != "none" else None
            token = args.token_file.read_text().strip() if args.token_file else None
            generate = (
                parse_size(args.generate) if args.generate and args.generate != "none" else None
            )
            write_settings(args.root, rate, token, generate)
            return 0
    except (HubError, OSError) as exc:
        sys.stderr.write(f"hub: {exc}\n")
        return 2
    server = make_server(args.root, args.host, args.port, args.cache)
    if args.port_file:
        args.port_file.write_text(f"{server.server_address[1]}\n")
    sys.stderr.write(f"hub: serving {args.root} at {endpoint(server)}\n")
    sys.stderr.flush()
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever(poll_interval=0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
