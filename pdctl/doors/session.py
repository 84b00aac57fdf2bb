"""One command's hold on its fleets: each inventory read once, one SSH pool per fleet.

A command (a deploy, a status, a destroy, the scaler's run on the control node) opens one
Session and hands it to every part that reaches the fleet: the plan's placement (the fleet's
facts, the hosts' holdings), the quick drift check, the model and image prefetch, the playbook
run's error reports and the rolling update. Each reads the fleet the session read and talks to
its hosts over the session's pool, so a deploy reads its inventory once and opens one pool
(connections are made as hosts are first used and kept until the command ends).
"""

from __future__ import annotations

from types import TracebackType

from pdctl.core.errors import NotFound
from pdctl.core.fleet_model import Fleet
from pdctl.doors import inventory, ssh
from pdctl.doors.workspace import Workspace


class Session:
    """The fleets one command uses, each read once, and one SSH pool per fleet."""

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self._fleets: dict[str, Fleet] = {}
        self._pools: dict[str, ssh.Pool] = {}
        self._targets: dict[tuple[str, str], ssh.Target] = {}

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def fleet(self, name: str) -> Fleet:
        """The fleet's inventory, read on first use."""
        if name not in self._fleets:
            self._fleets[name] = inventory.load(self.workspace, name)
        return self._fleets[name]

    def pool(self, name: str) -> ssh.Pool:
        """The fleet's SSH pool (its pinned host keys), made on first use."""
        if name not in self._pools:
            known = ssh.KnownHosts(inventory.known_hosts_file(self.workspace, name))
            self._pools[name] = ssh.Pool(known, name)
        return self._pools[name]

    def target(self, fleet: str, host: str) -> ssh.Target:
        """How to reach ``host`` of ``fleet``; NotFound when the fleet no longer has it."""
        key = (fleet, host)
        if key not in self._targets:
            found = self.fleet(fleet)
            member = found.host(host)
            if member is None:
                raise NotFound(f"host {host} is no longer in fleet {fleet}")
            self._targets[key] = inventory.target(found, member)
        return self._targets[key]

    def targets(self, fleet: str, hosts: list[str]) -> dict[str, ssh.Target]:
        return {host: self.target(fleet, host) for host in hosts}

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
