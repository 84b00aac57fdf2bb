"""What the lab's engine stand-ins share: the capacity model, the lab's settings, hardware
checks, word tokens and the gRPC stand-ins' tokenizer. Standard library only (but
grpc_serving.py, which only the gRPC stand-ins import), relative imports only: the lab image
installs this tree under another package name."""
