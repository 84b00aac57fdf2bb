"""The scaler's config on the router host (roles/pd_scaler/vars/main.yml) carries every
plan field the scaler acts on: a field left out reaches the deployed scaler as its default
(a budgeted service whose scaler drew from no ledger, an advising one that acted)."""

from __future__ import annotations

from pathlib import Path

import yaml

from pdctl.core.plan import Plan

REPO = Path(__file__).resolve().parents[3]
# Plan fields the scaler does not read (each with why), so the role need not carry them.
NOT_READ = {
    "excluded_hosts": "deploy's placement notes",
    "model_cache": "the deploy fills the cache; a start reads it on the worker host",
    "model_repo": "as model_cache",
    "model_revision": "as model_cache",
    "notes": "the plan's notes for the operator",
    "port_stride": "ports are the slots' own, planned",
    "roots": "carried as pd_layout (plan_from_extravars takes the roots from it)",
    "scaler_metrics_port": "the role's own variable (pd_scaler_metrics_port) serves it",
    "secrets_digest": "the drift check's, on the controller",
}


def test_the_scalers_config_carries_every_field_it_reads() -> None:
    role_vars = yaml.safe_load((REPO / "roles/pd_scaler/vars/main.yml").read_text())
    carried = set(role_vars["_pd_scaler_config"]["plan"])
    wanted = {f"pd_{name}" for name in Plan.model_fields if name not in NOT_READ}
    assert wanted <= carried, sorted(wanted - carried)
    assert {"pd_scaling_mode", "pd_max_gpus", "pd_gpu_budget"} <= carried
