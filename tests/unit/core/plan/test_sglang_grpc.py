"""SGLang workers in gRPC mode (``--grpc-mode``): the connection read from the launch command,
what is refused (a half-gRPC service, a valued switch, latency scaling that needs HTTP
/metrics), and the plan's slots: grpc:// URLs, SMG's registration with runtime_type sglang and
the prefill's bootstrap port, the grpc.health.v1 probe, --enable-igw on the router; stored plans
from before the connection was recorded read back as they ran; the lab's stand-in reads the
switch as SGLang does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdctl.core.entrypoint import find_launch, worker_script
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import Plan, build, plan_from_extravars
from pdctl.core.shell import CommandError
from pdctl.core.spec import SpecError, parse
from pdctl.lab.worker.sglang.launch_server import parse_args
from tests.support import assert_apart

ENV = {"HF_TOKEN": "hf_value"}
LAUNCH = "python3 -m sglang.launch_server --model-path m --disaggregation-transfer-backend nixl"
PREFILL = f"{LAUNCH} --grpc-mode --disaggregation-mode prefill"
DECODE = f"{LAUNCH} --grpc-mode --disaggregation-mode decode"
OK = Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00", checks=[])


def spec_text(
    prefill: str = PREFILL,
    decode: str = DECODE,
    router: str = "smg launch --pd-disaggregation --enable-igw --prefill-policy cache_aware",
    decode_extra: str = "",
) -> str:
    def group(command: str, extra: str = "") -> str:
        return (
            f"  - {extra}commands:\n      - {json.dumps(command)}\n    resources: {{gpu: H200}}\n"
        )

    return (
        "type: service\nname: g\nimage: img:1\nreplicas:\n"
        f"  - count: 1\n    router: {{type: sglang}}\n    commands: [{json.dumps(router)}]\n"
        + group(prefill)
        + group(decode, decode_extra)
    )


def refused(text: str) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse(text, Path("pd.yml"), ENV)
    return caught.value


def plan_of(text: str) -> Plan:
    spec, env = parse(text, Path("pd.yml"), ENV)
    facts = {"cpus": 96, "memory_gb": 1024.0, "gpus": {"count": 8, "model": "H200"}}
    hosts = [
        FleetHost(name="cpu1", address="10.0.0.1", user="root", kind="cpu",
                  facts={"cpus": 8, "memory_gb": 16.0, "gpus": {"count": 0}}, preflight=OK),
        FleetHost(name="gpu1", address="10.0.0.11", user="root", kind="gpu", facts=facts,
                  preflight=OK),
    ]  # fmt: skip
    return build(spec, env, Fleet(name="f", hosts=hosts), secrets_digest="")


@pytest.mark.parametrize(
    ("command", "connection"),
    [
        (PREFILL, "grpc"),
        (f"{LAUNCH} --grpc", "grpc"),  # SGLang's argparse takes the abbreviation
        (f"{LAUNCH} --disaggregation-mode prefill", "http"),
        (f"{LAUNCH} --grpc-mode-x", "http"),  # another flag, not the switch
        ("vllm serve m --grpc --kv-transfer-config "
         """'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'""", "grpc"),
    ],
)  # fmt: skip
def test_the_connection_comes_from_the_launch(command: str, connection: str) -> None:
    launch = find_launch(["pip list", command])
    assert launch is not None and launch.connection == connection


def test_a_valued_grpc_mode_is_refused_with_the_reason() -> None:
    command = f"{LAUNCH} --grpc-mode=true --disaggregation-mode prefill"
    with pytest.raises(CommandError, match="is a switch and takes no value"):
        worker_script([command], "prefill")
    error = refused(spec_text(prefill=command))
    assert "pd.yml:9: replicas[1].commands[0]: `--grpc-mode=true`: --grpc-mode is a switch" in (
        error.one_line()
    )


def test_a_service_is_grpc_in_both_groups_or_neither() -> None:
    http_decode = f"{LAUNCH} --disaggregation-mode decode"
    error = refused(spec_text(decode=http_decode))
    assert "the prefill group runs sglang over gRPC and the decode group sglang" in str(error)
    assert error.hint is not None and "give both groups --grpc-mode or neither" in error.hint
    assert "\n" not in error.one_line()


def test_latency_scaling_needs_the_workers_http_metrics() -> None:
    scaled = "count: 1..2\n    scaling: {metric: itl, target: 50ms}\n    "
    error = refused(spec_text(decode_extra=scaled))
    line = error.one_line()
    assert "itl is read from the workers' HTTP /metrics" in line
    assert "an SGLang (--grpc-mode) gRPC worker serves no HTTP" in line
    assert "scale the decode group on rps" in line
    # rps needs only SMG's counter: it plans.
    rps = "count: 1..2\n    scaling: {metric: rps, target: 2}\n    "
    assert plan_of(spec_text(decode_extra=rps)).groups["decode"].max == 2


def test_each_slot_is_a_grpc_worker_smg_registers_as_sglang() -> None:
    plan = plan_of(spec_text())
    prefill, decode = plan.groups["prefill"].slots[0], plan.groups["decode"].slots[0]
    assert prefill.url == f"grpc://10.0.0.11:{prefill.port}"
    assert prefill.registration() == {
        "url": prefill.url,
        "worker_type": "prefill",
        "runtime_type": "sglang",
        "bootstrap_port": 8998,
    }
    assert decode.registration() == {
        "url": decode.url,
        "worker_type": "decode",
        "runtime_type": "sglang",
    }
    assert prefill.probe_url("/health") == f"{prefill.url}/grpc.health.v1.Health/Check"
    assert prefill.env()["PDCTL_BOOTSTRAP_PORT"] == "8998"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in prefill.env()
    script = plan.groups["prefill"].script
    assert (
        "--grpc-mode" in script
        and "--disaggregation-bootstrap-port $PDCTL_BOOTSTRAP_PORT" in script
    )
    assert_apart(plan)
    # What the roles get: the same registration and probe; the plan reads back the same.
    entries = plan.extravars()["pd_host_slots"]["gpu1"]
    entry = next(e for e in entries if e["group"] == "prefill")
    assert entry["registration"] == prefill.registration()
    assert entry["probe_url"] == prefill.probe_url(plan.probe.url)
    assert plan_from_extravars(plan.extravars()) == plan


def test_the_router_is_smgs_igw_with_the_flag_added_when_missing() -> None:
    kept = plan_of(spec_text())
    assert kept.router.args.count("--enable-igw") == 1
    assert not any("--enable-igw added" in n for n in kept.notes)
    added = plan_of(spec_text(router="smg launch --pd-disaggregation --prefill-policy random"))
    assert "--enable-igw" in added.router.args
    assert any("router: --enable-igw added" in n for n in added.notes)
    http = plan_of(
        spec_text(
            prefill=f"{LAUNCH} --disaggregation-mode prefill",
            decode=f"{LAUNCH} --disaggregation-mode decode",
            router="smg launch --pd-disaggregation",
        )
    )
    assert "--enable-igw" not in http.router.args and http.notes == []


def test_a_stored_plan_without_connections_reads_back_as_it_ran() -> None:
    """Plans stored before slots said their connection: vLLM's spoke gRPC, SGLang's HTTP."""
    stored = plan_of(spec_text()).model_dump(mode="json")
    for group in stored["groups"].values():
        group.pop("connection")
        for slot in group["slots"]:
            slot.pop("connection")
    sglang = Plan.model_validate(stored)
    assert {s.connection for s in sglang.slots()} == {"http"}
    for group in stored["groups"].values():
        group["engine"] = "vllm"
        for slot in group["slots"]:
            slot["engine"] = "vllm"
    vllm = Plan.model_validate(stored)
    assert {s.connection for s in vllm.slots()} == {"grpc"}
    assert {g.connection for g in vllm.groups.values()} == {"grpc"}


@pytest.mark.parametrize(
    ("argv", "grpc_mode"),
    [
        (["--grpc-mode"], True),
        (["--grpc"], True),  # as SGLang's argparse (and pdctl/core/launch.py) read it
        (["--grpc-m"], True),
        (["--gr"], False),  # too short to be the switch: an unknown flag, ignored
        ([], False),
    ],
)
def test_the_lab_stand_in_reads_the_switch_as_sglang_does(argv: list[str], grpc_mode: bool) -> None:
    args, ignored = parse_args(["--model-path", "m", *argv])
    assert args.grpc_mode is grpc_mode
    assert ignored == ([] if grpc_mode or not argv else argv)
