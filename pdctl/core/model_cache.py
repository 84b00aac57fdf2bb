"""Which hub model a service's workers load, and how they see the host's model cache. PURE.

The model id comes from the spec's ``model`` or else the workers' ``--model-path``/``--model``
(a ``$NAME`` there is read from the spec's env); a local path (``/...``) is the spec's own
business (a volume), not the cache's. The cache is the fleet's setting (pdctl/core/fleet_model.py),
mounted read-only where the engines look for the hub cache, unless a spec volume mounts
something there itself: then that host directory is the cache pdctl fills.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdctl.core import layout
from pdctl.core.errors import InputError
from pdctl.core.spec import Env, Spec
from pdctl.onhost import hf_layout

_MODEL_FLAG = re.compile(r"--model(?:-path)?(?:=|\s+)(\S+)")
_VARIABLE = re.compile(r"^\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))\Z")
DEFAULT_REVISION = "main"


@dataclass(frozen=True)
class ModelCache:
    repo: str
    revision: str
    cache: str  # the host directory (HF_HOME's, mounted read-only into the workers)


def model_id(spec: Spec, env: Env) -> str | None:
    """The model the workers load, as the spec names it (None: it names none)."""
    if spec.model_name:
        return spec.model_name
    for group in spec.replicas:
        for command in group.commands:
            found = _MODEL_FLAG.search(command)
            if found:
                value = found.group(1).strip("'\"")
                variable = _VARIABLE.match(value)
                if variable:
                    name = variable.group(1) or variable.group(2)
                    return env.plain.get(name) or None
                return value
    return None


def plan_cache(spec: Spec, env: Env, fleet_cache: str) -> ModelCache | None:
    """The hub model to fetch into the cache, and that cache (None: no hub model)."""
    model = model_id(spec, env)
    if model is None or model.startswith("/"):
        return None
    revision = spec.pdctl.model_revision or DEFAULT_REVISION
    try:
        repo = hf_layout.check_repo_id(model)
    except ValueError as exc:
        raise InputError(
            f"model: {exc}",
            hint="name a hub model (ORG/NAME), or a local path (/...) that a spec volume mounts",
        ) from exc
    mounted = next(
        (v.split(":")[0] for v in spec.volumes if v.split(":")[1] == layout.CONTAINER_HF_HOME),
        None,
    )
    return ModelCache(repo=repo, revision=revision, cache=mounted or fleet_cache)


def worker_env(cache: ModelCache | None, env: Env) -> Env:
    """The env with the hub cache's: HF_HOME on the mount, offline (the spec's own win)."""
    if cache is None:
        return env
    added = {"HF_HOME": layout.CONTAINER_HF_HOME, "HF_HUB_OFFLINE": "1"}
    plain = {**added, **env.plain}
    return env.model_copy(update={"plain": {k: plain[k] for k in sorted(plain)}})


def cache_volume(cache: ModelCache | None, volumes: list[str]) -> list[str]:
    """The volumes with the cache mounted read-only (unless a spec volume mounts it)."""
    if cache is None or any(v.split(":")[1] == layout.CONTAINER_HF_HOME for v in volumes):
        return volumes
    return [*volumes, f"{cache.cache}:{layout.CONTAINER_HF_HOME}:ro"]
