"""pdctl.ssh: pinned keys before any packet, what names a host, what it lets paramiko print."""

from __future__ import annotations

import logging
from pathlib import Path

import paramiko
import pytest

from pdctl.core.errors import HostError, InputError
from pdctl.doors import ssh  # importing it installs the log filter under test
from tests.support import contacted, listener


def test_refused_channels_are_not_printed_but_other_errors_are(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The logger and format paramiko's Transport uses for a refused direct-tcpip channel.
    logger = paramiko.util.get_logger("paramiko.transport")
    with caplog.at_level(logging.ERROR, logger="paramiko.transport"):
        logger.log(logging.ERROR, "Secsh channel %d open FAILED: %s: %s", 12, "refused", "x")
        logger.log(logging.ERROR, "Exception (client): Error reading SSH protocol banner")
    assert [r.getMessage() for r in caplog.records] == [
        "Exception (client): Error reading SSH protocol banner"
    ]


def test_a_host_without_a_pinned_key_is_refused_before_any_packet(tmp_path: Path) -> None:
    known = ssh.KnownHosts(tmp_path / "known_hosts.txt")
    with listener() as server:
        target = ssh.Target("127.0.0.1", server.getsockname()[1], "pdops")
        with pytest.raises(HostError) as refused:
            ssh.connect(target, known, fleet="f")
        assert not contacted(server)
    port = target.port
    assert refused.value.one_line() == (
        f"pdops@127.0.0.1:{port}: no host key is pinned for it; refusing to contact it "
        f"(if the key it offers now is the right one, pin it: "
        f"`pdctl fleet add f --host 127.0.0.1:{port} --repin`)"
    )


def test_an_unpinned_jump_host_is_refused_by_name_even_when_pinning_the_host(
    tmp_path: Path,
) -> None:
    known = ssh.KnownHosts(tmp_path / "known_hosts.txt")
    with listener() as jump_server, listener() as host_server:
        jump = ssh.Target("127.0.0.1", jump_server.getsockname()[1], "hop")
        target = ssh.Target("127.0.0.1", host_server.getsockname()[1], "pdops", proxy_jump=jump)
        # fleet add pins a new host, never the jump host on the way to it
        with pytest.raises(HostError) as refused:
            ssh.connect(target, known, pin_new=True, fleet="f")
        assert not contacted(jump_server) and not contacted(host_server)
    message = refused.value.one_line()
    assert message.startswith(f"jump host {jump.label}: no host key is pinned for it")
    assert f"`pdctl fleet add f --proxy-jump hop@127.0.0.1:{jump.port} --repin`" in message


@pytest.mark.parametrize(
    "text",
    [
        "root@{{lookup('pipe','id')}}",
        "root@host;reboot",
        "$(id)@host",
        "root@host name",
        "root@[not-ipv6]:22",
    ],
)
def test_a_host_is_letters_digits_and_dots_only(text: str) -> None:
    # Users and addresses become words of the jump host's ProxyCommand and inventory values.
    with pytest.raises(InputError):
        ssh.parse_target(text, default_user="root")


def test_the_default_user_obeys_the_same_rule() -> None:
    with pytest.raises(InputError, match="not a user name"):
        ssh.parse_target("10.0.0.1", default_user="a;b")


def test_labels_and_endpoints_read_back_as_the_same_target() -> None:
    for text in ("pdops@10.0.0.1", "root@10.0.0.1:2222", "root@[fe80::1]:2222", "u@[::1]"):
        target = ssh.parse_target(text, default_user="x")
        assert ssh.parse_target(target.label, default_user="x") == target
        assert ssh.parse_target(target.endpoint, default_user=target.user) == target


CHANGED = """\
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @
Host key for 10.77.3.11 has changed and you have requested strict checking.
Host key verification failed.
kex_exchange_identification: Connection closed by remote host
Connection closed by UNKNOWN port 65535"""
UNKNOWN = (
    "No ED25519 host key is known for [10.0.0.5]:2222 and you have requested strict checking."
    "\nHost key verification failed."
)
MITOGEN = "Host key checking is enabled, and SSH reported an unrecognized or mismatching host key."
PROXY_CLOSED = (
    "Failed to connect to the host via ssh: kex_exchange_identification: Connection closed by"
    " remote host\r\nConnection closed by UNKNOWN port 65535"
)


def test_openssh_refusals_name_the_host_in_its_known_hosts_form() -> None:
    assert ssh.refused_key_names(CHANGED) == ["10.77.3.11"]
    assert ssh.refused_key_names(UNKNOWN) == ["[10.0.0.5]:2222"]
    assert ssh.refused_key_names(MITOGEN) == []  # refused, but no name
    assert ssh.refused_key_names("ssh: connect to host x port 22: No route to host") is None
    assert ssh.closed_by_proxy(PROXY_CLOSED) and not ssh.closed_by_proxy(UNKNOWN)
