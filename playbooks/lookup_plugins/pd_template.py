"""The pd_template lookup: ``ansible.builtin.template``'s lookup without its copy of the variables.

The builtin lookup deep-copies the task's whole variables before it renders a template (its own
source asks "why isn't this a chainmap with a sacrificial bottom layer?"). Those variables hold
the plan, whose size grows with the fleet, and under ansible-core 2.19 every value carries its
tags: on a 16-host deploy the copies were 70 % of the CPU of each host's apply task (py-spy of
its workers), a cost per host that grows with the fleet. This lookup gives the template the
same variables as a chain: the lookup's own (the ``template_*`` ones and ``template_vars``) over
the task's, read where they are. Same options, same search path, same output.

Only for templates that read their variables (the roles' templates set locals only); a template
that changed a variable's dict in place would change the task's.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import MutableMapping
from typing import Any

from ansible.plugins.lookup.template import LookupModule as TemplateLookup

DOCUMENTATION = """
name: pd_template
author: pdctl
short_description: ansible.builtin.template's lookup, reading the task's variables in place
description:
  - Renders each template as ansible.builtin.template's lookup does, with the same options,
    over a chain of the lookup's own variables and the task's instead of a deep copy of them.
  - For templates that only read their variables.
options:
  _terms:
    description: Templates, found as the builtin lookup finds them (a role's templates/).
  template_vars:
    description: Variables added for the template, over the task's.
    type: dict
    default: {}
  variable_start_string:
    description: As ansible.builtin.template's lookup.
    default: "{{"
    type: str
  variable_end_string:
    description: As ansible.builtin.template's lookup.
    default: "}}"
    type: str
  comment_start_string:
    description: As ansible.builtin.template's lookup.
    type: str
    default: "{#"
  comment_end_string:
    description: As ansible.builtin.template's lookup.
    type: str
    default: "#}"
  trim_blocks:
    description: As ansible.builtin.template's lookup.
    type: bool
    default: true
"""

RETURN = """
_raw:
  description: The rendered text of each template.
  type: list
  elements: raw
"""


class _ReadInPlace(ChainMap[str, Any]):
    """The task's variables, whose deep copy is a new empty layer over them (what the builtin
    lookup then adds goes to that layer)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> ChainMap[str, Any]:
        return ChainMap({}, *self.maps)


class LookupModule(TemplateLookup):  # type: ignore[misc]  # ansible-core ships no type hints
    def run(
        self, terms: list[Any], variables: MutableMapping[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        return super().run(terms, variables=_ReadInPlace(variables or {}), **kwargs)
