"""yamlsrc: line-tracking YAML that stays bounded on hostile input (alias bombs, deep nesting,
huge files), keeps scalars as written, and reads Ansible's tagged inventory values."""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdctl.core import yamlsrc
from pdctl.core.errors import InputError
from pdctl.core.yamlsrc import (
    MAX_BYTES,
    MAX_DEPTH,
    YamlError,
    load_mapping_file,
    load_text,
    read_text_capped,
)
from pdctl.doors import inventory
from pdctl.operations import drift

# CPU seconds: a refusal must come long before any expansion gets expensive (an unbounded
# expansion takes minutes). CPU time, not wall time: other tests share the machine's cores.
FAST = 1.0
ROOT = Path(__file__).resolve().parents[3]


def refused(load: Callable[[], Any], match: str) -> YamlError:
    """The YamlError ``load`` raises, checked to come in under FAST CPU seconds."""
    start = time.process_time()
    with pytest.raises(YamlError, match=match) as caught:
        load()
    elapsed = time.process_time() - start
    assert elapsed < FAST, f"refused after {elapsed:.2f} CPU s"
    return caught.value


# Alias bombs: each level repeats the previous one 10 times, 9 levels: 10**9 values.


def lol_sequences() -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 10) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


def lol_mappings() -> str:
    lines = ["a0: &a0 {" + ", ".join(f"k{j}: lol" for j in range(10)) + "}"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(10)) + "}")
    return "\n".join(lines) + "\n"


def lol_merges() -> str:
    """Each level merges the one before (`<<: *a`) and holds it ten times more."""
    lines = ["a0: &a0 {" + ", ".join(f"k{j}: lol" for j in range(10)) + "}"]
    for i in range(1, 9):
        held = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i}\n  <<: *a{i - 1}\n  v{i}: [{held}]")
    return "\n".join(lines) + "\n"


def lol_merge_lists() -> str:
    """Merges of merged lists: each level pulls in ten copies of the previous one's entries."""
    lines = ["a0: &a0 {" + ", ".join(f"k{j}: [lol, lol]" for j in range(10)) + "}"]
    for i in range(1, 9):
        sources = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i}\n  <<: [{sources}]\n  v{i}: [{sources}]")
    return "\n".join(lines) + "\n"


BOMBS = {
    "sequences": lol_sequences,
    "mappings": lol_mappings,
    "merges": lol_merges,
    "merge lists": lol_merge_lists,
}


@pytest.mark.parametrize("shape", sorted(BOMBS))
def test_alias_bomb_is_refused_fast(shape: str) -> None:
    text = BOMBS[shape]()
    assert len(text) < 2000  # a few hundred bytes ...
    error = refused(lambda: load_text(text), "too many values once aliases are expanded")
    assert f"limit {yamlsrc.MAX_VALUES}" in str(error) and "alias bomb" in str(error)
    assert error.line is not None


def test_alias_bomb_in_an_inventory_file_is_refused_fast(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yml"
    path.write_text(lol_merges())
    refused(lambda: load_mapping_file(path), "alias bomb")


def test_collapsing_aliased_mapping_does_not_cost_its_length_each_time(tmp_path: Path) -> None:
    # 20000 equal keys (the inventory loader keeps the last, as Ansible does) collapse to one
    # entry; repeated 20000 times it must not cost 20000 x 20000 steps.
    text = "a: &a {" + ", ".join(["k: 1"] * 20000) + "}\nb: [" + ", ".join(["*a"] * 20000) + "]\n"
    path = tmp_path / "vars.yml"
    path.write_text(text)
    start = time.process_time()
    doc = load_mapping_file(path)
    assert doc["a"] == {"k": 1} and len(doc["b"]) == 20000
    assert time.process_time() - start < 10 * FAST  # composing 260 KB dominates; quadratic: hours


def test_self_referencing_aliases_are_refused() -> None:
    refused(lambda: load_text("a: &a [x, *a]\n"), "refers to a collection that contains it")
    refused(lambda: load_text("a: &a {x: {y: *a}}\n"), "refers to a collection that contains it")
    refused(lambda: load_text("a: &a {<<: *a, x: 1}\n"), "merges itself")
    refused(lambda: load_text("a: &a {<<: *b}\nb: &b {<<: *a}\n"), "not valid YAML")  # *b unknown


# Depth: PyYAML's composer recurses once per level and overflows at about a thousand.


def block_mappings(depth: int) -> str:
    return "".join(" " * level + "a:\n" for level in range(depth))


DEEP = {
    "flow sequences": "[" * 2000 + "]" * 2000,
    "flow mappings": "{a: " * 2000 + "}" * 2000,
    "block sequences": "- " * 2000 + "x\n",
    "mixed": ("a:\n  - " + "[" * 2000 + "]" * 2000) + "\n",
}


@pytest.mark.parametrize("shape", sorted(DEEP))
def test_deep_nesting_is_refused_cleanly(shape: str) -> None:
    error = refused(lambda: load_text(DEEP[shape]), f"nested deeper than {MAX_DEPTH} levels")
    assert error.line is not None


def test_deep_block_mappings_are_refused_cleanly() -> None:
    text = block_mappings(2000)  # 2 MB of indentation: lift the size limit to reach the nesting
    error = refused(lambda: load_text(text, limit=len(text)), f"nested deeper than {MAX_DEPTH}")
    assert error.line == MAX_DEPTH + 1


def test_nesting_up_to_the_limit_is_accepted() -> None:
    deepest = load_text("[" * MAX_DEPTH + "x" + "]" * MAX_DEPTH).data
    for _ in range(MAX_DEPTH):
        assert isinstance(deepest, list) and len(deepest) == 1
        deepest = deepest[0]
    assert deepest == "x"
    assert load_text(block_mappings(MAX_DEPTH)).line_of(["a"] * MAX_DEPTH) == MAX_DEPTH
    with pytest.raises(YamlError, match="nested deeper"):
        load_text("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))


def test_depth_gained_through_aliases_is_refused() -> None:
    inner = "[" * 40 + "x" + "]" * 40
    outer = "[" * 40 + "*a" + "]" * 40
    error = refused(lambda: load_text(f"a: &a {inner}\nb: {outer}\n"), "once aliases are expanded")
    assert error.line == 1  # where the 65th level is written: inside the anchored value


def test_recursion_error_becomes_a_yaml_error() -> None:
    # Within the limits the stack never runs out; on a stack already nearly full it may.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + 40)
    try:
        with pytest.raises(YamlError, match="nested too deeply"):
            load_text("[" * 60 + "]" * 60)
    finally:
        sys.setrecursionlimit(limit)


# Size.


def test_text_over_the_size_limit_is_refused() -> None:
    error = refused(lambda: load_text("a: " + "x" * MAX_BYTES), f"limit of {MAX_BYTES} bytes")
    assert f"{MAX_BYTES + 3} characters" in str(error)
    # Under the limit in characters, over it in UTF-8 bytes.
    wide = "a: " + "é" * (MAX_BYTES // 2)
    assert len(wide) <= MAX_BYTES
    assert f"{MAX_BYTES + 3} bytes" in str(refused(lambda: load_text(wide), "over the limit"))


def test_size_limit_can_be_changed() -> None:
    with pytest.raises(YamlError, match="the text is 5 characters, over the limit of 4 bytes"):
        load_text("a: 1\n", limit=4)
    assert load_text("a: 1\n", limit=5).data == {"a": 1}
    # Raised above the default: see test_deep_block_mappings_are_refused_cleanly.


def test_read_text_capped_refuses_a_big_file_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "huge.yml"
    with path.open("wb") as file:
        file.truncate(64 << 30)  # 64 GiB, sparse: reading it all would take minutes and memory
    error = refused(lambda: read_text_capped(path, MAX_BYTES), f"{64 << 30} bytes")
    assert f"limit of {MAX_BYTES} bytes" in str(error)
    refused(lambda: load_mapping_file(path), "over the limit")


def test_read_text_capped_reads_at_most_one_byte_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "proc-like"
    path.write_bytes(b"x" * 100)
    real_fstat = os.fstat

    def lying_fstat(fd: int) -> os.stat_result:  # as /proc files do: st_size 0
        fields = list(real_fstat(fd))
        fields[6] = 0
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", lying_fstat)
    with pytest.raises(YamlError, match="reads longer than its stated size"):
        read_text_capped(path, 99)
    assert read_text_capped(path, 100) == "x" * 100


def test_read_text_capped_takes_utf8_only(tmp_path: Path) -> None:
    path = tmp_path / "a.yml"
    path.write_bytes("a: é\n".encode())
    assert read_text_capped(path, 6) == "a: é\n"
    path.write_bytes(b"a: \xff\n")
    with pytest.raises(YamlError, match=r"not UTF-8 text \(byte 3\)"):
        read_text_capped(path)
    with pytest.raises(FileNotFoundError):
        read_text_capped(tmp_path / "missing.yml")


# What the loader keeps: lines, duplicates refused, anchors, merges, source text.


def test_duplicate_keys_are_refused_with_their_line() -> None:
    with pytest.raises(YamlError, match="duplicate key 'b'") as caught:
        load_text("a: 1\nb: 2\nc:\n  x: 1\nb: 3\n")
    assert caught.value.line == 5
    with pytest.raises(YamlError, match="duplicate key 'x'") as caught:
        load_text("a:\n  x: 1\n  y: 2\n  x: 3\n")
    assert caught.value.line == 4


def test_ordinary_anchors_aliases_and_merges_are_accepted() -> None:
    text = (
        "defaults: &defaults\n"
        "  image: lmsysorg/sglang:v0.4\n"
        "  env: &env [A=1, B=2]\n"
        "prefill:\n"
        "  <<: *defaults\n"
        "  image: custom\n"
        "decode:\n"
        "  <<: *defaults\n"
        "  extra: *env\n"
        "both: [*env, *env]\n"
    )
    located = load_text(text)
    env = ["A=1", "B=2"]
    assert located.data == {
        "defaults": {"image": "lmsysorg/sglang:v0.4", "env": env},
        "prefill": {"image": "custom", "env": env},
        "decode": {"image": "lmsysorg/sglang:v0.4", "env": env, "extra": env},
        "both": [env, env],
    }
    assert list(located.data["prefill"]) == ["image", "env"]  # merged keys first, in order
    assert located.line_of(("prefill", "image")) == 6  # its own value's line
    assert located.line_of(("decode", "image")) == 2  # a merged value: where it is written
    assert located.line_of(("decode", "extra", 1)) == 3
    assert located.line_of(("both",)) == 10


def test_merge_precedence_follows_the_merge_key_spec() -> None:
    text = "a: &a {x: a, y: a}\nb: &b {x: b, z: b}\nc:\n  <<: [*a, *b]\n  y: own\n"
    assert load_text(text).data["c"] == {"x": "a", "y": "own", "z": "b"}


def test_a_large_alias_free_document_is_accepted() -> None:
    text = "".join(f"key{i}: [{i}, value]\n" for i in range(20000))
    data = load_text(text).data
    assert len(data) == 20000 and data["key19999"] == [19999, "value"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("? [a, b]\n: 1\n", "a mapping key must be a single value"),
        ("a: !custom x\n", "unknown tag !custom"),
        ("a: !!int nope\n", "cannot read 'nope' as tag:yaml.org,2002:int"),
        ("a: !!bool maybe\n", "cannot read 'maybe'"),
        ("a: 1\n---\nb: 2\n", "not valid YAML"),
        ("a: &x [1]\nb: {<<: [1, 2]}\n", "`<<` merges a mapping or a list of mappings"),
    ],
)
def test_malformed_documents_raise_yaml_errors(text: str, message: str) -> None:
    with pytest.raises(YamlError, match=message) as caught:
        load_text(text)
    assert caught.value.line is not None


def test_source_text_keeps_scalars_as_written() -> None:
    text = (
        "env:\n"
        "  A: yes\n"
        "  B: 010\n"
        "  C: 1.10\n"
        "  D: 0x1F\n"
        "  E: ~\n"
        '  F: "quoted"\n'
        "  G: 'single'\n"
        "  H: &h on\n"
        "  I: *h\n"
        "  J: |\n    two\n    lines\n"
        "  K:\n"
    )
    located = load_text(text)
    assert located.data["env"] == {
        "A": True,
        "B": 8,
        "C": 1.1,
        "D": 31,
        "E": None,
        "F": "quoted",
        "G": "single",
        "H": True,
        "I": True,
        "J": "two\nlines\n",
        "K": None,
    }
    written = {key: located.source_text(("env", key)) for key in located.data["env"]}
    assert written == {
        "A": "yes",
        "B": "010",
        "C": "1.10",
        "D": "0x1F",
        "E": "~",
        "F": "quoted",
        "G": "single",
        "H": "on",
        "I": "on",
        "J": "two\nlines\n",
        "K": "",
    }
    plain = {key for key in located.data["env"] if ("env", key) in located.plain}
    assert plain == {"A", "B", "C", "D", "E", "H", "I", "K"}
    assert located.source_text(("env",)) is None  # a mapping, not a scalar
    assert located.source_text(("env", "missing")) is None


def test_load_text_keeps_empty_documents_empty() -> None:
    assert load_text("").data is None
    assert load_text("# only a comment\n").data is None


# The inventory loader: Ansible's tags, empty files, and its two callers.

INVENTORY = """\
---
# Written by pdctl
all:
  children:
    pd_gpu_hosts:
      hosts:
        gpu1:
          ansible_host: !unsafe 10.0.0.1
          ansible_port: 2222
          !unsafe note: !unsafe "{{ lookup('pipe', 'id') }}"
  vars:
    secret: !vault |
      $ANSIBLE_VAULT;1.1;AES256
      6162
    yes_as_written: !unsafe yes
"""


def test_load_mapping_file_reads_ansible_tags_as_text(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yml"
    path.write_text(INVENTORY)
    doc = load_mapping_file(path)
    gpu1 = doc["all"]["children"]["pd_gpu_hosts"]["hosts"]["gpu1"]
    assert gpu1 == {
        "ansible_host": "10.0.0.1",
        "ansible_port": 2222,
        "note": "{{ lookup('pipe', 'id') }}",
    }
    assert doc["all"]["vars"] == {
        "secret": "$ANSIBLE_VAULT;1.1;AES256\n6162\n",
        "yes_as_written": "yes",
    }
    with pytest.raises(YamlError, match="unknown tag !unsafe"):
        load_text(INVENTORY)  # a service file gets no such leniency


def test_load_mapping_file_empty_and_non_mapping(tmp_path: Path) -> None:
    path = tmp_path / "vars.yml"
    path.write_text("")
    assert load_mapping_file(path) == {}
    path.write_text("---\n# nothing yet\n")
    assert load_mapping_file(path) == {}
    path.write_text("- a\n- b\n")
    with pytest.raises(YamlError, match="expected a mapping at the top"):
        load_mapping_file(path)
    path.write_text("a: 1\na: 2\n")  # as safe_load and Ansible do: the last wins
    assert load_mapping_file(path) == {"a": 2}


def test_inventory_reports_bad_files_with_path_and_hint(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yml"
    path.write_text("all:\n  hosts: [x\n")
    with pytest.raises(InputError, match=r"hosts\.yml:3: not valid YAML") as caught:
        inventory._read_yaml(path)
    assert str(path) in caught.value.message and caught.value.hint == "fix or remove the file"
    path.write_text(lol_sequences())
    with pytest.raises(InputError, match="alias bomb"):
        inventory._read_yaml(path)
    path.write_text("- a list\n")
    with pytest.raises(InputError, match=r"hosts\.yml:1: expected a mapping at the top"):
        inventory._read_yaml(path)
    path.write_text(INVENTORY)
    assert inventory._read_yaml(path)["all"]["vars"]["yes_as_written"] == "yes"
    assert inventory._read_yaml(tmp_path / "missing.yml") == {}


def test_drift_digest_reads_tagged_host_vars_and_refuses_bombs(tmp_path: Path) -> None:
    host_vars = tmp_path / "host_vars" / "gpu1.yml"
    host_vars.parent.mkdir()
    host_vars.write_text("x: !unsafe '{{ a }}'\npd_facts: {gpus: 8}\n")
    base = drift.inputs_digest(bytes(32), {}, tmp_path)
    host_vars.write_text("pd_facts: {gpus: 4}\nx: !unsafe '{{ a }}'\n")
    assert drift.inputs_digest(bytes(32), {}, tmp_path) == base
    host_vars.write_text(lol_mappings())
    with pytest.raises(InputError, match=r"gpu1\.yml:\d+: too many values"):
        drift.inputs_digest(bytes(32), {}, tmp_path)


# What users bring (dstack's published files, the examples) and the shapes this module cares
# about: lines, scalars as written, plain or quoted, merges, tags, Ansible's tags.
SAME_DOCUMENTS = [
    *sorted(str(p) for p in (ROOT / "tests" / "data").rglob("*.yml")),
    *sorted(str(p) for p in (ROOT / "examples").rglob("*.yml")),
]


@pytest.mark.parametrize("path", SAME_DOCUMENTS, ids=lambda p: Path(p).name)
def test_libyamls_parser_reads_what_pyyamls_own_reads(path: str) -> None:
    """The libyaml parser (the fast path) gives the same document, lines, scalars and plain
    scalars as PyYAML's Python parser: only the speed differs."""
    text = Path(path).read_text(encoding="utf-8")
    python = yamlsrc._loader(yamlsrc._PythonParser)
    for lenient in (True, False):
        try:
            slow = yamlsrc._load(text, limit=MAX_BYTES, lenient=lenient, new_loader=python)
        except YamlError as exc:
            with pytest.raises(YamlError) as fast_error:
                yamlsrc._load(text, limit=MAX_BYTES, lenient=lenient)
            assert (fast_error.value.line, str(fast_error.value)) == (exc.line, str(exc))
            continue
        fast = yamlsrc._load(text, limit=MAX_BYTES, lenient=lenient)
        assert (fast.data, fast.lines, fast.scalars, fast.plain) == (
            slow.data,
            slow.lines,
            slow.scalars,
            slow.plain,
        )


def test_the_fast_parser_is_libyamls_where_pyyaml_has_it() -> None:
    assert yaml.__with_libyaml__ == (yamlsrc._FAST_PARSER is not yamlsrc._PythonParser)


@pytest.mark.parametrize("text", ["a: \ud800\n", "a: b\x07\n", "a: \x00\n"])
def test_characters_yaml_does_not_allow_are_refused(text: str) -> None:
    """A lone surrogate (a str from a hostile caller) or a control character: one YamlError,
    never an encoder's or parser's own exception."""
    with pytest.raises(YamlError, match=r"not valid YAML: .*(unacceptable|control|special)"):
        load_text(text)
