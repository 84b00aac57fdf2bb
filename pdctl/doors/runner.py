"""The one place pdctl starts Ansible (through ansible-runner).

A private data dir per run (0700, removed afterwards), the project's
ansible.cfg, events turned into per-host progress and a summary, Ctrl-C
turned into a clean cancel. Extra-vars reach Ansible as a file in that private dir,
every string tagged !unsafe (pdctl/core/ansible_data.py): never on ansible-playbook's
command line, never rendered as a template. No output, event or fact cache is kept on disk
(ansible-runner's callback hands each event over in a file removed once read).

No secret touches the disk, even if pdctl is killed: ansible-playbook's environment is an
allowlist (pdctl's and ansible-runner's settings, and of the operator's only PATH, HOME, the
locale, TERM, USER, LOGNAME, TMPDIR, SSH_AUTH_SOCK, PYTHONPATH and ANSIBLE_*), since
ansible-runner writes that environment to the private dir (artifacts/<ident>/command). The
secrets a run needs go to pdctl/doors/exec_with_secrets.py through the pty ansible-runner already
drives, answered from memory (ansible-runner's `passwords`), and it starts ansible-playbook
with them in its environment, where the roles read them as in a plain run
(`lookup('ansible.builtin.env', NAME)`). If pdctl is killed, its ansible-playbook stops with
it (the launcher asks for SIGTERM on its parent's death) and the next run removes the private
dir left behind (no secret in it, but the plan's extra-vars).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from types import FrameType
from typing import TYPE_CHECKING, Any

from pdctl.core.ansible_data import unsafe_yaml
from pdctl.core.errors import EnvironmentProblem, InputError, Interrupted
from pdctl.doors.content import content_root, playbook

if TYPE_CHECKING:
    from ansible_runner import RunnerConfig

Progress = Callable[[str], None]
_RESULT_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipped",
}


@dataclass
class TaskResult:
    host: str
    task: str
    action: str
    status: str  # ok | failed | unreachable | skipped
    changed: bool
    ignored: bool
    res: dict[str, Any]

    @property
    def message(self) -> str:
        # A loop's failure says only "One or more items failed": the first failed item says why.
        for item in self.res.get("results") or []:
            if isinstance(item, dict) and item.get("failed"):
                return str(item.get("msg") or item.get("stderr") or "").strip()
        return str(self.res.get("msg") or self.res.get("stderr") or "").strip()


@dataclass
class RunSummary:
    rc: int
    status: str
    results: list[TaskResult] = field(default_factory=list)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)

    def unreachable(self) -> dict[str, str]:
        return {r.host: r.message for r in self.results if r.status == "unreachable"}

    def failures(self) -> dict[str, TaskResult]:
        """The first unignored failure per host."""
        found: dict[str, TaskResult] = {}
        for result in self.results:
            if result.status == "failed" and not result.ignored and result.host not in found:
                found[result.host] = result
        return found

    def changed_hosts(self) -> list[str]:
        return sorted({r.host for r in self.results if r.changed})


STRATEGY_VARIABLE = "PDCTL_ANSIBLE_STRATEGY"
# Mitogen pays a start-up per host (an interpreter, and its code sent over) that a playbook
# of a few tasks does not win back: on 16 lab hosts `fleet check` took 24 s under Mitogen
# and 12-14 s under linear. The long playbooks (deploy, destroy) run under Mitogen.
_LINEAR_PLAYBOOKS = frozenset({"preflight.yml"})


def strategy_env(playbook_name: str) -> dict[str, str]:
    """The Ansible strategy for one of pdctl's runs: PDCTL_ANSIBLE_STRATEGY, auto by default.

    Ansible ships every module to a host as a zip that a fresh python3 unpacks and compiles;
    Mitogen keeps one interpreter per host and caches the code in it. Measured on a 16-host
    lab: a first deploy 201 s -> 97 s, a no-op redeploy 285 s -> 105 s. Plain
    `ansible-playbook` with the project's ansible.cfg runs pd_linear, Ansible's linear strategy
    with each worker forked from a frozen heap (playbooks/strategy_plugins/pd_linear.py); it
    does not name Mitogen's, whose path depends on where Mitogen is installed.
    """
    chosen = os.environ.get(STRATEGY_VARIABLE, "auto")
    if chosen == "auto":
        chosen = "linear" if playbook_name in _LINEAR_PLAYBOOKS else "mitogen"
    if chosen == "linear":
        return {"ANSIBLE_STRATEGY": "pd_linear"}
    if chosen != "mitogen":
        raise InputError(
            f"{STRATEGY_VARIABLE}={chosen!r} is not a strategy pdctl knows",
            hint=f"set {STRATEGY_VARIABLE} to auto (the default), mitogen or linear",
        )
    spec = importlib.util.find_spec("ansible_mitogen")
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentProblem(
            "Mitogen (package mitogen) is not installed beside pdctl",
            hint=f"pip install pdctl's dependencies again, or set {STRATEGY_VARIABLE}=linear",
        )
    plugins = Path(next(iter(spec.submodule_search_locations))) / "plugins" / "strategy"
    # Mitogen's strategies and pdctl's (pd_mitogen_linear: Mitogen's over pd_linear).
    path = os.pathsep.join([str(plugins), str(playbook("strategy_plugins"))])
    return {"ANSIBLE_STRATEGY_PLUGINS": path, "ANSIBLE_STRATEGY": "pd_mitogen_linear"}


def _env(playbook_name: str, verbosity: int) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # ansible-playbook lives beside our python
    env = {
        "ANSIBLE_CONFIG": str(content_root() / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(content_root() / "roles"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        # ansible-runner sets ANSIBLE_HOST_KEY_CHECKING=False unless told otherwise; Mitogen
        # would then accept any host key (Ansible's ssh plugin is saved by the inventory's
        # StrictHostKeyChecking=yes). The fleet's pinned keys must hold under both.
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        **strategy_env(playbook_name),
    }
    if verbosity > 1:
        env["ANSIBLE_VERBOSITY"] = str(verbosity - 1)
    return env


# What ansible-playbook may see of the operator's environment (besides what pdctl and
# ansible-runner set): ansible-runner writes the child's whole environment to the private dir,
# and an operator's shell holds secrets of its own (cloud keys...).
_OPERATOR_NAMES = frozenset(
    {"PATH", "HOME", "LANG", "TERM", "USER", "LOGNAME", "TMPDIR", "SSH_AUTH_SOCK", "PYTHONPATH"}
)
_OPERATOR_PREFIXES = ("LC_", "ANSIBLE_")
_EXEC_WITH_SECRETS = Path(__file__).with_name("exec_with_secrets.py")


def child_env(
    prepared: Mapping[str, str], operator: Mapping[str, str], secret_names: Collection[str]
) -> dict[str, str]:
    """ansible-playbook's environment, from the one ansible-runner prepared.

    ansible-runner starts from a copy of the operator's whole environment; a value that differs
    from the operator's was set by pdctl or ansible-runner (its callback's settings). Of the
    rest only the allowlist stays (PYTHONPATH: how this Python may find ansible). Secrets are
    never in it, whatever their name: exec_with_secrets.py adds them after the artifact is
    written.
    """
    return {
        name: value
        for name, value in prepared.items()
        if name not in secret_names
        and (
            operator.get(name) != value
            or name in _OPERATOR_NAMES
            or name.startswith(_OPERATOR_PREFIXES)
        )
    }


def _runs_parent() -> Path:
    """The directory of this user's runs: $TMPDIR/pdctl-runs-<uid>, 0700, ours."""
    parent = Path(tempfile.gettempdir()) / f"pdctl-runs-{os.getuid()}"
    with suppress(FileExistsError):
        parent.mkdir(mode=0o700)
    found = parent.lstat()  # in a shared /tmp anyone may have made it first, or a symlink
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise EnvironmentProblem(
            f"{parent} is not a directory only this user can use",
            hint="remove it, or point TMPDIR at a private directory",
        )
    return parent


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove_dead_runs(parent: Path) -> None:
    """Remove the private dirs (<pid>-<random>) of runs whose pdctl was killed mid-run."""
    for entry in parent.iterdir():
        pid = entry.name.partition("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


@contextmanager
def _private_dir() -> Iterator[Path]:
    parent = _runs_parent()
    _remove_dead_runs(parent)
    private = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=parent))
    try:
        yield private
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _configure(config: RunnerConfig, secrets: Collection[str], prompt: str) -> None:
    """Prepare ``config`` to start ansible-playbook with the allowlisted environment, through
    exec_with_secrets.py, whose ``prompt`` config.passwords answers."""
    config.prepare()
    # prepare() reads this from env/settings only, dropping what the constructor was given.
    config.suppress_output_file = True
    # By its full path: a secret may be named PATH, and is then absent until the exec.
    program, *args = config.command
    program = shutil.which(program, path=config.env.get("PATH")) or program
    config.env = child_env(config.env, os.environ, secrets)
    config.command = [sys.executable, "-I", str(_EXEC_WITH_SECRETS), prompt, program, *args]


@contextmanager
def _cancel_on_interrupt() -> Iterator[threading.Event]:
    """Ctrl-C asks ansible-runner to stop ansible-playbook instead of killing pdctl mid-run."""
    cancelled = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield cancelled
        return

    def handler(_signum: int, _frame: FrameType | None) -> None:
        cancelled.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield cancelled
    finally:
        signal.signal(signal.SIGINT, previous)


def run_playbook(
    name: str,
    inventory: Path,
    *,
    extravars: dict[str, Any] | None = None,
    secrets: Mapping[str, str] | None = None,
    limit: str | None = None,
    forks: int | None = None,
    check: bool = False,
    diff: bool = False,
    progress: Progress | None = None,
    verbosity: int = 0,
    playbooks: Path | None = None,
) -> RunSummary:
    """Run playbook ``name`` (from pdctl's playbooks, or the directory ``playbooks``).

    ``secrets`` (name -> value) reach ansible-playbook's environment and nothing else: no file,
    no argv, no ansible-runner artifact.
    """
    results: list[TaskResult] = []
    stats: dict[str, dict[str, int]] = {}

    def on_event(event: dict[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        if kind in _RESULT_EVENTS:
            res = data.get("res") or {}
            result = TaskResult(
                host=data.get("host", ""),
                task=data.get("task", ""),
                action=data.get("resolved_action") or data.get("task_action", ""),
                status=_RESULT_EVENTS[kind],
                changed=bool(res.get("changed")),
                ignored=bool(data.get("ignore_errors")),
                res=res,
            )
            results.append(result)
            if progress and result.status in {"failed", "unreachable"} and not result.ignored:
                progress(f"{result.host}: {result.task}: {result.status}")
        elif kind == "playbook_on_task_start" and progress:
            progress(data.get("task", ""))
        elif kind == "playbook_on_stats":
            for counter in ("ok", "changed", "failures", "dark", "skipped"):
                for host, count in (data.get(counter) or {}).items():
                    stats.setdefault(host, {})[counter] = count
        return False  # nothing is written to disk: events may carry host data

    from ansible_runner import Runner, RunnerConfig  # noqa: PLC0415 - heavy; scaler hosts lack it

    secrets = secrets or {}
    cmdline = " ".join(flag for flag, on in (("--check", check), ("--diff", diff)) if on)
    # Random, so no output of a host can match it and have the secrets sent again.
    prompt = f"pdctl: secrets for this run {token_hex(16)}"
    with _private_dir() as private, _cancel_on_interrupt() as cancelled:
        if extravars:
            # Given as a dict, ansible-runner would put the extra-vars on the command line
            # (visible in ps, and templated by Ansible); env/extravars is read as a file.
            (private / "env").mkdir(mode=0o700)
            (private / "env" / "extravars").write_text(unsafe_yaml(extravars))
        config = RunnerConfig(
            private_data_dir=str(private),
            playbook=str(playbook(name) if playbooks is None else playbooks.resolve() / name),
            inventory=str(inventory),
            limit=limit,
            forks=forks,
            cmdline=cmdline or None,
            envvars=_env(name, verbosity),
            # Only in memory: ansible-runner's run() would have written them to env/passwords.
            passwords={re.escape(prompt): json.dumps(dict(secrets))},
            # A jsonfile cache in the private dir would hold the facts; memory serves one run.
            fact_cache_type="memory",
            quiet=verbosity < 2,
        )
        _configure(config, secrets, prompt)
        runner = Runner(config=config, event_handler=on_event, cancel_callback=cancelled.is_set)
        runner.run()
        if cancelled.is_set():
            raise Interrupted(
                f"{name} was cancelled", hint="re-run it; pdctl's playbooks are idempotent"
            )
    return RunSummary(
        rc=int(runner.rc or 0), status=str(runner.status), results=results, stats=stats
    )
