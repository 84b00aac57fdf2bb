"""How one host of a prefetch proves itself to another: each request carries an HMAC-SHA256 of
its method, the server it is for, its path and a fresh nonce, keyed by the prefetch's one-time
key (given to every host on stdin, never sent over the network). A server takes each nonce once.

So an on-path observer of the fleet's network learns no key it could use, cannot replay a
request it saw (the nonce is spent, and the MAC names one server and one path), and cannot
forge another. It still sees what the hosts send each other (docs: README, "Security model").

Runs on the hosts, in the model fetcher's bundle (model_fetch.py imports it).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading

AUTH_SCHEME = "PDCTL-HMAC"
_AUTH_HEADER = re.compile(rf"^{AUTH_SCHEME} nonce=([0-9a-f]{{32}}), mac=([0-9a-f]{{64}})\Z")
MAX_NONCES = 1 << 17  # requests one server takes in one prefetch: far more than it serves


def authority(host: str, port: int) -> str:
    """``host:port`` as a URL spells it (an IPv6 address in brackets): what a MAC names."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _mac(key: str, method: str, where: str, path: str, nonce: str) -> str:
    message = "\n".join((method, where, path, nonce)).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def sign_request(key: str, method: str, where: str, path: str) -> str:
    """The ``Authorization`` value of one request to the server at ``where`` (authority())."""
    nonce = secrets.token_hex(16)
    return f"{AUTH_SCHEME} nonce={nonce}, mac={_mac(key, method, where, path, nonce)}"


class RequestVerifier:
    """A server's check of a request's ``Authorization``: the MAC is right for this server,
    this method and this path, and its nonce was never seen before."""

    def __init__(self, key: str, where: str) -> None:
        self.key, self.where = key, where
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def allows(self, header: str | None, method: str, path: str) -> bool:
        match = _AUTH_HEADER.match(header or "")
        if match is None:
            return False
        nonce, mac = match.groups()
        if not hmac.compare_digest(mac, _mac(self.key, method, self.where, path, nonce)):
            return False
        with self._lock:
            if nonce in self._seen or len(self._seen) >= MAX_NONCES:
                return False
            self._seen.add(nonce)
        return True
