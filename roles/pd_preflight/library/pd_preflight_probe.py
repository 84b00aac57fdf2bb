#!/usr/bin/python
"""Probe a host for PD inference: GPUs, the RDMA fabric, the runtime, disk and peers.

Read-only: it runs the vendor tools and reads files, and never changes the host.
The parsing and the verdicts live in pd_hardware (pdctl/hardware.py), shared
with pdctl's own SSH fact gathering.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pd_preflight_probe
short_description: Check a GPU host for Prefill/Decode inference (read-only)
description:
  - Runs ibv_devices, ibv_devinfo, amd-smi (or rocm-smi), the container runtime's info,
    tries in a throwaway child what the OCI runtime does for `--ulimit memlock=-1:-1`,
    and TCP connects to peers; returns one result per check with a message that names
    the finding and the fix. Never changes the host and never fails by itself.
options:
  host: {description: Name used in messages., type: str, required: true}
  kind: {description: gpu or cpu (CPU hosts skip the GPU/RDMA checks)., type: str, required: true}
  expected_gpus: {description: GPUs a GPU host must have., type: int, default: 8}
  gpu_model: {description: Substring the GPU model must contain (empty for any)., type: str, default: MI300X}
  gpu_vendor: {description: amd or nvidia., type: str, default: amd}
  expected_nics: {description: RDMA devices a GPU host must have., type: int, default: 8}
  nic_driver: {description: "The NICs' libibverbs provider name (bnxt_re, mlx5, ...).", type: str, default: bnxt_re}
  nic_prefix: {description: Usual device name prefix (empty derives it from nic_driver)., type: str, default: ""}
  link_layer: {description: eth (RoCE) or ib (InfiniBand)., type: str, default: eth}
  provider_lib: {description: Path of the libibverbs provider library., type: str, required: true}
  gid_index: {description: GID index that must be RoCE v2 (Mooncake's MC_GID_INDEX)., type: int, default: 3}
  min_disk_gb: {description: Free GB needed on the container storage path., type: float, default: 50}
  storage_paths: {description: Candidate container storage paths, first existing wins., type: list, elements: str, required: true}
  peers: {description: "[address, port] pairs that must accept TCP.", type: list, elements: list}
author: pdctl
"""

RETURN = r"""
checks: {description: One dict per check (name, ok, message, skipped)., type: list, returned: always}
facts: {description: What was found (GPUs, RDMA devices, runtime, disk)., type: dict, returned: always}
ok: {description: Whether every check passed., type: bool, returned: always}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.pd_hardware import Expectations, collect, evaluate, facts


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "host": {"type": "str", "required": True},
            "kind": {"type": "str", "required": True, "choices": ["gpu", "cpu"]},
            "expected_gpus": {"type": "int", "default": 8},
            "gpu_model": {"type": "str", "default": "MI300X"},
            "gpu_vendor": {"type": "str", "default": "amd", "choices": ["amd", "nvidia", "any"]},
            "expected_nics": {"type": "int", "default": 8},
            "nic_driver": {"type": "str", "default": "bnxt_re"},
            "nic_prefix": {"type": "str", "default": ""},
            "link_layer": {"type": "str", "default": "eth", "choices": ["eth", "ib", "auto"]},
            "provider_lib": {"type": "str", "required": True},
            "gid_index": {"type": "int", "default": 3},
            "min_disk_gb": {"type": "float", "default": 50.0},
            "storage_paths": {"type": "list", "elements": "str", "required": True},
            "peers": {"type": "list", "elements": "list", "default": []},
        },
        supports_check_mode=True,
    )
    params = module.params
    try:
        expect = Expectations(
            kind=params["kind"], gpus=params["expected_gpus"], gpu_model=params["gpu_model"] or None,
            nics=params["expected_nics"], nic_prefix=params["nic_prefix"] or None,
            provider_lib=params["provider_lib"], gid_index=params["gid_index"],
            min_disk_gb=params["min_disk_gb"], gpu_vendor=params["gpu_vendor"],
            nic_driver=params["nic_driver"], link_layer=params["link_layer"],
        )
    except ValueError as exc:
        module.fail_json(msg=f"{params['host']}: {exc}")
    raw = collect(
        provider_lib=params["provider_lib"],
        storage_paths=params["storage_paths"],
        peers=[(str(address), int(port)) for address, port in params["peers"]],
    )
    checks = evaluate(params["host"], raw, expect)
    module.exit_json(changed=False, ok=all(c.ok for c in checks),
                     checks=[c.to_dict() for c in checks], facts=facts(raw))


if __name__ == "__main__":
    main()
