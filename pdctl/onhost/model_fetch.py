"""A host's model cache: fetch a hub model into it, serve it to peers, check it.

Runs on the hosts, in the bundle of the prefetch's entry (image_fetch.py, whose main serves
this module's sessions too): pdctl/operations/prefetch.py talks to it in JSON lines on
stdin/stdout (``main()``). pdctl imports it too for the layout, the name rules and the hub's
file list.

What to fetch (the commit and every file with its checksum) comes from pdctl, which asked the
hub itself; what a peer sends is checked against it, byte for byte. A peer never redirects a
host, and a host's own server answers only the fleet's addresses, with signed requests.

The cache is the Hugging Face hub cache layout (docs/facts.md, "Hugging Face Hub API and cache"), so
that an engine with ``HF_HOME`` on it and ``HF_HUB_OFFLINE=1`` finds the model:
``<cache>/hub/models--ORG--NAME/{blobs/<sha256|git oid>, snapshots/<commit>/<path> -> blob,
refs/<revision>}``. Beside it, ``<cache>/pdctl/models--ORG--NAME/``: the file list of each
commit fetched (``<commit>.json``) and the stamps of the blobs verified (``verified.json``),
so that a check need not hash a blob twice.

Every name that becomes a path (repo id, revision, commit, file paths, blob names) is checked
against a whitelist first: they come from a spec and from a hub, both untrusted.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import http.server
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdctl.onhost.hf_layout import (
    COMMIT,
    check_blob_name,
    check_commit,
    check_manifest,
    check_path,
    check_repo_id,
    check_revision,
    record_dir,
    repo_dir,
)
from pdctl.onhost.peer_auth import RequestVerifier, authority, sign_request
from pdctl.onhost.secret_mask import Masker

CHUNK = 1 << 20
RETRIES = 3
PROGRESS_EVERY = 0.5  # seconds between two progress lines
WAIT_STEP = 0.05  # seconds between two looks at a file a peer is still writing
ORDER_WAIT = 120.0  # seconds a peer's request waits for this host's own order (its file list)


def _makedirs(path: Path) -> None:
    """Directories root-owned 0755: readable by the workers, writable by root alone."""
    if path.is_dir():
        return
    _makedirs(path.parent)
    path.mkdir(0o755)
    path.chmod(0o755)  # the workers read the cache; only root writes


def _check_root(cache: str) -> None:
    """The cache's own directory: an absolute path, owned by root, writable by root alone."""
    if not cache.startswith("/") or "/../" in cache + "/" or "/./" in cache + "/":
        raise ValueError(f"cache {cache!r} is not an absolute path")
    _makedirs(Path(cache))
    info = Path(cache).lstat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ValueError(
            f"cache {cache} is owned by uid {info.st_uid} with mode {oct(info.st_mode & 0o777)}: "
            "it must be root's and writable by root alone"
        )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    tmp.replace(path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


class Cache:
    """One model's part of a host's cache."""

    def __init__(self, cache: str, repo: str) -> None:
        self.cache, self.repo = cache, check_repo_id(repo)
        self.root = repo_dir(cache, repo)
        self.records = record_dir(cache, repo)
        self._stamps_lock = threading.Lock()

    def blob(self, name: str) -> Path:
        return self.root / "blobs" / check_blob_name(name)

    def partial(self, name: str) -> Path:
        """Where a blob is downloaded to (huggingface_hub's own name for it)."""
        return self.root / "blobs" / f"{check_blob_name(name)}.incomplete"

    def ref(self, revision: str) -> str | None:
        try:
            text = (self.root / "refs" / check_revision(revision)).read_text().strip()
        except OSError:
            return None
        return text if COMMIT.match(text) else None

    def manifest(self, commit: str) -> dict[str, Any] | None:
        doc = _read_json(self.records / f"{check_commit(commit)}.json")
        try:
            return check_manifest(doc) if doc is not None else None
        except ValueError:
            return None

    def prepare(self) -> None:
        _check_root(self.cache)
        for sub in ("blobs", "refs", "snapshots"):
            _makedirs(self.root / sub)
        _makedirs(self.records)

    def save_manifest(self, manifest: dict[str, Any]) -> None:
        path = self.records / f"{manifest['commit']}.json"
        _write_atomic(path, json.dumps(manifest, sort_keys=True).encode())

    def _stamps(self) -> dict[str, Any]:
        doc = _read_json(self.records / "verified.json")
        return doc if isinstance(doc, dict) else {}

    def _stamp_of(self, path: Path) -> list[int]:
        info = path.stat()
        return [info.st_size, info.st_mtime_ns, info.st_ino]

    def stamp(self, name: str) -> None:
        with self._stamps_lock:
            stamps = self._stamps()
            stamps[name] = self._stamp_of(self.blob(name))
            _write_atomic(self.records / "verified.json", json.dumps(stamps).encode())

    def state(self, entry: dict[str, Any], deep: bool) -> str:
        """ready | missing | corrupt | partial (an .incomplete download is there)."""
        path = self.blob(entry["blob"])
        try:
            size = path.stat().st_size
        except OSError:
            return "partial" if self.partial(entry["blob"]).exists() else "missing"
        if size != entry["size"]:
            return "corrupt"
        if self._stamps().get(entry["blob"]) == self._stamp_of(path):
            return "ready"
        if not deep:
            return "unverified"
        if digest_file(path, entry["lfs"]) != entry["blob"]:
            return "corrupt"
        if os.getuid() == self.records.stat().st_uid:
            self.stamp(entry["blob"])
        return "ready"

    def link(self, manifest: dict[str, Any], entry: dict[str, Any]) -> None:
        """snapshots/<commit>/<path> -> ../../blobs/<blob>: relative, as huggingface_hub links."""
        link = self.snapshot(manifest["commit"], entry["path"])
        _makedirs(link.parent)
        target = os.path.relpath(self.blob(entry["blob"]), link.parent)
        if link.is_symlink() and str(link.readlink()) == target:
            return
        tmp = link.with_name(f"{link.name}.tmp{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        tmp.replace(link)

    def snapshot(self, commit: str, path: str) -> Path:
        return self.root / "snapshots" / check_commit(commit) / check_path(path)

    def set_ref(self, revision: str, commit: str) -> None:
        if revision != commit:
            _write_atomic(self.root / "refs" / check_revision(revision), commit.encode())


def digest_file(path: Path, lfs: bool) -> str:
    """The blob name a file's content gives: its sha256 (LFS) or its git blob oid."""
    with path.open("rb") as file:
        digest = _new_digest(lfs, os.fstat(file.fileno()).st_size)
        _feed(digest, file)
        return str(digest.hexdigest())


def _new_digest(lfs: bool, size: int) -> Any:
    # git names a blob by the sha1 of its header and content: a name, not a security check
    return hashlib.sha256() if lfs else hashlib.sha1(b"blob %d\0" % size)  # noqa: S324


def _feed(digest: Any, file: Any) -> None:
    for chunk in iter(lambda: file.read(CHUNK), b""):
        digest.update(chunk)


# ---------------------------------------------------------------- talking to a hub
class _HubRedirects(urllib.request.HTTPRedirectHandler):
    """A hub's redirects (to its CDN): only to https, or back to the hub itself; the token is
    dropped when the host changes. Anything else (an internal http URL) is refused."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        was, goes = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if goes.scheme != "https" and (goes.scheme, goes.netloc) != (was.scheme, was.netloc):
            raise urllib.error.HTTPError(
                req.full_url,
                code,
                f"redirected to {newurl}: refused (a hub may redirect only to https or to itself)",
                headers,
                fp,
            )
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and goes.netloc != was.netloc:
            new.headers.pop("Authorization", None)
            new.unredirected_hdrs.pop("Authorization", None)
        return new


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A peer never redirects: a 3xx from a peer is refused, as it could point this root fetch
    at any address the host reaches (and have its answer served on to the fleet)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise urllib.error.HTTPError(
            req.full_url, code, f"answered with a redirect to {newurl}: refused", headers, fp
        )


_OPENER = urllib.request.build_opener(_HubRedirects())
# No proxy between two hosts of the fleet (the peer checks the address it sees), no redirect.
_PEER_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())


def _open(url: str, headers: dict[str, str], timeout: float = 60.0) -> Any:
    if urllib.parse.urlsplit(url).scheme not in {"http", "https"}:
        raise ValueError(f"{url!r}: only http and https sources are fetched from")
    request = urllib.request.Request(url, headers=headers)  # noqa: S310  # scheme checked above
    return _OPENER.open(request, timeout=timeout)


def open_peer(
    url: str, key: str, headers: dict[str, str] | None = None, timeout: float = 300.0
) -> Any:
    """GET from a peer of the prefetch: plain http to a fleet address, the request signed with
    the prefetch key (pdctl/onhost/peer_auth.py), no redirect followed."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.netloc:
        raise ValueError(f"{url!r} is not a peer's URL")
    signed = {
        **(headers or {}),
        "Authorization": sign_request(key, "GET", parts.netloc, parts.path),
    }
    request = urllib.request.Request(url, headers=signed)  # noqa: S310  # scheme checked above
    return _PEER_OPENER.open(request, timeout=timeout)


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def hub_manifest(endpoint: str, repo: str, revision: str, token: str | None) -> dict[str, Any]:
    """The model's commit and files as the hub lists them (model info, then its tree)."""
    quoted = urllib.parse.quote(check_repo_id(repo), safe="/")
    base = endpoint.rstrip("/")
    with _open(
        f"{base}/api/models/{quoted}/revision/{check_revision(revision)}", _auth(token)
    ) as r:
        commit = check_commit(json.loads(r.read()).get("sha"))
    url: str | None = f"{base}/api/models/{quoted}/tree/{commit}?recursive=true"
    files = []
    while url:
        with _open(url, _auth(token)) as response:
            entries = json.loads(response.read())
            url = _next_link(response.headers.get("Link"), base)
        if not isinstance(entries, list):
            raise ValueError("the hub's file list is not a list")
        for entry in entries:
            if not isinstance(entry, dict) or entry.get("type") != "file":
                continue
            lfs = entry.get("lfs") if isinstance(entry.get("lfs"), dict) else None
            files.append(
                {
                    "path": entry.get("path"),
                    "size": (lfs or entry).get("size"),
                    "blob": (lfs or {}).get("oid") or entry.get("oid"),
                    "lfs": lfs is not None,
                }
            )
    return check_manifest({"repo": repo, "commit": commit, "files": files})


def _next_link(header: str | None, base: str) -> str | None:
    """The next page of a paginated list (the hub's ``Link: <url>; rel="next"``), on the hub."""
    match = re.search(r'<([^>]+)>;\s*rel="next"', header or "")
    if not match:
        return None
    url = urllib.parse.urljoin(base + "/", match.group(1))
    same = urllib.parse.urlsplit(url).netloc == urllib.parse.urlsplit(base).netloc
    return url if same else None


def resolve_url(endpoint: str, repo: str, commit: str, path: str) -> str:
    quoted = urllib.parse.quote(check_repo_id(repo), safe="/")
    file = urllib.parse.quote(check_path(path))
    return f"{endpoint.rstrip('/')}/{quoted}/resolve/{check_commit(commit)}/{file}"


# ---------------------------------------------------------------- downloading one file
class ContentMismatch(ValueError):
    """Bytes that are not the listed file's (another checksum, more than its size)."""


class SourceFault(RuntimeError):
    """A file its source kept sending wrong (other bytes, a redirect): the source's doing."""


class Fetcher:
    """Downloads a model's missing files into the cache from one source (the hub or a peer),
    resuming partial files, verifying each and fetching a corrupt one again."""

    def __init__(
        self,
        cache: Cache,
        manifest: dict[str, Any],
        source: dict[str, Any],
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        self.cache, self.manifest, self.source, self.emit = cache, manifest, source, emit
        self.total = sum(f["size"] for f in manifest["files"])
        self.have = 0  # bytes in the cache, verified or being written
        self.fetched = 0  # bytes this run took from its source
        self.started = time.monotonic()
        self._said = 0.0

    def _request(self, entry: dict[str, Any], offset: int) -> Any:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        if self.source["kind"] == "dir":
            mirror = Cache(self.source["path"], self.manifest["repo"])
            return _FileResponse(mirror.blob(entry["blob"]), offset)
        if self.source["kind"] == "hub":
            url = resolve_url(
                self.source["endpoint"],
                self.manifest["repo"],
                self.manifest["commit"],
                entry["path"],
            )
            headers.update(_auth(self.source.get("token")))
        else:
            url = f"{self.source['url'].rstrip('/')}/blobs/{entry['blob']}"
            return open_peer(url, self.source["secret"], headers)
        return _open(url, headers, timeout=300.0)

    def progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._said < PROGRESS_EVERY:
            return
        self._said = now
        elapsed = max(now - self.started, 1e-6)
        rate = self.fetched / elapsed
        left = self.total - self.have
        self.emit(
            {
                "event": "progress",
                "bytes": self.have,
                "total": self.total,
                "fetched": self.fetched,
                "rate": rate,
                "eta": (left / rate) if rate > 0 else None,
            }
        )

    def _download(self, entry: dict[str, Any]) -> None:
        blob = self.cache.blob(entry["blob"])
        partial = self.cache.partial(entry["blob"])
        offset = partial.stat().st_size if partial.exists() else 0
        if offset > entry["size"]:
            partial.unlink()
            offset = 0
        self.have += offset
        with self._request(entry, offset) as response:
            if offset and response.status != 206:  # the source ignored the range: start over
                self.have -= offset
                offset = 0
            # Hashed as it arrives (a resumed file's head first): no second read of the blob.
            digest = _new_digest(entry["lfs"], entry["size"])
            if offset:
                with partial.open("rb") as head:
                    _feed(digest, head)
            with partial.open("ab" if offset else "wb") as out:
                partial.chmod(0o644)
                while True:
                    chunk = response.read(CHUNK)
                    if not chunk:
                        break
                    if offset + len(chunk) > entry["size"]:
                        raise ContentMismatch(
                            f"{entry['path']}: the source sent more than its size"
                        )
                    out.write(chunk)
                    out.flush()  # a peer streams it from here to the next host
                    digest.update(chunk)
                    offset += len(chunk)
                    self.have += len(chunk)
                    self.fetched += len(chunk)
                    self.progress()
        if offset != entry["size"]:
            raise ValueError(f"{entry['path']}: got {offset} of {entry['size']} bytes")
        if digest.hexdigest() != entry["blob"]:
            partial.unlink()
            self.have -= offset
            raise ContentMismatch(f"{entry['path']}: checksum mismatch (corrupt download)")
        partial.replace(blob)
        self.cache.stamp(entry["blob"])

    def fetch_one(self, entry: dict[str, Any]) -> None:
        state = self.cache.state(entry, deep=True)
        if state == "corrupt":
            self.cache.blob(entry["blob"]).unlink()
        if state == "ready":
            self.have += entry["size"]
        else:
            error, fault = "", False
            for _attempt in range(RETRIES):
                try:
                    self._download(entry)
                    error = ""
                    break
                except (OSError, ValueError, http.client.HTTPException) as exc:
                    error = _reason(exc)
                    fault = isinstance(exc, ContentMismatch) or (
                        isinstance(exc, urllib.error.HTTPError) and 300 <= exc.code < 400
                    )
                    self.have = self._recount(entry)
                    if isinstance(exc, urllib.error.HTTPError):  # refused: start clean next time
                        self.cache.partial(entry["blob"]).unlink(missing_ok=True)
                    time.sleep(0.5)
            if error:
                raise (SourceFault if fault else RuntimeError)(f"{entry['path']}: {error}")
        self.cache.link(self.manifest, entry)

    def _recount(self, entry: dict[str, Any]) -> int:
        """Bytes of the cache so far: files done, plus what this one's partial holds."""
        done = 0
        for other in self.manifest["files"]:
            if other is entry:
                break
            done += other["size"]
        partial = self.cache.partial(entry["blob"])
        return done + (partial.stat().st_size if partial.exists() else 0)

    def run(self, revision: str) -> None:
        for entry in self.manifest["files"]:
            self.fetch_one(entry)
        self.cache.set_ref(revision, self.manifest["commit"])
        self.progress(force=True)


class _FileResponse:
    """A blob of a local mirror read as a download (from ``offset``, like a Range)."""

    def __init__(self, path: Path, offset: int) -> None:
        self.file = path.open("rb")
        self.file.seek(offset)
        self.status = 206 if offset else 200

    def __enter__(self) -> _FileResponse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def read(self, size: int) -> bytes:
        return bytes(self.file.read(size))


def dir_manifest(root: str, repo: str, revision: str) -> dict[str, Any]:
    """The file list of a model in a local mirror: another hub cache (an NFS copy, a disk),
    read as huggingface_hub would: refs/<revision> -> snapshots/<commit>/<path> -> blob.
    Only the links' blob names are used: the blobs are read from the mirror's blobs/."""
    mirror = Cache(root, repo)
    commit = revision if COMMIT.match(revision) else mirror.ref(revision)
    if commit is None:
        raise RuntimeError(f"the mirror {root} has no {repo} at {revision}")
    recorded = mirror.manifest(commit)
    if recorded is not None:
        return recorded
    snapshot = mirror.root / "snapshots" / commit
    files = []
    for folder, _dirs, names in os.walk(snapshot):  # links to folders are not followed
        for name in names:
            link = Path(folder, name)
            blob = link.readlink().name if link.is_symlink() else ""
            files.append(
                {
                    "path": link.relative_to(snapshot).as_posix(),
                    "size": mirror.blob(blob).stat().st_size,
                    "blob": blob,
                    "lfs": len(blob) == 64,
                }
            )
    if not files:
        raise RuntimeError(f"the mirror {root} has no files of {repo} at {commit}")
    return check_manifest({"repo": repo, "commit": commit, "files": files})


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return str(exc)


# ---------------------------------------------------------------- serving peers
def _addresses(names: list[str]) -> set[str]:
    """The IP addresses of the fleet's hosts (an inventory may name them)."""
    found: set[str] = set()
    for name in names:
        try:
            found.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except OSError:
            continue
    return found


class Peer:
    """A host's HTTP server for the prefetch's peers: only the fleet's addresses are let in (an
    address outside it is closed before any thread starts), at most ``max_connections`` at once,
    each silent at most ``read_timeout`` seconds, and only requests signed with the one-time key
    (pdctl/onhost/peer_auth.py) are answered, for the prefetch's duration. What it serves is a
    subclass's ``serve`` (the model's blobs here, worker images in pdctl/onhost/image_fetch.py)."""

    protocol_version = "HTTP/1.0"
    max_connections = 32  # the chain needs one at a time, the image tree one per round
    read_timeout = 30.0  # seconds: a connection that sends or takes nothing for this long ends

    def __init__(self, bind: str, allow: list[str], secret: str) -> None:
        self.allow = _addresses(allow)
        server = self
        slots = threading.BoundedSemaphore(self.max_connections)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = server.protocol_version
            timeout = server.read_timeout

            def log_message(self, format: str, *args: Any) -> None:
                return  # no request logs (they would land in pdctl's stdout)

            def do_GET(self) -> None:
                server.handle(self)

        family = socket.AF_INET6 if ":" in bind else socket.AF_INET

        class Server(http.server.ThreadingHTTPServer):
            address_family = family
            daemon_threads = True
            # socketserver's backlog is 5: a burst of connections (strangers the accepting
            # thread closes, or many peers at once) overflowed it, and the kernel dropped the
            # next SYNs, a fleet host's among them, for a 1 s (then 3 s, 7 s) retransmit.
            request_queue_size = 128

            def verify_request(self, request: Any, client_address: Any) -> bool:
                # In the accepting thread: a stranger, or one connection too many, is closed
                # here and costs no thread.
                return client_address[0] in server.allow and slots.acquire(blocking=False)

            def process_request(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    slots.release()  # no thread started: give its place back
                    raise

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self.httpd = Server((bind, 0), Handler)
        self.port = self.httpd.server_address[1]
        self.verifier = RequestVerifier(secret, authority(bind, self.port))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, request: http.server.BaseHTTPRequestHandler) -> None:
        signed = self.verifier.allows(
            request.headers.get("Authorization"), request.command, request.path
        )
        if request.client_address[0] not in self.allow or not signed:
            request.send_error(403, "not a host of this prefetch")
            return
        self.serve(request)

    def serve(self, request: http.server.BaseHTTPRequestHandler) -> None:
        raise NotImplementedError


class PeerServer(Peer):
    """Serves the blobs of one model, read-only, to the fleet's hosts holding the one-time
    secret, while this host's prefetch runs. A blob still being written is streamed as it
    grows (a pipeline: the next host need not wait for the whole file)."""

    def __init__(self, cache: Cache, bind: str, allow: list[str], secret: str) -> None:
        self.cache = cache
        self.expected: dict[str, int] = {}  # blob -> size, once the manifest is known
        self.ordered = threading.Event()  # this host has its order (or will never get one)
        self.done = threading.Event()  # this host's fetch ended (ok or not)
        self.failed = False
        super().__init__(bind, allow, secret)

    def serve(self, request: http.server.BaseHTTPRequestHandler) -> None:
        # pdctl orders every host at once: the next host may ask before this one has its list
        self.ordered.wait(ORDER_WAIT)
        match = re.match(r"^/blobs/([0-9a-f]{40}|[0-9a-f]{64})\Z", request.path)
        size = self.expected.get(match.group(1)) if match else None
        if match is None or size is None:
            request.send_error(404, "no such blob")
            return
        offset = 0
        wanted = request.headers.get("Range")
        if wanted:
            got = re.match(r"^bytes=(\d+)-\Z", wanted)
            if not got or int(got.group(1)) > size:
                request.send_error(416, "bad range")
                return
            offset = int(got.group(1))
        file = self._open(match.group(1))
        if file is None:
            request.send_error(503, "this host could not fetch it")
            return
        with file:
            request.send_response(206 if offset else 200)
            request.send_header("Content-Length", str(size - offset))
            if offset:
                request.send_header("Content-Range", f"bytes {offset}-{size - 1}/{size}")
            request.end_headers()
            self._stream(file, offset, size, request)

    def _open(self, name: str) -> Any:
        """The blob, or its partial download (waited for while this host's fetch runs)."""
        while True:
            for path in (self.cache.blob(name), self.cache.partial(name)):
                try:
                    return path.open("rb")
                except OSError:
                    continue
            if self.done.is_set():
                return None
            time.sleep(WAIT_STEP)

    def _stream(self, file: Any, offset: int, size: int, request: Any) -> None:
        file.seek(offset)
        sent = offset
        while sent < size:
            chunk = file.read(min(CHUNK, size - sent))
            if not chunk:
                if self.failed or (self.done.is_set() and os.fstat(file.fileno()).st_size < size):
                    return  # the writer gave up: the client sees a short body and retries
                if os.fstat(file.fileno()).st_nlink == 0:
                    return  # deleted (corrupt): the client's checksum fails, it retries
                time.sleep(WAIT_STEP)
                continue
            try:
                request.wfile.write(chunk)
            except OSError:
                return
            sent += len(chunk)


# ---------------------------------------------------------------- the ops
LOCK_WAIT = 10.0  # seconds: the previous fetcher of this cache may still be on its way out


def _lock(cache: Cache) -> Any:
    cache.prepare()
    handle = (cache.records / "lock").open("w")
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError:
            if time.monotonic() >= deadline:
                handle.close()
                raise RuntimeError(f"another prefetch of {cache.repo} runs on this host") from None
            time.sleep(0.1)


def _busy(cache: Cache) -> bool:
    try:
        with (cache.records / "lock").open() as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
    except OSError:
        return False
    return False


def check(request: dict[str, Any]) -> dict[str, Any]:
    """What the cache holds of a model: ready | fetching | missing | corrupt, per file too."""
    cache = Cache(request["cache"], request["repo"])
    revision = check_revision(request["revision"])
    commit = revision if COMMIT.match(revision) else cache.ref(revision)
    manifest = cache.manifest(commit) if commit else None
    if manifest is None:
        state = "fetching" if _busy(cache) else "missing"
        return {"state": state, "commit": commit, "bytes": None, "files": {}}
    files = {}
    for entry in manifest["files"]:
        files[entry["path"]] = cache.state(entry, deep=bool(request.get("deep", True)))
        link = cache.snapshot(manifest["commit"], entry["path"])
        if files[entry["path"]] == "ready" and not link.is_file():
            files[entry["path"]] = "missing"
    states = set(files.values())
    if states <= {"ready"}:
        state = "ready"
    elif _busy(cache):
        state = "fetching"
    elif "corrupt" in states:
        state = "corrupt"
    else:
        state = "missing"
    total = sum(entry["size"] for entry in manifest["files"])
    return {"state": state, "commit": manifest["commit"], "bytes": total, "files": files}


class Session:
    """One host's part of a prefetch, driven by pdctl over stdin/stdout (see main())."""

    def __init__(self, request: dict[str, Any], out: Any) -> None:
        self.out = out
        self._out_lock = threading.Lock()
        self.cache = Cache(request["cache"], request["repo"])
        self.revision = check_revision(request["revision"])
        self.server = PeerServer(self.cache, request["bind"], request["allow"], request["secret"])
        self.secret = request["secret"]
        self.mirror = request.get("mirror")  # a mirror directory on the hosts (offline fleets)
        self.masker = Masker([self.secret])

    def emit(self, doc: dict[str, Any]) -> None:
        with self._out_lock:
            self.out.write(json.dumps(self.masker.doc(doc)) + "\n")
            self.out.flush()

    def hello(self) -> None:
        """What this host holds of the model, and (offline) the mirror's file list as it reads
        it: claims pdctl checks, never a file list it hands on as they are."""
        commit = self.revision if COMMIT.match(self.revision) else self.cache.ref(self.revision)
        manifest = self.cache.manifest(commit) if commit else None
        complete = manifest is not None and all(
            self.cache.state(e, deep=False) == "ready" for e in manifest["files"]
        )
        doc: dict[str, Any] = {
            "event": "hello",
            "port": self.server.port,
            "commit": commit,
            "complete": complete,
            "manifest": manifest,
        }
        if isinstance(self.mirror, str):
            try:
                doc["mirror"] = {
                    "manifest": dir_manifest(self.mirror, self.cache.repo, self.revision)
                }
            except (OSError, ValueError, RuntimeError) as exc:
                doc["mirror"] = {"error": _reason(exc)}
        self.emit(doc)

    def run(self, order: dict[str, Any]) -> None:
        """Fetch what the cache lacks of the file list pdctl sends (the hub's, as pdctl asked
        it, or the one every holder agreed on) from the source it names."""
        source = order.get("source")
        if source is not None and source["kind"] == "peer":
            source = {**source, "secret": self.secret}
        if source is not None and source["kind"] == "hub":
            self.masker.add(source.get("token"))
        if order.get("manifest") is None:
            raise RuntimeError("pdctl sent no file list")
        manifest = check_manifest(order["manifest"])
        if manifest["repo"] != self.cache.repo:
            raise RuntimeError(f"the file list is {manifest['repo']}'s, not {self.cache.repo}'s")
        self.server.expected = {f["blob"]: f["size"] for f in manifest["files"]}
        self.server.ordered.set()
        self.cache.save_manifest(manifest)
        self.emit({"event": "manifest", "commit": manifest["commit"]})
        fetcher = Fetcher(self.cache, manifest, source or {"kind": "none"}, self.emit)
        if source is None:
            for entry in manifest["files"]:
                if self.cache.state(entry, deep=True) != "ready":
                    raise RuntimeError(f"{entry['path']}: not in the cache, and no source given")
        fetcher.run(self.revision)
        self.emit(
            {
                "event": "done",
                "bytes": fetcher.total,
                "fetched": fetcher.fetched,
                "seconds": time.monotonic() - fetcher.started,
            }
        )


def _serve_session(stdin: Any, stdout: Any, request: dict[str, Any]) -> int:
    session = Session(request, stdout)
    handle = _lock(session.cache)
    session.server.start()
    try:
        session.hello()
        order = json.loads(stdin.readline() or "null")
        if order is None:
            return 0
        try:
            session.run(order)
        except (OSError, ValueError, RuntimeError, http.client.HTTPException) as exc:
            session.server.failed = True
            error = {"event": "error", "message": _reason(exc)}
            if isinstance(exc, SourceFault):
                error["fault"] = "source"  # what the source sent was not the listed file
            session.emit(error)
            return 1
        finally:
            session.server.ordered.set()
            session.server.done.set()
        stdin.readline()  # serve peers until pdctl says stop (or hangs up)
        return 0
    finally:
        session.server.stop()
        handle.close()


Op = Callable[[Any, Any, dict[str, Any]], int]  # (stdin, stdout, request) -> exit status


def main(ops: dict[str, Op] | None = None) -> int:
    """One JSON request line on stdin: ``{"op": "check", ...}`` prints the cache's state;
    ``{"op": "fetch", ...}`` is a prefetch session: it prints ``hello`` (its peer port and what
    it holds), reads its order (source, file list), prints progress, ``done`` or ``error``,
    then serves peers until the next line (or EOF). ``ops`` adds other sessions by name
    (pdctl/onhost/image_fetch.py's ``images``), in the same run."""
    os.umask(0o022)
    stdin, stdout = sys.stdin, sys.stdout
    masker = Masker()
    try:
        request = json.loads(stdin.readline())
        masker.add(request.get("secret"))
        if request.get("op") == "check":
            stdout.write(json.dumps(check(request)) + "\n")
            return 0
        if ops and request.get("op") in ops:
            return ops[request["op"]](stdin, stdout, request)
        return _serve_session(stdin, stdout, request)
    except (OSError, ValueError, RuntimeError, KeyError, http.client.HTTPException) as exc:
        message = masker.text(_reason(exc))
        stdout.write(json.dumps({"event": "error", "message": message}) + "\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
