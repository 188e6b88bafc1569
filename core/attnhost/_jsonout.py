"""``json.dumps(payload, indent=2)`` for the CLI's ``--json`` output, without importing ``json``.

Split from :mod:`attnhost.cli` because it is a start-up optimisation, not a
command: ``attnhost list --json`` must stay faster than a bare
``importlib.metadata`` scan (BENCHMARKS.md), and ``json`` costs ~2 ms of that.
The CLI imports this module only on its ``--json`` paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["dumps"]


def dumps(payload: object) -> str:
    """``json.dumps(payload, indent=2)``, byte for byte, without importing ``json``.

    With ``indent`` the standard library encodes in pure Python, and importing
    ``json`` (with its decoder) costs another ~1 ms: together ~2 ms of
    ``attnhost list --json``'s start-up. Our payloads are dicts with string keys,
    lists, strings, bools, ints and None; only strings need real escaping, done
    by the same C function ``json`` uses. Anything else falls back to ``json``.
    """
    try:
        from _json import encode_basestring_ascii
    except ImportError:  # pragma: no cover - CPython always has _json
        import json

        return json.dumps(payload, indent=2)
    parts: list[str] = []
    if not _encode(payload, parts, "\n", encode_basestring_ascii):
        import json

        return json.dumps(payload, indent=2)
    return "".join(parts)


def _encode(value: object, out: list[str], newline: str, quote: Callable[[str], str]) -> bool:
    """Append ``value`` as ``json.dumps(indent=2)`` would; False if it holds a type we do not handle."""
    if isinstance(value, str):
        out.append(quote(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif type(value) is int:
        out.append(int.__repr__(value))
    elif isinstance(value, (list, tuple)):
        if not value:
            out.append("[]")
            return True
        inner = newline + "  "
        out.append("[")
        for i, item in enumerate(value):
            out.append(inner if i == 0 else "," + inner)
            if not _encode(item, out, inner, quote):
                return False
        out.append(newline + "]")
    elif isinstance(value, dict):
        if not value:
            out.append("{}")
            return True
        inner = newline + "  "
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                return False
            out.append((inner if i == 0 else "," + inner) + quote(key) + ": ")
            if not _encode(item, out, inner, quote):
                return False
        out.append(newline + "}")
    else:
        return False
    return True
