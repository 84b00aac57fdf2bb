"""Everything pdctl prints goes through one Output object.

Human mode: rich tables and a spinner on stderr, results on stdout.
JSON mode (``--json``): exactly one JSON document on stdout per command,
errors included; progress and notes go nowhere, so scripts can parse stdout.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from rich.console import Console


# rich is imported when a console is first used: a JSON-mode command, what scripts and the tests
# run, never uses one, and rich was a tenth of a command's start.
def _console(*, stderr: bool) -> Console:
    from rich.console import Console  # noqa: PLC0415 - see above: JSON mode never loads rich

    return Console(stderr=stderr, soft_wrap=True, highlight=False)


class Output:
    def __init__(self, *, json_mode: bool = False, verbosity: int = 0, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.verbosity = verbosity
        self.quiet = quiet

    @functools.cached_property
    def out(self) -> Console:
        return _console(stderr=False)

    @functools.cached_property
    def err(self) -> Console:
        return _console(stderr=True)

    # -- results -----------------------------------------------------------
    def result(self, doc: Any, render: Callable[[], None] | None = None) -> None:
        """Emit a command's result: the JSON document, or its human rendering. A typed result
        (pdctl/core/results.py) is its ``model_dump(mode="json")``."""
        if isinstance(doc, BaseModel):
            doc = doc.model_dump(mode="json")
        if self.json_mode:
            sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
            sys.stdout.flush()
        elif render is not None:
            render()
        else:
            self.out.print_json(data=doc)

    def table(
        self, columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None
    ) -> None:
        from rich.table import Table  # noqa: PLC0415 - human output only (see _console)

        table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*("" if cell is None else str(cell) for cell in row))
        self.out.print(table)

    def line(self, text: str = "") -> None:
        """A line of the human result on stdout (never printed in JSON mode)."""
        if not self.json_mode:
            self.out.print(text, markup=False)

    # -- side channel (stderr) -----------------------------------------------
    def info(self, text: str) -> None:
        if not (self.json_mode or self.quiet):
            self.err.print(text, markup=False)

    def detail(self, text: str) -> None:
        if self.verbosity > 0 and not self.json_mode:
            self.err.print(text, markup=False, style="dim")

    def warn(self, text: str) -> None:
        if not self.json_mode:
            self.err.print(f"warning: {text}", markup=False, style="yellow")

    def error(self, doc: dict[str, Any], line: str) -> None:
        if self.json_mode:
            sys.stdout.write(json.dumps({"error": doc}, indent=2) + "\n")
            sys.stdout.flush()
        else:
            self.err.print(f"error: {line}", markup=False, style="bold red")

    @contextmanager
    def progress(self, text: str) -> Iterator[Callable[[str], None]]:
        """A spinner while long work runs; yields a function to update its text."""
        if self.json_mode or self.quiet or not self.err.is_terminal:
            self.info(text)
            yield lambda message: self.info(f"{text}: {message}")
            return
        with self.err.status(text) as status:
            yield lambda message: status.update(f"{text}: {message}")
