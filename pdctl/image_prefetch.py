"""Put each worker image on every host that runs it before the units start: taken once, then
spread inside the fleet.

Every host with a slot runs pdctl/image_fetch.py (shipped in the prefetch script, as root, the
secret on stdin) and says which of the plan's images its runtime holds (the runtime as
pd_runtime picks it: pdctl.runtime, auto = podman when present, else docker). For each image,
the hosts that hold it are its sources; when none does, one host takes it the usual way (pulls
it from its registry, or loads it from pdctl.image_archive when the plan sets one). Then the
hosts that lack it take it from one that has it (``save`` streamed into ``load``), as a tree:
each round every holder serves one more host, so the holders double each round and no one
host serves them all. A host that takes an image checks that it got the holder's image (its
ID) and serves it from then on. pd_runtime then finds nothing missing.

Images pinned by digest (``name@sha256:...``) are left to pd_runtime's pull on each host: an
archive does not keep the registry's manifest, so the digest would not name the loaded image.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paramiko

from pdctl import prefetch, validate
from pdctl.errors import HostError
from pdctl.plan import WORKER_ROLES, Plan
from pdctl.workspace import Workspace

Progress = Callable[[str], None]
REPORT_EVERY = prefetch.REPORT_EVERY


@dataclass
class Take:
    """One image on one host."""

    state: str = "missing"  # present (held before) | taking | ready (taken) | failed
    source: str = ""  # a host's name, "registry" or "archive" ("" when it was there)
    bytes: int = 0
    total: int = 0
    rate: float = 0.0
    seconds: float = 0.0
    id: str = ""
    error: str | None = None
    reported: float = field(default_factory=time.monotonic)

    def report(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "source": self.source,
            "bytes": self.bytes,
            "rate": round(self.rate),
            "seconds": round(self.seconds, 2),
            "id": self.id,
            **({"error": self.error} if self.error else {}),
        }


@dataclass
class Agent:
    """One host's image session: its channel, its peer port, its runtime, what it holds."""

    name: str
    address: str
    channel: prefetch.Channel
    port: int = 0
    runtime: str = ""
    held: dict[str, dict[str, Any] | None] = field(default_factory=dict)


def next_round(holders: list[str], pending: list[str]) -> list[tuple[str, str]]:
    """This round's transfers: each holder serves the next host that lacks the image."""
    return list(zip(holders, pending, strict=False))


def fanned_out(ref: str) -> bool:
    """Whether an image can be spread by save and load (not one pinned by digest)."""
    return "@" not in ref


def plan_images(plan: Plan) -> dict[str, list[str]]:
    """Each worker image of the plan -> the hosts with a slot that runs it (spares too), as
    pd_runtime's pd_runtime_images lists them per host."""
    needs: dict[str, list[str]] = {}
    for role in WORKER_ROLES:
        group = plan.groups[role]
        for slot in group.slots:
            hosts = needs.setdefault(validate.image(group.image), [])
            if slot.host not in hosts:
                hosts.append(slot.host)
    order = plan.hosts()
    return {ref: sorted(hosts, key=order.index) for ref, hosts in needs.items()}


def _mb(value: float) -> str:
    return f"{value / 1e6:.0f} MB"


def _start(
    open_channel: prefetch.Opener,
    hosts: dict[str, str],
    refs: list[str],
    runtime: str,
    secret: str,
) -> dict[str, Agent]:
    agents: dict[str, Agent] = {}
    allow = sorted(set(hosts.values()))
    for name, address in hosts.items():
        channel = open_channel(name)
        agents[name] = Agent(name=name, address=address, channel=channel)
        channel.send(
            {
                "op": "images",
                "images": refs,
                "runtime": runtime,
                "bind": address,
                "allow": allow,
                "secret": secret,
            }
        )
    for agent in agents.values():
        doc = agent.channel.receive()
        if doc is None or doc.get("event") != "hello":
            message = (doc or {}).get("message") or agent.channel.last_error()
            raise HostError(
                f"{agent.name}: the image fetcher did not start: {message}",
                hint="install the container runtime the spec names (pdctl.runtime) on the host",
            )
        agent.port, agent.runtime = int(doc["port"]), str(doc["runtime"])
        agent.held = dict(doc.get("images") or {})
    return agents


def _url(agent: Agent) -> str:
    host = f"[{agent.address}]" if ":" in agent.address else agent.address
    return f"http://{host}:{agent.port}"


def _take(
    agent: Agent, ref: str, source: dict[str, Any], take: Take, progress: Progress
) -> dict[str, Any] | None:
    """Order one take and follow it to its end: what the host then holds (None: it failed)."""
    take.state = "taking"
    try:
        agent.channel.send({"take": ref, "source": source})
        while True:
            doc = agent.channel.receive()
            if doc is None:
                take.state, take.error = "failed", agent.channel.last_error()
                return None
            event = doc.get("event")
            if event == "progress":
                take.bytes, take.total = int(doc["bytes"]), int(doc["total"])
                take.rate, take.seconds = float(doc["rate"]), float(doc["seconds"])
                now = time.monotonic()
                if now - take.reported >= REPORT_EVERY:
                    take.reported = now
                    size = f" of {_mb(take.total)}" if take.total else ""
                    progress(
                        f"image {ref} on {agent.name}: {_mb(take.bytes)}{size}, "
                        f"{take.rate / 1e6:.1f} MB/s from {take.source}, {take.seconds:.0f} s"
                    )
            elif event == "took":
                found = dict(doc["found"])
                take.state, take.id = "ready", str(found["id"])
                take.bytes, take.seconds = int(doc["bytes"]), float(doc["seconds"])
                take.rate = take.bytes / take.seconds if take.seconds > 0 else 0.0
                agent.held[ref] = found
                progress(
                    f"image {ref} on {agent.name}: ready, {_mb(take.bytes)} from {take.source} "
                    f"in {take.seconds:.1f} s"
                )
                return found
            elif event in {"failed", "error"}:
                take.state, take.error = "failed", str(doc.get("message"))
                return None
    except (OSError, ValueError, KeyError, TypeError, EOFError, paramiko.SSHException) as exc:
        take.state, take.error = "failed", f"lost the image fetcher: {exc}"
        return None


def _first_take(archive: str | None) -> tuple[str, dict[str, Any]]:
    """How the one host takes an image no host holds: as pd_runtime would take it."""
    if archive:
        return "archive", {"kind": "archive", "path": validate.host_path(archive)}
    return "registry", {"kind": "registry"}


def _spread(
    agents: dict[str, Agent],
    ref: str,
    needers: list[str],
    archive: str | None,
    progress: Progress,
) -> dict[str, Take]:
    """One image onto every host in ``needers``: from its holders, in rounds."""
    takes: dict[str, Take] = {}
    held = {name: found for name, agent in agents.items() if (found := agent.held.get(ref))}
    holders = list(held)
    for name, found in held.items():
        takes[name] = Take(state="present", id=str(found["id"]))
    pending = [name for name in needers if name not in holders]
    for name in pending:
        takes[name] = Take()
    ids = {takes[name].id for name in holders}
    if len(ids) > 1:
        progress(
            f"image {ref}: the hosts holding it hold different images under that name "
            f"({', '.join(sorted(i[:12] for i in ids))}); each taker gets its source's"
        )
    if not pending:
        return takes
    if not holders:
        first = pending.pop(0)
        kind, source = _first_take(archive)
        takes[first].source = kind
        progress(
            f"image {ref}: no host holds it; {first} takes it from the {kind}, "
            f"then {len(pending)} host(s) from peers"
        )
        if _take(agents[first], ref, source, takes[first], progress) is None:
            for name in pending:
                takes[name].state = "failed"
                takes[name].error = f"no source: {first} could not take it from the {kind}"
            return takes
        holders = [first]
    else:
        progress(f"image {ref}: {len(holders)} host(s) hold it, {len(pending)} take it from peers")
    while pending:
        pairs = next_round(holders, pending)
        pending = pending[len(pairs) :]
        threads = []
        for upstream, name in pairs:
            giver = agents[upstream]
            found = giver.held[ref] or {}
            takes[name].source = upstream
            source = {
                "kind": "peer",
                "url": _url(giver),
                "runtime": giver.runtime,
                "expect": {"id": found["id"], "layers": found["layers"], "size": found["size"]},
            }
            thread = threading.Thread(
                target=_take, args=(agents[name], ref, source, takes[name], progress), daemon=True
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        holders += [name for _, name in pairs if takes[name].state == "ready"]
    return takes


def _fix(take: Take, ref: str, runtime: str) -> str:
    """What to do about one failed take."""
    if take.source == "registry":
        return (
            f"make {ref}'s registry reachable from the hosts, or set pdctl.image_archive to an "
            f"archive on them, or load it on one host ({runtime} load -i FILE) and re-run: "
            "pdctl copies it to the others"
        )
    if take.source == "archive":
        return "put the archive (pdctl.image_archive) on the host, holding that image"
    if take.error and "another image" in take.error:
        return (
            f"the hosts hold different images named {ref}: remove the stale ones "
            f"({runtime} rmi {ref}) or pin the image by digest, and re-run"
        )
    if take.error and take.error.startswith("no source"):
        return "fix the first host's cause; the others then take it from it"
    return (
        "check that the hosts reach each other on the fleet's addresses (a firewall?) and the "
        "disk for the image, and re-run: hosts that got it serve it next time"
    )


def spread(
    open_channel: prefetch.Opener,
    hosts: dict[str, str],
    needs: dict[str, list[str]],
    progress: Progress,
    *,
    runtime: str = "auto",
    archive: str | None = None,
) -> dict[str, Any]:
    """Every image of ``needs`` (image -> hosts that run it) onto its hosts (name -> address on
    the fleet's network); per image and host what happened (HostError when any host failed)."""
    refs = [ref for ref in needs if fanned_out(ref)]
    doc: dict[str, Any] = {}
    for ref in needs:
        if not fanned_out(ref):
            doc[ref] = {"skipped": "pinned by digest: each host pulls it (pd_runtime)"}
            progress(f"image {ref}: pinned by digest, each host pulls it")
    if not refs:
        return doc
    secret = secrets.token_urlsafe(32)
    agents: dict[str, Agent] = {}
    errors: list[str] = []
    fixes: dict[str, None] = {}
    try:
        agents = _start(open_channel, hosts, refs, runtime, secret)
        for ref in refs:
            started = time.monotonic()
            takes = _spread(agents, ref, needs[ref], archive, progress)
            holder = next((a.held[ref] for a in agents.values() if a.held.get(ref)), None)
            doc[ref] = {
                "id": (holder or {}).get("id"),
                "bytes": (holder or {}).get("size"),
                "seconds": round(time.monotonic() - started, 2),
                "hosts": {name: take.report() for name, take in takes.items()},
            }
            for name, take in takes.items():
                if take.state == "failed":
                    errors.append(f"{name}: {ref} from {take.source or '-'}: {take.error}")
                    fixes[_fix(take, ref, agents[name].runtime or "podman")] = None
    finally:
        for agent in agents.values():
            with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
                agent.channel.send({"stop": True})
            agent.channel.close()
    if errors:
        raise HostError(
            "image prefetch failed: " + "; ".join(errors), hint="; ".join(fixes), images=doc
        )
    return doc


def for_plan(workspace: Workspace, plan: Plan, progress: Progress) -> dict[str, Any] | None:
    """Every worker image on every host with a slot before the units start (None: no slot)."""
    needs = plan_images(plan)
    if not needs:
        return None
    with prefetch.fleet_channels(workspace, plan) as (opener, addresses):
        return spread(
            opener,
            addresses,
            needs,
            progress,
            runtime=plan.runtime,
            archive=plan.image_archive,
        )
