"""Where a service lives on a host, and the defaults a spec and the roles share. PURE.

The one home of these facts: pdctl reads them here, and the roles and templates read the
plan's ``pd_layout`` (Layout.extravar(): every path and name resolved for the plan's
service), so that what pdctl checks and what the roles wrote cannot drift apart.
tests/unit/core/test_layout.py renders the roles' view of a plan with Ansible and holds it equal
to this one. Standard library and pydantic only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict

# ---------------------------------------------------------------- roots a plan may move
CONFIG_ROOT = "/etc/pdctl"  # <root>/<service>: its env files, API key, scaler config
INSTALL_ROOT = "/opt/pdctl"  # the router's launcher, SMG venvs, the scaler's install
STATE_ROOT = "/var/lib/pdctl"  # <root>/<service>: the scaler's state
# A host's model cache (the Hugging Face hub cache layout, pdctl/onhost/hf_layout.py), shared by
# every service on the host: a fleet setting, so not under a plan's roots.
MODEL_CACHE = "/var/lib/pdctl/models"
# Where the workers see it (read-only), as HF_HOME: the engines' default hub cache.
CONTAINER_HF_HOME = "/root/.cache/huggingface"

# ---------------------------------------------------------------- fixed places
UNIT_DIR = "/etc/systemd/system"
# The only command pdctl and the scaler run on a worker host (pd_worker's pdctl-unitctl.sh.j2);
# authorized_keys and sudoers name it, so it cannot move with a plan.
UNITCTL = "/usr/local/libexec/pdctl-unitctl"
SUDOERS_DIR = "/etc/sudoers.d"
RUN_DIR = "/run/pdctl"  # the scaler's lock: one scaler per service on a host
SCALER_USER = "pdctl-scaler"
SCALER_USER_HOME = f"/var/lib/{SCALER_USER}"

# ---------------------------------------------------------------- the worker groups
# A slot's group names its unit, container and files; the roles read the groups as the keys
# of pd_layout.groups, so no task spells them.
Group = Literal["prefill", "decode"]
GROUPS: tuple[Group, ...] = get_args(Group)

# ---------------------------------------------------------------- files of a config dir
SERVICE_ENV = "service.env"
SECRETS_ENV = "secrets.env"
ROUTER_ENV = "router.env"
SCALER_CONFIG = "scaler.json"
SCALER_KEY = "scaler_id_ed25519"
SCALER_KNOWN_HOSTS = "scaler_known_hosts"
ROUTER_LAUNCHER = "router_launch.py"  # in the router's install dir
SMG_VENV_PREFIX = "smg-"  # <install root>/smg-<version>: one venv per SMG version
SCALER_INSTALL = "scaler"  # <install root>/scaler: shared by the host's scalers
# Several routers (router HA): with pdctl.router.mesh, the SMG mesh's mutual TLS, a CA that
# every router host keeps (any of them signs a new router's certificate); and keepalived,
# which holds the failover address on a healthy router.
MESH_CA_CERT = "mesh-ca.pem"
MESH_CA_KEY = "mesh-ca.key"
MESH_CERT = "mesh.pem"
MESH_KEY = "mesh.key"
KEEPALIVED_CONF = "keepalived.conf"
ROUTER_CHECK = "router_check.py"  # in the router's install dir: keepalived's health check
KEEPALIVED_STATE = "state"  # in its run dir: MASTER, BACKUP, FAULT (router_check.py notify)

# ---------------------------------------------------------------- files of a state dir
# What the scaler records every tick (fences, its heartbeat): named apart from its config.
SCALER_STATE = "state.json"
# Where a scaler of an older pdctl recorded it: read when SCALER_STATE is not there yet.
SCALER_STATE_LEGACY = "scaler.json"
SCALER_PINS = "overrides.json"  # `pdctl scale`'s pins, which the scaler reads every tick
# Under the state root, beside the services' directories (no service is named so: a service
# name has no '_'): the fleets' GPU ledgers, one file per fleet (pdctl/onhost/gpu_ledger.py).
GPU_LEDGER_DIR = "_gpu-budget"

# ---------------------------------------------------------------- a slot's environment
# What a slot's unit and container read from <group>.env and <group>-<k>.env (the plan writes
# the slot's, pdctl/core/plan/ Slot.env; the pd_worker role the group's). The unit template and
# the group scripts read them by these names, and pdctl/onhost/holdings_probe.py reads other
# services' back: tests/unit/content/test_role_facts.py holds every spelling to this table.
ENV_IMAGE = "PDCTL_IMAGE"  # <group>.env: the group's image
ENV_CONFIG = "PDCTL_CONFIG"  # <group>.env: its config identity (the containers' pdctl.config)
ENV_SLOT = "PDCTL_SLOT"  # group/index
ENV_HOST = "PDCTL_HOST"  # the address the slot listens on
ENV_PORT = "PDCTL_PORT"
ENV_BOOTSTRAP_PORT = "PDCTL_BOOTSTRAP_PORT"  # an SGLang prefill's
ENV_KV_PORT = "PDCTL_KV_PORT"  # a vLLM slot's KV connector listener
ENV_GPU_IDS = "PDCTL_GPU_IDS"  # "0,1": the host's GPU indices
ENV_DEVICE_ARGS = "PDCTL_DEVICE_ARGS"  # the runtime flags giving the container those GPUs
ENV_RDMA_DEVICES = "PDCTL_RDMA_DEVICES"  # the NICs nearest them
SLOT_ENV_NAMES = (
    ENV_IMAGE,
    ENV_CONFIG,
    ENV_SLOT,
    ENV_HOST,
    ENV_PORT,
    ENV_BOOTSTRAP_PORT,
    ENV_KV_PORT,
    ENV_GPU_IDS,
    ENV_DEVICE_ARGS,
    ENV_RDMA_DEVICES,
)
# router.env: the router's API key, which the launcher hands to SMG (pdctl/onhost/router_launch.py).
ENV_ROUTER_API_KEY = "PDCTL_ROUTER_API_KEY"

# ---------------------------------------------------------------- defaults
START_TIMEOUT = 1800  # seconds a replica may take to become healthy
STOP_TIMEOUT = 600  # seconds a replica may take to drain on stop
PROBE_URL = "/health"
PROBE_INTERVAL = 15  # seconds between probes
PROBE_TIMEOUT = 10  # seconds one probe may take
# The scaler's own metrics on 127.0.0.1 of the router host: the plan's first choice (another
# service's scaler there takes the next free port) and the pd_scaler role's default.
SCALER_METRICS_PORT = 29100
# Candidate container storage paths: the first that exists is measured for free space.
STORAGE_PATHS = ("/var/lib/containers", "/var/lib/docker", "/var/lib")

_ROOT = re.compile(r"^(?:/[A-Za-z0-9_+-][A-Za-z0-9._+-]*)+\Z")


def _root(path: str) -> str:
    if not _ROOT.match(path) or "/../" in f"{path}/" or "/./" in f"{path}/":
        raise ValueError(f"{path!r}: an absolute directory, without '.', '..' or a final '/'")
    return path


Root = Annotated[str, AfterValidator(_root)]


class Roots(BaseModel):
    """The directories a plan may move (with pd_layout); every other path derives from them.
    A host holds one of each: pdctl-unitctl and the other services' placement read them too."""

    model_config = ConfigDict(frozen=True)

    config_root: Root = CONFIG_ROOT
    install_root: Root = INSTALL_ROOT
    state_root: Root = STATE_ROOT


def prefix(service: str) -> str:
    """What every unit and container of the service is named with."""
    return f"pd-{service}-"


def slot_unit(service: str, group: str, index: int | str) -> str:
    """The systemd unit of one slot (an instance of worker_unit)."""
    return f"{prefix(service)}{group}@{index}.service"


def worker_unit(service: str, group: str) -> str:
    """The templated unit of a group: one instance per slot index."""
    return slot_unit(service, group, "")


def container(service: str, group: str, index: int | str) -> str:
    """The container a slot's unit runs."""
    return f"{prefix(service)}{group}-{index}"


def router_unit(service: str) -> str:
    return f"{prefix(service)}router.service"


def scaler_unit(service: str) -> str:
    return f"{prefix(service)}scaler.service"


def keepalived_unit(service: str) -> str:
    """The service's own keepalived (its failover address), apart from the host's keepalived."""
    return f"{prefix(service)}keepalived.service"


def unit_file(unit: str) -> str:
    return f"{UNIT_DIR}/{unit}"


def smg_venv(version: str, roots: Roots | None = None) -> str:
    return f"{(roots or Roots()).install_root}/{SMG_VENV_PREFIX}{version}"


@dataclass(frozen=True)
class Layout:
    """Every path and name of one service on its hosts."""

    service: str
    roots: Roots = field(default_factory=Roots)

    @property
    def config_dir(self) -> str:
        return f"{self.roots.config_root}/{self.service}"

    def config_file(self, name: str) -> str:
        return f"{self.config_dir}/{name}"

    def group_env(self, group: str) -> str:
        return self.config_file(f"{group}.env")

    def group_script(self, group: str) -> str:
        return self.config_file(f"{group}.sh")

    def slot_env(self, group: str, index: int | str) -> str:
        return self.config_file(f"{group}-{index}.env")

    @property
    def state_dir(self) -> str:
        return f"{self.roots.state_root}/{self.service}"

    @property
    def gpu_ledger_dir(self) -> str:
        return f"{self.roots.state_root}/{GPU_LEDGER_DIR}"

    def gpu_ledger(self, fleet: str) -> str:
        """The fleet's GPU ledger, on the router host its budgeted services share."""
        return f"{self.gpu_ledger_dir}/{fleet}.json"

    @property
    def router_home(self) -> str:
        return f"{self.roots.install_root}/{self.service}"

    @property
    def scaler_home(self) -> str:
        return f"{self.roots.install_root}/{SCALER_INSTALL}"

    @property
    def scaler_lock(self) -> str:
        return f"{RUN_DIR}/{self.service}-scaler.lock"

    @property
    def keepalived_run_dir(self) -> str:
        """keepalived's pid files and its state (MASTER, BACKUP, ...): gone when it stops."""
        return f"{RUN_DIR}/{self.service}-keepalived"

    @property
    def keepalived_state(self) -> str:
        return f"{self.keepalived_run_dir}/{KEEPALIVED_STATE}"

    @property
    def scaler_sudoers(self) -> str:
        return f"{SUDOERS_DIR}/{SCALER_USER}-{self.service}"

    def extravar(self, groups: Iterable[str]) -> dict[str, Any]:
        """``pd_layout``: what the roles and templates read instead of spelling a path."""
        svc = self.service
        return {
            "service": svc,
            **self.roots.model_dump(),
            "config_dir": self.config_dir,
            "service_env": self.config_file(SERVICE_ENV),
            "secrets_env": self.config_file(SECRETS_ENV),
            "router_env": self.config_file(ROUTER_ENV),
            "scaler_config": self.config_file(SCALER_CONFIG),
            "scaler_key": self.config_file(SCALER_KEY),
            "scaler_known_hosts": self.config_file(SCALER_KNOWN_HOSTS),
            "state_dir": self.state_dir,
            "run_dir": RUN_DIR,
            "scaler_lock": self.scaler_lock,
            "router_home": self.router_home,
            "router_launcher": f"{self.router_home}/{ROUTER_LAUNCHER}",
            "router_check": f"{self.router_home}/{ROUTER_CHECK}",
            "mesh_ca_cert": self.config_file(MESH_CA_CERT),
            "mesh_ca_key": self.config_file(MESH_CA_KEY),
            "mesh_cert": self.config_file(MESH_CERT),
            "mesh_key": self.config_file(MESH_KEY),
            "keepalived_conf": self.config_file(KEEPALIVED_CONF),
            "keepalived_unit": keepalived_unit(svc),
            "keepalived_run_dir": self.keepalived_run_dir,
            "keepalived_state": self.keepalived_state,
            "smg_venv_prefix": smg_venv("", self.roots),
            "scaler_home": self.scaler_home,
            "unit_dir": UNIT_DIR,
            "router_unit": router_unit(svc),
            "any_router_unit": router_unit("*"),
            "scaler_unit": scaler_unit(svc),
            "any_scaler_unit": scaler_unit("*"),
            "container_prefix": prefix(svc),
            "unitctl": UNITCTL,
            "scaler_user": SCALER_USER,
            "scaler_user_home": SCALER_USER_HOME,
            "scaler_sudoers": self.scaler_sudoers,
            "groups": {
                group: {
                    "env": self.group_env(group),
                    "script": self.group_script(group),
                    "container": container(svc, group, "%i"),  # %i: the slot index
                    "slot_env": self.slot_env(group, "%i"),
                    "unit": worker_unit(svc, group),
                    "instances": slot_unit(svc, group, "*"),
                }
                for group in groups
            },
        }
