"""Text laid out for the terminal it lands on: tables that fit its width, notes wrapped, plugin text defused.

Operators read ``attnhost list`` in an 80-column SSH session as often as in a wide terminal, and a table that
wraps is unreadable. Every cell is :func:`attnhost.errors.printable`: plugin metadata must not clear the screen.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

from attnhost.errors import printable

__all__ = ["ELLIPSIS", "ENCODING", "fit_table", "shorten", "shown", "terminal_width", "wrap"]

ELLIPSIS = "..."
MIN_LAST = 24  # a wrapping last column keeps at least this many characters a line before other columns shrink
MIN_WIDTH = 40  # narrower than this, wrapping every line would help no one: lay out for this width instead
ENCODING: list[str] = []  # while the CLI writes to a stream that is not UTF-8: its encoding (``cli.main`` sets it)


def shown(text: str) -> str:
    """``text`` as it will print: :func:`printable`, and what the output's encoding lacks as the escapes it will
    become, so a column is as wide on the screen as it was measured."""
    text = printable(text)
    return text.encode(ENCODING[-1], "backslashreplace").decode(ENCODING[-1]) if ENCODING else text


def terminal_width() -> int:
    """The columns of the terminal (``COLUMNS`` wins; 80 when the output is not a terminal)."""
    return max(MIN_WIDTH, shutil.get_terminal_size().columns)


def shorten(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters (more than 3: every caller's are), ending in ``...`` when it was cut."""
    return text if len(text) <= width else text[: width - len(ELLIPSIS)] + ELLIPSIS


def wrap(text: str, width: int | None, *, indent: str = "", hanging: str | None = None) -> list[str]:
    """One paragraph wrapped to ``width`` (``None``: one line); continuation lines get ``hanging`` or line up."""
    if width is None:
        return [indent + shown(text)]
    lines = textwrap.wrap(
        shown(text),
        width=width,
        initial_indent=indent,
        subsequent_indent=" " * len(indent) if hanging is None else hanging,
        break_on_hyphens=False,
    )
    return lines or [indent.rstrip()]


def fit_table(
    rows: Sequence[Sequence[str]],
    width: int | None = None,
    *,
    flexible: Sequence[int] = (),
    wrap_last: bool = True,
) -> list[str]:
    """The rows as aligned lines no wider than ``width`` (``None``: unbounded): columns in ``flexible`` (not the last)
    shrink, widest first, to their header's width; then the last wraps (``wrap_last``); the rest is cut."""
    table = [[shown(cell) for cell in row] for row in rows]
    widths = [max(map(len, column)) for column in zip(*table, strict=True)]
    gap = 2
    if width is not None:
        floor = {i: max(len(table[0][i]), len(ELLIPSIS) + 1) for i in flexible}
        last = min(widths[-1], MIN_LAST) if wrap_last else widths[-1]
        excess = sum(widths[:-1]) + gap * (len(widths) - 1) + last - width
        while excess > 0 and (shrinkable := [i for i in flexible if widths[i] > floor[i]]):
            widths[max(shrinkable, key=lambda i: widths[i])] -= 1  # the widest first
            excess -= 1
    lead = sum(widths[:-1]) + gap * (len(widths) - 1)
    last_width = widths[-1] if width is None else max(width - lead, 10)
    lines: list[str] = []
    for row in table:
        prefix = "".join(shorten(cell, widths[i]).ljust(widths[i]) + " " * gap for i, cell in enumerate(row[:-1]))
        pieces = [shorten(row[-1], last_width)]  # unbounded, last_width is the column's: nothing is cut
        if wrap_last and len(row[-1]) > last_width:
            pieces = textwrap.wrap(row[-1], width=last_width, break_on_hyphens=False) or [""]
        lines.append((prefix + pieces[0]).rstrip())
        lines.extend((" " * lead + piece).rstrip() for piece in pieces[1:])
    if width is not None:
        lines = [shorten(line, width) for line in lines]
    return lines
