"""bench scale-out-warm: from the scaler's decision to the new replica serving (started, probe
healthy, registered with SMG), with the model in the host's cache (pdctl) against without it
(the container downloads it from the hub at start, as with dstack).

One service on a small lab, deployed with one spec, then redeployed with the other; the two
differ in the cache alone: the same 1 GiB model (model-fanout's, pdctl/lab/hub_models.py), the
hub capped at the site's uplink and the hosts' links at ten times that (model-fanout's caps),
no replica running (the spares are what is measured). pdctl's spec names its model as specs
do (`model`, `MODEL_ID=...`): pdctl fills every host's cache at deploy and mounts it read-only
with HF_HOME and HF_HUB_OFFLINE=1, so a spare starts from the cache. The baseline's spec names
it only in a variable taken from the deploying shell (a bare env KEY), which pdctl's plan
never reads: pdctl then plans no cache (fetches nothing, mounts nothing, sets no HF_HOME),
which is what a tool without a model cache gives the workers. With HF_ENDPOINT on the hub,
each worker downloads the model at start into its container's own filesystem (the lab
worker's online mode, pdctl/lab/worker/model_cache.py), and again at every start (`podman
run --rm`).

Each action is the scaler's own scale-out (pdctl/doors/slots.py Actuator.scale_out, through
bench/actions.py: the spares in turn, the previous one taken back out in the background, the
first action not counted). Nothing is subtracted: the model's load from disk and the worker's
warm-up are the same in both.

1 GiB rather than a smaller model: at the hub's cap it takes seconds to download, more than a
container start, as a real model does (140 GB at a 10 Gb/s uplink: two minutes); smaller, the
difference would be mostly the lab's own start-up noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench import actions, model_fanout
from bench.lablib import FLEET, BenchError, BenchLab, spec_filling
from pdctl.core import layout, model_cache, spec

HOSTS = 4  # a CPU host (the router) and GPU hosts (the bench service's smallest lab)
ACTIONS = 3  # counted scale-outs per path (each downloads the model once in the baseline)
WARM, COLD = "warm", "cold"
SERVICE = "scaled"  # one service, deployed with the warm spec, then redeployed with the cold
MODEL_VARIABLE = "MODEL_ID"


def service_spec(name: str, endpoint: str) -> dict[str, Any]:
    """The bench service with the big model, scaled from zero: one spare slot per group and
    none running (the deploy downloads nothing at start in either case). ``warm`` names the
    model where pdctl reads it, ``cold`` only in a variable from the deploying shell."""
    doc = spec_filling(HOSTS)
    doc["name"] = SERVICE
    for group in doc["replicas"][1:]:
        group["count"] = "0..1"
    doc["env"] = [e for e in doc["env"] if not e.startswith(f"{MODEL_VARIABLE}=")]
    doc["env"].append(f"HF_ENDPOINT={endpoint}")
    if name == WARM:
        doc["model"] = model_fanout.REPO
        doc["env"].append(f"{MODEL_VARIABLE}={model_fanout.REPO}")
    else:
        doc.pop("model", None)
        doc["env"].append(MODEL_VARIABLE)  # bare: the deploying shell's value, which no plan reads
    return doc


def write_specs(lab: BenchLab, endpoint: str) -> dict[str, Path]:
    paths = {}
    for name in (WARM, COLD):
        paths[name] = lab.home / f"{name}.yml"
        paths[name].write_text(yaml.safe_dump(service_spec(name, endpoint), sort_keys=False))
    return paths


def give_model_variable(lab: BenchLab) -> None:
    """The deploying shell's environment holds the cold spec's model id."""
    lab.env[MODEL_VARIABLE] = model_fanout.REPO


def check_inputs(lab: BenchLab) -> None:
    """Both specs are valid; pdctl plans its cache for the warm one only (no lab needed)."""
    give_model_variable(lab)
    for name, path in write_specs(lab, "http://10.77.0.2:8080").items():
        service, env = spec.load(path, lab.env)
        cache = model_cache.plan_cache(service, env, layout.MODEL_CACHE)
        planned = cache.repo if cache is not None else None
        if planned != (model_fanout.REPO if name == WARM else None):
            raise BenchError(f"scale-out-warm: the {name} spec plans the model cache {cache}")


def measure(lab: BenchLab, log: Callable[[str], None]) -> tuple[list[float], list[float]]:
    """Seconds of each counted scale-out: from the cache, and downloading from the hub."""
    give_model_variable(lab)
    timings: dict[str, list[float]] = {}
    model_fanout.prepare(lab)
    for name in (WARM, COLD):
        path = write_specs(lab, lab.status()["hub"]["endpoint"])[name]
        # The cold spec redeploys the service: its units without the cache (no slot runs).
        log(f"scale-out-warm: deploy the {name} spec")
        lab.pdctl("deploy", str(path), "--fleet", FLEET, "-y")
        with actions.parked_scaler(lab, SERVICE) as (plan, actuator):
            if (plan.model_cache is not None) != (name == WARM):
                raise BenchError(
                    f"scale-out-warm: the {name} deploy's model cache: {plan.model_cache}"
                )
            timings[name] = actions.take_turns(
                actuator, actions.spares(plan), ACTIONS, actuator.scale_out
            )
        log(f"scale-out-warm: {name} " + ", ".join(f"{t:.1f} s" for t in timings[name]))
    return timings[WARM], timings[COLD]


def p50(values: list[float]) -> float:
    return statistics.median(values)
