"""Helpers the tests share: run the real pdctl CLI, reach lab hosts over real SSH."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdctl.core.plan import Plan, listeners
from pdctl.lab import hub, worker_tree
from tests import zygote

LAB_PROGRAMS = ("debootstrap", "systemd-nspawn", "ip", "nsenter", "ssh", "ssh-keygen")


def running(doc: dict[str, Any], role: str) -> int:
    """A status document's count of running replicas of ROLE."""
    return int(doc["groups"][role]["running"])


def watch_status(
    status: Callable[[], dict[str, Any]],
    seconds: float,
    done: Callable[[dict[str, Any]], bool],
    journal: Callable[[], str] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Poll a service's status until done(doc); every doc seen, for what must hold
    throughout. A timeout names each group's last decision (and the scaler's journal's tail)."""
    deadline = time.monotonic() + seconds
    seen = []
    while True:
        doc = status()
        seen.append(doc)
        if done(doc):
            return doc, seen
        if time.monotonic() > deadline:
            groups = {r: doc["groups"][r]["last_decision"] for r in ("prefill", "decode")}
            tail = "\n".join(journal().splitlines()[-40:]) if journal else ""
            raise AssertionError(f"timed out: {json.dumps(groups, indent=1)}\n{tail}")
        # A status reads every host (about a CPU second here and there): what it waits for (a
        # scaler's window, a replica's start) takes tens of seconds.
        time.sleep(5)


def wait_for(
    condition: Callable[[], object],
    timeout: float = 60.0,
    step: float = 0.1,
    what: str = "the condition",
) -> None:
    """Poll ``condition`` until it is true, for at most ``timeout`` seconds.

    What a background activity produces (a metric, a log line, a unit state, a registration, a
    count) is waited for this way, never read once: on a loaded machine it lands late. A
    timeout generous enough for a loaded CI machine costs nothing when the condition holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {timeout:g} s")
        time.sleep(step)


def worker_tree_dir(engine: worker_tree.Engine) -> Path:
    """The lab image's Python files for ``engine`` (stand-ins and entry points, no wheels: the
    venv has those packages) laid out once per content: ``site`` goes on PYTHONPATH."""
    dest = Path(tempfile.gettempdir()) / f"pdctl-worker-{engine}-{worker_tree.digest(engine)}"
    if not (dest / "site").is_dir():
        staging = Path(tempfile.mkdtemp(prefix=f"{dest.name}.", dir=dest.parent))
        worker_tree.write_tree(staging, engine)
        try:
            staging.rename(dest)
        except OSError:  # another test process laid it out first
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def pdctl(
    home: Path,
    *args: str,
    check: bool = True,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (`python -m pdctl`) in a workspace."""
    inherited = {k: v for k, v in os.environ.items() if k != "PDCTL_JSON"}
    tmp = private_tmp(home)
    tmp.mkdir(parents=True, exist_ok=True)
    full_env = {**inherited, "PDCTL_HOME": str(home), "TMPDIR": str(tmp), **(env or {})}
    argv = [sys.executable, "-m", "pdctl", *args]
    if zygote.can_run(env or {}):
        proc = zygote.run(argv, full_env, timeout)
    else:
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=full_env, timeout=timeout, check=False
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"pdctl {' '.join(args)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def service_status(home: Path, service: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`pdctl --json status SERVICE`: exit 0, or 8 while the service is down (its router
    does not answer or is not ready); the document either way."""
    proc = pdctl(home, "--json", "status", service, env=env, check=False)
    assert proc.returncode in (0, 8), f"status exited {proc.returncode}: {proc.stderr}"
    doc: dict[str, Any] = json.loads(proc.stdout)
    assert (proc.returncode == 8) == (doc["health"] == "down"), doc["health"]
    return doc


def private_tmp(home: Path) -> Path:
    """The TMPDIR of pdctl runs in workspace `home` (tests run side by side: /tmp is shared)."""
    return home.with_name(home.name + ".tmp")


def pdctl_json(home: Path, *args: str, **kwargs: Any) -> Any:
    return json.loads(pdctl(home, "--json", *args, **kwargs).stdout)


def listener() -> socket.socket:
    """A local TCP port that queues connections and never serves one."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    return server


def contacted(server: socket.socket) -> bool:
    """Whether anything connected to a listener() port."""
    try:
        server.accept()[0].close()
    except BlockingIOError:
        return False
    return True


def lab_unavailable() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "the lab needs root"
    missing = [p for p in LAB_PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"missing programs: {', '.join(missing)} (run `make install`)"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return f"cannot create namespaces: {probe.stderr.decode().strip()}"
    return None


def require_lab() -> None:
    """Skip when the lab cannot run, unless CI said it must (PDCTL_REQUIRE_LAB=1)."""
    reason = lab_unavailable()
    if reason is None:
        return
    if os.environ.get("PDCTL_REQUIRE_LAB") == "1":
        pytest.fail(f"PDCTL_REQUIRE_LAB=1 but the lab cannot run: {reason}")
    pytest.skip(reason)


@dataclass
class Lab:
    """A running lab in its own workspace."""

    home: Path
    # `pdctl --json fleet add`'s document, when the lab was added as fleet `lab` (lab_fleet()).
    fleet_added: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    # Each host's name, address, user, identity file and kind, read once: they hold for the
    # lab's life (faults and power cycles keep them), and every `pdctl lab status` is a whole
    # CLI run. status() and host() read live.
    _hosts: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = pdctl_json(self.home, "lab", "status")
        return doc

    def host(self, name: str) -> dict[str, Any]:
        return next(h for h in self.status()["hosts"] if h["name"] == name)

    def hosts(self) -> list[dict[str, Any]]:
        """Every host's lasting facts (name, address, user, identity file, kind), read once."""
        if not self._hosts:
            keep = ("name", "address", "port", "user", "identity_file", "kind")
            self._hosts = [{k: h[k] for k in keep} for h in self.status()["hosts"]]
        return self._hosts

    def node_at(self, address: str) -> str:
        """The lab node name of a host address as pdctl reports it."""
        return str(next(h["name"] for h in self.hosts() if h["address"] == address))

    def gpu_hosts(self) -> list[str]:
        return [h["name"] for h in self.hosts() if h["kind"] == "gpu"]

    def cpu_hosts(self) -> list[str]:
        return [h["name"] for h in self.hosts() if h["kind"] == "cpu"]

    def ssh(
        self,
        name: str,
        command: str,
        user: str | None = None,
        check: bool = True,
        timeout: float = 120,
        stdin: str | None = None,
        host: dict[str, Any] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command on a lab host through the real ssh client (``host``: the host's entry
        of an earlier status(), which saves asking pdctl again)."""
        host = host or next(h for h in self.hosts() if h["name"] == name)
        argv = [
            "ssh",
            "-i",
            host["identity_file"],
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=5",
            f"{user or host['user']}@{host['address']}",
            command,
        ]
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            input=stdin,
            errors="replace",
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"ssh {name} {command!r} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def fault(self, name: str, kind: str, arg: str | None = None) -> None:
        pdctl(self.home, "lab", "fault", name, kind, *([arg] if arg else []))


def chat(
    endpoint: str, text: str, key: str | None, timeout: float = 10, model: str = "lab/tiny-llama"
) -> tuple[int, dict[str, Any]]:
    """One chat completion through a service's router (SMG routes by ``model``): HTTP status
    and JSON body."""
    request = urllib.request.Request(
        f"{endpoint}/v1/chat/completions",
        method="POST",
        data=json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 8,
            }
        ).encode(),
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {}),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {"text": body}
        return exc.code, doc if isinstance(doc, dict) else {"body": doc}


def assert_apart(*plans: Plan) -> None:
    """No (host, GPU) and no (host, port) of one plan in another's (or twice in one)."""
    gpus = [(s.host, g) for p in plans for s in p.slots() for g in s.gpus]
    assert len(gpus) == len(set(gpus)), gpus
    ports = [
        (item.host, port)
        for p in plans
        for item in listeners(p)
        for port in range(item.first, item.last + 1)
    ]
    assert len(ports) == len(set(ports))


def start_lab(home: Path, hosts: int, cpu_hosts: int) -> Lab:
    home.mkdir(parents=True, exist_ok=True)
    up = pdctl(home, "lab", "up", "--hosts", str(hosts), "--cpu-hosts", str(cpu_hosts), check=False)
    if up.returncode != 0:  # the hosts that did boot would outlive the test
        pdctl(home, "lab", "down", check=False)
        raise AssertionError(f"pdctl lab up exited {up.returncode}\n{up.stderr}")
    return Lab(home)


def lab_fleet(tmp_path_factory: pytest.TempPathFactory, name: str) -> Lab:
    """A 3-host lab (node1 without GPUs) in a fresh workspace, added as fleet `lab`."""
    require_lab()
    lab = start_lab(tmp_path_factory.mktemp(name), hosts=3, cpu_hosts=1)
    added = pdctl(lab.home, "--json", *lab.status()["fleet_add"].split()[1:], check=False)
    if added.returncode != 0:
        pdctl(lab.home, "lab", "down", check=False)
        raise AssertionError(f"fleet add exited {added.returncode}\n{added.stdout}{added.stderr}")
    lab.fleet_added = json.loads(added.stdout)
    return lab


LAB_SCALING = (
    "  - count: 1..2\n    scaling:\n      metric: rps\n      target: 2\n"
    "      scale_up_delay: 10s\n      scale_down_delay: 30s\n"
)


def renamed(spec_text: str, name: str) -> str:
    """The lab spec (examples/lab/pd.yml) as service ``name``: a module on the shared lab
    deploys under a name of its own."""
    assert spec_text.count("\nname: pdlab\n") == 1
    return spec_text.replace("\nname: pdlab\n", f"\nname: {name}\n")


def lab_service(spec_text: str, name: str, port: int, metrics_port: int, count: int = 1) -> str:
    """The lab spec (examples/lab/pd.yml) as service ``name`` with ``count`` prefill and
    ``count`` decode replicas (fixed: no scaling, no spares), its router on ``port`` and
    metrics on ``metrics_port`` (two services' routers on one host need their own)."""
    assert spec_text.count(LAB_SCALING) == 2 and "port: 8000\nmodel:" in spec_text
    text = renamed(spec_text, name)
    text = text.replace(LAB_SCALING, f"  - count: {count}\n")
    text = text.replace("port: 8000\nmodel:", f"port: {port}\nmodel:")
    router = "  router:\n    health_check_interval"  # under pdctl:
    assert text.count(router) == 1
    return text.replace(router, router.replace("\n", f"\n    metrics_port: {metrics_port}\n"))


PREFILL_LAUNCH = (
    "      - |\n        python3 -m sglang.launch_server \\\n"
    "          --model-path $MODEL_ID \\\n          --disaggregation-mode prefill"
)


def template_text(canary: Path) -> dict[str, str]:
    """Values a template engine would act on: a lookup that would create ``canary`` on the
    machine rendering it, a Jinja comment opener, dstack's own secret syntax."""
    lookup = f"{{{{ lookup('pipe', 'touch {canary}') }}}}"
    return {
        "env_jinja": f"JINJA={lookup}",
        "env_shell": "SHELLISH=${#ARR[@]} ${{ secrets.X }}",
        "command": f": '${{#ARR[@]}}' \"{lookup}\"",
    }


def with_template_text(spec_text: str, canary: Path) -> str:
    """The lab spec with template_text() in its env and as a prefill command (a no-op `:`)."""
    values = template_text(canary)

    def quoted(text: str) -> str:  # a YAML single-quoted scalar
        return "'" + text.replace("'", "''") + "'"

    env = "".join(f"  - {quoted(values[k])}\n" for k in ("env_jinja", "env_shell"))
    assert "  - MC_GID_INDEX=3\n" in spec_text and PREFILL_LAUNCH in spec_text
    text = spec_text.replace("  - MC_GID_INDEX=3\n", "  - MC_GID_INDEX=3\n" + env)
    return text.replace(
        PREFILL_LAUNCH, f"      - {quoted(values['command'])}\n" + PREFILL_LAUNCH, 1
    )


@contextmanager
def lab_hub_on_loopback(root: Path) -> Iterator[str]:
    """The lab's model hub serving ``root`` on loopback, in a thread: its endpoint."""
    server = hub.make_server(root)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield hub.endpoint(server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
