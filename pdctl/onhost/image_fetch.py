"""A host's worker images: say which it holds, take one (from a peer, a registry or an archive),
serve the ones it holds to peers. The image part of the prefetch
(pdctl/operations/image_prefetch.py).

Runs on the hosts as the prefetch's entry (``python3 -m pdctl.onhost.image_fetch``, shipped by
pdctl/onhost/bundle.py; pdctl/operations/prefetch.py runs it), which serves model_fetch's
sessions too, on the same transport: model_fetch's ``Peer`` (the fleet's addresses only, signed
requests, for the prefetch's duration) and its JSON lines on stdin/stdout
(``{"op": "images", ...}``).

Images move as ``RUNTIME save REF``, then ``RUNTIME load`` (docs/facts.md, "Container images:
save and load"): the holder streams the archive of exactly the image asked for over HTTP
(chunked: a cut stream is seen as one); the taker spools it to a root-only file no larger than
the image, reads it (pdctl/onhost/image_archive.py: one image, named only REF, whose config has the
digest pdctl expects: never what the holder says) and only then loads it; the names a take
could move are put back when it fails. Image references reach a runtime as argv elements only.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from pdctl.onhost.image_archive import check_image_ref, inspect_archive, ref_names
from pdctl.onhost.model_fetch import CHUNK, PROGRESS_EVERY, Peer, _reason, main, open_peer
from pdctl.onhost.secret_mask import Masker

RUNTIMES = ("podman", "docker")
_IMAGE_ID = re.compile(r"^(?:sha256:)?([0-9a-f]{64})\Z")
HEARTBEAT = 2.0  # seconds between two progress lines while a pull or a load runs
# The archive a peer may send: the image's size as pdctl knows it, plus room for the tar's
# headers and the image's metadata (a larger stream is cut off, not spooled on).
SPOOL_SLACK = 64 << 20
# Where podman's own load from stdin would spool it (docs/facts.md); the spool is a fresh
# mkdtemp directory in it (0700, unique), so a shared /var/tmp is fine.
SPOOL_DIR = "/var/tmp"  # noqa: S108


def image_id_hex(value: Any) -> str:
    """An image ID as podman (bare hex) and docker (``sha256:`` hex) print it, as bare hex."""
    match = _IMAGE_ID.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not an image ID")
    return match.group(1)


def pick_runtime(engine: str) -> str:
    """The runtime as pd_runtime picks it: ``auto`` is podman when on PATH, else docker."""
    found = [name for name in RUNTIMES if shutil.which(name)]
    if engine == "auto":
        if not found:
            raise RuntimeError(
                "no container runtime (neither podman nor docker is on PATH); install podman"
            )
        return found[0]
    if engine not in RUNTIMES:
        raise ValueError(f"{engine!r} is not a container runtime (podman, docker or auto)")
    if engine not in found:
        raise RuntimeError(f"{engine} is not installed; install it or set pdctl.runtime")
    return engine


def _tail(file: Any) -> str:
    file.seek(0)
    lines = file.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def inspect_image(runtime: str, ref: str) -> dict[str, Any] | None:
    """What the runtime holds under ``ref``: its ID, its layers' diff IDs and its size (None:
    it holds no such image). Present is decided as pd_runtime decides it (podman's ``image
    exists``, docker's ``image inspect`` exit 1)."""
    check_image_ref(ref)
    if runtime == "podman":
        exists = subprocess.run(
            ["podman", "image", "exists", ref], capture_output=True, check=False
        ).returncode
        if exists == 1:
            return None
        if exists != 0:
            raise RuntimeError(f"podman cannot tell whether {ref} is present (exit {exists})")
    done = subprocess.run([runtime, "image", "inspect", ref], capture_output=True, check=False)
    if done.returncode == 1 and runtime == "docker":
        return None
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeError(f"{runtime} image inspect {ref}: {message[-1] if message else '?'}")
    doc = json.loads(done.stdout)
    entry = doc[0] if isinstance(doc, list) and doc else doc
    layers = (entry.get("RootFS") or {}).get("Layers") or []
    return {
        "id": image_id_hex(entry.get("Id")),
        "layers": [str(layer) for layer in layers],
        "size": int(entry.get("Size") or 0),
    }


def same_image(expected: str, got: dict[str, Any], runtime: str, diff_ids: Any = None) -> bool:
    """Whether the image a take left under its name is the expected one (an image ID as pdctl
    knows it from a trusted source, never from the host that gave it): the same ID, which for
    podman and docker's classic store is the digest of the image's config. docker's containerd
    store names an image by a manifest digest instead; there the loaded layers must be those of
    the archive this host read before loading it (its config had the expected digest)."""
    if got["id"] == expected:
        return True
    return runtime == "docker" and bool(diff_ids) and got["layers"] == diff_ids


def save_argv(runtime: str, ref: str) -> list[str]:
    """The archive of exactly ``ref`` on stdout: podman's docker-archive (its default, and the
    format that keeps the image ID), docker's own (the only one it writes)."""
    check_image_ref(ref)
    if runtime == "podman":
        return ["podman", "save", "--quiet", "--format", "docker-archive", ref]
    return ["docker", "save", ref]


def load_argv(runtime: str, archive: str | None = None) -> list[str]:
    """``load`` from stdin, or from an archive on the host."""
    argv = [runtime, "load", "--quiet"]
    return [*argv, "--input", archive] if archive else argv


class ImageServer(Peer):
    """Streams ``save`` of an image to a peer: only an image this host's request named and this
    host holds, asked for by its ID (what the taker checks it against)."""

    protocol_version = "HTTP/1.1"  # chunked: a stream cut short is told from a whole one

    def __init__(
        self, runtime: str, refs: list[str], bind: str, allow: list[str], secret: str
    ) -> None:
        self.runtime, self.refs = runtime, [check_image_ref(r) for r in refs]
        self.held: dict[str, str] = {}  # image ID (hex) -> the reference it is served as
        self._held_lock = threading.Lock()
        super().__init__(bind, allow, secret)

    def hold(self, ref: str, found: dict[str, Any] | None) -> None:
        if ref in self.refs and found is not None:
            with self._held_lock:
                self.held.setdefault(found["id"], ref)

    def serve(self, request: http.server.BaseHTTPRequestHandler) -> None:
        request.close_connection = True
        match = re.match(r"^/images/([0-9a-f]{64})\Z", request.path)
        with self._held_lock:
            ref = self.held.get(match.group(1)) if match else None
        if ref is None:
            request.send_error(404, "not an image of this prefetch")
            return
        with tempfile.TemporaryFile() as errors:
            save = subprocess.Popen(
                save_argv(self.runtime, ref), stdout=subprocess.PIPE, stderr=errors
            )
            try:
                request.send_response(200)
                request.send_header("Content-Type", "application/x-tar")
                request.send_header("Transfer-Encoding", "chunked")
                request.send_header("Connection", "close")
                request.end_headers()
                assert save.stdout is not None
                for chunk in iter(lambda: save.stdout.read(CHUNK), b""):  # type: ignore[union-attr]
                    request.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if save.wait() == 0:
                    request.wfile.write(b"0\r\n\r\n")  # the end: only after a whole archive
            except OSError:
                pass  # the taker hung up: it says so itself
            finally:
                if save.poll() is None:
                    save.kill()
                save.wait()


class _Taking:
    """Progress of one take, said every PROGRESS_EVERY seconds."""

    def __init__(self, ref: str, total: int, emit: Any) -> None:
        self.ref, self.total, self.emit = ref, total, emit
        self.bytes = 0
        self.started = time.monotonic()
        self._said = 0.0

    def say(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._said < PROGRESS_EVERY:
            return
        self._said = now
        elapsed = max(now - self.started, 1e-6)
        self.emit(
            {
                "event": "progress",
                "image": self.ref,
                "bytes": self.bytes,
                "total": self.total,
                "rate": self.bytes / elapsed,
                "seconds": elapsed,
            }
        )


def _wait(proc: subprocess.Popen[bytes], taking: _Taking) -> int:
    """The exit status, saying all along that it still runs (a pull, a load of many GB)."""
    while True:
        try:
            return proc.wait(timeout=HEARTBEAT)
        except subprocess.TimeoutExpired:
            taking.say(force=True)


def _run_quietly(argv: list[str], taking: _Taking) -> None:
    """Run a pull or an archive load (no bytes to count)."""
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=errors, stderr=errors)
        status = _wait(proc, taking)
        if status != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} exited {status}: {_tail(errors)}")


def _spool_dir() -> str:
    return os.environ.get("TMPDIR") or SPOOL_DIR


def _take_from_peer(
    runtime: str, ref: str, url: str, key: str, expected: str, taking: _Taking
) -> list[str]:
    """GET the holder's archive into a root-only file no larger than the image, read it
    (pdctl/onhost/image_archive.py), then load it: the layers' diff IDs of what was loaded."""
    cap = taking.total + taking.total // 4 + SPOOL_SLACK
    folder = tempfile.mkdtemp(prefix="pdctl-image-", dir=_spool_dir())  # 0700, root's
    path = Path(folder, "image.tar")
    try:
        with open_peer(url, key) as response:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as out:
                for chunk in iter(lambda: response.read(CHUNK), b""):
                    taking.bytes += len(chunk)
                    if taking.bytes > cap:
                        raise RuntimeError(
                            f"the holder sent more than the image's size ({cap} bytes): refused"
                        )
                    out.write(chunk)
                    taking.say()
        diff_ids = inspect_archive(str(path), ref, expected, runtime)
        _run_quietly(load_argv(runtime, str(path)), taking)
        return diff_ids
    except http.client.HTTPException:
        raise RuntimeError(
            f"the holder's stream broke off after {taking.bytes} bytes "
            "(its save failed, or it went away)"
        ) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _names_now(runtime: str, ref: str) -> dict[str, str | None]:
    """The image ID under each name a take of ``ref`` may move (None: no image): the names in
    full (a short name given to ``tag`` would make one more)."""
    return {name: (inspect_image(runtime, name) or {}).get("id") for name in sorted(ref_names(ref))}


def _put_back(runtime: str, before: dict[str, str | None]) -> str:
    """Give each name the image it named before a failed take (or none): what could not be."""
    stuck = []
    for name, old in before.items():
        try:
            if (inspect_image(runtime, name) or {}).get("id") == old:
                continue
        except (OSError, ValueError, RuntimeError):
            pass
        argv = [runtime, "tag", old, name] if old else [runtime, "rmi", name]
        done = subprocess.run(argv, capture_output=True, check=False)
        if done.returncode != 0:
            message = done.stderr.decode(errors="replace").strip().splitlines()
            stuck.append(f"{' '.join(argv)}: {message[-1] if message else done.returncode}")
    return "; ".join(stuck)


def check_take(order: Any, refs: list[str]) -> tuple[str, dict[str, Any]]:
    """An order to take an image: one of the session's images, from a peer (an http URL and
    the image ID it holds), an archive (an absolute path) or the registry."""
    ref = check_image_ref(order.get("take") if isinstance(order, dict) else None)
    if ref not in refs:
        raise ValueError(f"{ref} is not an image of this prefetch")
    source = order.get("source")
    kind = source.get("kind") if isinstance(source, dict) else None
    if kind == "peer":
        url = str(source["url"]).rstrip("/")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.path or parts.query:
            raise ValueError(f"{url!r} is not a peer's URL")
        expect = source.get("expect") if isinstance(source.get("expect"), dict) else {}
        size = expect.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{size!r} is not an image size")
        return ref, {
            **source,
            "url": url,
            "expect": {"id": image_id_hex(expect.get("id")), "size": size},
        }
    if kind == "archive":
        path = source.get("path")
        if not isinstance(path, str) or not path.startswith("/") or "/../" in path + "/":
            raise ValueError(f"{path!r} is not an absolute path")
        return ref, source
    if kind == "registry":
        return ref, source
    raise ValueError(f"{kind!r} is not an image source")


class ImageSession:
    """One host's part of an image prefetch, driven by pdctl over stdin/stdout."""

    def __init__(self, request: dict[str, Any], out: Any) -> None:
        self.out = out
        self._out_lock = threading.Lock()
        self.refs = [check_image_ref(r) for r in request["images"]]
        self.runtime = pick_runtime(str(request.get("runtime") or "auto"))
        self.secret = str(request["secret"])
        self.masker = Masker([self.secret])
        self.server = ImageServer(
            self.runtime, self.refs, request["bind"], request["allow"], self.secret
        )

    def emit(self, doc: dict[str, Any]) -> None:
        with self._out_lock:
            self.out.write(json.dumps(self.masker.doc(doc)) + "\n")
            self.out.flush()

    def hello(self) -> None:
        held = {}
        for ref in self.refs:
            held[ref] = inspect_image(self.runtime, ref)
            self.server.hold(ref, held[ref])
        self.emit(
            {"event": "hello", "port": self.server.port, "runtime": self.runtime, "images": held}
        )

    def take(self, order: dict[str, Any]) -> None:
        """Take one image (``{"take": REF, "source": ...}``): ``took`` with what was loaded,
        or ``failed`` with the cause, the names it could have moved put back; the session
        goes on either way. ``source.expect.id`` is the image pdctl expects (from a trusted
        source): a peer's archive is checked against it before it is loaded."""
        ref, source = check_take(order, self.refs)
        expect: dict[str, Any] = source.get("expect") or {}
        expected = image_id_hex(expect["id"]) if expect.get("id") else None
        taking = _Taking(ref, int(expect.get("size") or 0), self.emit)
        before: dict[str, str | None] | None = None
        try:
            before = _names_now(self.runtime, ref)
            diff_ids = None
            if source["kind"] == "peer" and expected:
                url = f"{source['url']}/images/{expected}"
                diff_ids = _take_from_peer(self.runtime, ref, url, self.secret, expected, taking)
            elif source["kind"] == "archive":
                _run_quietly(load_argv(self.runtime, source["path"]), taking)
            else:
                _run_quietly([self.runtime, "pull", "--quiet", ref], taking)
            got = inspect_image(self.runtime, ref)
            if got is None:
                raise RuntimeError(f"the {source['kind']} did not hold {ref}")
            if expected and not same_image(expected, got, self.runtime, diff_ids):
                raise RuntimeError(
                    f"loaded another image than expected: ID {got['id'][:12]}, "
                    f"expected {expected[:12]}"
                )
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            message = _reason(exc)
            stuck = _put_back(self.runtime, before) if before is not None else ""
            if stuck:
                message += f" (and the names it may have moved could not be put back: {stuck})"
            self.emit({"event": "failed", "image": ref, "message": message})
            return
        taking.say(force=True)
        self.server.hold(ref, got)
        elapsed = time.monotonic() - taking.started
        self.emit(
            {"event": "took", "image": ref, "found": got, "bytes": taking.bytes, "seconds": elapsed}
        )


def serve_images(stdin: Any, stdout: Any, request: dict[str, Any]) -> int:
    """The ``images`` op: ``hello`` (the runtime, what it holds, the peer port), then one order
    per line (``{"take": REF, "source": ...}``) until ``{"stop": true}`` or EOF, serving peers
    all along."""
    session = ImageSession(request, stdout)
    session.server.start()
    try:
        session.hello()
        for line in iter(stdin.readline, ""):
            order = json.loads(line)
            if not isinstance(order, dict) or order.get("stop"):
                break
            session.take(order)
        return 0
    finally:
        session.server.stop()


def host_main() -> int:
    return main({"images": serve_images})


if __name__ == "__main__":
    sys.exit(host_main())
