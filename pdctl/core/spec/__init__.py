"""pd.yml: a dstack service file, plus pdctl's own settings under one extra key, ``pdctl:``.

A file written for dstack (replica groups, scaling, resources, env, volumes,
probes) is accepted unchanged; dstack fields with no meaning on bare metal
(spot_policy, regions, a router group's python, ...) are accepted and ignored (the
plan's notes list them); anything else unknown is refused. Every error names the
file, the line and the field. Ports are not judged here but per host, after
placement (pdctl/core/plan/): a dstack file may give the router and every worker one.
PURE: no network, no disk beyond reading the file it is given.

- values.py    the values a service file spells its own way (durations, memory, ranges,
               GPUs, resources) and SpecError
- dstack.py    dstack's service file: replica groups, scaling, probes, the router; Spec
- settings.py  pdctl's own settings, under ``pdctl:``
- checks.py    what holds across fields (groups, engines, launches, images, scaling, ...)
- document.py  a file read: YAML with its lines -> Spec and Env (parse, load)
"""

from pdctl.core.spec.checks import added_flags, image_pin
from pdctl.core.spec.document import load, parse
from pdctl.core.spec.dstack import Env, Probe, ReplicaGroup, Spec
from pdctl.core.spec.settings import DEFAULT_PORT_STRIDE, MIN_PORT_STRIDE, PdctlSettings
from pdctl.core.spec.values import Gpu, Range, Resources, SpecError, describe_gb

__all__ = [
    "DEFAULT_PORT_STRIDE",
    "MIN_PORT_STRIDE",
    "Env",
    "Gpu",
    "PdctlSettings",
    "Probe",
    "Range",
    "ReplicaGroup",
    "Resources",
    "Spec",
    "SpecError",
    "added_flags",
    "describe_gb",
    "image_pin",
    "load",
    "parse",
]
