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
    whole: Sequence[int] = (),
    wrap_last: bool = True,
) -> list[str]:
    """The rows as aligned lines no wider than ``width`` (``None``: unbounded, the ``--wide`` layout).

    Columns in ``flexible`` shrink first, widest first, to their header's width, cut and marked ``...`` (the last
    column among them when it does not wrap). Columns in ``whole`` hold names a reader copies (a plugin, a
    distribution), so they narrow only after those and are never cut: a longer cell is printed in full and the
    rest of its row goes on the next line, under its columns, as argparse does with a long option. Then the last
    column wraps (``wrap_last``); what still does not fit is cut at the edge, but not a line a whole cell ends.
    """
    table = [[shown(cell) for cell in row] for row in rows]
    widths = [max(map(len, column)) for column in zip(*table, strict=True)]
    gap, last = 2, len(widths) - 1
    if width is not None:
        widths[last] = min(widths[last], MIN_LAST) if wrap_last else widths[last]
        floor = [max(len(header), len(ELLIPSIS) + 1) for header in table[0]]
        excess = sum(widths) + gap * last - width
        natural, cut = list(widths), [i for i in flexible if i < last or not wrap_last]
        while excess > 0 and (shrinkable := [i for i in cut if widths[i] > floor[i]]):
            widths[max(shrinkable, key=lambda i: widths[i])] -= 1  # the widest first
            excess -= 1
        excess = _narrow_whole(table, widths, floor, whole, excess) if excess > 0 else excess
        while excess < 0 and (growable := [i for i in cut if widths[i] < natural[i]]):
            widths[min(growable, key=lambda i: widths[i])] += 1  # what the names gave up, the narrowest first
            excess += 1
    starts = [sum(widths[:i]) + gap * i for i in range(len(widths))]
    last_width = widths[last] if width is None else max(width - starts[last], 10)
    lines: list[tuple[str, bool]] = []  # each line, and whether it may be cut at the edge (not if a whole cell ends it)
    for row in table:
        line, cuttable = "", True
        for i, cell in enumerate(row[:last]):
            if line and len(line) + gap > starts[i]:  # a whole cell ran past this column: the rest of the row below
                lines.append((line.rstrip(), cuttable))
                line, cuttable = "", True
            text = cell if i in whole else shorten(cell, widths[i])
            line, cuttable = line.ljust(starts[i]) + text, len(text) <= widths[i]
        pieces = [shorten(row[last], last_width)]  # unbounded, last_width is the column's: nothing is cut
        if wrap_last and len(row[last]) > last_width:
            pieces = textwrap.wrap(row[last], width=last_width, break_on_hyphens=False) or [""]
        if line and len(line) + gap > starts[last] and (pieces[0] or len(pieces) > 1):
            lines.append((line.rstrip(), cuttable))
            line, cuttable = "", True
        lines.append(((line.ljust(starts[last]) + pieces[0]).rstrip(), cuttable or bool(pieces[0])))
        lines.extend(((" " * starts[last] + piece).rstrip(), True) for piece in pieces[1:])
    return [shorten(text, width) if width is not None and cuttable else text for text, cuttable in lines]


def _narrow_whole(
    table: list[list[str]], widths: list[int], floor: list[int], whole: Sequence[int], excess: int
) -> int:
    """Narrow the ``whole`` columns (in ``widths``) by ``excess`` or more, each step to the width of a column's next
    narrower cell, choosing the step that sends the fewest more rows past their column (each takes an extra line):
    a long name or two overflow and the other rows stay on one line. A step that sends no more rows over is taken
    even once the table fits, so a column is no wider than the rows kept in it. Returns the excess left (negative:
    room to give back)."""
    over: set[int] = set()  # the rows with a cell wider than its whole column

    def step(i: int) -> int:
        return max([floor[i], *(len(row[i]) for row in table[1:] if len(row[i]) < widths[i])])

    def cost(i: int) -> int:
        return sum(1 for r, row in enumerate(table[1:]) if r not in over and len(row[i]) > step(i))

    while shrinkable := [i for i in whole if widths[i] > floor[i]]:
        i = min(shrinkable, key=lambda i: (cost(i), -widths[i]))  # the fewest new overflows; then the widest
        if excess <= 0 and cost(i):
            break
        excess -= widths[i] - step(i)
        widths[i] = step(i)
        over.update(r for r, row in enumerate(table[1:]) if len(row[i]) > widths[i])
    return excess
