"""Put each worker image on every host that runs it before the units start: taken once, then
spread inside the fleet.

Every host with a slot runs pdctl/onhost/image_fetch.py (shipped in the prefetch script, as root,
the one-time key on stdin) and says which of the plan's images its runtime holds (the runtime as
pd_runtime picks it: pdctl.runtime, auto = podman when present, else docker).

Which image a name must be comes from a trusted source, never from the host that gives it:
the operator's pin (pdctl.image_id), else the image the one host pdctl picks takes the usual
way (a pull from its registry, or pdctl.image_archive), else (hosts already hold it, no pin)
the image every holder holds: holders that disagree stop the image, named. The hosts that hold
the expected image are its sources; the hosts that lack it take it from one of them
(``save``, spooled, read, then ``load``), as a tree: each round every holder serves one more
host, so the holders double each round and no one host serves them all. A taker checks the
archive against the expected ID before it loads it, and serves the image from then on.
pd_runtime then finds nothing missing.

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

from pdctl.core import validate
from pdctl.core.errors import HostError
from pdctl.core.plan import WORKER_ROLES, Plan
from pdctl.doors import service as services
from pdctl.doors.session import Session
from pdctl.onhost.secret_mask import Masker
from pdctl.operations import prefetch

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
    the pd_runtime role finds them per host (its _pd_runtime_images)."""
    needs: dict[str, list[str]] = {}
    for role in WORKER_ROLES:
        group = plan.groups[role]
        for slot in group.slots:
            hosts = needs.setdefault(validate.image(group.image), [])
            if slot.host not in hosts:
                hosts.append(slot.host)
    order = plan.hosts()
    return {ref: sorted(hosts, key=order.index) for ref, hosts in needs.items()}


def plan_pins(plan: Plan) -> dict[str, str]:
    """Each worker image the operator pinned (pdctl.image_id) -> its ID, as 64 hex digits."""
    pins = {}
    for role in WORKER_ROLES:
        group = plan.groups[role]
        if group.image_id:
            pins[validate.image(group.image)] = validate.image_id(group.image_id).split(":")[1]
    return pins


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


def _expected(
    ref: str, held: dict[str, dict[str, Any]], pin: str | None, needers: list[str]
) -> tuple[str | None, dict[str, Take]]:
    """The image ``ref`` must be: the pin, else the one every holder holds (None: no holder).
    Holders that disagree fail every host that needs the image, each named with its ID."""
    if pin is not None or not held:
        return pin, {}
    ids = {str(found["id"]) for found in held.values()}
    if len(ids) == 1:
        return ids.pop(), {}
    said = ", ".join(f"{name} {str(found['id'])[:12]}" for name, found in held.items())
    error = f"the hosts hold different images named {ref} ({said}): none is trusted"
    return None, {name: Take(state="failed", error=error) for name in needers}


def _take_first(
    agents: dict[str, Agent],
    ref: str,
    pending: list[str],
    archive: str | None,
    expected: str | None,
    takes: dict[str, Take],
    progress: Progress,
) -> dict[str, Any] | None:
    """No host holds the image: the first of ``pending`` takes it the usual way (what it then
    holds; None: it could not, and every other host fails for want of a source)."""
    first = pending[0]
    kind, source = _first_take(archive)
    if expected is not None:
        source["expect"] = {"id": expected, "size": 0}
    takes[first].source = kind
    progress(
        f"image {ref}: no host holds it; {first} takes it from the {kind}, "
        f"then {len(pending) - 1} host(s) from peers"
    )
    found = _take(agents[first], ref, source, takes[first], progress)
    if found is None:
        for name in pending[1:]:
            takes[name].state = "failed"
            takes[name].error = f"no source: {first} could not take it from the {kind}"
    return found


def _spread(
    agents: dict[str, Agent],
    ref: str,
    needers: list[str],
    archive: str | None,
    pin: str | None,
    progress: Progress,
) -> tuple[str | None, int, dict[str, Take]]:
    """One image onto every host in ``needers``: from the hosts that hold the expected image,
    in rounds. The expected image's ID and size, and what happened on each host."""
    held = {name: found for name, agent in agents.items() if (found := agent.held.get(ref))}
    expected, takes = _expected(ref, held, pin, needers)
    if takes:
        return None, 0, takes
    holders = [name for name, found in held.items() if found["id"] == expected]
    for name in holders:
        takes[name] = Take(state="present", id=str(expected))
    for name, found in held.items():
        if name not in holders:
            progress(
                f"image {ref} on {name}: holds {str(found['id'])[:12]}, not the pinned "
                f"{str(expected)[:12]}: not used; it takes the pinned one"
            )
    size = min((int(held[name].get("size") or 0) for name in holders), default=0)
    pending = [name for name in needers if name not in holders]
    for name in pending:
        takes[name] = Take()
    if not pending:
        return expected, size, takes
    if not holders:
        found = _take_first(agents, ref, pending, archive, expected, takes, progress)
        if found is None:
            return expected, size, takes
        expected, size, holders = str(found["id"]), int(found.get("size") or 0), [pending.pop(0)]
    else:
        progress(f"image {ref}: {len(holders)} host(s) hold it, {len(pending)} take it from peers")
    while pending:
        pairs = next_round(holders, pending)
        pending = pending[len(pairs) :]
        threads = []
        for upstream, name in pairs:
            takes[name].source = upstream
            source = {
                "kind": "peer",
                "url": _url(agents[upstream]),
                "expect": {"id": expected, "size": size},
            }
            thread = threading.Thread(
                target=_take, args=(agents[name], ref, source, takes[name], progress), daemon=True
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        holders += [name for _, name in pairs if takes[name].state == "ready"]
    return expected, size, takes


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
    if take.error and ("another image" in take.error or "different images" in take.error):
        return (
            f"the hosts hold different images named {ref}: pin the one you mean "
            f"(pdctl.image_id: the ID `{runtime} image inspect --format '{{{{.Id}}}}' {ref}` "
            f"prints on a host you trust), or remove the stale ones ({runtime} rmi {ref}), "
            "and re-run"
        )
    if take.error and take.error.startswith("the archive"):
        return (
            f"the host it took {ref} from sent an archive that is not the expected image: "
            "check that host (pdctl fleet check), or take it out of the fleet, and re-run"
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
    pins: dict[str, str] | None = None,
    secrets_known: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Every image of ``needs`` (image -> hosts that run it) onto its hosts (name -> address on
    the fleet's network); per image and host what happened (HostError when any host failed).
    ``pins``: image -> the ID it must have (64 hex digits); ``secrets_known``: values masked
    in what the hosts say."""
    refs = [ref for ref in needs if fanned_out(ref)]
    doc: dict[str, Any] = {}
    for ref in needs:
        if not fanned_out(ref):
            doc[ref] = {"skipped": "pinned by digest: each host pulls it (pd_runtime)"}
            progress(f"image {ref}: pinned by digest, each host pulls it")
    if not refs:
        return doc
    key = secrets.token_urlsafe(32)
    opener = prefetch.masked(open_channel, Masker([*secrets_known, key]))
    agents: dict[str, Agent] = {}
    errors: list[str] = []
    fixes: dict[str, None] = {}
    try:
        agents = _start(opener, hosts, refs, runtime, key)
        for ref in refs:
            started = time.monotonic()
            expected, size, takes = _spread(
                agents, ref, needs[ref], archive, (pins or {}).get(ref), progress
            )
            doc[ref] = {
                "id": expected,
                "bytes": size,
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


def for_plan(session: Session, plan: Plan, progress: Progress) -> dict[str, Any] | None:
    """Every worker image on every host with a slot before the units start (None: no slot)."""
    needs = plan_images(plan)
    if not needs:
        return None
    opener, addresses = prefetch.fleet_channels(session, plan)
    return spread(
        opener,
        addresses,
        needs,
        progress,
        runtime=plan.runtime,
        archive=plan.image_archive,
        pins=plan_pins(plan),
        secrets_known=tuple(services.secret_values(plan).values()),
    )
