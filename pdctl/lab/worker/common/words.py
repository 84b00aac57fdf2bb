"""The stand-ins' tokens: whitespace-separated words (standard library only), so that token
counts, ``max_tokens`` and stream deltas are deterministic and easy to check."""

from __future__ import annotations

import re


def count_tokens(text: str) -> int:
    """A deterministic token count: whitespace-separated words."""
    return len(text.split())


def pieces(text: str) -> list[str]:
    """Stream deltas: one word (with its trailing space) at a time."""
    return re.findall(r"\S+\s*", text)


def fit(text: str, limit: int) -> str:
    """``text`` with exactly ``limit`` words: its words cycled or cut (an engine stops at
    max_tokens, or goes on talking until it gets there)."""
    words = text.split()
    return " ".join(words[i % len(words)] for i in range(limit)) if words else ""
