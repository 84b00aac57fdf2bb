"""A fleet's hardware expectations: `fleet add --gpu/--gpu-vendor/--nic-driver/--link-layer`
become settings, reach the pd_preflight role's variables, and bad values are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdctl import fleet as fleets
from pdctl import inventory
from pdctl.errors import InputError
from pdctl.fleet_model import Fleet, FleetSettings
from pdctl.workspace import Workspace
from tests.support import pdctl


def test_defaults_are_todays_amd_fleet() -> None:
    settings = fleets._settings(None, fleets.AddOptions(hosts=[]))
    assert (settings.gpu_model, settings.gpu_vendor) == ("MI300X", "amd")
    assert (settings.nic_driver, settings.link_layer) == ("bnxt_re", "eth")
    assert settings.provider_lib == "/usr/lib64/libibverbs/libbnxt_re-rdmav34.so"


def test_nvidia_settings_reach_the_role(tmp_path: Path) -> None:
    options = fleets.AddOptions(hosts=[], gpu_model="H200", nic_driver="mlx5", link_layer="ib")
    settings = fleets._settings(None, options)
    assert (settings.gpu_model, settings.gpu_vendor) == ("H200", "nvidia")
    workspace = Workspace(tmp_path)
    inventory.save(workspace, Fleet(name="hgx", settings=settings))
    all_vars = yaml.safe_load(
        (inventory.fleet_dir(workspace, "hgx") / "group_vars/all.yml").read_text()
    )
    assert (
        all_vars.items()
        >= {
            "pd_preflight_gpu_model": "H200",
            "pd_preflight_gpu_vendor": "nvidia",
            "pd_preflight_nic_driver": "mlx5",
            "pd_preflight_link_layer": "ib",
            "pd_preflight_expected_nics": 8,
        }.items()
    )
    assert inventory.load(workspace, "hgx").settings == settings
    # A later add without the options keeps them; --expect-nics still works.
    again = fleets._settings(settings, fleets.AddOptions(hosts=[], expect_nics=4))
    assert (again.gpu_vendor, again.nic_driver, again.expect_nics) == ("nvidia", "mlx5", 4)


def test_explicit_vendor_wins_over_the_models() -> None:
    options = fleets.AddOptions(hosts=[], gpu_model="MI300X", gpu_vendor="nvidia")
    assert fleets._settings(None, options).gpu_vendor == "nvidia"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (fleets.AddOptions(hosts=[], gpu_model="H200;rm"), "--gpu 'H200;rm' is not a GPU model"),
        (fleets.AddOptions(hosts=[], nic_driver="../mlx5"), "--nic-driver '../mlx5'"),
        (fleets.AddOptions(hosts=[], link_layer="fc"), "fleet settings"),
    ],
)
def test_bad_values_are_refused(options: fleets.AddOptions, words: str) -> None:
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(";", ";")):
        fleets._settings(None, options)


def test_the_cli_refuses_before_contacting_any_host(workspace: Path) -> None:
    proc = pdctl(
        workspace, "fleet", "add", "f", "--host", "127.0.0.1:1", "--nic-driver", "mlx5 x",
        check=False,
    )  # fmt: skip
    assert proc.returncode == 3
    assert "--nic-driver 'mlx5 x' is not a driver name" in proc.stderr
    assert not (workspace / "inventories" / "f").exists()
    usage = pdctl(workspace, "fleet", "add", "f", "--host", "h", "--link-layer", "x", check=False)
    assert usage.returncode == 2


def test_stored_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="nic_driver"):
        FleetSettings(nic_driver="mlx5/../x")
