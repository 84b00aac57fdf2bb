"""The one place pdctl opens SSH (paramiko): pinned host keys, jump hosts, a pool.

Host keys are trust-on-first-use per fleet: the first contact records the key
in the fleet's own known_hosts (also used by Ansible); afterwards a different
key is refused with the command that re-pins it. Nothing here ever accepts a
changed key silently.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import shlex
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import paramiko

from pdctl.errors import HostError, InputError


class _RefusedChannelFilter(logging.Filter):
    """Drops paramiko's ERROR line for each refused direct-tcpip channel.

    pdctl turns a refused channel into ConnectionRefusedError and handles it: polling the
    health of a worker whose port is not listening yet is routine, not an error to print.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "open FAILED" not in record.getMessage()


logging.getLogger("paramiko.transport").addFilter(_RefusedChannelFilter())

CONNECT_TIMEOUT = 8.0
R = TypeVar("R")
Log = Callable[[str], None]
_TARGET = re.compile(r"^(?:(?P<user>[^@\s]+)@)?(?P<addr>\[[^\]]+\]|[^:@\s]+)(?::(?P<port>\d+))?$")


@dataclass(frozen=True)
class Target:
    """How to reach one host."""

    address: str
    port: int = 22
    user: str = "root"
    identity_file: str | None = None
    proxy_jump: Target | None = None

    @property
    def label(self) -> str:
        port = "" if self.port == 22 else f":{self.port}"
        return f"{self.user}@{self.address}{port}"

    @property
    def known_hosts_name(self) -> str:
        """How OpenSSH (and so Ansible) names this host in known_hosts."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"


def parse_target(
    text: str,
    *,
    default_user: str,
    identity_file: str | None = None,
    proxy_jump: Target | None = None,
) -> Target:
    """``[USER@]ADDR[:PORT]`` -> Target; a bad form is an InputError naming it."""
    match = _TARGET.match(text.strip())
    if not match:
        raise InputError(
            f"not a host: {text!r}", hint="use [USER@]ADDRESS[:PORT], e.g. root@10.0.0.11"
        )
    port = int(match["port"] or 22)
    if not 0 < port < 65536:
        raise InputError(f"bad port in {text!r}")
    return Target(
        address=match["addr"].strip("[]"),
        port=port,
        user=match["user"] or default_user,
        identity_file=identity_file,
        proxy_jump=proxy_jump,
    )


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's form: SHA256:<base64 without padding>."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class KnownHosts:
    """A fleet's known_hosts file (OpenSSH format), safe to use from threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._keys = paramiko.HostKeys()
        if path.exists():
            self._keys.load(str(path))
        self._lock = threading.Lock()
        self.pinned: dict[str, str] = {}  # name -> fingerprint, pinned by this process

    def lookup(self, target: Target) -> dict[str, paramiko.PKey]:
        with self._lock:
            entry = self._keys.lookup(target.known_hosts_name)
            return dict(entry) if entry else {}

    def pin(self, target: Target, key: paramiko.PKey) -> None:
        with self._lock:
            self._keys.add(target.known_hosts_name, key.get_name(), key)
            self.pinned[target.known_hosts_name] = fingerprint(key)

    def forget(self, target: Target) -> bool:
        with self._lock:
            name = target.known_hosts_name
            if name not in self._keys:
                return False
            del self._keys[name]
            return True

    def save(self) -> None:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._keys.save(str(self.path))


class _Pin(paramiko.MissingHostKeyPolicy):
    def __init__(self, known: KnownHosts, target: Target, allow: bool) -> None:
        self.known, self.target, self.allow = known, target, allow

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if not self.allow:
            raise HostError(
                f"{self.target.label}: host key {fingerprint(key)} is not pinned",
                hint="add the host with `pdctl fleet add` first",
            )
        self.known.pin(self.target, key)


def connect(
    target: Target,
    known: KnownHosts,
    *,
    pin_new: bool = True,
    fleet: str | None = None,
    timeout: float = CONNECT_TIMEOUT,
) -> paramiko.SSHClient:
    """An authenticated client; HostError (naming host and fix) on any failure."""
    sock = None
    jump_client = None
    if target.proxy_jump is not None:
        jump_client = connect(
            target.proxy_jump, known, pin_new=pin_new, fleet=fleet, timeout=timeout
        )
        transport = jump_client.get_transport()
        assert transport is not None  # connect() returned an authenticated client
        try:
            sock = transport.open_channel(
                "direct-tcpip", (target.address, target.port), ("127.0.0.1", 0), timeout=timeout
            )
        except (paramiko.SSHException, OSError) as exc:
            jump_client.close()
            raise HostError(
                f"{target.label}: unreachable through jump host {target.proxy_jump.label}: {exc}",
                hint="check the address and that the jump host can reach it",
            ) from exc
    client = paramiko.SSHClient()
    for name, key in known.lookup(target).items():
        client.get_host_keys().add(target.known_hosts_name, name, key)
    client.set_missing_host_key_policy(_Pin(known, target, pin_new))
    try:
        client.connect(
            target.address,
            port=target.port,
            username=target.user,
            key_filename=target.identity_file,
            allow_agent=target.identity_file is None,
            look_for_keys=target.identity_file is None,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            sock=sock,
        )
    except paramiko.BadHostKeyException as exc:
        client.close()
        repin = f"pdctl fleet add {fleet} --host {target.label} --repin" if fleet else "re-pin it"
        raise HostError(
            f"{target.label}: host key changed! pinned {fingerprint(exc.expected_key)}, "
            f"now offered {fingerprint(exc.key)}; refusing to connect",
            hint=f"if the host was reinstalled on purpose, run `{repin}`",
        ) from exc
    except paramiko.AuthenticationException as exc:
        client.close()
        raise HostError(
            f"{target.label}: SSH authentication failed ({exc})",
            hint="check --user and --identity-file, and the key in authorized_keys",
        ) from exc
    except TimeoutError as exc:
        client.close()
        raise HostError(
            f"{target.label}: SSH connection timed out after {timeout:.0f} s",
            hint="check the address, routing and firewalls",
        ) from exc
    except (paramiko.SSHException, OSError) as exc:
        client.close()
        raise HostError(
            f"{target.label}: SSH connection failed: {exc}",
            hint="check that sshd runs on the host and the port is right",
        ) from exc
    if jump_client is not None:
        client._pdctl_jump = jump_client  # type: ignore[attr-defined]  # keep the tunnel alive
    return client


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str


def run(
    client: paramiko.SSHClient, command: str, *, stdin: str | None = None, timeout: float = 60.0
) -> Result:
    """Run a command; rc, stdout and stderr, never raising for a non-zero rc."""
    channel_in, channel_out, channel_err = client.exec_command(command, timeout=timeout)
    if stdin is not None:
        channel_in.write(stdin)
    channel_in.channel.shutdown_write()
    out = channel_out.read().decode(errors="replace")
    err = channel_err.read().decode(errors="replace")
    return Result(rc=channel_out.channel.recv_exit_status(), stdout=out, stderr=err)


def sudo(command: str) -> str:
    """Wrap a command to run as root without a password prompt (fails fast instead)."""
    return f"sudo -n -- sh -c {shlex.quote(command)}"


class Pool:
    """Long-lived connections for fast repeated actions (the scaler): one per target."""

    def __init__(self, known: KnownHosts, fleet: str | None = None) -> None:
        self.known, self.fleet = known, fleet
        self._clients: dict[Target, paramiko.SSHClient] = {}
        self._locks: dict[Target, threading.Lock] = {}
        self._guard = threading.Lock()

    def _client(self, target: Target) -> paramiko.SSHClient:
        with self._guard:
            lock = self._locks.setdefault(target, threading.Lock())
        with lock:  # one connection per host, made once even when threads race for it
            client = self._clients.get(target)
            transport = client.get_transport() if client else None
            if client is None or transport is None or not transport.is_active():
                client = connect(target, self.known, pin_new=False, fleet=self.fleet)
                self._clients[target] = client
            return client

    @contextmanager
    def session(self, target: Target) -> Iterator[paramiko.SSHClient]:
        """The host's pooled connection. Not held exclusively: commands on one host run side
        by side, each on its own channel (a slow `stop` does not hold up a health check)."""
        client = self._client(target)
        try:
            yield client
        except paramiko.ChannelException:
            raise  # one channel refused; the connection itself is fine
        except (paramiko.SSHException, OSError):
            client.close()
            with self._guard:
                if self._clients.get(target) is client:
                    self._clients.pop(target, None)
            raise

    def run(self, target: Target, command: str, *, timeout: float = 60.0) -> Result:
        with self.session(target) as client:
            return run(client, command, timeout=timeout)

    def connector(self, target: Target) -> Callable[[str, int], paramiko.Channel]:
        """Open TCP streams from the target host (e.g. to its 127.0.0.1-only ports)."""

        def open_stream(host: str, port: int) -> paramiko.Channel:
            try:
                with self.session(target) as client:
                    transport = client.get_transport()
                    assert transport is not None  # session() hands out connected clients
                    return transport.open_channel(
                        "direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=CONNECT_TIMEOUT
                    )
            except paramiko.ChannelException as exc:
                raise ConnectionRefusedError(f"{host}:{port} via {target.label}: {exc}") from exc

        return open_stream

    def close(self) -> None:
        with self._guard:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def run_python(
    pool: Pool, target: Target, source: str, *, become: bool, timeout: float = 60.0
) -> str:
    """Run Python source on a host (``python3 -``, through sudo when ``become``); its stdout.

    The source travels on stdin: nothing of it in any argv. HostError (the last line of its
    stderr) when it exits non-zero.
    """
    command = "sudo -n python3 -" if become else "python3 -"
    with pool.session(target) as client:
        result = run(client, command, stdin=source, timeout=timeout)
    if result.rc != 0:
        raise HostError((result.stderr.strip().splitlines() or ["no output"])[-1])
    return result.stdout


def at_once(hosts: Sequence[str], work: Callable[[str], R]) -> dict[str, R]:
    """``work`` on every host at the same time (threads: each waits on its own channel)."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts) or 1)) as pool:
        return dict(zip(hosts, pool.map(work, hosts), strict=True))
