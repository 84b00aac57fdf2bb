"""The worker entrypoint script, run for real by /bin/sh against stub programs.

The stubs (python, python3, bash, pip) print what they received: argv, pid, parent pid,
working directory and a few environment variables. So the tests check what the server
would get, not the script's text.
"""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from pdctl.core.entrypoint import worker_script
from pdctl.core.shell import CommandError, shell_words

REPO = Path(__file__).resolve().parents[3]
LAUNCH = "python -m sglang.launch_server"
PORT, HOST, BOOTSTRAP = "31000", "10.1.2.3", "32000"
Role = Literal["prefill", "decode"]
ROLES: list[Role] = ["prefill", "decode"]

STUB = """#!/bin/sh
echo "prog ${0##*/}"
echo "pid $$"
echo "ppid $PPID"
echo "cwd $PWD"
echo "env FOO=${FOO-<unset>}"
echo "env BAR=${BAR-<unset>}"
echo "env SETUP=${SETUP-<unset>}"
for arg in "$@"; do printf 'arg %s\\n' "$arg"; done
"""


@dataclass
class Call:
    prog: str
    pid: int = 0
    ppid: int = 0
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)


@dataclass
class Run:
    script: str
    calls: list[Call]
    lines: list[str]  # stdout lines that no stub printed (the commands' own output)

    @property
    def server(self) -> Call:
        return self.calls[-1]


def stubs(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "python3", "bash", "pip"):
        stub = bin_dir / name
        stub.write_text(STUB)
        stub.chmod(0o755)
    return bin_dir


def parse_output(stdout: str) -> tuple[list[Call], list[str]]:
    calls: list[Call] = []
    lines: list[str] = []
    for line in stdout.splitlines():
        key, _, rest = line.partition(" ")
        if key == "prog":
            calls.append(Call(rest))
        elif calls and key in ("pid", "ppid"):
            setattr(calls[-1], key, int(rest))
        elif calls and key == "cwd":
            calls[-1].cwd = rest
        elif calls and key == "env":
            name, _, value = rest.partition("=")
            calls[-1].env[name] = value
        elif calls and key == "arg":
            calls[-1].argv.append(rest)
        else:
            lines.append(line)
    return calls, lines


def run_script(tmp_path: Path, script: str) -> Run:
    path = tmp_path / "entrypoint.sh"
    path.write_text(script)
    checked = subprocess.run(
        ["/bin/sh", "-n", str(path)], check=False, capture_output=True, text=True
    )
    assert checked.returncode == 0, (script, checked.stderr)
    proc = subprocess.run(
        ["/bin/sh", str(path)],
        check=False,
        cwd=tmp_path,
        env={
            "PATH": f"{stubs(tmp_path)}:/usr/bin:/bin",
            "PDCTL_PORT": PORT,
            "PDCTL_HOST": HOST,
            "PDCTL_BOOTSTRAP_PORT": BOOTSTRAP,
            "MODEL_ID": "org/model",
        },
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, (script, proc.stderr)
    calls, lines = parse_output(proc.stdout)
    assert calls, (script, proc.stdout, proc.stderr)
    return Run(script, calls, lines)


def run(tmp_path: Path, commands: list[str], role: Role = "decode") -> Run:
    return run_script(tmp_path, worker_script(commands, role))


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values the server's argparse would see for `flag` (both spellings)."""
    values: list[str] = []
    for i, arg in enumerate(argv):
        if arg == flag:
            values.append(argv[i + 1] if i + 1 < len(argv) else "<none>")
        elif arg.startswith(flag + "="):
            values.append(arg.partition("=")[2])
    return values


def group_commands(path: str, index: int) -> list[str]:
    doc = yaml.safe_load((REPO / path).read_text())
    commands: list[str] = doc["replicas"][index]["commands"]
    return commands


def refused(commands: list[str], role: Role = "decode") -> CommandError:
    with pytest.raises(CommandError) as caught:
        worker_script(commands, role)
    return caught.value


# --- the service files people bring -------------------------------------------------------


def test_dstack_prefill_gets_the_slot_ports(tmp_path: Path) -> None:
    result = run(tmp_path, group_commands("tests/data/dstack-pd.yml", 0), "prefill")
    assert result.server.prog == "python"
    assert result.server.argv == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "org/model",
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        "mooncake",
        "--host",
        "0.0.0.0",
        "--port",
        PORT,
        "--disaggregation-bootstrap-port",
        BOOTSTRAP,
    ]
    assert result.script.startswith("set -e\nexec python -m sglang.launch_server \\\n")


def test_dstack_decode_gets_the_slot_port_and_no_bootstrap_port(tmp_path: Path) -> None:
    result = run(tmp_path, group_commands("tests/data/dstack-pd.yml", 1), "decode")
    argv = result.server.argv
    assert argv[:4] == ["-m", "sglang.launch_server", "--model-path", "org/model"]
    assert flag_values(argv, "--port") == [PORT]
    assert flag_values(argv, "--host") == ["0.0.0.0"]
    assert not any("bootstrap" in arg for arg in argv)


def test_amd_example_groups(tmp_path: Path) -> None:
    prefill = run(tmp_path, group_commands("examples/pd-amd-mi300x.yml", 1), "prefill").server
    assert prefill.prog == "python3"
    assert prefill.argv[-9:] == [
        "--tp",
        "4",
        "--trust-remote-code",
        "--host",
        "0.0.0.0",
        "--port",
        PORT,
        "--disaggregation-bootstrap-port",
        BOOTSTRAP,
    ]
    assert "bnxt_re0,bnxt_re1,bnxt_re2,bnxt_re3" in prefill.argv
    decode = run(tmp_path, group_commands("examples/pd-amd-mi300x.yml", 2), "decode").server
    assert decode.argv[-6:] == ["4", "--trust-remote-code", "--host", "0.0.0.0", "--port", PORT]


def test_router_group_only_gets_exec() -> None:
    script = worker_script(group_commands("examples/pd-amd-mi300x.yml", 0), "decode")
    assert script.splitlines() == [
        "set -e",
        "pip install smg",
        "exec smg launch --host 0.0.0.0 --port 30000 --pd-disaggregation "
        "--prefill-policy cache_aware --decode-policy least_load",
    ]


def test_the_script_is_a_fixed_point() -> None:
    script = worker_script(group_commands("tests/data/dstack-pd.yml", 0), "prefill")
    assert worker_script([script.removeprefix("set -e\n")], "prefill") == script


# --- the launch command's flags -----------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "port_args"),
    [
        ("--port 8000", ["--port", PORT]),
        ("--port=8000", [f"--port={PORT}"]),
        ('"--port" "8000"', ["--port", PORT]),
        ("--port $(echo 8000)", ["--port", PORT]),
        ("--por 8000", ["--por", PORT]),  # argparse takes unambiguous prefixes
        ("", ["--port", PORT]),
    ],
)
def test_port_is_the_slot_port(tmp_path: Path, flags: str, port_args: list[str]) -> None:
    argv = run(tmp_path, [f"{LAUNCH} --model-path $MODEL_ID {flags}"]).server.argv
    assert argv == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "org/model",
        *port_args,
        "--host",
        HOST,
    ]


def test_host_is_kept_when_given(tmp_path: Path) -> None:
    argv = run(tmp_path, [f"{LAUNCH} --host 0.0.0.0"]).server.argv
    assert argv == ["-m", "sglang.launch_server", "--host", "0.0.0.0", "--port", PORT]
    argv = run(tmp_path, [f"{LAUNCH} --host=::"]).server.argv
    assert argv == ["-m", "sglang.launch_server", "--host=::", "--port", PORT]


def test_hostname_is_not_a_host(tmp_path: Path) -> None:
    argv = run(tmp_path, [f"{LAUNCH} --hostname x"]).server.argv
    assert argv == ["-m", "sglang.launch_server", "--hostname", "x", "--port", PORT, "--host", HOST]


def test_missing_flags_are_appended(tmp_path: Path) -> None:
    argv = run(tmp_path, [LAUNCH], "prefill").server.argv
    assert argv == [
        "-m",
        "sglang.launch_server",
        "--port",
        PORT,
        "--host",
        HOST,
        "--disaggregation-bootstrap-port",
        BOOTSTRAP,
    ]


def test_bootstrap_port_is_replaced_for_prefill(tmp_path: Path) -> None:
    command = f"{LAUNCH} --disaggregation-bootstrap-port=8998 --port 1 --host h"
    argv = run(tmp_path, [command], "prefill").server.argv
    assert flag_values(argv, "--disaggregation-bootstrap-port") == [BOOTSTRAP]
    assert flag_values(run(tmp_path, [command], "decode").server.argv, "--port") == [PORT]


def test_a_trailing_comment_does_not_swallow_the_flags(tmp_path: Path) -> None:
    result = run(tmp_path, [f"{LAUNCH} --model-path $MODEL_ID  # the model, --port 1"])
    assert result.server.argv == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "org/model",
        "--port",
        PORT,
        "--host",
        HOST,
    ]
    assert result.script.endswith("--host $PDCTL_HOST  # the model, --port 1\n")


def test_a_block_with_a_comment_and_a_trailing_continuation(tmp_path: Path) -> None:
    block = f"{LAUNCH} \\\n  --model-path $MODEL_ID \\\n  --tp 2  # two GPUs \\\n"
    argv = run(tmp_path, [block]).server.argv
    assert argv[-6:] == ["--tp", "2", "--port", PORT, "--host", HOST]
    block = f"{LAUNCH} \\\n  --model-path $MODEL_ID \\\n"
    script = worker_script([block], "decode")
    assert script.endswith("$MODEL_ID --port $PDCTL_PORT --host $PDCTL_HOST\n")
    assert run_script(tmp_path, script).server.argv[-4:] == ["--port", PORT, "--host", HOST]


def test_a_quoted_json_argument_is_left_alone(tmp_path: Path) -> None:
    json = '{"--port": 1, "--host": "x", "a b": "$MODEL_ID"}'
    command = f"{LAUNCH} --json-model-override-args '{json}' --port 8000"
    argv = run(tmp_path, [command]).server.argv
    assert argv == [
        "-m",
        "sglang.launch_server",
        "--json-model-override-args",
        json,
        "--port",
        PORT,
        "--host",
        HOST,
    ]


def test_quoting_and_variables_stay_as_written(tmp_path: Path) -> None:
    command = f'{LAUNCH} --model-path "$MODEL_ID" --served-model-name "a b"\\ c --port 1'
    script = worker_script([command], "decode")
    assert '--model-path "$MODEL_ID" --served-model-name "a b"\\ c --port $PDCTL_PORT' in script
    argv = run_script(tmp_path, script).server.argv
    assert argv[2:6] == ["--model-path", "org/model", "--served-model-name", "a b c"]


# --- exec ---------------------------------------------------------------------------------


def test_the_server_replaces_the_shell(tmp_path: Path) -> None:
    result = run(tmp_path, ['echo "shell $$"', f"{LAUNCH} --port 1"])
    assert result.lines == [f"shell {result.server.pid}"]
    assert result.server.ppid == os.getpid()


def test_leading_assignments_reach_the_server(tmp_path: Path) -> None:
    # POSIX: assignments before the special builtin exec are exported to the program it
    # runs; checked here with the real /bin/sh (dash on Debian).
    result = run(tmp_path, ['echo "shell $$"', f"FOO=1 BAR='a b' {LAUNCH}"])
    assert f"FOO=1 BAR='a b' exec {LAUNCH}" in result.script
    assert result.server.env["FOO"] == "1" and result.server.env["BAR"] == "a b"
    assert result.lines == [f"shell {result.server.pid}"]


def test_exec_already_there_is_kept(tmp_path: Path) -> None:
    script = worker_script(["exec python3 -m sglang.launch_server --port 1"], "decode")
    assert script == (
        "set -e\nexec python3 -m sglang.launch_server --port $PDCTL_PORT --host $PDCTL_HOST\n"
    )
    script = worker_script([f"FOO=2 exec {LAUNCH}"], "decode")
    assert script.startswith(f"set -e\nFOO=2 exec {LAUNCH} --port")
    assert run_script(tmp_path, script).server.env["FOO"] == "2"


def test_a_custom_entrypoint_is_execed_unchanged(tmp_path: Path) -> None:
    result = run(tmp_path, ['echo "shell $$"', "bash /start.sh --port 8000"])
    assert result.script == 'set -e\necho "shell $$"\nexec bash /start.sh --port 8000\n'
    assert result.server.prog == "bash"
    assert result.server.argv == ["/start.sh", "--port", "8000"]
    assert result.lines == [f"shell {result.server.pid}"]


def test_setup_commands_run_first(tmp_path: Path) -> None:
    commands = [
        "pip install smg",
        "export SETUP=done",
        "mkdir -p work",
        "cd work  # the model's scratch space",
        f"{LAUNCH} --port 8000",
    ]
    result = run(tmp_path, commands)
    assert [call.prog for call in result.calls] == ["pip", "python"]
    assert result.calls[0].argv == ["install", "smg"]
    assert result.server.env["SETUP"] == "done"
    assert result.server.cwd == str(tmp_path / "work")


def test_compound_setup_commands_are_kept(tmp_path: Path) -> None:
    commands = [
        'if [ -n "$MODEL_ID" ]; then echo "model $MODEL_ID"; else exit 1; fi',
        'for i in 1 2; do echo "i $i"; done',
        'case "$MODEL_ID" in\n  org/*) echo org ;;\n  *) echo other ;;\nesac',
        "cat > note.txt <<'EOF'\nport $PDCTL_PORT 'quote\nEOF",
        'x=$(case a in a) echo y;; esac) && echo "x $x" ${UNSET:-\'}\'} "$((1 + (2)))"',
        "f() { echo f; }; f",
        "true \\\n  # a comment ending in a backslash \\",
        "",
        "# only a comment",
        f"{LAUNCH}",
    ]
    result = run(tmp_path, commands)
    assert result.lines == ["model org/model", "i 1", "i 2", "org", "x y } 3", "f"]
    assert (tmp_path / "note.txt").read_text() == "port $PDCTL_PORT 'quote\n"
    assert result.server.argv == ["-m", "sglang.launch_server", "--port", PORT, "--host", HOST]


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "found"),
    [
        (f"cd d && {LAUNCH}", "`&&`"),
        (f"{LAUNCH} || true", "`||`"),
        (f"{LAUNCH}; echo done", "`;`"),
        (f"{LAUNCH} &", "`&`"),
        (f"{LAUNCH} 2>&1 | tee log", "`|`"),
        (f"{LAUNCH} > log", "`>`"),
        (f"{LAUNCH}\n--port 1", "a line break"),
        (f"{LAUNCH} \\\n  --tp 2  # two GPUs \\\n  --port 1", "a line break"),
        (f"if true; then {LAUNCH}; fi", "`if`"),
        (f"( {LAUNCH} )", "`(`"),
    ],
)
def test_the_launch_must_be_a_plain_command(command: str, found: str) -> None:
    error = refused(["pip install x", command])
    assert error.index == 1
    assert "plain command" in error.problem and found in error.problem
    if "&&" in command:
        assert "`cd DIR`" in error.hint


def test_the_launch_must_be_last() -> None:
    error = refused([f"{LAUNCH} --port 1", "echo done"])
    assert error.index == 0 and "last command" in error.problem and "SIGTERM" in error.hint


def test_one_launch_per_group() -> None:
    error = refused([LAUNCH, "true", f"exec {LAUNCH}"])
    assert error.index == 2 and "second" in error.problem


@pytest.mark.parametrize(
    "command",
    [
        "if true; then bash x; fi",
        "bash a && bash b",
        "bash a || bash b",
        "bash a | bash b",
        "bash a; bash b",
        "bash a\nbash b",
        "bash a &",
        "! bash a",
        "(bash a)",
        "{ bash a; }",
        "for i in 1; do bash a; done",
        "while false; do :; done",
        "case x in x) bash a ;; esac",
    ],
)
def test_the_last_command_must_be_plain(command: str) -> None:
    error = refused(["true", command])
    assert error.index == 1 and "plain command" in error.problem and "exec" in error.problem
    assert "last command, on its own" in error.hint


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("cd /srv", "builtin `cd`"),
        ("export A=1", "builtin `export`"),
        ("A=1 B=2", "only sets variables"),
        ("", "empty"),
        ("# done", "empty"),
        ("exec", "without a program"),
    ],
)
def test_the_last_command_must_run_a_program(command: str, problem: str) -> None:
    error = refused(["true", command])
    assert error.index == 1 and problem in error.problem


def test_exec_before_the_last_command_is_refused() -> None:
    error = refused(["exec bash /x", LAUNCH])
    assert error.index == 0 and "never run" in error.problem
    worker_script(["exec >/dev/null 2>&1", LAUNCH], "decode")  # redirects the shell: fine


@pytest.mark.parametrize(
    ("command", "what"),
    [
        ("echo 'a", "`'` quote"),
        ('echo "a', '`"` quote'),
        ('echo "a\\"', '`"` quote'),
        ("echo `a", "backquote"),
        ("echo $(a", "`$(`"),
        ('echo $(echo ")"', "`$(`"),
        ("echo ${a", "`${`"),
        ("echo $((1", "`$((`"),
        ("cat <<EOF\nx\n", "here-document"),
        ("cat <<EOF", "here-document"),
        (f"{LAUNCH} --model-path '$MODEL_ID", "`'` quote"),
    ],
)
def test_unterminated_quotes_are_refused(command: str, what: str) -> None:
    error = refused(["true", command, "bash x"])
    assert error.index == 1 and what in error.problem and "never closed" in error.problem


@pytest.mark.parametrize(
    "command",
    [
        "pip install x &&",
        "pip install x |",
        "echo a \\",
        "if true; then",
        "while true; do",
        "{ echo a",
        "(echo a",
        "echo a)",
        "fi",
        "; echo a",
        "echo a && ; echo b",
        "case x in",
        "f()",
    ],
)
def test_incomplete_commands_are_refused(command: str) -> None:
    # Joined as lines, these would change how the next command parses.
    error = refused([command, "bash x"])
    assert error.index == 0


@pytest.mark.parametrize(
    ("char", "name"),
    [
        ("\r", "carriage return (U+000D)"),
        ("\0", "NUL byte (U+0000)"),
        ("\x1b", "escape character (U+001B)"),
        ("\x07", "control character (U+0007)"),
        ("\x7f", "delete character (U+007F)"),
        ("\u00a0", "no-break space (U+00A0)"),
        ("\u200b", "zero width space (U+200B)"),
        ("\u2028", "line separator (U+2028)"),
    ],
)
def test_control_characters_are_refused(char: str, name: str) -> None:
    error = refused(["true", f"{LAUNCH} \\\n --tp 2{char} --port 1"])
    assert error.index == 1 and name in error.problem and "line 2" in error.problem


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        ("--port", "--port"),
        ("--port --tp 4", "--port"),
        ("--host", "--host"),
        ("--port 1 --disaggregation-bootstrap-port", "--disaggregation-bootstrap-port"),
    ],
)
def test_a_flag_without_value_is_refused(flags: str, flag: str) -> None:
    error = refused([f"{LAUNCH} {flags}"], "prefill")
    assert error.index == 0 and error.problem == f"`{flag}` has no value"


@pytest.mark.parametrize(
    "command",
    [
        "bash -c 'python -m sglang.launch_server --port 8000'",
        'CMD="python -m sglang.launch_server"',
        "cat > run.sh <<EOF\npython -m sglang.launch_server --port 8000\nEOF",
        "echo $(python -m sglang.launch_server)",
    ],
)
def test_a_hidden_launch_is_refused(command: str) -> None:
    # pdctl could not give it the slot's ports.
    error = refused([command, "bash run.sh"])
    assert error.index == 0 and "launch_server" in error.problem


def test_no_commands_is_refused() -> None:
    error = refused([])
    assert error.index is None and str(error).startswith("commands: ")


def test_error_text() -> None:
    error = refused(["true", "echo 'a"])
    assert str(error) == f"commands[1]: {error.problem} ({error.hint})"
    assert isinstance(error, ValueError)


# --- the scanner --------------------------------------------------------------------------


def test_shell_words_values_and_spans() -> None:
    command = 'a \'b c\' "d\\"e\\q" f\\ g $(echo ")") ${X:-"}"}x `x y` h\\\ni 2>&1 #c \'d\nj#k'
    words = shell_words(command)
    assert [w.value for w in words] == [
        "a",
        "b c",
        'd"e\\q',
        "f g",
        '$(echo ")")',
        '${X:-"}"}x',
        "`x y`",
        "hi",
        "1",  # the target of >&
        "j#k",
    ]
    assert all(command[w.start : w.end] == w.text for w in words)


_PIECES = [
    "a",
    "-x",
    "#",
    "=",
    "{",
    "}",
    "'s p;|&'",
    "'\"'",
    "''",
    '"d q"',
    '"\\"x\\$y\\\\z\\q"',
    '"a\'b"',
    '""',
    "\\;",
    "\\ ",
    "\\'",
    '\\"',
    "\\\\",
    "\\\n",
    "'$x'",
    '"line\nbreak"',
]


def test_shell_words_agree_with_sh() -> None:
    rng = random.Random(20260101)
    for _ in range(150):
        words = [
            "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 5))
        ]
        command = "printf '%s\\0' " + " ".join(words)
        proc = subprocess.run(
            ["/bin/sh", "-c", command], check=False, capture_output=True, text=True
        )
        if proc.returncode != 0:  # a comment left a quote open
            with pytest.raises(CommandError):
                shell_words(command)
            continue
        values = [w.value for w in shell_words(command)][2:]
        assert values == (proc.stdout.split("\0")[:-1] if values else []), command


_TAILS = [
    "--port",
    "--port=8000",
    "8000",
    "--host",
    "0.0.0.0",
    "--hostname",
    "--disaggregation-bootstrap-port",
    "8998",
    "'{\"--port\": 1}'",
    '"--port"',
    "'--port=1'",
    "--tp",
    "4",
    "$MODEL_ID",
    "'",
    '"',
    "#",
    "# c",
    "\\\n",
    "\n",
    ";",
    "&&",
    "|",
    "&",
    ">",
    "$(echo 7)",
    "`echo 7`",
    "(",
    ")",
    "\\",
]


def test_a_random_launch_is_refused_or_gets_the_slot_ports(tmp_path: Path) -> None:
    """Whatever the launch command's tail, the server gets the slot's ports, or pdctl
    refuses the command: never a script that silently does something else."""
    rng = random.Random(7)
    accepted = 0
    for _ in range(120):
        tail = [rng.choice(_TAILS) for _ in range(rng.randint(0, 6))]
        command = LAUNCH + " " + " ".join(tail)
        role = rng.choice(ROLES)
        try:
            script = worker_script(["true", command], role)
        except CommandError:
            continue
        accepted += 1
        server = run_script(tmp_path, script).server
        assert server.prog == "python", script
        assert set(flag_values(server.argv, "--port")) == {PORT}, script
        assert flag_values(server.argv, "--host"), script
        if role == "prefill":
            assert set(flag_values(server.argv, "--disaggregation-bootstrap-port")) == {BOOTSTRAP}
    assert accepted > 20


_SHELL_TOKENS = [
    "echo", "a", ";", "&&", "||", "|", "&", "\n", "if", "then", "else", "elif", "fi", "while",
    "until", "do", "done", "for", "i", "in", "case", "esac", "(", ")", ";;", "{", "}", "!",
    ">", "<", "2>&1", "<<EOF", "\nEOF\n", "'q'", '"d"', "$(", "`", "${x}", "#c", "\\\n", "f()",
    "x=1", "true",
]  # fmt: skip


def test_an_accepted_setup_command_keeps_the_script_valid(tmp_path: Path) -> None:
    """Any command that pdctl accepts leaves a script that sh can parse."""
    rng = random.Random(11)
    path = tmp_path / "entrypoint.sh"
    accepted = 0
    for _ in range(400):
        command = " ".join(rng.choice(_SHELL_TOKENS) for _ in range(rng.randint(1, 9)))
        try:
            path.write_text(worker_script([command, "bash x"], "decode"))
        except CommandError:
            continue
        accepted += 1
        checked = subprocess.run(["/bin/sh", "-n", str(path)], check=False, capture_output=True)
        assert checked.returncode == 0, command
    assert accepted > 50
