"""A stand-in for SGLang's server, for pdctl's lab (no GPU, no model).

The lab image installs this package as ``sglang`` so that the unmodified command
``python3 -m sglang.launch_server ...`` starts :mod:`sglang.launch_server`, which speaks
the HTTP contract the Shepherd Model Gateway relies on (standard library only), or with
``--grpc-mode`` SMG's gRPC protocol (:mod:`sglang.grpc_server`, which needs grpcio).
"""
