"""The pd_onhost lookup: how the roles run pdctl's Python on a host (pdctl/onhost/bundle.py).

``lookup('pd_onhost', 'pdctl.onhost.unit_probe')`` gives ``{"argv", "stdin", "boot", "entry",
"source"}``: a command task runs ``argv`` (plus the entry's own arguments) with ``stdin`` (plus
what the entry reads after it), the same bundle and loader pdctl itself sends over SSH; a unit
runs ``python -c "<boot>" <entry>`` with ``stdin`` kept in a file; ``source`` is the entry's
own text, for a module that imports nothing of pdctl and is installed as its file (the router's
launcher), else empty.

Beside the playbooks, Ansible finds it for any of them; ansible.cfg names it for a playbook
elsewhere (molecule's config too). The bundle is built from the pdctl package this content
ships with (a checkout's ``pdctl/`` beside ``playbooks/``, or the wheel's package above
``_content/``), with bundle.py loaded by its path: Ansible's Python need not have pdctl.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: pd_onhost
author: pdctl
short_description: Run pdctl's on-host Python (a bundle and its loader)
description:
  - For each entry module of pdctl (pdctl.onhost.*, pdctl.scaler), the argv and stdin that run
    it on a host, the loader's one-line program and, for a module that imports nothing of pdctl,
    its own text.
options:
  _terms:
    description: Entry modules, e.g. pdctl.onhost.unit_probe.
    required: true
"""

RETURN = """
_list:
  description: One dict per entry, keys argv, stdin, boot, entry and source.
  type: list
  elements: dict
"""

_CONTENT = Path(__file__).resolve().parents[2]  # the checkout, or pdctl/_content in a wheel
_CANDIDATES = (
    _CONTENT / "pdctl" / "onhost" / "bundle.py",  # a checkout
    _CONTENT.parent / "onhost" / "bundle.py",  # a wheel: pdctl/_content/playbooks/lookup_plugins/
)


@functools.cache  # one load per process: its bundles are cached in it
def _bundle() -> ModuleType:
    for path in _CANDIDATES:
        if path.is_file():
            spec = importlib.util.spec_from_file_location("_pd_onhost_bundle", path)
            if spec is None or spec.loader is None:
                break
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise AnsibleLookupError(f"pdctl's on-host code is missing next to {_CONTENT}")


# The entries playbooks/group_vars/all.yml runs (a test holds them equal): every playbook run
# computes them once, in the playbook process (pd_linear calls LookupModule.warm), and each
# task's worker, a fork of it, inherits them instead of parsing its bundles again (the scaler's
# alone takes about 0.1 CPU-s; the preflight and host-apply bundles ran in every host's worker).
ENTRIES = (
    "pdctl.onhost.hardware.preflight",
    "pdctl.onhost.host_apply",
    "pdctl.onhost.host_remove",
    "pdctl.onhost.router_check",
    "pdctl.onhost.router_launch",
    "pdctl.onhost.router_register",
    "pdctl.onhost.router_restart",
    "pdctl.onhost.unit_probe",
    "pdctl.onhost.venv_install",
    "pdctl.scaler",
)


@functools.cache
def _entry(entry: str) -> dict[str, str | list[str]]:
    bundle = _bundle()
    try:
        stdin = bundle.stdin(entry).decode("ascii")
        try:
            source = bundle.source(entry)
        except bundle.BundleError:
            source = ""
    except bundle.BundleError as exc:
        raise AnsibleLookupError(f"pd_onhost: {exc}") from exc
    return {
        "argv": bundle.argv(entry),
        "stdin": stdin,
        "boot": bundle.BOOT,
        "entry": entry,
        "source": source,
    }


class LookupModule(LookupBase):  # type: ignore[misc]  # ansible-core ships no type hints
    def run(self, terms: list[Any], variables: Any = None, **kwargs: Any) -> list[dict[str, Any]]:
        # Copies: nothing a task does to its result reaches the next task's.
        return [copy.deepcopy(_entry(str(term))) for term in terms]

    @staticmethod
    def warm() -> None:
        """Compute every entry the playbooks run; one that fails fails again where it is used."""
        for entry in ENTRIES:
            try:
                _entry(entry)
            except AnsibleLookupError:
                continue
