"""YAML with line numbers: load a document and remember where each value came from.

Errors about a user's file must name the file and line; PyYAML's plain loader
forgets both, and silently keeps the last of two duplicate keys.

pdctl runs as root and reads files it did not write, so reading is bounded: the
text's size, how deep its collections nest, and how many values its aliases
expand to (a "billion laughs" document is a few hundred bytes that expand to
billions of values). Each limit is refused with a YamlError, in well under a
second, instead of exhausting time, memory or the interpreter's stack.

Also the one writer of the YAML pdctl generates (inventories, plan files), so
what it writes passes the same yamllint rules as the hand-written content.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner


class _PythonParser(Reader, Scanner, Parser):
    """PyYAML's own reader, scanner and parser, in Python."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)


_FAST_PARSER: type
try:  # libyaml's parser: a tenth of the Python scanner's time (most of a command's reading)
    from yaml._yaml import CParser as _FAST_PARSER
except ImportError:  # a PyYAML built without libyaml
    _FAST_PARSER = _PythonParser


Path_ = tuple[str | int, ...]
_Entries = dict[Any, tuple[yaml.Node, yaml.Node]]  # key: (key node, value node)

MAX_BYTES = 1 << 20  # 1 MiB: a service file or a fleet's inventory is a few KiB
MAX_DEPTH = 64  # collections within collections; PyYAML's composer recurses per level
MAX_VALUES = 100_000  # values built, each alias counted again for what it repeats

_MERGE_TAG = "tag:yaml.org,2002:merge"
# Tags the resolver gives the plain scalars `<<` and `=`, meaningful only as keys.
_KEY_ONLY_TAGS = frozenset({_MERGE_TAG, "tag:yaml.org,2002:value"})


@dataclass
class Located:
    """A YAML document, the line (1-based) of every mapping key and sequence item, and the
    source text of every scalar.

    ``scalars`` keeps a scalar as written, before YAML 1.1 retypes it (``yes`` is True,
    ``010`` is 8, ``1.10`` is 1.1); ``plain`` holds the paths of the scalars written without
    quotes or a block indicator, the only ones the retyping applies to.
    """

    data: Any
    lines: dict[Path_, int] = field(default_factory=dict)
    scalars: dict[Path_, str] = field(default_factory=dict)
    plain: set[Path_] = field(default_factory=set)

    def line_of(self, loc: Sequence[str | int]) -> int | None:
        """The line of the deepest known prefix of ``loc``."""
        path = tuple(loc)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)

    def source_text(self, loc: Sequence[str | int]) -> str | None:
        """The text of the scalar at ``loc`` as written (None when ``loc`` is no scalar)."""
        return self.scalars.get(tuple(loc))


class YamlError(ValueError):
    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.line = line

    def describe(self, path: Path) -> str:
        """The message prefixed with ``path`` and, when known, the line."""
        where = f"{path}:{self.line}" if self.line else str(path)
        return f"{where}: {self}"


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _too_big(what: str, limit: int) -> YamlError:
    return YamlError(f"{what}, over the limit of {limit} bytes; refusing", None)


class _Bounded(Composer, SafeConstructor, Resolver):
    """PyYAML's SafeLoader, refusing collections nested deeper than MAX_DEPTH, over a parser
    that gives its events (_loader: libyaml's where PyYAML has it, with the same events and
    marks).

    The scanner and parser keep their state on lists, but the composer recurses once per
    level and a few thousand brackets overflow the stack; checking on the way down refuses
    a deep document before the recursion gets there, in the same single pass. The composer
    is PyYAML's own, in Python, so that this check sees every level.
    """

    # The parser's, in the class _loader makes:
    check_event: Callable[..., bool]
    peek_event: Callable[[], Any]
    dispose: Callable[[], None]

    def __init__(self) -> None:
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH and self.check_event(
                yaml.SequenceStartEvent, yaml.MappingStartEvent
            ):
                line = int(self.peek_event().start_mark.line) + 1
                raise YamlError(f"nested deeper than {MAX_DEPTH} levels", line)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _loader(parser: Any) -> Callable[[str], _Bounded]:
    class Loader(_Bounded, parser):  # type: ignore[misc]  # a base chosen at import
        def __init__(self, text: str) -> None:
            parser.__init__(self, text)
            _Bounded.__init__(self)

    return Loader


_new_loader = _loader(_FAST_PARSER)


class _Converter:
    """Python values from a composed document, recording where each one came from.

    The composer shares an aliased node rather than copying it, so aliases are expanded
    here: every value built and every entry a ``<<`` merge pulls in is paid for from one
    budget, which a billion-laughs document exhausts long before it gets expensive.
    """

    def __init__(self, loader: _Bounded, *, lenient: bool) -> None:
        self.loader = loader
        self.lenient = lenient
        self.located = Located(data=None)
        self.budget = MAX_VALUES
        self.open: set[int] = set()  # the collections being converted: an alias to one loops
        self.flat: dict[int, _Entries] = {}  # entries() of each mapping node, by id

    def spend(self, line: int) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise YamlError(
                f"too many values once aliases are expanded (limit {MAX_VALUES}); "
                "refusing: a YAML alias bomb?",
                line,
            )

    def convert(self, node: yaml.Node, path: Path_, line: int) -> Any:
        """``node`` as a Python value; ``line``: where it appears (an alias's, not its anchor's)."""
        self.spend(line)
        self.located.lines[path] = line
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node, path)
        if len(path) >= MAX_DEPTH:
            raise YamlError(
                f"nested deeper than {MAX_DEPTH} levels once aliases are expanded", line
            )
        if id(node) in self.open:
            raise YamlError("an alias refers to a collection that contains it", line)
        self.open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self.mapping(node, path)
            if isinstance(node, yaml.SequenceNode):
                return self.sequence(node, path)
            raise TypeError(f"not a YAML node: {node!r}")  # the composer makes no other kind
        finally:
            self.open.discard(id(node))

    def scalar(self, node: yaml.ScalarNode, path: Path_) -> Any:
        self.located.scalars[path] = node.value
        if not node.style:  # plain: None from PyYAML's parser, "" from libyaml's
            self.located.plain.add(path)
        return self.construct(node)

    def construct(self, node: yaml.ScalarNode) -> Any:
        if node.tag in _KEY_ONLY_TAGS:
            return node.value
        if node.tag not in self.loader.yaml_constructors:
            if self.lenient:
                return node.value  # Ansible's own tags (!unsafe, !vault): the text is the value
            raise YamlError(f"unknown tag {node.tag}", _line(node))
        try:
            return self.loader.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, KeyError, TypeError) as exc:
            raise YamlError(f"cannot read {node.value!r} as {node.tag}", _line(node)) from exc

    def sequence(self, node: yaml.SequenceNode, path: Path_) -> list[Any]:
        items = []
        for index, item in enumerate(node.value):
            items.append(self.convert(item, (*path, index), _line(item)))
        return items

    def mapping(self, node: yaml.MappingNode, path: Path_) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        for key, (key_node, value_node) in self.entries(node, ()).items():
            result[key] = self.convert(value_node, (*path, key), _line(key_node))
        return result

    def key(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise YamlError(
                "a mapping key must be a single value, not a list or mapping", _line(node)
            )
        return self.construct(node)

    def entries(self, node: yaml.MappingNode, chain: tuple[int, ...]) -> _Entries:
        """A mapping's entries with its ``<<`` merges resolved: merged keys first, in order,
        then its own keys, which win over merged ones. ``chain``: the mappings merging this one.

        Worked out once per mapping: an aliased mapping whose entries collapse (equal keys,
        merged keys overridden) would otherwise cost its full length on every repetition
        while the budget saw only the few entries left.
        """
        if id(node) not in self.flat:
            self.flat[id(node)] = self.flatten(node, chain)
        return self.flat[id(node)]

    def flatten(self, node: yaml.MappingNode, chain: tuple[int, ...]) -> _Entries:
        merged: _Entries = {}
        own: _Entries = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                self.merge(merged, value_node, (*chain, id(node)))
                continue
            key = self.key(key_node)
            if key in own and not self.lenient:
                raise YamlError(f"duplicate key {key!r}", _line(key_node))
            own[key] = (key_node, value_node)
        merged.update(own)
        return merged

    def merge(
        self,
        merged: _Entries,
        value: yaml.Node,
        chain: tuple[int, ...],
    ) -> None:
        """Add the entries ``<<: value`` brings that ``merged`` lacks: an earlier mapping of
        a merged list wins over a later one, as the merge key's specification says."""
        sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                raise YamlError("`<<` merges a mapping or a list of mappings", _line(source))
            if id(source) in chain:
                raise YamlError("a mapping merges itself (`<<`)", _line(source))
            if len(chain) >= MAX_DEPTH:
                raise YamlError(f"merges nested deeper than {MAX_DEPTH} levels", _line(source))
            for key, entry in self.entries(source, chain).items():
                self.spend(_line(entry[0]))
                merged.setdefault(key, entry)


def _compose(loader: _Bounded) -> yaml.Node | None:
    try:
        return loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        if "maximum nesting depth" in str(exc.problem):  # libyaml's limit, met while reading ahead
            raise YamlError(f"nested deeper than {MAX_DEPTH} levels", line) from exc
        raise YamlError(f"not valid YAML: {exc.problem or exc}", line) from exc
    except yaml.YAMLError as exc:
        raise YamlError(f"not valid YAML: {exc}", None) from exc


def _check_size(text: str, limit: int) -> None:
    # A character is at least one byte: a text longer than the limit is over it unencoded.
    if len(text) > limit:
        raise _too_big(f"the text is {len(text)} characters", limit)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise _too_big(f"the text is {size} bytes", limit)


def _load(
    text: str, *, limit: int, lenient: bool, new_loader: Callable[[str], _Bounded] = _new_loader
) -> Located:
    _check_size(text, limit)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: no character YAML allows
        raise YamlError(
            f"not valid YAML: unacceptable character #x{ord(text[exc.start]):x}", None
        ) from exc
    try:
        loader = new_loader(text)  # its reader refuses unprintable characters
    except yaml.YAMLError as exc:
        raise YamlError(f"not valid YAML: {exc}".replace("\n", " "), None) from exc
    try:
        node = _compose(loader)
        if node is None:
            return Located(data=None)
        converter = _Converter(loader, lenient=lenient)
        converter.located.data = converter.convert(node, (), _line(node))
        return converter.located
    except RecursionError as exc:
        # The limits keep this to a few hundred frames, but a caller already deep in its own
        # stack could still run out: a refusal, never a traceback.
        raise YamlError("nested too deeply to read", None) from exc
    finally:
        loader.dispose()


def load_text(text: str, *, limit: int = MAX_BYTES) -> Located:
    """One YAML document, refusing duplicate keys, unknown tags and anything over the limits
    (``limit``: the text's size in UTF-8 bytes)."""
    return _load(text, limit=limit, lenient=False)


def read_text_capped(path: Path, limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of ``path``, refused (YamlError) when over ``limit`` bytes without
    reading more than ``limit + 1`` of them. OSError as usual when the file cannot be read."""
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise _too_big(f"the file is {size} bytes", limit)
        # st_size can lie (a file still growing, /proc): never read more than one byte over.
        data = file.read(limit + 1)
    if len(data) > limit:
        raise _too_big("the file reads longer than its stated size", limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlError(f"not UTF-8 text (byte {exc.start})", None) from exc


def load_mapping_file(path: Path, *, limit: int = MAX_BYTES) -> dict[str, Any]:
    """pdctl's own state and Ansible inventory files: a mapping, ``{}`` for an empty file.

    Read as Ansible reads them rather than strictly: a tag PyYAML does not know (Ansible's
    ``!unsafe``, ``!vault``) gives the scalar's text, and of two equal keys the last wins.
    """
    data = _load(read_text_capped(path, limit), limit=limit, lenient=True).data
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise YamlError("expected a mapping at the top", 1)
    return data


class IndentedDumper(yaml.SafeDumper):
    """Indents a sequence under its key, as yamllint's default ``indentation`` rule wants."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def dump_text(doc: Any) -> str:
    """``doc`` as block-style YAML, keys in their given order."""
    return yaml.dump(
        doc, Dumper=IndentedDumper, sort_keys=False, default_flow_style=False, width=120
    )
