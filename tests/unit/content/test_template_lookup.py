"""pd_template (playbooks/lookup_plugins/pd_template.py): ansible.builtin.template's lookup,
reading the task's variables in place instead of deep-copying them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import lookup_loader
from ansible.template import Templar

from pdctl.doors.content import content_root

TEMPLATE = (
    "{# a comment #}\n"
    "{% for name in names %}{{ name }}={{ group }}\n{% endfor %}"
    "{% if plan.slots %}slots={{ plan.slots | length }}{% endif %}\n"  # trim_blocks eats this \n
    "{{ template_path | basename }}\n"
)


class _RefusesCopy(dict[str, Any]):
    """A variable that fails its task when deep-copied (as the plan's tagged values cost)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise AssertionError("the variables were deep-copied")


@pytest.fixture(scope="module", autouse=True)
def _plugins() -> None:
    """Ansible's lookup loader finds pdctl's lookups, as ansible.cfg's lookup_plugins says."""
    lookup_loader.add_directory(str(content_root() / "playbooks" / "lookup_plugins"))


def _render(name: str, variables: dict[str, Any], **options: Any) -> list[str]:
    loader = DataLoader()
    lookup = lookup_loader.get(
        name, loader=loader, templar=Templar(loader=loader, variables=variables)
    )
    assert lookup is not None, name
    result: list[str] = lookup.run(["unit.j2"], variables=variables, **options)
    return result


@pytest.fixture
def variables(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "unit.j2").write_text(TEMPLATE)
    return {
        "ansible_search_path": [str(tmp_path)],
        "names": ["prefill", "decode"],
        "plan": {"slots": [1, 2, 3]},
    }


def test_it_renders_what_the_builtin_lookup_renders(variables: dict[str, Any]) -> None:
    options = {"template_vars": {"group": "g1"}}
    ours = _render("pd_template", variables, **options)
    assert ours == _render("template", variables, **options)
    assert ours == ["prefill=g1\ndecode=g1\nslots=3unit.j2\n"]


def test_it_reads_the_variables_in_place_and_leaves_them_as_they_were(
    variables: dict[str, Any],
) -> None:
    variables["plan"] = _RefusesCopy(slots=[1])
    before = dict(variables)
    with pytest.raises(AssertionError, match="deep-copied"):
        _render("template", variables, template_vars={"group": "g"})  # what it saves
    assert _render("pd_template", variables, template_vars={"group": "g"}) == [
        "prefill=g\ndecode=g\nslots=1unit.j2\n"
    ]
    assert variables == before  # template_vars and template_path went to a layer of its own


def test_the_roles_render_their_templates_with_it() -> None:
    roles = content_root() / "roles"
    texts = "\n".join(path.read_text() for path in roles.rglob("*.yml"))
    assert "lookup('pd_template'" in texts
    assert "lookup('ansible.builtin.template'" not in texts
