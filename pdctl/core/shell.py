"""Worker commands as POSIX shell: a scanner and a parser of the subset a service file's
`commands` use, so that the entrypoint script (entrypoint.py) is spliced at a word's span
instead of matched with regexes. PURE: stdlib only.

It knows quoting (single, double, backslash), expansions kept as written (``$X``, ``${...}``,
``$(...)``, backquotes, arithmetic), here-documents, redirections, pipelines, and-or lists,
compound commands (``if``, ``while``, ``until``, ``for``, ``case``, braces, subshells) and
function definitions; what it cannot read with certainty is a CommandError that says how to
write it instead. Characters that would break a unit's script (control characters, line
separators, bidi overrides) are refused first.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal


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
    return parse_command(command).words


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

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


@dataclass
class SimpleCommand:
    """A simple command: assignments, words and redirections."""

    assignments: list[Word] = field(default_factory=list)
    words: list[Word] = field(default_factory=list)
    redirections: list[str] = field(default_factory=list)


@dataclass
class _Item:
    """One command of a list (an and-or list), and the `;`, `&` or line break after it."""

    simple: SimpleCommand | None  # when the item is one simple command, without | && || !
    separator: str = ""


@dataclass(frozen=True)
class ParsedCommand:
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


def parse_command(text: str) -> ParsedCommand:
    _check_characters(text)
    lexer = _Lexer(text)
    try:
        parser = _Parser(lexer)
        items = parser.program()
    except RecursionError:
        raise CommandError(
            "the command nests shell constructs too deeply", "move it into a script file"
        ) from None
    return ParsedCommand(text, items, parser.words, parser.constructs, lexer.comments, lexer.end)


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

    def _pipeline(self) -> SimpleCommand | None:
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

    def _command(self) -> SimpleCommand | None:
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

    def _simple(self) -> SimpleCommand | None:
        node = SimpleCommand()
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
