"""Start-up stays lean: what ``import attnhost`` and ``attnhost list`` may and may not import.

``attnhost list`` must beat a bare ``importlib.metadata`` entry-point scan
(BENCHMARKS.md, "CLI cold start"); importing torch (seconds) or a backend module would make
that impossible, and would also mean discovery runs vendor kernels' import
side effects. These tests read the interpreter's own record of what was
imported (``-X importtime``), so they hold without any timing assertion.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from helpers import run_python, subprocess_env

from attnhost import cli

BACKEND_MODULES = ("attnhost_builtin.torch_native", "attnhost.runner", "attnhost.forward_batch", "attnhost.backend")


def imported_modules(*args: str) -> list[str]:
    """Modules a fresh ``python -X importtime ARGS`` imported, in order."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    return [line.rpartition("|")[2].strip() for line in lines[1:]]  # the first line is the column header


@pytest.mark.parametrize("argv", [["list"], ["list", "--json"], ["list", "--draft"], ["plugins"]])
def test_cli_imports_neither_torch_nor_backend_modules(argv: list[str]) -> None:
    modules = imported_modules("-m", "attnhost", *argv)
    assert "attnhost.cli" in modules and "attnhost_builtin" in modules
    assert "pluggy" in modules, "plugins must still be loaded through pluggy"
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")], "attnhost list imported torch"
    assert not set(BACKEND_MODULES) & set(modules)


def test_import_attnhost_imports_no_pluggy_and_no_torch() -> None:
    result = run_python("import sys, json, attnhost; print(json.dumps(sorted(sys.modules)))")
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout)
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "pluggy", "attnhost_builtin")]
    assert not heavy, heavy
    assert [m for m in modules if m.startswith("attnhost")] == ["attnhost"]


def test_backend_spec_and_platform_need_no_pluggy() -> None:
    code = (
        "import sys, attnhost; attnhost.BackendSpec(name='x', factory='m:f'); attnhost.current_platform();"
        "print('pluggy' in sys.modules, 'torch' in sys.modules)"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_abbreviated_flag_works() -> None:
    out = io.StringIO()
    assert cli.main(["list", "--js"], out=out, err=io.StringIO()) == 0
    assert json.loads(out.getvalue())["backends"]


def test_list_json_output_is_json_dumps_indent_2() -> None:
    out = io.StringIO()
    assert cli.main(["list", "--json"], out=out) == 0
    assert out.getvalue() == json.dumps(json.loads(out.getvalue()), indent=2) + "\n"
