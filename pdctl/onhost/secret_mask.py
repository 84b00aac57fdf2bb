"""Secret values out of messages: every text a host sends back, and every error pdctl builds
from one, passes a Masker that knows the values. PURE.

Runs on the hosts too, in the model fetcher's bundle (a host masks what it knows: the hub
token, the prefetch key), and pdctl masks the same messages again with every secret of the
plan.

A value is masked in the forms a message may carry it: as is, as Python's repr or JSON would
escape it (http.client quotes a bad header value with repr), and each run of it between
control characters (a value a line break cut in two). Values shorter than 4 characters are
left alone: masking them would garble ordinary words and hide nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

MASK = "***"
MASKED_MIN = 4  # the shortest value worth masking
_CONTROL_RUN = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def _forms(value: str) -> set[str]:
    forms = {
        value,
        value.strip(),
        repr(value)[1:-1],
        json.dumps(value)[1:-1],
        repr(value.encode("utf-8", "replace"))[2:-1],  # a bytes value's repr (http.client)
        *_CONTROL_RUN.split(value),
    }
    return {form for form in forms if len(form) >= MASKED_MIN}


class Masker:
    """Replaces every known secret value (in each form it may take) with ``***``."""

    def __init__(self, values: Iterable[Any] = ()) -> None:
        self._forms: list[str] = []
        self.add(*values)

    def add(self, *values: Any) -> None:
        found = set(self._forms)
        for value in values:
            if isinstance(value, str):
                found.update(_forms(value))
        # Longest first: a value inside another is masked with it, not left half shown.
        self._forms = sorted(found, key=len, reverse=True)

    def text(self, text: str) -> str:
        for form in self._forms:
            if form in text:
                text = text.replace(form, MASK)
        return text

    def doc(self, value: Any) -> Any:
        """A JSON document with every string in it masked (mapping keys too)."""
        if not self._forms:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.doc(k): self.doc(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.doc(item) for item in value]
        return value
