"""Pinned versions of what pdctl installs on hosts: one home for each."""

from importlib import metadata

# The Shepherd Model Gateway (PyPI `smg`), installed in its own venv on the router host.
SMG_VERSION = "1.13.0"

# What the scaler's code imports on the router host (no Ansible there), and nothing more: its
# venv is made on a router host's first deploy (a test holds this equal to the bundle's imports).
SCALER_PACKAGES = ("paramiko", "pydantic", "pyyaml", "prometheus-client")


def scaler_requirements() -> list[str]:
    """The scaler's packages at the versions this control node runs, so it behaves as tested."""
    pinned = []
    for name in SCALER_PACKAGES:
        try:
            pinned.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pinned.append(name)
    return pinned


# The lab's gRPC stand-ins (vLLM's, and SGLang's in --grpc-mode) serve SMG's gRPC protocol
# (PyPI smg-grpc-proto) with these, unpacked from the wheelhouse into both worker images
# (pdctl/lab/worker_tree.py). smg-grpc-proto is pinned in pyproject.toml's dev extras too, so
# the tests run the stand-ins with the venv's interpreter.
GRPC_STANDIN_PACKAGES = {
    "grpcio": "1.85.3",
    "grpcio-health-checking": "1.85.1",
    "protobuf": "7.36.2",
    "smg-grpc-proto": "0.4.28",
}
