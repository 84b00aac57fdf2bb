"""Protocol Buffers' wire format, read: enough of it for the answers pdctl decodes itself (a
gRPC health answer on the hosts, an engine's GetLoads in the scaler), where no protobuf
package is installed. Every length is bounded by the message: a malformed one is a WireError.

Standard library only (pdctl/onhost: it runs on hosts too).
"""

from __future__ import annotations

from collections.abc import Iterator

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise WireError("a truncated or overlong varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        shift += 7
        if not byte & 0x80:
            return value, at


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value): a varint or fixed field as its integer bits, a
    length-delimited one as its bytes. Groups (wire types 3, 4) do not occur in proto3."""
    at = 0
    while at < len(data):
        key, at = varint(data, at)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == VARINT:
            value, at = varint(data, at)
            yield number, wire, value
        elif wire in (FIXED64, FIXED32):
            size = 8 if wire == FIXED64 else 4
            if at + size > len(data):
                raise WireError("a truncated fixed-size field")
            yield number, wire, int.from_bytes(data[at : at + size], "little")
            at += size
        elif wire == LENGTH:
            size, at = varint(data, at)
            if at + size > len(data):
                raise WireError("a length-delimited field runs past the message")
            yield number, wire, data[at : at + size]
            at += size
        else:
            raise WireError(f"wire type {wire}")
