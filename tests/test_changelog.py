"""CHANGELOG.md is kept, in Keep a Changelog's shape, so users can see what changed before they upgrade."""

from __future__ import annotations

import re
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parents[1] / "CHANGELOG.md"
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_changelog_has_an_unreleased_section_of_known_kinds() -> None:
    text = CHANGELOG.read_text()
    releases = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert releases and releases[0] == "Unreleased", releases
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## ", 1)[0]
    kinds = re.findall(r"^### (.+)$", unreleased, re.M)
    assert kinds and set(kinds) <= KINDS, kinds
    for kind in kinds:
        body = unreleased.split(f"### {kind}\n", 1)[1].split("\n### ", 1)[0]
        assert re.search(r"^- \S", body, re.M), f"{kind} has no entries"
    for change in ("SGLang bridge", "vLLM bridge", "attnhost list NAME", "attnhost[test]", "control characters"):
        assert change in unreleased, change
