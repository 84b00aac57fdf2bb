"""The two small pieces the fan-out's messages and requests stand on: the masker every host
message passes (pdctl/secret_mask.py) and the signed peer requests (pdctl/peer_auth.py)."""

from __future__ import annotations

import http.client
import json

import pytest

from pdctl import peer_auth
from pdctl.secret_mask import MASK, Masker

TOKEN = "hf_0123456789abcdef"


def test_a_value_is_masked_in_every_form_a_message_carries_it() -> None:
    crlf = f"{TOKEN}\r\n"  # a value read from a CRLF env file
    masker = Masker([crlf, "db pass\"'\\", "abc", None, 7])
    connection = http.client.HTTPConnection("localhost")
    connection.putrequest("GET", "/")
    with pytest.raises(ValueError, match="Invalid header value") as raised:  # http.client's
        connection.putheader("Authorization", f"Bearer {crlf}")
    said = [
        str(raised.value),
        json.dumps({"token": crlf}),
        repr(crlf),
        f"first line {TOKEN}",
        "quoted: db pass\"'\\ and " + json.dumps("db pass\"'\\"),
    ]
    for text in said:
        masked = masker.text(text)
        assert TOKEN not in masked and "db pass" not in masked and MASK in masked, masked
    assert masker.text("abc is left alone") == "abc is left alone"  # too short to mask


def test_a_document_is_masked_throughout_and_the_longer_value_first() -> None:
    masker = Masker(["secret-value", "secret"])
    doc = {"event": "error", "secret-value": ["a secret-value", {"n": 1, "m": "secret!"}]}
    assert masker.doc(doc) == {"event": "error", MASK: [f"a {MASK}", {"n": 1, "m": f"{MASK}!"}]}
    assert Masker().doc(doc) is doc


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
