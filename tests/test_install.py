"""What ``pip install 'attnhost[test]'`` brings, read from the installed distribution's own metadata."""

from __future__ import annotations

import re
from importlib.metadata import requires


def _extra(name: str) -> set[str]:
    found = set()
    for requirement in requires("attnhost") or []:
        if re.search(rf"""extra\s*==\s*["']{name}["']""", requirement):
            found.add(re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower())
    return found


def test_test_extra_brings_what_the_conformance_kit_needs() -> None:
    # pytest runs the kit; numpy keeps torch from warning on every run. torch itself stays a separate,
    # deliberate install (the CPU build on CPU-only Linux), so it is not in the extra.
    assert _extra("test") == {"pytest", "numpy"}
    assert _extra("torch") == {"torch"}
