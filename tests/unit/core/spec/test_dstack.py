"""dstack's own published P/D files (tests/data/dstack/, SOURCES says where each came from),
unchanged: each plans on a lab-shaped fleet; the lab-sized copies differ from their originals
only in GPU count, cpu/memory minimums and image.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdctl.core.errors import CheckFailed
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import Plan, build, listeners
from pdctl.core.spec import Gpu, Resources, SpecError, load
from tests.hostfacts import amd_facts, nvidia_facts
from tests.support import assert_apart

DATA = Path(__file__).resolve().parents[3] / "data" / "dstack"
SOURCES = yaml.safe_load((DATA / "SOURCES").read_text())
ENV = {"HF_TOKEN": "hf_value"}
CHECKED = Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00", checks=[])
PLANNED = sorted(SOURCES["files"])
# The lab copies: (copy, original); the lab's 3 hosts (`lab up --hosts 3 --cpu-hosts 1`).
LAB_COPIES = [
    (f"lab/{name}", name)
    for name in ("amd-pd.dstack.yml", "sglang-pd.dstack.yml", "sglang-pd-grpc.dstack.yml")
]


def lab_shaped(vendor: str, gpu_hosts: int, cpus: int = 64, memory_gb: float = 256.0) -> Fleet:
    """Hosts as `pdctl lab up --cpu-hosts 1` names them (node1 the CPU-only router host,
    then 8-GPU hosts with 8 NICs), with a real server's CPUs and memory unless given."""
    hosts = [
        FleetHost(
            name="node1",
            address="10.77.0.11",
            user="pdops",
            kind="cpu",
            facts={"cpus": cpus, "memory_gb": memory_gb},
            preflight=CHECKED,
        )
    ]
    for number in range(2, gpu_hosts + 2):
        facts = amd_facts() if vendor == "amd" else nvidia_facts()
        if (cpus, memory_gb) != (64, 256.0):
            facts |= {"cpus": cpus, "memory_gb": memory_gb}
        hosts.append(
            FleetHost(
                name=f"node{number}",
                address=f"10.77.0.{10 + number}",
                user="pdops",
                kind="gpu",
                facts=facts,
                preflight=CHECKED,
            )
        )
    return Fleet(name="lab", hosts=hosts)


def vendor_of(text: str) -> str:
    return "amd" if "MI300X" in text else "nvidia"


def gpus_needed(name: str) -> int:
    spec, _ = load(DATA / name, ENV)
    return sum(
        spec.group(role).count[1] * (spec.gpus(spec.group(role)) or Gpu()).count
        for role in ("prefill", "decode")
    )


def test_the_files_are_dstacks_as_published() -> None:
    """Each file's bytes are those SOURCES names (its sha256, kept from the markdown block);
    every file here is in SOURCES, each with the page and lines it came from."""
    assert SOURCES["repo"] == "https://github.com/dstackai/dstack"
    assert re.fullmatch(r"[0-9a-f]{40}", SOURCES["commit"])
    kept = {p.name for p in DATA.glob("*.yml")}
    assert kept == set(SOURCES["files"]) | set(SOURCES["refused"])
    for name, entry in (SOURCES["files"] | SOURCES["refused"]).items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == entry["sha256"], name
        for page in entry["published"]:
            assert page["path"].startswith("mkdocs/") and page["path"].endswith(".md")
            assert re.fullmatch(r"\d+-\d+", page["lines"]) and page["block"]


@pytest.mark.parametrize("name", sorted(SOURCES["refused"]))
def test_a_published_file_pdctl_does_not_run_is_refused_in_one_clear_error(name: str) -> None:
    """dstack's P/D task (node groups wired by address), its Dynamo service and a service of
    one model server: the error names what pdctl does not run (the type, the router, the
    missing groups), not a field those files hold that a P/D service refuses."""
    with pytest.raises(SpecError) as refused:
        load(DATA / name, ENV)
    assert str(refused.value).startswith(f"{DATA}/{SOURCES['refused'][name]['error']}")


@pytest.mark.parametrize("name", PLANNED)
def test_each_published_file_plans_on_a_lab_shaped_fleet(name: str) -> None:
    """As published: its GPUs, its ports (router and workers on one port, as dstack runs
    each replica on its own instance), its resources, dstack-only settings ignored."""
    text = (DATA / name).read_text()
    spec, env = load(DATA / name, ENV)
    hosts = -(-gpus_needed(name) // 8)  # 8-GPU hosts: as many as every slot needs
    plan = build(spec, env, lab_shaped(vendor_of(text), hosts), secrets_digest="")
    assert plan.router.host == "node1"
    assert plan.router.port == spec.port  # the file's own: pdctl never moves a port it sets
    for role in ("prefill", "decode"):
        assert len(plan.groups[role].slots) == spec.group(role).count[1]
    assert {s.host for s in plan.slots()} <= {f"node{n}" for n in range(2, hosts + 2)}
    assert_apart(plan)
    assert plan.model_repo == (spec.model_name or env.plain.get("MODEL_ID"))
    json.dumps(plan.model_dump(mode="json"))  # the stored plan


def test_amds_file_keeps_port_30000_for_the_router_and_every_worker() -> None:
    """dstack's AMD file sets 30000 for the router and every worker, pdctl's own worker base:
    on separate hosts nothing meets; beside the router (no CPU host), pdctl's worker ports
    step past the router's, and its metrics stay where they are."""
    spec, env = load(DATA / "amd-pd.dstack.yml", ENV)
    plan = build(spec, env, lab_shaped("amd", 6), secrets_digest="")
    assert (plan.router.host, plan.router.port) == ("node1", 30000)
    assert {s.port for s in plan.slots()} == {30000}  # one slot of 8 GPUs per host
    gpu_only = Fleet(name="lab", hosts=lab_shaped("amd", 6).hosts[1:])
    beside = build(spec, env, gpu_only, secrets_digest="")
    assert (beside.router.host, beside.router.port) == ("node2", 30000)
    on_router_host = [s for s in beside.slots() if s.host == "node2"]
    assert [s.port for s in on_router_host] == [31000]  # position 0 holds the router's 30000
    assert on_router_host[0].bootstrap_port == 8999
    assert beside.router.metrics_port == 29000 and beside.scaler_metrics_port == 29100
    assert_apart(beside)


def test_the_notes_say_what_pdctl_leaves_out_of_dstacks_vllm_file() -> None:
    """The gRPC router's `--model-path $MODEL_ID` (SMG takes the tokenizer from the workers)
    and the router group's `python: "3.12"` (SMG runs from pdctl's venv)."""
    spec, env = load(DATA / "vllm-pd.dstack.yml", ENV)
    plan = build(spec, env, lab_shaped("nvidia", 2), secrets_digest="")
    assert "--model-path" not in plan.router.args and "--enable-igw" in plan.router.args
    assert any("--model-path left out of `smg launch`" in note for note in plan.notes)
    assert any("ignored: replicas[0].python" in note for note in plan.notes)
    images = {plan.groups[r].image for r in ("prefill", "decode")}
    assert images == {"ghcr.io/lightseekorg/smg:1.4.1-vllm-v0.18.0"}  # each group's own


def test_dstacks_sglang_grpc_file_plans_grpc_workers_behind_an_igw_router() -> None:
    """SGLang with --grpc-mode: SMG reaches the workers at grpc://, registers them with
    runtime_type sglang (the prefill with its bootstrap port), in its IGW mode (the file's
    --enable-igw kept); the router's `--model-path $MODEL_ID` is left out (SMG takes the
    tokenizer from the workers' GetTokenizer), and pdctl probes grpc.health.v1."""
    spec, env = load(DATA / "sglang-pd-grpc.dstack.yml", ENV)
    plan = build(spec, env, lab_shaped("nvidia", 2), secrets_digest="")
    assert "--enable-igw" in plan.router.args and "--model-path" not in plan.router.args
    assert not any("$MODEL_ID" in arg for arg in plan.router.args)
    assert any("--model-path left out of `smg launch`" in note for note in plan.notes)
    assert not any("--enable-igw added" in note for note in plan.notes)  # the file has it
    prefill, decode = plan.groups["prefill"], plan.groups["decode"]
    assert (prefill.connection, decode.connection) == ("grpc", "grpc")
    assert prefill.image == decode.image == "ghcr.io/lightseekorg/smg:1.4.1-sglang-v0.5.10"
    first = prefill.slots[0]
    assert first.registration() == {
        "url": f"grpc://{first.address}:{first.port}",
        "worker_type": "prefill",
        "runtime_type": "sglang",
        "bootstrap_port": first.bootstrap_port,
    }
    assert first.bootstrap_port is not None
    assert first.probe_url("/health") == f"{first.url}/grpc.health.v1.Health/Check"
    assert "--disaggregation-bootstrap-port $PDCTL_BOOTSTRAP_PORT" in prefill.script
    assert "--grpc-mode" in prefill.script and "--grpc-mode" in decode.script
    assert decode.slots[0].registration()["url"].startswith("grpc://")
    assert "bootstrap_port" not in decode.slots[0].registration()


def test_the_published_files_need_the_fleet_they_name() -> None:
    """On the 3-host lab shape the originals' 8-GPU replicas do not all fit (refused unless
    --allow-partial, which plans what fits); the router's `cpu: 4` needs a CPU host with 4."""
    spec, env = load(DATA / "amd-pd.dstack.yml", ENV)
    with pytest.raises(CheckFailed) as caught:
        build(spec, env, lab_shaped("amd", 2), secrets_digest="")
    assert "not enough GPUs" in caught.value.message
    partial = build(spec, env, lab_shaped("amd", 2), secrets_digest="", allow_partial=True)
    assert len(partial.slots()) == 2
    small = lab_shaped("nvidia", 2, cpus=2, memory_gb=24.0)
    spec, env = load(DATA / "sglang-pd.dstack.yml", ENV)
    with pytest.raises(CheckFailed) as caught:
        build(spec, env, small, secrets_digest="")
    assert (
        "router group's resources" in caught.value.message and "2 CPUs < 4" in caught.value.message
    )


def _differences(a: Any, b: Any, where: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [(where, a, b)]


@pytest.mark.parametrize(("copy", "original"), LAB_COPIES)
def test_a_lab_copy_differs_only_in_gpu_count_cpu_memory_minimums_and_image(
    copy: str, original: str
) -> None:
    lab_text, text = (DATA / copy).read_text(), (DATA / original).read_text()
    # Line for line: the same lines but those of these fields (comments, order, spacing kept).
    lines = zip(text.splitlines(), lab_text.splitlines(), strict=True)
    changed = [(old, new) for old, new in lines if old != new]
    assert changed and all(
        re.fullmatch(r"\s*(image|gpu|cpu|memory): \S+", line) for pair in changed for line in pair
    ), changed
    for where, old, new in _differences(yaml.safe_load(text), yaml.safe_load(lab_text)):
        field = where.rsplit(".", 1)[-1]
        if field == "gpu":  # the count only: the same model, vendor and memory
            before, after = Gpu.parse(old), Gpu.parse(new)
            assert before.model_copy(update={"count": after.count}) == after, where
        elif field in {"cpu", "memory"}:  # minimums only, lowered
            before, after = (
                getattr(Resources.model_validate({field: v}), field) for v in (old, new)
            )
            assert after.min < before.min and after.max in {None, after.min}, where
        else:  # the service's image or a worker group's
            assert re.fullmatch(r"(\.replicas\[\d+\])?\.image", where), where
            assert new.startswith("localhost/pdctl-lab/"), where


@pytest.mark.parametrize(("copy", "original"), LAB_COPIES)
def test_a_lab_copy_plans_on_the_lab_as_is(copy: str, original: str) -> None:
    """On `lab up --hosts 3 --cpu-hosts 1`'s hosts (2 CPUs and 24 GB each here, the machine's),
    no --allow-partial: every slot of every group fits."""
    text = (DATA / copy).read_text()
    spec, env = load(DATA / copy, ENV)
    plan: Plan = build(
        spec, env, lab_shaped(vendor_of(text), 2, cpus=2, memory_gb=24.0), secrets_digest=""
    )
    assert plan.router.host == "node1" and plan.router.port == spec.port
    assert all(plan.groups[r].max == spec.group(r).count[1] for r in ("prefill", "decode"))
    assert all(item.last <= 65535 for item in listeners(plan))
    del original
