"""The one place pdctl starts Ansible (through ansible-runner).

A private data dir per run (0700, removed afterwards), the project's
ansible.cfg, events turned into per-host progress and a summary, Ctrl-C
turned into a clean cancel. Extra-vars reach Ansible as a file in that private dir,
every string tagged !unsafe (pdctl/ansible_data.py): never on ansible-playbook's
command line, never rendered as a template. No event is written to disk.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from pdctl.ansible_data import unsafe_yaml
from pdctl.content import content_root, playbook
from pdctl.errors import EnvironmentProblem, InputError, Interrupted

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
    `ansible-playbook` with the project's ansible.cfg keeps Ansible's own linear strategy
    (the plugin's path depends on where Mitogen is installed).
    """
    chosen = os.environ.get(STRATEGY_VARIABLE, "auto")
    if chosen == "auto":
        chosen = "linear" if playbook_name in _LINEAR_PLAYBOOKS else "mitogen"
    if chosen == "linear":
        return {"ANSIBLE_STRATEGY": "linear"}
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
    return {"ANSIBLE_STRATEGY_PLUGINS": str(plugins), "ANSIBLE_STRATEGY": "mitogen_linear"}


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
    limit: str | None = None,
    forks: int | None = None,
    check: bool = False,
    diff: bool = False,
    progress: Progress | None = None,
    verbosity: int = 0,
) -> RunSummary:
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

    import ansible_runner  # noqa: PLC0415 - heavy; hosts that only run the scaler lack it

    cmdline = " ".join(flag for flag, on in (("--check", check), ("--diff", diff)) if on)
    private = Path(tempfile.mkdtemp(prefix="pdctl-run-"))
    private.chmod(0o700)
    if extravars:
        # ansible-runner passes a dict of extra-vars as JSON on the command line (visible in
        # ps, and templated by Ansible); env/extravars in the private dir is read as a file.
        (private / "env").mkdir(mode=0o700)
        (private / "env" / "extravars").write_text(unsafe_yaml(extravars))
    try:
        with _cancel_on_interrupt() as cancelled:
            runner = ansible_runner.run(
                private_data_dir=str(private),
                playbook=str(playbook(name)),
                inventory=str(inventory),
                limit=limit,
                forks=forks,
                cmdline=cmdline or None,
                envvars=_env(name, verbosity),
                event_handler=on_event,
                cancel_callback=cancelled.is_set,
                quiet=verbosity < 2,
                suppress_output_file=True,
            )
            if cancelled.is_set():
                raise Interrupted(
                    f"{name} was cancelled", hint="re-run it; pdctl's playbooks are idempotent"
                )
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return RunSummary(
        rc=int(runner.rc or 0), status=str(runner.status), results=results, stats=stats
    )
