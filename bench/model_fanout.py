"""bench model-fanout: one model onto N lab hosts, pdctl's fan-out against every host
downloading it from the hub at once, with the hub capped at a tenth of the hosts' links.

Both runs use pdctl's own fetcher (pdctl/onhost/model_fetch.py over SSH,
pdctl/operations/prefetch.py): pdctl's
prefetch chains the hosts (the hub sends each file once, each host streams it on to the next);
the baseline runs one prefetch per host at the same time, each from the hub, as engines that
download their own model do. The caches are emptied before each run (not after the last).
The hub's cap and the hosts' link caps are the lab's (`pdctl lab hub limit`, `pdctl lab
link-rate`: tbf on the veths, docs/facts.md).
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.lablib import FLEET, BenchError, BenchLab, stopwatch
from pdctl.doors import inventory, ssh
from pdctl.doors.workspace import Workspace
from pdctl.lab import hub_models
from pdctl.onhost import hf_layout
from pdctl.operations import prefetch

REPO = "lab/bench-1g"
SIZE = "1G"
# bytes/s of each host's link, both ways, and the site's uplink (the hub's cap): a tenth of it.
# The baselines take N x SIZE / HUB_RATE (the lab's CPU keeps up: within a few percent).
# Faster caps shorten `make bench`, but pdctl's relaying is bound by the lab's 2 cores, not
# by the links, so its time shrinks less than the baseline's: at 150M/1500M the 16-host
# ratio fell to 2.8; these keep the hub the bottleneck a real site has.
LINK_RATE = "1000M"
HUB_RATE = "100M"


class Fleet:
    """The lab fleet's first ``hosts`` hosts as the prefetch sees them."""

    def __init__(self, lab: BenchLab, hosts: int) -> None:
        self.lab = lab
        workspace = Workspace(lab.home)
        fleet = inventory.load(workspace, FLEET)
        if len(fleet.hosts) < hosts:
            raise BenchError(f"model-fanout wants {hosts} hosts, the fleet has {len(fleet.hosts)}")
        chosen = fleet.hosts[:hosts]
        self.names = [h.address for h in chosen]
        self.lab_names = {h.address: h for h in chosen}
        self.targets = {h.address: inventory.target(fleet, h) for h in chosen}
        self.known = ssh.KnownHosts(inventory.known_hosts_file(workspace, FLEET))
        self.request = prefetch.Request(
            repo=REPO,
            revision="main",
            cache=fleet.settings.model_cache,
            endpoint=fleet.settings.model_endpoint,
            token=lab.env.get("HF_TOKEN"),
        )

    def clear(self) -> None:
        """Empty the hosts' caches."""
        self.on_every_host(f"sudo -n rm -rf {shlex.quote(self.request.cache)}")

    def idle(self) -> None:
        """Stop what earlier benchmarks left running on the hosts (a deployed service's units):
        the lab's hosts share its 2 cores, so one host's idle workers would slow another's
        relaying, which on a real fleet has its own CPUs."""
        self.on_every_host("sudo -n systemctl stop 'pd-*'")

    def on_every_host(self, command: str) -> None:
        """``command`` on every host at once, over one pooled connection each."""
        pool = ssh.Pool(self.known, FLEET)
        try:
            with ThreadPoolExecutor(len(self.names)) as workers:
                runs = workers.map(lambda n: pool.run(self.targets[n], command), self.names)
                failed = [(n, r) for n, r in zip(self.names, runs, strict=True) if r.rc != 0]
        finally:
            pool.close()
        if failed:
            name, run = failed[0]
            raise BenchError(f"{name}: {command} failed: {run.stderr.strip()[-300:]}")

    def fan_out(self, names: list[str], log: Callable[[str], None]) -> dict[str, Any]:
        pool = ssh.Pool(self.known, FLEET)
        try:
            opener = prefetch.ssh_opener(pool, self.targets)
            addresses = {n: self.targets[n].address for n in names}
            return prefetch.prefetch(opener, addresses, self.request, log)
        finally:
            pool.close()


def _all_from_the_hub(fleet: Fleet, log: Callable[[str], None]) -> None:
    """Every host at once, each its own prefetch from the hub."""
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            fleet.fan_out([name], lambda _line: None)
        except Exception as exc:  # reported below, with the host
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in fleet.names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise BenchError(f"baseline download failed: {errors[0]}")


def check_inputs() -> None:
    """What the run would give the lab: a valid model id, the hub at a tenth of the links."""
    hf_layout.check_repo_id(REPO)
    link, hub = hub_models.parse_size(LINK_RATE), hub_models.parse_size(HUB_RATE)
    if link != 10 * hub:
        raise BenchError(f"the hub's cap {HUB_RATE} is not a tenth of the links' {LINK_RATE}")


def prepare(lab: BenchLab) -> None:
    """The lab's caps, and the model on its hub."""
    lab.pdctl("lab", "link-rate", LINK_RATE)
    lab.pdctl("lab", "hub", "limit", HUB_RATE)
    lab.pdctl("lab", "hub", "add", REPO, "--size", SIZE)


def measure(lab: BenchLab, hosts: int, log: Callable[[str], None]) -> tuple[float, float, int]:
    """Seconds of pdctl's fan-out and of the baseline onto the fleet's first ``hosts`` hosts;
    the hub's downloads of the model during pdctl's run."""
    fleet = Fleet(lab, hosts)
    fleet.idle()
    fleet.clear()
    before = _downloads(lab)
    with stopwatch() as ours:
        doc = fleet.fan_out(fleet.names, lambda _line: None)
    taken = _downloads(lab) - before
    log(f"pdctl: {hosts} hosts in {ours[0]:.1f} s, {doc['bytes']} bytes each")
    fleet.clear()
    with stopwatch() as theirs:
        _all_from_the_hub(fleet, log)
    # The hub's cap is what the baseline waits for, unless the lab's CPU cannot keep up.
    rate = hosts * doc["bytes"] / theirs[0] / hub_models.parse_size(HUB_RATE)
    log(f"baseline: {hosts} hosts in {theirs[0]:.1f} s, the hub at {rate:.0%} of its cap")
    return ours[0], theirs[0], taken


def _downloads(lab: BenchLab) -> int:
    counts = lab.status()["hub"]["downloads"]
    return sum(v for k, v in counts.items() if k.startswith(f"{REPO}/"))
