"""Code that justifies itself with a measurement cites where the figure is: ``(BENCHMARKS.md, "Heading")``, a
heading BENCHMARKS.md has. A bare ``(BENCHMARKS.md)`` sends the reader through the whole file, and a heading that
was renamed sends them nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("core", "plugins", "examples", "benchmarks", "testkits", "tests")
_CITATION = re.compile(r"BENCHMARKS\.md(?P<rest>[^\n]{0,3})")
_HEADED = re.compile(r'BENCHMARKS\.md,\s+"(?P<heading>[^"]+)"')


def _python_files() -> list[Path]:
    files = []
    for top in SOURCES:
        for path in (ROOT / top).rglob("*.py"):
            parts = set(path.relative_to(ROOT).parts)
            if not parts & {"build", ".tox", "__pycache__"} and path != Path(__file__).resolve():
                files.append(path)
    return files


def _joined(text: str) -> str:
    """The source with line breaks inside comments and docstrings closed up, so a citation that wraps reads whole."""
    return re.sub(r"\n\s*(?:#\s*)?", " ", text)


def test_every_citation_of_the_figures_names_a_heading_they_have() -> None:
    headings = [
        line.lstrip("#").strip()
        for line in (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    ]
    problems = []
    for path in _python_files():
        text = _joined(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT)
        for match in _CITATION.finditer(text):
            headed = _HEADED.match(text, match.start())
            if headed is None:
                if match.group("rest").startswith(")"):
                    problems.append(f"{where}: a bare (BENCHMARKS.md): name the heading the figure is under")
                continue
            heading = headed.group("heading")
            if not any(h.startswith(heading) for h in headings):
                problems.append(f"{where}: BENCHMARKS.md has no heading {heading!r}")
    assert problems == []
