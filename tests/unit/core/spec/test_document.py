"""pd.yml: dstack service files parse unchanged; each invalid form names file, line, field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdctl.core.entrypoint import worker_script
from pdctl.core.errors import InputError
from pdctl.core.spec import Gpu, Range, SpecError, added_flags, load, parse

REPO = Path(__file__).resolve().parents[4]
ENV = {"HF_TOKEN": "hf_value"}


@pytest.mark.parametrize(
    "name",
    [
        "examples/pd-amd-mi300x.yml",
        "examples/pd-nvidia-h200.yml",
        "examples/lab/pd.yml",
        "tests/data/dstack-pd.yml",
    ],
)
def test_examples_parse(name: str) -> None:
    spec, env = load(REPO / name, ENV)
    roles = [g.role for g in spec.replicas]
    assert {"prefill", "decode"} <= set(roles)
    assert env.secrets == ["HF_TOKEN"] and "HF_TOKEN" not in env.plain
    assert env.plain["MODEL_ID"]


def test_dstack_file_keeps_its_meaning() -> None:
    spec, _ = load(REPO / "tests/data/dstack-pd.yml", ENV)
    prefill, decode = spec.group("prefill"), spec.group("decode")
    assert prefill.count == (1, 4) and decode.count == (1, 8)
    assert prefill.scaling is not None and prefill.scaling.target == 3
    assert spec.gpus(prefill) == Gpu(model=None, count=1)
    assert spec.router is not None and spec.router.pd_disaggregation
    assert spec.probes[0].interval == 15.0 and spec.probes[0].url == "/health_generate"
    assert spec.ignored == ["spot_policy"]  # a dstack-only field: accepted and ignored


def test_amd_example_groups_and_durations() -> None:
    spec, _ = load(REPO / "examples/pd-amd-mi300x.yml", ENV)
    assert [g.role for g in spec.replicas] == ["router", "prefill", "decode"]
    scaling = spec.group("decode").scaling
    assert scaling is not None and scaling.scale_up_delay == 180 and scaling.scale_down_delay == 600
    assert spec.gpus(spec.group("prefill")) == Gpu(model="MI300X", count=4)
    assert spec.pdctl.start_timeout == 3600


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("MI300X:8", Gpu(model="MI300X", count=8)),
        ("8", Gpu(count=8)),
        (4, Gpu(count=4)),
        ("MI300X", Gpu(model="MI300X", count=1)),
        ("MI300X:192GB:8", Gpu(model="MI300X", count=8, memory=Range(min=192, max=192))),
        ({"name": "MI300X", "count": 2}, Gpu(model="MI300X", count=2)),
        # dstack's grammar (configurations' resources.gpu): vendor, names, memory, count.
        ("H200", Gpu(names=("H200",), count=1)),
        ("H200:8", Gpu(names=("H200",), count=8)),
        ("nvidia", Gpu(vendor="nvidia")),
        ("amd:4", Gpu(vendor="amd", count=4)),
        ("NVIDIA:2", Gpu(vendor="nvidia", count=2)),
        ("80GB..", Gpu(memory=Range(min=80, max=None))),
        ("H100:80GB:2", Gpu(names=("H100",), count=2, memory=Range(min=80, max=80))),
        ("H100,H200:8", Gpu(names=("H100", "H200"), count=8)),
        ("nvidia:40GB..80GB:1..4", Gpu(vendor="nvidia", memory=Range(min=40, max=80), count=1)),
        ("H200:2..", Gpu(names=("H200",), count=2)),
        ("..4", Gpu(count=1)),
        ({"name": ["H100", "H200"], "count": "2..8"}, Gpu(names=("H100", "H200"), count=2)),
        (
            {"vendor": "nvidia", "memory": "80GB..", "total_memory": "640GB"},
            Gpu(
                vendor="nvidia",
                memory=Range(min=80, max=None),
                total_memory=Range(min=640, max=640),
            ),
        ),
    ],
)
def test_gpu_forms(value: object, expected: Gpu) -> None:
    assert Gpu.parse(value) == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("tpu", "pdctl places workers on amd or nvidia GPUs"),
        ("H200::8", "has an empty part"),
        ("H200:8:4", "gives the count twice"),
        ("H100:H200", "gives the names twice"),
        ("nvidia:amd", "gives the vendor twice"),
        ("0", "a replica takes 1..64 GPUs"),
        ("65", "a replica takes 1..64 GPUs"),
        ("4..2", "MIN is above MAX"),
        ("80GBx", "is not a GPU memory size"),
        ("80GB..40GB", "MIN is above MAX"),
        ("H,", "GPU name ''"),
        ({"compute_capability": "9.0"}, "pdctl cannot check it"),
        ({"name": "H200", "count": 1, "nvlink": True}, "unknown GPU field(s) nvlink"),
        (True, "a GPU spec is text, a count or a mapping"),
    ],
)
def test_gpu_forms_refused(value: object, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        Gpu.parse(value)


def test_gpu_errors_name_file_line_and_field(tmp_path: Path) -> None:
    text = BASE.replace("resources: {gpu: MI300X:4}", "resources: {gpu: 'H200:8:4'}")
    with pytest.raises(SpecError) as caught:
        parse(text, tmp_path / "pd.yml", ENV)
    assert caught.value.message.startswith(f"{tmp_path / 'pd.yml'}:12: replicas[1].resources.gpu:")
    assert "gives the count twice" in caught.value.message


def test_gpu_describes_itself_as_written() -> None:
    assert Gpu.parse("H200").describe() == "H200:1"
    assert Gpu.parse("nvidia:80GB..:2").describe() == "nvidia:80GB..:2"
    assert Gpu.parse({"name": ["H100", "H200"], "total_memory": "640GB.."}).describe() == (
        "H100,H200:1 (total 640GB..)"
    )


def test_ranges() -> None:
    assert Range.parse("96..").contains(128) and not Range.parse("96..").contains(64)
    assert Range.parse("..4").contains(1) and not Range.parse("2..4").contains(5)
    assert Range.parse(8) == Range(min=8, max=8)


BASE = """\
type: service
name: svc
image: img:1
env:
  - A=1
replicas:
  - count: 1
    router: {type: sglang}
  - count: 1..2
    scaling: {metric: rps, target: 2}
    commands: ["python3 -m sglang.launch_server --disaggregation-mode prefill"]
    resources: {gpu: MI300X:4}
  - count: 1
    commands: ["python3 -m sglang.launch_server --disaggregation-mode decode"]
    resources: {gpu: MI300X:4}
"""


def error(text: str, environ: dict[str, str] | None = None) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse(text, Path("pd.yml"), ENV if environ is None else environ)
    return caught.value


def test_base_is_valid() -> None:
    spec, env = parse(BASE, Path("pd.yml"), ENV)
    assert spec.name == "svc" and env.plain == {"A": "1"}


def test_unknown_field_names_line_and_field() -> None:
    text = BASE.replace("  - count: 1..2\n", "  - count: 1..2\n    replica_magic: yes\n")
    err = error(text)
    assert err.message.startswith("pd.yml:10: replicas[1].replica_magic: unknown field")
    assert err.details["line"] == 10


def test_unknown_top_level_field() -> None:
    err = error(BASE + "colour: blue\n")
    assert err.message == "pd.yml:16: colour: unknown field (pdctl-only settings go under `pdctl:`)"


def test_a_file_of_another_type_or_none_is_named_before_its_fields() -> None:
    """A task's fields (groups, startup_order) would each be refused by a service's rules:
    the type is the one error (its value shown only when it is short, printable text)."""
    task = BASE.replace("type: service\n", "type: task\n") + "startup_order: workers-first\n"
    assert error(task).message.startswith("pd.yml:1: type: 'task': pdctl deploys dstack services")
    missing = error(BASE.replace("type: service\n", ""))
    assert missing.message == (
        "pd.yml:1: type: missing: pdctl deploys dstack services (type: service)"
    )
    odd = error('name: x\ntype: ["service\\n"]\n')
    assert odd.message.startswith("pd.yml:2: type: this value: ")
    assert odd.hint is not None and "type: service" in odd.hint


def test_a_service_of_one_group_is_named_before_its_fields() -> None:
    """dstack's one-server service (top-level commands, a replica count): not P/D, said first,
    not as a newline its command holds."""
    one = "type: service\nname: x\ncommands:\n  - |\n    sglang serve \\\n      --port 30000\n"
    missing = error(one)
    assert missing.message.startswith("pd.yml:3: replicas: missing: this is a service of one group")
    assert missing.hint is not None and "a prefill group and a decode group" in missing.hint
    counted = error(one + "replicas: 1..4\n")
    assert counted.message.startswith("pd.yml:7: replicas: '1..4': a replica count")
    assert error("type: service\nname: x\nreplicas: 2\n").message.startswith(
        "pd.yml:3: replicas: 2: a replica count"
    )


def test_range_count_needs_scaling() -> None:
    text = BASE.replace("    scaling: {metric: rps, target: 2}\n", "")
    err = error(text)
    assert "pd.yml:9: replicas[1]" in err.message and "a range count needs `scaling`" in err.message


def test_bad_count() -> None:
    err = error(BASE.replace("count: 1..2", "count: lots"))
    assert "pd.yml:9: replicas[1].count" in err.message and "'lots' is not a count" in err.message


def test_unset_bare_env_is_named() -> None:
    err = error(BASE.replace("  - A=1\n", "  - A=1\n  - HF_TOKEN\n"), environ={})
    assert err.message.startswith("pd.yml:6: env[1]: HF_TOKEN is to be taken from your environment")
    assert err.hint == "export HF_TOKEN=... before running pdctl"


def test_newline_in_env_value_is_refused() -> None:
    err = error(BASE.replace("  - A=1\n", '  - "A=1\\nExecStart=/bin/evil"\n'))
    assert "holds a newline" in err.message and "env[0]" in err.message


def test_secret_with_newline_is_refused() -> None:
    err = error(BASE.replace("  - A=1\n", "  - HF_TOKEN\n"), environ={"HF_TOKEN": "a\nb"})
    assert "HF_TOKEN holds a newline" in err.message and "a\nb" not in err.message


def test_missing_decode_group() -> None:
    text = BASE[: BASE.index("  - count: 1\n    commands")]
    err = error(text)
    assert err.message == "pd.yml:6: replicas: PD disaggregation needs a decode group"


def test_two_routers_and_router_count() -> None:
    two = BASE.replace("  - count: 1\n    router", "  - count: 2\n    router")
    assert parse(two, Path("pd.yml"), ENV)[0].routers == 2
    assert parse(BASE, Path("pd.yml"), ENV)[0].routers == 1
    for count in ("9", "0", "1..2"):
        bad = BASE.replace("  - count: 1\n    router", f"  - count: {count}\n    router")
        assert "replicas[0]" in error(bad).message, count
    many = error(BASE.replace("  - count: 1\n    router", "  - count: 9\n    router"))
    assert "a fixed number of routers, 1 to 8, each on its own host" in many.message
    doubled = BASE + "  - count: 1\n    router: {type: sglang}\n"
    assert "a second router group" in error(doubled).message


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("10.0.0.300", "is not an IPv4 address"),
        ("127.0.0.5", "not loopback"),
        ("224.0.0.18", "not loopback, multicast"),
        ("10.0.0.255", "broadcast"),
        ("fe80::1", "is not an IPv4 address"),
    ],
)
def test_a_failover_address_is_one_a_host_can_hold(address: str, why: str) -> None:
    text = BASE + f"pdctl:\n  router:\n    address: {address}\n"
    err = error(text)
    assert "pdctl.router.address" in err.message and why in err.message, err.message


def test_a_failover_address_and_its_virtual_router_id() -> None:
    text = BASE + "pdctl:\n  router:\n    address: 10.0.0.200\n    virtual_router_id: 7\n"
    router = parse(text, Path("pd.yml"), ENV)[0].pdctl.router
    assert (router.address, router.virtual_router_id) == ("10.0.0.200", 7)
    assert "virtual_router_id" in error(text.replace(": 7", ": 256")).message


def test_group_without_gpus() -> None:
    err = error(BASE.replace("    resources: {gpu: MI300X:4}\n  - count: 1\n", "  - count: 1\n", 1))
    assert "how many GPUs a replica needs" in err.message


def test_bad_volume() -> None:
    err = error(BASE + "volumes:\n  - data:/data\n")
    assert "pd.yml:17: volumes[0]" in err.message


def test_yaml_syntax_and_duplicates() -> None:
    assert error("type: service\nname: [x\n").message.startswith("pd.yml:3: not valid YAML")
    assert error(BASE + "name: again\n").message == "pd.yml:16: duplicate key 'name'"
    assert "expected a mapping" in error("- just\n- a list\n").message


def test_unreadable_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load(tmp_path / "missing.yml", ENV)


# -- latency scaling (ttft on prefill, itl on decode) --------------------------------------------

PREFILL_SCALING = "    scaling: {metric: rps, target: 2}\n"


def latency(prefill: str, decode: str | None = None) -> str:
    text = BASE.replace(PREFILL_SCALING, f"    scaling: {prefill}\n")
    text = text.replace("launch_server --disagg", "launch_server --enable-metrics --disagg")
    if decode is not None:
        text = text.replace(
            "  - count: 1\n    commands", f"  - count: 1..3\n    scaling: {decode}\n    commands"
        )
    return text


def test_ttft_and_itl_targets_are_durations() -> None:
    text = latency(
        "{metric: ttft, target: 500ms}",
        "{metric: itl, target: 0.05s, percentile: p99, window: 2m}",
    )
    spec, _ = parse(text, Path("pd.yml"), ENV)
    prefill, decode = spec.group("prefill").scaling, spec.group("decode").scaling
    assert prefill is not None and decode is not None
    assert (prefill.metric, prefill.target, prefill.percentile, prefill.window) == (
        "ttft",
        pytest.approx(0.5),
        90.0,
        60.0,
    )
    assert (decode.metric, decode.target, decode.percentile, decode.window) == (
        "itl",
        pytest.approx(0.05),
        99.0,
        120.0,
    )


@pytest.mark.parametrize(
    ("scaling", "field", "problem"),
    [
        ("{metric: ttft, target: 500}", "replicas[1].scaling.target", "write e.g. 500ms"),
        ("{metric: ttft, target: -5ms}", "replicas[1].scaling.target", "not a duration"),
        ("{metric: ttft, target: 0ms}", "replicas[1].scaling.target", "positive"),
        ("{metric: ttft, target: .nan}", "replicas[1].scaling.target", "positive, finite"),
        ("{metric: ttft, target: fast}", "replicas[1].scaling.target", "not a duration"),
        ("{metric: rps, target: 500ms}", "replicas[1].scaling.target", "number of requests"),
        ("{metric: rps, target: .inf}", "replicas[1].scaling.target", "(0, 1000000]"),
        ("{metric: ttft, target: 1s, percentile: p100}", "replicas[1].scaling.percentile", "p99.9"),
        (
            "{metric: ttft, target: 1s, percentile: yes}",
            "replicas[1].scaling.percentile",
            "percentile",
        ),
        ("{metric: ttft, target: 1s, window: 1s}", "replicas[1].scaling.window", "between 10 s"),
        ("{metric: ttft, target: 1s, window: .inf}", "replicas[1].scaling.window", "finite"),
        ("{metric: p99, target: 1s}", "replicas[1].scaling.metric", "'rps', 'ttft' or 'itl'"),
    ],
)
def test_latency_scaling_refused(scaling: str, field: str, problem: str) -> None:
    err = error(latency(scaling))
    assert err.message.startswith(f"pd.yml:10: {field}: "), err.message
    assert problem in err.message, err.message


def test_ttft_on_decode_and_itl_on_prefill_are_refused() -> None:
    err = error(latency("{metric: itl, target: 50ms}"))
    assert err.message.startswith("pd.yml:10: replicas[1].scaling.metric: itl measures the decode")
    assert "scale the prefill group on ttft" in str(err.hint)
    err = error(latency("{metric: rps, target: 2}", "{metric: ttft, target: 500ms}"))
    assert "replicas[2].scaling.metric: ttft measures the prefill phase" in err.message


def test_latency_scaling_gets_sglang_metrics_added_not_refused() -> None:
    """SGLang serves /metrics only with --enable-metrics: a group that scales on ttft or itl
    gets it from pdctl (the plan says so), once, and only where it is missing."""
    text = latency("{metric: ttft, target: 500ms}").replace("--enable-metrics ", "")
    spec, _ = parse(text, Path("pd.yml"), ENV)
    prefill, decode = spec.group("prefill"), spec.group("decode")
    assert added_flags(prefill) == ("--enable-metrics",) and added_flags(decode) == ()
    script = worker_script(prefill.commands, "prefill", added_flags(prefill))
    assert script.count("--enable-metrics") == 1
    written, _ = parse(latency("{metric: ttft, target: 500ms}"), Path("pd.yml"), ENV)
    assert added_flags(written.group("prefill")) == ()  # the spec has it already
    rps, _ = parse(BASE, Path("pd.yml"), ENV)
    assert added_flags(rps.group("prefill")) == ()  # rps is the router's: no worker metrics


# ---------------------------------------------------------------- dstack's group settings


def test_dstacks_group_settings_are_read_as_dstack_means_them() -> None:
    """`replicas` is a group's count; each worker group may name its own image (then the file
    needs none); a router group's python/nvcc/image and a group's spot_policy are ignored,
    and listed (the plan's notes say so)."""
    text = (
        BASE.replace("image: img:1\n", "")
        .replace("  - count: 1..2\n", "  - replicas: 1..2\n    image: p:1\n    spot_policy: auto\n")
        .replace("  - count: 1\n    commands", "  - count: 1\n    image: d:1\n    commands")
        .replace("    router: {type: sglang}\n", '    router: {type: sglang}\n    python: "3.12"\n')
    )
    spec, _ = parse(text, Path("pd.yml"), ENV)
    assert spec.image is None and spec.group("prefill").count == (1, 2)
    assert (spec.image_of(spec.group("prefill")), spec.image_of(spec.group("decode"))) == (
        "p:1",
        "d:1",
    )
    assert spec.ignored == ["replicas[1].spot_policy", "replicas[0].python"]


@pytest.mark.parametrize(
    ("change", "field", "said"),
    [
        (("image: img:1\n", ""), "replicas[1].image", "the prefill group names no image"),
        (
            ("image: img:1\n", ""),
            "replicas[1].image",
            "`python` picks dstack's own base image",
        ),
        (
            ("  - count: 1\n    commands", "  - count: 1\n    docker: true\n    commands"),
            "replicas[2].docker",
            "a docker-in-docker worker group",
        ),
        (
            ("  - count: 1\n    commands", "  - count: 1\n    privileged: true\n    commands"),
            "replicas[2].privileged",
            "differ in `privileged`",
        ),
    ],
    ids=["no-image", "python-no-image", "docker", "privileged-differs"],
)
def test_a_worker_group_dstack_would_run_otherwise_is_refused(
    change: tuple[str, str], field: str, said: str
) -> None:
    text = BASE.replace(*change)
    if "python" in said:
        text = text.replace("  - count: 1..2\n", '  - count: 1..2\n    python: "3.12"\n')
    err = error(text)
    assert f": {field}: " in err.message and said in err.message, err.message


def test_both_worker_groups_privileged_runs_them_privileged() -> None:
    group = "    privileged: true\n    commands"
    text = BASE.replace(
        "  - count: 1..2\n    scaling: {metric: rps, target: 2}\n    commands",
        "  - count: 1..2\n    scaling: {metric: rps, target: 2}\n" + group,
    )
    text = text.replace("  - count: 1\n    commands", "  - count: 1\n" + group)
    spec, _ = parse(text, Path("pd.yml"), ENV)
    assert spec.privileged is False and spec.workers_privileged is True
