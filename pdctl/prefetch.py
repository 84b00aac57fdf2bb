"""Fill the hosts' model cache before the units start: one download, fanned out in the fleet.

Every host with a slot (spares too) runs pdctl/model_fetch.py over SSH, as root, its source
and a one-time secret on stdin (never in an argv or a log). Each says what its cache holds;
pdctl then chains them: the first (one that holds the model, if any) resolves the model at
the hub (the only host that gets the hub token), and each next host takes every file from
the host before it, streaming a file while that host still writes it, so the hub sends each
file once and the total time grows with the hop count only by a file's head start. The peers
serve blobs to the fleet's hosts only, for the prefetch's duration.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import secrets
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

from pdctl import hf_layout, hub_errors, image_fetch, inventory, model_fetch, ssh
from pdctl import service as services
from pdctl.errors import HostError
from pdctl.plan import Plan
from pdctl.workspace import Workspace

Progress = Callable[[str], None]
# One script: hf_layout's source, then model_fetch's, then image_fetch's (whose last lines run
# it), without their imports of each other, and without model_fetch's own entry point.
_SHIPPED = (hf_layout, model_fetch, image_fetch)
_PDCTL_IMPORT = re.compile(
    r"^from __future__ import annotations\n|^from pdctl\.\w+ import (?:\([^)]*\)|[^\n]*)\n",
    flags=re.MULTILINE,
)


def _joined(modules: tuple[Any, ...]) -> str:
    return "from __future__ import annotations\n" + "".join(
        _PDCTL_IMPORT.sub("", Path(module.__file__ or "").read_text()) for module in modules
    )


# The hub client alone (hf_layout and model_fetch as one module): the lab's worker image
# carries it (pdctl/lab/worker_tree.py) to download a model the way pdctl's fetcher does.
SCRIPT = _joined((hf_layout, model_fetch))
_SOURCE = _joined(_SHIPPED).replace('if __name__ == "__main__":\n    sys.exit(main())\n', "")
# The argv holds this fixed loader only: the script, then the requests, come on stdin.
_LOADER = (
    "import sys;n=int(sys.stdin.buffer.readline());"
    "exec(compile(sys.stdin.buffer.read(n),'pdctl-model-fetch','exec'))"
)
COMMAND = f"sudo -n python3 -c {shlex.quote(_LOADER)}"
REPORT_EVERY = 5.0  # seconds between two progress lines per host on the terminal
# The longest a fetcher may stay silent (it says its progress twice a second while it fetches;
# hashing a large blob it found in its cache is the longest silence).
READ_TIMEOUT = 600.0


def script_input() -> bytes:
    """What the loader reads first: the script's length, then the script."""
    data = _SOURCE.encode()
    return str(len(data)).encode() + b"\n" + data


@dataclass
class Request:
    repo: str
    revision: str
    cache: str
    endpoint: str
    token: str | None = None  # sent to the one host that contacts the hub


@dataclass
class HostRun:
    name: str
    address: str
    state: str = "starting"  # starting | fetching | ready | failed
    port: int | None = None
    complete: bool = False
    manifest: dict[str, Any] | None = None
    source: str = ""
    bytes: int = 0
    total: int = 0
    fetched: int = 0
    rate: float = 0.0
    eta: float | None = None
    seconds: float = 0.0
    error: str | None = None
    hub: dict[str, Any] | None = None  # the hub's refusal, as the fetcher reported it
    cut_off: bool = False  # failed after the host it took the model from failed
    reported: float = field(default_factory=time.monotonic)  # the first line after a while
    manifest_ready: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    def report(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "source": self.source,
            "bytes": self.bytes,
            "total": self.total,
            "fetched": self.fetched,
            "rate": round(self.rate),
            "seconds": round(self.seconds, 2),
            **({"error": self.error} if self.error else {}),
        }


class Channel:
    """One host's fetcher, started with the loader: JSON lines to its stdin, from its stdout."""

    def __init__(self, stdin: Any, stdout: Any, stderr: Any) -> None:
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.stdin.write(script_input())
        self.stdin.flush()

    def send(self, doc: dict[str, Any] | None) -> None:
        self.stdin.write((json.dumps(doc) + "\n").encode())
        self.stdin.flush()

    def receive(self) -> dict[str, Any] | None:
        line = self.stdout.readline()
        if not line:
            return None
        doc = json.loads(line)
        return doc if isinstance(doc, dict) else None

    def last_error(self) -> str:
        try:
            text = self.stderr.read()
        except OSError:
            text = b""
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        lines = text.strip().splitlines()
        return lines[-1] if lines else "the fetcher ended without a word"

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.stdin.close()


Opener = Callable[[str], Channel]  # host name -> its fetcher, started


def ssh_opener(pool: ssh.Pool, targets: dict[str, ssh.Target]) -> Opener:
    """Start the fetcher on a host over the pool's SSH connection (as root, through sudo)."""

    def open_channel(host: str) -> Channel:
        with pool.session(targets[host]) as client:
            stdin, stdout, stderr = client.exec_command(COMMAND)
        stdout.channel.settimeout(READ_TIMEOUT)
        return Channel(stdin, stdout, stderr)

    return open_channel


def _mb(value: float) -> str:
    return f"{value / 1e6:.0f} MB"


def _line(run: HostRun) -> str:
    eta = f", ETA {run.eta:.0f} s" if run.eta is not None and run.state == "fetching" else ""
    return (
        f"model on {run.name}: {_mb(run.bytes)} of {_mb(run.total)}, "
        f"{run.rate / 1e6:.1f} MB/s from {run.source or '-'}{eta}"
    )


def _order(runs: list[HostRun]) -> list[HostRun]:
    """The chain: hosts that hold the model first (they need nothing), then the rest."""
    return sorted(runs, key=lambda r: not r.complete)


def _follow(run: HostRun, channel: Channel, progress: Progress) -> None:
    """Read a host's events until it is done or fails."""
    try:
        while True:
            doc = channel.receive()
            if doc is None:
                run.state, run.error = "failed", channel.last_error()
                return
            event = doc.get("event")
            if event == "manifest":
                run.manifest = doc.get("manifest")
                run.total = sum(f["size"] for f in (run.manifest or {}).get("files", []))
                run.manifest_ready.set()
            elif event == "progress":
                run.bytes, run.total = int(doc["bytes"]), int(doc["total"])
                run.fetched, run.rate, run.eta = int(doc["fetched"]), float(doc["rate"]), doc["eta"]
                now = time.monotonic()
                if now - run.reported >= REPORT_EVERY:
                    run.reported = now
                    progress(_line(run))
            elif event == "done":
                run.state, run.seconds = "ready", float(doc["seconds"])
                run.bytes, run.fetched = int(doc["bytes"]), int(doc["fetched"])
                return
            elif event == "error":
                run.state, run.error = "failed", str(doc.get("message"))
                run.hub = doc.get("hub") if isinstance(doc.get("hub"), dict) else None
                return
    except (OSError, ValueError, KeyError, TypeError) as exc:
        run.state, run.error = "failed", f"lost the fetcher: {exc}"
    finally:
        run.manifest_ready.set()
        run.finished.set()


def _start(
    open_channel: Opener, run: HostRun, request: Request, allow: list[str], secret: str
) -> Channel:
    channel = open_channel(run.name)
    channel.send(
        {
            "op": "fetch",
            "cache": request.cache,
            "repo": request.repo,
            "revision": request.revision,
            "bind": run.address,
            "allow": allow,
            "secret": secret,
        }
    )
    return channel


def _hello(run: HostRun, channel: Channel) -> None:
    doc = channel.receive()
    if doc is None or doc.get("event") != "hello":
        message = (doc or {}).get("message") or channel.last_error()
        raise HostError(f"{run.name}: the model fetcher did not start: {message}")
    run.port, run.complete = int(doc["port"]), bool(doc.get("complete"))


def prefetch(
    open_channel: Opener, hosts: dict[str, str], request: Request, progress: Progress
) -> dict[str, Any]:
    """Fill the cache on every host (name -> its address on the fleet's network); the
    per-host report (HostError when any host failed).

    A host that fails mid-chain cuts off the hosts after it; they take the model again, from a
    host that has it now, in a second chain that puts the hosts that failed by themselves
    last: so one bad host fails only itself."""
    started = time.monotonic()
    runs, chain = _fill(open_channel, hosts, list(hosts), request, progress)
    failed = [r for r in runs if r.state != "ready"]
    ready = [r for r in runs if r.state == "ready"]
    if failed and ready:
        cut_off = [r for r in failed if r.cut_off]
        order = [
            ready[0].name,
            *(r.name for r in cut_off),
            *(r.name for r in failed if not r.cut_off),
        ]
        progress(
            f"model {request.repo}: {len(failed)} host(s) did not get it; "
            f"taking it again from {ready[0].name}"
        )
        again, _ = _fill(open_channel, {n: hosts[n] for n in order}, order, request, progress)
        retried = {r.name: r for r in again[1:]}
        runs = [retried.get(r.name, r) for r in runs]
    failed = [r for r in runs if r.state != "ready"]
    _raise_hub_refusal(failed, request)
    if failed:
        raise HostError(
            "model prefetch failed: " + "; ".join(f"{r.name}: {r.error}" for r in failed),
            hint="check the fleet's model_endpoint (pdctl fleet show) and the hosts' disk",
        )
    return {
        "repo": request.repo,
        "revision": request.revision,
        "commit": (chain[0].manifest or {}).get("commit"),
        "bytes": chain[0].total,
        "seconds": round(time.monotonic() - started, 2),
        "hosts": {r.name: r.report() for r in runs},
    }


def _raise_hub_refusal(failed: list[HostRun], request: Request) -> None:
    """The hub refused the model (no such model or revision, a token it does not accept):
    one line the user acts on, not a host failure."""
    for run in failed:
        report = run.hub or {}
        status, code, error = report.get("status"), report.get("code"), report.get("error")
        if not isinstance(status, int) or not isinstance(code, str | None):
            continue
        found = hub_errors.describe(status, code, error if isinstance(error, str) else None)
        refused = found and hub_errors.refusal(
            found, request.endpoint, request.repo, request.revision, bool(request.token)
        )
        if refused:
            raise refused


def _fill(
    open_channel: Opener,
    hosts: dict[str, str],
    order: list[str],
    request: Request,
    progress: Progress,
) -> tuple[list[HostRun], list[HostRun]]:
    """One chain over ``hosts`` (holders first, then in ``order``): every run, and the chain."""
    runs = [HostRun(name=name, address=hosts[name]) for name in order]
    secret = secrets.token_urlsafe(32)
    allow = sorted({r.address for r in runs})
    channels: dict[str, Channel] = {}
    try:
        for run in runs:
            channels[run.name] = _start(open_channel, run, request, allow, secret)
        for run in runs:
            _hello(run, channels[run.name])
        chain = _order(runs)
        progress(
            f"model {request.repo}@{request.revision}: "
            f"{sum(r.complete for r in runs)} of {len(runs)} host(s) hold it; "
            f"hub {request.endpoint} -> {' -> '.join(r.name for r in chain)}"
        )
        _run_chain(chain, channels, request, progress)
    finally:
        for channel in channels.values():
            with contextlib.suppress(OSError, EOFError):
                channel.send({"stop": True})
            channel.close()
    return runs, chain


def _run_chain(
    chain: list[HostRun], channels: dict[str, Channel], request: Request, progress: Progress
) -> None:
    head = chain[0]
    source = _head_source(request)
    head.source = "hub" if source["kind"] == "hub" else "mirror"
    threads = [
        threading.Thread(target=_follow, args=(r, channels[r.name], progress), daemon=True)
        for r in chain
    ]
    channels[head.name].send({"source": source, "manifest": None})
    threads[0].start()
    head.manifest_ready.wait()
    if head.manifest is None:
        for run in chain[1:]:
            run.state, run.error = "failed", f"no file list: {head.name} failed first"
            run.cut_off = True
        threads[0].join()
        return
    for upstream, run, thread in zip(chain[:-1], chain[1:], threads[1:], strict=True):
        run.source = upstream.name
        channels[run.name].send(
            {
                "source": {
                    "kind": "peer",
                    "url": f"http://{_host(upstream.address)}:{upstream.port}",
                },
                "manifest": head.manifest,
            }
        )
        thread.start()
    for thread in threads:
        thread.join()
    for upstream, run in itertools.pairwise(chain):
        run.cut_off = run.state == "failed" and upstream.state == "failed"
    for run in chain:
        if run.state == "ready":
            progress(
                f"model on {run.name}: ready, {_mb(run.fetched)} fetched from {run.source} "
                f"in {run.seconds:.1f} s"
            )


def _head_source(request: Request) -> dict[str, Any]:
    """The hub (its token with it), or a local mirror on the hosts (a path: no token)."""
    if request.endpoint.startswith("/"):
        return {"kind": "dir", "path": request.endpoint}
    return {"kind": "hub", "endpoint": request.endpoint, "token": request.token}


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def check(open_channel: Opener, hosts: Iterable[str], request: Request) -> dict[str, Any]:
    """What each host's cache holds of the model (model_fetch.check), read in parallel."""
    doc = {"op": "check", "cache": request.cache, "repo": request.repo}

    def one(host: str) -> dict[str, Any]:
        try:
            channel = open_channel(host)
            channel.send({**doc, "revision": request.revision})
            channel.close()
            found = channel.receive()
        except (OSError, paramiko.SSHException, HostError, ValueError) as exc:
            return {"state": "unknown", "error": str(exc)}
        if not found or "state" not in found:
            return {"state": "unknown", "error": (found or {}).get("message", "no answer")}
        return found

    return ssh.at_once(list(hosts), one)


# ---------------------------------------------------------------- a plan's model
def plan_request(plan: Plan, endpoint: str) -> Request | None:
    """The plan's model as a request (None: the plan fetches none). The hub token is the
    spec's HF_TOKEN secret, from pdctl's environment like the other secrets."""
    if plan.model_repo is None or plan.model_cache is None:
        return None
    return Request(
        repo=plan.model_repo,
        revision=plan.model_revision or "main",
        cache=plan.model_cache,
        endpoint=endpoint,
        token=services.secret_values(plan).get("HF_TOKEN") or None,
    )


def model_hosts(plan: Plan) -> list[str]:
    """Every host with a slot of the plan, spares included: the scaler may start any."""
    return sorted({slot.host for slot in plan.slots()}, key=plan.hosts().index)


def for_plan(workspace: Workspace, plan: Plan, progress: Progress) -> dict[str, Any] | None:
    """Fill the cache of every host with a slot before the units start (None: no model)."""
    fleet = inventory.load(workspace, plan.fleet)
    request = plan_request(plan, fleet.settings.model_endpoint)
    if request is None:
        return None
    with fleet_channels(workspace, plan) as (opener, addresses):
        return prefetch(opener, addresses, request, progress)


@contextlib.contextmanager
def fleet_channels(workspace: Workspace, plan: Plan) -> Iterator[tuple[Opener, dict[str, str]]]:
    """How to start the fetcher on each host with a slot of the plan, and their addresses."""
    fleet = inventory.load(workspace, plan.fleet)
    hosts = model_hosts(plan)
    targets = {}
    for name in hosts:
        host = fleet.host(name)
        if host is None:
            raise HostError(f"host {name} of the plan is no longer in fleet {plan.fleet}")
        targets[name] = inventory.target(fleet, host)
    pool = ssh.Pool(ssh.KnownHosts(inventory.known_hosts_file(workspace, plan.fleet)), plan.fleet)
    try:
        yield ssh_opener(pool, targets), {name: targets[name].address for name in hosts}
    finally:
        pool.close()


def status(
    plan: Plan, endpoint: str, pool: ssh.Pool, targets: dict[str, ssh.Target]
) -> dict[str, Any] | None:
    """``pdctl status``'s ``model``: each slot host's cache, ready | fetching | missing |
    corrupt (unknown: the host could not be read)."""
    request = plan_request(plan, endpoint)
    if request is None:
        return None
    found = check(ssh_opener(pool, targets), model_hosts(plan), request)
    sizes = [doc.get("bytes") for doc in found.values() if doc.get("bytes")]
    return {
        "repo": request.repo,
        "revision": request.revision,
        "bytes": max(sizes) if sizes else None,
        "hosts": {host: str(doc.get("state")) for host, doc in found.items()},
    }
