"""Reading the code (issue 23, points 14-16): the README leads to every module, no import circle, no stale counts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
CORE = ROOT / "core" / "attnhost"
README = (ROOT / "README.md").read_text(encoding="utf-8")
CORE_LINE_BUDGET = 4_250  # issue 10: the core without testing/ and engines/ (MLA in the contract: +300)


def _module(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every attnhost module ``path`` imports: at module level, in functions and under TYPE_CHECKING alike."""
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
    return {name for name in found if name.startswith("attnhost.")}


def test_the_core_has_no_import_circle() -> None:
    """The facade ``attnhost/__init__`` (lazy re-exports) aside, imports form no cycle, TYPE_CHECKING included."""
    modules = {_module(path): path for path in CORE.rglob("*.py")}
    graph = {name: _imports(path, name) & set(modules) for name, path in modules.items() if name != "attnhost"}
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
    # vLLM unpickles a config in a spawned child before any plugin loads: names.restore must register there,
    # so it imports the bridge in its body (both circles below go through that one import)
    lazy = {
        "attnhost.engines.vllm.adapter -> attnhost.engines.vllm.names -> attnhost.engines.vllm.bridge -> "
        "attnhost.engines.vllm.adapter",
        "attnhost.engines.vllm.bridge -> attnhost.engines.vllm.names -> attnhost.engines.vllm.bridge",
    }
    assert [circle for circle in circles if circle not in lazy] == [], circles


def test_the_core_stays_within_its_line_budget() -> None:
    files = [p for p in CORE.rglob("*.py") if not {"testing", "engines"} & set(p.relative_to(CORE).parts)]
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)
    assert lines <= CORE_LINE_BUDGET, f"{lines} lines in the core, more than {CORE_LINE_BUDGET}"


def test_the_module_table_names_where_engines_are_bridged() -> None:
    table = README[README.index("| module | job |") :].split("\n\n")[0]
    for module in ("engines.export", "engines.runner_view", "engines.sglang.bridge", "engines.sglang.adapter"):
        assert f"`attnhost.{module}`" in table, module
    assert "`attnhost.engines.vllm.bridge`" in table and "`attnhost.kv_cache`" in table
    resolution = ast.get_docstring(ast.parse((CORE / "resolution.py").read_text(encoding="utf-8"))) or ""
    assert "attnhost.engines.sglang.bridge" in resolution and "resolver" in resolution


def test_the_readme_quotes_no_test_counts_and_warns_about_the_checkout_directory() -> None:
    assert not re.search(r"\b\d+ passed\b|\bruns \d+ tests\b", README), "a test count goes stale; say no number"
    guide = README[README.index("## Writing a backend plugin") :]
    assert "cannot import name '__version__' from 'attnhost' (unknown location)" in guide
    assert "python -m pytest" in guide and "python -m attnhost" in guide
