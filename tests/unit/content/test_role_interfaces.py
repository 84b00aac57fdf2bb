"""Each role says what it takes, takes nothing else, and keeps to itself.

Read from the roles' own files: every variable an entry point's tasks, templates and handlers
read (through its vars/ and defaults/) is in that entry point's meta/argument_specs.yml, and
every option there is read; defaults/ and the specs agree; no role reaches outside its own
directory; one task file (the pd_health role's) waits for units to be healthy.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "meta").is_dir())
# Bare Jinja expressions (no braces): Ansible's conditionals.
CONDITIONALS = {"when", "that", "until", "failed_when", "changed_when"}
INCLUDES = ("ansible.builtin.import_tasks", "ansible.builtin.include_tasks")
TEMPLATE = re.compile(r"\{\{(.*?)\}\}|\{%(.*?)%\}", re.DOTALL)
RAW = re.compile(r"\{%-?\s*raw\s*-?%\}.*?\{%-?\s*endraw\s*-?%\}|\{#.*?#\}", re.DOTALL)
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
NAME = re.compile(r"(?<![\w.])(_{0,2}pd_[a-z0-9_]+)")
# A template rendered by a lookup: the builtin's, or pd_template (the same, reading in place).
TEMPLATE_LOOKUP = re.compile(
    r"lookup\(\s*'(?:ansible\.builtin\.template|pd_template)',\s*'([^']+)'"
)


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _expressions(value: Any, key: str = "") -> Iterator[str]:
    """Every Jinja expression in a YAML document (the text between braces, and conditionals)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _expressions(v, str(k))
    elif isinstance(value, list):
        for v in value:
            yield from _expressions(v, key)
    elif isinstance(value, str):
        if key in CONDITIONALS:
            yield value
        yield from _template_expressions(value)
    elif isinstance(value, bool) and key in CONDITIONALS:
        return


def _template_expressions(text: str) -> Iterator[str]:
    for match in TEMPLATE.finditer(RAW.sub("", text)):
        yield match[1] if match[1] is not None else match[2]


def _names(expression: str) -> set[str]:
    return set(NAME.findall(QUOTED.sub("''", expression)))


def _tasks(value: Any) -> Iterator[dict[str, Any]]:
    for task in value or []:
        if isinstance(task, dict):
            yield task
            for section in ("block", "rescue", "always"):
                yield from _tasks(task.get(section))


class Entry:
    """What one entry point of a role reads and sets."""

    def __init__(self, role: str, entry: str) -> None:
        self.root = REPO / "roles" / role
        self.docs: list[Any] = []
        self.templates: list[str] = []
        self._follow(self.root / "tasks" / f"{entry}.yml")
        if any("notify" in task for doc in self.docs for task in _tasks(doc)):
            self.docs.append(_load(self.root / "handlers" / "main.yml"))
        self.vars = _load(self.root / "vars" / "main.yml") or {}
        self.defaults = _load(self.root / "defaults" / "main.yml") or {}

    def _follow(self, path: Path) -> None:
        doc = _load(path)
        self.docs.append(doc)
        for task in _tasks(doc):
            for action in INCLUDES:
                target = task.get(action)
                target = target.get("file") if isinstance(target, dict) else target
                if target:
                    self._follow(self.root / "tasks" / target)
            template = task.get("ansible.builtin.template")
            if template:
                assert "{{" not in template["src"], (path, "a role's own template, by name")
                self.templates.append(template["src"])

    def set_here(self) -> set[str]:
        """Names the entry point sets itself: registered results, facts, loop and task vars."""
        found: set[str] = set()
        for doc in self.docs:
            for task in _tasks(doc):
                found |= {task["register"]} if "register" in task else set()
                found |= set(task.get("ansible.builtin.set_fact") or {})
                found |= set(task.get("vars") or {})
                found |= {(task.get("loop_control") or {}).get("loop_var", "item")}
        return found

    def reads(self) -> set[str]:
        """Every pd_ name the entry point reads, through vars/ and defaults/, and through the
        role's templates (a template task's, or a template lookup's in an expression)."""
        seen: set[str] = set()
        rendered: set[str] = set()
        todo = [e for doc in self.docs for e in _expressions(doc)]
        for template in self.templates:
            rendered.add(template)
            todo += _template_expressions((self.root / "templates" / template).read_text())
        while todo:
            expression = todo.pop()
            for template in TEMPLATE_LOOKUP.findall(expression):
                if template not in rendered:
                    rendered.add(template)
                    todo += _template_expressions((self.root / "templates" / template).read_text())
            for name in _names(expression) - seen:
                seen.add(name)
                for source in (self.vars, self.defaults):
                    todo += _expressions(source.get(name))
        return seen


def _specs(role: str) -> dict[str, Any]:
    doc = _load(REPO / "roles" / role / "meta" / "argument_specs.yml")
    return dict(doc["argument_specs"])


ENTRIES = [(role, entry) for role in ROLES for entry in _specs(role)]


@pytest.mark.parametrize(("role", "entry"), ENTRIES, ids=[f"{r}:{e}" for r, e in ENTRIES])
def test_an_entry_point_spec_names_exactly_what_it_reads(role: str, entry: str) -> None:
    found = Entry(role, entry)
    inputs = {n for n in found.reads() - found.set_here() if not n.startswith("_")}
    options = set(_specs(role)[entry].get("options") or {})
    assert inputs - options == set(), f"{role}:{entry} reads names its spec lacks"
    assert options - inputs == set(), f"{role}:{entry}'s spec names what it never reads"


@pytest.mark.parametrize("role", ROLES)
def test_the_defaults_are_documented_as_they_are(role: str) -> None:
    """Every default is an option of an entry point, with the same default; the role's own
    settings are pd_<role>_*, its internal values _pd_<role>_* in vars/."""
    defaults = _load(REPO / "roles" / role / "defaults" / "main.yml") or {}
    internal = _load(REPO / "roles" / role / "vars" / "main.yml") or {}
    specs = _specs(role)
    for name, value in defaults.items():
        assert name.startswith(f"{role}_"), name
        documented = [e["options"][name] for e in specs.values() if name in e.get("options", {})]
        assert documented, f"{role}: {name} is in no entry point's spec"
        for option in documented:
            if "default" in option or (value is not None and "{{" not in str(value)):
                assert option.get("default") == value, f"{role}: {name}"
    for name in internal:
        assert name.startswith(f"_{role}_"), name


@pytest.mark.parametrize("role", ROLES)
def test_a_role_keeps_to_itself(role: str) -> None:
    """What a role needs comes in as variables or lives in its own directory: no path leaves
    it (role_path/.., playbook_dir), and its templates are its own."""
    root = REPO / "roles" / role
    for path in sorted(root.rglob("*")):
        assert not path.is_symlink(), path  # on-host code comes in as a variable (pd_onhost)
        if path.is_file() and path.suffix in {".yml", ".j2"}:
            text = path.read_text()
            for outside in ("role_path", "playbook_dir", "../"):
                assert outside not in text, (path, outside)


def test_one_task_file_waits_for_health() -> None:
    """The probe-then-verdict lives in roles/pd_health/tasks/wait.yml; the roles and the
    playbooks include it."""
    content = [
        p
        for top in ("roles", "playbooks")
        for p in (REPO / top).rglob("*.yml")
        if p.is_file() and not p.is_symlink()
    ]
    probing = sorted(
        str(p.relative_to(REPO))
        for p in content
        if re.search(r"from_json\)\.status|unit_probe|pd_health_probe\b", p.read_text())
    )
    assert probing == [
        "playbooks/group_vars/all.yml",  # where the probe is, for the role
        "roles/pd_health/meta/argument_specs.yml",
        "roles/pd_health/tasks/wait.yml",
    ]
    waiting = sorted(str(p.relative_to(REPO)) for p in content if _includes(_load(p), "pd_health"))
    assert waiting == [
        "playbooks/scale.yml",
        "roles/pd_worker/tasks/restart.yml",
    ]
    # The worker hosts', the router's and the scaler's one step (pd_apply) waits on the host,
    # with the same probe.
    applying = (REPO / "pdctl/onhost/host_apply.py").read_text()
    assert "apply(request, probe=unit_probe.probe)" in applying


def _includes(value: Any, role: str) -> bool:
    """Whether a YAML document includes ``role`` anywhere (include_role)."""
    if isinstance(value, list):
        return any(_includes(v, role) for v in value)
    if not isinstance(value, dict):
        return False
    include = value.get("ansible.builtin.include_role")
    if isinstance(include, dict) and include.get("name") == role:
        return True
    return any(_includes(v, role) for v in value.values())


def test_molecule_gives_the_roles_what_the_playbooks_give_them() -> None:
    """The variables playbooks/group_vars/all.yml hands the roles (their on-host code) are the
    ones molecule's inventory hands them: a scenario runs a role as a deploy does."""
    playbooks = yaml.safe_load((REPO / "playbooks/group_vars/all.yml").read_text())
    molecule = yaml.safe_load((REPO / ".config/molecule/config.yml").read_text())
    assert molecule["provisioner"]["inventory"]["group_vars"]["all"] == playbooks
