"""NVIDIA's tools: ``nvidia-smi --query-gpu`` (CSV), ``nvidia-ctk --version`` and
``nvidia-ctk cdi list``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pdctl.onhost.hardware.parsing import ParseError, snippet
from pdctl.onhost.hardware.pci import normalize_bdf

NVIDIA_QUERY_FIELDS = ("index", "name", "uuid", "memory.total", "driver_version", "pci.bus_id")

_NVIDIA_NO_DRIVER = "NVIDIA-SMI has failed"

_NVIDIA_NO_DEVICE = "No devices were found"

_HEADER_UNIT = re.compile(r"\s*\[[^\]]*\]$")  # "memory.total [MiB]"

_MIB = re.compile(r"^(\d+)(?:\s*MiB)?$")

_NOT_AVAILABLE = ("[N/A]", "N/A", "[Not Supported]")


def _nvidia_value(field_name: str, value: str, number: int) -> Any:
    if value in _NOT_AVAILABLE:
        return None
    if field_name == "index":
        if not value.isdigit():
            raise ParseError(f"line {number}: expected a GPU index, got {value!r}")
        return int(value)
    if field_name == "memory.total":
        match = _MIB.match(value)
        if not match:
            raise ParseError(
                f"line {number}: expected memory.total as '<N> MiB' or '<N>', got {value!r}"
            )
        return int(match.group(1))
    if field_name == "pci.bus_id":
        bdf = normalize_bdf(value)
        if bdf is None:
            raise ParseError(
                f"line {number}: expected pci.bus_id like 00000000:1B:00.0, got {value!r}"
            )
        return bdf
    return value


def parse_nvidia_smi_query(
    text: str, fields: Sequence[str] = NVIDIA_QUERY_FIELDS
) -> list[dict[str, Any]]:
    """Rows of ``nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits]``.

    One dict per GPU keyed by field name (``pci.bus_id`` also as ``pci``, normalised);
    memory in MiB with or without the unit; ``[N/A]`` is None; no device is [].
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith(_NVIDIA_NO_DRIVER):
        raise ParseError(f"nvidia-smi cannot talk to the driver: {snippet(lines[0])}")
    if lines and lines[0].startswith(_NVIDIA_NO_DEVICE):
        return []
    header = [_HEADER_UNIT.sub("", part.strip()) for part in lines[0].split(",")] if lines else []
    if header == list(fields):
        lines = lines[1:]
    rows = []
    for number, line in enumerate(lines, 1):
        parts = [part.strip() for part in line.split(", ")]
        if len(parts) != len(fields):
            raise ParseError(
                f"line {number}: expected {len(fields)} comma-separated values "
                f"({', '.join(fields)}), got {snippet(line)!r}"
            )
        row = {name: _nvidia_value(name, value, number) for name, value in zip(fields, parts)}
        if "pci.bus_id" in row:
            row["pci"] = row["pci.bus_id"]
        rows.append(row)
    return rows


_CDI_NAME = re.compile(r"^([a-z0-9][a-z0-9.-]*/[a-zA-Z0-9][a-zA-Z0-9_.-]*)=(\S+)$")

_LOG_LINE = re.compile(r"^(INFO|WARN|WARNING|DEBUG)\[\d+\]")


def parse_nvidia_ctk_cdi_list(text: str, kind: str = "nvidia.com/gpu") -> list[str]:
    """Device names of KIND from ``nvidia-ctk cdi list`` ('nvidia.com/gpu=0' -> '0').

    Its 'INFO[0000] Found N CDI devices' log line (stderr, sometimes merged) is skipped.
    """
    names = []
    for number, raw_line in enumerate(text.splitlines(), 1):
        line = raw_line.strip()
        if not line or _LOG_LINE.match(line):
            continue
        match = _CDI_NAME.match(line)
        if not match:
            raise ParseError(
                f"line {number}: expected a CDI device name like nvidia.com/gpu=0, "
                f"got {snippet(line)!r}"
            )
        if match.group(1) == kind:
            names.append(match.group(2))
    return names


def parse_nvidia_ctk_version(text: str) -> str:
    """'NVIDIA Container Toolkit CLI version 1.17.8' (first line of --version) -> '1.17.8'."""
    match = re.search(r"\bversion\s+v?(\d+\.\d+[^\s]*)", text)
    if not match:
        raise ParseError(
            "expected 'NVIDIA Container Toolkit CLI version X.Y.Z' from nvidia-ctk --version, "
            f"got {snippet(text)!r}"
        )
    return match.group(1)
