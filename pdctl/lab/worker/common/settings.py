"""The lab's settings and faults for a stand-in: its state file (``PDFAKE_STATE``, default
``/etc/pd-fake/state.json``, re-read when it changes) with an environment variable overriding
each value (standard library only)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .capacity import (
    DEFAULT_DECODE_TOKEN_FLOOR_MS,
    DEFAULT_DECODE_TOKENS_PER_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    Rates,
)

DEFAULT_STATE_FILE = "/etc/pd-fake/state.json"
DEFAULT_WARMUP_SECS = 1.0
DEFAULT_LATENCY_MS = 20.0

Json = dict[str, Any]


def state_file(env: Mapping[str, str]) -> StateFile:
    return StateFile(Path(env.get("PDFAKE_STATE") or DEFAULT_STATE_FILE))


class StateFile:
    """The lab's fault file, re-read only when its mtime or size changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] | None = None
        self._data: Json = {}

    def read(self) -> Json:
        try:
            stat = self.path.stat()
        except OSError:
            return {}
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if key == self._key:
                return self._data
        try:
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            loaded = {}
        data: Json = loaded if isinstance(loaded, dict) else {}
        with self._lock:
            self._key, self._data = key, data
        return data


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def setting(env_name: str, state_key: str, default: float, state: Json) -> float:
    """An environment override, else the state file's value, else the default."""
    for candidate in (os.environ.get(env_name), state.get(state_key)):
        number = _number(candidate)
        if number is not None and number >= 0:
            return number
    return default


def warmup_secs(state: Json) -> float:
    """``worker_warmup_secs`` (``PDFAKE_WARMUP_SECS``): unhealthy for this long after start."""
    return setting("PDFAKE_WARMUP_SECS", "worker_warmup_secs", DEFAULT_WARMUP_SECS, state)


def latency_secs(state: Json) -> float:
    """``worker_latency_ms`` (``PDFAKE_LATENCY_MS``): a fixed cost before each first token."""
    return setting("PDFAKE_LATENCY_MS", "worker_latency_ms", DEFAULT_LATENCY_MS, state) / 1000.0


def rates(state: Json) -> Rates:
    """The capacity model's rates (capacity.py) from the lab's settings."""
    prefill = DEFAULT_PREFILL_TOKENS_PER_S
    decode = DEFAULT_DECODE_TOKENS_PER_S
    floor_ms = DEFAULT_DECODE_TOKEN_FLOOR_MS
    return Rates(
        prefill_tokens_per_s=setting(
            "PDFAKE_PREFILL_TOKENS_PER_S", "prefill_tokens_per_s", prefill, state
        ),
        decode_tokens_per_s=setting(
            "PDFAKE_DECODE_TOKENS_PER_S", "decode_tokens_per_s", decode, state
        ),
        decode_floor_s=setting(
            "PDFAKE_DECODE_TOKEN_FLOOR_MS", "decode_token_floor_ms", floor_ms, state
        )
        / 1000.0,
    )


def unhealthy(state: Json) -> bool:
    """The lab's ``worker-unhealthy`` fault."""
    return state.get("worker_unhealthy") is True
