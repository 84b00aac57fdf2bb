"""The lab's engine stand-ins (no GPU, no model): ``sglang`` (HTTP) and ``vllm`` (gRPC), and
what they share (``common``). The lab image installs this tree as ``pdlab_worker`` with thin
``sglang``/``vllm`` entry points spelled as the real engines' (pdctl/lab/worker_tree.py)."""
