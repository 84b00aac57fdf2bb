from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def listener() -> Iterator[socket.socket]:
    """A fleet's address: a socket on loopback that must never see a connection (a test
    checks with ``listener.accept()`` raising BlockingIOError that no host was contacted)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    yield sock
    sock.close()
