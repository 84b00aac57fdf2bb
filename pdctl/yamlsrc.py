"""YAML with line numbers: load a document and remember where each value came from.

Errors about a user's file must name the file and line; PyYAML's plain loader
forgets both, and silently keeps the last of two duplicate keys.

Also the one writer of the YAML pdctl generates (inventories, plan files), so
what it writes passes the same yamllint rules as the hand-written content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


@dataclass
class Located:
    """A YAML document and the line (1-based) of every mapping key and sequence item."""

    data: Any
    lines: dict[Path_, int] = field(default_factory=dict)

    def line_of(self, loc: Sequence[str | int]) -> int | None:
        """The line of the deepest known prefix of ``loc``."""
        path = tuple(loc)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)


class YamlError(ValueError):
    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.line = line


def _convert(node: yaml.Node, path: Path_, lines: dict[Path_, int], loader: yaml.SafeLoader) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if key in result:
                raise YamlError(f"duplicate key {key!r}", key_node.start_mark.line + 1)
            lines[(*path, key)] = key_node.start_mark.line + 1
            result[key] = _convert(value_node, (*path, key), lines, loader)
        return result
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            items.append(_convert(item, (*path, index), lines, loader))
        return items
    return loader.construct_object(node, deep=True)


def load_text(text: str) -> Located:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise YamlError(
            f"not valid YAML: {exc.problem or exc}", mark.line + 1 if mark else None
        ) from exc
    except yaml.YAMLError as exc:
        raise YamlError(f"not valid YAML: {exc}", None) from exc
    if node is None:
        return Located(data=None)
    lines: dict[Path_, int] = {}
    return Located(data=_convert(node, (), lines, yaml.SafeLoader("")), lines=lines)


def load_file(path: Path) -> Located:
    return load_text(path.read_text())


class _IndentedDumper(yaml.SafeDumper):
    """Indents a sequence under its key, as yamllint's default ``indentation`` rule wants."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def dump_text(doc: Any) -> str:
    """``doc`` as block-style YAML, keys in their given order."""
    return yaml.dump(
        doc, Dumper=_IndentedDumper, sort_keys=False, default_flow_style=False, width=120
    )
