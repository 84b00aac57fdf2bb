"""Where a host keeps what collection reads and the checks name: the libibverbs provider
directories, the default provider library, the container storage candidates, the CDI spec.
"""

from __future__ import annotations

DEFAULT_PROVIDER_LIB = "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"

# pdctl/core/layout.py's STORAGE_PATHS: this file runs on hosts without pdctl, so it keeps a copy,
# which tests/unit/core/test_layout.py holds equal.
DEFAULT_STORAGE_PATHS = ("/var/lib/containers", "/var/lib/docker", "/var/lib")

# Where distributions put libibverbs providers (RHEL-style, Debian multiarch, local builds).
PROVIDER_DIRS = (
    "/usr/lib64/libibverbs",
    "/usr/lib/x86_64-linux-gnu/libibverbs",
    "/usr/lib/aarch64-linux-gnu/libibverbs",
    "/usr/local/lib64/libibverbs",
    "/usr/local/lib/libibverbs",
)

# Where nvidia-ctk writes the CDI spec (toolkit >= 1.18 also keeps the /var/run one fresh).
CDI_SPEC_PATHS = ("/etc/cdi/nvidia.yaml", "/var/run/cdi/nvidia.yaml")
