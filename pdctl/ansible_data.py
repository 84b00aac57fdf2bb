"""Values pdctl hands to Ansible are data, never templates. PURE.

Ansible renders every string it loads from an extra-vars file (`-e @plan.yml`) as a Jinja
template when a task uses it: a spec's env value `{{ lookup('pipe', 'id') }}` would run `id`
on the controller, and a shell `${#ARR[@]}` would fail the run half-way. YAML's `!unsafe`
tag is Ansible's own marking for "never template this": every string pdctl writes for
Ansible (plan files, the extra-vars of its runs, facts in host_vars) carries it, so the
value reaches the host exactly as written, whether pdctl or a plain `ansible-playbook`
loads the file.
"""

from __future__ import annotations

from typing import Any

import yaml

from pdctl.yamlsrc import IndentedDumper

UNSAFE_TAG = "!unsafe"


class _Unsafe(str):
    """A string to be written with the !unsafe tag."""


class _UnsafeDumper(IndentedDumper):
    pass


def _represent_unsafe(dumper: yaml.SafeDumper, value: _Unsafe) -> yaml.ScalarNode:
    style = '"' if any(ord(c) < 32 or c in "\x7f\u2028\u2029" for c in value) else None
    return dumper.represent_scalar(UNSAFE_TAG, str(value), style=style)


_UnsafeDumper.add_representer(_Unsafe, _represent_unsafe)


def mark_unsafe(value: Any) -> Any:
    """``value`` with every string (mapping keys included) marked for the !unsafe tag."""
    if isinstance(value, str):
        return _Unsafe(value)
    if isinstance(value, dict):
        return {mark_unsafe(k): mark_unsafe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mark_unsafe(item) for item in value]
    return value


def unsafe_yaml(variables: dict[str, Any]) -> str:
    """Ansible variables as YAML, every string value tagged !unsafe (the variable names,
    pdctl's own, stay plain)."""
    doc = {name: mark_unsafe(value) for name, value in variables.items()}
    return yaml.dump(
        doc, Dumper=_UnsafeDumper, sort_keys=False, default_flow_style=False, width=120
    )
