"""Runs ON the host for the pd_preflight role: collect, then the checks and the facts.

Read-only: it runs the vendor tools and reads files, and never changes the host. One JSON
request on stdin, built by the role's task from its variables:

  host, kind (gpu | cpu), provider_lib, storage_paths     required
  expected_gpus, gpu_model, gpu_vendor, expected_nics, nic_driver, link_layer, gid_index,
  min_disk_gb                                              the fleet's expectations, required:
                                                           the role passes the fleet's
                                                           (FleetSettings is their home)
  nic_prefix                                               optional (the driver's usual one)
  peers                                                    [address, port] pairs that must
                                                           accept TCP

It prints ``{"ok", "checks", "facts"}`` (one dict per check: name, ok, message, skipped), or
exits 2 with ``{"error"}`` when the request is not one. A failed check is no failure of the
run: the role gates on ``ok``, and every failed check's message is on stderr, one per line.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pdctl.onhost.hardware.checks import Expectations, evaluate
from pdctl.onhost.hardware.collect import collect, read_request
from pdctl.onhost.hardware.facts import facts

# The request's names for Expectations' fields (the role's variables say expected_*).
_EXPECTATIONS = {
    "kind": "kind",
    "expected_gpus": "gpus",
    "gpu_model": "gpu_model",
    "gpu_vendor": "gpu_vendor",
    "expected_nics": "nics",
    "nic_driver": "nic_driver",
    "nic_prefix": "nic_prefix",
    "link_layer": "link_layer",
    "provider_lib": "provider_lib",
    "gid_index": "gid_index",
    "min_disk_gb": "min_disk_gb",
}
_TYPES: dict[str, tuple[type, ...]] = {
    "host": (str,),
    "kind": (str,),
    "expected_gpus": (int,),
    "gpu_model": (str,),
    "gpu_vendor": (str,),
    "expected_nics": (int,),
    "nic_driver": (str,),
    "nic_prefix": (str,),
    "link_layer": (str,),
    "provider_lib": (str,),
    "gid_index": (int,),
    "min_disk_gb": (int, float),
    "storage_paths": (list,),
    "peers": (list,),
}
_REQUIRED = (
    "host",
    "kind",
    "expected_gpus",
    "gpu_model",
    "gpu_vendor",
    "expected_nics",
    "nic_driver",
    "link_layer",
    "provider_lib",
    "gid_index",
    "min_disk_gb",
    "storage_paths",
)


def read(data: object) -> tuple[str, Expectations, dict[str, Any]]:
    """The host's name, its Expectations and collect()'s arguments; ValueError says why not."""
    if not isinstance(data, dict):
        raise ValueError("the request must be a JSON object")
    unknown = sorted(set(data) - set(_TYPES))
    missing = [key for key in _REQUIRED if key not in data]
    if unknown or missing:
        raise ValueError(
            "; ".join(
                ([f"unknown keys: {', '.join(unknown)}"] if unknown else [])
                + ([f"missing keys: {', '.join(missing)}"] if missing else [])
            )
        )
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, _TYPES[key]):
            raise ValueError(f"{key} must be a {' or '.join(t.__name__ for t in _TYPES[key])}")
    chosen = {field: data[key] for key, field in _EXPECTATIONS.items() if key in data}
    # An empty model or prefix: any model, the driver's usual prefix.
    for field in ("gpu_model", "nic_prefix"):
        if chosen.get(field) == "":
            chosen[field] = None
    expect = Expectations(**chosen)  # ValueError on a kind, vendor or driver it does not know
    gather = read_request(
        {key: data[key] for key in ("provider_lib", "storage_paths", "peers") if key in data}
    )
    gather["peers"] = [(str(peer[0]), int(peer[1])) for peer in gather["peers"]]
    return data["host"], expect, gather


def main() -> int:
    try:
        host, expect, gather = read(json.loads(sys.stdin.read() or "null"))
    except (ValueError, TypeError, IndexError) as exc:
        sys.stdout.write(json.dumps({"error": f"the preflight request: {exc}"}) + "\n")
        return 2
    raw = collect(**gather)
    checks = evaluate(host, raw, expect)
    doc = {"ok": all(c.ok for c in checks), "checks": [c.to_dict() for c in checks]}
    sys.stdout.write(json.dumps({**doc, "facts": facts(raw)}) + "\n")
    # What a run that gates on the report shows as its failure (the deploy's gate: its task
    # fails on "ok" and says its stderr): each failed check's message, one per line.
    sys.stderr.write("".join(f"{c.message}\n" for c in checks if not c.ok))
    return 0


if __name__ == "__main__":
    sys.exit(main())
