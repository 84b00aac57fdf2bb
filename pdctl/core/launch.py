"""Which engine a worker group's launch command starts, and what it says about its role. PURE.

Read from the words of one command (their values, quotes removed; pdctl/core/entrypoint.py splits
them), never by matching the raw text:
- SGLang: ``python -m sglang.launch_server ...`` (or a path to launch_server.py), over HTTP, or
  over gRPC with ``--grpc-mode`` (dstack's pd-grpc.dstack.yml: SGLang then serves SMG's
  ``sglang.grpc.scheduler.SglangScheduler`` and grpc.health.v1 on its port, no HTTP);
- vLLM over gRPC: ``vllm serve MODEL --grpc ...`` or ``python -m vllm.entrypoints.grpc_server``.
  SMG routes vLLM workers over gRPC only (docs/facts.md, "vLLM P/D behind SMG"), so a vLLM
  HTTP server (``vllm serve`` without ``--grpc``, the OpenAI api_server module) is refused.
A vLLM worker's role comes from its ``--kv-transfer-config`` JSON: kv_producer is a prefill,
kv_consumer a decode, kv_both says neither (the group's name or ``pdctl: {role: ...}`` must).
The connector and role it names are sent to SMG in the worker's registration, so they are
checked against a whitelist here; a ``kv_port`` (and ``kv_ip``) it sets is a listener the
plan accounts for on each slot's host (pdctl/core/plan/).
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Literal

Engine = Literal["sglang", "vllm"]
ENGINES: tuple[Engine, ...] = ("sglang", "vllm")
# How SMG reaches a worker: SGLang over HTTP (or gRPC in its --grpc-mode), vLLM over gRPC.
Connection = Literal["http", "grpc"]
Role = Literal["prefill", "decode"]
# vLLM's kv_role values (KVTransferConfig) and the P/D role each gives a worker.
KV_ROLES: dict[str, Role | None] = {
    "kv_producer": "prefill",
    "kv_consumer": "decode",
    "kv_both": None,
}
KV_CONFIG_FLAG = "--kv-transfer-config"
# SGLang's flag that makes a worker serve SMG over gRPC (dstack's pd-grpc.dstack.yml); a
# switch, which SGLang's argparse also takes abbreviated (down to --grpc).
GRPC_MODE = "--grpc-mode"
_GRPC_MODE_SHORTEST = "--grpc"
_KV_EXAMPLE = f"""{KV_CONFIG_FLAG} '{{"kv_connector":"NixlConnector","kv_role":"kv_producer"}}'"""
_KV_CONNECTOR = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}\Z")

# `sglang.launch_server` after `-m` (or glued to it), or a path to launch_server(.py).
SGLANG_WORD = re.compile(r"(?:-m)?(?:[\w.]*\.|\S*/)?launch_server(?:\.py)?")
# vLLM's gRPC server module (deprecated in newer vLLM but present), or a path to it.
_VLLM_GRPC_MODULE = re.compile(
    r"(?:-m)?vllm\.entrypoints\.grpc_server|\S*/vllm/entrypoints/grpc_server\.py"
)
# vLLM's HTTP (OpenAI) servers: SMG cannot route to them.
_VLLM_HTTP_MODULE = re.compile(r"(?:-m)?vllm\.entrypoints\.(?:openai\.)?api_server(?:\.py)?")
_VLLM_PROGRAM = re.compile(r"(?:\S*/)?vllm")
# Text that names a launch: a command holding it must have it as a word pdctl can find.
MENTIONS = ("launch_server", "grpc_server", "vllm serve")

_GRPC_HINT = (
    "SMG routes vLLM workers over gRPC only: start it with `vllm serve MODEL --grpc ...` "
    "or `python -m vllm.entrypoints.grpc_server --model MODEL ...`"
)


class LaunchError(ValueError):
    """A launch command pdctl cannot use; problem and how to write it instead."""

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(problem, hint)
        self.problem = problem
        self.hint = hint


@dataclass(frozen=True)
class Launch:
    """A server launch found in a command's words."""

    engine: Engine
    at: int  # the index of the word that names the server; its arguments follow it
    connection: Connection = "http"
    kv_connector: str | None = None  # vLLM: from --kv-transfer-config
    kv_role: str | None = None
    # vLLM: the KV connector's own listener, when the config sets it (kv_port and kv_ip):
    # a port the user chose, which pdctl accounts for on each slot's host (pdctl/core/plan/).
    kv_port: int | None = None
    kv_ip: str | None = None
    args: tuple[str, ...] = ()  # the values of the words after the server's name

    def has_flag(self, flag: str) -> bool:
        return any(arg == flag or arg.startswith(f"{flag}=") for arg in self.args)

    @property
    def name(self) -> str:
        return "SGLang" if self.engine == "sglang" else "vLLM"

    @property
    def role(self) -> Role | None:
        """The role the command itself says (vLLM's kv_role; None: it does not say)."""
        return KV_ROLES.get(self.kv_role or "")


def find(values: list[str]) -> Launch | None:
    """The launch among a simple command's word values (None: it starts no server)."""
    for at, value in enumerate(values):
        if SGLANG_WORD.fullmatch(value):
            sglang_args = tuple(values[at + 1 :])
            return Launch(
                "sglang", at, connection=_sglang_connection(sglang_args), args=sglang_args
            )
        if _VLLM_HTTP_MODULE.fullmatch(value):
            raise LaunchError(f"`{value}` starts vLLM's HTTP server", _GRPC_HINT)
        if _VLLM_GRPC_MODULE.fullmatch(value):
            return _vllm(values, at)
        if _VLLM_PROGRAM.fullmatch(value) and values[at + 1 : at + 2] == ["serve"]:
            args = values[at + 2 :]
            if not any(arg == "--grpc" or arg.startswith("--grpc=") for arg in args):
                raise LaunchError(
                    "`vllm serve` without --grpc starts vLLM's HTTP server", _GRPC_HINT
                )
            return _vllm(values, at + 1)
    return None


def _sglang_connection(args: tuple[str, ...]) -> Connection:
    """gRPC when the arguments switch SGLang's gRPC mode on (the flag, or argparse's
    abbreviation of it), else HTTP."""
    grpc = False
    for arg in args:
        name, inline, _ = arg.partition("=")
        if len(name) < len(_GRPC_MODE_SHORTEST) or not GRPC_MODE.startswith(name):
            continue
        if inline:
            raise LaunchError(
                f"`{arg}`: {GRPC_MODE} is a switch and takes no value",
                f"write {GRPC_MODE} alone (SGLang then serves SMG over gRPC), or leave it out "
                "(HTTP)",
            )
        grpc = True
    return "grpc" if grpc else "http"


def _vllm(values: list[str], at: int) -> Launch:
    raw: str | None = None
    args = values[at + 1 :]
    for index, word in enumerate(args):
        name, inline, value = word.partition("=")
        if name.startswith(f"{KV_CONFIG_FLAG}."):
            raise LaunchError(
                f"`{name}`: pdctl reads the KV transfer config as one JSON value",
                f"write {_KV_EXAMPLE}",
            )
        if name != KV_CONFIG_FLAG:
            continue
        if raw is not None:
            raise LaunchError(f"{KV_CONFIG_FLAG} is given twice", "keep one")
        if not inline:
            if index + 1 == len(args):
                raise LaunchError(f"{KV_CONFIG_FLAG} has no value", "give it a JSON object")
            value = args[index + 1]
        raw = value
    if raw is None:
        raise LaunchError(
            f"a vLLM P/D worker needs {KV_CONFIG_FLAG} (its KV connector and kv_role)",
            f"add {_KV_EXAMPLE} (kv_consumer for the decode group)",
        )
    connector, role, config = _kv_config(raw)
    kv_port, kv_ip = _kv_listener(config)
    return Launch(
        "vllm",
        at,
        connection="grpc",
        kv_connector=connector,
        kv_role=role,
        kv_port=kv_port,
        kv_ip=kv_ip,
        args=tuple(args),
    )


def _kv_listener(config: dict[str, object]) -> tuple[int | None, str | None]:
    """kv_port and kv_ip as the config sets them (None: it does not)."""
    port = config.get("kv_port")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535
    ):
        raise LaunchError(
            f"{KV_CONFIG_FLAG} kv_port {port!r}: a TCP port, 1..65535", 'e.g. "kv_port": 14579'
        )
    address = config.get("kv_ip")
    if address is not None:
        try:
            address = str(ipaddress.ip_address(address if isinstance(address, str) else ""))
        except ValueError:
            raise LaunchError(
                f"{KV_CONFIG_FLAG} kv_ip {address!r}: an IP address",
                'e.g. "kv_ip": "0.0.0.0"; leave it out to let vLLM pick its host\'s',
            ) from None
    return port, address


def _kv_config(raw: str) -> tuple[str, str, dict[str, object]]:
    hint = f"write it as JSON in single quotes: {_KV_EXAMPLE}"
    if "$" in raw or "`" in raw:
        raise LaunchError(
            f"{KV_CONFIG_FLAG} holds a shell expansion: pdctl must read the connector and role",
            hint,
        )
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise LaunchError(f"{KV_CONFIG_FLAG} is not valid JSON ({exc})", hint) from None
    if not isinstance(config, dict):
        raise LaunchError(f"{KV_CONFIG_FLAG} is not a JSON object", hint)
    role = config.get("kv_role")
    if role not in KV_ROLES:
        raise LaunchError(
            f"{KV_CONFIG_FLAG} kv_role {role!r}: one of {', '.join(KV_ROLES)}",
            "kv_producer for the prefill group, kv_consumer for the decode group",
        )
    connector = config.get("kv_connector")
    if not isinstance(connector, str) or not _KV_CONNECTOR.match(connector):
        raise LaunchError(
            f"{KV_CONFIG_FLAG} kv_connector {connector!r}: a connector class name "
            "(a letter, then letters, digits or '_')",
            "e.g. NixlConnector",
        )
    return connector, role, config
