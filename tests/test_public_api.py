"""The public API is one table in ``attnhost/__init__.py``; everything else there follows from it.

``__all__``, the lazy exports (``__getattr__``) and the ``TYPE_CHECKING``
imports that type checkers read must name the same objects from the same
modules, or a name works at run time and not for mypy (or the reverse).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import keyword
import re
from pathlib import Path

import pytest
from helpers import run_python

import attnhost

INIT = Path(attnhost.__file__)


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(INIT.read_text(encoding="utf-8"))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    names: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.dump(node)
        for alias in node.names:
            assert alias.asname is None, f"{alias.name} is imported under another name"
            names[alias.name] = node.module
    return names


def test_all_lazy_exports_and_type_checking_imports_agree() -> None:
    table = attnhost._MODULE_OF
    assert attnhost.__all__ == sorted(table)
    assert _type_checking_imports() == table


@pytest.mark.torch  # needs torch installed (the py312/py313 envs have none)
def test_every_export_is_defined_by_its_module_and_listed_in_its_all() -> None:
    for name, module_name in attnhost._MODULE_OF.items():
        module = importlib.import_module(module_name)
        assert name in module.__all__, f"{module_name}.__all__ lacks {name}"
        assert getattr(attnhost, name) is getattr(module, name)


def test_dir_shows_only_public_names() -> None:
    names = dir(attnhost)
    assert names == sorted([*attnhost.__all__, "__version__"])
    assert "hookspec" not in names and not [n for n in names if n.startswith("_") and n != "__version__"]


def test_no_export_is_named_like_a_submodule() -> None:
    # importing a submodule sets it as an attribute of the package, replacing a lazily exported
    # object of the same name
    submodules = {p.stem for p in INIT.parent.glob("*.py")} | {p.name for p in INIT.parent.iterdir() if p.is_dir()}
    assert not submodules & set(attnhost.__all__)


@pytest.mark.torch  # needs torch installed (the py312/py313 envs have none)
def test_resolve_stays_the_function_after_importing_the_runner() -> None:
    result = run_python(
        "import attnhost; from attnhost import ModelRunner; import attnhost.resolution; "
        "print(callable(attnhost.resolve), type(attnhost.resolve).__name__)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "function"]


@pytest.mark.torch  # needs torch installed (the py312/py313 envs have none)
def test_public_functions_return_and_raise_exported_types() -> None:
    exported = set(attnhost.__all__)
    for name in ("Resolution", "BackendEntry", "Availability", "KVPoolFullError", "InvalidPluginError"):
        assert name in exported
    for name in sorted(exported):
        obj = getattr(attnhost, name)
        if not inspect.isfunction(obj):
            continue
        module = importlib.import_module(obj.__module__)
        annotation = str(obj.__annotations__.get("return", ""))
        for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", annotation):
            defined_here = inspect.isclass(vars(module).get(word)) and vars(module)[word].__module__.startswith(
                "attnhost"
            )
            if defined_here and not keyword.iskeyword(word):
                assert word in exported, f"attnhost.{name}() returns {word}, which attnhost does not export"
