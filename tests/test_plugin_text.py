"""Plugin text cannot hurt: control characters from plugins reach no terminal and no log unescaped."""

from __future__ import annotations

import pytest

from attnhost.errors import describe_exception, one_line, plugin_label, printable, safe_repr

HOSTILE = [
    "\x1b[2J\x1b[H",  # clear the screen, cursor home
    "\x1b]0;owned\x07",  # set the terminal title
    "line\nforged: ok",  # a forged second line
    "tab\there\r\x08",
    "\u202eevil\u202c",  # bidi override
    "zero\u200bwidth",
    "\x7f\x85\x9b",  # DEL, NEL, CSI (C1)
    "lone \udcff surrogate",
    "\u2028\u2029",  # line and paragraph separators
]


@pytest.mark.parametrize("text", HOSTILE)
def test_printable_leaves_only_printable_text_and_is_idempotent(text: str) -> None:
    shown = printable(text)
    assert shown.isprintable()
    assert printable(shown) == shown
    assert shown.isascii()  # every hostile character above is escaped, and the escapes are ASCII


def test_printable_keeps_ordinary_text_as_is() -> None:
    for text in ("flashinfer", "café — naïve 注意", "C:\\path\\x1b", ""):
        assert printable(text) == text
    assert printable("a\x1bb") == "a\\x1bb"
    assert printable("\u202e") == "\\u202e"


def test_message_helpers_escape_plugin_text() -> None:
    label = plugin_label("p\x1b[2J", "dist\x1b[2J", "1.0\x1b[2J")
    assert "\x1b" not in label and label.count("\\x1b") == 3

    class Hostile(Exception):
        def __str__(self) -> str:
            return "\x1b[31mred\x1b[0m\nsecond"

    described = describe_exception(Hostile())
    assert described.isprintable() and "\\x1b[31mred" in described

    class Repr:
        def __repr__(self) -> str:
            return "\x1b[2J"

    assert safe_repr(Repr()) == "\\x1b[2J"
    assert one_line("a\n\x1b b") == "a \\x1b b"
