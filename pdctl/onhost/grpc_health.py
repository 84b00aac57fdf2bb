"""One unary gRPC call over cleartext HTTP/2 (h2c), enough to ask a worker whether it is healthy.

Standard library only, and one implementation for both places that ask: pdctl and the scaler
call grpc_healthy() over a stream they open (an SSH channel to the worker's host), and the
roles' unit probe (unit_probe.py) calls it on the hosts, which have python3 and its standard
library only.

The call asks, by default, vLLM's ``vllm.grpc.engine.VllmEngine/HealthCheck``: what SMG itself
calls, served by both of vLLM's gRPC entry points (docs/facts.md, "vLLM P/D behind SMG"). Its
answer is ``HealthCheckResponse{bool healthy = 1; ...}``. SGLang's gRPC mode is asked
grpc.health.v1's ``Check`` (its own HealthCheck runs a generation; docs/facts.md, "SGLang's
gRPC mode"), which answers ``{ServingStatus status = 1}`` with SERVING = 1 (the empty request
asks about the whole server): in both, healthy is field 1 as varint 1, so one reading serves
either. The response headers are not decoded (that would need HPACK's
Huffman table): a failed call carries no DATA frame (its status is in the trailers), and no
message is no health.
"""

from __future__ import annotations

import struct
import time
from typing import Any

from pdctl.onhost.protowire import VARINT, WireError, fields

GRPC_HEALTH_CHECK = "/vllm.grpc.engine.VllmEngine/HealthCheck"
GRPC_STANDARD_HEALTH = "/grpc.health.v1.Health/Check"
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY = 0, 1, 3, 4, 6, 7
_END_STREAM, _ACK, _END_HEADERS, _PADDED = 0x1, 0x1, 0x4, 0x8
_STREAM = 1  # the one stream a call opens
_MAX_FRAME = 1 << 14  # SETTINGS_MAX_FRAME_SIZE's default: a peer sends no larger frame


class GrpcCallError(Exception):
    """The call got no answer message: refused, reset, or the peer is not a gRPC server."""


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a field whose first byte starts with ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _text(value: str) -> bytes:
    data = value.encode()
    return _integer(len(data), 7) + data  # a string literal, not Huffman-coded


def _headers(authority: str, path: str) -> bytes:
    """The request's header block: static-table entries and literals never indexed, so the
    server's dynamic table is never needed (RFC 7541 6.1, 6.2.2)."""
    block = bytes([0x83, 0x86])  # :method POST, :scheme http
    block += _integer(4, 4) + _text(path)  # :path (static name 4)
    block += _integer(1, 4) + _text(authority)  # :authority (static name 1)
    block += _integer(31, 4) + _text("application/grpc")  # content-type (static name 31)
    return block + b"\x00" + _text("te") + _text("trailers")


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
    return head + payload


def _read(stream: Any, size: int, deadline: float) -> bytes:
    data = b""
    while len(data) < size:
        if time.monotonic() > deadline:
            raise GrpcCallError("no answer in time")
        chunk = stream.recv(size - len(data))
        if not chunk:
            raise GrpcCallError("the connection closed before the answer")
        data += chunk
    return data


def grpc_call(stream: Any, authority: str, path: str, message: bytes, timeout: float) -> bytes:
    """Send one unary request on ``stream`` (socket-like: sendall, recv, settimeout) and return
    the response message. GrpcCallError when none comes."""
    deadline = time.monotonic() + timeout
    stream.settimeout(timeout)
    request = b"\x00" + struct.pack(">I", len(message)) + message
    stream.sendall(
        _PREFACE
        + _frame(_SETTINGS, 0, 0)
        + _frame(_HEADERS, _END_HEADERS, _STREAM, _headers(authority, path))
        + _frame(_DATA, _END_STREAM, _STREAM, request)
    )
    body = b""
    try:
        while True:
            head = b"\x00" + _read(stream, 9, deadline)
            length, kind, flags, stream_id = struct.unpack(">IBBI", head)
            if length > _MAX_FRAME:
                raise GrpcCallError("not an HTTP/2 peer (a frame larger than it may send)")
            payload = _read(stream, length, deadline)
            stream_id &= 0x7FFFFFFF
            if kind == _SETTINGS and not flags & _ACK:
                stream.sendall(_frame(_SETTINGS, _ACK, 0))
            elif kind == _PING and not flags & _ACK:
                stream.sendall(_frame(_PING, _ACK, 0, payload))
            elif kind == _GOAWAY or (kind == _RST_STREAM and stream_id == _STREAM):
                raise GrpcCallError("the server refused the call")
            elif kind == _DATA and stream_id == _STREAM:
                pad = payload[0] if flags & _PADDED else 0
                body += payload[1 : length - pad] if flags & _PADDED else payload
            if stream_id == _STREAM and kind in (_DATA, _HEADERS) and flags & _END_STREAM:
                break
    except OSError as exc:
        raise GrpcCallError(str(exc) or type(exc).__name__) from exc
    if len(body) < 5 or body[0] != 0:
        raise GrpcCallError("no answer message (the call failed)")
    (size,) = struct.unpack(">I", body[1:5])
    return body[5 : 5 + size]


def _field_one(message: bytes) -> int:
    """Field 1 of a protobuf message when it is a varint (absent: 0, proto3's default)."""
    try:
        for number, wire, value in fields(message):
            if number == 1 and wire == VARINT and isinstance(value, int):
                return value
    except WireError as exc:
        raise GrpcCallError("a malformed answer message") from exc
    return 0


def grpc_healthy(
    stream: Any, authority: str, path: str = GRPC_HEALTH_CHECK, timeout: float = 5.0
) -> bool:
    """Whether the worker on ``stream`` answers its health call with healthy (SERVING)."""
    try:
        return _field_one(grpc_call(stream, authority, path, b"", timeout)) == 1
    except GrpcCallError:
        return False
