"""The one place pdctl opens SSH (paramiko): pinned host keys, jump hosts, a pool.

Host keys are trust-on-first-use per fleet, and only `pdctl fleet add` pins one: the
first contact records the key in the fleet's own known_hosts (also used by Ansible).
Every other contact needs a pinned key: a host (or jump host) without one is refused
before a packet is sent, a different key is refused on contact, each with the command
that re-pins it. Nothing here ever accepts an unknown or changed key silently.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import paramiko

from pdctl.core.errors import HostError, InputError
from pdctl.onhost import bundle


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
# User and address become words of a shell command (the jump host's ProxyCommand in the
# inventory) and inventory values: letters, digits and . _ -, never a leading - (an option);
# IPv6 in brackets.
_WORD = r"[A-Za-z0-9._][A-Za-z0-9._-]*"
_TARGET = re.compile(
    rf"^(?:(?P<user>{_WORD})@)?(?P<addr>\[[0-9A-Fa-f:.]+\]|{_WORD})(?::(?P<port>\d+))?\Z"
)
# OpenSSH's words when StrictHostKeyChecking=yes refuses a host (the known_hosts name).
_OPENSSH_REFUSED = re.compile(
    r"(?:Host key for|host key is known for) (\S+) (?:has changed and|and) you have requested"
    r" strict checking"
)
# The same refusal, however it is reported (Mitogen names no host).
_KEY_REFUSED = re.compile(r"host key verification failed|mismatching host key", re.IGNORECASE)
# OpenSSH's words for a ProxyCommand that closed before the host's banner (no peer address).
_PROXY_CLOSED = re.compile(r"Connection closed by UNKNOWN port \d+")


@dataclass(frozen=True)
class Target:
    """How to reach one host."""

    address: str
    port: int = 22
    user: str = "root"
    identity_file: str | None = None
    proxy_jump: Target | None = None

    @property
    def endpoint(self) -> str:
        """``ADDR[:PORT]`` (an IPv6 address in brackets), as `--host` takes it back."""
        address = f"[{self.address}]" if ":" in self.address else self.address
        return address if self.port == 22 else f"{address}:{self.port}"

    @property
    def label(self) -> str:
        """``USER@ADDR[:PORT]``, as `--host` and `--proxy-jump` take it back."""
        return f"{self.user}@{self.endpoint}"

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
    if not match or not re.fullmatch(_WORD, default_user):
        raise InputError(
            f"not a host: {text!r}" if not match else f"not a user name: {default_user!r}",
            hint="use [USER@]ADDRESS[:PORT], e.g. root@10.0.0.11 (letters, digits, . _ -)",
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

    def fingerprint(self, target: Target) -> str | None:
        """The pinned key's fingerprint (None: no key pinned)."""
        keys = self.lookup(target)
        return fingerprint(next(iter(keys.values()))) if keys else None

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


def _who(target: Target, jump: bool) -> str:
    return f"jump host {target.label}" if jump else target.label


def repin_command(fleet: str | None, target: Target, *, jump: bool = False) -> str:
    """The command that (re-)pins a host's key, or a fleet's jump host's. A host is named by
    its endpoint: `fleet add` keeps the user on record (the refused connection may be the
    scaler's, as its own user). The jump host with its user: --proxy-jump sets both."""
    option = f"--proxy-jump {target.label}" if jump else f"--host {target.endpoint}"
    return f"pdctl fleet add {fleet or '<fleet>'} {option} --repin"


def key_refused(target: Target, fleet: str | None, reason: str, *, jump: bool = False) -> HostError:
    """A host (or the fleet's jump host) refused for its key: who, why, and the fix."""
    return HostError(
        f"{_who(target, jump)}: {reason}",
        hint="if the key it offers now is the right one, pin it: "
        f"`{repin_command(fleet, target, jump=jump)}`",
    )


def require_pinned(
    target: Target, known: KnownHosts, fleet: str | None, *, jump: bool = False
) -> None:
    """HostError unless the host, and the jump host on the way, have a pinned key."""
    if target.proxy_jump is not None:
        require_pinned(target.proxy_jump, known, fleet, jump=True)
    if not known.lookup(target):
        raise key_refused(
            target, fleet, "no host key is pinned for it; refusing to contact it", jump=jump
        )


def refused_key_names(output: str) -> list[str] | None:
    """The known_hosts names of the hosts whose key OpenSSH refused, read from its output
    (under Ansible or Mitogen); [] when it refused one without naming it (Mitogen's
    message), None when the output is no host key refusal."""
    names = _OPENSSH_REFUSED.findall(output)
    if names or _KEY_REFUSED.search(output):
        return list(dict.fromkeys(names))
    return None


def closed_by_proxy(output: str) -> bool:
    """Whether ssh's output says its ProxyCommand (the jump hop) ended before the host
    answered; under ControlPersist OpenSSH sends the jump hop's own errors to /dev/null."""
    return bool(_PROXY_CLOSED.search(output))


class _Pin(paramiko.MissingHostKeyPolicy):
    def __init__(
        self, known: KnownHosts, target: Target, allow: bool, fleet: str | None, jump: bool
    ) -> None:
        self.known, self.target, self.allow = known, target, allow
        self.fleet, self.jump = fleet, jump

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if not self.allow:  # a key of a type other than the pinned one's
            raise key_refused(
                self.target,
                self.fleet,
                f"host key {fingerprint(key)} is not the pinned one; refusing to connect",
                jump=self.jump,
            )
        self.known.pin(self.target, key)


def _tunnel(
    target: Target, known: KnownHosts, fleet: str | None, timeout: float
) -> tuple[paramiko.SSHClient, paramiko.Channel]:
    """A TCP stream to the target through its jump host (whose key must be pinned already:
    only `fleet add` pins a jump host, on its own, never on the way to another host)."""
    assert target.proxy_jump is not None
    jump_client = connect(target.proxy_jump, known, jump=True, fleet=fleet, timeout=timeout)
    transport = jump_client.get_transport()
    assert transport is not None  # connect() returned an authenticated client
    try:
        channel = transport.open_channel(
            "direct-tcpip", (target.address, target.port), ("127.0.0.1", 0), timeout=timeout
        )
    except (paramiko.SSHException, OSError) as exc:
        jump_client.close()
        raise HostError(
            f"{target.label}: unreachable through jump host {target.proxy_jump.label}: {exc}",
            hint="check the address and that the jump host can reach it",
        ) from exc
    return jump_client, channel


def _login(
    client: paramiko.SSHClient,
    target: Target,
    sock: paramiko.Channel | None,
    *,
    fleet: str | None,
    jump: bool,
    timeout: float,
) -> None:
    """client.connect(), its failures turned into HostErrors naming the host and the fix."""
    who = _who(target, jump)
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
        raise key_refused(
            target,
            fleet,
            f"host key changed! pinned {fingerprint(exc.expected_key)}, "
            f"now offered {fingerprint(exc.key)}; refusing to connect",
            jump=jump,
        ) from exc
    except paramiko.AuthenticationException as exc:
        raise HostError(
            f"{who}: SSH authentication failed ({exc})",
            hint="check --user and --identity-file, and the key in authorized_keys",
        ) from exc
    except TimeoutError as exc:
        raise HostError(
            f"{who}: SSH connection timed out after {timeout:.0f} s",
            hint="check the address, routing and firewalls",
        ) from exc
    except (paramiko.SSHException, OSError) as exc:
        raise HostError(
            f"{who}: SSH connection failed: {exc}",
            hint="check that sshd runs on the host and the port is right",
        ) from exc


def connect(
    target: Target,
    known: KnownHosts,
    *,
    pin_new: bool = False,
    jump: bool = False,
    fleet: str | None = None,
    timeout: float = CONNECT_TIMEOUT,
) -> paramiko.SSHClient:
    """An authenticated client; HostError (naming host and fix) on any failure.

    ``pin_new``: pin the key of a host that has none (`fleet add`); otherwise such a host
    is refused before any packet is sent. ``jump``: the target is a fleet's jump host
    (errors say so, and name the fix for it).
    """
    if not pin_new:
        require_pinned(target, known, fleet, jump=jump)
    sock: paramiko.Channel | None = None
    jump_client = None
    if target.proxy_jump is not None:
        jump_client, sock = _tunnel(target, known, fleet, timeout)
    client = paramiko.SSHClient()
    for name, key in known.lookup(target).items():
        client.get_host_keys().add(target.known_hosts_name, name, key)
    client.set_missing_host_key_policy(_Pin(known, target, pin_new, fleet, jump))
    try:
        _login(client, target, sock, fleet=fleet, jump=jump, timeout=timeout)
    except BaseException:
        client.close()
        if jump_client is not None:
            jump_client.close()
        raise
    if jump_client is not None:
        client._pdctl_jump = jump_client  # type: ignore[attr-defined]  # keep the tunnel alive
    return client


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str


class CommandTimeout(HostError):
    """A command over SSH did not complete within its deadline (the host may have stopped
    answering: a dead peer keeps a TCP connection silent for many minutes). ``silent``: the
    host never acknowledged the command (its connection is no use), rather than the command
    itself running long."""

    def __init__(self, message: str, *, silent: bool, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.silent = silent


def run(
    client: paramiko.SSHClient,
    command: str,
    *,
    stdin: str | bytes | None = None,
    timeout: float = 60.0,
) -> Result:
    """Run a command; rc, stdout and stderr, never raising for a non-zero rc.

    ``timeout`` bounds the whole command, whatever the host does: opening its channel, the
    server's answer, the output. At the deadline the channel is closed (which wakes every wait
    on it) and CommandTimeout raised."""
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise paramiko.SSHException("the connection is closed")
    expired = threading.Event()
    opened: list[paramiko.Channel] = []
    guard = threading.Lock()

    def expire() -> None:
        with guard:
            expired.set()
            channels = list(opened)
        for channel in channels:
            channel.close()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    acknowledged = False  # the host accepted the command: it answers, the command runs long
    try:
        channel = transport.open_session(timeout=timeout)
        with guard:
            opened.append(channel)
            late = expired.is_set()
        if late:
            channel.close()
        channel.settimeout(timeout)
        channel.exec_command(command)
        acknowledged = True
        if stdin is not None:
            channel.sendall(stdin.encode() if isinstance(stdin, str) else stdin)
        channel.shutdown_write()
        out = channel.makefile("rb").read().decode(errors="replace")
        err = channel.makefile_stderr("rb").read().decode(errors="replace")
        rc = channel.recv_exit_status()
    except (paramiko.SSHException, OSError) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise CommandTimeout(
                f"no answer within {timeout:g} s ({exc or 'timed out'})", silent=not acknowledged
            ) from exc
        raise
    finally:
        timer.cancel()
    if expired.is_set():
        raise CommandTimeout(f"no answer within {timeout:g} s", silent=not acknowledged)
    return Result(rc=rc, stdout=out, stderr=err)


# What a command on an open connection can fail with besides a non-zero exit: the channel
# or the connection breaking, or a read timing out.
CHANNEL_ERRORS: tuple[type[Exception], ...] = (paramiko.SSHException, OSError)


class Running:
    """A command started on a host and not waited for (a server the caller talks to)."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel
        self._out = bytearray()
        self._err = bytearray()

    def _drain(self) -> None:
        while self._channel.recv_ready():
            self._out += self._channel.recv(65536)
        while self._channel.recv_stderr_ready():
            self._err += self._channel.recv_stderr(65536)

    def done(self) -> bool:
        self._drain()
        return self._channel.exit_status_ready()

    def wait(self, timeout: float) -> Result:
        """Its exit and output; rc 124 (as coreutils' timeout says it) when it has not
        exited within ``timeout`` seconds (the channel is closed; the caller's own time
        limit on the host ends the command)."""
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() > deadline:
                self.close()
                return Result(124, self._out.decode(errors="replace"), "timed out\n")
            time.sleep(0.02)
        self._drain()
        # Output still in flight after the exit status: read to the channel's end.
        self._channel.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while chunk := self._channel.recv(65536):
                self._out += chunk
            while chunk := self._channel.recv_stderr(65536):
                self._err += chunk
        except TimeoutError:
            pass
        rc = self._channel.recv_exit_status()
        return Result(rc, self._out.decode(errors="replace"), self._err.decode(errors="replace"))

    def close(self) -> None:
        self._channel.close()


def start(client: paramiko.SSHClient, command: str) -> Running:
    """Start a command (stdin closed) and return at once."""
    transport = client.get_transport()
    assert transport is not None  # callers hand in connected clients
    channel = transport.open_session(timeout=CONNECT_TIMEOUT)
    channel.exec_command(command)
    channel.shutdown_write()
    return Running(channel)


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
        except CommandTimeout as exc:
            # Silent: the next use connects afresh (and fails fast when the host is gone)
            # instead of waiting on this connection again. A command that merely ran long
            # leaves the others on the connection alone.
            if exc.silent:
                self.drop(target, client)
            raise
        except (paramiko.SSHException, OSError):
            transport = client.get_transport()
            if transport is None or not transport.is_active():
                self.drop(target, client)  # the connection broke, not just one channel
            raise

    def drop(self, target: Target, client: paramiko.SSHClient | None = None) -> None:
        """Forget the host's pooled connection (``client``: only if it is still that one)."""
        with self._guard:
            current = self._clients.get(target)
            if current is None or (client is not None and current is not client):
                return
            self._clients.pop(target, None)
        current.close()

    def run(self, target: Target, command: str, *, timeout: float = 60.0) -> Result:
        """``command`` on the host within ``timeout`` seconds; HostError (naming the host)
        when it cannot be reached or does not answer in time."""
        try:
            with self.session(target) as client:
                return run(client, command, timeout=timeout)
        except CommandTimeout as exc:
            raise CommandTimeout(
                f"{target.label}: {exc.message}", silent=exc.silent, hint=exc.hint
            ) from exc
        except (paramiko.SSHException, OSError) as exc:
            raise HostError(
                f"{target.label}: SSH command failed: {exc or type(exc).__name__}",
                hint="check that the host is up and reachable",
            ) from exc

    def start(self, target: Target, command: str) -> Running:
        with self.session(target) as client:
            return start(client, command)

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


def run_onhost(
    pool: Pool,
    target: Target,
    entry: str,
    stdin: str = "",
    *,
    become: bool,
    timeout: float = 60.0,
) -> str:
    """Run pdctl's on-host module ``entry`` on a host (through sudo when ``become``); its stdout.

    The loader and the bundle (pdctl/onhost/bundle.py), then ``stdin``, travel on stdin: nothing
    of them in any argv. HostError (the last line of its stderr) when it exits non-zero.
    """
    command = bundle.command(entry, become=become)
    with pool.session(target) as client:
        result = run(client, command, stdin=bundle.stdin(entry) + stdin.encode(), timeout=timeout)
    if result.rc != 0:
        raise HostError((result.stderr.strip().splitlines() or ["no output"])[-1])
    return result.stdout


def at_once(hosts: Sequence[str], work: Callable[[str], R]) -> dict[str, R]:
    """``work`` on every host at the same time (threads: each waits on its own channel)."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts) or 1)) as pool:
        return dict(zip(hosts, pool.map(work, hosts), strict=True))
