"""What the lab's engine stand-ins share: the capacity model, the lab's settings, hardware
checks and word tokens. Standard library only, relative imports only: the lab image installs
this tree under another package name."""
