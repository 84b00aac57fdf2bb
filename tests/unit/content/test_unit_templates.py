"""Property: for any spec text pdctl accepts, the units and env files it writes keep one
directive per line, so no value can add a directive (an ExecStartPre=+..., a second
EnvironmentFile, an env variable root reads).

Hypothesis feeds arbitrary strings (control characters, Unicode line separators, quotes,
`%`, `$`, template syntax) into each field that reaches a host; the spec is parsed and
planned as pdctl does, and the files are rendered from the project's own templates: the
roles' unit templates with plain Jinja2 from the plan's extra-vars (the lab tests hold that
equal to what the roles write) and the env files from the pd_worker role's own task text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.core.errors import PdctlError
from pdctl.core.fleet_model import Fleet, FleetHost, Preflight
from pdctl.core.plan import Plan, build
from pdctl.core.spec import parse
from tests import role_templates
from tests.hostfacts import nvidia_facts

ROOT = Path(__file__).resolve().parents[3]
TEMPLATES = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
DIRECTIVE = re.compile(r"^[A-Z][A-Za-z]+=")
ENV_LINE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _role_template(name: str) -> str:
    """The content template of one file the pd_worker role writes (configure.yml), named by
    its pd_layout key."""
    tasks = yaml.safe_load((ROOT / "roles/pd_worker/tasks/configure.yml").read_text())
    for task in tasks:
        for entry in (task.get("vars") or {}).get("_service", []):
            if name in entry["path"]:
                return str(entry["content"])
    raise AssertionError(f"no {name} in configure.yml")


SERVICE_ENV = TEMPLATES.from_string(_role_template("service_env"))


def _fleet(gpu: dict[str, Any] | None = None) -> Fleet:
    checked = Preflight(ok=True, checked_at="2026-01-01T00:00:00+00:00", checks=[])
    gpu = gpu or {
        "cpus": 96,
        "memory_gb": 1024.0,
        "gpus": {"count": 8, "model": "AMD Instinct MI300X"},
    }
    return Fleet(
        name="f",
        hosts=[
            FleetHost(
                name="cpu1",
                address="10.0.0.1",
                user="root",
                kind="cpu",
                facts={"cpus": 8, "memory_gb": 16.0},
                preflight=checked,
            ),
            FleetHost(
                name="gpu1",
                address="10.0.0.2",
                user="root",
                kind="gpu",
                facts=gpu,
                preflight=checked,
            ),
        ],
    )


def _spec(**fields: Any) -> dict[str, Any]:
    prefill = ["python -m sglang.launch_server --disaggregation-mode prefill --port 8000"]
    return {
        "type": "service",
        "name": fields.get("name", "svc"),
        "image": fields.get("image", "lmsysorg/sglang:v0.5.5"),
        "env": ["HF_TOKEN", f"PLAIN={fields.get('env', 'x')}"],
        "volumes": [fields.get("volume", "/data:/data:ro")],
        "model": fields.get("model", "org/model"),
        "replicas": [
            {
                "count": 1,
                "commands": [
                    "smg launch --pd-disaggregation --request-timeout-secs "
                    + fields.get("router_value", "600")
                ],
                "router": {"type": "sglang"},
            },
            {
                "count": 1,
                "commands": [fields.get("command", "true"), *prefill],
                "resources": {"gpu": fields.get("gpu", "MI300X:4")},
            },
            {
                "count": 1,
                "commands": [
                    "python -m sglang.launch_server --disaggregation-mode decode"
                    + fields.get("backend", "")
                ],
                "resources": {"gpu": fields.get("gpu", "MI300X:4")},
            },
        ],
        "probes": [{"type": "http", "url": fields.get("url", "/health"), "interval": "5s"}],
        "pdctl": {
            "wheelhouse": fields.get("wheelhouse", "/opt/wheels"),
            "provider_lib": fields.get("pdctl_provider_lib", "auto"),
        },
    }


def _plan(
    fields: dict[str, Any], secret: str = "hf_x", facts: dict[str, Any] | None = None
) -> Plan | None:
    text = yaml.safe_dump(_spec(**fields), allow_unicode=True)
    try:
        spec, env = parse(text, Path("pd.yml"), {"HF_TOKEN": secret})
        plan = build(spec, env, _fleet(facts), secrets_digest="")
    except PdctlError:
        return None  # refused: nothing is written
    return plan if plan.slots() else None  # a host whose facts were refused takes no slot


def _logical_lines(unit: str) -> list[str]:
    """A unit's lines as systemd reads them: split on newlines only, `\\` continues a line."""
    assert unit.endswith("\n")
    lines: list[str] = []
    pending = ""
    for raw in unit[:-1].split("\n"):
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    assert pending == ""
    return lines


def _directives(unit: str) -> list[str]:
    found = []
    for line in _logical_lines(unit):
        if not line or line.startswith("#") or re.fullmatch(r"\[[A-Za-z]+\]", line):
            continue
        assert DIRECTIVE.match(line), f"not a directive line: {line!r}"
        found.append(line.split("=", 1)[0])
    return found


def _units(plan: Plan, runtime: str = "podman") -> dict[str, str]:
    plan_vars = plan.extravars()
    vendor = plan.groups["prefill"].slots[0].vendor
    return {
        "worker": role_templates.worker_unit(plan_vars, "prefill", runtime, vendor),
        "router": role_templates.router_unit(plan_vars),
    }


def _env_files(plan: Plan, secret: str) -> dict[str, tuple[str, int]]:
    """Each env file's text and how many variables it must hold."""
    group = plan.groups["prefill"]
    slot_env = group.slots[0].env()
    return {
        "prefill.env": (f"PDCTL_IMAGE={group.image}\nPDCTL_CONFIG={group.config}\n", 2),
        "service.env": (SERVICE_ENV.render(pd_env=plan.env), len(plan.env)),
        "slot.env": ("".join(f"{k}={v}\n" for k, v in slot_env.items()), len(slot_env)),
        "secrets.env": (f"HF_TOKEN={secret}\n", 1),
    }


BASELINE = _plan({})
assert BASELINE is not None
BASELINE_DIRECTIVES = {name: _directives(text) for name, text in _units(BASELINE).items()}


def _check(plan: Plan, secret: str = "hf_x") -> None:
    for runtime in ("podman", "docker"):
        for name, text in _units(plan, runtime).items():
            assert text.split("\n") == [*text.splitlines(), ""], name  # no other line breaks
            assert _directives(text) == BASELINE_DIRECTIVES[name], name
    for slot in plan.slots():
        for value in slot.env().values():
            # $PDCTL_DEVICE_ARGS is split into words by systemd, and the NICs are joined
            # with ',' and ':': no value holds a quote, a space inside a word, or a '$'.
            assert not set(value) & set("\"'\\$%\n"), value
    for name, (text, count) in _env_files(plan, secret).items():
        lines = text.split("\n")
        assert lines[-1] == "" and len(lines) - 1 == count, name
        assert text.splitlines() == lines[:-1], name
        assert all(ENV_LINE.match(line) for line in lines[:-1]), name


ANY_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=0, max_size=40
)
# Text biased toward what attacks a unit or an env file.
NASTY = st.one_of(
    ANY_TEXT,
    st.lists(
        st.sampled_from(
            [
                "\n",
                "\r",
                "\x0b",
                "\x0c",
                "\x85",
                "\u2028",
                "\u2029",
                "\t",
                "\\",
                "%",
                "$",
                "'",
                '"',
                " ",
                "{{",
                "}}",
                "{#",
                "${",
                "ExecStartPre=+/bin/sh",
                "X=1",
                "/",
                ":",
                "..",
                "=",
                ";",
                "#",
                "a",
                "0",
            ]
        ),
        max_size=12,
    ).map("".join),
)
FIELDS = ["env", "volume", "image", "url", "router_value", "model", "name", "wheelhouse", "command"]
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("field", FIELDS)
@PROPERTY
@given(value=NASTY)
def test_accepted_values_keep_one_directive_per_line(field: str, value: str) -> None:
    if field in {"volume", "wheelhouse", "url"}:
        value = "/" + value  # the form each field needs, so more values get past the parser
    if field == "volume":
        value += ":/data"
    plan = _plan({field: value})
    if plan is not None:
        _check(plan)


@PROPERTY
@given(secret=NASTY)
def test_accepted_secrets_keep_one_variable_per_line(secret: str) -> None:
    plan = _plan({}, secret=secret or "x")
    if plan is not None:
        _check(plan, secret or "x")


NIC_NAMES = st.one_of(
    NASTY,
    st.lists(
        st.sampled_from(["mlx5_", "0", " ", "\n", ":", ",", "$", '"', "\t", "X=1"]), max_size=8
    ).map("".join),
)


@PROPERTY
@given(
    name=st.one_of(st.just("mlx5_0"), NIC_NAMES),
    cdi=st.one_of(st.just("GPU-1a4626a2"), NASTY),
    library=st.one_of(st.just("libmlx5-rdmav34.so"), NASTY),
)
def test_nvidia_facts_keep_one_directive_per_line(name: str, cdi: str, library: str) -> None:
    """What the hosts report (NIC names, CDI names, the provider library's path) reaches the
    slot env files and the units only when it is safe there; else the host is not used."""
    facts = nvidia_facts()
    facts["rdma"]["devices"][0]["name"] = name
    facts["nvidia"]["cdi_devices"].append(cdi)
    facts["rdma"]["provider_libs"]["mlx5"] = "/usr/lib/" + library
    for backend in ("", " --disaggregation-transfer-backend nixl"):
        fields = {"gpu": "H200:4", "backend": backend, "pdctl_provider_lib": "host"}
        plan = _plan(fields, facts=facts)
        if plan is not None:
            _check(plan)
            assert plan.groups["prefill"].slots[0].vendor == "nvidia"


def test_nvidia_units_and_env_files_have_the_baseline_directives() -> None:
    for backend in ("", " --disaggregation-transfer-backend nixl"):
        plan = _plan({"gpu": "H200:4", "backend": backend}, facts=nvidia_facts())
        assert plan is not None
        _check(plan)
        decode = plan.groups["decode"].slots[0].env()
        assert decode["PDCTL_RDMA_DEVICES"] == "mlx5_4,mlx5_5,mlx5_6,mlx5_7"
        assert ("UCX_NET_DEVICES" in decode) == bool(backend)
        worker = _units(plan, "docker")["worker"]
        assert '--gpus "\\"device=${PDCTL_GPU_IDS}\\""' in worker and "/dev/kfd" not in worker


def test_the_baseline_has_each_directive_once() -> None:
    worker = BASELINE_DIRECTIVES["worker"]
    assert worker.count("ExecStart") == 1 and worker.count("EnvironmentFile") == 2
    assert "ExecStartPre" in worker and BASELINE_DIRECTIVES["router"].count("ExecStart") == 1


def test_a_value_with_a_newline_never_gets_through() -> None:
    # A worker command is shell text: its lines are lines of the group's script (a file of
    # its own, run inside the container), never of a unit or an env file.
    for field in [f for f in FIELDS if f != "command"]:
        assert _plan({field: "/a\nExecStartPre=+/bin/sh"}) is None, field
    assert _plan({}, secret="a\nb") is None
