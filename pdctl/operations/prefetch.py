"""Fill the hosts' model cache before the units start: one download, fanned out in the fleet.

pdctl itself asks the hub for the model's commit and file list (every file with its size and
checksum); that list is what every host fetches and checks bytes against, whoever sends them.
Offline (a mirror directory on the hosts) or with the hub out of pdctl's reach, the list comes
from the hosts, and every host that reports one must report the same, else nothing moves.

Every host with a slot (spares too) runs pdctl/onhost/model_fetch.py over SSH, as root, its
bundle and a one-time key on stdin (never in an argv or a log). Each says what its cache holds (a
claim, checked against the list); pdctl then chains them: the first (one whose cache holds
that list whole, if any) takes what it lacks from the hub (the only host that gets the hub
token), and each next host takes every file from the host before it, streaming a file while
that host still writes it, so the hub sends each file once and the total time grows with the
hop count only by a file's head start. The peers serve blobs to the fleet's hosts only, to
signed requests, for the prefetch's duration. Whatever a host says passes a masker that knows
the plan's secrets before pdctl prints it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import paramiko

from pdctl.core.errors import HostError
from pdctl.core.plan import Plan
from pdctl.doors import model_list, ssh
from pdctl.doors import service as services
from pdctl.doors.session import Session
from pdctl.onhost import bundle
from pdctl.onhost.secret_mask import Masker

Progress = Callable[[str], None]
# What each host runs: the image fetcher, whose main serves model_fetch's sessions too.
FETCHER = "pdctl.onhost.image_fetch"
# The bundle, then the requests, come on stdin (pdctl/onhost/bundle.py): the argv holds the
# loader's fixed line only.
COMMAND = bundle.command(FETCHER, become=True)
REPORT_EVERY = 5.0  # seconds between two progress lines per host on the terminal
# The longest a fetcher may stay silent (it says its progress twice a second while it fetches;
# hashing a large blob it found in its cache is the longest silence).
READ_TIMEOUT = 600.0


def script_input() -> bytes:
    """What a fetcher reads first: the loader and the bundle (its requests follow)."""
    return bundle.stdin(FETCHER)


@dataclass
class Request:
    repo: str
    revision: str
    cache: str
    endpoint: str
    token: str | None = None  # sent to the one host that contacts the hub
    secrets: tuple[str, ...] = ()  # every secret value of the plan: masked in what hosts say


@dataclass
class HostRun:
    name: str
    address: str
    state: str = "starting"  # starting | fetching | ready | failed
    port: int | None = None
    claim: dict[str, Any] | None = None  # the list its cache holds whole, as it says
    mirror: dict[str, Any] | None = None  # the mirror's list as it reads it (offline)
    mirror_error: str | None = None
    holds: bool = False  # its claim is the trusted list: it heads the chain
    source: str = ""
    bytes: int = 0
    total: int = 0
    fetched: int = 0
    rate: float = 0.0
    eta: float | None = None
    seconds: float = 0.0
    error: str | None = None
    fault: bool = False  # what its source sent was not the listed file
    cut_off: bool = False  # failed after the host it took the model from failed
    reported: float = field(default_factory=time.monotonic)  # the first line after a while
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
    """One host's fetcher, started with the loader: JSON lines to its stdin, from its stdout.
    Every string it reads back passes ``masker`` (the prefetch sets it: the plan's secrets)."""

    def __init__(self, stdin: Any, stdout: Any, stderr: Any) -> None:
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.masker = Masker()
        self.stdin.write(script_input())
        self.stdin.flush()

    def send(self, doc: dict[str, Any] | None) -> None:
        self.stdin.write((json.dumps(doc) + "\n").encode())
        self.stdin.flush()

    def receive(self) -> dict[str, Any] | None:
        line = self.stdout.readline()
        if not line:
            return None
        doc = self.masker.doc(json.loads(line))
        return doc if isinstance(doc, dict) else None

    def last_error(self) -> str:
        try:
            text = self.stderr.read()
        except OSError:
            text = b""
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        lines = self.masker.text(text).strip().splitlines()
        return lines[-1] if lines else "the fetcher ended without a word"

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.stdin.close()


Opener = Callable[[str], Channel]  # host name -> its fetcher, started


def masked(open_channel: Opener, masker: Masker) -> Opener:
    """The same fetchers, each reading back through ``masker``."""

    def open_masked(host: str) -> Channel:
        channel = open_channel(host)
        channel.masker = masker
        return channel

    return open_masked


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


def _follow(run: HostRun, channel: Channel, progress: Progress) -> None:
    """Read a host's events until it is done or fails."""
    try:
        while True:
            doc = channel.receive()
            if doc is None:
                run.state, run.error = "failed", channel.last_error()
                return
            event = doc.get("event")
            if event == "progress":
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
                run.fault = doc.get("fault") == "source"
                return
    except (OSError, ValueError, KeyError, TypeError) as exc:
        run.state, run.error = "failed", f"lost the fetcher: {exc}"
    finally:
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
            **({"mirror": request.endpoint} if _offline(request) else {}),
        }
    )
    return channel


def _hello(run: HostRun, channel: Channel) -> None:
    doc = channel.receive()
    if doc is None or doc.get("event") != "hello":
        message = (doc or {}).get("message") or channel.last_error()
        raise HostError(f"{run.name}: the model fetcher did not start: {message}")
    run.port = int(doc["port"])
    run.claim = model_list.checked(doc.get("manifest")) if doc.get("complete") else None
    mirror = doc.get("mirror")
    if isinstance(mirror, dict):
        run.mirror = model_list.checked(mirror.get("manifest"))
        run.mirror_error = None if run.mirror else str(mirror.get("error") or "no file list")


def _offline(request: Request) -> bool:
    """A mirror directory on the hosts (a path), not a hub."""
    return request.endpoint.startswith("/")


def prefetch(
    open_channel: Opener, hosts: dict[str, str], request: Request, progress: Progress
) -> dict[str, Any]:
    """Fill the cache on every host (name -> its address on the fleet's network); the
    per-host report (HostError when any host failed).

    A host that fails mid-chain cuts off the hosts after it; they take the model again, from a
    host that has it now, in a second chain that puts the hosts that failed by themselves
    last: so one bad host fails only itself. A host that sent bytes that are not the listed
    file's is no source in the second chain (its hosts take the model from the hub)."""
    started = time.monotonic()
    masker = Masker([*request.secrets, request.token])
    opener = masked(open_channel, masker)
    trusted = None
    if not _offline(request):
        trusted = model_list.from_hub(
            request.endpoint, request.repo, request.revision, request.token, masker
        )
        if trusted is None:
            progress(
                f"model {request.repo}@{request.revision}: the hub {request.endpoint} cannot be "
                "reached from here: the hosts that hold the model must agree on its files"
            )
    runs, trusted = _fill(opener, hosts, list(hosts), request, progress, masker, trusted)
    failed = [r for r in runs if r.state != "ready"]
    suspects = {r.source for r in failed if r.fault and r.source in hosts}
    for run in failed:
        if run.fault and run.source in hosts:
            progress(
                f"model on {run.name}: {run.source} sent what is not the listed file "
                f"({run.error}): {run.source} is no source again"
            )
    ready = [r for r in runs if r.state == "ready" and r.name not in suspects]
    if failed and (ready or suspects):
        cut_off = [r for r in failed if r.cut_off]
        head = [ready[0].name] if ready else []
        order = [*head, *(r.name for r in cut_off), *(r.name for r in failed if not r.cut_off)]
        origin = head[0] if head else ("the mirror" if _offline(request) else "the hub")
        progress(
            f"model {request.repo}: {len(failed)} host(s) did not get it; "
            f"taking it again from {origin}"
        )
        again, _ = _fill(
            opener, {n: hosts[n] for n in order}, order, request, progress, masker, trusted
        )
        retried = {r.name: r for r in again if r.name not in head}
        runs = [retried.get(r.name, r) for r in runs]
    failed = [r for r in runs if r.state != "ready"]
    if failed:
        raise HostError(
            "model prefetch failed: " + "; ".join(_failure(r) for r in failed),
            hint="check the fleet's model_endpoint (pdctl fleet show) and the hosts' disk",
        )
    return {
        "repo": request.repo,
        "revision": request.revision,
        "commit": trusted["commit"],
        "bytes": sum(f["size"] for f in trusted["files"]),
        "seconds": round(time.monotonic() - started, 2),
        "hosts": {r.name: r.report() for r in runs},
    }


def _failure(run: HostRun) -> str:
    """One host's failure, with the host it took the model from when that host is to blame."""
    if run.fault:
        return f"{run.name}: {run.error}, in what {run.source} sent"
    return f"{run.name}: {run.error}"


def _fill(
    open_channel: Opener,
    hosts: dict[str, str],
    order: list[str],
    request: Request,
    progress: Progress,
    masker: Masker,
    trusted: dict[str, Any] | None,
) -> tuple[list[HostRun], dict[str, Any]]:
    """One chain over ``hosts`` (holders of the trusted list first, then in ``order``): every
    run, and the list it fetched (``trusted``, or the one the hosts agreed on)."""
    runs = [HostRun(name=name, address=hosts[name]) for name in order]
    secret = secrets.token_urlsafe(32)
    masker.add(secret)
    allow = sorted({r.address for r in runs})
    channels: dict[str, Channel] = {}
    try:
        for run in runs:
            channels[run.name] = _start(open_channel, run, request, allow, secret)
        for run in runs:
            _hello(run, channels[run.name])
        if trusted is None:
            trusted = _agreed(runs, request)
        _judge(runs, trusted, request, progress)
        chain = sorted(runs, key=lambda r: not r.holds)
        progress(
            f"model {request.repo}@{request.revision}: "
            f"{sum(r.holds for r in runs)} of {len(runs)} host(s) hold it; "
            f"{_head_name(request)} {request.endpoint} -> {' -> '.join(r.name for r in chain)}"
        )
        _run_chain(chain, channels, request, trusted, progress)
    finally:
        for channel in channels.values():
            with contextlib.suppress(OSError, EOFError):
                channel.send({"stop": True})
            channel.close()
    return runs, trusted


def _head_name(request: Request) -> str:
    return "mirror" if _offline(request) else "hub"


def _agreed(runs: list[HostRun], request: Request) -> dict[str, Any]:
    """Without the hub's list: the one every host that reports a list (its cache's, or the
    mirror's as it reads it) reports."""
    claims = [model_list.Claim(r.name, "the mirror", r.mirror) for r in runs if r.mirror]
    claims += [model_list.Claim(r.name, "its cache", r.claim) for r in runs if r.claim]
    if _offline(request):
        why = "; ".join(f"{r.name}: {r.mirror_error}" for r in runs if r.mirror_error)
        why_none = f"no host reads it in the mirror {request.endpoint} ({why or 'no answer'})"
    else:
        why_none = f"the hub {request.endpoint} cannot be reached from here, and no host holds it"
    return model_list.agreed(claims, f"model {request.repo}@{request.revision}", why_none)


def _judge(
    runs: list[HostRun], trusted: dict[str, Any], request: Request, progress: Progress
) -> None:
    """Which hosts hold the trusted list: only they may head the chain. A host whose cache
    claims another list for the revision is said, and fetches the trusted one like the rest."""
    for run in runs:
        run.holds = run.claim is not None and model_list.same(run.claim, trusted)
        if run.claim is not None and not run.holds:
            progress(
                f"model on {run.name}: its cache says {request.repo}@{request.revision} is "
                f"{model_list.describe(run.claim)}, not the trusted "
                f"{model_list.describe(trusted)}: not used; {run.name} takes the trusted files"
            )


def _run_chain(
    chain: list[HostRun],
    channels: dict[str, Channel],
    request: Request,
    trusted: dict[str, Any],
    progress: Progress,
) -> None:
    head = chain[0]
    head.source = _head_name(request)
    total = sum(f["size"] for f in trusted["files"])
    threads = []
    for upstream, run in zip([None, *chain[:-1]], chain, strict=True):
        run.total = total
        if upstream is None:
            source = _head_source(request)
        else:
            run.source = upstream.name
            source = {"kind": "peer", "url": f"http://{_host(upstream.address)}:{upstream.port}"}
        channels[run.name].send({"source": source, "manifest": trusted})
        thread = threading.Thread(
            target=_follow, args=(run, channels[run.name], progress), daemon=True
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    for upstream, run in itertools.pairwise(chain):
        run.cut_off = run.state == "failed" and upstream.state == "failed" and not run.fault
    for run in chain:
        if run.state == "ready":
            progress(
                f"model on {run.name}: ready, {_mb(run.fetched)} fetched from {run.source} "
                f"in {run.seconds:.1f} s"
            )


def _head_source(request: Request) -> dict[str, Any]:
    """The hub (its token with it), or a local mirror on the hosts (a path: no token)."""
    if _offline(request):
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
        secrets=tuple(services.secret_values(plan).values()),
    )


def model_hosts(plan: Plan) -> list[str]:
    """Every host with a slot of the plan, spares included: the scaler may start any."""
    return sorted({slot.host for slot in plan.slots()}, key=plan.hosts().index)


def for_plan(session: Session, plan: Plan, progress: Progress) -> dict[str, Any] | None:
    """Fill the cache of every host with a slot before the units start (None: no model)."""
    request = plan_request(plan, session.fleet(plan.fleet).settings.model_endpoint)
    if request is None:
        return None
    opener, addresses = fleet_channels(session, plan)
    return prefetch(opener, addresses, request, progress)


def fleet_channels(session: Session, plan: Plan) -> tuple[Opener, dict[str, str]]:
    """How to start the fetcher on each host with a slot of the plan (over the session's
    pool), and their addresses."""
    fleet = session.fleet(plan.fleet)
    hosts = model_hosts(plan)
    for name in hosts:
        if fleet.host(name) is None:
            raise HostError(f"host {name} of the plan is no longer in fleet {plan.fleet}")
    targets = session.targets(plan.fleet, hosts)
    opener = ssh_opener(session.pool(plan.fleet), targets)
    return opener, {name: targets[name].address for name in hosts}


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
