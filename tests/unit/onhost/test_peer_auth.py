"""The signed peer requests of a fan-out (pdctl/onhost/peer_auth.py): each taken once, for its
server, method and path."""

from __future__ import annotations

from pdctl.onhost import peer_auth


def test_a_signed_request_is_taken_once_for_its_server_method_and_path() -> None:
    where = peer_auth.authority("10.0.0.12", 4321)
    header = peer_auth.sign_request("k3y", "GET", where, "/blobs/ab")
    assert "k3y" not in header
    server = peer_auth.RequestVerifier("k3y", where)
    assert not server.allows(header, "GET", "/blobs/ac")  # another path
    assert not server.allows(header, "HEAD", "/blobs/ab")  # another method
    other = peer_auth.RequestVerifier("k3y", peer_auth.authority("10.0.0.13", 4321))
    assert not other.allows(header, "GET", "/blobs/ab")  # another server
    assert not peer_auth.RequestVerifier("other", where).allows(header, "GET", "/blobs/ab")
    assert server.allows(header, "GET", "/blobs/ab")
    assert not server.allows(header, "GET", "/blobs/ab")  # replayed
    for junk in (None, "", "Bearer k3y", header + " ", header.replace("nonce=", "nonce=0")):
        assert not server.allows(junk, "GET", "/blobs/ab")
    assert peer_auth.authority("fd00::1", 80) == "[fd00::1]:80"
