"""A stand-in for vLLM's gRPC server (server.py), for pdctl's lab (no GPU, no model).

The lab image installs it with entry points spelled as vLLM's own (``vllm serve ... --grpc``,
``python3 -m vllm.entrypoints.grpc_server``); it needs grpcio, grpcio-health-checking and
smg-grpc-proto, which the image unpacks from the wheelhouse.
"""
