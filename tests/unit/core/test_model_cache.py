"""The plan's model cache (pdctl/core/model_cache.py): which hub model, which cache, how the
workers see it; hostile model ids and revisions refused with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdctl.core.errors import InputError
from pdctl.core.fleet_model import Fleet, FleetSettings
from pdctl.core.plan import build
from pdctl.core.spec import SpecError, load
from pdctl.operations import prefetch
from tests.unit.core.plan.test_placement import ENV, REPO, host

LAB = (REPO / "examples/lab/pd.yml").read_text()
HF = "/root/.cache/huggingface"


def plan_of(text: str, tmp_path: Path, **settings: str):  # type: ignore[no-untyped-def]
    spec_file = tmp_path / "pd.yml"
    spec_file.write_text(text)
    spec, env = load(spec_file, ENV)
    hosts = [host("cpu1", "cpu"), host("gpu1"), host("gpu2"), host("gpu3")]
    fleet = Fleet(name="f", hosts=hosts, settings=FleetSettings(**settings))
    return build(spec, env, fleet, secrets_digest="")


def test_the_spec_model_is_fetched_into_the_fleet_cache_mounted_read_only(tmp_path: Path) -> None:
    plan = plan_of(LAB, tmp_path)
    assert (plan.model_repo, plan.model_revision, plan.model_cache) == (
        "lab/tiny-llama",
        "main",
        "/var/lib/pdctl/models",
    )
    assert f"/var/lib/pdctl/models:{HF}:ro" in plan.volumes
    assert plan.env["HF_HOME"] == HF and plan.env["HF_HUB_OFFLINE"] == "1"
    # Every host with a slot, spares too (the lab example: 2+2 slots on the 3 GPU hosts).
    assert prefetch.model_hosts(plan) == ["gpu1", "gpu2", "gpu3"]
    assert any(not s.start for s in plan.slots())


def test_the_fleet_setting_and_a_pinned_revision(tmp_path: Path) -> None:
    text = LAB.replace("pdctl:\n", "pdctl:\n  model_revision: v1.2\n", 1)
    plan = plan_of(text, tmp_path, model_cache="/data/models")
    assert (plan.model_revision, plan.model_cache) == ("v1.2", "/data/models")
    assert f"/data/models:{HF}:ro" in plan.volumes


def test_a_spec_volume_on_the_hub_cache_is_the_cache_filled(tmp_path: Path) -> None:
    text = LAB.replace("port: 8000\nmodel:", f"volumes:\n  - /nfs/hf:{HF}\nport: 8000\nmodel:")
    plan = plan_of(text, tmp_path)
    assert plan.model_cache == "/nfs/hf"
    assert [v for v in plan.volumes if HF in v] == [f"/nfs/hf:{HF}"]


def test_the_model_from_the_commands_when_the_spec_names_none(tmp_path: Path) -> None:
    text = LAB.replace("model: lab/tiny-llama\n", "").replace(
        "MODEL_ID=lab/tiny-llama", "MODEL_ID=org/from-env"
    )
    assert plan_of(text, tmp_path).model_repo == "org/from-env"


def test_a_local_path_model_fetches_nothing_and_mounts_no_cache(tmp_path: Path) -> None:
    text = LAB.replace("model: lab/tiny-llama\n", "").replace(
        "MODEL_ID=lab/tiny-llama", "MODEL_ID=/models/llama"
    )
    plan = plan_of(text, tmp_path)
    assert plan.model_repo is None and plan.model_cache is None
    assert not any(HF in v for v in plan.volumes) and "HF_HUB_OFFLINE" not in plan.env


@pytest.mark.parametrize("model", ["a/b/c", "a--b/c", "x/..", "a/.b"])
def test_a_model_that_is_no_hub_id_is_refused(tmp_path: Path, model: str) -> None:
    with pytest.raises(InputError, match="not a hub model id"):
        plan_of(LAB.replace("model: lab/tiny-llama", f"model: {model}"), tmp_path)


@pytest.mark.parametrize("revision", ["../x", "refs/pr/1", "'a b'", "'..'"])
def test_a_hostile_revision_is_refused_in_the_spec(tmp_path: Path, revision: str) -> None:
    with pytest.raises(SpecError, match="model_revision"):
        plan_of(LAB.replace("pdctl:\n", f"pdctl:\n  model_revision: {revision}\n", 1), tmp_path)


@pytest.mark.parametrize(
    "setting",
    [
        {"model_endpoint": "file:///etc"},
        {"model_endpoint": "http://user:pw@hub"},
        {"model_endpoint": "http://hub/?q=1"},
        {"model_cache": "relative/dir"},
        {"model_cache": "/var/lib/../etc"},
    ],
)
def test_hostile_fleet_settings_are_refused(setting: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        FleetSettings(**setting)
