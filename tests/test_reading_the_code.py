"""Reading the code: the docs lead to every module, no import circle, no stale counts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import ROOT, doc, plugin_guide, reader_pages

CORE = ROOT / "core" / "attnhost"
# Where the code outside the core lives, each folder a root its modules are imported from: the built-in plugin's
# package, each example plugin's package (its own distribution's root) and the benchmark scripts, which import
# each other as top-level modules (``from _common import Row``).
OUTSIDE_THE_CORE = {
    "plugins": [ROOT / "plugins"],
    "examples": sorted(path.parent for path in (ROOT / "examples").glob("*/pyproject.toml")),
    "benchmarks": [ROOT / "benchmarks"],
}


def _module(path: Path, root: Path = CORE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(root: Path) -> dict[str, Path]:
    """Every module importable with ``root`` on ``sys.path``, by name: its top-level scripts and its packages'
    modules (not its tests or build output, which are no package)."""
    modules = {path.stem: path for path in root.glob("*.py")}
    for init in root.glob("*/__init__.py"):
        modules.update({_module(path, root): path for path in init.parent.rglob("*.py")})
    return modules


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports: at module level, in functions and under TYPE_CHECKING alike."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: ``from . import x`` in package a.b is a.b.x
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [base])])
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def _circles(modules: dict[str, Path], facades: frozenset[str] = frozenset()) -> list[str]:
    """Every import circle among ``modules``, each spelt once (``a -> b -> a``); a facade's imports are not followed."""
    graph = {name: _imports(path, name) & set(modules) for name, path in modules.items() if name not in facades}
    circles = []

    def visit(name: str, trail: list[str]) -> None:
        for imported in sorted(graph.get(name, ())):
            if imported in trail:
                circle = trail[trail.index(imported) :]
                first = circle.index(min(circle))  # one spelling per circle, wherever the walk entered it
                circle = circle[first:] + circle[:first]
                circles.append(" -> ".join([*circle, circle[0]]))
            elif imported not in done:
                visit(imported, [*trail, imported])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    return circles


def test_the_core_has_no_import_circle() -> None:
    """The facade ``attnhost/__init__`` (lazy re-exports) aside, imports form no cycle, TYPE_CHECKING included."""
    circles = _circles(_sources(CORE.parent), facades=frozenset({"attnhost"}))
    assert circles == [], "import circles: " + "; ".join(circles)


@pytest.mark.parametrize("where", sorted(OUTSIDE_THE_CORE))
def test_the_plugins_examples_and_benchmarks_have_no_import_circle(where: str) -> None:
    """What a plugin author copies and what a contributor reads next are held to the core's rule: no cycle,
    TYPE_CHECKING included; a piece two modules share lives in a module both import."""
    modules = {name: path for root in OUTSIDE_THE_CORE[where] for name, path in _sources(root).items()}
    assert modules, f"{where}: no module found"
    circles = _circles(modules)
    assert circles == [], f"{where}: import circles: " + "; ".join(circles)


def test_the_module_table_names_where_engines_are_bridged() -> None:
    architecture = doc("architecture.md")
    table = architecture[architecture.index("| module | job |") :].split("\n\n")[0]
    for module in ("engines.export", "engines.runner_view", "engines.sglang.bridge", "engines.sglang.adapter"):
        assert f"`attnhost.{module}`" in table, module
    assert "`attnhost.engines.vllm.bridge`" in table and "`attnhost.kv_cache`" in table
    resolution = ast.get_docstring(ast.parse((CORE / "resolution.py").read_text(encoding="utf-8"))) or ""
    assert "attnhost.engines.sglang.bridge" in resolution and "resolver" in resolution


def _table_names(table: str) -> set[str]:
    """Every module a row of the module table names: ``attnhost.x``, and the short forms a row continues with
    (```.y``` after ``attnhost.x.z``: ``attnhost.x.y``)."""
    names = set()
    for row in table.splitlines():
        cell = row.split("|")[1] if row.startswith("|") else ""
        parent = ""
        for name in re.findall(r"`([a-z_.]+)`", cell):
            if name.startswith("attnhost."):
                names.add(name)
                parent = name.rpartition(".")[0]
            elif name.startswith(".") and parent:
                names.add(parent + name)
    return names


def test_every_core_module_has_a_row_in_the_module_table() -> None:
    """A newcomer finds each job in the file named for it: the table leads to every module there is."""
    architecture = doc("architecture.md")
    table = architecture[architecture.index("| module | job |") :].split("\n\n")[0]
    named = _table_names(table)
    modules = {_module(path) for path in CORE.rglob("*.py")} - {"attnhost"}
    missing = sorted(m for m in modules if m not in named)
    assert missing == [], f"docs/architecture.md's module table has no row for {missing}"


def test_the_docs_quote_no_test_counts_and_warn_about_the_checkout_directory() -> None:
    for page, text in reader_pages().items():
        assert not re.search(r"\b\d+ passed\b|\bruns \d+ tests\b", text), f"{page}: a test count goes stale"
    guide = plugin_guide()
    assert "cannot import name '__version__' from 'attnhost' (unknown location)" in guide
    assert "python -m pytest" in guide and "python -m attnhost" in guide
