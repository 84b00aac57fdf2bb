"""The router group's `smg launch` line -> the SMG flags pdctl keeps. PURE.

pdctl runs SMG itself (its address, port, metrics, API key and health settings are pdctl's),
so a spec's launch line is read for the rest: policies, timeouts, ... . SMG's argparse takes
any unambiguous abbreviation of a flag, so `--prometheus-ho 0.0.0.0` would move the metrics
off loopback: a word that abbreviates a flag pdctl owns is refused, not passed on. SMG is no
shell's child, so shell syntax in that line would reach it as words: refused too.
"""

from __future__ import annotations

import re
import shlex

from pdctl.core.validate import control_char, describe_char

# Flags of `smg launch` that pdctl sets itself (value count after the flag; -1: all up to
# the next flag). A dstack file carries some of them (--host, --port, ...): they are dropped.
OWNED: dict[str, int] = {
    "--host": 1,
    "--port": 1,
    "--pd-disaggregation": 0,
    "--prefill": 2,
    "--decode": 1,
    "--worker-urls": -1,
    "--prometheus-host": 1,
    "--prometheus-port": 1,
    "--api-key": 1,
    "--worker-startup-check-interval": 1,
    "--health-check-interval-secs": 1,
    "--shutdown-grace-period-secs": 1,
}
# Flags pdctl drops because it does that job another way: SMG takes the tokenizer from the
# workers it routes (a vLLM worker's GetTokenizer; HTTP workers need none at the router), so
# the router host needs no copy of the model and no hub access. dstack's gRPC files pass
# `--model-path $MODEL_ID`: the value is dropped with the flag, never expanded.
DROPPED: dict[str, int] = {"--model-path": 1, "--tokenizer-path": 1}
# Makes SMG 1.13 route the gRPC workers registered through its API (docs/facts.md).
IGW_FLAG = "--enable-igw"
LAUNCH = re.compile(
    r"(?:^|\s)(?:smg\s+launch|python3?\s+-m\s+(?:smg|sglang_router)\.launch_router)\b"
)
# SMG 1.13 starts a PD router whose prefill or decode policy is one of these only with two
# workers of that kind on its command line; pdctl registers every worker once the router is
# up, so such a router would never start.
LAUNCH_WORKER_POLICIES = frozenset({"power_of_two"})
GROUP_POLICY_FLAGS = ("--prefill-policy", "--decode-policy")
_SHELL_WORD = re.compile(r"^(?:&&|\|\||[;&|<>]|[<>]>?|\d?>&?\d?)$|[`$]")
_SHORT_OPTION = re.compile(r"^-[A-Za-z]")


class RouterFlagError(ValueError):
    """A word of the launch line pdctl cannot pass to SMG; says how to write it."""


def launch_line(commands: list[str]) -> str | None:
    """The router group's command that starts SMG (None: it has none)."""
    return next((c for c in commands if LAUNCH.search(c)), None)


def _words(line: str) -> list[str]:
    if "\n" in line.replace("\\\n", " ").strip():
        raise RouterFlagError(
            "the router's launch line holds a line break: write `smg launch ...` as one "
            "command (continue long lines with a trailing backslash)"
        )
    try:
        lexer = shlex.shlex(line.replace("\\\n", " "), posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        return list(lexer)
    except ValueError as exc:
        raise RouterFlagError(f"the router's launch line cannot be read: {exc}") from None


def group_policy(flag: str, value: str) -> str:
    """A prefill or decode policy SMG can start with while it has no worker yet."""
    if value in LAUNCH_WORKER_POLICIES:
        kind = flag.removeprefix("--").split("-")[0]
        raise RouterFlagError(
            f"{flag} {value}: SMG starts a PD router with {value} only when two {kind} workers "
            "are on its command line, and pdctl registers workers after the router starts; "
            "choose another policy (e.g. cache_aware, round_robin, least_load)"
        )
    return value


def _owned_abbreviation(flag: str) -> str | None:
    if flag in OWNED or flag in DROPPED or len(flag) < 4:
        return None
    return next((owned for owned in (*OWNED, *DROPPED) if owned.startswith(flag)), None)


def _check_word(word: str, dropped: bool = False) -> None:
    bad = control_char(word)
    if bad is not None:
        raise RouterFlagError(f"a router flag holds {describe_char(bad)}: {word!r}")
    if dropped:  # a value that never reaches SMG
        return
    if _SHELL_WORD.search(word):
        raise RouterFlagError(
            f"{word!r} in the router's launch line: pdctl starts SMG itself, not through a "
            "shell, so shell syntax and $VARIABLES are not expanded; write the values themselves"
        )
    if _SHORT_OPTION.match(word):
        raise RouterFlagError(f"{word!r}: pass SMG's long flags (--name value)")
    flag = word.split("=", 1)[0]
    if flag.startswith("--"):
        owned = _owned_abbreviation(flag)
        if owned is not None:
            raise RouterFlagError(
                f"{flag} abbreviates {owned}, which pdctl sets itself; remove it "
                "(pdctl.router in the spec holds the router's settings)"
            )


def _next(words: list[str], index: int) -> str:
    return words[index] if index < len(words) else ""


def kept_flags(line: str) -> list[str]:
    """The launch line's flags minus those pdctl sets (RouterFlagError: one it cannot pass)."""
    return _scan(line)[0]


def dropped_flags(line: str) -> list[str]:
    """The DROPPED flags the launch line gives (pdctl's plan says it left them out)."""
    return _scan(line)[1]


def _scan(line: str) -> tuple[list[str], list[str]]:
    words = _words(line)
    start = next(
        (i for i, w in enumerate(words) if w == "launch" or w.endswith("launch_router")), None
    )
    if start is None:
        raise RouterFlagError("the router's launch line has no `smg launch`")
    kept: list[str] = []
    dropped: list[str] = []
    i = start + 1
    while i < len(words):
        word = words[i]
        flag = word.split("=", 1)[0]
        _check_word(word, dropped=flag in DROPPED)
        i += 1
        if flag in GROUP_POLICY_FLAGS:
            group_policy(flag, word.split("=", 1)[1] if "=" in word else _next(words, i))
        if flag in OWNED or flag in DROPPED:
            take = OWNED.get(flag, DROPPED.get(flag, 0))
            if "=" not in word:
                while take != 0 and i < len(words) and not words[i].startswith("--"):
                    _check_word(words[i], dropped=flag in DROPPED)
                    i += 1
                    take -= 1
            if flag in DROPPED:
                dropped.append(flag)
            continue
        kept.append(word)
    return kept, dropped
