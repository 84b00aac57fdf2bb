"""pdctl: Prefill/Decode-disaggregated LLM inference on bare-metal GPU fleets."""

import sys

__version__ = "0.1.0"

# paramiko's ssh_config module imports invoke (and with it asyncio and unittest.mock) when it
# loads, only to run the `Match exec` lines of an ssh_config file. pdctl parses none (its SSH
# targets are explicit), and that import was a tenth of every command's start. Marked absent,
# paramiko takes its own fallback, which would raise only if a `Match exec` line were evaluated.
# This is the package's root, so the mark comes before any pdctl module imports paramiko.
sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]
