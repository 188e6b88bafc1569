"""The ``attnhost`` CLI's argv fast path: common ``list``/``plugins`` spellings parsed without ``argparse``.

Split from :mod:`attnhost.cli` because it is a start-up optimisation, not a
command (BENCHMARKS.md; the cost it saves is in :func:`parse`). The table of fast commands
(handler and flag defaults, exactly as ``argparse`` declares them) stays in
the CLI next to the parser it mirrors and is passed in, so this module
imports nothing from the CLI.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = ["parse"]


def parse(
    argv: Sequence[str], commands: Mapping[str, tuple[Callable[..., int], Mapping[str, Any]]]
) -> SimpleNamespace | None:
    """Parse ``list``/``plugins`` invocations spelled exactly (no abbreviations), or return None.

    Importing and building the argparse parser costs ~3 ms, an eighth of
    ``attnhost list``'s start-up; this handles the spellings scripts use and
    yields the same namespace argparse would. Anything else — ``--help``,
    abbreviations, unknown flags, a missing or dash-leading ``--platform``
    value — returns None and goes through argparse, which produces the
    usual messages and errors.
    """
    if not argv or argv[0] not in commands:
        return None
    handler, defaults = commands[argv[0]]
    values = dict(defaults)
    i = 1
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        if not eq and flag in ("--json", "--draft") and flag[2:] in values:
            values[flag[2:]] = True
        elif flag == "--platform" and "platform" in values:
            if eq:
                values["platform"] = inline
            elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                i += 1
                values["platform"] = argv[i]
            else:
                return None
        else:
            return None
        i += 1
    return SimpleNamespace(command=argv[0], handler=handler, **values)
