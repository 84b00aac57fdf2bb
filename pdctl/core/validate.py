"""Rules for text that comes from a spec, an inventory or a host. PURE.

pdctl runs as root on every host, and what a spec says becomes unit lines, env files,
paths and argv words there. Each rule here is a whitelist: what is allowed, and a message
that says so. Each check raises ValueError with that message (pydantic turns it into a
field error with its line), so a rule is written once and used by every model.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterator
from typing import Any

# dstack's own rule for run and replica group names; pdctl also spells unit names and
# host paths (pdctl/core/layout.py) with them.
SERVICE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}\Z")
SERVICE_NAME_RULE = "a lower-case letter, then up to 39 lower-case letters, digits or '-'"
# A fleet is a directory of the workspace (inventories/<fleet>) and an Ansible inventory.
FLEET_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}\Z")
FLEET_NAME_RULE = "lower-case letters, digits, '-' and '_' (at most 63), not starting with - or _"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")

# The OCI distribution reference grammar (distribution/reference's regexp.go).
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(
    rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?\Z"
)
_IMAGE_NAME_MAX = 255

# Paths on a host: absolute, no '..', and only characters that need no quoting in a unit
# file, an env file or a shell word.
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._@+,=/-]*\Z")
PATH_RULE = "an absolute path of letters, digits and . _ @ + , = / - (no '..', no spaces)"
# An HTTP path (and query) as a probe may ask for it: RFC 3986 pchar plus '/' and '?'.
_URL_PATH = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*\Z")

# The longest duration pdctl accepts anywhere (timeouts, probe intervals, scaling delays).
MAX_SECONDS = 30 * 86400


def control_char(text: str, allowed: str = "") -> str | None:
    """The first control or line-separating character in ``text`` (None: there is none)."""
    for char in text:
        if char in allowed:
            continue
        if unicodedata.category(char) in {"Cc", "Zl", "Zp"} or char in "\x85":
            return char
    return None


def describe_char(char: str) -> str:
    names = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\0": "a NUL"}
    return names.get(char, f"the control character U+{ord(char):04X}")


def shown(value: object, otherwise: str) -> str:
    """A value from a file, written for an error message when it is a short printable text or
    a number; else ``otherwise`` (a message never carries a file's control characters or its
    bulk)."""
    if isinstance(value, str) and value.isprintable() and len(value) <= 40:
        return repr(value)
    if isinstance(value, int | float):
        return repr(value)
    return otherwise


def walk_strings(
    data: Any, loc: tuple[str | int, ...] = ()
) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Every string in a YAML document (mapping keys included) with its location."""
    if isinstance(data, str):
        yield loc, data
    elif isinstance(data, dict):
        for key, value in data.items():
            if isinstance(key, str):
                yield (*loc, key), key
            yield from walk_strings(value, (*loc, key))
    elif isinstance(data, list):
        for index, item in enumerate(data):
            yield from walk_strings(item, (*loc, index))


def service_name(value: str) -> str:
    if not SERVICE_NAME.match(value):
        raise ValueError(f"{value!r} is not a valid name: use {SERVICE_NAME_RULE}")
    return value


def fleet_name(value: str) -> str:
    if not FLEET_NAME.match(value):
        raise ValueError(f"{value!r} is not a valid fleet name: use {FLEET_NAME_RULE}")
    return value


def image(value: str) -> str:
    name = value.split("@", 1)[0].rsplit(":", 1)[0] if value.count(":") else value
    if not IMAGE_REFERENCE.match(value) or len(name) > _IMAGE_NAME_MAX:
        raise ValueError(
            f"{value!r} is not an image reference "
            "(use [registry[:port]/]name[:tag][@sha256:digest], e.g. lmsysorg/sglang:v0.5.5)"
        )
    return value


_IMAGE_ID = re.compile(r"^(?:sha256:)?([0-9a-f]{64})\Z")


def image_id(value: str) -> str:
    """An image ID as podman and docker print it (the digest of the image's config), as
    ``sha256:`` and 64 hex digits."""
    match = _IMAGE_ID.match(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not an image ID: use sha256: and 64 hex digits, as "
            "`podman image inspect --format '{{.Id}}' IMAGE` prints it"
        )
    return f"sha256:{match.group(1)}"


def host_path(value: str) -> str:
    if not _SAFE_PATH.match(value) or ".." in value.split("/"):
        raise ValueError(f"{value!r}: use {PATH_RULE}")
    return value


def volume(value: str) -> str:
    parts = value.split(":")
    if len(parts) not in {2, 3} or (len(parts) == 3 and parts[2] not in {"ro", "rw"}):
        raise ValueError(f"{value!r}: use /host/path:/container/path[:ro|:rw]")
    for part in parts[:2]:
        host_path(part)
    return value


_ENDPOINT = re.compile(
    r"^https?://(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*|\[[0-9A-Fa-f:.]+\])"
    r"(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~/-]*)?\Z"
)


def endpoint_url(value: str) -> str:
    """Where models come from: a hub's base URL (HF_ENDPOINT-style: http(s), a host, a port, a
    plain path; no user), or a directory on the hosts holding a hub cache (a local mirror)."""
    if value.startswith("/"):
        return host_path(value)
    if not _ENDPOINT.match(value):
        raise ValueError(
            f"{value!r}: use http(s)://HOST[:PORT][/PATH] (no user, query or spaces), "
            "or a directory on the hosts"
        )
    return value.rstrip("/")


def url_path(value: str) -> str:
    if not _URL_PATH.match(value):
        raise ValueError(
            f"{value!r} is not a URL path: it must start with '/' and hold only URL characters "
            "(the probe asks the worker itself, e.g. /health)"
        )
    return value


def port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"{value} is not a TCP port (1..65535)")
    return value


def seconds(value: float, *, zero_ok: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{value} is not a usable duration (a positive, finite time)")
    if value > MAX_SECONDS:
        raise ValueError(f"{value:g} s is longer than pdctl allows ({MAX_SECONDS // 86400} days)")
    return value
