"""The lab: an emulated bare-metal GPU fleet on one Linux machine.

Each host is a systemd-nspawn container (systemd as PID 1, a real sshd,
podman) on its own overlay of a cached Debian rootfs, in its own network
namespace on a private bridge. Only GPUs and RDMA hardware are faked (the
tools in ``fakes/`` and the SGLang stand-in in ``worker/``).
"""
