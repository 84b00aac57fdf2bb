"""Values pdctl hands to Ansible are data, never templates. PURE.

Ansible renders every string it loads from an extra-vars file (`-e @plan.yml`) as a Jinja
template when a task uses it: a spec's env value `{{ lookup('pipe', 'id') }}` would run `id`
on the controller, and a shell `${#ARR[@]}` would fail the run half-way. YAML's `!unsafe`
tag is Ansible's own marking for "never template this". pdctl puts it on the document's
root mapping: Ansible's loader then builds everything inside as untrusted, while each
value keeps its YAML type (a tag on a scalar would make Ansible re-resolve its type from
the text, so the string '3' would load as the number 3).
"""

from __future__ import annotations

from typing import Any

import yaml

from pdctl.core.yamlsrc import IndentedDumper

UNSAFE_TAG = "!unsafe"


class _UnsafeRoot(dict[str, Any]):
    """The document's root mapping, written with the !unsafe tag."""


class _UnsafeDumper(IndentedDumper):
    pass


def _represent_root(dumper: yaml.SafeDumper, value: _UnsafeRoot) -> yaml.MappingNode:
    return dumper.represent_mapping(UNSAFE_TAG, dict(value))


_UnsafeDumper.add_representer(_UnsafeRoot, _represent_root)


def unsafe_yaml(variables: dict[str, Any]) -> str:
    """Ansible variables as one YAML document whose root carries the !unsafe tag."""
    return yaml.dump(
        _UnsafeRoot(variables),
        Dumper=_UnsafeDumper,
        sort_keys=False,
        default_flow_style=False,
        width=120,
    )
