"""The masker every host message passes (pdctl/onhost/secret_mask.py): a value in every form a
message carries it, the longer value first."""

from __future__ import annotations

import http.client
import json

import pytest

from pdctl.onhost.secret_mask import MASK, Masker

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
