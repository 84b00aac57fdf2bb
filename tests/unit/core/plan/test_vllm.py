"""vLLM groups: the engine and role read from the launch command, what is refused (HTTP vLLM,
mixed engines, an unsaid role, hostile KV configs), the slot's script, ports, environment and
registration, and the side channel in the port checks, also across services on one fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdctl.core.entrypoint import find_launch, worker_script
from pdctl.core.errors import InputError
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import Held, Plan, build, held_by, listeners, plan_from_extravars, router_args
from pdctl.core.shell import CommandError
from pdctl.core.spec import SpecError, parse
from pdctl.operations import sharing
from tests.support import assert_apart

ENV = {"HF_TOKEN": "hf_value"}
PRODUCER = """'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'"""
CONSUMER = """'{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'"""
SERVE = "vllm serve m --grpc --kv-transfer-config "
MODULE = "python3 -m vllm.entrypoints.grpc_server --model m --kv-transfer-config "


def spec_text(
    prefill: str = SERVE + PRODUCER,
    decode: str = MODULE + CONSUMER,
    names: tuple[str, str] = ("p", "d"),
    extra: str = "",
    gpus: int = 4,
) -> str:
    def group(name: str, command: str) -> str:
        return (
            f"  - name: {name}\n    commands:\n      - {json.dumps(command)}\n"
            f"    resources:\n      gpu: MI300X:{gpus}\n"
        )

    return (
        "type: service\nname: v\nimage: img:1\nreplicas:\n"
        "  - count: 1\n    router: {type: sglang}\n"
        + group(names[0], prefill)
        + group(names[1], decode)
        + extra
    )


def refused(text: str) -> str:
    with pytest.raises(SpecError) as caught:
        parse(text, Path("pd.yml"), ENV)
    return str(caught.value) + " " + (caught.value.hint or "")


@pytest.mark.parametrize(
    ("command", "engine", "role"),
    [
        ("python -m sglang.launch_server --disaggregation-mode prefill", "sglang", None),
        (SERVE + PRODUCER, "vllm", "prefill"),
        (MODULE + CONSUMER, "vllm", "decode"),
        ("/usr/bin/vllm serve m --grpc=true --kv-transfer-config=" + PRODUCER, "vllm", "prefill"),
        (
            "python3 -mvllm.entrypoints.grpc_server --kv-transfer-config " + PRODUCER,
            "vllm",
            "prefill",
        ),
    ],
)
def test_the_engine_and_role_come_from_the_launch(command: str, engine: str, role: str) -> None:
    launch = find_launch(["pip list", command])
    assert launch is not None and launch.engine == engine and launch.role == role
    assert find_launch(["pip install vllm", "sleep 1"]) is None


def kv(config: str) -> str:
    return f"vllm serve m --grpc --kv-transfer-config '{config}'"


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("vllm serve m --kv-transfer-config " + PRODUCER, "without --grpc"),
        ("python -m vllm.entrypoints.openai.api_server --model m", "HTTP server"),
        ("vllm serve m --grpc", "needs --kv-transfer-config"),
        (kv('{"kv_role":'), "not valid JSON"),
        (kv("[1]"), "not a JSON object"),
        (kv('{"kv_connector":"N","kv_role":"x"}'), "kv_role 'x'"),
        (kv('{"kv_connector":"a b","kv_role":"kv_both"}'), "kv_connector 'a b'"),
        (kv('{"kv_connector":"a\\nExecStart=x","kv_role":"kv_both"}'), "kv_connector"),
        (kv('{"kv_connector":"N","kv_role":"kv_both"}') + " --kv-transfer-config '{}'", "twice"),
        ('vllm serve m --grpc --kv-transfer-config "{$C}"', "shell expansion"),
        ("vllm serve m --grpc --kv-transfer-config.kv_role kv_producer", "one JSON value"),
        ("sh -c 'vllm serve m --grpc'", "not as a command that pdctl can"),
        (SERVE + PRODUCER + " | tee log", "plain command"),
    ],
)
def test_unusable_vllm_launches_are_refused_with_the_reason(command: str, says: str) -> None:
    with pytest.raises(CommandError) as caught:
        worker_script([command], "prefill")
    assert says in str(caught.value)
    assert says in refused(spec_text(prefill=command))


def test_a_vllm_worker_gets_the_slots_port_and_host() -> None:
    script = worker_script([SERVE + PRODUCER + " --port 8000"], "prefill")
    assert script.endswith(f"exec {SERVE}{PRODUCER} --port $PDCTL_PORT --host $PDCTL_HOST\n")
    assert "bootstrap" not in script  # SGLang's bootstrap port is no vLLM flag
    script = worker_script(["cd /x", MODULE + CONSUMER + " --host 0.0.0.0"], "decode")
    assert script.endswith(f"exec {MODULE}{CONSUMER} --host 0.0.0.0 --port $PDCTL_PORT\n")
    with pytest.raises(CommandError, match="the vLLM launch command must be the group's last"):
        worker_script([SERVE + PRODUCER, "true"], "prefill")


def test_kv_both_needs_the_role_said_another_way() -> None:
    both = SERVE + PRODUCER.replace("kv_producer", "kv_both")
    assert "does not say whether this vLLM group is prefill or decode" in refused(
        spec_text(prefill=both, names=("a", "d"))
    )
    spec, _ = parse(spec_text(prefill=both, names=("prefill", "d")), Path("pd.yml"), ENV)
    assert spec.group("prefill").launch.kv_role == "kv_both"  # type: ignore[union-attr]
    said = spec_text(prefill=both, names=("a", "d")).replace(
        "  - name: a\n", "  - name: a\n    pdctl: {role: prefill}\n"
    )
    spec, _ = parse(said, Path("pd.yml"), ENV)
    assert spec.group("prefill").name == "a"


def test_the_kv_role_and_the_name_must_agree() -> None:
    text = refused(spec_text(names=("decode-group", "d")))
    assert "kv_role kv_producer makes this a prefill group, but its name says decode" in text


def test_one_service_runs_one_engine() -> None:
    sglang = "python -m sglang.launch_server --disaggregation-mode decode"
    assert "the prefill group runs vllm and the decode group sglang" in refused(
        spec_text(decode=sglang)
    )


def test_the_side_channel_is_pdctls_per_slot() -> None:
    env = "env:\n  - VLLM_NIXL_SIDE_CHANNEL_PORT=5600\n"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT is set by pdctl for each vLLM slot" in refused(
        spec_text(extra=env)
    )
    # Worker ports from 5600, where the side channels start too: no refusal, pdctl's layout
    # steps to a position whose parts are apart (judged per host, after placement).
    plan = plan_of(spec_text(extra="pdctl:\n  ports: {base: 5600}\n"))
    assert_apart(plan)
    for slot in plan.slots():
        assert slot.side_channel_port is not None
        assert not slot.port <= slot.side_channel_port < slot.port + plan.port_stride


def test_latency_scaling_needs_http_metrics() -> None:
    text = spec_text().replace(
        "  - name: d\n", "  - name: d\n    count: 1..2\n    scaling: {metric: itl, target: 50ms}\n"
    )
    assert "a vLLM gRPC worker serves no HTTP" in refused(text)


# --- the plan ------------------------------------------------------------------------------

OK = Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00", checks=[])


def gpu_host(name: str, address: str, gpus: int = 8) -> FleetHost:
    facts = {"cpus": 96, "memory_gb": 1024.0, "gpus": {"count": gpus, "model": "MI300X"}}
    return FleetHost(name=name, address=address, user="root", kind="gpu", facts=facts, preflight=OK)


def cpu_host() -> FleetHost:
    facts = {"cpus": 8, "memory_gb": 16.0, "gpus": {"count": 0}}
    return FleetHost(
        name="cpu1", address="10.0.0.1", user="root", kind="cpu", facts=facts, preflight=OK
    )


def plan_of(text: str, held: list[Held] | None = None, hosts: int = 1) -> Plan:
    spec, env = parse(text, Path("pd.yml"), ENV)
    gpus = [gpu_host(f"gpu{i}", f"10.0.0.{10 + i}") for i in range(1, hosts + 1)]
    fleet = Fleet(name="f", hosts=[cpu_host(), *gpus])
    return build(spec, env, fleet, secrets_digest="", held=held or [])


def test_each_vllm_slot_has_its_port_side_channel_and_registration() -> None:
    text = spec_text(gpus=2).replace("  - name: d\n", "  - name: d\n    count: 2\n")
    plan = plan_of(text)
    slots = {s.name: s for s in plan.slots()}
    assert [(n, s.port, s.side_channel_port) for n, s in sorted(slots.items())] == [
        ("decode/1", 31000, 5602),
        ("decode/2", 32000, 5604),
        ("prefill/1", 30000, 5600),
    ]
    decode = slots["decode/2"]
    assert decode.bootstrap_port is None and decode.url == "grpc://10.0.0.11:32000"
    env = decode.env()
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5604"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.11"
    assert "PDCTL_BOOTSTRAP_PORT" not in env
    assert decode.registration() == {
        "url": "grpc://10.0.0.11:32000",
        "worker_type": "decode",
        "runtime_type": "vllm",
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
    }
    assert slots["prefill/1"].registration()["kv_role"] == "kv_producer"
    health = "grpc://10.0.0.11:32000/vllm.grpc.engine.VllmEngine/HealthCheck"
    assert decode.probe_url("/health") == health
    assert plan.groups["decode"].engine == "vllm"
    assert "--enable-igw" in plan.router.args
    channels = [x for x in listeners(plan) if x.what.endswith("NIXL side channel")]
    assert [(x.first, x.last) for x in channels] == [(5600, 5601), (5602, 5603), (5604, 5605)]
    assert_apart(plan)
    # The plan's extra-vars carry what the roles use, and read back to the same plan.
    entries = plan.extravars()["pd_host_slots"]["gpu1"]
    entry = next(e for e in entries if e["group"] == "decode" and e["index"] == 2)
    assert entry["registration"] == decode.registration()
    assert entry["probe_url"] == health
    assert plan_from_extravars(plan.extravars()) == plan


def test_another_services_side_channel_moves_the_slots() -> None:
    first = plan_of(spec_text(gpus=2))
    second_text = spec_text(gpus=2, extra="port: 8001\npdctl:\n  router: {metrics_port: 29001}\n")
    second_text = second_text.replace("name: v\n", "name: w\n")
    second = plan_of(second_text, held=held_by(first))
    assert {s.side_channel_port for s in second.slots()} == {5604, 5606}
    assert_apart(first, second)
    # A held side channel alone (a service deployed from another workspace) moves them too.
    taken = [Held("x", "gpu1", "decode/1's NIXL side channel", ports=(5600, 5603))]
    moved = plan_of(spec_text(gpus=2), held=taken)
    assert min(s.side_channel_port or 0 for s in moved.slots()) >= 5604


def test_sglang_services_are_unchanged() -> None:
    sglang = spec_text(
        prefill="python -m sglang.launch_server --disaggregation-mode prefill",
        decode="python -m sglang.launch_server --disaggregation-mode decode",
    )
    plan = plan_of(sglang)
    prefill = plan.groups["prefill"].slots[0]
    assert prefill.engine == "sglang" and prefill.side_channel_port is None
    assert prefill.url.startswith("http://") and prefill.bootstrap_port == 8998
    assert prefill.registration() == {
        "url": prefill.url,
        "worker_type": "prefill",
        "runtime": "sglang",
        "bootstrap_port": 8998,
    }
    assert prefill.probe_url("/health") == f"{prefill.url}/health"
    assert "--enable-igw" not in plan.router.args
    spec, _ = parse(sglang, Path("pd.yml"), ENV)
    assert router_args(spec) == plan.router.args


def test_a_side_channel_past_the_last_port_is_refused() -> None:
    text = spec_text(extra="pdctl:\n  ports: {side_channel_base: 65534}\n")
    with pytest.raises(InputError, match="NIXL side channel"):
        plan_of(text)


def test_a_hosts_vllm_side_channels_are_held() -> None:
    """What a host shows of a vLLM service no stored plan explains (holdings_probe.py's
    report): its side channel ports, as many as the slot's GPUs, and nothing hostile."""
    values = {
        "PDCTL_GPU_IDS": "4,5",
        "PDCTL_PORT": "31000",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5602",
    }
    text = json.dumps({"slots": [["a", "decode-1", values]], "listeners": []})
    assert Held("a", "h1", "decode/1's NIXL side channel", ports=(5602, 5603)) in set(
        sharing.parse_report("h1", text)
    )
    for bad in ("5602\nX=1", "99999", "-1", "0x10"):
        values["VLLM_NIXL_SIDE_CHANNEL_PORT"] = bad
        text = json.dumps({"slots": [["a", "decode-1", values]], "listeners": []})
        assert not [h for h in sharing.parse_report("h1", text) if "side channel" in h.what]
