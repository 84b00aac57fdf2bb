"""The vLLM stand-in's command lines, spelled as vLLM's own (docs/facts.md, vLLM P/D):

* ``vllm serve MODEL --grpc [--host H] [--port P] --kv-transfer-config JSON ...``
* ``python3 -m vllm.entrypoints.grpc_server --model MODEL [--host H] [--port P] ...``

Flags the stand-in does not model (vLLM has hundreds) are accepted and ignored; a malformed
``--kv-transfer-config`` or an unknown ``kv_role`` is refused, as vLLM refuses them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_SIDE_CHANNEL_PORT = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT's default
DEFAULT_SIDE_CHANNEL_HOST = "localhost"  # VLLM_NIXL_SIDE_CHANNEL_HOST's default
DEFAULT_MAX_MODEL_LEN = 32768
DEFAULT_MAX_NUM_SEQS = 256


class UsageError(ValueError):
    """A command line vLLM would refuse at start."""


@dataclass(frozen=True)
class KvTransfer:
    connector: str
    role: str  # one of KV_ROLES
    engine_id: str


@dataclass(frozen=True)
class Config:
    model: str
    served_model_name: str
    host: str
    port: int
    kv: KvTransfer | None
    max_model_len: int
    max_num_seqs: int
    tensor_parallel_size: int
    data_parallel_size: int
    block_size: int
    attention_backend: str
    kv_cache_dtype: str
    dtype: str
    side_host: str
    side_port: int
    hostname: str

    @property
    def role(self) -> str:
        """What the worker does with a request that carries no KV-transfer parameters."""
        if self.kv is None:
            return "regular"
        return {"kv_producer": "prefill", "kv_consumer": "decode"}.get(self.kv.role, "both")


def parse_kv_transfer_config(text: str) -> KvTransfer:
    """vLLM's KVTransferConfig, as far as SMG and the P/D hand-off use it."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--kv-transfer-config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("--kv-transfer-config must be a JSON object")
    connector = value.get("kv_connector")
    if not isinstance(connector, str) or not connector:
        raise UsageError("--kv-transfer-config needs kv_connector (e.g. NixlConnector)")
    role = value.get("kv_role")
    if role not in KV_ROLES:
        raise UsageError(f"Unsupported kv_role: {role!r}. Supported roles are {list(KV_ROLES)}")
    engine_id = value.get("engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise UsageError("--kv-transfer-config: engine_id must be a string")
    return KvTransfer(connector, role, engine_id or str(uuid.uuid4()))


def _parser(prog: str, positional_model: bool, default_port: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="pdctl lab stand-in for vLLM's gRPC server (no GPU, echoes prompts).",
        allow_abbrev=False,
    )
    add = parser.add_argument
    if positional_model:
        add("model_tag", nargs="?", default=None, metavar="MODEL")
        add("--grpc", action="store_true", help="serve gRPC (the only mode this stand-in has)")
    add("--model", default=None)
    add("--served-model-name", nargs="+", default=None)
    add("--host", default="0.0.0.0")  # noqa: S104 - vLLM's own default: all interfaces
    add("--port", type=int, default=default_port)
    add("--kv-transfer-config", default=None)
    add("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    add("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    add("--tensor-parallel-size", "-tp", type=int, default=1)
    add("--data-parallel-size", "-dp", type=int, default=1)
    add("--block-size", type=int, default=16)
    add("--attention-backend", default="")
    add("--kv-cache-dtype", default="auto")
    add("--dtype", default="auto")
    return parser


def parse(
    argv: Sequence[str], entry: str, env: Mapping[str, str] = os.environ
) -> tuple[Config, list[str]]:
    """The config and the flags ignored; ``entry`` is ``serve`` (``vllm serve``) or
    ``grpc_server``. Raises UsageError for what vLLM would refuse."""
    serve = entry == "serve"
    prog = "vllm serve" if serve else "python3 -m vllm.entrypoints.grpc_server"
    args, unknown = _parser(prog, serve, 8000 if serve else 50051).parse_known_args(list(argv))
    model = args.model or (args.model_tag if serve else None)
    if not model:
        raise UsageError(f"{prog}: a model is required ({'MODEL or ' if serve else ''}--model)")
    if serve and not args.grpc:
        raise UsageError("vllm serve: this stand-in serves gRPC only (add --grpc)")
    kv = (
        None
        if args.kv_transfer_config is None
        else parse_kv_transfer_config(args.kv_transfer_config)
    )
    try:
        side_port = int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or DEFAULT_SIDE_CHANNEL_PORT)
    except ValueError:
        raise UsageError("VLLM_NIXL_SIDE_CHANNEL_PORT must be a port number") from None
    cfg = Config(
        model=model,
        served_model_name=(args.served_model_name or [model])[0],
        host=args.host,
        port=args.port,
        kv=kv,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=max(1, args.data_parallel_size),
        block_size=args.block_size,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        side_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or DEFAULT_SIDE_CHANNEL_HOST,
        side_port=side_port,
        hostname=socket.gethostname(),
    )
    return cfg, [item for item in unknown if item.startswith("-")]
