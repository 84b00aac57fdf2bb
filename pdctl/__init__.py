"""pdctl: Prefill/Decode-disaggregated LLM inference on bare-metal GPU fleets."""

__version__ = "0.1.0"
