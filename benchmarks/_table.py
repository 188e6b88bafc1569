"""The benchmarks' one printed table: a line per comparison, candidate and baseline side by side.

``run.py`` prints every section's rows with it, and ``bench_attention.py`` run alone prints its rows the same way.
It is a module of its own so that a script reaches it without importing ``run.py``, which imports the scripts.
"""

from __future__ import annotations

import math

from _common import Row

__all__ = ["print_table"]


def _figure(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    if unit == "us" and value >= 10_000:
        value, unit = value / 1000, "ms"
    digits = 0 if value >= 100 else 1 if value >= 10 else 2
    return f"{value:.{digits}f} {unit}"


def print_table(rows: list[Row]) -> None:
    """One line per comparison; spread = interquartile range / median of that figure."""
    header = ["section", "case", "attnhost", "figure", "±", "baseline", "figure", "±", "ratio", "target", "met"]
    table = [header]
    for row in rows:
        table.append(
            [
                row.section,
                row.case,
                row.candidate,
                _figure(row.value, row.unit),
                f"{row.spread * 100:.0f}%",
                row.baseline,
                _figure(row.baseline_value, row.unit),
                f"{row.baseline_spread * 100:.0f}%" if not math.isnan(row.baseline_value) else "",
                f"{row.ratio:.2f}" if not math.isnan(row.baseline_value) else "-",
                row.target or "",
                {True: "yes", False: "NO", None: ""}[row.met],
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for index, line in enumerate(table):
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
        if index == 0:
            print("  ".join("-" * width for width in widths))
    for row in rows:
        for note in row.notes:
            print(f"  [{row.section} / {row.case}] {note}")
