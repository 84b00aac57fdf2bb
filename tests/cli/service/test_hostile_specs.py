"""Hostile and malformed service files, through the real CLI.

Each one gets one clean error: exit 3, no traceback, a few lines naming file:line and the
field. No host is contacted (the fleet's only hosts are a listening socket on loopback that
must see no connection), nothing is written outside the workspace, and the workspace gains
no service state.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import is_trusted_as_template

from pdctl.core.fleet_model import Fleet, FleetHost, FleetSettings, Preflight
from pdctl.doors import inventory
from pdctl.doors.workspace import Workspace
from tests.support import pdctl, private_tmp

BASE = """\
type: service
name: svc
image: lmsysorg/sglang:v0.5.5
env:
  - HF_TOKEN
  - MODEL_ID=org/model
replicas:
  - count: 1
    commands:
      - pip install smg
      - smg launch --host 0.0.0.0 --port 8000 --pd-disaggregation --prefill-policy cache_aware
    router:
      type: sglang
  - count: 1..2
    scaling:
      metric: rps
      target: 2
    commands:
      - |
        python -m sglang.launch_server \\
          --model-path $MODEL_ID \\
          --disaggregation-mode prefill \\
          --port 8000
    resources:
      gpu: MI300X:4
  - count: 1
    commands:
      - python -m sglang.launch_server --model-path $MODEL_ID --disaggregation-mode decode
    resources:
      gpu: MI300X:4
port: 8000
probes:
  - type: http
    url: /health
    interval: 15s
pdctl:
  start_timeout: 10m
"""
PREFILL_CMD = "          --port 8000\n"
DECODE_CMD = (
    "      - python -m sglang.launch_server --model-path $MODEL_ID --disaggregation-mode decode\n"
)
ROUTER_CMD = "--prefill-policy cache_aware\n"


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _laughs() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, 9):
        prev = chr(ord("a") + level - 1)
        this = chr(ord("a") + level)
        lines.append(f"{this}: &{this} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def sub(old: str, new: str) -> str:
    assert old in BASE, old
    return BASE.replace(old, new, 1)


# (class, file text, what the one error line must name)
CASES: list[tuple[str, str, str]] = [
    # Text that would start a new line in a unit or an env file read by root.
    (
        "newline-in-router-flag",
        sub(
            "      - smg launch --host 0.0.0.0 --port 8000 --pd-disaggregation "
            "--prefill-policy cache_aware\n",
            '      - "smg launch --pd-disaggregation --prefill-policy '
            "'x\\nExecStartPre=+/bin/touch /tmp/p'\"\n",
        ),
        "replicas[0].commands[1]",
    ),
    (
        "newline-in-volume",
        sub("port: 8000\n", 'port: 8000\nvolumes: ["/a:/b\\nX=1"]\n'),
        "volumes[0]",
    ),
    (
        "newline-in-image",
        sub("image: lmsysorg/sglang:v0.5.5", 'image: "a/b\\nExecStart=x"'),
        "image",
    ),
    ("cr-in-env", sub("  - MODEL_ID=org/model", '  - "MODEL_ID=org\\rmodel"'), "env[1]"),
    ("nul-in-model", sub("port: 8000\n", 'port: 8000\nmodel: "a\\0b"\n'), "model"),
    ("escape-in-probe", sub("url: /health", 'url: "/health\\e[2J"'), "probes[0].url"),
    # Names that become host paths, unit names or the inventory directory.
    ("traversal-name", sub("name: svc", "name: ../../etc/x y"), "name"),
    ("upper-name", sub("name: svc", "name: Svc"), "name"),
    ("long-name", sub("name: svc", "name: " + "a" * 41), "name"),
    ("traversal-fleet", sub("pdctl:\n", "pdctl:\n  fleet: ../../somedir\n"), "pdctl.fleet"),
    (
        "group-name",
        sub("  - count: 1..2\n", "  - name: ../x\n    count: 1..2\n"),
        "replicas[1].name",
    ),
    # Images by the OCI grammar; volumes absolute, no '..'.
    ("image-shell", sub("image: lmsysorg/sglang:v0.5.5", 'image: "x;$(id)"'), "image"),
    ("image-upper", sub("image: lmsysorg/sglang:v0.5.5", "image: LmsysOrg/SGLang"), "image"),
    ("image-space", sub("image: lmsysorg/sglang:v0.5.5", 'image: "a b"'), "image"),
    ("volume-relative", sub("port: 8000\n", "port: 8000\nvolumes: [data:/data]\n"), "volumes[0]"),
    ("volume-dotdot", sub("port: 8000\n", "port: 8000\nvolumes: [/a/../etc:/b]\n"), "volumes[0]"),
    ("volume-mode", sub("port: 8000\n", "port: 8000\nvolumes: ['/a:/b:rw,z']\n"), "volumes[0]"),
    ("volume-space", sub("port: 8000\n", "port: 8000\nvolumes: ['/a b:/b']\n"), "volumes[0]"),
    ("wheelhouse-path", sub("pdctl:\n", "pdctl:\n  wheelhouse: ../wheels\n"), "pdctl.wheelhouse"),
    # An image ID pinned: 64 hex digits, and one per image.
    ("image-id-bad", sub("pdctl:\n", "pdctl:\n  image_id: sha256:../x\n"), "pdctl.image_id"),
    (
        "image-id-twice",
        sub(
            "    resources:\n      gpu: MI300X:4\n  - count: 1\n",
            f"    resources:\n      gpu: MI300X:4\n    pdctl:\n      image_id: {'a' * 64}\n"
            f"  - count: 1\n    pdctl:\n      image_id: {'b' * 64}\n",
        ),
        "replicas[2].pdctl.image_id",
    ),
    # Ports, GPUs, counts.
    ("port-range", sub("port: 8000\n", "port: 70000\n"), "port"),
    ("port-zero", sub("port: 8000\n", "port: 0\n"), "port"),
    (
        "metrics-equals-port",
        sub("pdctl:\n", "pdctl:\n  router:\n    metrics_port: 8000\n"),
        "pdctl.router.metrics_port",
    ),
    ("worker-ports-past-65535", sub("pdctl:\n", "pdctl:\n  ports:\n    base: 65000\n"), "65535"),
    ("gpu-zero", sub("gpu: MI300X:4\n  - count: 1\n", "gpu: 0\n  - count: 1\n"), "gpu"),
    ("gpu-negative", sub("gpu: MI300X:4\n  - count: 1\n", "gpu: -2\n  - count: 1\n"), "gpu"),
    ("gpu-too-many", sub("gpu: MI300X:4\n  - count: 1\n", "gpu: 1000\n  - count: 1\n"), "gpu"),
    ("fixed-count-with-scaling", sub("count: 1..2\n", "count: 2\n"), "replicas[1]"),
    ("huge-count", sub("count: 1..2\n", "count: 1..1000000\n"), "replicas[1]"),
    (
        "count-bool",
        sub(
            "  - count: 1\n    commands:\n      - python",
            "  - count: yes\n    commands:\n      - python",
        ),
        "count",
    ),
    # Probes and durations.
    ("probe-relative", sub("url: /health", "url: health"), "probes[0].url"),
    (
        "probe-userinfo",
        sub("url: /health", 'url: "@169.254.169.254/latest/meta-data"'),
        "probes[0].url",
    ),
    ("probe-absolute", sub("url: /health", "url: http://169.254.169.254/"), "probes[0].url"),
    ("interval-negative", sub("interval: 15s", "interval: -1"), "probes[0].interval"),
    ("interval-below-1s", sub("interval: 15s", "interval: 0.2"), "probes[0].interval"),
    ("duration-inf", sub("start_timeout: 10m", "start_timeout: .inf"), "pdctl.start_timeout"),
    ("duration-nan", sub("start_timeout: 10m", "start_timeout: .nan"), "pdctl.start_timeout"),
    ("duration-huge", sub("start_timeout: 10m", "start_timeout: 100000d"), "pdctl.start_timeout"),
    ("target-inf", sub("target: 2", "target: .inf"), "replicas[1].scaling.target"),
    (
        "itl-on-prefill",
        sub("metric: rps\n      target: 2", "metric: itl\n      target: 50ms"),
        "replicas[1].scaling.metric",
    ),
    (
        "ttft-bare-number",
        sub("metric: rps\n      target: 2", "metric: ttft\n      target: 500"),
        "replicas[1].scaling.target",
    ),
    # Env: duplicates, secret and plain at once, reserved names.
    (
        "env-duplicate",
        sub("  - MODEL_ID=org/model\n", "  - MODEL_ID=org/model\n  - MODEL_ID=x\n"),
        "env[2]",
    ),
    (
        "env-secret-and-plain",
        sub("  - MODEL_ID=org/model\n", "  - MODEL_ID=org/model\n  - HF_TOKEN=plain\n"),
        "env[2]",
    ),
    (
        "env-reserved",
        sub("  - MODEL_ID=org/model\n", "  - MODEL_ID=org/model\n  - PDCTL_PORT=1\n"),
        "env[2]",
    ),
    (
        "env-bad-name",
        sub("  - MODEL_ID=org/model\n", "  - MODEL_ID=org/model\n  - A-B=1\n"),
        "env[2]",
    ),
    ("env-not-text", sub("  - MODEL_ID=org/model\n", "  - MODEL_ID=org/model\n  - 12\n"), "env[2]"),
    ("duplicate-key", sub("port: 8000\n", "port: 8000\nport: 9000\n"), "duplicate key"),
    # Router flags: an abbreviation of one pdctl owns, or shell syntax (SMG is no shell's child).
    (
        "router-abbrev",
        sub(ROUTER_CMD, "--prefill-policy cache_aware --prometheus-ho 0.0.0.0\n"),
        "--prometheus-ho",
    ),
    ("router-abbrev-eq", sub(ROUTER_CMD, "--prefill-policy cache_aware --api-k=x\n"), "--api-k"),
    (
        "router-shell",
        sub(ROUTER_CMD, "--prefill-policy cache_aware && curl x\n"),
        "replicas[0].commands[1]",
    ),
    ("router-variable", sub(ROUTER_CMD, "--prefill-policy $POLICY\n"), "replicas[0].commands[1]"),
    # SMG cannot start with it: pdctl registers the workers after the router is up.
    (
        "router-power-of-two",
        sub(ROUTER_CMD, "--prefill-policy cache_aware --decode-policy power_of_two\n"),
        "replicas[0].commands[1]",
    ),
    (
        "policy-power-of-two",
        sub("pdctl:\n", "pdctl:\n  router:\n    prefill_policy: power_of_two\n"),
        "pdctl.router.prefill_policy",
    ),
    (
        "policy-unknown",
        sub("pdctl:\n", "pdctl:\n  router:\n    decode_policy: 'x; rm -rf /'\n"),
        "pdctl.router.decode_policy",
    ),
    # Commands pdctl rewrites: refused where it cannot rewrite them safely.
    (
        "launch-after-cd",
        sub(
            DECODE_CMD,
            "      - cd /w && python -m sglang.launch_server --disaggregation-mode decode\n",
        ),
        "replicas[2].commands[0]",
    ),
    (
        "launch-not-last",
        sub(DECODE_CMD, DECODE_CMD + "      - echo done\n"),
        "replicas[2].commands",
    ),
    (
        "compound-last",
        sub(
            DECODE_CMD,
            "      - |\n        if true; then python -m sglang.launch_server"
            " --disaggregation-mode decode; fi\n",
        ),
        "replicas[2].commands[0]",
    ),
    (
        "unterminated-quote",
        sub(PREFILL_CMD, "          --port 8000 --json-model-override-args '{\n"),
        "replicas[1].commands[0]",
    ),
    ("port-without-value", sub(PREFILL_CMD, "          --port\n"), "replicas[1].commands[0]"),
    # Parsing bounds.
    ("nested-brackets", sub("port: 8000\n", f"port: 8000\nmodel: {_nested(2000)}\n"), "deeper"),
    ("billion-laughs", _laughs(), "aliases"),
    ("oversized", BASE + "# " + "x" * (2 << 20) + "\n", "over the limit"),
    ("not-a-mapping", "- just\n- a list\n", "mapping"),
    ("binary", "\x00\x01\x02garbage", "pd.yml"),
    ("unknown-field", sub("port: 8000\n", "port: 8000\ncommand: [x]\n"), "command"),
    ("non-text-key", sub("port: 8000\n", "port: 8000\nmodel: {1: x}\n"), "model"),
]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, listener: socket.socket) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    port = listener.getsockname()[1]
    facts = {"cpus": 96, "memory_gb": 1024.0, "gpus": {"count": 8, "model": "AMD Instinct MI300X"}}
    checked = Preflight(ok=True, checked_at="2026-11-25T00:00:00Z", checks=[])
    fleet = Fleet(
        name="f",
        settings=FleetSettings(),
        hosts=[
            FleetHost(
                name=f"h{i}",
                address="127.0.0.1",
                port=port,
                user="root",
                kind=kind,
                facts=facts if kind == "gpu" else {"cpus": 8, "memory_gb": 16.0},
                preflight=checked,
            )
            for i, kind in enumerate(("cpu", "gpu", "gpu"))
        ],
    )
    inventory.save(Workspace(root), fleet)
    return root


def _drain(listener: socket.socket) -> None:
    """Close connections an earlier, failed case left queued: each case checks its own."""
    while True:
        try:
            listener.accept()[0].close()
        except BlockingIOError:
            return


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_the_base_spec_plans(home: Path, tmp_path: Path) -> None:
    """The corpus's base is valid: each case fails for its own change, not the base."""
    spec = tmp_path / "pd.yml"
    spec.write_text(BASE)
    proc = pdctl(home, "--json", "plan", str(spec), "--fleet", "f", env={"HF_TOKEN": "hf_x"})
    plan = json.loads(proc.stdout)["plan"]
    assert plan["service"] == "svc" and len(plan["groups"]["prefill"]["slots"]) == 2


ROUTES = [("deploy", "-y"), ("deploy", "--dry-run"), ("plan",)]
# Every case through `deploy -y`; a sample of the classes through the other routes too (they
# share the one validation: the sample shows they reach it before anything else).
SAMPLE = ("traversal-name", "newline-in-router-flag", "billion-laughs", "router-abbrev")
RUNS = [
    (case, route) for case in CASES for route in ROUTES if route == ROUTES[0] or case[0] in SAMPLE
]


@pytest.mark.parametrize(
    ("case", "command"), RUNS, ids=[f"{route[-1].lstrip('-')}-{case[0]}" for case, route in RUNS]
)
def test_hostile_spec_is_refused_cleanly(
    home: Path,
    listener: socket.socket,
    tmp_path: Path,
    case: tuple[str, str, str],
    command: tuple[str, ...],
) -> None:
    name, text, names = case
    _drain(listener)
    spec = tmp_path / "pd.yml"
    spec.write_bytes(text.encode("utf-8", "surrogateescape"))
    before = _tree(home)
    proc = pdctl(
        home,
        command[0],
        str(spec),
        "--fleet",
        "f",
        *command[1:],
        check=False,
        timeout=60,
        env={"HF_TOKEN": "hf_secret_value"},
    )
    assert proc.returncode == 3, (name, proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and 1 <= len(lines) <= 3, proc.stderr
    if name not in PLACEMENT_CASES:  # those name the host and the fields to change instead
        assert re.search(rf"{re.escape(str(spec))}(:\d+)?:", proc.stderr), proc.stderr
    assert names in proc.stderr, (name, proc.stderr)
    assert "hf_secret_value" not in proc.stderr + proc.stdout
    with pytest.raises(BlockingIOError):
        listener.accept()  # no host was contacted
    assert _tree(home) == before  # no service state, no inventory change
    scratch = private_tmp(home)  # pdctl's TMPDIR: nothing left there either
    assert not scratch.exists() or not any(scratch.iterdir())


# Ports are judged per host, after placement: these name the host and the fields instead.
PLACEMENT_CASES = {"worker-ports-past-65535", "metrics-equals-port"}


@pytest.mark.parametrize(
    "value", ["hf_secret_value\r", "hf_secret\r\nvalue", "hf_secret_value\x1b"]
)
def test_a_secret_with_a_control_character_is_refused_at_plan_time_and_never_shown(
    home: Path, listener: socket.socket, tmp_path: Path, value: str
) -> None:
    """A CRLF env file's value would reach an HTTP header (the hub token) and be quoted back
    in an error: refused before any host is contacted, without a word of the value."""
    _drain(listener)
    spec = tmp_path / "pd.yml"
    spec.write_text(BASE)
    for command in (("deploy", "-y"), ("prefetch",)):
        proc = pdctl(
            home,
            command[0],
            str(spec),
            "--fleet",
            "f",
            *command[1:],
            check=False,
            timeout=60,
            env={"HF_TOKEN": value},
        )
        assert proc.returncode == 3, (proc.stdout, proc.stderr)
        assert "env[0]: your environment's HF_TOKEN holds" in proc.stderr, proc.stderr
        assert "hf_secret" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()  # no host was contacted


def test_json_error_names_file_line_and_field(home: Path, tmp_path: Path) -> None:
    spec = tmp_path / "pd.yml"
    spec.write_text(sub("port: 8000\n", "port: 70000\n"))
    proc = pdctl(home, "--json", "deploy", str(spec), "--fleet", "f", "-y", check=False)
    error = json.loads(proc.stdout)["error"]
    assert proc.returncode == 3 and error["kind"] == "invalid_input"
    assert error["details"]["field"] == "port"
    assert error["details"]["line"] == BASE.splitlines().index("port: 8000") + 1
    assert error["details"]["file"] == str(spec)


def test_env_values_keep_their_source_text(home: Path, tmp_path: Path) -> None:
    """YAML 1.1 would make `yes` True, `010` 8, `1.10` 1.1: the worker gets what was written."""
    text = sub(
        "env:\n  - HF_TOKEN\n  - MODEL_ID=org/model\n",
        "env:\n  HF_TOKEN:\n  MODEL_ID: org/model\n  A: yes\n  B: 010\n  C: 1.10\n  D: 0x1F\n"
        '  E: \'{{ lookup("pipe", "id") }}\'\n',
    )
    spec = tmp_path / "pd.yml"
    spec.write_text(text)
    plan = json.loads(
        pdctl(home, "--json", "plan", str(spec), "--fleet", "f", env={"HF_TOKEN": "x"}).stdout
    )["plan"]
    assert plan["env"] == {
        "HF_HOME": "/root/.cache/huggingface",  # the model cache's, for the spec's model
        "HF_HUB_OFFLINE": "1",
        "MODEL_ID": "org/model",
        "A": "yes",
        "B": "010",
        "C": "1.10",
        "D": "0x1F",
        "E": '{{ lookup("pipe", "id") }}',
    }
    assert plan["secret_names"] == ["HF_TOKEN"]


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_plan_file_marks_every_string_unsafe(home: Path, tmp_path: Path) -> None:
    """`pdctl plan -o` writes what a pipeline's ansible-playbook loads (`-e @plan.yml`):
    loaded as Ansible loads extra-vars, no string in it may be trusted as a template."""
    spec = tmp_path / "pd.yml"
    hostile = "  - \"X={{ lookup('pipe', 'id') }}\"\n  - N=3\n  - B=yes\n  - E=\n  - T=~\n"
    spec.write_text(sub("  - MODEL_ID=org/model\n", "  - MODEL_ID=org/model\n" + hostile))
    out = tmp_path / "plan.yml"
    pdctl(home, "plan", str(spec), "--fleet", "f", "-o", str(out), env={"HF_TOKEN": "x"})
    loaded = DataLoader().load_from_file(str(out), trusted_as_template=True)
    assert loaded["pd_env"] == {  # every value still the text it was, no YAML retyping
        "HF_HOME": "/root/.cache/huggingface",  # the model cache's, for the spec's model
        "HF_HUB_OFFLINE": "1",
        "MODEL_ID": "org/model",
        "X": "{{ lookup('pipe', 'id') }}",
        "N": "3",
        "B": "yes",
        "E": "",
        "T": "~",
    }
    values = [v for name, value in loaded.items() for v in _strings(value)]
    assert len(values) > 20
    assert not [v for v in values if is_trusted_as_template(v)]
