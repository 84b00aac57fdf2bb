#!/usr/bin/python
"""Probe a host for PD inference: GPUs, the RDMA fabric, the runtime, disk and peers.

Read-only: it runs the vendor tools and reads files, and never changes the host.
The parsing and the verdicts live in pd_hardware (pdctl/hardware.py), shared
with pdctl's own SSH fact gathering. What a host must have has no default here:
the role passes the fleet's (FleetSettings, pdctl/fleet_model.py, is their home).
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
  expected_gpus: {description: GPUs a GPU host must have., type: int, required: true}
  gpu_model: {description: Substring the GPU model must contain (empty for any)., type: str, required: true}
  gpu_vendor: {description: amd, nvidia or any., type: str, required: true}
  expected_nics: {description: RDMA devices a GPU host must have., type: int, required: true}
  nic_driver: {description: "The NICs' libibverbs provider name (bnxt_re, mlx5, ..., auto).", type: str, required: true}
  nic_prefix: {description: Usual device name prefix (empty derives it from nic_driver)., type: str, default: ""}
  link_layer: {description: eth (RoCE), ib (InfiniBand) or auto., type: str, required: true}
  provider_lib: {description: Path of the libibverbs provider library., type: str, required: true}
  gid_index: {description: GID index that must be RoCE v2 (Mooncake's MC_GID_INDEX)., type: int, required: true}
  min_disk_gb: {description: Free GB needed on the container storage path., type: float, required: true}
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
            "expected_gpus": {"type": "int", "required": True},
            "gpu_model": {"type": "str", "required": True},
            "gpu_vendor": {"type": "str", "required": True, "choices": ["amd", "nvidia", "any"]},
            "expected_nics": {"type": "int", "required": True},
            "nic_driver": {"type": "str", "required": True},
            "nic_prefix": {"type": "str", "default": ""},
            "link_layer": {"type": "str", "required": True, "choices": ["eth", "ib", "auto"]},
            "provider_lib": {"type": "str", "required": True},
            "gid_index": {"type": "int", "required": True},
            "min_disk_gb": {"type": "float", "required": True},
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
