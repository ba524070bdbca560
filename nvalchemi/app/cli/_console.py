"""Where the CLI writes: a rich console on stderr for people, stdout for payloads.

JSON payloads (``--json``, specs without ``--out``) go to stdout, so pipes get clean data.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["err_console", "format_number", "print_table"]

_PLAIN_WIDTH = 110


def err_console() -> Console:
    """A console on the current ``sys.stderr`` (fixed width when not a terminal)."""
    console = Console(file=sys.stderr, highlight=False)
    if not console.is_terminal:
        console = Console(file=sys.stderr, highlight=False, width=_PLAIN_WIDTH, no_color=True)
    return console


def format_number(value: Any, digits: int = 4) -> str:
    """Compact human form: ints with separators, floats with ``digits`` significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.{digits}g}"
        return f"{value:.{max(digits - 1, 1)}e}"
    return str(value)


def print_table(
    console: Console,
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
) -> Table:
    """Print ``title`` on a line of its own, then a table; numbers via :func:`format_number`."""
    console.print(title, style="italic", soft_wrap=True)
    table = Table(show_lines=False)
    for i, name in enumerate(columns):
        table.add_column(name, justify="right" if i > 0 else "left")
    for row in rows:
        table.add_row(*(format_number(v) if not isinstance(v, str) else v for v in row))
    console.print(table)
    return table
