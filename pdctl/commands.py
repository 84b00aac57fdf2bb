"""A worker group's `commands` as the container's entrypoint script. PURE: stdlib only.

The commands come from a service file, which is untrusted input, and become lines of
a script that `/bin/sh` (dash in Debian images) runs. So they are parsed as POSIX shell
rather than matched with regexes: every rewrite is a splice at a word's span in the
original text (all other quoting and `$VARS` stay as written), and a command that pdctl
cannot rewrite with certainty is refused with a CommandError saying how to write it
instead. A script is never produced silently broken.

The script is ``set -e`` and then the commands, one per line, as written except that
- the launch command (SGLang's ``python -m sglang.launch_server ...``, vLLM's
  ``vllm serve ... --grpc`` or ``python -m vllm.entrypoints.grpc_server``: pdctl/launch.py)
  gets the slot's ports: ``--port $PDCTL_PORT``, ``--host $PDCTL_HOST`` unless a host is
  given and, for an SGLang prefill, ``--disaggregation-bootstrap-port $PDCTL_BOOTSTRAP_PORT``;
  and the flags the plan adds (``--enable-metrics`` for latency scaling: spec.added_flags);
- the last command runs with ``exec``: it replaces the shell, so it is the container's
  PID 1 and gets the SIGTERM of a stop, on which SGLang drains (a shell as PID 1 would
  not pass the signal on).

Every command must be complete on its own (quotes, here-documents, `if ... fi`), so
that joining them as lines cannot change how any of them parses.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pdctl import launch as launches
from pdctl import layout
from pdctl.launch import Launch, LaunchError

__all__ = [
    "BOOTSTRAP_PORT",
    "HOST",
    "PORT",
    "CommandError",
    "Word",
    "find_launch",
    "shell_words",
    "worker_script",
]


class CommandError(ValueError):
    """A command that pdctl cannot turn into a correct script line."""

    index: int | None  # which command of the list, from 0 (None: the list as a whole)
    problem: str  # what is wrong, one sentence
    hint: str  # how to write it instead

    def __init__(self, problem: str, hint: str, index: int | None = None) -> None:
        super().__init__(problem, hint, index)
        self.problem = problem
        self.hint = hint
        self.index = index

    def __str__(self) -> str:
        where = "commands" if self.index is None else f"commands[{self.index}]"
        return f"{where}: {self.problem} ({self.hint})"

    def at(self, index: int) -> CommandError:
        return CommandError(self.problem, self.hint, index)


@dataclass(frozen=True)
class Word:
    """One shell word: where it is in the command, and what the program receives."""

    start: int
    end: int
    text: str  # as written
    value: str  # quotes and escapes removed; expansions ($X, $(...), `...`) kept as written


def shell_words(command: str) -> list[Word]:
    """The words of one command, in order (those of `$(...)` stay inside their word).

    Assignments before a command are not words of it. CommandError when the command is not
    complete, valid shell on its own.
    """
    return _parse(command).words


PORT = f"${layout.ENV_PORT}"
HOST = f"${layout.ENV_HOST}"
BOOTSTRAP_PORT = f"${layout.ENV_BOOTSTRAP_PORT}"


def worker_script(
    commands: list[str], role: Literal["prefill", "decode"], add: tuple[str, ...] = ()
) -> str:
    """The group's commands as the container's shell script, wired to the slot's ports;
    ``add``: flags (without values) the launch gets unless it has them (spec.added_flags)."""
    if not commands:
        raise CommandError(
            "the group has no commands",
            "add the command that starts the server: python -m sglang.launch_server ...",
        )
    parsed = _parse_all(commands)
    last = len(parsed) - 1
    found = _find_launch(parsed)
    if found is not None and found[0] != last:
        raise CommandError(
            f"the {found[1].name} launch command must be the group's last command",
            "move the commands after it before it: pdctl runs the last command with exec, so "
            "that the server is the container's PID 1 and gets the SIGTERM that makes it drain",
            found[0],
        )
    for index, command in enumerate(parsed[:-1]):
        _check_not_exec(command, index)
    try:
        final = _last_line(parsed[-1], role, found[1] if found is not None else None, add)
    except CommandError as exc:
        raise exc.at(last) from None
    lines = ["set -e", *(command.text[: command.end] for command in parsed[:-1]), final]
    return "\n".join(lines) + "\n"


def _parse_all(commands: list[str]) -> list[_Command]:
    """Each command parsed; a CommandError names the command's index."""
    parsed: list[_Command] = []
    for index, text in enumerate(commands):
        try:
            parsed.append(_parse(text))
        except CommandError as exc:
            raise exc.at(index) from None
    return parsed


def find_launch(commands: list[str]) -> Launch | None:
    """The server launch among a group's commands (None: none of them starts one), with its
    engine and, for vLLM, its KV connector and role. CommandError as worker_script's."""
    found = _find_launch(_parse_all(commands))
    return found[1] if found is not None else None


# --- the launch command and the last command ---------------------------------------------

_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Builtins with no program of the same name: `exec` cannot run them.
_SHELL_ONLY = frozenset(
    {
        ".", ":", "alias", "bg", "break", "cd", "command", "continue", "eval", "exit",
        "export", "fg", "getopts", "hash", "jobs", "local", "read", "readonly", "return",
        "set", "shift", "source", "times", "trap", "type", "ulimit", "umask", "unalias",
        "unset", "wait",
    }
)  # fmt: skip
_SPLIT_HINT = (
    "put setup such as `cd DIR` or `export X=1` in its own command before it: each command "
    "is a line of the script, run under set -e"
)
_LINE_BREAK_HINT = (
    "continue a long command with a `\\` at the end of each line; a `#` comment runs to the "
    "end of its line and takes that `\\` with it, so put comments after the last line"
)


def _find_launch(parsed: list[_Command]) -> tuple[int, Launch] | None:
    """The index of the group's launch command and what it launches, checked to be a plain
    command."""
    launch: tuple[int, Launch] | None = None
    for index, command in enumerate(parsed):
        try:
            found = _launch_in(command.words)
        except CommandError as exc:
            raise exc.at(index) from None
        if found is None:
            code = command.code()
            mention = next((m for m in launches.MENTIONS if m in code), None)
            if mention is not None:
                raise CommandError(
                    f"the command mentions {mention}, but not as a command that pdctl can "
                    "give the slot's ports: it is inside quotes, a variable or a substitution",
                    "write the launch as a command of its own: python -m sglang.launch_server "
                    "..., vllm serve MODEL --grpc ...",
                    index,
                )
            continue
        try:
            simple = _plain(command, launch=found.name)
            found = _launch_in(simple.words) or found
        except CommandError as exc:
            raise exc.at(index) from None
        if launch is not None:
            raise CommandError(
                f"the group has a second launch command; the first is commands[{launch[0]}]",
                "keep one: each replica of the group runs one server",
                index,
            )
        launch = (index, found)
    return launch


def _launch_in(words: list[Word]) -> Launch | None:
    try:
        return launches.find([word.value for word in words])
    except LaunchError as exc:
        raise CommandError(exc.problem, exc.hint) from None


def _check_not_exec(command: _Command, index: int) -> None:
    for item in command.items:
        simple = item.simple
        if simple is not None and len(simple.words) > 1 and simple.words[0].value == "exec":
            raise CommandError(
                "only the last command may exec a program: the commands after this one would "
                "never run",
                "drop the `exec`: pdctl adds it to the last command",
                index,
            )


def _plain(command: _Command, *, launch: str | None) -> _Simple:
    """The command as one simple command, or a CommandError naming what is in the way."""
    items = command.items
    if not items:
        raise CommandError(
            "the last command is empty, but it must start the server",
            "end the commands with the one that starts the server",
        )
    found = ""
    hint = _SPLIT_HINT
    if len(items) > 1 or items[0].separator:
        separator = items[0].separator
        found = "a line break" if separator == "\n" else f"`{separator}`"
        if separator == "\n":
            hint = _LINE_BREAK_HINT
    elif items[0].simple is None:
        found = f"`{command.constructs[0]}`" if command.constructs else "a compound command"
    elif launch and items[0].simple.redirections:
        found = f"`{items[0].simple.redirections[0]}`"
        hint = "drop the redirection: the server's output goes to the unit's journal"
    simple = items[0].simple
    if found or simple is None:
        if launch:
            raise CommandError(
                f"the {launch} launch command must be a plain command of its own, "
                f"but it has {found}",
                hint,
            )
        raise CommandError(
            "the last command must be a plain command, which pdctl runs with exec so that it "
            f"is the container's PID 1 and gets SIGTERM, but it has {found}",
            "make the server launch the last command, on its own, and move the rest into "
            "commands before it",
        )
    return simple


_Edit = tuple[int, int, str]


def _last_line(
    command: _Command,
    role: Literal["prefill", "decode"],
    launch: Launch | None,
    add: tuple[str, ...],
) -> str:
    simple = _plain(command, launch=launch.name if launch is not None else None)
    edits = _exec_edits(simple)
    if launch is not None:
        edits += _port_edits(simple, role, launch, add)
    text = command.text[: command.end]
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def _exec_edits(simple: _Simple) -> list[_Edit]:
    if not simple.words:
        raise CommandError(
            "the last command only sets variables, so the container has no program to run",
            "end the commands with the one that starts the server",
        )
    first = simple.words[0]
    if first.value == "exec":
        if len(simple.words) == 1:
            raise CommandError(
                "the last command is an `exec` without a program",
                "end the commands with the one that starts the server",
            )
        return []
    if first.value in _SHELL_ONLY:
        raise CommandError(
            f"the last command runs the shell builtin `{first.value}`, which exec cannot run",
            "end the commands with the one that starts the server",
        )
    # `A=1 exec prog` exports A to prog in POSIX sh (dash too); `exec A=1 prog` would not.
    return [(first.start, first.start, "exec ")]


def _port_edits(
    simple: _Simple, role: Literal["prefill", "decode"], launch: Launch, add: tuple[str, ...]
) -> list[_Edit]:
    words = simple.words
    args = words[launch.at + 1 :]
    appended = "".join(f" {flag}" for flag in add if not launch.has_flag(flag))
    wanted = [("--port", PORT, True), ("--host", HOST, False)]
    # vLLM's NIXL side channel takes its port from the environment (the slot's env file).
    if role == "prefill" and launch.engine == "sglang":
        wanted.append(("--disaggregation-bootstrap-port", BOOTSTRAP_PORT, True))
    edits: list[_Edit] = []
    for flag, value, replace in wanted:
        found = False
        for index, word in enumerate(args):
            name, inline, _ = word.value.partition("=")
            if not _abbreviates(name, flag):
                continue
            found = True
            if inline:
                if replace:
                    edits.append((word.start, word.end, f"{flag}={value}"))
                continue
            if index + 1 == len(args) or args[index + 1].value.startswith("-"):
                raise CommandError(
                    f"`{word.text}` has no value",
                    f"write `{flag} VALUE`, or leave the flag out: pdctl sets it for each slot",
                )
            if replace:
                following = args[index + 1]
                edits.append((following.start, following.end, value))
        if not found:
            appended += f" {flag} {value}"
    if appended:
        # After the last word: before a trailing comment, continuation or line break.
        edits.append((words[-1].end, words[-1].end, appended))
    return edits


def _abbreviates(name: str, flag: str) -> bool:
    """Whether argparse reads option `name` as `flag` (it takes unambiguous prefixes)."""
    return len(name) > 2 and name.startswith("--") and flag.startswith(name)


# --- characters --------------------------------------------------------------------------

_CHARACTER_NAMES = {
    "\0": "a NUL byte",
    "\b": "a backspace",
    "\v": "a vertical tab",
    "\f": "a form feed",
    "\r": "a carriage return",
    "\x1b": "an escape character",
    "\x7f": "a delete character",
}


def _check_characters(text: str) -> None:
    for pos, char in enumerate(text):
        if char.isprintable() or char in "\n\t":
            continue
        category = unicodedata.category(char)
        name = _CHARACTER_NAMES.get(char) or (
            "a control character"
            if category == "Cc"
            else unicodedata.name(char, "an unprintable character").lower()
        )
        if char == "\r":
            hint = "save the file with Unix line endings, LF rather than CRLF"
        elif category == "Zs":
            hint = "replace it with a plain space: the shell does not split words at it"
        else:
            hint = "remove it: a command may hold printable text, spaces, tabs and line breaks"
        raise CommandError(
            f"the command contains {name} (U+{ord(char):04X}) on line {_line(text, pos)}", hint
        )


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# --- the shell scanner -------------------------------------------------------------------

_OPERATOR_CHARS = frozenset(";&|<>()")
# Longest first, so that `<<-` is not read as `<<` and then `-`.
_OPERATORS = (
    "<<-", "&&", "||", ";;", "<<", ">>", "<&", ">&", "<>", ">|",
    ";", "&", "|", "<", ">", "(", ")",
)  # fmt: skip
_REDIRECTIONS = frozenset({"<", ">", ">>", "<&", ">&", "<>", ">|", "<<", "<<-"})
_OPENERS = frozenset({"if", "while", "until", "for", "case", "{"})
# Reserved words that cannot start a command.
_NOT_A_START = frozenset({"then", "elif", "else", "fi", "do", "done", "esac", "}", "in"})


@dataclass(frozen=True)
class _Token:
    kind: Literal["word", "io", "op", "newline", "eof"]  # io: the 2 of 2>&1
    start: int
    end: int
    text: str
    value: str = ""

    def word(self) -> Word:
        return Word(self.start, self.end, self.text, self.value)


def _unterminated(text: str, what: str, pos: int) -> CommandError:
    return CommandError(
        f"the {what} opened on line {_line(text, pos)} is never closed",
        "close it in the same command; for a literal quote character, escape it with `\\` "
        "or quote it with the other kind of quote",
    )


class _Lexer:
    """Tokens of POSIX shell: words (with their unquoted values), operators, line breaks."""

    def __init__(self, text: str, pos: int = 0) -> None:
        self.text = text
        self.pos = pos
        self.end = pos  # the end of the last token, comment or here-document read
        self.comments: list[tuple[int, int]] = []
        self.heredocs: list[tuple[str, bool]] = []  # (delimiter, strip tabs) to read at a line end

    def next(self) -> _Token:
        self._skip_blanks()
        text, pos = self.text, self.pos
        if pos >= len(text):
            if self.heredocs:
                raise self._open_heredoc()
            return _Token("eof", pos, pos, "")
        char = text[pos]
        if char == "\n":
            self.pos = pos + 1
            self._read_heredocs()
            return _Token("newline", pos, pos + 1, "\n")
        if char in _OPERATOR_CHARS:
            op = next(op for op in _OPERATORS if text.startswith(op, pos))
            self.pos = self.end = pos + len(op)
            return _Token("op", pos, self.pos, op)
        return self._word()

    def _skip_blanks(self) -> None:
        text, pos = self.text, self.pos
        while pos < len(text):
            if text[pos] in " \t":
                pos += 1
            elif text.startswith("\\\n", pos):
                pos += 2
            elif text[pos] == "#":  # only ever reached at the start of a word
                end = text.find("\n", pos)
                end = len(text) if end < 0 else end
                self.comments.append((pos, end))
                self.end = pos = end
            else:
                break
        self.pos = pos

    def _word(self) -> _Token:
        text = self.text
        start = pos = self.pos
        value: list[str] = []
        while pos < len(text):
            char = text[pos]
            if char in " \t\n" or char in _OPERATOR_CHARS:
                break
            if char == "\\":
                if pos + 1 == len(text):
                    raise CommandError(
                        "the command ends with a `\\`, which would join the next line of the "
                        "script to it",
                        "remove the trailing `\\`",
                    )
                if text[pos + 1] != "\n":
                    value.append(text[pos + 1])
                pos += 2
            elif char == "'":
                pos = self._single(pos, value)
            elif char == '"':
                pos = self._double(pos, value)
            elif char in "`$":
                end = self._backquote(pos) if char == "`" else self._dollar(pos, quoted=False)
                value.append(text[pos:end])
                pos = end
            else:
                value.append(char)
                pos += 1
        self.pos = self.end = pos
        written = text[start:pos]
        io = written.isascii() and written.isdigit() and pos < len(text) and text[pos] in "<>"
        return _Token("io" if io else "word", start, pos, written, "".join(value))

    def _single(self, pos: int, value: list[str]) -> int:
        end = self.text.find("'", pos + 1)
        if end < 0:
            raise _unterminated(self.text, "`'` quote", pos)
        value.append(self.text[pos + 1 : end])
        return end + 1

    def _double(self, pos: int, value: list[str]) -> int:
        text = self.text
        i = pos + 1
        while i < len(text):
            char = text[i]
            if char == '"':
                return i + 1
            if char == "\\" and i + 1 < len(text):
                escaped = text[i + 1]
                if escaped in '$`"\\':
                    value.append(escaped)
                elif escaped != "\n":
                    value.append(char + escaped)
                i += 2
            elif char in "`$":
                end = (
                    self._backquote(i, quoted=True) if char == "`" else self._dollar(i, quoted=True)
                )
                value.append(text[i:end])
                i = end
            else:
                value.append(char)
                i += 1
        raise _unterminated(text, '`"` quote', pos)

    def _backquote(self, pos: int, *, quoted: bool = False) -> int:
        text = self.text
        body: list[str] = []
        i = pos + 1
        while i < len(text):
            char = text[i]
            if char == "\\" and i + 1 < len(text):
                escaped = text[i + 1]
                unescaped = escaped in "$`\\" or (quoted and escaped == '"')
                body.append(escaped if unescaped else char + escaped)
                i += 2
            elif char == "`":
                # The body is a script of its own: sh checks it along with the rest.
                _Parser(_Lexer("".join(body))).program()
                return i + 1
            else:
                body.append(char)
                i += 1
        raise _unterminated(text, "backquote", pos)

    def _dollar(self, pos: int, *, quoted: bool) -> int:
        """The end of the expansion at `pos` (a lone `$` or `$NAME` is plain text)."""
        text = self.text
        if text.startswith("$((", pos):
            return self._arithmetic(pos)
        if text.startswith("$(", pos):
            parser = _Parser(_Lexer(text, pos + 2))
            return parser.substitution(pos)
        if text.startswith("${", pos):
            return self._braces(pos, quoted=quoted)
        return pos + 1

    def _arithmetic(self, pos: int) -> int:
        text = self.text
        depth = 0
        i = pos + 1
        while i < len(text):
            if text[i] == "\\":
                i += 1
            elif text[i] == "(":
                depth += 1
            elif text[i] == ")":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        raise _unterminated(text, "`$((`", pos)

    def _braces(self, pos: int, *, quoted: bool) -> int:
        text = self.text
        scratch: list[str] = []
        i = pos + 2
        while i < len(text):
            char = text[i]
            if char == "}":
                return i + 1
            if char == "\\":
                i += 2
            elif char == "'" and not quoted:  # inside "${...}", a ' is a plain character
                i = self._single(i, scratch)
            elif char == '"':
                i = self._double(i, scratch)
            elif char == "`":
                i = self._backquote(i)
            elif char == "$":
                i = self._dollar(i, quoted=quoted)
            else:
                i += 1
        raise _unterminated(text, "`${`", pos)

    def _read_heredocs(self) -> None:
        text = self.text
        for delimiter, strip_tabs in self.heredocs:
            while True:
                if self.pos >= len(text):
                    raise self._open_heredoc()
                line_end = text.find("\n", self.pos)
                line_end = len(text) if line_end < 0 else line_end
                line = text[self.pos : line_end]
                self.pos = min(line_end + 1, len(text))
                if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                    self.end = line_end
                    break
        self.heredocs.clear()

    def _open_heredoc(self) -> CommandError:
        return CommandError(
            f"the here-document ending at `{self.heredocs[0][0]}` is never closed",
            "end it in the same command, with its delimiter alone on the last line",
        )


# --- the shell parser --------------------------------------------------------------------


@dataclass
class _Simple:
    """A simple command: assignments, words and redirections."""

    assignments: list[Word] = field(default_factory=list)
    words: list[Word] = field(default_factory=list)
    redirections: list[str] = field(default_factory=list)


@dataclass
class _Item:
    """One command of a list (an and-or list), and the `;`, `&` or line break after it."""

    simple: _Simple | None  # when the item is one simple command, without | && || !
    separator: str = ""


@dataclass(frozen=True)
class _Command:
    text: str
    items: list[_Item]
    words: list[Word]  # all words but assignments, compound commands' included
    constructs: list[str]  # operators and compound keywords, in order
    comments: list[tuple[int, int]]
    end: int  # the end of the content: trailing blanks, line breaks and continuations dropped

    def code(self) -> str:
        """The text without its comments."""
        parts: list[str] = []
        pos = 0
        for start, end in self.comments:
            parts.append(self.text[pos:start])
            pos = end
        return "".join([*parts, self.text[pos:]])


def _parse(text: str) -> _Command:
    _check_characters(text)
    lexer = _Lexer(text)
    try:
        parser = _Parser(lexer)
        items = parser.program()
    except RecursionError:
        raise CommandError(
            "the command nests shell constructs too deeply", "move it into a script file"
        ) from None
    return _Command(text, items, parser.words, parser.constructs, lexer.comments, lexer.end)


class _Parser:
    """A recursive-descent parser of the POSIX shell grammar, enough to check that a command
    is complete and to find its simple commands' words."""

    def __init__(self, lexer: _Lexer) -> None:
        self.lexer = lexer
        self.words: list[Word] = []
        self.constructs: list[str] = []
        self.tok = lexer.next()

    def program(self) -> list[_Item]:
        items: list[_Item] = []
        self._linebreak()
        while not self._at_end():
            item = self._and_or()
            items.append(item)
            if self._at(";", "&"):
                item.separator = self._advance().text
            elif self.tok.kind == "newline":
                item.separator = "\n"
            elif not self._at_end():
                raise self._unexpected()
            self._linebreak()
        if items and items[-1].separator == "\n":
            items[-1].separator = ""
        return items

    def substitution(self, start: int) -> int:
        """The end of the `$(...)` whose body this parser's lexer starts at."""
        self._linebreak()
        if not self._at(")"):
            self._compound_list(")")
        if self.tok.kind == "eof":
            raise _unterminated(self.lexer.text, "`$(`", start)
        if not self._at(")"):
            raise self._unexpected("`)`")
        return self.tok.end

    # Tokens.

    def _advance(self) -> _Token:
        tok = self.tok
        self.tok = self.lexer.next()
        return tok

    def _at(self, *texts: str) -> bool:
        """At one of these operators, or reserved words (unquoted, where a command starts)."""
        return self.tok.kind in ("word", "op") and self.tok.text in texts

    def _at_end(self) -> bool:
        return self.tok.kind == "eof"

    def _expect(self, text: str) -> None:
        if not self._at(text):
            raise self._unexpected(f"`{text}`")
        self._advance()

    def _linebreak(self) -> None:
        while self.tok.kind == "newline":
            self._advance()

    def _take_word(self, *, record: bool = True) -> Word:
        word = self._advance().word()
        if record:
            self.words.append(word)
        return word

    def _unexpected(self, wanted: str = "") -> CommandError:
        tok = self.tok
        expected = f", where {wanted} was expected" if wanted else ""
        if tok.kind == "eof":
            problem = f"the command ends in the middle of a shell construct{expected}"
        else:
            found = "a line break" if tok.kind == "newline" else f"`{tok.text}`"
            where = f"on line {_line(self.lexer.text, tok.start)}"
            problem = f"the command is not valid shell: unexpected {found} {where}{expected}"
        return CommandError(
            problem,
            "fix the shell syntax; each command must be complete on its own: an `if` needs "
            "its `fi`, a `&&` its next command, a `(` its `)`",
        )

    # Grammar.

    def _compound_list(self, *stops: str) -> None:
        self._linebreak()
        while True:
            self._and_or()
            if self._at(";", "&"):
                self._advance()
            elif self.tok.kind != "newline":
                return
            self._linebreak()
            if self._at(*stops) or self.tok.kind == "eof":
                return

    def _and_or(self) -> _Item:
        simple = self._pipeline()
        while self._at("&&", "||"):
            self.constructs.append(self._advance().text)
            self._linebreak()
            self._pipeline()
            simple = None
        return _Item(simple)

    def _pipeline(self) -> _Simple | None:
        bang = self._at("!")
        if bang:
            self.constructs.append(self._advance().text)
            if self._at("!"):
                raise self._unexpected("a command")
        simple = self._command()
        while self._at("|"):
            self.constructs.append(self._advance().text)
            self._linebreak()
            if self._at("!"):
                raise self._unexpected("a command")
            self._command()
            simple = None
        return None if bang else simple

    def _command(self) -> _Simple | None:
        tok = self.tok
        if tok.kind == "op" and tok.text == "(":
            self.constructs.append(self._advance().text)
            self._compound_list(")")
            self._expect(")")
        elif tok.kind == "word" and tok.text in _OPENERS:
            self.constructs.append(tok.text)
            compounds: dict[str, Callable[[], None]] = {
                "if": self._if,
                "while": self._loop,
                "until": self._loop,
                "for": self._for,
                "case": self._case,
                "{": self._brace_group,
            }
            compounds[tok.text]()
        elif tok.kind == "word" and tok.text in _NOT_A_START:
            raise self._unexpected()
        else:
            return self._simple()
        while self.tok.kind == "io" or self._at(*_REDIRECTIONS):
            self._redirection()
        return None

    def _simple(self) -> _Simple | None:
        node = _Simple()
        while True:
            if self.tok.kind == "io" or self._at(*_REDIRECTIONS):
                node.redirections.append(self._redirection())
            elif self.tok.kind == "word":
                if not node.words and _ASSIGNMENT.match(self.tok.text):
                    node.assignments.append(self._take_word(record=False))
                else:
                    node.words.append(self._take_word())
            else:
                break
        if (
            self._at("(")
            and len(node.words) == 1
            and not (node.assignments or node.redirections)
            and _NAME.fullmatch(node.words[0].text)
        ):
            self._function()
            return None
        if not (node.assignments or node.words or node.redirections):
            raise self._unexpected("a command")
        return node

    def _function(self) -> None:
        self.constructs.append("()")
        self._advance()
        self._expect(")")
        self._linebreak()
        if self._at("!"):
            raise self._unexpected("the function's body")
        self._command()

    def _redirection(self) -> str:
        if self.tok.kind == "io":
            self._advance()
        op = self._advance().text
        if self.tok.kind != "word":
            raise self._unexpected(f"a file name after `{op}`")
        if op in ("<<", "<<-"):
            # Before the next token is read: the body starts at the next line break.
            self.lexer.heredocs.append((self.tok.value, op == "<<-"))
        self._take_word()
        return op

    def _if(self) -> None:
        self._advance()
        self._compound_list("then")
        self._expect("then")
        self._compound_list("elif", "else", "fi")
        while self._at("elif"):
            self._advance()
            self._compound_list("then")
            self._expect("then")
            self._compound_list("elif", "else", "fi")
        if self._at("else"):
            self._advance()
            self._compound_list("fi")
        self._expect("fi")

    def _loop(self) -> None:
        self._advance()
        self._compound_list("do")
        self._do_group()

    def _do_group(self) -> None:
        self._expect("do")
        self._compound_list("done")
        self._expect("done")

    def _for(self) -> None:
        self._advance()
        if self.tok.kind != "word" or not _NAME.fullmatch(self.tok.text):
            raise self._unexpected("a variable name")
        self._take_word()
        self._linebreak()
        if self._at("in"):
            self._advance()
            while self.tok.kind == "word":
                self._take_word()
            if not (self._at(";") or self.tok.kind == "newline"):
                raise self._unexpected("`;` or a line break")
            self._advance()
        elif self._at(";"):
            self._advance()
        self._linebreak()
        self._do_group()

    def _case(self) -> None:
        self._advance()
        if self.tok.kind != "word":
            raise self._unexpected("a word")
        self._take_word()
        self._linebreak()
        self._expect("in")
        self._linebreak()
        while not self._at("esac"):
            if self._at("("):
                self._advance()
            self._pattern()
            while self._at("|"):
                self._advance()
                self._pattern()
            self._expect(")")
            self._linebreak()
            if not self._at(";;", "esac"):
                self._compound_list(";;", "esac")
            if self._at(";;"):
                self._advance()
                self._linebreak()
            elif not self._at("esac"):
                raise self._unexpected("`;;` or `esac`")
        self._advance()

    def _pattern(self) -> None:
        if self.tok.kind != "word":
            raise self._unexpected("a pattern or `esac`")
        self._take_word()

    def _brace_group(self) -> None:
        self._advance()
        self._compound_list("}")
        self._expect("}")
